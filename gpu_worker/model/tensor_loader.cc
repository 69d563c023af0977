#include "gpu_worker/model/tensor_loader.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <optional>

#include "common/model/safetensors.h"

namespace fmoe {
namespace {

// LibTorch's dtype for a stored floating-point weight dtype; nullopt for the others.
std::optional<at::ScalarType> TorchDType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return at::kFloat;
    case DType::kF16:
      return at::kHalf;
    case DType::kBF16:
      return at::kBFloat16;
    default:
      return std::nullopt;
  }
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
  FMOE_ASSIGN_OR_RETURN(const TensorView* view, ckpt_.Get(name, shape));
  const std::string where = "model: " + ckpt_.FileOf(name) + ": tensor \"" + name + "\"";
  const std::optional<at::ScalarType> stored = TorchDType(view->dtype);
  if (!stored) {
    return InvalidArgument(where + ": dtype " + DTypeName(view->dtype) +
                           " is not a floating-point weight type (F32, F16, BF16)");
  }
  at::Tensor out;
  try {
    out = at::empty(view->shape, at::TensorOptions().dtype(dtype_).device(device));
    FMOE_RETURN_IF_ERROR(ReadInto(ckpt_, name, *view, *stored, out));
  } catch (const c10::OutOfMemoryError& e) {
    return ResourceExhausted(where + ": " + e.what_without_backtrace());
  } catch (const c10::Error& e) {
    return Internal(where + ": " + e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    return ResourceExhausted(where + ": out of host memory");
  }
  done_ += view->data.size();
  if (progress_) progress_(done_, total_);
  return out;
}

Status TensorLoader::Skip(const std::string& name, const std::vector<int64_t>& shape) {
  FMOE_ASSIGN_OR_RETURN(const TensorView* view, ckpt_.Get(name, shape));
  done_ += view->data.size();
  if (progress_) progress_(done_, total_);
  return Status::Ok();
}

}  // namespace fmoe
