#include "gpu_worker/cache/store/disk_reader.h"

#include <fcntl.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

constexpr size_t kChunk = 64 << 10;
constexpr uint64_t kFileBytes = (6 << 20) + 123;  // Its end is not 4096-aligned.
constexpr uint8_t kGuard = 0xA5;

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> bytes(n);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(bytes.data() + i, &v, std::min<size_t>(8, n - i));
  }
  return bytes;
}

void WriteFile(const fs::path& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// Collects `n` finished reads, or what arrived within 10 s.
std::vector<ReadDone> WaitFor(DiskReader* reader, size_t n) {
  std::vector<ReadDone> done;
  const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (done.size() < n && std::chrono::steady_clock::now() < limit) {
    reader->Wait(&done, milliseconds(100));
  }
  return done;
}

std::map<uint64_t, ReadDone> ById(const std::vector<ReadDone>& done) {
  std::map<uint64_t, ReadDone> by_id;
  for (const ReadDone& d : done) by_id[d.id] = d;
  return by_id;
}

// A destination with guard bytes around it, `misalign` bytes past an aligned address.
struct Dest {
  Dest(size_t bytes, size_t misalign) : bytes(bytes), misalign(misalign) {
    storage.assign(bytes + misalign + 128, kGuard);
  }
  uint8_t* data() { return storage.data() + 64 + misalign; }
  bool GuardsIntact() const {
    for (size_t i = 0; i < 64 + misalign; ++i) {
      if (storage[i] != kGuard) return false;
    }
    for (size_t i = 64 + misalign + bytes; i < storage.size(); ++i) {
      if (storage[i] != kGuard) return false;
    }
    return true;
  }
  size_t bytes;
  size_t misalign;
  std::vector<uint8_t> storage;
};

class DiskReaderTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ =
        fs::temp_directory_path() / ("fmoe-disk-reader-" + std::to_string(getpid()) + "-" + name);
    fs::create_directories(dir_);
    path_ = dir_ / "shard.bin";
    bytes_ = RandomBytes(kFileBytes, 42);
    WriteFile(path_, bytes_);

    DiskReaderOptions probe;
    probe.backend = GetParam();
    auto reader = DiskReader::Create(probe);
    if (!reader.ok() && GetParam() == "io_uring") {
      GTEST_SKIP() << "io_uring is unavailable here: " << reader.status().ToString();
    }
    ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::unique_ptr<DiskReader> Make(uint32_t queue_depth, size_t chunk_bytes = kChunk) {
    DiskReaderOptions options;
    options.backend = GetParam();
    options.queue_depth = queue_depth;
    options.chunk_bytes = chunk_bytes;
    auto reader = DiskReader::Create(options);
    EXPECT_TRUE(reader.ok()) << reader.status().ToString();
    if (!reader.ok()) return nullptr;
    EXPECT_EQ((*reader)->backend(), GetParam());
    return std::move(reader).value();
  }

  fs::path dir_;
  fs::path path_;
  std::vector<uint8_t> bytes_;
};

struct Range {
  uint64_t offset;
  size_t bytes;
};

