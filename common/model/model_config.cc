#include "common/model/model_config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string_view>

#include <nlohmann/json.hpp>

namespace fmoe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr uint64_t kFnvOffset = 1469598103934665603ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;
// A safetensors header larger than this is not a header (the format caps it at 100 MB).
constexpr uint64_t kMaxSafetensorsHeader = 100ull << 20;

uint64_t Fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= kFnvPrime;
  }
  return h;
}

// Reads a positive integer key that fits uint32; `required` says whether absence is an error.
Status ReadCount(const Json& j, const char* key, bool required, uint32_t* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) return InvalidArgument(std::string(key) + ": missing");
    return Status::Ok();
  }
  if (!it->is_number_integer()) {
    return InvalidArgument(std::string(key) + ": " + it->dump() + " is not an integer");
  }
  int64_t v = it->get<int64_t>();
  if (v < 1 || v > std::numeric_limits<int32_t>::max()) {
    return InvalidArgument(std::string(key) + ": " + std::to_string(v) + " is out of range");
  }
  *out = static_cast<uint32_t>(v);
  return Status::Ok();
}

// Reads a finite number > 0; absence keeps `*out` (the default).
Status ReadPositiveDouble(const Json& j, const char* key, double* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_number())
    return InvalidArgument(std::string(key) + ": " + it->dump() + " is not a number");
  double v = it->get<double>();
  if (!std::isfinite(v) || v <= 0) {
    return InvalidArgument(std::string(key) + ": " + it->dump() + " is out of range");
  }
  *out = v;
  return Status::Ok();
}

// Reads a token id (an integer in [0, 2^31)) from `v`, naming `key` in errors.
Status ReadTokenId(const Json& v, const std::string& key, int32_t* out) {
  if (!v.is_number_integer()) return InvalidArgument(key + ": " + v.dump() + " is not an integer");
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  const bool in_range = v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(kMax)
                                               : v.get<int64_t>() >= 0 && v.get<int64_t>() <= kMax;
  if (!in_range) return InvalidArgument(key + ": " + v.dump() + " is out of range");
  *out = static_cast<int32_t>(v.get<int64_t>());
  return Status::Ok();
}

// The hyperparameters the model runtime needs (read for every family for now).
Status ParseRuntimeFields(const Json& j, ModelInfo* info) {
  FMOE_RETURN_IF_ERROR(ReadCount(j, "num_attention_heads", true, &info->num_attention_heads));
  info->num_key_value_heads = info->num_attention_heads;
  FMOE_RETURN_IF_ERROR(ReadCount(j, "num_key_value_heads", false, &info->num_key_value_heads));
  if (info->num_attention_heads % info->num_key_value_heads != 0) {
    return InvalidArgument("num_key_value_heads (" + std::to_string(info->num_key_value_heads) +
                           ") does not divide num_attention_heads (" +
                           std::to_string(info->num_attention_heads) + ")");
  }
  if (auto it = j.find("head_dim"); it != j.end() && !it->is_null()) {
    FMOE_RETURN_IF_ERROR(ReadCount(j, "head_dim", true, &info->head_dim));
  } else {
    if (info->hidden_size % info->num_attention_heads != 0) {
      return InvalidArgument("head_dim: missing, and hidden_size (" +
                             std::to_string(info->hidden_size) +
                             ") is not a multiple of num_attention_heads (" +
                             std::to_string(info->num_attention_heads) + ")");
    }
    info->head_dim = info->hidden_size / info->num_attention_heads;
  }
  FMOE_RETURN_IF_ERROR(ReadPositiveDouble(j, "rms_norm_eps", &info->rms_norm_eps));
  FMOE_RETURN_IF_ERROR(ReadPositiveDouble(j, "rope_theta", &info->rope_theta));
  if (auto it = j.find("tie_word_embeddings"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean()) {
      return InvalidArgument("tie_word_embeddings: " + it->dump() + " is not a boolean");
    }
    info->tie_word_embeddings = it->get<bool>();
  }
  if (auto it = j.find("bos_token_id"); it != j.end() && !it->is_null()) {
    int32_t id = 0;
    FMOE_RETURN_IF_ERROR(ReadTokenId(*it, "bos_token_id", &id));
    info->bos_token_id = id;
  }
  if (auto it = j.find("eos_token_id"); it != j.end() && !it->is_null()) {
    if (it->is_array()) {
      for (size_t i = 0; i < it->size(); ++i) {
        int32_t id = 0;
        FMOE_RETURN_IF_ERROR(ReadTokenId((*it)[i], "eos_token_id[" + std::to_string(i) + "]", &id));
        info->eos_token_ids.push_back(id);
      }
    } else {
      int32_t id = 0;
      FMOE_RETURN_IF_ERROR(ReadTokenId(*it, "eos_token_id", &id));
      info->eos_token_ids.push_back(id);
    }
  }
  if (auto it = j.find("torch_dtype"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return InvalidArgument("torch_dtype: " + it->dump() + " is not a string");
    info->torch_dtype = it->get<std::string>();
  }
  return Status::Ok();
}

// Reads a boolean key; absence or null keeps `*out` (the family's default).
Status ReadBool(const Json& j, const char* key, bool* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_boolean())
    return InvalidArgument(std::string(key) + ": " + it->dump() + " is not a boolean");
  *out = it->get<bool>();
  return Status::Ok();
}

