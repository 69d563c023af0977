// The host tier (DESIGN section 13) over a real file: experts read from their extents into slots,
// eviction by score and recency that never takes a pinned or requested expert, requests waiting
// for a slot, read errors naming the tensor and the file (and retried), and the tiered link in
// front of the emulated device link delivering each expert's bytes to the device.
#include "gpu_worker/cache/store/host_tier.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "gpu_worker/cache/store/tiered_link.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

constexpr uint32_t kExperts = 4;  // Per layer.
constexpr uint32_t kLayers = 3;
constexpr uint32_t kKeys = kExperts * kLayers;
// Three stored tensors per expert, of these sizes, packed at these offsets (with padding).
constexpr uint64_t kPart[3] = {5000, 777, 12289};
constexpr uint64_t kDst[3] = {0, 5056, 5888};
constexpr size_t kExpertBytes = 18240;

// A checkpoint-like file: every expert's parts at scattered, unaligned offsets (in reverse key
// order, parts interleaved), and the expected packed bytes of each expert.
struct TestFile {
  fs::path path;
  std::vector<std::vector<ExpertExtent>> extents;
  std::vector<std::vector<uint8_t>> packed;  // Per key.
};

TestFile MakeFile(const std::string& name) {
  TestFile f;
  const fs::path dir =
      fs::path(::testing::TempDir()) / ("host_tier_test_" + std::to_string(getpid()));
  fs::create_directories(dir);
  f.path = dir / name;
  std::vector<uint8_t> bytes(123, 0x11);  // A header of odd length.
  std::mt19937 rng(7);
  f.extents.resize(kKeys);
  f.packed.assign(kKeys, std::vector<uint8_t>(kExpertBytes, 0));
  for (int part = 2; part >= 0; --part) {
    for (int key = kKeys - 1; key >= 0; --key) {
      ExpertExtent x;
      x.file = 0;
      x.offset = bytes.size();
      x.bytes = kPart[part];
      x.dst_offset = kDst[part];
      x.tensor = "layers." + std::to_string(key / kExperts) + ".experts." +
                 std::to_string(key % kExperts) + ".w" + std::to_string(part + 1);
      for (uint64_t i = 0; i < x.bytes; ++i) {
        const auto b = static_cast<uint8_t>(rng());
        bytes.push_back(b);
        f.packed[key][x.dst_offset + i] = b;
      }
      bytes.resize(bytes.size() + rng() % 700, 0x22);  // Gaps between tensors.
      f.extents[key].push_back(x);
    }
  }
  for (auto& e : f.extents)
    std::sort(e.begin(), e.end(), [](auto& a, auto& b) { return a.dst_offset < b.dst_offset; });
  std::ofstream out(f.path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  EXPECT_TRUE(out.good());
  return f;
}

std::unique_ptr<HostTier> MakeTier(const TestFile& f, uint32_t slots,
                                   std::vector<std::vector<ExpertExtent>> extents = {}) {
  DiskReaderOptions r;
  r.backend = "threads";
  r.queue_depth = 4;
  r.chunk_bytes = 8192;  // Several chunks per tensor.
  auto reader = DiskReader::Create(r);
  EXPECT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_TRUE((*reader)->AddFile(f.path.string()).ok());
  HostTierOptions o;
  o.num_experts = kExperts;
  o.expert_bytes = kExpertBytes;
  o.slots = slots;
  auto tier = HostTier::Create(o, extents.empty() ? f.extents : std::move(extents),
                               {f.path.string()}, std::move(*reader));
  EXPECT_TRUE(tier.ok()) << tier.status().ToString();
  return tier.ok() ? std::move(*tier) : nullptr;
}

// Waits for `n` finished reads (at most 10 s).
std::vector<TierDone> WaitReads(HostTier& tier, size_t n) {
  std::vector<TierDone> done;
  const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (done.size() < n && std::chrono::steady_clock::now() < limit) {
    tier.Wait(&done, milliseconds(100));
  }
  return done;
}

bool Holds(const void* p, const std::vector<uint8_t>& want) {
  return p != nullptr && std::memcmp(p, want.data(), want.size()) == 0;
}

TEST(HostTier, ReadsEachExpertFromItsExtentsIntoASlot) {
  const TestFile f = MakeFile("read.bin");
  auto tier = MakeTier(f, 3);
  ASSERT_NE(tier, nullptr);
  for (uint32_t key : {0u, 5u, 11u}) {
    EXPECT_EQ(tier->Pin(key), nullptr);
    tier->Request(key, /*urgent=*/false);
  }
  const std::vector<TierDone> done = WaitReads(*tier, 3);
  ASSERT_EQ(done.size(), 3u);
  for (const TierDone& d : done) {
    EXPECT_TRUE(d.status.ok()) << d.status.ToString();
    EXPECT_GE(d.end_ns, d.start_ns);
    const void* p = tier->Pin(d.key);
    EXPECT_TRUE(Holds(p, f.packed[d.key])) << "key " << d.key;
    tier->Unpin(d.key);
  }
  const HostTierStats st = tier->stats();
  EXPECT_EQ(st.misses, 3u);
  EXPECT_EQ(st.reads, 3u);
  EXPECT_EQ(st.hits, 3u);
  EXPECT_EQ(st.bytes_read, 3 * (kPart[0] + kPart[1] + kPart[2]));
  EXPECT_EQ(st.resident, 3u);
  EXPECT_TRUE(tier->CheckInvariants().ok()) << tier->CheckInvariants().ToString();
}

TEST(HostTier, EvictsTheLowestScoreNeverAPinnedOrRequestedOne) {
  const TestFile f = MakeFile("evict.bin");
  auto tier = MakeTier(f, 2);
  ASSERT_NE(tier, nullptr);
  // Key 1 scores lowest, then 2, then the rest.
  tier->set_score([](uint32_t key) { return key == 1 ? 0.0 : key == 2 ? 1.0 : 5.0; });
  for (uint32_t key : {1u, 2u}) tier->Request(key, false);
  ASSERT_EQ(WaitReads(*tier, 2).size(), 2u);
  // Read but not pinned since their request: held, so a third request waits.
  tier->Request(3, false);
  EXPECT_EQ(tier->pending(), 1u);
  ASSERT_NE(tier->Pin(1), nullptr);  // Pinned: not evictable.
  ASSERT_NE(tier->Pin(2), nullptr);
  tier->Unpin(2);  // Key 2 evictable now: key 3 takes its slot.
  ASSERT_EQ(WaitReads(*tier, 1).size(), 1u);
  EXPECT_FALSE(tier->Resident(2));
  EXPECT_TRUE(tier->Resident(1));
  EXPECT_TRUE(Holds(tier->Pin(3), f.packed[3]));
  tier->Unpin(3);
  tier->Unpin(1);
  // Both unpinned and not held: the lower score (key 1) goes for the next read.
  tier->Request(4, true);
  ASSERT_EQ(WaitReads(*tier, 1).size(), 1u);
  EXPECT_FALSE(tier->Resident(1));
  EXPECT_TRUE(tier->Resident(3));
  EXPECT_EQ(tier->stats().evictions, 2u);
  EXPECT_TRUE(tier->CheckInvariants().ok()) << tier->CheckInvariants().ToString();
}

TEST(HostTier, ARequestWaitsWhileEverySlotIsPinnedAndAcquireSaysSo) {
  const TestFile f = MakeFile("wait.bin");
  auto tier = MakeTier(f, 1);
  ASSERT_NE(tier, nullptr);
  auto a = tier->Acquire(6);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_TRUE(Holds(*a, f.packed[6]));
  // The only slot is pinned: a blocking acquire of another expert cannot finish.
  auto b = tier->Acquire(7);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("pinned"), std::string::npos);
  // A request waits instead, and is read once the slot is unpinned.
  tier->Request(8, false);
  EXPECT_EQ(tier->pending(), 2u);  // 7 (still queued) and 8.
  tier->Release(7);
  EXPECT_EQ(tier->pending(), 1u);
  tier->Unpin(6);
  // Acquire's own reads come out too (a tiered link may wait for them): 6's first.
  const std::vector<TierDone> done = WaitReads(*tier, 2);
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].key, 6u);
  EXPECT_EQ(done[1].key, 8u);
  EXPECT_TRUE(done[1].status.ok()) << done[1].status.ToString();
  const void* p = tier->Pin(8);
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(Holds(p, f.packed[8]));
  tier->Unpin(8);
  EXPECT_TRUE(tier->CheckInvariants().ok()) << tier->CheckInvariants().ToString();
}

