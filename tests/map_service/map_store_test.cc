// The map store against a straightforward reference computation on random data: semantic and
// trajectory matching pick the same entries with scores within 1e-5, deduplication replaces the
// entry the RDY formula names, and the similarity-aware selection follows delta and top-k.
#include "map_service/map_store.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace fmoe {
namespace {

constexpr uint32_t kL = 6, kJ = 8, kK = 2, kH = 16;

std::vector<float> RandomSem(std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> v(kH);
  for (float& x : v) x = n(rng);
  return v;
}

// L rows of J probabilities, peaked like real gate distributions.
std::vector<float> RandomMap(std::mt19937& rng) {
  std::gamma_distribution<float> g(0.3f, 1.0f);
  std::vector<float> v(kL * kJ);
  for (uint32_t l = 0; l < kL; ++l) {
    float sum = 0.0f;
    for (uint32_t j = 0; j < kJ; ++j) sum += v[l * kJ + j] = g(rng) + 1e-6f;
    for (uint32_t j = 0; j < kJ; ++j) v[l * kJ + j] /= sum;
  }
  return v;
}

double RefCos(const float* a, const float* b, size_t n) {
  double d = 0, na = 0, nb = 0;
  for (size_t i = 0; i < n; ++i) {
    d += double(a[i]) * b[i];
    na += double(a[i]) * a[i];
    nb += double(b[i]) * b[i];
  }
  return na > 0 && nb > 0 ? d / std::sqrt(na * nb) : 0.0;
}

MapStore NewStore(uint32_t capacity) {
  MapStoreOptions o;
  o.num_layers = kL;
  o.num_experts = kJ;
  o.top_k = kK;
  o.hidden = kH;
  o.capacity = capacity;
  o.prefetch_distance = 2;
  auto s = MapStore::Create(o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return std::move(*s);
}

TEST(MapStore, SemanticMatchEqualsTheReference) {
  std::mt19937 rng(1);
  MapStore store = NewStore(64);
  EXPECT_EQ(store.SemanticMatch(RandomSem(rng)).index, -1);  // Empty.
  for (uint64_t id = 0; id < 50; ++id)
    ASSERT_TRUE(store.Insert(id, RandomSem(rng), RandomMap(rng)).ok());
  for (int q = 0; q < 100; ++q) {
    const std::vector<float> sem = RandomSem(rng);
    int best = -1;
    double best_score = -2;
    for (uint32_t i = 0; i < store.size(); ++i) {
      const double c = RefCos(sem.data(), store.sem(i).data(), kH);
      if (c > best_score) best_score = c, best = static_cast<int>(i);
    }
    const MapMatch m = store.SemanticMatch(sem);
    EXPECT_EQ(m.index, best);
    EXPECT_NEAR(m.score, best_score, 1e-5);
  }
}

// Beyond 64 rows the search screens with bfloat16 copies first; it must still be exact. Near
// ties far below bfloat16's resolution of about 2e-3 (rows that differ from the query by 1e-2
// noise have cosines within 1e-5 of each other), a scale of 1e4, a zero row and an embedding
// size that is not a multiple of the vector width.
TEST(MapStore, ScreenedSemanticMatchIsExact) {
  for (uint32_t h : {16u, 1027u}) {
    std::mt19937 rng(h);
    std::normal_distribution<float> n(0.0f, 1.0f);
    MapStoreOptions o;
    o.num_layers = kL;
    o.num_experts = kJ;
    o.top_k = kK;
    o.hidden = h;
    o.capacity = 400;
    auto created = MapStore::Create(o);
    ASSERT_TRUE(created.ok());
    MapStore& store = *created;
    std::vector<float> base(h);
    for (float& x : base) x = n(rng);
    for (uint32_t i = 0; i < 400; ++i) {
      std::vector<float> v(h);
      const float eps = i % 3 == 0 ? 3e-3f : (i % 3 == 1 ? 1e-2f : 1.0f);
      const float scale = i % 7 == 0 ? 1e4f : 1.0f;
      for (uint32_t k = 0; k < h; ++k) v[k] = scale * (base[k] + eps * n(rng));
      if (i == 5) std::fill(v.begin(), v.end(), 0.0f);
      ASSERT_TRUE(store.Put(i, i, v, RandomMap(rng)).ok());
    }
    int checked = 0;
    for (int q = 0; q < 200; ++q) {
      std::vector<float> sem(h);
      const float eps = q % 2 == 0 ? 1e-3f : 0.5f;
      for (uint32_t k = 0; k < h; ++k) sem[k] = base[k] + eps * n(rng);
      double best = -2, second = -2;
      int best_index = -1;
      for (uint32_t i = 0; i < store.size(); ++i) {
        const double c = RefCos(sem.data(), store.sem(i).data(), h);
        if (c > best) {
          second = best;
          best = c;
          best_index = static_cast<int>(i);
        } else if (c > second) {
          second = c;
        }
      }
      const MapMatch m = store.SemanticMatch(sem);
      EXPECT_NEAR(m.score, best, 1e-5) << "h=" << h << " query " << q;
      // The store's float-lane dots and this double reference may order rows closer than about
      // 1e-7 differently; every wider gap must be decided alike.
      if (best - second > 1e-6) {
        EXPECT_EQ(m.index, best_index) << "h=" << h << " query " << q << " gap " << best - second;
        ++checked;
      }
    }
    EXPECT_GT(checked, 80);
  }
}

TEST(MapStore, IncrementalTrajectoryEqualsTheReference) {
  std::mt19937 rng(2);
  MapStore store = NewStore(40);
  for (uint64_t id = 0; id < 40; ++id)
    ASSERT_TRUE(store.Insert(id, RandomSem(rng), RandomMap(rng)).ok());
  for (int q = 0; q < 30; ++q) {
    // Observed maps near a stored one, so matches are meaningful.
    std::vector<float> observed = RandomMap(rng);
    if (q % 2 == 0) {
      const auto base = store.map(static_cast<uint32_t>(rng() % store.size()));
      for (size_t i = 0; i < observed.size(); ++i)
        observed[i] = 0.8f * base[i] + 0.2f * observed[i];
    }
    Trajectory t;
    store.BeginTrajectory(&t);
    for (uint32_t l = 0; l < kL; ++l) {
      if (q % 5 == 4 && l == 3) {  // The store changes mid-trajectory.
        ASSERT_TRUE(store.Insert(1000 + q, RandomSem(rng), RandomMap(rng)).ok());
      }
      const MapMatch m = store.ObserveLayer(&t, {observed.data() + l * kJ, kJ});
      int best = -1;
      double best_score = -2;
      for (uint32_t i = 0; i < store.size(); ++i) {
        const double c = RefCos(observed.data(), store.map(i).data(), (l + 1) * kJ);
        if (c > best_score) best_score = c, best = static_cast<int>(i);
      }
      ASSERT_EQ(m.index, best) << "query " << q << " layer " << l;
      ASSERT_NEAR(m.score, best_score, 1e-5);
    }
    // Past the last layer nothing more is matched.
    EXPECT_EQ(store.ObserveLayer(&t, {observed.data(), kJ}).index, -1);
  }
}

TEST(MapStore, FullStoreReplacesTheMostRedundantEntry) {
  std::mt19937 rng(3);
  MapStore store = NewStore(20);
  for (uint64_t id = 0; id < 20; ++id) {
    auto r = store.Insert(id, RandomSem(rng), RandomMap(rng));
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(r->replaced);
    EXPECT_EQ(r->index, id);
  }
  for (uint64_t id = 20; id < 120; ++id) {
    const std::vector<float> sem = RandomSem(rng);
    const std::vector<float> map = RandomMap(rng);
    // Reference: RDY = (d/L) cos_sem + ((L-d)/L) cos_map, argmax, lowest row on ties.
    int best = -1;
    double best_rdy = -10;
    std::vector<uint64_t> ids_before;
    for (uint32_t i = 0; i < store.size(); ++i) {
      ids_before.push_back(store.id(i));
      const double rdy = (2.0 / kL) * RefCos(sem.data(), store.sem(i).data(), kH) +
                         ((kL - 2.0) / kL) * RefCos(map.data(), store.map(i).data(), kL * kJ);
      if (rdy > best_rdy) best_rdy = rdy, best = static_cast<int>(i);
    }
    auto r = store.Insert(id, sem, map);
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(r->replaced);
    ASSERT_EQ(static_cast<int>(r->index), best);
    EXPECT_EQ(r->replaced_id, ids_before[best]);
    EXPECT_NEAR(r->redundancy, best_rdy, 1e-5);
    EXPECT_EQ(store.size(), 20u);
    EXPECT_EQ(store.id(r->index), id);
    EXPECT_EQ(std::vector<float>(store.map(r->index).begin(), store.map(r->index).end()), map);
  }
}

TEST(MapStore, RejectsWrongShapesAndNonFiniteValues) {
  std::mt19937 rng(4);
  MapStore store = NewStore(4);
  std::vector<float> sem = RandomSem(rng), map = RandomMap(rng);
  auto bad = store.Insert(1, std::vector<float>(kH + 1), map);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("expected h = 16"), std::string::npos);
  bad = store.Insert(1, sem, std::vector<float>(kL * kJ - 1));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("expected L * J = 48"), std::string::npos);
  map[5] = std::nanf("");
  EXPECT_FALSE(store.Insert(1, sem, map).ok());
  EXPECT_EQ(store.size(), 0u);
  map[5] = 0.1f;
  EXPECT_FALSE(store.Put(1, 7, sem, map).ok());  // Rows fill in order.
  EXPECT_TRUE(store.Put(0, 7, sem, map).ok());
  EXPECT_EQ(store.size(), 1u);
  EXPECT_FALSE(MapStore::Create({kL, kJ, kJ + 1, kH, 10, 3}).ok());
  EXPECT_FALSE(MapStore::Create({kL, kJ, kK, kH, 0, 3}).ok());
}

