#include "common/model/model_config.h"

#include <set>
#include <string>

#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <gtest/gtest.h>

#include "common/json.h"
#include "common/model/families/family.h"

namespace fmoe {
namespace {

const char* kMixtral = R"({"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 8,
  "hidden_size": 256, "vocab_size": 4096, "num_local_experts": 8, "num_experts_per_tok": 2,
  "max_position_embeddings": 1024, "intermediate_size": 512, "num_attention_heads": 8})";

// Every family's file is complete, each architecture name belongs to one family, and the
// refusal of an unknown one lists them all.
TEST(ModelFamilies, EachArchitectureFindsItsOwnFamily) {
  std::set<std::string> seen;
  for (const ModelFamily* f : AllModelFamilies()) {
    ASSERT_FALSE(f->architectures.empty());
    EXPECT_NE(f->parse, nullptr) << f->architectures[0];
    EXPECT_NE(std::string(f->experts_key), "") << f->architectures[0];
    EXPECT_NE(std::string(f->tensors.moe), "") << f->architectures[0];
    for (const char* name : {f->tensors.expert_gate, f->tensors.expert_up, f->tensors.expert_down})
      EXPECT_NE(std::string(name), "") << f->architectures[0];
    for (const char* name : f->architectures) {
      EXPECT_TRUE(seen.insert(name).second) << name << " is served by two families";
      auto found = FindModelFamily(name);
      ASSERT_TRUE(found.ok()) << found.status().ToString();
      EXPECT_EQ(*found, f) << name;
    }
  }
  EXPECT_EQ(seen.size(), 11u);
  auto missing = FindModelFamily("LlamaForCausalLM");
  ASSERT_FALSE(missing.ok());
  for (const std::string& name : seen)
    EXPECT_NE(missing.status().message().find(name), std::string::npos) << name;
}

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
    "num_experts_per_tok": 4, "decoder_sparse_step": 1, "mlp_only_layers": [0, 5],
    "intermediate_size": 5632, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_attention_heads": 16})",
                               "/q");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->num_experts, 60u);
  EXPECT_EQ(info->num_moe_layers, 22u);
  ASSERT_EQ(info->moe_layers.size(), 22u);
  EXPECT_EQ(info->moe_layers[0], 1u);
  EXPECT_EQ(info->moe_layers[3], 4u);
  EXPECT_EQ(info->moe_layers[4], 6u);
  EXPECT_EQ(info->intermediate_size, 1408u) << "a routed expert's width";
  EXPECT_EQ(info->dense_intermediate_size, 5632u);
  EXPECT_EQ(info->shared_expert_intermediate_size, 5632u);
  EXPECT_TRUE(info->shared_expert_gated);
  EXPECT_TRUE(info->qkv_bias);
  EXPECT_FALSE(info->o_bias);
  EXPECT_FALSE(info->routing.normalize_topk) << "Qwen2MoeConfig's norm_topk_prob default";
  EXPECT_EQ(info->routing.top_k, 4u);
  EXPECT_EQ(info->routing.num_experts, 60u);
  EXPECT_TRUE(info->runtime_unsupported.empty());

  // decoder_sparse_step 2: every second layer is sparse.
  auto step = ParseModelConfig(R"({"architectures": ["Qwen2MoeForCausalLM"],
    "num_hidden_layers": 6, "hidden_size": 64, "vocab_size": 100, "num_experts": 8,
    "num_experts_per_tok": 2, "decoder_sparse_step": 2, "intermediate_size": 96,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
    "num_attention_heads": 4, "norm_topk_prob": true})",
                               "/q");
  ASSERT_TRUE(step.ok()) << step.status().ToString();
  EXPECT_EQ(step->moe_layers, (std::vector<uint32_t>{1, 3, 5}));
  EXPECT_TRUE(step->routing.normalize_topk);
}

TEST(ModelConfig, ReadsQwen3MoeAndOlmoe) {
  auto qwen3 = ParseModelConfig(R"({"architectures": ["Qwen3MoeForCausalLM"],
    "num_hidden_layers": 48, "hidden_size": 2048, "vocab_size": 151936, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "use_sliding_window": false, "sliding_window": null, "attention_bias": false,
    "hidden_act": "silu", "rope_scaling": null})",
                                "/q3");
  ASSERT_TRUE(qwen3.ok()) << qwen3.status().ToString();
  EXPECT_EQ(qwen3->num_moe_layers, 48u);
  EXPECT_EQ(qwen3->head_dim, 128u) << "independent of hidden_size / heads";
  EXPECT_EQ(qwen3->intermediate_size, 768u);
  EXPECT_EQ(qwen3->dense_intermediate_size, 0u) << "no dense layer";
  EXPECT_EQ(qwen3->qk_norm, QkNorm::kPerHead);
  EXPECT_TRUE(qwen3->routing.normalize_topk);
  EXPECT_EQ(qwen3->shared_expert_intermediate_size, 0u);

  auto olmoe = ParseModelConfig(R"({"architectures": ["OlmoeForCausalLM"],
    "num_hidden_layers": 16, "hidden_size": 2048, "vocab_size": 50304, "num_experts": 64,
    "num_experts_per_tok": 8, "intermediate_size": 1024, "num_attention_heads": 16,
    "clip_qkv": 8.0, "norm_topk_prob": false})",
                                "/o");
  ASSERT_TRUE(olmoe.ok()) << olmoe.status().ToString();
  EXPECT_EQ(olmoe->qk_norm, QkNorm::kWhole);
  ASSERT_TRUE(olmoe->clip_qkv.has_value());
  EXPECT_EQ(*olmoe->clip_qkv, 8.0);
  EXPECT_FALSE(olmoe->routing.normalize_topk);
  EXPECT_EQ(olmoe->intermediate_size, 1024u);

  auto phi = ParseModelConfig(R"({"architectures": ["PhimoeForCausalLM"],
    "num_hidden_layers": 32, "hidden_size": 4096, "vocab_size": 32064, "num_local_experts": 16,
    "num_experts_per_tok": 2, "intermediate_size": 6400, "num_attention_heads": 32})",
                              "/p");
  ASSERT_TRUE(phi.ok()) << phi.status().ToString();
  EXPECT_EQ(phi->num_moe_layers, 32u);
  EXPECT_EQ(phi->runtime_unsupported, "") << "the runtime runs it";
}

