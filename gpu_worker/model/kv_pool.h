// The paged KV cache (DESIGN section 14): one pool of kKvBlockTokens-position blocks per rank,
// and each sequence's block tables into it. No sequence owns tensors: per transformer layer the
// pool holds two tensors [blocks * kKvBlockTokens, rows, width] (grouped-query attention: keys
// and values, rows = KV heads, width = head_dim; MLA: the latents after kv_a_layernorm and the
// rotated rotary keys, rows = 1), and position p of a sequence lives in pool row
// table.blocks[p / 16 - first_block] * 16 + p % 16. Attention writes a step's new keys there and
// gathers the positions a query may see (gpu_worker/model/blocks.h AttentionSpan).
//
// Layers come in one or two groups, each with its own blocks: the full-attention layers (and
// MLA), and the sliding-window layers (gpt-oss), whose blocks before the window are released as
// a sequence grows. Prefix caching (kv_blocks.h) covers the first group; it is off for models
// with sliding layers (their window's keys of a cached prefix would be gone).
//
// A pool with a token budget is fixed: Reserve fails when its blocks are taken (the engine then
// preempts or waits). A pool without one (tests, `fmoe generate`) grows by doubling when full.
//
// One device budget (KvPoolOptions::arena, DESIGN section 14): the first group's blocks live in
// pages of device memory shared with the expert cache. Each page is an expert's slot or
// page_bytes / block_bytes blocks; a block's positions of every layer are one run of bytes (a
// position's keys and values of each layer in turn), so position rows are evenly spaced over
// all pages and each layer's tensors are strided views of the whole memory. Reserve borrows
// pages from the lender when the pool's own are taken (the cache evicts an expert for each), and
// ReturnIdle gives back borrowed pages nobody references, keeping a page of free blocks.
// One owner thread (the engine's); caches keep the pool alive.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/status.h"
#include "gpu_worker/core/kv_blocks.h"

namespace fmoe {

class ExpertGroup;

struct KvPoolOptions {
  // Positions the pool holds per layer group (rounded up to whole blocks); 0 = it grows on
  // demand. Default: 0
  uint64_t tokens = 0;
  // Full blocks of a sequence are shared with later sequences that begin with the same tokens.
  // Ignored (off) for models with sliding-window layers and (MoeModel::ConfigureKv) LongRoPE.
  // Default: off
  bool prefix_caching = false;
  // With `tokens` set: positions of the sliding-window layers' blocks (they keep only a window
  // per sequence); 0 = as many as `tokens`. Default: 0
  uint64_t sliding_tokens = 0;
  // One device budget: the first group lives in these pages (`tokens` is then ignored; the
  // arena's page_bytes must be a multiple of the group's block bytes, KvPool::BlockBytes).
  // Default: none
  std::optional<KvArena> arena = std::nullopt;
  // One device budget: a borrowed page goes back only while the pool keeps a page of free
  // blocks beyond the most blocks it needed over the last return_hold_ms (at least; at most
  // twice that), so a burst that comes and goes within it does not evict experts for the same
  // page again and again. 0: back as soon as a page of free blocks stays. Default: 0
  int64_t return_hold_ms = 0;
};

// What a pool holds, for /metrics and /health.
struct KvPoolFigures {
  bool fixed = false;
  uint64_t total_blocks = 0;  // Of the first group, held now.
  uint64_t max_blocks = 0;    // Of the first group, the most it may hold (one budget: borrowed).
  uint64_t used_blocks = 0;   // Referenced by a sequence (first group).
  uint64_t bytes = 0;         // The pool's memory now, every group.
  uint64_t bytes_per_token = 0;
  KvBlockStats blocks;  // The first group's prefix-cache figures.
  // One device budget: the bytes of the pages the expert cache holds now (slots), and the
  // pages borrowed and given back since start.
  uint64_t expert_bytes = 0;
  uint64_t pages_borrowed = 0;
  uint64_t pages_returned = 0;
};

class KvPool {
 public:
  struct LayerShape {
    int64_t rows = 1;     // KV heads, or 1 (MLA).
    int64_t k_width = 0;  // head_dim, or kv_lora_rank.
    int64_t v_width = 0;  // head_dim, or qk_rope_head_dim.
    int64_t window = 0;   // Sliding window (0: full attention).
  };
  KvPool(std::vector<LayerShape> layers, at::TensorOptions tensor_options, KvPoolOptions options);

  // Bytes of one block of the first group's layers (16 positions, keys and values).
  static uint64_t BlockBytes(const std::vector<LayerShape>& layers, at::ScalarType dtype);