TEST(HostTier, AFailedReadNamesTheTensorAndTheFileAndALaterRequestRetries) {
  TestFile f = MakeFile("fail.bin");
  auto tier = MakeTier(f, 2);
  ASSERT_NE(tier, nullptr);
  const uint64_t size = fs::file_size(f.path);
  // Key 0's parts were written last: cutting the file's end takes its w1.
  const ExpertExtent& cut = f.extents[0][0];
  ASSERT_EQ(::truncate(f.path.c_str(), static_cast<off_t>(cut.offset + 10)), 0);
  tier->Request(0, true);
  tier->Request(11, false);  // Written first: still whole.
  const std::vector<TierDone> done = WaitReads(*tier, 2);
  ASSERT_EQ(done.size(), 2u);
  for (const TierDone& d : done) {
    if (d.key == 11) {
      EXPECT_TRUE(d.status.ok()) << d.status.ToString();
      continue;
    }
    ASSERT_FALSE(d.status.ok());
    EXPECT_EQ(d.status.code(), ErrorCode::kDataLoss) << d.status.ToString();
    EXPECT_NE(d.status.message().find("expert 0 of layer 0"), std::string::npos);
    EXPECT_NE(d.status.message().find(cut.tensor), std::string::npos) << d.status.ToString();
    EXPECT_NE(d.status.message().find(f.path.string()), std::string::npos);
  }
  EXPECT_FALSE(tier->Resident(0));
  EXPECT_EQ(tier->stats().read_errors, 1u);
  EXPECT_TRUE(tier->CheckInvariants().ok()) << tier->CheckInvariants().ToString();
  auto failed = tier->Acquire(0);
  EXPECT_EQ(failed.status().code(), ErrorCode::kDataLoss);
  // The file whole again: the same expert reads.
  ASSERT_EQ(::truncate(f.path.c_str(), static_cast<off_t>(size)), 0);
  {
    // Restore the bytes the cut removed.
    const TestFile again = MakeFile("fail.bin");
    f = again;
  }
  auto ok = tier->Acquire(0);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_TRUE(Holds(*ok, f.packed[0]));
  tier->Unpin(0);
}

