// The CPU expert kernel against host memory bandwidth and the machine's GEMM peak: one
// Mixtral-shaped routed expert (hidden 4096, intermediate 14336: 352 MB in bfloat16, 704 MB in
// float32) for 1 to 256 tokens, computed by CpuSwiGlu (gpu_worker/experts/cpu_expert.h, hybrid
// execution's host run), by the runtime's own products (SwiGlu with row_block 4: the host GEMM,
// gpu_worker/kernels/cpu_gemm.h) and by plain LibTorch matmuls (row_block 0), in float32 and
// bfloat16, and by CpuSwiGlu from the expert stored in FP8 (128 x 128 blocks) and INT4 (group
// 128): 168 MB and 88 MB read per token. Before the benchmarks the program measures the machine's
// read bandwidth with its intra-op threads (a streaming integer sum over 512 MiB, far beyond the
// last-level cache; the best of 5 passes); each case reports the weight bytes it streams per
// second (`weights_GBps`), that rate's fraction of the measured read bandwidth (`of_read_bw`) and
// its multiply-adds (`gflops`), which BM_BlasPeak's large LibTorch product puts in scale.
//   build/bin/cpu_expert_bench [--benchmark_filter=...] [--benchmark_repetitions=5]
// FMOE_BENCH_EXPERT="hidden,intermediate" picks another shape (e.g. "2048,1408").
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "gpu_worker/experts/cpu_expert.h"
#include "gpu_worker/kernels/cpu_gemm.h"
#include "gpu_worker/model/blocks.h"

