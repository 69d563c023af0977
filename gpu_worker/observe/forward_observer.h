// ForwardObserver: what the forward pass reports while it runs (DESIGN sections 4 and 11): each
// request's semantic embedding, every MoE layer's gate distribution and routing, and the
// speculative predictions. MapPublisher (map_publisher.h) and TraceRecorder (trace_recorder.h)
// implement it; ObserverFanOut hands one Forward to several. Torch-free: spans only, valid only
// during the call. Engine thread only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "gpu_worker/core/sequence.h"

namespace fmoe {

// Calls per Forward, in this order:
//   OnBatchStart(sequences)
//   OnIterationStart per sequence
//   per MoE layer l: OnLayerGates per sequence, OnLayerRouting per sequence,
//                    for t in l+1 .. l+speculation_distance() (t < L): OnSpeculation(l, t) per
//                    sequence
//   OnIterationEnd per sequence                 (not reached when the Forward fails, nor for a
//                                               sequence an unreadable expert failed)
// then, from the engine, OnRequestEnd once a request has left the batch.
class ForwardObserver {
 public:
  virtual ~ForwardObserver() = default;
  // The batch of this Forward: each sequence's request, iteration and new tokens, in batch order.
  virtual void OnBatchStart(std::span<const SequenceInfo> sequences) {}
  // Mean of the embedding-layer output over the sequence's new tokens (length h).
  virtual void OnIterationStart(uint64_t request_id, uint32_t iteration,
                                std::span<const float> sem) {}
  // Softmax over all J experts of MoE layer `layer`, averaged over the new tokens.
  virtual void OnLayerGates(uint64_t request_id, uint32_t iteration, uint32_t layer,
                            std::span<const float> probs) {}
  // The experts the gate picked for this sequence's new tokens in MoE layer `layer`, ascending,
  // with the tokens routed to each (their sum is tokens * top_k).
  virtual void OnLayerRouting(uint64_t request_id, uint32_t iteration, uint32_t layer,
                              std::span<const uint32_t> experts, std::span<const uint32_t> tokens) {
  }
  // How many later layers' gates the observer wants applied to each layer's hidden state; 0 =
  // none. Computed for the observer alone: the expert source sees only its own distance.
  virtual uint32_t speculation_distance() const { return 0; }
  // One sequence's speculative prediction, before `layer`'s experts run: for each expert of
  // `target`, the fraction of this sequence's new tokens (not the batch's) whose top-k of
  // target's gate, applied to layer's hidden state, picks it (a multiple of 1 / its tokens; they
  // sum to top_k). The expert source still gets the batch's share (ExpertSource::Speculate).
  virtual void OnSpeculation(uint64_t request_id, uint32_t iteration, uint32_t layer,
                             uint32_t target, std::span<const float> fractions) {}
  virtual void OnIterationEnd(uint64_t request_id, uint32_t iteration) {}
  // The request left the batch (finished, cancelled or failed); called by the engine, only for a
  // request that completed at least one iteration: after its last OnIterationEnd, or after the
  // Forward that failed.
  virtual void OnRequestEnd(uint64_t request_id) {}
};

// Hands every call to each observer, in the order they were added.
class ObserverFanOut final : public ForwardObserver {
 public:
  // Null is ignored.
  void Add(ForwardObserver* observer) {
    if (observer != nullptr) observers_.push_back(observer);
  }
  bool empty() const { return observers_.empty(); }

  void OnBatchStart(std::span<const SequenceInfo> sequences) override {
    for (ForwardObserver* o : observers_) o->OnBatchStart(sequences);
  }
  void OnIterationStart(uint64_t request_id, uint32_t iteration,
                        std::span<const float> sem) override {
    for (ForwardObserver* o : observers_) o->OnIterationStart(request_id, iteration, sem);
  }
  void OnLayerGates(uint64_t request_id, uint32_t iteration, uint32_t layer,
                    std::span<const float> probs) override {
    for (ForwardObserver* o : observers_) o->OnLayerGates(request_id, iteration, layer, probs);
  }
  void OnLayerRouting(uint64_t request_id, uint32_t iteration, uint32_t layer,
                      std::span<const uint32_t> experts,
                      std::span<const uint32_t> tokens) override {
    for (ForwardObserver* o : observers_) {
      o->OnLayerRouting(request_id, iteration, layer, experts, tokens);
    }
  }
  // The largest any observer asks for; each gets only the targets within its own distance.
  uint32_t speculation_distance() const override {
    uint32_t d = 0;
    for (const ForwardObserver* o : observers_) d = std::max(d, o->speculation_distance());
    return d;
  }
  void OnSpeculation(uint64_t request_id, uint32_t iteration, uint32_t layer, uint32_t target,
                     std::span<const float> fractions) override {
    for (ForwardObserver* o : observers_) {
      if (target <= layer + o->speculation_distance()) {
        o->OnSpeculation(request_id, iteration, layer, target, fractions);
      }
    }
  }
  void OnIterationEnd(uint64_t request_id, uint32_t iteration) override {
    for (ForwardObserver* o : observers_) o->OnIterationEnd(request_id, iteration);
  }
  void OnRequestEnd(uint64_t request_id) override {
    for (ForwardObserver* o : observers_) o->OnRequestEnd(request_id);
  }

 private:
  std::vector<ForwardObserver*> observers_;
};

}  // namespace fmoe
