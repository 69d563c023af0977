#include "gpu_worker/model/tensor_loader.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <optional>
#include <utility>

#include "common/model/safetensors.h"
#include "gpu_worker/experts/quantized.h"

namespace fmoe {
namespace {

// LibTorch's dtype for a stored floating-point weight dtype; nullopt for the others.
std::optional<at::ScalarType> TorchDType(DType dtype) {
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) return std::nullopt;
  return *StoredTorchDType(dtype);
}

// Stored bytes copied (or converted) at a time, after which their mapped pages are released: the
// most of the mapping resident at once beyond what the loaded tensors hold.
constexpr uint64_t kChunkBytes = 16u << 20;

// Reads `view` (tensor `name` of `ckpt`) into `out` (its shape, the compute dtype, any device), a
// chunk at a time: each chunk is one copy, or one conversion, from the mapping, then its mapped
// pages are released. Throws what LibTorch throws.
Status ReadInto(const Checkpoint& ckpt, const std::string& name, const TensorView& view,
                at::ScalarType stored, at::Tensor& out) {
  const auto* data = view.data.data();
  const uint64_t size = DTypeSize(view.dtype);
  const int64_t numel = view.numel();
  const auto per_chunk = static_cast<int64_t>(kChunkBytes / size);
  // Offsets need not be aligned in a file that mixes dtypes: such data is copied out first.
  const bool aligned = reinterpret_cast<uintptr_t>(data) % size == 0;
  at::Tensor staging;
  at::Tensor flat = out.view({-1});
  for (int64_t i = 0; i < numel; i += per_chunk) {
    const int64_t n = std::min(per_chunk, numel - i);
    const uint64_t offset = static_cast<uint64_t>(i) * size;
    const uint64_t bytes = static_cast<uint64_t>(n) * size;
    at::Tensor src;
    if (aligned) {
      // A view over the read-only mapping: only ever read (copy_ reads its source).
      src = at::from_blob(const_cast<std::byte*>(data + offset), {n}, at::dtype(stored));
    } else {
      if (!staging.defined()) staging = at::empty({std::min(per_chunk, numel)}, at::dtype(stored));
      src = staging.narrow(0, 0, n);
      std::memcpy(src.data_ptr(), data + offset, bytes);
    }
    // On the host, one copy or one conversion. To another device, the same dtype is one copy
    // from the mapping; another is converted into a host buffer first (as to() does).
    flat.narrow(0, i, n).copy_(src);
    FMOE_RETURN_IF_ERROR(ckpt.ReleasePages(name, offset, bytes));
  }
  return Status::Ok();
}

}  // namespace

TensorLoader::TensorLoader(const Checkpoint& ckpt, at::ScalarType dtype, at::Device device,
                           const LoadProgress& progress)
    : ckpt_(ckpt), dtype_(dtype), device_(device), progress_(progress) {
  total_ = ckpt.total_bytes();
}

Result<at::Tensor> TensorLoader::Load(const std::string& name, const std::vector<int64_t>& shape,
                                      at::Device device) {
  if (shape.size() == 2 && StoredQuantized(name)) return LoadDequantized(name, shape, device);
  FMOE_ASSIGN_OR_RETURN(const TensorView* view, ckpt_.Get(name, shape));
  const std::string where = Where(name);
  const std::optional<at::ScalarType> stored = TorchDType(view->dtype);
  if (!stored) {
    return InvalidArgument(where + ": dtype " + DTypeName(view->dtype) +
                           " is not a floating-point weight type (F32, F16, BF16)");
  }
  return Read(name, *view, *stored, at::TensorOptions().dtype(dtype_).device(device));
}

