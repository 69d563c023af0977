// Cache policies (DESIGN section 6): what to prefetch and what to evict, behind one interface, so
// every baseline runs in the same expert cache. Torch-free: policies see expert ids, layers and
// events, never weights. A policy is owned by one ExpertCache and called on the engine thread
// only, in this order per iteration:
//   OnIterationStart -> per MoE layer: [OnSpeculation...] OnLayerStart, OnUse per expert the
//   gate picked, OnLayerEnd -> OnIterationEnd; OnDirective and OnRequestEnd between any two.
// Layers are MoE layer indices from 0; positions are ExpertCache positions (iteration * L +
// layer), so "layer l of this iteration" and "of the next" are comparable.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/wire/messages.h"
#include "gpu_worker/core/sequence.h"

namespace fmoe {

// What a policy may ask of the cache. Implemented by ExpertCache.
class CacheControl {
 public:
  virtual ~CacheControl() = default;
  virtual uint32_t num_layers() const = 0;
  virtual uint32_t num_experts() const = 0;  // J per layer.
  virtual uint32_t top_k() const = 0;
  virtual uint32_t slots() const = 0;  // Experts the budget holds.
  virtual bool Owns(uint32_t layer, uint32_t expert) const = 0;
  // The MoE layer running now, or the last one that ran between layers.
  virtual uint32_t current_layer() const = 0;
  // Queues a prefetch of expert (layer, expert) for `layer` of the running iteration, at
  // `priority` (higher is loaded first). A newer request for the same expert replaces the
  // older's priority (re-ranks). Ignored (and counted) for an expert this rank does not own or
  // a layer that has already started. An expert already resident is protected from eviction
  // until its layer has run.
  virtual void Prefetch(uint32_t layer, uint32_t expert, double priority) = 0;
  // Drops every queued prefetch not yet handed to the link.
  virtual void ClearPrefetches() = 0;
};

class CachePolicy {
 public:
  virtual ~CachePolicy() = default;
  virtual std::string_view name() const = 0;
  // Once, before any other call.
  virtual void Attach(CacheControl* control) { control_ = control; }

  virtual void OnIterationStart(std::span<const SequenceInfo> sequences) {}
  virtual void OnLayerStart(const LayerRouting& routing) {}
  // Expert (layer, expert) of this rank is used by the running layer; `hit` if it was resident.
  virtual void OnUse(uint32_t layer, uint32_t expert, bool hit) {}
  virtual void OnLayerEnd(uint32_t layer) {}
  virtual void OnIterationEnd() {}
  virtual void OnRequestEnd(uint64_t request_id) {}
  // An expert became resident / left the device.
  virtual void OnResident(uint32_t layer, uint32_t expert) {}
  virtual void OnEvicted(uint32_t layer, uint32_t expert) {}

  // Map-service prefetch directives (the fmoe policies); others ignore them.
  virtual void OnDirective(const PrefetchDirective& directive) {}
  // Speculative prediction: how many layers ahead the model should apply later layers' gates to
  // the current hidden state (0 = none), and the result: for target layer `target`, the
  // fraction of the batch's tokens whose top-k would pick each expert (length J).
  virtual uint32_t speculation_distance() const { return 0; }
  virtual void OnSpeculation(uint32_t layer, uint32_t target, std::span<const float> probs) {}

  // Eviction order: among the experts the cache may evict (resident, unpinned, unprotected),
  // the one with the lowest score goes first. Ties: the lower (layer, expert) goes first.
  virtual double EvictionScore(uint32_t layer, uint32_t expert) const = 0;
  // Whether the cache admits a queued prefetch only when the link can finish it before its
  // layer starts (DESIGN section 6, link budget).
  virtual bool admit_by_deadline() const { return false; }

 protected:
  CacheControl* control_ = nullptr;
};

// One layer's accesses, for the oracle: the experts the gate picked, in the order they occur.
struct LayerAccess {
  uint32_t layer = 0;
  std::vector<uint32_t> experts;
};

struct PolicyOptions {
  // Prefetch distance d for speculative and the oracle (moe-infinity looks at every later
  // layer, as its paper does).
  uint32_t prefetch_distance = 3;  // Default: 3
  // p for an expert no directive has mentioned (fmoe's p * freq). Default: 0.01
  double probability_floor = 0.01;
  // moe-infinity: EAM collection capacity. Default: 1000
  uint32_t eam_capacity = 1000;
  // oracle: the whole future access sequence (from a recorded run); empty for other policies.
  std::vector<LayerAccess> future;
};

// The policies defined in cache_policy.cc (every name of common/policy_names.h but
// moe-infinity, moe_infinity_policy.h); nullptr for another name, kInvalidArgument for oracle
// without options.future. Build policies with policy_factory.h's MakePolicy.
Result<std::unique_ptr<CachePolicy>> MakeBuiltinPolicy(std::string_view name,
                                                       const PolicyOptions& options);

}  // namespace fmoe