TEST(ModelConfig, DescribesTheExpertShapes) {
  auto info = ParseModelConfig(R"({"architectures": ["Qwen2MoeForCausalLM"],
    "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 100, "num_experts": 8,
    "num_experts_per_tok": 2, "mlp_only_layers": [1], "intermediate_size": 128,
    "moe_intermediate_size": 48, "shared_expert_intermediate_size": 96,
    "num_attention_heads": 8, "num_key_value_heads": 2, "torch_dtype": "bfloat16"})",
                               "/q");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  const std::string d = DescribeModel(*info);
  EXPECT_NE(d.find("architecture: Qwen2MoeForCausalLM\n"), std::string::npos) << d;
  EXPECT_NE(d.find("layers: 4, of which L = 3 MoE (dense: 1, MLP width 128)"), std::string::npos)
      << d;
  EXPECT_NE(d.find("J = 8 per MoE layer, K = 2 per token (softmax, top-2 of 8, not renormalised)"),
            std::string::npos)
      << d;
  EXPECT_NE(d.find("routed expert: 3 x 48 x 64 = 9216 parameters, 0.0 MB in bfloat16; 24 in all"),
            std::string::npos)
      << d;
  EXPECT_NE(d.find("shared expert: 3 x 96 x 64 with a sigmoid gate"), std::string::npos) << d;
  EXPECT_NE(d.find("head_dim 8, q/k/v biases"), std::string::npos) << d;
  EXPECT_EQ(RoutedExpertParams(*info), 3u * 48 * 64);
  EXPECT_EQ(SharedExpertParams(*info), 3u * 96 * 64 + 64);
  EXPECT_EQ(CheckpointBytesPerParam(*info), 2u);
}

TEST(ModelConfig, RefusesWhatTheRuntimeDoesNotCompute) {
  const std::string qwen = R"({"architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 2,
    "hidden_size": 64, "vocab_size": 100, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
    "num_attention_heads": 4)";
  struct Case {
    std::string json;
    const char* error;
  } cases[] = {
      {qwen + R"(, "use_sliding_window": true})",
       "use_sliding_window: true is not implemented by the model runtime"},
      {qwen + R"(, "rope_scaling": {"type": "yarn", "factor": 4.0}})",
       "rope_scaling: {\"factor\":4.0,\"type\":\"yarn\"} is not implemented"},
      {qwen + R"(, "hidden_act": "gelu_pytorch_tanh"})",
       "hidden_act: \"gelu_pytorch_tanh\" is not implemented by the model runtime"},
      {qwen + R"(, "norm_topk_prob": "yes"})", "norm_topk_prob: \"yes\" is not a boolean"},
      {qwen + R"(, "mlp_only_layers": [0]})",
       "a dense layer's MLP width: intermediate_size: missing"},
      {qwen + R"(, "mlp_only_layers": [0, 1], "intermediate_size": 64})",
       "the model has no MoE layer"},
      {R"({"architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
         "vocab_size": 100, "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "num_attention_heads": 4})",
       "shared_expert_intermediate_size: missing"},
      {R"({"architectures": ["OlmoeForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
         "vocab_size": 100, "num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
         "num_attention_heads": 4, "clip_qkv": -1})",
       "clip_qkv: -1 is out of range"},
  };
  for (const auto& c : cases) {
    auto info = ParseModelConfig(c.json, "/m");
    ASSERT_FALSE(info.ok()) << c.json;
    EXPECT_NE(info.status().message().find(c.error), std::string::npos)
        << info.status().message() << "\n wanted: " << c.error;
  }
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

TEST(ModelConfig, ReadsRuntimeFields) {
  auto info = ParseModelConfig(R"({"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 3,
    "hidden_size": 64, "vocab_size": 512, "num_local_experts": 8, "num_experts_per_tok": 2,
    "intermediate_size": 96, "num_attention_heads": 8, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "tie_word_embeddings": true,
    "bos_token_id": 1, "eos_token_id": [2, 7], "torch_dtype": "bfloat16",
    "sliding_window": 4096})",
                               "/m");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->intermediate_size, 96u);
  EXPECT_EQ(info->num_attention_heads, 8u);
  EXPECT_EQ(info->num_key_value_heads, 2u);
  EXPECT_EQ(info->head_dim, 8u);
  EXPECT_EQ(info->rms_norm_eps, 1e-6);
  EXPECT_EQ(info->rope_theta, 10000.0);
  EXPECT_TRUE(info->tie_word_embeddings);
  EXPECT_EQ(info->bos_token_id, std::optional<int32_t>(1));
  EXPECT_EQ(info->eos_token_ids, (std::vector<int32_t>{2, 7}));
  EXPECT_EQ(info->torch_dtype, "bfloat16");
  EXPECT_EQ(info->sliding_window, std::optional<uint32_t>(4096));
}

