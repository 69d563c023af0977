// Reads checkpoint tensors into LibTorch tensors of the compute dtype, counting progress in
// stored bytes. A tensor goes from the mapped file straight to its compute dtype, 16 MiB at a
// time: one copy when the dtypes match, one conversion when they differ (no float32 detour),
// then those mapped pages are released (Checkpoint::ReleasePages), so a load's peak host memory
// is the loaded tensors plus one chunk. One owner thread (the model's loader).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/model/checkpoint.h"
#include "common/model/quant.h"
#include "common/status.h"
#include "gpu_worker/experts/expert_source.h"

namespace fmoe {

// Bytes read so far, of the total.
using LoadProgress = std::function<void(uint64_t done, uint64_t total)>;

// The prefix of a linear layer's weight name ("...q_proj." of "...q_proj.weight"); "" when
// `name` does not end in "weight".
std::string LinearPrefix(const std::string& name);

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

  // Quantized checkpoints (DESIGN section 12): with a format set, Load dequantizes a linear
  // weight stored in it (`name` ends in "weight"; FP8 "<p>weight" with its scale, or the 4-bit
  // formats' "<p>weight_packed" / "<p>qweight" and the rest) into the compute dtype; float
  // weights load as before.
  void set_quant(const QuantSpec& quant) { quant_ = quant; }
  // One [out, in] projection "<prefix>..." kept as stored, in host memory: its weight into
  // `weight`, the rest into `parts`. Errors name the tensor: a missing one, another shape or
  // dtype than the format's (QuantTensorsOf), a group index out of range.
  Status LoadQuantized(const std::string& prefix, int64_t out, int64_t in, at::Tensor* weight,
                       ProjectionParts* parts);
  // The same, checked and counted, not read (another rank's expert).
  Status SkipQuantized(const std::string& prefix, int64_t out, int64_t in);
  // Experts left on disk (the host tier, DESIGN section 13): while a sink is set, Load and
  // LoadQuantized read nothing: each returns a tensor of the stored shape and dtype on the meta
  // device and records where its bytes are in the sink, by the tensor's TensorImpl. A tensor
  // that would be converted (stored in another dtype than the compute dtype) is refused: the
  // host tier reads experts as stored. Not counted in the progress. Null: read as usual.
  using DiskSink = std::unordered_map<const void*, DiskExtent>;
  void set_disk_sink(DiskSink* sink) { sink_ = sink; }
  // Whether the weight `name` is stored quantized (by what the checkpoint holds).
  bool StoredQuantized(const std::string& name) const;
  // The tensor `name` as stored, which must be `dtype` and `shape`, in host memory (gpt-oss's
  // fused MXFP4 blocks and scales). Errors name the tensor, as LoadQuantized's.
  Result<at::Tensor> LoadRaw(const std::string& name, DType dtype,
                             const std::vector<int64_t>& shape);

 private:
  const Checkpoint& ckpt_;
  at::ScalarType dtype_;
  at::Device device_;
  // The stored tensor `name` as is (its own dtype, host memory), after checking it against
  // `spec`; undefined when it is optional and absent.
  Result<at::Tensor> LoadStored(const std::string& name, const QuantTensorSpec& spec);
  // `view` read into a new tensor of `options` (one copy or conversion from `stored`), counted.
  Result<at::Tensor> Read(const std::string& name, const TensorView& view, at::ScalarType stored,
                          const at::TensorOptions& options);
  std::string Where(const std::string& name) const;  // "model: FILE: tensor \"NAME\"".
  Result<at::Tensor> LoadDequantized(const std::string& name, const std::vector<int64_t>& shape,
                                     at::Device device);

  LoadProgress progress_;  // A copy: a temporary argument may be passed.
  QuantSpec quant_;
  DiskSink* sink_ = nullptr;
  uint64_t done_ = 0, total_ = 0;
};

}  // namespace fmoe
