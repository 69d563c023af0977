#include "gpu_worker/cache/policies/moe_infinity_policy.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace fmoe {

// ---- EamCollection (paper 4.2) ----

EamCollection::EamCollection(uint32_t capacity, uint32_t num_layers, uint32_t num_experts)
    : capacity_(capacity), layers_(num_layers), experts_(num_experts) {}

std::optional<uint32_t> EamCollection::Insert(std::span<const uint32_t> eam) {
  const size_t cells = size_t{layers_} * experts_;
  if (capacity_ == 0 || cells == 0 || eam.size() != cells) return std::nullopt;
  double norm2 = 0;
  for (uint32_t v : eam) norm2 += double{static_cast<float>(v)} * static_cast<float>(v);
  if (norm2 == 0) return std::nullopt;

  uint32_t index = 0;
  if (size_ < capacity_) {
    index = size_++;
    data_.resize(size_t{size_} * cells);
    prefix_inv_norm_.resize(size_t{size_} * layers_);
  } else {
    // Paper 4.2: "we opt to replace an EAM that is most similar to the incoming one", i.e. the
    // one with the smallest cosine distance 1 - cos (largest cos); ties keep the lower index.
    double best = -1;
    for (uint32_t c = 0; c < size_; ++c) {
      const double sim = Similarity(c, Dot(c, eam), norm2, layers_);
      if (sim > best) {
        best = sim;
        index = c;
      }
    }
  }

  float* out = data_.data() + size_t{index} * cells;
  double prefix = 0;
  for (uint32_t l = 0; l < layers_; ++l) {
    for (uint32_t j = 0; j < experts_; ++j) {
      const size_t cell = size_t{l} * experts_ + j;
      out[cell] = static_cast<float>(eam[cell]);
      prefix += double{out[cell]} * out[cell];
    }
    prefix_inv_norm_[size_t{index} * layers_ + l] = prefix > 0 ? 1.0 / std::sqrt(prefix) : 0.0;
  }
  return index;
}

std::span<const float> EamCollection::entry(uint32_t index) const {
  const size_t cells = size_t{layers_} * experts_;
  return std::span<const float>(data_.data() + size_t{index} * cells, cells);
}

void EamCollection::AccumulateRowDots(uint32_t layer, std::span<const uint32_t> row,
                                      std::span<const uint32_t> nonzero,
                                      std::span<double> dots) const {
  const size_t cells = size_t{layers_} * experts_;
  const float* base = data_.data() + size_t{layer} * experts_;
  for (uint32_t c = 0; c < size_; ++c) {
    const float* stored = base + size_t{c} * cells;
    double dot = 0;
    for (uint32_t j : nonzero) dot += double{static_cast<float>(row[j])} * stored[j];
    dots[c] += dot;
  }
}

double EamCollection::Dot(uint32_t index, std::span<const uint32_t> eam) const {
  const std::span<const float> stored = entry(index);
  double dot = 0;
  for (size_t cell = 0; cell < stored.size(); ++cell) {
    if (eam[cell] != 0) dot += double{static_cast<float>(eam[cell])} * stored[cell];
  }
  return dot;
}

double EamCollection::Similarity(uint32_t index, double dot, double query_norm2,
                                 uint32_t layers) const {
  if (layers == 0 || dot <= 0 || query_norm2 <= 0) return 0;
  // Cosine similarity (paper 4.2) over rows [0, layers) of both.
  const double query_inv_norm = 1.0 / std::sqrt(query_norm2);
  return dot * prefix_inv_norm_[size_t{index} * layers_ + std::min(layers, layers_) - 1] *
         query_inv_norm;
}

void EamCollection::TopMatches(std::span<const double> dots, double query_norm2, uint32_t layers,
                               uint32_t count, std::vector<uint32_t>* out) const {
  out->clear();
  if (count == 0 || layers == 0 || query_norm2 <= 0) return;
  const double query_inv_norm = 1.0 / std::sqrt(query_norm2);
  const double* inv_norm = prefix_inv_norm_.data() + std::min(layers, layers_) - 1;
  double worst = 0;  // Similarity of out->back() once out is full; 0 before.
  for (uint32_t c = 0; c < size_; ++c) {
    const double sim = dots[c] * inv_norm[size_t{c} * layers_] * query_inv_norm;
    if (sim <= worst) continue;  // Ties keep the earlier, lower index.
    size_t pos = out->size();
    while (pos > 0 &&
           sim > Similarity((*out)[pos - 1], dots[(*out)[pos - 1]], query_norm2, layers)) {
      --pos;
    }
    if (out->size() == count) out->pop_back();
    out->insert(out->begin() + static_cast<std::ptrdiff_t>(pos), c);
    if (out->size() == count)
      worst = Similarity(out->back(), dots[out->back()], query_norm2, layers);
  }
}

