#include "gpu_worker/group/sliced_wait.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

namespace fmoe {
namespace {

using std::chrono::milliseconds;

// A c10d Work's behaviour, scripted: the first `slices_before_done` waits run out ("Operation
// timed out!", as c10d says); the work completes right after the wait given by
// `done_after_wait` (before the caller looks at isCompleted()), with `error` or without.
struct FakeWork {
  int slices_before_done = 0;
  int done_after_wait = -1;  // -1: never completes on its own.
  std::string error;         // Empty: completes without error.
  int waits = 0;
  bool completed = false;

  void wait(milliseconds /*slice*/) {
    ++waits;
    if (completed) {
      if (!error.empty()) throw std::runtime_error(error);
      return;
    }
    if (waits > slices_before_done && done_after_wait < 0) {
      completed = true;
      if (!error.empty()) throw std::runtime_error(error);
      return;
    }
    if (waits == done_after_wait) completed = true;  // Completes as the slice runs out.
    throw std::runtime_error("Operation timed out!");
  }
  bool isCompleted() const { return completed; }
};

std::string Never() { return ""; }

TEST(WaitInSlices, AWorkThatCompletesAsItsSliceRunsOutSucceeds) {
  auto work = std::make_shared<FakeWork>();
  work->done_after_wait = 3;
  EXPECT_NO_THROW(WaitInSlices(work, milliseconds{60000}, milliseconds{1}, Never));
  EXPECT_EQ(work->waits, 4);  // Three slices, then the completed work's own outcome.
}

TEST(WaitInSlices, AWorkThatFailsAsItsSliceRunsOutGivesItsOwnError) {
  auto work = std::make_shared<FakeWork>();
  work->done_after_wait = 1;
  work->error = "Connection closed by peer";
  try {
    WaitInSlices(work, milliseconds{60000}, milliseconds{1}, Never);
    FAIL() << "no throw";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "Connection closed by peer");
  }
}

TEST(WaitInSlices, SlicesRunOutUntilTheWorkIsDone) {
  auto work = std::make_shared<FakeWork>();
  work->slices_before_done = 5;
  EXPECT_NO_THROW(WaitInSlices(work, milliseconds{60000}, milliseconds{1}, Never));
  EXPECT_EQ(work->waits, 6);
}

TEST(WaitInSlices, ALostRankBreaksTheWaitWithItsReason) {
  auto work = std::make_shared<FakeWork>();
  work->slices_before_done = 1000000;
  int asked = 0;
  try {
    WaitInSlices(work, milliseconds{60000}, milliseconds{1}, [&]() -> std::string {
      return ++asked < 3 ? "" : "liveness: rank 2 has not beaten for 2100 ms";
    });
    FAIL() << "no throw";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "liveness: rank 2 has not beaten for 2100 ms");
  }
  EXPECT_EQ(work->waits, 3);
}

TEST(WaitInSlices, TheTimeoutEndsAWorkThatNeverCompletes) {
  auto work = std::make_shared<FakeWork>();
  work->slices_before_done = 1000000;
  try {
    WaitInSlices(work, milliseconds{20}, milliseconds{1}, Never);
    FAIL() << "no throw";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "Operation timed out!");
  }
  EXPECT_FALSE(work->isCompleted());
}

}  // namespace
}  // namespace fmoe
