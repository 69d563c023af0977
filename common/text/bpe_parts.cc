#include "common/text/bpe_parts.h"

namespace fmoe {

bool WordCache::Get(std::string_view word, std::vector<int32_t>* out) const {
  Shard& shard = ShardFor(word);
  std::lock_guard<std::mutex> lock(shard.mu);
  auto it = shard.map.find(word);
  if (it == shard.map.end()) return false;
  out->insert(out->end(), it->second.begin(), it->second.end());
  return true;
}

void WordCache::Put(std::string_view word, std::span<const int32_t> ids) const {
  Shard& shard = ShardFor(word);
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.map.size() >= kEntriesPerShard) shard.map.clear();
  shard.map.emplace(std::string(word), std::vector<int32_t>(ids.begin(), ids.end()));
}

void TokenTrie::Add(std::string_view s, int32_t index) {
  if (s.empty()) return;
  int32_t node = 0;
  for (unsigned char c : s) {
    int32_t next = Child(node, c);
    if (next < 0) {
      next = static_cast<int32_t>(nodes_.size());
      nodes_[node].edges.emplace_back(c, next);
      nodes_.emplace_back();
    }
    node = next;
  }
  nodes_[node].index = index;
  first_[static_cast<unsigned char>(s[0])] = true;
}

std::pair<size_t, int32_t> TokenTrie::LongestAt(std::string_view text, size_t pos) const {
  std::pair<size_t, int32_t> best{0, -1};
  if (!first_[static_cast<unsigned char>(text[pos])]) return best;
  int32_t node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    node = Child(node, static_cast<unsigned char>(text[i]));
    if (node < 0) break;
    if (nodes_[node].index >= 0) best = {i + 1 - pos, nodes_[node].index};
  }
  return best;
}

int32_t TokenTrie::Child(int32_t node, unsigned char c) const {
  for (const auto& [byte, child] : nodes_[node].edges) {
    if (byte == c) return child;
  }
  return -1;
}

std::string DecodeTokenBytes(std::span<const int32_t> ids, const std::vector<std::string>& bytes,
                             const std::vector<bool>& special, bool skip_special) {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= bytes.size()) continue;
    if (skip_special && static_cast<size_t>(id) < special.size() && special[id]) continue;
    out += bytes[id];
  }
  return out;
}

}  // namespace fmoe
