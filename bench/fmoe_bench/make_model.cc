// `fmoe-bench make-model`: writes a checkpoint with random weights and the exact tensor shapes of
// a real MoE model (make_model_shapes.h), in the Hugging Face layout our loaders read
// (common/model/checkpoint.h, common/model/model_config.h): tokenizer files and a README first,
// then the safetensors shards streamed chunk by chunk (common/model/safetensors.h
// SafetensorsWriter), the index, and config.json last, so a directory with a config.json is
// complete. Weights are a deterministic function of (seed, tensor name): the same seed gives the
// same bytes whatever the shard size. With --quant the linear layers the format quantizes are
// stored as its checkpoints store them (FP8 block, compressed-tensors INT4, GPTQ, AWQ: DESIGN
// section 12): the same random weights, quantized with a fixed scale, packed as the format packs
// them. One thread.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench/fmoe_bench/commands.h"
#include "bench/fmoe_bench/make_model_shapes.h"
#include "common/json.h"
#include "common/model/safetensors.h"
#include "common/status.h"

namespace fmoe::bench {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// The tokenizer copied into every checkpoint (its ids fit every shape's vocabulary).
constexpr const char* kTokenizerInTree = "deploy/models/tiny-moe";
#ifdef FMOE_MAKE_MODEL_TOKENIZER_DIR
constexpr const char* kDefaultTokenizerDir = FMOE_MAKE_MODEL_TOKENIZER_DIR;
#else
constexpr const char* kDefaultTokenizerDir = kTokenizerInTree;
#endif
constexpr const char* kTokenizerFiles[] = {"tokenizer.json", "tokenizer_config.json"};
constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr size_t kChunkBytes = 16u << 20;  // Generated and written at a time.
// Weights are uniform in [-a, a) with the standard deviation of transformers' normal init
// (initializer_range 0.02): a = 0.02 * sqrt(3).
constexpr float kUniformBound = 0.0346410162f;

// The command line, as typed: numbers are parsed here so every bad argument exits 2.
struct Args {
  std::string shape, out, layers, experts, vocab, dtype = "bfloat16", seed = "0", shard_gb = "4";
  std::string quant;  // "": float weights.
  std::string tokenizer = kDefaultTokenizerDir;
  bool force = false;
  bool dry_run = false;
};

struct TokenizerInfo {
  uint32_t vocab_size = 0;  // Highest id + 1.
  std::optional<int32_t> bos_id, eos_id;
};

// Everything decided before a byte is written.
struct Plan {
  const ModelShape* shape = nullptr;
  ModelSize size;
  DType dtype = DType::kBF16;
  std::string dtype_name;
  const QuantFormat* quant = nullptr;  // --quant; nullptr: float weights.
  uint64_t seed = 0;
  uint64_t shard_limit = 0;            // Bytes.
  std::vector<PlannedTensor> tensors;  // The model's tensors (parameters).
  std::vector<StoredTensor> stored;    // As written (quantized projections split in parts).
  std::vector<size_t> shard_of;        // Per stored tensor.
  std::vector<uint64_t> shard_bytes;   // Per shard: tensor data bytes.
  std::optional<int32_t> bos_id, eos_id;
  std::string bos_eos_note;  // Why the ids differ from the real model's, or "".

  std::string ShardName(size_t i) const {
    if (shard_bytes.size() == 1) return "model.safetensors";
    char buf[64];
    std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", i + 1, shard_bytes.size());
    return buf;
  }
};

std::string Gb(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GB", static_cast<double>(bytes) / 1e9);
  return buf;
}

Result<uint64_t> ParseCount(const char* flag, const std::string& text, uint64_t min, uint64_t max) {
  uint64_t v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || p != end) {
    return InvalidArgument(std::string(flag) + ": \"" + text + "\" is not a whole number");
  }
  if (v < min || v > max) {
    return InvalidArgument(std::string(flag) + ": " + text + " is not in [" + std::to_string(min) +
                           ", " + std::to_string(max) + "]");
  }
  return v;
}

Result<std::string> ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return IoError(path.string() + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return IoError(path.string() + ": cannot read");
  return ss.str();
}

// Writes `text` to `path` through a temporary file and a rename.
Status WriteFileAtomic(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return IoError(tmp.string() + ": cannot create");
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.flush();
    if (!out) {
      std::error_code ignored;
      fs::remove(tmp, ignored);
      return IoError(path.string() + ": cannot write");
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    return IoError(path.string() + ": cannot rename into place: " + ec.message());
  }
  return Status::Ok();
}

// The id of special token `key` ("bos_token") of tokenizer_config.json, looked up in
// tokenizer.json.
std::optional<int32_t> SpecialId(const Json& config, const Json& tokenizer, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return std::nullopt;
  std::string content;
  if (it->is_string()) {
    content = it->get<std::string>();
  } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    content = (*it)["content"].get<std::string>();
  } else {
    return std::nullopt;
  }
  if (auto added = tokenizer.find("added_tokens"); added != tokenizer.end() && added->is_array()) {
    for (const Json& t : *added) {
      if (t.is_object() && t.value("content", "") == content && t.contains("id") &&
          t["id"].is_number_integer()) {
        return t["id"].get<int32_t>();
      }
    }
  }
  const Json* vocab = tokenizer.contains("model") ? &tokenizer["model"] : nullptr;
  if (vocab != nullptr && vocab->is_object() && vocab->contains("vocab")) {
    const Json& v = (*vocab)["vocab"];
    if (v.is_object() && v.contains(content) && v[content].is_number_integer()) {
      return v[content].get<int32_t>();
    }
  }
  return std::nullopt;
}

