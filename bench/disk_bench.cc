// disk_bench: read bandwidth of expert-sized reads through the DiskReader
// (gpu_worker/cache/store/disk_reader.h), O_DIRECT, for both backends, at queue depths 1..16.
// Mixtral-8x7B's bf16 expert is ~336 MiB in three tensors (~112 MiB each); the sizes here, 8 and
// 64 MiB, bracket one tensor's share of a smaller model's expert and a large tensor's.
// Usage: disk_bench [--file PATH] [--chunk_bytes N] [benchmark flags]
//   --file PATH      read PATH (at least 64 MiB); without it a 2 GiB file of pseudo-random bytes
//                    is written to $TMPDIR (default /tmp), dropped from the page cache, and
//                    removed at exit.
//   --chunk_bytes N  the reader's chunk size (a multiple of 4096). Default: 1 MiB
// Each benchmark keeps enough reads outstanding that queue_depth chunks are always in flight, at
// random expert-aligned offsets; an iteration is one finished read. Counter GB: 1e9 bytes/s.
// Scatter/*: the host tier's ScatterRegion (host_tier.h) on the engine thread, for a fused
// gpt-oss-120b expert's regions (h = I = 2880): MXFP4's gate_up blocks (rows split 2 ways) and
// bfloat16's gate_up [h, 2I] (columns split 2 ways, transposed) and down [I, h] (transposed); an
// iteration is one region, counter GB its bytes per second; copy_bf16_gate_up copies gate_up's
// bytes unchanged, the floor. They need no file (one is written only when a DiskRead benchmark
// runs).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <spdlog/spdlog.h>

#include "gpu_worker/cache/store/disk_reader.h"
#include "gpu_worker/cache/store/host_tier.h"

namespace fmoe {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kCreatedFileBytes = uint64_t{2} << 30;

std::string g_path;
uint64_t g_file_bytes = 0;
size_t g_chunk_bytes = kMiB;

// Writes `bytes` pseudo-random bytes to `path`, syncs them and drops them from the page cache.
bool CreateFile(const std::string& path, uint64_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    std::fprintf(stderr, "disk_bench: %s: open: %s\n", path.c_str(), std::strerror(errno));
    return false;
  }
  std::vector<uint64_t> block(8 * kMiB / sizeof(uint64_t));
  std::mt19937_64 rng(1);
  for (uint64_t& v : block) v = rng();
  bool ok = true;
  for (uint64_t written = 0; ok && written < bytes; written += 8 * kMiB) {
    block[0] = written;  // Every block differs.
    const size_t n = std::min<uint64_t>(8 * kMiB, bytes - written);
    ok = ::write(fd, block.data(), n) == static_cast<ssize_t>(n);
  }
  ok = ok && ::fsync(fd) == 0;
  if (!ok) std::fprintf(stderr, "disk_bench: %s: write: %s\n", path.c_str(), std::strerror(errno));
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  return ok;
}

bool g_created = false;

// The file the DiskRead benchmarks read: --file's, or one written on first use.
bool EnsureFile() {
  if (g_file_bytes > 0) return true;
  if (g_path.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    g_path = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/fmoe-disk-bench-" +
             std::to_string(getpid()) + ".bin";
    std::fprintf(stderr, "disk_bench: writing %llu bytes to %s\n",
                 static_cast<unsigned long long>(kCreatedFileBytes), g_path.c_str());
    g_created = true;
    if (!CreateFile(g_path, kCreatedFileBytes)) return false;
  }
  struct stat st {};
  if (::stat(g_path.c_str(), &st) != 0) {
    std::fprintf(stderr, "disk_bench: %s: stat: %s\n", g_path.c_str(), std::strerror(errno));
    return false;
  }
  g_file_bytes = static_cast<uint64_t>(st.st_size);
  return true;
}

