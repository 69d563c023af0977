// `fmoe-bench make-model`, run as a binary: dry runs of the five real shapes (tensor names and
// shapes, parameter counts against the published totals), cut-down Qwen1.5-MoE, Qwen3-MoE and
// OLMoE checkpoints written and read back through our Torch-free loaders
// (common/model/model_config.h, common/model/checkpoint.h) with the config keys that change the
// computation, determinism across shard sizes, --force, and argument errors; --quant: the
// published per-expert bytes of each format (DESIGN section 12) from dry runs, and cut-down
// quantized checkpoints read back with every stored tensor of the routed experts, dequantized by
// hand against the float checkpoint of the same seed.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/json.h"
#include "common/model/checkpoint.h"
#include "common/model/model_config.h"
#include "common/model/quant.h"
#include "common/model/safetensors.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

struct RunResult {
  int code = -1;
  std::string out, err;
};

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// DIR/config.json, parsed (discarded when it is not JSON).
Json ReadConfig(const fs::path& dir) {
  return Json::parse(ReadAll(dir / "config.json"), nullptr, /*allow_exceptions=*/false);
}

// Each key of `want` is in `config` with that value.
void ExpectKeys(const Json& config, const Json& want) {
  for (const auto& [key, value] : want.items()) {
    ASSERT_TRUE(config.contains(key)) << "config.json has no " << key;
    EXPECT_EQ(config[key], value) << key;
  }
}

class MakeModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("fmoe-make-model-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs `fmoe-bench make-model ARGS` (each argument single-quoted).
  RunResult Run(const std::vector<std::string>& args) const {
    std::string cmd = std::string("'") + FMOE_BINARY_DIR + "/bin/fmoe-bench' make-model";
    for (const std::string& a : args) cmd += " '" + a + "'";
    const fs::path err = dir_ / "stderr.txt";
    cmd += " 2>'" + err.string() + "'";
    RunResult r;
    FILE* pipe = ::popen(cmd.c_str(), "r");
    if (pipe == nullptr) return r;
    char buf[65536];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), pipe)) > 0;) r.out.append(buf, n);
    const int status = ::pclose(pipe);
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.err = ReadAll(err);
    return r;
  }

  fs::path dir_;
};

// The number after "KEY: " in the summary, or -1.
long long SummaryNumber(const std::string& out, const std::string& key) {
  const size_t at = out.find("\n" + key + ": ");
  if (at == std::string::npos) return -1;
  return std::stoll(out.substr(at + key.size() + 3));
}

bool HasLine(const std::string& out, const std::string& prefix) {
  return out.find("\n" + prefix) != std::string::npos || out.rfind(prefix, 0) == 0;
}

