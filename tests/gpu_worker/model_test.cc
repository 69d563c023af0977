// The model runtime against Hugging Face transformers, one fixture per family
// (tests/fixtures/<family>-ref, made by tests/fixtures/gen_moe_reference.py): prefill logits,
// router probabilities and top-k, greedy continuations, tokenizer ids; batch invariance; a
// LibTorch error as a Status; and bad checkpoints.
#include "gpu_worker/model/model.h"

#include <unistd.h>

#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/json.h"
#include "common/model/checkpoint.h"
#include "common/model/model_config.h"
#include "common/model/safetensors.h"
#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"
#include "gpu_worker/experts/expert_source.h"
#include "gpu_worker/model/blocks.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

const std::string kRefDir = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/mixtral-ref";

Json ReadJson(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return Json::parse(ss.str());
}

struct Runtime {
  ModelInfo info;
  std::unique_ptr<MoeModel> model;
  std::unique_ptr<ResidentExperts> experts;
};

Result<Runtime> LoadRuntime(const std::string& dir, RuntimeOptions options = {}) {
  Runtime rt;
  FMOE_ASSIGN_OR_RETURN(rt.info, LoadModelInfo(dir));
  ExpertTable table;
  FMOE_ASSIGN_OR_RETURN(rt.model, MoeModel::Load(rt.info, options, {}, &table));
  rt.experts = std::make_unique<ResidentExperts>(std::move(table));
  return rt;
}

// The fixtures: the families, then one quantized checkpoint per format (DESIGN section 12;
// references from the dequantized float model: tests/fixtures/gen_quant_reference.py).
const char* const kFamilies[] = {
    "mixtral-ref",      "qwen2-moe-ref",       "qwen3-moe-ref",
    "olmoe-ref",        "deepseek-v2-ref",     "deepseek-v3-ref",
    "phimoe-ref",       "deepseek-v3-fp8-ref", "qwen3-moe-fp8-channel-ref",
    "kimi-k2-int4-ref", "mixtral-gptq-ref",    "qwen2-moe-awq-ref",
    "glm4-moe-ref",     "minimax-m2-ref",      "gpt-oss-ref",
    "gpt-oss-mxfp4-ref"};

std::string FixtureDir(const std::string& name) {
  return std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/" + name;
}

Runtime& Fixture(const std::string& name) {
  static auto* loaded = new std::map<std::string, std::unique_ptr<Runtime>>();
  auto& rt = (*loaded)[name];
  if (!rt) {
    auto r = LoadRuntime(FixtureDir(name));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    rt = std::make_unique<Runtime>(std::move(*r));
  }
  return *rt;
}

const Json& FixtureJson(const std::string& name) {
  static auto* loaded = new std::map<std::string, Json>();
  auto it = loaded->find(name);
  if (it == loaded->end()) {
    it = loaded->emplace(name, ReadJson(FixtureDir(name) + "/reference.json")).first;
  }
  return it->second;
}

Runtime& Reference() { return Fixture("mixtral-ref"); }
const Json& ReferenceJson() { return FixtureJson("mixtral-ref"); }

std::vector<int32_t> Ids(const Json& j) { return j.get<std::vector<int32_t>>(); }

// A prompt's reference logits: "logits" holds the [T][V] float32 values row-major, little-endian,
// in base64 (the generators' f32_b64).
std::vector<float> RefLogits(const Json& prompt) {
  static const std::string kAlphabet =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  const std::string text = prompt.at("logits").get<std::string>();
  std::vector<uint8_t> bytes;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : text) {
    if (c == '=') break;
    const size_t v = kAlphabet.find(c);
    EXPECT_NE(v, std::string::npos) << "not base64: " << c;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      bytes.push_back(static_cast<uint8_t>((acc >> bits) & 0xff));
    }
  }
  EXPECT_EQ(bytes.size() % 4, 0u);
  std::vector<float> out(bytes.size() / 4);
  for (size_t i = 0; i < out.size(); ++i) {
    const uint32_t u = uint32_t{bytes[4 * i]} | uint32_t{bytes[4 * i + 1]} << 8 |
                       uint32_t{bytes[4 * i + 2]} << 16 | uint32_t{bytes[4 * i + 3]} << 24;
    std::memcpy(&out[i], &u, 4);
  }
  return out;
}

// Prefill of `tokens` in a fresh cache; all logits.
ForwardResult Prefill(Runtime& rt, const std::vector<int32_t>& tokens, bool record_router = false) {
  auto kv = rt.model->NewKvCache();
  SequenceInput in;
  in.tokens = tokens;
  in.kv = kv.get();
  in.all_logits = true;
  ForwardResult out;
  Status s = rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out, record_router);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

size_t ArgMax(std::span<const float> v) {
  size_t best = 0;
  for (size_t i = 1; i < v.size(); ++i) {
    if (v[i] > v[best]) best = i;
  }
  return best;
}

class FamilyReference : public ::testing::TestWithParam<const char*> {};

INSTANTIATE_TEST_SUITE_P(Families, FamilyReference, ::testing::ValuesIn(kFamilies),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::erase(name, '-');
                           return name;
                         });

TEST_P(FamilyReference, PrefillLogitsAndRouterMatchTransformers) {
  Runtime& rt = Fixture(GetParam());
  const Json& ref = FixtureJson(GetParam());
  const size_t vocab = rt.info.vocab_size, experts = rt.info.num_experts;
  const size_t layers = rt.info.num_moe_layers, top_k = rt.info.top_k;
  ASSERT_GE(ref["prompts"].size(), 3u);  // One token, a short and a longer prompt at least.
  for (const Json& p : ref["prompts"]) {
    const std::vector<int32_t> ids = Ids(p["ids"]);
    const size_t t = ids.size();
    ForwardResult out = Prefill(rt, ids, /*record_router=*/true);
    ASSERT_EQ(out.logits[0].size(), t * vocab);
    const std::vector<float> ref_logits = RefLogits(p);
    ASSERT_EQ(ref_logits.size(), t * vocab);
    double max_logit_diff = 0;
    for (size_t i = 0; i < t * vocab; ++i) {
      max_logit_diff = std::max(max_logit_diff, double{std::abs(out.logits[0][i] - ref_logits[i])});
    }
    EXPECT_LE(max_logit_diff, 1e-4) << "prompt " << p["text"];
    ASSERT_EQ(out.router_probs.size(), layers);
    ASSERT_EQ(p["router_probs"].size(), layers);
    double max_router_diff = 0;
    for (size_t l = 0; l < layers; ++l) {
      for (size_t i = 0; i < t; ++i) {
        for (size_t e = 0; e < experts; ++e) {
          max_router_diff =
              std::max(max_router_diff, std::abs(out.router_probs[l][i * experts + e] -
                                                 p["router_probs"][l][i][e].get<double>()));
        }
        std::vector<int32_t> ours(out.router_topk[l].begin() + i * top_k,
                                  out.router_topk[l].begin() + (i + 1) * top_k);
        EXPECT_EQ(ours, Ids(p["top2_experts"][l][i])) << "layer " << l << " token " << i;
      }
    }
    EXPECT_LE(max_router_diff, 1e-5) << "prompt " << p["text"];
  }
}

