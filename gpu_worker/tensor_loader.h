// Reads checkpoint tensors into LibTorch tensors of the compute dtype, counting progress in
// stored bytes. One owner thread (the model's loader).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/checkpoint.h"
#include "common/status.h"

namespace fmoe {

// Bytes read so far, of the total.
using LoadProgress = std::function<void(uint64_t done, uint64_t total)>;

class TensorLoader {
 public:
  TensorLoader(const Checkpoint& ckpt, at::ScalarType dtype, at::Device device,
               const LoadProgress& progress);

  // The tensor `name`, which must have `shape`, in the compute dtype on `device`. Errors name the
  // file and the tensor.
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
  const LoadProgress& progress_;
  uint64_t done_ = 0, total_ = 0;
};

}  // namespace fmoe
