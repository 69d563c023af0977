// What the leader of an expert-parallel group tells every other rank before each iteration
// (DESIGN section 7): the batch to run (each sequence's request id, iteration and new tokens),
// the requests that left the batch since the last plan (their KV caches and cache state can go)
// or were preempted (their KV blocks go back to the pool, as on the leader),
// or that nothing runs (a keep-alive while idle, so a waiting rank can tell an idle leader from a
// dead one) or that the group stops. Torch-free; the bytes travel in a c10d broadcast.
//
// Layout (little-endian): magic "FMPL", version u16, kind u16, step u64, ended count u32,
// sequence count u32, ended ids u64[], preempted count u32, preempted ids u64[], then per
// sequence: request id u64, iteration u32, flags u8
// (bit 0: prefill, bit 1: restart), token count u32, tokens i32[]. DecodePlan checks every count
// against the bytes that are there and against the limits given, and names what is wrong.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/wire/messages.h"
#include "gpu_worker/core/sequence.h"

namespace fmoe {

enum class PlanKind : uint16_t {
  kIdle = 0,       // Nothing to run; the leader is alive.
  kIteration = 1,  // Run `sequences` through one Forward.
  kStop = 2,       // The group is stopping: leave the loop and exit.
};

struct PlannedSequence {
  uint64_t request_id = 0;
  uint32_t iteration = 0;       // 0: a new request (SequenceInfo::iteration).
  std::vector<int32_t> tokens;  // New tokens.
  bool prefill = false;         // Prompt tokens (a prefill or a chunk of one); else one decode.
  // Preempted since its last iteration: its KV is emptied and it is prefilled again from
  // position 0 (with prefill).
  bool restart = false;

  bool operator==(const PlannedSequence&) const = default;
};

struct IterationPlan {
  PlanKind kind = PlanKind::kIdle;
  uint64_t step = 0;            // Plans sent so far by this leader; each rank checks the sequence.
  std::vector<uint64_t> ended;  // Requests that left the batch since the previous plan.
  std::vector<PlannedSequence> sequences;
  // Requests preempted since the previous plan: their KV blocks go back to the pool now (they
  // restart later, PlannedSequence::restart).
  std::vector<uint64_t> preempted;

  bool operator==(const IterationPlan&) const = default;
};

struct PlanLimits {
  uint32_t max_sequences = 1024;   // The group's max_batch.
  uint32_t max_ended = 1u << 16;   // Requests ended between two plans.
  uint32_t max_tokens = 1u << 20;  // New tokens of one sequence.
  uint32_t vocab_size = 0;         // Tokens must be below it; 0 = unchecked.
};

std::vector<uint8_t> EncodePlan(const IterationPlan& plan);
// kInvalidArgument naming the field for anything malformed or over the limits.
Result<IterationPlan> DecodePlan(std::span<const uint8_t> bytes, const PlanLimits& limits);

// The counters every rank adds to the group's after an iteration: per sequence of the plan, in
// plan order, its RequestUsage (hits, misses, bytes moved, host runs, host ns, bytes not moved);
// then the rank's expert-cache totals.
std::vector<int64_t> PackFigures(std::span<const RequestUsage> usage, const ExpertFigures& totals);
// The inverse, on the summed counters; `usage` has one entry per sequence.
void UnpackFigures(std::span<const int64_t> counters, std::span<RequestUsage> usage,
                   ExpertFigures* totals);

}  // namespace fmoe