// Computed in bfloat16 on the host (the dtype users load these families in; the attention's
// products run in float32 there, blocks.cc ProductDType), every family's prefill follows
// transformers' float32 logits within bfloat16's rounding: the median row's logits differ from
// the reference by under 5% of the row's spread (0.5-2.9% measured), and two rows in three or
// more have its argmax (72-100% measured).
TEST_P(FamilyReference, PrefillInBfloat16FollowsTransformers) {
  RuntimeOptions options;
  options.dtype = "bfloat16";
  auto rt = LoadRuntime(FixtureDir(GetParam()), options);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  const size_t vocab = rt->info.vocab_size;
  std::vector<double> row_diffs;  // Per row: the largest logit difference / the row's spread.
  size_t same_argmax = 0;
  for (const Json& p : FixtureJson(GetParam())["prompts"]) {
    const std::vector<int32_t> ids = Ids(p["ids"]);
    const size_t t = ids.size();
    ForwardResult out = Prefill(*rt, ids);
    ASSERT_EQ(out.logits[0].size(), t * vocab);
    const std::vector<float> ref = RefLogits(p);
    ASSERT_EQ(ref.size(), t * vocab);
    for (size_t i = 0; i < t; ++i) {
      std::span<const float> ours(out.logits[0].data() + i * vocab, vocab);
      std::span<const float> theirs(ref.data() + i * vocab, vocab);
      const auto [lo, hi] = std::minmax_element(theirs.begin(), theirs.end());
      double diff = 0;
      for (size_t v = 0; v < vocab; ++v) {
        diff = std::max(diff, double{std::abs(ours[v] - theirs[v])});
      }
      row_diffs.push_back(diff / std::max(1e-6, double{*hi - *lo}));
      same_argmax += ArgMax(ours) == ArgMax(theirs);
    }
  }
  // A tiny random model's router flips a top-k choice now and then in bfloat16, which moves a
  // row's logits a lot: the median row and the argmax agreement are what hold.
  const size_t rows = row_diffs.size();
  std::nth_element(row_diffs.begin(), row_diffs.begin() + rows / 2, row_diffs.end());
  EXPECT_LE(row_diffs[rows / 2], 0.05) << "median row";
  EXPECT_GT(row_diffs[rows / 2], 0.0) << "bfloat16 left the logits exact";
  EXPECT_GE(same_argmax * 3, rows * 2) << same_argmax << " of " << rows << " rows";
}

// Chunked prefill (gpu_worker/core/scheduler.h): the prompt fed in chunks of 1, 3 and 7 tokens,
// each chunk attending to the KV the chunks before it left, gives every row the logits of the
// whole prompt at once, for every family (sliding windows and MLA included); the prompt logprobs
// of the chunks, each given the prompt token after it, join into the whole prompt's. LongRoPE
// picks its factors by the length at each Forward, so a prompt past its original context is not
// cut (the engine runs it whole: Engine::Admit): its prompts are compared up to that length.
TEST_P(FamilyReference, ChunkedPrefillMatchesTheWholePrompt) {
  Runtime& rt = Fixture(GetParam());
  const size_t vocab = rt.info.vocab_size;
  int compared = 0;
  for (const Json& p : FixtureJson(GetParam())["prompts"]) {
    std::vector<int32_t> ids = Ids(p["ids"]);
    if (rt.info.longrope && ids.size() > rt.info.longrope->original_max_position_embeddings) {
      ids.resize(rt.info.longrope->original_max_position_embeddings);
    }
    const ForwardResult whole = Prefill(rt, ids);
    std::vector<float> whole_logprobs;
    {
      auto kv = rt.model->NewKvCache();
      SequenceInput in;
      in.tokens = ids;
      in.kv = kv.get();
      in.prompt_logprobs = 2;
      ForwardResult out;
      ASSERT_TRUE(rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out).ok());
      whole_logprobs = out.prompt_logprobs[0].logprob;
    }
    for (size_t chunk : {size_t{1}, size_t{3}, size_t{7}}) {
      if (chunk >= ids.size()) continue;
      auto kv = rt.model->NewKvCache();
      std::vector<float> logits, logprobs;
      for (size_t first = 0; first < ids.size(); first += chunk) {
        const size_t n = std::min(chunk, ids.size() - first);
        SequenceInput in;
        in.iteration = static_cast<uint32_t>(first / chunk);
        in.prefill = true;
        in.tokens = std::span<const int32_t>(ids).subspan(first, n);
        in.kv = kv.get();
        in.all_logits = true;
        in.prompt_logprobs = 2;
        if (first + n < ids.size()) in.next_token = ids[first + n];
        ForwardResult out;
        ASSERT_TRUE(rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out).ok());
        ASSERT_EQ(out.logits[0].size(), n * vocab);
        logits.insert(logits.end(), out.logits[0].begin(), out.logits[0].end());
        const auto& lp = out.prompt_logprobs[0];
        ASSERT_EQ(lp.logprob.size(), first + n < ids.size() ? n : n - 1);
        ASSERT_EQ(lp.top.size(), 2 * lp.logprob.size());
        logprobs.insert(logprobs.end(), lp.logprob.begin(), lp.logprob.end());
      }
      ASSERT_EQ(kv->length(), static_cast<int64_t>(ids.size()));
      ++compared;
      ASSERT_EQ(logits.size(), whole.logits[0].size());
      double diff = 0;
      for (size_t i = 0; i < logits.size(); ++i) {
        diff = std::max(diff, double{std::abs(logits[i] - whole.logits[0][i])});
      }
      EXPECT_LE(diff, 1e-4) << "chunks of " << chunk << ", prompt " << p["text"];
      ASSERT_EQ(logprobs.size(), whole_logprobs.size());
      for (size_t i = 0; i < logprobs.size(); ++i) {
        EXPECT_NEAR(logprobs[i], whole_logprobs[i], 1e-4) << "chunks of " << chunk << " row " << i;
      }
    }
  }
  EXPECT_GT(compared, 0);
}

// A long prompt's prefill runs its queries in blocks (RuntimeOptions::attention_score_budget):
// blocks of one row, and of three rows for the 40-token prompts (13 and a last one of one), give
// transformers' logits too.
TEST_P(FamilyReference, PrefillInQueryBlocksMatchesTransformers) {
  const Json& ref = FixtureJson(GetParam());
  const int64_t heads = Fixture(GetParam()).info.num_attention_heads;
  for (int64_t budget : {int64_t{1}, heads * 3 * 41}) {
    RuntimeOptions options;
    options.attention_score_budget = budget;
    auto blocked = LoadRuntime(FixtureDir(GetParam()), options);
    ASSERT_TRUE(blocked.ok()) << blocked.status().ToString();
    const size_t vocab = blocked->info.vocab_size;
    for (const Json& p : ref["prompts"]) {
      const std::vector<int32_t> ids = Ids(p["ids"]);
      ForwardResult out = Prefill(*blocked, ids);
      ASSERT_EQ(out.logits[0].size(), ids.size() * vocab);
      const std::vector<float> ref_logits = RefLogits(p);
      ASSERT_EQ(ref_logits.size(), ids.size() * vocab);
      double max_diff = 0;
      for (size_t i = 0; i < ids.size() * vocab; ++i) {
        max_diff = std::max(max_diff, double{std::abs(out.logits[0][i] - ref_logits[i])});
      }
      EXPECT_LE(max_diff, 1e-4) << "budget " << budget << ", prompt " << p["text"];
    }
  }
}

TEST(MoeModel, QueryBlocksHoldTheScoreBudget) {
  EXPECT_EQ(QueryBlockRows(32, 1000, 32 * 1000 * 7), 7);
  EXPECT_EQ(QueryBlockRows(32, 1000, 32 * 1000 * 7 + 31999), 7);
  EXPECT_EQ(QueryBlockRows(32, 100000, 1000), 1) << "at least one row";
  EXPECT_EQ(QueryBlockRows(4, 1, 1000), 250);
  EXPECT_EQ(QueryBlockRows(8, 10, 0), 1);
}

