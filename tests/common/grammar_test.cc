// Grammars, regexes and choices (grammar.h) run by the byte matcher (grammar_matcher.h) and the
// token mask (token_mask.h): accepted and rejected texts, the errors that name what is refused,
// and masked sampling over random vocabularies that only ever produces matching text (checked
// against PCRE2, common/text/regex.h, for regexes).
#include "common/text/grammar.h"

#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/text/grammar_matcher.h"
#include "common/text/regex.h"
#include "common/text/token_mask.h"

namespace fmoe {
namespace {

std::shared_ptr<const JsonGrammar> Gbnf(std::string_view text) {
  auto g = CompileGrammar(text);
  EXPECT_TRUE(g.ok()) << g.status().message() << " for " << text;
  return g.ok() ? *g : nullptr;
}

std::shared_ptr<const JsonGrammar> Regex(std::string_view text) {
  auto g = CompileRegex(text);
  EXPECT_TRUE(g.ok()) << g.status().message() << " for " << text;
  return g.ok() ? *g : nullptr;
}

// PCRE2's whole-text match, an independent engine (Unicode-aware: the texts here are ASCII
// where that differs from ours).
bool PcreMatches(const std::string& pattern, std::string_view text) {
  auto re = fmoe::Regex::Compile("\\A(?:" + pattern + ")\\z");
  EXPECT_TRUE(re.ok()) << pattern;
  std::vector<std::pair<size_t, size_t>> found;
  if (!re.ok() || !re->FindAll(text, &found).ok()) return false;
  return !found.empty() && found[0] == std::pair<size_t, size_t>{0, text.size()};
}

bool Matches(const std::shared_ptr<const JsonGrammar>& g, std::string_view text) {
  if (g == nullptr) return false;
  GrammarMatcher m(g);
  return m.Accept(text) && m.complete();
}

std::string GrammarError(std::string_view text) {
  auto g = CompileGrammar(text);
  return g.ok() ? std::string("(compiled)") : g.status().message();
}

std::string RegexError(std::string_view text) {
  auto g = CompileRegex(text);
  return g.ok() ? std::string("(compiled)") : g.status().message();
}

TEST(Grammar, AcceptsTheLanguageOfAGbnfGrammar) {
  auto g = Gbnf(R"(
    # A list of small words.
    root ::= "[" ws item ("," ws item)* ws "]"
    item ::= word | num
    word ::= [a-z]+
    num  ::= "-"? [0-9]{1,3}
    ws   ::= [ \t\n]*
  )");
  EXPECT_TRUE(Matches(g, "[a]"));
  EXPECT_TRUE(Matches(g, "[ abc, -12,\n7 ]"));
  EXPECT_TRUE(Matches(g, "[1,2,3]"));
  EXPECT_FALSE(Matches(g, "[]"));
  EXPECT_FALSE(Matches(g, "[1234]"));
  EXPECT_FALSE(Matches(g, "[a,]"));
  EXPECT_FALSE(Matches(g, "[A]"));
  EXPECT_FALSE(Matches(g, "[a"));
  EXPECT_FALSE(Matches(g, "[a]x"));
}

TEST(Grammar, RecursionNullablesAndAmbiguity) {
  auto parens = Gbnf("root ::= \"(\" root \")\" | \"\"");
  EXPECT_TRUE(Matches(parens, ""));
  EXPECT_TRUE(Matches(parens, "((()))"));
  EXPECT_FALSE(Matches(parens, "(()"));
  // Right recursion does not grow the stack: a long list fits.
  auto list = Gbnf("root ::= \"a\" rest\nrest ::= \",\" \"a\" rest | \"\"");
  std::string long_list = "a";
  for (int i = 0; i < 500; ++i) long_list += ",a";
  EXPECT_TRUE(Matches(list, long_list));
  // A literal that is a prefix of another, nullable elements and overlapping repetitions.
  auto g = Gbnf("root ::= (\"ab\" | \"a\") \"b\"? [a-c]* \"c\"");
  EXPECT_TRUE(Matches(g, "abc"));
  EXPECT_TRUE(Matches(g, "ac"));
  EXPECT_TRUE(Matches(g, "abbbbc"));
  EXPECT_TRUE(Matches(g, "acccc"));
  EXPECT_FALSE(Matches(g, "ab"));
  auto counts = Gbnf("root ::= (\"x\"?){2,3} \"y\"{0,}");
  EXPECT_TRUE(Matches(counts, ""));
  EXPECT_TRUE(Matches(counts, "xxx"));
  EXPECT_FALSE(Matches(counts, "xxxx"));
  EXPECT_TRUE(Matches(counts, "xyyyy"));
  // xgrammar's form: rules ended by ';', alternatives across lines.
  auto semi = Gbnf("root ::= a | b;\na ::= \"A\";\nb ::=\n  \"B\"\n  | \"C\";");
  EXPECT_TRUE(Matches(semi, "C"));
  EXPECT_FALSE(Matches(semi, "AB"));
}

TEST(Grammar, CharacterClassesAreUnicode) {
  auto g = Gbnf(R"(root ::= [à-ÿ]+ [^a-z\n] "é" "\u00e8\x41" .)");
  EXPECT_TRUE(Matches(g,
                      "àé"
                      "€"
                      "é"
                      "èA"
                      "\xF0\x9F\x98\x80"));
  EXPECT_FALSE(Matches(g, "àéaéèAx"));        // 'a' is in [a-z].
  EXPECT_FALSE(Matches(g, "a€éèAx"));         // 'a' is not in [à-ÿ].
  EXPECT_FALSE(Matches(g, "à\xC3\x28éèAx"));  // Not UTF-8.
  // A prefix of a character outside the class is refused at its first byte when no
  // completion could be in it: U+20AC starts E2, and [à-ÿ] is all two-byte.
  GrammarMatcher m(Gbnf("root ::= [à-ÿ]"));
  EXPECT_FALSE(m.Accept("\xE2"));
  EXPECT_TRUE(m.Accept("\xC3"));
  EXPECT_FALSE(m.Accept("\x80"));  // U+00C0 is below à (U+00E0).
  EXPECT_TRUE(m.Accept("\xA9"));
  EXPECT_TRUE(m.complete());
}

TEST(Grammar, RefusesBadGrammarsNamingTheProblem) {
  EXPECT_EQ(GrammarError("item ::= \"a\""), "grammar: no rule named root");
  EXPECT_EQ(GrammarError("root ::= item"), "grammar line 1 col 10: no rule named item");
  EXPECT_EQ(GrammarError("root ::= \"a\"\nroot ::= \"b\""),
            "grammar line 2 col 1: rule root is defined twice");
  EXPECT_EQ(GrammarError("root ::= root \"a\" | \"b\""),
            "grammar: rule root is left-recursive (it can reach itself before consuming input)");
  EXPECT_NE(GrammarError("root ::= x\nx ::= \"\"? y\ny ::= x \"a\"").find("left-recursive"),
            std::string::npos);
  EXPECT_EQ(GrammarError("root ::= \"a"), "grammar line 1 col 12: unterminated literal");
  EXPECT_EQ(GrammarError("root ::= [a-"), "grammar line 1 col 13: unterminated character class");
  EXPECT_EQ(GrammarError("root ::= \"a\"{5000}"),
            "grammar line 1 col 14: repetition count above 1000");
  EXPECT_EQ(GrammarError("root ::= \"a\"{3,2}"),
            "grammar line 1 col 14: repetition {m,n} with n < m");
  EXPECT_EQ(GrammarError("root ::= [z-a]"), "grammar line 1 col 14: character range is backwards");
  EXPECT_EQ(GrammarError("root ::= \"\\q\""), "grammar line 1 col 11: unknown escape \\q");
  EXPECT_EQ(GrammarError("root ::= ( \"a\""), "grammar line 1 col 15: expected )");
  EXPECT_EQ(GrammarError("root ::= \"a\" @"), "grammar line 1 col 14: unexpected '@'");
  EXPECT_EQ(GrammarError("root = \"a\""), "grammar line 1 col 6: expected ::= after root");
  EXPECT_EQ(GrammarError(R"(root ::= "a" [^\x00-\U0010FFFF])"),
            "grammar: a character class matches no character");
  std::string deep = "root ::= " + std::string(100, '(') + "\"a\"" + std::string(100, ')');
  EXPECT_NE(GrammarError(deep).find("nest deeper than 64"), std::string::npos);
  // Only UTF-8's shortest forms: an overlong '|' (0xC1 0xBC) or NUL (0xE0 0x80 0x80) is refused,
  // not read as the character it spells.
  for (const char* overlong :
       {"root ::= \"a\xC1\xBC\"", "root ::= [\xE0\x80\x80]", "root ::= \"\xF0\x8F\xBF\xBF\""}) {
    EXPECT_NE(GrammarError(overlong).find("not UTF-8"), std::string::npos) << overlong;
  }
  EXPECT_FALSE(CompileChoice({"(\xC1\xBCx"}).ok());
  EXPECT_NE(GrammarError(std::string(kMaxGrammarBytes + 1, ' ')).find("larger than"),
            std::string::npos);
}

// llama.cpp's token terminals: <[id]> is that token itself. Its bytes (TokenTerminalBytes) are
// no UTF-8 text, so no text matches it; other token forms are refused by name.
TEST(Grammar, TokenTerminalsAreTheTokensThemselves) {
  auto g = Gbnf("root ::= <[200005]> \"commentary\" <[7]> [a-z]+ | <[7]>");
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->tokens, (std::vector<int32_t>{7, 200005}));
  const std::string channel = TokenTerminalBytes(200005), message = TokenTerminalBytes(7);
  EXPECT_EQ(channel.size(), 6u);
  EXPECT_NE(channel, TokenTerminalBytes(200006));
  EXPECT_TRUE(Matches(g, channel + "commentary" + message + "abc"));
  EXPECT_TRUE(Matches(g, message));
  EXPECT_FALSE(Matches(g, "<[200005]>commentary<[7]>abc"));  // The spelling is not the token.
  EXPECT_FALSE(Matches(g, channel + "commentary" + channel + "abc"));
  EXPECT_EQ(GrammarError("root ::= <|message|>"),
            "grammar line 1 col 10: a token is written <[id]> (its id); <text> is not supported");
  EXPECT_EQ(GrammarError("root ::= <[12x]>"),
            "grammar line 1 col 10: a token is written <[id]>, its id in decimal");
  EXPECT_EQ(GrammarError("root ::= <[]>"),
            "grammar line 1 col 10: a token is written <[id]>, its id in decimal");
  EXPECT_EQ(GrammarError("root ::= <[99999999999]>"),
            "grammar line 1 col 10: a token is written <[id]>, its id in decimal");
  EXPECT_EQ(GrammarError("root ::= <[2000000000]>"),
            "grammar line 1 col 10: token id 2000000000 is out of range");
  EXPECT_NE(GrammarError("root ::= !<[5]>").find("a negated token (!<[id]>) is not supported"),
            std::string::npos);
}

// A character of a class leaves no trace of which one it was, and neither do a multi-byte
// character's bytes once the class takes whatever follows them: the token mask's states stay few
// (a walk of free text reuses them, bench/RESULTS.md).
TEST(Grammar, CharactersOfAClassLeaveEqualStates) {
  auto g = Regex(".x");
  const auto state_after = [&](std::string_view text) {
    GrammarMatcher m(g);
    EXPECT_TRUE(m.Accept(text)) << text;
    return m.state();
  };
  const auto same = [](const MatchState& a, const MatchState& b) {
    return a.frames == b.frames && a.ends == b.ends;
  };
  EXPECT_TRUE(same(state_after("a"), state_after("b")));
  EXPECT_TRUE(same(state_after("é"), state_after("a")));
  EXPECT_TRUE(same(state_after("\xE4\xB8"), state_after("\xE5\xA0")));  // Two CJK halves.
  // Where the class still depends on the bytes to come, the state keeps them.
  auto cjk = Regex("[一-丁]x");  // U+4E00..U+4E01.
  GrammarMatcher m1(cjk), m2(cjk);
  ASSERT_TRUE(m1.Accept("\xE4\xB8"));
  EXPECT_FALSE(m2.Accept("\xE5\xA0"));
  EXPECT_TRUE(m1.Accept("\x80x") && m1.complete());
}

TEST(Regex, MatchesWholeOutputs) {
  auto g = Regex(R"(^(\d{3})-[A-Z]{2,}\.?(?:x|yz)*$)");
  EXPECT_TRUE(Matches(g, "123-AB"));
  EXPECT_TRUE(Matches(g, "123-ABC.xyzx"));
  EXPECT_FALSE(Matches(g, "12-AB"));
  EXPECT_FALSE(Matches(g, "123-A"));
  EXPECT_FALSE(Matches(g, "123-AB.y"));
  auto email = Regex(R"([\w.+-]+@[\w-]+\.[a-z]{2,4})");
  EXPECT_TRUE(Matches(email, "a.b+c@ex-ample.com"));
  EXPECT_FALSE(Matches(email, "a@b"));
  auto any = Regex("a.c|[^abc]{2}|é+|\\x41\\u00e8|(?P<n>q)(?<m>r)|{x}");
  EXPECT_TRUE(Matches(any,
                      "a\xE2\x82\xAC"
                      "c"));
  EXPECT_FALSE(Matches(any, "a\nc"));
  EXPECT_TRUE(Matches(any, "xy"));
  EXPECT_TRUE(Matches(any, "ééé"));
  EXPECT_TRUE(Matches(any, "Aè"));
  EXPECT_TRUE(Matches(any, "qr"));
  EXPECT_TRUE(Matches(any, "{x}"));
  auto lazy = Regex("a+?b*?c??");
  EXPECT_TRUE(Matches(lazy, "aabbc"));
  EXPECT_TRUE(Matches(Regex(""), ""));
}

TEST(Regex, RefusesUnsupportedConstructsNamingThem) {
  EXPECT_EQ(RegexError("a(?=b)"), "regex at 1: lookaround is not supported");
  EXPECT_EQ(RegexError("(?<!a)b"), "regex at 0: lookaround is not supported");
  EXPECT_EQ(RegexError("(a)\\1"), "regex at 3: backreferences are not supported");
  EXPECT_EQ(RegexError("(?P<x>a)(?P=x)"), "regex at 8: backreferences are not supported");
  EXPECT_EQ(RegexError("\\bword"), "regex at 0: \\b (an anchor or word boundary) is not supported");
  EXPECT_EQ(RegexError("\\p{L}"), "regex at 0: \\p{...} (Unicode properties) is not supported");
  EXPECT_EQ(RegexError("(?i)abc"),
            "regex at 0: inline flags and (?...) groups other than (?: ), (?P<name> ) and "
            "(?<name> ) are not supported");
  EXPECT_EQ(RegexError("a*+"), "regex at 2: possessive quantifiers are not supported");
  EXPECT_EQ(RegexError("a**"), "regex at 2: a quantifier cannot follow a quantifier");
  EXPECT_EQ(RegexError("*a"), "regex at 0: nothing to repeat before '*'");
  EXPECT_EQ(RegexError("a{2000}"), "regex at 2: repetition count above 1000");
  EXPECT_EQ(RegexError("(ab"), "regex at 3: missing )");
  EXPECT_EQ(RegexError("ab)"), "regex at 2: unbalanced )");
  EXPECT_EQ(RegexError("a$b"), "regex at 1: $ is only supported at the end");
  EXPECT_EQ(RegexError("[[:alpha:]]"), "regex at 1: POSIX classes [:...:] are not supported");
  EXPECT_NE(RegexError(std::string(kMaxRegexBytes + 1, 'a')).find("longer than"),
            std::string::npos);
}

TEST(Choice, IsExactlyOneOfTheStrings) {
  auto g = CompileChoice({"yes", "no", "y\"es\\", "n\x01", "né", "ye"});
  ASSERT_TRUE(g.ok()) << g.status().message();
  for (const char* s : {"yes", "no", "y\"es\\", "n\x01", "né", "ye"}) EXPECT_TRUE(Matches(*g, s));
  for (const char* s : {"y", "yess", "", "n", "No"}) EXPECT_FALSE(Matches(*g, s)) << s;
  EXPECT_FALSE(CompileChoice({}).ok());
  EXPECT_EQ(CompileChoice({std::string(kMaxGuidedChoiceBytes + 1, 'a')}).status().message(),
            "choice: the strings exceed 32768 bytes");
  // The largest choice's GBNF (every byte escaped) is within a grammar's bound.
  auto escaped = CompileChoice(std::vector<std::string>(16, std::string(2048, '\x01')));
  EXPECT_TRUE(escaped.ok()) << escaped.status().message();
  EXPECT_FALSE(CompileChoice(std::vector<std::string>(kMaxGuidedChoices + 1, "a")).ok());
  // Many choices sharing a prefix stay one trie: none is lost to the matcher's stack bound.
  std::vector<std::string> many;
  for (int i = 0; i < 500; ++i) many.push_back("item-" + std::to_string(i));
  auto m = CompileChoice(many);
  ASSERT_TRUE(m.ok());
  for (const std::string& s : many) EXPECT_TRUE(Matches(*m, s)) << s;
}

// Sampling random allowed tokens until only the end is left: every text matches, and the end
// token is offered exactly when the text is complete. Every mask, remembered or walked, is the
// one a fresh masker walks after the same tokens. Returns the masks answered from memory.
uint64_t CheckMaskedWalks(const std::shared_ptr<const JsonGrammar>& g, const std::string* re,
                          const std::vector<std::string>& pieces, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::string> bytes;
  for (int i = 0; i < 200; ++i) {
    std::string t;
    for (int k = 0, n = 1 + static_cast<int>(rng() % 3); k < n; ++k) {
      t += pieces[rng() % pieces.size()];
    }
    bytes.push_back(t);
  }
  for (const std::string& p : pieces) bytes.push_back(p);  // Every piece alone too.
  bytes.push_back("<eos>");
  std::vector<bool> special(bytes.size(), false);
  special.back() = true;
  const auto eos = static_cast<int32_t>(bytes.size() - 1);
  auto vocab = std::make_shared<const TokenVocab>(bytes, special);
  int finished = 0;
  uint64_t remembered = 0;
  for (int walk = 0; walk < 40; ++walk) {
    TokenMasker masker(g, vocab, {eos});
    std::string text;
    std::vector<uint8_t> mask, fresh_mask;
    std::vector<int32_t> taken;
    for (int step = 0; step < 60; ++step) {
      const uint64_t before = masker.remembered();
      const size_t n = masker.Fill(bytes.size(), &mask);
      EXPECT_GT(n, 0u) << "stuck after \"" << text << "\"";
      if (n == 0) return remembered;
      if (masker.remembered() > before) {
        TokenMasker fresh(g, vocab, {eos});
        for (int32_t t : taken) EXPECT_TRUE(fresh.Accept(t));
        EXPECT_EQ(fresh.Fill(bytes.size(), &fresh_mask), n) << text;
        EXPECT_EQ(fresh_mask, mask) << "a remembered mask differs after \"" << text << "\"";
      }
      EXPECT_EQ(mask[static_cast<size_t>(eos)] == 1, masker.complete()) << text;
      std::vector<int32_t> allowed;
      for (size_t id = 0; id < mask.size(); ++id) {
        if (mask[id]) allowed.push_back(static_cast<int32_t>(id));
      }
      const int32_t token = allowed[rng() % allowed.size()];
      EXPECT_TRUE(masker.Accept(token));
      taken.push_back(token);
      if (token == eos) {
        GrammarMatcher check(g);
        EXPECT_TRUE(check.Accept(text) && check.complete()) << text;
        if (re != nullptr) {
          EXPECT_TRUE(PcreMatches(*re, text)) << text;
        }
        ++finished;
        break;
      }
      text += bytes[static_cast<size_t>(token)];
    }
    remembered += masker.remembered();
  }
  EXPECT_GT(finished, 0);
  return remembered;
}

TEST(GrammarMask, MaskedSamplingOnlyProducesMatchingText) {
  const std::vector<std::string> pieces = {"a", "b", "ab", "-", "1",    "12",   "x",  "\"", ",",
                                           " ", "[", "]",  "é", "\xC3", "\xA9", "\n", "c",  "yz"};
  // The last: a bound far past any token's length, whose counts share one remembered mask.
  const char* regexes[] = {"[ab]+-\\d{1,3}",    "(ab|a)*x?c",   "\\[(\\d+(, ?\\d+)*)?\\]",
                           "(a|b|c){2,4}(yz)?", "[^\\n]{0,5}1", "(?:[ab ]|é){3,40}c"};
  ASSERT_TRUE(PcreMatches("[^\\n]{0,2}", "éé"));  // The reference counts characters.
  ASSERT_FALSE(PcreMatches("a", "ab"));
  uint64_t seed = 1;
  uint64_t remembered = 0;
  for (const char* r : regexes) {
    SCOPED_TRACE(r);
    const std::string re = r;
    remembered = CheckMaskedWalks(Regex(r), &re, pieces, seed++);
  }
  EXPECT_GT(remembered, 0u);  // The long repetition's, checked against fresh walks.
  CheckMaskedWalks(Gbnf("root ::= \"[\" (item (\",\" \" \"? item)*)? \"]\"\n"
                        "item ::= \"\\\"\" [a-c]{1,3} \"\\\"\" | [0-9]+ | root"),
                   nullptr, pieces, seed++);
  auto choice = CompileChoice({"ab", "abab", "x", "yz-1"});
  ASSERT_TRUE(choice.ok());
  const std::string choice_re = "ab|abab|x|yz-1";
  CheckMaskedWalks(*choice, &choice_re, pieces, seed++);
}

std::shared_ptr<const JsonGrammar> Tag(std::string_view spec) {
  auto g = CompileStructuralTag(spec);
  EXPECT_TRUE(g.ok()) << g.status().message() << " for " << spec;
  return g.ok() ? *g : nullptr;
}

std::string TagError(std::string_view spec) {
  auto g = CompileStructuralTag(spec);
  return g.ok() ? std::string("(compiled)") : g.status().message();
}

// token_ids: in begins and ends each listed text is that token itself (gpt-oss's call header, as
// the router forces tool_choice "required"); triggers may not hold them.
TEST(StructuralTag, TokenIdsStandForTheTokens) {
  auto g = Tag(R"({"triggers": [" to=functions."], "at_least_one": true, "stop_after_first": true,
    "token_ids": {"<|channel|>": 10, "<|message|>": 11, "<|call|>": 12},
    "structures": [
      {"begin": " to=functions.get<|channel|>commentary json<|message|>", "end": "<|call|>",
       "schema": {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"]}},
      {"begin": " to=functions.now<|channel|>commentary json<|message|>", "end": "<|call|>",
       "schema": {"type": "object"}}]})");
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->tokens, (std::vector<int32_t>{10, 11, 12}));
  const std::string ch = TokenTerminalBytes(10), msg = TokenTerminalBytes(11),
                    call = TokenTerminalBytes(12);
  EXPECT_TRUE(Matches(
      g, " to=functions.get" + ch + "commentary json" + msg + R"({"city":"Paris"})" + call));
  EXPECT_TRUE(Matches(g, " to=functions.now" + ch + "commentary json" + msg + "{}" + call));
  EXPECT_FALSE(Matches(g, " to=functions.now" + ch + "commentary json" + msg + "{}"));
  EXPECT_FALSE(Matches(g, R"( to=functions.now<|channel|>commentary json<|message|>{}<|call|>)"));
  EXPECT_FALSE(Matches(g, "Sure." + std::string(" to=functions.now") + ch + "commentary json" +
                              msg + "{}" + call));  // It opens with the call.
  EXPECT_NE(TagError(R"({"triggers": ["<|x|>"], "token_ids": {"<|x|>": 1},
                         "structures": [{"begin": "<|x|>", "schema": {}, "end": ""}]})")
                .find("triggers[0]: holds the token \"<|x|>\" (token_ids): a trigger is text"),
            std::string::npos);
  EXPECT_NE(TagError(R"({"triggers": ["<"], "token_ids": {"<|x|>": 1},
                         "structures": [{"begin": "<|x|>", "schema": {}, "end": ""}]})")
                .find("structures[0].begin: has a token (token_ids) within its trigger"),
            std::string::npos);
  for (const char* bad : {R"("token_ids": [1])", R"("token_ids": {"<|x|>": -1})",
                          R"("token_ids": {"<|x|>": "1"})", R"("token_ids": {"": 1})"}) {
    EXPECT_NE(TagError(std::string(R"({"triggers": ["a"], "structures": [{"begin": "a",
                         "schema": {}, "end": ""}], )") +
                       bad + "}")
                  .find("structural tag token_ids"),
              std::string::npos)
        << bad;
  }
}