TEST(HostTier, PrefetchTakesAFreeSlotOrOneThatScoresLower) {
  const TestFile f = MakeFile("prefetch.bin");
  auto tier = MakeTier(f, 2);
  ASSERT_NE(tier, nullptr);
  tier->set_score([](uint32_t key) { return static_cast<double>(key); });
  tier->Prefetch(4);
  tier->Prefetch(6);
  ASSERT_EQ(WaitReads(*tier, 2).size(), 2u);
  tier->Prefetch(2);  // Scores below both: no slot for it.
  EXPECT_EQ(tier->pending(), 0u);
  EXPECT_FALSE(tier->Resident(2));
  tier->Prefetch(9);  // Scores above 4: takes its slot.
  ASSERT_EQ(WaitReads(*tier, 1).size(), 1u);
  EXPECT_FALSE(tier->Resident(4));
  EXPECT_TRUE(Holds(tier->Pin(9), f.packed[9]));
  tier->Unpin(9);
  const HostTierStats st = tier->stats();
  EXPECT_EQ(st.prefetches, 3u);
  EXPECT_EQ(st.prefetches_used, 1u);
}

// A reader whose reads end only when the test says so: the tier's order of reads, without a disk.
class HeldReader final : public DiskReader {
 public:
  struct Read {
    uint64_t id;
    bool urgent;
    std::function<void()> then;
  };
  std::string_view backend() const override { return "held"; }
  Result<uint32_t> AddFile(const std::string&) override { return uint32_t{0}; }
  bool direct(uint32_t) const override { return true; }
  void Submit(uint64_t id, uint32_t, uint64_t, size_t, void*, bool urgent,
              std::function<void()> then) override {
    submitted.push_back({id, urgent, std::move(then)});
  }
  size_t Poll(std::vector<ReadDone>* out) override {
    const size_t n = done.size();
    for (const ReadDone& d : done) out->push_back(d);
    done.clear();
    return n;
  }
  size_t Wait(std::vector<ReadDone>* out, std::chrono::milliseconds) override { return Poll(out); }
  size_t pending() const override { return submitted.size() - finished; }
  DiskReaderStats stats() const override { return {}; }
  // Ends every read submitted so far.
  void FinishAll() {
    for (; finished < submitted.size(); ++finished) {
      if (submitted[finished].then) submitted[finished].then();
      ReadDone d;
      d.id = submitted[finished].id;
      done.push_back(d);
    }
  }