// The host's one-pass RoPE gives the bits of LibTorch's expression, in float32 and bfloat16, for
// full and partial rotary, with large and negative values; a layout it does not take (cos
// broadcast over heads from a [t, heads, rd] view) still goes through the expression.
TEST(MoeModel, HostRotaryMatchesTheExpressionBitForBit) {
  at::manual_seed(5);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    for (auto [t, heads, hd, rd] : std::vector<std::array<int64_t, 4>>{
             {1, 8, 32, 32}, {5, 4, 64, 64}, {3, 6, 128, 64}, {2, 2, 80, 40}, {7, 1, 16, 2}}) {
      const at::Tensor x = (at::randn({t, heads, hd}) * 30.0).to(dt);
      const at::Tensor angles = at::randn({t, 1, rd}) * 10.0;
      const at::Tensor cos = (angles.cos() * 1.3).to(dt), sin = (angles.sin() * 1.3).to(dt);
      const at::Tensor host = RotaryEmbedding(x, cos, sin);
      const at::Tensor ref = RotateExpression(x, cos, sin);
      ASSERT_EQ(host.scalar_type(), dt);
      ASSERT_EQ(host.sizes(), ref.sizes());
      ASSERT_EQ(std::memcmp(host.data_ptr(), ref.contiguous().data_ptr(),
                            static_cast<size_t>(ref.numel() * ref.element_size())),
                0)
          << c10::toString(dt) << " t=" << t << " heads=" << heads << " hd=" << hd << " rd=" << rd
          << ": max difference "
          << (host.to(at::kFloat) - ref.to(at::kFloat)).abs().max().item<float>();
    }
  }
  const at::Tensor x = at::randn({2, 3, 8});
  const at::Tensor cos = at::randn({2, 3, 8}), sin = at::randn({2, 3, 8});
  EXPECT_TRUE(at::equal(RotaryEmbedding(x, cos, sin), RotateExpression(x, cos, sin)));
}

TEST_P(FamilyReference, GreedyContinuationMatchesTransformers) {
  Runtime& rt = Fixture(GetParam());
  for (const Json& p : FixtureJson(GetParam())["prompts"]) {
    const std::vector<int32_t> expected = Ids(p["generated_ids"]);
    auto kv = rt.model->NewKvCache();
    std::vector<int32_t> next = Ids(p["ids"]), generated;
    for (size_t step = 0; step < expected.size(); ++step) {
      SequenceInput in;
      in.tokens = next;
      in.kv = kv.get();
      in.iteration = static_cast<uint32_t>(step);
      ForwardResult out;
      ASSERT_TRUE(rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out).ok());
      generated.push_back(static_cast<int32_t>(ArgMax(out.logits[0])));
      next = {generated.back()};
    }
    EXPECT_EQ(generated, expected) << "prompt " << p["text"];
    EXPECT_EQ(kv->length(), static_cast<int64_t>(p["ids"].size() + expected.size() - 1));
  }
}

TEST_P(FamilyReference, TokenizerIdsMatchTransformers) {
  auto tok = Tokenizer::Load(FixtureDir(GetParam()));
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  for (const Json& p : FixtureJson(GetParam())["prompts"]) {
    auto ids = (*tok)->Encode(p["text"].get<std::string>(), true);
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(*ids, Ids(p["ids"])) << p["text"];
  }
}

// The family's chat template (the real model's, in the fixture's tokenizer_config.json) renders
// each conversation as transformers' apply_chat_template does, text and ids, with the BOS and
// EOS strings the router passes.
TEST_P(FamilyReference, ChatTemplateRendersAsTransformers) {
  const Json& ref = FixtureJson(GetParam());
  if (!ref.contains("chat")) {
    GTEST_SKIP() << GetParam()
                 << " has no chat conversations (mixtral-ref predates them: "
                    "tests/fixtures/chat_templates/mixtral_*.json cover its template; the "
                    "quantized checkpoints test their weights' format only, the 2026 families' "
                    "small fixtures of gen_family_reference.py their computation)";
  }
  auto tok = Tokenizer::Load(FixtureDir(GetParam()));
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  const Tokenizer& t = **tok;
  ASSERT_FALSE(t.chat_template().empty());
  const std::string bos = t.bos_id() ? t.IdToToken(*t.bos_id()) : "";
  const std::string eos = t.eos_id() ? t.IdToToken(*t.eos_id()) : "";
  ASSERT_GE(ref["chat"].size(), 2u);
  for (const Json& c : ref["chat"]) {
    std::vector<ChatMessage> messages;
    for (const Json& m : c["messages"]) {
      messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    }
    auto text = RenderChatTemplate(t.chat_template(), messages, bos, eos,
                                   c["add_generation_prompt"].get<bool>());
    ASSERT_TRUE(text.ok()) << text.status().ToString();
    EXPECT_EQ(*text, c["text"].get<std::string>());
    auto ids = t.Encode(*text, /*add_special_tokens=*/false);
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(*ids, Ids(c["ids"]));
  }
}

TEST(MixtralReference, HardStringsMatchTransformers) {
  auto tok = Tokenizer::Load(kRefDir);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  const Json hard = ReadJson(kRefDir + "/hard_strings.json");
  ASSERT_GE(hard.size(), 20u);
  for (const Json& h : hard) {
    const std::string text = h["text"].get<std::string>();
    auto plain = (*tok)->Encode(text, false);
    auto special = (*tok)->Encode(text, true);
    ASSERT_TRUE(plain.ok() && special.ok()) << text;
    EXPECT_EQ(*plain, Ids(h["ids"])) << text;
    EXPECT_EQ(*special, Ids(h["ids_with_special"])) << text;
    EXPECT_EQ((*tok)->Decode(*plain, false), h["decoded"].get<std::string>()) << text;
  }
}

// DeepSeek's KV cache keeps one latent (kv_lora_rank) and one rotary key (qk_rope_head_dim) per
// token and layer, not per-head keys and values: its bytes are those of KvBytesPerToken.
TEST(MoeModel, LatentAttentionCachesTheLatentAndTheRotaryKey) {
  for (const char* name : {"deepseek-v2-ref", "deepseek-v3-ref"}) {
    Runtime& rt = Fixture(name);
    ASSERT_TRUE(rt.info.mla.has_value()) << name;
    const std::vector<int32_t> tokens = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
    auto kv = rt.model->NewKvCache();
    SequenceInput in;
    in.tokens = tokens;
    in.kv = kv.get();
    ForwardResult out;
    ASSERT_TRUE(rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out).ok());
    ASSERT_EQ(kv->length(), 10);
    // One 16-position block of the paged pool; float32 values.
    const size_t per_token = KvBytesPerToken(rt.info, 4);
    EXPECT_EQ(per_token, size_t{3} * (16 + 8) * 4) << name;
    EXPECT_EQ(kv->bytes(), 16 * per_token) << name;
    EXPECT_EQ(rt.model->kv_figures().bytes_per_token, per_token) << name;
    EXPECT_LT(kv->bytes(), 16 * ExpandedKvBytesPerToken(rt.info, 4)) << name;
  }
}