TEST_P(DiskReaderTest, ReadsExactBytesAtAnyOffsetLengthAndDestination) {
  for (const size_t chunk : {size_t{4096}, kChunk}) {
    SCOPED_TRACE("chunk_bytes=" + std::to_string(chunk));
    auto reader = Make(4, chunk);
    ASSERT_NE(reader, nullptr);
    auto file = reader->AddFile(path_.string());
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    std::vector<Range> ranges = {
        {0, 1},
        {1, 1},
        {4095, 1},
        {4096, 4095},
        {123, 4097},
        {5000, chunk + 1},
        {chunk - 1, 3 * chunk + 7},
        {0, kFileBytes},  // The whole file, its unaligned end included.
        {kFileBytes - 1, 1},
        {kFileBytes - 10000, 10000},
        {8192, 8192},
    };
    std::mt19937_64 rng(7);
    for (int i = 0; i < 100; ++i) {
      const uint64_t offset = rng() % kFileBytes;
      ranges.push_back({offset, 1 + rng() % std::min<uint64_t>(kFileBytes - offset, 300000)});
    }
    std::vector<std::unique_ptr<Dest>> dests;
    for (size_t i = 0; i < ranges.size(); ++i) {
      dests.push_back(std::make_unique<Dest>(ranges[i].bytes, i % 8));
      reader->Submit(i, *file, ranges[i].offset, ranges[i].bytes, dests[i]->data(), i % 5 == 0);
    }
    EXPECT_EQ(reader->pending(), ranges.size());
    const auto done = ById(WaitFor(reader.get(), ranges.size()));
    ASSERT_EQ(done.size(), ranges.size());
    EXPECT_EQ(reader->pending(), 0u);
    for (size_t i = 0; i < ranges.size(); ++i) {
      SCOPED_TRACE("read " + std::to_string(i) + " [" + std::to_string(ranges[i].offset) + ", +" +
                   std::to_string(ranges[i].bytes) + ")");
      const ReadDone& d = done.at(i);
      ASSERT_TRUE(d.status.ok()) << d.status.ToString();
      EXPECT_EQ(std::memcmp(dests[i]->data(), bytes_.data() + ranges[i].offset, ranges[i].bytes),
                0);
      EXPECT_TRUE(dests[i]->GuardsIntact());
      EXPECT_LE(d.submit_ns, d.start_ns);
      EXPECT_LE(d.start_ns, d.end_ns);
    }
  }
}

TEST_P(DiskReaderTest, UrgentReadsOvertakeQueuedOnes) {
  auto reader = Make(1);
  ASSERT_NE(reader, nullptr);
  auto file = reader->AddFile(path_.string());
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  constexpr size_t kReads = 64;
  constexpr size_t kReadBytes = 8 * kChunk;
  std::vector<std::vector<uint8_t>> dests(kReads + 2, std::vector<uint8_t>(kReadBytes));
  for (size_t i = 0; i < kReads; ++i) {
    const uint64_t offset = (i * kReadBytes) % (kFileBytes - kReadBytes);
    reader->Submit(i, *file, offset, kReadBytes, dests[i].data(), false);
  }
  // Two urgent reads, submitted last: FIFO between them, ahead of every queued normal read.
  reader->Submit(1000, *file, 777, kReadBytes, dests[kReads].data(), true);
  reader->Submit(1001, *file, 4096, kReadBytes, dests[kReads + 1].data(), true);
  const std::vector<ReadDone> order = WaitFor(reader.get(), kReads + 2);
  ASSERT_EQ(order.size(), kReads + 2);
  std::vector<uint64_t> ids;
  for (const ReadDone& d : order) {
    ASSERT_TRUE(d.status.ok()) << d.status.ToString();
    ids.push_back(d.id);
  }
  const auto pos = [&](uint64_t id) { return std::find(ids.begin(), ids.end(), id) - ids.begin(); };
  EXPECT_LT(pos(1000), pos(1001));
  const auto by_id = ById(order);
  const ReadDone& urgent = by_id.at(1000);
  const ReadDone& urgent2 = by_id.at(1001);
  // A normal read that had not started when an urgent one came starts after it ended (one chunk
  // in flight at a time; a started read is not preempted).
  size_t overtaken = 0;
  for (size_t i = 0; i < kReads; ++i) {
    const ReadDone& d = by_id.at(i);
    for (const ReadDone* u : {&urgent, &urgent2}) {
      if (d.start_ns > u->submit_ns) {
        EXPECT_GE(d.start_ns, u->end_ns) << "read " << i;
      }
    }
    if (d.start_ns > urgent.submit_ns) ++overtaken;
  }
  // Normal reads are FIFO.
  for (size_t i = 1; i < kReads; ++i) EXPECT_LT(pos(i - 1), pos(i));
  EXPECT_GE(overtaken, kReads / 2) << "the queued reads finished before the urgent ones came";
  EXPECT_LE(pos(1001), static_cast<ptrdiff_t>(kReads - overtaken + 1));
  EXPECT_EQ(std::memcmp(dests[kReads].data(), bytes_.data() + 777, kReadBytes), 0);
  EXPECT_EQ(std::memcmp(dests[kReads + 1].data(), bytes_.data() + 4096, kReadBytes), 0);
}