TEST(ModelConfig, RuntimeFieldDefaults) {
  auto info = ParseModelConfig(kMixtral, "/m");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->intermediate_size, 512u);
  EXPECT_EQ(info->num_key_value_heads, 8u) << "defaults to num_attention_heads";
  EXPECT_EQ(info->head_dim, 32u) << "hidden_size / num_attention_heads";
  EXPECT_EQ(info->rms_norm_eps, 1e-5);
  EXPECT_EQ(info->rope_theta, 1e6);
  EXPECT_FALSE(info->tie_word_embeddings);
  EXPECT_FALSE(info->bos_token_id.has_value());
  EXPECT_TRUE(info->eos_token_ids.empty());
  EXPECT_EQ(info->torch_dtype, "");
  EXPECT_FALSE(info->sliding_window.has_value());

  // An explicit head_dim need not divide hidden_size; nulls mean "absent"; one eos id.
  auto explicit_dim = ParseModelConfig(R"({"architectures": ["MixtralForCausalLM"],
    "num_hidden_layers": 2, "hidden_size": 100, "vocab_size": 8, "num_local_experts": 4,
    "num_experts_per_tok": 2, "intermediate_size": 16, "num_attention_heads": 3,
    "head_dim": 40, "sliding_window": null, "bos_token_id": null, "eos_token_id": 5,
    "rope_theta": 500000, "num_key_value_heads": null})",
                                       "/m");
  ASSERT_TRUE(explicit_dim.ok()) << explicit_dim.status().ToString();
  EXPECT_EQ(explicit_dim->head_dim, 40u);
  EXPECT_EQ(explicit_dim->num_key_value_heads, 3u);
  EXPECT_EQ(explicit_dim->rope_theta, 500000.0);
  EXPECT_EQ(explicit_dim->eos_token_ids, std::vector<int32_t>{5});
  EXPECT_FALSE(explicit_dim->sliding_window.has_value());
  EXPECT_FALSE(explicit_dim->bos_token_id.has_value());

  auto null_eos = ParseModelConfig(R"({"architectures": ["MixtralForCausalLM"],
    "num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 8, "num_local_experts": 4,
    "num_experts_per_tok": 2, "intermediate_size": 16, "num_attention_heads": 2,
    "eos_token_id": null})",
                                   "/m");
  ASSERT_TRUE(null_eos.ok()) << null_eos.status().ToString();
  EXPECT_TRUE(null_eos->eos_token_ids.empty());
}

TEST(ModelConfig, ReadsTheTinyMoeConfig) {
  std::ifstream in(std::string(FMOE_SOURCE_DIR) + "/deploy/models/tiny-moe/config.json");
  ASSERT_TRUE(in.good());
  std::stringstream ss;
  ss << in.rdbuf();
  auto info = ParseModelConfig(ss.str(), "/tiny");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_GT(info->intermediate_size, 0u);
  EXPECT_EQ(info->num_attention_heads % info->num_key_value_heads, 0u);
  EXPECT_EQ(info->head_dim * info->num_attention_heads, info->hidden_size);
}

TEST(ModelConfig, RejectsBadRuntimeFields) {
  // A valid Mixtral config but for `extra`, spliced in last (later keys override earlier ones).
  auto with = [](const std::string& extra) {
    return std::string(R"({"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2,
      "hidden_size": 64, "vocab_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
      "intermediate_size": 16, "num_attention_heads": 8)") +
           (extra.empty() ? "" : ", " + extra) + "}";
  };
  struct Case {
    std::string json;
    const char* error;
  } cases[] = {
      {R"({"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2, "hidden_size": 8,
         "vocab_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
         "num_attention_heads": 2})",
       "model: /m/config.json: intermediate_size: missing"},
      {R"({"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2, "hidden_size": 8,
         "vocab_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
         "intermediate_size": 16})",
       "model: /m/config.json: num_attention_heads: missing"},
      {with(R"("intermediate_size": 0)"), "intermediate_size: 0 is out of range"},
      {with(R"("intermediate_size": "16")"), "intermediate_size: \"16\" is not an integer"},
      {with(R"("num_attention_heads": null)"), "num_attention_heads: missing"},
      {with(R"("num_attention_heads": 2.5)"), "num_attention_heads: 2.5 is not an integer"},
      {with(R"("num_key_value_heads": 3)"),
       "num_key_value_heads (3) does not divide num_attention_heads (8)"},
      {with(R"("num_key_value_heads": 0)"), "num_key_value_heads: 0 is out of range"},
      {with(R"("num_attention_heads": 6)"),
       "head_dim: missing, and hidden_size (64) is not a multiple of num_attention_heads (6)"},
      {with(R"("head_dim": "8")"), "head_dim: \"8\" is not an integer"},
      {with(R"("head_dim": -8)"), "head_dim: -8 is out of range"},
      {with(R"("rms_norm_eps": "1e-5")"), "rms_norm_eps: \"1e-5\" is not a number"},
      {with(R"("rms_norm_eps": 0)"), "rms_norm_eps: 0 is out of range"},
      {with(R"("rms_norm_eps": -1e-05)"), "rms_norm_eps: -1e-05 is out of range"},
      {with(R"("rope_theta": true)"), "rope_theta: true is not a number"},
      {with(R"("rope_theta": -10000.0)"), "rope_theta: -10000.0 is out of range"},
      {with(R"("tie_word_embeddings": 1)"), "tie_word_embeddings: 1 is not a boolean"},
      {with(R"("bos_token_id": -1)"), "bos_token_id: -1 is out of range"},
      {with(R"("bos_token_id": 4294967296)"), "bos_token_id: 4294967296 is out of range"},
      {with(R"("bos_token_id": "<s>")"), "bos_token_id: \"<s>\" is not an integer"},
      {with(R"("eos_token_id": [2, "x"])"), "eos_token_id[1]: \"x\" is not an integer"},
      {with(R"("eos_token_id": [2, -3])"), "eos_token_id[1]: -3 is out of range"},
      {with(R"("eos_token_id": {"id": 2})"), "eos_token_id: {\"id\":2} is not an integer"},
      {with(R"("eos_token_id": 2.0)"), "eos_token_id: 2.0 is not an integer"},
      {with(R"("torch_dtype": 16)"), "torch_dtype: 16 is not a string"},
      {with(R"("sliding_window": 0)"), "sliding_window: 0 is out of range"},
      {with(R"("sliding_window": "4096")"), "sliding_window: \"4096\" is not an integer"},
  };
  ASSERT_TRUE(ParseModelConfig(with(""), "/m").ok())
      << ParseModelConfig(with(""), "/m").status().ToString();
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