  std::vector<Read> submitted;
  size_t finished = 0;
  std::vector<ReadDone> done;
};

struct HeldTier {
  HeldReader* reader = nullptr;
  std::unique_ptr<HostTier> tier;
};

HeldTier MakeHeldTier(const TestFile& f, uint32_t slots) {
  auto reader = std::make_unique<HeldReader>();
  HeldTier t;
  t.reader = reader.get();
  HostTierOptions o;
  o.num_experts = kExperts;
  o.expert_bytes = kExpertBytes;
  o.slots = slots;
  auto tier = HostTier::Create(o, f.extents, {f.path.string()}, std::move(reader));
  EXPECT_TRUE(tier.ok()) << tier.status().ToString();
  if (tier.ok()) t.tier = std::move(*tier);
  return t;
}

TEST(HostTier, APrefetchDoesNotStartWhileAnUrgentReadIsReadingOrQueued) {
  const TestFile f = MakeFile("spare.bin");
  HeldTier t = MakeHeldTier(f, 2);
  ASSERT_NE(t.tier, nullptr);
  HostTier& tier = *t.tier;
  tier.set_score([](uint32_t key) { return static_cast<double>(key); });
  tier.Request(0, /*urgent=*/true);
  const size_t parts = f.extents[0].size();
  ASSERT_EQ(t.reader->submitted.size(), parts);
  EXPECT_EQ(tier.urgent_pending(), 1u);
  tier.Prefetch(5);  // The urgent read would share the disk with it: not started.
  EXPECT_EQ(t.reader->submitted.size(), parts);
  EXPECT_FALSE(tier.Resident(5));
  EXPECT_EQ(tier.stats().prefetches_yielded, 1u);
  // A read a load does not wait for (a device prefetch's) does not hold prefetches back.
  tier.Request(1, /*urgent=*/false);
  EXPECT_EQ(tier.urgent_pending(), 1u);
  t.reader->FinishAll();
  std::vector<TierDone> done;
  ASSERT_EQ(tier.Poll(&done), 2u);
  EXPECT_EQ(tier.urgent_pending(), 0u);
  // Both slots held for their requesters; pinned, then a third urgent request queues for a slot.
  ASSERT_NE(tier.Pin(0), nullptr);
  ASSERT_NE(tier.Pin(1), nullptr);
  tier.Request(2, /*urgent=*/true);
  EXPECT_EQ(tier.pending(), 1u);
  EXPECT_EQ(tier.urgent_pending(), 1u);
  const size_t before = t.reader->submitted.size();
  tier.Prefetch(6);  // Queued for a slot, still urgent: the prefetch yields.
  EXPECT_EQ(t.reader->submitted.size(), before);
  EXPECT_EQ(tier.stats().prefetches_yielded, 2u);
  tier.Unpin(1);  // Key 2 takes key 1's slot and is read.
  EXPECT_EQ(t.reader->submitted.size(), before + parts);
  t.reader->FinishAll();
  ASSERT_EQ(tier.Poll(&done), 1u);
  EXPECT_EQ(tier.urgent_pending(), 0u);
  ASSERT_NE(tier.Pin(2), nullptr);
  tier.Unpin(2);
  tier.Unpin(0);
  // Nothing urgent now: the prefetch starts, as a normal (not urgent) read.
  tier.Prefetch(6);
  ASSERT_EQ(t.reader->submitted.size(), before + 2 * parts);
  EXPECT_FALSE(t.reader->submitted.back().urgent);
  EXPECT_EQ(tier.stats().prefetches, 1u);
  EXPECT_TRUE(tier.CheckInvariants().ok()) << tier.CheckInvariants().ToString();
}

