// The paged KV cache's bookkeeping (DESIGN section 14), Torch-free: a pool of fixed-size blocks
// (kKvBlockTokens positions each) with reference counts, and the prefix cache over them. The
// tensors the blocks index live in the model (gpu_worker/model/model.h KvPool); a sequence's
// positions map to blocks through its block table (KvBlockTable).
//
// Prefix caching: a full block of a sequence's prompt is published under a key that covers its
// tokens and every token before it (a 64-bit chain hash of the previous block's key and this
// block's tokens, checked against the block's own tokens on lookup). A later sequence whose
// prompt starts with the same full blocks takes them (reference counted) instead of computing
// them. A block nobody references stays cached, in LRU order, until a fresh block is needed and
// no never-used block is left: then the least recently released cached block is evicted.
//
// One device budget (DESIGN section 14): the pool's memory may be pages the expert cache lends
// (KvPageLender). The allocator then addresses every block of every page, but only the blocks of
// the pages the pool holds are present (Add / Remove a page's range); free blocks are handed out
// lowest first, so the pages borrowed last empty first and can go back.
// Thread-unsafe: the engine thread owns it.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <set>
#include <span>
#include <unordered_map>
#include <vector>

namespace fmoe {

inline constexpr uint32_t kKvBlockTokens = 16;

struct KvBlockStats {
  uint64_t prefix_queries = 0;     // Prompt tokens looked up (full blocks' worth).
  uint64_t prefix_hit_tokens = 0;  // Of those, found cached.
  uint64_t evictions = 0;          // Cached blocks given up for fresh ones.
};

// The expert cache's side of one device budget (DESIGN section 14): device memory in pages, each
// an expert's slot or a run of the KV pool's blocks. Engine thread only.
class KvPageLender {
 public:
  virtual ~KvPageLender() = default;
  // A page for the KV pool (the expert in it given up by the cache's policy; it waits for a load
  // in flight when every slot is loading); nullopt when none can be given (the experts' floor).
  virtual std::optional<uint32_t> Lend() = 0;
  // A page the pool lent back: the expert cache's again.
  virtual void Return(uint32_t page) = 0;
};

// The device memory of one budget (CachedExperts::kv_arena): `pages` pages of `page_bytes` at
// `base`, each an expert's slot or whole KV blocks. Pages [0, floor_pages) are always the KV
// pool's; up to max_pages in all may be; `lender` lends and takes back the others. A group of
// several ranks caps max_pages at its smallest rank's (AgreeKvArena), which may leave a rank's
// floor pages beyond it unused.
struct KvArena {
  void* base = nullptr;
  uint64_t page_bytes = 0;
  uint32_t pages = 0;
  uint32_t floor_pages = 0;
  uint32_t max_pages = 0;
  KvPageLender* lender = nullptr;
};

class KvBlockAllocator {
 public:
  // Blocks [0, present) of `blocks` (>= 1) are present; present > blocks counts as blocks.
  KvBlockAllocator(uint32_t blocks, bool prefix_caching, uint32_t present = UINT32_MAX);

  // Blocks present (the pool's now).
  uint32_t total_blocks() const { return present_; }
  // Blocks addressable (present or not).
  uint32_t max_blocks() const { return total_; }
  // Blocks a sequence could get now: never used or freed, plus cached ones nobody references.
  uint32_t free_blocks() const { return static_cast<uint32_t>(free_.size() + lru_.size()); }
  uint32_t used_blocks() const { return present_ - free_blocks(); }
  bool prefix_caching() const { return prefix_caching_; }
  const KvBlockStats& stats() const { return stats_; }

  // A block for new keys (its reference count 1): a free one, else the least recently released
  // cached block (which leaves the prefix cache). nullopt when every block is referenced.
  std::optional<uint32_t> Allocate();
  // One reference fewer; at zero the block is free again (or, when published, cached in LRU
  // order). A block not referenced is ignored.
  void Release(uint32_t block);
  // More references to a referenced block (sharing).
  void Retain(uint32_t block);
  // The pool grew to `blocks` (more than now): the new blocks are free.
  void Grow(uint32_t blocks);
  // Blocks [first, first + count), absent, are present and free (a page came in).
  void Add(uint32_t first, uint32_t count);
  // Blocks [first, first + count), present, leave the pool when none is referenced (cached ones
  // are evicted); false, with nothing changed, when one is referenced.
  bool Remove(uint32_t first, uint32_t count);
  // Whether none of [first, first + count) is referenced by a sequence.
  bool Unreferenced(uint32_t first, uint32_t count) const;

  // The key of a block holding `tokens` (kKvBlockTokens of them) after the blocks whose key is
  // `parent` (0 for the first block).
  static uint64_t Key(uint64_t parent, std::span<const int32_t> tokens);
  // The cached block with this key and these tokens, with one more reference; nullopt if none.
  std::optional<uint32_t> Lookup(uint64_t key, std::span<const int32_t> tokens);
  // `block` (referenced, full) now holds `tokens` under `key`; a later Lookup may share it. A
  // key already published keeps its block. No-op without prefix caching.
  void Publish(uint32_t block, uint64_t key, std::span<const int32_t> tokens);
  // Counts a prompt's lookup for the hit rate.
  void CountLookup(uint64_t queried_tokens, uint64_t hit_tokens) {
    stats_.prefix_queries += queried_tokens;
    stats_.prefix_hit_tokens += hit_tokens;
  }

 private:
  struct Block {
    uint32_t refs = 0;
    bool present = true;
    bool published = false;
    uint64_t key = 0;
    std::vector<int32_t> tokens;        // When published.
    std::list<uint32_t>::iterator lru;  // When published and unreferenced.
  };
  void Unpublish(uint32_t block);

  uint32_t total_;
  uint32_t present_;
  bool prefix_caching_;
  std::vector<Block> blocks_;
  std::set<uint32_t> free_;  // Present, never used or unpublished, unreferenced; lowest first.
  std::list<uint32_t> lru_;  // Published, unreferenced; least recently released first.
  std::unordered_multimap<uint64_t, uint32_t> by_key_;
  KvBlockStats stats_;
};

// One sequence's blocks in one group of layers: position p lives in blocks[p / kKvBlockTokens -
// first_block] at offset p % kKvBlockTokens. Blocks before first_block were released (a sliding
// window's).
struct KvBlockTable {
  std::vector<uint32_t> blocks;
  uint32_t first_block = 0;
  // Prefix caching: the key of each published block of this table, from block 0 (their count is
  // how many of the sequence's full blocks were published or shared).
  std::vector<uint64_t> keys;

  // Positions held room for (first_block included).
  uint64_t capacity() const { return (uint64_t{first_block} + blocks.size()) * kKvBlockTokens; }
  // Blocks needed to hold positions up to `end` (exclusive).
  uint32_t BlocksFor(uint64_t end) const {
    const uint64_t want = (end + kKvBlockTokens - 1) / kKvBlockTokens;
    const uint64_t have = uint64_t{first_block} + blocks.size();
    return want > have ? static_cast<uint32_t>(want - have) : 0;
  }
};

}  // namespace fmoe