// Free text in which each trigger starts one of its structures: begin, a JSON value of the
// schema, end; the output may end anywhere in free text, never inside a structure.
TEST(StructuralTag, FreeTextWithStructuresAfterEachTrigger) {
  auto g = Tag(R"({"triggers": ["<function="],
    "structures": [
      {"begin": "<function=get>", "end": "</function>", "schema": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}},
      {"begin": "<function=add>", "end": "</function>", "schema": {"type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}]})");
  EXPECT_TRUE(Matches(g, ""));
  EXPECT_TRUE(Matches(g, "Hello, world."));
  EXPECT_TRUE(Matches(g, "a < b, and <func"));  // A trigger's start at the end is free text.
  EXPECT_TRUE(Matches(g, R"(Weather: <function=get>{"city": "Paris"}</function> done)"));
  EXPECT_TRUE(Matches(g, R"(<function=get>{"city":"P"}</function><function=add>{"a":1,"b":2})"
                         R"(</function>)"));
  // Triggers found across false starts ("<<", "<functio<").
  EXPECT_TRUE(Matches(g, R"(<<function=add>{"a":1,"b":2}</function>)"));
  EXPECT_TRUE(Matches(g, R"(<functio<function=add>{"a":1,"b":2}</function>!)"));
  EXPECT_FALSE(Matches(g, "<function=mul>{}</function>"));               // No structure begins so.
  EXPECT_FALSE(Matches(g, R"(<function=get>{"town":"P"}</function>)"));  // Not the schema.
  EXPECT_FALSE(Matches(g, R"(<function=get>{"city":"P"})"));             // Ends inside a structure.
  EXPECT_FALSE(Matches(g, R"(<function=get>{"city":"P"}</functio)"));
  EXPECT_FALSE(Matches(g, "x <function="));

  // Code points beyond ASCII, an empty end, and a begin that is its trigger.
  auto u = Tag(R"({"triggers": ["«"], "structures": [{"begin": "«", "schema": {"enum": [1, 22]},
                  "end": ""}]})");
  EXPECT_TRUE(Matches(u, "ü«1 «22»"));
  EXPECT_TRUE(Matches(u, "é"));
  EXPECT_FALSE(Matches(u, "a « b"));
  EXPECT_FALSE(Matches(u, "«3"));
}

