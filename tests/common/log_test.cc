// Log lines cannot be forged (issue: a group name with a newline and ANSI escapes wrote a line of
// its own into the router's log): every message goes through EscapeForLog.
#include "common/log.h"

#include <string>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

TEST(EscapeForLog, KeepsPrintableTextAndUtf8) {
  EXPECT_EQ(EscapeForLog("group=a-1 model=\"Mixtral\" 100%"), "group=a-1 model=\"Mixtral\" 100%");
  EXPECT_EQ(EscapeForLog("naïve 模型 🙂"), "naïve 模型 🙂");
  EXPECT_EQ(EscapeForLog(""), "");
}

TEST(EscapeForLog, MakesControlsVisible) {
  EXPECT_EQ(EscapeForLog("a\nb\rc\td"), "a\\nb\\rc\\td");
  EXPECT_EQ(EscapeForLog("\x1b[31mred\x1b[0m"), "\\x1b[31mred\\x1b[0m");
  EXPECT_EQ(EscapeForLog(std::string("nul\0end", 7)), "nul\\x00end");
  EXPECT_EQ(EscapeForLog("del\x7f"), "del\\x7f");
  // C1 controls as UTF-8: CSI (U+009B) and NEL (U+0085); U+00A0 is not one.
  EXPECT_EQ(EscapeForLog("\xc2\x9b"
                         "31m\xc2\x85"),
            "\\u{009b}31m\\u{0085}");
  EXPECT_EQ(EscapeForLog("\xc2\xa0"), "\xc2\xa0");
}

TEST(EscapeForLog, MakesMalformedUtf8Visible) {
  EXPECT_EQ(EscapeForLog("\xff"), "\\xff");
  EXPECT_EQ(EscapeForLog("a\xc3"), "a\\xc3");                           // Cut short.
  EXPECT_EQ(EscapeForLog("\xc0\xaf"), "\\xc0\\xaf");                    // Overlong.
  EXPECT_EQ(EscapeForLog("\xed\xa0\x80"), "\\xed\\xa0\\x80");           // A surrogate.
  EXPECT_EQ(EscapeForLog("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");  // Above U+10FFFF.
}

TEST(Logging, AForgedLineStaysOnOneLine) {
  ASSERT_TRUE(InitLogging("log_test", "info").ok());
  ::testing::internal::CaptureStderr();
  spdlog::info("worker hello from group={}",
               "g\n2026-11-26T00:00:00.000 info  fmoe-router[1] "
               "\x1b[2Jforged");
  spdlog::default_logger()->flush();
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_FALSE(err.empty());
  EXPECT_EQ(err.find('\n'), err.size() - 1) << err;
  EXPECT_EQ(err.find('\x1b'), std::string::npos) << err;
  EXPECT_NE(err.find("group=g\\n2026-11-26T00:00:00.000"), std::string::npos) << err;
  EXPECT_NE(err.find("\\x1b[2Jforged"), std::string::npos) << err;
}

}  // namespace
}  // namespace fmoe
