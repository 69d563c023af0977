#include "common/model/checkpoint.h"

#include "common/model/model_config.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <tuple>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

namespace fs = std::filesystem;

// One float32 tensor filled with `fill`.
struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  float fill = 0;
};

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("fmoe-ckpt-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Dir() const { return dir_.string(); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  void WriteShard(const std::string& file, const std::vector<Spec>& specs) const {
    std::vector<std::vector<float>> data;
    data.reserve(specs.size());
    std::vector<TensorToWrite> tensors;
    for (const Spec& s : specs) {
      int64_t n = 1;
      for (int64_t d : s.shape) n *= d;
      data.emplace_back(static_cast<size_t>(n), s.fill);
      tensors.push_back(
          {s.name, DType::kF32, s.shape, std::as_bytes(std::span<const float>(data.back()))});
    }
    ASSERT_TRUE(WriteSafetensors(Path(file), tensors).ok());
  }

  void WriteText(const std::string& file, const std::string& text) const {
    std::ofstream(Path(file), std::ios::binary | std::ios::trunc) << text;
  }

  // An index mapping each (tensor, file) pair.
  void WriteIndex(const std::vector<std::pair<std::string, std::string>>& entries) const {
    std::string text = R"({"metadata": {"total_size": 0}, "weight_map": {)";
    for (size_t i = 0; i < entries.size(); ++i) {
      text += (i ? ", \"" : "\"") + entries[i].first + "\": \"" + entries[i].second + "\"";
    }
    WriteText("model.safetensors.index.json", text + "}}");
  }

  // A good three-shard checkpoint.
  void WriteSharded() const {
    WriteShard("model-00001-of-00003.safetensors",
               {{"model.embed_tokens.weight", {16, 4}, 1}, {"model.norm.weight", {4}, 2}});
    WriteShard("model-00002-of-00003.safetensors", {{"model.layers.0.w1", {8, 4}, 3}});
    WriteShard("model-00003-of-00003.safetensors", {{"lm_head.weight", {16, 4}, 4}});
    WriteIndex({{"model.embed_tokens.weight", "model-00001-of-00003.safetensors"},
                {"model.norm.weight", "model-00001-of-00003.safetensors"},
                {"model.layers.0.w1", "model-00002-of-00003.safetensors"},
                {"lm_head.weight", "model-00003-of-00003.safetensors"}});
  }

  Status OpenError() const {
    auto ckpt = Checkpoint::Open(Dir());
    EXPECT_FALSE(ckpt.ok()) << "opened";
    return ckpt.ok() ? Status::Ok() : ckpt.status();
  }

  fs::path dir_;
};

float FirstFloat(const TensorView* view) {
  float f = 0;
  std::memcpy(&f, view->data.data(), sizeof(f));
  return f;
}

TEST_F(CheckpointTest, OpensASingleFile) {
  WriteShard("model.safetensors", {{"a", {4, 8}, 1.5f}, {"b", {3}, -2}});
  std::vector<std::tuple<size_t, size_t, uint64_t>> calls;
  auto ckpt = Checkpoint::Open(Dir(), [&](size_t done, size_t total, uint64_t bytes) {
    calls.emplace_back(done, total, bytes);
  });
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  EXPECT_EQ((*ckpt)->dir(), Dir());
  EXPECT_EQ((*ckpt)->TensorNames(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ((*ckpt)->total_bytes(), fs::file_size(Path("model.safetensors")));
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0], std::make_tuple(size_t{1}, size_t{1}, (*ckpt)->total_bytes()));

  auto a = (*ckpt)->Get("a", {4, 8});
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(FirstFloat(*a), 1.5f);
  EXPECT_EQ((*ckpt)->Find("b")->shape, std::vector<int64_t>{3});
  EXPECT_TRUE((*ckpt)->Get("b", {}).ok()) << "an empty shape skips the check";
  EXPECT_EQ((*ckpt)->FileOf("a"), Path("model.safetensors"));
  EXPECT_EQ((*ckpt)->FileOf("zz"), "");
  EXPECT_EQ((*ckpt)->Find("zz"), nullptr);

  auto wrong = (*ckpt)->Get("a", {4, 16});
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(wrong.status().message(), "model: " + Path("model.safetensors") +
                                          ": tensor \"a\": shape [4, 8], expected [4, 16]");
  auto missing = (*ckpt)->Get("lm_head.weight", {4, 8});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), ErrorCode::kNotFound);
  EXPECT_EQ(missing.status().message(),
            "model: " + Dir() + ": tensor \"lm_head.weight\" is missing");
}

