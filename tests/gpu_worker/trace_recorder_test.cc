// TraceRecorder driven by synthetic ForwardObserver calls, in the order the model and the engine
// make them: the records ReadTrace gets back (routing, explicit maps, sem, each request's own
// speculation, `last`), the one-iteration lag, requests that end by cancel, by a failed Forward
// or by the worker stopping, invalid iterations, the file's fate at open; and ObserverFanOut.
#include "gpu_worker/observe/trace_recorder.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

namespace fs = std::filesystem;

constexpr uint32_t kL = 3, kJ = 4, kK = 2, kH = 2;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = ::testing::TempDir() + "/trace_recorder_test.XXXXXX";
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

TraceHeader Header() {
  TraceHeader h;
  h.model = "m";
  h.source = "fmoe-worker g rank 0";
  h.iteration_unit = "engine iteration";
  h.semantic = "test";
  h.num_layers = kL;
  h.num_experts = kJ;
  h.top_k = kK;
  h.hidden = kH;
  return h;
}

std::unique_ptr<TraceRecorder> OpenRecorder(const std::string& path, uint32_t distance = 2) {
  TraceRecorderOptions o;
  o.path = path;
  o.header = Header();
  o.speculation_distance = distance;
  auto r = TraceRecorder::Open(o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(*r) : nullptr;
}

// One sequence of a synthetic Forward: its routing per layer is derived from `seed` so each
// request and iteration differs; every token picks experts (seed + l) % J and (seed + l + 1) % J.
struct Seq {
  uint64_t id;
  uint32_t iteration;
  uint32_t tokens;
};

float SemValue(const Seq& s, uint32_t i) { return static_cast<float>(s.id * 10 + s.iteration + i); }

std::vector<float> Gates(const Seq& s, uint32_t l) {
  std::vector<float> p(kJ, 0.1f);
  p[(s.id + s.iteration + l) % kJ] = 0.7f;
  return p;
}

// The experts and counts of sequence s in layer l (ascending).
void Routing(const Seq& s, uint32_t l, std::vector<uint32_t>* experts,
             std::vector<uint32_t>* tokens) {
  const uint32_t a = static_cast<uint32_t>((s.id + s.iteration + l) % kJ);
  const uint32_t b = (a + 1) % kJ;
  std::map<uint32_t, uint32_t> m{{a, s.tokens}, {b, s.tokens}};
  experts->clear();
  tokens->clear();
  for (auto [e, n] : m) {
    experts->push_back(e);
    tokens->push_back(n);
  }
}

// Sequence s's speculation for layer l -> target t: expert (id + t) % J gets 1, expert
// (id + t + l) % J another 0.5 (1.5 where they coincide, which the recorder clamps to 1). It
// depends on the request, so a record holding another request's entries shows.
std::vector<float> Speculation(const Seq& s, uint32_t l, uint32_t t) {
  std::vector<float> share(kJ, 0.0f);
  share[(s.id + t) % kJ] = 1.0f;
  share[(s.id + t + l) % kJ] += 0.5f;
  return share;
}

// The calls of one Forward; with `fail_at_layer` < L the Forward stops there (no iteration end).
void Forward(ForwardObserver& o, const std::vector<Seq>& batch, uint32_t fail_at_layer = kL) {
  std::vector<SequenceInfo> infos;
  for (const Seq& s : batch) infos.push_back({s.id, s.iteration, s.tokens});
  o.OnBatchStart(infos);
  for (const Seq& s : batch) {
    const std::vector<float> sem = {SemValue(s, 0), SemValue(s, 1)};
    o.OnIterationStart(s.id, s.iteration, sem);
  }
  std::vector<uint32_t> experts, tokens;
  for (uint32_t l = 0; l < kL; ++l) {
    if (l == fail_at_layer) return;
    for (const Seq& s : batch) o.OnLayerGates(s.id, s.iteration, l, Gates(s, l));
    for (const Seq& s : batch) {
      Routing(s, l, &experts, &tokens);
      o.OnLayerRouting(s.id, s.iteration, l, experts, tokens);
    }
    for (uint32_t t = l + 1; t < kL && t <= l + o.speculation_distance(); ++t) {
      for (const Seq& s : batch) o.OnSpeculation(s.id, s.iteration, l, t, Speculation(s, l, t));
    }
  }
  for (const Seq& s : batch) o.OnIterationEnd(s.id, s.iteration);
}

Trace Read(const std::string& path) {
  Result<Trace> t = ReadTrace(path);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(*t) : Trace{};
}

// (request, iteration, last) of every record in file order.
std::vector<std::tuple<uint64_t, uint32_t, bool>> Order(const Trace& t) {
  std::vector<std::tuple<uint64_t, uint32_t, bool>> out;
  for (const auto& it : t.iterations) out.emplace_back(it.request_id, it.iteration, it.last);
  return out;
}

TEST(TraceRecorder, WritesEachIterationWhenTheNextCompletesAndTheLastAtRequestEnd) {
  TempDir dir;
  auto rec = OpenRecorder(dir.File("t.trc"));
  ASSERT_NE(rec, nullptr);
  Forward(*rec, {{1, 0, 3}, {2, 0, 2}});  // Both prefill.
  Forward(*rec, {{1, 1, 1}, {2, 1, 1}});
  rec->OnRequestEnd(1);  // Finished after iteration 1.
  Forward(*rec, {{2, 2, 1}, {3, 0, 4}});
  rec->OnRequestEnd(2);  // Cancelled after iteration 2.
  Forward(*rec, {{3, 1, 1}});
  rec->OnRequestEnd(3);
  EXPECT_EQ(rec->stats().records, 7u);
  EXPECT_EQ(rec->stats().requests, 3u);
  EXPECT_EQ(rec->stats().dropped, 0u);
  ASSERT_TRUE(rec->Close().ok());

  const Trace t = Read(dir.File("t.trc"));
  EXPECT_EQ(t.header.source, "fmoe-worker g rank 0");
  using R = std::tuple<uint64_t, uint32_t, bool>;
  EXPECT_EQ(Order(t), (std::vector<R>{{1, 0, false},
                                      {2, 0, false},
                                      {1, 1, true},
                                      {2, 1, false},
                                      {2, 2, true},
                                      {3, 0, false},
                                      {3, 1, true}}));
  for (const TraceIteration& it : t.iterations) {
    SCOPED_TRACE("req " + std::to_string(it.request_id) + " it " + std::to_string(it.iteration));
    const Seq s{it.request_id, it.iteration, it.tokens};
    EXPECT_EQ(it.tokens, it.iteration > 0 ? 1u
                                          : (it.request_id == 1   ? 3u
                                             : it.request_id == 2 ? 2u
                                                                  : 4u));
    EXPECT_EQ(it.sem, (std::vector<float>{SemValue(s, 0), SemValue(s, 1)}));
    EXPECT_FALSE(it.map_derived);
    std::vector<float> map;
    it.FillMap(t.header, &map);
    std::vector<uint32_t> experts, tokens;
    for (uint32_t l = 0; l < kL; ++l) {
      EXPECT_EQ(std::vector<float>(map.begin() + l * kJ, map.begin() + (l + 1) * kJ), Gates(s, l));
      ASSERT_EQ(it.map_offsets[l + 1] - it.map_offsets[l], kJ) << "all J entries, layer " << l;
      Routing(s, l, &experts, &tokens);
      auto used = it.used(l);
      auto counts = it.used_counts(l);
      EXPECT_EQ(std::vector<uint32_t>(used.begin(), used.end()), experts);
      EXPECT_EQ(std::vector<uint32_t>(counts.begin(), counts.end()), tokens);
    }
    // Distance 2 over 3 layers: 0->1, 0->2, 1->2, the request's own; zero fractions left out,
    // 1.5 clamped to 1.
    const std::vector<std::pair<uint32_t, uint32_t>> pairs = {{0, 1}, {0, 2}, {1, 2}};
    ASSERT_EQ(it.speculation.size(), pairs.size());
    for (size_t i = 0; i < pairs.size(); ++i) {
      const auto [l, target] = pairs[i];
      const TraceSpeculation& sp = it.speculation[i];
      EXPECT_EQ(sp.layer, l);
      EXPECT_EQ(sp.target, target);
      const std::vector<float> share = Speculation(s, l, target);
      std::vector<uint16_t> experts;
      std::vector<float> fractions;
      for (uint32_t j = 0; j < kJ; ++j) {
        if (share[j] == 0.0f) continue;
        experts.push_back(static_cast<uint16_t>(j));
        fractions.push_back(std::min(share[j], 1.0f));
      }
      EXPECT_EQ(sp.experts, experts) << l << "->" << target;
      EXPECT_EQ(sp.fractions, fractions) << l << "->" << target;
    }
  }
  // The first Forward batched requests 1 and 2: each record holds its own predictions.
  const TraceIteration& one = t.iterations[0];
  const TraceIteration& two = t.iterations[1];
  ASSERT_EQ(one.request_id, 1u);
  ASSERT_EQ(two.request_id, 2u);
  EXPECT_EQ(one.speculation[0].experts, (std::vector<uint16_t>{2}));
  EXPECT_EQ(two.speculation[0].experts, (std::vector<uint16_t>{3}));
  EXPECT_EQ(one.speculation[2].experts, (std::vector<uint16_t>{0, 3}));
  EXPECT_EQ(one.speculation[2].fractions, (std::vector<float>{0.5f, 1.0f}));
  EXPECT_EQ(two.speculation[2].experts, (std::vector<uint16_t>{0, 1}));
  EXPECT_EQ(two.speculation[2].fractions, (std::vector<float>{1.0f, 0.5f}));
}

TEST(TraceRecorder, RecordsAreInTheFileAsSoonAsWritten) {
  TempDir dir;
  auto rec = OpenRecorder(dir.File("t.trc"));
  ASSERT_NE(rec, nullptr);
  for (uint32_t i = 0; i < 3; ++i) Forward(*rec, {{5, i, i == 0 ? 6u : 1u}});
  // A worker killed now leaves iterations 0 and 1 whole; iteration 2 was still held.
  const Trace t = Read(dir.File("t.trc"));
  using R = std::tuple<uint64_t, uint32_t, bool>;
  EXPECT_EQ(Order(t), (std::vector<R>{{5, 0, false}, {5, 1, false}}));
}

TEST(TraceRecorder, AFailedForwardEndsTheRequestWithItsLastCompleteIteration) {
  TempDir dir;
  auto rec = OpenRecorder(dir.File("t.trc"));
  ASSERT_NE(rec, nullptr);
  Forward(*rec, {{1, 0, 2}});
  Forward(*rec, {{1, 1, 1}, {2, 0, 3}}, /*fail_at_layer=*/1);
  // The engine fails both; only request 1 had completed an iteration, so only it is ended.
  rec->OnRequestEnd(1);
  Forward(*rec, {{3, 0, 1}});  // Request 2's partial prefill is dropped here.
  rec->OnRequestEnd(3);
  EXPECT_EQ(rec->stats().dropped, 2u);
  ASSERT_TRUE(rec->Close().ok());
  using R = std::tuple<uint64_t, uint32_t, bool>;
  EXPECT_EQ(Order(Read(dir.File("t.trc"))), (std::vector<R>{{1, 0, true}, {3, 0, true}}));
}

TEST(TraceRecorder, CloseMarksTheRunningRequestsLastIterationLast) {
  TempDir dir;
  auto rec = OpenRecorder(dir.File("t.trc"));
  ASSERT_NE(rec, nullptr);
  Forward(*rec, {{9, 0, 2}, {4, 0, 1}});
  Forward(*rec, {{9, 1, 1}, {4, 1, 1}});
  Forward(*rec, {{9, 2, 1}, {4, 2, 1}}, /*fail_at_layer=*/2);  // Stopped mid-iteration.
  ASSERT_TRUE(rec->Close().ok());
  EXPECT_EQ(rec->stats().records, 4u);
  EXPECT_EQ(rec->stats().requests, 2u);
  EXPECT_EQ(rec->stats().dropped, 2u);
  // After Close nothing more is written.
  Forward(*rec, {{7, 0, 1}});
  rec->OnRequestEnd(7);
  EXPECT_TRUE(rec->Close().ok());
  using R = std::tuple<uint64_t, uint32_t, bool>;
  EXPECT_EQ(Order(Read(dir.File("t.trc"))),
            (std::vector<R>{{9, 0, false}, {4, 0, false}, {4, 1, true}, {9, 1, true}}));
}

// Hands every call on to `inner`, except where a subclass spoils one sequence's iteration.
class Spoiler : public ForwardObserver {
 public:
  Spoiler(ForwardObserver& inner, uint64_t id, uint32_t iteration)
      : inner_(inner), id_(id), iteration_(iteration) {}
  void OnBatchStart(std::span<const SequenceInfo> s) override { inner_.OnBatchStart(s); }
  void OnIterationStart(uint64_t id, uint32_t it, std::span<const float> sem) override {
    inner_.OnIterationStart(id, it, sem);
  }
  void OnLayerGates(uint64_t id, uint32_t it, uint32_t l, std::span<const float> p) override {
    inner_.OnLayerGates(id, it, l, p);
  }
  void OnLayerRouting(uint64_t id, uint32_t it, uint32_t l, std::span<const uint32_t> e,
                      std::span<const uint32_t> t) override {
    inner_.OnLayerRouting(id, it, l, e, t);
  }
  uint32_t speculation_distance() const override { return inner_.speculation_distance(); }
  void OnSpeculation(uint64_t id, uint32_t it, uint32_t l, uint32_t t,
                     std::span<const float> f) override {
    inner_.OnSpeculation(id, it, l, t, f);
  }
  void OnIterationEnd(uint64_t id, uint32_t it) override { inner_.OnIterationEnd(id, it); }
  void OnRequestEnd(uint64_t id) override { inner_.OnRequestEnd(id); }

 protected:
  bool Spoiled(uint64_t id, uint32_t it) const { return id == id_ && it == iteration_; }
  ForwardObserver& inner_;

 private:
  uint64_t id_;
  uint32_t iteration_;
};

// Replaces one sequence's sem with NaN in one iteration.
class NanSem final : public Spoiler {
 public:
  using Spoiler::Spoiler;
  void OnIterationStart(uint64_t id, uint32_t it, std::span<const float> sem) override {
    std::vector<float> v(sem.begin(), sem.end());
    if (Spoiled(id, it)) v[0] = std::numeric_limits<float>::quiet_NaN();
    inner_.OnIterationStart(id, it, v);
  }
};

// Gives one sequence's speculation one fraction too few in one iteration.
class ShortSpeculation final : public Spoiler {
 public:
  using Spoiler::Spoiler;
  void OnSpeculation(uint64_t id, uint32_t it, uint32_t l, uint32_t t,
                     std::span<const float> f) override {
    inner_.OnSpeculation(id, it, l, t, Spoiled(id, it) ? f.first(f.size() - 1) : f);
  }
};

// Asks for one layer more speculation than `inner` wants, so `inner` gets targets beyond its
// distance.
class AskFarther final : public Spoiler {
 public:
  using Spoiler::Spoiler;
  uint32_t speculation_distance() const override { return inner_.speculation_distance() + 1; }
};

TEST(TraceRecorder, AnInvalidIterationEndsThatRequestsTraceAndTheFileStaysReadable) {
  TempDir dir;
  auto rec = OpenRecorder(dir.File("t.trc"));
  ASSERT_NE(rec, nullptr);
  NanSem nan(*rec, 1, 2);
  for (uint32_t i = 0; i < 4; ++i) Forward(nan, {{1, i, 1}, {2, i, 1}});
  rec->OnRequestEnd(1);
  rec->OnRequestEnd(2);
  EXPECT_EQ(rec->stats().dropped, 2u) << "request 1's iterations 2 and 3";
  ASSERT_TRUE(rec->Close().ok());
  const Trace t = Read(dir.File("t.trc"));
  std::map<uint64_t, std::vector<uint32_t>> its;
  std::map<uint64_t, bool> last;
  for (const auto& it : t.iterations) {
    its[it.request_id].push_back(it.iteration);
    last[it.request_id] = it.last;
  }
  EXPECT_EQ(its[1], (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(its[2], (std::vector<uint32_t>{0, 1, 2, 3}));
  EXPECT_TRUE(last[1]);
  EXPECT_TRUE(last[2]);
}

TEST(TraceRecorder, ASpeculationThatDoesNotFitInvalidatesOnlyItsRequestsIteration) {
  TempDir dir;
  auto rec = OpenRecorder(dir.File("t.trc"));
  ASSERT_NE(rec, nullptr);
  ShortSpeculation bad(*rec, 2, 1);
  for (uint32_t i = 0; i < 2; ++i) Forward(bad, {{1, i, 1}, {2, i, 1}});
  rec->OnRequestEnd(1);
  rec->OnRequestEnd(2);
  EXPECT_EQ(rec->stats().dropped, 1u) << "request 2's iteration 1";
  ASSERT_TRUE(rec->Close().ok());
  using R = std::tuple<uint64_t, uint32_t, bool>;
  EXPECT_EQ(Order(Read(dir.File("t.trc"))),
            (std::vector<R>{{1, 0, false}, {2, 0, true}, {1, 1, true}}));
}

TEST(TraceRecorder, TargetsBeyondItsDistanceAreIgnored) {
  TempDir dir;
  auto rec = OpenRecorder(dir.File("t.trc"), /*distance=*/1);
  ASSERT_NE(rec, nullptr);
  AskFarther farther(*rec, 0, 0);
  Forward(farther, {{7, 0, 2}});
  rec->OnRequestEnd(7);
  EXPECT_EQ(rec->stats().dropped, 0u);
  ASSERT_TRUE(rec->Close().ok());
  const Trace t = Read(dir.File("t.trc"));
  ASSERT_EQ(t.iterations.size(), 1u);
  const auto& sp = t.iterations[0].speculation;
  ASSERT_EQ(sp.size(), 2u) << "0->1 and 1->2, not 0->2";
  EXPECT_EQ(sp[0].target, 1);
  EXPECT_EQ(sp[1].layer, 1);
}

TEST(TraceRecorder, MissingLayersAndWrongShapesAreNotWritten) {
  TempDir dir;
  auto rec = OpenRecorder(dir.File("t.trc"), /*distance=*/0);
  ASSERT_NE(rec, nullptr);
  const SequenceInfo s{1, 0, 1};
  rec->OnBatchStart(std::span<const SequenceInfo>(&s, 1));
  rec->OnIterationStart(1, 0, std::vector<float>(kH, 0.0f));
  std::vector<uint32_t> e = {0, 1}, n = {1, 1};
  for (uint32_t l = 0; l < kL; ++l) {
    rec->OnLayerGates(1, 0, l, std::vector<float>(l == 1 ? kJ + 1 : kJ, 0.25f));  // Bad size.
    rec->OnLayerRouting(1, 0, l, e, n);
  }
  rec->OnIterationEnd(1, 0);
  rec->OnRequestEnd(1);
  EXPECT_EQ(rec->stats().records, 0u);
  EXPECT_EQ(rec->stats().dropped, 1u);
  ASSERT_TRUE(rec->Close().ok());
  EXPECT_TRUE(Read(dir.File("t.trc")).iterations.empty());
}

TEST(TraceRecorder, OpenKeepsAnExistingTraceAndNamesABadPath) {
  TempDir dir;
  const std::string path = dir.File("t.trc");
  std::ofstream(path) << "old";
  auto first = OpenRecorder(path);
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(first->kept_previous(), path + ".1");
  ASSERT_TRUE(first->Close().ok());
  auto second = OpenRecorder(path);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(second->kept_previous(), path + ".2");
  std::ifstream old(path + ".1");
  std::string text;
  old >> text;
  EXPECT_EQ(text, "old");
  EXPECT_TRUE(ReadTrace(path + ".2").ok());

  TraceRecorderOptions o;
  o.header = Header();
  o.path = dir.File("no/such/dir/t.trc");
  auto missing = TraceRecorder::Open(o);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), ErrorCode::kIoError);
  EXPECT_EQ(missing.status().message(), o.path + ": No such file or directory");
  o.path = dir.File("");
  auto directory = TraceRecorder::Open(o);
  ASSERT_FALSE(directory.ok());
  EXPECT_NE(directory.status().message().find("is a directory"), std::string::npos);
  o.path = dir.File("bad.trc");
  o.header.top_k = kJ + 1;
  EXPECT_EQ(TraceRecorder::Open(o).status().code(), ErrorCode::kInvalidArgument);
}

TEST(TraceRecorder, WorkerHeaderDescribesTheRun) {
  ModelInfo info;
  info.num_moe_layers = 8;
  info.num_experts = 8;
  info.top_k = 2;
  info.hidden_size = 256;
  const TraceHeader h = WorkerTraceHeader(info, "tiny-moe", "g0", 0, 3);
  EXPECT_EQ(h.model, "tiny-moe");
  EXPECT_EQ(h.source, "fmoe-worker g0 rank 0");
  EXPECT_EQ(h.iteration_unit,
            "engine iteration (0 = prefill of the whole prompt, then one decode step each)");
  EXPECT_NE(h.semantic.find("per request"), std::string::npos);
  EXPECT_EQ(h.semantic.find("batch-level"), std::string::npos);
  EXPECT_NE(h.semantic.find("l+1..l+3"), std::string::npos);
  EXPECT_EQ(h.num_layers, 8u);
  EXPECT_EQ(h.num_experts, 8u);
  EXPECT_EQ(h.top_k, 2u);
  EXPECT_EQ(h.hidden, 256u);
}

// Counts calls; asks for `distance` speculation.
class Counting final : public ForwardObserver {
 public:
  explicit Counting(uint32_t distance) : distance_(distance) {}
  void OnBatchStart(std::span<const SequenceInfo>) override { ++calls; }
  void OnIterationStart(uint64_t, uint32_t, std::span<const float>) override { ++calls; }
  void OnLayerGates(uint64_t, uint32_t, uint32_t, std::span<const float>) override { ++calls; }
  void OnLayerRouting(uint64_t, uint32_t, uint32_t, std::span<const uint32_t>,
                      std::span<const uint32_t>) override {
    ++calls;
  }
  uint32_t speculation_distance() const override { return distance_; }
  void OnSpeculation(uint64_t request_id, uint32_t, uint32_t layer, uint32_t target,
                     std::span<const float>) override {
    targets.emplace_back(request_id, layer, target);
  }
  void OnIterationEnd(uint64_t, uint32_t) override { ++calls; }
  void OnRequestEnd(uint64_t) override { ++calls; }
  int calls = 0;
  std::vector<std::tuple<uint64_t, uint32_t, uint32_t>> targets;  // (request, layer, target)

 private:
  uint32_t distance_;
};

TEST(ObserverFanOut, EveryObserverGetsEveryCallAndOnlyItsOwnSpeculationTargets) {
  Counting none(0), one(1), two(2);
  ObserverFanOut fan;
  EXPECT_TRUE(fan.empty());
  fan.Add(&none);
  fan.Add(nullptr);
  fan.Add(&one);
  fan.Add(&two);
  EXPECT_EQ(fan.speculation_distance(), 2u);
  Forward(fan, {{1, 0, 2}, {2, 0, 1}});
  fan.OnRequestEnd(1);
  // 1 batch + 2 starts + 3 layers x (2 gates + 2 routings) + 2 ends + 1 request end.
  for (const Counting* c : {&none, &one, &two}) EXPECT_EQ(c->calls, 18);
  // Speculation once per sequence, in batch order.
  using P = std::tuple<uint64_t, uint32_t, uint32_t>;
  EXPECT_TRUE(none.targets.empty());
  EXPECT_EQ(one.targets, (std::vector<P>{{1, 0, 1}, {2, 0, 1}, {1, 1, 2}, {2, 1, 2}}));
  EXPECT_EQ(two.targets,
            (std::vector<P>{{1, 0, 1}, {2, 0, 1}, {1, 0, 2}, {2, 0, 2}, {1, 1, 2}, {2, 1, 2}}));
}

}  // namespace
}  // namespace fmoe
