// fmoe-bench import-trace, run as a binary: the Mixtral files' phase is named and recorded in the
// header, so the serving replay knows decode steps from prompt positions, and several files make
// one trace.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "bench/fmoe_bench/replay_workload.h"
#include "common/model/expert_trace.h"

namespace fmoe::bench {
namespace {

namespace fs = std::filesystem;

class TraceImportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("fmoe-trace-import-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A vLLM routing file: `problems` problems of `tokens` tokens over 2 layers, top-2.
  fs::path Routing(const std::string& name, const std::string& dataset, int problems,
                   int tokens) const {
    const fs::path path = dir_ / name;
    std::ofstream out(path);
    for (int p = 0; p < problems; ++p) {
      for (int layer = 0; layer < 2; ++layer) {
        for (int t = 0; t < tokens; ++t) {
          out << "{\"dataset\": \"" << dataset << "\", \"problem_id\": " << p
              << ", \"layer\": " << layer << ", \"experts\": [" << (t % 8) << ", " << ((t + 3) % 8)
              << "], \"gating_probs\": [0.7, 0.3], \"token_idx\": " << t << "}\n";
        }
      }
    }
    return path;
  }

  // Exit code of `fmoe-bench import-trace ARGS`.
  int Run(const std::vector<std::string>& args) const {
    std::string cmd = std::string("'") + FMOE_BINARY_DIR + "/bin/fmoe-bench' import-trace";
    for (const std::string& a : args) cmd += " '" + a + "'";
    cmd += " >/dev/null 2>'" + (dir_ / "stderr.txt").string() + "'";
    const int status = std::system(cmd.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  fs::path dir_;
};

TEST_F(TraceImportTest, MixtralFilesNeedTheirPhaseAndSayItInTheHeader) {
  const fs::path gsm = Routing("gsm8k_2_routing.jsonl", "gsm8k", 2, 5);
  const fs::path he = Routing("humaneval_2_routing.jsonl", "humaneval", 2, 3);
  const std::string out = (dir_ / "mx.trace").string();
  EXPECT_EQ(Run({"--format", "mixtral-vllm", "--input", gsm.string(), "--out", out}), 2);
  ASSERT_EQ(Run({"--format", "mixtral-vllm", "--phase", "decode", "--input", gsm.string(),
                 "--input", he.string(), "--out", out}),
            0);
  auto trace = ReadTrace(out);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  EXPECT_EQ(*DetectTraceKind(trace->header), TraceKind::kDecodePositions);
  EXPECT_EQ(trace->header.num_layers, 2u);
  EXPECT_EQ(trace->iterations.size(), 2u * 5 + 2u * 3);  // Four problems from two files.
  ASSERT_EQ(Run({"--format", "mixtral-vllm", "--phase", "prefill", "--input", gsm.string(), "--out",
                 out}),
            0);
  trace = ReadTrace(out);
  ASSERT_TRUE(trace.ok());
  EXPECT_EQ(*DetectTraceKind(trace->header), TraceKind::kPromptPositions);
}

}  // namespace
}  // namespace fmoe::bench
