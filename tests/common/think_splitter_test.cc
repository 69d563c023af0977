#include "common/text/think_splitter.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"

namespace fmoe {
namespace {

using Pieces = ThinkSplitter::Pieces;

// `text` fed whole and then cut at every byte (two pieces, then byte by byte); every way must
// give the same split, which is returned.
Pieces Split(ThinkStyle style, const std::string& text) {
  ThinkSplitter whole(style);
  Pieces want = whole.Feed(text);
  Pieces rest = whole.Finish();
  want.content += rest.content;
  want.reasoning += rest.reasoning;
  auto check = [&](const std::vector<std::string>& pieces, const std::string& how) {
    ThinkSplitter s(style);
    Pieces got;
    for (const std::string& piece : pieces) {
      Pieces p = s.Feed(piece);
      got.content += p.content;
      got.reasoning += p.reasoning;
    }
    Pieces p = s.Finish();
    got.content += p.content;
    got.reasoning += p.reasoning;
    EXPECT_EQ(got.content, want.content) << how;
    EXPECT_EQ(got.reasoning, want.reasoning) << how;
  };
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    check({text.substr(0, cut), text.substr(cut)}, "cut at " + std::to_string(cut));
  }
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  check(bytes, "byte by byte");
  return want;
}

TEST(ThinkSplitter, DeepSeekR1StartsInsideTheThinking) {
  // R1's template ends the prompt with "<think>\n": only </think> is in the output.
  Pieces p = Split(ThinkStyle::kStartsThinking, "Let me see.\n2+2=4\n</think>\n\nIt is 4.");
  EXPECT_EQ(p.reasoning, "Let me see.\n2+2=4\n");
  EXPECT_EQ(p.content, "\n\nIt is 4.");
}

TEST(ThinkSplitter, DeepSeekR1WithoutEndIsAllReasoning) {
  Pieces p = Split(ThinkStyle::kStartsThinking, "Still thinking when max_tokens came </thi");
  EXPECT_EQ(p.reasoning, "Still thinking when max_tokens came </thi");
  EXPECT_EQ(p.content, "");
}

TEST(ThinkSplitter, DeepSeekR1DropsAnOpeningTheModelWritesAgain) {
  // An older R1 template leaves <think> to the model.
  Pieces p = Split(ThinkStyle::kStartsThinking, "<think>\nHm.</think>Yes.");
  EXPECT_EQ(p.reasoning, "\nHm.");
  EXPECT_EQ(p.content, "Yes.");
}

TEST(ThinkSplitter, Qwen3OpensTheThinkingItself) {
  Pieces p = Split(ThinkStyle::kOpensThinking, "<think>\nShort.\n</think>\n\nParis.");
  EXPECT_EQ(p.reasoning, "\nShort.\n");
  EXPECT_EQ(p.content, "\n\nParis.");
}

TEST(ThinkSplitter, Qwen3WithoutThinkingIsAllContent) {
  // enable_thinking false: the template wrote the empty thinking into the prompt.
  Pieces p = Split(ThinkStyle::kOpensThinking, "Paris. A </think> here stays, as <thin does.");
  EXPECT_EQ(p.reasoning, "");
  EXPECT_EQ(p.content, "Paris. A </think> here stays, as <thin does.");
}

TEST(ThinkSplitter, Qwen3UnterminatedThinkingIsReasoning) {
  Pieces p = Split(ThinkStyle::kOpensThinking, "<think>\nA long thought <");
  EXPECT_EQ(p.reasoning, "\nA long thought <");
  EXPECT_EQ(p.content, "");
}

TEST(ThinkSplitter, TextBeforeTheOpeningIsContent) {
  Pieces p = Split(ThinkStyle::kOpensThinking, "\n<think>r</think>c");
  EXPECT_EQ(p.content, "\nc");
  EXPECT_EQ(p.reasoning, "r");
}

TEST(ThinkSplitter, AfterTheEndEverythingIsContentMarkersIncluded) {
  Pieces p = Split(ThinkStyle::kOpensThinking, "<think>a</think>b<think>c</think>d");
  EXPECT_EQ(p.reasoning, "a");
  EXPECT_EQ(p.content, "b<think>c</think>d");
}

TEST(ThinkSplitter, MarkerPrefixesAreHeldUntilSettled) {
  // Byte by byte: what may still be a marker is held back, a look-alike comes out once it cannot
  // be one, and Finish has nothing left.
  ThinkSplitter s(ThinkStyle::kOpensThinking);
  const std::string text = "<thin><think>x</thinks></think>y";
  std::vector<std::string> content(1), reasoning(1);
  for (char c : text) {
    Pieces p = s.Feed(std::string(1, c));
    content.push_back(content.back() + p.content);
    reasoning.push_back(reasoning.back() + p.reasoning);
  }
  EXPECT_EQ(content[5], "");        // "<thin"
  EXPECT_EQ(content[6], "<thin>");  // "<thin>" cannot be <think>.
  EXPECT_EQ(reasoning[14], "x");    // "...x"
  EXPECT_EQ(reasoning[21], "x");    // "...x</think": may still be </think>.
  EXPECT_EQ(reasoning[22], "x</thinks");
  EXPECT_EQ(content.back(), "<thin>y");
  EXPECT_EQ(reasoning.back(), "x</thinks>");
  Pieces p = s.Finish();
  EXPECT_TRUE(p.content.empty() && p.reasoning.empty());
}

TEST(ThinkSplitter, AnyBytesPassThrough) {
  // Ill-formed UTF-8 and NUL bytes are text like any other; the markers still split.
  const std::string nul(1, '\0');
  const std::string text = "\xFF\xC3<think>" + nul + "\x80</think>\xE2\x82";
  Pieces p = Split(ThinkStyle::kOpensThinking, text);
  EXPECT_EQ(p.content, "\xFF\xC3\xE2\x82");
  EXPECT_EQ(p.reasoning, nul + "\x80");
  const std::string cut = "<\xFF</" + nul + "</think";
  Pieces r = Split(ThinkStyle::kStartsThinking, cut);
  EXPECT_EQ(r.reasoning, cut);
  EXPECT_EQ(r.content, "");
}

TEST(ThinkSplitter, EmptyOutput) {
  for (ThinkStyle style : {ThinkStyle::kStartsThinking, ThinkStyle::kOpensThinking}) {
    Pieces p = Split(style, "");
    EXPECT_EQ(p.content, "");
    EXPECT_EQ(p.reasoning, "");
  }
}

TEST(ThinkStyleFor, FromTheMarkersAndTheGenerationPrompt) {
  const std::string r1 = "{{'<｜Assistant｜>'}}{{'<think>\\n'}} {# strips </think> #}";
  EXPECT_EQ(ThinkStyleFor(true, r1, "<｜User｜>Hi<｜Assistant｜><think>\n"),
            ThinkStyle::kStartsThinking);
  EXPECT_EQ(ThinkStyleFor(true, r1, "<|im_start|>assistant\n"), ThinkStyle::kOpensThinking);
  // Thinking switched off in the prompt: closed again, so the model opens it (or not) itself.
  EXPECT_EQ(ThinkStyleFor(true, r1, "assistant\n<think>\n\n</think>\n\n"),
            ThinkStyle::kOpensThinking);
  EXPECT_EQ(ThinkStyleFor(false, r1, "<think>\n"), std::nullopt);
  EXPECT_EQ(ThinkStyleFor(true, "no markers here", "<think>\n"), std::nullopt);
}

TEST(ThinkStyleFor, ModelDirectories) {
  // Qwen3's fixture: <think> and </think> are tokens, its template (Qwen3-30B-A3B's) strips
  // </think> from history and leaves the opening to the model.
  auto qwen3 = Tokenizer::Load(FMOE_SOURCE_DIR "/tests/fixtures/qwen3-moe-ref");
  ASSERT_TRUE(qwen3.ok()) << qwen3.status().ToString();
  auto compiled = ChatTemplate::Compile((*qwen3)->chat_template());
  ASSERT_TRUE(compiled.ok()) << compiled.status().ToString();
  EXPECT_EQ(ThinkStyleFor(**qwen3, *compiled, "", "<|im_end|>"), ThinkStyle::kOpensThinking);
  // The same tokenizer under an R1-shaped template that opens the thinking in the prompt.
  auto r1 = ChatTemplate::Compile(
      "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}"
      "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
      "{# content.split('</think>') #}");
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ(ThinkStyleFor(**qwen3, *r1, "", ""), ThinkStyle::kStartsThinking);
  // A tokenizer without the markers has no style whatever the template says.
  auto tiny = Tokenizer::Load(FMOE_SOURCE_DIR "/deploy/models/tiny-moe");
  ASSERT_TRUE(tiny.ok()) << tiny.status().ToString();
  EXPECT_EQ(ThinkStyleFor(**tiny, *r1, "", ""), std::nullopt);
}

}  // namespace
}  // namespace fmoe
