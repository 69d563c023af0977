// CudaLink: the transfer engine on a real GPU. One worker thread takes tasks in the link order of
// transfer_queue.h and issues cudaMemcpyAsync chunk by chunk on a dedicated non-blocking copy
// stream, keeping up to kWindow chunks in flight (an event after each), so the stream never idles
// and a park or cancel takes effect within kWindow chunks. A task is reported once the event
// after its last chunk has completed (cudaEventSynchronize).
//
// Compute fences: RecordComputeFence() records an event on the legacy default stream (LibTorch's
// default). The link owns fence events (fence_registry.h): a fence lives while a submitted task
// that has not started copying names it, and while it is the newest (the expert cache names the
// newest fence in every copy until the next one); the rest are destroyed with the link. A task
// naming a fence that is gone (a bookkeeping error, logged) waits on a fresh event on the legacy
// default stream instead (later in that stream, so still safe, only more conservative).
//
// Lock order: the queue (inside TransferQueue) and the fence registry's lock are never held
// together.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <spdlog/spdlog.h>

#include "gpu_worker/cache/transfer/fence_registry.h"
#include "gpu_worker/cache/transfer/transfer_engine.h"
#include "gpu_worker/cache/transfer/transfer_queue.h"

namespace fmoe {
namespace {

using transfer_internal::ChunkVerdict;
using transfer_internal::LinkTask;
using transfer_internal::SteadyNowNs;
using transfer_internal::TransferQueue;

constexpr int kWindow = 4;  // Chunks in flight on the copy stream.

// Converts a CUDA error into a Status and clears it if it is not sticky.
Status CudaStatus(cudaError_t err, int device, const char* what) {
  cudaGetLastError();
  std::string message =
      "link: cuda:" + std::to_string(device) + ": " + what + ": " + cudaGetErrorString(err);
  if (err == cudaErrorMemoryAllocation) return ResourceExhausted(std::move(message));
  return Unavailable(std::move(message));
}

class CudaLink final : public TransferEngine {
 public:
  CudaLink(int device, const LinkOptions& options)
      : device_(device), chunk_bytes_(options.cuda_chunk_bytes) {}

  // Creates the stream and events and starts the worker. REQUIRES: device_ is current.
  Status Init() {
    cudaError_t err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    if (err != cudaSuccess) return CudaStatus(err, device_, "cudaStreamCreateWithFlags");
    for (cudaEvent_t& ev : chunk_events_) {
      err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
      if (err != cudaSuccess) return CudaStatus(err, device_, "cudaEventCreateWithFlags");
    }
    thread_ = std::thread([this] { Run(); });
    return Status::Ok();
  }

