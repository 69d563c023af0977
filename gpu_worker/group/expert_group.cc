#include "gpu_worker/group/expert_group.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <type_traits>

// Debian's LibTorch is built with Gloo, but its headers leave the Gloo process group out unless
// the includer says so.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef FMOE_HAVE_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "common/clock.h"
#include "common/log.h"
#include "gpu_worker/group/sliced_wait.h"

namespace fmoe {
namespace {

// Hands one collective to the process group, with no other group of this process doing so at
// the same time. LibTorch 2.x records every collective in a process-wide flight recorder that
// crashes when two process groups enqueue at once (several ranks of one process: the tests run
// a group's ranks as threads). A worker process holds one rank, so it never waits here; the
// collective itself runs outside the lock.
template <typename Fn>
auto EnqueueCollective(Fn&& fn) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  return fn();
}

// The first broadcast of a plan carries its length and, when it fits, the plan itself: a decode
// iteration's plan needs one collective.
constexpr int64_t kInlineBytes = 1024;

// What the Gloo and NCCL process groups derive from, and what the collectives are called on:
// c10d::ProcessGroup in LibTorch 1.x, c10d::Backend in 2.x (where a ProcessGroup dispatches to
// backends by device).
using Collectives = std::conditional_t<std::is_base_of_v<c10d::Backend, c10d::ProcessGroupGloo>,
                                       c10d::Backend, c10d::ProcessGroup>;

// c10d's exceptions carry a C++ backtrace in what(); the first line is the message.
std::string Why(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) {
    std::string m = c10->what_without_backtrace();
    return m.substr(0, m.find('\n'));
  }
  std::string m = e.what();
  return m.substr(0, m.find('\n'));
}

// The longest a collective waits before it looks at the liveness again.
constexpr std::chrono::milliseconds kWaitSlice{100};

}  // namespace