TEST(HostTier, APrefetchWhoseUseComesBeforeTheReadWouldEndIsNotStarted) {
  const TestFile f = MakeFile("late.bin");
  HeldTier t = MakeHeldTier(f, 4);
  ASSERT_NE(t.tier, nullptr);
  HostTier& tier = *t.tier;
  // Nothing measured: a prefetch with any predicted use starts.
  EXPECT_EQ(tier.read_ns_mean(), 0.0);
  tier.Prefetch(1, /*use_in_ns=*/1);
  EXPECT_EQ(tier.stats().prefetches, 1u);
  // One read of at least 2 ms: the expected read time.
  std::this_thread::sleep_for(milliseconds(2));
  t.reader->FinishAll();
  std::vector<TierDone> done;
  ASSERT_EQ(tier.Poll(&done), 1u);
  const double read_ns = tier.read_ns_mean();
  ASSERT_GE(read_ns, 2e6);
  // Used sooner than a read ends: the load will read it anyway; not started.
  const size_t before = t.reader->submitted.size();
  tier.Prefetch(2, static_cast<int64_t>(read_ns / 2));
  EXPECT_EQ(t.reader->submitted.size(), before);
  EXPECT_EQ(tier.stats().prefetches_late, 1u);
  // Used after it: started. A second one must wait behind it, so it needs twice the time.
  tier.Prefetch(2, static_cast<int64_t>(read_ns * 1.5));
  EXPECT_GT(t.reader->submitted.size(), before);
  tier.Prefetch(3, static_cast<int64_t>(read_ns * 1.5));
  EXPECT_EQ(tier.stats().prefetches_late, 2u);
  tier.Prefetch(3, static_cast<int64_t>(read_ns * 2.5));
  // Unknown use (negative): only the disk's state decides.
  tier.Prefetch(4, -1);
  EXPECT_EQ(tier.stats().prefetches, 4u);
  EXPECT_TRUE(tier.CheckInvariants().ok()) << tier.CheckInvariants().ToString();
}

// `split` of `region` done one element at a time, as RegionSplit says it.
std::vector<uint8_t> NaiveScatter(const RegionSplit& split, const std::vector<uint8_t>& region,
                                  std::vector<uint8_t> expert) {
  const uint64_t ways = split.part_dst.size(), e = split.elem_bytes;
  for (uint64_t r = 0; r < split.rows; ++r) {
    for (uint64_t c = 0; c < split.cols; ++c) {
      // Element (r, c) of the region: which part, and where in it.
      uint64_t p = 0, at = 0;
      if (split.by_columns) {
        p = c % ways;
        at = (c / ways) * split.rows + r;  // Row c / ways of the transposed part.
      } else {
        p = r % ways;
        at = (r / ways) * split.cols + c;
      }
      for (uint64_t b = 0; b < e; ++b) {
        expert[split.part_dst[p] + at * e + b] = region[(r * split.cols + c) * e + b];
      }
    }
  }
  return expert;
}

