#include "common/text/tiktoken_tokenizer.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "common/json.h"
#include "common/text/unicode.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// The Kimi-style fixture: tests/fixtures/gen_tiktoken_fixture.py.
const std::string kKimi = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/tokenizers/kimi";
constexpr int32_t kRanks = 531;  // Lines of kimi/tiktoken.model.

std::string ReadText(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

const Json& Expected() {
  static const Json expected = Json::parse(ReadText(kKimi + "/expected.json"));
  return expected;
}

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

// The fixture's tiktoken.model read by TiktokenTokenizer itself (for EncodeOrdinary).
std::unique_ptr<TiktokenTokenizer> MustCreate(const std::string& model_text) {
  auto tok = TiktokenTokenizer::Create(model_text, "/m/tiktoken.model", TokenizerConfig{});
  EXPECT_TRUE(tok.ok()) << tok.status().ToString();
  return tok.ok() ? std::move(*tok) : nullptr;
}

fs::path TempDir(const std::string& name) {
  fs::path dir = fs::path(testing::TempDir()) / ("fmoe_tiktoken_test_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void WriteFile(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::string Printable(const std::string& s) { return Json(s).dump(-1, ' ', true); }

// FNV-1a 64 over each id as 4 little-endian bytes (as the generator writes it).
std::string Fnv1a64(const std::vector<int32_t>& ids) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t id : ids) {
    uint32_t v = static_cast<uint32_t>(id);
    for (int i = 0; i < 4; ++i) {
      h = (h ^ ((v >> (8 * i)) & 0xFF)) * 0x100000001b3ull;
    }
  }
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

// ---- identical ids to tiktoken with Kimi's pattern, special tokens and cutting ----

TEST(TiktokenTokenizer, EncodesTheStringsAsKimiDoes) {
  auto tok = MustLoad(kKimi);
  ASSERT_NE(tok, nullptr);
  auto ordinary = MustCreate(ReadText(kKimi + "/tiktoken.model"));
  ASSERT_NE(ordinary, nullptr);
  std::vector<std::string> strings = Expected()["strings"].get<std::vector<std::string>>();
  ASSERT_GE(strings.size(), 70u);
  for (size_t i = 0; i < strings.size(); ++i) {
    SCOPED_TRACE("string " + std::to_string(i) + ": " + Printable(strings[i]));
    std::vector<int32_t> want = Expected()["ids"][i].get<std::vector<int32_t>>();
    std::vector<int32_t> ids = MustEncode(*tok, strings[i], false);
    EXPECT_EQ(ids, want);
    // Kimi adds no BOS or EOS (its tokenizer_config.json has no add_bos_token).
    EXPECT_EQ(MustEncode(*tok, strings[i], true), want);
    EXPECT_EQ(tok->Decode(ids, false), strings[i]);
    auto plain = ordinary->EncodeOrdinary(strings[i]);
    ASSERT_TRUE(plain.ok()) << plain.status().ToString();
    EXPECT_EQ(*plain, Expected()["ids_ordinary"][i].get<std::vector<int32_t>>());
    EXPECT_EQ(ordinary->Decode(*plain, false), strings[i]);
  }
}

TEST(TiktokenTokenizer, CutsLongTextsAsKimiDoes) {
  auto tok = MustLoad(kKimi);
  ASSERT_NE(tok, nullptr);
  for (const Json& c : Expected()["long"]) {
    std::string text = c["prefix"].get<std::string>();
    std::string unit = c["unit"].get<std::string>();
    for (int i = 0; i < c["times"].get<int>(); ++i) text += unit;
    text += c["suffix"].get<std::string>();
    SCOPED_TRACE(Printable(unit.substr(0, 12)) + " x " + std::to_string(c["times"].get<int>()));
    std::vector<int32_t> ids = MustEncode(*tok, text, false);
    EXPECT_EQ(ids.size(), c["count"].get<size_t>());
    EXPECT_EQ(Fnv1a64(ids), c["fnv1a64"].get<std::string>());
    EXPECT_EQ(tok->Decode(ids, false), text);
  }
}

// ---- special tokens, vocabulary, configuration ----

TEST(TiktokenTokenizer, SpecialTokensFollowTheRanks) {
  auto tok = MustLoad(kKimi);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), static_cast<size_t>(kRanks + 258));
  EXPECT_EQ(tok->bos_id(), kRanks);
  EXPECT_EQ(tok->eos_id(), kRanks + 1);
  EXPECT_EQ(tok->TokenToId("<|im_end|>"), kRanks + 2);
  EXPECT_EQ(tok->TokenToId("<|im_middle|>"), kRanks + 17);
  EXPECT_EQ(tok->IdToToken(kRanks + 255), "[PAD]");
  // Unnamed ids get Kimi's reserved names; all of them are special.
  EXPECT_EQ(tok->IdToToken(kRanks + 8), "<|reserved_token_" + std::to_string(kRanks + 8) + "|>");
  EXPECT_EQ(tok->IdToToken(kRanks + 257),
            "<|reserved_token_" + std::to_string(kRanks + 257) + "|>");
  for (int32_t id = kRanks; id < kRanks + 258; ++id) EXPECT_TRUE(tok->IsSpecial(id)) << id;
  EXPECT_FALSE(tok->IsSpecial(kRanks - 1));
  EXPECT_FALSE(tok->IsSpecial(kRanks + 258));
  // Ordinary tokens are spelled in the byte-level alphabet, as Kimi's get_vocab does.
  EXPECT_EQ(tok->IdToToken(0), "\xC4\x80");   // Byte 0x00 is "Ā".
  EXPECT_EQ(tok->IdToToken(32), "\xC4\xA0");  // " " is "Ġ".
  for (int32_t id = 0; id < kRanks + 258; ++id) {
    ASSERT_EQ(tok->TokenToId(tok->IdToToken(id)), id) << id;
  }
  EXPECT_EQ(tok->TokenToId("no such token"), std::nullopt);
  EXPECT_EQ(tok->IdToToken(-1), "");
  EXPECT_EQ(tok->IdToToken(kRanks + 258), "");
  EXPECT_NE(tok->chat_template().find("<|im_middle|>"), std::string::npos);

  std::vector<int32_t> ids = MustEncode(*tok, "[BOS]Hi<|im_end|>", false);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), kRanks);
  EXPECT_EQ(ids.back(), kRanks + 2);
  EXPECT_EQ(tok->Decode(ids, false), "[BOS]Hi<|im_end|>");
  EXPECT_EQ(tok->Decode(ids, true), "Hi");
  // Out-of-range ids decode to nothing.
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{-1, kRanks + 258, 1 << 30}, false), "");
}

