#include "map_service/map_store.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>

namespace fmoe {
namespace {

// Eight float partial sums (vectorised by the compiler), combined in double: close to a double
// dot product (relative error about 1e-7 at h = 4096) at the speed of float arithmetic.
double Dot(const float* a, const float* b, size_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (size_t k = 0; k < 8; ++k) lanes[k] += a[i + k] * b[i + k];
  }
  double s = 0.0;
  for (float x : lanes) s += x;
  for (; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// bfloat16 copy of a float, rounded to nearest even: relative error at most 2^-9.
uint16_t ToBf16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Dot product of floats with bfloat16s (the semantic search's screening pass): eight float lanes.
float DotBf16Portable(const float* a, const uint16_t* b, size_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (size_t k = 0; k < 8; ++k) {
      lanes[k] += a[i + k] * std::bit_cast<float>(static_cast<uint32_t>(b[i + k]) << 16);
    }
  }
  float s = 0.0f;
  for (float x : lanes) s += x;
  for (; i < n; ++i) s += a[i] * std::bit_cast<float>(static_cast<uint32_t>(b[i]) << 16);
  return s;
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) float DotBf16Avx2(const float* a, const uint16_t* b, size_t n) {
  // Four independent accumulators hide the FMA latency.
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < 2; ++k) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i + 16 * k));
      const __m256 lo = _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(w)), 16));
      const __m256 hi = _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(w, 1)), 16));
      acc[2 * k] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16 * k), lo, acc[2 * k]);
      acc[2 * k + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16 * k + 8), hi, acc[2 * k + 1]);
    }
  }
  float lanes[8];
  _mm256_storeu_ps(lanes,
                   _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  float s = 0.0f;
  for (float x : lanes) s += x;
  return s + DotBf16Portable(a + i, b + i, n - i);
}
#endif

using DotBf16Fn = float (*)(const float*, const uint16_t*, size_t);
DotBf16Fn PickDotBf16() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return DotBf16Avx2;
#endif
  return DotBf16Portable;
}
const DotBf16Fn kDotBf16 = PickDotBf16();

double Cosine(double dot, double norm_a, double norm_b) {
  if (norm_a <= 0.0 || norm_b <= 0.0) return 0.0;
  return dot / (norm_a * norm_b);
}

bool AllFinite(std::span<const float> v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

}  // namespace

Result<MapStore> MapStore::Create(const MapStoreOptions& options) {
  if (options.num_layers == 0 || options.num_experts == 0 || options.hidden == 0) {
    return InvalidArgument("map store: L, J and h must be positive");
  }
  if (options.top_k == 0 || options.top_k > options.num_experts) {
    return InvalidArgument("map store: top_k " + std::to_string(options.top_k) + " is not in 1.." +
                           std::to_string(options.num_experts));
  }
  if (options.capacity == 0 || options.capacity > 1000000) {
    return InvalidArgument("map store: capacity " + std::to_string(options.capacity) +
                           " is not in 1..1000000");
  }
  return MapStore(options);
}

uint64_t MapStore::BytesFor(const MapStoreOptions& o) {
  // In double: exact far beyond any limit, and no product can overflow.
  const double per_row = 8.0 + 8.0 +                           // id, |sem|
                         6.0 * o.hidden +                      // sem (float, bfloat16)
                         8.0 * o.num_layers * o.num_experts +  // map, layer-major map
                         16.0 * o.num_layers;                  // prefix norms, inverse prefix norms
  const double bytes = per_row * o.capacity;
  return bytes >= 18e18 ? UINT64_MAX : static_cast<uint64_t>(bytes);
}

MapStore::MapStore(const MapStoreOptions& options)
    : options_(options), map_width_(static_cast<size_t>(options.num_layers) * options.num_experts) {
  const size_t c = options_.capacity;
  ids_.resize(c);
  sems_.resize(c * options_.hidden);
  sems_bf16_.resize(c * options_.hidden);
  maps_.resize(c * map_width_);
  layer_maps_.resize(c * map_width_);
  prefix_inv_norm_.resize(c * options_.num_layers);
  sem_norm_.resize(c);
  prefix_norm2_.resize(c * options_.num_layers);
}

std::span<const float> MapStore::sem(uint32_t index) const {
  return {sems_.data() + static_cast<size_t>(index) * options_.hidden, options_.hidden};
}

std::span<const float> MapStore::map(uint32_t index) const {
  return {maps_.data() + index * map_width_, map_width_};
}

std::span<const float> MapStore::map_layer(uint32_t index, uint32_t layer) const {
  return {maps_.data() + index * map_width_ + static_cast<size_t>(layer) * options_.num_experts,
          options_.num_experts};
}