TEST(RegionSplit, ScatterGivesEachPartItsRowsOrItsColumnsTransposed) {
  std::mt19937 rng(11);
  int cases = 0;
  for (uint32_t elem : {1u, 2u, 4u}) {
    for (bool by_columns : {false, true}) {
      for (uint64_t ways : {1u, 2u, 3u}) {
        // Sizes around the transpose's 64-element tiles.
        for (uint64_t rows : {3u, 64u, 130u}) {
          for (uint64_t per_part : {1u, 5u, 65u}) {
            RegionSplit split;
            split.by_columns = by_columns;
            split.elem_bytes = elem;
            split.rows = by_columns ? rows : rows * ways;
            split.cols = by_columns ? per_part * ways : per_part;
            const uint64_t bytes = split.rows * split.cols * elem;
            // Parts in reverse order with a gap between them, after a few bytes.
            for (uint64_t p = 0; p < ways; ++p) {
              split.part_dst.push_back(7 + (ways - 1 - p) * (bytes / ways + 5));
            }
            std::vector<uint8_t> region(bytes);
            for (auto& b : region) b = static_cast<uint8_t>(rng());
            std::vector<uint8_t> expert(7 + ways * (bytes / ways + 5), 0xAB);
            const std::vector<uint8_t> want = NaiveScatter(split, region, expert);
            ScatterRegion(split, reinterpret_cast<const char*>(region.data()),
                          reinterpret_cast<char*>(expert.data()));
            ASSERT_EQ(expert, want) << "elem " << elem << " by_columns " << by_columns << " ways "
                                    << ways << " rows " << rows << " per part " << per_part;
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 162);
}

// A region split between two parts is read once (one extent's bytes) and each part lands where
// its tensor goes, whole experts beside it unchanged.
TEST(HostTier, ASplitRegionIsReadOnceAndScatteredIntoItsParts) {
  const TestFile f = MakeFile("split.bin");
  std::ifstream in(f.path, std::ios::binary);
  const std::vector<uint8_t> file((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
  auto extents = f.extents;
  auto packed = f.packed;
  for (uint32_t key = 0; key < kKeys; ++key) {
    // Part 0's 5000 bytes as 50 x 50 two-byte elements: columns split two ways, transposed,
    // into the same 5000 bytes of the expert (the halves swapped).
    ExpertExtent& x = extents[key][0];
    ASSERT_EQ(x.bytes, 5000u);
    x.split = RegionSplit{true, 50, 50, 2, {2500, 0}};
    const std::vector<uint8_t> region(file.begin() + static_cast<std::ptrdiff_t>(x.offset),
                                      file.begin() + static_cast<std::ptrdiff_t>(x.offset + 5000));
    packed[key] = NaiveScatter(x.split, region, packed[key]);
  }
  auto tier = MakeTier(f, 3, extents);
  ASSERT_NE(tier, nullptr);
  for (uint32_t key : {1u, 6u, 9u, 1u}) {
    auto p = tier->Acquire(key);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_TRUE(Holds(*p, packed[key])) << "key " << key;
    EXPECT_FALSE(Holds(*p, f.packed[key])) << "key " << key;
    tier->Unpin(key);
  }
  const HostTierStats st = tier->stats();
  EXPECT_EQ(st.reads, 3u);
  EXPECT_EQ(st.bytes_read, 3 * (kPart[0] + kPart[1] + kPart[2]));
  EXPECT_TRUE(tier->CheckInvariants().ok()) << tier->CheckInvariants().ToString();
}

TEST(HostTier, RejectsBadOptionsAndExtents) {
  const TestFile f = MakeFile("bad.bin");
  auto make = [&](HostTierOptions o, std::vector<std::vector<ExpertExtent>> x) {
    DiskReaderOptions r;
    r.backend = "threads";
    auto reader = DiskReader::Create(r);
    EXPECT_TRUE((*reader)->AddFile(f.path.string()).ok());
    return HostTier::Create(o, std::move(x), {f.path.string()}, std::move(*reader)).status();
  };
  HostTierOptions o;
  o.num_experts = kExperts;
  o.expert_bytes = kExpertBytes;
  o.slots = 0;
  EXPECT_EQ(make(o, f.extents).code(), ErrorCode::kInvalidArgument);
  o.slots = 2;
  auto too_big = f.extents;
  too_big[3][2].dst_offset = kExpertBytes - 10;
  const Status s = make(o, too_big);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("expert 3 of layer 0"), std::string::npos) << s.ToString();
  auto bad_file = f.extents;
  bad_file[1][0].file = 3;
  EXPECT_EQ(make(o, bad_file).code(), ErrorCode::kInvalidArgument);
  // Splits: the shape is not the region's bytes, 3-byte elements, rows that do not split, a
  // part that does not fit the expert.
  for (const RegionSplit& bad :
       {RegionSplit{true, 50, 49, 2, {0, 2500}}, RegionSplit{false, 50, 50, 3, {0, 2500}},
        RegionSplit{false, 25, 100, 2, {0, 2500, 5000}},
        RegionSplit{false, 50, 50, 2, {0, kExpertBytes - 2000}}}) {
    auto split = f.extents;
    split[2][0].split = bad;
    const Status bs = make(o, split);
    EXPECT_EQ(bs.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(bs.message().find("expert 2 of layer 0"), std::string::npos) << bs.ToString();
  }
  EXPECT_EQ(make(o, {{}}).code(), ErrorCode::kInvalidArgument);
}

// The tiered link in front of the emulated device link: every expert's bytes reach its device
// slot whether it was in host memory or on disk, a task waiting for its read is cancelled at
// once, and a failed read fails the task with its status.
TEST(TieredLink, DeliversEveryExpertFromHostOrDisk) {
  const TestFile f = MakeFile("link.bin");
  auto tier = MakeTier(f, 3);
  ASSERT_NE(tier, nullptr);
  LinkOptions lo;
  lo.gbps = 50;
  lo.latency_us = 1;
  auto device = NewEmulatedLink(lo);
  ASSERT_TRUE(device.ok());
  TieredLink link(std::move(*device), tier.get());
  auto slots = link.AllocateDevice(kKeys * kExpertBytes);
  ASSERT_TRUE(slots.ok());
  char* dst = static_cast<char*>(*slots);
  std::memset(dst, 0, kKeys * kExpertBytes);
  // Twice over every key: the second round finds some in host memory.
  uint64_t id = 1;
  size_t done = 0;
  std::vector<TransferDone> out;
  for (int round = 0; round < 2; ++round) {
    for (uint32_t key = 0; key < kKeys; ++key) {
      TransferTask t;
      t.id = id++;
      t.key = key;
      t.dst = dst + key * kExpertBytes;
      t.bytes = kExpertBytes;
      t.on_demand = key % 2 == 0;
      link.Submit(t);
    }
    const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (out.size() < (round + 1) * kKeys && std::chrono::steady_clock::now() < limit) {
      link.Wait(&out, milliseconds(100));
    }
    ASSERT_EQ(out.size(), (round + 1) * kKeys);
    for (; done < out.size(); ++done) {
      EXPECT_TRUE(out[done].status.ok()) << out[done].status.ToString();
      EXPECT_FALSE(out[done].cancelled);
    }
    for (uint32_t key = 0; key < kKeys; ++key) {
      EXPECT_EQ(std::memcmp(dst + key * kExpertBytes, f.packed[key].data(), kExpertBytes), 0)
          << "key " << key;
    }
    std::memset(dst, 0, kKeys * kExpertBytes);
    EXPECT_TRUE(tier->CheckInvariants().ok()) << tier->CheckInvariants().ToString();
  }
  EXPECT_GT(tier->stats().hits, 0u);
  EXPECT_EQ(tier->stats().resident, 3u);

  // Cancelled while its read is under way: done at once, cancelled, nothing copied.
  const uint32_t absent = [&] {
    for (uint32_t k = 0; k < kKeys; ++k) {
      if (!tier->Resident(k)) return k;
    }
    return kKeys;
  }();
  ASSERT_LT(absent, kKeys);
  TransferTask t;
  t.id = id++;
  t.key = absent;
  t.dst = dst;
  t.bytes = kExpertBytes;
  link.Submit(t);
  link.Cancel(t.id);
  out.clear();
  link.Poll(&out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(out[0].cancelled);
  EXPECT_EQ(out[0].bytes_copied, 0u);

  // A read that fails (the file cut short) fails its task with the read's error.
  while (tier->pending() > 0) {
    std::vector<TierDone> ignore;
    tier->Wait(&ignore, milliseconds(100));
  }
  ASSERT_EQ(::truncate(f.path.c_str(), 100), 0);
  uint32_t missing = kKeys;
  for (uint32_t k = 0; k < kKeys && missing == kKeys; ++k) {
    if (!tier->Resident(k)) missing = k;
  }
  ASSERT_LT(missing, kKeys);
  t.id = id++;
  t.key = missing;
  t.on_demand = true;
  link.Submit(t);
  out.clear();
  const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (out.empty() && std::chrono::steady_clock::now() < limit)
    link.Wait(&out, milliseconds(100));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_FALSE(out[0].status.ok());
  EXPECT_NE(out[0].status.message().find(f.path.string()), std::string::npos)
      << out[0].status.ToString();
  link.FreeDevice(*slots);
}

}  // namespace
}  // namespace fmoe