// Fields every family shares that change the computation in ways the runtime does not implement.
// `rope_scaling_read`: the family's parser read rope_scaling (DeepSeek's YaRN).
Status RefuseUnimplemented(const Json& j, bool rope_scaling_read) {
  if (auto it = j.find("quantization_config"); it != j.end() && !it->is_null()) {
    std::string format = "an unknown format";
    if (it->is_object()) {
      for (const char* key : {"quant_method", "fmt"}) {
        if (auto f = it->find(key); f != it->end() && f->is_string()) {
          format = (format == "an unknown format" ? "" : format + " ") + f->get<std::string>();
        }
      }
    }
    return InvalidArgument("quantization_config: quantized weights (" + format +
                           ") are not implemented by the model runtime; use a bfloat16 or float32 "
                           "checkpoint");
  }
  if (auto it = j.find("rope_scaling"); !rope_scaling_read && it != j.end() && !it->is_null()) {
    return InvalidArgument("rope_scaling: " + it->dump() +
                           " is not implemented by the model runtime (only plain RoPE is)");
  }
  if (auto it = j.find("hidden_act"); it != j.end() && !it->is_null()) {
    if (!it->is_string() || it->get<std::string>() != "silu") {
      return InvalidArgument("hidden_act: " + it->dump() +
                             " is not implemented by the model runtime (only \"silu\" is)");
    }
  }
  return Status::Ok();
}

// The MoE layers: Qwen's families interleave dense layers by decoder_sparse_step and
// mlp_only_layers (transformers: layer i is sparse when i is not in mlp_only_layers and
// (i + 1) % decoder_sparse_step == 0).
Status ReadQwenLayers(const Json& j, ModelInfo* info) {
  uint32_t sparse_step = 1;
  FMOE_RETURN_IF_ERROR(ReadCount(j, "decoder_sparse_step", false, &sparse_step));
  std::set<int64_t> dense_layers;
  if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return InvalidArgument("mlp_only_layers: not a list");
    for (const auto& v : *it) {
      if (!v.is_number_integer()) return InvalidArgument("mlp_only_layers: not integers");
      dense_layers.insert(v.get<int64_t>());
    }
  }
  info->moe_layers.clear();
  for (uint32_t i = 0; i < info->num_hidden_layers; ++i) {
    if (dense_layers.count(i) == 0 && (i + 1) % sparse_step == 0) info->moe_layers.push_back(i);
  }
  return Status::Ok();
}

Status RefuseQwenSlidingWindow(const Json& j) {
  bool use = false;
  FMOE_RETURN_IF_ERROR(ReadBool(j, "use_sliding_window", &use));
  if (use) {
    return InvalidArgument(
        "use_sliding_window: true is not implemented by the model runtime for this family");
  }
  return Status::Ok();
}

// Each family: what its config.json says beyond the shared fields. Defaults are transformers'.
Status ParseMixtral(const Json& j, ModelInfo* info) {
  FMOE_RETURN_IF_ERROR(ReadCount(j, "intermediate_size", true, &info->intermediate_size));
  info->routing.normalize_topk = true;  // MixtralSparseMoeBlock always renormalises.
  if (auto it = j.find("sliding_window"); it != j.end() && !it->is_null()) {
    uint32_t window = 0;
    FMOE_RETURN_IF_ERROR(ReadCount(j, "sliding_window", true, &window));
    info->sliding_window = window;
  }
  return Status::Ok();
}

