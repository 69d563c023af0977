#include "gpu_worker/model/kv_pool.h"

#include <algorithm>
#include <utility>

#include <ATen/ATen.h>

#include "common/log.h"
#include "gpu_worker/group/expert_group.h"

namespace fmoe {

namespace {

// A growing pool starts with this many blocks per group.
constexpr uint32_t kInitialBlocks = 64;

}  // namespace

uint64_t KvPool::BlockBytes(const std::vector<LayerShape>& layers, at::ScalarType dtype) {
  const auto elem = static_cast<int64_t>(at::elementSize(dtype));
  uint64_t bytes = 0;
  for (const LayerShape& s : layers) {
    if (s.window > 0) continue;
    bytes += static_cast<uint64_t>(s.rows * (s.k_width + s.v_width) * elem) * kKvBlockTokens;
  }
  return bytes;
}

KvPool::KvPool(std::vector<LayerShape> layers, at::TensorOptions tensor_options,
               KvPoolOptions options)
    : shapes_(std::move(layers)),
      tensor_options_(tensor_options),
      fixed_(options.tokens > 0 || options.arena.has_value()),
      arena_(options.arena),
      return_hold_ms_(std::max<int64_t>(options.return_hold_ms, 0)) {
  const int64_t elem =
      static_cast<int64_t>(at::elementSize(c10::typeMetaToScalarType(tensor_options_.dtype())));
  int64_t sliding_window = 0;
  for (const LayerShape& s : shapes_) {
    if (s.window > 0) sliding_window = s.window;
  }
  const bool prefix = options.prefix_caching && sliding_window == 0;
  uint64_t blocks64 =
      fixed_ ? (options.tokens + kKvBlockTokens - 1) / kKvBlockTokens : kInitialBlocks;
  uint32_t present = UINT32_MAX;
  if (arena_) {
    const uint64_t block_bytes =
        BlockBytes(shapes_, c10::typeMetaToScalarType(tensor_options_.dtype()));
    blocks_per_page_ =
        static_cast<uint32_t>(arena_->page_bytes / std::max<uint64_t>(block_bytes, 1));
    blocks64 = uint64_t{arena_->pages} * blocks_per_page_;
    present = std::min(arena_->floor_pages, arena_->max_pages) * blocks_per_page_;
  }
  const auto blocks = static_cast<uint32_t>(std::min<uint64_t>(blocks64, UINT32_MAX));
  groups_.push_back(Group{KvBlockAllocator(blocks, prefix, present), 0, 0, {}});
  if (sliding_window > 0) {
    uint32_t sliding_blocks = arena_
                                  ? static_cast<uint32_t>(std::min<uint64_t>(
                                        uint64_t{arena_->max_pages} * blocks_per_page_, UINT32_MAX))
                                  : blocks;
    if (fixed_ && options.sliding_tokens > 0) {
      sliding_blocks = static_cast<uint32_t>(std::min<uint64_t>(
          (options.sliding_tokens + kKvBlockTokens - 1) / kKvBlockTokens, sliding_blocks));
    }
    groups_.push_back(Group{KvBlockAllocator(sliding_blocks, false), sliding_window, 0, {}});
  }
  layer_group_.resize(shapes_.size());
  for (size_t l = 0; l < shapes_.size(); ++l) {
    const LayerShape& s = shapes_[l];
    const int g = s.window > 0 ? 1 : 0;
    layer_group_[l] = g;
    groups_[g].layers.push_back(l);
    groups_[g].block_bytes +=
        static_cast<uint64_t>(s.rows * (s.k_width + s.v_width) * elem) * kKvBlockTokens;
  }
  k_.resize(shapes_.size());
  v_.resize(shapes_.size());
}

void KvPool::Materialize() {
  if (arena_ && !groups_[0].layers.empty() && !k_[groups_[0].layers[0]].defined()) {
    // Views of the arena: position row r of every layer is at r * row bytes, each layer's keys
    // and values at their offset in the row.
    const int64_t elem =
        static_cast<int64_t>(at::elementSize(c10::typeMetaToScalarType(tensor_options_.dtype())));
    const auto row_elems = static_cast<int64_t>(groups_[0].block_bytes / kKvBlockTokens) / elem;
    const int64_t rows = int64_t{groups_[0].alloc.max_blocks()} * kKvBlockTokens;
    auto* base = static_cast<char*>(arena_->base);
    int64_t offset = 0;  // Elements into the row.
    for (size_t l : groups_[0].layers) {
      const LayerShape& s = shapes_[l];
      k_[l] = at::from_blob(base + offset * elem, {rows, s.rows, s.k_width},
                            {row_elems, s.k_width, 1}, tensor_options_);
      offset += s.rows * s.k_width;
      v_[l] = at::from_blob(base + offset * elem, {rows, s.rows, s.v_width},
                            {row_elems, s.v_width, 1}, tensor_options_);
      offset += s.rows * s.v_width;
    }
  }
  for (size_t l = 0; l < shapes_.size(); ++l) {
    if (k_[l].defined()) continue;
    const LayerShape& s = shapes_[l];
    const int64_t rows = int64_t{groups_[layer_group_[l]].alloc.total_blocks()} * kKvBlockTokens;
    // Never read before written (attention gathers only positions it wrote), so not zeroed: on
    // the CPU the pages are committed as blocks are first used.
    k_[l] = at::empty({rows, s.rows, s.k_width}, tensor_options_);
    v_[l] = at::empty({rows, s.rows, s.v_width}, tensor_options_);
  }
}

bool KvPool::Borrow(uint32_t blocks) {
  if (!arena_ || arena_->lender == nullptr) return false;
  KvBlockAllocator& alloc = groups_[0].alloc;
  peak_blocks_ = std::max(peak_blocks_, alloc.used_blocks() + blocks);
  while (alloc.free_blocks() < blocks) {
    if (alloc.total_blocks() + blocks_per_page_ > max_arena_blocks()) return false;
    const std::optional<uint32_t> page = arena_->lender->Lend();
    if (!page || *page >= arena_->pages) return false;
    alloc.Add(*page * blocks_per_page_, blocks_per_page_);
    borrowed_.push_back(*page);
    ++pages_borrowed_;
  }
  return true;
}

uint32_t KvPool::ReturnIdle(int64_t now_ms) {
  if (!arena_ || arena_->lender == nullptr) return 0;
  KvBlockAllocator& alloc = groups_[0].alloc;
  uint32_t keep = alloc.used_blocks();
  if (return_hold_ms_ > 0) {
    // The recent peak: the current window's and the previous one's, so what was needed up to
    // return_hold_ms ago (and at most twice that) is kept.
    peak_blocks_ = std::max(peak_blocks_, keep);
    if (window_start_ms_ == INT64_MIN) {
      window_start_ms_ = now_ms;
    } else if (now_ms - window_start_ms_ >= return_hold_ms_ || now_ms < window_start_ms_) {
      // A window left without a call for a whole hold says nothing about the last hold.
      const bool adjacent = now_ms - window_start_ms_ < 2 * return_hold_ms_;
      previous_peak_blocks_ = adjacent ? peak_blocks_ : 0;
      peak_blocks_ = keep;
      window_start_ms_ = now_ms;
    }
    keep = std::max(peak_blocks_, previous_peak_blocks_);
  }
  uint32_t returned = 0;
  for (size_t i = borrowed_.size(); i > 0; --i) {
    const uint32_t page = borrowed_[i - 1];
    const uint32_t first = page * blocks_per_page_;
    if (alloc.total_blocks() < keep + 2 * blocks_per_page_ ||
        !alloc.Unreferenced(first, blocks_per_page_)) {
      continue;
    }
    alloc.Remove(first, blocks_per_page_);
    arena_->lender->Return(page);
    borrowed_.erase(borrowed_.begin() + static_cast<std::ptrdiff_t>(i - 1));
    ++pages_returned_;
    ++returned;
  }
  return returned;
}

bool KvPool::Grow(int group) {
  if (fixed_) return false;
  Group& g = groups_[group];
  const uint32_t old_blocks = g.alloc.total_blocks();
  if (old_blocks >= UINT32_MAX / 2) return false;
  const uint32_t blocks = old_blocks * 2;
  for (size_t l : g.layers) {
    if (!k_[l].defined()) continue;
    const LayerShape& s = shapes_[l];
    const int64_t rows = int64_t{blocks} * kKvBlockTokens;
    at::Tensor k = at::empty({rows, s.rows, s.k_width}, tensor_options_);
    at::Tensor v = at::empty({rows, s.rows, s.v_width}, tensor_options_);
    k.narrow(0, 0, k_[l].size(0)).copy_(k_[l]);
    v.narrow(0, 0, v_[l].size(0)).copy_(v_[l]);
    k_[l] = std::move(k);
    v_[l] = std::move(v);
  }
  g.alloc.Grow(blocks);
  return true;
}

KvPoolFigures KvPool::figures() const {
  KvPoolFigures f;
  f.fixed = fixed_;
  f.total_blocks = groups_[0].alloc.total_blocks();
  f.max_blocks = arena_ ? max_arena_blocks() : f.total_blocks;
  f.used_blocks = groups_[0].alloc.used_blocks();
  f.blocks = groups_[0].alloc.stats();
  for (const Group& g : groups_) {
    f.bytes += uint64_t{g.alloc.total_blocks()} * g.block_bytes;
    f.bytes_per_token += g.block_bytes / kKvBlockTokens;
  }
  if (arena_) {
    const uint64_t kv_pages = arena_->floor_pages + borrowed_.size();
    f.bytes += kv_pages * arena_->page_bytes - uint64_t{f.total_blocks} * groups_[0].block_bytes;
    f.expert_bytes = (arena_->pages - kv_pages) * arena_->page_bytes;
    f.pages_borrowed = pages_borrowed_;
    f.pages_returned = pages_returned_;
  }
  return f;
}

Status AgreeKvArena(ExpertGroup& group, uint64_t block_bytes, KvArena* arena) {
  if (group.world_size() == 1) return Status::Ok();
  // Minima of each value and of its negation: the group's least and greatest.
  std::vector<int64_t> v = {arena->max_pages, static_cast<int64_t>(arena->page_bytes),
                            -static_cast<int64_t>(arena->page_bytes),
                            static_cast<int64_t>(block_bytes), -static_cast<int64_t>(block_bytes)};
  FMOE_RETURN_IF_ERROR(group.MinAcrossRanks(v));
  if (v[1] != -v[2] || v[3] != -v[4]) {
    return FailedPrecondition("memory: the group's ranks cut their budgets differently (pages of " +
                              std::to_string(v[1]) + " to " + std::to_string(-v[2]) +
                              " bytes, KV blocks of " + std::to_string(v[3]) + " to " +
                              std::to_string(-v[4]) +
                              " bytes); every rank of a group needs the same dtype and model");
  }
  const auto least = static_cast<uint32_t>(v[0]);
  if (least < arena->max_pages) {
    spdlog::info(
        "memory: the KV pool may take up to {} pages, the group's smallest rank's (this rank's "
        "budget allows {}), so that every rank holds what the leader's pool holds",
        least, arena->max_pages);
  }
  arena->max_pages = least;
  return Status::Ok();
}

KvCache::KvCache(std::shared_ptr<KvPool> pool) : pool_(std::move(pool)) {
  tables_.resize(pool_->groups());
}

KvCache::~KvCache() { Reset(); }

size_t KvCache::bytes() const {
  size_t total = 0;
  for (size_t g = 0; g < tables_.size(); ++g) {
    total += tables_[g].blocks.size() * pool_->block_bytes(static_cast<int>(g));
  }
  return total;
}

void KvCache::Reset() {
  for (size_t g = 0; g < tables_.size(); ++g) {
    KvBlockAllocator& alloc = pool_->allocator(static_cast<int>(g));
    // The last block first: a prefix's later blocks leave the LRU before its earlier ones.
    for (auto it = tables_[g].blocks.rbegin(); it != tables_[g].blocks.rend(); ++it) {
      alloc.Release(*it);
    }
    tables_[g] = {};
  }
  length_ = 0;
  tokens_.clear();
}

bool KvCache::Reserve(int64_t tokens) {
  const auto end = static_cast<uint64_t>(length_ + tokens);
  if (pool_->fixed()) {
    for (size_t g = 0; g < tables_.size(); ++g) {
      const uint32_t need = tables_[g].BlocksFor(end);
      if (need <= pool_->allocator(static_cast<int>(g)).free_blocks()) continue;
      // One device budget: the first group borrows pages for what its own blocks cannot hold.
      if (g == 0 && pool_->Borrow(need)) continue;
      return false;
    }
  }
  pool_->Materialize();
  for (size_t g = 0; g < tables_.size(); ++g) {
    KvBlockTable& t = tables_[g];
    KvBlockAllocator& alloc = pool_->allocator(static_cast<int>(g));
    for (uint32_t n = t.BlocksFor(end); n > 0; --n) {
      std::optional<uint32_t> b = alloc.Allocate();
      if (!b && pool_->Grow(static_cast<int>(g))) b = alloc.Allocate();
      if (!b) return false;  // Not reached: checked above, or the pool grew.
      t.blocks.push_back(*b);
    }
  }
  return true;
}

int64_t KvCache::TakePrefix(std::span<const int32_t> tokens) {
  if (length_ != 0 || !pool_->prefix_caching() || tokens.empty()) return 0;
  KvBlockAllocator& alloc = pool_->allocator(0);
  KvBlockTable& t = tables_[0];
  // At least the last token is computed: its logits are the first sample's.
  const size_t full = (tokens.size() - 1) / kKvBlockTokens;
  uint64_t parent = 0;
  for (size_t b = 0; b < full; ++b) {
    std::span<const int32_t> block = tokens.subspan(b * kKvBlockTokens, kKvBlockTokens);
    const uint64_t key = KvBlockAllocator::Key(parent, block);
    std::optional<uint32_t> found = alloc.Lookup(key, block);
    if (!found) break;
    t.blocks.push_back(*found);
    t.keys.push_back(key);
    parent = key;
  }
  length_ = static_cast<int64_t>(t.blocks.size() * kKvBlockTokens);
  tokens_.assign(tokens.begin(), tokens.begin() + length_);
  alloc.CountLookup(full * kKvBlockTokens, static_cast<uint64_t>(length_));
  return length_;
}

void KvCache::Advance(std::span<const int32_t> tokens) {
  length_ += static_cast<int64_t>(tokens.size());
  if (pool_->prefix_caching()) {
    tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
    KvBlockTable& t = tables_[0];
    KvBlockAllocator& alloc = pool_->allocator(0);
    while ((t.keys.size() + 1) * kKvBlockTokens <= static_cast<size_t>(length_)) {
      const size_t b = t.keys.size();
      std::span<const int32_t> block(tokens_.data() + b * kKvBlockTokens, kKvBlockTokens);
      const uint64_t key = KvBlockAllocator::Key(t.keys.empty() ? 0 : t.keys.back(), block);
      alloc.Publish(t.blocks[b], key, block);
      t.keys.push_back(key);
    }
  }
  for (size_t g = 1; g < tables_.size(); ++g) {
    // A later query at position p >= length sees positions > p - window: a block wholly before
    // length - window + 1 is never read again.
    KvBlockTable& t = tables_[g];
    const int64_t keep_from = length_ - pool_->window(static_cast<int>(g)) + 1;
    KvBlockAllocator& alloc = pool_->allocator(static_cast<int>(g));
    size_t drop = 0;
    while (drop < t.blocks.size() &&
           static_cast<int64_t>((t.first_block + drop + 1) * kKvBlockTokens) <= keep_from) {
      alloc.Release(t.blocks[drop]);
      ++drop;
    }
    t.blocks.erase(t.blocks.begin(), t.blocks.begin() + static_cast<std::ptrdiff_t>(drop));
    t.first_block += static_cast<uint32_t>(drop);
  }
}

at::Tensor KvCache::Slots(int group, int64_t first, int64_t end, at::Device device) const {
  const KvBlockTable& t = tables_[group];
  std::vector<int64_t> rows(static_cast<size_t>(std::max<int64_t>(0, end - first)));
  for (int64_t p = first; p < end; ++p) {
    const int64_t block = t.blocks[static_cast<size_t>(p / kKvBlockTokens - t.first_block)];
    rows[static_cast<size_t>(p - first)] = block * kKvBlockTokens + p % kKvBlockTokens;
  }
  at::Tensor slots = at::tensor(rows, at::TensorOptions().dtype(at::kLong));
  return device.is_cpu() ? slots : slots.to(device);
}

}  // namespace fmoe