// The vocabulary size (highest id + 1) and bos/eos ids of the tokenizer in `dir`.
Result<TokenizerInfo> ReadTokenizer(const fs::path& dir) {
  for (const char* name : kTokenizerFiles) {
    std::error_code ec;
    if (!fs::is_regular_file(dir / name, ec)) {
      return NotFound("--tokenizer: " + (dir / name).string() + ": no such file");
    }
  }
  FMOE_ASSIGN_OR_RETURN(std::string text, ReadFile(dir / "tokenizer.json"));
  FMOE_ASSIGN_OR_RETURN(std::string config_text, ReadFile(dir / "tokenizer_config.json"));
  const Json tok = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  const Json config = Json::parse(config_text, nullptr, /*allow_exceptions=*/false);
  if (!tok.is_object()) return DataLoss((dir / "tokenizer.json").string() + ": not a JSON object");
  if (!config.is_object()) {
    return DataLoss((dir / "tokenizer_config.json").string() + ": not a JSON object");
  }
  int64_t max_id = -1;
  if (auto m = tok.find("model"); m != tok.end() && m->is_object() && m->contains("vocab")) {
    const Json& vocab = (*m)["vocab"];
    if (vocab.is_object()) {
      for (const auto& [token, id] : vocab.items()) {
        if (id.is_number_integer()) max_id = std::max(max_id, id.get<int64_t>());
      }
    } else if (vocab.is_array()) {  // Unigram: [[piece, score], ...], ids by position.
      max_id = static_cast<int64_t>(vocab.size()) - 1;
    }
  }
  if (auto added = tok.find("added_tokens"); added != tok.end() && added->is_array()) {
    for (const Json& t : *added) {
      if (t.is_object() && t.contains("id") && t["id"].is_number_integer()) {
        max_id = std::max(max_id, t["id"].get<int64_t>());
      }
    }
  }
  if (max_id < 0 || max_id >= std::numeric_limits<int32_t>::max()) {
    return DataLoss((dir / "tokenizer.json").string() + ": no token ids found");
  }
  TokenizerInfo info;
  info.vocab_size = static_cast<uint32_t>(max_id + 1);
  info.bos_id = SpecialId(config, tok, "bos_token");
  info.eos_id = SpecialId(config, tok, "eos_token");
  return info;
}

