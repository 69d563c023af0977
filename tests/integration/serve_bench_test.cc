// `fmoe-bench serve` end to end: the real processes (`fmoe launch` with the tiny model, one cpu
// rank) once per policy (lru, fmoe) and once all resident, driven over HTTP by a small arrival
// trace in the Azure format and a prompts JSONL that the test writes. Checks the summary CSV (one
// row per run, tokens generated, ordered percentiles, hit rates in [0, 1] and 1 when resident),
// the per-request CSVs, and that no process of the benchmark is left afterwards.
#include <dirent.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using testing::BinDir;
using testing::ReadFile;
using testing::RunCommand;
using testing::WriteFile;

std::vector<std::string> SplitLines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) lines.push_back(line);
  }
  return lines;
}

// Our CSV quotes only the error field, and only when needed.
std::vector<std::string> SplitCsv(const std::string& line) {
  std::vector<std::string> cells;
  std::string cell;
  bool quoted = false;
  for (char c : line) {
    if (c == '"') {
      quoted = !quoted;
    } else if (c == ',' && !quoted) {
      cells.push_back(cell);
      cell.clear();
    } else {
      cell += c;
    }
  }
  cells.push_back(cell);
  return cells;
}

// Rows of a CSV as column name -> value.
std::vector<std::map<std::string, std::string>> ReadCsv(const std::string& path) {
  const std::vector<std::string> lines = SplitLines(ReadFile(path));
  std::vector<std::map<std::string, std::string>> rows;
  if (lines.empty()) return rows;
  const std::vector<std::string> header = SplitCsv(lines[0]);
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::vector<std::string> cells = SplitCsv(lines[i]);
    std::map<std::string, std::string> row;
    for (size_t c = 0; c < header.size() && c < cells.size(); ++c) row[header[c]] = cells[c];
    rows.push_back(std::move(row));
  }
  return rows;
}

// A numeric cell; NaN (and a test failure) when it is missing or not a number.
double Num(const std::map<std::string, std::string>& row, const std::string& key) {
  auto it = row.find(key);
  char* end = nullptr;
  const double v = it == row.end() ? 0.0 : std::strtod(it->second.c_str(), &end);
  if (it == row.end() || it->second.empty() || *end != '\0') {
    ADD_FAILURE() << key << " is not a number: \"" << (it == row.end() ? "" : it->second) << "\"";
    return std::nan("");
  }
  return v;
}

// Processes whose command line mentions `text`.
std::vector<std::string> ProcessesMentioning(const std::string& text) {
  std::vector<std::string> found;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return found;
  while (dirent* e = readdir(proc)) {
    const std::string name = e->d_name;
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string cmdline = ReadFile("/proc/" + name + "/cmdline");
    for (char& c : cmdline) {
      if (c == '\0') c = ' ';
    }
    if (cmdline.find(text) != std::string::npos) found.push_back(name + ": " + cmdline);
  }
  closedir(proc);
  return found;
}

