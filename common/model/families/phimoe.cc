// Phi-3.5-MoE (PhimoeForCausalLM; the Hub's config.json names its remote code PhiMoEForCausalLM,
// the checkpoint is the same): sparsemixer routing to 2 experts, LayerNorm, q/k/v/o and lm_head
// biases, LongRoPE, an optional sliding window; experts w1/w3/w2 under "block_sparse_moe.".
#include <set>
#include <string>
#include <utility>

#include "common/model/families/config_json.h"
#include "common/model/families/family.h"

namespace fmoe {
namespace {

using namespace config_json;

// Phi-3.5-MoE's rope_scaling: LongRoPE only (PhimoeConfig requires short_mscale and long_mscale;
// its rotary embedding reads original_max_position_embeddings from rope_scaling). "factor" and
// "attention_factor" are read by transformers' generic LongRoPE only for an attention factor that
// PhimoeRotaryEmbedding replaces by the mscales, so they change nothing here either.
Status ReadLongRope(const Json& j, uint32_t head_dim, ModelInfo* info) {
  static const std::set<std::string> kKnown = {"type",
                                               "rope_type",
                                               "short_factor",
                                               "long_factor",
                                               "short_mscale",
                                               "long_mscale",
                                               "original_max_position_embeddings",
                                               "factor",
                                               "attention_factor"};
  FMOE_ASSIGN_OR_RETURN(const Json* scaling, RopeScaling(j, "longrope", kKnown));
  if (scaling == nullptr) return Status::Ok();
  const Json& r = *scaling;
  LongRopeSpec spec;
  for (auto [key, out] : {std::pair{"short_factor", &spec.short_factor},
                          std::pair{"long_factor", &spec.long_factor}}) {
    auto f = r.find(key);
    if (f == r.end() || !f->is_array()) {
      return InvalidArgument(std::string("rope_scaling: ") + key + ": missing or not a list");
    }
    if (f->size() != head_dim / 2) {
      return InvalidArgument(std::string("rope_scaling: ") + key + ": " +
                             std::to_string(f->size()) +
                             " values, expected head_dim / 2 = " + std::to_string(head_dim / 2));
    }
    for (const Json& v : *f) {
      if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() <= 0) {
        return InvalidArgument(std::string("rope_scaling: ") + key + ": " + v.dump() +
                               " is not a positive number");
      }
      out->push_back(v.get<double>());
    }
  }
  for (const char* key : {"short_mscale", "long_mscale"}) {
    if (r.find(key) == r.end() || r[key].is_null()) {
      return InvalidArgument(std::string("rope_scaling: ") + key + ": missing");
    }
  }
  FMOE_RETURN_IF_ERROR(
      ReadPositiveDouble(r, "short_mscale", &spec.short_mscale).WithContext("rope_scaling"));
  FMOE_RETURN_IF_ERROR(
      ReadPositiveDouble(r, "long_mscale", &spec.long_mscale).WithContext("rope_scaling"));
  FMOE_RETURN_IF_ERROR(
      ReadCount(r, "original_max_position_embeddings", true, &spec.original_max_position_embeddings)
          .WithContext("rope_scaling"));
  // A top-level original_max_position_embeddings overrides rope_scaling's for the factors'
  // switch in transformers but not for the mscales': only agreeing values are served.
  if (auto top = j.find("original_max_position_embeddings"); top != j.end() && !top->is_null()) {
    uint32_t value = 0;
    FMOE_RETURN_IF_ERROR(ReadCount(j, "original_max_position_embeddings", true, &value));
    if (value != spec.original_max_position_embeddings) {
      return InvalidArgument("original_max_position_embeddings: " + std::to_string(value) +
                             " differs from rope_scaling's " +
                             std::to_string(spec.original_max_position_embeddings));
    }
  }
  info->longrope = std::move(spec);
  return Status::Ok();
}

// Phi-3.5-MoE: sparsemixer routing, LayerNorm, q/k/v/o and lm_head biases, LongRoPE. The head
// width is always hidden_size / num_attention_heads (PhimoeAttention).
Status ParsePhimoe(const Json& j, ModelInfo* info) {
  FMOE_RETURN_IF_ERROR(ReadCount(j, "intermediate_size", true, &info->intermediate_size));
  if (info->top_k != 2) {
    return InvalidArgument("num_experts_per_tok: " + std::to_string(info->top_k) +
                           " is not implemented for PhimoeForCausalLM (sparsemixer routes to 2 "
                           "experts)");
  }
  RoutingSpec& r = info->routing;
  r.scoring = RouterScoring::kSparseMixer;
  r.normalize_topk = false;
  double jitter = 0.01;  // PhimoeConfig's router_jitter_noise.
  FMOE_RETURN_IF_ERROR(ReadNonNegativeDouble(j, "router_jitter_noise", &jitter));
  r.jitter_eps = static_cast<float>(jitter);
  FMOE_RETURN_IF_ERROR(ReadBool(j, "attention_bias", &info->qkv_bias));
  info->o_bias = info->qkv_bias;
  FMOE_RETURN_IF_ERROR(ReadBool(j, "lm_head_bias", &info->lm_head_bias));
  info->layer_norm = true;
  if (auto it = j.find("partial_rotary_factor"); it != j.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() != 1.0) {
      return InvalidArgument("partial_rotary_factor: " + it->dump() +
                             " is not implemented by the model runtime for this family (only 1)");
    }
  }
  FMOE_RETURN_IF_ERROR(ReadSlidingWindow(j, &info->sliding_window));
  uint32_t heads = 0;
  FMOE_RETURN_IF_ERROR(ReadCount(j, "num_attention_heads", true, &heads));
  if (info->hidden_size % heads != 0) {
    return InvalidArgument("hidden_size (" + std::to_string(info->hidden_size) +
                           ") is not a multiple of num_attention_heads (" + std::to_string(heads) +
                           ")");
  }
  return ReadLongRope(j, info->hidden_size / heads, info);
}

}  // namespace

const ModelFamily& PhimoeFamily() {
  static const ModelFamily kFamily{
      .architectures = {"PhimoeForCausalLM", "PhiMoEForCausalLM"},
      .experts_key = "num_local_experts",
      .reads_head_dim = false,
      .reads_rope_scaling = true,
      .parse = ParsePhimoe,
      .tensors = {"block_sparse_moe.", "w1.weight", "w3.weight", "w2.weight", ""},
  };
  return kFamily;
}

}  // namespace fmoe
