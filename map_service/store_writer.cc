#include "map_service/store_writer.h"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "common/log.h"

namespace fmoe {

StoreWriter::StoreWriter(std::unique_ptr<StoreDb> db, StoreWriterOptions options,
                         wire::Notifier* notifier)
    : db_(std::move(db)),
      options_(std::move(options)),
      notifier_(notifier),
      thread_([this] { Loop(); }) {}

StoreWriter::~StoreWriter() { Stop(); }

bool StoreWriter::TrySubmit(StoreJob job) {
  if (full()) return false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queued_.push_back(std::move(job));
  }
  ++pending_;
  cv_.notify_one();
  return true;
}

void StoreWriter::Loop() {
  pthread_setname_np(pthread_self(), "fmoe-store");
  const sched_param normal{};
  if (pthread_setschedparam(pthread_self(), SCHED_OTHER, &normal) != 0) {
    spdlog::warn("store writer: cannot run as SCHED_OTHER: {}", std::strerror(errno));
  }
  // Linux keeps a nice value per thread. Once raised it cannot come back down without privilege,
  // so the whole thread runs at it (or at the process's, when that is higher).
  const auto tid = static_cast<id_t>(gettid());
  errno = 0;
  const int inherited = getpriority(PRIO_PROCESS, tid);
  if ((errno != 0 || inherited < options_.nice) &&
      setpriority(PRIO_PROCESS, tid, options_.nice) != 0) {
    spdlog::warn("store writer: cannot set its nice value to {}: {}", options_.nice,
                 std::strerror(errno));
  }
  for (;;) {
    StoreJob job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return exit_ || !queued_.empty(); });
      if (exit_) return;
      job = std::move(queued_.front());
      queued_.pop_front();
    }
    // A job is a boundary: what it throws ends it with an error, and the writer goes on.
    Status ran;
    try {
      if (options_.before_job) options_.before_job(stop_.get_token());
      job.run(*db_, stop_.get_token());
    } catch (...) {
      ran = Internal("store job threw: " + CurrentExceptionText());
      spdlog::error("{}", ran.message());
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      finished_.emplace_back(std::move(job), std::move(ran));
    }
    if (notifier_ != nullptr) notifier_->Notify();
  }
}

size_t StoreWriter::RunDone() {
  std::deque<std::pair<StoreJob, Status>> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    finished.swap(finished_);
  }
  for (auto& [job, ran] : finished) {
    --pending_;
    Done(job, ran);
  }
  return finished.size();
}

void StoreWriter::Done(StoreJob& job, const Status& ran) {
  // The owner's loop goes on whatever one `done` throws.
  try {
    job.done(ran);
  } catch (...) {
    spdlog::error("a store job's completion threw: {}", CurrentExceptionText());
  }
}

size_t StoreWriter::Stop() {
  if (stopped_) return 0;
  stopped_ = true;
  stop_.request_stop();
  std::deque<StoreJob> abandoned;
  {
    std::lock_guard<std::mutex> lock(mu_);
    exit_ = true;
    abandoned.swap(queued_);
  }
  cv_.notify_one();
  thread_.join();
  RunDone();
  const Status why = Unavailable("abandoned: the map service stopped before it was written");
  for (StoreJob& job : abandoned) {
    --pending_;
    Done(job, why);
  }
  return abandoned.size();
}

}  // namespace fmoe
