#include "gpu_worker/core/kv_blocks.h"

#include <algorithm>
#include <iterator>

namespace fmoe {

KvBlockAllocator::KvBlockAllocator(uint32_t blocks, bool prefix_caching, uint32_t present)
    : total_(std::max<uint32_t>(blocks, 1)),
      present_(std::min(present, total_)),
      prefix_caching_(prefix_caching),
      blocks_(total_) {
  for (uint32_t b = 0; b < total_; ++b) {
    if (b < present_) {
      free_.insert(free_.end(), b);
    } else {
      blocks_[b].present = false;
    }
  }
}

std::optional<uint32_t> KvBlockAllocator::Allocate() {
  uint32_t b = 0;
  if (!free_.empty()) {
    b = *free_.begin();
    free_.erase(free_.begin());
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
    free_.insert(b);
  }
}

void KvBlockAllocator::Retain(uint32_t b) {
  if (b < total_ && blocks_[b].refs > 0) ++blocks_[b].refs;
}

void KvBlockAllocator::Grow(uint32_t blocks) {
  if (blocks <= total_) return;
  blocks_.resize(blocks);
  for (uint32_t b = total_; b < blocks; ++b) free_.insert(free_.end(), b);
  present_ += blocks - total_;
  total_ = blocks;
}

void KvBlockAllocator::Add(uint32_t first, uint32_t count) {
  for (uint32_t b = first; b < first + count && b < total_; ++b) {
    if (blocks_[b].present) continue;
    blocks_[b] = Block{};
    free_.insert(b);
    ++present_;
  }
}

bool KvBlockAllocator::Unreferenced(uint32_t first, uint32_t count) const {
  for (uint32_t b = first; b < first + count && b < total_; ++b) {
    if (blocks_[b].present && blocks_[b].refs > 0) return false;
  }
  return true;
}

bool KvBlockAllocator::Remove(uint32_t first, uint32_t count) {
  if (!Unreferenced(first, count)) return false;
  for (uint32_t b = first; b < first + count && b < total_; ++b) {
    Block& block = blocks_[b];
    if (!block.present) continue;
    if (block.published) {
      lru_.erase(block.lru);
      Unpublish(b);
      ++stats_.evictions;
    } else {
      free_.erase(b);
    }
    block.present = false;
    --present_;
  }
  return true;
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