Status ParseQwen2Moe(const Json& j, ModelInfo* info) {
  FMOE_RETURN_IF_ERROR(ReadQwenLayers(j, info));
  FMOE_RETURN_IF_ERROR(RefuseQwenSlidingWindow(j));
  FMOE_RETURN_IF_ERROR(ReadCount(j, "moe_intermediate_size", true, &info->intermediate_size));
  FMOE_RETURN_IF_ERROR(ReadCount(j, "shared_expert_intermediate_size", true,
                                 &info->shared_expert_intermediate_size));
  info->shared_expert_gated = true;
  info->qkv_bias = true;  // Qwen2MoeConfig's qkv_bias (absent from the Hub's configs: true).
  FMOE_RETURN_IF_ERROR(ReadBool(j, "qkv_bias", &info->qkv_bias));
  info->routing.normalize_topk = false;
  return ReadBool(j, "norm_topk_prob", &info->routing.normalize_topk);
}

Status ParseQwen3Moe(const Json& j, ModelInfo* info) {
  FMOE_RETURN_IF_ERROR(ReadQwenLayers(j, info));
  FMOE_RETURN_IF_ERROR(RefuseQwenSlidingWindow(j));
  FMOE_RETURN_IF_ERROR(ReadCount(j, "moe_intermediate_size", true, &info->intermediate_size));
  FMOE_RETURN_IF_ERROR(ReadBool(j, "attention_bias", &info->qkv_bias));
  info->o_bias = info->qkv_bias;
  info->qk_norm = QkNorm::kPerHead;
  info->routing.normalize_topk = false;
  return ReadBool(j, "norm_topk_prob", &info->routing.normalize_topk);
}

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
  info->routing.normalize_topk = false;
  return ReadBool(j, "norm_topk_prob", &info->routing.normalize_topk);
}

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

// Reads a finite number >= 0; absence keeps `*out`.
Status ReadNonNegativeDouble(const Json& j, const char* key, double* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < 0) {
    return InvalidArgument(std::string(key) + ": " + it->dump() + " is not a number >= 0");
  }
  *out = it->get<double>();
  return Status::Ok();
}

// A family's rope_scaling object: nullptr when absent or null; kInvalidArgument when it is not an
// object, its type ("type" or "rope_type") is not `type`, or it has a key outside `known`.
Result<const Json*> RopeScaling(const Json& j, std::string_view type,
                                const std::set<std::string>& known) {
  auto it = j.find("rope_scaling");
  if (it == j.end() || it->is_null()) return static_cast<const Json*>(nullptr);
  if (!it->is_object()) return InvalidArgument("rope_scaling: " + it->dump() + " is not an object");
  std::string got;
  for (const char* key : {"type", "rope_type"}) {
    if (auto t = it->find(key); t != it->end() && t->is_string()) got = t->get<std::string>();
  }
  if (got != type) {
    return InvalidArgument("rope_scaling: type \"" + got +
                           "\" is not implemented by the model runtime for this family (only \"" +
                           std::string(type) + "\" is)");
  }
  for (const auto& [key, value] : it->items()) {
    if (known.count(key) == 0) {
      return InvalidArgument("rope_scaling: " + key + " is not implemented by the model runtime");
    }
  }
  return &*it;
}

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
  if (auto it = j.find("sliding_window"); it != j.end() && !it->is_null()) {
    uint32_t window = 0;
    FMOE_RETURN_IF_ERROR(ReadCount(j, "sliding_window", true, &window));
    info->sliding_window = window;
  }
  uint32_t heads = 0;
  FMOE_RETURN_IF_ERROR(ReadCount(j, "num_attention_heads", true, &heads));
  if (info->hidden_size % heads != 0) {
    return InvalidArgument("hidden_size (" + std::to_string(info->hidden_size) +
                           ") is not a multiple of num_attention_heads (" + std::to_string(heads) +
                           ")");
  }
  return ReadLongRope(j, info->hidden_size / heads, info);
}

