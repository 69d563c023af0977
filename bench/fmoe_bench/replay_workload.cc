#include "bench/fmoe_bench/replay_workload.h"

#include <algorithm>
#include <cmath>

namespace fmoe::bench {

std::string_view TraceKindName(TraceKind kind) {
  switch (kind) {
    case TraceKind::kIterations:
      return "iterations";
    case TraceKind::kPromptPositions:
      return "prompt-positions";
    case TraceKind::kDecodePositions:
      return "decode-positions";
  }
  return "?";
}

Result<TraceKind> ParseTraceKind(std::string_view name) {
  for (TraceKind k :
       {TraceKind::kIterations, TraceKind::kPromptPositions, TraceKind::kDecodePositions}) {
    if (name == TraceKindName(k)) return k;
  }
  return InvalidArgument("trace kind \"" + std::string(name) +
                         "\" is not iterations, prompt-positions or decode-positions");
}

Result<TraceKind> DetectTraceKind(const TraceHeader& h) {
  const std::string_view unit = h.iteration_unit;
  if (unit.starts_with("engine iteration")) return TraceKind::kIterations;
  if (unit.starts_with("prompt token position") || unit.starts_with("prefill token position")) {
    return TraceKind::kPromptPositions;
  }
  if (unit.starts_with("decode token position")) return TraceKind::kDecodePositions;
  return InvalidArgument("the trace's iteration unit \"" + h.iteration_unit +
                         "\" does not say whether its records are engine iterations, prompt "
                         "positions or decode positions: re-import it, or pass --trace-kind");
}

TraceIteration MergePositions(const TraceHeader& h,
                              const std::vector<const TraceIteration*>& positions) {
  TraceIteration out;
  if (positions.empty()) return out;
  const TraceIteration& first = *positions.front();
  out.request_id = first.request_id;
  out.sem = first.sem;
  out.speculation = first.speculation;
  bool derived = true;
  for (const TraceIteration* p : positions) {
    out.tokens += p->tokens;
    derived = derived && p->map_derived;
  }
  out.map_derived = derived;
  const uint32_t L = h.num_layers, J = h.num_experts;
  std::vector<uint32_t> counts(J);
  out.used_offsets.assign(1, 0);
  for (uint32_t l = 0; l < L; ++l) {
    std::fill(counts.begin(), counts.end(), 0);
    for (const TraceIteration* p : positions) {
      auto experts = p->used(l);
      auto tokens = p->used_counts(l);
      for (size_t i = 0; i < experts.size(); ++i) counts[experts[i]] += tokens[i];
    }
    for (uint32_t j = 0; j < J; ++j) {
      if (counts[j] == 0) continue;
      out.used_experts.push_back(static_cast<uint16_t>(j));
      out.used_tokens.push_back(counts[j]);
    }
    out.used_offsets.push_back(static_cast<uint32_t>(out.used_experts.size()));
  }
  if (!derived) {
    // The mean of the positions' maps, weighted by their tokens (the iteration's P_l is the mean
    // over its tokens).
    std::vector<double> sum(static_cast<size_t>(L) * J, 0.0);
    std::vector<float> map;
    for (const TraceIteration* p : positions) {
      p->FillMap(h, &map);
      for (size_t k = 0; k < sum.size(); ++k) sum[k] += static_cast<double>(map[k]) * p->tokens;
    }
    out.map_offsets.assign(1, 0);
    for (uint32_t l = 0; l < L; ++l) {
      for (uint32_t j = 0; j < J; ++j) {
        const double v = sum[static_cast<size_t>(l) * J + j] / out.tokens;
        if (v <= 0) continue;
        out.map_experts.push_back(static_cast<uint16_t>(j));
        out.map_probs.push_back(static_cast<float>(std::min(v, 1.0)));
      }
      out.map_offsets.push_back(static_cast<uint32_t>(out.map_experts.size()));
    }
  }
  return out;
}

Result<ServeWorkload> BuildServeWorkload(const TraceRequests& requests,
                                         const ServeWorkloadOptions& options) {
  if (!(options.decode_share >= 0.0 && options.decode_share <= 1.0)) {
    return InvalidArgument("decode share " + std::to_string(options.decode_share) +
                           " is not in [0, 1]");
  }
  const Trace& trace = *requests.trace;
  ServeWorkload w;
  w.trace = &trace;
  w.kind = options.kind;
  w.requests.reserve(requests.requests.size());
  for (const std::vector<uint32_t>& its : requests.requests) {
    if (its.empty()) return InvalidArgument("a request without iterations");
    ServeRequest r;
    r.id = trace.iterations[its.front()].request_id;
    switch (options.kind) {
      case TraceKind::kIterations: {
        // An engine that prefilled the prompt in chunks recorded its leading iterations with
        // `prefill` set: they are one prefill here, as a whole prompt would have been recorded,
        // so the replay's own batching (and chunking) decides how it runs.
        size_t chunks = 1;
        if (trace.iterations[its.front()].prefill) {
          while (chunks < its.size() && trace.iterations[its[chunks]].prefill) ++chunks;
        }
        if (chunks > 1) {
          std::vector<const TraceIteration*> prompt;
          for (size_t c = 0; c < chunks; ++c) prompt.push_back(&trace.iterations[its[c]]);
          w.merged.push_back(MergePositions(trace.header, prompt));
          w.merged.back().prefill = true;
          w.merged.back().last = prompt.back()->last;
          r.steps.push_back(&w.merged.back());
        } else {
          r.steps.push_back(&trace.iterations[its.front()]);
        }
        for (size_t i = chunks; i < its.size(); ++i) r.steps.push_back(&trace.iterations[its[i]]);
        r.prompt_tokens = r.steps.front()->tokens;
        break;
      }
      case TraceKind::kDecodePositions:
        r.has_prefill = false;
        for (uint32_t i : its) r.steps.push_back(&trace.iterations[i]);
        break;
      case TraceKind::kPromptPositions: {
        const size_t T = its.size();
        size_t decode =
            static_cast<size_t>(std::llround(static_cast<double>(T) * options.decode_share));
        decode = T >= 2 ? std::clamp<size_t>(decode, 1, T - 1) : 0;
        std::vector<const TraceIteration*> prompt;
        for (size_t p = 0; p < T - decode; ++p) prompt.push_back(&trace.iterations[its[p]]);
        w.merged.push_back(MergePositions(trace.header, prompt));
        r.steps.push_back(&w.merged.back());
        r.prompt_positions = std::move(prompt);
        r.prompt_tokens = w.merged.back().tokens;
        for (size_t p = T - decode; p < T; ++p) r.steps.push_back(&trace.iterations[its[p]]);
        break;
      }
    }
    w.requests.push_back(std::move(r));
  }
  return w;
}

Result<std::vector<int64_t>> ArrivalOffsets(const ArrivalTrace* trace, size_t count,
                                            const ArrivalOptions& options) {
  if (!(options.time_scale > 0) || !std::isfinite(options.time_scale)) {
    return InvalidArgument("arrival time scale must be > 0");
  }
  if (!(options.rate >= 0) || !std::isfinite(options.rate)) {
    return InvalidArgument("arrival rate must be >= 0");
  }
  std::vector<int64_t> out(count, 0);
  if (trace == nullptr || count == 0) return out;
  if (options.offset + count > trace->rows.size()) {
    return InvalidArgument("the arrival trace has " + std::to_string(trace->rows.size()) +
                           " rows; rows " + std::to_string(options.offset) + ".." +
                           std::to_string(options.offset + count - 1) + " were asked for");
  }
  const double t0 = trace->rows[options.offset].time_s;
  const double span = trace->rows[options.offset + count - 1].time_s - t0;
  double scale = options.time_scale;
  if (options.rate > 0 && count > 1 && span > 0) {
    scale = static_cast<double>(count - 1) / options.rate / span;
  }
  for (size_t i = 0; i < count; ++i) {
    const double dt = std::max(0.0, trace->rows[options.offset + i].time_s - t0);
    out[i] = std::llround(dt * scale * 1e9);
    if (i > 0) out[i] = std::max(out[i], out[i - 1]);  // Rows out of order arrive together.
  }
  return out;
}

}  // namespace fmoe::bench
