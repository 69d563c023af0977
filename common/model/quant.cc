#include "common/model/quant.h"

#include <cctype>
#include <cmath>
#include <cstring>

namespace fmoe {
namespace {

using Json = nlohmann::json;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// j[key], or null when absent (a const json's operator[] must not be given a missing key).
Json At(const Json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() ? Json(nullptr) : *it;
}

Status Refuse(const std::string& field, const Json& value, const std::string& why) {
  return InvalidArgument(
      (field.empty() ? std::string("quantization_config") : "quantization_config." + field) + ": " +
      value.dump() + " " + why);
}

// A string field; absent or null gives `fallback`.
Result<std::string> StringField(const Json& j, const std::string& where, const char* key,
                                const std::string& fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_string()) return Refuse(where + key, *it, "is not a string");
  return it->get<std::string>();
}

Result<bool> BoolField(const Json& j, const std::string& where, const char* key, bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return Refuse(where + key, *it, "is not a boolean");
  return it->get<bool>();
}

// An integer field; absent or null gives `fallback`.
Result<int64_t> IntField(const Json& j, const std::string& where, const char* key,
                         int64_t fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number_integer()) return Refuse(where + key, *it, "is not an integer");
  return it->get<int64_t>();
}

Result<uint32_t> GroupSize(const Json& j, const std::string& where, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Refuse(where + key, Json(nullptr), "is required");
  FMOE_ASSIGN_OR_RETURN(const int64_t g, IntField(j, where, key, 0));
  if (g == -1) {
    return Refuse(where + key, *it,
                  "(one group per row) is not implemented; group sizes 1..65536 are");
  }
  if (g < 1 || g > 65536) return Refuse(where + key, *it, "is not a group size in 1..65536");
  return static_cast<uint32_t>(g);
}

Status ParseFp8(const Json& j, QuantSpec* out) {
  FMOE_ASSIGN_OR_RETURN(const std::string fmt, StringField(j, "", "fmt", "e4m3"));
  if (fmt != "e4m3") return Refuse("fmt", At(j, "fmt"), "is not implemented (only \"e4m3\" is)");
  FMOE_ASSIGN_OR_RETURN(const std::string act, StringField(j, "", "activation_scheme", "dynamic"));
  if (act != "dynamic") {
    return Refuse("activation_scheme", At(j, "activation_scheme"),
                  "is not implemented (only \"dynamic\": the weights carry no activation scales)");
  }
  auto b = j.find("weight_block_size");
  if (b == j.end() || b->is_null()) {
    return Refuse("weight_block_size", Json(nullptr),
                  "is required: per-tensor FP8 is not implemented, block-wise FP8 is");
  }
  if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number_integer() ||
      !(*b)[1].is_number_integer() || (*b)[0].get<int64_t>() < 1 || (*b)[1].get<int64_t>() < 1 ||
      (*b)[0].get<int64_t>() > 65536 || (*b)[1].get<int64_t>() > 65536) {
    return Refuse("weight_block_size", *b, "is not two block sizes in 1..65536");
  }
  out->method = QuantMethod::kFp8Block;
  out->block_out = (*b)[0].get<uint32_t>();
  out->block_in = (*b)[1].get<uint32_t>();
  return Status::Ok();
}

