// fmoe-train end to end on a few KB of generated text with a tiny shape: the loss falls, the aux
// loss is finite, and the directory it writes loads through the project's own loaders
// (Checkpoint, LoadModelInfo, Tokenizer) with every tensor where the HF Mixtral layout puts it.
#include "tools/trainer/trainer.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/model/checkpoint.h"
#include "common/model/model_config.h"
#include "common/text/tokenizer.h"

namespace fmoe::trainer {
namespace {
namespace fs = std::filesystem;

// Deterministic English-like documents separated by "</s>" lines, as prepare_corpus.sh writes.
std::string Corpus(int docs, int seed) {
  const std::vector<std::string> subjects = {"The farmer", "A small bird", "The old king",
                                             "My sister",  "The river",    "A quiet child"};
  const std::vector<std::string> verbs = {"walked to",  "looked at", "sang about",
                                          "dreamed of", "ran past",  "spoke with"};
  const std::vector<std::string> objects = {"the green hill.",    "the bright morning.",
                                            "the wooden bridge.", "the silver moon.",
                                            "the busy market.",   "the tall tower."};
  std::string out;
  unsigned state = unsigned(seed);
  for (int d = 0; d < docs; ++d) {
    if (d > 0) out += "</s>\n";
    for (int s = 0; s < 6; ++s) {
      state = state * 1103515245u + 12345u;
      out += subjects[(state >> 8) % subjects.size()] + " " + verbs[(state >> 12) % verbs.size()] +
             " " + objects[(state >> 16) % objects.size()] + "\n";
    }
  }
  return out;
}

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("fmoe_trainer_test_" + std::to_string(getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_ / "data");
    std::ofstream(root_ / "data" / "train.txt") << Corpus(60, 1);
    std::ofstream(root_ / "data" / "val.txt") << Corpus(6, 2);
  }
  void TearDown() override { fs::remove_all(root_); }

  TrainOptions Tiny() const {
    TrainOptions o;
    o.data_dir = (root_ / "data").string();
    o.out_dir = (root_ / "model").string();
    o.shape.vocab_size = 320;
    o.shape.hidden_size = 32;
    o.shape.intermediate_size = 24;
    o.shape.num_layers = 2;
    o.shape.num_heads = 4;
    o.shape.num_kv_heads = 2;
    o.shape.num_experts = 4;
    o.shape.top_k = 2;
    o.shape.max_position_embeddings = 64;
    o.shape.tie_word_embeddings = false;  // exercise lm_head.weight too
    o.steps = 60;
    o.batch = 4;
    o.seq_len = 32;
    o.lr = 1e-2;
    o.warmup_steps = 5;
    o.log_every = 5;
    o.eval_every = 30;
    o.eval_windows = 4;
    o.checkpoint_every = 30;
    o.final_train_windows = 8;
    o.sample_prompts = {"The old king"};
    o.sample_tokens = 8;
    return o;
  }