// at_least_one: the output opens with a structure; stop_after_first: it ends after the first
// structure met in the free text; both: the opening structure, free text, at most one more.
TEST(StructuralTag, AtLeastOneAndStopAfterFirst) {
  const std::string body =
      R"("triggers": ["<t"], "structures": [{"begin": "<t>", "schema": {"enum": [1, 22]},
      "end": "</t>"}])";
  auto stop = Tag("{" + body + R"(, "stop_after_first": true})");
  EXPECT_TRUE(Matches(stop, ""));
  EXPECT_TRUE(Matches(stop, "plain text"));
  EXPECT_TRUE(Matches(stop, "a <t>1</t>"));
  EXPECT_FALSE(Matches(stop, "a <t>1</t> b"));
  EXPECT_FALSE(Matches(stop, "<t>1</t><t>22</t>"));
  auto one = Tag("{" + body + R"(, "at_least_one": true})");
  EXPECT_TRUE(Matches(one, "<t>1</t>"));
  EXPECT_TRUE(Matches(one, "<t>1</t> and <t>22</t> more"));
  EXPECT_FALSE(Matches(one, ""));
  EXPECT_FALSE(Matches(one, "text"));
  EXPECT_FALSE(Matches(one, "a <t>1</t>"));
  auto both = Tag("{" + body + R"(, "at_least_one": true, "stop_after_first": true})");
  EXPECT_TRUE(Matches(both, "<t>1</t>"));
  EXPECT_TRUE(Matches(both, "<t>1</t> then"));
  EXPECT_TRUE(Matches(both, "<t>1</t> then <t>22</t>"));
  EXPECT_FALSE(Matches(both, "<t>1</t> then <t>22</t>."));
  EXPECT_FALSE(Matches(both, "x<t>1</t>"));
  // Masked sampling under at_least_one gives only its language.
  const std::string re =
      "<t>(?:1|22)</t>(?:(?!<t)[\\s\\S])*(?:<t>(?:1|22)</t>(?:(?!<t)[\\s\\S])*)*";
  ASSERT_TRUE(PcreMatches(re, "<t>1</t>a<t>22</t>"));
  ASSERT_FALSE(PcreMatches(re, "a<t>1</t>"));
  const std::vector<std::string> pieces = {"<",    "t", ">", "<t", "<t>", "1",  "2", "22",
                                           "</t>", "/", "a", " ",  "é",   "t>", "</"};
  CheckMaskedWalks(one, &re, pieces, 7);
  EXPECT_NE(
      TagError("{" + body + R"(, "at_least_one": 1})").find("at_least_one: must be true or false"),
      std::string::npos);
}

