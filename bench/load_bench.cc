// load_bench: loading a checkpoint the way the worker does: Checkpoint::Open, then every tensor
// through TensorLoader into the compute dtype, every tensor kept (as the model keeps them), in
// the files' order. Prints the checkpoint's bytes, the seconds and GB/s of the loads, and the
// peak resident memory (VmHWM) against the checkpoint's bytes, with the resident memory before
// the load (LibTorch itself) for reference. One load per process: the peak is the process's.
//
//   build/bin/load_bench --model /tmp/mixtral-1l --dtype bfloat16
//   build/bin/load_bench --model /tmp/mixtral-1l --dtype float32 --cold
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include "common/log.h"
#include "common/model/checkpoint.h"
#include "common/model/safetensors.h"
#include "gpu_worker/model/tensor_loader.h"

namespace {

namespace fs = std::filesystem;

// A "Vm...:" line of /proc/self/status, in bytes (0 when absent).
uint64_t ProcStatusBytes(const std::string& key) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key + ":", 0) == 0) return std::stoull(line.substr(key.size() + 1)) * 1024;
  }
  return 0;
}

// Drops the page cache of every *.safetensors file in `dir` (clean pages only; no root needed),
// so the load reads from the disk.
void DropPageCache(const std::string& dir) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    const int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

double Gb(uint64_t bytes) { return static_cast<double>(bytes) / 1e9; }

}  // namespace

int main(int argc, char** argv) {
  // Logs go to stderr: stdout carries the tables.
  if (fmoe::Status s = fmoe::InitLogging("load_bench", "info"); !s.ok()) return 2;
  using namespace fmoe;
  CLI::App app{"load_bench: checkpoint load rate and peak resident memory"};
  std::string model_dir;
  std::string dtype_name = "bfloat16";
  std::string device_name = "cpu";
  int threads = 0;
  bool cold = false;
  app.add_option("--model", model_dir, "checkpoint directory")->required();
  app.add_option("--dtype", dtype_name, "compute dtype: bfloat16, float16 or float32")
      ->capture_default_str();
  app.add_option("--device", device_name, "cpu or cuda:N")->capture_default_str();
  app.add_option("--threads", threads, "intra-op threads, 0 = LibTorch default");
  app.add_flag("--cold", cold, "drop the files' page cache first (posix_fadvise)");
  CLI11_PARSE(app, argc, argv);

  at::ScalarType dtype = at::kBFloat16;
  if (dtype_name == "float32") {
    dtype = at::kFloat;
  } else if (dtype_name == "float16") {
    dtype = at::kHalf;
  } else if (dtype_name != "bfloat16") {
    std::fprintf(stderr, "load_bench: --dtype: \"%s\" is not bfloat16, float16 or float32\n",
                 dtype_name.c_str());
    return 2;
  }
  if (threads > 0) at::set_num_threads(threads);
  const at::Device device(device_name);
  if (cold) DropPageCache(model_dir);

  const uint64_t rss_before = ProcStatusBytes("VmRSS");
  const auto start = std::chrono::steady_clock::now();
  auto ckpt = Checkpoint::Open(model_dir);
  if (!ckpt.ok()) {
    std::fprintf(stderr, "load_bench: %s\n", ckpt.status().ToString().c_str());
    return 1;
  }
  std::vector<const TensorView*> views;
  for (const std::string& name : (*ckpt)->TensorNames()) views.push_back((*ckpt)->Find(name));
  std::sort(views.begin(), views.end(), [&](const TensorView* a, const TensorView* b) {
    const std::string fa = (*ckpt)->FileOf(a->name), fb = (*ckpt)->FileOf(b->name);
    return fa != fb ? fa < fb : a->data.data() < b->data.data();
  });

  const LoadProgress progress;
  TensorLoader loader(**ckpt, dtype, device, progress);
  std::vector<at::Tensor> kept;
  kept.reserve(views.size());
  uint64_t tensor_bytes = 0;
  for (const TensorView* view : views) {
    auto t = loader.Load(view->name, view->shape);
    if (!t.ok()) {
      std::fprintf(stderr, "load_bench: %s\n", t.status().ToString().c_str());
      return 1;
    }
    tensor_bytes += static_cast<uint64_t>(t->nbytes());
    kept.push_back(*std::move(t));
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const uint64_t peak = ProcStatusBytes("VmHWM");
  const uint64_t rss_after = ProcStatusBytes("VmRSS");
  const uint64_t bytes = (*ckpt)->total_bytes();

  std::printf("model: %s (%zu tensors, %s)\n", (*ckpt)->dir().c_str(), views.size(),
              cold ? "cold: page cache dropped" : "warm page cache");
  std::printf("compute: %s on %s, %d threads\n", dtype_name.c_str(), device_name.c_str(),
              at::get_num_threads());
  std::printf("checkpoint bytes: %llu (%.2f GB)\n", static_cast<unsigned long long>(bytes),
              Gb(bytes));
  std::printf("loaded tensor bytes: %llu (%.2f GB)\n",
              static_cast<unsigned long long>(tensor_bytes), Gb(tensor_bytes));
  std::printf("seconds: %.2f\n", seconds);
  std::printf("GB/s: %.2f (checkpoint bytes / seconds)\n", Gb(bytes) / seconds);
  std::printf("rss before: %.2f GB; after: %.2f GB\n", Gb(rss_before), Gb(rss_after));
  std::printf("peak rss: %.2f GB = %.3f x checkpoint bytes (%.3f x without the rss before)\n",
              Gb(peak), static_cast<double>(peak) / static_cast<double>(bytes),
              static_cast<double>(peak - rss_before) / static_cast<double>(bytes));
  return 0;
}
