// The store writer: jobs run in order on its thread and complete in order on the owner's; the
// queue refuses a job once `capacity` are pending; Stop() lets the running job finish, abandons
// the queued ones (done with kUnavailable, never run) and cancels long jobs through their stop
// token; a job that throws completes with kInternal and the writer goes on.
#include "map_service/store_writer.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

class StoreWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("fmoe-store-writer");
    auto db = StoreDb::Open({dir_ + "/db", false});
    ASSERT_TRUE(db.ok()) << db.status().ToString();
    db_ = std::move(*db);
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  static StoreWriterOptions Capacity(size_t n) {
    StoreWriterOptions o;
    o.capacity = n;
    return o;
  }
  // Runs completions until `n` have run (or 10 s pass).
  static size_t RunDoneUntil(StoreWriter& writer, wire::Notifier& notifier, size_t n) {
    size_t done = 0;
    for (int i = 0; i < 1000 && done < n; ++i) {
      std::vector<wire::SocketBase*> none;
      std::vector<bool> readable;
      bool notified = false;
      (void)wire::Poll(none, 10, &readable, &notifier, &notified);
      if (notified) notifier.Drain();
      done += writer.RunDone();
    }
    return done;
  }

  std::string dir_;
  std::unique_ptr<StoreDb> db_;
};

TEST_F(StoreWriterTest, RunsJobsInOrderAndCompletesThemInOrderOnTheOwnersThread) {
  wire::Notifier notifier;
  StoreWriter writer(std::move(db_), Capacity(16), &notifier);
  const auto owner = std::this_thread::get_id();
  std::vector<int> ran, done;
  std::atomic<bool> on_owner{false};
  for (int i = 0; i < 10; ++i) {
    StoreJob job;
    job.run = [&ran, &on_owner, owner, i](StoreDb& db, std::stop_token) {
      if (std::this_thread::get_id() == owner) on_owner = true;
      EXPECT_EQ(db.CountMaps(1), 0u);
      ran.push_back(i);  // The owner reads `ran` only after the completions came back.
    };
    job.done = [&done, owner, i](const Status& s) {
      EXPECT_TRUE(s.ok()) << s.ToString();
      EXPECT_EQ(std::this_thread::get_id(), owner);
      done.push_back(i);
    };
    ASSERT_TRUE(writer.TrySubmit(std::move(job)));
  }
  EXPECT_EQ(RunDoneUntil(writer, notifier, 10), 10u);
  EXPECT_EQ(ran, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(done, ran);
  EXPECT_FALSE(on_owner);
  EXPECT_EQ(writer.pending(), 0u);
}

TEST_F(StoreWriterTest, RefusesJobsOncePendingReachesCapacity) {
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  wire::Notifier notifier;
  StoreWriter writer(std::move(db_), Capacity(3), &notifier);
  int completed = 0;
  auto job = [&] {
    StoreJob j;
    j.run = [released](StoreDb&, std::stop_token) { released.wait(); };
    j.done = [&completed](const Status&) { ++completed; };
    return j;
  };
  ASSERT_TRUE(writer.TrySubmit(job()));  // Running, blocked.
  ASSERT_TRUE(writer.TrySubmit(job()));
  ASSERT_TRUE(writer.TrySubmit(job()));
  EXPECT_TRUE(writer.full());
  EXPECT_FALSE(writer.TrySubmit(job()));  // Back-pressure: refused, and its done never runs.
  EXPECT_EQ(writer.pending(), 3u);
  release.set_value();
  EXPECT_EQ(RunDoneUntil(writer, notifier, 3), 3u);
  EXPECT_EQ(completed, 3);
  EXPECT_FALSE(writer.full());
  EXPECT_TRUE(writer.TrySubmit(job()));
  EXPECT_EQ(RunDoneUntil(writer, notifier, 1), 1u);
  EXPECT_EQ(completed, 4);
}

TEST_F(StoreWriterTest, StopFinishesTheRunningJobAndAbandonsTheQueuedOnes) {
  std::promise<void> started;
  StoreWriter writer(std::move(db_), Capacity(8), nullptr);
  std::vector<Status> done(3);
  std::atomic<int> runs{0};
  for (int i = 0; i < 3; ++i) {
    StoreJob job;
    job.run = [&, i](StoreDb&, std::stop_token stop) {
      ++runs;
      if (i != 0) return;
      started.set_value();
      // A long job: ends early once stop is requested.
      while (!stop.stop_requested()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    };
    job.done = [&done, i](const Status& s) { done[i] = s; };
    ASSERT_TRUE(writer.TrySubmit(std::move(job)));
  }
  started.get_future().wait();
  EXPECT_EQ(writer.Stop(), 2u);
  EXPECT_EQ(runs, 1);
  EXPECT_TRUE(done[0].ok()) << done[0].ToString();
  for (int i = 1; i < 3; ++i) {
    EXPECT_EQ(done[i].code(), ErrorCode::kUnavailable) << done[i].ToString();
    EXPECT_NE(done[i].message().find("abandoned"), std::string::npos) << done[i].message();
  }
  EXPECT_EQ(writer.pending(), 0u);
  StoreJob late;
  late.run = [](StoreDb&, std::stop_token) {};
  late.done = [](const Status&) {};
  EXPECT_FALSE(writer.TrySubmit(std::move(late)));
  EXPECT_EQ(writer.Stop(), 0u);  // Idempotent.
}

TEST_F(StoreWriterTest, AJobThatThrowsCompletesWithAnErrorAndTheWriterGoesOn) {
  wire::Notifier notifier;
  StoreWriter writer(std::move(db_), {}, &notifier);
  Status first, second = Internal("not run");
  StoreJob bad;
  bad.run = [](StoreDb&, std::stop_token) { throw std::runtime_error("disk on fire"); };
  bad.done = [&first](const Status& s) { first = s; };
  StoreJob good;
  good.run = [](StoreDb&, std::stop_token) {};
  good.done = [&second](const Status& s) { second = s; };
  ASSERT_TRUE(writer.TrySubmit(std::move(bad)));
  ASSERT_TRUE(writer.TrySubmit(std::move(good)));
  EXPECT_EQ(RunDoneUntil(writer, notifier, 2), 2u);
  EXPECT_EQ(first.code(), ErrorCode::kInternal);
  EXPECT_NE(first.message().find("disk on fire"), std::string::npos) << first.message();
  EXPECT_TRUE(second.ok()) << second.ToString();
}

}  // namespace
}  // namespace fmoe