namespace {

int64_t g_hidden = 4096;
int64_t g_inter = 14336;
double g_read_gbps = 0.0;

double MeasureReadGbps() {
  const int64_t words = (int64_t{512} << 20) / 8;
  std::vector<uint64_t> buf(static_cast<size_t>(words));
  at::parallel_for(0, words, 1 << 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) buf[static_cast<size_t>(i)] = static_cast<uint64_t>(i);
  });
  double best = 0.0;
  uint64_t sink = 0;
  for (int pass = 0; pass < 5; ++pass) {
    const int threads = at::get_num_threads();
    std::vector<uint64_t> partial(static_cast<size_t>(threads) * 8, 0);
    const auto t0 = std::chrono::steady_clock::now();
    at::parallel_for(0, words, words / threads + 1, [&](int64_t b, int64_t e) {
      uint64_t s = 0;  // Integer sums vectorise (associative), so this reads at memory speed.
      for (int64_t i = b; i < e; ++i) s += buf[static_cast<size_t>(i)];
      partial[static_cast<size_t>(at::get_thread_num()) * 8] += s;
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (uint64_t p : partial) sink += p;
    best = std::max(best, static_cast<double>(words) * 8 / s / 1e9);
  }
  benchmark::DoNotOptimize(sink);
  return best;
}

struct Expert {
  at::Tensor w1, w3, w2;
  double bytes = 0;
};

const Expert& GetExpert(at::ScalarType dt) {
  static std::map<at::ScalarType, Expert> experts;
  auto it = experts.find(dt);
  if (it != experts.end()) return it->second;
  experts.clear();  // One shape in memory at a time.
  Expert e;
  at::manual_seed(1);
  e.w1 = (at::randn({g_inter, g_hidden}) * 0.02).to(dt);
  e.w3 = (at::randn({g_inter, g_hidden}) * 0.02).to(dt);
  e.w2 = (at::randn({g_hidden, g_inter}) * 0.02).to(dt);
  e.bytes = static_cast<double>(3 * g_inter * g_hidden * e.w1.element_size());
  return experts.emplace(dt, std::move(e)).first->second;
}

void Report(benchmark::State& state, double bytes) {
  const double per_s =
      bytes * static_cast<double>(state.iterations());  // Rate counters divide by time.
  state.counters["weights_GBps"] = benchmark::Counter(per_s / 1e9, benchmark::Counter::kIsRate);
  state.counters["of_read_bw"] =
      benchmark::Counter(per_s / 1e9 / g_read_gbps, benchmark::Counter::kIsRate);
}

void BM_CpuSwiGlu(benchmark::State& state, at::ScalarType dt) {
  const Expert& e = GetExpert(dt);
  fmoe::ExpertWeights w;
  w.w1 = e.w1;
  w.w2 = e.w2;
  w.w3 = e.w3;
  at::Tensor x = at::randn({state.range(0), g_hidden}).to(dt);
  for (auto _ : state) {
    auto y = fmoe::CpuSwiGlu(x, w);
    if (!y.ok()) {
      state.SkipWithError(y.status().message().c_str());
      return;
    }
    benchmark::DoNotOptimize(y->data_ptr());
  }
  Report(state, e.bytes);
  const double flops = 2.0 * 3.0 * static_cast<double>(state.range(0) * g_hidden * g_inter);
  state.counters["gflops"] = benchmark::Counter(
      flops * static_cast<double>(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
}

// The same expert stored quantized (DESIGN section 12): FP8 e4m3 with float32 scales per
// 128 x 128 block, or compressed-tensors INT4 symmetric group 128 with bfloat16 scales; random
// stored bytes (no FP8 NaN codes), scales that keep the weights near 0.02. `bytes` counts every
// stored byte the kernel streams.
struct QuantExpert {
  fmoe::ExpertWeights w;
  double bytes = 0;
};

const QuantExpert& GetQuantExpert(fmoe::QuantMethod method) {
  static std::map<fmoe::QuantMethod, QuantExpert> experts;
  auto it = experts.find(method);
  if (it != experts.end()) return it->second;
  experts.clear();
  QuantExpert e;
  at::manual_seed(2);
  fmoe::QuantSpec spec;
  spec.method = method;
  if (method == fmoe::QuantMethod::kFp8Block) {
    spec.block_out = spec.block_in = 128;
  } else {
    spec.group_size = 128;
  }
  e.w.quant = spec;
  auto projection = [&](int64_t out, int64_t in, at::Tensor* weight, fmoe::ProjectionParts* parts) {
    if (method == fmoe::QuantMethod::kFp8Block) {
      // Magnitudes 0..0x7e with either sign: every finite e4m3 code.
      at::Tensor mag = at::randint(0, 0x7f, {out, in}, at::kInt);
      at::Tensor sign = at::randint(0, 2, {out, in}, at::kInt) * 0x80;
      *weight = (mag + sign).to(at::kByte);
      parts->scale = at::full({(out + 127) / 128, (in + 127) / 128}, 0.02f / 64, at::kFloat);
    } else {
      *weight = at::randint(std::numeric_limits<int32_t>::min(),
                            std::numeric_limits<int32_t>::max(), {out, in / 8}, at::kInt);
      parts->scale = at::full({out, (in + 127) / 128}, 0.02f / 4, at::kBFloat16);
    }
  };
  projection(g_inter, g_hidden, &e.w.w1, &e.w.q[0]);
  projection(g_hidden, g_inter, &e.w.w2, &e.w.q[1]);
  projection(g_inter, g_hidden, &e.w.w3, &e.w.q[2]);
  e.bytes = static_cast<double>(e.w.bytes());
  return experts.emplace(method, std::move(e)).first->second;
}

void BM_CpuSwiGluQuantized(benchmark::State& state, fmoe::QuantMethod method) {
  const QuantExpert& e = GetQuantExpert(method);
  at::Tensor x = at::randn({state.range(0), g_hidden}).to(at::kBFloat16);
  for (auto _ : state) {
    auto y = fmoe::CpuSwiGlu(x, e.w);
    if (!y.ok()) {
      state.SkipWithError(y.status().message().c_str());
      return;
    }
    benchmark::DoNotOptimize(y->data_ptr());
  }
  Report(state, e.bytes);
}

// The dense path's SwiGLU: row_block 0 = LibTorch's products (not batch-invariant), 4 = the
// host kernel (gpu_worker/kernels/cpu_gemm.h, what the runtime runs on the CPU). `gflops`
// counts the three products' multiply-adds twice.
void BM_SwiGlu(benchmark::State& state, at::ScalarType dt, int row_block) {
  const Expert& e = GetExpert(dt);
  at::Tensor x = at::randn({state.range(0), g_hidden}).to(dt);
  for (auto _ : state) {
    at::Tensor y = fmoe::SwiGlu(x, e.w1, e.w3, e.w2, row_block);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  Report(state, e.bytes);
  const double flops = 2.0 * 3.0 * static_cast<double>(state.range(0) * g_hidden * g_inter);
  state.counters["gflops"] = benchmark::Counter(
      flops * static_cast<double>(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
}
void BM_TorchSwiGlu(benchmark::State& state, at::ScalarType dt) { BM_SwiGlu(state, dt, 0); }
void BM_HostGemmSwiGlu(benchmark::State& state, at::ScalarType dt) { BM_SwiGlu(state, dt, 4); }

// The machine's GEMM peak as LibTorch's BLAS reaches it: a 2048 x 2048 x 2048 float32 product
// (compute-bound; OpenBLAS or MKL) with the intra-op threads. `gflops` is what the SwiGLU cases'
// counters compare with.
void BM_BlasPeak(benchmark::State& state) {
  at::manual_seed(4);
  const at::Tensor a = at::randn({2048, 2048}), b = at::randn({2048, 2048});
  for (auto _ : state) {
    at::Tensor c = at::mm(a, b);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  state.counters["gflops"] =
      benchmark::Counter(2.0 * 2048 * 2048 * 2048 * static_cast<double>(state.iterations()) / 1e9,
                         benchmark::Counter::kIsRate);
}

}  // namespace

BENCHMARK(BM_BlasPeak)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_CpuSwiGlu, bf16, at::kBFloat16)
    ->Arg(1)
    ->Arg(4)
    ->Arg(16)
    ->Arg(32)
    ->Arg(64)
    ->Arg(256)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_TorchSwiGlu, bf16, at::kBFloat16)
    ->Arg(1)
    ->Arg(4)
    ->Arg(32)
    ->Arg(128)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_HostGemmSwiGlu, bf16, at::kBFloat16)
    ->Arg(1)
    ->Arg(4)
    ->Arg(32)
    ->Arg(128)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_CpuSwiGluQuantized, fp8_block128, fmoe::QuantMethod::kFp8Block)
    ->Arg(1)
    ->Arg(4)
    ->Arg(32)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_CpuSwiGluQuantized, int4_g128, fmoe::QuantMethod::kInt4Packed)
    ->Arg(1)
    ->Arg(4)
    ->Arg(32)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_CpuSwiGlu, fp32, at::kFloat)
    ->Arg(1)
    ->Arg(4)
    ->Arg(16)
    ->Arg(32)
    ->Arg(64)
    ->Arg(256)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_TorchSwiGlu, fp32, at::kFloat)
    ->Arg(1)
    ->Arg(4)
    ->Arg(32)
    ->Arg(128)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_HostGemmSwiGlu, fp32, at::kFloat)
    ->Arg(1)
    ->Arg(4)
    ->Arg(32)
    ->Arg(128)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

int main(int argc, char** argv) {
  if (const char* s = std::getenv("FMOE_BENCH_EXPERT")) {
    long long h = 0, i = 0;
    if (std::sscanf(s, "%lld,%lld", &h, &i) != 2 || h <= 0 || i <= 0) {
      std::fprintf(stderr, "FMOE_BENCH_EXPERT=\"%s\" is not \"hidden,intermediate\"\n", s);
      return 2;
    }
    g_hidden = h;
    g_inter = i;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  g_read_gbps = MeasureReadGbps();
  std::printf(
      "expert %lldx%lld, %d intra-op threads, avx2 kernel: %s, host gemm: %s, read bandwidth "
      "%.2f GB/s\n",
      static_cast<long long>(g_hidden), static_cast<long long>(g_inter), at::get_num_threads(),
      fmoe::CpuSwiGluVectorised() ? "yes" : "no", std::string(fmoe::GemmIsa()).c_str(),
      g_read_gbps);
  benchmark::AddCustomContext("read_GBps", std::to_string(g_read_gbps));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