struct ExpertGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<Collectives> pg;
  at::Device device = at::kCPU;  // Where the backend wants its tensors.
  bool gather = false;           // Sum by all-gather and a local sum.

  // ---- liveness (options.liveness_timeout > 0) ----
  // Shared with the liveness thread, which may outlive the group: a store that does not answer
  // holds it in a call without a deadline, so the group waits a moment for it, then lets it go.
  struct Liveness {
    std::chrono::milliseconds timeout{0};
    std::string store_at;              // "HOST:PORT", for messages.
    std::atomic<int64_t> round_us{0};  // When this rank's last round went through.
    std::mutex mu;
    std::condition_variable cv;
    bool stopping = false;  // GUARDED_BY(mu)
    bool done = false;      // GUARDED_BY(mu): the thread has returned.
    std::string lost;       // GUARDED_BY(mu): a silent rank, once seen.
  };
  std::shared_ptr<Liveness> liveness;  // Null: off.
  std::thread liveness_thread;

  ~Impl() {
    if (!liveness) return;
    std::unique_lock<std::mutex> lock(liveness->mu);
    liveness->stopping = true;
    liveness->cv.notify_all();
    const bool done =
        liveness->cv.wait_for(lock, std::chrono::seconds(1), [&] { return liveness->done; });
    lock.unlock();
    if (done) {
      liveness_thread.join();
    } else {
      liveness_thread.detach();
    }
  }

  // Why the group is to break now; "" while every rank beats.
  std::string Lost() {
    if (!liveness) return "";
    {
      std::lock_guard<std::mutex> lock(liveness->mu);
      if (!liveness->lost.empty()) return liveness->lost;
    }
    const int64_t silent_ms = (SteadyNowUs() - liveness->round_us.load()) / 1000;
    if (silent_ms > liveness->timeout.count()) {
      return "liveness: rank 0's store at " + liveness->store_at + " has not answered for " +
             std::to_string(silent_ms) + " ms (liveness timeout " +
             std::to_string(liveness->timeout.count()) + " ms)";
    }
    return "";
  }

  // Waits for `work` up to `timeout`, in slices, breaking off (a throw) once Lost() says so.
  template <typename W>
  void Wait(const W& work, std::chrono::milliseconds timeout) {
    if (!liveness) {
      work->wait(timeout);
      return;
    }
    WaitInSlices(work, timeout, kWaitSlice, [this] { return Lost(); });
  }

  // The liveness thread: adds to this rank's counter; rank 0 also watches every other's.
  static void LivenessLoop(std::shared_ptr<Liveness> l, c10::intrusive_ptr<c10d::Store> store,
                           uint32_t rank, uint32_t world, std::chrono::milliseconds interval) {
    const auto key = [](uint32_t r) { return "fmoe/alive/" + std::to_string(r); };
    std::vector<int64_t> last(world, -1);
    std::vector<int64_t> changed_us(world, SteadyNowUs());
    std::unique_lock<std::mutex> lock(l->mu);
    while (!l->stopping) {
      lock.unlock();
      std::string lost;
      try {
        store->add(key(rank), 1);
        const int64_t now = SteadyNowUs();
        for (uint32_t r = 0; r < world && rank == 0; ++r) {
          if (r == rank) continue;
          const int64_t v = store->add(key(r), 0);
          if (v != last[r]) {
            last[r] = v;
            changed_us[r] = now;
          } else if ((now - changed_us[r]) / 1000 > l->timeout.count()) {
            lost = "liveness: rank " + std::to_string(r) + " has not beaten for " +
                   std::to_string((now - changed_us[r]) / 1000) + " ms (liveness timeout " +
                   std::to_string(l->timeout.count()) + " ms)";
          }
        }
        l->round_us.store(SteadyNowUs());
      } catch (const std::exception& e) {
        // Lost() judges from round_us: a store that does not answer shows there.
        spdlog::debug("liveness: store at {}: {}", l->store_at, Why(e));
      }
      lock.lock();
      if (!lost.empty() && l->lost.empty()) {
        l->lost = lost;
        spdlog::warn("{}", lost);
      }
      l->cv.wait_for(lock, interval, [&] { return l->stopping; });
    }
    l->done = true;
    l->cv.notify_all();
  }

  // Sums an integer tensor (on `device`) across the ranks, in place: an all-reduce, or an
  // all-gather and a local sum. Integer sums are exact in any order.
  void SumInPlace(at::Tensor& t, std::chrono::milliseconds timeout) {
    if (gather) {
      std::vector<std::vector<at::Tensor>> gathered(1);
      {
        // Gloo's thread writes them, outside the caller's inference mode: normal tensors.
        c10::InferenceMode normal(false);
        for (int r = 0; r < pg->getSize(); ++r)
          gathered[0].push_back(at::empty(t.sizes(), t.options()));
      }
      std::vector<at::Tensor> input{t};
      c10d::AllgatherOptions gather_options;
      gather_options.timeout = timeout;
      Wait(EnqueueCollective([&] { return pg->allgather(gathered, input, gather_options); }),
           timeout);
      at::Tensor sum = gathered[0][0].clone();
      for (size_t r = 1; r < gathered[0].size(); ++r) sum.add_(gathered[0][r]);
      t.copy_(sum);
      return;
    }
    std::vector<at::Tensor> tensors{t};
    c10d::AllreduceOptions reduce_options;
    reduce_options.reduceOp = c10d::ReduceOp::SUM;
    reduce_options.timeout = timeout;
    Wait(EnqueueCollective([&] { return pg->allreduce(tensors, reduce_options); }), timeout);
  }
};

ExpertGroup::ExpertGroup(ExpertGroupOptions options)
    : options_(std::move(options)), impl_(std::make_unique<Impl>()) {}

ExpertGroup::~ExpertGroup() = default;

