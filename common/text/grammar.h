// Grammars, regular expressions and choices -> JsonGrammar, the node table GrammarMatcher runs
// (vLLM's guided_grammar, guided_regex and guided_choice). Torch-free and stateless; every text
// from outside goes through these functions, which bound its size, nesting, repetition counts
// and node count and name what they refuse and where ("grammar line 3 col 9: ...").
//
// The languages (docs/api.md "Structured output" says the same for clients):
// - Grammar: GBNF as llama.cpp and xgrammar take it. Rules `name ::= alternatives` (a rule ends
//   where the next `name ::=` starts, or at an optional ';'), `root` is the start; literals
//   "..." (escapes \n \r \t \\ \" \' \[ \] \- \xHH \uHHHH \UHHHHHHHH), character classes
//   [a-z] and [^...] over Unicode code points, `.` (any character), rule references, ( ),
//   |, postfix * + ? {m} {m,} {m,n}; `#` comments. Left recursion (a rule that can reach
//   itself before consuming a byte) is refused naming the rule.
// - Regex: the whole output matches it (as re.fullmatch). Literals, escapes (\d \w \s and their
//   negations are ASCII, \n \t \r \f \v \0 \xHH \uHHHH \x{...}, an escaped punctuation mark),
//   classes, `.` (any character but \n), groups ( ), (?: ), (?P<name> ), (?<name> ), |,
//   * + ? {m} {m,} {m,n} (lazy forms too: the language is the same), ^ first and $ last.
//   Refused: lookaround, backreferences, \b \B \A \z \Z, \p{..}, inline flags, possessive
//   quantifiers, anchors elsewhere.
// - Choice: exactly one of the strings.
// - Structural tag (vLLM's response_format {"type": "structural_tag"}, as xgrammar's
//   TagDispatch): free text, in which every occurrence of a trigger starts a tagged structure:
//   one of the structures whose `begin` starts with that trigger, written as its begin text,
//   then a JSON value of its schema (json_schema.h's language), then its end text; after the
//   end, free text again, and the output may end anywhere in free text. A trigger may not
//   contain another trigger, and every begin starts with a trigger.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/text/json_schema.h"

namespace fmoe {

inline constexpr size_t kMaxGrammarBytes = size_t{1} << 18;       // A grammar's text.
inline constexpr size_t kMaxRegexBytes = size_t{1} << 14;         // A regex's text.
inline constexpr size_t kMaxGuidedChoices = 1024;                 // guided_choice's strings.
inline constexpr size_t kMaxGuidedChoiceBytes = size_t{1} << 15;  // All the strings.
inline constexpr uint32_t kMaxRepeat = 1000;                      // m and n of {m,n}.
inline constexpr uint32_t kMaxGrammarNesting = 64;                // Of parentheses.
inline constexpr size_t kMaxGrammarRules = 1024;

// kInvalidArgument naming the line and column ("grammar line 2 col 7: no rule named \"item\"").
Result<std::shared_ptr<const JsonGrammar>> CompileGrammar(std::string_view gbnf);
// kInvalidArgument naming the offset ("regex at 3: lookaround (?= is not supported").
Result<std::shared_ptr<const JsonGrammar>> CompileRegex(std::string_view regex);
// kInvalidArgument when there are none, more than kMaxGuidedChoices, or more than
// kMaxGuidedChoiceBytes (their GBNF then fits in kMaxGrammarBytes).
Result<std::shared_ptr<const JsonGrammar>> CompileChoice(const std::vector<std::string>& choices);
// The GBNF grammar whose language is exactly `choices` (what the router sends the worker).
std::string ChoiceGrammar(const std::vector<std::string>& choices);

inline constexpr size_t kMaxTagStructures = 64;   // structures[].
inline constexpr size_t kMaxTagTriggers = 64;     // triggers[].
inline constexpr size_t kMaxTagTextBytes = 1024;  // A begin, end or trigger text.
inline constexpr size_t kMaxTagTokens = 64;       // token_ids.
// A structural tag's spec, JSON text: {"structures": [{"begin": TEXT, "schema": SCHEMA, "end":
// TEXT}, ...], "triggers": [TEXT, ...], "at_least_one": BOOL, "stop_after_first": BOOL,
// "token_ids": {TEXT: ID, ...}} (the flags optional, false by default; other members are
// ignored). Free text in which each trigger starts one of its structures, free text again after
// it; at_least_one: the output opens with a structure; stop_after_first: it ends after the first
// structure met in the free text (after the opening one and at most one more with both, as
// xgrammar's triggered tags). token_ids (ours, optional): in the begin and end texts each of
// these texts is that token itself (a token terminal, as <[ID]> in a grammar: gpt-oss's
// "<|channel|>" is the special token, never its spelling in other tokens); triggers may not
// hold them. kInvalidArgument naming the member ("structural tag structures[1].schema
// /properties/a: ...", "structural tag triggers[0]: contains triggers[1] (\"<f\")").
Result<std::shared_ptr<const JsonGrammar>> CompileStructuralTag(std::string_view spec_json);

}  // namespace fmoe
