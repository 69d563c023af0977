#include "bench/fmoe_bench/replay_time.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "bench/fmoe_bench/format.h"

namespace fmoe::bench {
namespace {

bool ParseDouble(std::string_view text, double* out) {
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, *out);
  return ec == std::errc() && p == end && std::isfinite(*out);
}

}  // namespace

int64_t TimeModel::LayerNs(uint64_t tokens) const {
  if (layer.empty()) return 1;
  const double t = static_cast<double>(std::max<uint64_t>(tokens, 1));
  double ms = layer.front().ms;
  if (layer.size() > 1 && t > layer.front().tokens) {
    // The segment that holds t, or the last one beyond the last point.
    size_t i = 1;
    while (i + 1 < layer.size() && layer[i].tokens < t) ++i;
    const LayerTimePoint& a = layer[i - 1];
    const LayerTimePoint& b = layer[i];
    ms = a.ms + (b.ms - a.ms) * (t - a.tokens) / (b.tokens - a.tokens);
  }
  return std::max<int64_t>(1, std::llround(ms * 1e6));
}

int64_t TimeModel::LoadNs() const {
  const double ns = link_latency_us * 1e3 + expert_mb * 1e6 / link_gbps;
  return std::max<int64_t>(1, std::llround(ns));
}

std::string TimeModel::Describe() const {
  std::string out = name + ": layer";
  for (size_t i = 0; i < layer.size(); ++i) {
    out += (i ? ", " : " ") + Fixed(layer[i].ms, 3) + " ms at " + Fixed(layer[i].tokens, 0);
  }
  out += " tokens; expert " + Fixed(expert_mb, 3) + " MB over " + Fixed(link_gbps, 2) + " GB/s + " +
         Fixed(link_latency_us, 1) + " us = " + Fixed(static_cast<double>(LoadNs()) / 1e6, 3) +
         " ms (" + Fixed(static_cast<double>(LoadNs()) / static_cast<double>(LayerNs(1)), 1) +
         " layers of 1-token compute)";
  return out;
}

Status ValidateTimeModel(const TimeModel& m) {
  const auto bad = [](const std::string& what) { return InvalidArgument("time model: " + what); };
  if (m.layer.empty()) return bad("no layer compute times");
  for (size_t i = 0; i < m.layer.size(); ++i) {
    const LayerTimePoint& p = m.layer[i];
    const std::string at = "layer time " + std::to_string(i + 1) + " (" + Fixed(p.tokens, 1) +
                           " tokens: " + Fixed(p.ms, 4) + " ms)";
    if (!(p.tokens >= 1) || !std::isfinite(p.tokens)) return bad(at + ": tokens must be >= 1");
    if (!(p.ms > 0) || !std::isfinite(p.ms)) return bad(at + ": the time must be > 0");
    if (i > 0 && !(p.tokens > m.layer[i - 1].tokens)) {
      return bad(at + ": tokens must ascend");
    }
  }
  if (!(m.expert_mb > 0) || !std::isfinite(m.expert_mb)) return bad("expert MB must be > 0");
  if (!(m.link_gbps > 0) || !std::isfinite(m.link_gbps)) return bad("link GB/s must be > 0");
  if (!(m.link_latency_us >= 0) || !std::isfinite(m.link_latency_us)) {
    return bad("link latency must be >= 0");
  }
  for (size_t i = 0; i < m.cpu_expert.size(); ++i) {
    const LayerTimePoint& p = m.cpu_expert[i];
    const std::string at = "CPU expert time " + std::to_string(i + 1) + " (" + Fixed(p.tokens, 1) +
                           " tokens: " + Fixed(p.ms, 4) + " ms)";
    if (!(p.tokens >= 1) || !std::isfinite(p.tokens)) return bad(at + ": tokens must be >= 1");
    if (!(p.ms > 0) || !std::isfinite(p.ms)) return bad(at + ": the time must be > 0");
    if (i > 0 && !(p.tokens > m.cpu_expert[i - 1].tokens)) return bad(at + ": tokens must ascend");
  }
  if (!m.cpu_expert.empty() && (!(m.cpu_expert_mb > 0) || !std::isfinite(m.cpu_expert_mb))) {
    return bad("the CPU expert curve's expert MB must be > 0");
  }
  return Status::Ok();
}

