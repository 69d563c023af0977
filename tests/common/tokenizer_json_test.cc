#include "common/text/tokenizer_json.h"

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "common/json.h"
#include "common/text/bpe_tokenizer.h"
#include "common/text/tokenizer.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

// A small valid byte-level BPE tokenizer.json: "a", "b", "c", "ab", "abc", "Ġ" and one special.
Json Valid() {
  return Json::parse(R"({
    "version": "1.0",
    "added_tokens": [{"id": 6, "content": "<s>", "special": true, "lstrip": false,
                      "rstrip": false, "single_word": false, "normalized": false}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "special_tokens": {"<s>": {"id": "<s>", "ids": [6], "tokens": ["<s>"]}}},
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "fuse_unk": false,
              "byte_fallback": false, "ignore_merges": false,
              "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4, "Ġ": 5, "<s>": 6},
              "merges": ["a b", ["ab", "c"]]}
  })");
}

std::string ParseError(const Json& j) {
  auto r = ParseTokenizerJson(j.dump());
  if (r.ok()) return "ok";
  EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
  return r.status().message();
}

TEST(TokenizerJson, ParsesTheValidFile) {
  auto r = ParseTokenizerJson(Valid().dump());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->vocab.size(), 7u);
  ASSERT_EQ(r->merges.size(), 2u);
  EXPECT_EQ(r->merges[0].result, 3);
  EXPECT_EQ(r->merges[1].left, 3);
  EXPECT_EQ(r->merges[1].result, 4);
  EXPECT_EQ(r->post_prefix, std::vector<int32_t>{6});
  EXPECT_TRUE(r->decoder_byte_level);
  auto tok = BpeTokenizer::Create(std::move(*r), {});
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  auto ids = (*tok)->Encode("abc<s>ab c", true);
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  // <s> first (post-processor), "abc", <s>, "ab", then " c" -> "Ġ" "c".
  EXPECT_EQ(*ids, (std::vector<int32_t>{6, 4, 6, 3, 5, 2}));
  // Characters outside the vocab with no unk_token are dropped, as Hugging Face does (and
  // their neighbours then merge).
  EXPECT_EQ(*(*tok)->Encode("axb", false), (std::vector<int32_t>{3}));
}

