// DeepSeek-V2 and V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM; one code path): multi-head
// latent attention with YaRN, shared experts, dense first layers, group-limited routing; V3
// scores with a sigmoid and a correction bias. Experts gate/up/down_proj under "mlp.", the
// shared experts under "mlp.shared_experts.".
#include <limits>
#include <set>
#include <string>
#include <utility>

#include "common/model/families/config_json.h"
#include "common/model/families/family.h"

namespace fmoe {
namespace {

using namespace config_json;

// DeepSeek's MoE layers: layer i is sparse when i >= first_k_dense_replace and
// i % moe_layer_freq == 0 (DeepSeek's modelling code; transformers reads first_k_dense_replace
// only, which agrees while moe_layer_freq is 1, as in every released checkpoint).
Status ReadDeepseekLayers(const Json& j, ModelInfo* info) {
  uint32_t first_dense = 0, freq = 1;
  if (auto it = j.find("first_k_dense_replace"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0 ||
        it->get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return InvalidArgument("first_k_dense_replace: " + it->dump() + " is out of range");
    }
    first_dense = static_cast<uint32_t>(it->get<int64_t>());
  }
  FMOE_RETURN_IF_ERROR(ReadCount(j, "moe_layer_freq", false, &freq));
  info->moe_layers.clear();
  for (uint32_t i = first_dense; i < info->num_hidden_layers; ++i) {
    if (i % freq == 0) info->moe_layers.push_back(i);
  }
  return Status::Ok();
}

// DeepSeek-V2 and V3 (one code path): MLA, shared experts, dense first layers, group-limited
// routing; V3 scores with a sigmoid and a correction bias.
Status ParseDeepseek(const Json& j, ModelInfo* info, bool v3) {
  FMOE_RETURN_IF_ERROR(ReadDeepseekLayers(j, info));
  FMOE_RETURN_IF_ERROR(ReadCount(j, "moe_intermediate_size", true, &info->intermediate_size));
  uint32_t shared = 0;
  FMOE_RETURN_IF_ERROR(ReadCount(j, "n_shared_experts", false, &shared));
  info->shared_expert_intermediate_size = shared * info->intermediate_size;
  info->shared_expert_gated = false;

  MlaSpec mla;
  FMOE_RETURN_IF_ERROR(ReadCount(j, "q_lora_rank", false, &mla.q_lora_rank));
  FMOE_RETURN_IF_ERROR(ReadCount(j, "kv_lora_rank", true, &mla.kv_lora_rank));
  FMOE_RETURN_IF_ERROR(ReadCount(j, "qk_nope_head_dim", true, &mla.qk_nope_head_dim));
  FMOE_RETURN_IF_ERROR(ReadCount(j, "qk_rope_head_dim", true, &mla.qk_rope_head_dim));
  FMOE_RETURN_IF_ERROR(ReadCount(j, "v_head_dim", true, &mla.v_head_dim));
  if (mla.qk_rope_head_dim % 2 != 0) {
    return InvalidArgument("qk_rope_head_dim: " + std::to_string(mla.qk_rope_head_dim) +
                           " is odd; rotary embeddings need it even");
  }
  if (v3) FMOE_RETURN_IF_ERROR(ReadBool(j, "rope_interleave", &mla.rope_interleave));
  info->mla = mla;
  FMOE_RETURN_IF_ERROR(ReadYarnScaling(j, info));
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    bool on = false;
    FMOE_RETURN_IF_ERROR(ReadBool(j, key, &on));
    if (on) {
      return InvalidArgument(std::string(key) +
                             ": true is not implemented by the model runtime for this family");
    }
  }

  RoutingSpec& r = info->routing;
  const std::string scoring_default = v3 ? "sigmoid" : "softmax";
  const std::string method_default = v3 ? "noaux_tc" : "greedy";
  std::string scoring = scoring_default, method = method_default;
  for (auto [key, out] : {std::pair{"scoring_func", &scoring}, std::pair{"topk_method", &method}}) {
    if (auto it = j.find(key); it != j.end() && !it->is_null()) {
      if (!it->is_string()) return InvalidArgument(std::string(key) + ": not a string");
      *out = it->get<std::string>();
    }
  }
  if (scoring != scoring_default) {
    return InvalidArgument("scoring_func: \"" + scoring + "\" is not implemented for " +
                           info->architecture + " (only \"" + scoring_default + "\" is)");
  }
  r.scoring = v3 ? RouterScoring::kSigmoid : RouterScoring::kSoftmax;
  r.correction_bias = v3;
  info->router_correction_bias = v3;
  uint32_t n_group = 1, topk_group = 1;
  FMOE_RETURN_IF_ERROR(ReadCount(j, "n_group", false, &n_group));
  FMOE_RETURN_IF_ERROR(ReadCount(j, "topk_group", false, &topk_group));
  if (v3) {
    // transformers' DeepseekV3TopkRouter always selects groups by their top-2 sum.
    if (method != "noaux_tc") {
      return InvalidArgument("topk_method: \"" + method +
                             "\" is not implemented for DeepseekV3ForCausalLM (only noaux_tc)");
    }
    r.groups = GroupScoring::kTopTwoSum;
  } else if (method == "group_limited_greedy") {
    r.groups = GroupScoring::kMaxScore;
  } else if (method != "greedy") {
    return InvalidArgument("topk_method: \"" + method +
                           "\" is not implemented for DeepseekV2ForCausalLM (greedy, "
                           "group_limited_greedy)");
  }
  r.num_groups = n_group;
  r.topk_groups = topk_group;
  double scaling = 1.0;
  FMOE_RETURN_IF_ERROR(ReadPositiveDouble(j, "routed_scaling_factor", &scaling));
  r.scaling = static_cast<float>(scaling);
  r.normalize_topk = false;
  FMOE_RETURN_IF_ERROR(ReadBool(j, "norm_topk_prob", &r.normalize_topk));
  if (!v3 && r.normalize_topk) {
    // DeepSeek's V2 code renormalises and then skips the scaling; transformers scales and never
    // renormalises. No released V2 checkpoint sets it.
    return InvalidArgument(
        "norm_topk_prob: true is not implemented for DeepseekV2ForCausalLM (DeepSeek's code and "
        "transformers compute it differently)");
  }
  return Status::Ok();
}

Status ParseDeepseekV2(const Json& j, ModelInfo* info) { return ParseDeepseek(j, info, false); }
Status ParseDeepseekV3(const Json& j, ModelInfo* info) { return ParseDeepseek(j, info, true); }

constexpr ExpertTensorNames kTensors = {"mlp.", "gate_proj.weight", "up_proj.weight",
                                        "down_proj.weight", "shared_experts."};

}  // namespace

const ModelFamily& DeepseekV2Family() {
  static const ModelFamily kFamily{
      .architectures = {"DeepseekV2ForCausalLM"},
      .experts_key = "n_routed_experts",
      .reads_head_dim = false,
      .reads_rope_scaling = true,
      .parse = ParseDeepseekV2,
      .tensors = kTensors,
  };
  return kFamily;
}

const ModelFamily& DeepseekV3Family() {
  static const ModelFamily kFamily{
      .architectures = {"DeepseekV3ForCausalLM"},
      .experts_key = "n_routed_experts",
      .reads_head_dim = false,
      .reads_rope_scaling = true,
      .parse = ParseDeepseekV3,
      .tensors = kTensors,
  };
  return kFamily;
}

}  // namespace fmoe