TEST_P(DiskReaderTest, ReadPastTheEndOfATruncatedFileIsDataLoss) {
  auto reader = Make(4);
  ASSERT_NE(reader, nullptr);
  const fs::path short_path = dir_ / "truncated.bin";
  WriteFile(short_path, RandomBytes(1 << 20, 9));
  auto good = reader->AddFile(path_.string());
  auto truncated = reader->AddFile(short_path.string());
  ASSERT_TRUE(good.ok() && truncated.ok());
  constexpr uint64_t kEnd = 300001;
  ASSERT_EQ(::truncate(short_path.c_str(), kEnd), 0);
  std::vector<uint8_t> a(1000), b(2000), c(100), d(kChunk * 3), e(5000);
  reader->Submit(1, *truncated, 0, a.size(), a.data(), false);
  reader->Submit(2, *truncated, kEnd - 1000, b.size(), b.data(), false);  // Crosses the end.
  reader->Submit(3, *truncated, 500000, c.size(), c.data(), false);       // Past the end.
  reader->Submit(4, *truncated, 200000, d.size(), d.data(), true);        // Chunks past the end.
  reader->Submit(5, *good, 12345, e.size(), e.data(), false);
  const auto done = ById(WaitFor(reader.get(), 5));
  ASSERT_EQ(done.size(), 5u);
  EXPECT_TRUE(done.at(1).status.ok()) << done.at(1).status.ToString();
  EXPECT_TRUE(done.at(5).status.ok()) << done.at(5).status.ToString();
  EXPECT_EQ(std::memcmp(e.data(), bytes_.data() + 12345, e.size()), 0);
  const std::string range2 = "bytes [" + std::to_string(kEnd - 1000) + ", " +
                             std::to_string(kEnd + 1000) + "): the file ends at " +
                             std::to_string(kEnd);
  EXPECT_EQ(done.at(2).status.code(), ErrorCode::kDataLoss);
  EXPECT_EQ(done.at(2).status.message(), short_path.string() + ": " + range2);
  for (uint64_t id : {3, 4}) {
    EXPECT_EQ(done.at(id).status.code(), ErrorCode::kDataLoss) << id;
    EXPECT_NE(done.at(id).status.message().find(short_path.string()), std::string::npos);
    EXPECT_NE(done.at(id).status.message().find("the file ends at " + std::to_string(kEnd)),
              std::string::npos)
        << done.at(id).status.message();
  }
  EXPECT_NE(done.at(3).status.message().find("bytes [500000, 500100)"), std::string::npos);
  const DiskReaderStats stats = reader->stats();
  EXPECT_EQ(stats.reads, 5u);
  EXPECT_EQ(stats.failed, 3u);
  EXPECT_EQ(stats.bytes_read, a.size() + e.size());
}

// `then` runs once the bytes are in, off the caller's thread, before its read comes back; the
// disk goes on while it runs; a failed read skips it.
TEST_P(DiskReaderTest, ThenRunsOffTheCallersThreadBeforeItsReadComesBack) {
  auto reader = Make(4);
  ASSERT_NE(reader, nullptr);
  auto file = reader->AddFile(path_.string());
  ASSERT_TRUE(file.ok());
  constexpr uint64_t kAt = 4096 * 3 + 17;
  std::vector<uint8_t> a(kChunk * 2 + 5), b(3000), c(100);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  bool a_ran = false, c_ran = false, a_saw_bytes = false;
  std::thread::id a_thread;
  // The blocked `then` is let go however the test ends (the reader's destructor waits for it).
  auto let_go = [&] {
    {
      std::lock_guard<std::mutex> lock(mu);
      release = true;
    }
    cv.notify_all();
  };
  struct OnExit {
    std::function<void()> f;
    ~OnExit() { f(); }
  } on_exit{let_go};
  reader->Submit(1, *file, kAt, a.size(), a.data(), false, [&] {
    std::unique_lock<std::mutex> lock(mu);
    a_ran = true;
    a_thread = std::this_thread::get_id();
    a_saw_bytes = std::memcmp(a.data(), bytes_.data() + kAt, a.size()) == 0;
    cv.notify_all();
    cv.wait(lock, [&] { return release; });
  });
  // While the first read's `then` blocks, a second read still comes back.
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return a_ran; }));
  }
  reader->Submit(2, *file, 777, b.size(), b.data(), true);
  const auto first = WaitFor(reader.get(), 1);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].id, 2u);
  EXPECT_TRUE(first[0].status.ok()) << first[0].status.ToString();
  EXPECT_EQ(std::memcmp(b.data(), bytes_.data() + 777, b.size()), 0);
  // Past the end of the file: fails, and its `then` does not run.
  reader->Submit(3, *file, kFileBytes + 10, c.size(), c.data(), false, [&] {
    std::lock_guard<std::mutex> lock(mu);
    c_ran = true;
  });
  let_go();
  const auto rest = ById(WaitFor(reader.get(), 2));
  ASSERT_EQ(rest.size(), 2u);
  EXPECT_TRUE(rest.at(1).status.ok()) << rest.at(1).status.ToString();
  EXPECT_EQ(rest.at(3).status.code(), ErrorCode::kDataLoss) << rest.at(3).status.ToString();
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_TRUE(a_saw_bytes);
  EXPECT_NE(a_thread, std::this_thread::get_id());
  EXPECT_FALSE(c_ran);
  EXPECT_EQ(reader->pending(), 0u);
}