TEST(StructuralTag, RefusesBadSpecsNamingTheMember) {
  const std::string s = R"("structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}])";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"[]", "structural tag: must be a JSON object"},
      {"{", "structural tag: not valid JSON"},
      {"{" + s + "}", "structural tag triggers: must be a non-empty array of strings"},
      {"{" + s + R"(, "triggers": [""]})", "structural tag triggers[0]: is empty"},
      {"{" + s + R"(, "triggers": ["<f", 3]})", "structural tag triggers[1]: must be a string"},
      {"{" + s + R"(, "triggers": ["<f", "x<f"]})",
       "structural tag triggers[1]: contains triggers[0] (\"<f\"): a trigger may not contain "
       "another"},
      {"{" + s + R"(, "triggers": ["<f", "<f"]})",
       "structural tag triggers[1]: repeats triggers[0]"},
      {"{" + s + R"(, "triggers": ["<f", "<g"]})",
       "structural tag triggers[1]: starts none of the structures"},
      {R"({"triggers": ["<f"], "structures": []})",
       "structural tag structures: must be a non-empty array of objects"},
      {R"({"triggers": ["<f"], "structures": [{"begin": "<g>", "schema": {}, "end": ""}]})",
       "structural tag structures[0].begin: does not start with any of the triggers"},
      {R"({"triggers": ["<f"], "structures": [{"begin": "<f>", "schema": {}}]})",
       "structural tag structures[0].end: is missing"},
      {R"({"triggers": ["<f"], "structures": [{"begin": "<f>", "end": ""}]})",
       "structural tag structures[0].schema: is missing"},
      {R"({"triggers": ["<f"], "structures": [{"begin": "<f>", "end": "", "schema": 3}]})",
       "structural tag structures[0].schema: must be a JSON Schema object"},
      {R"({"triggers": ["<f"], "structures": [{"begin": "<f>", "end": "",
           "schema": {"type": "string", "pattern": "a"}}]})",
       "structural tag structures[0].schema: schema /: \"pattern\" is not supported"},
      // JSON's parser refuses text that is not UTF-8.
      {std::string("{\"triggers\": [\"\xC3\"], ") + s + "}", "structural tag: not valid JSON"},
  };
  for (const auto& [spec, message] : cases) EXPECT_EQ(TagError(spec), message) << spec;
  const std::string long_trigger(kMaxTagTextBytes + 1, 'a');
  EXPECT_EQ(TagError(R"({"triggers": [")" + long_trigger +
                     R"("], "structures": [{"begin": "<f>", "end": "", "schema": {}}]})"),
            "structural tag triggers[0]: is longer than 1024 bytes");
}