TEST(ServeBench, TwoPoliciesAndResidentFromSmallTrace) {
  const std::string dir = testing::MakeTempDir("fmoe-serve-bench");
  ASSERT_FALSE(dir.empty());
  const std::string manifest = dir + "/base.yaml";
  WriteFile(manifest, "model:\n  name: tiny-moe\n  path: " + std::string(FMOE_SOURCE_DIR) +
                          "/deploy/models/tiny-moe\n"
                          "worker_groups:\n  - name: g0\n    max_batch: 4\n"
                          "    workers:\n      - device: cpu\n"
                          "heartbeat:\n  interval_ms: 100\n  timeout_ms: 5000\n"
                          "launcher:\n  ready_timeout_s: 60\n  stop_timeout_s: 5\n");
  // Seven requests (one warm-up) about 0.2 s apart, in the Azure trace's format.
  const std::string arrivals = dir + "/arrivals.csv";
  WriteFile(arrivals,
            "TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:15:46.6805900,374,40\n"
            "2023-11-16 18:15:46.9000000,1200,100\n"
            "2023-11-16 18:15:47.0500000,90,20\n"
            "2023-11-16 18:15:47.3000000,2000,80\n"
            "2023-11-16 18:15:47.4000000,600,60\n"
            "2023-11-16 18:15:47.7000000,3000,100\n"
            "2023-11-16 18:15:47.8000000,150,30\n");
  const std::string prompts = dir + "/prompts.jsonl";
  WriteFile(prompts,
            "{\"id\": 1, \"prompt\": \"The history of the city\"}\n"
            "{\"id\": 2, \"prompt\": \"In the beginning God created the heaven and the earth.\"}\n"
            "{\"id\": 3, \"no_prompt\": \"skipped\"}\n"
            "{\"id\": 4, \"prompt\": \"def main():\\n    print(\\\"hello\\\")\"}\n"
            "{\"id\": 5, \"prompt\": \"A dictionary defines a word by\"}\n"
            "{\"id\": 6, \"prompt\": \"User: what is a mixture of experts model? Answer in two "
            "short sentences, please.\"}\n"
            "{\"id\": 7, \"prompt\": \"Wikipedia is a free online encyclopedia\"}\n");
  const std::string out = dir + "/out";
  const std::string csv = out + "/summary.csv";

  const auto [code, output] = RunCommand({BinDir() + "/fmoe-bench",
                                          "serve",
                                          "--manifest",
                                          manifest,
                                          "--policies",
                                          "lru,fmoe",
                                          "--budget",
                                          "0.25",
                                          "--arrivals",
                                          arrivals,
                                          "--prompts",
                                          prompts,
                                          "--requests",
                                          "6",
                                          "--warmup",
                                          "1",
                                          "--max-tokens",
                                          "8",
                                          "--min-tokens",
                                          "2",
                                          "--max-prompt-tokens",
                                          "32",
                                          "--out",
                                          out,
                                          "--csv",
                                          csv,
                                          "--fmoe",
                                          BinDir() + "/fmoe",
                                          "--ready-timeout",
                                          "60",
                                          "--request-timeout",
                                          "30",
                                          "--stop-timeout",
                                          "15"},
                                         85000);
  ASSERT_EQ(code, 0) << output;

  const auto rows = ReadCsv(csv);
  ASSERT_EQ(rows.size(), 3u) << ReadFile(csv);
  const std::vector<std::string> names = {"lru", "fmoe", "resident"};
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& row = rows[i];
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(row.at("run"), names[i]);
    EXPECT_EQ(row.at("status"), "ok") << row.at("error");
    EXPECT_EQ(row.at("requests"), "6");
    EXPECT_EQ(row.at("ok"), "6");
    EXPECT_EQ(row.at("errors"), "0");
    EXPECT_GT(Num(row, "output_tokens"), 0);
    EXPECT_LE(Num(row, "output_tokens"), Num(row, "requested_tokens"));
    for (const std::string metric : {"ttft", "tpot"}) {
      const double p50 = Num(row, metric + "_p50_ms");
      const double p90 = Num(row, metric + "_p90_ms");
      const double p99 = Num(row, metric + "_p99_ms");
      EXPECT_GE(p50, 0) << metric;
      EXPECT_LE(p50, p90) << metric;
      EXPECT_LE(p90, p99) << metric;
    }
    EXPECT_GT(Num(row, "ttft_p50_ms"), 0);
    EXPECT_GT(Num(row, "ttft_mean_ms"), 0);
    EXPECT_GE(Num(row, "tpot_mean_ms"), 0);
    EXPECT_GT(Num(row, "output_tokens_per_s"), 0);
    const double hit_rate = Num(row, "hit_rate");
    EXPECT_GE(hit_rate, 0.0);
    EXPECT_LE(hit_rate, 1.0);
    // Every run answers the same requests: one line each (warm-up included) per run.
    const auto requests = ReadCsv(out + "/" + names[i] + "/requests.csv");
    EXPECT_EQ(requests.size(), 7u);
  }
  EXPECT_EQ(rows[2].at("budget"), "1.0000");
  EXPECT_EQ(Num(rows[2], "hit_rate"), 1.0);
  EXPECT_EQ(rows[2].at("expert_misses"), "0");
  EXPECT_EQ(rows[0].at("budget"), "0.2500");
  // The same requests in every run: same prompts, so the same prompt token totals.
  EXPECT_EQ(rows[0].at("prompt_tokens"), rows[1].at("prompt_tokens"));
  EXPECT_EQ(rows[0].at("prompt_tokens"), rows[2].at("prompt_tokens"));

  // The table was printed, and nothing of the benchmark outlives it.
  EXPECT_NE(output.find("resident"), std::string::npos) << output;
  EXPECT_NE(output.find("TTFT50"), std::string::npos) << output;
  const std::vector<std::string> left = ProcessesMentioning(dir);
  EXPECT_TRUE(left.empty()) << left.size() << " process(es) left, first: " << left.front();

  std::error_code ec;
  if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir, ec);
}

}  // namespace
}  // namespace fmoe
