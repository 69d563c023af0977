#include "gpu_worker/experts/quantized.h"
#include "gpu_worker/experts/dequantize_cuda.h"

#include <new>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace fmoe {
namespace {

const at::Tensor* PartFor(QuantRole role, const at::Tensor& weight, const ProjectionParts& parts) {
  switch (role) {
    case QuantRole::kWeight:
      return &weight;
    case QuantRole::kScale:
      return &parts.scale;
    case QuantRole::kZero:
      return &parts.zero;
    case QuantRole::kGroupIndex:
      return &parts.g_idx;
  }
  return nullptr;
}

// The stored tensors against the format's list (shapes and dtypes).
Status CheckParts(const QuantSpec& spec, const at::Tensor& weight, const ProjectionParts& parts,
                  int64_t out, int64_t in) {
  for (const QuantTensorSpec& t : QuantTensorsOf(spec, out, in)) {
    const at::Tensor* p = PartFor(t.role, weight, parts);
    if (!p->defined()) {
      if (t.optional) continue;
      return InvalidArgument("dequantize: " + spec.Describe() + " [" + std::to_string(out) + ", " +
                             std::to_string(in) + "]: no " + t.suffix);
    }
    bool dtype_ok = false;
    for (DType d : t.dtypes) {
      Result<at::ScalarType> s = StoredTorchDType(d);
      dtype_ok = dtype_ok || (s.ok() && *s == p->scalar_type());
    }
    if (!dtype_ok || p->sizes() != at::IntArrayRef(t.shape)) {
      return InvalidArgument("dequantize: " + spec.Describe() + ": " + t.suffix + " is " +
                             std::string(c10::toString(p->scalar_type())) + " " +
                             ShapeString(p->sizes().vec()) + ", not " + ShapeString(t.shape));
    }
  }
  return Status::Ok();
}

// The FP8 e4m3fn bytes as float32, by their bits (no float8 dtype needed): sign, 4 exponent bits
// (bias 7), 3 mantissa bits; exponent 0 is subnormal (m x 2^-9); 0x7f / 0xff are NaN.
at::Tensor DecodeFp8(const at::Tensor& bytes) {
  at::Tensor b = bytes.to(at::kInt);
  at::Tensor e = at::bitwise_and(at::bitwise_right_shift(b, 3), 15);
  at::Tensor m = at::bitwise_and(b, 7).to(at::kFloat);
  at::Tensor normal = (m + 8.0) * at::exp2((e - 10).to(at::kFloat));
  at::Tensor value = at::where(e == 0, m * (1.0 / 512.0), normal);
  value = at::where(at::logical_and(e == 15, m == 7), at::full({}, NAN, value.options()), value);
  return at::where(at::bitwise_and(b, 128) != 0, -value, value);
}

// Eight 4-bit values per int32 along a new last dimension: nibble k at `shifts[k]` bits.
at::Tensor Nibbles(const at::Tensor& packed, const at::Tensor& shifts) {
  return at::bitwise_and(at::bitwise_right_shift(packed.unsqueeze(-1), shifts), 15);
}

at::Tensor Shifts(const at::Tensor& like, bool awq_order) {
  // AWQ packs columns [0, 2, 4, 6, 1, 3, 5, 7] into nibbles 0..7: column j sits in nibble
  // [0, 4, 1, 5, 2, 6, 3, 7][j].
  static const int32_t kPlain[8] = {0, 4, 8, 12, 16, 20, 24, 28};
  static const int32_t kAwq[8] = {0, 16, 4, 20, 8, 24, 12, 28};
  return at::from_blob(const_cast<int32_t*>(awq_order ? kAwq : kPlain), {8}, at::kInt)
      .to(like.device());
}

// Each input column's group: the stored g_idx, else column / group_size.
at::Tensor ColumnGroups(const QuantSpec& spec, const at::Tensor& g_idx, int64_t in,
                        const at::Tensor& like) {
  if (g_idx.defined()) return g_idx.to(at::kLong);
  return at::div(at::arange(in, at::TensorOptions().dtype(at::kLong).device(like.device())),
                 int64_t{spec.group_size}, "floor");
}

// MXFP4: byte k of a row holds elements 2k (low nibble) and 2k + 1 (high nibble), each an FP4
// e2m1 value (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6), times
// 2^(scale - 127) for its block of 32 (transformers' convert_moe_packed_tensors). Exact in
// float32.
at::Tensor Mxfp4(const at::Tensor& w, const at::Tensor& s, int64_t out, int64_t in) {
  static const float kValues[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const at::Tensor lut =
      at::from_blob(const_cast<float*>(kValues), {16}, at::kFloat).to(w.device());
  const at::Tensor b = w.to(at::kLong);
  const at::Tensor idx =
      at::stack({at::bitwise_and(b, 15), at::bitwise_right_shift(b, 4)}, -1).reshape({out, in});
  const at::Tensor exponent = (s.to(at::kInt) - 127).to(at::kFloat);
  const at::Tensor scale = at::exp2(exponent).repeat_interleave(32, 1);  // [out, in]
  return lut.index_select(0, idx.reshape({-1})).reshape({out, in}) * scale;
}

at::Tensor Fp8Block(const QuantSpec& spec, const at::Tensor& w, const at::Tensor& s, int64_t out,
                    int64_t in) {
  at::Tensor scale = s.to(at::kFloat)
                         .repeat_interleave(spec.block_out, 0)
                         .narrow(0, 0, out)
                         .repeat_interleave(spec.block_in, 1)
                         .narrow(1, 0, in);
  return DecodeFp8(w) * scale;
}

at::Tensor Int4Packed(const QuantSpec& spec, const at::Tensor& w, const ProjectionParts& p,
                      int64_t out, int64_t in) {
  const at::Tensor shifts = Shifts(w, false);
  at::Tensor q = (Nibbles(w, shifts).reshape({out, in}) - 8).to(at::kFloat);
  const at::Tensor groups = ColumnGroups(spec, p.g_idx, in, w);
  if (p.zero.defined()) {
    // Zero points packed along the rows: [ceil(out / 8), G] -> [ceil(out / 8) * 8, G].
    at::Tensor z = Nibbles(p.zero.transpose(0, 1), shifts)  // [G, ceil(out/8), 8]
                       .reshape({p.zero.size(1), -1})
                       .narrow(1, 0, out)
                       .transpose(0, 1);  // [out, G]
    q = q - (z - 8).to(at::kFloat).index_select(1, groups);
  }
  return q * p.scale.to(at::kFloat).index_select(1, groups);
}

// GPTQ and AWQ: [in, out] values, then transposed.
at::Tensor Int4Columns(const QuantSpec& spec, const at::Tensor& w, const ProjectionParts& p,
                       int64_t out, int64_t in) {
  const bool awq = spec.method == QuantMethod::kAwq;
  const at::Tensor shifts = Shifts(w, awq);
  at::Tensor q;
  if (awq) {
    q = Nibbles(w, shifts).reshape({in, out});  // [in, out/8, 8]
  } else {
    q = Nibbles(w.transpose(0, 1), shifts)  // [out, in/8, 8]
            .reshape({out, in})
            .transpose(0, 1);
  }
  at::Tensor z = Nibbles(p.zero, shifts).reshape({p.zero.size(0), out});
  if (spec.method == QuantMethod::kGptq && !spec.gptq_v2) z = z + 1;  // v1 stores zero - 1.
  const at::Tensor groups = ColumnGroups(spec, p.g_idx, in, w);
  at::Tensor values = (q - z.index_select(0, groups)).to(at::kFloat) *
                      p.scale.to(at::kFloat).index_select(0, groups);
  return values.transpose(0, 1).contiguous();
}

std::optional<DequantDType> KernelDType(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return DequantDType::kF32;
    case at::kBFloat16:
      return DequantDType::kBF16;
    case at::kHalf:
      return DequantDType::kF16;
    default:
      return std::nullopt;
  }
}

// On a CUDA device: the kernel (dequantize_cuda.h) writes the weight in one pass over the stored
// bytes. Null where it does not apply (another device, a build without it, a dtype it does not
// write); throws what LibTorch throws.
Result<at::Tensor> OnCuda(const QuantSpec& spec, const at::Tensor& weight, const ProjectionParts& p,
                          int64_t out, int64_t in, at::ScalarType dtype) {
  const std::optional<DequantDType> dst = KernelDType(dtype);
  const std::optional<DequantDType> scale = KernelDType(p.scale.scalar_type());
  if (!weight.is_cuda() || !CudaDequantizeCompiled() || !dst || !scale) return at::Tensor();
  for (const at::Tensor* t : {&weight, &p.scale, &p.zero, &p.g_idx}) {
    if (t->defined() &&
        (!t->is_cuda() || t->get_device() != weight.get_device() || !t->is_contiguous())) {
      return at::Tensor();
    }
  }
  at::Tensor w = at::empty({out, in}, weight.options().dtype(dtype));
  DequantArgs a;
  switch (spec.method) {
    case QuantMethod::kFp8Block:
      a.format = DequantFormat::kFp8Block;
      break;
    case QuantMethod::kFp8Channel:
      a.format = DequantFormat::kFp8Channel;
      break;
    case QuantMethod::kInt4Packed:
      a.format = DequantFormat::kInt4Packed;
      break;
    case QuantMethod::kGptq:
      a.format = DequantFormat::kGptq;
      break;
    case QuantMethod::kAwq:
      a.format = DequantFormat::kAwq;
      break;
    case QuantMethod::kNone:
    case QuantMethod::kMxfp4:  // No kernel yet: the LibTorch operations below, on the device.
      return at::Tensor();
  }
  a.block_out = spec.block_out;
  a.block_in = spec.block_in;
  a.group_size = spec.group_size;
  a.gptq_v2 = spec.gptq_v2;
  a.out = out;
  a.in = in;
  a.weight = weight.data_ptr();
  a.scale = p.scale.data_ptr();
  a.scale_dtype = *scale;
  a.scale_cols = p.scale.size(1);
  a.zero = p.zero.defined() ? static_cast<const int32_t*>(p.zero.data_ptr()) : nullptr;
  a.g_idx = p.g_idx.defined() ? static_cast<const int32_t*>(p.g_idx.data_ptr()) : nullptr;
  a.groups = spec.group_size > 0 ? (in + spec.group_size - 1) / spec.group_size : 0;
  a.dst = w.data_ptr();
  a.dst_dtype = *dst;
  FMOE_RETURN_IF_ERROR(CudaDequantize(a));
  return w;
}

}  // namespace

