// The CUDA transfer engine (gpu_worker/cache/transfer/transfer_engine_cuda.cu) on cuda:0, against
// the contract transfer_engine_test.cc checks on the emulated link: copies land byte-exact in
// device memory and on-demand tasks finish in submission order; a task cancelled while queued is
// reported cancelled, never lands, and the tasks after it still do; a copy naming a compute fence
// writes only after the work queued on the legacy default stream before the fence; many tasks in
// flight all land. Torch-free. Label gpu: without a usable GPU every test says "skipped: no GPU"
// (ctest: Skipped).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "gpu_worker/cache/transfer/transfer_engine.h"
#include "tests/gpu_worker/transfer_waits.h"

namespace fmoe {
namespace {

using std::chrono::milliseconds;

// Empty when cuda:0 exists; otherwise why not.
std::string WhyNoCudaDevice() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("no GPU (") + cudaGetErrorString(err) + ")";
  }
  if (count == 0) return "no GPU (the CUDA runtime sees no device)";
  return "";
}

#define FMOE_SKIP_WITHOUT_CUDA_DEVICE()                          \
  if (const std::string why = WhyNoCudaDevice(); !why.empty()) { \
    GTEST_SKIP() << "skipped: " << why;                          \
  }

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

std::unique_ptr<TransferEngine> MakeLink(size_t chunk_bytes) {
  LinkOptions options;
  options.chunk_bytes = chunk_bytes;
  auto link = NewCudaLink(0, options);
  EXPECT_TRUE(link.ok()) << link.status().ToString();
  if (!link.ok()) return nullptr;
  EXPECT_EQ((*link)->name(), "cuda");
  return std::move(link).value();
}