namespace fmoe {
namespace {

// deepseek-ai/DeepSeek-V2-Lite's config.json (the keys that matter).
const char* kDeepseekV2Lite = R"({"architectures": ["DeepseekV2ForCausalLM"],
  "attention_bias": false, "bos_token_id": 100000, "eos_token_id": 100001,
  "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
  "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
  "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
  "n_shared_experts": 2, "norm_topk_prob": false, "num_attention_heads": 16,
  "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
  "q_lora_rank": null, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
    "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
  "tie_word_embeddings": false, "topk_group": 1, "topk_method": "greedy",
  "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400})";

TEST(ModelConfig, ReadsDeepseekV2Lite) {
  auto info = ParseModelConfig(kDeepseekV2Lite, "/d");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->num_moe_layers, 26u);
  EXPECT_EQ(info->moe_layers.front(), 1u) << "first_k_dense_replace 1";
  EXPECT_EQ(info->dense_intermediate_size, 10944u);
  EXPECT_EQ(info->intermediate_size, 1408u);
  EXPECT_EQ(info->shared_expert_intermediate_size, 2u * 1408u);
  EXPECT_FALSE(info->shared_expert_gated);
  ASSERT_TRUE(info->mla.has_value());
  EXPECT_EQ(info->mla->q_lora_rank, 0u);
  EXPECT_EQ(info->mla->kv_lora_rank, 512u);
  EXPECT_EQ(info->head_dim, 64u) << "the rotary width";
  ASSERT_TRUE(info->yarn.has_value());
  EXPECT_DOUBLE_EQ(info->yarn->factor, 40.0);
  EXPECT_DOUBLE_EQ(info->yarn->mscale_all_dim, 0.707);
  EXPECT_EQ(info->yarn->original_max_position_embeddings, 4096u);
  EXPECT_EQ(info->routing.scoring, RouterScoring::kSoftmax);
  EXPECT_EQ(info->routing.groups, GroupScoring::kNone);
  EXPECT_FALSE(info->routing.normalize_topk);
  EXPECT_FALSE(info->routing.correction_bias);
  // MLA's cache: 512 + 64 values per layer, against 16 x (128 + 64 + 128) expanded.
  EXPECT_EQ(KvBytesPerToken(*info, 2), 27u * 576u * 2u);
  EXPECT_EQ(ExpandedKvBytesPerToken(*info, 2), 27u * 16u * 320u * 2u);
  EXPECT_NE(DescribeModel(*info).find("multi-head latent"), std::string::npos);
}

// deepseek-ai/DeepSeek-V3's config.json (the keys that matter), without its FP8
// quantization_config.
const char* kDeepseekV3 = R"({"architectures": ["DeepseekV3ForCausalLM"],
  "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
  "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
  "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
  "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
  "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
  "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128,
  "vocab_size": 129280})";

TEST(ModelConfig, ReadsDeepseekV3) {
  auto info = ParseModelConfig(kDeepseekV3, "/d");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->num_moe_layers, 58u);
  EXPECT_EQ(info->moe_layers.front(), 3u);
  EXPECT_EQ(info->mla->q_lora_rank, 1536u);
  EXPECT_TRUE(info->mla->rope_interleave);
  EXPECT_EQ(info->routing.scoring, RouterScoring::kSigmoid);
  EXPECT_EQ(info->routing.groups, GroupScoring::kTopTwoSum);
  EXPECT_EQ(info->routing.num_groups, 8u);
  EXPECT_EQ(info->routing.topk_groups, 4u);
  EXPECT_FLOAT_EQ(info->routing.scaling, 2.5f);
  EXPECT_TRUE(info->routing.normalize_topk);
  EXPECT_TRUE(info->routing.correction_bias);
  EXPECT_TRUE(info->router_correction_bias);

  // moe_layer_freq 2: every second layer from first_k_dense_replace.
  nlohmann::json j = nlohmann::json::parse(kDeepseekV3);
  j["moe_layer_freq"] = 2;
  j["num_hidden_layers"] = 8;
  auto freq = ParseModelConfig(j.dump(), "/d");
  ASSERT_TRUE(freq.ok()) << freq.status().ToString();
  EXPECT_EQ(freq->moe_layers, (std::vector<uint32_t>{4, 6}));
}

