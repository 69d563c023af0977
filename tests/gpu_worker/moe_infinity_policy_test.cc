#include "gpu_worker/cache/policies/moe_infinity_policy.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

using Eam = std::vector<uint32_t>;

// Records what the policy asks of the cache; `queue` mimics the cache's prefetch queue.
class FakeControl final : public CacheControl {
 public:
  struct Call {
    uint32_t layer;
    uint32_t expert;
    double priority;  // < 0: a ClearPrefetches.
    bool operator==(const Call&) const = default;
  };

  FakeControl(uint32_t layers, uint32_t experts, uint32_t world_size = 1, uint32_t rank = 0)
      : layers_(layers), experts_(experts), world_size_(world_size), rank_(rank) {}

  uint32_t num_layers() const override { return layers_; }
  uint32_t num_experts() const override { return experts_; }
  uint32_t top_k() const override { return 2; }
  uint32_t slots() const override { return 4; }
  bool Owns(uint32_t layer, uint32_t expert) const override {
    return (layer * experts_ + expert) % world_size_ == rank_;
  }
  uint32_t current_layer() const override { return 0; }
  void Prefetch(uint32_t layer, uint32_t expert, double priority) override {
    log.push_back({layer, expert, priority});
    queue[{layer, expert}] = priority;
  }
  void ClearPrefetches() override {
    log.push_back({0, 0, -1.0});
    queue.clear();
  }

  std::vector<Call> log;
  std::map<std::pair<uint32_t, uint32_t>, double> queue;

 private:
  uint32_t layers_, experts_, world_size_, rank_;
};

PolicyOptions Options(uint32_t distance = 0, uint32_t capacity = 16) {
  PolicyOptions o;
  o.prefetch_distance = distance;
  o.eam_capacity = capacity;
  return o;
}

// Runs one layer: `counts` is [sequences x J] row-major.
void Layer(MoeInfinityPolicy& p, uint32_t layer, const Eam& counts, uint32_t experts) {
  std::vector<uint32_t> used, tokens;
  for (uint32_t j = 0; j < experts; ++j) {
    uint32_t t = 0;
    for (size_t s = 0; s < counts.size() / experts; ++s) t += counts[s * experts + j];
    if (t == 0) continue;
    used.push_back(j);
    tokens.push_back(t);
  }
  LayerRouting r;
  r.layer = layer;
  r.experts = used;
  r.tokens = tokens;
  r.sequence_counts = counts;
  p.OnLayerStart(r);
  for (uint32_t j : used) p.OnUse(layer, j, false);
  p.OnLayerEnd(layer);
}

// A whole iteration: per_layer[l] is layer l's [sequences x J] counts.
void Iteration(MoeInfinityPolicy& p, const std::vector<SequenceInfo>& seqs,
               const std::vector<Eam>& per_layer, uint32_t experts) {
  p.OnIterationStart(seqs);
  for (uint32_t l = 0; l < per_layer.size(); ++l) Layer(p, l, per_layer[l], experts);
  p.OnIterationEnd();
}

// One request's single-iteration trace where row l is `rows[l]`.
std::vector<Eam> Rows(std::vector<Eam> rows) { return rows; }

double RefCosine(const Eam& a, const Eam& b, size_t cells) {
  double dot = 0, na = 0, nb = 0;
  for (size_t i = 0; i < cells; ++i) {
    dot += double(a[i]) * b[i];
    na += double(a[i]) * a[i];
    nb += double(b[i]) * b[i];
  }
  if (na == 0 || nb == 0) return 0;
  return dot / std::sqrt(na * nb);
}

Eam RandomEam(std::mt19937& rng, uint32_t layers, uint32_t experts, uint32_t active) {
  Eam e(size_t{layers} * experts, 0);
  std::uniform_int_distribution<uint32_t> pick(0, experts - 1), count(1, 9);
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t a = 0; a < active; ++a) e[l * experts + pick(rng)] += count(rng);
  }
  return e;
}

// ---- EamCollection ----

TEST(EamCollection, AppendsBelowCapacityAndSkipsEmpty) {
  EamCollection c(3, 2, 3);
  EXPECT_FALSE(c.Insert(Eam(6, 0)).has_value());
  EXPECT_FALSE(c.Insert(Eam(5, 1)).has_value());  // Wrong size.
  const Eam a{1, 0, 2, 0, 3, 0};
  ASSERT_EQ(c.Insert(a), 0u);
  ASSERT_EQ(c.Insert(Eam{0, 1, 0, 4, 0, 0}), 1u);
  EXPECT_EQ(c.size(), 2u);
  const std::span<const float> e = c.entry(0);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(e[i], static_cast<float>(a[i]));
  EamCollection none(0, 2, 3);
  EXPECT_FALSE(none.Insert(a).has_value());
}