Result<at::Tensor> TensorLoader::Read(const std::string& name, const TensorView& view,
                                      at::ScalarType stored, const at::TensorOptions& options) {
  at::Tensor out;
  if (sink_ != nullptr) {
    if (options.dtype() != stored) {
      return InvalidArgument(Where(name) + ": stored as " + std::string(c10::toString(stored)) +
                             " and computed in " +
                             std::string(c10::toString(options.dtype().toScalarType())) +
                             ": experts read from disk by the host tier (host_cache_gb) are "
                             "used as stored; set dtype to the stored one or leave "
                             "host_cache_gb unset");
    }
    FMOE_ASSIGN_OR_RETURN(const Checkpoint::Location where, ckpt_.Locate(name));
    out = at::empty(view.shape, at::TensorOptions().dtype(stored).device(at::kMeta));
    sink_->emplace(out.unsafeGetTensorImpl(),
                   DiskExtent{where.path, name, where.offset, where.bytes});
    total_ -= std::min<uint64_t>(total_, view.data.size());
    if (progress_) progress_(done_, total_);
    return out;
  }
  try {
    out = at::empty(view.shape, options);
    FMOE_RETURN_IF_ERROR(ReadInto(ckpt_, name, view, stored, out));
  } catch (const c10::OutOfMemoryError& e) {
    return ResourceExhausted(Where(name) + ": " + e.what_without_backtrace());
  } catch (const c10::Error& e) {
    return Internal(Where(name) + ": " + e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    return ResourceExhausted(Where(name) + ": out of host memory");
  }
  done_ += view.data.size();
  if (progress_) progress_(done_, total_);
  return out;
}

std::string TensorLoader::Where(const std::string& name) const {
  return "model: " + ckpt_.FileOf(name) + ": tensor \"" + name + "\"";
}

Status TensorLoader::Skip(const std::string& name, const std::vector<int64_t>& shape) {
  FMOE_ASSIGN_OR_RETURN(const TensorView* view, ckpt_.Get(name, shape));
  done_ += view->data.size();
  if (progress_) progress_(done_, total_);
  return Status::Ok();
}

namespace {}  // namespace

std::string LinearPrefix(const std::string& name) {
  constexpr std::string_view kWeight = "weight";
  if (name.size() < kWeight.size() ||
      name.compare(name.size() - kWeight.size(), kWeight.size(), kWeight) != 0) {
    return "";
  }
  return name.substr(0, name.size() - kWeight.size());
}

bool TensorLoader::StoredQuantized(const std::string& name) const {
  if (!quant_.quantized()) return false;
  if (const TensorView* v = ckpt_.Find(name)) return v->dtype == DType::kF8E4M3;
  const std::string prefix = LinearPrefix(name);
  return !prefix.empty() && (ckpt_.Find(prefix + "weight_packed") != nullptr ||
                             ckpt_.Find(prefix + "qweight") != nullptr);
}

Result<at::Tensor> TensorLoader::LoadStored(const std::string& name, const QuantTensorSpec& spec) {
  const TensorView* view = ckpt_.Find(name);
  if (view == nullptr) {
    if (spec.optional) return at::Tensor();
    return NotFound("model: " + ckpt_.dir() + ": tensor \"" + name + "\" is missing (" +
                    quant_.Describe() + " stores it)");
  }
  const std::string where = Where(name);
  bool dtype_ok = false;
  std::string dtypes;
  for (DType d : spec.dtypes) {
    dtype_ok = dtype_ok || d == view->dtype;
    dtypes += (dtypes.empty() ? "" : " or ") + std::string(DTypeName(d));
  }
  if (!dtype_ok) {
    return InvalidArgument(where + ": dtype " + DTypeName(view->dtype) + ", expected " + dtypes +
                           " (" + quant_.Describe() + ")");
  }
  if (view->shape != spec.shape) {
    return InvalidArgument(where + ": shape " + ShapeString(view->shape) + ", expected " +
                           ShapeString(spec.shape) + " (" + quant_.Describe() + ")");
  }
  FMOE_ASSIGN_OR_RETURN(const at::ScalarType stored, StoredTorchDType(view->dtype));
  return Read(name, *view, stored, at::TensorOptions().dtype(stored));
}

Result<at::Tensor> TensorLoader::LoadRaw(const std::string& name, DType dtype,
                                         const std::vector<int64_t>& shape) {
  return LoadStored(name, QuantTensorSpec{QuantRole::kWeight, "", shape, {dtype}});
}

Status TensorLoader::LoadQuantized(const std::string& prefix, int64_t out, int64_t in,
                                   at::Tensor* weight, ProjectionParts* parts) {
  if (std::string why = QuantShapeError(quant_, out, in); !why.empty()) {
    return InvalidArgument("model: " + ckpt_.dir() + ": \"" + prefix + "\": " + why);
  }
  *weight = at::Tensor();
  *parts = ProjectionParts{};
  for (const QuantTensorSpec& spec : QuantTensorsOf(quant_, out, in)) {
    FMOE_ASSIGN_OR_RETURN(at::Tensor t, LoadStored(prefix + spec.suffix, spec));
    switch (spec.role) {
      case QuantRole::kWeight:
        *weight = std::move(t);
        break;
      case QuantRole::kScale:
        parts->scale = std::move(t);
        break;
      case QuantRole::kZero:
        parts->zero = std::move(t);
        break;
      case QuantRole::kGroupIndex:
        if (t.defined()) {
          // Each column's group indexes the scales: one out of range would read past them. Left
          // on disk, they are read here once to be checked.
          at::Tensor values = t;
          if (t.is_meta()) {
            DiskSink* sink = std::exchange(sink_, nullptr);
            Result<at::Tensor> read = LoadStored(prefix + spec.suffix, spec);
            sink_ = sink;
            FMOE_ASSIGN_OR_RETURN(values, std::move(read));
          }
          const int64_t groups = (in + quant_.group_size - 1) / quant_.group_size;
          const int64_t lo = values.min().item<int64_t>(), hi = values.max().item<int64_t>();
          if (lo < 0 || hi >= groups) {
            return InvalidArgument("model: " + ckpt_.FileOf(prefix + spec.suffix) + ": tensor \"" +
                                   prefix + spec.suffix + "\": group " +
                                   std::to_string(lo < 0 ? lo : hi) + " is outside 0.." +
                                   std::to_string(groups - 1));
          }
        }
        parts->g_idx = std::move(t);
        break;
    }
  }
  // compressed-tensors records each packed weight's shape beside it.
  if (const TensorView* shape = ckpt_.Find(prefix + "weight_shape");
      shape != nullptr && quant_.method == QuantMethod::kInt4Packed) {
    std::vector<int64_t> values;
    if (shape->numel() == 2 && (shape->dtype == DType::kI64 || shape->dtype == DType::kI32)) {
      for (int64_t i = 0; i < 2; ++i) {
        if (shape->dtype == DType::kI64) {
          int64_t v;
          std::memcpy(&v, shape->data.data() + 8 * i, 8);
          values.push_back(v);
        } else {
          int32_t v;
          std::memcpy(&v, shape->data.data() + 4 * i, 4);
          values.push_back(v);
        }
      }
    }
    if (values != std::vector<int64_t>{out, in}) {
      return InvalidArgument("model: " + ckpt_.FileOf(prefix + "weight_shape") + ": tensor \"" +
                             prefix + "weight_shape\" does not hold [" + std::to_string(out) +
                             ", " + std::to_string(in) + "]");
    }
    done_ += shape->data.size();
  }
  return Status::Ok();
}

Status TensorLoader::SkipQuantized(const std::string& prefix, int64_t out, int64_t in) {
  for (const QuantTensorSpec& spec : QuantTensorsOf(quant_, out, in)) {
    if (spec.optional && ckpt_.Find(prefix + spec.suffix) == nullptr) continue;
    FMOE_ASSIGN_OR_RETURN(const TensorView* view, ckpt_.Get(prefix + spec.suffix, spec.shape));
    done_ += view->data.size();
  }
  if (const TensorView* shape = ckpt_.Find(prefix + "weight_shape")) done_ += shape->data.size();
  if (progress_) progress_(done_, total_);
  return Status::Ok();
}

Result<at::Tensor> TensorLoader::LoadDequantized(const std::string& name,
                                                 const std::vector<int64_t>& shape,
                                                 at::Device device) {
  at::Tensor weight;
  ProjectionParts parts;
  const std::string prefix = LinearPrefix(name);
  FMOE_RETURN_IF_ERROR(LoadQuantized(prefix, shape[0], shape[1], &weight, &parts));
  Result<at::Tensor> w = DequantizeProjection(quant_, weight, parts, dtype_);
  if (!w.ok()) return w.status().WithContext("model: tensor \"" + name + "\"");
  try {
    return w->to(device);
  } catch (const c10::OutOfMemoryError& e) {
    return ResourceExhausted("model: tensor \"" + name + "\": " + e.what_without_backtrace());
  } catch (const c10::Error& e) {
    return Internal("model: tensor \"" + name + "\": " + e.what_without_backtrace());
  }
}

}  // namespace fmoe
