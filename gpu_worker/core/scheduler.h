// The engine's scheduler (DESIGN section 14): the waiting and running queues, and each step's
// work within a token budget. The engine loop asks it what to run (Schedule), runs one Forward,
// tells it what ran (Completed), samples, and removes the requests that ended (Remove).
// Torch-free and thread-unsafe: the engine thread owns it.
//
// A step, with budget B = max_batched_tokens (0: no budget):
//   1. every running request whose prompt is in its KV decodes one token (always, whatever B);
//   2. the running requests still in their prompt get the next chunk of it, oldest first, each
//      at most what is left of B;
//   3. while a batch slot is free and budget is left, the oldest waiting request is admitted
//      with the first chunk of its prompt.
// A request samples its first token after the step that ran its prompt's last chunk. With
// max_batched_tokens >= max_batch (Options::Check) the decodes never take the whole budget while
// a running request is in its prompt, so the oldest such request gets a chunk every step and
// prompts complete in admission order. A prompt that must not be cut (Add's `chunkable` false)
// runs whole, in a step where it is the first prompt chunk, even beyond B. A prompt with a
// boundary (Add's `boundary`) is never cut across it: a chunk that starts before it ends there
// at most, with or without a budget (LongRoPE: positions before the original context and after
// it are rotated with different factors, each by the Forward that computes them).
//
// Expert-aware chunks (chunk_planner.h): with a chunk advisor, a prompt chunk the budget would
// cut short of its prompt goes to the advisor, which may ask for a larger one (a small chunk
// would load nearly the experts of the whole prompt). The first prompt chunk of a step gets
// it, even beyond B, as an uncut prompt does; a later one waits for a step where it is first.
//
// The paged KV (kv_blocks.h): on admission the admit hook says how many of the prompt's tokens
// are already in the request's KV (a cached prefix); its prefill starts after them. When the KV
// pool cannot hold a step's work the engine preempts (Preempt): the request goes back to the
// front of the waiting queue, to be prefilled again from its first token.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "gpu_worker/core/chunk_planner.h"

namespace fmoe {

struct SchedulerOptions {
  uint32_t max_batch = 8;  // Requests running at once. Default: 8
  // Tokens one step runs (decode tokens plus prompt chunks); 0 = no budget (whole prompts at
  // once). Default: 0
  uint32_t max_batched_tokens = 0;
  uint32_t max_waiting = 1024;  // Requests waiting for a slot. Default: 1024

  // kInvalidArgument naming the field: max_batch 0, or a budget below max_batch.
  Status Check() const;
};

// One request's part of a step.
struct ScheduledWork {
  uint64_t id = 0;
  bool prefill = false;   // Prompt tokens [first, first + tokens); else one decode token.
  uint32_t first = 0;     // Prefill: the chunk's first prompt position.
  uint32_t tokens = 0;    // New tokens this step (1 for a decode).
  bool admitted = false;  // The request's first step: it left the waiting queue.
  bool samples = false;   // A decode, or the prompt's last chunk: a token is drawn after it.
  bool grown = false;     // Prefill: the chunk advisor grew it past the token budget's chunk.
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerOptions options) : options_(options) {}

  const SchedulerOptions& options() const { return options_; }
  // Queues a request with a prompt of `prompt_tokens` (>= 1) tokens. false when max_waiting
  // requests wait already, or `id` is queued or running. `boundary` (> 0, chunkable prompts): no
  // chunk of the prompt, or of what Preempt gives it to prefill again, runs across that position.
  bool Add(uint64_t id, uint32_t prompt_tokens, bool chunkable = true, uint32_t boundary = 0);
  // The request leaves the scheduler (finished, cancelled or failed), waiting or running; false
  // when it is not here.
  bool Remove(uint64_t id);
  bool Contains(uint64_t id) const;
  bool IsWaiting(uint64_t id) const;
  // Called when a request is admitted, with its id and prompt tokens: the tokens at the start
  // of the prompt already in its KV (a cached prefix; fewer than the prompt). Default: none.
  void SetAdmitHook(std::function<uint32_t(uint64_t id, uint32_t prompt)> hook) {
    admit_hook_ = std::move(hook);
  }
  // Called for a prompt chunk of `chunk` tokens the budget allows when `rest` (> chunk) are
  // left: the chunk to run (>= chunk, <= rest). Default: none (the budget's chunk).
  void SetChunkAdvisor(ChunkAdvisor advisor) { chunk_advisor_ = std::move(advisor); }
  // A running request leaves the batch for the front of the waiting queue, its KV gone: it is
  // prefilled again over `prompt_tokens` (>= 1) tokens when next admitted, cut as Add's
  // `chunkable` and `boundary` said. false when it is not running.
  bool Preempt(uint64_t id, uint32_t prompt_tokens);

  // This step's work, decodes first (in admission order), then prompt chunks (in admission
  // order); empty when nothing runs. Admitted requests are running from now on.
  std::vector<ScheduledWork> Schedule();
  // The step's Forward ran `work` (as Schedule returned it; requests removed since are skipped):
  // the chunks' tokens are in the requests' KV.
  void Completed(std::span<const ScheduledWork> work);

  size_t waiting() const { return waiting_.size(); }
  size_t running() const { return running_.size(); }
  // Running requests' ids in admission order.
  std::vector<uint64_t> RunningIds() const;
  // Waiting requests' ids, oldest first.
  std::vector<uint64_t> WaitingIds() const;

 private:
  struct Entry {
    uint64_t id = 0;
    uint32_t prompt = 0;     // Prompt tokens.
    uint32_t prefilled = 0;  // Prompt tokens in the KV.
    bool chunkable = true;
    uint32_t boundary = 0;  // No chunk runs across this position (0: none).
    bool decoding() const { return prefilled >= prompt; }
  };
  Entry* Find(uint64_t id);
  const Entry* Find(uint64_t id) const;
  // The next chunk of `e`'s prompt within `*budget` (updated), or 0 when none fits; *grown
  // (if given): the chunk advisor made it larger than the budget's.
  uint32_t ChunkOf(const Entry& e, bool first_prefill, uint64_t* budget,
                   bool* grown = nullptr) const;

  SchedulerOptions options_;
  std::function<uint32_t(uint64_t, uint32_t)> admit_hook_;
  ChunkAdvisor chunk_advisor_;
  std::deque<Entry> waiting_;
  std::vector<Entry> running_;  // Admission order.
};

}  // namespace fmoe