TEST(EamCollection, ReplacesMostSimilarWhenFull) {
  constexpr uint32_t kL = 4, kJ = 8, kCap = 5;
  std::mt19937 rng(1234);
  EamCollection c(kCap, kL, kJ);
  std::vector<Eam> reference;
  for (int n = 0; n < 40; ++n) {
    const Eam e = RandomEam(rng, kL, kJ, 2);
    size_t expected = reference.size();
    if (reference.size() == kCap) {
      // Straightforward reference: smallest cosine distance, lower index on ties.
      double best_distance = 2;
      for (size_t i = 0; i < reference.size(); ++i) {
        const double distance = 1 - RefCosine(reference[i], e, e.size());
        if (distance < best_distance - 1e-12) {
          best_distance = distance;
          expected = i;
        }
      }
      reference[expected] = e;
    } else {
      reference.push_back(e);
    }
    const auto index = c.Insert(e);
    ASSERT_TRUE(index.has_value());
    ASSERT_EQ(*index, expected) << "insert " << n;
  }
  ASSERT_EQ(c.size(), kCap);
  for (uint32_t i = 0; i < kCap; ++i) {
    const std::span<const float> e = c.entry(i);
    for (size_t cell = 0; cell < e.size(); ++cell) {
      ASSERT_EQ(e[cell], static_cast<float>(reference[i][cell]));
    }
  }
}

TEST(EamCollection, ReplacementTieTakesLowerIndex) {
  EamCollection c(3, 1, 4);
  ASSERT_EQ(c.Insert(Eam{1, 0, 0, 0}), 0u);
  ASSERT_EQ(c.Insert(Eam{0, 0, 1, 0}), 1u);
  ASSERT_EQ(c.Insert(Eam{0, 0, 2, 0}), 2u);
  EXPECT_EQ(c.Insert(Eam{0, 0, 5, 0}), 1u);  // Equal to entries 1 and 2: the lower goes.
  EXPECT_EQ(c.Insert(Eam{0, 0, 0, 7}), 0u);  // Orthogonal to all: the lower goes.
}

TEST(EamCollection, MatchPicksMostSimilarOnLayerPrefix) {
  constexpr uint32_t kL = 5, kJ = 6, kCap = 30;
  std::mt19937 rng(99);
  EamCollection c(kCap, kL, kJ);
  std::vector<Eam> stored;
  for (uint32_t n = 0; n < kCap; ++n) {
    stored.push_back(RandomEam(rng, kL, kJ, 3));
    ASSERT_TRUE(c.Insert(stored.back()).has_value());
  }
  std::vector<double> dots;
  std::vector<uint32_t> out;
  for (int q = 0; q < 20; ++q) {
    Eam query = RandomEam(rng, kL, kJ, 1);
    for (uint32_t layers = 1; layers <= kL; ++layers) {
      // Reference: cosine over rows [0, layers) of both.
      const size_t cells = size_t{layers} * kJ;
      std::vector<std::pair<double, uint32_t>> ranked;
      for (uint32_t i = 0; i < kCap; ++i) {
        ranked.push_back({-RefCosine(stored[i], query, cells), i});
      }
      std::sort(ranked.begin(), ranked.end());
      size_t positive = 0;
      while (positive < ranked.size() && -ranked[positive].first > 0) ++positive;
      double query_norm2 = 0;
      for (size_t i = 0; i < cells; ++i) query_norm2 += double(query[i]) * query[i];
      c.Match(query, layers, 3, &dots, &out);
      ASSERT_EQ(out.size(), std::min<size_t>(3, positive));
      for (size_t k = 0; k < out.size(); ++k) {
        EXPECT_NEAR(c.Similarity(out[k], dots[out[k]], query_norm2, layers), -ranked[k].first,
                    1e-9);
      }
      // The best one by index, unless the reference has a near-tie at the top.
      if (positive > 1 && ranked[0].first < ranked[1].first - 1e-9) {
        EXPECT_EQ(out[0], ranked[0].second) << "query " << q << " layers " << layers;
      }
      // Incremental row dots equal the whole-prefix dots.
      std::vector<double> incremental(kCap, 0.0);
      for (uint32_t l = 0; l < layers; ++l) {
        const std::span<const uint32_t> row(query.data() + l * kJ, kJ);
        std::vector<uint32_t> nz;
        for (uint32_t j = 0; j < kJ; ++j) {
          if (row[j] != 0) nz.push_back(j);
        }
        c.AccumulateRowDots(l, row, nz, incremental);
      }
      for (uint32_t i = 0; i < kCap; ++i) EXPECT_NEAR(incremental[i], dots[i], 1e-9);
    }
  }
}

