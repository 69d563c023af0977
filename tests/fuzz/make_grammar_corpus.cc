// Writes the seed corpus of grammar_fuzz into the directory named on the command line: grammars,
// regexes, choices and structural tags clients send (llama.cpp's and xgrammar's GBNF, outlines'
// regexes), some the compilers refuse (left recursion, lookaround, backreferences, huge counts),
// each after its selector byte and followed by a NUL and a candidate text. Usage:
// make_grammar_corpus DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_grammar_corpus DIR\n");
    return 2;
  }
  const fs::path out = argv[1];
  fs::create_directories(out);
  const std::vector<std::tuple<char, std::string, std::string>> seeds = {
      {0,
       "root ::= \"[\" ws item (\",\" ws item)* ws \"]\"\nitem ::= [a-z]+ | \"-\"? [0-9]{1,3}\n"
       "ws ::= [ \\t\\n]*\n",
       "[ab, -12]"},
      {0, "root ::= answer\nanswer ::= \"yes\" | \"no\" # a comment\n", "yes"},
      {0, "root ::= \"(\" root \")\" | \"\"", "(())"},
      {0,
       "root ::= expr\nexpr ::= term ((\"+\" | \"-\") term)*\nterm ::= [0-9]+ | \"(\" expr \")\"",
       "1+(2-3)"},
      {0, "root ::= [^\"\\\\\\x00-\\x1F] . [à-ÿ]{2,} \"\\u00e9\"", "x€àéé"},
      {0, "root ::= a;\na ::= b \"x\";\nb ::= \"\"? a", "x"},
      {0, "root ::= root \"a\" | \"b\"", "ba"},
      // Token terminals: the candidate holds token 5's bytes (TokenTerminalBytes).
      {0, "root ::= [a-z]* <[5]> (\"x\" | <[200005]>)+ | <[0]>", "ab\xFF\x85\x80\x80\x80\x80x"},
      {1, "^\\d{3}-[A-Z]{2,}\\.?(?:x|yz)*$", "123-AB.x"},
      {1, "[\\w.+-]+@[\\w-]+\\.[a-z]{2,4}", "a@b.cd"},
      {1, "(a|ab)(c|bcd)(d*)", "abcd"},
      {1, "(?P<n>q)(?=x)\\1\\bz{5000}", "q"},
      {1, "[^\\n]{0,5}é+\\x41\\u00e8", "abéA"},
      {2, "yes\nno\nmaybe\ny", "maybe"},
      {2, "item-1\nitem-10\nitem-100", "item-10"},
      {2, "(\xC1\xBCx|yz)*", "(|x"},  // An overlong '|': refused, not read as '|'.
      {3,
       R"({"triggers": ["<function="], "structures": [{"begin": "<function=get>", "schema":
          {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
          "end": "</function>"}, {"begin": "<function=add>", "schema": {"type": "object",
          "properties": {"a": {"type": "integer"}}}, "end": "</function>"}]})",
       R"(ok <function=get>{"city": "Oslo"}</function> then <<function=add>{}</function>)"},
      {3,
       R"({"triggers": ["«", "<t"], "structures": [{"begin": "«", "schema": {"enum": [1, 22]},
          "end": ""}, {"begin": "<tool>", "schema": {"type": "array", "items": {}},
          "end": "</tool>"}]})",
       "ü«1 <tool>[1,\"a\"]</tool>"},
      {3, R"({"triggers": ["ab", "b"], "structures": [{"begin": "ab", "schema": {}, "end": ""}]})",
       "ab"},
      {3,
       R"({"triggers": ["<t"], "structures": [{"begin": "<t>", "schema": {"type": "integer"},
          "end": "</t>"}], "at_least_one": true, "stop_after_first": true})",
       "<t>12</t> then <t>3</t>"},
      {3,
       R"({"triggers": [" to=functions."], "structures": [{"begin":
          " to=functions.get<|channel|>commentary json<|message|>", "schema": {"type": "object"},
          "end": "<|call|>"}], "at_least_one": true, "stop_after_first": true,
          "token_ids": {"<|channel|>": 200005, "<|message|>": 200008, "<|call|>": 200012}})",
       " to=functions.get"},
  };
  int i = 0;
  for (const auto& [selector, text, bytes] : seeds) {
    std::ofstream f(out / ("seed_" + std::to_string(i++)), std::ios::binary);
    f << selector << text << '\0' << bytes;
  }
  return 0;
}