Status ParseCompressedTensors(const Json& j, QuantSpec* out) {
  FMOE_ASSIGN_OR_RETURN(const std::string format, StringField(j, "", "format", ""));
  FMOE_ASSIGN_OR_RETURN(const std::string status,
                        StringField(j, "", "quantization_status", "compressed"));
  if (status != "compressed") {
    return Refuse("quantization_status", At(j, "quantization_status"),
                  "is not implemented (only \"compressed\" checkpoints are)");
  }
  if (auto kv = j.find("kv_cache_scheme"); kv != j.end() && !kv->is_null()) {
    return Refuse("kv_cache_scheme", *kv, "is not implemented (a quantized KV cache)");
  }
  if (auto sp = j.find("sparsity_config");
      sp != j.end() && !sp->is_null() && !(sp->is_object() && sp->empty())) {
    return Refuse("sparsity_config", *sp, "is not implemented (sparse weights)");
  }
  auto groups = j.find("config_groups");
  if (groups == j.end() || !groups->is_object() || groups->size() != 1) {
    return Refuse("config_groups", groups == j.end() ? Json(nullptr) : *groups,
                  "is not one config group (one scheme for every quantized layer is implemented)");
  }
  const std::string where = "config_groups." + groups->begin().key() + ".";
  const Json& group = groups->begin().value();
  if (!group.is_object()) return Refuse(where, group, "is not an object");
  for (const char* key : {"output_activations"}) {
    if (auto it = group.find(key); it != group.end() && !it->is_null()) {
      return Refuse(where + key, *it, "is not implemented (quantized outputs)");
    }
  }
  if (auto in = group.find("input_activations"); in != group.end() && !in->is_null()) {
    // Activations quantized on the fly (FP8_DYNAMIC): the weights alone are stored; the runtime
    // computes with the dequantized weights (weight-only).
    FMOE_ASSIGN_OR_RETURN(const bool dynamic,
                          BoolField(*in, where + "input_activations.", "dynamic", false));
    if (!in->is_object() || !dynamic) {
      return Refuse(where + "input_activations", *in,
                    "is not implemented (static activation scales; dynamic ones are)");
    }
  }
  auto w = group.find("weights");
  if (w == group.end() || !w->is_object()) {
    return Refuse(where + "weights", w == group.end() ? Json(nullptr) : *w, "is not an object");
  }
  const std::string ww = where + "weights.";
  FMOE_ASSIGN_OR_RETURN(const std::string type, StringField(*w, ww, "type", ""));
  FMOE_ASSIGN_OR_RETURN(const int64_t bits, IntField(*w, ww, "num_bits", 0));
  FMOE_ASSIGN_OR_RETURN(const std::string strategy, StringField(*w, ww, "strategy", ""));
  FMOE_ASSIGN_OR_RETURN(const bool symmetric, BoolField(*w, ww, "symmetric", true));
  FMOE_ASSIGN_OR_RETURN(const bool dynamic, BoolField(*w, ww, "dynamic", false));
  if (dynamic) return Refuse(ww + "dynamic", At(*w, "dynamic"), "is not implemented");
  if (type == "float") {
    if (bits != 8) return Refuse(ww + "num_bits", At(*w, "num_bits"), "is not implemented (8 is)");
    if (strategy != "channel") {
      return Refuse(ww + "strategy", At(*w, "strategy"),
                    "is not implemented for float weights (\"channel\" is)");
    }
    if (!symmetric) return Refuse(ww + "symmetric", At(*w, "symmetric"), "is not implemented");
    if (format != "float-quantized" && format != "naive-quantized") {
      return Refuse("format", At(j, "format"),
                    "is not implemented for FP8 weights (\"float-quantized\" is)");
    }
    out->method = QuantMethod::kFp8Channel;
    return Status::Ok();
  }
  if (type != "int") {
    return Refuse(ww + "type", At(*w, "type"), "is not implemented (\"int\" and \"float\" are)");
  }
  if (bits != 4) return Refuse(ww + "num_bits", At(*w, "num_bits"), "is not implemented (4 is)");
  if (strategy != "group") {
    return Refuse(ww + "strategy", At(*w, "strategy"),
                  "is not implemented for int4 weights (\"group\" is)");
  }
  if (format != "pack-quantized") {
    return Refuse("format", At(j, "format"),
                  "is not implemented for int4 weights (\"pack-quantized\" is)");
  }
  FMOE_ASSIGN_OR_RETURN(out->group_size, GroupSize(*w, ww, "group_size"));
  bool act_order = false;
  if (auto a = w->find("actorder"); a != w->end() && !a->is_null()) {
    if (a->is_boolean()) {
      act_order = a->get<bool>();
    } else if (a->is_string() && (*a == "group" || *a == "weight")) {
      // "group" stores each column's group (weight_g_idx); "weight" only reordered the
      // quantization and stores groups in column order.
      act_order = *a == "group";
    } else {
      return Refuse(ww + "actorder", *a, "is not one of null, \"group\", \"weight\"");
    }
  }
  out->method = QuantMethod::kInt4Packed;
  out->symmetric = symmetric;
  out->act_order = act_order;
  return Status::Ok();
}

Status ParseGptq(const Json& j, QuantSpec* out) {
  FMOE_ASSIGN_OR_RETURN(const int64_t bits, IntField(j, "", "bits", 0));
  if (bits != 4) {
    return Refuse("bits", At(j, "bits"), "is not implemented (4 is)");
  }
  FMOE_ASSIGN_OR_RETURN(out->group_size, GroupSize(j, "", "group_size"));
  FMOE_ASSIGN_OR_RETURN(out->act_order, BoolField(j, "", "desc_act", false));
  FMOE_ASSIGN_OR_RETURN(out->symmetric, BoolField(j, "", "sym", true));
  FMOE_ASSIGN_OR_RETURN(const std::string fmt, StringField(j, "", "checkpoint_format", "gptq"));
  if (fmt != "gptq" && fmt != "gptq_v2") {
    return Refuse("checkpoint_format", At(j, "checkpoint_format"),
                  "is not implemented (\"gptq\" and \"gptq_v2\" are)");
  }
  out->gptq_v2 = fmt == "gptq_v2";
  out->method = QuantMethod::kGptq;
  return Status::Ok();
}