// Random bytes in pinned host memory and a device slot of the same size from the link, zeroed.
struct Buffer {
  Buffer(TransferEngine* link, size_t bytes, uint64_t seed) : link(link), bytes(bytes) {
    EXPECT_EQ(cudaMallocHost(reinterpret_cast<void**>(&src), bytes == 0 ? 1 : bytes), cudaSuccess);
    std::mt19937_64 rng(seed);
    for (size_t i = 0; i < bytes; i += 8) {
      const uint64_t v = rng();
      std::memcpy(src + i, &v, std::min<size_t>(8, bytes - i));
    }
    auto p = link->AllocateDevice(bytes == 0 ? 1 : bytes);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    dst = p.ok() ? *p : nullptr;
    if (dst != nullptr) {
      EXPECT_EQ(cudaMemset(dst, 0, bytes == 0 ? 1 : bytes), cudaSuccess);
    }
  }
  ~Buffer() {
    if (dst != nullptr) link->FreeDevice(dst);
    cudaFreeHost(src);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  TransferTask Task(uint64_t id, bool on_demand = true, double priority = 0.0) const {
    TransferTask t;
    t.id = id;
    t.src = src;
    t.dst = dst;
    t.bytes = bytes;
    t.on_demand = on_demand;
    t.priority = priority;
    return t;
  }
  // The device slot's bytes, copied back.
  std::vector<uint8_t> Device() const {
    std::vector<uint8_t> out(bytes);
    if (bytes > 0) {
      EXPECT_EQ(cudaMemcpy(out.data(), dst, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return out;
  }
  bool Arrived() const {
    const std::vector<uint8_t> got = Device();
    return bytes == 0 || std::memcmp(got.data(), src, bytes) == 0;
  }
  bool StillZero() const {
    for (uint8_t b : Device()) {
      if (b != 0) return false;
    }
    return true;
  }

  TransferEngine* link;
  size_t bytes;
  uint8_t* src = nullptr;
  void* dst = nullptr;
};

// Collects `n` completions, or what arrived within 20000 ms.
std::vector<TransferDone> WaitFor(TransferEngine* link, size_t n,
                                  milliseconds limit = milliseconds(20000)) {
  return testing::WaitFor(link, n, limit);
}

using testing::Ids;

TEST(CudaLink, CopiesLandByteExactInSubmissionOrder) {
  FMOE_SKIP_WITHOUT_CUDA_DEVICE();
  auto link = MakeLink(64 << 10);
  ASSERT_NE(link, nullptr);
  const std::vector<size_t> sizes = {1, 4095, 64 << 10, (64 << 10) + 1, 100'000, (3 << 20) + 17};
  std::vector<std::unique_ptr<Buffer>> buffers;
  std::vector<uint64_t> submitted;
  size_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    buffers.push_back(std::make_unique<Buffer>(link.get(), sizes[i], i + 1));
    ASSERT_NE(buffers.back()->dst, nullptr);
    link->Submit(buffers.back()->Task(i));  // On-demand: FIFO.
    submitted.push_back(i);
    total += sizes[i];
  }
  const std::vector<TransferDone> done = WaitFor(link.get(), sizes.size());
  ASSERT_EQ(Ids(done), submitted);
  for (const TransferDone& d : done) {
    EXPECT_FALSE(d.cancelled) << d.id;
    EXPECT_EQ(d.bytes_copied, sizes[d.id]);
    EXPECT_GE(d.start_ns, d.submit_ns);
    EXPECT_GE(d.end_ns, d.start_ns);
    EXPECT_TRUE(buffers[d.id]->Arrived()) << "size " << sizes[d.id];
  }
  for (size_t i = 1; i < done.size(); ++i) EXPECT_GE(done[i].start_ns, done[i - 1].end_ns);
  const TransferStats stats = link->stats();
  EXPECT_EQ(stats.tasks_done, sizes.size());
  EXPECT_EQ(stats.tasks_cancelled, 0u);
  EXPECT_EQ(stats.bytes_copied, total);
}

// A 512 MiB copy keeps the link busy for milliseconds; a task cancelled right after its Submit is
// still queued behind it.
TEST(CudaLink, ACancelledTaskDoesNotLandAndLaterOnesDo) {
  FMOE_SKIP_WITHOUT_CUDA_DEVICE();
  auto link = MakeLink(1 << 20);
  ASSERT_NE(link, nullptr);
  Buffer blocker(link.get(), size_t{512} << 20, 1);
  Buffer cancelled(link.get(), 1 << 20, 2);
  Buffer after(link.get(), 1 << 20, 3);
  ASSERT_NE(blocker.dst, nullptr);
  ASSERT_NE(cancelled.dst, nullptr);
  ASSERT_NE(after.dst, nullptr);
  link->Submit(blocker.Task(1));
  link->Submit(cancelled.Task(2));
  link->Cancel(2);
  link->Submit(after.Task(3));
  const std::vector<TransferDone> done = WaitFor(link.get(), 3);
  ASSERT_EQ(done.size(), 3u);
  ASSERT_EQ(Ids(done), (std::vector<uint64_t>{2, 1, 3}));  // A queued cancel is reported at once.
  EXPECT_TRUE(done[0].cancelled);
  EXPECT_EQ(done[0].bytes_copied, 0u);
  EXPECT_EQ(done[0].start_ns, done[0].end_ns);  // Never started.
  EXPECT_FALSE(done[1].cancelled);
  EXPECT_FALSE(done[2].cancelled);
  EXPECT_TRUE(blocker.Arrived());
  EXPECT_TRUE(cancelled.StillZero());
  EXPECT_TRUE(after.Arrived());
  const TransferStats stats = link->stats();
  EXPECT_EQ(stats.tasks_done, 2u);
  EXPECT_EQ(stats.tasks_cancelled, 1u);
  link->Cancel(3);   // Finished: no effect.
  link->Cancel(99);  // Unknown: no effect.
  std::vector<TransferDone> more;
  EXPECT_EQ(link->Poll(&more), 0u);
}

// The compute stream (the legacy default stream, LibTorch's) first runs long device-to-device
// copies, then fills the slot with 0xAB; the fence comes after. The link's copy into the slot
// names the fence, so it writes after the fill: the slot ends with the host bytes. Without the
// fence the copy (on the link's non-blocking stream) would land first and the fill overwrite it.
TEST(CudaLink, AFencedCopyWritesAfterTheComputeStreamsEarlierWork) {
  FMOE_SKIP_WITHOUT_CUDA_DEVICE();
  auto link = MakeLink(256 << 10);
  ASSERT_NE(link, nullptr);
  Buffer slot(link.get(), 4 << 20, 7);
  ASSERT_NE(slot.dst, nullptr);
  const size_t scratch_bytes = size_t{256} << 20;
  void* a = nullptr;
  void* b = nullptr;
  ASSERT_CUDA(cudaMalloc(&a, scratch_bytes));
  ASSERT_CUDA(cudaMalloc(&b, scratch_bytes));
  ASSERT_CUDA(cudaMemset(a, 1, scratch_bytes));
  ASSERT_CUDA(cudaDeviceSynchronize());
  for (int i = 0; i < 32; ++i) {
    ASSERT_CUDA(cudaMemcpyAsync(i % 2 == 0 ? b : a, i % 2 == 0 ? a : b, scratch_bytes,
                                cudaMemcpyDeviceToDevice, cudaStreamLegacy));
  }
  ASSERT_CUDA(cudaMemsetAsync(slot.dst, 0xAB, slot.bytes, cudaStreamLegacy));
  const uint64_t fence = link->RecordComputeFence();
  ASSERT_NE(fence, 0u);
  TransferTask t = slot.Task(1);
  t.wait_fence = fence;
  link->Submit(t);
  const std::vector<TransferDone> done = WaitFor(link.get(), 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].cancelled);
  EXPECT_EQ(done[0].bytes_copied, slot.bytes);
  ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_TRUE(slot.Arrived()) << "the fill on the compute stream overwrote the copy";
  cudaFree(a);
  cudaFree(b);
}

// 200 tasks, prefetches of mixed priority and on-demand ones, all in flight at once: every one
// lands byte-exact and is reported once.
TEST(CudaLink, ManyTasksInFlightAllLand) {
  FMOE_SKIP_WITHOUT_CUDA_DEVICE();
  auto link = MakeLink(64 << 10);
  ASSERT_NE(link, nullptr);
  constexpr size_t kTasks = 200;
  std::vector<std::unique_ptr<Buffer>> buffers;
  size_t total = 0;
  for (size_t i = 0; i < kTasks; ++i) {
    const size_t bytes = (100 << 10) + 977 * i;
    buffers.push_back(std::make_unique<Buffer>(link.get(), bytes, 100 + i));
    ASSERT_NE(buffers.back()->dst, nullptr);
    total += bytes;
  }
  for (size_t i = 0; i < kTasks; ++i) {
    link->Submit(
        buffers[i]->Task(i, /*on_demand=*/i % 5 == 0, /*priority=*/static_cast<double>(i % 7)));
  }
  const std::vector<TransferDone> done = WaitFor(link.get(), kTasks, milliseconds(60000));
  ASSERT_EQ(done.size(), kTasks);
  std::vector<int> seen(kTasks, 0);
  for (const TransferDone& d : done) {
    ASSERT_LT(d.id, kTasks);
    ++seen[d.id];
    EXPECT_FALSE(d.cancelled) << d.id;
    EXPECT_EQ(d.bytes_copied, buffers[d.id]->bytes);
  }
  for (size_t i = 0; i < kTasks; ++i) {
    EXPECT_EQ(seen[i], 1) << i;
    EXPECT_TRUE(buffers[i]->Arrived()) << i;
  }
  const TransferStats stats = link->stats();
  EXPECT_EQ(stats.tasks_done, kTasks);
  EXPECT_EQ(stats.bytes_copied, total);
}

}  // namespace
}  // namespace fmoe