void EamCollection::Match(std::span<const uint32_t> query, uint32_t layers, uint32_t count,
                          std::vector<double>* dots, std::vector<uint32_t>* out) const {
  const size_t cells = size_t{layers_} * experts_;
  const size_t used = std::min(size_t{std::min(layers, layers_)} * experts_, query.size());
  double norm2 = 0;
  std::vector<uint32_t> nonzero;
  for (size_t cell = 0; cell < used; ++cell) {
    if (query[cell] == 0) continue;
    nonzero.push_back(static_cast<uint32_t>(cell));
    norm2 += double{static_cast<float>(query[cell])} * static_cast<float>(query[cell]);
  }
  dots->assign(size_, 0.0);
  for (uint32_t c = 0; c < size_; ++c) {
    const float* stored = data_.data() + size_t{c} * cells;
    double dot = 0;
    for (uint32_t cell : nonzero) dot += double{static_cast<float>(query[cell])} * stored[cell];
    (*dots)[c] = dot;
  }
  TopMatches(*dots, norm2, layers, count, out);
}

// ---- MoeInfinityPolicy ----
//
// Choices where the paper leaves room (each also noted where it is made):
// - Matching (4.2, 5.1): cosine similarity between a request's iteration EAM so far (rows 0..l)
//   and rows 0..l of each stored EAM of the same phase: the stored rows after l are what we
//   predict, not evidence against the match. "Several matched EAMs might be returned": the
//   `matches` (default 3) most similar with similarity > 0, ties to the lower index; their cells
//   summed and each row normalised. Dot products grow incrementally, O(C * nonzero) per layer.
// - Batch: per-request predictions combined by max. Horizon: prefetch_distance layers (0: all).
// - Iteration start: decode requests match their request EAM of earlier iterations; prefill none.
// - Eviction: (1 + (L - l)/L) * sum over requests in flight of their request EAM cell.

MoeInfinityPolicy::MoeInfinityPolicy(const PolicyOptions& options, uint32_t matches)
    : options_(options), matches_(matches) {}

void MoeInfinityPolicy::Attach(CacheControl* control) {
  CachePolicy::Attach(control);
  layers_ = control->num_layers();
  experts_ = control->num_experts();
  const size_t cells = size_t{layers_} * experts_;
  for (auto& collection : collections_) {
    collection = std::make_unique<EamCollection>(options_.eam_capacity, layers_, experts_);
  }
  batch_counts_.assign(cells, 0);
  pred_.assign(cells, 0.0);
  row_.assign(experts_, 0.0);
  nonzero_.reserve(experts_);
  matched_.reserve(matches_);
}

uint32_t MoeInfinityPolicy::LastTarget(int64_t current) const {
  // Multi-layer prefetch (paper 5.1) over the next prefetch_distance layers; 0 means every
  // subsequent layer, as the paper does.
  const int64_t last_layer = int64_t{layers_} - 1;
  if (options_.prefetch_distance == 0) return static_cast<uint32_t>(last_layer);
  return static_cast<uint32_t>(std::min(last_layer, current + options_.prefetch_distance));
}