  fs::path root_;
};

TEST_F(TrainerTest, LossFallsAndTheDirectoryLoads) {
  const TrainOptions o = Tiny();
  auto report = RunTraining(o);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ASSERT_GE(report->logged_loss.size(), 2u);
  EXPECT_LT(report->logged_loss.back(), report->logged_loss.front() - 0.5)
      << "first " << report->logged_loss.front() << " last " << report->logged_loss.back();
  EXPECT_TRUE(std::isfinite(report->last_aux_loss));
  EXPECT_GT(report->last_aux_loss, 0.0);
  EXPECT_EQ(report->steps, 60u);
  EXPECT_EQ(report->tokens_seen, 60u * 4 * 32);
  EXPECT_TRUE(std::isfinite(report->val_bf16.loss));
  ASSERT_EQ(report->val_bf16.usage_entropy.size(), 2u);
  for (double e : report->val_bf16.usage_entropy) {
    EXPECT_GT(e, 0.0);
    EXPECT_LE(e, 1.0 + 1e-9);
  }

  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json",
                        "tokenizer_config.json", "MODEL_CARD.md"}) {
    EXPECT_TRUE(fs::exists(fs::path(o.out_dir) / f)) << f;
  }

  auto info = LoadModelInfo(o.out_dir);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->architecture, "MixtralForCausalLM");
  EXPECT_EQ(info->num_hidden_layers, 2u);
  EXPECT_EQ(info->num_experts, 4u);
  EXPECT_EQ(info->top_k, 2u);
  EXPECT_EQ(info->hidden_size, 32u);
  EXPECT_EQ(info->intermediate_size, 24u);
  EXPECT_EQ(info->num_key_value_heads, 2u);
  EXPECT_EQ(info->head_dim, 8u);
  EXPECT_EQ(info->vocab_size, 320u);
  EXPECT_EQ(info->torch_dtype, "bfloat16");
  EXPECT_DOUBLE_EQ(info->rope_theta, 10000.0);

  auto ckpt = Checkpoint::Open(o.out_dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected = {
      {"model.embed_tokens.weight", {320, 32}},
      {"model.norm.weight", {32}},
      {"lm_head.weight", {320, 32}}};
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    expected.push_back({p + "input_layernorm.weight", {32}});
    expected.push_back({p + "post_attention_layernorm.weight", {32}});
    expected.push_back({p + "self_attn.q_proj.weight", {32, 32}});
    expected.push_back({p + "self_attn.k_proj.weight", {16, 32}});
    expected.push_back({p + "self_attn.v_proj.weight", {16, 32}});
    expected.push_back({p + "self_attn.o_proj.weight", {32, 32}});
    expected.push_back({p + "block_sparse_moe.gate.weight", {4, 32}});
    for (int j = 0; j < 4; ++j) {
      const std::string e = p + "block_sparse_moe.experts." + std::to_string(j) + ".";
      expected.push_back({e + "w1.weight", {24, 32}});
      expected.push_back({e + "w2.weight", {32, 24}});
      expected.push_back({e + "w3.weight", {24, 32}});
    }
  }
  for (const auto& [name, shape] : expected) {
    auto t = (*ckpt)->Get(name, shape);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ((*t)->dtype, DType::kBF16) << name;
  }
  EXPECT_EQ((*ckpt)->TensorNames().size(), expected.size());

  auto tok = Tokenizer::Load(o.out_dir);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_LE((*tok)->vocab_size(), 320u);
  EXPECT_EQ((*tok)->TokenToId("<s>"), std::optional<int32_t>(1));
  EXPECT_EQ((*tok)->TokenToId("</s>"), std::optional<int32_t>(2));
  const std::string text = "The quiet farmer sang about the silver bridge.\nÜber 42 zebras!";
  auto ids = (*tok)->Encode(text, /*add_special_tokens=*/false);
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  EXPECT_LT(ids->size(), text.size());  // merges were learnt
  EXPECT_EQ((*tok)->Decode(*ids, /*skip_special_tokens=*/false), text);

  // The saved BF16 weights, loaded back through Checkpoint, continue the prompt exactly as the
  // trainer's in-memory BF16-rounded model did.
  ASSERT_EQ(report->samples.size(), 1u);
  auto generated = GenerateGreedy(o.out_dir, report->samples[0].first, 8, nullptr);
  ASSERT_TRUE(generated.ok()) << generated.status().ToString();
  EXPECT_EQ(*generated, report->samples[0].second);
}

TEST_F(TrainerTest, ResumesFromTheCheckpoint) {
  TrainOptions o = Tiny();
  o.steps = 20;
  o.checkpoint_every = 10;
  o.sample_prompts.clear();
  auto first = RunTraining(o);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  o.steps = 30;
  o.resume = true;
  auto resumed = RunTraining(o);
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  EXPECT_EQ(resumed->steps, 30u);
  EXPECT_EQ(resumed->tokens_seen, 30u * 4 * 32);
  // Only the 10 new steps ran in this process: two logged intervals of 5.
  EXPECT_EQ(resumed->logged_loss.size(), 2u);
}

TEST(TrainerOptions, RejectsBadShapes) {
  TrainOptions o;
  o.data_dir = "/nonexistent";
  o.out_dir = "/nonexistent/out";
  o.shape.num_kv_heads = 3;
  auto r = RunTraining(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("kv heads"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace fmoe::trainer
