// The parts both BPE tokenizers share (bpe_tokenizer for tokenizer.json, tiktoken_tokenizer for
// tiktoken.model): the rank-ordered merge of a word's symbols, the sharded cache of merged words
// and the byte trie that finds added or special tokens in text (leftmost, longest).
// MergeSymbols and the trie are stateless after building; the cache is safe from any thread
// (each shard behind its own mutex).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fmoe {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

using StringMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// What merging a pair of adjacent symbols gives: its rank (lower merges first) and the symbol.
struct PairMerge {
  int32_t rank;
  int32_t result;
};

// Merges the symbols (*ids)[first..] in place: the adjacent pair with the lowest rank, the
// leftmost among equal ranks, becomes one symbol, again until no adjacent pair merges. `pair(left,
// right, &merge)` says whether two symbols merge and into what. O(n log n) in the word's length.
template <class PairFn>
void MergeSymbols(std::vector<int32_t>* ids, size_t first, const PairFn& pair) {
  const int32_t n = static_cast<int32_t>(ids->size() - first);
  if (n < 2) return;
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    bool alive;
  };
  thread_local std::vector<Symbol> symbols;
  symbols.clear();
  for (int32_t i = 0; i < n; ++i) symbols.push_back({(*ids)[first + i], i - 1, i + 1, true});
  symbols.back().next = -1;

  // Lowest rank first, then leftmost: a min-heap on (rank, position) with stale entries skipped.
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t result;
  };
  auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  thread_local std::vector<Candidate> heap;
  heap.clear();
  auto consider = [&](int32_t pos) {
    int32_t next = symbols[pos].next;
    if (next < 0) return;
    PairMerge merge;
    if (!pair(symbols[pos].id, symbols[next].id, &merge)) return;
    heap.push_back({merge.rank, pos, merge.result});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  for (int32_t i = 0; i + 1 < n; ++i) consider(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    Candidate top = heap.back();
    heap.pop_back();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    PairMerge merge;
    if (!pair(left.id, symbols[left.next].id, &merge) || merge.result != top.result ||
        merge.rank != top.rank) {
      continue;  // Stale: a neighbour merged since.
    }
    Symbol& right = symbols[left.next];
    left.id = top.result;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0) consider(left.prev);
    consider(top.pos);
  }
  ids->resize(first);
  for (const Symbol& s : symbols) {
    if (s.alive) ids->push_back(s.id);
  }
}

// Words already merged, keyed by the model's input string. Sharded so that threads encoding at
// once rarely wait on each other; a full shard is cleared.
class WordCache {
 public:
  static constexpr size_t kMaxWordBytes = 128;  // Longer words are not cached.

  // Appends the cached ids of `word` to `out`; false when it is not cached.
  bool Get(std::string_view word, std::vector<int32_t>* out) const;
  void Put(std::string_view word, std::span<const int32_t> ids) const;

 private:
  static constexpr size_t kShards = 16;
  static constexpr size_t kEntriesPerShard = 4096;  // ~64K words in all.
  struct Shard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>>
        map;  // GUARDED_BY(mu)
  };
  Shard& ShardFor(std::string_view word) const { return shards_[StringHash{}(word) % kShards]; }
  mutable std::array<Shard, kShards> shards_;
};

// Ids to bytes for a byte-level vocabulary: each id's bytes in order; out-of-range ids write
// nothing, special ones nothing when `skip_special`.
std::string DecodeTokenBytes(std::span<const int32_t> ids, const std::vector<std::string>& bytes,
                             const std::vector<bool>& special, bool skip_special);

// Leftmost-longest matching of a set of strings (added tokens, special tokens): a byte trie
// walked from each position.
class TokenTrie {
 public:
  bool empty() const { return nodes_.size() == 1; }
  // `s` must not be empty; adding it again replaces its index.
  void Add(std::string_view s, int32_t index);
  // The longest string starting at text[pos]: {length, index}, or {0, -1}.
  std::pair<size_t, int32_t> LongestAt(std::string_view text, size_t pos) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> edges;
    int32_t index = -1;
  };
  int32_t Child(int32_t node, unsigned char c) const;
  std::vector<Node> nodes_ = std::vector<Node>(1);
  std::array<bool, 256> first_{};
};

}  // namespace fmoe