TEST(EamCollection, MatchTiesTakeLowerIndexAndSkipsDisjoint) {
  EamCollection c(4, 2, 3);
  ASSERT_TRUE(c.Insert(Eam{0, 0, 1, 0, 0, 1}).has_value());  // Disjoint from the query.
  ASSERT_TRUE(c.Insert(Eam{2, 0, 0, 1, 0, 0}).has_value());
  ASSERT_TRUE(c.Insert(Eam{4, 0, 0, 0, 3, 0}).has_value());  // Same layer-0 row as 1.
  std::vector<double> dots;
  std::vector<uint32_t> out;
  c.Match(Eam{1, 0, 0, 0, 0, 0}, 1, 4, &dots, &out);
  EXPECT_EQ(out, (std::vector<uint32_t>{1, 2}));
}

// ---- MoeInfinityPolicy ----

TEST(MoeInfinityPolicy, TracesIterationAndRequestEams) {
  constexpr uint32_t kL = 3, kJ = 4;
  FakeControl control(kL, kJ);
  MoeInfinityPolicy p(Options());
  p.Attach(&control);
  // Two sequences (requests 7 and 9), prefill.
  const std::vector<Eam> prefill = {
      {1, 2, 0, 0, /**/ 0, 0, 3, 0},
      {0, 3, 0, 0, /**/ 1, 1, 0, 1},
      {3, 0, 0, 0, /**/ 0, 0, 0, 3},
  };
  Iteration(p, {{7, 0, 3}, {9, 0, 3}}, prefill, kJ);
  EXPECT_EQ(Eam(p.IterationEam(7).begin(), p.IterationEam(7).end()),
            (Eam{1, 2, 0, 0, 0, 3, 0, 0, 3, 0, 0, 0}));
  EXPECT_EQ(Eam(p.IterationEam(9).begin(), p.IterationEam(9).end()),
            (Eam{0, 0, 3, 0, 1, 1, 0, 1, 0, 0, 0, 3}));
  const std::span<const uint32_t> r7 = p.RequestEam(7, MoeInfinityPolicy::kPrefill);
  EXPECT_EQ(Eam(r7.begin(), r7.end()), (Eam{1, 2, 0, 0, 0, 3, 0, 0, 3, 0, 0, 0}));

  // Two decode iterations, sequences in the other order: rows follow OnIterationStart order.
  Iteration(
      p, {{9, 1, 1}, {7, 1, 1}},
      {{0, 1, 0, 0, /**/ 1, 0, 0, 0}, {0, 0, 1, 0, /**/ 0, 1, 0, 0}, {1, 0, 0, 0, 0, 0, 1, 0}}, kJ);
  Iteration(
      p, {{9, 2, 1}, {7, 2, 1}},
      {{0, 1, 0, 0, /**/ 0, 0, 0, 1}, {0, 0, 1, 0, /**/ 0, 1, 0, 0}, {0, 0, 0, 1, 0, 0, 1, 0}}, kJ);
  EXPECT_EQ(Eam(p.IterationEam(7).begin(), p.IterationEam(7).end()),
            (Eam{0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 1, 0}));
  const std::span<const uint32_t> d7 = p.RequestEam(7, MoeInfinityPolicy::kDecode);
  EXPECT_EQ(Eam(d7.begin(), d7.end()), (Eam{1, 0, 0, 1, 0, 2, 0, 0, 0, 0, 2, 0}));
  const std::span<const uint32_t> d9 = p.RequestEam(9, MoeInfinityPolicy::kDecode);
  EXPECT_EQ(Eam(d9.begin(), d9.end()), (Eam{0, 2, 0, 0, 0, 0, 2, 0, 1, 0, 0, 1}));
  // The prefill EAM is kept apart (paper 4.1: traced separately).
  const std::span<const uint32_t> p9 = p.RequestEam(9, MoeInfinityPolicy::kPrefill);
  EXPECT_EQ(Eam(p9.begin(), p9.end()), (Eam{0, 0, 3, 0, 1, 1, 0, 1, 0, 0, 0, 3}));
}

