#include "common/model_config.h"

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

const char* kMixtral = R"({"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 8,
  "hidden_size": 256, "vocab_size": 4096, "num_local_experts": 8, "num_experts_per_tok": 2,
  "max_position_embeddings": 1024})";

TEST(ModelConfig, ReadsMixtralShape) {
  auto info = ParseModelConfig(kMixtral, "/m");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->architecture, "MixtralForCausalLM");
  EXPECT_EQ(info->num_moe_layers, 8u);
  EXPECT_EQ(info->num_experts, 8u);
  EXPECT_EQ(info->top_k, 2u);
  EXPECT_EQ(info->hidden_size, 256u);
  EXPECT_EQ(info->max_position_embeddings, 1024u);
}

TEST(ModelConfig, QwenDenseLayersAreNotMoeLayers) {
  auto info = ParseModelConfig(R"({"architectures": ["Qwen2MoeForCausalLM"],
    "num_hidden_layers": 24, "hidden_size": 2048, "vocab_size": 151936, "num_experts": 60,
    "num_experts_per_tok": 4, "decoder_sparse_step": 1, "mlp_only_layers": [0, 5]})",
                               "/q");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->num_experts, 60u);
  EXPECT_EQ(info->num_moe_layers, 22u);
}

TEST(ModelConfig, RejectsWhatCannotBeServed) {
  struct Case {
    const char* json;
    const char* error;
  } cases[] = {
      {"not json", "model: /m/config.json: not valid JSON"},
      {"[1]", "model: /m/config.json: not a JSON object"},
      {R"({"architectures": ["LlamaForCausalLM"]})", "is not a supported MoE architecture"},
      {R"({"architectures": ["MixtralForCausalLM"], "hidden_size": 8, "vocab_size": 8,
         "num_local_experts": 8, "num_experts_per_tok": 2})",
       "num_hidden_layers: missing"},
      {R"({"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2, "hidden_size": 8,
         "vocab_size": 8, "num_local_experts": 8, "num_experts_per_tok": 9})",
       "num_experts_per_tok (9) > number of experts (8)"},
      {R"({"architectures": ["MixtralForCausalLM"], "num_hidden_layers": "2", "hidden_size": 8,
         "vocab_size": 8, "num_local_experts": 8, "num_experts_per_tok": 2})",
       "num_hidden_layers: \"2\" is not an integer"},
      {R"({"architectures": ["MixtralForCausalLM"], "num_hidden_layers": -1, "hidden_size": 8,
         "vocab_size": 8, "num_local_experts": 8, "num_experts_per_tok": 2})",
       "num_hidden_layers: -1 is out of range"},
  };
  for (const auto& c : cases) {
    auto info = ParseModelConfig(c.json, "/m");
    ASSERT_FALSE(info.ok()) << c.json;
    EXPECT_EQ(info.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(info.status().message().find(c.error), std::string::npos) << info.status().message();
  }
}

TEST(ModelConfig, FingerprintFollowsConfigAndWeightsHeader) {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("fmoe-model-" + std::to_string(getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << kMixtral;
  auto a = LoadModelInfo(dir.string());
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(FingerprintHex(a->fingerprint).size(), 16u);

  auto write_weights = [&](const std::string& header) {
    std::ofstream out(dir / "model.safetensors", std::ios::binary);
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
    out << header;
  };
  write_weights(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})");
  auto b = LoadModelInfo(dir.string());
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->weight_files, std::vector<std::string>{"model.safetensors"});
  EXPECT_NE(a->fingerprint, b->fingerprint);
  write_weights(R"({"w":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})");
  auto c = LoadModelInfo(dir.string());
  ASSERT_TRUE(c.ok());
  EXPECT_NE(b->fingerprint, c->fingerprint);
  EXPECT_EQ(LoadModelInfo(dir.string())->fingerprint, c->fingerprint) << "deterministic";

  // A header length that runs past the file is corruption, not a crash.
  {
    std::ofstream out(dir / "model.safetensors", std::ios::binary);
    out << std::string("\xff\xff\xff\x00\x00\x00\x00\x00{", 9);
  }
  auto d = LoadModelInfo(dir.string());
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), ErrorCode::kDataLoss);
  fs::remove_all(dir);

  auto missing = LoadModelInfo("/nonexistent/model");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message(), "model: /nonexistent/model: no such directory");
}

}  // namespace
}  // namespace fmoe