TEST(TiktokenTokenizer, ConfigAddsBosAndEosAndNamesTheSpecialTokens) {
  fs::path dir = TempDir("config");
  fs::copy_file(kKimi + "/tiktoken.model", dir / "tiktoken.model");
  // A non-special named token: recognised in the text, kept when skipping special tokens.
  WriteFile(dir / "tokenizer_config.json",
            R"({"added_tokens_decoder": {"531": {"content": "<s>"}, "532": {"content": "</s>"},
                "540": {"content": "<tool>", "special": false}},
                "bos_token": "<s>", "eos_token": {"content": "</s>"},
                "add_bos_token": true, "add_eos_token": true})");
  auto tok = MustLoad(dir.string());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->bos_id(), kRanks);
  EXPECT_EQ(tok->eos_id(), kRanks + 1);
  std::vector<int32_t> plain = MustEncode(*tok, "a<tool>b", false);
  std::vector<int32_t> with = MustEncode(*tok, "a<tool>b", true);
  EXPECT_EQ(plain, (std::vector<int32_t>{'a', 540, 'b'}));
  EXPECT_EQ(with, (std::vector<int32_t>{kRanks, 'a', 540, 'b', kRanks + 1}));
  EXPECT_FALSE(tok->IsSpecial(540));
  EXPECT_EQ(tok->Decode(with, true), "a<tool>b");
  EXPECT_EQ(tok->chat_template(), "");
  EXPECT_EQ(tok->TokenToId("[BOS]"), std::nullopt);  // Not named here: <|reserved_token_531|>.

  WriteFile(dir / "tokenizer_config.json", R"({"bos_token": "<nope>"})");
  auto bad = Tokenizer::Load(dir.string());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("tokenizer_config.json: bos_token: \"<nope>\" is not a "
                                        "token"),
            std::string::npos)
      << bad.status().ToString();
}

// ---- streaming: any split of the ids, invalid UTF-8 from the model ----