TEST(TokenizerJson, NamesTheFieldOfEachMistake) {
  struct Case {
    const char* what;
    std::function<void(Json&)> edit;
    const char* want;
  };
  const Case cases[] = {
      {"merge result", [](Json& j) { j["model"]["merges"].push_back("b c"); },
       R"(model.merges[2]: "b" + "c" is not in the vocab)"},
      {"merge part", [](Json& j) { j["model"]["merges"][0] = "a q"; },
       R"(model.merges[0]: "q" is not in the vocab)"},
      {"merge shape", [](Json& j) { j["model"]["merges"][1] = "a b c"; },
       R"(model.merges[1]: "a b c" is not two tokens separated by one space)"},
      {"merge type", [](Json& j) { j["model"]["merges"][1] = 7; },
       R"(model.merges[1]: 7 is not "a b" or ["a", "b"])"},
      {"duplicate id", [](Json& j) { j["model"]["vocab"]["c"] = 1; },
       R"(model.vocab: tokens "b" and "c" both have id 1)"},
      {"negative id", [](Json& j) { j["model"]["vocab"]["c"] = -2; },
       R"(model.vocab["c"]: -2 is out of range (0..16777215))"},
      {"id type", [](Json& j) { j["model"]["vocab"]["c"] = "2"; },
       R"(model.vocab["c"]: "2" is not an integer id)"},
      {"sparse ids", [](Json& j) { j["model"]["vocab"]["c"] = 9000000; },
       "model.vocab: id 9000000 is far beyond the 7 tokens (ids must be dense)"},
      {"vocab type", [](Json& j) { j["model"]["vocab"] = Json::array(); },
       "model.vocab: missing or not an object of token: id"},
      {"added id clash", [](Json& j) { j["added_tokens"][0]["id"] = 2; },
       R"(added_tokens[0]: "<s>" has id 2 but model.vocab gives it 6)"},
      {"added content", [](Json& j) { j["added_tokens"][0]["content"] = ""; },
       "added_tokens[0].content: missing or empty"},
      {"added flag", [](Json& j) { j["added_tokens"][0]["lstrip"] = "yes"; },
       R"(added_tokens[0].lstrip: "yes" is not true or false)"},
      {"added twice",
       [](Json& j) {
         Json t = j["added_tokens"][0];
         t["id"] = 7;
         j["added_tokens"].push_back(t);
       },
       R"(added_tokens[1]: "<s>" is also added_tokens[0])"},
      {"unk", [](Json& j) { j["model"]["unk_token"] = "<unk>"; },
       R"(model.unk_token: "<unk>" is not in the vocab)"},
      {"model type", [](Json& j) { j["model"]["type"] = "Unigram"; },
       R"(model.type: "Unigram" is not supported (only BPE))"},
      {"byte fallback", [](Json& j) { j["model"]["byte_fallback"] = true; },
       "model.byte_fallback: true is not supported"},
      {"normalizer",
       [](Json& j) {
         j["normalizer"] = Json::parse(R"({"type": "Sequence", "normalizers": [{"type": "NFC"},
                                          {"type": "Lowercase"}]})");
       },
       R"(normalizer.normalizers[1].type: normalizer type "Lowercase" is not supported (NFC, NFD, NFKC, NFKD, Sequence))"},
      {"pre-tokenizer",
       [](Json& j) {
         j["pre_tokenizer"] = Json::parse(R"({"type": "Sequence", "pretokenizers": [
             {"type": "Metaspace", "replacement": "_"}]})");
       },
       R"(pre_tokenizer.pretokenizers[0].type: pre_tokenizer type "Metaspace" is not supported (ByteLevel, Split, Digits, Sequence))"},
      {"split behavior",
       [](Json& j) {
         j["pre_tokenizer"] =
             Json::parse(R"({"type": "Split", "pattern": {"Regex": "a"}, "behavior": "Sideways"})");
       },
       R"(pre_tokenizer.behavior: "Sideways" is not Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous)"},
      {"split pattern",
       [](Json& j) {
         j["pre_tokenizer"] =
             Json::parse(R"({"type": "Split", "pattern": {"Glob": "*"}, "behavior": "Isolated"})");
       },
       R"(pre_tokenizer.pattern: not {"Regex": "..."} or {"String": "..."})"},
      {"template token",
       [](Json& j) { j["post_processor"]["single"][0]["SpecialToken"]["id"] = "<bos>"; },
       R"(post_processor.single[0]: "<bos>" is not in post_processor.special_tokens)"},
      {"template id", [](Json& j) { j["post_processor"]["special_tokens"]["<s>"]["ids"][0] = 99; },
       R"(post_processor.special_tokens["<s>"].ids[0]: id 99 is not a token)"},
      {"template $B", [](Json& j) { j["post_processor"]["single"][1]["Sequence"]["id"] = "B"; },
       "post_processor.single[1]: a single-sequence template can only hold $A, not $B"},
      {"post type", [](Json& j) { j["post_processor"]["type"] = "BertProcessing"; },
       R"(post_processor.type: post_processor type "BertProcessing" is not supported (ByteLevel, TemplateProcessing, Sequence))"},
      {"decoder", [](Json& j) { j["decoder"] = Json::parse(R"({"type": "WordPiece"})"); },
       R"(decoder.type: decoder type "WordPiece" is not supported (only ByteLevel))"},
      {"no model", [](Json& j) { j.erase("model"); }, "model: missing"},
      {"root", [](Json& j) { j = Json::array(); }, "(root): not a JSON object"},
  };
  for (const Case& c : cases) {
    Json j = Valid();
    c.edit(j);
    EXPECT_EQ(ParseError(j), c.want) << c.what;
  }
}

