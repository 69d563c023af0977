// A latency histogram with fixed bucket bounds, cheap enough to update on every message: counts
// per bucket, the total and the sum, and quantiles estimated within a bucket (linear in the
// bucket). Not thread-safe: the owner's thread updates and reads it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace fmoe {

class Histogram {
 public:
  // `bounds`: ascending upper bounds of the buckets; one more bucket holds what lies above.
  explicit Histogram(std::vector<double> bounds)
      : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

  // Microsecond bounds from 5 us to 100 ms, about three per decade.
  static Histogram LatencyUs() {
    return Histogram({5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 100000});
  }

  void Add(double value) {
    const size_t b = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) -
                                         bounds_.begin());
    ++counts_[b];
    ++count_;
    sum_ += value;
    max_ = std::max(max_, value);
  }

  uint64_t count() const { return count_; }
  double sum() const { return sum_; }
  double max() const { return max_; }
  const std::vector<double>& bounds() const { return bounds_; }
  const std::vector<uint64_t>& counts() const { return counts_; }

  // The q-quantile (0 < q <= 1), interpolated inside its bucket; 0 when empty. The top bucket
  // reports the largest value seen.
  double Quantile(double q) const {
    if (count_ == 0) return 0.0;
    const double rank = q * static_cast<double>(count_);
    uint64_t below = 0;
    for (size_t b = 0; b < counts_.size(); ++b) {
      if (counts_[b] == 0) continue;
      if (static_cast<double>(below + counts_[b]) >= rank) {
        if (b == bounds_.size()) return max_;
        const double lo = b == 0 ? 0.0 : bounds_[b - 1];
        const double hi = std::min(bounds_[b], max_);
        const double within = (rank - static_cast<double>(below)) / counts_[b];
        return lo + std::clamp(within, 0.0, 1.0) * std::max(0.0, hi - lo);
      }
      below += counts_[b];
    }
    return max_;
  }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;
  uint64_t count_ = 0;
  double sum_ = 0.0;
  double max_ = 0.0;
};

}  // namespace fmoe
