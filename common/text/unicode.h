// UTF-8 and Unicode helpers for the tokenizers: strict UTF-8 validation, the GPT-2 byte-level
// alphabet, character classes, and normalization forms. ICU stays inside unicode.cc. Stateless;
// every function is safe from any thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace fmoe {

// True when `s` is well-formed UTF-8: no overlong forms, surrogates or code points > U+10FFFF.
bool IsValidUtf8(std::string_view s);

// The byte offset of the first ill-formed sequence in `s`, or s.size() when it is valid.
size_t FirstInvalidUtf8(std::string_view s);

// The number of bytes at the end of `s` that begin a character whose remaining bytes are not
// there yet (0 when `s` ends on a character boundary, or in bytes that can never complete).
size_t IncompleteUtf8Tail(std::string_view s);

// `s` with each ill-formed sequence replaced by U+FFFD: one per maximal subpart of an ill-formed
// subsequence (Unicode's recommended practice, as Rust's from_utf8_lossy and so Hugging Face
// `tokenizers` decode). Valid input comes back unchanged.
std::string ToValidUtf8(std::string_view s);

// Decodes the character at s[i] (which must be valid UTF-8); returns its length in bytes.
size_t DecodeUtf8(std::string_view s, size_t i, char32_t* cp);
void AppendUtf8(char32_t cp, std::string* out);

// GPT-2's bytes_to_unicode: every byte maps to one printable character (bytes that are already
// printable map to themselves, the others to U+0100 onwards). Returns the UTF-8 of that
// character.
const std::array<std::string, 256>& ByteLevelAlphabet();
// The byte a byte-level character stands for, or nullopt when `cp` is not in the alphabet.
std::optional<uint8_t> ByteLevelByte(char32_t cp);
// Maps every byte of `raw` to its byte-level character (appended to `out`).
void ByteLevelEncode(std::string_view raw, std::string* out);
// Inverse of ByteLevelEncode for one token: nullopt when a character is not in the alphabet.
std::optional<std::string> ByteLevelDecode(std::string_view token);

// Unicode White_Space (what Rust's char::is_whitespace and Oniguruma's \s accept).
bool IsUnicodeWhitespace(char32_t cp);
// A "word" character as Unicode regexes define \w: alphabetic, marks, decimal digits,
// connector punctuation, join controls.
bool IsUnicodeWordChar(char32_t cp);

enum class NormalizationForm { kNfc, kNfd, kNfkc, kNfkd };
// `text` must be valid UTF-8. kInternal when ICU fails.
Result<std::string> Normalize(std::string_view text, NormalizationForm form);

}  // namespace fmoe
