#include "bench/fmoe_bench/replay_hybrid.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "bench/fmoe_bench/format.h"
#include "bench/fmoe_bench/replay_time.h"

namespace fmoe::bench {

int64_t CpuModel::ExpertNs(uint64_t tokens, int64_t load_ns) const {
  const double t = static_cast<double>(std::max<uint64_t>(tokens, 1));
  double ns = 0;
  if (!curve.empty()) {
    double us = curve.front().us;
    if (curve.size() > 1 && t > curve.front().tokens) {
      size_t i = 1;
      while (i + 1 < curve.size() && curve[i].tokens < t) ++i;
      const CpuExpertPoint& a = curve[i - 1];
      const CpuExpertPoint& b = curve[i];
      us = a.us + (b.us - a.us) * (t - a.tokens) / (b.tokens - a.tokens);
    }
    ns = us * 1e3;
  } else {
    ns = factor * static_cast<double>(load_ns) * std::max(1.0, t / knee_tokens);
  }
  return std::max<int64_t>(1, std::llround(ns));
}

std::string CpuModel::Describe(int64_t load_ns) const {
  if (!enabled()) return "off";
  std::string out = "one CPU queue, one expert at a time; ";
  if (!curve.empty()) {
    out += "measured";
    for (size_t i = 0; i < curve.size(); ++i) {
      out += (i ? ", " : " ") + Fixed(curve[i].us / 1e3, 3) + " ms at " +
             Fixed(curve[i].tokens, 0) + " tokens";
    }
    if (!source.empty()) out += " (" + source + ")";
    return out;
  }
  return out + "c = " + Fixed(factor, 2) + " of a load (" +
         Fixed(static_cast<double>(ExpertNs(1, load_ns)) / 1e6, 3) + " ms per expert up to " +
         Fixed(knee_tokens, 0) + " tokens, then linear in the tokens)";
}

Status ValidateCpuModel(const CpuModel& m) {
  const auto bad = [](const std::string& what) { return InvalidArgument("CPU model: " + what); };
  for (size_t i = 0; i < m.curve.size(); ++i) {
    const CpuExpertPoint& p = m.curve[i];
    const std::string at = "point " + std::to_string(i + 1) + " (" + Fixed(p.tokens, 1) +
                           " tokens: " + Fixed(p.us, 3) + " us)";
    if (!(p.tokens >= 1) || !std::isfinite(p.tokens)) return bad(at + ": tokens must be >= 1");
    if (!(p.us > 0) || !std::isfinite(p.us)) return bad(at + ": the time must be > 0");
    if (i > 0 && !(p.tokens > m.curve[i - 1].tokens)) return bad(at + ": tokens must ascend");
  }
  if (!(m.factor >= 0) || !std::isfinite(m.factor)) return bad("the factor c must be >= 0");
  if (!(m.knee_tokens >= 1) || !std::isfinite(m.knee_tokens)) {
    return bad("the knee must be >= 1 token");
  }
  return Status::Ok();
}

Result<std::vector<CpuExpertPoint>> ParseCpuExpertTimes(std::string_view text) {
  FMOE_ASSIGN_OR_RETURN(auto pairs, ParseTokenPairs(text, "CPU expert times",
                                                    "TOKENS:MICROSECONDS (e.g. 1:5500,32:9000)"));
  std::vector<CpuExpertPoint> out;
  for (const auto& [tokens, us] : pairs) out.push_back({tokens, us});
  CpuModel check;
  check.curve = out;
  FMOE_RETURN_IF_ERROR(ValidateCpuModel(check));
  return out;
}

LayerSplit SplitLayer(std::span<const MissingExpert> missing, int64_t link_free_ns,
                      int64_t cpu_free_ns) {
  const size_t n = missing.size();
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  // Cheapest on the CPU relative to the link first: cpu_a / link_a < cpu_b / link_b.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const double lhs =
        static_cast<double>(missing[a].cpu_ns) * static_cast<double>(missing[b].link_ns);
    const double rhs =
        static_cast<double>(missing[b].cpu_ns) * static_cast<double>(missing[a].link_ns);
    if (lhs != rhs) return lhs < rhs;
    return missing[a].expert < missing[b].expert;
  });
  int64_t link_total = 0;
  for (const MissingExpert& m : missing) link_total += m.link_ns;
  // k = 0: everything over the link.
  size_t best_k = 0;
  int64_t best_link = n ? link_free_ns + link_total : 0, best_cpu = 0, best_busy = 0;
  int64_t cpu_sum = 0, link_left = link_total;
  for (size_t k = 1; k <= n; ++k) {
    const MissingExpert& m = missing[order[k - 1]];
    cpu_sum += m.cpu_ns;
    link_left -= m.link_ns;
    const int64_t link_done = k < n ? link_free_ns + link_left : 0;
    const int64_t cpu_done = cpu_free_ns + cpu_sum;
    if (std::max(link_done, cpu_done) < std::max(best_link, best_cpu)) {
      best_k = k;
      best_link = link_done;
      best_cpu = cpu_done;
      best_busy = cpu_sum;
    }
  }
  LayerSplit split;
  for (size_t k = 0; k < best_k; ++k) split.cpu.push_back(missing[order[k]].expert);
  std::sort(split.cpu.begin(), split.cpu.end());
  split.link_done_ns = best_link;
  split.cpu_done_ns = best_cpu;
  split.cpu_busy_ns = best_busy;
  return split;
}

}  // namespace fmoe::bench
