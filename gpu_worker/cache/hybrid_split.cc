#include "gpu_worker/cache/hybrid_split.h"

#include <algorithm>
#include <bit>
#include <numeric>

namespace fmoe {

namespace {

// Weight of a new sample in a bucket's moving average.
constexpr double kHostAverageWeight = 0.2;

}  // namespace

void HostTimeModel::Record(uint32_t tokens, int64_t ns) {
  if (tokens == 0 || ns <= 0) return;
  double& avg = avg_[std::bit_width(tokens)];
  const double sample = static_cast<double>(ns);
  avg = avg == 0.0 ? sample : (1.0 - kHostAverageWeight) * avg + kHostAverageWeight * sample;
  skipped_[std::bit_width(tokens)] = 0;
  ++samples_;
}

bool HostTimeModel::Due(uint32_t tokens) const {
  const int b = std::bit_width(std::max<uint32_t>(tokens, 1));
  return avg_[b] == 0.0 || skipped_[b] >= kReprobeAfter;
}

void HostTimeModel::Skipped(uint32_t tokens) {
  uint32_t& n = skipped_[std::bit_width(std::max<uint32_t>(tokens, 1))];
  n = std::min(n + 1, kReprobeAfter);
}

std::optional<double> HostTimeModel::Estimate(uint32_t tokens) const {
  if (samples_ == 0) return std::nullopt;
  const int b = std::bit_width(std::max<uint32_t>(tokens, 1));
  if (avg_[b] > 0.0) return avg_[b];
  for (int up = b + 1; up < static_cast<int>(avg_.size()); ++up) {
    if (avg_[up] > 0.0) return avg_[up];
  }
  for (int down = b - 1; down >= 1; --down) {
    if (avg_[down] > 0.0) {
      // Bucket `down` holds 2^(down-1) .. 2^down - 1 tokens.
      const double smallest = static_cast<double>(uint64_t{1} << (down - 1));
      return avg_[down] * static_cast<double>(tokens) / smallest;
    }
  }
  return std::nullopt;
}

bool HostTimeModel::Measured(uint32_t tokens) const {
  return avg_[std::bit_width(std::max<uint32_t>(tokens, 1))] > 0.0;
}

std::vector<bool> SplitMissing(std::span<const MissingExpert> missing, double load_ns,
                               double link_ahead_ns, HostTimeModel& host) {
  std::vector<bool> on_host(missing.size(), false);
  if (missing.empty() || load_ns <= 0.0) return on_host;
  double host_free = 0.0;
  // The probe: the lightest expert whose bucket the host has not run yet.
  size_t probe = missing.size();
  for (size_t i = 0; i < missing.size(); ++i) {
    if (!host.Due(missing[i].tokens)) continue;
    if (probe == missing.size() || missing[i].tokens < missing[probe].tokens) probe = i;
  }
  if (probe < missing.size()) {
    on_host[probe] = true;
    if (host.samples() == 0) {  // Nothing else to go by.
      for (size_t i = 0; i < missing.size(); ++i) {
        if (i != probe) host.Skipped(missing[i].tokens);
      }
      return on_host;
    }
    host_free = host.Estimate(missing[probe].tokens).value_or(0.0);
  }
  std::vector<size_t> order(missing.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return missing[a].tokens > missing[b].tokens; });
  double link_free = std::max(link_ahead_ns, 0.0);
  for (size_t i : order) {
    if (i == probe) continue;
    const double host_ns = host.Estimate(missing[i].tokens).value_or(0.0);
    const double by_link = link_free + load_ns;
    const double by_host = host_free + host_ns;
    if (host_ns > 0.0 && by_host < by_link) {
      on_host[i] = true;
      host_free = by_host;
    } else {
      link_free = by_link;
      host.Skipped(missing[i].tokens);
    }
  }
  return on_host;
}

}  // namespace fmoe