// Parses and checks the arguments; reads the tokenizer when it matters (a write, or --vocab).
Result<Plan> MakePlan(const Args& a, std::optional<TokenizerInfo>* tokenizer) {
  Plan plan;
  if (a.shape.empty()) return InvalidArgument("--shape: required (" + ModelShapeNames() + ")");
  plan.shape = FindModelShape(a.shape);
  if (plan.shape == nullptr) {
    return InvalidArgument("--shape: \"" + a.shape + "\" is not one of " + ModelShapeNames());
  }
  const ModelShape& s = *plan.shape;
  if (a.out.empty() && !a.dry_run) return InvalidArgument("--out: required (unless --dry-run)");
  plan.size = RealSize(s);
  if (!a.layers.empty()) {
    FMOE_ASSIGN_OR_RETURN(uint64_t v, ParseCount("--layers", a.layers, 1, s.num_hidden_layers));
    plan.size.layers = static_cast<uint32_t>(v);
  }
  if (!a.experts.empty()) {
    FMOE_ASSIGN_OR_RETURN(uint64_t v, ParseCount("--experts", a.experts, s.top_k, s.num_experts));
    plan.size.experts = static_cast<uint32_t>(v);
  }
  if (a.dtype == "bfloat16") {
    plan.dtype = DType::kBF16;
  } else if (a.dtype == "float16") {
    plan.dtype = DType::kF16;
  } else if (a.dtype == "float32") {
    plan.dtype = DType::kF32;
  } else {
    return InvalidArgument("--dtype: \"" + a.dtype + "\" is not bfloat16, float16 or float32");
  }
  plan.dtype_name = a.dtype;
  if (!a.quant.empty()) {
    plan.quant = FindQuantFormat(a.quant);
    if (plan.quant == nullptr) {
      return InvalidArgument("--quant: \"" + a.quant + "\" is not one of " + QuantFormatNames());
    }
    const bool mxfp4 = plan.quant->spec.method == QuantMethod::kMxfp4;
    if ((s.family == ModelFamily::kGptOss) != mxfp4) {
      return InvalidArgument(
          "--quant: " + a.quant + " is not a format of " + s.name +
          (mxfp4 ? " (mxfp4 is gpt-oss's format)" : " (gpt-oss's experts are released in mxfp4)"));
    }
  }
  FMOE_ASSIGN_OR_RETURN(plan.seed,
                        ParseCount("--seed", a.seed, 0, std::numeric_limits<uint64_t>::max()));
  {
    char* end = nullptr;
    const double gb = std::strtod(a.shard_gb.c_str(), &end);
    if (a.shard_gb.empty() || end != a.shard_gb.c_str() + a.shard_gb.size() || !std::isfinite(gb) ||
        gb <= 0 || gb > 1e6) {
      return InvalidArgument("--shard-gb: \"" + a.shard_gb + "\" is not a size in GB above 0");
    }
    plan.shard_limit = std::max<uint64_t>(1, static_cast<uint64_t>(gb * 1e9));
  }
  // The tokenizer: its ids must fit the vocabulary, and it fills in ids a cut vocabulary lacks.
  if (!a.dry_run || !a.vocab.empty()) {
    auto info = ReadTokenizer(a.tokenizer);
    if (!info.ok()) {
      return info.status().code() == ErrorCode::kNotFound
                 ? InvalidArgument(info.status().message() + " (pass --tokenizer DIR)")
                 : info.status();
    }
    *tokenizer = *info;
  }
  if (!a.vocab.empty()) {
    const uint64_t min = (*tokenizer)->vocab_size;
    if (min > s.vocab_size) {
      return InvalidArgument("--vocab: the tokenizer in " + a.tokenizer + " has " +
                             std::to_string(min) + " ids, more than " + s.name + "'s " +
                             std::to_string(s.vocab_size));
    }
    FMOE_ASSIGN_OR_RETURN(uint64_t v, ParseCount("--vocab", a.vocab, min, s.vocab_size));
    plan.size.vocab = static_cast<uint32_t>(v);
  }
  plan.bos_id = s.bos_token_id;
  plan.eos_id = s.eos_token_id;
  const bool bos_fits = !s.bos_token_id || static_cast<uint32_t>(*s.bos_token_id) < plan.size.vocab;
  const bool eos_fits = static_cast<uint32_t>(s.eos_token_id) < plan.size.vocab;
  if (tokenizer->has_value() && (!bos_fits || !eos_fits)) {
    const std::string eos = std::to_string(s.eos_token_id);
    const std::string vocab = std::to_string(plan.size.vocab);
    plan.eos_id = (*tokenizer)->eos_id;
    if (s.bos_token_id) {
      plan.bos_id = (*tokenizer)->bos_id;
      plan.bos_eos_note = "bos/eos ids " + std::to_string(*s.bos_token_id) + "/" + eos +
                          " do not fit vocab " + vocab + "; the tokenizer's are used";
    } else {  // A model without a bos id keeps none.
      plan.bos_eos_note =
          "eos id " + eos + " does not fit vocab " + vocab + "; the tokenizer's is used";
    }
  }

  plan.tensors = PlanTensors(s, plan.size);
  FMOE_ASSIGN_OR_RETURN(plan.stored, StoreTensors(plan.tensors, plan.dtype, plan.quant));
  // Shards as transformers cuts them: in order, a new shard when the next tensor would overflow.
  for (const StoredTensor& t : plan.stored) {
    const uint64_t bytes = t.bytes();
    if (plan.shard_bytes.empty() ||
        (plan.shard_bytes.back() > 0 && plan.shard_bytes.back() + bytes > plan.shard_limit)) {
      plan.shard_bytes.push_back(0);
    }
    plan.shard_bytes.back() += bytes;
    plan.shard_of.push_back(plan.shard_bytes.size() - 1);
  }
  if (plan.shard_bytes.size() > 99999) {
    return InvalidArgument("--shard-gb: " + a.shard_gb + " cuts the model into " +
                           std::to_string(plan.shard_bytes.size()) +
                           " shards, more than 99999; raise it");
  }
  return plan;
}

// splitmix64 (Steele, Lea and Flood): fast, and good enough for weights nobody trains.
uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t TensorSeed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a of the name, mixed with the seed.
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  uint64_t state = seed ^ h;
  return SplitMix64(&state);
}

// Stores float `v` as element `i` of `out` in dtype D.
template <DType D>
void Store(std::byte* out, size_t i, float v) {
  if constexpr (D == DType::kF32) {
    std::memcpy(out + 4 * i, &v, 4);
  } else {
    const uint16_t h = D == DType::kBF16 ? F32ToBF16(v) : F32ToF16(v);
    std::memcpy(out + 2 * i, &h, 2);
  }
}

// `n` uniform values in [-a, a), two from each 64-bit draw of the tensor's stream `state`.
template <DType D>
void FillRandom(uint64_t* state, size_t n, std::byte* out) {
  constexpr float kScale = kUniformBound / 2147483648.0f;  // int32 -> [-a, a).
  size_t i = 0;
  for (; i + 1 < n; i += 2) {
    const uint64_t bits = SplitMix64(state);
    Store<D>(out, i,
             static_cast<float>(static_cast<int32_t>(static_cast<uint32_t>(bits))) * kScale);
    Store<D>(out, i + 1, static_cast<float>(static_cast<int32_t>(bits >> 32)) * kScale);
  }
  if (i < n) {
    const uint64_t bits = SplitMix64(state);
    Store<D>(out, i,
             static_cast<float>(static_cast<int32_t>(static_cast<uint32_t>(bits))) * kScale);
  }
}

// Fills `out` with the next `n` values of a tensor in `dtype`, continuing its stream `state`.
// Chunks hold an even number of values, so the stream does not depend on the dtype.
void Fill(TensorInit init, DType dtype, uint64_t* state, size_t n, std::byte* out) {
  if (init != TensorInit::kRandom) {
    const float v = init == TensorInit::kOnes ? 1.0f : 0.0f;
    const size_t elem = DTypeSize(dtype);
    std::byte one[4];
    if (dtype == DType::kF32) Store<DType::kF32>(one, 0, v);
    if (dtype == DType::kBF16) Store<DType::kBF16>(one, 0, v);
    if (dtype == DType::kF16) Store<DType::kF16>(one, 0, v);
    for (size_t i = 0; i < n; ++i) std::memcpy(out + elem * i, one, elem);
    return;
  }
  switch (dtype) {
    case DType::kF32:
      FillRandom<DType::kF32>(state, n, out);
      break;
    case DType::kBF16:
      FillRandom<DType::kBF16>(state, n, out);
      break;
    default:
      FillRandom<DType::kF16>(state, n, out);
      break;
  }
}