TEST(MoeInfinityPolicy, FreesStateAndStoresEamsOnRequestEnd) {
  constexpr uint32_t kL = 2, kJ = 3;
  FakeControl control(kL, kJ);
  MoeInfinityPolicy p(Options());
  p.Attach(&control);
  Iteration(p, {{1, 0, 2}, {2, 0, 2}}, {{2, 0, 0, 0, 2, 0}, {0, 0, 2, 1, 1, 0}}, kJ);
  Iteration(p, {{1, 1, 1}}, {{1, 0, 0}, {0, 0, 1}}, kJ);
  EXPECT_EQ(p.requests_tracked(), 2u);
  p.OnRequestEnd(1);
  EXPECT_EQ(p.requests_tracked(), 1u);
  EXPECT_TRUE(p.IterationEam(1).empty());
  EXPECT_TRUE(p.RequestEam(1, MoeInfinityPolicy::kDecode).empty());
  ASSERT_EQ(p.collection(MoeInfinityPolicy::kPrefill).size(), 1u);
  ASSERT_EQ(p.collection(MoeInfinityPolicy::kDecode).size(), 1u);
  const std::span<const float> d = p.collection(MoeInfinityPolicy::kDecode).entry(0);
  EXPECT_EQ(std::vector<float>(d.begin(), d.end()), (std::vector<float>{1, 0, 0, 0, 0, 1}));
  p.OnRequestEnd(1);  // Unknown: ignored.
  // Ending a request in the middle of an iteration: its row is skipped afterwards.
  p.OnIterationStart(std::vector<SequenceInfo>{{2, 1, 1}, {3, 0, 1}});
  Layer(p, 0, {0, 1, 0, /**/ 1, 0, 0}, kJ);
  p.OnRequestEnd(2);
  Layer(p, 1, {0, 1, 0, /**/ 0, 0, 1}, kJ);
  p.OnIterationEnd();
  p.OnRequestEnd(3);
  EXPECT_EQ(p.requests_tracked(), 0u);
  for (uint32_t l = 0; l < kL; ++l) {
    for (uint32_t j = 0; j < kJ; ++j) EXPECT_EQ(p.EvictionScore(l, j), 0.0);
  }
  EXPECT_EQ(p.collection(MoeInfinityPolicy::kPrefill).size(), 3u);
  EXPECT_EQ(p.collection(MoeInfinityPolicy::kDecode).size(), 2u);
}

// Ends one single-iteration (prefill) request whose EAM rows are `rows`.
void Remember(MoeInfinityPolicy& p, uint64_t id, const std::vector<Eam>& rows, uint32_t experts) {
  Iteration(p, {{id, 0, 1}}, rows, experts);
  p.OnRequestEnd(id);
}

TEST(MoeInfinityPolicy, PrefetchFollowsMostSimilarStoredEam) {
  constexpr uint32_t kL = 3, kJ = 4;
  FakeControl control(kL, kJ);
  MoeInfinityPolicy p(Options(), /*matches=*/1);
  p.Attach(&control);
  Remember(p, 100, Rows({{4, 0, 0, 0}, {0, 4, 0, 0}, {0, 0, 4, 0}}), kJ);  // A.
  Remember(p, 101, Rows({{0, 0, 0, 4}, {0, 0, 4, 0}, {4, 0, 0, 0}}), kJ);  // B.
  Remember(p, 102, Rows({{1, 0, 0, 3}, {0, 0, 0, 4}, {0, 4, 0, 0}}), kJ);  // C, near B.

  control.queue.clear();  // Leftovers of the runs above (the cache drops them as stale).
  const size_t calls = control.log.size();
  p.OnIterationStart(std::vector<SequenceInfo>{{1, 0, 1}});
  EXPECT_EQ(control.log.size(), calls);  // Prefill: nothing to match yet.
  Layer(p, 0, {1, 0, 0, 0}, kJ);         // Like A.
  EXPECT_EQ(control.queue.size(), 2u);
  EXPECT_TRUE(control.queue.count({1, 1}));
  EXPECT_TRUE(control.queue.count({2, 2}));
  p.OnIterationEnd();

  p.OnIterationStart(std::vector<SequenceInfo>{{2, 0, 1}});
  Layer(p, 0, {0, 0, 0, 1}, kJ);  // B (cos 1) over C (cos 0.95).
  EXPECT_EQ(control.queue.size(), 2u);
  EXPECT_TRUE(control.queue.count({1, 2}));
  EXPECT_TRUE(control.queue.count({2, 0}));
  // Layer 1 moves the match to C; only the remaining layer is prefetched.
  Layer(p, 1, {0, 0, 0, 1}, kJ);
  ASSERT_EQ(control.queue.size(), 1u);
  EXPECT_TRUE(control.queue.count({2, 1}));
  Layer(p, 2, {0, 1, 0, 0}, kJ);  // Last layer: nothing left to prefetch.
  ASSERT_EQ(control.queue.size(), 1u);
  for (const FakeControl::Call& call : control.log) {
    if (call.priority >= 0) {
      EXPECT_GT(call.layer, 0u);
    }
  }
}