TEST_F(CheckpointTest, OpensShardsThroughTheIndex) {
  WriteSharded();
  // A shard the index does not name is ignored, even a broken one.
  WriteText("model-00009-of-00009.safetensors", "garbage");
  std::vector<std::tuple<size_t, size_t, uint64_t>> calls;
  auto ckpt = Checkpoint::Open(Dir() + "/", [&](size_t done, size_t total, uint64_t bytes) {
    calls.emplace_back(done, total, bytes);
  });
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  EXPECT_EQ((*ckpt)->dir(), Dir());
  EXPECT_EQ((*ckpt)->TensorNames().size(), 4u);
  struct {
    const char* name;
    std::vector<int64_t> shape;
    float fill;
    const char* file;
  } want[] = {
      {"model.embed_tokens.weight", {16, 4}, 1, "model-00001-of-00003.safetensors"},
      {"model.norm.weight", {4}, 2, "model-00001-of-00003.safetensors"},
      {"model.layers.0.w1", {8, 4}, 3, "model-00002-of-00003.safetensors"},
      {"lm_head.weight", {16, 4}, 4, "model-00003-of-00003.safetensors"},
  };
  for (const auto& w : want) {
    auto t = (*ckpt)->Get(w.name, w.shape);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ(FirstFloat(*t), w.fill) << w.name;
    EXPECT_EQ((*ckpt)->FileOf(w.name), Path(w.file));
  }
  uint64_t total = 0;
  for (int i = 1; i <= 3; ++i) {
    total += fs::file_size(Path("model-0000" + std::to_string(i) + "-of-00003.safetensors"));
  }
  EXPECT_EQ((*ckpt)->total_bytes(), total);
  ASSERT_EQ(calls.size(), 3u);
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(std::get<0>(calls[i]), i + 1);
    EXPECT_EQ(std::get<1>(calls[i]), 3u);
  }
  EXPECT_LT(std::get<2>(calls[0]), std::get<2>(calls[1]));
  EXPECT_EQ(std::get<2>(calls[2]), total);

  auto wrong = (*ckpt)->Get("model.layers.0.w1", {4, 8});
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().message(), "model: " + Path("model-00002-of-00003.safetensors") +
                                          ": tensor \"model.layers.0.w1\": shape [8, 4], "
                                          "expected [4, 8]");
  EXPECT_EQ((*ckpt)->Get("model.layers.1.w1", {}).status().code(), ErrorCode::kNotFound);
}

TEST_F(CheckpointTest, SingleFileWinsOverAnIndex) {
  WriteShard("model.safetensors", {{"only", {2}, 7}});
  WriteIndex({{"x", "missing.safetensors"}});
  auto ckpt = Checkpoint::Open(Dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  EXPECT_EQ((*ckpt)->TensorNames(), std::vector<std::string>{"only"});
}

TEST_F(CheckpointTest, MissingDirectoryOrWeights) {
  auto none = Checkpoint::Open(Dir() + "/absent");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), ErrorCode::kNotFound);
  EXPECT_EQ(none.status().message(), "model: " + Dir() + "/absent: no such directory");

  Status empty = OpenError();
  EXPECT_EQ(empty.code(), ErrorCode::kNotFound);
  EXPECT_EQ(empty.message(),
            "model: " + Dir() + ": no model.safetensors or model.safetensors.index.json");

  WriteShard("model-00001-of-00001.safetensors", {{"a", {2}, 1}});
  EXPECT_EQ(OpenError().code(), ErrorCode::kNotFound) << "shards without an index are not read";
}