TEST(TiktokenTokenizer, TextStreamPiecesAreValidAndConcatenateToDecode) {
  auto tok = MustLoad(kKimi);
  ASSERT_NE(tok, nullptr);
  std::vector<std::string> strings = Expected()["strings"].get<std::vector<std::string>>();
  for (const std::string& s : strings) {
    std::vector<int32_t> ids = MustEncode(*tok, s, false);
    for (bool skip : {false, true}) {
      SCOPED_TRACE(std::string(skip ? "skip " : "keep ") + Printable(s));
      TextStream stream(*tok, skip);
      std::string all;
      for (int32_t id : ids) {
        std::string piece = stream.Push(id);
        EXPECT_TRUE(IsValidUtf8(piece));
        all += piece;
      }
      all += stream.Finish();
      EXPECT_EQ(all, ToValidUtf8(tok->Decode(ids, skip)));
    }
  }
  // Sampled single bytes that are not characters (every byte is a token; its rank is its value
  // in this fixture).
  const std::string fffd = "\xEF\xBF\xBD";
  struct Case {
    std::vector<int32_t> ids;
    std::string expected;
  };
  for (const Case& c : std::vector<Case>{{{0xE4, ' '}, fffd + " "},
                                         {{'a', 0x80, 'b'}, "a" + fffd + "b"},
                                         {{0xF0, 0x9F, 0x98}, fffd},
                                         {{0xE6, 0x97, 0xA5, 0xE6}, "\xE6\x97\xA5" + fffd}}) {
    TextStream stream(*tok, false);
    std::string all;
    for (int32_t id : c.ids) all += stream.Push(id);
    all += stream.Finish();
    EXPECT_EQ(all, c.expected);
  }
}

TEST(TiktokenTokenizer, RejectsInvalidUtf8) {
  auto tok = MustLoad(kKimi);
  ASSERT_NE(tok, nullptr);
  auto ids = tok->Encode("ab\xC3", false);
  ASSERT_FALSE(ids.ok());
  EXPECT_EQ(ids.status().code(), ErrorCode::kInvalidArgument);
}

// ---- the file is checked line by line ----

