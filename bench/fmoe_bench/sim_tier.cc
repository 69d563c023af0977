#include "bench/fmoe_bench/sim_tier.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

namespace fmoe::bench {
namespace {

constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

}  // namespace

// ---- DiskModel ----

int64_t DiskModel::ReadNs(double expert_bytes) const {
  return std::max<int64_t>(1, std::llround(latency_us * 1e3 + expert_bytes / gbps));
}

std::string DiskModel::Describe(uint32_t experts, double expert_bytes) const {
  char buf[256];
  const uint32_t slots = std::max<uint32_t>(
      1, static_cast<uint32_t>(std::floor(host_budget * static_cast<double>(experts))));
  std::snprintf(buf, sizeof(buf),
                "host cache %.0f%% of the experts (%u of %u, %s at start), disk %.2f GB/s + %.0f "
                "us per read, queue depth %u, hinted reads in its spare time, at most %u: an "
                "expert read alone %.3f ms",
                100 * host_budget, std::min(slots, experts), experts, warm ? "warm" : "empty", gbps,
                latency_us, queue_depth, max_hinted_reads,
                static_cast<double>(ReadNs(expert_bytes)) / 1e6);
  return buf;
}

Status ValidateDiskModel(const DiskModel& m) {
  const auto bad = [](const std::string& what) { return InvalidArgument("disk tier: " + what); };
  if (!(m.host_budget > 0 && m.host_budget <= 1)) {
    return bad("host budget " + std::to_string(m.host_budget) + " is not in (0, 1]");
  }
  if (!(m.gbps > 0) || !std::isfinite(m.gbps)) {
    return bad("bandwidth " + std::to_string(m.gbps) + " GB/s is not positive");
  }
  if (!(m.latency_us >= 0) || !std::isfinite(m.latency_us)) {
    return bad("latency " + std::to_string(m.latency_us) + " us is negative");
  }
  if (m.queue_depth < 1) return bad("queue depth 0");
  if (m.max_hinted_reads < 1) return bad("max hinted reads 0");
  return Status::Ok();
}

// ---- SimTieredLink ----

Result<std::unique_ptr<SimTieredLink>> SimTieredLink::Create(ManualClock& clock, int64_t copy_ns,
                                                             const SimTierOptions& options) {
  FMOE_RETURN_IF_ERROR(ValidateDiskModel(options.disk));
  if (options.experts == 0) return InvalidArgument("disk tier: no experts");
  if (options.host_slots < 1 || options.host_slots > options.experts) {
    return InvalidArgument("disk tier: " + std::to_string(options.host_slots) + " host slots for " +
                           std::to_string(options.experts) + " experts");
  }
  if (!(options.expert_bytes > 0)) return InvalidArgument("disk tier: an expert of 0 bytes");
  if (copy_ns <= 0) return InvalidArgument("disk tier: the link's copy time is not positive");
  return std::unique_ptr<SimTieredLink>(new SimTieredLink(clock, copy_ns, options));
}

SimTieredLink::SimTieredLink(ManualClock& clock, int64_t copy_ns, const SimTierOptions& options)
    : clock_(clock),
      link_clock_(0),
      link_(link_clock_, copy_ns),
      options_(options),
      bytes_per_ns_(options.disk.gbps),  // 10^9 bytes/s = 1 byte/ns.
      latency_ns_(std::llround(options.disk.latency_us * 1e3)),
      entries_(options.experts),
      uses_(options.experts, 0.0) {
  now_ = clock_.NowNs();
  link_clock_.AdvanceNs(now_);
  if (options_.disk.warm) {
    for (uint32_t key = 0; key < options_.host_slots; ++key) {
      entries_[key].state = State::kResident;
      entries_[key].last_use = ++use_clock_;
      resident_.push_back(key);
    }
  }
}

SimTieredLink::~SimTieredLink() = default;

bool SimTieredLink::Resident(uint32_t key) const {
  return key < entries_.size() && entries_[key].state == State::kResident;
}

// ---- time ----

int64_t SimTieredLink::NextDiskEvent() const {
  size_t moving = 0;
  for (const Read& r : inflight_) moving += r.ready_ns <= now_ ? 1 : 0;
  int64_t next = kNever;
  for (const Read& r : inflight_) {
    if (r.ready_ns > now_) {
      next = std::min(next, r.ready_ns);
    } else {
      const double ns = r.left * static_cast<double>(moving) / bytes_per_ns_;
      next = std::min(next, now_ + static_cast<int64_t>(std::ceil(ns)));
    }
  }
  return next;
}

int64_t SimTieredLink::NextEvent() const {
  const int64_t link = link_.NextEndNs();
  return std::min(NextDiskEvent(), link < 0 ? kNever : link);
}

void SimTieredLink::RunDisk(int64_t to) {
  if (to <= now_) return;
  size_t moving = 0;
  for (const Read& r : inflight_) moving += r.ready_ns <= now_ ? 1 : 0;
  if (moving == 0) return;
  const double moved = static_cast<double>(to - now_) * bytes_per_ns_ / static_cast<double>(moving);
  for (Read& r : inflight_) {
    if (r.ready_ns <= now_) r.left = std::max(0.0, r.left - moved);
  }
}

void SimTieredLink::AdvanceTo(int64_t now, bool stalled) {
  const auto accrue = [&](int64_t to) {
    if (!stalled || to <= now_) return;
    for (const auto& [id, t] : tasks_) {
      if (!t.copying && t.task.on_demand) {
        stats_.disk_stall_ns += to - now_;
        return;
      }
    }
  };
  while (true) {
    const int64_t t = NextEvent();
    if (t > now) break;
    accrue(t);
    RunDisk(t);
    now_ = std::max(now_, t);
    RunLink(now_);  // The link's clock first: copies submitted below start at `t`.
    FinishReads();
    RunLink(now_);
  }
  accrue(now);
  RunDisk(now);
  now_ = std::max(now_, now);
  RunLink(now_);
}

void SimTieredLink::RunLink(int64_t to) {
  if (to > link_clock_.NowNs()) link_clock_.AdvanceNs(to - link_clock_.NowNs());
  copies_.clear();
  link_.Poll(&copies_);
  for (TransferDone& c : copies_) {
    auto it = tasks_.find(c.id);
    if (it == tasks_.end()) continue;
    Unpin(it->second.task.key);
    if (it->second.wait_ns >= 0) {
      // As TieredLink: a load that waited for its read started with the read.
      c.submit_ns = it->second.wait_ns;
      c.start_ns = it->second.wait_ns;
    }
    tasks_.erase(it);
    done_.push_back(c);
  }
}

void SimTieredLink::FinishReads() {
  size_t moving = 0;
  for (const Read& r : inflight_) moving += r.ready_ns <= now_ ? 1 : 0;
  std::vector<std::pair<uint32_t, int64_t>> finished;  // Key, StartRead.
  size_t kept = 0;
  for (Read& r : inflight_) {
    // Less than a nanosecond of bytes left (event times are whole nanoseconds): done.
    if (r.ready_ns <= now_ && r.left * static_cast<double>(moving) <= bytes_per_ns_) {
      finished.emplace_back(r.key, r.start_ns);
      continue;
    }
    inflight_[kept++] = r;
  }
  inflight_.resize(kept);
  for (const auto& [key, start_ns] : finished) {
    Entry& e = entries_[key];
    e.state = State::kResident;
    --reading_;
    if (e.urgent) {
      e.urgent = false;
      --urgent_pending_;
    }
    // A moving mean (1/8 per read), as HostTier's.
    const auto took = static_cast<double>(now_ - start_ns);
    read_ns_mean_ = read_ns_mean_ == 0 ? took : read_ns_mean_ + (took - read_ns_mean_) / 8;
    if (e.hinted) {
      e.hinted = false;
      --hinted_reading_;
    }
    e.last_use = ++use_clock_;
    resident_.push_back(key);
    ++stats_.disk_reads;
    stats_.bytes_read += options_.expert_bytes;
    for (auto& [id, t] : tasks_) {
      if (!t.copying && t.task.key == key) ToLink(t);
    }
  }
  if (!finished.empty()) {
    StartDisk();
    if (!slot_queue_.empty()) StartQueued();
  }
}

// ---- the host cache ----

void SimTieredLink::ToLink(Task& t) {
  Entry& e = entries_[t.task.key];
  ++e.pins;
  e.held = false;
  e.last_use = ++use_clock_;
  t.copying = true;
  link_.Submit(t.task);
}

void SimTieredLink::Unpin(uint32_t key) {
  if (key >= entries_.size() || entries_[key].pins == 0) return;
  if (--entries_[key].pins == 0 && !slot_queue_.empty()) StartQueued();
}

bool SimTieredLink::TakeSlot(const double* below) {
  if (resident_.size() + reading_ < options_.host_slots) return true;
  int64_t victim = -1;  // Index in resident_.
  double victim_score = 0;
  for (size_t i = 0; i < resident_.size(); ++i) {
    const Entry& e = entries_[resident_[i]];
    if (e.pins > 0 || e.held) continue;
    const double score = Score(resident_[i]);
    if (below != nullptr && !(score < *below)) continue;
    if (victim < 0 || score < victim_score ||
        (score == victim_score && e.last_use < entries_[resident_[victim]].last_use)) {
      victim = static_cast<int64_t>(i);
      victim_score = score;
    }
  }
  if (victim < 0) return false;
  entries_[resident_[victim]] = Entry{};
  resident_[victim] = resident_.back();
  resident_.pop_back();
  ++stats_.evictions;
  return true;
}

void SimTieredLink::StartRead(uint32_t key) {
  entries_[key].state = State::kReading;
  ++reading_;
  disk_queue_.push_back(Read{key, next_seq_++, 0, options_.expert_bytes, now_});
  StartDisk();
}

void SimTieredLink::StartDisk() {
  while (inflight_.size() < options_.disk.queue_depth && !disk_queue_.empty()) {
    // The oldest urgent read, else the oldest.
    auto best = disk_queue_.begin();
    for (auto it = disk_queue_.begin(); it != disk_queue_.end(); ++it) {
      const bool u = entries_[it->key].urgent, bu = entries_[best->key].urgent;
      if (u != bu ? u : it->seq < best->seq) best = it;
    }
    Read r = *best;
    disk_queue_.erase(best);
    r.ready_ns = now_ + latency_ns_;
    inflight_.push_back(r);
  }
}

void SimTieredLink::StartQueued() {
  // Urgent requests first, then in request order.
  for (int pass = 0; pass < 2 && !slot_queue_.empty(); ++pass) {
    for (size_t i = 0; i < slot_queue_.size();) {
      const uint32_t key = slot_queue_[i];
      if (pass == 0 && !entries_[key].urgent) {
        ++i;
        continue;
      }
      if (!TakeSlot(nullptr)) return;
      slot_queue_.erase(slot_queue_.begin() + static_cast<std::ptrdiff_t>(i));
      StartRead(key);
    }
  }
}

void SimTieredLink::Request(uint32_t key, bool urgent) {
  Entry& e = entries_[key];
  e.held = true;
  if (e.state == State::kResident) return;
  if (e.state == State::kQueued || e.state == State::kReading) {
    if (urgent && !e.urgent) {
      e.urgent = true;
      ++urgent_pending_;
      if (e.hinted) {
        // A hinted read someone now waits for.
        e.hinted = false;
        --hinted_reading_;
      }
    }
    return;
  }
  e.urgent = urgent;
  e.hinted = false;
  if (urgent) ++urgent_pending_;
  if (!TakeSlot(nullptr)) {
    e.state = State::kQueued;
    slot_queue_.push_back(key);
    return;
  }
  StartRead(key);
}

void SimTieredLink::Release(uint32_t key) {
  Entry& e = entries_[key];
  e.held = false;
  if (e.state == State::kQueued) {
    // Nobody waits for it: it takes no slot.
    slot_queue_.erase(std::find(slot_queue_.begin(), slot_queue_.end(), key));
    if (e.urgent) --urgent_pending_;
    e = Entry{};
  } else if (e.state == State::kResident && e.pins == 0 && !slot_queue_.empty()) {
    StartQueued();
  }
}

// ---- TransferEngine ----

void SimTieredLink::CountLoad(uint32_t key) {
  if (options_.disk.score != DiskModel::Score::kLoads || key >= uses_.size()) return;
  uses_[key] += 1.0;
  if (++loads_since_halving_ >= 32ull * options_.host_slots) {
    for (double& u : uses_) u *= 0.5;
    loads_since_halving_ = 0;
  }
}

void SimTieredLink::Submit(const TransferTask& task) {
  AdvanceTo(clock_.NowNs(), /*stalled=*/false);
  ++stats_.loads;
  CountLoad(task.key);
  if (task.key >= entries_.size()) {
    TransferDone d;
    d.id = task.id;
    d.submit_ns = d.start_ns = d.end_ns = now_;
    d.status = InvalidArgument("disk tier: task " + std::to_string(task.id) + " names expert key " +
                               std::to_string(task.key) + ", not one of the " +
                               std::to_string(entries_.size()));
    done_.push_back(std::move(d));
    return;
  }
  Task& t = tasks_[task.id];
  t.task = task;
  if (Resident(task.key)) {
    ++stats_.host_hits;
    ToLink(t);
    return;
  }
  t.wait_ns = now_;
  Request(task.key, task.on_demand);
}

void SimTieredLink::Cancel(uint64_t id) {
  AdvanceTo(clock_.NowNs(), /*stalled=*/false);
  auto it = tasks_.find(id);
  if (it == tasks_.end()) return;
  if (it->second.copying) {
    link_.Cancel(id);
    RunLink(now_);
    return;
  }
  TransferDone d;
  d.id = id;
  d.cancelled = true;
  d.submit_ns = it->second.wait_ns;
  d.start_ns = d.end_ns = now_;
  const uint32_t key = it->second.task.key;
  tasks_.erase(it);
  done_.push_back(d);
  Release(key);
}

void SimTieredLink::Promote(uint64_t id) {
  AdvanceTo(clock_.NowNs(), /*stalled=*/false);
  auto it = tasks_.find(id);
  if (it == tasks_.end()) return;
  it->second.task.on_demand = true;
  if (it->second.copying) {
    link_.Promote(id);
    RunLink(now_);
  } else {
    Request(it->second.task.key, /*urgent=*/true);
  }
}

void SimTieredLink::Hint(uint32_t key, int64_t use_in_ns) {
  AdvanceTo(clock_.NowNs(), /*stalled=*/false);
  if (key >= entries_.size() || entries_[key].state != State::kAbsent) return;
  // The disk's spare time only, as HostTier::Prefetch.
  if (urgent_pending_ > 0) {
    ++stats_.hints_yielded;
    return;
  }
  if (use_in_ns >= 0 &&
      static_cast<double>(use_in_ns) < read_ns_mean_ * static_cast<double>(hinted_reading_ + 1)) {
    ++stats_.hints_late;
    return;
  }
  if (hinted_reading_ >= options_.disk.max_hinted_reads) return;
  const double own = Score(key);
  if (!TakeSlot(&own)) return;
  Entry& e = entries_[key];
  e.urgent = false;
  e.hinted = true;
  ++hinted_reading_;
  ++stats_.hinted_reads;
  StartRead(key);
}

size_t SimTieredLink::Poll(std::vector<TransferDone>* out) {
  AdvanceTo(clock_.NowNs(), /*stalled=*/false);
  const size_t n = done_.size();
  out->insert(out->end(), done_.begin(), done_.end());
  done_.clear();
  return n;
}

size_t SimTieredLink::Wait(std::vector<TransferDone>* out, std::chrono::milliseconds) {
  AdvanceTo(clock_.NowNs(), /*stalled=*/false);
  while (done_.empty() && !tasks_.empty()) {
    const int64_t t = NextEvent();
    if (t == kNever) {
      // Nothing on the disk or the link, and tasks wait for a host slot: every slot is pinned
      // or held. Cannot happen with at least one slot (a held expert is pinned once read); fail
      // the waiting tasks rather than wait forever.
      for (auto it = tasks_.begin(); it != tasks_.end();) {
        if (it->second.copying) {
          ++it;
          continue;
        }
        TransferDone d;
        d.id = it->first;
        d.submit_ns = it->second.wait_ns;
        d.start_ns = d.end_ns = now_;
        d.status =
            ResourceExhausted("disk tier: every one of the " + std::to_string(options_.host_slots) +
                              " host slots is pinned or held");
        done_.push_back(std::move(d));
        Release(it->second.task.key);
        it = tasks_.erase(it);
      }
      break;
    }
    clock_.AdvanceNs(t - clock_.NowNs());
    AdvanceTo(t, /*stalled=*/true);
  }
  return Poll(out);
}

Status SimTieredLink::CheckInvariants() const {
  const auto name = [this](uint32_t key) { return "disk tier: key " + std::to_string(key); };
  if (resident_.size() + reading_ > options_.host_slots) {
    return Internal("disk tier: " + std::to_string(resident_.size()) + " resident + " +
                    std::to_string(reading_) + " reading experts in " +
                    std::to_string(options_.host_slots) + " host slots");
  }
  uint32_t resident = 0, reading = 0, hinted = 0, urgent = 0;
  for (uint32_t key = 0; key < entries_.size(); ++key) {
    const Entry& e = entries_[key];
    urgent += e.urgent && (e.state == State::kQueued || e.state == State::kReading) ? 1 : 0;
    resident += e.state == State::kResident ? 1 : 0;
    reading += e.state == State::kReading ? 1 : 0;
    hinted += e.state == State::kReading && e.hinted ? 1 : 0;
    if (e.pins > 0 && e.state != State::kResident) return Internal(name(key) + " pinned, absent");
    if ((e.state == State::kQueued) !=
        (std::find(slot_queue_.begin(), slot_queue_.end(), key) != slot_queue_.end())) {
      return Internal(name(key) + ": slot queue mismatch");
    }
  }
  if (resident != resident_.size() || reading != reading_ || hinted != hinted_reading_ ||
      urgent != urgent_pending_) {
    return Internal("disk tier: counts of resident, reading, hinted or urgent experts are off");
  }
  if (reading != disk_queue_.size() + inflight_.size()) {
    return Internal("disk tier: " + std::to_string(reading) + " reading experts, " +
                    std::to_string(disk_queue_.size() + inflight_.size()) + " reads");
  }
  if (inflight_.size() > options_.disk.queue_depth) {
    return Internal("disk tier: more reads in flight than the queue depth");
  }
  uint32_t pins = 0;
  for (const auto& [id, t] : tasks_) pins += t.copying ? 1 : 0;
  uint32_t pinned = 0;
  for (const Entry& e : entries_) pinned += e.pins;
  if (pins != pinned) {
    return Internal("disk tier: " + std::to_string(pinned) + " pins for " + std::to_string(pins) +
                    " copies");
  }
  return Status::Ok();
}

}  // namespace fmoe::bench