TEST_F(MakeModelTest, DryRunsHaveTheRealShapesAndParameterCounts) {
  struct Case {
    const char* shape;
    long long params;  // Counted from the Hugging Face model definitions.
    double published;  // The model card's total.
    long long expert_bytes;
    long long experts;
    long long tensors;
    std::vector<std::string> lines;   // Tensor lines that must be there.
    std::vector<std::string> absent;  // Tensor name prefixes that must not.
  } cases[] = {
      {"mixtral-8x7b",
       46702792704,
       46.7e9,
       352321536,
       8,
       995,
       {"tensor model.embed_tokens.weight BF16 [32000, 4096] 262144000 ",
        "tensor model.layers.0.self_attn.q_proj.weight BF16 [4096, 4096] 33554432 ",
        "tensor model.layers.0.self_attn.k_proj.weight BF16 [1024, 4096] 8388608 ",
        "tensor model.layers.0.block_sparse_moe.gate.weight BF16 [8, 4096] 65536 ",
        "tensor model.layers.31.block_sparse_moe.experts.7.w1.weight BF16 [14336, 4096] ",
        "tensor model.layers.31.block_sparse_moe.experts.7.w2.weight BF16 [4096, 14336] 117440512 ",
        "tensor model.layers.31.post_attention_layernorm.weight BF16 [4096] 8192 ",
        "tensor model.norm.weight BF16 [4096] 8192 ",
        "tensor lm_head.weight BF16 [32000, 4096] 262144000 "},
       {"tensor model.layers.32.", "tensor model.layers.0.self_attn.q_proj.bias",
        "tensor model.layers.0.block_sparse_moe.experts.8."}},
      {"qwen1.5-moe-a2.7b",
       14315784192,
       14.3e9,
       17301504,
       60,
       4659,
       {"tensor model.embed_tokens.weight BF16 [151936, 2048] 622329856 ",
        "tensor model.layers.0.self_attn.q_proj.bias BF16 [2048] 4096 ",
        "tensor model.layers.0.self_attn.v_proj.bias BF16 [2048] 4096 ",
        "tensor model.layers.0.mlp.gate.weight BF16 [60, 2048] 245760 ",
        "tensor model.layers.23.mlp.experts.59.gate_proj.weight BF16 [1408, 2048] 5767168 ",
        "tensor model.layers.23.mlp.experts.59.down_proj.weight BF16 [2048, 1408] 5767168 ",
        "tensor model.layers.23.mlp.shared_expert.up_proj.weight BF16 [5632, 2048] 23068672 ",
        "tensor model.layers.23.mlp.shared_expert.down_proj.weight BF16 [2048, 5632] 23068672 ",
        "tensor model.layers.23.mlp.shared_expert_gate.weight BF16 [1, 2048] 4096 ",
        "tensor lm_head.weight BF16 [151936, 2048] 622329856 "},
       {"tensor model.layers.0.self_attn.o_proj.bias", "tensor model.norm.bias",
        "tensor lm_head.bias", "tensor model.layers.0.mlp.experts.60."}},
      {"phi-3.5-moe",
       41873153344,
       41.9e9,
       157286400,
       16,
       1957,
       {"tensor model.embed_tokens.weight BF16 [32064, 4096] 262668288 ",
        "tensor model.layers.0.self_attn.o_proj.bias BF16 [4096] 8192 ",
        "tensor model.layers.0.self_attn.k_proj.bias BF16 [1024] 2048 ",
        "tensor model.layers.0.block_sparse_moe.gate.weight BF16 [16, 4096] 131072 ",
        "tensor model.layers.31.block_sparse_moe.experts.15.w3.weight BF16 [6400, 4096] 52428800 ",
        "tensor model.layers.31.input_layernorm.bias BF16 [4096] 8192 ",
        "tensor model.norm.bias BF16 [4096] 8192 ", "tensor lm_head.bias BF16 [32064] 64128 "},
       {"tensor model.layers.32.", "tensor model.layers.0.block_sparse_moe.experts.16."}},
      {"qwen3-30b-a3b",
       30532122624,
       30.5e9,
       9437184,
       128,
       18867,
       {"tensor model.embed_tokens.weight BF16 [151936, 2048] 622329856 ",
        // 32 heads of head_dim 128: q is twice the hidden size.
        "tensor model.layers.0.self_attn.q_proj.weight BF16 [4096, 2048] 16777216 ",
        "tensor model.layers.0.self_attn.k_proj.weight BF16 [512, 2048] 2097152 ",
        "tensor model.layers.0.self_attn.v_proj.weight BF16 [512, 2048] 2097152 ",
        "tensor model.layers.0.self_attn.o_proj.weight BF16 [2048, 4096] 16777216 ",
        "tensor model.layers.0.self_attn.q_norm.weight BF16 [128] 256 ",
        "tensor model.layers.0.self_attn.k_norm.weight BF16 [128] 256 ",
        "tensor model.layers.0.mlp.gate.weight BF16 [128, 2048] 524288 ",
        "tensor model.layers.47.mlp.experts.127.gate_proj.weight BF16 [768, 2048] 3145728 ",
        "tensor model.layers.47.mlp.experts.127.up_proj.weight BF16 [768, 2048] 3145728 ",
        "tensor model.layers.47.mlp.experts.127.down_proj.weight BF16 [2048, 768] 3145728 ",
        "tensor model.layers.47.post_attention_layernorm.weight BF16 [2048] 4096 ",
        "tensor lm_head.weight BF16 [151936, 2048] 622329856 "},
       {"tensor model.layers.48.", "tensor model.layers.0.self_attn.q_proj.bias",
        "tensor model.layers.0.mlp.shared_expert", "tensor model.layers.0.mlp.experts.128.",
        "tensor model.layers.0.block_sparse_moe", "tensor model.norm.bias"}},
      {"olmoe-1b-7b",
       6919161856,
       6.9e9,
       12582912,
       64,
       3219,
       {"tensor model.embed_tokens.weight BF16 [50304, 2048] 206045184 ",
        "tensor model.layers.0.self_attn.q_proj.weight BF16 [2048, 2048] 8388608 ",
        "tensor model.layers.0.self_attn.k_proj.weight BF16 [2048, 2048] 8388608 ",
        // q_norm and k_norm span the whole projections, not one head.
        "tensor model.layers.0.self_attn.q_norm.weight BF16 [2048] 4096 ",
        "tensor model.layers.0.self_attn.k_norm.weight BF16 [2048] 4096 ",
        "tensor model.layers.0.mlp.gate.weight BF16 [64, 2048] 262144 ",
        "tensor model.layers.15.mlp.experts.63.gate_proj.weight BF16 [1024, 2048] 4194304 ",
        "tensor model.layers.15.mlp.experts.63.down_proj.weight BF16 [2048, 1024] 4194304 ",
        "tensor model.layers.15.input_layernorm.weight BF16 [2048] 4096 ",
        "tensor lm_head.weight BF16 [50304, 2048] 206045184 "},
       {"tensor model.layers.16.", "tensor model.layers.0.self_attn.o_proj.bias",
        "tensor model.layers.0.mlp.shared_expert", "tensor model.layers.0.mlp.experts.64."}},
      // 2 x 102400 x 2048 embeddings + 27 MLA layers of 13763072 + 2 norms, one dense MLP of
      // 3 x 10944 x 2048, 26 MoE layers of 64 experts, a gate and 2 shared experts (571080704).
      {"deepseek-v2-lite",
       15706484224,
       15.7e9,
       17301504,
       64,
       5291,
       {"tensor model.embed_tokens.weight BF16 [102400, 2048] 419430400 ",
        "tensor model.layers.0.self_attn.q_proj.weight BF16 [3072, 2048] 12582912 ",
        "tensor model.layers.0.self_attn.kv_a_proj_with_mqa.weight BF16 [576, 2048] 2359296 ",
        "tensor model.layers.0.self_attn.kv_a_layernorm.weight BF16 [512] 1024 ",
        "tensor model.layers.0.self_attn.kv_b_proj.weight BF16 [4096, 512] 4194304 ",
        "tensor model.layers.0.self_attn.o_proj.weight BF16 [2048, 2048] 8388608 ",
        "tensor model.layers.0.mlp.gate_proj.weight BF16 [10944, 2048] 44826624 ",
        "tensor model.layers.1.mlp.gate.weight BF16 [64, 2048] 262144 ",
        "tensor model.layers.26.mlp.experts.63.down_proj.weight BF16 [2048, 1408] 5767168 ",
        "tensor model.layers.26.mlp.shared_experts.up_proj.weight BF16 [2816, 2048] 11534336 ",
        "tensor lm_head.weight BF16 [102400, 2048] 419430400 "},
       {"tensor model.layers.27.", "tensor model.layers.0.mlp.experts.",
        "tensor model.layers.0.self_attn.q_a_proj", "tensor model.layers.1.mlp.gate_proj",
        "tensor model.layers.1.mlp.gate.e_score_correction_bias",
        "tensor model.layers.1.mlp.experts.64."}},
      // 61 MLA layers with q LoRA (187107328 + 2 norms), 3 dense MLPs of 3 x 18432 x 7168, 58 MoE
      // layers of 256 experts, a gate with its correction bias and a shared expert.
      {"deepseek-v3",
       671026419200,
       671e9,
       88080384,
       256,
       45395,
       {"tensor model.embed_tokens.weight BF16 [129280, 7168] 1853358080 ",
        "tensor model.layers.0.self_attn.q_a_proj.weight BF16 [1536, 7168] 22020096 ",
        "tensor model.layers.0.self_attn.q_a_layernorm.weight BF16 [1536] 3072 ",
        "tensor model.layers.0.self_attn.q_b_proj.weight BF16 [24576, 1536] 75497472 ",
        "tensor model.layers.0.self_attn.kv_b_proj.weight BF16 [32768, 512] 33554432 ",
        "tensor model.layers.0.self_attn.o_proj.weight BF16 [7168, 16384] 234881024 ",
        "tensor model.layers.2.mlp.down_proj.weight BF16 [7168, 18432] 264241152 ",
        "tensor model.layers.3.mlp.gate.weight BF16 [256, 7168] 3670016 ",
        "tensor model.layers.3.mlp.gate.e_score_correction_bias BF16 [256] 512 ",
        "tensor model.layers.60.mlp.experts.255.gate_proj.weight BF16 [2048, 7168] 29360128 ",
        "tensor model.layers.60.mlp.shared_experts.down_proj.weight BF16 [7168, 2048] 29360128 ",
        "tensor lm_head.weight BF16 [129280, 7168] 1853358080 "},
       {"tensor model.layers.61.", "tensor model.layers.2.mlp.experts.",
        "tensor model.layers.0.self_attn.q_proj", "tensor model.layers.3.mlp.experts.256."}},
      // 96 heads of 128 with q/k/v biases, one dense layer of 10944, 45 MoE layers of 128
      // experts, a gate with its correction bias and a shared expert.
      {"glm-4.5-air",
       106852251264,
       106e9,
       34603008,
       128,
       17925,
       {"tensor model.layers.0.self_attn.q_proj.weight BF16 [12288, 4096] 100663296 ",
        "tensor model.layers.0.self_attn.q_proj.bias BF16 [12288] 24576 ",
        "tensor model.layers.0.self_attn.o_proj.weight BF16 [4096, 12288] 100663296 ",
        "tensor model.layers.0.mlp.down_proj.weight BF16 [4096, 10944] 89653248 ",
        "tensor model.layers.1.mlp.gate.e_score_correction_bias BF16 [128] 256 ",
        "tensor model.layers.45.mlp.experts.127.up_proj.weight BF16 [1408, 4096] 11534336 ",
        "tensor model.layers.45.mlp.shared_experts.down_proj.weight BF16 [4096, 1408] 11534336 "},
       {"tensor model.layers.46.", "tensor model.layers.0.mlp.experts.",
        "tensor model.layers.0.self_attn.o_proj.bias", "tensor model.layers.0.self_attn.q_norm"}},
      // q/k norms over the whole projections, 256 experts under block_sparse_moe with the
      // correction bias on the block.
      {"minimax-m2",
       228689764864,
       230e9,
       28311552,
       256,
       48239,
       {"tensor model.layers.0.self_attn.q_norm.weight BF16 [6144] 12288 ",
        "tensor model.layers.0.self_attn.k_norm.weight BF16 [1024] 2048 ",
        "tensor model.layers.0.block_sparse_moe.e_score_correction_bias BF16 [256] 512 ",
        "tensor model.layers.61.block_sparse_moe.experts.255.w2.weight BF16 [3072, 1536] "
        "9437184 "},
       {"tensor model.layers.62.", "tensor model.layers.0.mlp.",
        "tensor model.layers.0.self_attn.q_proj.bias"}},
      // Fused experts with biases (3 x 2880 x 2880 + 2 x 2880 + 2880 parameters each), sinks,
      // q/k/v/o biases, a router with a bias.
      {"gpt-oss-20b",
       20914757184,
       20.9e9,
       49783680,
       32,
       411,
       {"tensor model.layers.0.self_attn.sinks BF16 [64] 128 ",
        "tensor model.layers.0.self_attn.o_proj.bias BF16 [2880] 5760 ",
        "tensor model.layers.0.mlp.router.bias BF16 [32] 64 ",
        "tensor model.layers.0.mlp.experts.gate_up_proj BF16 [32, 2880, 5760] 1061683200 ",
        "tensor model.layers.23.mlp.experts.down_proj_bias BF16 [32, 2880] 184320 "},
       {"tensor model.layers.24.", "tensor model.layers.0.mlp.experts.0."}},
      {"gpt-oss-120b",
       116829156672,
       116.8e9,
       49783680,
       128,
       615,
       {"tensor model.layers.35.mlp.experts.down_proj BF16 [128, 2880, 2880] 2123366400 "},
       {"tensor model.layers.36."}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.shape);
    const fs::path out = dir_ / c.shape;
    RunResult r = Run({"--shape", c.shape, "--dry-run", "--out", out.string()});
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_FALSE(fs::exists(out)) << "a dry run wrote " << out;
    const long long params = SummaryNumber(r.out, "parameters");
    EXPECT_EQ(params, c.params);
    // 0.5%, or 1% where the card rounds to whole billions: GLM-4.5-Air's "106B" (the tensors
    // count 106.85 B) and MiniMax-M2's "230B" (228.69 B; make_model_shapes.cc says more).
    const std::string name = c.shape;
    const double tolerance = name == "glm-4.5-air" || name == "minimax-m2" ? 0.01 : 0.005;
    EXPECT_LT(std::abs(static_cast<double>(params) - c.published) / c.published, tolerance);
    EXPECT_EQ(SummaryNumber(r.out, "bytes"), 2 * c.params);  // bfloat16.
    EXPECT_EQ(SummaryNumber(r.out, "routed expert bytes"), c.expert_bytes);
    EXPECT_EQ(SummaryNumber(r.out, "experts per layer"), c.experts);
    EXPECT_EQ(SummaryNumber(r.out, "tensors"), c.tensors);
    long long lines = 0, bytes = 0;
    std::istringstream in(r.out);
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("tensor ", 0) != 0) continue;
      ++lines;
      std::istringstream fields(line.substr(line.find(']') + 1));
      long long b = 0;
      fields >> b;
      bytes += b;
    }
    EXPECT_EQ(lines, c.tensors);
    EXPECT_EQ(bytes, 2 * c.params);
    for (const std::string& want : c.lines) EXPECT_TRUE(HasLine(r.out, want)) << want;
    for (const std::string& not_want : c.absent) EXPECT_FALSE(HasLine(r.out, not_want)) << not_want;
  }

  // float32 doubles the bytes, not the parameters; --layers cuts whole layers.
  RunResult f32 = Run({"--shape", "mixtral-8x7b", "--dry-run", "--dtype", "float32"});
  ASSERT_EQ(f32.code, 0) << f32.err;
  EXPECT_EQ(SummaryNumber(f32.out, "bytes"), 4 * 46702792704LL);
  EXPECT_TRUE(HasLine(f32.out, "tensor lm_head.weight F32 [32000, 4096] 524288000 "));
  RunResult two = Run({"--shape", "mixtral-8x7b", "--dry-run", "--layers", "2"});
  ASSERT_EQ(two.code, 0) << two.err;
  const long long per_layer = (46702792704LL - 2LL * 32000 * 4096 - 4096) / 32;
  EXPECT_EQ(SummaryNumber(two.out, "parameters"), 2LL * 32000 * 4096 + 4096 + 2 * per_layer);
}

