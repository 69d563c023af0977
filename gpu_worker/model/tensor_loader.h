// Reads checkpoint tensors into LibTorch tensors of the compute dtype, counting progress in
// stored bytes. A tensor goes from the mapped file straight to its compute dtype, 16 MiB at a
// time: one copy when the dtypes match, one conversion when they differ (no float32 detour),
// then those mapped pages are released (Checkpoint::ReleasePages), so a load's peak host memory
// is the loaded tensors plus one chunk. One owner thread (the model's loader).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/model/checkpoint.h"
#include "common/status.h"

namespace fmoe {

// Bytes read so far, of the total.
using LoadProgress = std::function<void(uint64_t done, uint64_t total)>;

class TensorLoader {
 public:
  // `progress` (copied) is called after each tensor read or skipped.
  TensorLoader(const Checkpoint& ckpt, at::ScalarType dtype, at::Device device,
               const LoadProgress& progress);

  // The tensor `name`, which must have `shape` (empty: any), in the compute dtype on `device`.
  // Stored F32, F16 and BF16 load to any floating compute dtype. Errors name the file and the
  // tensor: a missing tensor or another shape (Checkpoint::Get), another stored dtype
  // (kInvalidArgument), memory LibTorch could not get (kResourceExhausted) or another LibTorch
  // error (kInternal).
  Result<at::Tensor> Load(const std::string& name, const std::vector<int64_t>& shape,
                          at::Device device);
  Result<at::Tensor> Load(const std::string& name, const std::vector<int64_t>& shape) {
    return Load(name, shape, device_);
  }
  // A tensor another rank loads: checked, counted, not read.
  Status Skip(const std::string& name, const std::vector<int64_t>& shape);

 private:
  const Checkpoint& ckpt_;
  at::ScalarType dtype_;
  at::Device device_;
  LoadProgress progress_;  // A copy: a temporary argument may be passed.
  uint64_t done_ = 0, total_ = 0;
};

}  // namespace fmoe
