// The matcher's directives from semantic and trajectory search, its validation of contexts, and
// the completed maps it hands to the store.
#include "map_service/map_matcher.h"

#include <gtest/gtest.h>

#include <random>

namespace fmoe {
namespace {

constexpr uint32_t kL = 5, kJ = 8, kK = 2, kH = 12;

struct World {
  World() : store(*MapStore::Create({kL, kJ, kK, kH, 100, 2})) {
    std::mt19937 rng(7);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (uint64_t id = 0; id < 10; ++id) {
      std::vector<float> sem(kH), map(kL * kJ, 0.0f);
      for (float& x : sem) x = n(rng);
      for (uint32_t l = 0; l < kL; ++l) {  // Peaked rows: 0.6, 0.3, 0.1 on three experts.
        map[l * kJ + (id + l) % kJ] = 0.6f;
        map[l * kJ + (id + l + 3) % kJ] = 0.3f;
        map[l * kJ + (id + l + 5) % kJ] = 0.1f;
      }
      sems.push_back(sem);
      maps.push_back(map);
      EXPECT_TRUE(store.Insert(id, sem, map).ok());
    }
  }
  std::vector<float> Row(size_t entry, uint32_t l) const {
    return {maps[entry].begin() + l * kJ, maps[entry].begin() + (l + 1) * kJ};
  }
  MapStore store;
  std::vector<std::vector<float>> sems, maps;
};

constexpr MatcherOptions kD2{.prefetch_distance = 2};

TEST(MapMatcher, SemanticSearchDirectsTheFirstLayers) {
  World w;
  MapMatcher m(w.store, kD2);
  std::vector<PrefetchDirective> out;
  m.OnIterationStart({42, 0, w.sems[4]}, &out);
  ASSERT_EQ(out.size(), 2u);  // d = 2: layers 0 and 1.
  for (uint32_t t = 0; t < 2; ++t) {
    EXPECT_EQ(out[t].request_id, 42u);
    EXPECT_EQ(out[t].target_layer, t);
    EXPECT_NEAR(out[t].score, 1.0f, 1e-6);
    ASSERT_EQ(out[t].entries.size(), kK);  // Perfect match: delta 0, exactly top-k.
    EXPECT_EQ(out[t].entries[0].expert, (4 + t) % kJ);
    EXPECT_FLOAT_EQ(out[t].entries[0].probability, 0.6f);
    EXPECT_FLOAT_EQ(out[t].entries[0].priority, 0.6f / (t + 1));
  }
}

TEST(MapMatcher, TrajectorySearchDirectsLayerPlusD) {
  World w;
  MapMatcher m(w.store, kD2);
  std::vector<PrefetchDirective> out;
  m.OnIterationStart({7, 3, std::vector<float>(kH, 0.5f)}, &out);
  out.clear();
  for (uint32_t l = 0; l < kL; ++l) {
    m.OnLayerObserved({7, 3, l, w.Row(6, l)}, &out);
  }
  ASSERT_EQ(out.size(), kL - 2);  // Targets 2, 3, 4.
  for (uint32_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].target_layer, i + 2);
    EXPECT_EQ(out[i].iteration, 3u);
    EXPECT_NEAR(out[i].score, 1.0f, 1e-6);
    EXPECT_EQ(out[i].entries[0].expert, (6 + i + 2) % kJ);
    EXPECT_FLOAT_EQ(out[i].entries[0].priority, 0.6f / 2);
  }
  auto done = m.OnIterationEnd({7, 3, true});
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->map, w.maps[6]);
  EXPECT_EQ(m.in_flight(), 0u);
  EXPECT_EQ(m.counters().completed, 1u);
}