// Masked sampling under a structural tag gives only texts of its language, checked against
// PCRE2 with a lookahead for "no trigger here" (a construct our regexes do not have).
TEST(StructuralTag, MaskedSamplingOnlyProducesMatchingText) {
  auto g = Tag(R"({"triggers": ["<t"], "structures": [{"begin": "<t>", "schema": {"enum": [1, 22]},
                  "end": "</t>"}]})");
  const std::string re = "(?:(?!<t)[\\s\\S])*(?:<t>(?:1|22)</t>(?:(?!<t)[\\s\\S])*)*";
  ASSERT_TRUE(PcreMatches(re, "a<t>1</t>b<t>22</t>"));
  ASSERT_FALSE(PcreMatches(re, "a<t>2</t>"));
  const std::vector<std::string> pieces = {"<",    "t", ">", "<t", "<t>", "1",  "2",  "22",
                                           "</t>", "/", "a", " ",  "é",   "t>", "</", "\n"};
  // Free text between the triggers is one state again and again: its mask is remembered.
  EXPECT_GT(CheckMaskedWalks(g, &re, pieces, 99), 0u);
}

// A token terminal allows exactly that token (special or not) where the grammar has it: never the
// tokens that spell its text, nor a raw 0xFF byte token (the terminal's lead byte); an end token
// the grammar has as a terminal is taken before the text is complete.
TEST(GrammarMask, TokenTerminalsAllowOnlyTheTokenItself) {
  const std::vector<std::string> bytes = {"a", "b", "<|m|>", "<|", "m|>", "\xFF", "<eos>", "<|m"};
  const std::vector<bool> special = {false, false, true, false, false, false, true, false};
  auto vocab = std::make_shared<const TokenVocab>(bytes, special);
  TokenMasker m(Gbnf("root ::= \"a\" <[2]> \"b\" <[6]>"), vocab, {6});
  std::vector<uint8_t> mask;
  EXPECT_EQ(m.Fill(8, &mask), 1u);
  EXPECT_EQ(mask[0], 1);
  ASSERT_TRUE(m.Accept(0));
  EXPECT_EQ(m.Fill(8, &mask), 1u);
  EXPECT_EQ(mask[2], 1);  // The special token itself, only.
  for (int32_t spelled : {3, 4, 5, 7}) EXPECT_FALSE(m.Accept(spelled)) << spelled;
  ASSERT_TRUE(m.Accept(2));
  EXPECT_EQ(m.Fill(8, &mask), 1u);
  ASSERT_TRUE(m.Accept(1));
  EXPECT_EQ(m.Fill(8, &mask), 1u);  // The end token, as the grammar's terminal.
  EXPECT_EQ(mask[6], 1);
  EXPECT_FALSE(m.complete());
  ASSERT_TRUE(m.Accept(6));
  EXPECT_TRUE(m.complete());
  // The same token outside the grammar's terminals stays refused.
  TokenMasker plain(Gbnf("root ::= \"a\" \"<|m|>\""), vocab, {6});
  ASSERT_TRUE(plain.Accept(0));
  EXPECT_FALSE(plain.Accept(2));
  EXPECT_EQ(plain.Fill(8, &mask), 2u);  // "<|m|>" spelled from "<|" or "<|m".
  EXPECT_EQ(mask[2], 0);
}

TEST(GrammarMask, EndsOnlyWhereTheGrammarMayEnd) {
  std::vector<std::string> bytes = {"a", "b", "<eos>"};
  std::vector<bool> special = {false, false, true};
  auto vocab = std::make_shared<const TokenVocab>(bytes, special);
  TokenMasker m(Regex("a{2}b?"), vocab, {2});
  std::vector<uint8_t> mask;
  EXPECT_EQ(m.Fill(3, &mask), 1u);  // "a"
  ASSERT_TRUE(m.Accept(0));
  EXPECT_FALSE(m.Accept(2));
  ASSERT_TRUE(m.Accept(0));
  EXPECT_EQ(m.Fill(3, &mask), 2u);  // "b" or the end.
  ASSERT_TRUE(m.Accept(1));
  EXPECT_EQ(m.Fill(3, &mask), 1u);  // Only the end: nothing more can follow.
  EXPECT_EQ(mask[2], 1);
}

}  // namespace
}  // namespace fmoe
