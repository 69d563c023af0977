#include "gpu_worker/tensor_loader.h"

#include <ATen/ATen.h>

#include <span>

#include "common/safetensors.h"

namespace fmoe {

TensorLoader::TensorLoader(const Checkpoint& ckpt, at::ScalarType dtype, at::Device device,
                           const LoadProgress& progress)
    : ckpt_(ckpt), dtype_(dtype), device_(device), progress_(progress) {
  total_ = ckpt.total_bytes();
}

Result<at::Tensor> TensorLoader::Load(const std::string& name, const std::vector<int64_t>& shape,
                                      at::Device device) {
  FMOE_ASSIGN_OR_RETURN(const TensorView* view, ckpt_.Get(name, shape));
  if (view->dtype != DType::kF32 && view->dtype != DType::kF16 && view->dtype != DType::kBF16) {
    return InvalidArgument("model: " + ckpt_.FileOf(name) + ": tensor \"" + name + "\": dtype " +
                           DTypeName(view->dtype) +
                           " is not a floating-point weight type (F32, F16, BF16)");
  }
  at::Tensor f32 = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  FMOE_RETURN_IF_ERROR(
      ConvertToF32(view->dtype, view->data,
                   std::span<float>(f32.data_ptr<float>(), static_cast<size_t>(f32.numel()))));
  done_ += view->data.size();
  if (progress_) progress_(done_, total_);
  return f32.to(device, dtype_);
}

Status TensorLoader::Skip(const std::string& name, const std::vector<int64_t>& shape) {
  FMOE_ASSIGN_OR_RETURN(const TensorView* view, ckpt_.Get(name, shape));
  done_ += view->data.size();
  if (progress_) progress_(done_, total_);
  return Status::Ok();
}

}  // namespace fmoe