Result<std::unique_ptr<ExpertGroup>> ExpertGroup::Join(const ExpertGroupOptions& options) {
  const std::string who = "expert group " + options.group + ": rank " +
                          std::to_string(options.rank) + "/" + std::to_string(options.world_size);
  if (options.world_size == 0 || options.rank >= options.world_size) {
    return InvalidArgument(who + ": the rank is not below the world size");
  }
  std::unique_ptr<ExpertGroup> group(new ExpertGroup(options));
  if (options.world_size == 1) return group;
  if (options.rendezvous_host.empty() || options.rendezvous_port == 0) {
    return InvalidArgument(who + ": no rendezvous address");
  }
  const std::string at = options.rendezvous_host + ":" + std::to_string(options.rendezvous_port);
  // A client's connect fails at once, not at the timeout, when rank 0's host is unreachable
  // (EHOSTUNREACH while a link is down): it tries again until the rendezvous timeout has passed,
  // so a rank restarted during a network outage waits for it instead of crash-looping.
  const auto deadline = std::chrono::steady_clock::now() + options.rendezvous_timeout;
  for (int attempt = 1;; ++attempt) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    try {
      c10d::TCPStoreOptions store_options;
      store_options.port = options.rendezvous_port;
      store_options.isServer = options.rank == 0;
      store_options.numWorkers = options.world_size;
      store_options.waitWorkers = true;
      store_options.timeout = std::max(left, std::chrono::milliseconds{1});
      group->impl_->store =
          c10::make_intrusive<c10d::TCPStore>(options.rendezvous_host, store_options);
      break;
    } catch (const std::exception& e) {
      if (options.rank != 0 &&
          std::chrono::steady_clock::now() + std::chrono::seconds{1} < deadline) {
        if (attempt == 1) {
          spdlog::warn(
              "{}: rendezvous at {} not reachable yet ({}); trying again each second "
              "until the rendezvous timeout ({} s)",
              who, at, Why(e), options.rendezvous_timeout.count() / 1000);
        }
        std::this_thread::sleep_for(std::chrono::seconds{1});
        continue;
      }
      return Unavailable(who + ": rendezvous at " + at + " failed within " +
                         std::to_string(options.rendezvous_timeout.count() / 1000) + " s (" +
                         (options.rank == 0 ? "serving the store; is the port free and every "
                                              "rank started?"
                                            : "is rank 0 running?") +
                         "): " + Why(e));
    }
  }
  try {
#ifdef FMOE_HAVE_NCCL
    if (options.cuda_index >= 0) {
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = options.collective_timeout;
      group->impl_->pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          group->impl_->store, static_cast<int>(options.rank), static_cast<int>(options.world_size),
          nccl_options);
      group->impl_->device = at::Device(at::kCUDA, static_cast<int16_t>(options.cuda_index));
      group->backend_ = "nccl";
    }
