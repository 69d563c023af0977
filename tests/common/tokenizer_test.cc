#include "common/text/tokenizer.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "common/json.h"
#include "common/text/unicode.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

const std::string kFixtures = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/tokenizers";

const Json& Expected() {
  static const Json expected = [] {
    std::ifstream in(kFixtures + "/expected.json");
    return Json::parse(in);
  }();
  return expected;
}

std::vector<std::string> Strings() { return Expected()["strings"].get<std::vector<std::string>>(); }

std::unique_ptr<Tokenizer> MustLoad(const std::string& dir) {
  auto tok = Tokenizer::Load(dir);
  EXPECT_TRUE(tok.ok()) << tok.status().ToString();
  return tok.ok() ? std::move(*tok) : nullptr;
}

std::vector<int32_t> MustEncode(const Tokenizer& tok, std::string_view text, bool special) {
  auto ids = tok.Encode(text, special);
  EXPECT_TRUE(ids.ok()) << ids.status().ToString();
  return ids.ok() ? *ids : std::vector<int32_t>{};
}

// A fresh directory under the test's temporary directory.
fs::path TempDir(const std::string& name) {
  fs::path dir = fs::path(testing::TempDir()) / ("fmoe_tokenizer_test_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void WriteFile(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// The text as a JSON string; bytes that are not UTF-8 as \xHH.
std::string Printable(const std::string& s) {
  if (IsValidUtf8(s)) return Json(s).dump(-1, ' ', true);
  std::string out;
  char buf[8];
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      std::snprintf(buf, sizeof(buf), "\\x%02X", c);
      out += buf;
    }
  }
  return out;
}

// ---- identical ids to Hugging Face `tokenizers` and `sentencepiece` ----

class HuggingFaceParity : public testing::TestWithParam<std::string> {};

TEST_P(HuggingFaceParity, EncodesAndDecodesTheHardStringsAlike) {
  const std::string variant = GetParam();
  if (!Expected()["variants"].contains(variant)) GTEST_SKIP() << variant << " not generated";
  const Json& want = Expected()["variants"][variant];
  auto tok = MustLoad(kFixtures + "/" + variant);
  ASSERT_NE(tok, nullptr);
  std::vector<std::string> strings = Strings();
  ASSERT_GE(strings.size(), 50u);
  for (size_t i = 0; i < strings.size(); ++i) {
    SCOPED_TRACE(variant + " string " + std::to_string(i) + ": " + Printable(strings[i]));
    std::vector<int32_t> ids = MustEncode(*tok, strings[i], false);
    EXPECT_EQ(ids, want["ids"][i].get<std::vector<int32_t>>());
    EXPECT_EQ(MustEncode(*tok, strings[i], true),
              want["ids_with_specials"][i].get<std::vector<int32_t>>());
    EXPECT_EQ(tok->Decode(ids, false), want["decoded"][i].get<std::string>());
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HuggingFaceParity,
                         testing::Values("gpt2", "llama3", "qwen2", "template", "split_removed",
                                         "split_merged", "split_invert", "trained"));

TEST(SentencePieceTokenizer, EncodesTheHardStringsAsSentencePieceDoes) {
  const Json& want = Expected()["variants"]["sp"];
  auto tok = MustLoad(kFixtures + "/sp");
  ASSERT_NE(tok, nullptr);
  std::vector<std::string> strings = Strings();
  for (size_t i = 0; i < strings.size(); ++i) {
    SCOPED_TRACE("string " + std::to_string(i) + ": " + Printable(strings[i]));
    std::vector<int32_t> ids = MustEncode(*tok, strings[i], false);
    EXPECT_EQ(ids, want["ids"][i].get<std::vector<int32_t>>());
    EXPECT_EQ(MustEncode(*tok, strings[i], true),
              want["ids_with_specials"][i].get<std::vector<int32_t>>());
    EXPECT_EQ(tok->Decode(ids, true), want["decoded_skipping_specials"][i].get<std::string>());
  }
}

TEST(SentencePieceTokenizer, SpecialsComeFromTheModel) {
  auto tok = MustLoad(kFixtures + "/sp");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 600u);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_TRUE(tok->IsSpecial(0));  // <unk>
  EXPECT_TRUE(tok->IsSpecial(1));
  EXPECT_TRUE(tok->IsSpecial(2));
  EXPECT_FALSE(tok->IsSpecial(300));
  EXPECT_EQ(tok->TokenToId("</s>"), 2);
  EXPECT_EQ(tok->TokenToId("no such piece"), std::nullopt);
  EXPECT_EQ(tok->IdToToken(1), "<s>");
  EXPECT_EQ(tok->IdToToken(600), "");
  EXPECT_EQ(tok->Decode(MustEncode(*tok, "Hello world", true), false), "<s> Hello world");
  EXPECT_EQ(tok->Decode(MustEncode(*tok, "Hello world", true), true), "Hello world");
  EXPECT_EQ(tok->chat_template(), "");
}

