#include "bench/fmoe_bench/replay_report.h"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <sstream>

#include "bench/fmoe_bench/format.h"
#include "bench/fmoe_bench/serve_workload.h"

namespace fmoe::bench {
namespace {

double Per(double v, uint64_t n) { return n ? v / static_cast<double>(n) : 0.0; }

}  // namespace

LatencySummary Summarise(std::vector<double> ns) {
  LatencySummary s;
  s.count = ns.size();
  if (ns.empty()) return s;
  s.mean_ms = std::accumulate(ns.begin(), ns.end(), 0.0) / static_cast<double>(ns.size()) / 1e6;
  s.p50_ms = Percentile(ns, 50) / 1e6;
  s.p90_ms = Percentile(ns, 90) / 1e6;
  s.p99_ms = Percentile(std::move(ns), 99) / 1e6;
  return s;
}

PhaseSummary Summarise(const PhaseFigures& p, double expert_mb) {
  PhaseSummary s;
  s.iterations = p.iterations;
  s.units = p.requests;
  s.hit_rate = p.hit_rate();
  s.stall_ms = Per(p.stall_ns, p.requests) / 1e6;
  s.loads = Per(p.experts_moved, p.requests);
  s.mb = s.loads * expert_mb;
  s.precision = p.precision();
  s.recall = p.recall();
  s.cpu_experts = Per(static_cast<double>(p.cpu_experts), p.requests);
  s.cpu_ms = Per(p.cpu_ns, p.requests) / 1e6;
  s.host_hit_rate = p.host_hit_rate();
  s.disk_reads = Per(static_cast<double>(p.disk_reads), p.requests);
  s.disk_mb = Per(p.disk_bytes, p.requests) / 1e6;
  s.disk_stall_ms = Per(p.disk_stall_ns, p.requests) / 1e6;
  s.hinted_reads = Per(static_cast<double>(p.hinted_reads), p.requests);
  s.hints_not_read = Per(static_cast<double>(p.hints_yielded + p.hints_late), p.requests);
  return s;
}

ServeSummary Summarise(const ServeResult& r, double expert_mb) {
  ServeSummary s;
  std::vector<double> ttft, tpot;
  for (const RequestTiming& t : r.requests) {
    ttft.push_back(t.ttft_ns());
    if (t.has_tpot()) tpot.push_back(t.tpot_ns());
  }
  s.ttft = Summarise(std::move(ttft));
  s.tpot = Summarise(std::move(tpot));
  s.prefill = Summarise(r.prefill, expert_mb);
  s.decode = Summarise(r.decode, expert_mb);
  s.mean_batch = r.mean_batch;
  s.total_s = r.total_ns / 1e9;
  s.hybrid = r.config.hybrid;
  s.disk = r.config.disk.enabled();
  return s;
}

std::string RunLabel(const ServeConfig& c) { return c.hybrid ? c.policy + "+cpu" : c.policy; }

std::string ServeTable(const std::vector<std::pair<std::string, ServeSummary>>& rows) {
  std::ostringstream out;
  char buf[512];
  const bool hybrid =
      std::any_of(rows.begin(), rows.end(), [](const auto& row) { return row.second.hybrid; });
  const bool disk =
      std::any_of(rows.begin(), rows.end(), [](const auto& row) { return row.second.disk; });
  std::snprintf(buf, sizeof(buf), "%-17s %31s %27s | %-32s | %-32s | %5s%s%s\n", "",
                "TTFT ms p50/p90/p99/mean", "TPOT ms p50/p90/p99/mean",
                "prefill: hit% stall ms MB P R", "decode: hit% stall ms/t MB/t P R", "batch",
                hybrid ? " | cpu/prefill cpu/token" : "",
                disk ? " | disk prefill: host% reads hinted stall ms | decode: host% reads/t "
                       "hinted/t stall ms/t"
                     : "");
  out << buf;
  for (const auto& [label, s] : rows) {
    const std::string ttft = Fixed(s.ttft.p50_ms, 1) + "/" + Fixed(s.ttft.p90_ms, 1) + "/" +
                             Fixed(s.ttft.p99_ms, 1) + "/" + Fixed(s.ttft.mean_ms, 1);
    const std::string tpot = Fixed(s.tpot.p50_ms, 2) + "/" + Fixed(s.tpot.p90_ms, 2) + "/" +
                             Fixed(s.tpot.p99_ms, 2) + "/" + Fixed(s.tpot.mean_ms, 2);
    std::snprintf(buf, sizeof(buf),
                  "%-17s %31s %27s | %5.1f %8.1f %6.1f %4.2f %4.2f | %5.1f %8.2f %6.2f %4.2f %4.2f "
                  "| %5.2f",
                  label.c_str(), ttft.c_str(), tpot.c_str(), 100 * s.prefill.hit_rate,
                  s.prefill.stall_ms, s.prefill.mb, s.prefill.precision, s.prefill.recall,
                  100 * s.decode.hit_rate, s.decode.stall_ms, s.decode.mb, s.decode.precision,
                  s.decode.recall, s.mean_batch);
    out << buf;
    if (hybrid) {
      std::snprintf(buf, sizeof(buf), " | %11.2f %9.3f", s.prefill.cpu_experts,
                    s.decode.cpu_experts);
      out << buf;
    }
    if (disk) {
      std::snprintf(buf, sizeof(buf), " | %18.1f %5.1f %6.1f %8.1f | %13.1f %7.3f %8.3f %10.2f",
                    100 * s.prefill.host_hit_rate, s.prefill.disk_reads, s.prefill.hinted_reads,
                    s.prefill.disk_stall_ms, 100 * s.decode.host_hit_rate, s.decode.disk_reads,
                    s.decode.hinted_reads, s.decode.disk_stall_ms);
      out << buf;
    }
    out << '\n';
  }
  return out.str();
}

std::string ServeCsvHeader(bool disk) {
  return "mode,max_batch,budget,distance,policy,requests,ttft_p50_ms,ttft_p90_ms,ttft_p99_ms,"
         "ttft_mean_ms,tpot_p50_ms,tpot_p90_ms,tpot_p99_ms,tpot_mean_ms,prefills,"
         "prefill_hit_rate,prefill_stall_ms,prefill_loads,prefill_mb,prefill_precision,"
         "prefill_recall,decode_tokens,decode_hit_rate,decode_stall_ms_per_token,"
         "decode_loads_per_token,decode_mb_per_token,decode_precision,decode_recall,mean_batch,"
         "total_s,hybrid,prefill_cpu_experts,prefill_cpu_ms,decode_cpu_experts_per_token,"
         "decode_cpu_ms_per_token,max_batched_tokens" +
         std::string(disk ? ",host_budget,prefill_host_hit_rate,prefill_disk_reads,"
                            "prefill_disk_mb,prefill_disk_stall_ms,decode_host_hit_rate,"
                            "decode_disk_reads_per_token,decode_disk_mb_per_token,"
                            "decode_disk_stall_ms_per_token"
                          : "") +
         ",chunk_overhead" +
         std::string(disk ? ",prefill_hinted_reads,prefill_hints_not_read,"
                            "decode_hinted_reads_per_token,decode_hints_not_read_per_token"
                          : "");
}

std::string ServeCsvRow(const ServeConfig& c, const ServeSummary& s) {
  std::ostringstream out;
  out << (c.online ? "online" : "offline") << ',' << c.max_batch << ',' << Fixed(c.budget, 2) << ','
      << c.distance << ',' << c.policy << ',' << s.ttft.count << ',' << Fixed(s.ttft.p50_ms, 3)
      << ',' << Fixed(s.ttft.p90_ms, 3) << ',' << Fixed(s.ttft.p99_ms, 3) << ','
      << Fixed(s.ttft.mean_ms, 3) << ',' << Fixed(s.tpot.p50_ms, 4) << ','
      << Fixed(s.tpot.p90_ms, 4) << ',' << Fixed(s.tpot.p99_ms, 4) << ','
      << Fixed(s.tpot.mean_ms, 4) << ',' << s.prefill.units << ',' << Fixed(s.prefill.hit_rate, 5)
      << ',' << Fixed(s.prefill.stall_ms, 3) << ',' << Fixed(s.prefill.loads, 3) << ','
      << Fixed(s.prefill.mb, 3) << ',' << Fixed(s.prefill.precision, 4) << ','
      << Fixed(s.prefill.recall, 4) << ',' << s.decode.units << ',' << Fixed(s.decode.hit_rate, 5)
      << ',' << Fixed(s.decode.stall_ms, 4) << ',' << Fixed(s.decode.loads, 4) << ','
      << Fixed(s.decode.mb, 4) << ',' << Fixed(s.decode.precision, 4) << ','
      << Fixed(s.decode.recall, 4) << ',' << Fixed(s.mean_batch, 3) << ',' << Fixed(s.total_s, 3)
      << ',' << (c.hybrid ? "on" : "off") << ',' << Fixed(s.prefill.cpu_experts, 3) << ','
      << Fixed(s.prefill.cpu_ms, 3) << ',' << Fixed(s.decode.cpu_experts, 4) << ','
      << Fixed(s.decode.cpu_ms, 4) << ',' << c.max_batched_tokens;
  if (!c.disk.enabled()) {
    out << ',' << Fixed(c.chunk_overhead, 3);
    return out.str();
  }
  out << ',' << Fixed(c.disk.host_budget, 3) << ',' << Fixed(s.prefill.host_hit_rate, 5) << ','
      << Fixed(s.prefill.disk_reads, 3) << ',' << Fixed(s.prefill.disk_mb, 3) << ','
      << Fixed(s.prefill.disk_stall_ms, 3) << ',' << Fixed(s.decode.host_hit_rate, 5) << ','
      << Fixed(s.decode.disk_reads, 4) << ',' << Fixed(s.decode.disk_mb, 4) << ','
      << Fixed(s.decode.disk_stall_ms, 4) << ',' << Fixed(c.chunk_overhead, 3) << ','
      << Fixed(s.prefill.hinted_reads, 3) << ',' << Fixed(s.prefill.hints_not_read, 3) << ','
      << Fixed(s.decode.hinted_reads, 4) << ',' << Fixed(s.decode.hints_not_read, 4);
  return out.str();
}

TargetCheck CheckTargets(const std::vector<std::pair<std::string, ServeSummary>>& policies) {
  TargetCheck t;
  const ServeSummary* fmoe = nullptr;
  const ServeSummary* lru = nullptr;
  const ServeSummary* oracle = nullptr;
  for (const auto& [name, s] : policies) {
    if (name == "fmoe") fmoe = &s;
    if (name == "lru") lru = &s;
    if (name == "oracle") {
      oracle = &s;
      continue;
    }
    if (t.best_tpot.empty() || s.tpot.mean_ms < t.best_tpot_ms) {
      t.best_tpot = name;
      t.best_tpot_ms = s.tpot.mean_ms;
    }
    if (t.best_ttft.empty() || s.ttft.mean_ms < t.best_ttft_ms) {
      t.best_ttft = name;
      t.best_ttft_ms = s.ttft.mean_ms;
    }
    if (name == "fmoe" || name == "fmoe-traj" || name == "fmoe-traj-sem") continue;
    if (t.baseline_tpot.empty() || s.tpot.mean_ms < t.baseline_tpot_ms) {
      t.baseline_tpot = name;
      t.baseline_tpot_ms = s.tpot.mean_ms;
    }
    if (t.baseline_ttft.empty() || s.ttft.mean_ms < t.baseline_ttft_ms) {
      t.baseline_ttft = name;
      t.baseline_ttft_ms = s.ttft.mean_ms;
    }
  }
  if (fmoe == nullptr) return t;
  t.fmoe_tpot_ms = fmoe->tpot.mean_ms;
  t.fmoe_ttft_ms = fmoe->ttft.mean_ms;
  const auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  if (lru != nullptr) t.decode_stall_vs_lru = ratio(fmoe->decode.stall_ms, lru->decode.stall_ms);
  if (oracle != nullptr) {
    t.tpot_vs_oracle = ratio(fmoe->tpot.mean_ms, oracle->tpot.mean_ms);
    t.ttft_vs_oracle = ratio(fmoe->ttft.mean_ms, oracle->ttft.mean_ms);
    t.decode_stall_vs_oracle = ratio(fmoe->decode.stall_ms, oracle->decode.stall_ms);
  }
  return t;
}

HybridCheck CheckHybridTargets(const std::vector<std::pair<std::string, ServeSummary>>& off,
                               const std::vector<std::pair<std::string, ServeSummary>>& on) {
  const auto stall = [](const auto& rows, const char* name) {
    for (const auto& [label, s] : rows) {
      if (label == name) return s.decode.stall_ms;
    }
    return 0.0;
  };
  const auto ratio = [](double a, double b) { return a > 0 && b > 0 ? a / b : 0.0; };
  const double fmoe_off = stall(off, "fmoe"), lru_off = stall(off, "lru");
  const double fmoe_on = stall(on, "fmoe"), lru_on = stall(on, "lru");
  HybridCheck h;
  h.fmoe_vs_lru = ratio(fmoe_on, lru_off);
  h.fmoe_vs_lru_hybrid = ratio(fmoe_on, lru_on);
  h.lru_gain = ratio(lru_on, lru_off);
  h.fmoe_gain = ratio(fmoe_on, fmoe_off);
  return h;
}

}  // namespace fmoe::bench