Result<at::ScalarType> StoredTorchDType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return at::kFloat;
    case DType::kF16:
      return at::kHalf;
    case DType::kBF16:
      return at::kBFloat16;
    case DType::kI32:
      return at::kInt;
    case DType::kI64:
      return at::kLong;
    case DType::kF8E4M3:
    case DType::kU8:
      return at::kByte;
    default:
      return InvalidArgument(std::string("dtype ") + DTypeName(dtype) +
                             " is not stored by a quantized format");
  }
}

std::pair<int64_t, int64_t> ProjectionShape(const QuantSpec& spec, const at::Tensor& weight) {
  if (weight.dim() != 2) return {0, 0};
  switch (spec.method) {
    case QuantMethod::kInt4Packed:
      return {weight.size(0), weight.size(1) * 8};
    case QuantMethod::kGptq:
      return {weight.size(1), weight.size(0) * 8};
    case QuantMethod::kAwq:
      return {weight.size(1) * 8, weight.size(0)};
    case QuantMethod::kMxfp4:
      return {weight.size(0), weight.size(1) * 2};
    default:
      return {weight.size(0), weight.size(1)};
  }
}

Status CheckProjection(const QuantSpec& spec, const at::Tensor& weight,
                       const ProjectionParts& parts) {
  if (!weight.defined() || weight.dim() != 2) {
    return InvalidArgument("dequantize: " + spec.Describe() + ": the weight is not a matrix");
  }
  const auto [out, in] = ProjectionShape(spec, weight);
  if (std::string why = QuantShapeError(spec, out, in); !why.empty()) {
    return InvalidArgument("dequantize: " + spec.Describe() + ": " + why);
  }
  return CheckParts(spec, weight, parts, out, in);
}