// DeepSeek's rope_scaling: YaRN only ({"type" or "rope_type": "yarn", "factor",
// "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}).
Status ReadYarn(const Json& j, ModelInfo* info) {
  static const std::set<std::string> kKnown = {
      "type",      "rope_type", "factor", "original_max_position_embeddings",
      "beta_fast", "beta_slow", "mscale", "mscale_all_dim"};
  FMOE_ASSIGN_OR_RETURN(const Json* scaling, RopeScaling(j, "yarn", kKnown));
  if (scaling == nullptr) return Status::Ok();
  const Json& r = *scaling;
  YarnSpec y;
  FMOE_RETURN_IF_ERROR(ReadPositiveDouble(r, "factor", &y.factor).WithContext("rope_scaling"));
  if (r.find("factor") == r.end()) return InvalidArgument("rope_scaling: factor: missing");
  FMOE_RETURN_IF_ERROR(
      ReadCount(r, "original_max_position_embeddings", true, &y.original_max_position_embeddings)
          .WithContext("rope_scaling"));
  FMOE_RETURN_IF_ERROR(
      ReadPositiveDouble(r, "beta_fast", &y.beta_fast).WithContext("rope_scaling"));
  FMOE_RETURN_IF_ERROR(
      ReadPositiveDouble(r, "beta_slow", &y.beta_slow).WithContext("rope_scaling"));
  FMOE_RETURN_IF_ERROR(ReadNonNegativeDouble(r, "mscale", &y.mscale).WithContext("rope_scaling"));
  FMOE_RETURN_IF_ERROR(
      ReadNonNegativeDouble(r, "mscale_all_dim", &y.mscale_all_dim).WithContext("rope_scaling"));
  info->yarn = y;
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
  FMOE_RETURN_IF_ERROR(ReadYarn(j, info));
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

struct Family {
  const char* architecture;
  const char* experts_key;  // The config key holding J.
  // Whether the family's attention reads config "head_dim"; otherwise it is always
  // hidden_size / num_attention_heads (transformers' Qwen2-MoE and OLMoE).
  bool reads_head_dim;
  Status (*parse)(const Json&, ModelInfo*);
  // The parser reads rope_scaling (DeepSeek's YaRN, Phi's LongRoPE).
  bool reads_rope_scaling = false;
};

const Family kFamilies[] = {
    {"MixtralForCausalLM", "num_local_experts", true, ParseMixtral},
    {"Qwen2MoeForCausalLM", "num_experts", false, ParseQwen2Moe},
    {"Qwen3MoeForCausalLM", "num_experts", true, ParseQwen3Moe},
    {"OlmoeForCausalLM", "num_experts", false, ParseOlmoe},
    {"PhimoeForCausalLM", "num_local_experts", false, ParsePhimoe, true},
    // The Hub's Phi-3.5-MoE config.json names its remote code; the checkpoint is the same.
    {"PhiMoEForCausalLM", "num_local_experts", false, ParsePhimoe, true},
    {"DeepseekV2ForCausalLM", "n_routed_experts", false, ParseDeepseekV2, true},
    {"DeepseekV3ForCausalLM", "n_routed_experts", false, ParseDeepseekV3, true},
};

Status ParseInto(const std::string& text, ModelInfo* info) {
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument("not valid JSON");
  if (!j.is_object()) return InvalidArgument("not a JSON object");

  auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string()) {
    return InvalidArgument("architectures: missing or not a list of names");
  }
  info->architecture = (*arch)[0].get<std::string>();
  const Family* family = nullptr;
  for (const Family& f : kFamilies) {
    if (info->architecture == f.architecture) family = &f;
  }
  if (family == nullptr) {
    std::string list;
    for (const Family& f : kFamilies)
      list += (list.empty() ? "" : ", ") + std::string(f.architecture);
    return InvalidArgument("architectures: \"" + info->architecture +
                           "\" is not a supported MoE architecture (" + list + ")");
  }

  FMOE_RETURN_IF_ERROR(ReadCount(j, "num_hidden_layers", true, &info->num_hidden_layers));
  FMOE_RETURN_IF_ERROR(ReadCount(j, "hidden_size", true, &info->hidden_size));
  FMOE_RETURN_IF_ERROR(ReadCount(j, "vocab_size", true, &info->vocab_size));
  FMOE_RETURN_IF_ERROR(ReadCount(j, "num_experts_per_tok", true, &info->top_k));
  FMOE_RETURN_IF_ERROR(
      ReadCount(j, "max_position_embeddings", false, &info->max_position_embeddings));
  FMOE_RETURN_IF_ERROR(ReadCount(j, family->experts_key, true, &info->num_experts));
  if (info->top_k > info->num_experts) {
    return InvalidArgument("num_experts_per_tok (" + std::to_string(info->top_k) +
                           ") > number of experts (" + std::to_string(info->num_experts) + ")");
  }
  info->moe_layers.clear();
  for (uint32_t i = 0; i < info->num_hidden_layers; ++i) info->moe_layers.push_back(i);
  FMOE_RETURN_IF_ERROR(family->parse(j, info));
  info->num_moe_layers = static_cast<uint32_t>(info->moe_layers.size());
  if (info->num_moe_layers == 0) return InvalidArgument("the model has no MoE layer");
  if (info->num_moe_layers < info->num_hidden_layers) {
    // Dense layers' MLP width (transformers' Qwen MLP uses intermediate_size).
    FMOE_RETURN_IF_ERROR(ReadCount(j, "intermediate_size", true, &info->dense_intermediate_size)
                             .WithContext("a dense layer's MLP width"));
  }
  info->routing.num_experts = info->num_experts;
  info->routing.top_k = info->top_k;
  FMOE_RETURN_IF_ERROR(info->routing.Validate());
  FMOE_RETURN_IF_ERROR(RefuseUnimplemented(j, family->reads_rope_scaling));
  if (family->reads_head_dim) return ParseRuntimeFields(j, info);
  Json plain = j;
  plain.erase("head_dim");
  if (info->mla) plain["head_dim"] = info->mla->qk_rope_head_dim;  // The rotary width.
  return ParseRuntimeFields(plain, info);
}

