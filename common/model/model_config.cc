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

#include "common/json.h"
#include "common/model/families/config_json.h"
#include "common/model/families/family.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;
using config_json::Json;
using config_json::ReadCount;
using config_json::ReadPositiveDouble;

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

// Fields every family shares that change the computation in ways the runtime does not implement.
// `rope_scaling_read`: the family's parser read rope_scaling (DeepSeek's YaRN).
Status RefuseUnimplemented(const Json& j, bool rope_scaling_read, ModelInfo* info) {
  if (auto it = j.find("quantization_config"); it != j.end() && !it->is_null()) {
    FMOE_RETURN_IF_ERROR(ParseQuantizationConfig(*it, &info->quant));
    const int64_t h = info->hidden_size, inter = info->intermediate_size;
    for (auto [out, in] : {std::pair{inter, h}, std::pair{h, inter}}) {
      if (std::string why = QuantShapeError(info->quant, out, in); !why.empty()) {
        return InvalidArgument("quantization_config: a routed expert's projection " + why);
      }
    }
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

// The rotated width of a head (ModelInfo::rotary_dim), once head_dim is known: config.json's
// rotary_dim, else int(head_dim * partial_rotary_factor) as transformers computes it, else the
// family's default fraction. A family that rotates whole heads refuses either key unless it
// says so.
Status ReadRotaryDim(const Json& j, const ModelFamily& family, ModelInfo* info) {
  auto dim_it = j.find("rotary_dim");
  auto factor_it = j.find("partial_rotary_factor");
  const bool has_dim = dim_it != j.end() && !dim_it->is_null();
  const bool has_factor = factor_it != j.end() && !factor_it->is_null();
  info->rotary_dim = 0;
  uint32_t dim = info->head_dim;
  if (has_dim) {
    FMOE_RETURN_IF_ERROR(ReadCount(j, "rotary_dim", true, &dim));
    if (has_factor) {  // MiniMax-M2.5 writes both: they must agree.
      double factor = 1.0;
      FMOE_RETURN_IF_ERROR(ReadPositiveDouble(j, "partial_rotary_factor", &factor));
      if (static_cast<uint32_t>(std::floor(info->head_dim * factor)) != dim) {
        return InvalidArgument("rotary_dim: " + std::to_string(dim) +
                               " disagrees with partial_rotary_factor " + factor_it->dump() +
                               " of head_dim " + std::to_string(info->head_dim));
      }
    }
  } else if (has_factor || family.partial_rotary_default > 0.0) {
    double factor = family.partial_rotary_default > 0.0 ? family.partial_rotary_default : 1.0;
    FMOE_RETURN_IF_ERROR(ReadPositiveDouble(j, "partial_rotary_factor", &factor));
    if (factor > 1.0) {
      return InvalidArgument("partial_rotary_factor: " + factor_it->dump() + " is above 1");
    }
    dim = static_cast<uint32_t>(std::floor(info->head_dim * factor));
  }
  const char* key = has_dim ? "rotary_dim" : "partial_rotary_factor";
  if (dim == info->head_dim) return Status::Ok();
  if (family.partial_rotary_default <= 0.0 || info->mla) {
    return InvalidArgument(std::string(key) + ": a rotary width of " + std::to_string(dim) +
                           " of head_dim " + std::to_string(info->head_dim) +
                           " is not implemented for " + info->architecture +
                           " (its heads rotate whole)");
  }
  if (dim == 0 || dim > info->head_dim || dim % 2 != 0) {
    return InvalidArgument(std::string(key) + ": gives a rotary width of " + std::to_string(dim) +
                           " for head_dim " + std::to_string(info->head_dim) +
                           "; it must be even and between 2 and head_dim");
  }
  info->rotary_dim = dim;
  return Status::Ok();
}

Status ParseInto(const std::string& text, ModelInfo* info) {
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument("not valid JSON");
  if (!j.is_object()) return InvalidArgument("not a JSON object");

  auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string()) {
    return InvalidArgument("architectures: missing or not a list of names");
  }
  info->architecture = (*arch)[0].get<std::string>();
  FMOE_ASSIGN_OR_RETURN(const ModelFamily* family, FindModelFamily(info->architecture));

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
  FMOE_RETURN_IF_ERROR(RefuseUnimplemented(j, family->reads_rope_scaling, info));
  if (family->reads_head_dim) {
    FMOE_RETURN_IF_ERROR(ParseRuntimeFields(j, info));
  } else {
    Json plain = j;
    plain.erase("head_dim");
    if (info->mla) plain["head_dim"] = info->mla->qk_rope_head_dim;  // The rotary width.
    FMOE_RETURN_IF_ERROR(ParseRuntimeFields(plain, info));
  }
  return ReadRotaryDim(j, *family, info);
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

uint64_t RoutedExpertBytes(const ModelInfo& info) {
  if (!info.quant.quantized()) return RoutedExpertParams(info) * CheckpointBytesPerParam(info);
  const int64_t h = info.hidden_size, inter = info.intermediate_size;
  // Biases (gpt-oss) stay in the checkpoint's float dtype beside the quantized weights.
  const uint64_t biases =
      info.expert_bias ? uint64_t(2 * inter + h) * CheckpointBytesPerParam(info) : 0;
  return 2 * QuantProjectionBytes(info.quant, inter, h) +
         QuantProjectionBytes(info.quant, h, inter) + biases;
}

uint64_t RoutedExpertParams(const ModelInfo& info) {
  const uint64_t h = info.hidden_size, inter = info.intermediate_size;
  return 3 * inter * h + (info.expert_bias ? 2 * inter + h : 0);
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

uint64_t KvPoolTokens(const ModelInfo& info, uint32_t max_batch, uint64_t requested) {
  constexpr uint64_t kBlock = 16;
  if (requested > 0) return (requested + kBlock - 1) / kBlock * kBlock;
  const uint64_t context = info.max_position_embeddings > 0 ? info.max_position_embeddings : 4096;
  const uint64_t tokens = std::max<uint64_t>(
      context, uint64_t{std::max<uint32_t>(max_batch, 1)} * std::min<uint64_t>(context, 32768));
  return (tokens + kBlock - 1) / kBlock * kBlock;
}

uint64_t KvSlidingPoolTokens(const ModelInfo& info, uint32_t max_batch, uint32_t max_batched_tokens,
                             uint64_t pool_tokens) {
  constexpr uint64_t kBlock = 16;
  const uint64_t window = info.mla ? 0 : info.sliding_window.value_or(0);
  if (window == 0 || max_batched_tokens == 0) return pool_tokens;
  const uint64_t per_sequence = (window + kBlock - 1) / kBlock * kBlock + 2 * kBlock;
  const uint64_t tokens = uint64_t{std::max<uint32_t>(max_batch, 1)} * per_sequence +
                          (uint64_t{max_batched_tokens} + kBlock - 1) / kBlock * kBlock;
  return std::min(tokens, pool_tokens);
}

std::pair<uint64_t, uint64_t> KvBytesPerTokenSplit(const ModelInfo& info,
                                                   uint32_t bytes_per_value) {
  const uint64_t total = KvBytesPerToken(info, bytes_per_value);
  const uint64_t layers = std::max<uint32_t>(info.num_hidden_layers, 1);
  if (info.mla || info.sliding_window.value_or(0) == 0) return {total, 0};
  uint64_t sliding = 0;
  for (uint64_t l = 0; l < layers; ++l) {
    if (info.sliding_layers.empty() || (l < info.sliding_layers.size() && info.sliding_layers[l])) {
      ++sliding;
    }
  }
  const uint64_t per_layer = total / layers;
  return {per_layer * (layers - sliding), per_layer * sliding};
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
  if (info.quant.quantized()) {
    char buf[160];
    std::snprintf(buf, sizeof(buf), "%.3f MiB (%.4f bytes per parameter)",
                  static_cast<double>(RoutedExpertBytes(info)) / (1 << 20),
                  static_cast<double>(RoutedExpertBytes(info)) /
                      static_cast<double>(RoutedExpertParams(info)));
    out << "  quantized: " << info.quant.Describe() << "; a routed expert stores " << buf
        << ", kept so in host memory, on the link and in the expert cache; dense weights are "
           "dequantized at load\n";
  }
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
  if (info.rotary_dim != 0) out << ", RoPE on the first " << info.rotary_dim << " dims of a head";
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
  if (info.sliding_window && info.sliding_layers.empty()) {
    out << ", sliding window " << *info.sliding_window;
  } else if (info.sliding_window) {
    size_t n = 0;
    for (bool s : info.sliding_layers) n += s ? 1 : 0;
    out << ", sliding window " << *info.sliding_window << " on " << n << " of "
        << info.sliding_layers.size() << " layers";
  }
  if (info.attention_sinks) out << ", attention sinks";
  if (info.yarn) out << ", YaRN x" << info.yarn->factor;
  if (info.swiglu_limit) out << "\n  experts: biases, SwiGLU clamped at " << *info.swiglu_limit;
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