TEST(MoeInfinityPolicy, AggregatesMatchesBySummingCellsAndNormalisingRows) {
  constexpr uint32_t kL = 2, kJ = 3;
  FakeControl control(kL, kJ);
  MoeInfinityPolicy p(Options(), /*matches=*/2);
  p.Attach(&control);
  Remember(p, 100, Rows({{2, 0, 0}, {3, 0, 0}}), kJ);
  Remember(p, 101, Rows({{2, 0, 0}, {0, 1, 0}}), kJ);
  Remember(p, 102, Rows({{0, 0, 5}, {0, 0, 5}}), kJ);  // Disjoint: not matched.
  p.OnIterationStart(std::vector<SequenceInfo>{{1, 0, 1}});
  Layer(p, 0, {1, 0, 0}, kJ);
  const double proximity = 1.0 - 1.0 / kL;
  ASSERT_EQ(control.queue.size(), 2u);
  EXPECT_DOUBLE_EQ((control.queue[{1, 0}]), 0.75 * proximity);
  EXPECT_DOUBLE_EQ((control.queue[{1, 1}]), 0.25 * proximity);
}

TEST(MoeInfinityPolicy, PrefetchPriorityFollowsLayerProximity) {
  constexpr uint32_t kL = 4, kJ = 4;
  for (uint32_t distance : {0u, 2u}) {
    FakeControl control(kL, kJ);
    MoeInfinityPolicy p(Options(distance));
    p.Attach(&control);
    // Every layer: experts 1 and 2 equally likely.
    Remember(p, 100, Rows({{0, 2, 2, 0}, {0, 2, 2, 0}, {0, 2, 2, 0}, {0, 2, 2, 0}}), kJ);
    p.OnIterationStart(std::vector<SequenceInfo>{{1, 0, 1}});
    Layer(p, 0, {0, 1, 0, 0}, kJ);
    const uint32_t last = distance == 0 ? kL - 1 : distance;
    ASSERT_EQ(control.queue.size(), 2u * last);
    for (uint32_t i = 1; i <= last; ++i) {
      for (uint32_t j : {1u, 2u}) {
        EXPECT_DOUBLE_EQ((control.queue[{i, j}]), 0.5 * (1.0 - double(i) / kL));
      }
      if (i > 1) {
        EXPECT_LT((control.queue[{i, 1}]), (control.queue[{i - 1, 1}]));
      }
    }
    Layer(p, 1, {0, 0, 1, 0}, kJ);
    for (const auto& [key, priority] : control.queue) {
      EXPECT_GT(key.first, 1u);
      EXPECT_DOUBLE_EQ(priority, 0.5 * (1.0 - double(key.first - 1) / kL));
    }
    EXPECT_EQ(control.queue.size(), 4u);
  }
}

TEST(MoeInfinityPolicy, BatchCombinesRequestsByMax) {
  constexpr uint32_t kL = 2, kJ = 4;
  FakeControl control(kL, kJ);
  MoeInfinityPolicy p(Options(), /*matches=*/1);
  p.Attach(&control);
  Remember(p, 100, Rows({{0, 0, 3, 0}, {1, 1, 0, 0}}), kJ);
  Remember(p, 101, Rows({{0, 0, 0, 3}, {0, 2, 0, 0}}), kJ);
  p.OnIterationStart(std::vector<SequenceInfo>{{1, 0, 1}, {2, 0, 1}});
  Layer(p, 0, {0, 0, 1, 0, /**/ 0, 0, 0, 1}, kJ);
  const double proximity = 1.0 - 1.0 / kL;
  ASSERT_EQ(control.queue.size(), 2u);
  EXPECT_DOUBLE_EQ((control.queue[{1, 0}]), 0.5 * proximity);
  EXPECT_DOUBLE_EQ((control.queue[{1, 1}]), 1.0 * proximity);
}