// Element `i` of the random stream FillRandom writes from `start` (a tensor's TensorSeed): draw
// i / 2 of splitmix64, its low half for even i. splitmix64 is a counter, so any element is one
// draw away; the quantized tensors, packed across rows or columns, read their weights this way.
float UniformAt(uint64_t start, uint64_t i) {
  constexpr float kScale = kUniformBound / 2147483648.0f;
  uint64_t state = start + (i / 2) * 0x9e3779b97f4a7c15ull;
  const uint64_t bits = SplitMix64(&state);
  const uint32_t half =
      i % 2 == 0 ? static_cast<uint32_t>(bits) : static_cast<uint32_t>(bits >> 32);
  return static_cast<float>(static_cast<int32_t>(half)) * kScale;
}

// The FP8 e4m3fn byte nearest to `v` (ties to even), saturating at +-448: never a NaN code (0x7f,
// 0xff). common/model/quant.h's Fp8E4m3ToFloat reads it back.
uint8_t F32ToE4m3(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x43e00000u) return sign | 0x7e;  // 448 and above (NaN inputs never come).
  if (magnitude < 0x3c800000u) {  // Below 2^-6: subnormal m x 2^-9 (m = 8 is 2^-6's code).
    return sign | static_cast<uint8_t>(std::nearbyint(std::fabs(v) * 512.0f));
  }
  // The 23-bit mantissa rounded to 3 bits, ties to even (a carry steps the exponent), then the
  // exponent rebiased from 127 to 7.
  const uint32_t rounded = (magnitude + 0x7ffffu + ((magnitude >> 20) & 1u)) >> 20;
  return sign | static_cast<uint8_t>(std::min<uint32_t>(rounded - ((127u - 7u) << 3), 0x7e));
}

// `v` rounded to the float dtype `dtype` and back.
float RoundTo(DType dtype, float v) {
  std::byte bytes[4];
  if (dtype == DType::kBF16) Store<DType::kBF16>(bytes, 0, v);
  if (dtype == DType::kF16) Store<DType::kF16>(bytes, 0, v);
  if (dtype != DType::kBF16 && dtype != DType::kF16) return v;
  float out = v;
  (void)ConvertToF32(dtype, std::span<const std::byte>(bytes, 2), std::span<float>(&out, 1));
  return out;
}

// AWQ's nibble order: nibble k of a word holds output column 8c + kAwqOrder[k].
constexpr int kAwqOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// MXFP4 (gpt-oss's fused experts, planned [J, in, out]): one scale for every block,
// 2^ceil(log2(a / 6)) (the float path's bound a at or under FP4's largest magnitude, 6), and each
// weight of the same seed at the nearest FP4 e2m1 value of w / scale; element 2k of a block in
// the low nibble of byte k.
void FillMxfp4(const PlannedTensor& p, const StoredTensor& t, uint64_t start, uint64_t begin,
               size_t n, std::byte* out) {
  const int exponent = static_cast<int>(std::ceil(std::log2(kUniformBound / 6.0f)));
  if (t.kind == StoredKind::kQuantScale) {
    for (size_t k = 0; k < n; ++k) out[k] = static_cast<std::byte>(exponent + 127);
    return;
  }
  static constexpr float kMagnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float inv = std::ldexp(1.0f, -exponent);
  auto code = [&](float w) {
    const float v = w * inv;
    int best = 0;
    for (int c = 1; c < 8; ++c) {
      if (std::fabs(std::fabs(v) - kMagnitudes[c]) < std::fabs(std::fabs(v) - kMagnitudes[best])) {
        best = c;
      }
    }
    return static_cast<uint8_t>(best == 0 || v >= 0 ? best : best + 8);
  };
  const int64_t in = p.shape[1], outs = p.shape[2];
  const int64_t bytes_per_row = in / 2;  // Of one output row: in / 32 blocks of 16 bytes.
  for (size_t k = 0; k < n; ++k) {
    const int64_t b = static_cast<int64_t>(begin + k);
    const int64_t row = b / bytes_per_row, byte = b % bytes_per_row;  // row = e * out + o.
    const int64_t e = row / outs, o = row % outs, i = 2 * byte;
    const float lo = UniformAt(start, static_cast<uint64_t>((e * in + i) * outs + o));
    const float hi = UniformAt(start, static_cast<uint64_t>((e * in + i + 1) * outs + o));
    out[k] = static_cast<std::byte>(code(lo) | (code(hi) << 4));
  }
}