void MoeInfinityPolicy::OnIterationStart(std::span<const SequenceInfo> sequences) {
  if (layers_ == 0 || experts_ == 0) return;
  const size_t cells = size_t{layers_} * experts_;
  batch_.clear();
  for (const SequenceInfo& seq : sequences) {
    const Phase phase = seq.in_prefill() ? kPrefill : kDecode;
    auto [it, inserted] = requests_.try_emplace(seq.request_id);
    Request& r = it->second;
    if (inserted) {
      r.iteration.assign(cells, 0);
      r.eams[kPrefill].assign(cells, 0);
      r.eams[kDecode].assign(cells, 0);
      r.decode_dots.assign(collections_[kDecode]->size(), 0.0);
      r.phase = phase;
    } else {
      // The last iteration's dot products join those of the decode EAM of earlier iterations,
      // so the start-of-iteration match below costs O(C), not O(C * L * J).
      if (r.phase == kDecode) {
        for (size_t c = 0; c < r.dots.size(); ++c) r.decode_dots[c] += r.dots[c];
      }
    }
    if (!inserted && r.phase != phase) {
      // The cache priority follows the request EAM of the phase the request is in (paper 4.1
      // traces prefill and decode separately).
      for (size_t cell = 0; cell < cells; ++cell) {
        batch_counts_[cell] += int64_t{r.eams[phase][cell]} - int64_t{r.eams[r.phase][cell]};
      }
      r.phase = phase;
    }
    std::fill(r.iteration.begin(), r.iteration.end(), 0u);
    r.query_norm2 = 0;
    r.dots.assign(collections_[phase]->size(), 0.0);
    batch_.push_back(&r);
  }

  // Start of a decode iteration: no layer of it is known yet, so the partial trace matched is
  // the request's decode EAM of the earlier iterations (its prefill EAM on the first decode
  // iteration), over all layers. A prefill has no earlier trace: nothing to match, no prefetch.
  const uint32_t last = LastTarget(-1);
  std::fill(pred_.begin(), pred_.begin() + static_cast<std::ptrdiff_t>((last + 1) * experts_), 0.0);
  bool any_decode = false;
  for (Request* r : batch_) {
    if (r->phase != kDecode) continue;
    any_decode = true;
    if (r->decode_norm2 > 0) {
      collections_[kDecode]->TopMatches(r->decode_dots, r->decode_norm2, layers_, matches_,
                                        &matched_);
    } else {  // First decode iteration, once per request.
      collections_[kDecode]->Match(r->eams[kPrefill], layers_, matches_, &dots_, &matched_);
    }
    AddPrediction(kDecode, 0, last);
  }
  if (any_decode) IssuePrefetches(-1, 0, last);
}

void MoeInfinityPolicy::OnLayerStart(const LayerRouting& routing) {
  const uint32_t l = routing.layer;
  const uint32_t J = experts_;
  if (l >= layers_ || routing.sequence_counts.size() != batch_.size() * J) return;

  // Trace (paper 4.1): row l of each request's iteration EAM. The paper adds the iteration EAM
  // to the request EAM at the end of the iteration; we add each row as soon as its layer is
  // routed, so the cache priority of an expert just used already counts this use (5.2, reset
  // "when expert finishes its inference"). At iteration end both are the same.
  for (size_t s = 0; s < batch_.size(); ++s) {
    Request* r = batch_[s];
    if (r == nullptr) continue;
    const std::span<const uint32_t> row = routing.sequence_counts.subspan(s * J, J);
    nonzero_.clear();
    for (uint32_t j = 0; j < J; ++j) {
      const uint32_t v = row[j];
      if (v == 0) continue;
      nonzero_.push_back(j);
      const size_t cell = size_t{l} * J + j;
      r->iteration[cell] += v;
      uint32_t& count = r->eams[r->phase][cell];
      if (r->phase == kDecode) {
        r->decode_norm2 += double{static_cast<float>(count + v)} * static_cast<float>(count + v) -
                           double{static_cast<float>(count)} * static_cast<float>(count);
      }
      count += v;
      batch_counts_[cell] += v;
      r->query_norm2 += double{static_cast<float>(v)} * static_cast<float>(v);
    }
    // Incremental matching: dot products with every stored EAM grow by this row only.
    collections_[r->phase]->AccumulateRowDots(l, row, nonzero_, r->dots);
  }

  // Prefetch (paper 5.1): match each request's iteration EAM so far, on layers 0..l, against the
  // collection of its phase; predict layers l+1..last.
  if (l + 1 >= layers_) return;
  const uint32_t first = l + 1;
  const uint32_t last = LastTarget(l);
  std::fill(pred_.begin() + static_cast<std::ptrdiff_t>(size_t{first} * J),
            pred_.begin() + static_cast<std::ptrdiff_t>(size_t{last + 1} * J), 0.0);
  for (Request* r : batch_) {
    if (r == nullptr || r->query_norm2 == 0) continue;
    collections_[r->phase]->TopMatches(r->dots, r->query_norm2, l + 1, matches_, &matched_);
    AddPrediction(r->phase, first, last);
  }
  IssuePrefetches(l, first, last);
}

void MoeInfinityPolicy::AddPrediction(Phase phase, uint32_t first, uint32_t last) {
  // Paper 5.1, step 2: "the cell of each matched EAM is summed up and normalized on each row",
  // giving each expert's activation probability in a future layer. Across the requests of the
  // batch we keep the max: a miss stalls the whole batch whichever request needs the expert, and
  // the max keeps every row in [0, 1] so proximity weights compare across layers for any batch.
  if (matched_.empty()) return;
  const EamCollection& collection = *collections_[phase];
  const uint32_t J = experts_;
  for (uint32_t i = first; i <= last; ++i) {
    std::fill(row_.begin(), row_.end(), 0.0);
    for (uint32_t m : matched_) {
      const std::span<const float> stored = collection.entry(m).subspan(size_t{i} * J, J);
      for (uint32_t j = 0; j < J; ++j) row_[j] += stored[j];
    }
    double total = 0;
    for (uint32_t j = 0; j < J; ++j) total += row_[j];
    if (total <= 0) continue;
    double* pred = pred_.data() + size_t{i} * J;
    for (uint32_t j = 0; j < J; ++j) pred[j] = std::max(pred[j], row_[j] / total);
  }
}

