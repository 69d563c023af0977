#include "gpu_worker/core/kv_blocks.h"

#include <algorithm>
#include <iterator>

namespace fmoe {

KvBlockAllocator::KvBlockAllocator(uint32_t blocks, bool prefix_caching)
    : total_(std::max<uint32_t>(blocks, 1)), prefix_caching_(prefix_caching), blocks_(total_) {
  free_.reserve(total_);
  // Popped from the back: block 0 first.
  for (uint32_t b = total_; b > 0; --b) free_.push_back(b - 1);
}

std::optional<uint32_t> KvBlockAllocator::Allocate() {
  uint32_t b = 0;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {
    b = lru_.front();
    lru_.pop_front();
    Unpublish(b);
    ++stats_.evictions;
  } else {
    return std::nullopt;
  }
  blocks_[b].refs = 1;
  return b;
}

void KvBlockAllocator::Unpublish(uint32_t b) {
  Block& block = blocks_[b];
  if (!block.published) return;
  auto [lo, hi] = by_key_.equal_range(block.key);
  for (auto it = lo; it != hi; ++it) {
    if (it->second == b) {
      by_key_.erase(it);
      break;
    }
  }
  block.published = false;
  block.tokens.clear();
}

void KvBlockAllocator::Release(uint32_t b) {
  if (b >= total_ || blocks_[b].refs == 0) return;
  Block& block = blocks_[b];
  if (--block.refs > 0) return;
  if (block.published) {
    lru_.push_back(b);
    block.lru = std::prev(lru_.end());
  } else {
    free_.push_back(b);
  }
}

void KvBlockAllocator::Retain(uint32_t b) {
  if (b < total_ && blocks_[b].refs > 0) ++blocks_[b].refs;
}

void KvBlockAllocator::Grow(uint32_t blocks) {
  if (blocks <= total_) return;
  blocks_.resize(blocks);
  // Free blocks are popped from the back: the new ones go in front of the old, lowest last.
  std::vector<uint32_t> fresh;
  fresh.reserve(blocks - total_ + free_.size());
  for (uint32_t b = blocks; b > total_; --b) fresh.push_back(b - 1);
  fresh.insert(fresh.end(), free_.begin(), free_.end());
  free_.swap(fresh);
  total_ = blocks;
}

uint64_t KvBlockAllocator::Key(uint64_t parent, std::span<const int32_t> tokens) {
  // splitmix64 over the parent's key and each token: a chain, so a key covers the whole prefix.
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  uint64_t h = mix(parent + 0x9e3779b97f4a7c15ull);
  for (int32_t t : tokens) h = mix(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(t)) + 1));
  return h == 0 ? 1 : h;  // 0 is "no parent".
}

std::optional<uint32_t> KvBlockAllocator::Lookup(uint64_t key, std::span<const int32_t> tokens) {
  if (!prefix_caching_) return std::nullopt;
  auto [lo, hi] = by_key_.equal_range(key);
  for (auto it = lo; it != hi; ++it) {
    Block& block = blocks_[it->second];
    if (!std::equal(block.tokens.begin(), block.tokens.end(), tokens.begin(), tokens.end())) {
      continue;
    }
    if (block.refs == 0) lru_.erase(block.lru);
    ++block.refs;
    return it->second;
  }
  return std::nullopt;
}

void KvBlockAllocator::Publish(uint32_t b, uint64_t key, std::span<const int32_t> tokens) {
  if (!prefix_caching_ || b >= total_ || blocks_[b].refs == 0 || blocks_[b].published) return;
  auto [lo, hi] = by_key_.equal_range(key);
  for (auto it = lo; it != hi; ++it) {
    const Block& other = blocks_[it->second];
    if (std::equal(other.tokens.begin(), other.tokens.end(), tokens.begin(), tokens.end())) {
      return;  // Already cached in another block.
    }
  }
  Block& block = blocks_[b];
  block.published = true;
  block.key = key;
  block.tokens.assign(tokens.begin(), tokens.end());
  by_key_.emplace(key, b);
}

}  // namespace fmoe