// The paged KV cache: a sequence's logits do not depend on where in the pool its blocks are.
// Alone in a fresh pool its blocks are consecutive; with other sequences growing between its
// steps (one of them ending halfway so its blocks are reused) they are scattered, and a sliding
// layer's early blocks are released. The logits are equal bit for bit in float32, for every family,
// over prefill and decode steps that cross several block boundaries.
TEST(MoeModel, PagedKvDoesNotDependOnWhereItsBlocksAre) {
  for (const char* name : kFamilies) {
    SCOPED_TRACE(name);
    Runtime& rt = Fixture(name);
    std::vector<int32_t> prompt;
    for (int i = 0; i < 20; ++i) prompt.push_back(3 + (i * 11) % 200);
    auto run = [&](bool crowded) {
      rt.model->ConfigureKv(crowded ? KvPoolOptions{512, false} : KvPoolOptions{});
      std::vector<std::vector<float>> logits;
      auto a = rt.model->NewKvCache();
      auto f = rt.model->NewKvCache();
      auto g = rt.model->NewKvCache();
      const std::vector<int32_t> f_prompt = {9, 8, 7, 6, 5, 4, 3}, g_prompt(33, 12);
      const std::vector<int32_t> five = {5};
      ForwardResult out;
      if (crowded) {
        SequenceInput in{1, 0, f_prompt, f.get(), true};
        EXPECT_TRUE(rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out).ok());
      }
      std::vector<int32_t> next = prompt;
      for (int step = 0; step < 30; ++step) {
        // The others run in Forwards of their own between this sequence's (batch invariance is
        // another test's): only the placement of its blocks differs.
        std::vector<SequenceInput> others;
        if (crowded && step == 0) others.push_back({3, 0, g_prompt, g.get(), true});
        if (crowded && step > 0 && step % 3 == 0) others.push_back({3, 1, five, g.get()});
        if (crowded && f && step < 12) others.push_back({1, 1, five, f.get()});
        if (crowded && step == 12) f.reset();  // Its blocks go back to the pool.
        for (const SequenceInput& o : others) {
          ForwardResult ignored;
          EXPECT_TRUE(rt.model->Forward({&o, 1}, *rt.experts, nullptr, &ignored).ok());
        }
        SequenceInput in{2, static_cast<uint32_t>(step), next, a.get(), step == 0};
        out = ForwardResult{};
        Status st = rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out);
        EXPECT_TRUE(st.ok()) << st.message();
        if (!st.ok()) break;
        logits.push_back(out.logits[0]);
        next = {static_cast<int32_t>(ArgMax(out.logits[0]))};
      }
      return logits;
    };
    const auto alone = run(false);
    const auto crowded = run(true);
    rt.model->ConfigureKv({});
    ASSERT_EQ(alone.size(), 30u);
    ASSERT_EQ(crowded.size(), 30u);
    for (size_t step = 0; step < alone.size(); ++step) {
      EXPECT_EQ(crowded[step], alone[step]) << "step " << step;
    }
  }
}

// Sliding-window layers have their own, smaller group of blocks: a prompt prefilled in chunks
// and decoded through a pool whose sliding group holds 4 blocks gives the logits of a growing
// pool, since a sliding layer's blocks before its window go back as the sequence grows.
TEST(MoeModel, ASmallSlidingGroupHoldsOnlyTheWindow) {
  Runtime& rt = Fixture("gpt-oss-ref");
  ASSERT_EQ(rt.info.sliding_window, 4u);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 100; ++i) prompt.push_back(5 + (i * 13) % 300);
  auto run = [&](const KvPoolOptions& options) {
    rt.model->ConfigureKv(options);
    auto kv = rt.model->NewKvCache();
    std::vector<std::vector<float>> logits;
    for (size_t at = 0; at < prompt.size(); at += 16) {
      std::span<const int32_t> chunk(prompt.data() + at, std::min<size_t>(16, prompt.size() - at));
      SequenceInput in{1, static_cast<uint32_t>(at / 16), chunk, kv.get(), true};
      ForwardResult out;
      Status s = rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out);
      EXPECT_TRUE(s.ok()) << s.message();
      if (!s.ok()) break;
      logits.push_back(out.logits[0]);
    }
    return logits;
  };
  const auto growing = run({});
  const auto small = run({1024, false, 64});
  rt.model->ConfigureKv({});
  ASSERT_EQ(growing.size(), 7u);
  EXPECT_EQ(small, growing);
  // A whole prompt does not fit the sliding group: refused, not computed.
  rt.model->ConfigureKv({1024, false, 64});
  auto kv = rt.model->NewKvCache();
  SequenceInput whole{1, 0, prompt, kv.get(), true};
  ForwardResult out;
  EXPECT_EQ(rt.model->Forward({&whole, 1}, *rt.experts, nullptr, &out).code(),
            ErrorCode::kResourceExhausted);
  kv.reset();
  rt.model->ConfigureKv({});
}

// A fixed pool refuses a Forward it cannot hold, naming the shortfall, before computing
// anything; the cache stays usable.
TEST(MoeModel, AFullFixedPoolRefusesTheForward) {
  Runtime& rt = Reference();
  rt.model->ConfigureKv({32, false});
  EXPECT_EQ(rt.model->kv_capacity_tokens(), 32u);
  auto kv = rt.model->NewKvCache();
  std::vector<int32_t> tokens(40, 7);
  SequenceInput in{1, 0, tokens, kv.get(), true};
  ForwardResult out;
  Status s = rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out);
  EXPECT_EQ(s.code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(s.message().find("the KV pool has no room for 40 more positions (2 of 2 blocks free)"),
            std::string::npos)
      << s.message();
  EXPECT_EQ(kv->length(), 0);
  tokens.resize(30);
  in.tokens = tokens;
  EXPECT_TRUE(rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out).ok());
  EXPECT_EQ(kv->length(), 30);
  kv.reset();
  rt.model->ConfigureKv({});
}

// Prefix caching in the model: a second sequence takes the first's full blocks and its logits
// are those of a run without the cache (within float32 rounding: the prefix was computed in a
// longer forward); a model with sliding layers or LongRoPE has no prefix caching.
TEST(MoeModel, PrefixCachingSharesFullBlocks) {
  Runtime& rt = Reference();
  std::vector<int32_t> first(40), second(45);
  for (int i = 0; i < 40; ++i) first[i] = 3 + (i * 7) % 100;
  for (int i = 0; i < 45; ++i) second[i] = i < 35 ? first[i] : 50 + i;
  rt.model->ConfigureKv({});
  auto plain = rt.model->NewKvCache();
  SequenceInput whole{2, 0, second, plain.get(), true};
  ForwardResult ref;
  ASSERT_TRUE(rt.model->Forward({&whole, 1}, *rt.experts, nullptr, &ref).ok());
  plain.reset();

  rt.model->ConfigureKv({1024, true});
  auto a = rt.model->NewKvCache();
  SequenceInput in{1, 0, first, a.get(), true};
  ForwardResult out;
  ASSERT_TRUE(rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out).ok());
  a.reset();  // Its two full blocks stay cached.
  auto b = rt.model->NewKvCache();
  EXPECT_EQ(b->TakePrefix(second), 32);
  EXPECT_EQ(b->length(), 32);
  std::span<const int32_t> rest(second.data() + 32, second.size() - 32);
  SequenceInput tail{2, 0, rest, b.get(), true};
  ASSERT_TRUE(rt.model->Forward({&tail, 1}, *rt.experts, nullptr, &out).ok());
  ASSERT_EQ(out.logits[0].size(), ref.logits[0].size());
  for (size_t v = 0; v < ref.logits[0].size(); ++v) {
    EXPECT_NEAR(out.logits[0][v], ref.logits[0][v], 1e-4) << v;
  }
  EXPECT_EQ(ArgMax(out.logits[0]), ArgMax(ref.logits[0]));
  b.reset();
  rt.model->ConfigureKv({});

  Runtime& oss = Fixture("gpt-oss-ref");
  oss.model->ConfigureKv({1024, true});
  auto c = oss.model->NewKvCache();
  SequenceInput cin{1, 0, first, c.get(), true};
  ASSERT_TRUE(oss.model->Forward({&cin, 1}, *oss.experts, nullptr, &out).ok());
  c.reset();
  auto d = oss.model->NewKvCache();
  EXPECT_EQ(d->TakePrefix(first), 0);
  d.reset();
  oss.model->ConfigureKv({});
  // Nor LongRoPE (Phi-3.5-MoE): a key's rotation depends on the length of its Forward.
  Runtime& phi = Fixture("phimoe-ref");
  ASSERT_TRUE(phi.info.longrope.has_value());
  phi.model->ConfigureKv({1024, true});
  auto e = phi.model->NewKvCache();
  SequenceInput ein{1, 0, first, e.get(), true};
  ASSERT_TRUE(phi.model->Forward({&ein, 1}, *phi.experts, nullptr, &out).ok());
  e.reset();
  auto f = phi.model->NewKvCache();
  EXPECT_EQ(f->TakePrefix(first), 0);
  f.reset();
  phi.model->ConfigureKv({});
}