Status ParseAwq(const Json& j, QuantSpec* out) {
  const char* bits_key = j.contains("bits") ? "bits" : "w_bit";
  FMOE_ASSIGN_OR_RETURN(const int64_t bits, IntField(j, "", bits_key, 0));
  if (bits != 4) {
    return Refuse(bits_key, At(j, bits_key), "is not implemented (4 is)");
  }
  FMOE_ASSIGN_OR_RETURN(out->group_size,
                        GroupSize(j, "", j.contains("group_size") ? "group_size" : "q_group_size"));
  FMOE_ASSIGN_OR_RETURN(const bool zero_point, BoolField(j, "", "zero_point", true));
  if (!zero_point) return Refuse("zero_point", At(j, "zero_point"), "is not implemented (true is)");
  FMOE_ASSIGN_OR_RETURN(std::string version, StringField(j, "", "version", "gemm"));
  for (char& c : version) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (version != "gemm") {
    return Refuse("version", At(j, "version"), "is not implemented (\"gemm\" is)");
  }
  out->method = QuantMethod::kAwq;
  out->symmetric = false;
  return Status::Ok();
}

// gpt-oss's {"quant_method": "mxfp4", "modules_to_not_convert": [...]}: the modules listed stay in
// float (the checkpoint's tensors say which are stored quantized); any other key is refused.
Status ParseMxfp4(const Json& j, QuantSpec* out) {
  for (const auto& [key, value] : j.items()) {
    if (key == "quant_method") continue;
    if (key == "modules_to_not_convert") {
      if (!value.is_null() && !value.is_array()) {
        return Refuse(key, value, "is not a list of module names");
      }
      continue;
    }
    return Refuse(key, value, "is not implemented for mxfp4");
  }
  out->method = QuantMethod::kMxfp4;
  out->group_size = 32;
  return Status::Ok();
}

}  // namespace

std::string QuantSpec::Describe() const {
  std::string g = "g";
  g.append(std::to_string(group_size));
  switch (method) {
    case QuantMethod::kNone:
      return "float";
    case QuantMethod::kFp8Block:
      return std::string("fp8 e4m3 block ")
          .append(std::to_string(block_out))
          .append("x")
          .append(std::to_string(block_in));
    case QuantMethod::kFp8Channel:
      return "fp8 e4m3 per channel (compressed-tensors)";
    case QuantMethod::kInt4Packed:
      return "int4 " + g + (symmetric ? " symmetric" : " asymmetric") +
             (act_order ? " act-order" : "") + " (compressed-tensors pack-quantized)";
    case QuantMethod::kGptq:
      return "gptq int4 " + g + (symmetric ? " sym" : " asym") + (act_order ? " desc_act" : "") +
             (gptq_v2 ? " v2" : "");
    case QuantMethod::kAwq:
      return "awq int4 " + g + " gemm";
    case QuantMethod::kMxfp4:
      return "mxfp4 e2m1 g32 (e8m0 scales)";
  }
  return "?";
}

