// Transfer engine (DESIGN sections 2 and 6): moves expert bytes from host memory into device
// cache slots over one link, one copy at a time. Backends: EmulatedLink (cpu mode: its own
// thread does real memcpy paced to link_gbps and link_latency_us) and CudaLink (cuda mode: a
// copy stream and events; transfer_engine_cuda.cu). The expert cache owns one.
//
// Threads: Submit/Cancel/Promote/Poll/Wait/RecordComputeFence are called by the engine thread
// only. The backend's thread does the copies; finished tasks come back through Poll/Wait as
// TransferDone records, never as callbacks.
//
// Order on the link: on-demand tasks first (FIFO among them), then prefetches by descending
// priority (FIFO on ties). When an on-demand task arrives while a prefetch is being copied, the
// prefetch is parked at its next chunk boundary (progress kept) and resumed after the on-demand
// tasks; a parked task competes again by its priority.
//
// A task's life: QUEUED --(link free, its turn)--> COPYING --(all bytes)--> done
//   QUEUED or COPYING(parked at a chunk) --Cancel--> done with cancelled = true
//   QUEUED prefetch --Promote--> QUEUED on-demand (a prefetch the running layer now waits for)
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace fmoe {

// TransferTask::key when the task names no expert.
inline constexpr uint32_t kNoExpertKey = 0xffffffffu;

struct TransferTask {
  uint64_t id = 0;            // Unique among unfinished tasks; chosen by the caller.
  const void* src = nullptr;  // Host memory (pinned in cuda mode).
  // The expert (layer * J + expert) whose bytes these are. A link in front of a host tier
  // (TieredLink) finds the source itself from it and ignores src. Default: none
  uint32_t key = kNoExpertKey;
  void* dst = nullptr;  // Device cache slot (cpu mode: the emulated device pool).
  size_t bytes = 0;
  bool on_demand = false;  // Overtakes every prefetch.
  double priority = 0.0;   // Among prefetches: higher first.
  // From RecordComputeFence(): the copy must not write dst before it. 0 = none.
  uint64_t wait_fence = 0;
};

struct TransferDone {
  uint64_t id = 0;
  bool cancelled = false;
  size_t bytes_copied = 0;  // All of them unless cancelled.
  int64_t submit_ns = 0;    // Steady clock (ns): Submit, first byte, last byte.
  int64_t start_ns = 0;     // Cancelled before its first byte: start_ns == end_ns (the Cancel).
  int64_t end_ns = 0;
  // Not ok when the source could not be had (a tiered link's disk read failed): nothing was
  // copied, and the message names the file and the tensor.
  Status status;
};

struct TransferStats {
  uint64_t tasks_done = 0;  // Finished with every byte; cancelled ones are not counted.
  uint64_t tasks_cancelled = 0;
  uint64_t preemptions = 0;   // Prefetches parked for an on-demand task.
  uint64_t bytes_copied = 0;  // Including the partial bytes of cancelled tasks.
  int64_t busy_ns = 0;        // Time the link spent copying (latency included).
};

struct LinkOptions {
  double gbps = 16.0;        // Emulated bandwidth, gigabytes (1e9 bytes) per second. Default: 16
  double latency_us = 10.0;  // Emulated fixed cost per task, microseconds. Default: 10
  size_t chunk_bytes = 256 << 10;  // Copy and preemption granularity. Default: 256 KiB
  // The CUDA link's copy and preemption granularity, 4 chunks in flight. Default: 4 MiB: on an
  // H100 (PCIe 5) 4 MiB chunks moved 51.9 GB/s against 54-55 GB/s for one plain pinned copy, and
  // 256 KiB chunks 33.4 GB/s; a preempting on-demand load waits for at most one chunk (~80 us).
  // `link_bench` (BM_CudaLink/chunk_KiB) measures it per chunk size.
  size_t cuda_chunk_bytes = size_t{4} << 20;
};

class TransferEngine {
 public:
  virtual ~TransferEngine() = default;
  virtual std::string_view name() const = 0;
  virtual void Submit(const TransferTask& task) = 0;
  // No effect on a finished or unknown id. A cancelled task is still reported by Poll/Wait.
  virtual void Cancel(uint64_t id) = 0;
  // Makes a queued or parked prefetch on-demand. No effect on an unknown id.
  virtual void Promote(uint64_t id) = 0;
  // A load of expert `key` is likely soon, not yet submitted: a link in front of a slower tier
  // may start bringing its bytes closer. `use_in_ns`: the predicted time until the expert is
  // used (the layers until its layer times a layer's compute), so the link can judge whether
  // reading it now is worth it; negative when nothing is measured yet. Default: nothing.
  virtual void Hint(uint32_t key, int64_t use_in_ns) {}
  // Whether expert `key`'s bytes are in host memory now, so that a load waits for no slower tier.
  // Default: always.
  virtual bool Staged(uint32_t key) const { return true; }
  // Appends finished tasks to `out` without blocking; returns how many.
  virtual size_t Poll(std::vector<TransferDone>* out) = 0;
  // Blocks until at least one task has finished (or `timeout` passes) and appends every finished
  // task; returns how many. Returns 0 at once if nothing is submitted and unfinished.
  virtual size_t Wait(std::vector<TransferDone>* out, std::chrono::milliseconds timeout) = 0;
  // cuda: records an event on the current compute stream (after the kernels that read a slot)
  // and returns it; cpu: 0, compute is synchronous.
  virtual uint64_t RecordComputeFence() { return 0; }
  virtual TransferStats stats() const = 0;

  // Memory on the two ends of the link. Called by the owner before Submit, from one thread.
  // The device slot pool: cuda: device memory; cpu: host memory standing for it (64-byte
  // aligned). kResourceExhausted when it cannot be had.
  virtual Result<void*> AllocateDevice(size_t bytes) = 0;
  virtual void FreeDevice(void* ptr) = 0;
  // Bytes the slot pool could still take: cuda: the device's free memory (cudaMemGetInfo); cpu:
  // the host's available memory (/proc/meminfo MemAvailable), which the emulated slots use.
  // Links that cannot tell (test and replay links): kFailedPrecondition.
  virtual Result<uint64_t> FreeDeviceBytes() const {
    return FailedPrecondition(std::string("link: ") + std::string(name()) +
                              " cannot tell its free memory");
  }
  // Makes host memory a copy source at full speed (cuda: cudaHostRegister, page-locked);
  // cpu: nothing to do.
  virtual Status RegisterHost(void* ptr, size_t bytes) { return Status::Ok(); }
  virtual void UnregisterHost(void* ptr) {}
};

// Emulated link for cpu mode: one thread copying with memcpy, chunk by chunk, each task taking
// latency_us + bytes / gbps of wall time (it sleeps off the difference).
Result<std::unique_ptr<TransferEngine>> NewEmulatedLink(const LinkOptions& options);

// The CUDA backend (cudaMemcpyAsync on a dedicated non-blocking stream, one event per task,
// compute fences as events). kFailedPrecondition in builds without FMOE_CUDA.
Result<std::unique_ptr<TransferEngine>> NewCudaLink(int device_index, const LinkOptions& options);

}  // namespace fmoe