TEST(SentencePieceTokenizer, ConfigTurnsBosOffAndEosOn) {
  fs::path dir = TempDir("sp_config");
  fs::copy_file(kFixtures + "/sp/tokenizer.model", dir / "tokenizer.model");
  WriteFile(dir / "tokenizer_config.json",
            R"({"add_bos_token": false, "add_eos_token": true, "chat_template": "{{x}}"})");
  auto tok = MustLoad(dir.string());
  ASSERT_NE(tok, nullptr);
  std::vector<int32_t> plain = MustEncode(*tok, "Hello", false);
  std::vector<int32_t> with = MustEncode(*tok, "Hello", true);
  plain.push_back(2);
  EXPECT_EQ(with, plain);
  EXPECT_EQ(tok->chat_template(), "{{x}}");
}

// ---- byte-level BPE behaviour ----

TEST(BpeTokenizer, DecodeOfEncodeIsTheText) {
  std::vector<std::string> strings = Strings();
  strings.push_back("\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x92\xBB tab\there \x7F \x01 nul?");
  // (Not the template variant: its add_prefix_space puts a space before every piece.)
  for (const char* variant : {"gpt2", "llama3", "split_merged", "trained"}) {
    auto tok = MustLoad(kFixtures + "/" + variant);
    ASSERT_NE(tok, nullptr);
    for (const std::string& s : strings) {
      SCOPED_TRACE(std::string(variant) + ": " + Printable(s));
      std::vector<int32_t> ids = MustEncode(*tok, s, false);
      std::string back = tok->Decode(ids, false);
      // [MASK] (lstrip) and <|tool|> (rstrip) swallow the whitespace beside them, by design.
      if (s.find("[MASK]") != std::string::npos) continue;
      EXPECT_EQ(back, s);
    }
  }
}

TEST(BpeTokenizer, NormalizesToNfcBeforeSplitting) {
  auto tok = MustLoad(kFixtures + "/qwen2");
  ASSERT_NE(tok, nullptr);
  // "e" + combining acute and the precomposed "é" are the same text after NFC.
  EXPECT_EQ(MustEncode(*tok, "cafe\xCC\x81", false), MustEncode(*tok, "caf\xC3\xA9", false));
  EXPECT_EQ(tok->Decode(MustEncode(*tok, "cafe\xCC\x81", false), false), "caf\xC3\xA9");
}

TEST(BpeTokenizer, SpecialTokensInTextAndSkipping) {
  auto tok = MustLoad(kFixtures + "/gpt2");
  ASSERT_NE(tok, nullptr);
  auto s = tok->TokenToId("<s>");
  auto e = tok->TokenToId("</s>");
  ASSERT_TRUE(s && e);
  EXPECT_TRUE(tok->IsSpecial(*s));
  std::vector<int32_t> ids = MustEncode(*tok, "<s>Hi</s>", false);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), *s);
  EXPECT_EQ(ids.back(), *e);
  EXPECT_EQ(tok->Decode(ids, false), "<s>Hi</s>");
  EXPECT_EQ(tok->Decode(ids, true), "Hi");
  // [MASK] is an added token that is not special: kept when skipping specials.
  auto mask = tok->TokenToId("[MASK]");
  ASSERT_TRUE(mask.has_value());
  EXPECT_FALSE(tok->IsSpecial(*mask));
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{*mask}, true), "[MASK]");
  // Out-of-range ids decode to nothing.
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{-1, 1 << 20}, false), "");
  EXPECT_EQ(tok->IdToToken(-5), "");
  EXPECT_EQ(tok->IdToToken(*s), "<s>");
  // The vocab form of a token, not its bytes.
  auto hello = tok->TokenToId("\xC4\xA0Hello");  // "ĠHello"
  if (hello) {
    EXPECT_EQ(tok->Decode(std::vector<int32_t>{*hello}, false), " Hello");
  }
}