TEST(MoeInfinityPolicy, DecodeStartMatchesEarlierIterationsPrefillDoesNot) {
  constexpr uint32_t kL = 3, kJ = 4;
  FakeControl control(kL, kJ);
  MoeInfinityPolicy p(Options(/*distance=*/2), /*matches=*/1);
  p.Attach(&control);
  // A finished request with a decode trace.
  Iteration(p, {{100, 0, 1}}, Rows({{2, 0, 0, 0}, {0, 2, 0, 0}, {0, 0, 2, 0}}), kJ);
  Iteration(p, {{100, 1, 1}}, Rows({{0, 1, 0, 0}, {0, 0, 1, 0}, {0, 0, 0, 1}}), kJ);
  p.OnRequestEnd(100);
  control.log.clear();

  p.OnIterationStart(std::vector<SequenceInfo>{{1, 0, 2}});
  EXPECT_TRUE(control.log.empty());  // Prefill start: no trace, no prefetch.
  Layer(p, 0, {0, 2, 0, 0}, kJ);
  Layer(p, 1, {0, 0, 2, 0}, kJ);
  Layer(p, 2, {0, 0, 0, 2}, kJ);
  p.OnIterationEnd();
  control.queue.clear();

  // First decode iteration: the prefill EAM is the partial trace, matched against decode EAMs;
  // layers 0 .. distance-1 are prefetched with proximity to a virtual layer -1.
  p.OnIterationStart(std::vector<SequenceInfo>{{1, 1, 1}});
  ASSERT_EQ(control.queue.size(), 2u);
  EXPECT_DOUBLE_EQ((control.queue[{0, 1}]), 1.0 - 1.0 / kL);
  EXPECT_DOUBLE_EQ((control.queue[{1, 2}]), 1.0 - 2.0 / kL);
}

TEST(MoeInfinityPolicy, CollectionChangeMidIterationUpdatesMatching) {
  constexpr uint32_t kL = 3, kJ = 3;
  FakeControl control(kL, kJ);
  MoeInfinityPolicy p(Options(), /*matches=*/1);
  p.Attach(&control);
  Iteration(p, {{2, 0, 1}}, Rows({{1, 0, 0}, {0, 0, 1}, {0, 1, 0}}), kJ);
  p.OnIterationStart(std::vector<SequenceInfo>{{1, 0, 1}, {2, 1, 1}});
  Layer(p, 0, {1, 0, 0, /**/ 0, 0, 1}, kJ);
  EXPECT_TRUE(control.queue.empty());  // Empty collection.
  p.OnRequestEnd(2);                   // Its prefill EAM is stored mid-iteration.
  // Request 1 matches it through layer 0 only (layer 1 is disjoint): the dot product of the
  // layer already seen must have been brought up to date by the insert.
  Layer(p, 1, {0, 1, 0, /**/ 0, 0, 0}, kJ);
  ASSERT_EQ(control.queue.size(), 1u);
  EXPECT_DOUBLE_EQ((control.queue[{2, 1}]), 1.0 - 1.0 / kL);
}

TEST(MoeInfinityPolicy, EvictionFavoursInFlightUseAndInitialLayers) {
  constexpr uint32_t kL = 4, kJ = 3;
  FakeControl control(kL, kJ);
  MoeInfinityPolicy p(Options());
  p.Attach(&control);
  Iteration(p, {{1, 0, 2}, {2, 0, 2}},
            {{2, 0, 0, /**/ 1, 1, 0},
             {0, 2, 0, /**/ 0, 2, 0},
             {0, 0, 2, /**/ 0, 0, 2},
             {2, 0, 0, /**/ 2, 0, 0}},
            kJ);
  auto weight = [&](uint32_t l) { return 1.0 + double(kL - l) / kL; };
  EXPECT_DOUBLE_EQ(p.EvictionScore(0, 0), 3 * weight(0));
  EXPECT_DOUBLE_EQ(p.EvictionScore(0, 1), 1 * weight(0));
  EXPECT_DOUBLE_EQ(p.EvictionScore(1, 1), 4 * weight(1));
  EXPECT_EQ(p.EvictionScore(0, 2), 0.0);  // Unused: goes first.
  EXPECT_EQ(p.EvictionScore(1, 0), 0.0);
  // Equal counts: the initial layer is kept longer.
  EXPECT_GT(p.EvictionScore(1, 1), p.EvictionScore(3, 0));
  EXPECT_GT(p.EvictionScore(2, 2), p.EvictionScore(3, 0));
  EXPECT_EQ(p.EvictionScore(kL, 0), 0.0);  // Out of range.

  // Decoding: the cache priority follows the decode request EAM (prefill counts drop out).
  Iteration(p, {{1, 1, 1}}, {{0, 0, 1}, {0, 1, 0}, {1, 0, 0}, {1, 0, 0}}, kJ);
  EXPECT_DOUBLE_EQ(p.EvictionScore(0, 0), 1 * weight(0));  // Request 2's prefill only.
  EXPECT_DOUBLE_EQ(p.EvictionScore(0, 2), 1 * weight(0));
  EXPECT_DOUBLE_EQ(p.EvictionScore(3, 0), 3 * weight(3));
  p.OnRequestEnd(2);
  EXPECT_EQ(p.EvictionScore(0, 0), 0.0);
  EXPECT_DOUBLE_EQ(p.EvictionScore(2, 0), 1 * weight(2));
}

