// `fmoe generate`, run as the user runs it: the launcher (which must not link LibTorch) execs
// fmoe-generate from its own directory with the arguments, and the output is that binary's. On
// the shipped tiny model: the text and timings, the same tokens as fmoe-generate run directly,
// the options in --help, and the errors. A build without LibTorch says it has no model runtime.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using testing::BinDir;
using testing::RunCommand;

const std::string kModel = std::string(FMOE_SOURCE_DIR) + "/deploy/models/tiny-moe";

std::pair<int, std::string> Fmoe(std::vector<std::string> args) {
  args.insert(args.begin(), BinDir() + "/fmoe");
  return RunCommand(args, 120000);
}

TEST(Generate, TheLauncherDoesNotLinkLibTorch) {
  if (std::system("command -v ldd >/dev/null 2>&1") != 0) GTEST_SKIP() << "no ldd";
  auto [code, out] = RunCommand({"/bin/sh", "-c", "ldd '" + BinDir() + "/fmoe'"}, 30000);
  ASSERT_EQ(code, 0) << out;
  // Library names only: ldd's load addresses are hexadecimal and may spell "c10".
  EXPECT_EQ(out.find("libtorch"), std::string::npos) << out;
  EXPECT_EQ(out.find("libc10"), std::string::npos) << out;
}