std::vector<QuantTensorSpec> QuantTensorsOf(const QuantSpec& spec, int64_t out, int64_t in) {
  using R = QuantRole;
  const std::vector<DType> scales = {DType::kBF16, DType::kF16, DType::kF32};
  const std::vector<DType> fp16_scales = {DType::kF16, DType::kBF16, DType::kF32};
  const int64_t groups = spec.group_size > 0 ? CeilDiv(in, spec.group_size) : 0;
  switch (spec.method) {
    case QuantMethod::kNone:
      return {};
    case QuantMethod::kFp8Block:
      return {{R::kWeight, "weight", {out, in}, {DType::kF8E4M3}},
              {R::kScale,
               "weight_scale_inv",
               {CeilDiv(out, spec.block_out), CeilDiv(in, spec.block_in)},
               {DType::kF32, DType::kBF16}}};
    case QuantMethod::kFp8Channel:
      return {{R::kWeight, "weight", {out, in}, {DType::kF8E4M3}},
              {R::kScale, "weight_scale", {out, 1}, scales}};
    case QuantMethod::kInt4Packed: {
      std::vector<QuantTensorSpec> t = {{R::kWeight, "weight_packed", {out, in / 8}, {DType::kI32}},
                                        {R::kScale, "weight_scale", {out, groups}, scales}};
      if (!spec.symmetric) {
        t.push_back({R::kZero, "weight_zero_point", {CeilDiv(out, 8), groups}, {DType::kI32}});
      }
      if (spec.act_order) t.push_back({R::kGroupIndex, "weight_g_idx", {in}, {DType::kI32}});
      return t;
    }
    case QuantMethod::kGptq:
      return {{R::kWeight, "qweight", {in / 8, out}, {DType::kI32}},
              {R::kZero, "qzeros", {groups, out / 8}, {DType::kI32}},
              {R::kScale, "scales", {groups, out}, fp16_scales},
              {R::kGroupIndex, "g_idx", {in}, {DType::kI32}, /*optional=*/!spec.act_order}};
    case QuantMethod::kAwq:
      return {{R::kWeight, "qweight", {in, out / 8}, {DType::kI32}},
              {R::kZero, "qzeros", {groups, out / 8}, {DType::kI32}},
              {R::kScale, "scales", {groups, out}, fp16_scales}};
    case QuantMethod::kMxfp4:
      // One expert's rows of gpt-oss's fused "<name>_blocks" [J, out, in/32, 16] and
      // "<name>_scales" [J, out, in/32] (the blocks of a row kept as one row of bytes).
      return {{R::kWeight, "blocks", {out, in / 2}, {DType::kU8}},
              {R::kScale, "scales", {out, in / 32}, {DType::kU8}}};
  }
  return {};
}

std::string QuantShapeError(const QuantSpec& spec, int64_t out, int64_t in) {
  std::string shape = "[";
  shape.append(std::to_string(out)).append(", ").append(std::to_string(in)).append("]");
  switch (spec.method) {
    case QuantMethod::kNone:
    case QuantMethod::kFp8Block:
    case QuantMethod::kFp8Channel:
      return "";
    case QuantMethod::kInt4Packed:
      if (in % 8 != 0) return shape + ": input size is not a multiple of 8 (int4 packing)";
      return "";
    case QuantMethod::kMxfp4:
      if (in % 32 != 0) return shape + ": input size is not a multiple of 32 (mxfp4 blocks)";
      return "";
    case QuantMethod::kGptq:
    case QuantMethod::kAwq:
      if (in % 8 != 0 || out % 8 != 0) {
        return shape + ": sizes are not multiples of 8 (int4 packing)";
      }
      if (spec.method == QuantMethod::kAwq && in % spec.group_size != 0) {
        return shape + ": input size is not a multiple of the group size " +
               std::to_string(spec.group_size);
      }
      return "";
  }
  return "";
}

uint64_t QuantProjectionBytes(const QuantSpec& spec, int64_t out, int64_t in) {
  if (!spec.quantized()) return static_cast<uint64_t>(out) * static_cast<uint64_t>(in) * 2;
  uint64_t total = 0;
  for (const QuantTensorSpec& t : QuantTensorsOf(spec, out, in)) {
    uint64_t n = DTypeSize(t.dtypes.front());
    for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
    total += n;
  }
  return total;
}

Status ParseQuantizationConfig(const Json& j, QuantSpec* out) {
  *out = QuantSpec{};
  if (!j.is_object()) return Refuse("", j, "is not an object");
  auto m = j.find("quant_method");
  if (m == j.end() || !m->is_string()) {
    return Refuse("quant_method", m == j.end() ? Json(nullptr) : *m, "is not a string");
  }
  const std::string method = m->get<std::string>();
  if (method == "fp8") return ParseFp8(j, out);
  if (method == "compressed-tensors") return ParseCompressedTensors(j, out);
  if (method == "gptq") return ParseGptq(j, out);
  if (method == "awq") return ParseAwq(j, out);
  if (method == "mxfp4") return ParseMxfp4(j, out);
  return Refuse("quant_method", *m,
                "is not implemented (fp8, compressed-tensors, gptq, awq and mxfp4 are; or use "
                "a bfloat16 or float32 checkpoint)");
}

float Fp8E4m3ToFloat(uint8_t bits) {
  const bool negative = (bits & 0x80u) != 0;
  const int exponent = (bits >> 3) & 0xf;
  const int mantissa = bits & 0x7;
  float value;
  if (exponent == 0xf && mantissa == 0x7) {
    value = std::nanf("");
  } else if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -9);  // Subnormal: m/8 * 2^-6.
  } else {
    value = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);  // (1 + m/8) * 2^(e-7).
  }
  return negative ? -value : value;
}

}  // namespace fmoe
