#include "gpu_worker/core/group_plan.h"

#include <algorithm>
#include <cstring>

namespace fmoe {
namespace {

constexpr uint8_t kMagic[4] = {'F', 'M', 'P', 'L'};
// 2: per-sequence flags (prefill); 3: preempted ids, restart; 4: iteration flags (stream).
constexpr uint16_t kVersion = 4;

class Writer {
 public:
  template <class T>
  void Put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    const size_t at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &value, sizeof(T));
  }
  void PutBytes(const void* p, size_t n) {
    const size_t at = out_.size();
    out_.resize(at + n);
    if (n > 0) std::memcpy(out_.data() + at, p, n);
  }
  std::vector<uint8_t> Take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

class Reader {
 public:
  explicit Reader(std::span<const uint8_t> in) : in_(in) {}
  template <class T>
  bool Get(T* value) {
    if (in_.size() - at_ < sizeof(T)) return false;
    std::memcpy(value, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return true;
  }
  size_t left() const { return in_.size() - at_; }

 private:
  std::span<const uint8_t> in_;
  size_t at_ = 0;
};

Status Bad(const std::string& what) { return InvalidArgument("iteration plan: " + what); }

constexpr size_t kUsageCounters = 7;  // Per request: the fields of RequestUsage.

}  // namespace

std::vector<uint8_t> EncodePlan(const IterationPlan& plan) {
  Writer w;
  w.PutBytes(kMagic, sizeof(kMagic));
  w.Put<uint16_t>(kVersion);
  w.Put<uint16_t>(static_cast<uint16_t>(plan.kind));
  w.Put<uint64_t>(plan.step);
  w.Put<uint32_t>(static_cast<uint32_t>(plan.ended.size()));
  w.Put<uint32_t>(static_cast<uint32_t>(plan.sequences.size()));
  for (uint64_t id : plan.ended) w.Put<uint64_t>(id);
  w.Put<uint32_t>(static_cast<uint32_t>(plan.preempted.size()));
  for (uint64_t id : plan.preempted) w.Put<uint64_t>(id);
  w.Put<uint8_t>(plan.stream ? 1 : 0);
  for (const PlannedSequence& s : plan.sequences) {
    w.Put<uint64_t>(s.request_id);
    w.Put<uint32_t>(s.iteration);
    w.Put<uint8_t>(static_cast<uint8_t>((s.prefill ? 1 : 0) | (s.restart ? 2 : 0)));
    w.Put<uint32_t>(static_cast<uint32_t>(s.tokens.size()));
    w.PutBytes(s.tokens.data(), s.tokens.size() * sizeof(int32_t));
  }
  return w.Take();
}

Result<IterationPlan> DecodePlan(std::span<const uint8_t> bytes, const PlanLimits& limits) {
  Reader r(bytes);
  uint8_t magic[4];
  for (uint8_t& m : magic) {
    if (!r.Get(&m)) return Bad("truncated header (" + std::to_string(bytes.size()) + " bytes)");
  }
  if (std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) return Bad("bad magic");
  uint16_t version = 0, kind = 0;
  IterationPlan plan;
  uint32_t n_ended = 0, n_seq = 0;
  if (!r.Get(&version) || !r.Get(&kind) || !r.Get(&plan.step) || !r.Get(&n_ended) ||
      !r.Get(&n_seq)) {
    return Bad("truncated header (" + std::to_string(bytes.size()) + " bytes)");
  }
  if (version != kVersion) {
    return Bad("version " + std::to_string(version) + ", this rank speaks " +
               std::to_string(kVersion) + " (every rank of a group must run the same build)");
  }
  if (kind > static_cast<uint16_t>(PlanKind::kStop)) {
    return Bad("unknown kind " + std::to_string(kind));
  }
  plan.kind = static_cast<PlanKind>(kind);
  if (n_ended > limits.max_ended) {
    return Bad(std::to_string(n_ended) + " ended requests, more than " +
               std::to_string(limits.max_ended));
  }
  if (n_seq > limits.max_sequences) {
    return Bad(std::to_string(n_seq) + " sequences, more than max_batch " +
               std::to_string(limits.max_sequences));
  }
  if (plan.kind != PlanKind::kIteration && n_seq > 0) {
    return Bad("a plan that runs nothing lists " + std::to_string(n_seq) + " sequences");
  }
  if (r.left() < static_cast<size_t>(n_ended) * sizeof(uint64_t)) return Bad("truncated ended ids");
  plan.ended.resize(n_ended);
  for (uint64_t& id : plan.ended) r.Get(&id);
  uint32_t n_preempted = 0;
  if (!r.Get(&n_preempted)) return Bad("truncated preempted count");
  if (n_preempted > limits.max_sequences) {
    return Bad(std::to_string(n_preempted) + " preempted requests, more than max_batch " +
               std::to_string(limits.max_sequences));
  }
  if (r.left() < static_cast<size_t>(n_preempted) * sizeof(uint64_t)) {
    return Bad("truncated preempted ids");
  }
  plan.preempted.resize(n_preempted);
  for (uint64_t& id : plan.preempted) r.Get(&id);
  uint8_t iteration_flags = 0;
  if (!r.Get(&iteration_flags)) return Bad("truncated iteration flags");
  if (iteration_flags > 1) return Bad("unknown iteration flags " + std::to_string(iteration_flags));
  if (iteration_flags != 0 && plan.kind != PlanKind::kIteration) {
    return Bad("a plan that runs nothing streams");
  }
  plan.stream = (iteration_flags & 1) != 0;
  plan.sequences.resize(n_seq);
  for (uint32_t i = 0; i < n_seq; ++i) {
    PlannedSequence& s = plan.sequences[i];
    const std::string which = "sequence " + std::to_string(i);
    uint32_t n_tokens = 0;
    uint8_t flags = 0;
    if (!r.Get(&s.request_id) || !r.Get(&s.iteration) || !r.Get(&flags) || !r.Get(&n_tokens)) {
      return Bad(which + ": truncated");
    }
    if (flags > 3) return Bad(which + ": unknown flags " + std::to_string(flags));
    s.prefill = (flags & 1) != 0;
    s.restart = (flags & 2) != 0;
    if (s.restart && !s.prefill) {
      return Bad(which + " (req=" + std::to_string(s.request_id) + ") restarts with a decode step");
    }
    if (s.iteration == 0 && !s.prefill) {
      return Bad(which + " (req=" + std::to_string(s.request_id) +
                 ") starts with a decode step, not its prompt");
    }
    if (n_tokens == 0)
      return Bad(which + " (req=" + std::to_string(s.request_id) + ") has no tokens");
    if (n_tokens > limits.max_tokens) {
      return Bad(which + " has " + std::to_string(n_tokens) + " tokens, more than " +
                 std::to_string(limits.max_tokens));
    }
    if (!s.prefill && n_tokens != 1) {
      return Bad(which + " (req=" + std::to_string(s.request_id) + ") decodes " +
                 std::to_string(n_tokens) + " tokens at once");
    }
    if (r.left() < static_cast<size_t>(n_tokens) * sizeof(int32_t)) {
      return Bad(which + ": truncated tokens");
    }
    s.tokens.resize(n_tokens);
    for (int32_t& t : s.tokens) {
      r.Get(&t);
      if (t < 0 || (limits.vocab_size > 0 && static_cast<uint32_t>(t) >= limits.vocab_size)) {
        return Bad(which + " (req=" + std::to_string(s.request_id) + "): token " +
                   std::to_string(t) + " is not in the vocabulary of " +
                   std::to_string(limits.vocab_size));
      }
    }
    for (uint32_t j = 0; j < i; ++j) {
      if (plan.sequences[j].request_id == s.request_id) {
        return Bad("request " + std::to_string(s.request_id) + " appears twice");
      }
    }
  }
  if (r.left() != 0) return Bad(std::to_string(r.left()) + " trailing bytes");
  return plan;
}

std::vector<int64_t> PackFigures(std::span<const RequestUsage> usage, const ExpertFigures& totals) {
  std::vector<int64_t> out;
  out.reserve(usage.size() * kUsageCounters + 14);
  for (const RequestUsage& u : usage) {
    out.insert(out.end(),
               {static_cast<int64_t>(u.hits), static_cast<int64_t>(u.misses),
                static_cast<int64_t>(u.bytes_moved), static_cast<int64_t>(u.host_runs), u.host_ns,
                static_cast<int64_t>(u.bytes_not_moved), static_cast<int64_t>(u.disk_reads)});
  }
  out.insert(
      out.end(),
      {static_cast<int64_t>(totals.hits), static_cast<int64_t>(totals.misses),
       static_cast<int64_t>(totals.prefetches_issued), static_cast<int64_t>(totals.prefetches_used),
       static_cast<int64_t>(totals.bytes_moved), static_cast<int64_t>(totals.stall_us),
       static_cast<int64_t>(totals.host_runs), static_cast<int64_t>(totals.host_us),
       static_cast<int64_t>(totals.bytes_not_moved), static_cast<int64_t>(totals.disk_reads),
       static_cast<int64_t>(totals.disk_bytes), static_cast<int64_t>(totals.disk_stall_us),
       static_cast<int64_t>(totals.failed_loads), static_cast<int64_t>(totals.failed_experts)});
  return out;
}

void UnpackFigures(std::span<const int64_t> counters, std::span<RequestUsage> usage,
                   ExpertFigures* totals) {
  auto u64 = [&](size_t i) { return i < counters.size() ? static_cast<uint64_t>(counters[i]) : 0; };
  for (size_t i = 0; i < usage.size(); ++i) {
    const size_t u = kUsageCounters * i;
    usage[i] = {u64(u),     u64(u + 1), u64(u + 2), u64(u + 3), static_cast<int64_t>(u64(u + 4)),
                u64(u + 5), u64(u + 6)};
  }
  const size_t t = kUsageCounters * usage.size();
  *totals = {u64(t),      u64(t + 1),  u64(t + 2),  u64(t + 3), u64(t + 4),
             u64(t + 5),  u64(t + 6),  u64(t + 7),  u64(t + 8), u64(t + 9),
             u64(t + 10), u64(t + 11), u64(t + 12), u64(t + 13)};
}

void PackFailures(std::span<const std::optional<RankFailure>> failures, uint32_t rank,
                  uint32_t world_size, uint32_t experts, std::vector<int64_t>* counters) {
  const size_t first = counters->size();
  counters->resize(first + failures.size() * world_size, 0);
  for (size_t i = 0; i < failures.size(); ++i) {
    if (!failures[i]) continue;
    (*counters)[first + size_t{rank} * failures.size() + i] =
        1 + int64_t{failures[i]->layer} * experts + failures[i]->expert;
  }
}

std::vector<std::optional<RankFailure>> UnpackFailures(std::span<const int64_t> counters,
                                                       size_t first, size_t sequences,
                                                       uint32_t world_size, uint32_t experts) {
  std::vector<std::optional<RankFailure>> out(sequences);
  for (size_t i = 0; i < sequences; ++i) {
    for (uint32_t r = 0; r < world_size && !out[i]; ++r) {
      const size_t at = first + size_t{r} * sequences + i;
      const int64_t code = at < counters.size() ? counters[at] : 0;
      if (code == 0) continue;
      const auto key = static_cast<uint64_t>(code - 1);
      const uint64_t j = experts == 0 ? 1 : experts;
      out[i] = RankFailure{r, static_cast<uint32_t>(key / j), static_cast<uint32_t>(key % j)};
    }
  }
  return out;
}

void PackSplit(uint64_t kv_bytes, uint64_t expert_bytes, uint32_t rank, uint32_t world_size,
               std::vector<int64_t>* counters) {
  const size_t first = counters->size();
  counters->resize(first + size_t{world_size} * 2, 0);
  (*counters)[first + size_t{rank} * 2] = static_cast<int64_t>(kv_bytes);
  (*counters)[first + size_t{rank} * 2 + 1] = static_cast<int64_t>(expert_bytes);
}

std::vector<KvFigures::RankSplit> UnpackSplit(std::span<const int64_t> counters, size_t first,
                                              uint32_t world_size) {
  auto at = [&](size_t i) {
    return i < counters.size() ? static_cast<uint64_t>(std::max<int64_t>(counters[i], 0)) : 0;
  };
  std::vector<KvFigures::RankSplit> out(world_size);
  for (uint32_t r = 0; r < world_size; ++r) {
    out[r] = {at(first + size_t{r} * 2), at(first + size_t{r} * 2 + 1)};
  }
  return out;
}

}  // namespace fmoe