void BM_DiskRead(benchmark::State& state, const std::string& backend, uint64_t read_bytes) {
  if (!EnsureFile()) {
    state.SkipWithError("no file to read");
    return;
  }
  state.SetLabel(g_path);
  DiskReaderOptions options;
  options.backend = backend;
  options.queue_depth = static_cast<uint32_t>(state.range(0));
  options.chunk_bytes = g_chunk_bytes;
  options.direct = true;
  auto created = DiskReader::Create(options);
  if (!created.ok()) {
    state.SkipWithError(created.status().ToString().c_str());
    return;
  }
  DiskReader& reader = **created;
  auto file = reader.AddFile(g_path);
  if (!file.ok()) {
    state.SkipWithError(file.status().ToString().c_str());
    return;
  }
  if (!reader.direct(*file)) state.SetLabel(g_path + ", not O_DIRECT");
  const uint64_t slots = g_file_bytes / read_bytes;
  if (slots == 0) {
    state.SkipWithError("the file is smaller than one read");
    return;
  }
  // Reads outstanding: enough queued chunks to keep queue_depth in flight, plus one.
  const uint64_t chunks_per_read = (read_bytes + options.chunk_bytes - 1) / options.chunk_bytes;
  const size_t window = static_cast<size_t>(
      std::max<uint64_t>(2, (options.queue_depth + chunks_per_read - 1) / chunks_per_read + 1));
  std::vector<std::vector<uint8_t>> dst(window, std::vector<uint8_t>(read_bytes));
  std::mt19937_64 rng(static_cast<uint64_t>(state.range(0)) * 7919 + read_bytes);
  const auto submit = [&](uint64_t slot) {
    reader.Submit(slot, *file, (rng() % slots) * read_bytes, read_bytes, dst[slot].data(), false);
  };
  for (uint64_t slot = 0; slot < window; ++slot) submit(slot);

  std::vector<ReadDone> done;
  std::deque<uint64_t> finished;
  uint64_t bytes = 0;
  for (auto _ : state) {
    while (finished.empty()) {
      done.clear();
      reader.Wait(&done, std::chrono::milliseconds(1000));
      for (const ReadDone& d : done) {
        if (!d.status.ok()) {
          state.SkipWithError(d.status.ToString().c_str());
          break;
        }
        finished.push_back(d.id);
      }
      if (state.error_occurred()) break;
    }
    if (state.error_occurred()) break;
    bytes += read_bytes;
    const uint64_t slot = finished.front();
    finished.pop_front();
    submit(slot);
  }
  // Drain what is still in flight (after the timed loop) before the reader goes.
  while (reader.pending() > 0) {
    done.clear();
    reader.Wait(&done, std::chrono::milliseconds(1000));
  }
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  // Printed "GB=1.23/s": 1e9 bytes per second.
  state.counters["GB"] =
      benchmark::Counter(static_cast<double>(bytes) / 1e9, benchmark::Counter::kIsRate);
}

// One region of `rows` x `cols` elements of `elem_bytes`, split `ways` ways into an expert buffer.
void BM_Scatter(benchmark::State& state, bool by_columns, uint64_t rows, uint64_t cols,
                uint32_t elem_bytes, uint32_t ways) {
  const uint64_t bytes = rows * cols * elem_bytes;
  RegionSplit split{by_columns, rows, cols, elem_bytes, {}};
  for (uint32_t p = 0; p < ways; ++p) split.part_dst.push_back(p * (bytes / ways));
  std::vector<char> region(bytes);
  std::mt19937_64 rng(3);
  for (char& c : region) c = static_cast<char>(rng());
  std::vector<char> expert(bytes);
  for (auto _ : state) {
    ScatterRegion(split, region.data(), expert.data());
    benchmark::DoNotOptimize(expert.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["GB"] = benchmark::Counter(static_cast<double>(state.iterations() * bytes) / 1e9,
                                            benchmark::Counter::kIsRate);
}

void RegisterAll() {
  constexpr uint64_t kH = 2880, kI = 2880;
  benchmark::RegisterBenchmark("Scatter/mxfp4_gate_up_blocks", BM_Scatter, false, 2 * kI,
                               kH / 32 * 16, 1, 2)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("Scatter/bf16_gate_up", BM_Scatter, true, kH, 2 * kI, 2, 2)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("Scatter/bf16_down", BM_Scatter, true, kI, kH, 2, 1)
      ->Unit(benchmark::kMillisecond);
  // The floor: gate_up's bytes copied as they are (rows split 1 way).
  benchmark::RegisterBenchmark("Scatter/copy_bf16_gate_up", BM_Scatter, false, kH, 2 * kI, 2, 1)
      ->Unit(benchmark::kMillisecond);
  for (const std::string backend : {"threads", "io_uring"}) {
    for (const uint64_t mib : {8, 64}) {
      const std::string name = "DiskRead/" + backend + "/" + std::to_string(mib) + "MiB";
      benchmark::RegisterBenchmark(name.c_str(), BM_DiskRead, backend, mib * kMiB)
          ->ArgName("qd")
          ->Arg(1)
          ->Arg(2)
          ->Arg(4)
          ->Arg(8)
          ->Arg(16)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace
}  // namespace fmoe

int main(int argc, char** argv) {
  using namespace fmoe;
  spdlog::set_level(spdlog::level::warn);
  // Our flags first; the rest go to Google Benchmark.
  std::vector<char*> rest = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--file" && i + 1 < argc) {
      g_path = argv[++i];
    } else if (arg == "--chunk_bytes" && i + 1 < argc) {
      g_chunk_bytes = std::strtoull(argv[++i], nullptr, 10);
    } else if (arg.rfind("--file=", 0) == 0) {
      g_path = arg.substr(7);
    } else if (arg.rfind("--chunk_bytes=", 0) == 0) {
      g_chunk_bytes = std::strtoull(arg.c_str() + 14, nullptr, 10);
    } else {
      rest.push_back(argv[i]);
    }
  }
  benchmark::AddCustomContext("chunk_bytes", std::to_string(g_chunk_bytes));
  RegisterAll();
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  if (benchmark::ReportUnrecognizedArguments(rest_argc, rest.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (g_created) ::unlink(g_path.c_str());
  return 0;
}