// gpt-oss's sliding layers (window 4: layers 0 and 2 of gpt-oss-ref) keep only their window of
// keys and values: after a 200-token prefill and decode steps they hold a fixed few entries while
// the full layer holds every position, and the output equals a run whose caches were never cut
// (a prefill of the whole sequence at once, whose attention sees it uncut).
TEST(MoeModel, SlidingLayersKeepOnlyTheirWindow) {
  Runtime& rt = Fixture("gpt-oss-ref");
  ASSERT_EQ(rt.info.sliding_layers, (std::vector<bool>{true, false, true}));
  ASSERT_EQ(rt.info.sliding_window, 4u);
  std::vector<int32_t> tokens;
  for (int i = 0; i < 200; ++i) tokens.push_back(5 + (i * 37) % 300);
  auto kv = rt.model->NewKvCache();
  SequenceInput in;
  in.tokens = tokens;
  in.kv = kv.get();
  ForwardResult out;
  ASSERT_TRUE(rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out).ok());
  std::vector<int32_t> all = tokens;
  for (int step = 0; step < 6; ++step) {
    const int32_t next = static_cast<int32_t>(ArgMax(out.logits[0]));
    all.push_back(next);
    const std::vector<int32_t> one = {next};
    in.tokens = one;
    out = ForwardResult{};
    ASSERT_TRUE(rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out).ok());
  }
  ASSERT_EQ(kv->length(), 206);
  // float32 keys and values of 2 KV heads x 16: 256 bytes a position a layer. The full layer
  // holds 13 blocks of 16 positions (206 positions); the sliding layers only the blocks that hold
  // positions a next query sees (203..206): the block of 192..207.
  const size_t per_position = 2 * 2 * 16 * 4;
  EXPECT_EQ(kv->bytes(), per_position * 16 * (13 + 2 * 1));
  // The last step's logits against a fresh prefill of the same 206 tokens.
  auto fresh = rt.model->NewKvCache();
  SequenceInput whole;
  whole.tokens = all;
  whole.kv = fresh.get();
  ForwardResult ref;
  ASSERT_TRUE(rt.model->Forward({&whole, 1}, *rt.experts, nullptr, &ref).ok());
  ASSERT_EQ(ref.logits[0].size(), out.logits[0].size());
  double diff = 0;
  for (size_t v = 0; v < ref.logits[0].size(); ++v) {
    diff = std::max(diff, double{std::abs(ref.logits[0][v] - out.logits[0][v])});
  }
  EXPECT_LT(diff, 1e-4);
}

// A sequence's logits are bit-for-bit the same alone and in any batch, in prefill and decode.
TEST(MoeModel, LogitsDoNotDependOnTheBatch) {
  Runtime& rt = Reference();
  std::vector<std::vector<int32_t>> prompts;
  for (const Json& p : ReferenceJson()["prompts"]) prompts.push_back(Ids(p["ids"]));
  const size_t n = prompts.size();
  // Alone: prefill, then two decode steps feeding token 7 and 9.
  auto run = [&](const std::vector<size_t>& order, bool stagger) {
    std::vector<std::unique_ptr<KvCache>> kv(n);
    std::vector<std::vector<std::vector<float>>> logits(n);
    for (size_t i = 0; i < n; ++i) kv[i] = rt.model->NewKvCache();
    const std::vector<int32_t> t7 = {7}, t9 = {9};
    // Step s: sequence i runs its step (s - delay_i), where step 0 is the prefill.
    for (size_t step = 0; step < 3 + (stagger ? n : 0); ++step) {
      std::vector<SequenceInput> batch;
      std::vector<size_t> who;
      for (size_t i : order) {
        const size_t delay = stagger ? i : 0;
        if (step < delay || step - delay > 2) continue;
        SequenceInput in;
        in.request_id = i;
        in.kv = kv[i].get();
        in.tokens = step == delay ? prompts[i] : (step - delay == 1 ? t7 : t9);
        batch.push_back(in);
        who.push_back(i);
      }
      ForwardResult out;
      EXPECT_TRUE(rt.model->Forward(batch, *rt.experts, nullptr, &out).ok());
      for (size_t b = 0; b < who.size(); ++b) logits[who[b]].push_back(out.logits[b]);
    }
    return logits;
  };
  std::vector<std::vector<std::vector<float>>> alone(n);
  for (size_t i = 0; i < n; ++i) alone[i] = run({i}, false)[i];
  std::vector<size_t> forward_order(n), reverse_order(n);
  for (size_t i = 0; i < n; ++i) forward_order[i] = i, reverse_order[i] = n - 1 - i;
  for (auto [order, stagger] : {std::pair{forward_order, false}, std::pair{reverse_order, true}}) {
    auto together = run(order, stagger);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(together[i].size(), 3u);
      for (size_t s = 0; s < 3; ++s) {
        EXPECT_EQ(together[i][s], alone[i][s]) << "sequence " << i << " step " << s;
      }
    }
  }
}

TEST(MoeModel, DecodeMatchesPrefill) {
  Runtime& rt = Reference();
  const std::vector<int32_t> ids = Ids(ReferenceJson()["prompts"][4]["ids"]);
  const size_t vocab = rt.info.vocab_size;
  ForwardResult full = Prefill(rt, ids);
  auto kv = rt.model->NewKvCache();
  for (size_t i = 0; i < ids.size(); ++i) {
    SequenceInput in;
    in.tokens = std::span<const int32_t>(&ids[i], 1);
    in.kv = kv.get();
    ForwardResult out;
    ASSERT_TRUE(rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out).ok());
    double diff = 0;
    for (size_t v = 0; v < vocab; ++v) {
      diff = std::max(diff, double(std::abs(out.logits[0][v] - full.logits[0][i * vocab + v])));
    }
    EXPECT_LE(diff, 1e-4) << "position " << i;
  }
}

