#include "gpu_worker/cache/transfer/transfer_engine.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/gpu_worker/transfer_waits.h"

namespace fmoe {
namespace {

using std::chrono::milliseconds;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::unique_ptr<TransferEngine> MakeLink(double gbps, double latency_us, size_t chunk_bytes) {
  LinkOptions options;
  options.gbps = gbps;
  options.latency_us = latency_us;
  options.chunk_bytes = chunk_bytes;
  auto link = NewEmulatedLink(options);
  EXPECT_TRUE(link.ok()) << link.status().ToString();
  return std::move(link).value();
}

// Random host bytes and an emulated device slot of the same size.
struct Buffer {
  Buffer(TransferEngine* link, size_t bytes, uint64_t seed) : link(link), src(bytes) {
    std::mt19937_64 rng(seed);
    for (size_t i = 0; i < bytes; i += 8) {
      const uint64_t v = rng();
      std::memcpy(src.data() + i, &v, std::min<size_t>(8, bytes - i));
    }
    auto p = link->AllocateDevice(bytes);
    EXPECT_TRUE(p.ok());
    dst = static_cast<uint8_t*>(*p);
  }
  ~Buffer() { link->FreeDevice(dst); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  TransferTask Task(uint64_t id, bool on_demand = false, double priority = 0.0) const {
    TransferTask t;
    t.id = id;
    t.src = src.data();
    t.dst = dst;
    t.bytes = src.size();
    t.on_demand = on_demand;
    t.priority = priority;
    return t;
  }
  bool Arrived(size_t bytes) const {
    return bytes == 0 || std::memcmp(src.data(), dst, bytes) == 0;
  }
  bool Arrived() const { return Arrived(src.size()); }

  TransferEngine* link;
  std::vector<uint8_t> src;
  uint8_t* dst = nullptr;
};

// Collects `n` completions, or what arrived within 5000 ms.
std::vector<TransferDone> WaitFor(TransferEngine* link, size_t n,
                                  milliseconds limit = milliseconds(5000)) {
  return testing::WaitFor(link, n, limit);
}

using testing::Ids;

// Blocks until the link has copied some bytes of the running task.
void WaitUntilCopying(TransferEngine* link, uint64_t bytes_before = 0) {
  const int64_t give_up = NowNs() + 2'000'000'000;
  while (link->stats().bytes_copied <= bytes_before && NowNs() < give_up) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

TEST(EmulatedLink, RejectsInvalidOptions) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (double gbps : {0.0, -1.0, nan, inf}) {
    LinkOptions o;
    o.gbps = gbps;
    auto link = NewEmulatedLink(o);
    ASSERT_FALSE(link.ok()) << gbps;
    EXPECT_EQ(link.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(link.status().message().rfind("link: gbps", 0), 0u) << link.status().message();
  }
  for (double latency : {-1.0, nan, inf}) {
    LinkOptions o;
    o.latency_us = latency;
    auto link = NewEmulatedLink(o);
    ASSERT_FALSE(link.ok()) << latency;
    EXPECT_EQ(link.status().message().rfind("link: latency_us", 0), 0u);
  }
  LinkOptions o;
  o.chunk_bytes = 4095;
  auto link = NewEmulatedLink(o);
  ASSERT_FALSE(link.ok());
  EXPECT_EQ(link.status().message().rfind("link: chunk_bytes", 0), 0u);
  o.chunk_bytes = 4096;
  o.latency_us = 0;
  EXPECT_TRUE(NewEmulatedLink(o).ok());
}

TEST(EmulatedLink, AllocatesAlignedDeviceMemory) {
  auto link = MakeLink(16, 10, 256 << 10);
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{100}, size_t{1} << 20}) {
    auto p = link->AllocateDevice(bytes);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(*p) % 64, 0u);
    link->FreeDevice(*p);
  }
  EXPECT_EQ(link->name(), "emulated");
  EXPECT_EQ(link->RecordComputeFence(), 0u);
}

TEST(EmulatedLink, CopiesBytesIntact) {
  auto link = MakeLink(50, 0, 16 << 10);
  const std::vector<size_t> sizes = {0, 1, 4095, 16 << 10, (16 << 10) + 1, 100'000, (3 << 20) + 17};
  std::vector<std::unique_ptr<Buffer>> buffers;
  const int64_t before = NowNs();
  for (size_t i = 0; i < sizes.size(); ++i) {
    buffers.push_back(std::make_unique<Buffer>(link.get(), sizes[i], i));
    link->Submit(buffers.back()->Task(i, /*on_demand=*/false, /*priority=*/static_cast<double>(i)));
  }
  std::vector<TransferDone> done = WaitFor(link.get(), sizes.size());
  ASSERT_EQ(done.size(), sizes.size());
  size_t total = 0;
  for (const TransferDone& d : done) {
    ASSERT_LT(d.id, sizes.size());
    EXPECT_FALSE(d.cancelled);
    EXPECT_EQ(d.bytes_copied, sizes[d.id]);
    EXPECT_TRUE(buffers[d.id]->Arrived()) << "size " << sizes[d.id];
    EXPECT_GE(d.submit_ns, before);
    EXPECT_GE(d.start_ns, d.submit_ns);
    EXPECT_GE(d.end_ns, d.start_ns);
    total += sizes[d.id];
  }
  const TransferStats stats = link->stats();
  EXPECT_EQ(stats.tasks_done, sizes.size());
  EXPECT_EQ(stats.tasks_cancelled, 0u);
  EXPECT_EQ(stats.bytes_copied, total);
  EXPECT_EQ(stats.preemptions, 0u);
  EXPECT_GT(stats.busy_ns, 0);
}

TEST(EmulatedLink, PacesToLatencyPlusBandwidth) {
  const double gbps = 1.0;
  const double latency_us = 2000;
  auto link = MakeLink(gbps, latency_us, 256 << 10);
  Buffer big(link.get(), 8 << 20, 1);
  Buffer empty(link.get(), 0, 2);
  link->Submit(big.Task(1, true));
  link->Submit(empty.Task(2, true));
  std::vector<TransferDone> done = WaitFor(link.get(), 2);
  ASSERT_EQ(Ids(done), (std::vector<uint64_t>{1, 2}));
  EXPECT_TRUE(big.Arrived());

  const double paced_ns = latency_us * 1e3 + static_cast<double>(big.src.size()) / gbps;
  const double took_ns = static_cast<double>(done[0].end_ns - done[0].start_ns);
  EXPECT_GE(took_ns, paced_ns - 1e3);
  EXPECT_LE(took_ns, 3 * paced_ns + 50e6);
  EXPECT_GE(done[0].end_ns - done[0].submit_ns, done[0].end_ns - done[0].start_ns);

  const double empty_ns = static_cast<double>(done[1].end_ns - done[1].start_ns);
  EXPECT_GE(empty_ns, latency_us * 1e3 - 1e3);
  EXPECT_LE(empty_ns, 3 * latency_us * 1e3 + 50e6);
  EXPECT_GE(done[1].start_ns, done[0].end_ns);  // One task at a time.

  EXPECT_GE(static_cast<double>(link->stats().busy_ns), took_ns + empty_ns - 1e3);
}

// A slow link (50 MB/s, 4 KiB chunks: 82 us a chunk) so that a queue builds up behind a 40 ms
// on-demand task.
TEST(EmulatedLink, OrdersOnDemandFirstThenPriorityThenFifo) {
  auto link = MakeLink(0.05, 0, 4096);
  Buffer blocker(link.get(), 2'000'000, 1);
  std::vector<std::unique_ptr<Buffer>> small;
  for (int i = 0; i < 7; ++i) small.push_back(std::make_unique<Buffer>(link.get(), 4096, 10 + i));
  link->Submit(blocker.Task(1, true));
  WaitUntilCopying(link.get());
  link->Submit(small[0]->Task(10, false, 1.0));
  link->Submit(small[1]->Task(11, false, 5.0));
  link->Submit(small[2]->Task(12, false, 1.0));
  link->Submit(small[3]->Task(13, false, 3.0));
  link->Submit(small[4]->Task(20, true));
  link->Submit(small[5]->Task(21, true));
  link->Submit(small[6]->Task(14, false, 5.0));
  std::vector<TransferDone> done = WaitFor(link.get(), 8);
  EXPECT_EQ(Ids(done), (std::vector<uint64_t>{1, 20, 21, 11, 14, 13, 10, 12}));
  for (const auto& b : small) EXPECT_TRUE(b->Arrived());
  EXPECT_EQ(link->stats().preemptions, 0u);
}

// 32 MiB at 0.5 GB/s: a 67 ms prefetch, 64 KiB chunks.
TEST(EmulatedLink, OnDemandPreemptsPrefetchWhichResumesIntact) {
  auto link = MakeLink(0.5, 10, 64 << 10);
  Buffer prefetch(link.get(), 32 << 20, 1);
  Buffer demand(link.get(), 64 << 10, 2);
  link->Submit(prefetch.Task(1, false, 9.0));
  WaitUntilCopying(link.get());
  link->Submit(demand.Task(2, true));
  std::vector<TransferDone> done = WaitFor(link.get(), 2);
  ASSERT_EQ(Ids(done), (std::vector<uint64_t>{2, 1}));
  EXPECT_FALSE(done[1].cancelled);
  EXPECT_EQ(done[1].bytes_copied, prefetch.src.size());
  EXPECT_TRUE(prefetch.Arrived());
  EXPECT_TRUE(demand.Arrived());
  EXPECT_LT(done[1].start_ns, done[0].start_ns);  // The prefetch started first...
  EXPECT_GT(done[1].end_ns, done[0].end_ns);      // ...and ended after the on-demand task.
  EXPECT_EQ(link->stats().preemptions, 1u);
  // Paced time of both plus the latency charged twice (not three times).
  const double paced_ns = 2 * 10e3 + static_cast<double>(32 << 20) / 0.5 + (64 << 10) / 0.5;
  EXPECT_GE(static_cast<double>(done[1].end_ns - done[1].start_ns), paced_ns - 1e3);
}

TEST(EmulatedLink, ParkedPrefetchCompetesByPriority) {
  auto link = MakeLink(0.5, 0, 64 << 10);
  Buffer low(link.get(), 32 << 20, 1);
  Buffer high(link.get(), 64 << 10, 2);
  Buffer demand(link.get(), 1 << 20, 3);
  link->Submit(low.Task(1, false, 1.0));
  WaitUntilCopying(link.get());
  link->Submit(high.Task(2, false, 5.0));  // Waits: prefetches do not preempt each other.
  link->Submit(demand.Task(3, true));      // Parks the low prefetch.
  std::vector<TransferDone> done = WaitFor(link.get(), 3);
  EXPECT_EQ(Ids(done), (std::vector<uint64_t>{3, 2, 1}));
  EXPECT_TRUE(low.Arrived());
  EXPECT_TRUE(high.Arrived());
  EXPECT_TRUE(demand.Arrived());
  EXPECT_EQ(link->stats().preemptions, 1u);
}

TEST(EmulatedLink, PromoteParkedPrefetch) {
  auto link = MakeLink(0.5, 0, 64 << 10);
  Buffer low(link.get(), 32 << 20, 1);
  Buffer high(link.get(), 64 << 10, 2);
  Buffer demand(link.get(), 16 << 20, 3);  // 33 ms: time to promote the parked prefetch.
  link->Submit(low.Task(1, false, 1.0));
  WaitUntilCopying(link.get());
  link->Submit(high.Task(2, false, 5.0));
  link->Submit(demand.Task(3, true));
  const int64_t give_up = NowNs() + 2'000'000'000;
  while (link->stats().preemptions == 0 && NowNs() < give_up) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  link->Promote(1);
  std::vector<TransferDone> done = WaitFor(link.get(), 3);
  EXPECT_EQ(Ids(done), (std::vector<uint64_t>{3, 1, 2}));
  EXPECT_TRUE(low.Arrived());
  EXPECT_EQ(link->stats().preemptions, 1u);
}

TEST(EmulatedLink, PromoteQueuedPrefetch) {
  auto link = MakeLink(0.05, 0, 4096);
  Buffer blocker(link.get(), 2'000'000, 1);
  Buffer a(link.get(), 4096, 2);
  Buffer b(link.get(), 4096, 3);
  Buffer c(link.get(), 4096, 4);
  Buffer d(link.get(), 4096, 5);
  link->Submit(blocker.Task(1, true));
  WaitUntilCopying(link.get());
  link->Submit(a.Task(2, false, 5.0));
  link->Submit(b.Task(3, true));
  link->Submit(c.Task(4, false, 1.0));
  link->Submit(d.Task(5, false, 1.0));
  link->Promote(5);  // Joins the on-demand tasks behind 3.
  link->Promote(3);  // Already on-demand: no effect.
  std::vector<TransferDone> done = WaitFor(link.get(), 5);
  EXPECT_EQ(Ids(done), (std::vector<uint64_t>{1, 3, 5, 2, 4}));
}

TEST(EmulatedLink, PromotedCurrentPrefetchIsNotParked) {
  auto link = MakeLink(0.5, 0, 64 << 10);
  Buffer prefetch(link.get(), 16 << 20, 1);
  Buffer demand(link.get(), 64 << 10, 2);
  link->Submit(prefetch.Task(1, false, 1.0));
  WaitUntilCopying(link.get());
  link->Promote(1);
  link->Submit(demand.Task(2, true));
  std::vector<TransferDone> done = WaitFor(link.get(), 2);
  EXPECT_EQ(Ids(done), (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(link->stats().preemptions, 0u);
  EXPECT_TRUE(prefetch.Arrived());
}

TEST(EmulatedLink, CancelQueuedTaskFinishesAtOnce) {
  auto link = MakeLink(0.05, 0, 4096);
  Buffer blocker(link.get(), 2'000'000, 1);
  Buffer queued(link.get(), 4096, 2);
  Buffer kept(link.get(), 4096, 3);
  link->Submit(blocker.Task(1, true));
  WaitUntilCopying(link.get());
  link->Submit(queued.Task(2, false, 1.0));
  link->Submit(kept.Task(3, false, 1.0));
  link->Cancel(2);
  std::vector<TransferDone> done;
  ASSERT_EQ(link->Poll(&done), 1u);  // Before the 40 ms blocker is through.
  EXPECT_EQ(done[0].id, 2u);
  EXPECT_TRUE(done[0].cancelled);
  EXPECT_EQ(done[0].bytes_copied, 0u);
  EXPECT_EQ(done[0].start_ns, done[0].end_ns);
  link->Cancel(2);   // Finished: no effect.
  link->Cancel(99);  // Unknown: no effect.
  link->Promote(99);
  done = WaitFor(link.get(), 2);
  EXPECT_EQ(Ids(done), (std::vector<uint64_t>{1, 3}));
  for (const TransferDone& d : done) EXPECT_FALSE(d.cancelled);
  EXPECT_TRUE(kept.Arrived());
  const TransferStats stats = link->stats();
  EXPECT_EQ(stats.tasks_done, 2u);
  EXPECT_EQ(stats.tasks_cancelled, 1u);
}

TEST(EmulatedLink, CancelInProgressStopsAtChunkBoundary) {
  auto link = MakeLink(0.5, 0, 64 << 10);
  Buffer big(link.get(), 32 << 20, 1);
  link->Submit(big.Task(1, false, 1.0));
  WaitUntilCopying(link.get());
  const int64_t cancel_ns = NowNs();
  link->Cancel(1);
  std::vector<TransferDone> done = WaitFor(link.get(), 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].cancelled);
  EXPECT_GT(done[0].bytes_copied, 0u);
  EXPECT_LT(done[0].bytes_copied, big.src.size());
  EXPECT_EQ(done[0].bytes_copied % (64 << 10), 0u);
  EXPECT_TRUE(big.Arrived(done[0].bytes_copied));
  EXPECT_LT(done[0].end_ns - cancel_ns, 50'000'000);  // A chunk is 131 us; the task 67 ms.
  const TransferStats stats = link->stats();
  EXPECT_EQ(stats.tasks_cancelled, 1u);
  EXPECT_EQ(stats.bytes_copied, done[0].bytes_copied);
  std::vector<TransferDone> more;
  EXPECT_EQ(link->Wait(&more, milliseconds(10'000)), 0u);  // Nothing left: at once.
}

TEST(EmulatedLink, CancelParkedTaskKeepsItsProgress) {
  auto link = MakeLink(0.5, 0, 64 << 10);
  Buffer prefetch(link.get(), 32 << 20, 1);
  Buffer demand(link.get(), 16 << 20, 2);
  link->Submit(prefetch.Task(1, false, 1.0));
  WaitUntilCopying(link.get());
  link->Submit(demand.Task(2, true));
  const int64_t give_up = NowNs() + 2'000'000'000;
  while (link->stats().preemptions == 0 && NowNs() < give_up) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  link->Cancel(1);
  std::vector<TransferDone> done;
  ASSERT_EQ(link->Poll(&done), 1u);
  EXPECT_EQ(done[0].id, 1u);
  EXPECT_TRUE(done[0].cancelled);
  EXPECT_GT(done[0].bytes_copied, 0u);
  EXPECT_LT(done[0].bytes_copied, prefetch.src.size());
  EXPECT_LT(done[0].start_ns, done[0].end_ns);
  done = WaitFor(link.get(), 1);
  EXPECT_EQ(Ids(done), (std::vector<uint64_t>{2}));
  EXPECT_TRUE(demand.Arrived());
}

TEST(EmulatedLink, WaitReturnsAtOnceWithNothingPending) {
  auto link = MakeLink(16, 10, 256 << 10);
  std::vector<TransferDone> done;
  int64_t t0 = NowNs();
  EXPECT_EQ(link->Wait(&done, milliseconds(10'000)), 0u);
  EXPECT_EQ(link->Poll(&done), 0u);
  EXPECT_LT(NowNs() - t0, 1'000'000'000);
  EXPECT_TRUE(done.empty());

  // Finished but not drained: Wait returns it at once.
  Buffer b(link.get(), 4096, 1);
  link->Submit(b.Task(7));
  while (link->stats().tasks_done == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
  t0 = NowNs();
  EXPECT_EQ(link->Wait(&done, milliseconds(10'000)), 1u);
  EXPECT_EQ(link->Wait(&done, milliseconds(10'000)), 0u);
  EXPECT_LT(NowNs() - t0, 1'000'000'000);
}

TEST(EmulatedLink, WaitTimesOutWhileTheLinkIsBusy) {
  auto link = MakeLink(0.05, 0, 4096);
  Buffer blocker(link.get(), 2'000'000, 1);
  link->Submit(blocker.Task(1, true));
  std::vector<TransferDone> done;
  const int64_t t0 = NowNs();
  EXPECT_EQ(link->Wait(&done, milliseconds(5)), 0u);
  EXPECT_GE(NowNs() - t0, 4'000'000);
  EXPECT_EQ(WaitFor(link.get(), 1).size(), 1u);
}

TEST(EmulatedLink, DestructorDropsQueuedTasks) {
  auto pool = MakeLink(16, 10, 256 << 10);  // Owns the buffers, which outlive `link`.
  Buffer a(pool.get(), 1 << 20, 1);
  Buffer b(pool.get(), 1 << 20, 2);
  auto link = MakeLink(0.01, 0, 4096);
  link->Submit(a.Task(1, true));
  link->Submit(b.Task(2, false, 1.0));
  WaitUntilCopying(link.get());
  const int64_t t0 = NowNs();
  link.reset();
  EXPECT_LT(NowNs() - t0, 500'000'000);  // The first task alone would take 105 ms.
}

}  // namespace
}  // namespace fmoe
