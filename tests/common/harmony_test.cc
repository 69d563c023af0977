#include "common/text/harmony.h"

#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

using Pieces = HarmonySplitter::Pieces;

// The whole text fed in pieces of `step` bytes, then finished.
Pieces Split(const std::string& text, size_t step) {
  HarmonySplitter s;
  Pieces all;
  for (size_t at = 0; at < text.size(); at += step) {
    Pieces p = s.Feed(text.substr(at, step));
    all.content += p.content;
    all.reasoning += p.reasoning;
  }
  Pieces p = s.Finish();
  all.content += p.content;
  all.reasoning += p.reasoning;
  return all;
}

// What gpt-oss writes after its prompt's "<|start|>assistant": an analysis message, then the
// final answer ended by <|return|>.
const std::string kAnswer =
    "<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is **4**.<|return|>";

TEST(Harmony, AnalysisIsReasoningAndFinalIsContent) {
  for (size_t step : {size_t{1}, size_t{2}, size_t{3}, size_t{7}, kAnswer.size()}) {
    Pieces p = Split(kAnswer, step);
    EXPECT_EQ(p.reasoning, "User asks 2+2. Answer 4.") << "step " << step;
    EXPECT_EQ(p.content, "It is **4**.") << "step " << step;
  }
}

TEST(Harmony, NothingReturnedIsTakenBack) {
  // Fed a byte at a time, no marker byte ever comes out, and the pieces add up.
  HarmonySplitter s;
  std::string content, reasoning;
  for (char c : kAnswer) {
    Pieces p = s.Feed(std::string(1, c));
    content += p.content;
    reasoning += p.reasoning;
    EXPECT_EQ(content.find("<|"), std::string::npos) << content;
    EXPECT_EQ(reasoning.find("<|"), std::string::npos) << reasoning;
  }
  Pieces p = s.Finish();
  EXPECT_EQ(content + p.content, "It is **4**.");
  EXPECT_EQ(reasoning + p.reasoning, "User asks 2+2. Answer 4.");
}

TEST(Harmony, TextThatOnlyLooksLikeAMarkerIsKept) {
  Pieces p = Split("<|channel|>final<|message|>a <|b and <|en|> c<|end|>", 1);
  EXPECT_EQ(p.content, "a <|b and <|en|> c");
  EXPECT_EQ(p.reasoning, "");
}

TEST(Harmony, CommentaryAndRecipientsAreContentAndConstrainIsPartOfTheHeader) {
  Pieces p = Split(
      "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
      "{\"city\":\"Paris\"}<|call|>",
      2);
  EXPECT_EQ(p.content, "{\"city\":\"Paris\"}");
  EXPECT_EQ(p.reasoning, "");
}

TEST(Harmony, AnOutputCutShortKeepsWhatItHas) {
  // max_tokens ended the analysis: it is all reasoning, a half-written marker included as text.
  Pieces p = Split("<|channel|>analysis<|message|>Thinking about<|en", 3);
  EXPECT_EQ(p.reasoning, "Thinking about<|en");
  EXPECT_EQ(p.content, "");
  // Cut inside the header: no message yet, the header's words are content without markers.
  p = Split("<|channel|>anal", 1);
  EXPECT_EQ(p.content, "anal");
}

TEST(Harmony, OutputWithoutHeadersIsContent) {
  // A model that writes plain text: held while it may still be a header, then content.
  const std::string plain(HarmonySplitter::kMaxHeaderBytes + 40, 'x');
  Pieces p = Split(plain, 5);
  EXPECT_EQ(p.content, plain);
  EXPECT_EQ(p.reasoning, "");
  HarmonySplitter s;
  EXPECT_EQ(s.Feed("short answer").content, "");  // Could still be a header.
  EXPECT_EQ(s.Finish().content, "short answer");
}

TEST(Harmony, MessagesWithoutAnEndStillSplit) {
  // A model that starts the next message without ending the analysis.
  Pieces p =
      Split("<|channel|>analysis<|message|>r1<|start|>assistant<|channel|>final<|message|>c1", 4);
  EXPECT_EQ(p.reasoning, "r1");
  EXPECT_EQ(p.content, "c1");
}

}  // namespace
}  // namespace fmoe
