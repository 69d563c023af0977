// Micro-benchmarks of the wire codec: Encode + Decode (Verifier and range checks included) of the
// hot map-channel messages. Run: build/bench/wire_bench [--benchmark_filter=LayerObserved].
#include <cmath>

#include <benchmark/benchmark.h>

#include "common/wire/codec.h"

namespace fmoe::wire {
namespace {

void RoundTrip(benchmark::State& state, const MapMessage& message) {
  const DecodeLimits limits;
  MapMessage out;
  DecodeError error;
  size_t bytes = 0;
  for (auto _ : state) {
    std::vector<uint8_t> frame = Encode(message);
    bytes = frame.size();
    if (!Decode(frame, limits, &out, &error)) {
      state.SkipWithError(error.detail.c_str());
      break;
    }
    benchmark::DoNotOptimize(out);
  }
  state.counters["frame_bytes"] = static_cast<double>(bytes);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

void BM_LayerObserved(benchmark::State& state) {
  LayerObserved m{.request_id = 17, .iteration = 3, .layer = 12, .probs = {}};
  const auto j = static_cast<size_t>(state.range(0));
  m.probs.assign(j, 1.0f / static_cast<float>(j));
  RoundTrip(state, m);
}
BENCHMARK(BM_LayerObserved)->Arg(8)->Arg(60)->Arg(128);

void BM_IterationStart(benchmark::State& state) {
  IterationStart m{.request_id = 17, .iteration = 0, .sem = {}};
  for (int64_t i = 0; i < state.range(0); ++i) m.sem.push_back(std::sin(0.01f * i));
  RoundTrip(state, m);
}
BENCHMARK(BM_IterationStart)->Arg(256)->Arg(4096);

void BM_PrefetchDirective(benchmark::State& state) {
  PrefetchDirective m{
      .request_id = 17, .iteration = 3, .target_layer = 13, .score = 0.9f, .entries = {}};
  for (int64_t i = 0; i < state.range(0); ++i) {
    m.entries.push_back({static_cast<uint32_t>(i * 3), 0.5f, static_cast<float>(i)});
  }
  RoundTrip(state, m);
}
BENCHMARK(BM_PrefetchDirective)->Arg(16);

}  // namespace
}  // namespace fmoe::wire
