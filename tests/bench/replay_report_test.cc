// The serving replay's report: percentiles and means per request, figures per prefill and per
// decode token, the CSV, and the target checks.
#include "bench/fmoe_bench/replay_report.h"

#include <algorithm>

#include <gtest/gtest.h>

namespace fmoe::bench {
namespace {

constexpr double kMs = 1e6;

TEST(ServeReportTest, PercentilesAreNearestRankAndTheMeanIsPlain) {
  std::vector<double> ns;
  for (int i = 100; i >= 1; --i) ns.push_back(i * kMs);
  LatencySummary s = Summarise(ns);
  EXPECT_EQ(s.count, 100u);
  EXPECT_DOUBLE_EQ(s.p50_ms, 50);
  EXPECT_DOUBLE_EQ(s.p90_ms, 90);
  EXPECT_DOUBLE_EQ(s.p99_ms, 99);
  EXPECT_DOUBLE_EQ(s.mean_ms, 50.5);
  s = Summarise({3 * kMs});
  EXPECT_DOUBLE_EQ(s.p50_ms, 3);
  EXPECT_DOUBLE_EQ(s.p99_ms, 3);
  EXPECT_EQ(Summarise({}).count, 0u);
  EXPECT_EQ(Summarise({}).mean_ms, 0);
}

TEST(ServeReportTest, PhaseFiguresArePerPrefillOrPerDecodeToken) {
  PhaseFigures p;
  p.iterations = 3;
  p.requests = 4;
  p.hits = 30;
  p.misses = 10;
  p.on_demand_loads = 6;
  p.prefetches_issued = 4;
  p.prefetches_used = 2;
  p.experts_moved = 10;
  p.stall_ns = 20 * kMs;
  PhaseSummary s = Summarise(p, 352.3);
  EXPECT_EQ(s.units, 4u);
  EXPECT_DOUBLE_EQ(s.hit_rate, 0.75);
  EXPECT_DOUBLE_EQ(s.stall_ms, 5);
  EXPECT_DOUBLE_EQ(s.loads, 2.5);
  EXPECT_DOUBLE_EQ(s.mb, 2.5 * 352.3);
  EXPECT_DOUBLE_EQ(s.precision, 0.5);
  EXPECT_DOUBLE_EQ(s.recall, 0.25);
  EXPECT_EQ(Summarise(PhaseFigures{}, 1.0).stall_ms, 0);
}

ServeResult Result3() {
  ServeResult r;
  r.config.policy = "fmoe";
  r.config.max_batch = 8;
  r.config.budget = 0.25;
  r.config.distance = 3;
  // TTFT 10, 20, 30 ms; TPOT 2 ms (5 steps), 4 ms (3 steps), none (a prefill only).
  RequestTiming a{1, true, 10, 5, 0, 0, 10 * 1'000'000, 18 * 1'000'000};
  RequestTiming b{2, true, 10, 3, 0, 0, 20 * 1'000'000, 28 * 1'000'000};
  RequestTiming c{3, true, 10, 1, 5'000'000, 5'000'000, 35 * 1'000'000, 35 * 1'000'000};
  r.requests = {a, b, c};
  r.mean_batch = 2.5;
  r.total_ns = 35 * kMs;
  return r;
}

TEST(ServeReportTest, RequestsWithoutDecodeStepsHaveNoTpot) {
  ServeSummary s = Summarise(Result3(), 1.0);
  EXPECT_EQ(s.ttft.count, 3u);
  EXPECT_DOUBLE_EQ(s.ttft.mean_ms, 20);
  EXPECT_DOUBLE_EQ(s.ttft.p50_ms, 20);
  EXPECT_DOUBLE_EQ(s.ttft.p99_ms, 30);
  EXPECT_EQ(s.tpot.count, 2u);
  EXPECT_DOUBLE_EQ(s.tpot.mean_ms, 3);
  EXPECT_DOUBLE_EQ(s.tpot.p50_ms, 2);
  EXPECT_DOUBLE_EQ(s.mean_batch, 2.5);
  EXPECT_DOUBLE_EQ(s.total_s, 0.035);
}

TEST(ServeReportTest, CsvRowsMatchTheHeaderAndTheTableNamesEveryRow) {
  const ServeResult r = Result3();
  const ServeSummary s = Summarise(r, 1.0);
  const std::string header = ServeCsvHeader();
  const std::string row = ServeCsvRow(r.config, s);
  EXPECT_EQ(std::count(header.begin(), header.end(), ','), std::count(row.begin(), row.end(), ','));
  EXPECT_EQ(row.rfind("offline,8,0.25,3,fmoe,3,", 0), 0u) << row;
  // max_batched_tokens then chunk_overhead are the last columns, after every older one.
  EXPECT_TRUE(header.ends_with(",decode_cpu_ms_per_token,max_batched_tokens,chunk_overhead"))
      << header;
  EXPECT_TRUE(row.ends_with(",0,0.000")) << row;
  ServeConfig chunked = r.config;
  chunked.max_batched_tokens = 64;
  chunked.chunk_overhead = 0.25;
  EXPECT_TRUE(ServeCsvRow(chunked, s).ends_with(",64,0.250")) << ServeCsvRow(chunked, s);
  const std::string table = ServeTable({{"fmoe", s}, {"lru", s}});
  EXPECT_NE(table.find("\nfmoe "), std::string::npos) << table;
  EXPECT_NE(table.find("\nlru "), std::string::npos) << table;
  EXPECT_NE(table.find("TTFT"), std::string::npos);
}

TEST(ServeReportTest, TargetsCompareFmoeWithTheRealizablePoliciesLruAndTheOracle) {
  auto summary = [](double ttft, double tpot, double decode_stall) {
    ServeSummary s;
    s.ttft.mean_ms = ttft;
    s.tpot.mean_ms = tpot;
    s.decode.stall_ms = decode_stall;
    return s;
  };
  TargetCheck t = CheckTargets({{"fmoe", summary(100, 10, 6)},
                                {"fmoe-traj", summary(95, 9, 6)},
                                {"lru", summary(90, 12, 8)},
                                {"oracle", summary(50, 5, 2)}});
  EXPECT_EQ(t.best_tpot, "fmoe-traj");
  EXPECT_EQ(t.best_ttft, "lru");      // The oracle does not count.
  EXPECT_EQ(t.baseline_tpot, "lru");  // fmoe's own ablations are not baselines.
  EXPECT_DOUBLE_EQ(t.baseline_tpot_ms, 12);
  EXPECT_DOUBLE_EQ(t.fmoe_tpot_ms, 10);
  EXPECT_DOUBLE_EQ(t.best_ttft_ms, 90);
  EXPECT_DOUBLE_EQ(t.decode_stall_vs_lru, 0.75);
  EXPECT_DOUBLE_EQ(t.tpot_vs_oracle, 2);
  EXPECT_DOUBLE_EQ(t.ttft_vs_oracle, 2);
  EXPECT_DOUBLE_EQ(t.decode_stall_vs_oracle, 3);
  t = CheckTargets({{"lru", summary(1, 1, 1)}});
  EXPECT_EQ(t.best_tpot, "lru");
  EXPECT_EQ(t.fmoe_tpot_ms, 0);
}

TEST(ServeReportTest, HybridRowsCarryTheirCpuFiguresAndTargets) {
  ServeResult r = Result3();
  r.config.hybrid = true;
  r.decode.requests = 10;
  r.decode.cpu_experts = 25;
  r.decode.cpu_ns = 50 * kMs;
  r.prefill.requests = 2;
  r.prefill.cpu_experts = 3;
  const ServeSummary s = Summarise(r, 1.0);
  EXPECT_TRUE(s.hybrid);
  EXPECT_DOUBLE_EQ(s.decode.cpu_experts, 2.5);
  EXPECT_DOUBLE_EQ(s.decode.cpu_ms, 5);
  EXPECT_DOUBLE_EQ(s.prefill.cpu_experts, 1.5);
  EXPECT_EQ(RunLabel(r.config), "fmoe+cpu");
  const std::string row = ServeCsvRow(r.config, s);
  EXPECT_NE(row.find(",on,1.500,0.000,2.5000,5.0000"), std::string::npos) << row;
  const std::string table = ServeTable({{"fmoe+cpu", s}});
  EXPECT_NE(table.find("cpu/token"), std::string::npos) << table;
  EXPECT_EQ(ServeTable({{"fmoe", Summarise(Result3(), 1.0)}}).find("cpu/token"), std::string::npos);

  auto decode_stall = [](double ms) {
    ServeSummary x;
    x.decode.stall_ms = ms;
    return x;
  };
  const HybridCheck h = CheckHybridTargets({{"fmoe", decode_stall(80)}, {"lru", decode_stall(100)}},
                                           {{"fmoe", decode_stall(30)}, {"lru", decode_stall(40)}});
  EXPECT_DOUBLE_EQ(h.fmoe_vs_lru, 0.3);
  EXPECT_DOUBLE_EQ(h.fmoe_vs_lru_hybrid, 0.75);
  EXPECT_DOUBLE_EQ(h.lru_gain, 0.4);
  EXPECT_DOUBLE_EQ(h.fmoe_gain, 0.375);
  EXPECT_EQ(CheckHybridTargets({{"lru", decode_stall(100)}}, {}).fmoe_vs_lru, 0);
}

}  // namespace
}  // namespace fmoe::bench