TEST(BpeTokenizer, TokenizerConfigAndPostProcessor) {
  auto tok = MustLoad(kFixtures + "/template");
  ASSERT_NE(tok, nullptr);
  auto bos = tok->TokenToId("<s>");
  ASSERT_TRUE(bos.has_value());
  EXPECT_EQ(tok->bos_id(), bos);
  EXPECT_EQ(tok->eos_id(), tok->TokenToId("</s>"));
  EXPECT_NE(tok->chat_template().find("messages"), std::string::npos);
  std::vector<int32_t> ids = MustEncode(*tok, "hi", true);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.front(), *bos);

  // add_bos_token / add_eos_token replace what the post-processor adds.
  fs::path dir = TempDir("bpe_config");
  fs::copy_file(kFixtures + "/template/tokenizer.json", dir / "tokenizer.json");
  WriteFile(dir / "tokenizer_config.json",
            R"({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": false,
                "add_eos_token": true, "chat_template": [{"name": "tool_use", "template": "T"},
                {"name": "default", "template": "D"}]})");
  auto tok2 = MustLoad(dir.string());
  ASSERT_NE(tok2, nullptr);
  std::vector<int32_t> plain = MustEncode(*tok2, "hi", false);
  plain.push_back(*tok2->eos_id());
  EXPECT_EQ(MustEncode(*tok2, "hi", true), plain);
  EXPECT_EQ(tok2->chat_template(), "D");

  // No chat_template in the config: chat_template.jinja beside it.
  WriteFile(dir / "tokenizer_config.json", R"({"bos_token": null})");
  WriteFile(dir / "chat_template.jinja", "J");
  auto tok3 = MustLoad(dir.string());
  ASSERT_NE(tok3, nullptr);
  EXPECT_EQ(tok3->chat_template(), "J");
}

