// Qwen3-MoE (Qwen3MoeForCausalLM): softmax top-k routing (norm_topk_prob); q/k RMSNorm per head;
// optional attention biases; dense layers by decoder_sparse_step and mlp_only_layers; config
// head_dim; experts gate/up/down_proj under "mlp.".
#include "common/model/families/config_json.h"
#include "common/model/families/family.h"
#include "common/model/families/qwen_layers.h"

namespace fmoe {
namespace {

using namespace config_json;

Status ParseQwen3Moe(const Json& j, ModelInfo* info) {
  FMOE_RETURN_IF_ERROR(ReadQwenMoe(j, info));
  FMOE_RETURN_IF_ERROR(ReadBool(j, "attention_bias", &info->qkv_bias));
  info->o_bias = info->qkv_bias;
  info->qk_norm = QkNorm::kPerHead;
  return ReadNormTopkProb(j, &info->routing);
}

}  // namespace

const ModelFamily& Qwen3MoeFamily() {
  static const ModelFamily kFamily{
      .architectures = {"Qwen3MoeForCausalLM"},
      .experts_key = "num_experts",
      .reads_head_dim = true,
      .parse = ParseQwen3Moe,
      .tensors = {"mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight", ""},
  };
  return kFamily;
}

}  // namespace fmoe
