// TieredLink (DESIGN section 13): the device link with the host tier in front of it, as one
// TransferEngine for the expert cache. A task names its expert (TransferTask::key): when the
// expert is in a host slot the slot is pinned and the copy goes to the device link at once;
// otherwise the host tier reads it from disk first (urgent for an on-demand task) and the copy
// follows the read. The slot is unpinned when the copy is done. A failed read finishes the task
// with its status (nothing copied). Cancel drops a task still waiting for its read at once (the
// read finishes into the host tier, where the expert stays); Promote makes a waiting read urgent.
// Hint asks the host tier to prefetch. Times: a task that waited for a read reports the read's
// start as its start, so the cache's load-time model sees the disk.
//
// Threads: as TransferEngine (the engine thread), with the host tier on the same thread.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "gpu_worker/cache/store/host_tier.h"
#include "gpu_worker/cache/transfer/transfer_engine.h"

namespace fmoe {

class TieredLink final : public TransferEngine {
 public:
  // `tier` must outlive the link.
  TieredLink(std::unique_ptr<TransferEngine> device_link, HostTier* tier);
  ~TieredLink() override;

  std::string_view name() const override { return name_; }
  void Submit(const TransferTask& task) override;
  void Cancel(uint64_t id) override;
  void Promote(uint64_t id) override;
  void Hint(uint32_t key, int64_t use_in_ns) override { tier_->Prefetch(key, use_in_ns); }
  bool Staged(uint32_t key) const override { return tier_->Resident(key); }
  size_t Poll(std::vector<TransferDone>* out) override;
  size_t Wait(std::vector<TransferDone>* out, std::chrono::milliseconds timeout) override;
  uint64_t RecordComputeFence() override { return device_->RecordComputeFence(); }
  TransferStats stats() const override { return device_->stats(); }
  Result<void*> AllocateDevice(size_t bytes) override { return device_->AllocateDevice(bytes); }
  void FreeDevice(void* ptr) override { device_->FreeDevice(ptr); }
  Result<uint64_t> FreeDeviceBytes() const override { return device_->FreeDeviceBytes(); }
  Status RegisterHost(void* ptr, size_t bytes) override {
    return device_->RegisterHost(ptr, bytes);
  }
  void UnregisterHost(void* ptr) override { device_->UnregisterHost(ptr); }

  TransferEngine& device_link() { return *device_; }

 private:
  struct Task {
    TransferTask task;
    bool copying = false;  // On the device link (its slot pinned); else waiting for a read.
    int64_t read_start_ns = 0;
  };
  void ToDevice(Task& t);
  // Moves finished reads' tasks to the device link and finished copies out.
  void Drain(std::vector<TransferDone>* out);

  std::unique_ptr<TransferEngine> device_;
  HostTier* tier_;
  std::string name_;
  std::unordered_map<uint64_t, Task> tasks_;
  std::vector<TransferDone> ready_;  // Finished here (cancelled while waiting, failed reads).
  std::vector<TierDone> reads_;
  std::vector<TransferDone> copies_;
};

}  // namespace fmoe
