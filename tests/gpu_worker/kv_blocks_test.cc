#include "gpu_worker/core/kv_blocks.h"

#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

std::vector<int32_t> Block(int32_t base) {
  std::vector<int32_t> t(kKvBlockTokens);
  for (uint32_t i = 0; i < kKvBlockTokens; ++i) t[i] = base + static_cast<int32_t>(i);
  return t;
}

TEST(KvBlockAllocator, AllocatesEveryBlockOnceAndTakesReleasedOnesBack) {
  KvBlockAllocator alloc(4, false);
  std::set<uint32_t> got;
  for (int i = 0; i < 4; ++i) {
    auto b = alloc.Allocate();
    ASSERT_TRUE(b.has_value());
    EXPECT_TRUE(got.insert(*b).second);
  }
  EXPECT_FALSE(alloc.Allocate().has_value());
  EXPECT_EQ(alloc.free_blocks(), 0u);
  alloc.Retain(2);
  alloc.Release(2);
  EXPECT_EQ(alloc.free_blocks(), 0u);  // Still referenced once.
  alloc.Release(2);
  alloc.Release(2);  // Not referenced: ignored.
  EXPECT_EQ(alloc.free_blocks(), 1u);
  EXPECT_EQ(alloc.Allocate(), 2u);
  alloc.Grow(6);
  EXPECT_EQ(alloc.free_blocks(), 2u);
  EXPECT_TRUE(alloc.Allocate().has_value());
  EXPECT_TRUE(alloc.Allocate().has_value());
  EXPECT_FALSE(alloc.Allocate().has_value());
}

TEST(KvBlockAllocator, KeysCoverTheWholePrefix) {
  const auto a = Block(0), b = Block(100);
  const uint64_t ka = KvBlockAllocator::Key(0, a);
  EXPECT_EQ(ka, KvBlockAllocator::Key(0, a));
  EXPECT_NE(KvBlockAllocator::Key(ka, b), KvBlockAllocator::Key(0, b));
  EXPECT_NE(KvBlockAllocator::Key(ka, b), KvBlockAllocator::Key(KvBlockAllocator::Key(0, b), a));
  auto c = a;
  c.back() += 1;
  EXPECT_NE(KvBlockAllocator::Key(0, c), ka);
}

TEST(KvBlockAllocator, PublishedBlocksAreSharedThenEvictedLeastRecentlyReleasedFirst) {
  KvBlockAllocator alloc(3, true);
  const auto t0 = Block(0), t1 = Block(50), t2 = Block(90);
  const uint64_t k0 = KvBlockAllocator::Key(0, t0), k1 = KvBlockAllocator::Key(k0, t1);
  const uint32_t b0 = *alloc.Allocate(), b1 = *alloc.Allocate();
  alloc.Publish(b0, k0, t0);
  alloc.Publish(b1, k1, t1);
  // Shared while referenced.
  EXPECT_EQ(alloc.Lookup(k0, t0), b0);
  EXPECT_FALSE(alloc.Lookup(k0, t2).has_value());  // Same key, other tokens: no.
  alloc.Release(b0);
  alloc.Release(b0);
  alloc.Release(b1);
  EXPECT_EQ(alloc.free_blocks(), 3u);  // Cached blocks count as free.
  // b0 was released first: it goes first when a fresh block is needed.
  const uint32_t fresh = *alloc.Allocate();
  EXPECT_NE(fresh, b0);
  EXPECT_NE(fresh, b1);
  EXPECT_EQ(*alloc.Allocate(), b0);
  EXPECT_EQ(alloc.stats().evictions, 1u);
  EXPECT_FALSE(alloc.Lookup(k0, t0).has_value());
  EXPECT_EQ(alloc.Lookup(k1, t1), b1);  // Still cached, now referenced again.
  EXPECT_FALSE(alloc.Allocate().has_value());
  // Without prefix caching nothing is published or found.
  KvBlockAllocator plain(2, false);
  const uint32_t p = *plain.Allocate();
  plain.Publish(p, k0, t0);
  EXPECT_FALSE(plain.Lookup(k0, t0).has_value());
}