// Folds a safetensors file's header (length prefix and JSON) into the fingerprint: it names
// every tensor with its dtype, shape and offsets, so different weights layouts differ.
Status FoldSafetensorsHeader(const fs::path& path, uint64_t* h) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return IoError(path.string() + ": cannot open");
  unsigned char len_bytes[8];
  if (!in.read(reinterpret_cast<char*>(len_bytes), 8)) {
    return DataLoss(path.string() + ": shorter than the 8-byte safetensors header length");
  }
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | len_bytes[i];
  if (len == 0 || len > kMaxSafetensorsHeader) {
    return DataLoss(path.string() + ": safetensors header length " + std::to_string(len) +
                    " is out of range");
  }
  std::string header(len, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(len))) {
    return DataLoss(path.string() + ": truncated safetensors header");
  }
  std::string name = path.filename().string();
  *h = Fnv1a(*h, name.data(), name.size());
  *h = Fnv1a(*h, header.data(), header.size());
  return Status::Ok();
}

}  // namespace

uint64_t RoutedExpertParams(const ModelInfo& info) {
  return 3ull * info.intermediate_size * info.hidden_size;
}

uint64_t SharedExpertParams(const ModelInfo& info) {
  if (info.shared_expert_intermediate_size == 0) return 0;
  return 3ull * info.shared_expert_intermediate_size * info.hidden_size +
         (info.shared_expert_gated ? info.hidden_size : 0);
}

uint64_t KvBytesPerToken(const ModelInfo& info, uint32_t bytes_per_value) {
  const uint64_t per_layer = info.mla
                                 ? uint64_t{info.mla->kv_lora_rank} + info.mla->qk_rope_head_dim
                                 : 2ull * info.num_key_value_heads * info.head_dim;
  return per_layer * info.num_hidden_layers * bytes_per_value;
}

uint64_t ExpandedKvBytesPerToken(const ModelInfo& info, uint32_t bytes_per_value) {
  if (!info.mla) return KvBytesPerToken(info, bytes_per_value);
  const MlaSpec& m = *info.mla;
  const uint64_t per_layer =
      uint64_t{info.num_attention_heads} * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim);
  return per_layer * info.num_hidden_layers * bytes_per_value;
}

uint32_t CheckpointBytesPerParam(const ModelInfo& info) {
  if (info.torch_dtype == "bfloat16" || info.torch_dtype == "float16") return 2;
  return 4;
}

