#include "common/text/unicode.h"

#include <set>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

TEST(Unicode, ValidatesUtf8Strictly) {
  EXPECT_TRUE(IsValidUtf8(""));
  EXPECT_TRUE(IsValidUtf8("plain ascii"));
  EXPECT_TRUE(IsValidUtf8("caf\xC3\xA9 \xE6\x97\xA5 \xF0\x9F\x98\x80 \xF4\x8F\xBF\xBF"));
  EXPECT_EQ(FirstInvalidUtf8("ab\x80"), 2u);                // Lone continuation byte.
  EXPECT_EQ(FirstInvalidUtf8("a\xC0\xAF"), 1u);             // Overlong '/'.
  EXPECT_EQ(FirstInvalidUtf8("\xE0\x80\xAF"), 0u);          // Overlong three-byte form.
  EXPECT_EQ(FirstInvalidUtf8("x\xED\xA0\x80"), 1u);         // UTF-16 surrogate.
  EXPECT_EQ(FirstInvalidUtf8("\xF4\x90\x80\x80"), 0u);      // Above U+10FFFF.
  EXPECT_EQ(FirstInvalidUtf8("ok\xE6\x97"), 2u);            // Truncated at the end.
  EXPECT_EQ(FirstInvalidUtf8("\xE6\x41\x41"), 0u);          // Lead byte without continuations.
  EXPECT_EQ(FirstInvalidUtf8(std::string("a\0b", 3)), 3u);  // NUL is a character.
}

TEST(Unicode, ReplacesEachMaximalIllFormedSubpartWithOneReplacementCharacter) {
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(ToValidUtf8(""), "");
  EXPECT_EQ(ToValidUtf8("caf\xC3\xA9 \xF0\x9F\x98\x80"), "caf\xC3\xA9 \xF0\x9F\x98\x80");
  EXPECT_EQ(ToValidUtf8("ab\x80"), "ab" + r);
  EXPECT_EQ(ToValidUtf8("\xE4 x"), r + " x");
  EXPECT_EQ(ToValidUtf8("\xC0\xAF"), r + r);                  // Overlong: C0 is never a lead.
  EXPECT_EQ(ToValidUtf8("\xE0\x80\xAF"), r + r + r);          // E0's second byte must be A0..BF.
  EXPECT_EQ(ToValidUtf8("\xED\xA0\x80"), r + r + r);          // Surrogates.
  EXPECT_EQ(ToValidUtf8("\xF4\x90\x80\x80"), r + r + r + r);  // Above U+10FFFF.
  EXPECT_EQ(ToValidUtf8("\xF0\x9F\x98"), r);                  // Truncated: one subpart.
  EXPECT_EQ(ToValidUtf8("\xF0\x9F\x98x\xE6\x97"), r + "x" + r);
  EXPECT_EQ(ToValidUtf8("\xE6\x41\x41"), r + "AA");
  EXPECT_EQ(ToValidUtf8("\xF5\xFF"), r + r);
  for (int b = 0; b < 256; ++b) {
    for (int c = 0; c < 256; c += 7) {
      const std::string s = {static_cast<char>(b), static_cast<char>(c), '\xA5', 'z'};
      EXPECT_TRUE(IsValidUtf8(ToValidUtf8(s))) << b << " " << c;
    }
  }
}

TEST(Unicode, FindsTheIncompleteTail) {
  EXPECT_EQ(IncompleteUtf8Tail(""), 0u);
  EXPECT_EQ(IncompleteUtf8Tail("abc"), 0u);
  EXPECT_EQ(IncompleteUtf8Tail("a\xF0"), 1u);
  EXPECT_EQ(IncompleteUtf8Tail("a\xF0\x9F"), 2u);
  EXPECT_EQ(IncompleteUtf8Tail("a\xF0\x9F\x98"), 3u);
  EXPECT_EQ(IncompleteUtf8Tail("a\xF0\x9F\x98\x80"), 0u);
  EXPECT_EQ(IncompleteUtf8Tail("\xC3"), 1u);
  EXPECT_EQ(IncompleteUtf8Tail("\xC3\xA9"), 0u);
  EXPECT_EQ(IncompleteUtf8Tail("\x80\x80"), 0u);  // Stray continuation bytes never complete.
  EXPECT_EQ(IncompleteUtf8Tail("\xFF"), 0u);
}

TEST(Unicode, ByteLevelAlphabetIsGpt2s) {
  const auto& alphabet = ByteLevelAlphabet();
  std::set<std::string> distinct(alphabet.begin(), alphabet.end());
  EXPECT_EQ(distinct.size(), 256u);
  EXPECT_EQ(alphabet['A'], "A");
  EXPECT_EQ(alphabet[' '], "\xC4\xA0");   // U+0120 'Ġ'
  EXPECT_EQ(alphabet['\n'], "\xC4\x8A");  // U+010A 'Ċ'
  EXPECT_EQ(alphabet[0], "\xC4\x80");     // U+0100
  EXPECT_EQ(alphabet[0xAD], "\xC5\x83");  // Soft hyphen, the last remapped byte: U+0143.
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  std::string mapped;
  ByteLevelEncode(all, &mapped);
  EXPECT_EQ(ByteLevelDecode(mapped), all);
  EXPECT_EQ(ByteLevelDecode("\xE6\x97\xA5"), std::nullopt);  // Not in the alphabet.
}

TEST(Unicode, CharacterClasses) {
  for (char32_t cp : {0x20u, 0x09u, 0x0Au, 0x85u, 0xA0u, 0x2028u, 0x3000u}) {
    EXPECT_TRUE(IsUnicodeWhitespace(cp)) << static_cast<uint32_t>(cp);
  }
  for (char32_t cp : {0x41u, 0x200Bu, 0x5Fu})
    EXPECT_FALSE(IsUnicodeWhitespace(cp)) << static_cast<uint32_t>(cp);
  for (char32_t cp : {0x41u, 0x5Fu, 0x39u, 0x301u, 0x65E5u, 0x200Du}) {
    EXPECT_TRUE(IsUnicodeWordChar(cp)) << static_cast<uint32_t>(cp);
  }
  for (char32_t cp : {0x20u, 0x2Du, 0x2Cu, 0x1F600u})
    EXPECT_FALSE(IsUnicodeWordChar(cp)) << static_cast<uint32_t>(cp);
}

TEST(Unicode, NormalizationForms) {
  EXPECT_EQ(*Normalize("cafe\xCC\x81", NormalizationForm::kNfc), "caf\xC3\xA9");
  EXPECT_EQ(*Normalize("caf\xC3\xA9", NormalizationForm::kNfd), "cafe\xCC\x81");
  EXPECT_EQ(*Normalize("\xEF\xAC\x81", NormalizationForm::kNfkc), "fi");  // The "fi" ligature.
  EXPECT_EQ(*Normalize("\xEF\xAC\x81", NormalizationForm::kNfc), "\xEF\xAC\x81");
  EXPECT_EQ(*Normalize("", NormalizationForm::kNfkd), "");
}

}  // namespace
}  // namespace fmoe
