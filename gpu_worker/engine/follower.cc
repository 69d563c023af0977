#include "gpu_worker/engine/follower.h"

#include <chrono>
#include <exception>
#include <string>

#include "common/clock.h"
#include "common/log.h"

namespace fmoe {

Follower::Follower(MoeModel& model, ExpertSource& experts, ExpertGroup& group, uint32_t max_batch,
                   std::function<ExpertFigures()> local_figures)
    : model_(model), experts_(experts), group_(group), local_figures_(std::move(local_figures)) {
  limits_.max_sequences = max_batch;
  limits_.vocab_size = model.info().vocab_size;
  if (model.info().max_position_embeddings > 0) {
    limits_.max_tokens = model.info().max_position_embeddings;
  }
}

Follower::~Follower() = default;

Status Follower::Run(const std::function<bool()>& stop, std::chrono::milliseconds grace) {
  std::vector<uint8_t> bytes;
  int64_t leave_at_us = -1;
  while (true) {
    if (leave_at_us < 0 && stop()) leave_at_us = SteadyNowUs() + grace.count() * 1000;
    if (leave_at_us >= 0 && SteadyNowUs() >= leave_at_us) return Status::Ok();
    FMOE_RETURN_IF_ERROR(group_.Broadcast(&bytes));
    auto plan = DecodePlan(bytes, limits_);
    if (!plan.ok()) return Internal("from the leader: " + plan.status().message());
    ++stats_.plans;
    if (plan->step != next_step_) {
      return Internal("the leader's plan " + std::to_string(plan->step) + " arrived where plan " +
                      std::to_string(next_step_) + " was due");
    }
    ++next_step_;
    for (uint64_t id : plan->ended) {
      auto it = requests_.find(id);
      if (it == requests_.end()) continue;  // Ended before this rank ran it.
      experts_.OnRequestEnd(id);
      requests_.erase(it);
    }
    for (uint64_t id : plan->preempted) {
      // The leader gave this request's blocks back: so does this rank, before the Forward.
      if (auto it = requests_.find(id); it != requests_.end()) it->second.kv->Reset();
    }
    if (plan->kind == PlanKind::kIteration) FMOE_RETURN_IF_ERROR(RunPlan(*plan));
    // One device budget: borrowed pages no sequence uses go back to this rank's cache, as the
    // leader's do (each rank's pool may take as many as the leader's, AgreeKvArena).
    model_.ReturnIdleKv();
    if (plan->kind == PlanKind::kStop) return Status::Ok();
  }
}

Status Follower::RunPlan(const IterationPlan& plan) {
  std::vector<SequenceInput> inputs(plan.sequences.size());
  for (size_t i = 0; i < plan.sequences.size(); ++i) {
    const PlannedSequence& s = plan.sequences[i];
    const std::string req = "req=" + std::to_string(s.request_id);
    auto it = requests_.find(s.request_id);
    if (s.iteration == 0) {
      if (it != requests_.end()) return Internal(req + ": prefilled twice");
      it = requests_.emplace(s.request_id, Request{model_.NewKvCache(), 0}).first;
    } else if (it == requests_.end()) {
      return Internal(req + ": iteration " + std::to_string(s.iteration) +
                      " of a request this rank never saw");
    } else if (s.restart && it->second.kv->length() != 0) {
      return Internal(req + ": restarts with " + std::to_string(it->second.kv->length()) +
                      " positions in its KV (its preemption was never told)");
    }
    if (s.prefill) {
      stats_.prefill_tokens += s.tokens.size();
    } else {
      ++stats_.decode_tokens;
    }
    if (it->second.next_iteration != s.iteration) {
      return Internal(req + ": iteration " + std::to_string(s.iteration) + " where " +
                      std::to_string(it->second.next_iteration) + " was due");
    }
    ++it->second.next_iteration;
    inputs[i].request_id = s.request_id;
    inputs[i].iteration = s.iteration;
    inputs[i].tokens = s.tokens;
    inputs[i].prefill = s.prefill;
    inputs[i].kv = it->second.kv.get();
  }
  if (requests_.size() > limits_.max_sequences) {
    return Internal("the leader runs " + std::to_string(requests_.size()) +
                    " requests, more than max_batch " + std::to_string(limits_.max_sequences));
  }
  // No logits (this rank never samples), but the sequences an unreadable expert of this rank
  // failed, which the group's sum below tells every rank.
  for (SequenceInput& in : inputs) in.no_logits = true;
  if (plan.stream) experts_.StreamNextIteration();  // This rank's own buffer, if it has one.
  ForwardResult result;
  const int64_t t0 = SteadyNowUs();
  try {
    FMOE_RETURN_IF_ERROR(model_.Forward(inputs, experts_, nullptr, &result));
  } catch (const std::exception& e) {  // c10::Error, std::bad_alloc: the group cannot go on.
    return Internal("plan " + std::to_string(plan.step) + ": the forward pass threw: " + e.what());
  }
  stats_.forward_us += static_cast<uint64_t>(SteadyNowUs() - t0);
  ++stats_.iterations;
  std::vector<RequestUsage> usage;
  for (const SequenceInput& in : inputs) usage.push_back(experts_.Usage(in.request_id));
  std::vector<int64_t> counters =
      PackFigures(usage, local_figures_ ? local_figures_() : ExpertFigures{});
  // The leader ends the failed sequences (they come back in its next plan's ended list).
  std::vector<std::optional<RankFailure>> failed(inputs.size());
  for (const SequenceFailure& f : result.failed) {
    failed[f.sequence] = RankFailure{group_.rank(), f.layer, f.expert};
    spdlog::error("rank={} req={}: {}", group_.rank(), inputs[f.sequence].request_id,
                  f.error.message());
  }
  PackFailures(failed, group_.rank(), group_.world_size(), model_.info().num_experts, &counters);
  const KvPoolFigures pool = model_.kv_figures();
  PackSplit(pool.bytes, pool.expert_bytes, group_.rank(), group_.world_size(), &counters);
  return group_.SumCounters(counters);
}

}  // namespace fmoe