  ~CudaLink() override {
    queue_.Stop();
    if (thread_.joinable()) thread_.join();
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (cudaEvent_t ev : chunk_events_) {
      if (ev != nullptr) cudaEventDestroy(ev);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::string_view name() const override { return "cuda"; }

  void Submit(const TransferTask& task) override {
    if (task.wait_fence != 0) fences_.Acquire(task.wait_fence);
    queue_.Submit(task);
  }

  void Cancel(uint64_t id) override {
    std::optional<LinkTask> t = queue_.Cancel(id);
    if (t && !t->started && t->task.wait_fence != 0) fences_.Release(t->task.wait_fence);
  }

  void Promote(uint64_t id) override { queue_.Promote(id); }
  size_t Poll(std::vector<TransferDone>* out) override { return queue_.Poll(out); }
  size_t Wait(std::vector<TransferDone>* out, std::chrono::milliseconds timeout) override {
    return queue_.Wait(out, timeout);
  }
  TransferStats stats() const override { return queue_.stats(); }

  // On a CUDA error the host waits for the compute stream instead and returns 0 (no fence needed).
  uint64_t RecordComputeFence() override {
    cudaEvent_t ev = nullptr;
    cudaError_t err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (err == cudaSuccess) {
      err = cudaEventRecord(ev, cudaStreamLegacy);
      if (err != cudaSuccess) cudaEventDestroy(ev);
    }
    if (err != cudaSuccess) {
      spdlog::error("{}; waiting for compute on the host",
                    CudaStatus(err, device_, "RecordComputeFence").message());
      cudaStreamSynchronize(cudaStreamLegacy);
      return 0;
    }
    const uint64_t id = next_fence_++;
    fences_.Add(id, ev);
    return id;
  }

  Result<void*> AllocateDevice(size_t bytes) override {
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      return CudaStatus(err, device_, ("cudaMalloc(" + std::to_string(bytes) + ")").c_str());
    }
    return p;
  }
  Result<uint64_t> FreeDeviceBytes() const override {
    size_t free = 0, total = 0;
    cudaError_t err = cudaSetDevice(device_);
    if (err == cudaSuccess) err = cudaMemGetInfo(&free, &total);
    if (err != cudaSuccess) return CudaStatus(err, device_, "cudaMemGetInfo");
    return static_cast<uint64_t>(free);
  }
  void FreeDevice(void* ptr) override {
    cudaError_t err = cudaFree(ptr);
    if (err != cudaSuccess) spdlog::error("{}", CudaStatus(err, device_, "cudaFree").message());
  }
  Status RegisterHost(void* ptr, size_t bytes) override {
    cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
    if (err != cudaSuccess) return CudaStatus(err, device_, "cudaHostRegister");
    return Status::Ok();
  }
  void UnregisterHost(void* ptr) override {
    cudaError_t err = cudaHostUnregister(ptr);
    if (err != cudaSuccess) {
      spdlog::error("{}", CudaStatus(err, device_, "cudaHostUnregister").message());
    }
  }

 private:
  // Makes the copy stream wait for fence `id`. Worker thread.
  cudaError_t WaitForFence(uint64_t id) {
    cudaError_t err = cudaSuccess;
    if (fences_.Use(id, [&](cudaEvent_t ev) { err = cudaStreamWaitEvent(stream_, ev, 0); })) {
      return err;
    }
    spdlog::warn("link: cuda:{}: fence {:#x} is gone; waiting on a newer one", device_, id);
    cudaEvent_t ev = nullptr;
    err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (err != cudaSuccess) return err;
    err = cudaEventRecord(ev, cudaStreamLegacy);
    if (err == cudaSuccess) err = cudaStreamWaitEvent(stream_, ev, 0);
    cudaEventDestroy(ev);
    return err;
  }

  // The worker thread: one segment per loop. A failed CUDA call is logged and its task completes
  // as cancelled (bytes_copied = the chunks known to have landed): the caller sees a cancelled
  // load, as if it had cancelled it, and may retry or fall back; there is no error channel in
  // TransferDone.
  void Run() {
    cudaError_t err = cudaSetDevice(device_);
    if (err != cudaSuccess) {
      spdlog::error("{}", CudaStatus(err, device_, "cudaSetDevice in the copy thread").message());
    }
    LinkTask t;
    while (queue_.TakeNext(&t)) {
      const int64_t segment_start = SteadyNowNs();
      bool failed = false;
      if (!t.started) {
        t.started = true;
        t.start_ns = segment_start;
        if (t.task.wait_fence != 0) {
          err = WaitForFence(t.task.wait_fence);
          if (err != cudaSuccess) failed = Fail(t, err, "cudaStreamWaitEvent");
        }
      }
      const auto* src = static_cast<const char*>(t.task.src);
      auto* dst = static_cast<char*>(t.task.dst);
      size_t issued = t.offset;
      size_t inflight[kWindow] = {};
      int head = 0;
      int count = 0;
      bool issuing = !failed;
      for (;;) {
        while (issuing && count < kWindow && issued < t.task.bytes) {
          const size_t n = std::min(chunk_bytes_, t.task.bytes - issued);
          const int slot = (head + count) % kWindow;
          err = cudaMemcpyAsync(dst + issued, src + issued, n, cudaMemcpyHostToDevice, stream_);
          if (err == cudaSuccess) err = cudaEventRecord(chunk_events_[slot], stream_);
          if (err != cudaSuccess) {
            issuing = false;
            failed = Fail(t, err, "cudaMemcpyAsync");
            break;
          }
          inflight[slot] = n;
          ++count;
          issued += n;
        }
        if (count == 0) break;
        err = cudaEventSynchronize(chunk_events_[head]);
        if (err != cudaSuccess) {
          failed = Fail(t, err, "cudaEventSynchronize");
          cudaStreamSynchronize(stream_);  // Let the rest drain before the events are reused.
          break;
        }
        const size_t n = inflight[head];
        head = (head + 1) % kWindow;
        --count;
        t.offset += n;
        if (queue_.AfterChunk(n) != ChunkVerdict::kContinue) issuing = false;
      }
      const int64_t end = SteadyNowNs();
      (void)queue_.EndSegment(std::move(t), end, end - segment_start);
      t = LinkTask();
    }
  }

  // Logs a failed CUDA call for task `t` and flags it cancelled. Returns true.
  bool Fail(const LinkTask& t, cudaError_t err, const char* what) {
    spdlog::error("{}; task={} bytes={} completes cancelled",
                  CudaStatus(err, device_, what).message(), t.task.id, t.task.bytes);
    (void)queue_.Cancel(t.task.id);  // The current task: flagged, reported by EndSegment.
    return true;
  }

  const int device_;
  const size_t chunk_bytes_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t chunk_events_[kWindow] = {};  // Worker thread only (after Init).
  // Destroying a pending event is safe: CUDA frees it once it completes.
  FenceRegistry<cudaEvent_t> fences_{[](cudaEvent_t ev) { cudaEventDestroy(ev); }};
  std::atomic<uint64_t> next_fence_{1};
  TransferQueue queue_;
  std::thread thread_;
};

}  // namespace

Result<std::unique_ptr<TransferEngine>> NewCudaLink(int device_index, const LinkOptions& options) {
  FMOE_RETURN_IF_ERROR(transfer_internal::ValidateLinkOptions(options));
  if (device_index < 0) {
    return InvalidArgument("link: cuda device index " + std::to_string(device_index) +
                           " is negative");
  }
  cudaError_t err = cudaSetDevice(device_index);
  if (err != cudaSuccess) return CudaStatus(err, device_index, "cudaSetDevice");
  auto link = std::make_unique<CudaLink>(device_index, options);
  FMOE_RETURN_IF_ERROR(link->Init());
  return std::unique_ptr<TransferEngine>(std::move(link));
}

}  // namespace fmoe