TEST_F(CheckpointTest, ReleasePagesNamesTheFileAndTensor) {
  WriteSharded();
  auto ckpt = Checkpoint::Open(Dir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  const std::vector<int64_t> shape = {8, 4};
  EXPECT_TRUE((*ckpt)->ReleasePages("model.layers.0.w1", 0, 128).ok());
  EXPECT_TRUE((*ckpt)->ReleasePages("model.layers.0.w1", 64, 64).ok());
  // The data reads back after the release.
  EXPECT_EQ(FirstFloat(*(*ckpt)->Get("model.layers.0.w1", shape)), 3.0f);

  Status missing = (*ckpt)->ReleasePages("zz", 0, 1);
  EXPECT_EQ(missing.code(), ErrorCode::kNotFound);
  EXPECT_EQ(missing.message(), "model: " + Dir() + ": tensor \"zz\" is missing");
  Status past = (*ckpt)->ReleasePages("model.layers.0.w1", 64, 65);
  EXPECT_EQ(past.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(past.message(), "model: " + Path("model-00002-of-00003.safetensors") +
                                ": tensor \"model.layers.0.w1\": bytes [64, +65) run past its 128");
}

TEST_F(CheckpointTest, CorruptSingleFile) {
  WriteText("model.safetensors", "short");
  Status s = OpenError();
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss);
  EXPECT_EQ(s.message().rfind("model: " + Path("model.safetensors") + ": ", 0), 0u) << s.message();
}

TEST_F(CheckpointTest, IndexNamingAMissingFile) {
  WriteShard("a.safetensors", {{"x", {2}, 1}});
  WriteIndex({{"x", "a.safetensors"}, {"y", "b.safetensors"}});
  Status s = OpenError();
  EXPECT_EQ(s.code(), ErrorCode::kNotFound);
  EXPECT_EQ(s.message(), "model: " + Path("model.safetensors.index.json") +
                             ": weight_map: \"y\" -> \"b.safetensors\": " + Path("b.safetensors") +
                             ": no such file");
}

TEST_F(CheckpointTest, CorruptShard) {
  WriteShard("a.safetensors", {{"x", {2}, 1}});
  WriteText("b.safetensors", std::string("\x04\0\0\0\0\0\0\0{}", 10) + "xx");
  WriteIndex({{"x", "a.safetensors"}, {"y", "b.safetensors"}});
  Status s = OpenError();
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss);
  EXPECT_NE(s.message().find(Path("b.safetensors") + ": "), std::string::npos) << s.message();
}

TEST_F(CheckpointTest, ShardPathsMustStayInTheDirectory) {
  WriteShard("a.safetensors", {{"x", {2}, 1}});
  fs::create_directories(dir_ / "sub");
  WriteShard("sub/b.safetensors", {{"model.norm.weight", {2}, 1}});
  for (std::string bad :
       {"../x.safetensors", "/etc/passwd", "sub/b.safetensors", "..", ".", "", "./a.safetensors"}) {
    SCOPED_TRACE(bad);
    WriteIndex({{"x", "a.safetensors"}, {"model.norm.weight", bad}});
    Status s = OpenError();
    EXPECT_EQ(s.code(), ErrorCode::kDataLoss);
    EXPECT_EQ(s.message(), "model: " + Path("model.safetensors.index.json") +
                               ": weight_map: \"model.norm.weight\" -> \"" + bad +
                               "\" leaves the model directory");
  }
}

TEST_F(CheckpointTest, TensorMustBeInTheFileTheIndexNames) {
  WriteShard("a.safetensors", {{"x", {2}, 1}});
  WriteShard("b.safetensors", {{"y", {2}, 1}});
  WriteIndex({{"x", "b.safetensors"}, {"y", "b.safetensors"}, {"z", "a.safetensors"}});
  Status s = OpenError();
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss);
  EXPECT_EQ(s.message(), "model: " + Path("model.safetensors.index.json") +
                             ": weight_map: \"x\" -> \"b.safetensors\": b.safetensors has no "
                             "tensor \"x\"");

  WriteIndex({{"x", "a.safetensors"}, {"y", "b.safetensors"}, {"gone", "b.safetensors"}});
  s = OpenError();
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss);
  EXPECT_NE(s.message().find("\"gone\" -> \"b.safetensors\": b.safetensors has no tensor"),
            std::string::npos)
      << s.message();
}

TEST_F(CheckpointTest, TensorInTwoShards) {
  WriteShard("a.safetensors", {{"x", {2}, 1}, {"w", {2}, 1}});
  WriteShard("b.safetensors", {{"w", {2}, 2}, {"y", {2}, 1}});
  WriteIndex({{"x", "a.safetensors"}, {"y", "b.safetensors"}, {"w", "a.safetensors"}});
  Status s = OpenError();
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss);
  EXPECT_EQ(s.message(), "model: " + Dir() + ": tensor \"w\" is in both " + Path("a.safetensors") +
                             " and " + Path("b.safetensors"));
}

