// The expert seam (DESIGN section 6): the forward pass reaches routed experts only through an
// ExpertSource. CachedExperts (cached_experts.h) implements it over the expert cache with a
// byte budget and prefetching; ResidentExperts, here, keeps every expert resident. Called by the
// engine thread only, per iteration in this order:
//   BeginIteration(sequences)
//   per MoE layer: [Speculate(layer, target, probs) for target in layer+1..layer+d]
//                  BeginLayer(routing)   -> the source pins what is resident, loads the rest
//                  Next() ... until kNotFound, each followed by Done(expert) (a failed one too)
//                  EndLayer()            -> weights from Next are invalid from here
//   EndIteration()
// Next hands out ready experts in the order they become available, so the model accumulates
// their outputs in ascending expert order afterwards: the result does not depend on that order.
// An expert whose weights are in host memory while the model computes on a device (hybrid
// execution) is run on the host (cpu_expert.h) and its result copied up. An expert whose weights
// could not be had (a tiered source whose read of it failed, after its retry) comes out of Next
// failed (SourcedExpert::failed): the model computes nothing for it and fails only the sequences
// whose rows picked it (model.h, ForwardResult::failed); the layer goes on.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/model/quant.h"
#include "common/status.h"
#include "gpu_worker/cache/policies/cache_policy.h"  // LayerAccess, for RecordingExperts.
#include "gpu_worker/core/sequence.h"