Status MapStore::CheckShapes(std::span<const float> sem, std::span<const float> map) const {
  if (sem.size() != options_.hidden) {
    return InvalidArgument("map store: semantic embedding of " + std::to_string(sem.size()) +
                           " floats, expected h = " + std::to_string(options_.hidden));
  }
  if (map.size() != map_width_) {
    return InvalidArgument("map store: expert map of " + std::to_string(map.size()) +
                           " floats, expected L * J = " + std::to_string(map_width_));
  }
  if (!AllFinite(sem) || !AllFinite(map)) {
    return InvalidArgument("map store: the entry holds a non-finite value");
  }
  return Status::Ok();
}

void MapStore::Write(uint32_t index, uint64_t id, std::span<const float> sem,
                     std::span<const float> map) {
  ids_[index] = id;
  std::copy(sem.begin(), sem.end(), sems_.begin() + static_cast<size_t>(index) * options_.hidden);
  std::transform(sem.begin(), sem.end(),
                 sems_bf16_.begin() + static_cast<size_t>(index) * options_.hidden, ToBf16);
  std::copy(map.begin(), map.end(), maps_.begin() + index * map_width_);
  sem_norm_[index] = std::sqrt(Dot(sem.data(), sem.data(), sem.size()));
  double running = 0.0;
  const uint32_t J = options_.num_experts;
  for (uint32_t l = 0; l < options_.num_layers; ++l) {
    const float* row = map.data() + static_cast<size_t>(l) * J;
    running += Dot(row, row, J);
    prefix_norm2_[static_cast<size_t>(index) * options_.num_layers + l] = running;
    prefix_inv_norm_[static_cast<size_t>(l) * options_.capacity + index] =
        running > 0.0 ? 1.0 / std::sqrt(running) : 0.0;
    std::copy(row, row + J,
              layer_maps_.begin() + (static_cast<size_t>(l) * options_.capacity + index) * J);
  }
  ++generation_;
}

double MapStore::Redundancy(uint32_t index, std::span<const float> sem, double sem_norm,
                            std::span<const float> map, double map_norm) const {
  const uint32_t layers = options_.num_layers;
  const double L = layers;
  const double d = std::min<double>(options_.prefetch_distance, L);
  const double cos_sem =
      Cosine(Dot(sem.data(), this->sem(index).data(), sem.size()), sem_norm, sem_norm_[index]);
  const double stored_map_norm =
      std::sqrt(prefix_norm2_[static_cast<size_t>(index) * layers + layers - 1]);
  const double cos_map =
      Cosine(Dot(map.data(), this->map(index).data(), map.size()), map_norm, stored_map_norm);
  return (d / L) * cos_sem + ((L - d) / L) * cos_map;
}

Result<InsertResult> MapStore::PlanInsert(std::span<const float> sem,
                                          std::span<const float> map) const {
  FMOE_RETURN_IF_ERROR(CheckShapes(sem, map));
  InsertResult result;
  if (size_ < options_.capacity) {
    result.index = size_;
    return result;
  }
  const double sem_norm = std::sqrt(Dot(sem.data(), sem.data(), sem.size()));
  const double map_norm = std::sqrt(Dot(map.data(), map.data(), map.size()));
  double best = -std::numeric_limits<double>::infinity();
  uint32_t best_index = 0;
  for (uint32_t i = 0; i < size_; ++i) {
    const double rdy = Redundancy(i, sem, sem_norm, map, map_norm);
    if (rdy > best) {
      best = rdy;
      best_index = i;
    }
  }
  result.index = best_index;
  result.replaced = true;
  result.replaced_id = ids_[best_index];
  result.redundancy = static_cast<float>(best);
  return result;
}

Result<InsertResult> MapStore::Insert(uint64_t id, std::span<const float> sem,
                                      std::span<const float> map) {
  FMOE_ASSIGN_OR_RETURN(InsertResult result, PlanInsert(sem, map));
  if (result.index == size_) ++size_;
  Write(result.index, id, sem, map);
  return result;
}

Status MapStore::Put(uint32_t index, uint64_t id, std::span<const float> sem,
                     std::span<const float> map) {
  FMOE_RETURN_IF_ERROR(CheckShapes(sem, map));
  if (index > size_ || index >= options_.capacity) {
    return InvalidArgument("map store: row " + std::to_string(index) + " is beyond the " +
                           std::to_string(size_) + " rows stored (capacity " +
                           std::to_string(options_.capacity) + ")");
  }
  if (index == size_) ++size_;
  Write(index, id, sem, map);
  return Status::Ok();
}

