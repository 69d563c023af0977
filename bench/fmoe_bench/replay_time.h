// The replay's time model (DESIGN section 11): how long one layer computes for an iteration of
// t tokens, and how long one expert takes over the link (latency + bytes / bandwidth). Every
// figure is a flag of `fmoe-bench replay`; the defaults are a named preset taken from a measured
// machine (bench/RESULTS.md), and the fMoE paper's testbed ratio is a preset too. Pure values and
// functions; no threads.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace fmoe::bench {

// One layer's compute at `tokens` tokens in the iteration.
struct LayerTimePoint {
  double tokens = 0;
  double ms = 0;
};

struct TimeModel {
  std::string name;    // The preset, or "custom" when a flag changed it.
  std::string source;  // Where the figures come from, for the report.
  // Piecewise linear in the iteration's tokens through these points (tokens ascending, >= 1):
  // the first point's time below it, the last segment's slope beyond the last point.
  std::vector<LayerTimePoint> layer;
  double expert_mb = 0;        // One expert, in 10^6 bytes.
  double link_gbps = 0;        // Host-to-device bandwidth, 10^9 bytes/s.
  double link_latency_us = 0;  // Per transfer.
  // Hybrid execution's default CPU model: the host kernel's measured time for one expert of
  // `cpu_expert_mb` MB against its tokens (piecewise linear, as `layer`), scaled by
  // expert_mb / cpu_expert_mb when --expert-mb changes the expert. Empty: no default.
  std::vector<LayerTimePoint> cpu_expert;
  double cpu_expert_mb = 0;
  std::string cpu_source;  // Where the curve comes from, for the report.

  // One layer's compute for an iteration of `tokens` tokens (>= 1 ns).
  int64_t LayerNs(uint64_t tokens) const;
  // One expert over the link (>= 1 ns).
  int64_t LoadNs() const;
  // "layer 0.521 ms at 1 token ... ; expert 0.393 MB over 0.30 GB/s + 10 us = 1.32 ms".
  std::string Describe() const;
};

// kInvalidArgument naming the field: no points, tokens not ascending or below 1, a time not
// positive, a size, bandwidth or latency out of range.
Status ValidateTimeModel(const TimeModel& model);

// Presets (TimeModelPresetNames lists them):
//  dev-vm      measured: the 2-vCPU AMD EPYC dev VM of bench/RESULTS.md. Layer compute from
//              runtime_bench (tiny model, 1 thread: decode of 1 and 8 tokens, prefill of 128 and
//              8 x 128 tokens, the iteration's time over its 8 layers); the link is cache_bench's
//              emulated link (0.30 GB/s + 10 us for a 393,216-byte fp32 expert: 1.32 ms, 3 layers
//              of decode compute), which link_bench measured at 99.6% of its setting. Hybrid
//              execution's CPU: the host kernel's time for that expert against its tokens
//              (cpu_expert_bench, 1 thread: 5.8 us at 1 token, 1.12 ms at 256).
//              fmoe-paper has no CPU curve (the paper's host was not measured): --hybrid
//              there needs --cpu-expert-us or --cpu-factor.
//  fmoe-paper  the fMoE paper's testbed: Mixtral-8x7B on an RTX 3090 over PCIe 4.0. A decode
//              layer reads two experts and attention (789 MB) at 936 GB/s: 0.842 ms; one 352.3 MB
//              expert at 32 GB/s: 11.01 ms (13.1 layers). Not measured here: the paper states
//              decode only, so prefill grows from 38 tokens at the card's 35.6 dense bf16 TFLOPS
//              (0.789 GFLOP per token and layer: 0.0222 ms per token).
std::vector<std::string> TimeModelPresetNames();
Result<TimeModel> TimeModelPreset(std::string_view name);

// "1:0.521,8:1.218,128:5.30" -> points. kInvalidArgument naming the bad item.
Result<std::vector<LayerTimePoint>> ParseLayerTimes(std::string_view text);
// "T1:V1,T2:V2,...": the (tokens, value) pairs, each two finite numbers; kInvalidArgument naming
// `what` and the expected `form` for any other item.
Result<std::vector<std::pair<double, double>>> ParseTokenPairs(std::string_view text,
                                                               std::string_view what,
                                                               std::string_view form);

}  // namespace fmoe::bench
