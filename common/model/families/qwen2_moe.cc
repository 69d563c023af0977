// Qwen2-MoE (Qwen2MoeForCausalLM): softmax top-k routing (norm_topk_prob, default off); a gated
// shared expert; q/k/v biases; dense layers by decoder_sparse_step and mlp_only_layers; head
// width hidden_size / num_attention_heads; experts gate/up/down_proj under "mlp.".
#include "common/model/families/config_json.h"
#include "common/model/families/family.h"
#include "common/model/families/qwen_layers.h"

namespace fmoe {
namespace {

using namespace config_json;

Status ParseQwen2Moe(const Json& j, ModelInfo* info) {
  FMOE_RETURN_IF_ERROR(ReadQwenMoe(j, info));
  FMOE_RETURN_IF_ERROR(ReadCount(j, "shared_expert_intermediate_size", true,
                                 &info->shared_expert_intermediate_size));
  info->shared_expert_gated = true;
  info->qkv_bias = true;  // Qwen2MoeConfig's qkv_bias (absent from the Hub's configs: true).
  FMOE_RETURN_IF_ERROR(ReadBool(j, "qkv_bias", &info->qkv_bias));
  return ReadNormTopkProb(j, &info->routing);
}

}  // namespace

const ModelFamily& Qwen2MoeFamily() {
  static const ModelFamily kFamily{
      .architectures = {"Qwen2MoeForCausalLM"},
      .experts_key = "num_experts",
      .reads_head_dim = false,
      .parse = ParseQwen2Moe,
      .tensors = {"mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
                  "shared_expert."},
  };
  return kFamily;
}

}  // namespace fmoe