// Fills `out` with elements [begin, begin + n) of quantized tensor `t`. One fixed scale per format
// (rounded to the scale's dtype) maps the float path's [-a, a) onto the codes: FP8 puts a at 448
// (DeepSeek's amax / 448); the 4-bit formats at 7.5 steps from the zero point 8
// (compressed-tensors' symmetric amax / 7.5, GPTQ's 2 amax / 15, AWQ's (max - min) / 15 with zero
// 8), so the dequantized weights are the float weights of the same seed to within the format's
// rounding.
void FillQuantized(const Plan& plan, const StoredTensor& t, uint64_t begin, size_t n,
                   std::byte* out) {
  const PlannedTensor& p = plan.tensors[t.planned];
  const QuantSpec& spec = plan.quant->spec;
  const uint64_t start = TensorSeed(plan.seed, p.name);
  if (spec.method == QuantMethod::kMxfp4) {
    FillMxfp4(p, t, start, begin, n, out);
    return;
  }
  const int64_t rows = p.shape[0], cols = p.shape[1];
  const bool fp8 = spec.method == QuantMethod::kFp8Block;
  DType scale_dtype = DType::kF32;
  for (const QuantTensorSpec& q : QuantTensorsOf(spec, rows, cols)) {
    if (q.role == QuantRole::kScale) scale_dtype = q.dtypes.front();
  }
  const float scale = RoundTo(scale_dtype, kUniformBound / (fp8 ? 448.0f : 7.5f));
  const float inv = 1.0f / scale;
  // The 4-bit code of a weight: round(w / scale) + 8, in 0..15.
  auto code = [&](float w) {
    return static_cast<uint32_t>(std::clamp(std::nearbyint(w * inv) + 8.0f, 0.0f, 15.0f));
  };
  // Weights w[o][i..i+8) (i even: four draws, as FillRandom makes them).
  auto eight = [&](int64_t o, int64_t i, float* w) {
    uint64_t state = start + static_cast<uint64_t>(o * cols + i) / 2 * 0x9e3779b97f4a7c15ull;
    constexpr float kScale = kUniformBound / 2147483648.0f;
    for (int b = 0; b < 8; b += 2) {
      const uint64_t bits = SplitMix64(&state);
      w[b] = static_cast<float>(static_cast<int32_t>(static_cast<uint32_t>(bits))) * kScale;
      w[b + 1] = static_cast<float>(static_cast<int32_t>(bits >> 32)) * kScale;
    }
  };
  auto store32 = [&](size_t k, uint32_t word) { std::memcpy(out + 4 * k, &word, 4); };
  switch (t.kind) {
    case StoredKind::kQuantWeight:
      for (size_t k = 0; k < n; ++k) {
        const int64_t j = static_cast<int64_t>(begin + k);
        if (fp8) {
          // Row-major, as the float path: two weights from each draw.
          if (j % 2 == 0 && k + 1 < n) {
            uint64_t state = start + static_cast<uint64_t>(j) / 2 * 0x9e3779b97f4a7c15ull;
            const uint64_t bits = SplitMix64(&state);
            constexpr float kScale = kUniformBound / 2147483648.0f;
            const float lo = static_cast<float>(static_cast<int32_t>(static_cast<uint32_t>(bits)));
            const float hi = static_cast<float>(static_cast<int32_t>(bits >> 32));
            out[k] = static_cast<std::byte>(F32ToE4m3(lo * kScale * inv));
            out[++k] = static_cast<std::byte>(F32ToE4m3(hi * kScale * inv));
          } else {
            out[k] =
                static_cast<std::byte>(F32ToE4m3(UniformAt(start, static_cast<uint64_t>(j)) * inv));
          }
          continue;
        }
        float w[8];
        if (spec.method == QuantMethod::kInt4Packed) {  // [out, in / 8]: 8 columns of a row.
          eight(j / (cols / 8), 8 * (j % (cols / 8)), w);
        } else if (spec.method == QuantMethod::kGptq) {  // [in / 8, out]: 8 input rows.
          eight(j % rows, 8 * (j / rows), w);
        } else {  // AWQ [in, out / 8]: 8 output columns, in AWQ's order.
          const int64_t i = j / (rows / 8), o = 8 * (j % (rows / 8));
          for (int b = 0; b < 8; ++b) {
            w[b] = UniformAt(start, static_cast<uint64_t>((o + kAwqOrder[b]) * cols + i));
          }
        }
        uint32_t word = 0;
        for (int b = 0; b < 8; ++b) word |= code(w[b]) << (4 * b);
        store32(k, word);
      }
      break;
    case StoredKind::kQuantScale:
      for (size_t k = 0; k < n; ++k) {
        if (t.dtype == DType::kF32) Store<DType::kF32>(out, k, scale);
        if (t.dtype == DType::kBF16) Store<DType::kBF16>(out, k, scale);
        if (t.dtype == DType::kF16) Store<DType::kF16>(out, k, scale);
      }
      break;
    case StoredKind::kQuantZero:
      // Zero point 8 in every nibble; GPTQ v1 stores zero - 1.
      for (size_t k = 0; k < n; ++k) {
        store32(k, spec.method == QuantMethod::kGptq && !spec.gptq_v2 ? 0x77777777u : 0x88888888u);
      }
      break;
    case StoredKind::kGroupIndex:
      for (size_t k = 0; k < n; ++k) {
        store32(k, static_cast<uint32_t>((begin + k) / spec.group_size));
      }
      break;
    case StoredKind::kWeightShape:
      for (size_t k = 0; k < n; ++k) {
        const int64_t v = begin + k == 0 ? rows : cols;
        std::memcpy(out + 8 * k, &v, 8);
      }
      break;
    case StoredKind::kFloat:
      break;
  }
}

