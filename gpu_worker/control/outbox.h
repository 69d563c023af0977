// Outbox: what the compute thread hands the control plane: the engine's token events (for the
// router) and the contexts the leader publishes (for the map service). It exists before the
// rank, so the rank's sinks post into it from the first Forward on; the Worker sends from it
// (worker.h). Thread-safe; posting never blocks: the context queue drops its oldest past
// `context_queue` entries, and every post wakes the Worker's poll through an eventfd.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "common/wire/messages.h"
#include "common/wire/wire.h"

namespace fmoe {

class Outbox {
 public:
  explicit Outbox(size_t context_queue = 4096) : context_queue_(context_queue) {}

  // Any thread: queues a token event for the router.
  void PostEvent(TokenEvent event);
  // Any thread: queues a context (IterationStart, LayerObserved or IterationEnd) for the map
  // service, dropping the oldest when `context_queue` are waiting.
  void PublishContext(MapMessage context);

  // The control thread: everything queued so far, oldest first.
  std::vector<TokenEvent> TakeEvents();
  std::deque<MapMessage> TakeContexts();

  struct Counts {
    uint64_t published = 0;     // PublishContext calls.
    uint64_t dropped_full = 0;  // Oldest dropped from the full queue.
  };
  Counts counts() const;

  // Notified on every post; the Worker polls it beside its sockets.
  wire::Notifier& notifier() { return notifier_; }

 private:
  const size_t context_queue_;
  wire::Notifier notifier_;
  std::mutex events_mu_;
  std::vector<TokenEvent> events_;  // GUARDED_BY(events_mu_)
  mutable std::mutex contexts_mu_;
  std::deque<MapMessage> contexts_;  // GUARDED_BY(contexts_mu_)
  Counts counts_;                    // GUARDED_BY(contexts_mu_)
};

}  // namespace fmoe