TEST(ModelConfig, ReadsDeepseekV3Fp8) {
  nlohmann::json j = nlohmann::json::parse(kDeepseekV3);
  j["quantization_config"] = {{"activation_scheme", "dynamic"},
                              {"fmt", "e4m3"},
                              {"quant_method", "fp8"},
                              {"weight_block_size", {128, 128}}};
  auto info = ParseModelConfig(j.dump(), "/d");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->quant.method, QuantMethod::kFp8Block);
  // DESIGN section 12: 42.0 MiB per routed expert (weights and float32 block scales).
  EXPECT_NEAR(static_cast<double>(RoutedExpertBytes(*info)) / (1 << 20), 42.0, 0.05);
  const std::string d = DescribeModel(*info);
  EXPECT_NE(d.find("quantized: fp8 e4m3 block 128x128; a routed expert stores 42.0"),
            std::string::npos)
      << d;
}

TEST(ModelConfig, RefusesWhatDeepseekDoesNotRun) {
  auto refused = [](const char* base, const char* key, nlohmann::json value) {
    nlohmann::json j = nlohmann::json::parse(base);
    j[key] = std::move(value);
    auto info = ParseModelConfig(j.dump(), "/d");
    EXPECT_FALSE(info.ok()) << key;
    return info.ok() ? std::string() : info.status().message();
  };
  std::string m = refused(kDeepseekV3, "quantization_config",
                          {{"activation_scheme", "static"},
                           {"fmt", "e4m3"},
                           {"quant_method", "fp8"},
                           {"weight_block_size", {128, 128}}});
  EXPECT_NE(m.find("quantization_config.activation_scheme: \"static\""), std::string::npos) << m;
  m = refused(kDeepseekV2Lite, "rope_scaling", {{"type", "linear"}, {"factor", 2.0}});
  EXPECT_NE(m.find("rope_scaling: type \"linear\""), std::string::npos) << m;
  m = refused(kDeepseekV2Lite, "rope_scaling",
              {{"type", "yarn"},
               {"factor", 2.0},
               {"original_max_position_embeddings", 64},
               {"attention_factor", 1.5}});
  EXPECT_NE(m.find("rope_scaling: attention_factor"), std::string::npos) << m;
  m = refused(kDeepseekV2Lite, "norm_topk_prob", true);
  EXPECT_NE(m.find("norm_topk_prob"), std::string::npos) << m;
  m = refused(kDeepseekV2Lite, "topk_method", "noaux_tc");
  EXPECT_NE(m.find("topk_method: \"noaux_tc\""), std::string::npos) << m;
  m = refused(kDeepseekV3, "scoring_func", "softmax");
  EXPECT_NE(m.find("scoring_func: \"softmax\""), std::string::npos) << m;
  m = refused(kDeepseekV3, "n_group", 3);
  EXPECT_NE(m.find("n_group 3 does not divide the 256 experts"), std::string::npos) << m;
  m = refused(kDeepseekV3, "attention_bias", true);
  EXPECT_NE(m.find("attention_bias"), std::string::npos) << m;
  // Other families still refuse any rope_scaling.
  nlohmann::json mixtral = nlohmann::json::parse(kMixtral);
  mixtral["rope_scaling"] = {{"type", "yarn"}, {"factor", 2.0}};
  EXPECT_FALSE(ParseModelConfig(mixtral.dump(), "/m").ok());
}

// As microsoft/Phi-3.5-MoE-instruct's config.json, with its LongRoPE factors cut to a head of 16
// (the real model's head_dim is 128: 64 factors each).
constexpr const char* kPhimoe = R"({"architectures": ["PhimoeForCausalLM"],
  "attention_bias": true, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 32000,
  "hidden_act": "silu", "hidden_dropout": 0.0, "hidden_size": 128, "initializer_range": 0.02,
  "input_jitter_noise": 0.01, "intermediate_size": 6400, "lm_head_bias": true,
  "max_position_embeddings": 131072, "model_type": "phimoe", "num_attention_heads": 8,
  "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 2,
  "num_local_experts": 16, "original_max_position_embeddings": 4096,
  "output_router_logits": false, "rms_norm_eps": 1e-05,
  "rope_scaling": {"long_factor": [1.0, 1.5, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0],
                   "long_mscale": 1.243163121016122, "original_max_position_embeddings": 4096,
                   "short_factor": [1.0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6],
                   "short_mscale": 1.243163121016122, "type": "longrope"},
  "rope_theta": 10000.0, "router_aux_loss_coef": 0.0, "router_jitter_noise": 0.01,
  "sliding_window": 131072, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "vocab_size": 32064})";

