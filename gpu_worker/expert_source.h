// The expert seam (DESIGN section 6): the forward pass reaches routed experts only through an
// ExpertSource. The expert cache manager implements it over a byte budget with prefetching;
// ResidentExperts, here, keeps every expert resident. Called by the engine thread only.
//
// Per MoE layer the forward pass calls, in order:
//   BeginLayer(layer, experts the gate picked)  -> the source pins them and starts any loads
//   Get(layer, expert) for each of them          -> blocks until that expert is resident
//   EndLayer(layer)                              -> pins released; weights from Get invalid
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/status.h"

namespace fmoe {

// One routed SwiGLU expert: out = w2(silu(w1 x) * w3 x).
struct ExpertWeights {
  at::Tensor w1;  // [intermediate, hidden] (gate projection)
  at::Tensor w2;  // [hidden, intermediate] (down projection)
  at::Tensor w3;  // [intermediate, hidden] (up projection)
  size_t bytes() const;
};

// Every routed expert of a model: experts[layer][expert], layer = MoE layer index.
using ExpertTable = std::vector<std::vector<ExpertWeights>>;

class ExpertSource {
 public:
  virtual ~ExpertSource() = default;
  // `experts`: sorted, unique expert indices of MoE layer `layer` used by this iteration.
  virtual Status BeginLayer(uint32_t layer, std::span<const uint32_t> experts) = 0;
  // The expert's weights on the compute device, valid until EndLayer(layer).
  virtual Result<ExpertWeights> Get(uint32_t layer, uint32_t expert) = 0;
  virtual void EndLayer(uint32_t layer) = 0;
};

// Every expert resident, nothing ever moves: the all-resident reference.
class ResidentExperts final : public ExpertSource {
 public:
  explicit ResidentExperts(ExpertTable experts) : experts_(std::move(experts)) {}
  Status BeginLayer(uint32_t layer, std::span<const uint32_t> experts) override;
  Result<ExpertWeights> Get(uint32_t layer, uint32_t expert) override;
  void EndLayer(uint32_t layer) override {}
  const ExpertTable& experts() const { return experts_; }

 private:
  ExpertTable experts_;
};

}  // namespace fmoe
