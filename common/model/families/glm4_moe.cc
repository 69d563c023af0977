// GLM-4.5 / 4.6 and -Air (Glm4MoeForCausalLM): grouped-query attention with q/k/v biases
// (attention_bias; the output projection has none), an optional RMSNorm over each head of q and
// k (use_qk_norm), RoPE on the first partial_rotary_factor of each head (default 0.5; the rest
// pass through), DeepSeek-V3's router (sigmoid scores, e_score_correction_bias, n_group /
// topk_group by top-2 sums, norm_topk_prob, routed_scaling_factor), n_shared_experts shared
// experts, first_k_dense_replace dense layers. Experts gate/up/down_proj under "mlp.", the shared
// experts under "mlp.shared_experts.". The multi-token-prediction layer the checkpoints carry
// after the last decoder layer (num_nextn_predict_layers) is not part of the forward and is
// skipped at load.
#include <string>

#include "common/model/families/config_json.h"
#include "common/model/families/family.h"

namespace fmoe {
namespace {

using namespace config_json;

Status ParseGlm4Moe(const Json& j, ModelInfo* info) {
  uint32_t first_dense = 1;  // Glm4MoeConfig's default.
  FMOE_RETURN_IF_ERROR(ReadInteger(j, "first_k_dense_replace", false, 0, &first_dense));
  info->moe_layers.clear();
  for (uint32_t i = first_dense; i < info->num_hidden_layers; ++i) info->moe_layers.push_back(i);
  FMOE_RETURN_IF_ERROR(ReadCount(j, "moe_intermediate_size", true, &info->intermediate_size));
  uint32_t shared = 1;  // Glm4MoeConfig's default.
  FMOE_RETURN_IF_ERROR(ReadInteger(j, "n_shared_experts", false, 0, &shared));
  info->shared_expert_intermediate_size = shared * info->intermediate_size;

  FMOE_RETURN_IF_ERROR(ReadBool(j, "attention_bias", &info->qkv_bias));
  info->o_bias = false;
  bool qk_norm = false;
  FMOE_RETURN_IF_ERROR(ReadBool(j, "use_qk_norm", &qk_norm));
  info->qk_norm = qk_norm ? QkNorm::kPerHead : QkNorm::kNone;

  RoutingSpec& r = info->routing;
  r.scoring = RouterScoring::kSigmoid;
  r.correction_bias = true;
  info->router_correction_bias = true;
  r.groups = GroupScoring::kTopTwoSum;
  r.num_groups = 1;
  r.topk_groups = 1;
  FMOE_RETURN_IF_ERROR(ReadCount(j, "n_group", false, &r.num_groups));
  FMOE_RETURN_IF_ERROR(ReadCount(j, "topk_group", false, &r.topk_groups));
  if (r.num_groups == 1) r.groups = GroupScoring::kNone;  // One group keeps every expert.
  double scaling = 1.0;
  FMOE_RETURN_IF_ERROR(ReadPositiveDouble(j, "routed_scaling_factor", &scaling));
  r.scaling = static_cast<float>(scaling);
  r.normalize_topk = true;  // Glm4MoeConfig's default.
  return ReadBool(j, "norm_topk_prob", &r.normalize_topk);
}

}  // namespace

const ModelFamily& Glm4MoeFamily() {
  static const ModelFamily kFamily{
      .architectures = {"Glm4MoeForCausalLM"},
      .experts_key = "n_routed_experts",
      .reads_head_dim = true,
      .partial_rotary_default = 0.5,
      .parse = ParseGlm4Moe,
      .tensors = {"mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
                  "shared_experts."},
  };
  return kFamily;
}

}  // namespace fmoe