namespace fmoe {

// A projection's stored tensors beside its weight: a quantized format's (DESIGN section 12) and
// the projection's bias (gpt-oss's experts); undefined where there is none.
struct ProjectionParts {
  at::Tensor scale;  // weight_scale_inv, weight_scale or scales.
  at::Tensor zero;   // Packed zero points (asymmetric INT4, GPTQ, AWQ).
  at::Tensor g_idx;  // Each input column's group (act order).
  at::Tensor bias;   // [out], in the compute dtype.
};

// How a routed expert turns its projections into its output: plain SwiGLU, or (swiglu_limit > 0)
// gpt-oss's clamped one: gate = min(w1 x + b1, limit), up = clamp(w3 x + b3, -limit, limit),
// out = w2((up + 1) * gate * sigmoid(1.702 gate)) + b2.
struct ExpertActivation {
  double swiglu_limit = 0.0;
};

// Where one stored tensor of an expert left on disk is (the host tier reads it from there).
struct DiskExtent {
  std::string path;    // The safetensors file.
  std::string tensor;  // Its name, for messages.
  uint64_t offset = 0;
  uint64_t bytes = 0;
  // ways > 0: the tensor is part `part` of the region [offset, offset + bytes), a [rows, cols]
  // matrix of elem_bytes elements split `ways` ways: its rows part, part + ways, ... or
  // (by_columns) its columns part, part + ways, ... transposed (gpt-oss's fused experts; the host
  // tier's RegionSplit). The region is read once for all its parts. ways 0: the region is the
  // tensor.
  uint32_t ways = 0;
  uint32_t part = 0;
  bool by_columns = false;
  uint64_t rows = 0;
  uint64_t cols = 0;
  uint32_t elem_bytes = 0;
};

// Where a stored tensor of an expert may be (ExpertWeights::Places).
inline constexpr size_t kExpertPlaces = 15;

// One routed SwiGLU expert: out = w2(silu(w1 x) * w3 x) (with biases, b1, b3 and b2 in q[0].bias,
// q[2].bias and q[1].bias, and gpt-oss's clamp: ExpertActivation). Float experts hold the three
// weights.
// A quantized expert (quant.quantized()) holds each projection as stored: w1, w2, w3 are the
// stored weights (FP8 as bytes, INT4 packed in int32, in the format's own layout) and q[0..2]
// the rest of w1, w2 and w3; DequantizeExpert (quantized.h) gives the float weights.
struct ExpertWeights {
  at::Tensor w1;  // [intermediate, hidden] (gate projection)
  at::Tensor w2;  // [hidden, intermediate] (down projection)
  at::Tensor w3;  // [intermediate, hidden] (up projection)
  std::array<ProjectionParts, 3> q;
  QuantSpec quant;
  // An expert left on disk (RuntimeOptions::experts_on_disk): its tensors are shapes and dtypes
  // only (the meta device), and this gives each one's bytes in the checkpoint, in Tensors()
  // order. Null for an expert in memory.
  std::shared_ptr<const std::vector<DiskExtent>> disk;
  bool quantized() const { return quant.quantized(); }
  // Every stored tensor's bytes.
  size_t bytes() const;
  // Every stored tensor in the order the expert store packs them: w1 and q[0], w3 and q[2], w2
  // and q[1] (undefined ones skipped; a part's bias last).
  std::vector<const at::Tensor*> Tensors() const;
  std::vector<at::Tensor*> Tensors();
  // Every place a stored tensor may be, in that order, defined or not.
  std::array<at::Tensor*, kExpertPlaces> Places();
};

// Every routed expert of a model: experts[layer][expert], layer = MoE layer index.
using ExpertTable = std::vector<std::vector<ExpertWeights>>;

// One expert of the running layer from ExpertSource::Next.
struct SourcedExpert {
  uint32_t expert = 0;
  ExpertWeights weights;  // Valid until EndLayer; undefined when failed.
  // Not ok: the expert's weights could not be had for this layer (its read failed); the message
  // names the file and the tensor where the source knows them.
  Status failed;
};

class ExpertSource {
 public:
  virtual ~ExpertSource() = default;
  virtual void BeginIteration(std::span<const SequenceInfo> sequences) {}
  // How many later layers' gates the model should apply to each layer's hidden state (the
  // speculative policy); 0 = none.
  virtual uint32_t speculation_distance() const { return 0; }
  virtual void Speculate(uint32_t layer, uint32_t target, std::span<const float> probs) {}
  virtual Status BeginLayer(const LayerRouting& routing) = 0;
  // The next expert of the layer that is ready on the compute device (this rank's only), with
  // its weights valid until EndLayer, or failed (SourcedExpert::failed) when they could not be
  // had; kNotFound when every one has been handed out. An error fails the whole Forward.
  virtual Result<SourcedExpert> Next() = 0;
  virtual void Done(uint32_t expert) {}
  // After BeginLayer: whether some expert of the layer will come out of Next in host memory
  // (hybrid execution), so a model on another device copies the layer's activations down once,
  // before it queues the device's work.
  virtual bool HostRunsPlanned() const { return false; }
  virtual void EndLayer() = 0;
  virtual void EndIteration() {}
  virtual void OnRequestEnd(uint64_t request_id) {}
  // The request's expert figures so far (until OnRequestEnd).
  virtual RequestUsage Usage(uint64_t request_id) const { return {}; }
  // Before a Forward: bring the experts its iteration misses through a stream buffer beside the
  // cache, each layer's ahead of its routing, instead of into the cache (DESIGN section 14;
  // core/chunk_planner.h StreamMode). The output is the same either way. false when this source
  // cannot (no stream buffer; every expert resident).
  virtual bool StreamNextIteration() { return false; }
};

// A deep copy in host memory, wherever `table` lives (each rank or run that packs experts into its
// own store needs its own, and the expert cache packs from host tensors).
ExpertTable CloneExpertTable(const ExpertTable& table);

// Delegates to another source and records every layer's routing in order: the future access
// sequence the oracle policy replays.
class RecordingExperts final : public ExpertSource {
 public:
  explicit RecordingExperts(ExpertSource& inner) : inner_(inner) {}
  Status BeginLayer(const LayerRouting& routing) override {
    accesses_.push_back({routing.layer, {routing.experts.begin(), routing.experts.end()}});
    return inner_.BeginLayer(routing);
  }
  Result<SourcedExpert> Next() override { return inner_.Next(); }
  void Done(uint32_t expert) override { inner_.Done(expert); }
  bool HostRunsPlanned() const override { return inner_.HostRunsPlanned(); }
  void EndLayer() override { inner_.EndLayer(); }
  const std::vector<LayerAccess>& accesses() const { return accesses_; }

 private:
  ExpertSource& inner_;
  std::vector<LayerAccess> accesses_;
};

// Every expert resident on the compute device, nothing ever moves: the all-resident reference.
// Hands experts out in ascending order.
class ResidentExperts final : public ExpertSource {
 public:
  // Experts in host memory, for a model on the host.
  explicit ResidentExperts(ExpertTable experts) : experts_(std::move(experts)) {}
  // For a model on cuda:`cuda_index` (>= 0) the experts are copied to that device first: a host
  // expert handed to a device model would run on the host (hybrid execution's path), at host
  // speed. kResourceExhausted when the device cannot hold them. cuda_index < 0 keeps them here.
  static Result<std::unique_ptr<ResidentExperts>> Create(ExpertTable experts, int cuda_index);
  Status BeginLayer(const LayerRouting& routing) override;
  Result<SourcedExpert> Next() override;
  void EndLayer() override { pending_.clear(); }
  const ExpertTable& experts() const { return experts_; }

 private:
  ExpertTable experts_;
  uint32_t layer_ = 0;
  std::vector<uint32_t> pending_;  // Experts of the running layer not yet handed out, reversed.
};

}  // namespace fmoe