TEST(MapMatcher, LowSimilarityPrefetchesMoreExperts) {
  // One stored entry; the observed layer 0 shares no expert with it: score 0, delta 1.
  MapStore store = *MapStore::Create({kL, kJ, kK, kH, 10, 2});
  std::vector<float> map(kL * kJ, 0.0f);
  for (uint32_t l = 0; l < kL; ++l) {
    map[l * kJ + 0] = 0.6f;
    map[l * kJ + 1] = 0.3f;
    map[l * kJ + 2] = 0.1f;
  }
  ASSERT_TRUE(store.Insert(1, std::vector<float>(kH, 1.0f), map).ok());
  std::vector<float> elsewhere(kJ, 0.0f);
  elsewhere[6] = elsewhere[7] = 0.5f;
  std::vector<PrefetchDirective> a, b;
  MapMatcher with_delta(store, kD2);
  MapMatcher without_delta(store, {.prefetch_distance = 2, .semantic = true, .delta = false});
  with_delta.OnIterationStart({1, 0, std::vector<float>(kH, 1.0f)}, &a);
  without_delta.OnIterationStart({1, 0, std::vector<float>(kH, 1.0f)}, &b);
  a.clear();
  b.clear();
  with_delta.OnLayerObserved({1, 0, 0, elsewhere}, &a);
  without_delta.OnLayerObserved({1, 0, 0, elsewhere}, &b);
  ASSERT_EQ(a.size(), 1u);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_NEAR(a[0].score, 0.0f, 1e-6);
  EXPECT_EQ(a[0].entries.size(), 3u);  // Every expert with mass.
  EXPECT_EQ(b[0].entries.size(), kK);  // Without delta: the top-k only.
  // A close match keeps to the top-k.
  a.clear();
  with_delta.OnIterationStart({1, 1, std::vector<float>(kH, 1.0f)}, &a);
  a.clear();
  with_delta.OnLayerObserved({1, 1, 0, {map.begin(), map.begin() + kJ}}, &a);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(a[0].entries.size(), kK);
}

TEST(MapMatcher, WithoutSemanticSearchTheFirstLayersGetNothing) {
  World w;
  MapMatcher m(w.store, {.prefetch_distance = 2, .semantic = false, .delta = true});
  std::vector<PrefetchDirective> out;
  m.OnIterationStart({1, 0, w.sems[0]}, &out);
  EXPECT_TRUE(out.empty());
  m.OnLayerObserved({1, 0, 0, w.Row(0, 0)}, &out);
  EXPECT_EQ(out.size(), 1u);
}

TEST(MapMatcher, InvalidContextsAreCountedAndIgnored) {
  World w;
  MapMatcher m(w.store, kD2);
  std::vector<PrefetchDirective> out;
  m.OnIterationStart({1, 0, std::vector<float>(kH + 1)}, &out);  // Wrong h.
  std::vector<float> nan_sem(kH, 1.0f);
  nan_sem[3] = std::nanf("");
  m.OnIterationStart({1, 0, nan_sem}, &out);
  m.OnLayerObserved({99, 0, 0, w.Row(0, 0)}, &out);  // Unknown request.
  EXPECT_EQ(m.counters().invalid, 3u);
  m.OnIterationStart({1, 0, w.sems[1]}, &out);
  out.clear();
  m.OnLayerObserved({1, 0, 1, w.Row(0, 1)}, &out);            // Layer 0 not seen yet.
  m.OnLayerObserved({1, 1, 0, w.Row(0, 0)}, &out);            // Another iteration.
  m.OnLayerObserved({1, 0, 0, std::vector<float>(3)}, &out);  // Wrong J.
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(m.counters().invalid, 6u);
  // An iteration that ends early gives no map; the request stays until it finishes.
  m.OnLayerObserved({1, 0, 0, w.Row(0, 0)}, &out);
  EXPECT_FALSE(m.OnIterationEnd({1, 0, false}).has_value());
  EXPECT_EQ(m.counters().incomplete, 1u);
  EXPECT_EQ(m.in_flight(), 1u);
  m.Forget(1);
  EXPECT_EQ(m.in_flight(), 0u);
}

TEST(MapMatcher, RefusesRequestsBeyondItsLimit) {
  World w;
  MapMatcher m(w.store,
               {.prefetch_distance = 2, .semantic = true, .delta = true, .max_requests = 2});
  std::vector<PrefetchDirective> out;
  for (uint64_t id = 1; id <= 3; ++id) m.OnIterationStart({id, 0, w.sems[0]}, &out);
  EXPECT_EQ(m.in_flight(), 2u);
  EXPECT_EQ(m.counters().refused, 1u);
}

}  // namespace
}  // namespace fmoe