TEST_P(DiskReaderTest, BadFileIndexAndZeroLengthFailAtOnce) {
  auto reader = Make(2);
  ASSERT_NE(reader, nullptr);
  auto file = reader->AddFile(path_.string());
  ASSERT_TRUE(file.ok());
  std::vector<uint8_t> dst(100);
  reader->Submit(1, *file + 1, 0, dst.size(), dst.data(), false);
  reader->Submit(2, *file, 0, 0, dst.data(), false);
  std::vector<ReadDone> done;
  EXPECT_EQ(reader->Poll(&done), 2u);
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].status.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(done[0].status.message().find("file index 1"), std::string::npos)
      << done[0].status.message();
  EXPECT_EQ(done[1].status.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(reader->pending(), 0u);
  EXPECT_EQ(reader->stats().failed, 2u);
}

TEST_P(DiskReaderTest, WaitWithNothingPendingReturnsAtOnce) {
  auto reader = Make(2);
  ASSERT_NE(reader, nullptr);
  std::vector<ReadDone> done;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(reader->Wait(&done, milliseconds(5000)), 0u);
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(500));
  EXPECT_EQ(reader->Poll(&done), 0u);
  EXPECT_TRUE(done.empty());
}

TEST_P(DiskReaderTest, StatsCountReadsBytesChunksAndBusyTime) {
  auto reader = Make(3);
  ASSERT_NE(reader, nullptr);
  auto file = reader->AddFile(path_.string());
  ASSERT_TRUE(file.ok());
  std::vector<uint8_t> a(10 * kChunk), b(1), c(kChunk + 1);
  reader->Submit(1, *file, 0, a.size(), a.data(), false);    // 10 chunks.
  reader->Submit(2, *file, 17, b.size(), b.data(), false);   // 1 chunk.
  reader->Submit(3, *file, 4095, c.size(), c.data(), true);  // [0, 2 * kChunk) aligned: 2.
  reader->Submit(4, 9, 0, 10, b.data(), false);
  ASSERT_EQ(WaitFor(reader.get(), 4).size(), 4u);
  const DiskReaderStats stats = reader->stats();
  EXPECT_EQ(stats.reads, 4u);
  EXPECT_EQ(stats.failed, 1u);
  EXPECT_EQ(stats.bytes_read, a.size() + b.size() + c.size());
  EXPECT_EQ(stats.chunks, 13u);
  EXPECT_GT(stats.busy_ns, 0);
}

TEST_P(DiskReaderTest, DestructionWithReadsInFlightJoinsCleanly) {
  std::vector<uint8_t> dst(kFileBytes);
  for (int round = 0; round < 5; ++round) {
    auto reader = Make(4, 4096);
    ASSERT_NE(reader, nullptr);
    auto file = reader->AddFile(path_.string());
    ASSERT_TRUE(file.ok());
    for (uint64_t id = 0; id < 8; ++id) {
      reader->Submit(id, *file, 0, dst.size(), dst.data(), id % 2 == 0);
    }
    if (round % 2 == 1) std::this_thread::sleep_for(milliseconds(1));
  }
}