TEST(MoeInfinityPolicy, PrefetchesOnlyOwnedExperts) {
  constexpr uint32_t kL = 2, kJ = 4;
  FakeControl control(kL, kJ, /*world_size=*/2, /*rank=*/1);
  MoeInfinityPolicy p(Options());
  p.Attach(&control);
  Remember(p, 100, Rows({{1, 1, 1, 1}, {1, 1, 1, 1}}), kJ);
  p.OnIterationStart(std::vector<SequenceInfo>{{1, 0, 1}});
  Layer(p, 0, {1, 0, 0, 0}, kJ);
  ASSERT_EQ(control.queue.size(), 2u);
  for (const auto& [key, priority] : control.queue) {
    EXPECT_TRUE(control.Owns(key.first, key.second));
  }
}

// From-scratch reference of the prefetches after layer `current` (-1: iteration start) for the
// batch `seqs`: each request's trace matched by EamCollection::Match, the matches' cells summed
// and rows normalised, max over the batch, times the layer proximity.
std::map<std::pair<uint32_t, uint32_t>, double> ExpectedPrefetches(
    const MoeInfinityPolicy& p, const std::vector<SequenceInfo>& seqs, int64_t current,
    uint32_t last, uint32_t layers, uint32_t experts, uint32_t matches) {
  std::vector<double> pred(size_t{layers} * experts, 0.0);
  for (const SequenceInfo& seq : seqs) {
    if (p.IterationEam(seq.request_id).empty()) continue;  // Ended.
    const auto phase =
        seq.iteration == 0 ? MoeInfinityPolicy::kPrefill : MoeInfinityPolicy::kDecode;
    Eam query;
    uint32_t prefix = layers;
    if (current < 0) {
      if (phase != MoeInfinityPolicy::kDecode) continue;
      const std::span<const uint32_t> decode = p.RequestEam(seq.request_id, phase);
      const bool empty =
          std::all_of(decode.begin(), decode.end(), [](uint32_t v) { return v == 0; });
      const std::span<const uint32_t> q =
          empty ? p.RequestEam(seq.request_id, MoeInfinityPolicy::kPrefill) : decode;
      query.assign(q.begin(), q.end());
    } else {
      const std::span<const uint32_t> q = p.IterationEam(seq.request_id);
      query.assign(q.begin(), q.end());
      prefix = static_cast<uint32_t>(current + 1);
    }
    std::vector<double> dots;
    std::vector<uint32_t> out;
    p.collection(phase).Match(query, prefix, matches, &dots, &out);
    for (uint32_t i = static_cast<uint32_t>(current + 1); i <= last; ++i) {
      std::vector<double> row(experts, 0.0);
      double total = 0;
      for (uint32_t m : out) {
        for (uint32_t j = 0; j < experts; ++j) {
          row[j] += p.collection(phase).entry(m)[size_t{i} * experts + j];
        }
      }
      for (double v : row) total += v;
      if (total <= 0) continue;
      for (uint32_t j = 0; j < experts; ++j) {
        pred[size_t{i} * experts + j] = std::max(pred[size_t{i} * experts + j], row[j] / total);
      }
    }
  }
  std::map<std::pair<uint32_t, uint32_t>, double> expected;
  for (uint32_t i = static_cast<uint32_t>(current + 1); i <= last; ++i) {
    const double proximity = 1.0 - double(int64_t{i} - current) / layers;
    for (uint32_t j = 0; j < experts; ++j) {
      if (pred[size_t{i} * experts + j] > 0 && proximity > 0) {
        expected[{i, j}] = pred[size_t{i} * experts + j] * proximity;
      }
    }
  }
  return expected;
}

