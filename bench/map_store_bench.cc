// map_store_bench: the map store's matching and insert costs at real model shapes (Google
// Benchmark, one core): the trajectory step per observed layer, the semantic match at
// iteration start, and insert with deduplication into a full store, for Mixtral-8x7B
// (L=32, J=8, h=4096), Qwen1.5-MoE-A2.7B (L=24, J=60, h=2048) and Phi-3.5-MoE (L=32, J=16,
// h=4096) at C = 1K, 10K and 50K entries of random data. Exact search (no index).
//
//   build/bin/map_store_bench --benchmark_min_time=0.2
#include <benchmark/benchmark.h>

#include <map>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "map_service/map_store.h"

namespace {

using namespace fmoe;

struct Shape {
  uint32_t layers, experts, top_k, hidden;
};
const Shape kShapes[] = {{32, 8, 2, 4096}, {24, 60, 4, 2048}, {32, 16, 2, 4096}};

std::vector<float> RandomVector(std::mt19937& rng, size_t n, bool distribution) {
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = distribution ? u(rng) * u(rng) * u(rng) : u(rng) - 0.5f;
  return v;
}

// One full store per (shape, capacity), built once and shared by the benchmarks.
MapStore& Store(int shape_index, uint32_t capacity) {
  static std::map<std::pair<int, uint32_t>, std::unique_ptr<MapStore>> stores;
  auto key = std::make_pair(shape_index, capacity);
  auto it = stores.find(key);
  if (it != stores.end()) return *it->second;
  stores.clear();  // One at a time: the 50K stores take up to 0.9 GB.
  const Shape& s = kShapes[shape_index];
  auto store = std::make_unique<MapStore>(
      *MapStore::Create({s.layers, s.experts, s.top_k, s.hidden, capacity, 3}));
  std::mt19937 rng(capacity + shape_index);
  const std::vector<float> sem = RandomVector(rng, s.hidden, false);
  for (uint32_t i = 0; i < capacity; ++i) {
    // Cheap distinct rows: a shared random embedding rotated, a fresh random map.
    std::vector<float> e(sem.size());
    for (size_t k = 0; k < e.size(); ++k) e[k] = sem[(k + i * 7) % sem.size()];
    (void)store->Put(i, i, e, RandomVector(rng, static_cast<size_t>(s.layers) * s.experts, true));
  }
  return *(stores[key] = std::move(store));
}

void Args(benchmark::internal::Benchmark* b) {
  for (int shape = 0; shape < 3; ++shape) {
    for (int c : {1000, 10000, 50000}) b->Args({shape, c});
  }
  b->ArgNames({"shape", "C"});
}

void BM_TrajectoryStep(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  MapStore& store = Store(static_cast<int>(state.range(0)), static_cast<uint32_t>(state.range(1)));
  std::mt19937 rng(1);
  const std::vector<float> map = RandomVector(rng, static_cast<size_t>(s.layers) * s.experts, true);
  Trajectory t;
  store.BeginTrajectory(&t);
  uint32_t layer = 0;
  for (auto _ : state) {
    if (layer == s.layers) {
      state.PauseTiming();
      store.BeginTrajectory(&t);
      layer = 0;
      state.ResumeTiming();
    }
    benchmark::DoNotOptimize(
        store.ObserveLayer(&t, {map.data() + static_cast<size_t>(layer) * s.experts, s.experts}));
    ++layer;
  }
}
BENCHMARK(BM_TrajectoryStep)->Apply(Args)->Unit(benchmark::kMicrosecond);

void BM_SemanticMatch(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  MapStore& store = Store(static_cast<int>(state.range(0)), static_cast<uint32_t>(state.range(1)));
  std::mt19937 rng(2);
  const std::vector<float> sem = RandomVector(rng, s.hidden, false);
  for (auto _ : state) benchmark::DoNotOptimize(store.SemanticMatch(sem));
}
BENCHMARK(BM_SemanticMatch)->Apply(Args)->Unit(benchmark::kMicrosecond);

void BM_InsertDeduplicate(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  MapStore& store = Store(static_cast<int>(state.range(0)), static_cast<uint32_t>(state.range(1)));
  std::mt19937 rng(3);
  const std::vector<float> sem = RandomVector(rng, s.hidden, false);
  const std::vector<float> map = RandomVector(rng, static_cast<size_t>(s.layers) * s.experts, true);
  uint64_t id = uint64_t{1} << 40;
  for (auto _ : state) benchmark::DoNotOptimize(store.Insert(id++, sem, map));
}
BENCHMARK(BM_InsertDeduplicate)->Apply(Args)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