  size_t groups() const { return groups_.size(); }
  int group_of(size_t layer) const { return layer_group_[layer]; }
  int64_t window(int group) const { return groups_[group].window; }
  bool fixed() const { return fixed_; }
  const std::optional<KvArena>& arena() const { return arena_; }
  bool prefix_caching() const { return groups_[0].alloc.prefix_caching(); }
  KvBlockAllocator& allocator(int group) { return groups_[group].alloc; }
  // Layer l's tensors, [blocks * 16, rows, width]; allocated on first use.
  at::Tensor& k(size_t layer) { return k_[layer]; }
  at::Tensor& v(size_t layer) { return v_[layer]; }
  // Positions one group's blocks hold (the first group's: what one sequence can reach).
  // With one device budget: the most it may borrow.
  uint64_t capacity_tokens() const {
    return uint64_t{arena_ ? max_arena_blocks() : groups_[0].alloc.total_blocks()} * kKvBlockTokens;
  }
  // A growing pool: `group` doubled (its tensors copied). false for a fixed pool.
  bool Grow(int group);
  // One device budget: pages borrowed until the first group has `blocks` free blocks; false
  // when the lender has none to give (or the pool is at its most).
  bool Borrow(uint32_t blocks);
  // One device budget: borrowed pages that no sequence references go back to the lender, the
  // last borrowed first, while a page of free blocks stays beyond the recent peak of blocks in
  // use (KvPoolOptions::return_hold_ms; `now_ms` on a steady clock). Returns the pages given back.
  uint32_t ReturnIdle(int64_t now_ms);
  // The tensors, allocated if they are not yet (a LibTorch error throws).
  void Materialize();
  KvPoolFigures figures() const;
  uint64_t block_bytes(int group) const { return groups_[group].block_bytes; }

 private:
  struct Group {
    KvBlockAllocator alloc;
    int64_t window = 0;
    uint64_t block_bytes = 0;
    std::vector<size_t> layers;
  };
  uint32_t max_arena_blocks() const { return arena_->max_pages * blocks_per_page_; }

  std::vector<LayerShape> shapes_;
  at::TensorOptions tensor_options_;
  bool fixed_ = false;
  std::optional<KvArena> arena_;
  uint32_t blocks_per_page_ = 0;
  std::vector<uint32_t> borrowed_;  // Pages borrowed, in order.
  // The most blocks in use (or asked for by Borrow) in the hold window that began at
  // window_start_ms_, and in the one before it.
  int64_t return_hold_ms_ = 0;
  int64_t window_start_ms_ = INT64_MIN;
  uint32_t peak_blocks_ = 0, previous_peak_blocks_ = 0;
  uint64_t pages_borrowed_ = 0, pages_returned_ = 0;
  std::vector<Group> groups_;
  std::vector<int> layer_group_;
  std::vector<at::Tensor> k_, v_;
};

// One device budget in a group of several ranks: every rank runs every sequence's attention, so
// each rank's pool must hold what the leader's does. The group's ranks agree on one arena:
// max_pages the smallest of theirs (each rank then borrows at most that, whatever its own floor
// and budget), and the same page and block bytes (else kFailedPrecondition naming both). A
// group of one rank: unchanged. Every rank calls it, once, before the pool is configured.
Status AgreeKvArena(ExpertGroup& group, uint64_t block_bytes, KvArena* arena);

// One sequence's keys and values: its block table per layer group in the pool.
class KvCache {
 public:
  explicit KvCache(std::shared_ptr<KvPool> pool);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  // Positions in the cache.
  int64_t length() const { return length_; }
  // The bytes of the blocks this sequence references.
  size_t bytes() const;
  // Blocks for `tokens` more positions, in every group: false, with nothing taken, when a fixed
  // pool has not enough free blocks.
  bool Reserve(int64_t tokens);
  // An empty cache only, with prefix caching: shares the cached full blocks that begin `tokens`
  // (leaving at least the last token to compute) and returns the positions now held.
  int64_t TakePrefix(std::span<const int32_t> tokens);
  // Every block released; length 0.
  void Reset();

  // The model's part, after a Forward wrote `tokens` at positions length().. : the length
  // grows, full blocks are published for prefix caching, a sliding group's blocks before its
  // window are released.
  void Advance(std::span<const int32_t> tokens);
  // Pool rows of positions [first, end) of `group`, as a kLong tensor on `device`.
  at::Tensor Slots(int group, int64_t first, int64_t end, at::Device device) const;
  KvPool& pool() { return *pool_; }

 private:
  std::shared_ptr<KvPool> pool_;
  int64_t length_ = 0;
  std::vector<KvBlockTable> tables_;  // Per group.
  std::vector<int32_t> tokens_;       // With prefix caching: the tokens of every position.
};

}  // namespace fmoe