MapMatch MapStore::SemanticMatch(std::span<const float> sem) const {
  MapMatch match;
  if (sem.size() != options_.hidden || size_ == 0) return match;
  const size_t h = options_.hidden;
  const double norm = std::sqrt(Dot(sem.data(), sem.data(), h));
  auto exact = [&](uint32_t i) {
    return Cosine(Dot(sem.data(), this->sem(i).data(), h), norm, sem_norm_[i]);
  };
  // Small stores (and a zero query) are scanned exactly. Otherwise two passes, still exact:
  // screen every row with its bfloat16 copy (half the bytes: this search is bound by memory
  // bandwidth), then recompute exactly every row that could still be the best. Each screened
  // cosine is within `margin` of the exact one: bfloat16 rounding moves a dot by at most
  // 2^-9 |x||y| (Cauchy-Schwarz), float accumulation (about h/8 additions per lane, in both
  // passes) by far less; the margin doubles that sum.
  const bool screen = size_ >= 64 && norm > 0.0;
  std::vector<float> approx;
  double floor = -std::numeric_limits<double>::infinity();
  if (screen) {
    const double margin =
        2.0 * (std::ldexp(1.0, -9) + 2.0 * (h / 8.0 + 16.0) * std::ldexp(1.0, -24));
    approx.resize(size_);
    double best_approx = -std::numeric_limits<double>::infinity();
    for (uint32_t i = 0; i < size_; ++i) {
      const double c = sem_norm_[i] > 0.0 ? kDotBf16(sem.data(), sems_bf16_.data() + i * h, h) /
                                                (norm * sem_norm_[i])
                                          : 0.0;
      approx[i] = static_cast<float>(c);
      best_approx = std::max(best_approx, c);
    }
    // The exact best has approx >= exact - margin >= exact(approx-best row) - margin
    // >= best_approx - 2 margin; float storage of `approx` costs at most 1e-7 more.
    floor = best_approx - 2.0 * margin - 1e-6;
  }
  double best = -std::numeric_limits<double>::infinity();
  for (uint32_t i = 0; i < size_; ++i) {
    if (screen && approx[i] < floor) continue;
    const double c = exact(i);
    if (c > best) {
      best = c;
      match.index = i;
    }
  }
  match.score = static_cast<float>(best);
  return match;
}

void MapStore::BeginTrajectory(Trajectory* t) const {
  t->dots.assign(size_, 0.0);
  t->observed.clear();
  t->norm2 = 0.0;
  t->layers = 0;
  t->generation = generation_;
}

MapMatch MapStore::ObserveLayer(Trajectory* t, std::span<const float> probs) const {
  MapMatch match;
  const uint32_t J = options_.num_experts;
  if (probs.size() != J || t->layers >= options_.num_layers) return match;
  const uint32_t l = t->layers;
  if (t->generation != generation_ || t->dots.size() != size_) {
    // Rows changed under this trajectory: recompute its dots over the layers seen so far.
    t->dots.assign(size_, 0.0);
    for (uint32_t i = 0; i < size_; ++i) {
      t->dots[i] = Dot(t->observed.data(), map(i).data(), t->observed.size());
    }
    t->generation = generation_;
  }
  t->observed.insert(t->observed.end(), probs.begin(), probs.end());
  t->norm2 += Dot(probs.data(), probs.data(), J);
  t->layers = l + 1;
  const double norm = std::sqrt(t->norm2);
  double best = -std::numeric_limits<double>::infinity();
  // Layer l of every stored map is one contiguous C x J block: one pass over it.
  const float* block = layer_maps_.data() + static_cast<size_t>(l) * options_.capacity * J;
  const double* inv = prefix_inv_norm_.data() + static_cast<size_t>(l) * options_.capacity;
  const double inv_norm = norm > 0.0 ? 1.0 / norm : 0.0;
  double* dots = t->dots.data();
  for (uint32_t i = 0; i < size_; ++i) {
    const float* row = block + static_cast<size_t>(i) * J;
    double d = 0.0;
    for (uint32_t j = 0; j < J; ++j) d += static_cast<double>(probs[j]) * row[j];
    dots[i] += d;
    const double c = dots[i] * inv_norm * inv[i];
    if (c > best) {
      best = c;
      match.index = i;
    }
  }
  if (match.index >= 0) match.score = static_cast<float>(best);
  return match;
}

std::vector<PrefetchEntry> SelectExperts(std::span<const float> probs, float score, uint32_t top_k,
                                         uint32_t target_layer, int32_t current_layer) {
  std::vector<uint32_t> order(probs.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return probs[a] > probs[b]; });
  const double delta = std::clamp(1.0 - static_cast<double>(score), 0.0, 1.0);
  const double distance =
      std::max(1.0, static_cast<double>(static_cast<int64_t>(target_layer) - current_layer));
  std::vector<PrefetchEntry> out;
  double sum = 0.0;
  for (uint32_t j : order) {
    if (out.size() >= top_k && sum >= delta) break;
    out.push_back({j, probs[j], static_cast<float>(probs[j] / distance)});
    sum += probs[j];
  }
  return out;
}

}  // namespace fmoe