// tmpfs: O_DIRECT since Linux 6.6, refused before (then read through the page cache).
TEST_P(DiskReaderTest, ReadsATmpfsFile) {
  struct statfs sfs {};
  constexpr long kTmpfsMagic = 0x01021994;
  if (::statfs("/dev/shm", &sfs) != 0 || static_cast<long>(sfs.f_type) != kTmpfsMagic) {
    GTEST_SKIP() << "/dev/shm is not a tmpfs here";
  }
  const fs::path shm = fs::path("/dev/shm") / ("fmoe-disk-reader-" + std::to_string(getpid()));
  const std::vector<uint8_t> bytes = RandomBytes(200000, 3);
  WriteFile(shm, bytes);
  auto reader = Make(2);
  ASSERT_NE(reader, nullptr);
  auto file = reader->AddFile(shm.string());
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  std::vector<uint8_t> dst(150001);
  reader->Submit(1, *file, 33, dst.size(), dst.data(), false);
  const auto done = WaitFor(reader.get(), 1);
  fs::remove(shm);
  ASSERT_EQ(done.size(), 1u);
  ASSERT_TRUE(done[0].status.ok()) << done[0].status.ToString();
  EXPECT_EQ(std::memcmp(dst.data(), bytes.data() + 33, dst.size()), 0);
}

// procfs refuses O_DIRECT at open: the file is read through the page cache.
TEST_P(DiskReaderTest, FallsBackToBufferedReadsWhereODirectIsRefused) {
  const std::string path = "/proc/version";
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT);
  if (fd >= 0) ::close(fd);
  if (fd >= 0 || errno != EINVAL) GTEST_SKIP() << path << " does not refuse O_DIRECT here";
  std::ifstream in(path);
  std::string expected;
  std::getline(in, expected);
  ASSERT_GT(expected.size(), 20u);
  auto reader = Make(2);
  ASSERT_NE(reader, nullptr);
  auto file = reader->AddFile(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_FALSE(reader->direct(*file));
  std::string dst(15, '\0');
  reader->Submit(1, *file, 5, dst.size(), dst.data(), false);
  const auto done = WaitFor(reader.get(), 1);
  ASSERT_EQ(done.size(), 1u);
  ASSERT_TRUE(done[0].status.ok()) << done[0].status.ToString();
  EXPECT_EQ(dst, expected.substr(5, 15));
}

TEST_P(DiskReaderTest, AddFileOfAMissingPathIsNotFound) {
  auto reader = Make(1);
  ASSERT_NE(reader, nullptr);
  const std::string missing = (dir_ / "missing.bin").string();
  auto file = reader->AddFile(missing);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(file.status().message().find(missing), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Backends, DiskReaderTest, ::testing::Values("threads", "io_uring"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

TEST(DiskReaderOptions, InvalidOptionsAreRefused) {
  const auto refused = [](DiskReaderOptions options) {
    auto reader = DiskReader::Create(options);
    return !reader.ok() && reader.status().code() == ErrorCode::kInvalidArgument;
  };
  DiskReaderOptions o;
  o.queue_depth = 0;
  EXPECT_TRUE(refused(o));
  o.queue_depth = 257;
  EXPECT_TRUE(refused(o));
  o = DiskReaderOptions();
  o.chunk_bytes = 5000;
  EXPECT_TRUE(refused(o));
  o.chunk_bytes = 0;
  EXPECT_TRUE(refused(o));
  o.chunk_bytes = (size_t{64} << 20) + 4096;
  EXPECT_TRUE(refused(o));
  o = DiskReaderOptions();
  o.backend = "spdk";
  EXPECT_TRUE(refused(o));
  o = DiskReaderOptions();
  o.backend = "threads";
  EXPECT_TRUE(DiskReader::Create(o).ok());
}

TEST(DiskReaderOptions, AutoPicksABackend) {
  auto reader = DiskReader::Create(DiskReaderOptions());
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_TRUE((*reader)->backend() == "io_uring" || (*reader)->backend() == "threads");
}

}  // namespace
}  // namespace fmoe