void PrintSummary(const Plan& plan) {
  const ModelShape& s = *plan.shape;
  const ModelSize real = RealSize(s);
  uint64_t params = 0, bytes = 0, routed = 0, shared = 0, routed_matrices = 0;
  uint64_t quantized = 0, quantized_tensors = 0, quantized_bytes = 0;
  for (const PlannedTensor& t : plan.tensors) {
    params += t.numel();
    routed_matrices += t.expert_matrices;
    if (plan.quant != nullptr && QuantizedBy(*plan.quant, t)) ++quantized;
  }
  for (const StoredTensor& t : plan.stored) {
    const TensorRole role = plan.tensors[t.planned].role;
    bytes += t.bytes();
    if (role == TensorRole::kRoutedExpert) routed += t.bytes();
    if (role == TensorRole::kSharedExpert) shared += t.bytes();
    if (t.kind != StoredKind::kFloat) {
      ++quantized_tensors;
      quantized_bytes += t.bytes();
    }
  }
  // DeepSeek's dense first layers have no experts: count the MoE layers from the tensors.
  const uint64_t routed_experts = routed_matrices / 3;
  const uint64_t moe_layers = plan.size.experts == 0 ? 0 : routed_experts / plan.size.experts;
  // Every routed expert is stored alike: its bytes are the routed bytes shared out.
  const uint64_t expert_bytes =
      routed_experts == 0 ? RoutedExpertParams(s) * DTypeSize(plan.dtype) : routed / routed_experts;
  std::printf("shape: %s (%s, the shape of %s)\n", s.name, s.architecture, s.hub_id);
  std::printf("layers: %u of %u; vocab: %u of %u; dtype: %s; seed: %llu\n", plan.size.layers,
              real.layers, plan.size.vocab, real.vocab, plan.dtype_name.c_str(),
              static_cast<unsigned long long>(plan.seed));
  std::printf("tensors: %zu\n", plan.stored.size());
  std::printf("parameters: %llu (%.2f B; the real model: %.1f B)\n",
              static_cast<unsigned long long>(params), static_cast<double>(params) / 1e9,
              s.published_params / 1e9);
  std::printf("bytes: %llu (%s)\n", static_cast<unsigned long long>(bytes), Gb(bytes).c_str());
  if (plan.quant != nullptr) {
    std::printf(
        "quantization: %s (--quant %s, the layout of %s): %llu of the linear weights, %s; "
        "%llu tensors, %llu bytes\n",
        plan.quant->spec.Describe().c_str(), plan.quant->name, plan.quant->as,
        static_cast<unsigned long long>(quantized),
        plan.quant->routed_experts_only ? "the routed experts only"
                                        : "every decoder linear but the routers",
        static_cast<unsigned long long>(quantized_tensors),
        static_cast<unsigned long long>(quantized_bytes));
  }
  // Native bytes (weights, scales, zero points, group indexes), as DESIGN section 12 counts them.
  std::printf("routed expert bytes: %llu (%s, %.2f MiB, %.4f bytes/param; 3 x %u x %u)\n",
              static_cast<unsigned long long>(expert_bytes), Gb(expert_bytes).c_str(),
              static_cast<double>(expert_bytes) / (1 << 20),
              static_cast<double>(expert_bytes) / static_cast<double>(RoutedExpertParams(s)),
              s.hidden_size, s.expert_intermediate_size);
  std::printf("experts per layer: %u of %u, top-%u\n", plan.size.experts, real.experts, s.top_k);
  std::printf("routed experts: %llu, %llu bytes (%.1f%% of the bytes)\n",
              static_cast<unsigned long long>(routed_experts),
              static_cast<unsigned long long>(routed),
              bytes == 0 ? 0.0 : 100.0 * static_cast<double>(routed) / static_cast<double>(bytes));
  if (shared > 0) {
    std::printf("shared expert bytes per layer: %llu\n",
                static_cast<unsigned long long>(moe_layers == 0 ? 0 : shared / moe_layers));
  }
  std::printf("dense bytes: %llu (everything but the routed experts)\n",
              static_cast<unsigned long long>(bytes - routed));
  std::printf("shards: %zu (at most %s each)\n", plan.shard_bytes.size(),
              Gb(plan.shard_limit).c_str());
  if (!plan.bos_eos_note.empty()) std::printf("note: %s\n", plan.bos_eos_note.c_str());
}

// --out: created if missing; a non-empty directory only with --force, which removes the weights
// and config.json a previous run left (every *.safetensors file is part of the model's
// fingerprint, and a stale model.safetensors would win over a new index).
Status PrepareOutDir(const fs::path& out, bool force) {
  std::error_code ec;
  if (fs::exists(out, ec)) {
    if (!fs::is_directory(out, ec)) {
      return InvalidArgument("--out: " + out.string() + " exists and is not a directory");
    }
    const bool empty = fs::is_empty(out, ec);
    if (ec) return IoError(out.string() + ": cannot list: " + ec.message());
    if (!empty && !force) {
      return InvalidArgument("--out: " + out.string() +
                             " is not empty (pass --force to write over it)");
    }
    std::vector<fs::path> stale;
    for (const auto& entry : fs::directory_iterator(out, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.ends_with(".safetensors") || name == kIndexFile || name == "config.json") {
        stale.push_back(entry.path());
      }
    }
    if (ec) return IoError(out.string() + ": cannot list: " + ec.message());
    for (const fs::path& path : stale) {
      if (!fs::remove(path, ec) && ec) {
        return IoError(path.string() + ": cannot remove: " + ec.message());
      }
    }
    return Status::Ok();
  }
  fs::create_directories(out, ec);
  if (ec) return IoError(out.string() + ": cannot create: " + ec.message());
  return Status::Ok();
}