TEST(MoeModel, RejectsTokensOutOfRangeAndPastTheContext) {
  Runtime& rt = Reference();
  auto kv = rt.model->NewKvCache();
  std::vector<int32_t> bad = {1, 5, static_cast<int32_t>(rt.info.vocab_size)};
  SequenceInput in;
  in.request_id = 9;
  in.tokens = bad;
  in.kv = kv.get();
  ForwardResult out;
  Status s = rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "req=9: token id 512 at position 2 is out of range (vocab 512)");
  EXPECT_EQ(kv->length(), 0);
  std::vector<int32_t> too_long(rt.info.max_position_embeddings + 1, 5);
  in.tokens = too_long;
  s = rt.model->Forward({&in, 1}, *rt.experts, nullptr, &out);
  EXPECT_EQ(s.message(), "req=9: 257 positions exceed max_position_embeddings 256");
}

// An expert source whose weights have the wrong shape: LibTorch throws inside the expert's
// product; Forward returns kInternal and the next batch runs as if nothing happened.
class MisshapenExperts final : public ExpertSource {
 public:
  explicit MisshapenExperts(ExpertSource& inner) : inner_(inner) {}
  Status BeginLayer(const LayerRouting& routing) override { return inner_.BeginLayer(routing); }
  Result<SourcedExpert> Next() override {
    auto next = inner_.Next();
    if (!next.ok()) return next;
    next->weights.w1 = next->weights.w1.t();  // [h, inter]: the product cannot be formed.
    return next;
  }
  void EndLayer() override { inner_.EndLayer(); }

 private:
  ExpertSource& inner_;
};

TEST(MoeModel, ALibTorchErrorIsAStatus) {
  Runtime& rt = Reference();
  const std::vector<int32_t> ids = Ids(ReferenceJson()["prompts"][1]["ids"]);
  MisshapenExperts bad(*rt.experts);
  auto kv = rt.model->NewKvCache();
  SequenceInput in;
  in.request_id = 3;
  in.tokens = ids;
  in.kv = kv.get();
  ForwardResult out;
  Status s = rt.model->Forward({&in, 1}, bad, nullptr, &out);
  EXPECT_EQ(s.code(), ErrorCode::kInternal);
  EXPECT_NE(s.message().find("model: forward: LibTorch: "), std::string::npos) << s.message();
  // The runtime serves on.
  ForwardResult good = Prefill(rt, ids);
  EXPECT_EQ(good.logits[0].size(), ids.size() * rt.info.vocab_size);
}

// A source whose expert `expert` of MoE layer `layer` cannot be read: Next hands it out failed.
class FailingExperts final : public ExpertSource {
 public:
  FailingExperts(ExpertSource& inner, uint32_t layer, uint32_t expert)
      : inner_(inner), layer_(layer), expert_(expert) {}
  void BeginIteration(std::span<const SequenceInfo> s) override { inner_.BeginIteration(s); }
  Status BeginLayer(const LayerRouting& routing) override {
    running_ = routing.layer;
    return inner_.BeginLayer(routing);
  }
  Result<SourcedExpert> Next() override {
    auto next = inner_.Next();
    if (next.ok() && running_ == layer_ && next->expert == expert_) {
      next->weights = {};
      next->failed = DataLoss("/m/model.safetensors: bytes [0, 64): the file ends at 0");
      ++failures;
    }
    return next;
  }
  void Done(uint32_t expert) override { inner_.Done(expert); }
  void EndLayer() override { inner_.EndLayer(); }
  void EndIteration() override { inner_.EndIteration(); }
  int failures = 0;

 private:
  ExpertSource& inner_;
  uint32_t layer_, expert_, running_ = 0;
};

// An expert that cannot be read fails only the sequences whose tokens picked it: the other
// sequence of the batch gets exactly the logits it gets alone, and keeps its KV; the failed one
// gets no logits and its KV cache is not advanced. Without a result to report it in, the
// failure is the Forward's error.
TEST(MoeModel, AnUnreadableExpertFailsOnlyTheSequencesThatPickedIt) {
  Runtime& rt = Reference();
  const std::vector<int32_t> a = Ids(ReferenceJson()["prompts"][2]["ids"]);
  // Two tokens of another prompt: they pick few experts.
  std::vector<int32_t> b = Ids(ReferenceJson()["prompts"][1]["ids"]);
  b.resize(2);
  const ForwardResult alone_a = Prefill(rt, a, /*record_router=*/true);
  const ForwardResult alone_b = Prefill(rt, b, /*record_router=*/true);
  // An expert of some MoE layer that a's tokens pick and b's do not.
  const auto k = static_cast<size_t>(rt.info.top_k);
  int64_t layer = -1, expert = -1;
  for (size_t l = 0; l < alone_a.router_topk.size() && layer < 0; ++l) {
    std::set<int32_t> used_b(alone_b.router_topk[l].begin(), alone_b.router_topk[l].end());
    for (int32_t e : alone_a.router_topk[l]) {
      if (used_b.count(e) == 0) {
        layer = static_cast<int64_t>(l);
        expert = e;
        break;
      }
    }
  }
  ASSERT_GE(layer, 0) << "every expert a picks, b picks too";
  ASSERT_EQ(alone_a.router_topk[layer].size(), a.size() * k);
  FailingExperts failing(*rt.experts, static_cast<uint32_t>(layer), static_cast<uint32_t>(expert));
  auto kv_a = rt.model->NewKvCache();
  auto kv_b = rt.model->NewKvCache();
  SequenceInput in[2];
  in[0].request_id = 1;
  in[0].tokens = a;
  in[0].kv = kv_a.get();
  in[0].all_logits = true;
  in[1].request_id = 2;
  in[1].tokens = b;
  in[1].kv = kv_b.get();
  in[1].all_logits = true;
  ForwardResult out;
  Status s = rt.model->Forward({in, 2}, failing, nullptr, &out);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(failing.failures, 1);
  ASSERT_EQ(out.failed.size(), 1u);
  EXPECT_EQ(out.failed[0].sequence, 0u);
  EXPECT_EQ(out.failed[0].layer, static_cast<uint32_t>(layer));
  EXPECT_EQ(out.failed[0].expert, static_cast<uint32_t>(expert));
  EXPECT_EQ(out.failed[0].error.code(), ErrorCode::kDataLoss);
  EXPECT_EQ(out.failed[0].error.message(),
            "expert " + std::to_string(expert) + " of MoE layer " + std::to_string(layer) +
                " could not be read: /m/model.safetensors: bytes [0, 64): the file ends at 0");
  EXPECT_TRUE(out.logits[0].empty());
  EXPECT_EQ(kv_a->length(), 0);
  EXPECT_EQ(out.logits[1], alone_b.logits[0]);  // Bit for bit.
  EXPECT_EQ(kv_b->length(), static_cast<int64_t>(b.size()));
  // b decodes on from its KV as it would have.
  const std::vector<int32_t> t7 = {7};
  SequenceInput next = in[1];
  next.tokens = t7;
  next.all_logits = false;
  ForwardResult decoded;
  ASSERT_TRUE(rt.model->Forward({&next, 1}, *rt.experts, nullptr, &decoded).ok());
  auto kv_ref = rt.model->NewKvCache();
  SequenceInput ref = in[1];
  ref.kv = kv_ref.get();
  ForwardResult ref_out;
  ASSERT_TRUE(rt.model->Forward({&ref, 1}, *rt.experts, nullptr, &ref_out).ok());
  ref.tokens = t7;
  ref.all_logits = false;
  ASSERT_TRUE(rt.model->Forward({&ref, 1}, *rt.experts, nullptr, &ref_out).ok());
  EXPECT_EQ(decoded.logits[0], ref_out.logits[0]);
  // No result to report it in: the Forward fails.
  auto kv_c = rt.model->NewKvCache();
  SequenceInput c = in[0];
  c.kv = kv_c.get();
  s = rt.model->Forward({&c, 1}, failing, nullptr, nullptr);
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << s.ToString();
  EXPECT_EQ(kv_c->length(), 0);
}