TEST(ModelConfig, ReadsPhimoe) {
  auto info = ParseModelConfig(kPhimoe, "/p");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->runtime_unsupported, "");
  EXPECT_EQ(info->num_moe_layers, 32u);
  EXPECT_EQ(info->num_experts, 16u);
  EXPECT_EQ(info->routing.scoring, RouterScoring::kSparseMixer);
  EXPECT_FLOAT_EQ(info->routing.jitter_eps, 0.01f);
  EXPECT_FALSE(info->routing.normalize_topk);
  EXPECT_TRUE(info->qkv_bias);
  EXPECT_TRUE(info->o_bias);
  EXPECT_TRUE(info->lm_head_bias);
  EXPECT_TRUE(info->layer_norm);
  EXPECT_EQ(info->head_dim, 16u);
  EXPECT_EQ(info->num_key_value_heads, 2u);
  EXPECT_EQ(info->rms_norm_eps, 1e-5);
  EXPECT_EQ(info->rope_theta, 10000.0);
  ASSERT_TRUE(info->sliding_window.has_value());
  EXPECT_EQ(*info->sliding_window, 131072u);
  ASSERT_TRUE(info->longrope.has_value());
  EXPECT_EQ(info->longrope->original_max_position_embeddings, 4096u);
  EXPECT_EQ(info->longrope->short_factor.size(), 8u);
  EXPECT_EQ(info->longrope->long_factor[7], 64.0);
  EXPECT_EQ(info->longrope->short_factor[2], 1.1);
  EXPECT_DOUBLE_EQ(info->longrope->long_mscale, 1.243163121016122);
  EXPECT_EQ(info->eos_token_ids, (std::vector<int32_t>{32000}));
  const std::string d = DescribeModel(*info);
  EXPECT_NE(d.find("sparsemixer"), std::string::npos) << d;
  // The Hub's own name for the architecture (its remote code) reads the same.
  nlohmann::json hub = nlohmann::json::parse(kPhimoe);
  hub["architectures"] = {"PhiMoEForCausalLM"};
  auto hub_info = ParseModelConfig(hub.dump(), "/p");
  ASSERT_TRUE(hub_info.ok()) << hub_info.status().ToString();
  EXPECT_EQ(hub_info->routing.scoring, RouterScoring::kSparseMixer);
  EXPECT_TRUE(hub_info->longrope.has_value());
  EXPECT_NE(d.find("LayerNorm, lm_head bias, LongRoPE (short factors up to 4096 tokens)"),
            std::string::npos)
      << d;
  // Defaults: no biases, plain RoPE, router_jitter_noise 0.01; a head_dim key is not read.
  auto plain = ParseModelConfig(R"({"architectures": ["PhimoeForCausalLM"],
    "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 100, "num_local_experts": 4,
    "num_experts_per_tok": 2, "intermediate_size": 32, "num_attention_heads": 4,
    "head_dim": 32})",
                                "/p");
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_FALSE(plain->qkv_bias);
  EXPECT_FALSE(plain->lm_head_bias);
  EXPECT_FALSE(plain->longrope.has_value());
  EXPECT_FLOAT_EQ(plain->routing.jitter_eps, 0.01f);
  EXPECT_EQ(plain->head_dim, 16u);
}

TEST(ModelConfig, RefusesWhatPhimoeDoesNotRun) {
  auto refused = [](const std::string& key, nlohmann::json value, bool in_rope = false) {
    nlohmann::json j = nlohmann::json::parse(kPhimoe);
    if (in_rope) {
      if (value.is_null()) {
        j["rope_scaling"].erase(key);
      } else {
        j["rope_scaling"][key] = std::move(value);
      }
    } else {
      j[key] = std::move(value);
    }
    auto info = ParseModelConfig(j.dump(), "/p");
    EXPECT_FALSE(info.ok()) << key;
    return info.ok() ? std::string() : info.status().message();
  };
  std::string m = refused("num_experts_per_tok", 4);
  EXPECT_NE(m.find("num_experts_per_tok: 4 is not implemented for PhimoeForCausalLM"),
            std::string::npos)
      << m;
  m = refused("router_jitter_noise", -0.5);
  EXPECT_NE(m.find("router_jitter_noise"), std::string::npos) << m;
  m = refused("hidden_act", "gelu");
  EXPECT_NE(m.find("hidden_act"), std::string::npos) << m;
  m = refused("partial_rotary_factor", 0.5);
  EXPECT_NE(m.find("partial_rotary_factor"), std::string::npos) << m;
  m = refused("original_max_position_embeddings", 2048);
  EXPECT_NE(m.find("original_max_position_embeddings: 2048 differs from rope_scaling's 4096"),
            std::string::npos)
      << m;
  m = refused("type", "yarn", true);
  EXPECT_NE(m.find("rope_scaling: type \"yarn\""), std::string::npos) << m;
  m = refused("short_factor", {1.0, 2.0}, true);
  EXPECT_NE(m.find("rope_scaling: short_factor: 2 values, expected head_dim / 2 = 8"),
            std::string::npos)
      << m;
  m = refused("long_factor", {1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -2.0}, true);
  EXPECT_NE(m.find("rope_scaling: long_factor: -2.0 is not a positive number"), std::string::npos)
      << m;
  m = refused("long_mscale", nullptr, true);
  EXPECT_NE(m.find("rope_scaling: long_mscale: missing"), std::string::npos) << m;
  m = refused("original_max_position_embeddings", nullptr, true);
  EXPECT_NE(m.find("original_max_position_embeddings: missing"), std::string::npos) << m;
  m = refused("beta_fast", 32, true);
  EXPECT_NE(m.find("rope_scaling: beta_fast is not implemented"), std::string::npos) << m;
  // LongRoPE's own factor and attention_factor change nothing in PhimoeForCausalLM: accepted.
  nlohmann::json j = nlohmann::json::parse(kPhimoe);
  j["rope_scaling"]["factor"] = 32.0;
  EXPECT_TRUE(ParseModelConfig(j.dump(), "/p").ok());
}