std::string DescribeModel(const ModelInfo& info) {
  std::ostringstream out;
  const uint32_t width = CheckpointBytesPerParam(info);
  const std::string dtype = info.torch_dtype.empty() ? "float32" : info.torch_dtype;
  auto mb = [&](uint64_t params) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.1f MB", static_cast<double>(params) * width / 1e6);
    return std::string(buf);
  };
  out << "model: " << info.dir << "\n";
  out << "  architecture: " << info.architecture
      << (info.runtime_unsupported.empty() ? "" : " (not run: " + info.runtime_unsupported + ")")
      << "\n";
  out << "  layers: " << info.num_hidden_layers << ", of which L = " << info.num_moe_layers
      << " MoE";
  if (info.num_moe_layers < info.num_hidden_layers) {
    out << " (dense:";
    size_t next = 0;
    for (uint32_t i = 0; i < info.num_hidden_layers; ++i) {
      if (next < info.moe_layers.size() && info.moe_layers[next] == i) {
        ++next;
        continue;
      }
      out << " " << i;
    }
    out << ", MLP width " << info.dense_intermediate_size << ")";
  }
  out << "\n";
  out << "  experts: J = " << info.num_experts << " per MoE layer, K = " << info.top_k
      << " per token (" << info.routing.Describe() << ")\n";
  out << "  routed expert: 3 x " << info.intermediate_size << " x " << info.hidden_size << " = "
      << RoutedExpertParams(info) << " parameters, " << mb(RoutedExpertParams(info)) << " in "
      << dtype << "; " << uint64_t{info.num_moe_layers} * info.num_experts << " in all\n";
  if (info.shared_expert_intermediate_size > 0) {
    out << "  shared expert: 3 x " << info.shared_expert_intermediate_size << " x "
        << info.hidden_size << (info.shared_expert_gated ? " with a sigmoid gate" : "") << ", "
        << mb(SharedExpertParams(info)) << " per MoE layer, resident outside the expert cache\n";
  }
  if (info.mla) {
    const MlaSpec& a = *info.mla;
    out << "  attention: multi-head latent, " << info.num_attention_heads << " heads, q "
        << (a.q_lora_rank > 0 ? "LoRA rank " + std::to_string(a.q_lora_rank) : "plain")
        << ", kv_lora_rank " << a.kv_lora_rank << ", qk " << a.qk_nope_head_dim << " + rope "
        << a.qk_rope_head_dim << ", v " << a.v_head_dim;
    if (info.yarn) out << ", YaRN x" << info.yarn->factor;
    out << "; KV cache " << KvBytesPerToken(info, CheckpointBytesPerParam(info))
        << " B/token (expanded: " << ExpandedKvBytesPerToken(info, CheckpointBytesPerParam(info))
        << ")\n  fingerprint: " << FingerprintHex(info.fingerprint) << "\n";
    return out.str();
  }
  out << "  attention: " << info.num_attention_heads << " heads, " << info.num_key_value_heads
      << " kv heads, head_dim " << info.head_dim;
  if (info.qkv_bias) out << ", q/k/v biases";
  if (info.o_bias) out << ", output bias";
  if (info.layer_norm) out << ", LayerNorm";
  if (info.lm_head_bias) out << ", lm_head bias";
  if (info.longrope) {
    out << ", LongRoPE (short factors up to " << info.longrope->original_max_position_embeddings
        << " tokens)";
  }
  if (info.qk_norm == QkNorm::kPerHead) out << ", q/k RMSNorm per head";
  if (info.qk_norm == QkNorm::kWhole) out << ", q/k RMSNorm over the projection";
  if (info.clip_qkv) out << ", q/k/v clipped to " << *info.clip_qkv;
  if (info.sliding_window) out << ", sliding window " << *info.sliding_window;
  out << "\n  fingerprint: " << FingerprintHex(info.fingerprint) << "\n";
  return out.str();
}

std::string FingerprintHex(uint64_t fingerprint) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(fingerprint));
  return buf;
}

Result<ModelInfo> ParseModelConfig(const std::string& json_text, const std::string& dir) {
  ModelInfo info;
  info.dir = dir;
  Status s = ParseInto(json_text, &info);
  if (!s.ok()) return s.WithContext("model: " + dir + "/config.json");
  info.fingerprint = Fnv1a(kFnvOffset, json_text.data(), json_text.size());
  return info;
}

Result<ModelInfo> LoadModelInfo(const std::string& dir) {
  std::error_code ec;
  fs::path root = fs::absolute(dir, ec).lexically_normal();
  if (!fs::is_directory(root, ec)) {
    return NotFound("model: " + root.string() + ": no such directory");
  }
  fs::path config = root / "config.json";
  std::ifstream in(config, std::ios::binary);
  if (!in) return NotFound("model: " + config.string() + ": no such file");
  std::stringstream ss;
  ss << in.rdbuf();
  FMOE_ASSIGN_OR_RETURN(ModelInfo info, ParseModelConfig(ss.str(), root.string()));

  for (const auto& entry : fs::directory_iterator(root, ec)) {
    if (entry.is_regular_file() && entry.path().extension() == ".safetensors") {
      info.weight_files.push_back(entry.path().filename().string());
    }
  }
  if (ec) return IoError("model: " + root.string() + ": " + ec.message());
  std::sort(info.weight_files.begin(), info.weight_files.end());
  for (const auto& name : info.weight_files) {
    Status s = FoldSafetensorsHeader(root / name, &info.fingerprint);
    if (!s.ok()) return s.WithContext("model");
  }
  return info;
}

}  // namespace fmoe