#endif
    if (!group->impl_->pg) {
      // Gloo writes to its peers' TCP sockets: a peer that died must be an error of the
      // collective, never a SIGPIPE that ends this process (the worker's main ignores it too;
      // any other process holding a group, a test or a benchmark, must as well).
      static std::once_flag ignore_sigpipe;
      std::call_once(ignore_sigpipe, [] { signal(SIGPIPE, SIG_IGN); });
      auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.collective_timeout);
      gloo_options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForHostname(options.host));
      // One thread runs the collectives; they are issued one at a time anyway.
      gloo_options->threads = 1;
      group->impl_->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(
          group->impl_->store, static_cast<int>(options.rank), static_cast<int>(options.world_size),
          gloo_options);
      group->backend_ = "gloo";
    }
  } catch (const std::exception& e) {
    return Unavailable(who + ": connecting the ranks (this rank's host " + options.host +
                       ") failed: " + Why(e));
  }
  // Measured over loopback (bench/RESULTS.md): Gloo's all-gather beats its all-reduce for two
  // ranks and loses to it for three.
  group->impl_->gather = options.sum_algorithm == SumAlgorithm::kAllGather ||
                         (options.sum_algorithm == SumAlgorithm::kAuto &&
                          group->backend_ == "gloo" && options.world_size == 2);
  // Gloo only: a Gloo work's wait that runs out of its slice leaves the work as it was; NCCL's
  // can count it as the collective's timeout.
  if (options.liveness_timeout.count() > 0 && group->backend_ == "gloo") {
    try {
      // A connection of its own: the collectives' store client is not shared across threads.
      c10d::TCPStoreOptions beat_options;
      beat_options.port = options.rendezvous_port;
      beat_options.isServer = false;
      beat_options.waitWorkers = false;
      // c10d counts a connect's timeout in whole seconds; Lost() bounds the silence instead.
      beat_options.timeout =
          std::max<std::chrono::milliseconds>(options.rendezvous_timeout, std::chrono::seconds(5));
      auto beat_store = c10::make_intrusive<c10d::TCPStore>(options.rendezvous_host, beat_options);
      auto l = std::make_shared<Impl::Liveness>();
      l->timeout = options.liveness_timeout;
      l->store_at = at;
      l->round_us.store(SteadyNowUs());
      group->impl_->liveness = l;
      group->impl_->liveness_thread = std::thread(Impl::LivenessLoop, l, beat_store, options.rank,
                                                  options.world_size, options.liveness_interval);
    } catch (const std::exception& e) {
      return Unavailable(who + ": liveness connection to " + at + " failed: " + Why(e));
    }
  }
  spdlog::info(
      "{}: joined through {} ({} backend, sums by {}, collective timeout {} ms, liveness "
      "timeout {} ms)",
      who, at, group->backend_, group->impl_->gather ? "all-gather" : "all-reduce",
      options.collective_timeout.count(),
      group->impl_->liveness ? options.liveness_timeout.count() : 0);
  return group;
}

bool ExpertGroup::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !failure_.ok();
}

Status ExpertGroup::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

GroupStats ExpertGroup::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

Status ExpertGroup::Fail(const std::string& op, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_.ok()) {
    failure_ =
        Unavailable("expert group " + options_.group + ": rank " + std::to_string(options_.rank) +
                    "/" + std::to_string(options_.world_size) + ": " + op + " failed: " + why);
  }
  return failure_;
}