// DeepSeek cut to a few layers: V3's tensors keep the real attention, dense-layer and router
// layout; a written V2-Lite reads through our config reader as the real model.
TEST_F(MakeModelTest, FewLayersOfDeepseekKeepTheRealLayout) {
  RunResult r = Run({"--shape", "deepseek-v3", "--layers", "4", "--experts", "16", "--vocab",
                     "4096", "--dry-run", "--out", (dir_ / "v3").string()});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(SummaryNumber(r.out, "experts per layer"), 16);
  EXPECT_EQ(SummaryNumber(r.out, "routed experts"), 16);  // One MoE layer after 3 dense ones.
  EXPECT_TRUE(HasLine(r.out, "tensor model.layers.2.mlp.up_proj.weight BF16 [18432, 7168] "));
  EXPECT_TRUE(HasLine(r.out, "tensor model.layers.3.mlp.gate.e_score_correction_bias BF16 [16] "));
  EXPECT_TRUE(HasLine(r.out, "tensor model.layers.3.mlp.experts.15.up_proj.weight BF16 "));
  EXPECT_FALSE(HasLine(r.out, "tensor model.layers.2.mlp.experts."));
  // Two layers: the dense prefix is cut to one so that a MoE layer stays.
  r = Run({"--shape", "deepseek-v3", "--layers", "2", "--experts", "16", "--vocab", "4096",
           "--dry-run", "--out", (dir_ / "v3-two").string()});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(HasLine(r.out, "tensor model.layers.1.mlp.experts.0.gate_proj.weight BF16 "));

  const fs::path out = dir_ / "deepseek-v2-lite";
  r = Run({"--shape", "deepseek-v2-lite", "--layers", "2", "--experts", "6", "--vocab", "4096",
           "--out", out.string()});
  ASSERT_EQ(r.code, 0) << r.err;
  auto info = LoadModelInfo(out.string());
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->architecture, "DeepseekV2ForCausalLM");
  EXPECT_EQ(info->moe_layers, std::vector<uint32_t>{1});
  EXPECT_EQ(info->num_experts, 6u);
  EXPECT_EQ(info->top_k, 6u);
  ASSERT_TRUE(info->mla.has_value());
  EXPECT_EQ(info->mla->q_lora_rank, 0u);
  EXPECT_EQ(info->mla->kv_lora_rank, 512u);
  EXPECT_EQ(info->head_dim, 64u);
  ASSERT_TRUE(info->yarn.has_value());
  EXPECT_DOUBLE_EQ(info->yarn->mscale_all_dim, 0.707);
  EXPECT_EQ(info->routing.groups, GroupScoring::kNone);
  EXPECT_FALSE(info->routing.correction_bias);
  EXPECT_EQ(info->dense_intermediate_size, 10944u);
  EXPECT_EQ(info->shared_expert_intermediate_size, 2816u);
  // MLA's cache against a plain one: 576 values per layer against 16 x 320.
  EXPECT_EQ(KvBytesPerToken(*info, 2), 2u * 576u * 2u);
  EXPECT_EQ(ExpandedKvBytesPerToken(*info, 2), 2u * 5120u * 2u);
}

// Phi-3.5-MoE: the model card's 6.6B active parameters (2 of 16 experts per layer) beside its
// 41.9B total; a few layers written read through our config reader as the runtime runs them.
TEST_F(MakeModelTest, PhiMoeHasTheModelCardsActiveParametersAndReadsAsTheRuntimeRunsIt) {
  RunResult r = Run({"--shape", "phi-3.5-moe", "--dry-run", "--out", (dir_ / "dry").string()});
  ASSERT_EQ(r.code, 0) << r.err;
  const long long total = SummaryNumber(r.out, "parameters");
  const long long expert = SummaryNumber(r.out, "routed expert bytes") / 2;  // bfloat16.
  EXPECT_EQ(expert, 3LL * 6400 * 4096);
  const long long active = total - 32LL * (16 - 2) * expert;
  EXPECT_EQ(active, 6640999744LL);
  EXPECT_LT(std::abs(static_cast<double>(active) - 6.6e9) / 6.6e9, 0.01);

  const fs::path out = dir_ / "phi";
  r = Run({"--shape", "phi-3.5-moe", "--layers", "2", "--experts", "4", "--vocab", "4096", "--out",
           out.string()});
  ASSERT_EQ(r.code, 0) << r.err;
  auto info = LoadModelInfo(out.string());
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->architecture, "PhimoeForCausalLM");
  EXPECT_EQ(info->runtime_unsupported, "");
  EXPECT_EQ(info->routing.scoring, RouterScoring::kSparseMixer);
  EXPECT_FLOAT_EQ(info->routing.jitter_eps, 0.01f);
  EXPECT_TRUE(info->layer_norm);
  EXPECT_TRUE(info->qkv_bias);
  EXPECT_TRUE(info->o_bias);
  EXPECT_TRUE(info->lm_head_bias);
  EXPECT_FALSE(info->longrope.has_value()) << "make-model writes rope_scaling null";
  EXPECT_EQ(info->head_dim, 128u);
  EXPECT_EQ(info->num_key_value_heads, 8u);
  EXPECT_EQ(KvBytesPerToken(*info, 2), 2u * 2u * 8u * 128u * 2u);
}

// FNV-1a of a tensor's bytes.
uint64_t Hash(std::span<const std::byte> data) {
  uint64_t h = 1469598103934665603ull;
  for (std::byte b : data) h = (h ^ static_cast<uint8_t>(b)) * 1099511628211ull;
  return h;
}