TEST_F(CheckpointTest, MalformedIndex) {
  WriteShard("a.safetensors", {{"x", {2}, 1}});
  struct {
    const char* text;
    const char* error;
  } cases[] = {
      {"{", ": not valid JSON"},
      {"[]", ": not a JSON object"},
      {R"({"metadata": {}})", ": weight_map: missing"},
      {R"({"weight_map": ["a.safetensors"]})", ": weight_map: not an object"},
      {R"({"weight_map": {}})", ": weight_map: empty"},
      {R"({"weight_map": {"x": 3}})", ": weight_map: \"x\": not a file name"},
  };
  for (const auto& c : cases) {
    WriteText("model.safetensors.index.json", c.text);
    Status s = OpenError();
    EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << c.text;
    EXPECT_EQ(s.message(), "model: " + Path("model.safetensors.index.json") + c.error);
  }
}

// The committed Mixtral reference (tests/fixtures/gen_mixtral_reference.py): three shards written
// by Hugging Face's save_pretrained, read through its index.
TEST(CheckpointFixture, OpensTheMixtralReference) {
  const std::string dir = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/mixtral-ref";
  auto info = LoadModelInfo(dir);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->architecture, "MixtralForCausalLM");
  EXPECT_EQ(info->weight_files.size(), 3u);
  EXPECT_EQ(info->num_moe_layers, 3u);
  EXPECT_EQ(info->num_key_value_heads, 2u);
  EXPECT_EQ(info->head_dim, 8u);
  EXPECT_EQ(info->rope_theta, 10000.0);
  EXPECT_EQ(info->eos_token_ids, std::vector<int32_t>{2});

  std::vector<size_t> done;
  auto ckpt = Checkpoint::Open(dir, [&](size_t d, size_t total, uint64_t) {
    EXPECT_EQ(total, 3u);
    done.push_back(d);
  });
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  EXPECT_EQ(done, (std::vector<size_t>{1, 2, 3}));
  const int64_t h = info->hidden_size;
  const int64_t v = info->vocab_size;
  const int64_t inter = info->intermediate_size;
  const int64_t q = info->num_attention_heads * info->head_dim;
  const int64_t kv = info->num_key_value_heads * info->head_dim;
  size_t expected = 3;  // embed_tokens, norm, lm_head
  EXPECT_TRUE((*ckpt)->Get("model.embed_tokens.weight", {v, h}).ok());
  EXPECT_TRUE((*ckpt)->Get("model.norm.weight", {h}).ok());
  EXPECT_TRUE((*ckpt)->Get("lm_head.weight", {v, h}).ok());
  for (uint32_t l = 0; l < info->num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const std::pair<std::string, std::vector<int64_t>> dense[] = {
        {"input_layernorm.weight", {h}},
        {"post_attention_layernorm.weight", {h}},
        {"self_attn.q_proj.weight", {q, h}},
        {"self_attn.k_proj.weight", {kv, h}},
        {"self_attn.v_proj.weight", {kv, h}},
        {"self_attn.o_proj.weight", {h, q}},
        {"block_sparse_moe.gate.weight", {info->num_experts, h}},
    };
    for (const auto& [name, shape] : dense) {
      auto t = (*ckpt)->Get(p + name, shape);
      EXPECT_TRUE(t.ok()) << t.status().ToString();
      if (t.ok()) {
        EXPECT_EQ((*t)->dtype, DType::kF32);
      }
      ++expected;
    }
    for (uint32_t e = 0; e < info->num_experts; ++e) {
      const std::string x = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
      EXPECT_TRUE((*ckpt)->Get(x + "w1.weight", {inter, h}).ok()) << x;
      EXPECT_TRUE((*ckpt)->Get(x + "w2.weight", {h, inter}).ok()) << x;
      EXPECT_TRUE((*ckpt)->Get(x + "w3.weight", {inter, h}).ok()) << x;
      expected += 3;
    }
  }
  EXPECT_EQ((*ckpt)->TensorNames().size(), expected);
  // The norm weights were randomised around 1 (HF initialises them to exactly 1).
  const TensorView* norm = (*ckpt)->Find("model.norm.weight");
  std::vector<float> values(static_cast<size_t>(norm->numel()));
  ASSERT_TRUE(ConvertToF32(norm->dtype, norm->data, values).ok());
  EXPECT_NE(values[0], 1.0f);
  EXPECT_GT(values[0], 0.0f);
}

}  // namespace
}  // namespace fmoe
