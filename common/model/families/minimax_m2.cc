// MiniMax-M2 (MiniMaxM2ForCausalLM): grouped-query attention without biases, an RMSNorm over the
// whole q and k projections (use_qk_norm with qk_norm_type "per_layer"; "per_head" normalises
// each head), RoPE on the first rotary_dim dims of each head (the rest pass through), a router
// of sigmoid scores with a correction bias (scoring_func "sigmoid", use_routing_bias) whose top-k
// weights are renormalised and scaled by routed_scaling_factor, no shared expert. Experts
// w1/w3/w2 under "block_sparse_moe.", the router "block_sparse_moe.gate.weight" and its bias
// "block_sparse_moe.e_score_correction_bias".
#include <string>

#include "common/model/families/config_json.h"
#include "common/model/families/family.h"

namespace fmoe {
namespace {

using namespace config_json;

Status ReadString(const Json& j, const char* key, std::string* out) {
  if (auto it = j.find(key); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return InvalidArgument(std::string(key) + ": not a string");
    *out = it->get<std::string>();
  }
  return Status::Ok();
}

Status ParseMiniMaxM2(const Json& j, ModelInfo* info) {
  FMOE_RETURN_IF_ERROR(ReadCount(j, "intermediate_size", true, &info->intermediate_size));
  bool qk_norm = true;
  FMOE_RETURN_IF_ERROR(ReadBool(j, "use_qk_norm", &qk_norm));
  std::string norm_type = "per_layer";
  FMOE_RETURN_IF_ERROR(ReadString(j, "qk_norm_type", &norm_type));
  if (!qk_norm) {
    info->qk_norm = QkNorm::kNone;
  } else if (norm_type == "per_layer") {
    info->qk_norm = QkNorm::kWhole;
  } else if (norm_type == "per_head") {
    info->qk_norm = QkNorm::kPerHead;
  } else {
    return InvalidArgument("qk_norm_type: \"" + norm_type +
                           "\" is not implemented (per_layer, per_head)");
  }
  // Sliding-window layers (attn_window_size, swa_rope_theta) are not in any released M2.
  if (auto it = j.find("attn_window_size"); it != j.end() && !it->is_null()) {
    const bool off = (it->is_number_integer() && it->get<int64_t>() <= 0);
    if (!off) {
      return InvalidArgument("attn_window_size: " + it->dump() +
                             " is not implemented by the model runtime for this family");
    }
  }
  std::string scoring = "sigmoid";
  FMOE_RETURN_IF_ERROR(ReadString(j, "scoring_func", &scoring));
  RoutingSpec& r = info->routing;
  if (scoring == "sigmoid") {
    r.scoring = RouterScoring::kSigmoid;
  } else if (scoring == "softmax") {
    r.scoring = RouterScoring::kSoftmax;
  } else {
    return InvalidArgument("scoring_func: \"" + scoring +
                           "\" is not implemented (sigmoid, softmax)");
  }
  bool bias = true;
  FMOE_RETURN_IF_ERROR(ReadBool(j, "use_routing_bias", &bias));
  r.correction_bias = bias;
  info->router_correction_bias = bias;
  bool grouped = false;
  FMOE_RETURN_IF_ERROR(ReadBool(j, "use_grouped_topk", &grouped));
  if (grouped) {
    return InvalidArgument("use_grouped_topk: true is not implemented for MiniMaxM2ForCausalLM");
  }
  r.groups = GroupScoring::kNone;
  r.normalize_topk = true;
  double scaling = 1.0;
  FMOE_RETURN_IF_ERROR(ReadPositiveDouble(j, "routed_scaling_factor", &scaling));
  r.scaling = static_cast<float>(scaling);
  uint32_t shared = 0;
  FMOE_RETURN_IF_ERROR(ReadInteger(j, "shared_intermediate_size", false, 0, &shared));
  if (shared != 0) {
    return InvalidArgument(
        "shared_intermediate_size: a shared expert is not implemented for MiniMaxM2ForCausalLM");
  }
  return Status::Ok();
}

}  // namespace

const ModelFamily& MinimaxM2Family() {
  static const ModelFamily kFamily{
      .architectures = {"MiniMaxM2ForCausalLM"},
      .experts_key = "num_local_experts",
      .reads_head_dim = true,
      .partial_rotary_default = 1.0,
      .parse = ParseMiniMaxM2,
      .tensors = {"block_sparse_moe.", "w1.weight", "w3.weight", "w2.weight", "",
                  "e_score_correction_bias"},
  };
  return kFamily;
}

}  // namespace fmoe
