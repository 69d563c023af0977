// Liveness of remote peers from application heartbeats. A peer is alive while its last message
// is younger than the timeout; Expire() removes and returns the dead ones so the owner can act
// (take a group out of service, free a rank's requests). Owned by one thread; not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/clock.h"

namespace fmoe {

template <class Info>
class PeerTable {
 public:
  struct Entry {
    Info info;
    int64_t first_seen_ms = 0;
    int64_t last_seen_ms = 0;
  };

  PeerTable(const Clock& clock, int64_t timeout_ms) : clock_(clock), timeout_ms_(timeout_ms) {}

  // Adds or replaces a peer and marks it seen now.
  void Upsert(const std::string& id, Info info) {
    int64_t now = clock_.NowMs();
    auto [it, inserted] = peers_.try_emplace(id);
    if (inserted) it->second.first_seen_ms = now;
    it->second.info = std::move(info);
    it->second.last_seen_ms = now;
  }
  // Marks a known peer seen now; false if unknown.
  bool Touch(const std::string& id) {
    auto it = peers_.find(id);
    if (it == peers_.end()) return false;
    it->second.last_seen_ms = clock_.NowMs();
    return true;
  }
  bool Erase(const std::string& id) { return peers_.erase(id) > 0; }

  Entry* Find(const std::string& id) {
    auto it = peers_.find(id);
    return it == peers_.end() ? nullptr : &it->second;
  }
  bool IsAlive(const std::string& id) const {
    auto it = peers_.find(id);
    return it != peers_.end() && clock_.NowMs() - it->second.last_seen_ms <= timeout_ms_;
  }
  int64_t SilenceMs(const Entry& entry) const { return clock_.NowMs() - entry.last_seen_ms; }

  // Removes the peers silent for longer than the timeout and returns them (id, entry).
  std::vector<std::pair<std::string, Entry>> Expire() {
    std::vector<std::pair<std::string, Entry>> dead;
    int64_t now = clock_.NowMs();
    for (auto it = peers_.begin(); it != peers_.end();) {
      if (now - it->second.last_seen_ms > timeout_ms_) {
        dead.emplace_back(it->first, std::move(it->second));
        it = peers_.erase(it);
      } else {
        ++it;
      }
    }
    return dead;
  }

  const std::map<std::string, Entry>& peers() const { return peers_; }
  size_t size() const { return peers_.size(); }

 private:
  const Clock& clock_;
  int64_t timeout_ms_;
  std::map<std::string, Entry> peers_;
};

}  // namespace fmoe