// A random workload of sequences that take, share and release blocks: no block is handed out
// twice while referenced, and free plus referenced blocks always make the pool.
TEST(KvBlockAllocator, PagesComeAndGoWhenUnreferenced) {
  // 3 pages of 4 blocks; only the first page present, as when the pool starts at its floor.
  KvBlockAllocator alloc(12, true, 4);
  EXPECT_EQ(alloc.total_blocks(), 4u);
  EXPECT_EQ(alloc.max_blocks(), 12u);
  std::vector<uint32_t> held;
  for (int i = 0; i < 4; ++i) held.push_back(*alloc.Allocate());
  EXPECT_FALSE(alloc.Allocate().has_value());  // Absent blocks are never handed out.
  alloc.Add(8, 4);                             // The third page comes in.
  EXPECT_EQ(alloc.total_blocks(), 8u);
  EXPECT_EQ(alloc.free_blocks(), 4u);
  const uint32_t b = *alloc.Allocate();
  EXPECT_EQ(b, 8u);
  EXPECT_FALSE(alloc.Remove(8, 4));  // Block 8 is referenced: nothing changes.
  EXPECT_EQ(alloc.total_blocks(), 8u);
  // A cached block in the page is evicted when the page goes.
  const auto tokens = Block(7);
  const uint64_t key = KvBlockAllocator::Key(0, tokens);
  alloc.Publish(b, key, tokens);
  alloc.Release(b);
  EXPECT_EQ(alloc.free_blocks(), 4u);
  EXPECT_TRUE(alloc.Remove(8, 4));
  EXPECT_EQ(alloc.total_blocks(), 4u);
  EXPECT_EQ(alloc.free_blocks(), 0u);
  EXPECT_EQ(alloc.stats().evictions, 1u);
  EXPECT_FALSE(alloc.Lookup(key, tokens).has_value());
  // Freed blocks are handed out lowest first: a later page empties before an earlier one.
  alloc.Add(4, 4);
  alloc.Release(held[1]);
  EXPECT_EQ(*alloc.Allocate(), held[1]);
  EXPECT_EQ(*alloc.Allocate(), 4u);
  EXPECT_EQ(alloc.used_blocks(), 5u);
}

TEST(KvBlockAllocator, RandomWorkloadKeepsTheCounts) {
  std::mt19937 rng(5);
  KvBlockAllocator alloc(32, true);
  std::vector<std::vector<uint32_t>> seqs;
  std::vector<uint32_t> refs(32, 0);
  for (int step = 0; step < 20000; ++step) {
    const int op = static_cast<int>(rng() % 3);
    if (op == 0 || seqs.empty()) {
      std::vector<uint32_t> blocks;
      uint64_t key = 0;
      const int n = 1 + static_cast<int>(rng() % 4);
      const int32_t family = static_cast<int32_t>(rng() % 3);
      for (int i = 0; i < n; ++i) {
        const auto t = Block(family * 1000 + i * 16);
        const uint64_t k = KvBlockAllocator::Key(key, t);
        std::optional<uint32_t> b = alloc.Lookup(k, t);
        if (!b) {
          b = alloc.Allocate();
          if (!b) break;
          EXPECT_EQ(refs[*b], 0u) << "block " << *b << " handed out while referenced";
          alloc.Publish(*b, k, t);
        }
        ++refs[*b];
        blocks.push_back(*b);
        key = k;
      }
      seqs.push_back(blocks);
    } else {
      const size_t s = rng() % seqs.size();
      for (uint32_t b : seqs[s]) {
        alloc.Release(b);
        --refs[b];
      }
      seqs.erase(seqs.begin() + static_cast<std::ptrdiff_t>(s));
    }
    const auto referenced = static_cast<uint32_t>(
        std::count_if(refs.begin(), refs.end(), [](uint32_t r) { return r > 0; }));
    ASSERT_EQ(alloc.used_blocks(), referenced);
  }
}

TEST(KvBlockTable, CountsTheBlocksAPositionNeeds) {
  KvBlockTable t;
  EXPECT_EQ(t.BlocksFor(0), 0u);
  EXPECT_EQ(t.BlocksFor(1), 1u);
  EXPECT_EQ(t.BlocksFor(16), 1u);
  EXPECT_EQ(t.BlocksFor(17), 2u);
  t.blocks = {4, 9};
  t.first_block = 3;  // Positions 48..79 held.
  EXPECT_EQ(t.capacity(), 80u);
  EXPECT_EQ(t.BlocksFor(80), 0u);
  EXPECT_EQ(t.BlocksFor(81), 1u);
}

}  // namespace
}  // namespace fmoe
