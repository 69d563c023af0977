// JSON Schema -> JsonGrammar, the node table GrammarMatcher runs (structured output by
// constrained decoding; grammar.h compiles grammars, regexes and choices into the same table).
// Torch-free; a compiled JsonGrammar is immutable and shared by the matchers of one request. Every
// schema from outside goes through CompileJsonSchema, which bounds nesting, node count and literal
// sizes and names the JSON pointer of what it refuses.
//
// The accepted language (docs/api.md "Structured output" says the same for clients):
// - Output is compact JSON with at most kMaxWhitespace whitespace bytes (space, \n, \t) in each
//   gap between tokens of the JSON text (after { [ , : and before } ] , :); none before the
//   value nor after it, so a model cannot loop on whitespace.
// - type (a string or an array), properties, required, additionalProperties, items, minItems,
//   maxItems, minLength, maxLength, enum, const, anyOf, oneOf (as anyOf, as xgrammar does),
//   allOf with one member, $ref to "#", "#/$defs/..", "#/definitions/.." (JSON pointers into
//   the document; recursion works, a cycle that consumes no input is refused), nullable (OpenAPI
//   3.0's: `nullable: true` also allows null).
// - Properties may come in any order, each at most once; keys are written without escapes.
//   Strings use no \u escapes of surrogates (characters beyond the BMP are written as UTF-8).
//   additionalProperties absent counts as false when the schema lists properties (xgrammar's
//   strict mode, vLLM's default) and as true for an object without properties.
// - Numbers: at most 16 integer digits, 16 fraction digits and 2 exponent digits.
// - Annotations (title, description, default, examples, format, discriminator, ...) and
//   unknown keywords are ignored; keywords that would narrow the language and are not
//   implemented (pattern, minimum, maximum, multipleOf, uniqueItems, not, if, prefixItems,
//   patternProperties, ...) are refused, so every accepted output validates against the schema.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/json.h"
#include "common/status.h"

namespace fmoe {

struct JsonGrammar {
  enum class Kind : uint8_t {
    kObject,   // props, required_mask, additional (-1: none)
    kArray,    // items, min_items, max_items
    kString,   // min_len, max_len
    kNumber,   // Any JSON number.
    kInteger,  // Digits with an optional '-'.
    kLiteral,  // One of the literal texts in the trie at trie_root (enum, const, true, ...).
    kAnyOf,    // alts: one of these.
    kRef,      // target: the same as node target.
    // The kinds below come from grammars, regexes and choices (grammar.h), never from schemas.
    kSeq,     // alts: these nodes in order (an empty one matches "").
    kRepeat,  // items: min_items to max_items times in a row.
    kChar,    // One UTF-8 character whose code point is in ranges.
  };
  struct Property {
    std::string name;
    int32_t node = 0;
  };
  struct Node {
    Kind kind = Kind::kLiteral;
    std::vector<Property> props{};
    uint64_t required_mask = 0;  // Bit i: props[i] is required.
    int32_t additional = -1;     // Node of extra properties' values; -1: none allowed.
    int32_t key_trie = -1;       // Root of the trie of props' names (kObject).
    int32_t items = -1;
    uint32_t min_items = 0;
    uint32_t max_items = UINT32_MAX;
    uint32_t min_len = 0;
    uint32_t max_len = UINT32_MAX;
    int32_t trie_root = -1;  // kLiteral.
    std::vector<int32_t> alts{};
    int32_t target = -1;                                  // kRef.
    std::vector<std::pair<uint32_t, uint32_t>> ranges{};  // kChar: sorted, disjoint, inclusive.
    bool nullable = false;  // Matches the empty text (grammar nodes; JSON values never do).
  };
  // A byte trie (literals and property names). Node 0 of each trie is its root.
  struct TrieNode {
    std::vector<std::pair<uint8_t, int32_t>> next{};  // Sorted by byte.
    int32_t terminal = -1;  // Literal: 0 when a text ends here; key trie: the property index.
    uint64_t below = 0;     // Key trie: the properties whose names pass here (bit i: props[i]).
  };
  std::vector<Node> nodes;
  std::vector<TrieNode> tries;
  int32_t root = 0;
  // Token terminals (a grammar's <[id]>): the token ids that stand in the text as themselves,
  // sorted, each written in a literal as TokenTerminalBytes(id). The token mask allows such a
  // token only where its bytes may come (token_mask.h); no other token's text can spell them.
  std::vector<int32_t> tokens;

  int32_t Child(int32_t trie, uint8_t byte) const;
  // The trie path of `text` from node `root`, made where missing (edges kept sorted by byte);
  // returns its last node.
  int32_t AddPath(int32_t root, std::string_view text);
};

// A token terminal's bytes: 0xFF (never in UTF-8 text, so no text matches it), then the id in
// five bytes of six bits each (0x80 | bits, low bits first). Ids up to kMaxTokenTerminal.
inline constexpr uint8_t kTokenTerminalLead = 0xFF;
inline constexpr int32_t kMaxTokenTerminal = (1 << 30) - 1;
inline constexpr size_t kTokenTerminalSize = 6;  // Bytes.
std::string TokenTerminalBytes(int32_t id);

inline constexpr uint32_t kMaxWhitespace = 16;   // Per gap.
inline constexpr uint32_t kMaxIntDigits = 16;    // Digits before the point.
inline constexpr uint32_t kMaxFracDigits = 16;   // After it.
inline constexpr uint32_t kMaxExpDigits = 2;     // Of the exponent.
inline constexpr uint32_t kMaxProperties = 64;   // Per object.
inline constexpr uint32_t kMaxSchemaDepth = 64;  // Nesting of schemas in the document.
inline constexpr size_t kMaxJsonDepth = 512;     // Nesting of the document's JSON values.
inline constexpr size_t kMaxGrammarNodes = 20000;
inline constexpr size_t kMaxLiteralBytes = size_t{1} << 18;  // enum/const texts and names, all.
inline constexpr size_t kMaxSchemaBytes = size_t{1} << 20;   // The schema's JSON text.

// Compiles a JSON Schema (JSON text). kInvalidArgument naming the JSON pointer and keyword:
// "schema /properties/a: \"pattern\" is not supported", "schema /$defs/A: $ref cycle".
Result<std::shared_ptr<const JsonGrammar>> CompileJsonSchema(std::string_view schema_json);
// The same for a schema already parsed (its nesting is checked here, before any recursion).
Result<std::shared_ptr<const JsonGrammar>> CompileJsonSchemaValue(const nlohmann::json& schema);

// The grammar of any JSON object (response_format json_object).
std::shared_ptr<const JsonGrammar> AnyJsonObjectGrammar();

}  // namespace fmoe