TEST(SelectExperts, DeltaFromTheScoreAndNeverFewerThanTopK) {
  const std::vector<float> p = {0.05f, 0.4f, 0.05f, 0.3f, 0.1f, 0.05f, 0.05f, 0.0f};
  // Perfect similarity: exactly the top-k.
  auto sel = SelectExperts(p, 1.0f, 2, 5, 2);
  ASSERT_EQ(sel.size(), 2u);
  EXPECT_EQ(sel[0].expert, 1u);
  EXPECT_EQ(sel[1].expert, 3u);
  EXPECT_FLOAT_EQ(sel[0].priority, 0.4f / 3);
  // Score 0.2: delta 0.8, so 0.4 + 0.3 + 0.1 (then ties by index).
  sel = SelectExperts(p, 0.2f, 2, 5, 2);
  ASSERT_EQ(sel.size(), 3u);
  EXPECT_EQ(sel[2].expert, 4u);
  // Score 0 (or negative): delta 1, every expert with mass, in order, ties by lower index.
  sel = SelectExperts(p, -0.5f, 2, 0, -1);
  ASSERT_EQ(sel.size(), 7u);
  EXPECT_EQ(sel[2].expert, 4u);
  EXPECT_EQ(sel[3].expert, 0u);
  EXPECT_FLOAT_EQ(sel[0].priority, 0.4f);  // Target 0 from iteration start: distance 1.
}

}  // namespace
}  // namespace fmoe
