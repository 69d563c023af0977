// TraceRecorder: the ForwardObserver that writes the worker's expert routing trace
// (common/model/expert_trace.h, `fmoe-worker --record-trace PATH`): per request and engine
// iteration one TraceIteration with every MoE layer's routing (experts ascending, tokens routed to
// each), the map stored explicitly as the request's gate distributions P_l (all J entries per
// layer), the semantic embedding, and the request's own speculative predictions of that iteration.
// Torch-free. Created and closed by the worker's main; the hooks run on the engine thread; Close
// only once the engine thread has returned.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/model/expert_trace.h"
#include "common/model/model_config.h"
#include "common/status.h"
#include "gpu_worker/core/sequence.h"
#include "gpu_worker/observe/forward_observer.h"

namespace fmoe {

struct TraceRecorderOptions {
  // The trace file. An existing file is kept: renamed to PATH.1 (or the first free PATH.N), so
  // a restarted worker does not overwrite its predecessor's trace. Required.
  std::string path;
  // model, source, iteration_unit, semantic and the shape (L, J, K, h). Required; see
  // WorkerTraceHeader.
  TraceHeader header;
  // Layers ahead whose gates are applied to each layer's hidden state for the speculation
  // entries (the map service's prefetch distance d); 0 = none. Default: 0
  uint32_t speculation_distance = 0;
};

struct TraceRecorderStats {
  uint64_t records = 0;   // Iterations written.
  uint64_t requests = 0;  // Requests whose last iteration was written.
  uint64_t dropped = 0;   // Iterations not written: incomplete (failed Forward) or invalid.
};

// The header the worker writes: model = the served name, source = "fmoe-worker <group> rank
// <rank>", iteration_unit = engine iterations, semantic = how sem and the speculation entries
// are computed; the shape from the model.
TraceHeader WorkerTraceHeader(const ModelInfo& model, const std::string& model_name,
                              const std::string& group, uint32_t rank,
                              uint32_t speculation_distance);

// A request's iteration:  ASSEMBLING (OnBatchStart .. OnIterationEnd)
//   -> HELD (complete; written when the request's next iteration completes, `last` unset)
//   -> written with `last` by OnRequestEnd (finished, cancelled, failed) or Close (the worker
//      stopped while the request ran).
// An iteration whose Forward failed never completes: it is dropped at the next OnBatchStart or
// at OnRequestEnd. An invalid iteration ends its request's trace: the held one is written with
// `last`, later ones are dropped. Every record is flushed as it is written, so a killed worker
// leaves whole records (its running requests' last one simply lacks `last`). A write error
// stops recording for good (logged); serving goes on.
class TraceRecorder final : public ForwardObserver {
 public:
  // Opens (creates) the trace and writes its header. kIoError naming the path when it cannot be
  // created; kInvalidArgument for a bad header.
  static Result<std::unique_ptr<TraceRecorder>> Open(const TraceRecorderOptions& options);
  ~TraceRecorder() override;  // Closes if Close was not called.

  void OnBatchStart(std::span<const SequenceInfo> sequences) override;
  void OnIterationStart(uint64_t request_id, uint32_t iteration,
                        std::span<const float> sem) override;
  void OnLayerGates(uint64_t request_id, uint32_t iteration, uint32_t layer,
                    std::span<const float> probs) override;
  void OnLayerRouting(uint64_t request_id, uint32_t iteration, uint32_t layer,
                      std::span<const uint32_t> experts, std::span<const uint32_t> tokens) override;
  uint32_t speculation_distance() const override { return options_.speculation_distance; }
  // Targets beyond speculation_distance are not asked for and ignored; an entry that does not fit
  // the header (layer >= target, target >= L, not J fractions) makes the iteration invalid.
  void OnSpeculation(uint64_t request_id, uint32_t iteration, uint32_t layer, uint32_t target,
                     std::span<const float> fractions) override;
  void OnIterationEnd(uint64_t request_id, uint32_t iteration) override;
  void OnRequestEnd(uint64_t request_id) override;

  // Writes every held iteration with `last` (requests still running), drops the incomplete
  // ones, closes the file. Later hooks do nothing. Returns the first write error, if any.
  Status Close();

  const TraceRecorderStats& stats() const { return stats_; }
  const std::string& path() const { return options_.path; }
  // The path an existing file was moved to by Open ("" if none).
  const std::string& kept_previous() const { return kept_previous_; }

 private:
  struct Assembling {
    TraceIteration it;
    bool has_sem = false;
    bool ok = true;  // False after a hook that did not fit (wrong layer order, target or size).
    uint32_t layers_gated = 0;
    uint32_t layers_routed = 0;
  };
  struct Request {
    std::optional<TraceIteration> held;
    uint32_t next = 0;   // The iteration expected to complete next.
    bool ended = false;  // Its trace ended early (an invalid or missing iteration).
  };

  TraceRecorder(TraceRecorderOptions options, TraceWriter writer);
  // Appends and flushes one record; on a write error stops recording (logged once).
  void Write(const TraceIteration& it);
  void Drop(uint64_t request_id, uint32_t iteration, const std::string& why);
  Assembling* Find(uint64_t request_id, uint32_t iteration);
  bool active() const { return error_.ok() && !closed_; }

  TraceRecorderOptions options_;
  TraceWriter writer_;
  TraceRecorderStats stats_;
  Status error_;  // The first write error; recording stops there.
  bool closed_ = false;
  std::string kept_previous_;
  std::unordered_map<uint64_t, Assembling> assembling_;  // This Forward's sequences.
  std::unordered_map<uint64_t, Request> requests_;       // Requests with an iteration done.
};

}  // namespace fmoe
