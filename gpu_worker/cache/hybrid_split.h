// Hybrid execution: which of a layer's missing experts to load over the link and
// which to run on the host from their host copies, so the layer finishes soonest, from rates
// measured online (the link's time per expert load, the host's time per expert as a function of
// its token count). Torch-free; the ExpertCache owns one HostTimeModel and calls SplitMissing in
// BeginLayer. Engine thread only.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace fmoe {

// Host time per expert run, by token count: a moving average per power-of-two bucket of tokens
// (1, 2-3, 4-7, ...).
class HostTimeModel {
 public:
  void Record(uint32_t tokens, int64_t ns);
  // The expected time of a run on `tokens` tokens: its bucket's average; for a bucket not seen
  // yet, the nearest larger bucket's, else the nearest smaller one's scaled up linearly by the
  // tokens (both err on the slow side). nullopt when nothing has been measured.
  std::optional<double> Estimate(uint32_t tokens) const;
  // Whether a run with this many tokens' bucket has been measured.
  bool Measured(uint32_t tokens) const;
  // Whether an expert with this many tokens should run on the host to (re)measure its bucket:
  // never measured, or loaded instead kReprobeAfter times since its last run (so one slow
  // sample cannot keep the host out for good).
  bool Due(uint32_t tokens) const;
  // An expert with this many tokens was loaded instead.
  void Skipped(uint32_t tokens);
  uint64_t samples() const { return samples_; }

  static constexpr uint32_t kReprobeAfter = 32;

 private:
  std::array<double, 33> avg_{};        // By std::bit_width(tokens); 0 = no sample.
  std::array<uint32_t, 33> skipped_{};  // Loads since the bucket's last run.
  uint64_t samples_ = 0;
};

struct MissingExpert {
  uint32_t key = 0;     // The cache's expert key.
  uint32_t tokens = 0;  // Tokens routed to it this layer (>= 1).
};

// For each of `missing` (neither resident nor on the link), whether it runs on the host. Greedy,
// by descending token count: each expert goes where it would finish first, the link (its loads
// one after another, starting `link_ahead_ns` from now, `load_ns` each) or the host (its runs
// one after another, each as `host` estimates); ties go to the link, which also caches the
// expert. With no link figure yet everything is loaded. Where some missing expert's bucket is
// Due (never measured, or long not run: an estimate otherwise stays as wrong as its last sample),
// the lightest such expert runs on the host first, to measure it: one such probe per layer.
// Notes each expert it loads in `host` (Skipped).
std::vector<bool> SplitMissing(std::span<const MissingExpert> missing, double load_ns,
                               double link_ahead_ns, HostTimeModel& host);

}  // namespace fmoe
