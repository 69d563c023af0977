// OLMoE (OlmoeForCausalLM): softmax top-k routing (norm_topk_prob); q/k RMSNorm over the whole
// projection; optional attention biases and q/k/v clipping; head width hidden_size /
// num_attention_heads; experts gate/up/down_proj under "mlp.".
#include "common/model/families/config_json.h"
#include "common/model/families/family.h"

namespace fmoe {
namespace {

using namespace config_json;

Status ParseOlmoe(const Json& j, ModelInfo* info) {
  FMOE_RETURN_IF_ERROR(ReadCount(j, "intermediate_size", true, &info->intermediate_size));
  FMOE_RETURN_IF_ERROR(ReadBool(j, "attention_bias", &info->qkv_bias));
  info->o_bias = info->qkv_bias;
  info->qk_norm = QkNorm::kWhole;
  if (auto it = j.find("clip_qkv"); it != j.end() && !it->is_null()) {
    double clip = 0;
    FMOE_RETURN_IF_ERROR(ReadPositiveDouble(j, "clip_qkv", &clip));
    info->clip_qkv = clip;
  }
  return ReadNormTopkProb(j, &info->routing);
}

}  // namespace

const ModelFamily& OlmoeFamily() {
  static const ModelFamily kFamily{
      .architectures = {"OlmoeForCausalLM"},
      .experts_key = "num_experts",
      .reads_head_dim = false,
      .parse = ParseOlmoe,
      .tensors = {"mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight", ""},
  };
  return kFamily;
}

}  // namespace fmoe