// ---- bad checkpoints: copies of the reference with one thing wrong ----

class BadCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("fmoe-model-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    for (const char* f : {"config.json", "tokenizer.json", "tokenizer_config.json"}) {
      fs::copy_file(fs::path(kRefDir) / f, dir_ / f);
    }
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes the reference weights into one model.safetensors, letting `edit` change each tensor
  // (return false to leave it out). Data converted to `dtype`.
  struct Tensor {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> values;
    DType dtype = DType::kF32;
  };
  void WriteWeights(const std::function<bool(Tensor&)>& edit) {
    auto ckpt = Checkpoint::Open(kRefDir);
    ASSERT_TRUE(ckpt.ok());
    std::vector<Tensor> tensors;
    for (const std::string& name : (*ckpt)->TensorNames()) {
      const TensorView* view = (*ckpt)->Find(name);
      Tensor t{name, view->shape, std::vector<float>(static_cast<size_t>(view->numel())),
               DType::kF32};
      ASSERT_TRUE(ConvertToF32(view->dtype, view->data, t.values).ok());
      if (edit(t)) tensors.push_back(std::move(t));
    }
    std::vector<std::vector<uint16_t>> halves(tensors.size());
    std::vector<TensorToWrite> out;
    for (size_t i = 0; i < tensors.size(); ++i) {
      Tensor& t = tensors[i];
      if (t.dtype == DType::kF32 || t.dtype == DType::kI32) {
        out.push_back({t.name, t.dtype, t.shape, std::as_bytes(std::span<const float>(t.values))});
        continue;
      }
      for (float v : t.values)
        halves[i].push_back(t.dtype == DType::kBF16 ? F32ToBF16(v) : F32ToF16(v));
      out.push_back(
          {t.name, t.dtype, t.shape, std::as_bytes(std::span<const uint16_t>(halves[i]))});
    }
    ASSERT_TRUE(WriteSafetensors((dir_ / "model.safetensors").string(), out).ok());
  }
  void EditConfig(const std::function<void(Json&)>& edit) {
    Json config = ReadJson((dir_ / "config.json").string());
    edit(config);
    std::ofstream((dir_ / "config.json").string(), std::ios::trunc) << config.dump(2);
  }
  Status Load() {
    auto rt = LoadRuntime(dir_.string());
    return rt.status();
  }
  std::string Weights() const { return (dir_ / "model.safetensors").string(); }

  fs::path dir_;
};

TEST_F(BadCheckpoint, HalfPrecisionWeightsLoadAndStayClose) {
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    WriteWeights([dtype](Tensor& t) {
      t.dtype = dtype;
      return true;
    });
    auto rt = LoadRuntime(dir_.string());
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    const Json& p = ReferenceJson()["prompts"][1];
    ForwardResult out = Prefill(*rt, Ids(p["ids"]));
    double diff = 0;
    const size_t vocab = rt->info.vocab_size;
    const std::vector<float> ref_logits = RefLogits(p);
    for (size_t v = 0; v < vocab; ++v) {
      diff = std::max(diff, double{std::abs(out.logits[0][v] - ref_logits[v])});
    }
    EXPECT_LT(diff, dtype == DType::kF16 ? 0.02 : 0.2) << DTypeName(dtype);
    EXPECT_GT(diff, 0.0) << DTypeName(dtype);
  }
}

TEST_F(BadCheckpoint, ComputeInBfloat16) {
  WriteWeights([](Tensor&) { return true; });
  RuntimeOptions options;
  options.dtype = "bfloat16";
  auto rt = LoadRuntime(dir_.string(), options);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  const Json& p = ReferenceJson()["prompts"][4];
  ForwardResult out = Prefill(*rt, Ids(p["ids"]));
  const size_t vocab = rt->info.vocab_size, t = p["ids"].size();
  size_t same_argmax = 0;
  for (size_t i = 0; i < t; ++i) {
    std::span<const float> row(out.logits[0].data() + i * vocab, vocab);
    const std::vector<float> all = RefLogits(p);
    std::vector<float> ref(all.begin() + static_cast<std::ptrdiff_t>(i * vocab),
                           all.begin() + static_cast<std::ptrdiff_t>((i + 1) * vocab));
    same_argmax += ArgMax(row) == ArgMax(ref);
  }
  EXPECT_GE(same_argmax * 10, t * 8) << same_argmax << " of " << t;
  options.dtype = "float64";
  EXPECT_EQ(LoadRuntime(dir_.string(), options).status().message(),
            "dtype \"float64\" is not float32, bfloat16 or float16");
}

TEST_F(BadCheckpoint, MissingTensorIsNamed) {
  WriteWeights(
      [](Tensor& t) { return t.name != "model.layers.1.block_sparse_moe.experts.3.w2.weight"; });
  Status s = Load();
  EXPECT_EQ(s.code(), ErrorCode::kNotFound);
  EXPECT_NE(s.message().find("\"model.layers.1.block_sparse_moe.experts.3.w2.weight\" is missing"),
            std::string::npos)
      << s.message();
}

TEST_F(BadCheckpoint, WrongShapeIsNamedWithBothShapes) {
  WriteWeights([](Tensor& t) {
    if (t.name == "model.layers.2.self_attn.k_proj.weight") t.shape = {8, 128};
    return true;
  });
  Status s = Load();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "model: " + Weights() +
                             ": tensor \"model.layers.2.self_attn.k_proj.weight\": shape [8, 128], "
                             "expected [16, 64]");
}

TEST_F(BadCheckpoint, IntegerWeightsAreRefused) {
  WriteWeights([](Tensor& t) {
    if (t.name == "model.norm.weight") t.dtype = DType::kI32;
    return true;
  });
  Status s = Load();
  EXPECT_EQ(s.message(), "model: " + Weights() +
                             ": tensor \"model.norm.weight\": dtype I32 is not a floating-point "
                             "weight type (F32, F16, BF16)");
}

TEST_F(BadCheckpoint, TruncatedFileIsDataLossNamingTheFile) {
  WriteWeights([](Tensor&) { return true; });
  fs::resize_file(Weights(), fs::file_size(Weights()) - 100);
  Status s = Load();
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss);
  EXPECT_NE(s.message().find(Weights()), std::string::npos) << s.message();
}

TEST_F(BadCheckpoint, ConfigProblemsAreNamed) {
  WriteWeights([](Tensor&) { return true; });
  EditConfig([](Json& c) { c.erase("num_attention_heads"); });
  Status s = Load();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "model: " + dir_.string() + "/config.json: num_attention_heads: missing");
  EditConfig([](Json& c) { c["num_attention_heads"] = 8; });
  // A family's own required field, and a field that changes the computation.
  EditConfig([](Json& c) { c["architectures"] = {"Qwen2MoeForCausalLM"}; });
  s = Load();
  EXPECT_EQ(s.message(), "model: " + dir_.string() + "/config.json: num_experts: missing");
  EditConfig([](Json& c) { c["num_experts"] = 8; });
  s = Load();
  EXPECT_EQ(s.message(),
            "model: " + dir_.string() + "/config.json: moe_intermediate_size: missing");
  EditConfig([](Json& c) {
    c["architectures"] = {"MixtralForCausalLM"};
    c["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  });
  s = Load();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rope_scaling: {\"factor\":2.0,\"type\":\"linear\"} is not "
                             "implemented by the model runtime"),
            std::string::npos)
      << s.message();
  EditConfig([](Json& c) {
    c.erase("rope_scaling");
    c["hidden_act"] = "gelu";
  });
  s = Load();
  EXPECT_NE(s.message().find("hidden_act: \"gelu\" is not implemented"), std::string::npos)
      << s.message();
  EditConfig([](Json& c) { c.erase("hidden_act"); });
  EditConfig([](Json& c) { c["architectures"] = {"LlamaForCausalLM"}; });
  s = Load();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("\"LlamaForCausalLM\" is not a supported MoE architecture"),
            std::string::npos)
      << s.message();
}