std::vector<std::string> TimeModelPresetNames() { return {"dev-vm", "fmoe-paper"}; }

Result<TimeModel> TimeModelPreset(std::string_view name) {
  TimeModel m;
  m.name = std::string(name);
  if (name == "dev-vm") {
    // runtime_bench, 1 thread: decode 4.17 ms (batch 1) and 9.74 ms (batch 8) per iteration;
    // prefill 3,018 tok/s of 128 tokens (42.4 ms) and 6,125 tok/s of 8 x 128 (167.2 ms); 8
    // layers each.
    m.source =
        "measured: 2-vCPU AMD EPYC dev VM (bench/RESULTS.md: runtime_bench, tiny model, 1 thread; "
        "cache_bench's emulated link)";
    m.layer = {{1, 0.521}, {8, 1.218}, {128, 5.302}, {1024, 20.90}};
    m.expert_mb = 0.393216;
    m.link_gbps = 0.30;
    m.link_latency_us = 10;
    // cpu_expert_bench, FMOE_BENCH_EXPERT="256,128" (the tiny model's float32 expert), 1 thread,
    // BM_CpuSwiGlu's medians of 3 (2026-11-27: the host GEMM).
    m.cpu_expert = {{1, 0.00577}, {4, 0.0148}, {16, 0.0548}, {64, 0.2247}, {256, 1.118}};
    m.cpu_expert_mb = 0.393216;
    m.cpu_source =
        "the host kernel measured on the dev VM: cpu_expert_bench, the tiny model's expert, 1 "
        "thread";
    return m;
  }
  if (name == "fmoe-paper") {
    m.source =
        "fMoE paper's testbed (Mixtral-8x7B, RTX 3090, PCIe 4.0): decode ratio from the paper, "
        "prefill growth from the card's dense bf16 TFLOPS (not measured here)";
    m.layer = {{1, 0.842}, {38, 0.842}, {1000, 22.16}};
    m.expert_mb = 352.3;
    m.link_gbps = 32;
    m.link_latency_us = 0;
    return m;
  }
  std::string names;
  for (const std::string& n : TimeModelPresetNames()) names += (names.empty() ? "" : ", ") + n;
  return InvalidArgument("unknown time model preset \"" + std::string(name) +
                         "\"; valid: " + names);
}

Result<std::vector<std::pair<double, double>>> ParseTokenPairs(std::string_view text,
                                                               std::string_view what,
                                                               std::string_view form) {
  std::vector<std::pair<double, double>> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string_view item = text.substr(at, comma - at);
    const size_t colon = item.find(':');
    std::pair<double, double> p;
    if (colon == std::string_view::npos || !ParseDouble(item.substr(0, colon), &p.first) ||
        !ParseDouble(item.substr(colon + 1), &p.second)) {
      return InvalidArgument(std::string(what) + ": \"" + std::string(item) + "\" is not " +
                             std::string(form));
    }
    out.push_back(p);
    at = comma + 1;
  }
  return out;
}

Result<std::vector<LayerTimePoint>> ParseLayerTimes(std::string_view text) {
  FMOE_ASSIGN_OR_RETURN(auto pairs,
                        ParseTokenPairs(text, "layer times", "TOKENS:MS (e.g. 1:0.521,128:5.30)"));
  std::vector<LayerTimePoint> out;
  for (const auto& [tokens, ms] : pairs) out.push_back({tokens, ms});
  TimeModel check;
  check.layer = out;
  check.expert_mb = check.link_gbps = 1;
  FMOE_RETURN_IF_ERROR(ValidateTimeModel(check));
  return out;
}

}  // namespace fmoe::bench
