#include "gpu_worker/control/outbox.h"

#include <algorithm>
#include <utility>

namespace fmoe {

void Outbox::PostEvent(TokenEvent event) {
  {
    std::lock_guard<std::mutex> lock(events_mu_);
    events_.push_back(std::move(event));
  }
  notifier_.Notify();
}

void Outbox::PublishContext(MapMessage context) {
  {
    std::lock_guard<std::mutex> lock(contexts_mu_);
    ++counts_.published;
    if (contexts_.size() >= std::max<size_t>(1, context_queue_)) {
      contexts_.pop_front();
      ++counts_.dropped_full;
    }
    contexts_.push_back(std::move(context));
  }
  notifier_.Notify();
}

std::vector<TokenEvent> Outbox::TakeEvents() {
  std::vector<TokenEvent> events;
  std::lock_guard<std::mutex> lock(events_mu_);
  events.swap(events_);
  return events;
}

std::deque<MapMessage> Outbox::TakeContexts() {
  std::deque<MapMessage> contexts;
  std::lock_guard<std::mutex> lock(contexts_mu_);
  contexts.swap(contexts_);
  return contexts;
}

Outbox::Counts Outbox::counts() const {
  std::lock_guard<std::mutex> lock(contexts_mu_);
  return counts_;
}

}  // namespace fmoe
