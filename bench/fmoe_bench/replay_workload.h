// The serving workload of the policy replay (DESIGN section 11): a trace's requests as a serving
// engine runs them. Each request is one prefill iteration (the union of its prompt tokens'
// experts, with per-expert token counts, all its tokens at once), then decode iterations of one
// token each (TraceKind says what a trace's records become). Arrival times come from an Azure
// arrival trace (serve_workload.h), scaled. Pure functions over a Trace, which must outlive the
// workload; no threads.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <vector>

#include "bench/fmoe_bench/replay_core.h"
#include "bench/fmoe_bench/serve_workload.h"
#include "common/model/expert_trace.h"
#include "common/status.h"

namespace fmoe::bench {

// What a trace's records become:
//   iterations        the worker's engine iterations: 0 is the prefill, each later one a decode
//                     step, used as recorded; a prefill recorded in chunks (the leading
//                     iterations flagged prefill) is merged into one.
//   prompt-positions  one record per prompt token position (the DeepSeek-V2-Lite trace, a prefill
//                     of the Mixtral files): the first positions are merged into the prefill; the
//                     last round(T * decode_share) positions (at least 1 when T >= 2, at most
//                     T - 1) are replayed as the decode steps, one each, standing in for the
//                     unrecorded decode.
//   decode-positions  one record per generated token (the Mixtral GSM8K and HumanEval files): no
//                     prefill was recorded; every record is a decode step.
enum class TraceKind { kIterations, kPromptPositions, kDecodePositions };

std::string_view TraceKindName(TraceKind kind);  // "iterations", "prompt-positions", ...
// A TraceKindName. kInvalidArgument naming the valid ones otherwise.
Result<TraceKind> ParseTraceKind(std::string_view name);
// From the header's iteration_unit as the worker and import-trace write it ("engine iteration",
// "prompt token position", "prefill token position", "decode token position").
// kInvalidArgument for any other (an older import: re-import it, or name the kind).
Result<TraceKind> DetectTraceKind(const TraceHeader& header);

struct ServeWorkloadOptions {
  TraceKind kind = TraceKind::kIterations;
  // prompt-positions: the share of a prompt's positions replayed as decode steps. Default: 0.15
  // (the Azure conversation trace's generated tokens over context + generated: 0.155).
  double decode_share = 0.15;
};

// One request as the engine runs it.
struct ServeRequest {
  uint64_t id = 0;             // The trace's request id.
  bool has_prefill = true;     // false: decode-positions (steps are all decode).
  uint32_t prompt_tokens = 0;  // Tokens of the prefill (0 without one).
  // The request's iterations in order: the prefill first (when it has one), then one decode step
  // per entry. Each points into the trace or into ServeWorkload::merged; only the routing, the
  // map, the embedding and the speculation are read (not request_id, iteration or last).
  std::vector<const TraceIteration*> steps;
  // prompt-positions: the records of the prefill's positions, in order (steps[0] is their merge),
  // from which a chunked prefill's chunks are merged (MergePositions of [a, b)); empty for the
  // other kinds, whose prefill routing is known only whole.
  std::vector<const TraceIteration*> prompt_positions;
  uint32_t decode_steps() const {
    return static_cast<uint32_t>(steps.size()) - (has_prefill ? 1u : 0u);
  }
};

struct ServeWorkload {
  const Trace* trace = nullptr;
  TraceKind kind = TraceKind::kIterations;
  std::deque<TraceIteration> merged;   // Prefills merged from prompt positions.
  std::vector<ServeRequest> requests;  // One per TraceRequests::requests entry, same order.
};

// The union of `positions`' routing as one iteration of their summed tokens: per layer every
// expert any of them used, with its summed token count; the map is derived when every position's
// is (their mean otherwise); the embedding and the speculation are the first position's.
TraceIteration MergePositions(const TraceHeader& header,
                              const std::vector<const TraceIteration*>& positions);

// kInvalidArgument for a decode_share outside [0, 1], or a request without iterations.
Result<ServeWorkload> BuildServeWorkload(const TraceRequests& requests,
                                         const ServeWorkloadOptions& options);

struct ArrivalOptions {
  size_t offset = 0;        // First row of the arrival trace (0-based). Default: 0
  double time_scale = 1.0;  // Multiplies the trace's gaps. Default: 1
  double rate = 0;          // > 0: gaps rescaled to this mean rate, requests/s. Default: 0
};

// Arrival offsets (ns from the first) of `count` requests: rows offset .. offset + count - 1 of
// `trace` (wrapping around its end), their gaps scaled. Without a trace (nullptr) every request
// arrives at 0. kInvalidArgument for a bad scale or rate.
Result<std::vector<int64_t>> ArrivalOffsets(const ArrivalTrace* trace, size_t count,
                                            const ArrivalOptions& options);

}  // namespace fmoe::bench
