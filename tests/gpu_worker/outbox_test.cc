#include "gpu_worker/control/outbox.h"

#include <thread>
#include <variant>
#include <vector>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

MapMessage Context(uint64_t request_id) { return IterationEnd{request_id, 0, false}; }

uint64_t RequestOf(const MapMessage& m) { return std::get<IterationEnd>(m).request_id; }

TEST(Outbox, KeepsTheNewestContextsAndCountsTheDropped) {
  Outbox outbox(3);
  for (uint64_t i = 1; i <= 5; ++i) outbox.PublishContext(Context(i));
  const auto taken = outbox.TakeContexts();
  ASSERT_EQ(taken.size(), 3u);
  EXPECT_EQ(RequestOf(taken[0]), 3u);
  EXPECT_EQ(RequestOf(taken[2]), 5u);
  EXPECT_EQ(outbox.counts().published, 5u);
  EXPECT_EQ(outbox.counts().dropped_full, 2u);
  EXPECT_TRUE(outbox.TakeContexts().empty());
}

TEST(Outbox, HandsEventsOverInOrderAndWakesThePoll) {
  Outbox outbox;
  std::thread poster([&] {
    for (uint64_t i = 0; i < 100; ++i) {
      TokenEvent ev;
      ev.request_id = i;
      outbox.PostEvent(ev);
    }
  });
  poster.join();
  bool notified = false;
  std::vector<bool> readable;
  ASSERT_TRUE(wire::Poll({}, 0, &readable, &outbox.notifier(), &notified).ok());
  EXPECT_TRUE(notified);
  const auto events = outbox.TakeEvents();
  ASSERT_EQ(events.size(), 100u);
  for (uint64_t i = 0; i < 100; ++i) EXPECT_EQ(events[i].request_id, i);
  EXPECT_TRUE(outbox.TakeEvents().empty());
}

}  // namespace
}  // namespace fmoe
