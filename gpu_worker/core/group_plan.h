// What the leader of an expert-parallel group tells every other rank before each iteration
// (DESIGN section 7): the batch to run (each sequence's request id, iteration and new tokens),
// the requests that left the batch since the last plan (their KV caches and cache state can go)
// or were preempted (their KV blocks go back to the pool, as on the leader),
// or that nothing runs (a keep-alive while idle, so a waiting rank can tell an idle leader from a
// dead one) or that the group stops. Torch-free; the bytes travel in a c10d broadcast.
//
// Layout (little-endian): magic "FMPL", version u16, kind u16, step u64, ended count u32,
// sequence count u32, ended ids u64[], preempted count u32, preempted ids u64[], iteration flags
// u8 (bit 0: stream), then per
// sequence: request id u64, iteration u32, flags u8
// (bit 0: prefill, bit 1: restart), token count u32, tokens i32[]. DecodePlan checks every count
// against the bytes that are there and against the limits given, and names what is wrong.
#pragma once

#include <cstdint>
#include <optional>
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
  // The iteration streams its missing experts (ExpertSource::StreamNextIteration).
  bool stream = false;

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

// A sequence that a rank's Forward failed: an expert the rank owns could not be read.
struct RankFailure {
  uint32_t rank = 0;
  uint32_t layer = 0;  // MoE layer.
  uint32_t expert = 0;
};
// After the figures, so that every rank ends the same sequences: a block of n counters (n
// sequences of the plan) per rank, where rank r writes 1 + layer * experts + expert for each
// sequence its Forward failed (`failures`: per sequence, nullopt when it did not), zero elsewhere;
// summed, every rank's entries arrive intact (one writer per counter).
void PackFailures(std::span<const std::optional<RankFailure>> failures, uint32_t rank,
                  uint32_t world_size, uint32_t experts, std::vector<int64_t>* counters);
// The inverse, on the summed counters from `first` (where PackFailures began): per sequence the
// lowest rank's failure, nullopt when no rank failed it (a counter missing from `counters` is
// zero: none).
std::vector<std::optional<RankFailure>> UnpackFailures(std::span<const int64_t> counters,
                                                       size_t first, size_t sequences,
                                                       uint32_t world_size, uint32_t experts);

// After the failures, one device budget's split on every rank: a pair of counters per rank
// (its KV pool's device bytes, its expert cache's), rank r writing its own pair, zero elsewhere.
void PackSplit(uint64_t kv_bytes, uint64_t expert_bytes, uint32_t rank, uint32_t world_size,
               std::vector<int64_t>* counters);
// The inverse, on the summed counters from `first` (where PackSplit began): world_size pairs
// (a counter missing from `counters` is zero).
std::vector<KvFigures::RankSplit> UnpackSplit(std::span<const int64_t> counters, size_t first,
                                              uint32_t world_size);

}  // namespace fmoe
