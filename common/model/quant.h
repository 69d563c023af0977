// Quantized checkpoints (DESIGN section 12): the formats config.json's quantization_config names,
// the tensors each stores per linear layer, their bytes, and the decoding of an FP8 e4m3 byte.
// Routed experts keep these native tensors everywhere (host store, link, device cache); the
// worker's dequantization lives in gpu_worker/experts/quantized.h. Torch-free; any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/json.h"
#include "common/model/safetensors.h"
#include "common/status.h"

namespace fmoe {

enum class QuantMethod : uint8_t {
  kNone,        // Float weights (F32, F16, BF16).
  kFp8Block,    // quant_method fp8, e4m3, weight_block_size [bo, bi] (DeepSeek-V3, Qwen3-FP8).
  kFp8Channel,  // compressed-tensors float 8 bits, strategy channel (llm-compressor FP8_DYNAMIC).
  kInt4Packed,  // compressed-tensors pack-quantized int 4 bits, strategy group (Kimi-K2 INT4).
  kGptq,        // GPTQ 4 bits (AutoGPTQ / GPTQModel layout).
  kAwq,         // AWQ 4 bits, version gemm.
  // quant_method mxfp4 (gpt-oss): FP4 e2m1 values, two a byte (the low nibble first), in blocks
  // of 32 along the input sharing one e8m0 scale byte (2^(s - 127)).
  kMxfp4,
};

struct QuantSpec {
  QuantMethod method = QuantMethod::kNone;
  uint32_t block_out = 0, block_in = 0;  // kFp8Block: a scale per block of rows x columns.
  uint32_t group_size = 0;               // 4-bit formats: input columns per scale.
  bool symmetric = true;                 // 4-bit formats: false = zero points stored.
  bool act_order = false;                // kInt4Packed / kGptq: columns' groups stored (g_idx).
  bool gptq_v2 = false;                  // kGptq: zero points stored as is (v1: stored - 1).

  bool quantized() const { return method != QuantMethod::kNone; }
  // e.g. "fp8 e4m3 block 128x128", "int4 compressed-tensors g32 symmetric", "gptq int4 g128".
  std::string Describe() const;
  bool operator==(const QuantSpec&) const = default;
};

// What one stored tensor of a quantized projection is.
enum class QuantRole : uint8_t { kWeight, kScale, kZero, kGroupIndex };

struct QuantTensorSpec {
  QuantRole role;
  std::string suffix;  // Appended to the projection's prefix ("...experts.3.gate_proj.").
  std::vector<int64_t> shape;
  std::vector<DType> dtypes;  // Accepted stored dtypes (the first is the format's usual one).
  bool optional = false;      // GPTQ's g_idx without desc_act: used when present.
};

// The stored tensors of one quantized [out, in] projection, in the order the worker packs them.
// Empty for kNone. `in` must be a multiple of 8 for the 4-bit formats and `out` too for AWQ and
// GPTQ (checked by QuantShapeError).
std::vector<QuantTensorSpec> QuantTensorsOf(const QuantSpec& spec, int64_t out, int64_t in);

// Why an [out, in] projection cannot be stored in the format ("" when it can): the 4-bit formats
// pack 8 values per int32 along one dimension, whose size must be a multiple of 8 (and of the
// group size along `in` for AWQ and GPTQ without act order).
std::string QuantShapeError(const QuantSpec& spec, int64_t out, int64_t in);

// Bytes of one [out, in] projection as stored (the required tensors, plus g_idx where the format
// always carries it); for kNone, bf16's 2 bytes per weight.
uint64_t QuantProjectionBytes(const QuantSpec& spec, int64_t out, int64_t in);

// Reads config.json's quantization_config (`j` is its value). kInvalidArgument naming the field
// and value for anything not listed in QuantMethod: another bit width, scheme, strategy, packing
// format, an activation scheme the weights do not carry, or several config groups.
Status ParseQuantizationConfig(const nlohmann::json& j, QuantSpec* out);

// The float value of an FP8 e4m3fn byte (no infinities; 0x7f and 0xff are NaN).
float Fp8E4m3ToFloat(uint8_t bits);

}  // namespace fmoe
