#include "common/text/regex.h"

#include <thread>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

std::vector<std::string> Matches(const Regex& re, std::string_view text) {
  std::vector<std::pair<size_t, size_t>> spans;
  EXPECT_TRUE(re.FindAll(text, &spans).ok());
  std::vector<std::string> out;
  for (auto [b, e] : spans) out.emplace_back(text.substr(b, e - b));
  return out;
}

TEST(Regex, UnicodePropertiesAndLookahead) {
  auto re = Regex::Compile(R"( ?\p{L}+| ?\p{N}+|\s+(?!\S)|\s+)");
  ASSERT_TRUE(re.ok()) << re.status().ToString();
  EXPECT_EQ(Matches(*re, "caf\xC3\xA9  42 \xE6\x97\xA5"),
            (std::vector<std::string>{"caf\xC3\xA9", " ", " 42", " \xE6\x97\xA5"}));
}

TEST(Regex, EmptyMatchesAdvanceByACharacter) {
  auto re = Regex::Compile("x*");
  ASSERT_TRUE(re.ok());
  // Empty matches at each character boundary (never inside the two-byte character).
  EXPECT_EQ(Matches(*re, "a\xC3\xA9xx"), (std::vector<std::string>{"", "", "xx", ""}));
}

TEST(Regex, BadPatternNamesTheOffset) {
  auto re = Regex::Compile("a(b");
  ASSERT_FALSE(re.ok());
  EXPECT_EQ(re.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(re.status().message().find("does not compile at offset 3"), std::string::npos)
      << re.status().message();
}

TEST(Regex, SharedAcrossThreads) {
  auto re = Regex::Compile(R"(\p{L}+)");
  ASSERT_TRUE(re.ok());
  std::string text;
  for (int i = 0; i < 1000; ++i) text += "word ";
  std::vector<std::thread> threads;
  std::vector<size_t> counts(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] { counts[t] = Matches(*re, text).size(); });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(counts, std::vector<size_t>(4, 1000));
}

TEST(Regex, LongRunsDoNotExhaustTheStack) {
  auto re = Regex::Compile(R"(\s+(?!\S)|\s+| ?[^\s\p{L}\p{N}]+)");
  ASSERT_TRUE(re.ok());
  std::string text(1 << 20, ' ');
  text += "x";
  text += std::string(1 << 20, '!');
  std::vector<std::pair<size_t, size_t>> spans;
  ASSERT_TRUE(re->FindAll(text, &spans).ok());
  // All spaces but the last (which stands before the "x"), the last space, the "!" run.
  ASSERT_EQ(spans.size(), 3u);
  EXPECT_EQ(spans[0], std::make_pair(size_t{0}, (size_t{1} << 20) - 1));
  EXPECT_EQ(spans[2], std::make_pair((size_t{1} << 20) + 1, text.size()));
}

}  // namespace
}  // namespace fmoe