void MoeInfinityPolicy::IssuePrefetches(int64_t current, uint32_t first, uint32_t last) {
  // The new priorities replace the queued ones (paper 5.1: the I/O thread "adjust[s] its current
  // prefetching operations"; experts no longer predicted are cancelled). An expert that misses
  // anyway is loaded on demand at once by the cache, ahead of every prefetch (5.1 (iii)); a
  // prefetched expert is protected by the cache until its layer has run, which is the paper's
  // "maximal cache priority until used or determined not to use" (5.2).
  control_->ClearPrefetches();
  const uint32_t J = experts_;
  for (uint32_t i = first; i <= last; ++i) {
    // Paper 5.1, step 3, layer proximity: (1 - (i - l)/L).
    const double proximity = 1.0 - static_cast<double>(int64_t{i} - current) / layers_;
    if (proximity <= 0) continue;
    const double* pred = pred_.data() + size_t{i} * J;
    for (uint32_t j = 0; j < J; ++j) {
      if (pred[j] <= 0 || !control_->Owns(i, j)) continue;
      control_->Prefetch(i, j, pred[j] * proximity);
    }
  }
}

void MoeInfinityPolicy::OnRequestEnd(uint64_t request_id) {
  auto node = requests_.extract(request_id);
  if (node.empty()) return;
  Request& r = node.mapped();
  const std::vector<uint32_t>& counted = r.eams[r.phase];
  for (size_t cell = 0; cell < counted.size(); ++cell) batch_counts_[cell] -= counted[cell];
  std::replace(batch_.begin(), batch_.end(), &r, static_cast<Request*>(nullptr));

  // Paper 4.2: the finished request's EAMs enter the collection of their phase. The other
  // requests' dot products with the entry written are brought up to date: the iteration EAM's
  // (matched against this phase's collection) and the decode EAM's of completed iterations.
  for (Phase phase : {kPrefill, kDecode}) {
    EamCollection& collection = *collections_[phase];
    const std::optional<uint32_t> index = collection.Insert(r.eams[phase]);
    if (!index) continue;
    for (auto& [id, other] : requests_) {
      const double iteration_dot =
          other.phase == phase ? collection.Dot(*index, other.iteration) : 0.0;
      if (other.phase == phase) {
        other.dots.resize(collection.size(), 0.0);
        other.dots[*index] = iteration_dot;
      }
      if (phase == kDecode) {
        other.decode_dots.resize(collection.size(), 0.0);
        other.decode_dots[*index] = collection.Dot(*index, other.eams[kDecode]) - iteration_dot;
      }
    }
  }
}

double MoeInfinityPolicy::EvictionScore(uint32_t layer, uint32_t expert) const {
  // Paper 5.2: cache priority from the request-level EAM counts, summed over the requests in
  // flight, with initial layers favoured ("subsequent layers ... are more likely to benefit from
  // prefetching and thus less need caching"): weight 1 + (L - l)/L, from 2 at layer 0 down to
  // 1 + 1/L at the last, so counts stay the primary key and the layer breaks near-ties. Experts
  // no request in flight has used score 0 and go first.
  if (layer >= layers_ || expert >= experts_) return 0;
  const int64_t count = batch_counts_[size_t{layer} * experts_ + expert];
  if (count <= 0) return 0;
  const double weight = 1.0 + static_cast<double>(layers_ - layer) / layers_;
  return weight * static_cast<double>(count);
}

std::span<const uint32_t> MoeInfinityPolicy::IterationEam(uint64_t request_id) const {
  const auto it = requests_.find(request_id);
  if (it == requests_.end()) return {};
  return it->second.iteration;
}

std::span<const uint32_t> MoeInfinityPolicy::RequestEam(uint64_t request_id, Phase phase) const {
  const auto it = requests_.find(request_id);
  if (it == requests_.end()) return {};
  return it->second.eams[phase];
}

std::unique_ptr<CachePolicy> NewMoeInfinityPolicy(const PolicyOptions& options) {
  return std::make_unique<MoeInfinityPolicy>(options);
}

}  // namespace fmoe
