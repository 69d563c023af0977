// The map service's store writer: one thread that owns the StoreDb once the service has loaded
// it, and does the durable work off the matching thread: map and registration writes (fsync with
// `sync`), export and import files. Fed by a bounded queue: TrySubmit() refuses a job while
// `capacity` jobs are pending, and the caller decides what refusal means (map_service/README.md).
// Jobs run one at a time, in submission order; their `done` runs on the owner's thread, in the
// same order, from RunDone(). The writer notifies `notifier` whenever a job finishes.
// Threading: everything but the constructor's thread is the owner's (the service thread); the
// writer thread touches only its queue (under mu_) and the database.
// A job: QUEUED (TrySubmit) -> RUNNING -> FINISHED -> done(Ok) (RunDone)
//        QUEUED -> ABANDONED (Stop) -> done(kUnavailable "abandoned: ...") (Stop)
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stop_token>
#include <thread>
#include <utility>

#include "common/status.h"
#include "common/wire/wire.h"
#include "map_service/store_db.h"

namespace fmoe {

struct StoreJob {
  // On the writer thread. A long job (export, import) ends early once `stop` is requested.
  std::function<void(StoreDb& db, std::stop_token stop)> run;
  // On the owner's thread, after `run`: Ok; kInternal when `run` threw (logged); kUnavailable
  // when the job was abandoned at Stop without running. What `run` produced travels in state
  // both lambdas share: the queue hands it over.
  std::function<void(const Status& ran)> done;
};

struct StoreWriterOptions {
  size_t capacity = 1024;  // Jobs pending at once (queued, running or finished). Default: 1024
  // The writer thread's nice value, 0..19 (SCHED_OTHER whatever its creator's policy), as RocksDB
  // lowers its background threads' CPU priority: its work yields the CPU. Default: 10
  int nice = 10;
  // Tests only: runs on the writer thread before each job's `run`. Default: none
  std::function<void(std::stop_token stop)> before_job;
};

class StoreWriter {
 public:
  // Starts the writer thread. `notifier` may be null (the owner then polls RunDone).
  StoreWriter(std::unique_ptr<StoreDb> db, StoreWriterOptions options, wire::Notifier* notifier);
  ~StoreWriter();  // Stop(), if not done yet.
  StoreWriter(const StoreWriter&) = delete;
  StoreWriter& operator=(const StoreWriter&) = delete;

  // Queues a job; false when `capacity` jobs are pending or after Stop (`done` will not run).
  [[nodiscard]] bool TrySubmit(StoreJob job);
  // Jobs submitted whose `done` has not run yet (queued, running or finished).
  size_t pending() const { return pending_; }
  // No job can be submitted now: `capacity` are pending, or Stop ran.
  bool full() const { return stopped_ || pending_ >= options_.capacity; }
  // Runs `done` of every finished job, oldest first; returns how many. A `done` may submit.
  size_t RunDone();
  // Asks the running and later long jobs to end early (their stop token); the queue still runs.
  void RequestStop() { stop_.request_stop(); }
  // Requests stop, abandons the queued jobs, waits for the running one, then runs `done` of the
  // finished jobs and of the abandoned ones. Returns how many were abandoned. Idempotent.
  size_t Stop();

 private:
  void Loop();
  void Done(StoreJob& job, const Status& ran);

  std::unique_ptr<StoreDb> db_;
  const StoreWriterOptions options_;
  wire::Notifier* notifier_;
  size_t pending_ = 0;  // Owner's thread only.
  bool stopped_ = false;
  std::stop_source stop_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<StoreJob> queued_;                       // GUARDED_BY(mu_)
  std::deque<std::pair<StoreJob, Status>> finished_;  // GUARDED_BY(mu_)
  bool exit_ = false;                                 // GUARDED_BY(mu_)
  std::thread thread_;                                // Last: starts after the above.
};

}  // namespace fmoe