// The policy's incremental matching (dot products grown layer by layer and iteration by
// iteration, patched when the collection changes) equals matching from scratch, on a random
// workload with continuous batching, phase changes, requests ending mid-iteration and a full
// collection being replaced into.
TEST(MoeInfinityPolicy, IncrementalMatchingEqualsFromScratch) {
  constexpr uint32_t kL = 5, kJ = 6, kDistance = 2, kMatches = 2;
  FakeControl control(kL, kJ);
  MoeInfinityPolicy p(Options(kDistance, /*capacity=*/6), kMatches);
  p.Attach(&control);
  std::mt19937 rng(2024);
  std::uniform_int_distribution<uint32_t> expert(0, kJ - 1), coin(0, 9);
  std::map<uint64_t, uint32_t> live;  // id -> iterations done.
  uint64_t next_id = 1;
  int checked = 0;
  for (int it = 0; it < 150; ++it) {
    while (live.size() < 3) live[next_id++] = 0;
    std::vector<SequenceInfo> seqs;
    for (const auto& [id, done] : live) seqs.push_back({id, done, done == 0 ? 3u : 1u});
    control.queue.clear();
    p.OnIterationStart(seqs);
    if (std::any_of(seqs.begin(), seqs.end(), [](const SequenceInfo& s) { return s.iteration; })) {
      ASSERT_EQ(control.queue, ExpectedPrefetches(p, seqs, -1, kDistance - 1, kL, kJ, kMatches))
          << "iteration " << it << " start";
      ++checked;
    }
    for (uint32_t l = 0; l < kL; ++l) {
      Eam counts(seqs.size() * kJ, 0);
      for (size_t s = 0; s < seqs.size(); ++s) {
        for (uint32_t t = 0; t < seqs[s].tokens * 2; ++t) {
          counts[s * kJ + (coin(rng) < 6 ? (seqs[s].request_id + l) % kJ : expert(rng))] += 1;
        }
      }
      control.queue.clear();
      Layer(p, l, counts, kJ);
      if (l + 1 < kL) {
        ASSERT_EQ(control.queue,
                  ExpectedPrefetches(p, seqs, l, std::min(kL - 1, l + kDistance), kL, kJ, kMatches))
            << "iteration " << it << " layer " << l;
        ++checked;
      }
      if (l == 2 && coin(rng) == 0) p.OnRequestEnd(seqs[0].request_id);  // Mid-iteration.
    }
    p.OnIterationEnd();
    for (auto& [id, done] : live) ++done;
    for (auto i = live.begin(); i != live.end();) {
      if (p.IterationEam(i->first).empty() || coin(rng) < 2) {
        p.OnRequestEnd(i->first);
        i = live.erase(i);
      } else {
        ++i;
      }
    }
  }
  EXPECT_GT(checked, 400);
  EXPECT_EQ(p.collection(MoeInfinityPolicy::kDecode).size(), 6u);
}

TEST(MoeInfinityPolicy, DeterministicAcrossRuns) {
  constexpr uint32_t kL = 6, kJ = 8;
  auto run = [&](FakeControl* control, std::vector<double>* scores) {
    MoeInfinityPolicy p(Options(3, 4));
    p.Attach(control);
    std::mt19937 rng(7);
    std::uniform_int_distribution<uint32_t> expert(0, kJ - 1);
    std::vector<uint64_t> live;
    uint64_t next_id = 1;
    for (int it = 0; it < 60; ++it) {
      while (live.size() < 3) live.push_back(next_id++);
      std::vector<SequenceInfo> seqs;
      for (uint64_t id : live) seqs.push_back({id, static_cast<uint32_t>(it % 5), 1});
      p.OnIterationStart(seqs);
      for (uint32_t l = 0; l < kL; ++l) {
        Eam counts(seqs.size() * kJ, 0);
        for (size_t s = 0; s < seqs.size(); ++s) {
          counts[s * kJ + expert(rng)] += 1;
          counts[s * kJ + (seqs[s].request_id + l) % kJ] += 1;
        }
        Layer(p, l, counts, kJ);
      }
      p.OnIterationEnd();
      for (uint32_t l = 0; l < kL; ++l) {
        for (uint32_t j = 0; j < kJ; ++j) scores->push_back(p.EvictionScore(l, j));
      }
      if (it % 5 == 4) {
        p.OnRequestEnd(live.front());
        live.erase(live.begin());
      }
    }
  };
  FakeControl a(kL, kJ), b(kL, kJ);
  std::vector<double> scores_a, scores_b;
  run(&a, &scores_a);
  run(&b, &scores_b);
  EXPECT_FALSE(a.log.empty());
  EXPECT_EQ(a.log, b.log);
  EXPECT_EQ(scores_a, scores_b);
}

}  // namespace
}  // namespace fmoe