// GLM-4.5-Air's config.json (zai-org/GLM-4.5-Air): partial rotary by default, DeepSeek-V3's
// router with one group, a shared expert, a dense first layer, q/k/v biases, no q/k norm.
const char* kGlm45Air = R"({"architectures": ["Glm4MoeForCausalLM"], "attention_bias": true,
  "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
  "intermediate_size": 10944, "max_position_embeddings": 131072, "moe_intermediate_size": 1408,
  "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1, "norm_topk_prob": true,
  "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 46,
  "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5,
  "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 1000000, "routed_scaling_factor": 1.0,
  "tie_word_embeddings": false, "topk_group": 1, "torch_dtype": "bfloat16", "use_qk_norm": false,
  "vocab_size": 151552, "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329})";

TEST(ModelConfig, ReadsGlm45Air) {
  auto info = ParseModelConfig(kGlm45Air, "/g");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->num_moe_layers, 45u);
  EXPECT_EQ(info->moe_layers.front(), 1u);
  EXPECT_EQ(info->dense_intermediate_size, 10944u);
  EXPECT_EQ(info->shared_expert_intermediate_size, 1408u);
  EXPECT_EQ(info->head_dim, 128u);
  EXPECT_EQ(info->rotary_dim, 64u);
  EXPECT_EQ(RotaryDim(*info), 64u);
  EXPECT_TRUE(info->qkv_bias);
  EXPECT_FALSE(info->o_bias);
  EXPECT_EQ(info->qk_norm, QkNorm::kNone);
  EXPECT_EQ(info->routing.scoring, RouterScoring::kSigmoid);
  EXPECT_TRUE(info->routing.correction_bias);
  EXPECT_EQ(info->routing.groups, GroupScoring::kNone);
  EXPECT_TRUE(info->routing.normalize_topk);
  EXPECT_EQ(info->eos_token_ids.size(), 3u);
  // Without partial_rotary_factor, Glm4MoeConfig's 0.5.
  std::string no_factor = kGlm45Air;
  no_factor.replace(no_factor.find("\"partial_rotary_factor\": 0.5,"),
                    std::string("\"partial_rotary_factor\": 0.5,").size(), "");
  auto defaulted = ParseModelConfig(no_factor, "/g");
  ASSERT_TRUE(defaulted.ok()) << defaulted.status().ToString();
  EXPECT_EQ(defaulted->rotary_dim, 64u);
}

// MiniMax-M2's config.json (MiniMaxAI/MiniMax-M2, its FP8 quantization_config left out).
const char* kMinimaxM2 = R"({"architectures": ["MiniMaxM2ForCausalLM"], "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 1536,
  "max_position_embeddings": 196608, "num_attention_heads": 48, "num_experts_per_tok": 8,
  "num_hidden_layers": 62, "num_key_value_heads": 8, "num_local_experts": 256,
  "num_mtp_modules": 3, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5000000,
  "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0,
  "tie_word_embeddings": false, "use_qk_norm": true, "use_routing_bias": true,
  "vocab_size": 200064, "torch_dtype": "bfloat16"})";

TEST(ModelConfig, ReadsMinimaxM2) {
  auto info = ParseModelConfig(kMinimaxM2, "/x");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->num_moe_layers, 62u);
  EXPECT_EQ(info->num_experts, 256u);
  EXPECT_EQ(info->rotary_dim, 64u);
  EXPECT_EQ(info->qk_norm, QkNorm::kWhole);
  EXPECT_FALSE(info->qkv_bias);
  EXPECT_EQ(info->shared_expert_intermediate_size, 0u);
  EXPECT_EQ(info->routing.scoring, RouterScoring::kSigmoid);
  EXPECT_TRUE(info->router_correction_bias);
  EXPECT_TRUE(info->routing.normalize_topk);
  // MiniMax-M2.5 also writes partial_rotary_factor; it must agree.
  std::string both = kMinimaxM2;
  both.insert(both.find("\"rotary_dim\""), "\"partial_rotary_factor\": 0.5, ");
  EXPECT_TRUE(ParseModelConfig(both, "/x").ok());
}

TEST(ModelConfig, RefusesRotaryWidthsThatCannotRun) {
  const std::string minimax = std::string(kMinimaxM2).substr(0, std::string(kMinimaxM2).size() - 1);
  std::string glm = std::string(kGlm45Air).substr(0, std::string(kGlm45Air).size() - 1);
  const std::string factor = "\"partial_rotary_factor\": 0.5,";
  glm.replace(glm.find(factor), factor.size(), "");
  struct Case {
    std::string json;
    const char* error;
  } cases[] = {
      {minimax + R"(, "partial_rotary_factor": 0.25})",
       "rotary_dim: 64 disagrees with partial_rotary_factor 0.25 of head_dim 128"},
      {std::string(kMixtral).substr(0, std::string(kMixtral).size() - 1) +
           R"(, "partial_rotary_factor": 0.5})",
       "partial_rotary_factor: a rotary width of 16 of head_dim 32 is not implemented for "
       "MixtralForCausalLM"},
      {glm + R"(, "rotary_dim": 63})", "rotary_dim: gives a rotary width of 63 for head_dim 128"},
      {glm + R"(, "rotary_dim": 130})", "rotary_dim: gives a rotary width of 130"},
      {minimax + R"(, "qk_norm_type": "per_group"})",
       "qk_norm_type: \"per_group\" is not implemented"},
      {minimax + R"(, "shared_intermediate_size": 512})",
       "shared_intermediate_size: a shared expert is not implemented"},
      {minimax + R"(, "scoring_func": "sparsemixer"})",
       "scoring_func: \"sparsemixer\" is not implemented"},
      {glm + R"(, "n_shared_experts": -1})", "n_shared_experts: -1 is out of range"},
  };
  for (const auto& c : cases) {
    auto info = ParseModelConfig(c.json, "/m");
    ASSERT_FALSE(info.ok()) << c.json;
    EXPECT_NE(info.status().message().find(c.error), std::string::npos)
        << info.status().message() << "\n wanted: " << c.error;
  }
}