TEST(Tokenizer, RejectsInvalidUtf8) {
  for (const char* variant : {"gpt2", "sp"}) {
    auto tok = MustLoad(kFixtures + "/" + variant);
    ASSERT_NE(tok, nullptr);
    for (std::string bad : {std::string("ab\xC3"), std::string("\xC0\xAF"), std::string("a\xFFz"),
                            std::string("\xED\xA0\x80"), std::string("\xF4\x90\x80\x80")}) {
      auto ids = tok->Encode(bad, false);
      ASSERT_FALSE(ids.ok()) << variant << " " << Printable(bad);
      EXPECT_EQ(ids.status().code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(ids.status().message().find("not valid UTF-8"), std::string::npos);
    }
  }
}

TEST(Tokenizer, PrefersTokenizerJsonAndNamesMissingFiles) {
  fs::path dir = TempDir("both");
  fs::copy_file(kFixtures + "/gpt2/tokenizer.json", dir / "tokenizer.json");
  fs::copy_file(kFixtures + "/sp/tokenizer.model", dir / "tokenizer.model");
  auto tok = MustLoad(dir.string());
  ASSERT_NE(tok, nullptr);
  EXPECT_TRUE(tok->TokenToId("[MASK]").has_value());  // The BPE one.

  auto none = Tokenizer::Load(TempDir("empty").string());
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(none.status().message().find("no tokenizer.json, tokenizer.model or tiktoken.model"),
            std::string::npos);
}

TEST(Tokenizer, EncodesFromManyThreadsAlike) {
  auto tok = MustLoad(kFixtures + "/llama3");
  ASSERT_NE(tok, nullptr);
  std::vector<std::string> strings = Strings();
  std::vector<std::vector<int32_t>> want;
  for (const std::string& s : strings) want.push_back(MustEncode(*tok, s, false));
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round) {
        for (size_t i = 0; i < strings.size(); ++i) {
          auto ids = tok->Encode(strings[(i + t) % strings.size()], false);
          if (!ids.ok() || *ids != want[(i + t) % strings.size()]) ++mismatches[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

// Encode throughput on a text file: FMOE_TOKENIZER_BENCH=<file> [FMOE_TOKENIZER_DIR=<dir>].
TEST(Tokenizer, Throughput) {
  const char* file = std::getenv("FMOE_TOKENIZER_BENCH");
  if (file == nullptr) GTEST_SKIP() << "set FMOE_TOKENIZER_BENCH=<text file> to measure";
  const char* dir = std::getenv("FMOE_TOKENIZER_DIR");
  auto tok = MustLoad(dir != nullptr ? dir : kFixtures + "/llama3");
  ASSERT_NE(tok, nullptr);
  std::ifstream in(file, std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  std::string text = buf.str();
  auto start = std::chrono::steady_clock::now();
  auto ids = tok->Encode(text, false);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  std::printf("encoded %zu bytes into %zu tokens in %.3f s: %.1f MB/s\n", text.size(), ids->size(),
              s, text.size() / s / 1e6);
}

// ---- TextStream ----

std::vector<std::string> StreamPieces(const Tokenizer& tok, const std::vector<int32_t>& ids,
                                      bool skip, std::string* all) {
  TextStream stream(tok, skip);
  std::vector<std::string> pieces;
  for (int32_t id : ids) pieces.push_back(stream.Push(id));
  pieces.push_back(stream.Finish());
  all->clear();
  for (const std::string& p : pieces) *all += p;
  return pieces;
}

TEST(TextStream, PiecesConcatenateToDecodeAndNeverSplitACharacter) {
  std::vector<std::string> strings = Strings();
  strings.push_back("<s>\xF0\x9F\x8D\x95</s> \xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9 ok");
  for (const char* variant : {"gpt2", "llama3", "qwen2", "template", "sp"}) {
    auto tok = MustLoad(kFixtures + "/" + variant);
    ASSERT_NE(tok, nullptr);
    for (const std::string& s : strings) {
      std::vector<int32_t> ids = MustEncode(*tok, s, true);
      for (bool skip : {false, true}) {
        SCOPED_TRACE(std::string(variant) + (skip ? " skip " : " keep ") + Printable(s));
        std::string all;
        std::vector<std::string> pieces = StreamPieces(*tok, ids, skip, &all);
        EXPECT_EQ(all, ToValidUtf8(tok->Decode(ids, skip)));
        for (const std::string& p : pieces) EXPECT_TRUE(IsValidUtf8(p)) << Printable(p);
      }
    }
  }
}

TEST(TextStream, HoldsAnEmojiSplitAcrossTokens) {
  for (const char* variant : {"gpt2", "sp"}) {
    auto tok = MustLoad(kFixtures + "/" + variant);
    ASSERT_NE(tok, nullptr);
    std::string crab = "\xF0\x9F\xA6\x80";  // A crab: in neither vocabulary, so split into bytes.
    std::vector<int32_t> ids = MustEncode(*tok, "a " + crab + " b", false);
    ASSERT_GT(ids.size(), 4u) << variant;
    std::string all;
    std::vector<std::string> pieces = StreamPieces(*tok, ids, false, &all);
    EXPECT_EQ(all, "a " + crab + " b") << variant;
    size_t empty = 0;
    bool whole = false;
    for (const std::string& p : pieces) {
      empty += p.empty();
      whole = whole || p.find(crab) != std::string::npos;
    }
    EXPECT_GE(empty, 2u) << variant << ": the emoji's first bytes are held";
    EXPECT_TRUE(whole) << variant << ": the emoji comes out in one piece";
  }
}

TEST(TextStream, FinishReturnsAnIncompleteTail) {
  auto tok = MustLoad(kFixtures + "/gpt2");
  ASSERT_NE(tok, nullptr);
  std::vector<int32_t> ids = MustEncode(*tok, "x\xF0\x9F\x8D\x95", false);
  ids.pop_back();  // Drop the emoji's last byte.
  TextStream stream(*tok, false);
  std::string out;
  for (int32_t id : ids) out += stream.Push(id);
  EXPECT_EQ(out, "x");
  EXPECT_EQ(stream.Finish(), "\xEF\xBF\xBD");  // The cut character is one U+FFFD.
}

// Sampled output can be any sequence of byte-level tokens: a lead byte followed by a space, a
// lone continuation byte, a character cut by the end. Every piece must be valid UTF-8, with
// U+FFFD where the bytes are not a character, as Hugging Face tokenizers decode.
TEST(TextStream, EveryKindOfInvalidUtf8ComesOutAsReplacementCharacters) {
  auto tok = MustLoad(kFixtures + "/gpt2");
  ASSERT_NE(tok, nullptr);
  // The byte-level token of each raw byte (every byte is in the base alphabet).
  auto byte_id = [&](unsigned char b) {
    std::string token;
    ByteLevelEncode(std::string(1, static_cast<char>(b)), &token);
    std::optional<int32_t> id = tok->TokenToId(token);
    EXPECT_TRUE(id.has_value()) << int(b);
    return id.value_or(0);
  };
  const std::string fffd = "\xEF\xBF\xBD";
  struct Case {
    std::vector<unsigned char> bytes;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{0xE4, ' '}, fffd + " "},                              // A lead byte followed by a space.
      {{'a', 0x80, 'b'}, "a" + fffd + "b"},                   // A lone continuation byte.
      {{0xC0, 0xAF}, fffd + fffd},                            // An overlong form.
      {{0xED, 0xA0, 0x80}, fffd + fffd + fffd},               // A UTF-16 surrogate.
      {{0xF4, 0x90, 0x80, 0x80}, fffd + fffd + fffd + fffd},  // Above U+10FFFF.
      {{0xF0, 0x9F, 0x98}, fffd},                         // Cut by the end: one maximal subpart.
      {{0xF0, 0x9F, 'x'}, fffd + "x"},                    // Cut by another character.
      {{0xFF, 0xFE}, fffd + fffd},                        // Never lead bytes.
      {{0xE6, 0x97, 0xA5, 0xE6}, "\xE6\x97\xA5" + fffd},  // A whole character, then a cut one.
  };
  for (const Case& c : cases) {
    std::vector<int32_t> ids;
    for (unsigned char b : c.bytes) ids.push_back(byte_id(b));
    std::string all;
    std::vector<std::string> pieces = StreamPieces(*tok, ids, false, &all);
    SCOPED_TRACE(Printable(std::string(c.bytes.begin(), c.bytes.end())));
    EXPECT_EQ(all, c.expected);
    for (const std::string& p : pieces) EXPECT_TRUE(IsValidUtf8(p)) << Printable(p);
  }
}

// ---- StopMatcher ----

std::string FeedAll(StopMatcher& m, const std::vector<std::string>& pieces,
                    std::vector<std::string>* outs = nullptr) {
  std::string all;
  for (const std::string& p : pieces) {
    std::string out = m.Feed(p);
    if (outs != nullptr) outs->push_back(out);
    all += out;
  }
  return all;
}

TEST(StopMatcher, StopAcrossPieces) {
  StopMatcher m({"</answer>"});
  std::vector<std::string> outs;
  std::string all = FeedAll(m, {"The answer is 42", "</ans", "wer> and more", "tail"}, &outs);
  EXPECT_EQ(all, "The answer is 42");
  EXPECT_EQ(outs[1], "");  // "</ans" could start the stop string: held.
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched(), "</answer>");
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopMatcher, ReleasesAHeldPrefixThatDoesNotMatch) {
  StopMatcher m({"STOP"});
  EXPECT_EQ(m.Feed("go ST"), "go ");
  EXPECT_EQ(m.Feed("O"), "");
  EXPECT_EQ(m.Feed("RY"), "STORY");  // No longer the start of STOP.
  EXPECT_EQ(m.Feed(" ST"), " ");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.Flush(), "ST");  // Generation ended for another reason.
}

TEST(StopMatcher, OverlappingPrefixes) {
  // "aab" inside "aaab": the held "aa" must not hide the match that starts one byte later.
  StopMatcher m({"aab"});
  EXPECT_EQ(FeedAll(m, {"x", "a", "a", "a", "b", "y"}), "xa");
  EXPECT_TRUE(m.stopped());
}

TEST(StopMatcher, SeveralStopsEarliestWins) {
  StopMatcher m({"\n\n", "User:", "Use"});
  EXPECT_EQ(FeedAll(m, {"Hello. Us", "er: hi\n\n"}), "Hello. ");
  EXPECT_EQ(m.matched(), "User:");  // Starts where "Use" does; the longer one is reported.
  StopMatcher m2({"STOP", "\n"});
  EXPECT_EQ(FeedAll(m2, {"line one\nSTOP"}), "line one");
  EXPECT_EQ(m2.matched(), "\n");
}

TEST(StopMatcher, MatchAtStartAndNothingAfter) {
  StopMatcher m({"<|end|>"});
  EXPECT_EQ(m.Feed("<|end|>more text"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.Feed("even more"), "");
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopMatcher, NoStopsPassesEverythingThrough) {
  StopMatcher m({"", ""});
  EXPECT_EQ(m.Feed("abc"), "abc");
  EXPECT_EQ(m.Flush(), "");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.matched(), "");
}

TEST(StopMatcher, HoldsMultiByteStopPrefixesOnCharacterBoundaries) {
  StopMatcher m(
      {"\xE2\x80\x94"
       "END"});  // "—END"
  std::vector<std::string> outs;
  std::string all = FeedAll(m, {"a \xE2\x80\x94", "E", "N", "x"}, &outs);
  EXPECT_EQ(outs[0], "a ");
  EXPECT_EQ(all + m.Flush(),
            "a \xE2\x80\x94"
            "ENx");
  EXPECT_FALSE(m.stopped());
}

}  // namespace
}  // namespace fmoe
