// Emulated link throughput: one on-demand task at a time (latency 10 us, 256 KiB chunks), timed by
// the link's own first-byte/last-byte stamps. Counters: GBps = bytes / (link time - latency),
// ratio = GBps / configured gbps, wall_ratio = paced time / (Submit to Wait returning).
// BM_Memcpy is the ceiling: plain memcpy in the same chunks on this machine.
// With FMOE_CUDA: BM_CudaLink moves an expert-sized task host (pinned) to device through the CUDA
// link, BM_PinnedCopy is its ceiling (one cudaMemcpyAsync of the same pinned buffer); both say
// "skipped: no GPU" without one. GBps of the CUDA link against the pinned copy has a target
// of >= 90% (bench/RESULTS.md).
// Run: build/bin/link_bench [--benchmark_filter=EmulatedLink]. Emulated figures say "emulated".
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <benchmark/benchmark.h>

#ifdef FMOE_LINK_BENCH_CUDA
#include <cuda_runtime.h>
#endif

#include "gpu_worker/cache/transfer/transfer_engine.h"

namespace fmoe {
namespace {

constexpr double kLatencyUs = 10.0;
constexpr size_t kChunkBytes = 256 << 10;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One on-demand task of `bytes` through `link`, waited for: its first-byte to last-byte time in
// nanoseconds (the link's own stamps).
double MoveOnce(TransferEngine& link, uint64_t id, const void* src, void* dst, size_t bytes) {
  TransferTask task;
  task.id = id;
  task.src = src;
  task.dst = dst;
  task.bytes = bytes;
  task.on_demand = true;
  link.Submit(task);
  std::vector<TransferDone> done;
  while (done.empty()) link.Wait(&done, std::chrono::milliseconds(1000));
  return static_cast<double>(done[0].end_ns - done[0].start_ns);
}

void BM_EmulatedLink(benchmark::State& state) {
  const double gbps = static_cast<double>(state.range(0));
  const size_t bytes = static_cast<size_t>(state.range(1)) << 20;
  LinkOptions options;
  options.gbps = gbps;
  options.latency_us = kLatencyUs;
  options.chunk_bytes = kChunkBytes;
  auto made = NewEmulatedLink(options);
  if (!made.ok()) {
    state.SkipWithError(made.status().ToString().c_str());
    return;
  }
  std::unique_ptr<TransferEngine> link = std::move(made).value();
  std::vector<char> src(bytes, 1);
  auto dst = link->AllocateDevice(bytes);
  if (!dst.ok()) {
    state.SkipWithError(dst.status().ToString().c_str());
    return;
  }
  std::memset(*dst, 0, bytes);  // Fault the pages in before timing.

  const double paced_ns = kLatencyUs * 1e3 + static_cast<double>(bytes) / gbps;
  double link_ns = 0;
  double wall_ns = 0;
  uint64_t id = 0;
  for (auto _ : state) {
    const int64_t t0 = NowNs();
    const double ns = MoveOnce(*link, ++id, src.data(), *dst, bytes);
    wall_ns += static_cast<double>(NowNs() - t0);
    link_ns += ns;
    state.SetIterationTime(ns / 1e9);
  }
  const auto n = static_cast<double>(state.iterations());
  const double achieved = n * static_cast<double>(bytes) / (link_ns - n * kLatencyUs * 1e3);
  state.counters["GBps"] = achieved;
  state.counters["ratio"] = achieved / gbps;
  state.counters["wall_ratio"] = n * paced_ns / wall_ns;
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
  link->FreeDevice(*dst);
}
BENCHMARK(BM_EmulatedLink)
    ->ArgNames({"gbps", "MiB"})
    ->ArgsProduct({{4, 8, 16, 32}, {1, 16, 64}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0)) << 20;
  std::vector<char> src(bytes, 1);
  std::vector<char> dst(bytes, 0);
  for (auto _ : state) {
    for (size_t off = 0; off < bytes; off += kChunkBytes) {
      std::memcpy(dst.data() + off, src.data() + off, std::min(kChunkBytes, bytes - off));
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.counters["GBps"] =
      benchmark::Counter(static_cast<double>(bytes) * static_cast<double>(state.iterations()) / 1e9,
                         benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Memcpy)->ArgName("MiB")->Arg(1)->Arg(16)->Arg(64)->Unit(benchmark::kMicrosecond);

#ifdef FMOE_LINK_BENCH_CUDA
bool HaveGpu(benchmark::State& state) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    state.SkipWithError("skipped: no GPU");
    return false;
  }
  return true;
}

void BM_CudaLink(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const size_t bytes = static_cast<size_t>(state.range(0)) << 20;
  LinkOptions options;
  options.cuda_chunk_bytes = static_cast<size_t>(state.range(1)) << 10;
  auto made = NewCudaLink(0, options);
  if (!made.ok()) {
    state.SkipWithError(made.status().ToString().c_str());
    return;
  }
  std::unique_ptr<TransferEngine> link = std::move(made).value();
  std::vector<char> src(bytes, 1);
  auto dst = link->AllocateDevice(bytes);
  Status pinned = link->RegisterHost(src.data(), bytes);
  if (!dst.ok() || !pinned.ok()) {
    state.SkipWithError((dst.ok() ? pinned : dst.status()).ToString().c_str());
    return;
  }
  uint64_t id = 0;
  double link_ns = 0;
  for (auto _ : state) {
    const double ns = MoveOnce(*link, ++id, src.data(), *dst, bytes);
    link_ns += ns;
    state.SetIterationTime(ns / 1e9);
  }
  state.counters["GBps"] = static_cast<double>(state.iterations()) * bytes / link_ns;
  link->UnregisterHost(src.data());
  link->FreeDevice(*dst);
}
// Each expert size at chunk sizes from 256 KiB to 16 MiB (the default is LinkOptions'
// cuda_chunk_bytes), to compare with BM_PinnedCopy of the same size.
BENCHMARK(BM_CudaLink)
    ->ArgNames({"MiB", "chunk_KiB"})
    ->ArgsProduct({{16, 112, 336}, {256, 1024, 4096, 16384}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

void BM_PinnedCopy(benchmark::State& state) {
  if (!HaveGpu(state)) return;
  const size_t bytes = static_cast<size_t>(state.range(0)) << 20;
  void* src = nullptr;
  void* dst = nullptr;
  cudaStream_t stream = nullptr;
  if (cudaMallocHost(&src, bytes) != cudaSuccess || cudaMalloc(&dst, bytes) != cudaSuccess ||
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    state.SkipWithError("cuda allocation failed");
    return;
  }
  std::memset(src, 1, bytes);
  for (auto _ : state) {
    const int64_t t0 = NowNs();
    cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream);
    cudaStreamSynchronize(stream);
    state.SetIterationTime(static_cast<double>(NowNs() - t0) / 1e9);
  }
  state.counters["GBps"] =
      benchmark::Counter(static_cast<double>(bytes) * static_cast<double>(state.iterations()) / 1e9,
                         benchmark::Counter::kIsRate);
  cudaStreamDestroy(stream);
  cudaFree(dst);
  cudaFreeHost(src);
}
BENCHMARK(BM_PinnedCopy)
    ->ArgName("MiB")
    ->Arg(16)
    ->Arg(112)
    ->Arg(336)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
#endif

}  // namespace
}  // namespace fmoe

// Google Benchmark before 1.8 (Debian 12 ships 1.7.1) takes --benchmark_min_time=0.2 and rejects
// the newer spelling 0.2s with no benchmark run; both spellings work here.
int main(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  constexpr std::string_view kMinTime = "--benchmark_min_time=";
  for (std::string& a : args) {
    if (!a.starts_with(kMinTime) || !a.ends_with('s')) continue;
    const std::string value = a.substr(kMinTime.size(), a.size() - kMinTime.size() - 1);
    char* end = nullptr;
    std::strtod(value.c_str(), &end);
    if (!value.empty() && end == value.c_str() + value.size()) a = std::string(kMinTime) + value;
  }
  std::vector<char*> pointers;
  for (std::string& a : args) pointers.push_back(a.data());
  int n = static_cast<int>(pointers.size());
  benchmark::Initialize(&n, pointers.data());
  if (benchmark::ReportUnrecognizedArguments(n, pointers.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