std::vector<std::string> FixtureLines() {
  std::vector<std::string> lines;
  std::istringstream in(ReadText(kKimi + "/tiktoken.model"));
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string Join(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += l + "\n";
  return out;
}

TEST(TiktokenTokenizer, NamesTheFileAndLineOfEachMalformedLine) {
  const std::vector<std::string> good = FixtureLines();
  ASSERT_EQ(good.size(), static_cast<size_t>(kRanks));
  ASSERT_EQ(good[299], "ZWw= 299");  // Line 300 ("el"), replaced below.
  struct Case {
    std::string name;
    std::string line300;  // What line 300 becomes.
    std::string message;  // After "<path>: line 300: ".
  };
  const std::vector<Case> cases = {
      {"no space", "ZWw=299", "expected \"<base64 token> <rank>\", found no space"},
      {"empty token", " 299", "the token before the space is empty"},
      {"bad base64", "ZW*= 299", "token \"ZW*=\" is not base64"},
      {"bad padding", "ZWw 299", "token \"ZWw\" is not base64"},
      {"too much padding", "I=== 299", "token \"I===\" is not base64"},
      {"rank not a number", "ZWw= x", "rank \"x\" is not a non-negative integer"},
      {"negative rank", "ZWw= -299", "rank \"-299\" is not a non-negative integer"},
      {"signed rank", "ZWw= +299", "rank \"+299\" is not a non-negative integer"},
      {"fractional rank", "ZWw= 299.0", "rank \"299.0\" is not a non-negative integer"},
      {"two spaces", "ZWw=  299", "rank \" 299\" is not a non-negative integer"},
      {"no rank", "ZWw= ", "rank \"\" is not a non-negative integer"},
      {"huge rank", "ZWw= 99999999999999999999", "rank \"99999999999999999999\" is too large"},
      {"duplicate token", "IA== 299", "token \"IA==\" is already on line 33"},
      {"duplicate rank", "ZWw= 12", "rank 12 is already on line 13"},
      {"gap", "ZWw= 531", "rank 531 leaves a gap: the 531 tokens must have the ranks 0..530"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<std::string> lines = good;
    lines[299] = c.line300;
    fs::path dir = TempDir("bad");
    WriteFile(dir / "tiktoken.model", Join(lines));
    auto tok = Tokenizer::Load(dir.string());
    ASSERT_FALSE(tok.ok());
    EXPECT_EQ(tok.status().code(), ErrorCode::kInvalidArgument);
    std::string want =
        "tokenizer: " + (dir / "tiktoken.model").string() + ": line 300: " + c.message;
    EXPECT_EQ(tok.status().message().substr(0, want.size()), want) << tok.status().message();
  }
}

TEST(TiktokenTokenizer, RefusesAFileWithoutEveryByte) {
  std::vector<std::string> lines = FixtureLines();
  ASSERT_EQ(lines[10], "Cg== 10");  // "\n"
  lines.erase(lines.begin() + 10);
  // Renumber the ranks after it so that only the byte is missing.
  for (size_t i = 10; i < lines.size(); ++i) {
    lines[i] = lines[i].substr(0, lines[i].find(' ')) + " " + std::to_string(i);
  }
  fs::path dir = TempDir("bytes");
  WriteFile(dir / "tiktoken.model", Join(lines));
  auto tok = Tokenizer::Load(dir.string());
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().message(), "tokenizer: " + (dir / "tiktoken.model").string() +
                                        ": the byte \"\\x0A\" is not a token (every single byte "
                                        "must be one)");
}

TEST(TiktokenTokenizer, RefusesSpecialTokensThatCollideWithRanks) {
  fs::path dir = TempDir("collide");
  fs::copy_file(kKimi + "/tiktoken.model", dir / "tiktoken.model");
  const std::string config = (dir / "tokenizer_config.json").string();
  struct Case {
    std::string json;
    std::string message;
  };
  const std::vector<Case> cases = {
      {R"({"added_tokens_decoder": {"100": {"content": "[BOS]"}}})",
       "added_tokens_decoder[\"100\"]: id 100 is the rank of line 101 of "},
      {R"({"added_tokens_decoder": {"789": {"content": "[BOS]"}}})",
       "added_tokens_decoder[\"789\"]: id 789 is past the special tokens 531..788"},
      {R"({"added_tokens_decoder": {"531": {"content": "[X]"}, "532": {"content": "[X]"}}})",
       "added_tokens_decoder[\"532\"]: \"[X]\" is also the token 531"},
      {R"({"added_tokens_decoder": {"531": {"content": ""}}})",
       "added_tokens_decoder[\"531\"]: the content is empty"},
      {R"({"added_tokens_decoder": {"5x": {"content": "a"}}})",
       "added_tokens_decoder[\"5x\"]: not a token id"},
      {R"({"added_tokens_decoder": {"531": "[BOS]"}})",
       "added_tokens_decoder[\"531\"]: not {\"content\": \"...\", ...}"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.json);
    WriteFile(config, c.json);
    auto tok = Tokenizer::Load(dir.string());
    ASSERT_FALSE(tok.ok());
    EXPECT_NE(tok.status().message().find(config + ": " + c.message), std::string::npos)
        << tok.status().message();
  }
}

TEST(TiktokenTokenizer, SkipsEmptyLinesAndCarriageReturns) {
  std::vector<std::string> lines = FixtureLines();
  for (std::string& l : lines) l += "\r";
  lines.insert(lines.begin() + 5, "");
  auto tok = MustCreate(Join(lines) + "\n");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), static_cast<size_t>(kRanks + 258));
  // Kimi's defaults without a tokenizer_config.json: [BOS] and [EOS] are not named, so none.
  EXPECT_EQ(tok->bos_id(), std::nullopt);
}

// ---- which file Load reads ----

TEST(TiktokenTokenizer, LoadReadsTiktokenModelOnlyWithoutTheOthers) {
  auto kimi = MustLoad(kKimi);
  ASSERT_NE(kimi, nullptr);
  EXPECT_NE(dynamic_cast<const TiktokenTokenizer*>(kimi.get()), nullptr);

  fs::path dir = TempDir("both");
  fs::copy_file(kKimi + "/tiktoken.model", dir / "tiktoken.model");
  fs::copy_file(std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/tokenizers/gpt2/tokenizer.json",
                dir / "tokenizer.json");
  auto tok = MustLoad(dir.string());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(dynamic_cast<const TiktokenTokenizer*>(tok.get()), nullptr);
  EXPECT_TRUE(tok->TokenToId("[MASK]").has_value());  // The tokenizer.json one.

  auto none = Tokenizer::Load(TempDir("none").string());
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(none.status().message().find("no tokenizer.json, tokenizer.model or tiktoken.model"),
            std::string::npos);
}

}  // namespace
}  // namespace fmoe