Status ExpertGroup::CombineDisjoint(at::Tensor& t) {
  if (options_.world_size == 1) return Status::Ok();
  if (failed()) return failure();
  const int64_t t0 = SteadyNowUs();
  const size_t bytes = t.numel() * t.element_size();
  try {
    at::Tensor flat = t.is_contiguous() ? t : t.contiguous();
    // Bytes as integers: with one nonzero contributor per element there is nothing to carry.
    at::Tensor words =
        bytes % 4 == 0 ? flat.view({-1}).view(at::kInt) : flat.view({-1}).view(at::kByte);
    at::Tensor on_device = words.device() == impl_->device ? words : words.to(impl_->device);
    impl_->SumInPlace(on_device, options_.collective_timeout);
    if (!on_device.is_same(words)) words.copy_(on_device);
    if (!flat.is_same(t)) t.copy_(flat);
  } catch (const std::exception& e) {
    return Fail("the expert all-reduce (" + std::to_string(bytes) + " bytes)", Why(e));
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.combines;
  stats_.payload_bytes += bytes;
  stats_.wait_us += static_cast<uint64_t>(SteadyNowUs() - t0);
  return Status::Ok();
}

Status ExpertGroup::Broadcast(std::vector<uint8_t>* bytes) {
  if (options_.world_size == 1) return Status::Ok();
  if (failed()) return failure();
  const int64_t t0 = SteadyNowUs();
  const bool root = options_.rank == 0;
  const auto cpu_bytes = at::TensorOptions().dtype(at::kByte);
  try {
    c10d::BroadcastOptions broadcast_options;
    broadcast_options.rootRank = 0;
    broadcast_options.timeout = options_.collective_timeout;
    auto run = [&](at::Tensor& host) {
      at::Tensor dev = host.device() == impl_->device ? host : host.to(impl_->device);
      std::vector<at::Tensor> tensors{dev};
      impl_->Wait(
          EnqueueCollective([&] { return impl_->pg->broadcast(tensors, broadcast_options); }),
          options_.collective_timeout);
      if (!dev.is_same(host)) host.copy_(dev);
    };
    // Header: the length (8 bytes), then up to kInlineBytes - 8 bytes of the payload.
    at::Tensor head = at::zeros({kInlineBytes}, cpu_bytes);
    uint8_t* h = head.data_ptr<uint8_t>();
    int64_t length = root ? static_cast<int64_t>(bytes->size()) : 0;
    if (root) {
      std::memcpy(h, &length, sizeof(length));
      std::memcpy(h + 8, bytes->data(), std::min<size_t>(bytes->size(), kInlineBytes - 8));
    }
    run(head);
    std::memcpy(&length, h, sizeof(length));
    if (length < 0 || length > (int64_t{1} << 31)) {
      return Fail("the plan broadcast", "rank 0 announced " + std::to_string(length) + " bytes");
    }
    const int64_t inline_part = std::min<int64_t>(length, kInlineBytes - 8);
    if (!root) bytes->assign(h + 8, h + 8 + inline_part);
    if (length > inline_part) {
      at::Tensor rest = at::empty({length - inline_part}, cpu_bytes);
      if (root)
        std::memcpy(rest.data_ptr<uint8_t>(), bytes->data() + inline_part, length - inline_part);
      run(rest);
      if (!root) {
        const uint8_t* p = rest.data_ptr<uint8_t>();
        bytes->insert(bytes->end(), p, p + (length - inline_part));
      }
    }
  } catch (const std::exception& e) {
    return Fail("the plan broadcast", Why(e));
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.broadcasts;
  if (root) stats_.payload_bytes += bytes->size();
  stats_.wait_us += static_cast<uint64_t>(SteadyNowUs() - t0);
  return Status::Ok();
}

Status ExpertGroup::SumCounters(std::span<int64_t> values) {
  if (options_.world_size == 1 || values.empty()) return Status::Ok();
  if (failed()) return failure();
  const int64_t t0 = SteadyNowUs();
  try {
    at::Tensor host = at::from_blob(values.data(), {static_cast<int64_t>(values.size())},
                                    at::TensorOptions().dtype(at::kLong));
    at::Tensor dev = impl_->device.is_cpu() ? host.clone() : host.to(impl_->device);
    impl_->SumInPlace(dev, options_.collective_timeout);
    host.copy_(dev);
  } catch (const std::exception& e) {
    return Fail("the counter all-reduce", Why(e));
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.sums;
  stats_.payload_bytes += values.size() * sizeof(int64_t);
  stats_.wait_us += static_cast<uint64_t>(SteadyNowUs() - t0);
  return Status::Ok();
}

Status ExpertGroup::MinAcrossRanks(std::span<int64_t> values) {
  if (options_.world_size == 1 || values.empty()) return Status::Ok();
  // Each rank's values in its own row, zeros elsewhere: the sum is every rank's row.
  const size_t n = values.size();
  std::vector<int64_t> rows(n * options_.world_size, 0);
  std::copy(values.begin(), values.end(), rows.begin() + static_cast<std::ptrdiff_t>(n * rank()));
  FMOE_RETURN_IF_ERROR(SumCounters(rows));
  for (size_t i = 0; i < n; ++i) {
    int64_t least = rows[i];
    for (uint32_t r = 1; r < options_.world_size; ++r) least = std::min(least, rows[r * n + i]);
    values[i] = least;
  }
  return Status::Ok();
}

}  // namespace fmoe