// openai/gpt-oss-20b's config.json (its MXFP4 quantization_config left out: the bfloat16 layout).
const char* kGptOss20b = R"({"architectures": ["GptOssForCausalLM"], "attention_bias": true,
  "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
  "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
  "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention",
  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
  "sliding_attention", "full_attention", "sliding_attention", "full_attention",
  "sliding_attention", "full_attention"], "max_position_embeddings": 131072,
  "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
  "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
  "pad_token_id": 199999, "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0,
  "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
  "rope_type": "yarn", "truncate": false}, "rope_theta": 150000, "router_aux_loss_coef": 0.9,
  "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "vocab_size": 201088})";

TEST(ModelConfig, ReadsGptOss20b) {
  auto info = ParseModelConfig(kGptOss20b, "/o");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->num_moe_layers, 24u);
  EXPECT_EQ(info->num_experts, 32u);
  EXPECT_EQ(info->top_k, 4u);
  EXPECT_EQ(info->head_dim, 64u);
  EXPECT_EQ(RotaryDim(*info), 64u);
  ASSERT_EQ(info->sliding_layers.size(), 24u);
  EXPECT_TRUE(info->sliding_layers[0]);
  EXPECT_FALSE(info->sliding_layers[1]);
  EXPECT_EQ(info->sliding_window, 128u);
  EXPECT_TRUE(info->attention_sinks && info->qkv_bias && info->o_bias);
  EXPECT_TRUE(info->router_bias && info->expert_bias);
  EXPECT_EQ(info->swiglu_limit, 7.0);
  EXPECT_EQ(info->routing.scoring, RouterScoring::kSoftmaxTopK);
  ASSERT_TRUE(info->yarn.has_value());
  EXPECT_EQ(info->yarn->factor, 32.0);
  EXPECT_FALSE(info->yarn->truncate);
  EXPECT_EQ(info->yarn->original_max_position_embeddings, 4096u);
  // 3 x 2880 x 2880 parameters an expert, and its biases (2 x 2880 on gate_up, 2880 on down).
  EXPECT_EQ(RoutedExpertParams(*info), 3ull * 2880 * 2880 + 3 * 2880);
  const std::string described = DescribeModel(*info);
  EXPECT_NE(described.find("sliding window 128 on 12 of 24 layers, attention sinks, YaRN x32"),
            std::string::npos)
      << described;
}

TEST(ModelConfig, ReadsGptOssMxfp4) {
  const std::string base = std::string(kGptOss20b).substr(0, std::string(kGptOss20b).size() - 1);
  auto info = ParseModelConfig(
      base +
          R"(, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}})",
      "/o");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->quant.method, QuantMethod::kMxfp4);
  // 2880 x 5760 and 2880 x 2880 FP4 values at 17/32 bytes each (half a byte and a scale byte
  // per 32), and the biases in bfloat16: 12.6 MiB per gpt-oss expert (DESIGN section 12).
  const uint64_t expected = (5760ull * 2880 + 2880ull * 2880) / 2 +
                            (5760ull * 2880 + 2880ull * 2880) / 32 + (2 * 2880 + 2880) * 2;
  EXPECT_EQ(RoutedExpertBytes(*info), expected);
  EXPECT_NEAR(static_cast<double>(RoutedExpertBytes(*info)) / (1 << 20), 12.6, 0.05);
}

TEST(ModelConfig, RefusesWhatGptOssCannotRun) {
  const std::string base = std::string(kGptOss20b).substr(0, std::string(kGptOss20b).size() - 1);
  struct Case {
    std::string json;
    const char* error;
  } cases[] = {
      {base + R"(, "layer_types": ["sliding_attention"]})",
       "layer_types: not a list of 24 layer types"},
      {std::string(kGptOss20b)
           .replace(std::string(kGptOss20b).find("\"full_attention\""), 16,
                    "\"chunked_attention\""),
       "layer_types[1]: \"chunked_attention\" is not"},
      {base +
           R"(, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "low_freq_factor": 1}})",
       "low_freq_factor"},
      {base + R"(, "swiglu_limit": -1})", "swiglu_limit"},
      {base + R"(, "quantization_config": {"quant_method": "mxfp4", "block_size": 16}})",
       "quantization_config.block_size: 16 is not implemented for mxfp4"},
      {base + R"(, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": 7}})",
       "quantization_config.modules_to_not_convert: 7 is not a list of module names"},
  };
  for (const auto& c : cases) {
    auto info = ParseModelConfig(c.json, "/m");
    ASSERT_FALSE(info.ok()) << c.json;
    EXPECT_NE(info.status().message().find(c.error), std::string::npos)
        << info.status().message() << "\n wanted: " << c.error;
  }
}

}  // namespace
}  // namespace fmoe