std::string Readme(const Plan& plan, const Args& a) {
  const ModelShape& s = *plan.shape;
  std::ostringstream r;
  r << "# Random weights with the shapes of " << s.hub_id << "\n\n"
    << "Written by `fmoe-bench make-model --shape " << s.name << " --layers " << plan.size.layers
    << " --experts " << plan.size.experts << " --vocab " << plan.size.vocab << " --dtype "
    << plan.dtype_name << (plan.quant != nullptr ? " --quant " + std::string(plan.quant->name) : "")
    << " --seed " << plan.seed << " --shard-gb " << a.shard_gb << "`.\n\n"
    << "The weights are random (uniform, the spread of initializer_range 0.02; norms 1, biases 0)\n"
    << "and mean nothing: the model writes noise. Every tensor has the name and shape a real\n"
    << s.architecture << " checkpoint has, so loading, expert transfers and expert compute can\n"
    << "be timed at real sizes. For timing only.\n\n"
    << "- decoder layers: " << plan.size.layers << " of " << s.num_hidden_layers << "\n"
    << "- routed experts per layer: " << plan.size.experts << " of " << s.num_experts << ", top-"
    << s.top_k << "\n"
    << "- vocabulary: " << plan.size.vocab << " of " << s.vocab_size << "\n"
    << "- tokenizer: copied from " << a.tokenizer << " (a small BPE whose ids fit the\n"
    << "  vocabulary; ids above its range decode to nothing)\n";
  if (!plan.bos_eos_note.empty()) r << "- " << plan.bos_eos_note << "\n";
  if (plan.quant != nullptr) {
    r << "- quantized: " << plan.quant->spec.Describe() << " in the layout of " << plan.quant->as
      << " ("
      << (plan.quant->routed_experts_only ? "the routed experts only"
                                          : "every decoder linear but the routers")
      << "); the same random weights quantized with one fixed scale\n";
  }
  if (s.family == ModelFamily::kPhimoe) {
    r << "- config.json leaves out the real model's LongRoPE factors (rope_scaling: null)\n";
  }
  return r.str();
}

Status WriteShard(const Plan& plan, const fs::path& out, size_t shard,
                  std::vector<std::byte>* chunk) {
  std::vector<TensorSpec> specs;
  std::vector<const StoredTensor*> tensors;
  for (size_t i = 0; i < plan.stored.size(); ++i) {
    if (plan.shard_of[i] != shard) continue;
    specs.push_back({plan.stored[i].name, plan.stored[i].dtype, plan.stored[i].shape});
    tensors.push_back(&plan.stored[i]);
  }
  const fs::path path = out / plan.ShardName(shard);
  FMOE_ASSIGN_OR_RETURN(
      std::unique_ptr<SafetensorsWriter> writer,
      SafetensorsWriter::Create(path.string(), specs,
                                {{"format", "pt"}, {"fmoe", "make-model random weights"}}));
  for (const StoredTensor* t : tensors) {
    const size_t elem = DTypeSize(t->dtype);
    const size_t per_chunk = chunk->size() / elem;
    uint64_t state = TensorSeed(plan.seed, t->name);
    for (uint64_t done = 0, total = t->numel(); done < total;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(total - done, per_chunk));
      if (t->kind == StoredKind::kFloat) {
        Fill(plan.tensors[t->planned].init, t->dtype, &state, n, chunk->data());
      } else {
        FillQuantized(plan, *t, done, n, chunk->data());
      }
      FMOE_RETURN_IF_ERROR(writer->Append(std::span<const std::byte>(chunk->data(), n * elem)));
      done += n;
    }
  }
  return writer->Finish();
}

Status WriteModel(const Plan& plan, const Args& a) {
  const fs::path out = a.out;
  FMOE_RETURN_IF_ERROR(PrepareOutDir(out, a.force));
  uint64_t total = 0;
  for (uint64_t b : plan.shard_bytes) total += b;
  std::error_code ec;
  const fs::space_info space = fs::space(out, ec);
  if (!ec && space.available < total + (64u << 20)) {
    return ResourceExhausted(out.string() + ": " + Gb(total) + " to write, " + Gb(space.available) +
                             " available");
  }
  for (const char* name : kTokenizerFiles) {
    FMOE_ASSIGN_OR_RETURN(std::string text, ReadFile(fs::path(a.tokenizer) / name));
    FMOE_RETURN_IF_ERROR(WriteFileAtomic(out / name, text));
  }
  FMOE_RETURN_IF_ERROR(WriteFileAtomic(out / "README.md", Readme(plan, a)));

  std::vector<std::byte> chunk(kChunkBytes);
  for (size_t shard = 0; shard < plan.shard_bytes.size(); ++shard) {
    const auto start = std::chrono::steady_clock::now();
    FMOE_RETURN_IF_ERROR(WriteShard(plan, out, shard, &chunk));
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "wrote %s (%s in %.1f s, %.2f GB/s)\n", plan.ShardName(shard).c_str(),
                 Gb(plan.shard_bytes[shard]).c_str(), s,
                 s > 0 ? static_cast<double>(plan.shard_bytes[shard]) / 1e9 / s : 0.0);
  }
  if (plan.shard_bytes.size() > 1) {
    // nlohmann::ordered_json keeps the tensors in checkpoint order.
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}};
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    for (size_t i = 0; i < plan.stored.size(); ++i) {
      weight_map[plan.stored[i].name] = plan.ShardName(plan.shard_of[i]);
    }
    index["weight_map"] = std::move(weight_map);
    FMOE_RETURN_IF_ERROR(WriteFileAtomic(out / kIndexFile, index.dump(2) + "\n"));
  }
  // Last: a directory with a config.json holds a whole checkpoint.
  return WriteFileAtomic(out / "config.json", ConfigJson(*plan.shape, plan.size, plan.dtype_name,
                                                         plan.bos_id, plan.eos_id, plan.quant));
}

