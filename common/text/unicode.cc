#include "common/text/unicode.h"

#include <climits>

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>
#include <unicode/uchar.h>

namespace fmoe {
namespace {

// The 188 bytes GPT-2 keeps as themselves: '!'..'~', 0xA1..0xAC, 0xAE..0xFF.
bool IsPrintableByte(int b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

struct ByteLevelTables {
  std::array<std::string, 256> byte_to_utf8;
  std::array<int16_t, 512> cp_to_byte;  // Every alphabet code point is below U+0144.

  ByteLevelTables() {
    cp_to_byte.fill(-1);
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      char32_t cp =
          IsPrintableByte(b) ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + next++);
      AppendUtf8(cp, &byte_to_utf8[b]);
      cp_to_byte[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelTables& Tables() {
  static const ByteLevelTables tables;
  return tables;
}

}  // namespace

size_t FirstInvalidUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    char32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07;
    } else {
      return i;  // A continuation byte, an overlong lead (C0, C1) or F5..FF.
    }
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF)) {
      return i;
    }
    i += len;
  }
  return n;
}

bool IsValidUtf8(std::string_view s) { return FirstInvalidUtf8(s) == s.size(); }

std::string ToValidUtf8(std::string_view s) {
  size_t bad = FirstInvalidUtf8(s);
  if (bad == s.size()) return std::string(s);
  constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  std::string out(s.substr(0, bad));
  size_t i = bad;
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    // The sequence's length and the range its second byte must be in (Unicode Table 3-7).
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    }
    if (len == 0) {  // Never a lead byte.
      out += kReplacement;
      ++i;
      continue;
    }
    size_t k = 1;
    while (k < len && i + k < n) {
      const unsigned char b = p[i + k];
      const bool ok = k == 1 ? (b >= lo && b <= hi) : (b & 0xC0) == 0x80;
      if (!ok) break;
      ++k;
    }
    if (k == len) {
      out.append(s.substr(i, len));
    } else {
      out += kReplacement;  // The maximal subpart s[i, i+k) stands for one character.
    }
    i += k;
  }
  return out;
}

size_t IncompleteUtf8Tail(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size();
  // Look back over at most three continuation bytes for the lead byte of the last character.
  for (size_t back = 1; back <= 4 && back <= n; ++back) {
    unsigned char c = p[n - back];
    if ((c & 0xC0) == 0x80) continue;  // A continuation byte: keep looking for the lead.
    size_t want = c >= 0xF0 && c <= 0xF4 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 && c <= 0xDF ? 2 : 1;
    if (c >= 0xF5) want = 1;  // Never a lead byte.
    return back < want ? back : 0;
  }
  return 0;
}

size_t DecodeUtf8(std::string_view s, size_t i, char32_t* cp) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  unsigned char c = p[i];
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
  char32_t v = c & (len == 2 ? 0x1F : len == 3 ? 0x0F : 0x07);
  for (size_t k = 1; k < len && i + k < s.size(); ++k) v = (v << 6) | (p[i + k] & 0x3F);
  *cp = v;
  return len;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

const std::array<std::string, 256>& ByteLevelAlphabet() { return Tables().byte_to_utf8; }

std::optional<uint8_t> ByteLevelByte(char32_t cp) {
  if (cp >= Tables().cp_to_byte.size()) return std::nullopt;
  int16_t b = Tables().cp_to_byte[cp];
  if (b < 0) return std::nullopt;
  return static_cast<uint8_t>(b);
}

void ByteLevelEncode(std::string_view raw, std::string* out) {
  const auto& table = Tables().byte_to_utf8;
  for (unsigned char c : raw) out->append(table[c]);
}

std::optional<std::string> ByteLevelDecode(std::string_view token) {
  std::string out;
  out.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    char32_t cp;
    i += DecodeUtf8(token, i, &cp);
    std::optional<uint8_t> b = ByteLevelByte(cp);
    if (!b) return std::nullopt;
    out.push_back(static_cast<char>(*b));
  }
  return out;
}

bool IsUnicodeWhitespace(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

bool IsUnicodeWordChar(char32_t cp) {
  auto c = static_cast<UChar32>(cp);
  if (u_hasBinaryProperty(c, UCHAR_ALPHABETIC) || u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL)) {
    return true;
  }
  int32_t mask = U_GET_GC_MASK(c);
  return (mask & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0;
}

Result<std::string> Normalize(std::string_view text, NormalizationForm form) {
  if (text.size() > static_cast<size_t>(INT32_MAX)) {
    return InvalidArgument("text of " + std::to_string(text.size()) +
                           " bytes is too long to normalize");
  }
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* norm = nullptr;
  switch (form) {
    case NormalizationForm::kNfc:
      norm = icu::Normalizer2::getNFCInstance(err);
      break;
    case NormalizationForm::kNfd:
      norm = icu::Normalizer2::getNFDInstance(err);
      break;
    case NormalizationForm::kNfkc:
      norm = icu::Normalizer2::getNFKCInstance(err);
      break;
    case NormalizationForm::kNfkd:
      norm = icu::Normalizer2::getNFKDInstance(err);
      break;
  }
  if (U_FAILURE(err) || norm == nullptr) {
    return Internal(std::string("unicode normalization unavailable: ") + u_errorName(err));
  }
  icu::StringPiece piece(text.data(), static_cast<int32_t>(text.size()));
  if (norm->isNormalizedUTF8(piece, err) && U_SUCCESS(err)) return std::string(text);
  err = U_ZERO_ERROR;
  std::string out;
  out.reserve(text.size() + text.size() / 4);
  icu::StringByteSink<std::string> sink(&out);
  norm->normalizeUTF8(0, piece, sink, nullptr, err);
  if (U_FAILURE(err)) return Internal(std::string("unicode normalization: ") + u_errorName(err));
  return out;
}

}  // namespace fmoe
