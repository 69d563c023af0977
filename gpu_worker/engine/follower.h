// A rank other than the leader in an expert-parallel group (DESIGN section 7): it runs the
// leader's plans (gpu_worker/core/group_plan.h). Each iteration it runs the same Forward as the
// leader, with its own KV caches and its own experts (the ones it owns), joins each layer's
// combination of expert outputs, and adds its expert figures to the group's, with the sequences
// an expert of its own that could not be read failed (the leader ends them); it never samples.
// Requests the leader ended are forgotten (KV cache, cache state).
//
// A plan that does not follow from the previous ones (a skipped step, a decode for a request this
// rank does not know, a prefill for one it already runs, more requests than max_batch) means the
// ranks disagree: Run returns kInternal and the rank leaves, which breaks the group.
// One thread: the one that calls Run.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>

#include "common/status.h"
#include "common/wire/messages.h"
#include "gpu_worker/core/group_plan.h"
#include "gpu_worker/group/expert_group.h"
#include "gpu_worker/model/model.h"

namespace fmoe {

struct FollowerStats {
  uint64_t plans = 0;
  uint64_t iterations = 0;
  uint64_t prefill_tokens = 0;
  uint64_t decode_tokens = 0;
  uint64_t forward_us = 0;
};

class Follower {
 public:
  // `local_figures` may be empty (figures count as zero).
  Follower(MoeModel& model, ExpertSource& experts, ExpertGroup& group, uint32_t max_batch,
           std::function<ExpertFigures()> local_figures);
  ~Follower();

  // Until the leader's stop plan (Ok) or a failure: the group's error, a bad plan, a Forward
  // error. Once stop() is true, follows plans for at most `grace` more, then returns Ok.
  Status Run(const std::function<bool()>& stop, std::chrono::milliseconds grace);
  const FollowerStats& stats() const { return stats_; }

 private:
  Status RunPlan(const IterationPlan& plan);

  MoeModel& model_;
  ExpertSource& experts_;
  ExpertGroup& group_;
  PlanLimits limits_;
  std::function<ExpertFigures()> local_figures_;
  struct Request {
    std::unique_ptr<KvCache> kv;
    uint32_t next_iteration = 0;
  };
  std::unordered_map<uint64_t, Request> requests_;
  uint64_t next_step_ = 0;
  FollowerStats stats_;
};

}  // namespace fmoe