int Run(Args a, const std::vector<std::string>& extras) {
  // The default tokenizer is the source tree's; a binary run from a copy of the tree elsewhere
  // finds it relative to the working directory.
  std::error_code ec;
  if (a.tokenizer == kDefaultTokenizerDir && !fs::exists(a.tokenizer, ec) &&
      fs::exists(kTokenizerInTree, ec)) {
    a.tokenizer = kTokenizerInTree;
  }
  if (!extras.empty()) {
    std::string list;
    for (const auto& e : extras) list += " " + e;
    std::fprintf(stderr, "fmoe-bench make-model: unexpected arguments:%s\n", list.c_str());
    return 2;
  }
  std::optional<TokenizerInfo> tokenizer;
  auto plan = MakePlan(a, &tokenizer);
  if (plan.ok() && !a.out.empty() && a.dry_run) {
    // A dry run writes nothing, but says what a write would refuse.
    if (fs::exists(a.out, ec) && (!fs::is_directory(a.out, ec) || !fs::is_empty(a.out, ec)) &&
        !a.force) {
      plan = InvalidArgument("--out: " + a.out + " is not empty (pass --force to write over it)");
    }
  }
  if (!plan.ok()) {
    std::fprintf(stderr, "fmoe-bench make-model: %s\n", plan.status().message().c_str());
    return plan.status().code() == ErrorCode::kInvalidArgument ? 2 : 1;
  }
  if (a.dry_run) {
    uint64_t bytes = 0;
    for (size_t i = 0; i < plan->stored.size(); ++i) {
      const StoredTensor& t = plan->stored[i];
      bytes += t.bytes();
      std::printf("tensor %s %s %s %llu %s\n", t.name.c_str(), DTypeName(t.dtype),
                  ShapeString(t.shape).c_str(), static_cast<unsigned long long>(t.bytes()),
                  plan->ShardName(plan->shard_of[i]).c_str());
    }
    std::printf("total: %zu tensors, %llu bytes (%s)\n", plan->stored.size(),
                static_cast<unsigned long long>(bytes), Gb(bytes).c_str());
    PrintSummary(*plan);
    return 0;
  }
  const auto start = std::chrono::steady_clock::now();
  Status s = WriteModel(*plan, a);
  if (!s.ok()) {
    std::fprintf(stderr, "fmoe-bench make-model: %s\n", s.message().c_str());
    return s.code() == ErrorCode::kInvalidArgument ? 2 : 1;
  }
  PrintSummary(*plan);
  std::printf("wrote %s in %.1f s\n", a.out.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return 0;
}

}  // namespace

void AddMakeModelCommand(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand(
      "make-model", "write a random-weight checkpoint with a real MoE model's tensor shapes");
  // Values are taken as text and checked in Run, so every bad argument exits 2 with one line.
  cmd->allow_extras();
  cmd->add_option("--shape", args->shape, "model shape: " + ModelShapeNames() + " (required)")
      ->type_name("NAME");
  cmd->add_option("--out", args->out,
                  "output directory (required unless --dry-run; must be empty unless --force)")
      ->type_name("DIR");
  cmd->add_option("--layers", args->layers, "decoder layers (default: the real model's)")
      ->type_name("N");
  cmd->add_option("--experts", args->experts,
                  "routed experts per layer, each at its real size, at least top-k (default: the "
                  "real model's; for tests and smoke runs)")
      ->type_name("N");
  cmd->add_option("--vocab", args->vocab,
                  "vocabulary size, at least the tokenizer's ids (default: the real model's; for "
                  "tests and smoke runs)")
      ->type_name("N");
  cmd->add_option("--dtype", args->dtype, "bfloat16, float16 or float32")
      ->type_name("DTYPE")
      ->capture_default_str();
  cmd->add_option("--quant", args->quant,
                  "store the linear layers quantized as published checkpoints do: fp8 (block "
                  "e4m3 128x128, as DeepSeek-V3), int4-g32 / int4-g128 (compressed-tensors, routed "
                  "experts only, as Kimi-K2), gptq (4-bit g128), awq (gemm g128); default: float")
      ->type_name("FORMAT");
  cmd->add_option("--seed", args->seed, "weights seed; same seed, same bytes")
      ->type_name("N")
      ->capture_default_str();
  cmd->add_option("--shard-gb", args->shard_gb, "largest shard in GB (10^9 bytes)")
      ->type_name("GB")
      ->capture_default_str();
  cmd->add_option("--tokenizer", args->tokenizer,
                  "directory whose tokenizer.json and tokenizer_config.json are copied")
      ->type_name("DIR")
      ->capture_default_str();
  cmd->add_flag("--force", args->force, "write into a non-empty --out (removes its weights)");
  cmd->add_flag("--dry-run", args->dry_run,
                "print every tensor with its shape and bytes, and the totals; write nothing");
  cmd->callback([args, cmd, &exit_code] { exit_code = Run(*args, cmd->remaining()); });
}

}  // namespace fmoe::bench