TEST(TokenizerJson, RejectsMalformedJsonAndDeepNestingWithoutCrashing) {
  auto r = ParseTokenizerJson(R"({"model": {"vocab": {"a": 0,}}})");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().rfind("not valid JSON: parse error at line 1, column 29", 0), 0u)
      << r.status().message();
  std::string deep(100000, '[');
  r = ParseTokenizerJson(R"({"model": )" + deep);
  EXPECT_FALSE(r.ok());
  r = ParseTokenizerJson(R"({"model": {"vocab": {"a": )" + deep + std::string(100000, ']') + "}}}");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), R"(model.vocab["a"]: an array is not an integer id)");
  EXPECT_FALSE(ParseTokenizerJson("").ok());
  EXPECT_FALSE(ParseTokenizerJson("\xFF\xFE").ok());
}

TEST(TokenizerJson, RegexThatDoesNotCompileIsAnError) {
  Json j = Valid();
  j["pre_tokenizer"] =
      Json::parse(R"({"type": "Split", "pattern": {"Regex": "(a"}, "behavior": "Isolated"})");
  auto spec = ParseTokenizerJson(j.dump());
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  auto tok = BpeTokenizer::Create(std::move(*spec), {});
  ASSERT_FALSE(tok.ok());
  EXPECT_NE(tok.status().message().find("regex /(a/ does not compile at offset 2"),
            std::string::npos)
      << tok.status().message();
}

TEST(TokenizerJson, UnkTokenAndFusing) {
  // No byte-level here: the model sees characters, unknown ones become <unk>.
  Json j = Valid();
  j["pre_tokenizer"] = nullptr;
  j["post_processor"] = nullptr;
  j["model"]["vocab"]["<unk>"] = 7;
  j["model"]["unk_token"] = "<unk>";
  for (bool fuse : {false, true}) {
    j["model"]["fuse_unk"] = fuse;
    auto spec = ParseTokenizerJson(j.dump());
    ASSERT_TRUE(spec.ok()) << spec.status().ToString();
    auto tok = BpeTokenizer::Create(std::move(*spec), {});
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    auto ids = (*tok)->Encode("axyab\xC3\xA9", true);
    ASSERT_TRUE(ids.ok());
    std::vector<int32_t> want =
        fuse ? std::vector<int32_t>{0, 7, 3, 7} : std::vector<int32_t>{0, 7, 7, 3, 7};
    EXPECT_EQ(*ids, want) << "fuse_unk " << fuse;
  }
}

void WriteFile(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

TEST(TokenizerJson, LoadNamesTheFile) {
  fs::path dir = fs::path(testing::TempDir()) / "fmoe_tokenizer_json_test";
  fs::remove_all(dir);
  fs::create_directories(dir);
  Json j = Valid();
  j["model"]["merges"].push_back("b c");
  WriteFile(dir / "tokenizer.json", j.dump());
  auto tok = Tokenizer::Load(dir.string());
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().ToString(),
            "invalid_argument: tokenizer: " + (dir / "tokenizer.json").string() +
                R"(: model.merges[2]: "b" + "c" is not in the vocab)");

  WriteFile(dir / "tokenizer.json", Valid().dump());
  WriteFile(dir / "tokenizer_config.json", R"({"bos_token": "<bos>"})");
  tok = Tokenizer::Load(dir.string());
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().message(),
            "tokenizer: " + dir.string() +
                R"(: tokenizer_config.json: bos_token: "<bos>" is not a token of tokenizer.json)");

  WriteFile(dir / "tokenizer_config.json", R"({"add_bos_token": "yes"})");
  tok = Tokenizer::Load(dir.string());
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().message(), "tokenizer: " + (dir / "tokenizer_config.json").string() +
                                        ": add_bos_token: not true or false");

  // A SentencePiece-style tokenizer.json next to a tokenizer.model: the model is used.
  fs::remove(dir / "tokenizer_config.json");
  Json sp_style = Valid();
  sp_style["model"]["byte_fallback"] = true;
  WriteFile(dir / "tokenizer.json", sp_style.dump());
  fs::copy_file(std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/tokenizers/sp/tokenizer.model",
                dir / "tokenizer.model");
  tok = Tokenizer::Load(dir.string());
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->vocab_size(), 600u);
}

}  // namespace
}  // namespace fmoe