TEST_F(MakeModelTest, ReducedQwenLoadsThroughOurLoadersAndIsDeterministic) {
  const fs::path out = dir_ / "qwen";
  const std::vector<std::string> args = {
      "--shape", "qwen1.5-moe-a2.7b", "--layers", "1",      "--experts",
      "4",       "--vocab",           "4096",     "--seed", "7",
      "--out",   out.string()};
  std::vector<std::string> sharded = args;
  sharded.insert(sharded.end(), {"--shard-gb", "0.05"});
  RunResult r = Run(sharded);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(SummaryNumber(r.out, "parameters"), 102782976);

  auto info = LoadModelInfo(out.string());
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->architecture, "Qwen2MoeForCausalLM");
  EXPECT_EQ(info->num_hidden_layers, 1u);
  EXPECT_EQ(info->num_moe_layers, 1u);
  EXPECT_EQ(info->num_experts, 4u);
  EXPECT_EQ(info->top_k, 4u);
  EXPECT_EQ(info->hidden_size, 2048u);
  EXPECT_EQ(info->vocab_size, 4096u);
  EXPECT_EQ(info->num_attention_heads, 16u);
  EXPECT_EQ(info->num_key_value_heads, 16u);
  EXPECT_EQ(info->head_dim, 128u);
  EXPECT_EQ(info->torch_dtype, "bfloat16");
  EXPECT_FALSE(info->tie_word_embeddings);
  EXPECT_DOUBLE_EQ(info->rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(info->rms_norm_eps, 1e-6);
  // 151643 does not fit a 4096 vocabulary: the copied tokenizer's ids stand in.
  EXPECT_EQ(info->bos_token_id, 1);
  EXPECT_EQ(info->eos_token_ids, std::vector<int32_t>{2});
  EXPECT_EQ(info->weight_files.size(), 5u);
  // The keys of Qwen2MoeConfig that change the computation, at the real model's values.
  ExpectKeys(ReadConfig(out), {{"architectures", {"Qwen2MoeForCausalLM"}},
                               {"model_type", "qwen2_moe"},
                               {"qkv_bias", true},
                               {"decoder_sparse_step", 1},
                               {"mlp_only_layers", Json::array()},
                               {"norm_topk_prob", false},
                               {"moe_intermediate_size", 1408},
                               {"shared_expert_intermediate_size", 5632},
                               {"intermediate_size", 5632},
                               {"num_experts", 4},
                               {"num_experts_per_tok", 4},
                               {"use_sliding_window", false},
                               {"rope_scaling", nullptr},
                               {"hidden_act", "silu"}});
  EXPECT_TRUE(fs::exists(out / "model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(out / "README.md"));
  for (const char* name : {"tokenizer.json", "tokenizer_config.json"}) {
    EXPECT_EQ(ReadAll(out / name),
              ReadAll(fs::path(FMOE_SOURCE_DIR) / "deploy/models/tiny-moe" / name))
        << name;
  }

  // Every tensor a Qwen2MoeForCausalLM checkpoint has, written out by hand from the model
  // definition, with nothing else.
  std::map<std::string, std::vector<int64_t>> want = {
      {"model.embed_tokens.weight", {4096, 2048}},
      {"model.norm.weight", {2048}},
      {"lm_head.weight", {4096, 2048}},
  };
  const std::string p = "model.layers.0.";
  for (const char* proj : {"q_proj", "k_proj", "v_proj"}) {
    want[p + "self_attn." + proj + ".weight"] = {2048, 2048};
    want[p + "self_attn." + proj + ".bias"] = {2048};
  }
  want[p + "self_attn.o_proj.weight"] = {2048, 2048};
  want[p + "mlp.gate.weight"] = {4, 2048};
  for (int e = 0; e < 4; ++e) {
    const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
    want[q + "gate_proj.weight"] = {1408, 2048};
    want[q + "up_proj.weight"] = {1408, 2048};
    want[q + "down_proj.weight"] = {2048, 1408};
  }
  want[p + "mlp.shared_expert.gate_proj.weight"] = {5632, 2048};
  want[p + "mlp.shared_expert.up_proj.weight"] = {5632, 2048};
  want[p + "mlp.shared_expert.down_proj.weight"] = {2048, 5632};
  want[p + "mlp.shared_expert_gate.weight"] = {1, 2048};
  want[p + "input_layernorm.weight"] = {2048};
  want[p + "post_attention_layernorm.weight"] = {2048};

  std::map<std::string, uint64_t> hashes;
  {
    auto ckpt = Checkpoint::Open(out.string());
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    EXPECT_EQ((*ckpt)->TensorNames().size(), want.size());
    for (const auto& [name, shape] : want) {
      auto view = (*ckpt)->Get(name, shape);
      ASSERT_TRUE(view.ok()) << view.status().ToString();
      EXPECT_EQ((*view)->dtype, DType::kBF16) << name;
      hashes[name] = Hash((*view)->data);
    }
    // Norms are 1, biases 0, weights small, finite and not constant.
    auto values = [&](const std::string& name) {
      const TensorView* v = (*ckpt)->Find(name);
      std::vector<float> f(static_cast<size_t>(v->numel()));
      EXPECT_TRUE(ConvertToF32(v->dtype, v->data, f).ok());
      return f;
    };
    for (float v : values(p + "input_layernorm.weight")) ASSERT_EQ(v, 1.0f);
    for (float v : values(p + "self_attn.k_proj.bias")) ASSERT_EQ(v, 0.0f);
    const std::vector<float> w = values(p + "mlp.experts.3.down_proj.weight");
    double sum = 0, sq = 0;
    for (float v : w) {
      ASSERT_TRUE(std::isfinite(v));
      ASSERT_LE(std::abs(v), 0.035f);
      sum += v;
      sq += double{v} * v;
    }
    const double mean = sum / static_cast<double>(w.size());
    const double sd = std::sqrt(sq / static_cast<double>(w.size()) - mean * mean);
    EXPECT_NEAR(sd, 0.02, 0.001);
    EXPECT_NEAR(mean, 0.0, 0.001);
  }

  // Without --force a non-empty directory is refused; with it, the old weights go (a stray
  // *.safetensors too), and one file with the same seed holds the same bytes.
  std::ofstream(out / "stray.safetensors") << "junk";
  RunResult refused = Run(args);
  EXPECT_EQ(refused.code, 2);
  EXPECT_NE(refused.err.find("is not empty"), std::string::npos) << refused.err;
  std::vector<std::string> forced = args;
  forced.push_back("--force");
  RunResult again = Run(forced);
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_FALSE(fs::exists(out / "stray.safetensors"));
  EXPECT_FALSE(fs::exists(out / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(out / "model-00001-of-00005.safetensors"));
  auto info2 = LoadModelInfo(out.string());
  ASSERT_TRUE(info2.ok()) << info2.status().ToString();
  EXPECT_EQ(info2->weight_files, std::vector<std::string>{"model.safetensors"});
  auto ckpt = Checkpoint::Open(out.string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  for (const auto& [name, hash] : hashes) {
    const TensorView* v = (*ckpt)->Find(name);
    ASSERT_NE(v, nullptr) << name;
    EXPECT_EQ(Hash(v->data), hash) << name;
  }
  for (const auto& entry : fs::directory_iterator(out)) {
    EXPECT_EQ(entry.path().string().find(".tmp."), std::string::npos) << entry.path();
  }
}

// The tensors a cut-down checkpoint of `shape` must hold with one layer: the embedding, the
// attention projections of `q_dim`/`kv_dim` rows, q/k norms of `q_norm`/`k_norm`, the router and
// `experts` experts of width `inter` under mlp., the layer norms, the final norm and lm_head.
std::map<std::string, std::vector<int64_t>> OneLayerTensors(int64_t vocab, int64_t h, int64_t q_dim,
                                                            int64_t kv_dim, int64_t q_norm,
                                                            int64_t k_norm, int64_t experts,
                                                            int64_t inter) {
  std::map<std::string, std::vector<int64_t>> want = {
      {"model.embed_tokens.weight", {vocab, h}},
      {"model.norm.weight", {h}},
      {"lm_head.weight", {vocab, h}},
  };
  const std::string p = "model.layers.0.";
  want[p + "self_attn.q_proj.weight"] = {q_dim, h};
  want[p + "self_attn.k_proj.weight"] = {kv_dim, h};
  want[p + "self_attn.v_proj.weight"] = {kv_dim, h};
  want[p + "self_attn.o_proj.weight"] = {h, q_dim};
  want[p + "self_attn.q_norm.weight"] = {q_norm};
  want[p + "self_attn.k_norm.weight"] = {k_norm};
  want[p + "mlp.gate.weight"] = {experts, h};
  for (int64_t e = 0; e < experts; ++e) {
    const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
    want[q + "gate_proj.weight"] = {inter, h};
    want[q + "up_proj.weight"] = {inter, h};
    want[q + "down_proj.weight"] = {h, inter};
  }
  want[p + "input_layernorm.weight"] = {h};
  want[p + "post_attention_layernorm.weight"] = {h};
  return want;
}

// Opens `dir` and expects exactly the tensors `want`, in bfloat16; q/k norms are ones.
void ExpectTensors(const fs::path& dir, const std::map<std::string, std::vector<int64_t>>& want) {
  auto ckpt = Checkpoint::Open(dir.string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  EXPECT_EQ((*ckpt)->TensorNames().size(), want.size());
  for (const auto& [name, shape] : want) {
    auto view = (*ckpt)->Get(name, shape);
    ASSERT_TRUE(view.ok()) << view.status().ToString();
    EXPECT_EQ((*view)->dtype, DType::kBF16) << name;
  }
  const TensorView* k_norm = (*ckpt)->Find("model.layers.0.self_attn.k_norm.weight");
  ASSERT_NE(k_norm, nullptr);
  std::vector<float> ones(static_cast<size_t>(k_norm->numel()));
  ASSERT_TRUE(ConvertToF32(k_norm->dtype, k_norm->data, ones).ok());
  for (float v : ones) ASSERT_EQ(v, 1.0f);
}

TEST_F(MakeModelTest, ReducedQwen3MoeLoadsThroughOurLoaders) {
  const fs::path out = dir_ / "qwen3";
  RunResult r = Run({"--shape", "qwen3-30b-a3b", "--layers", "1", "--experts", "8", "--vocab",
                     "4096", "--out", out.string()});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(SummaryNumber(r.out, "parameters"), 73423104);

  auto info = LoadModelInfo(out.string());
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->architecture, "Qwen3MoeForCausalLM");
  EXPECT_EQ(info->num_hidden_layers, 1u);
  EXPECT_EQ(info->num_moe_layers, 1u);
  EXPECT_EQ(info->num_experts, 8u);
  EXPECT_EQ(info->top_k, 8u);
  EXPECT_EQ(info->hidden_size, 2048u);
  EXPECT_EQ(info->num_attention_heads, 32u);
  EXPECT_EQ(info->num_key_value_heads, 4u);
  EXPECT_EQ(info->head_dim, 128u) << "set in config.json, not hidden_size / heads";
  EXPECT_EQ(info->max_position_embeddings, 40960u);
  EXPECT_DOUBLE_EQ(info->rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(info->rms_norm_eps, 1e-6);
  EXPECT_FALSE(info->tie_word_embeddings);
  EXPECT_FALSE(info->sliding_window.has_value());
  // 151643/151645 do not fit a 4096 vocabulary: the copied tokenizer's ids stand in.
  EXPECT_EQ(info->bos_token_id, 1);
  EXPECT_EQ(info->eos_token_ids, std::vector<int32_t>{2});
  // The keys of Qwen3MoeConfig that change the computation, at the real model's values.
  ExpectKeys(ReadConfig(out), {{"model_type", "qwen3_moe"},
                               {"head_dim", 128},
                               {"attention_bias", false},
                               {"norm_topk_prob", true},
                               {"decoder_sparse_step", 1},
                               {"mlp_only_layers", Json::array()},
                               {"moe_intermediate_size", 768},
                               {"intermediate_size", 6144},
                               {"use_sliding_window", false},
                               {"sliding_window", nullptr},
                               {"max_window_layers", 48},
                               {"rope_scaling", nullptr},
                               {"hidden_act", "silu"}});
  const Json config = ReadConfig(out);
  EXPECT_FALSE(config.contains("shared_expert_intermediate_size"));
  EXPECT_FALSE(config.contains("num_local_experts"));
  ExpectTensors(out, OneLayerTensors(4096, 2048, /*q_dim=*/4096, /*kv_dim=*/512, /*q_norm=*/128,
                                     /*k_norm=*/128, /*experts=*/8, /*inter=*/768));
}

TEST_F(MakeModelTest, ReducedOlmoeLoadsThroughOurLoaders) {
  const fs::path out = dir_ / "olmoe";
  RunResult r = Run({"--shape", "olmoe-1b-7b", "--layers", "1", "--experts", "8", "--vocab", "4096",
                     "--out", out.string()});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(SummaryNumber(r.out, "parameters"), 83912704);
  EXPECT_NE(r.out.find("note: eos id 50279 does not fit vocab 4096"), std::string::npos) << r.out;

  auto info = LoadModelInfo(out.string());
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->architecture, "OlmoeForCausalLM");
  EXPECT_EQ(info->num_moe_layers, 1u);
  EXPECT_EQ(info->num_experts, 8u);
  EXPECT_EQ(info->top_k, 8u);
  EXPECT_EQ(info->intermediate_size, 1024u);
  EXPECT_EQ(info->num_attention_heads, 16u);
  EXPECT_EQ(info->num_key_value_heads, 16u);
  EXPECT_EQ(info->head_dim, 128u);
  EXPECT_EQ(info->max_position_embeddings, 4096u);
  EXPECT_DOUBLE_EQ(info->rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(info->rms_norm_eps, 1e-5);
  // OLMoE has no bos id, and keeps none; 50279 does not fit: the tokenizer's eos stands in.
  EXPECT_FALSE(info->bos_token_id.has_value());
  EXPECT_EQ(info->eos_token_ids, std::vector<int32_t>{2});
  ExpectKeys(ReadConfig(out), {{"model_type", "olmoe"},
                               {"bos_token_id", nullptr},
                               {"pad_token_id", 1},
                               {"attention_bias", false},
                               {"clip_qkv", nullptr},
                               {"norm_topk_prob", false},
                               {"rope_scaling", nullptr},
                               {"hidden_act", "silu"},
                               {"tie_word_embeddings", false}});
  ExpectTensors(out, OneLayerTensors(4096, 2048, /*q_dim=*/2048, /*kv_dim=*/2048,
                                     /*q_norm=*/2048, /*k_norm=*/2048, /*experts=*/8,
                                     /*inter=*/1024));

  // With the real vocabulary the real ids are written: eos 50279 and no bos.
  const fs::path full = dir_ / "olmoe-vocab";
  r = Run({"--shape", "olmoe-1b-7b", "--layers", "1", "--experts", "8", "--out", full.string()});
  ASSERT_EQ(r.code, 0) << r.err;
  ExpectKeys(ReadConfig(full), {{"bos_token_id", nullptr}, {"eos_token_id", 50279}});
}

TEST_F(MakeModelTest, BadArgumentsExitTwoAndIoFailuresOne) {
  const std::string out = (dir_ / "m").string();
  struct Case {
    std::vector<std::string> args;
    const char* error;
  } cases[] = {
      {{"--dry-run"}, "--shape: required"},
      {{"--shape", "mixtral", "--dry-run"},
       "--shape: \"mixtral\" is not one of mixtral-8x7b, qwen1.5-moe-a2.7b, phi-3.5-moe, "
       "qwen3-30b-a3b, olmoe-1b-7b, deepseek-v2-lite, deepseek-v3, kimi-k2, glm-4.5-air, "
       "minimax-m2, gpt-oss-20b, gpt-oss-120b"},
      {{"--shape", "gpt-oss-20b", "--dry-run", "--quant", "fp8"},
       "--quant: fp8 is not a format of gpt-oss-20b (gpt-oss's experts are released in mxfp4)"},
      {{"--shape", "mixtral-8x7b", "--dry-run", "--quant", "mxfp4"},
       "--quant: mxfp4 is not a format of mixtral-8x7b (mxfp4 is gpt-oss's format)"},
      {{"--shape", "mixtral-8x7b"}, "--out: required"},
      {{"--shape", "mixtral-8x7b", "--dry-run", "--layers", "0"}, "--layers: 0 is not in [1, 32]"},
      {{"--shape", "phi-3.5-moe", "--dry-run", "--layers", "33"}, "--layers: 33 is not in [1, 32]"},
      {{"--shape", "mixtral-8x7b", "--dry-run", "--layers", "two"}, "is not a whole number"},
      {{"--shape", "qwen1.5-moe-a2.7b", "--dry-run", "--experts", "3"},
       "--experts: 3 is not in [4, 60]"},
      {{"--shape", "qwen3-30b-a3b", "--dry-run", "--experts", "7"},
       "--experts: 7 is not in [8, 128]"},
      {{"--shape", "olmoe-1b-7b", "--dry-run", "--layers", "17"}, "--layers: 17 is not in [1, 16]"},
      {{"--shape", "mixtral-8x7b", "--dry-run", "--vocab", "1000"},
       "--vocab: 1000 is not in [4096, 32000]"},
      {{"--shape", "mixtral-8x7b", "--dry-run", "--dtype", "int8"}, "--dtype: \"int8\""},
      {{"--shape", "mixtral-8x7b", "--dry-run", "--shard-gb", "-1"}, "--shard-gb: \"-1\""},
      {{"--shape", "mixtral-8x7b", "--dry-run", "--seed", "x"}, "--seed: \"x\""},
      {{"--shape", "mixtral-8x7b", "--dry-run", "--colour", "red"}, "unexpected arguments"},
      {{"--shape", "mixtral-8x7b", "--out", out, "--tokenizer", (dir_ / "none").string()},
       "tokenizer.json: no such file"},
  };
  for (const Case& c : cases) {
    RunResult r = Run(c.args);
    EXPECT_EQ(r.code, 2) << c.error << "\n" << r.err;
    EXPECT_NE(r.err.find(c.error), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
    EXPECT_FALSE(fs::exists(out));
  }

  // --out under a regular file: an I/O failure, naming the path.
  std::ofstream(dir_ / "file") << "x";
  const std::string under_file = (dir_ / "file" / "m").string();
  RunResult r = Run({"--shape", "qwen1.5-moe-a2.7b", "--layers", "1", "--experts", "4", "--vocab",
                     "4096", "--out", under_file});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find(under_file), std::string::npos) << r.err;

  // --out that is a file is a bad argument.
  r = Run({"--shape", "mixtral-8x7b", "--out", (dir_ / "file").string()});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("is not a directory"), std::string::npos) << r.err;
}

// The number after "KEY: ... (... , " up to " MiB" on the summary line KEY, or -1.
double SummaryMib(const std::string& out, const std::string& key) {
  const size_t at = out.find("\n" + key + ": ");
  if (at == std::string::npos) return -1;
  const size_t end = out.find(" MiB", at);
  const size_t begin = out.rfind(", ", end);
  if (end == std::string::npos || begin == std::string::npos || begin < at) return -1;
  return std::stod(out.substr(begin + 2, end - begin - 2));
}

// DESIGN section 12's bytes per routed expert (weights and scales), from the dry runs' summary.
TEST_F(MakeModelTest, QuantizedDryRunsHaveThePublishedBytesPerRoutedExpert) {
  struct Case {
    const char* shape;
    const char* quant;
    double mib;  // DESIGN section 12's table.
    std::vector<std::string> lines;
  } cases[] = {
      {"deepseek-v3",
       "fp8",
       42.0,
       {"tensor model.layers.3.mlp.experts.0.gate_proj.weight F8_E4M3 [2048, 7168] 14680064 ",
        "tensor model.layers.3.mlp.experts.0.gate_proj.weight_scale_inv F32 [16, 56] 3584 ",
        "tensor model.layers.0.self_attn.q_a_proj.weight F8_E4M3 [1536, 7168] ",
        "tensor model.layers.3.mlp.shared_experts.down_proj.weight_scale_inv F32 [56, 16] ",
        "tensor model.layers.3.mlp.gate.weight BF16 [256, 7168] ",
        "tensor lm_head.weight BF16 [129280, 7168] "}},
      {"deepseek-v3",
       "gptq",
       21.9,
       {"tensor model.layers.3.mlp.experts.0.down_proj.qweight I32 [256, 7168] 7340032 ",
        "tensor model.layers.3.mlp.experts.0.down_proj.qzeros I32 [16, 896] 57344 ",
        "tensor model.layers.3.mlp.experts.0.down_proj.scales F16 [16, 7168] 229376 ",
        "tensor model.layers.3.mlp.experts.0.down_proj.g_idx I32 [2048] 8192 ",
        "tensor model.layers.0.self_attn.o_proj.qweight I32 [2048, 7168] "}},
      {"deepseek-v3",
       "int4-g128",
       21.7,
       {"tensor model.layers.3.mlp.experts.0.up_proj.weight_packed I32 [2048, 896] 7340032 ",
        "tensor model.layers.3.mlp.experts.0.up_proj.weight_scale BF16 [2048, 56] 229376 ",
        "tensor model.layers.3.mlp.experts.0.up_proj.weight_shape I64 [2] 16 ",
        "tensor model.layers.3.mlp.shared_experts.up_proj.weight BF16 [2048, 7168] ",
        "tensor model.layers.0.self_attn.o_proj.weight BF16 [7168, 16384] "}},
      // Kimi-K2-Thinking: DeepSeek-V3's expert shape (7168 x 2048) in INT4 g32.
      {"kimi-k2",
       "int4-g32",
       23.6,
       {"tensor model.layers.1.mlp.experts.0.up_proj.weight_scale BF16 [2048, 224] 917504 ",
        "tensor model.layers.1.mlp.experts.383.down_proj.weight_packed I32 [7168, 256] 7340032 ",
        "tensor model.layers.1.mlp.shared_experts.up_proj.weight BF16 [2048, 7168] ",
        "tensor model.layers.0.self_attn.q_b_proj.weight BF16 [12288, 1536] "}},
      {"qwen3-30b-a3b",
       "fp8",
       4.50,
       {"tensor model.layers.0.mlp.experts.0.down_proj.weight_scale_inv F32 [16, 6] 384 ",
        "tensor model.layers.0.self_attn.k_proj.weight F8_E4M3 [512, 2048] 1048576 ",
        "tensor model.layers.0.self_attn.q_norm.weight BF16 [128] "}},
      // gpt-oss as released: 2880 x 5760 and 2880 x 2880 at 17/32 bytes a value, and the
      // biases (bfloat16): 12.6 MiB.
      {"gpt-oss-120b",
       "mxfp4",
       12.62,
       {"tensor model.layers.0.mlp.experts.gate_up_proj_blocks U8 [128, 5760, 90, 16] "
        "1061683200 ",
        "tensor model.layers.0.mlp.experts.gate_up_proj_scales U8 [128, 5760, 90] 66355200 ",
        "tensor model.layers.35.mlp.experts.down_proj_blocks U8 [128, 2880, 90, 16] 530841600 ",
        "tensor model.layers.35.mlp.experts.down_proj_bias BF16 [128, 2880] ",
        "tensor model.layers.0.mlp.router.weight BF16 [128, 2880] ",
        "tensor model.layers.0.self_attn.q_proj.weight BF16 [4096, 2880] "}},
      {"qwen3-30b-a3b",
       "gptq",
       2.36,
       {"tensor model.layers.0.mlp.experts.0.gate_proj.qweight I32 [256, 768] 786432 "}},
      {"qwen3-30b-a3b",
       "int4-g128",
       2.32,
       {"tensor model.layers.0.mlp.experts.0.down_proj.weight_packed I32 [2048, 96] 786432 "}},
      {"qwen3-30b-a3b",
       "awq",
       2.34,  // Not in the table: GPTQ's bytes without g_idx.
       {"tensor model.layers.0.mlp.experts.0.gate_proj.qweight I32 [2048, 96] 786432 ",
        "tensor model.layers.0.mlp.experts.0.gate_proj.qzeros I32 [16, 96] 6144 ",
        "tensor model.layers.0.mlp.experts.0.gate_proj.scales F16 [16, 768] 24576 "}},
      {"mixtral-8x7b",
       "fp8",
       168,
       {"tensor model.layers.0.block_sparse_moe.experts.0.w2.weight F8_E4M3 [4096, 14336] "}},
      {"mixtral-8x7b",
       "gptq",
       87.4,
       {"tensor model.layers.0.block_sparse_moe.experts.0.w1.g_idx I32 [4096] "}},
      {"mixtral-8x7b",
       "int4-g128",
       86.6,
       {"tensor model.layers.0.block_sparse_moe.experts.0.w3.weight_scale BF16 [14336, 32] "}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.shape) + " " + c.quant);
    RunResult r = Run({"--shape", c.shape, "--quant", c.quant, "--dry-run"});
    ASSERT_EQ(r.code, 0) << r.err;
    const long long expert = SummaryNumber(r.out, "routed expert bytes");
    const double mib = static_cast<double>(expert) / (1 << 20);
    EXPECT_LT(std::abs(mib - c.mib) / c.mib, 0.01) << mib << " MiB";
    EXPECT_NEAR(SummaryMib(r.out, "routed expert bytes"), mib, 0.005);
    EXPECT_NE(r.out.find(" bytes/param; 3 x "), std::string::npos);
    EXPECT_TRUE(HasLine(r.out, "quantization: ")) << r.out.substr(r.out.rfind("total: "));
    for (const std::string& want : c.lines) EXPECT_TRUE(HasLine(r.out, want)) << want;
    // The summary's bytes are the tensor lines' bytes.
    long long bytes = 0;
    std::istringstream in(r.out);
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("tensor ", 0) != 0) continue;
      std::istringstream fields(line.substr(line.find(']') + 1));
      long long b = 0;
      fields >> b;
      bytes += b;
    }
    EXPECT_EQ(bytes, SummaryNumber(r.out, "bytes"));
  }
  // The bytes per parameter of the formats.
  RunResult r =
      Run({"--shape", "deepseek-v3", "--quant", "int4-g32", "--dry-run", "--layers", "4"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("23.63 MiB, 0.5625 bytes/param"), std::string::npos) << r.out;
  r = Run({"--shape", "deepseek-v3", "--dry-run", "--layers", "4"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("84.00 MiB, 2.0000 bytes/param"), std::string::npos);

  // A shape the format cannot pack is refused, naming the tensor: DeepSeek-V2-Lite's dense MLP
  // is 10944 wide, not a multiple of AWQ's group of 128.
  r = Run({"--shape", "deepseek-v2-lite", "--quant", "awq", "--dry-run"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--quant awq: tensor model.layers.0.mlp.down_proj.weight [2048, 10944]: "
                       "input size is not a multiple of the group size 128"),
            std::string::npos)
      << r.err;
  r = Run({"--shape", "mixtral-8x7b", "--quant", "nf4", "--dry-run"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--quant: \"nf4\" is not one of fp8, int4-g32, int4-g128, gptq, awq"),
            std::string::npos)
      << r.err;
}

// A tensor's values as float32 (F32, F16, BF16).
std::vector<float> Floats(const TensorView& v) {
  std::vector<float> f(static_cast<size_t>(v.numel()));
  EXPECT_TRUE(ConvertToF32(v.dtype, v.data, f).ok()) << v.name;
  return f;
}

// Element i of an I32 tensor, as the bits of a uint32.
uint32_t Word(const TensorView& v, int64_t i) {
  uint32_t w;
  std::memcpy(&w, v.data.data() + 4 * i, 4);
  return w;
}

// The [out, in] projection at `prefix` dequantized as the format's reference code does it (DESIGN
// section 12), row-major; empty after a failed expectation.
std::vector<float> Dequantize(const Checkpoint& ckpt, const QuantSpec& q, const std::string& prefix,
                              int64_t out, int64_t in) {
  std::map<QuantRole, const TensorView*> t;
  for (const QuantTensorSpec& spec : QuantTensorsOf(q, out, in)) {
    t[spec.role] = ckpt.Find(prefix + spec.suffix);
    if (t[spec.role] == nullptr) {
      ADD_FAILURE() << prefix << spec.suffix << " is missing";
      return {};
    }
  }
  const std::vector<float> scale = Floats(*t[QuantRole::kScale]);
  std::vector<float> w(static_cast<size_t>(out * in));
  // AWQ: output column 8c + j sits in nibble kAwqNibbleOf[j].
  constexpr int kAwqNibbleOf[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      float v = 0;
      switch (q.method) {
        case QuantMethod::kFp8Block: {
          const auto byte = static_cast<uint8_t>(t[QuantRole::kWeight]->data[o * in + i]);
          const int64_t blocks_in = (in + q.block_in - 1) / q.block_in;
          v = Fp8E4m3ToFloat(byte) * scale[(o / q.block_out) * blocks_in + i / q.block_in];
          break;
        }
        case QuantMethod::kInt4Packed: {
          const uint32_t word = Word(*t[QuantRole::kWeight], o * (in / 8) + i / 8);
          const int64_t groups = (in + q.group_size - 1) / q.group_size;
          v = (static_cast<float>((word >> (4 * (i % 8))) & 15) - 8.0f) *
              scale[o * groups + i / q.group_size];
          break;
        }
        case QuantMethod::kGptq: {
          int32_t g;
          std::memcpy(&g, t[QuantRole::kGroupIndex]->data.data() + 4 * i, 4);
          const uint32_t word = Word(*t[QuantRole::kWeight], (i / 8) * out + o);
          const uint32_t zeros = Word(*t[QuantRole::kZero], g * (out / 8) + o / 8);
          const float zero = static_cast<float>(((zeros >> (4 * (o % 8))) & 15) + 1);  // v1.
          v = (static_cast<float>((word >> (4 * (i % 8))) & 15) - zero) * scale[g * out + o];
          break;
        }
        case QuantMethod::kAwq: {
          const int64_t g = i / q.group_size;
          const int shift = 4 * kAwqNibbleOf[o % 8];
          const uint32_t word = Word(*t[QuantRole::kWeight], i * (out / 8) + o / 8);
          const uint32_t zeros = Word(*t[QuantRole::kZero], g * (out / 8) + o / 8);
          v = (static_cast<float>((word >> shift) & 15) -
               static_cast<float>((zeros >> shift) & 15)) *
              scale[g * out + o];
          break;
        }
        default:
          break;
      }
      w[static_cast<size_t>(o * in + i)] = v;
    }
  }
  return w;
}

// Cut-down quantized checkpoints, one per --quant: config.json's quantization_config reads back
// as the format, every tensor QuantTensorsOf lists for the routed experts is there with its shape
// and usual dtype, routers stay float, and the dequantized weights are the float checkpoint's of
// the same seed to within the format's rounding, with its spread.
// gpt-oss's MXFP4 layout: blocks and scales per fused tensor in [J, out, in] order (the float
// checkpoint's [J, in, out] transposed), each value the float weight of the same seed to within
// half a step of the FP4 grid at the block's scale; our config reader takes the checkpoint.
TEST_F(MakeModelTest, Mxfp4ExpertsAreTheFloatWeightsOfTheSameSeed) {
  const std::vector<std::string> cut = {"--shape", "gpt-oss-20b", "--layers", "1",      "--experts",
                                        "4",       "--vocab",     "4096",     "--seed", "5"};
  std::vector<std::string> float_args = cut, mx_args = cut;
  float_args.insert(float_args.end(), {"--out", (dir_ / "go-float").string()});
  mx_args.insert(mx_args.end(), {"--out", (dir_ / "go-mxfp4").string(), "--quant", "mxfp4"});
  RunResult r = Run(float_args);
  ASSERT_EQ(r.code, 0) << r.err;
  r = Run(mx_args);
  ASSERT_EQ(r.code, 0) << r.err;
  auto info = LoadModelInfo((dir_ / "go-mxfp4").string());
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  ASSERT_EQ(info->quant.method, QuantMethod::kMxfp4);
  auto fl = Checkpoint::Open((dir_ / "go-float").string());
  auto mx = Checkpoint::Open((dir_ / "go-mxfp4").string());
  ASSERT_TRUE(fl.ok() && mx.ok());
  const std::string p = "model.layers.0.mlp.experts.";
  EXPECT_EQ((*mx)->Find(p + "gate_up_proj"), nullptr);
  const TensorView* blocks = (*mx)->Find(p + "gate_up_proj_blocks");
  const TensorView* scales = (*mx)->Find(p + "gate_up_proj_scales");
  const TensorView* weights = (*fl)->Find(p + "gate_up_proj");
  ASSERT_TRUE(blocks != nullptr && scales != nullptr && weights != nullptr);
  const int64_t in = 2880, out = 2 * 2880;
  EXPECT_EQ(blocks->shape, (std::vector<int64_t>{4, out, in / 32, 16}));
  EXPECT_EQ(weights->shape, (std::vector<int64_t>{4, in, out}));
  static const float kFp4[16] = {0,     0.5f,  1,  1.5f,  2,  3,  4,  6,
                                 -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  auto bf16 = [&](int64_t e, int64_t i, int64_t o) {
    uint16_t bits;
    std::memcpy(&bits, weights->data.data() + 2 * ((e * in + i) * out + o), 2);
    const uint32_t f = uint32_t{bits} << 16;
    float v;
    std::memcpy(&v, &f, 4);
    return v;
  };
  double worst = 0;
  for (int64_t e : {int64_t{0}, int64_t{3}}) {
    for (int64_t o : {int64_t{0}, int64_t{1}, out - 1}) {
      for (int64_t i = 0; i < 96; ++i) {
        const uint8_t byte = static_cast<uint8_t>(
            blocks->data[static_cast<size_t>((e * out + o) * (in / 2) + i / 2)]);
        const int code = i % 2 == 0 ? (byte & 15) : (byte >> 4);
        const int s = static_cast<int>(static_cast<uint8_t>(
            scales->data[static_cast<size_t>((e * out + o) * (in / 32) + i / 32)]));
        const float scale = std::ldexp(1.0f, s - 127);
        const float v = kFp4[code] * scale;
        // Half of the widest FP4 step (2, between 4 and 6) at this scale; bfloat16's rounding on
        // the float side is far below it.
        const double diff = std::abs(static_cast<double>(v) - bf16(e, i, o));
        worst = std::max(worst, diff / scale);
        EXPECT_LE(diff, 1.0 * scale) << e << " " << i << " " << o;
      }
    }
  }
  EXPECT_GT(worst, 0.0);  // The FP4 grid does round.
}

TEST_F(MakeModelTest, QuantizedCheckpointsLoadThroughOurLoaders) {
  const std::vector<std::string> cut = {"--layers", "2",    "--experts", "8",
                                        "--vocab",  "4096", "--seed",    "3"};
  auto args = [&](const std::string& shape, const std::string& quant, const fs::path& out) {
    std::vector<std::string> a = {"--shape", shape, "--out", out.string()};
    a.insert(a.end(), cut.begin(), cut.end());
    if (!quant.empty()) a.insert(a.end(), {"--quant", quant});
    return a;
  };
  std::map<std::string, fs::path> float_dirs;
  for (const char* shape : {"qwen3-30b-a3b", "deepseek-v2-lite"}) {
    float_dirs[shape] = dir_ / (std::string(shape) + "-float");
    RunResult r = Run(args(shape, "", float_dirs[shape]));
    ASSERT_EQ(r.code, 0) << r.err;
  }
  struct Case {
    const char* shape;
    const char* quant;
    Json config;                      // quantization_config keys.
    bool attention_quantized;         // Else only the routed experts.
    std::vector<std::string> ignore;  // compressed-tensors' ignore list holds these.
  } cases[] = {
      {"qwen3-30b-a3b",
       "fp8",
       {{"quant_method", "fp8"},
        {"fmt", "e4m3"},
        {"activation_scheme", "dynamic"},
        {"weight_block_size", {128, 128}}},
       true,
       {}},
      {"deepseek-v2-lite",
       "fp8",
       {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}},
       true,
       {}},
      {"deepseek-v2-lite",
       "int4-g32",
       {{"quant_method", "compressed-tensors"},
        {"format", "pack-quantized"},
        {"quantization_status", "compressed"}},
       false,
       {"lm_head", "model.layers.0.self_attn.kv_a_proj_with_mqa", "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.shared_experts.up_proj"}},
      {"qwen3-30b-a3b",
       "int4-g128",
       {{"quant_method", "compressed-tensors"}, {"format", "pack-quantized"}},
       false,
       {"lm_head", "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.gate"}},
      {"qwen3-30b-a3b",
       "gptq",
       {{"quant_method", "gptq"},
        {"bits", 4},
        {"group_size", 128},
        {"desc_act", false},
        {"sym", true},
        {"checkpoint_format", "gptq"}},
       true,
       {}},
      {"qwen3-30b-a3b",
       "awq",
       {{"quant_method", "awq"},
        {"bits", 4},
        {"group_size", 128},
        {"zero_point", true},
        {"version", "gemm"},
        {"modules_to_not_convert", {"model.layers.0.mlp.gate", "model.layers.1.mlp.gate"}}},
       true,
       {}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.shape) + " " + c.quant);
    const fs::path out = dir_ / (std::string(c.shape) + "-" + c.quant);
    RunResult r = Run(args(c.shape, c.quant, out));
    ASSERT_EQ(r.code, 0) << r.err;
    const Json config = ReadConfig(out);
    ASSERT_TRUE(config.contains("quantization_config")) << config.dump();
    const Json& qc = config["quantization_config"];
    ExpectKeys(qc, c.config);
    for (const std::string& name : c.ignore) {
      EXPECT_NE(std::find(qc["ignore"].begin(), qc["ignore"].end(), name), qc["ignore"].end())
          << name;
    }
    if (c.quant == std::string("int4-g32")) {  // DeepSeek's router is not an nn.Linear.
      EXPECT_EQ(qc["config_groups"]["group_0"]["weights"]["group_size"], 32);
      EXPECT_EQ(std::find(qc["ignore"].begin(), qc["ignore"].end(), "model.layers.1.mlp.gate"),
                qc["ignore"].end());
    }

    auto info = LoadModelInfo(out.string());
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    QuantSpec want;
    ASSERT_TRUE(ParseQuantizationConfig(qc, &want).ok());
    EXPECT_EQ(info->quant, want);
    ASSERT_TRUE(info->quant.quantized());
    EXPECT_EQ(info->quant.group_size, c.quant == std::string("int4-g32") ? 32u
                                      : c.quant == std::string("fp8")    ? 0u
                                                                         : 128u);
    EXPECT_FALSE(info->quant.act_order);
    EXPECT_FALSE(info->quant.gptq_v2);
    // Layer 1 has experts (DeepSeek's layer 0 is dense).
    ASSERT_FALSE(info->moe_layers.empty());
    ASSERT_EQ(info->moe_layers.back(), 1u);
    const int64_t h = info->hidden_size, inter = info->intermediate_size;

    auto ckpt = Checkpoint::Open(out.string());
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    uint64_t expert_bytes = 0;
    for (uint32_t e = 0; e < 8; ++e) {
      const std::string p = "model.layers.1.mlp.experts." + std::to_string(e) + ".";
      for (const auto& [proj, rows, cols] :
           {std::tuple{"gate_proj", inter, h}, std::tuple{"up_proj", inter, h},
            std::tuple{"down_proj", h, inter}}) {
        const std::string prefix = p + proj + ".";
        EXPECT_EQ((*ckpt)->Find(prefix + "weight") != nullptr,
                  info->quant.method == QuantMethod::kFp8Block)
            << prefix;
        for (const QuantTensorSpec& spec : QuantTensorsOf(info->quant, rows, cols)) {
          const TensorView* v = (*ckpt)->Find(prefix + spec.suffix);
          ASSERT_NE(v, nullptr) << prefix << spec.suffix;
          EXPECT_EQ(v->shape, spec.shape) << v->name;
          EXPECT_EQ(v->dtype, spec.dtypes.front()) << v->name;
          if (e == 0) expert_bytes += v->data.size();
        }
        if (info->quant.method == QuantMethod::kInt4Packed) {
          const TensorView* shape = (*ckpt)->Find(prefix + "weight_shape");
          ASSERT_NE(shape, nullptr) << prefix;
          ASSERT_EQ(shape->dtype, DType::kI64);
          int64_t v[2];
          ASSERT_EQ(shape->data.size(), sizeof(v));
          std::memcpy(v, shape->data.data(), sizeof(v));
          EXPECT_EQ(v[0], rows);
          EXPECT_EQ(v[1], cols);
        }
      }
    }
    EXPECT_EQ(expert_bytes, RoutedExpertBytes(*info));
    // Routers, embeddings and lm_head stay float; attention as the format has it.
    const TensorView* router = (*ckpt)->Find("model.layers.1.mlp.gate.weight");
    ASSERT_NE(router, nullptr);
    EXPECT_EQ(router->dtype, DType::kBF16);
    EXPECT_EQ((*ckpt)->Find("lm_head.weight")->dtype, DType::kBF16);
    const std::string attn =
        info->mla ? "model.layers.0.self_attn.kv_b_proj." : "model.layers.0.self_attn.o_proj.";
    const TensorView* attn_weight = (*ckpt)->Find(attn + "weight");
    if (!c.attention_quantized) {
      ASSERT_NE(attn_weight, nullptr);
      EXPECT_EQ(attn_weight->dtype, DType::kBF16);
    } else if (info->quant.method == QuantMethod::kFp8Block) {
      ASSERT_NE(attn_weight, nullptr);
      EXPECT_EQ(attn_weight->dtype, DType::kF8E4M3);
    } else {
      EXPECT_EQ(attn_weight, nullptr);
      EXPECT_NE((*ckpt)->Find(attn + "qweight"), nullptr);
    }

    // One expert's down_proj (and the attention's output projection where the format quantizes
    // it) against the float checkpoint of the same seed: within half a step of the 4-bit grid (a
    // little more where the rounded scale puts the edge past 7.5 steps), or FP8's 3-bit mantissa;
    // the float checkpoint rounds to bfloat16 on top.
    auto reference = Checkpoint::Open(float_dirs[c.shape].string());
    ASSERT_TRUE(reference.ok()) << reference.status().ToString();
    std::vector<std::tuple<std::string, int64_t, int64_t>> checked = {
        {"model.layers.1.mlp.experts.3.down_proj.", h, inter}};
    if (c.attention_quantized) {
      const TensorView* ref = (*reference)->Find(attn + "weight");
      ASSERT_NE(ref, nullptr);
      checked.emplace_back(attn, ref->shape[0], ref->shape[1]);
    }
    for (const auto& [prefix, rows, cols] : checked) {
      SCOPED_TRACE(prefix);
      const std::vector<float> deq = Dequantize(**ckpt, info->quant, prefix, rows, cols);
      const TensorView* ref = (*reference)->Find(prefix + "weight");
      ASSERT_NE(ref, nullptr);
      const std::vector<float> w = Floats(*ref);
      ASSERT_EQ(deq.size(), w.size());
      float step = 0;  // The one scale the writer uses.
      for (const QuantTensorSpec& spec : QuantTensorsOf(info->quant, rows, cols)) {
        if (spec.role == QuantRole::kScale) {
          step = Floats(*(*ckpt)->Find(prefix + spec.suffix))[0];
        }
      }
      ASSERT_GT(step, 0.0f);
      double sum = 0, sq = 0;
      for (size_t i = 0; i < w.size(); ++i) {
        ASSERT_TRUE(std::isfinite(deq[i])) << i;
        const float tolerance = info->quant.method == QuantMethod::kFp8Block
                                    ? 0.0703f * std::abs(w[i]) + step / 512
                                    : 0.55f * step + std::abs(w[i]) / 256;
        ASSERT_LE(std::abs(deq[i] - w[i]), tolerance) << i << ": " << deq[i] << " vs " << w[i];
        sum += deq[i];
        sq += double{deq[i]} * deq[i];
      }
      const double mean = sum / static_cast<double>(w.size());
      EXPECT_NEAR(mean, 0.0, 0.001);
      EXPECT_NEAR(std::sqrt(sq / static_cast<double>(w.size()) - mean * mean), 0.02, 0.0025);
    }
  }
}

}  // namespace
}  // namespace fmoe