TEST_F(BadCheckpoint, MissingDirectoryAndWeights) {
  Status s = Load();  // config present, no weights
  EXPECT_EQ(s.code(), ErrorCode::kNotFound);
  EXPECT_NE(s.message().find("no model.safetensors or model.safetensors.index.json"),
            std::string::npos)
      << s.message();
  s = LoadRuntime((dir_ / "nowhere").string()).status();
  EXPECT_EQ(s.code(), ErrorCode::kNotFound);
  EXPECT_EQ(s.message(), "model: " + (dir_ / "nowhere").string() + ": no such directory");
}

// One device budget's hysteresis: a borrowed page goes back only once the pool has not needed
// it for a hold (KvPoolOptions::return_hold_ms), so a burst that comes back within the hold
// finds its pages still there and evicts no expert for them again; with no hold it goes back at
// once.
class PageBank : public KvPageLender {
 public:
  std::optional<uint32_t> Lend() override {
    if (free.empty()) return std::nullopt;
    const uint32_t page = free.back();
    free.pop_back();
    ++lent;
    return page;
  }
  void Return(uint32_t page) override {
    free.push_back(page);
    ++returned;
  }
  std::vector<uint32_t> free{3, 2, 1};
  int lent = 0, returned = 0;
};

TEST(KvPool, BorrowedPagesGoBackOnlyAfterTheHold) {
  const std::vector<KvPool::LayerShape> shapes{{1, 4, 4, 0}, {1, 4, 4, 0}};
  const uint64_t block = KvPool::BlockBytes(shapes, at::kFloat);
  std::vector<float> memory(4 * 2 * block / sizeof(float));  // Four pages of two blocks.
  for (int64_t hold : {int64_t{0}, int64_t{1000}}) {
    SCOPED_TRACE("hold " + std::to_string(hold) + " ms");
    PageBank bank;
    KvPoolOptions o;
    o.arena = KvArena{memory.data(), 2 * block, 4, 1, 4, &bank};
    o.return_hold_ms = hold;
    auto pool = std::make_shared<KvPool>(shapes, at::TensorOptions().dtype(at::kFloat), o);
    pool->Materialize();
    auto burst = [&] {
      KvCache a(pool), b(pool);
      EXPECT_TRUE(a.Reserve(64));  // Four blocks: the own page and one borrowed.
      EXPECT_TRUE(b.Reserve(32));  // Two more: a second page borrowed.
      // Three more: a third page borrowed, and still short; the arena has no fourth.
      EXPECT_FALSE(KvCache(pool).Reserve(48));
    };
    burst();
    EXPECT_EQ(bank.lent, 3);
    EXPECT_EQ(pool->figures().total_blocks, 8u);
    if (hold == 0) {
      EXPECT_EQ(pool->ReturnIdle(0), 3u);
      EXPECT_EQ(pool->figures().total_blocks, 2u);
      continue;
    }
    // Within the hold nothing goes back, and the same burst borrows nothing more.
    EXPECT_EQ(pool->ReturnIdle(0), 0u);
    EXPECT_EQ(pool->ReturnIdle(999), 0u);
    burst();
    EXPECT_EQ(bank.lent, 3);
    EXPECT_EQ(pool->ReturnIdle(1000), 0u);  // The last hold's peak still stands.
    EXPECT_EQ(pool->ReturnIdle(1999), 0u);
    // A whole hold without the burst: every borrowed page goes back, the last borrowed first.
    EXPECT_EQ(pool->ReturnIdle(2000), 3u);
    EXPECT_EQ(bank.returned, 3);
    EXPECT_EQ(pool->figures().total_blocks, 2u);
    EXPECT_EQ(pool->figures().pages_returned, 3u);
    // A page in use stays, hold or not.
    KvCache c(pool);
    EXPECT_TRUE(c.Reserve(40));  // Three blocks: one page borrowed.
    EXPECT_EQ(bank.lent, 4);
    EXPECT_EQ(pool->ReturnIdle(5000), 0u);
    EXPECT_EQ(pool->ReturnIdle(7000), 0u);  // Still in use.
  }
}

// The MoE block's host loops (blocks.h: SelectRows, PlaceWeightedRows, SumSlots) give the bits of
// the LibTorch expressions they replace, in float32 and bfloat16, signed zeros, infinities and
// subnormals included; what they do not take (another layout) runs the expression itself.
bool SameBits(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  const at::ScalarType as_int = a.element_size() == 4 ? at::kInt : at::kShort;
  return at::equal(a.contiguous().view(as_int), b.contiguous().view(as_int));
}

TEST(MoeBookkeeping, HostLoopsGiveTheBitsOfTheExpressions) {
  for (const at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dt));
    at::manual_seed(11);
    const int64_t n = 9, h = 40, top_k = 3;
    at::Tensor x = (at::randn({n, h}) * 3).to(dt);
    at::Tensor y = (at::randn({4, h}) * 5).to(dt);
    for (at::Tensor* t : {&x, &y}) {
      t->index_put_({0, 0}, -0.0);
      t->index_put_({0, 1}, std::numeric_limits<double>::infinity());
      t->index_put_({1, 2}, 1e-39);  // Subnormal in float32 and in bfloat16.
      t->index_put_({1, 3}, -3e38);
    }
    const std::vector<int64_t> rows = {4, 0, 8, 4};
    EXPECT_TRUE(SameBits(SelectRows(x, rows), x.index_select(0, at::tensor(rows))));
    // Not contiguous: the expression itself.
    const at::Tensor xt = x.t().contiguous().t();
    EXPECT_TRUE(SameBits(SelectRows(xt, rows), x.index_select(0, at::tensor(rows))));

    const std::vector<int64_t> slot_rows = {5, 0, 11, 2};
    const std::vector<float> weights = {0.3f, 0.70000005f, 1.0f / 3.0f, -0.0f};
    at::Tensor base = (at::randn({4 * top_k, h})).to(dt);
    at::Tensor host = base.clone();
    PlaceWeightedRows(y, slot_rows, weights, host);
    at::Tensor expected = base.clone();
    expected.index_copy_(0, at::tensor(slot_rows),
                         y * at::tensor(weights, at::dtype(at::kFloat)).to(dt).unsqueeze(1));
    EXPECT_TRUE(SameBits(host, expected));

    const int64_t r = 4;
    at::Tensor slots = (at::randn({r * top_k, h}) * 7).to(dt);
    slots.index_put_({0, 0}, -0.0);
    slots.index_put_({1, 0}, -0.0);
    slots.index_put_({2, 0}, -0.0);
    slots.index_put_({3, 5}, std::numeric_limits<double>::infinity());
    at::Tensor sum = at::zeros({r, h}, slots.options());
    at::Tensor per_row = slots.view({r, top_k, h});
    for (int64_t s = 0; s < top_k; ++s) sum = sum + per_row.select(1, s);
    EXPECT_TRUE(SameBits(SumSlots(slots, r, top_k), sum));
  }
}

}  // namespace
}  // namespace fmoe