Result<at::Tensor> DequantizeProjection(const QuantSpec& spec, const at::Tensor& weight,
                                        const ProjectionParts& parts, at::ScalarType dtype) {
  FMOE_RETURN_IF_ERROR(CheckProjection(spec, weight, parts));
  const auto [out, in] = ProjectionShape(spec, weight);
  try {
    FMOE_ASSIGN_OR_RETURN(at::Tensor on_cuda, OnCuda(spec, weight, parts, out, in, dtype));
    if (on_cuda.defined()) return on_cuda;
    at::Tensor w;
    switch (spec.method) {
      case QuantMethod::kNone:
        return weight.to(dtype);
      case QuantMethod::kFp8Block:
        w = Fp8Block(spec, weight, parts.scale, out, in);
        break;
      case QuantMethod::kFp8Channel:
        w = DecodeFp8(weight) * parts.scale.to(at::kFloat);
        break;
      case QuantMethod::kInt4Packed:
        w = Int4Packed(spec, weight, parts, out, in);
        break;
      case QuantMethod::kGptq:
      case QuantMethod::kAwq:
        w = Int4Columns(spec, weight, parts, out, in);
        break;
      case QuantMethod::kMxfp4:
        w = Mxfp4(weight, parts.scale, out, in);
        break;
    }
    return w.to(dtype).contiguous();
  } catch (const c10::OutOfMemoryError& e) {
    return ResourceExhausted("dequantize: " + spec.Describe() + ": " + e.what_without_backtrace());
  } catch (const c10::Error& e) {
    return Internal("dequantize: " + spec.Describe() + ": " + e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("dequantize: " + spec.Describe() + ": out of host memory");
  }
}

Result<ExpertWeights> DequantizeExpert(const ExpertWeights& w, at::ScalarType dtype) {
  if (!w.quantized()) return w;
  ExpertWeights d;
  FMOE_ASSIGN_OR_RETURN(d.w1, DequantizeProjection(w.quant, w.w1, w.q[0], dtype));
  FMOE_ASSIGN_OR_RETURN(d.w2, DequantizeProjection(w.quant, w.w2, w.q[1], dtype));
  FMOE_ASSIGN_OR_RETURN(d.w3, DequantizeProjection(w.quant, w.w3, w.q[2], dtype));
  for (size_t i = 0; i < d.q.size(); ++i) d.q[i].bias = w.q[i].bias;  // Biases stay float.
  return d;
}

}  // namespace fmoe