// `fmoe validate` prints the model as every process reads it, and fails for a family the
// runtime does not run.
TEST(Validate, PrintsTheModelsExpertShapes) {
  const std::string dir = ::testing::TempDir() + "/fmoe-validate-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string manifest = dir + "/m.yaml";
  auto write = [&](const std::string& model) {
    std::FILE* f = std::fopen(manifest.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fprintf(f, "model: {path: %s}\nworker_groups: [{name: g0, workers: [{}]}]\n",
                 model.c_str());
    std::fclose(f);
  };
  write(std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/qwen2-moe-ref");
  auto [code, out] = Fmoe({"validate", manifest});
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("architecture: Qwen2MoeForCausalLM"), std::string::npos) << out;
  EXPECT_NE(out.find("of which L = 3 MoE (dense: 1"), std::string::npos) << out;
  EXPECT_NE(out.find("shared expert:"), std::string::npos) << out;

  write(std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/phimoe-ref");
  std::tie(code, out) = Fmoe({"validate", manifest});
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("architecture: PhimoeForCausalLM\n"), std::string::npos) << out;
  EXPECT_NE(out.find("sparsemixer (router_jitter_noise 0.250000), top-2 of 8"), std::string::npos)
      << out;
  EXPECT_NE(out.find("LayerNorm, lm_head bias, LongRoPE (short factors up to 8 tokens)"),
            std::string::npos)
      << out;

  write(std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/glm4-moe-ref");
  std::tie(code, out) = Fmoe({"validate", manifest});
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("architecture: Glm4MoeForCausalLM\n"), std::string::npos) << out;
  EXPECT_NE(out.find("q/k/v biases, q/k RMSNorm per head"), std::string::npos) << out;
  EXPECT_NE(out.find("RoPE on the first 8 dims of a head"), std::string::npos) << out;

  write(std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/minimax-m2-ref");
  std::tie(code, out) = Fmoe({"validate", manifest});
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("architecture: MiniMaxM2ForCausalLM\n"), std::string::npos) << out;
  EXPECT_NE(out.find("q/k RMSNorm over the projection"), std::string::npos) << out;
  EXPECT_NE(out.find("RoPE on the first 8 dims of a head"), std::string::npos) << out;

  write(std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/gpt-oss-ref");
  std::tie(code, out) = Fmoe({"validate", manifest});
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("architecture: GptOssForCausalLM\n"), std::string::npos) << out;
  EXPECT_NE(out.find("top-2 of 8 logits, softmax over the chosen"), std::string::npos) << out;
  EXPECT_NE(out.find("sliding window 4 on 2 of 3 layers, attention sinks, YaRN x4"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("experts: biases, SwiGLU clamped at 7"), std::string::npos) << out;

  write(std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/gpt-oss-mxfp4-ref");
  std::tie(code, out) = Fmoe({"validate", manifest});
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("quantized: mxfp4 e2m1 g32 (e8m0 scales)"), std::string::npos) << out;
  std::filesystem::remove_all(dir);
}

#ifdef FMOE_HAVE_TORCH

// The other families, through the whole command: each fixture generates.
TEST(Generate, RunsEverySupportedFamily) {
  for (const char* family :
       {"qwen2-moe-ref", "qwen3-moe-ref", "olmoe-ref", "deepseek-v2-ref", "deepseek-v3-ref",
        "phimoe-ref", "glm4-moe-ref", "minimax-m2-ref", "gpt-oss-ref", "gpt-oss-mxfp4-ref"}) {
    auto [code, out] =
        Fmoe({"generate", "--model", std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/" + family,
              "--prompt", "The river", "--max-tokens", "6"});
    EXPECT_EQ(code, 0) << family << ": " << out;
    // Greedy may meet the family's EOS before 6 tokens.
    EXPECT_NE(out.find(" generated; prefill"), std::string::npos) << family << ": " << out;
  }
}

TEST(Generate, StreamsAContinuationAndItsTimings) {
  auto [code, out] =
      Fmoe({"generate", "--model", kModel, "--prompt", "In the beginning", "--max-tokens", "8"});
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("In the beginning"), std::string::npos) << out;
  EXPECT_NE(out.find("loading " + std::filesystem::canonical(kModel).string()), std::string::npos)
      << out;
  EXPECT_NE(out.find("prompt tokens, 8 generated"), std::string::npos) << out;
  EXPECT_NE(out.find("cpu (LibTorch"), std::string::npos) << out;
}

TEST(Generate, GivesTheTokensOfFmoeGenerateRunDirectly) {
  const std::vector<std::string> args = {"--model",      kModel, "--prompt", "The word",
                                         "--max-tokens", "12",   "--dtype",  "float32"};
  std::vector<std::string> launcher = {BinDir() + "/fmoe", "generate"};
  launcher.insert(launcher.end(), args.begin(), args.end());
  std::vector<std::string> direct = {BinDir() + "/fmoe-generate"};
  direct.insert(direct.end(), args.begin(), args.end());
  auto [code_a, out_a] = RunCommand(launcher, 120000);
  auto [code_b, out_b] = RunCommand(direct, 120000);
  ASSERT_EQ(code_a, 0) << out_a;
  ASSERT_EQ(code_b, 0) << out_b;
  // The text is the line after the loading line; the timings differ.
  auto text = [](const std::string& out) {
    const size_t at = out.find("The word");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  EXPECT_FALSE(text(out_a).empty()) << out_a;
  EXPECT_EQ(text(out_a), text(out_b)) << out_a << "\n---\n" << out_b;
}

// --stop: fmoe-generate matches its stop strings in the text it prints (the engine does not) and
// ends the request at the first: the text stops right before it, and fewer tokens are made.
TEST(Generate, StopsAtAStopString) {
  const std::vector<std::string> args = {"generate", "--model",      kModel, "--prompt",
                                         "The word", "--max-tokens", "24"};
  auto [code, out] = Fmoe(args);
  ASSERT_EQ(code, 0) << out;
  const size_t at = out.find("The word");
  ASSERT_NE(at, std::string::npos) << out;
  const std::string text = out.substr(at, out.find('\n', at) - at);
  ASSERT_GE(text.size(), std::string("The word").size() + 8) << text;
  const std::string stop = text.substr(std::string("The word").size() + 4, 3);
  std::vector<std::string> stopped_args = args;
  stopped_args.insert(stopped_args.end(), {"--stop", "never-there", "--stop", stop});
  auto [stopped_code, stopped] = Fmoe(stopped_args);
  ASSERT_EQ(stopped_code, 0) << stopped;
  const size_t stopped_at = stopped.find("The word");
  ASSERT_NE(stopped_at, std::string::npos) << stopped;
  const std::string cut = stopped.substr(stopped_at, stopped.find('\n', stopped_at) - stopped_at);
  const size_t gen = std::string("The word").size();
  EXPECT_EQ(cut, text.substr(0, text.find(stop, gen))) << stopped;
  EXPECT_EQ(stopped.find("24 generated"), std::string::npos) << stopped;
  EXPECT_NE(stopped.find(" generated; prefill"), std::string::npos) << stopped;
}

TEST(Generate, HelpListsTheOptions) {
  auto [code, out] = Fmoe({"generate", "--help"});
  EXPECT_EQ(code, 0) << out;
  for (const char* option : {"--model", "--prompt", "--max-tokens", "--temperature", "--top-p",
                             "--top-k", "--seed", "--stop", "--dtype", "--threads", "--no-bos"}) {
    EXPECT_NE(out.find(option), std::string::npos) << option << "\n" << out;
  }
  EXPECT_NE(out.find("fmoe generate [OPTIONS]"), std::string::npos) << out;
  EXPECT_NE(out.find("{auto,float32,bfloat16,float16}=auto"), std::string::npos) << out;
}

TEST(Generate, ErrorsNameTheCause) {
  auto [code, out] = Fmoe({"generate", "--model", "/nonexistent/model", "--prompt", "x"});
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("fmoe generate: model: /nonexistent/model: no such directory"),
            std::string::npos)
      << out;
  auto [usage_code, usage] = Fmoe({"generate", "--model", kModel});
  EXPECT_NE(usage_code, 0) << usage;
  EXPECT_NE(usage.find("--prompt is required"), std::string::npos) << usage;
  auto [dtype_code, dtype] =
      Fmoe({"generate", "--model", kModel, "--prompt", "x", "--dtype", "fp8"});
  EXPECT_NE(dtype_code, 0) << dtype;
  EXPECT_NE(dtype.find("fp8"), std::string::npos) << dtype;
}

#else

TEST(Generate, ABuildWithoutLibTorchSaysItHasNoModelRuntime) {
  auto [code, out] = Fmoe({"generate", "--model", kModel, "--prompt", "x"});
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("fmoe generate: this build has no model runtime"), std::string::npos) << out;
}

#endif

}  // namespace
}  // namespace fmoe
