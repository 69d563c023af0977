#include "common/text/chat_template.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/json.h"
#include "common/text/tokenizer.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

const std::string kFixtures = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/chat_templates";

std::string Printable(const std::string& s) { return Json(s).dump(); }

Json LoadFixture(const std::string& name) {
  std::ifstream in(kFixtures + "/" + name + ".json");
  return Json::parse(in);
}

std::vector<ChatMessage> Messages(const Json& messages) {
  std::vector<ChatMessage> out;
  for (const Json& m : messages) out.push_back({m["role"], m["content"]});
  return out;
}

// Renders `source` with one user message "Hi" (and bos <s>, eos </s>).
Result<std::string> Render(std::string_view source, const ChatTemplateOptions& options = {},
                           std::vector<ChatMessage> messages = {{"user", "Hi"}}) {
  auto compiled = ChatTemplate::Compile(source, options);
  if (!compiled.ok()) return compiled.status();
  return compiled->Render(messages, "<s>", "</s>", /*add_generation_prompt=*/true);
}

std::string MustRender(std::string_view source,
                       std::vector<ChatMessage> messages = {{"user", "Hi"}}) {
  auto out = Render(source, {}, std::move(messages));
  EXPECT_TRUE(out.ok()) << Printable(std::string(source)) << ": " << out.status().ToString();
  return out.ok() ? *out : "";
}

Status RenderError(std::string_view source, const ChatTemplateOptions& options = {}) {
  auto out = Render(source, options);
  EXPECT_FALSE(out.ok()) << Printable(std::string(source)) << " rendered " << Printable(*out);
  return out.status();
}

Status CompileError(std::string_view source) {
  auto compiled = ChatTemplate::Compile(source);
  EXPECT_FALSE(compiled.ok()) << Printable(std::string(source)) << " compiled";
  return compiled.status();
}

// ---- byte-identical to Python's jinja2 (gen_chat_fixtures.py) on real templates ----

std::vector<std::string> FixtureNames() {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(kFixtures)) {
    if (entry.path().extension() == ".json") names.push_back(entry.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

class JinjaParity : public testing::TestWithParam<std::string> {};

// The instant strftime_now() sees in the fixtures: gen_chat_fixtures.py's FIXED_NOW,
// 2025-08-05 11:00 UTC (its date is the same in every zone from UTC-11 to UTC+12).
ChatTemplateOptions FixtureOptions() {
  ChatTemplateOptions options;
  options.clock = [] { return std::chrono::system_clock::from_time_t(1754391600); };
  return options;
}

// Whether the case needs more than ChatMessage holds: tools, kwargs, or messages with more than
// a string role and content.
bool NeedsJsonVariables(const Json& c) {
  if (c.contains("tools") || c.contains("kwargs")) return true;
  for (const Json& m : c["messages"]) {
    if (m.size() != 2 || !m.contains("role") || !m.contains("content") ||
        !m["content"].is_string()) {
      return true;
    }
  }
  return false;
}

// The variables apply_chat_template passes for the case (gen_chat_fixtures.py's render call).
Json CaseVariables(const Json& fixture, const Json& c) {
  Json variables = {{"messages", c["messages"]},
                    {"tools", c.contains("tools") ? c["tools"] : Json()},
                    {"documents", nullptr},
                    {"add_generation_prompt", c["add_generation_prompt"]},
                    {"bos_token", fixture["bos_token"]},
                    {"eos_token", fixture["eos_token"]}};
  if (c.contains("kwargs")) {
    for (const auto& [key, value] : c["kwargs"].items()) variables[key] = value;
  }
  return variables;
}

TEST_P(JinjaParity, RendersEveryConversationAsJinja2Does) {
  const Json fixture = LoadFixture(GetParam());
  SCOPED_TRACE(fixture["source"].get<std::string>());
  auto compiled = ChatTemplate::Compile(fixture["template"].get<std::string>(), FixtureOptions());
  ASSERT_TRUE(compiled.ok()) << compiled.status().ToString();
  const Json& cases = fixture["cases"];
  ASSERT_GE(cases.size(), 20u);
  for (size_t i = 0; i < cases.size(); ++i) {
    const Json& c = cases[i];
    SCOPED_TRACE("case " + std::to_string(i) + ": " + c["messages"].dump() +
                 " add_generation_prompt=" + c["add_generation_prompt"].dump());
    auto out = NeedsJsonVariables(c)
                   ? compiled->Render(CaseVariables(fixture, c))
                   : compiled->Render(Messages(c["messages"]), fixture["bos_token"],
                                      fixture["eos_token"], c["add_generation_prompt"]);
    if (c.contains("expected")) {
      ASSERT_TRUE(out.ok()) << out.status().ToString();
      EXPECT_EQ(*out, c["expected"].get<std::string>())
          << "got      " << Printable(*out) << "\nexpected " << c["expected"].dump();
    } else {
      ASSERT_FALSE(out.ok()) << "rendered " << Printable(*out);
      EXPECT_EQ(out.status().code(), ErrorCode::kInvalidArgument);
      // raise_exception's message exactly; Jinja's own errors with our "chat template: line N: ".
      const std::string message = out.status().message();
      const std::string expected = c["error"];
      if (message != expected) {
        EXPECT_TRUE(message.starts_with("chat template: line ") &&
                    message.ends_with(": " + expected))
            << message << "\nexpected " << expected;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, JinjaParity, testing::ValuesIn(FixtureNames()),
                         [](const testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

TEST(JinjaParityFixtures, CoverTheModelsWeServe) {
  std::vector<std::string> names = FixtureNames();
  for (const char* name :
       {"tiny_moe", "mixtral_8x7b_instruct_v0_1", "mixtral_8x7b_instruct_v0_1_original",
        "qwen1_5_moe_a2_7b_chat", "phi_3_5_moe_instruct", "llama3_8b_instruct",
        "namespace_loop_last", "expression_mix", "whitespace_control", "gpt_oss", "glm_4_5",
        "glm_4_6", "kimi_k2", "kimi_k2_thinking"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  }
}

TEST(JinjaParityFixtures, TinyMoeFixtureIsTheShippedTemplate) {
  auto tok = Tokenizer::Load(std::string(FMOE_SOURCE_DIR) + "/deploy/models/tiny-moe");
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->chat_template(), LoadFixture("tiny_moe")["template"].get<std::string>());
}

// ---- errors ----

TEST(ChatTemplate, RaiseExceptionGivesExactlyTheTemplatesMessage) {
  Status st = RenderError(
      "{% if messages[0].role == 'user' %}"
      "{{ raise_exception('Roles must alternate user/assistant/...') }}"
      "{% endif %}");
  EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "Roles must alternate user/assistant/...");
}

TEST(ChatTemplate, SyntaxErrorsNameLineColumnAndWhatWasExpected) {
  EXPECT_EQ(CompileError("Hello\n{% if x %}\n{{ x + }}\n{% endif %}").message(),
            "chat template: line 3, column 8: expected an expression, found '}}'");
  EXPECT_EQ(CompileError("{% for m in messages %}\n{{ m }}").message(),
            "chat template: line 2, column 8: expected 'else' or 'endfor' to close the 'for' on "
            "line 1, found end of template");
  EXPECT_EQ(CompileError("{% if a %}x{% endfor %}").message(),
            "chat template: line 1, column 15: unexpected 'endfor'; expected 'elif', 'else' or "
            "'endif' to close the 'if' on line 1");
  EXPECT_EQ(CompileError("{% call f() %}{% endcall %}").message(),
            "chat template: line 1, column 4: unknown tag 'call'");
  EXPECT_EQ(CompileError("{% macro f(a=1, b) %}{% endmacro %}").message(),
            "chat template: line 1, column 17: a parameter without a default follows one with a "
            "default");
  EXPECT_EQ(CompileError("{% macro f(a, a) %}{% endmacro %}").message(),
            "chat template: line 1, column 15: duplicate parameter 'a'");
  EXPECT_EQ(CompileError("{% for x in y %}{% macro f() %}{% break %}{% endmacro %}{% endfor %}")
                .message(),
            "chat template: line 1, column 35: 'break' outside a for loop");
  EXPECT_EQ(CompileError("{% macro f() %}x").message(),
            "chat template: line 1, column 17: expected 'endmacro' to close the 'macro' on line 1, "
            "found end of template");
  EXPECT_EQ(CompileError("{{ x | shout }}").message(),
            "chat template: line 1, column 8: unknown filter 'shout'");
  EXPECT_EQ(CompileError("{{ x is loud }}").message(),
            "chat template: line 1, column 9: unknown test 'loud'");
  EXPECT_EQ(CompileError("é {{ 'abc }}").message(),
            "chat template: line 1, column 6: the string is not closed");
  EXPECT_EQ(CompileError("  {{ a ; b }}").message(),
            "chat template: line 1, column 8: unexpected character ';'");
  EXPECT_EQ(CompileError("{{ a }").message(), "chat template: line 1, column 6: unexpected '}'");
  EXPECT_EQ(CompileError("{{ a").message(),
            "chat template: line 1, column 1: the tag is not closed; expected '}}'");
  EXPECT_EQ(CompileError("{# note").message(),
            "chat template: line 1, column 1: the comment is not closed; expected '#}'");
  EXPECT_EQ(CompileError("{% break %}").message(),
            "chat template: line 1, column 4: 'break' outside a for loop");
  EXPECT_EQ(CompileError("{% set x %}y{% endset %}").message(),
            "chat template: line 1, column 10: expected '=' ({% set %}...{% endset %} is not "
            "supported), found '%}'");
  EXPECT_EQ(CompileError("{{ f(a=1, 2) }}").message(),
            "chat template: line 1, column 11: a positional argument follows a keyword argument");
  EXPECT_EQ(CompileError("{{ (1 + 2 }}").message(),
            "chat template: line 1, column 11: unexpected '}'; expected ')'");
  EXPECT_EQ(CompileError("{{ (1 + 2] }}").message(),
            "chat template: line 1, column 10: unexpected ']'; expected ')'");
  EXPECT_EQ(CompileError("\xff").code(), ErrorCode::kInvalidArgument);
}

TEST(ChatTemplate, RuntimeErrorsNameTheLine) {
  EXPECT_EQ(RenderError("\n{{ nothing.attr }}").message(),
            "chat template: line 2: 'nothing' is undefined");
  EXPECT_EQ(RenderError("{{ messages[0].missing.x }}").message(),
            "chat template: line 1: 'dict object' has no attribute 'missing'");
  EXPECT_EQ(RenderError("{{ nothing + 'a' }}").message(),
            "chat template: line 1: 'nothing' is undefined");
  EXPECT_EQ(RenderError("{{ 'a' + 1 }}").message(),
            "chat template: line 1: unsupported operand type(s) for +: 'str' and 'int'");
  EXPECT_EQ(RenderError("{{ 1 // 0 }}").message(),
            "chat template: line 1: integer division or modulo by zero");
  EXPECT_EQ(RenderError("{{ 'x'.nope() }}").message(),
            "chat template: line 1: 'str object' has no attribute 'nope'");
  EXPECT_EQ(RenderError("{% set x = 1 %}{% set x.a = 2 %}").message(),
            "chat template: line 1: cannot assign attribute on non-namespace object");
  EXPECT_EQ(RenderError("{{ range(1000000) }}").message(),
            "chat template: line 1: Range too big. The sandbox blocks ranges larger than "
            "MAX_RANGE (100000).");
  EXPECT_EQ(RenderError("{{ 9223372036854775807 + 1 }}").message(),
            "chat template: line 1: integer overflow in '+'");
  EXPECT_EQ(RenderError("{{ 5[1:] }}").message(),
            "chat template: line 1: 'int' object is not subscriptable");
  EXPECT_EQ(RenderError("{{ (1, 2) + [3] }}").message(),
            "chat template: line 1: can only concatenate tuple to tuple");
  // As in Jinja, a value after a test's name is its argument, an error only when it runs.
  EXPECT_EQ(RenderError("{{ 3 is odd 1 }}").message(),
            "chat template: line 1: the test 'odd' takes no arguments");
  EXPECT_EQ(MustRender("{% if false %}{{ 3 is odd(1) }}{% endif %}ok"), "ok");
}

TEST(ChatTemplate, Macros) {
  // Positional, keyword and default arguments; the body's whitespace control; output returned.
  EXPECT_EQ(MustRender("{%- macro tag(name, body='', close=true) -%}\n"
                       "  <{{ name }}>{{ body }}{% if close %}</{{ name }}>{% endif %}\n"
                       "{%- endmacro -%}\n"
                       "{{ tag('a') }}|{{ tag('b', 'x') }}|{{ tag(close=false, name='c') }}|"
                       "{{ tag('d') | length }}"),
            "<a></a>|<b>x</b>|<c>|7");
  // The body sees the template's top level and its own parameters; its sets stay inside.
  EXPECT_EQ(MustRender("{% set greeting = 'hi' %}{% macro f(x) %}{% set greeting = x %}"
                       "{{ greeting }} {{ messages[0].content }} {{ missing }}{% endmacro %}"
                       "{{ f('yo') }} {{ greeting }}"),
            "yo Hi  hi");
  EXPECT_EQ(MustRender("{% macro f(a, b) %}[{{ a }}][{{ b is defined }}]{% endmacro %}{{ f(1) }}"),
            "[1][False]");
  // Recursion, as gpt-oss's render_typescript_type does, and a bound on its depth.
  EXPECT_EQ(MustRender("{% macro count(n) %}{{ n }}{% if n > 0 %}{{ count(n - 1) }}{% endif %}"
                       "{% endmacro %}{{ count(5) }}"),
            "543210");
  Status deep = RenderError("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
  EXPECT_EQ(deep.code(), ErrorCode::kResourceExhausted);
  EXPECT_EQ(deep.message(), "chat template: line 1: macro calls nest more than 64 deep");
  EXPECT_EQ(RenderError("{% macro f(a) %}{% endmacro %}{{ f(1, 2) }}").message(),
            "chat template: line 1: macro 'f' takes not more than 1 argument(s)");
  EXPECT_EQ(RenderError("{% macro f(a) %}{% endmacro %}{{ f(b=2) }}").message(),
            "chat template: line 1: macro 'f' takes no keyword argument 'b'");
  EXPECT_EQ(RenderError("{{ f() }}{% macro f() %}{% endmacro %}").message(),
            "chat template: line 1: 'f' is undefined");
  // A macro's output counts against the limits like any string.
  ChatTemplateOptions small;
  small.max_output_bytes = 100;
  EXPECT_EQ(RenderError("{% macro f() %}{{ 'x' * 60 }}{{ 'y' * 60 }}{% endmacro %}{{ f() }}", small)
                .code(),
            ErrorCode::kResourceExhausted);
}

TEST(ChatTemplate, StrftimeNowFormatsTheClocksLocalTime) {
  ChatTemplateOptions fixed;
  fixed.clock = [] { return std::chrono::system_clock::from_time_t(1754391600); };
  auto out = Render(
      "{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('') }}|{{ strftime_now('%%') }}", fixed);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(*out, "2025-08-05||%");
  EXPECT_EQ(RenderError("{{ strftime_now(1) }}").message(),
            "chat template: line 1: format must be a string");
  EXPECT_TRUE(Render("{{ strftime_now('%Y') }}").ok());  // The system clock.
}

TEST(ChatTemplate, TojsonTakesTransformersArguments) {
  EXPECT_EQ(MustRender("{{ {'b': 'é😀', 'a': [1, 2]} | tojson(ensure_ascii=true) }}"),
            "{\"b\": \"\\u00e9\\ud83d\\ude00\", \"a\": [1, 2]}");
  EXPECT_EQ(MustRender("{{ {'b': 1, 'a': {'d': 2, 'c': 3}} | tojson(sort_keys=true) }}"),
            "{\"a\": {\"c\": 3, \"d\": 2}, \"b\": 1}");
  EXPECT_EQ(MustRender("{{ {'a': [1, 2]} | tojson(separators=(',', ':')) }}"), "{\"a\":[1,2]}");
  EXPECT_EQ(MustRender("{{ {'a': [1]} | tojson(indent=1, separators=(';', '=')) }}"),
            "{\n \"a\"=[\n  1\n ]\n}");
  EXPECT_EQ(MustRender("{{ 'é' | tojson(false, 2) }} {{ 'é' | tojson(1) }}"), "\"é\" \"\\u00e9\"");
  EXPECT_EQ(RenderError("{{ 1 | tojson(separators=',') }}").message(),
            "chat template: line 1: tojson separators must be a pair of strings");
}

TEST(ChatTemplate, InputThatIsNotUtf8IsRejected) {
  auto compiled = ChatTemplate::Compile("{{ messages[0].content }}");
  ASSERT_TRUE(compiled.ok());
  auto out = compiled->Render({{"user", "bad \xc3"}}, "", "", false);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), ErrorCode::kInvalidArgument);
}

// ---- limits: nothing hangs or grows without bound ----

TEST(ChatTemplate, OutputSizeIsBounded) {
  ChatTemplateOptions small;
  small.max_output_bytes = 4096;
  EXPECT_EQ(RenderError("{% for i in range(1000) %}{{ 'x' * 10 }}{% endfor %}", small).code(),
            ErrorCode::kResourceExhausted);
  EXPECT_TRUE(Render("{% for i in range(100) %}{{ 'x' * 10 }}{% endfor %}", small).ok());
  // Strings built and thrown away count too, and are refused before they are allocated.
  Status st = RenderError(
      "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
      "{% endfor %}");
  EXPECT_EQ(st.code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(st.message().find("max_output_bytes=1048576"), std::string::npos) << st.message();
  EXPECT_EQ(RenderError("{% set x = 'x' * 1000000000000 %}").code(), ErrorCode::kResourceExhausted);
  EXPECT_EQ(RenderError("{% set x = [1, 2] * 1000000000000 %}").code(),
            ErrorCode::kResourceExhausted);
  EXPECT_EQ(RenderError("{{ (['x' * 1000] * 10000) | join }}").code(),
            ErrorCode::kResourceExhausted);
  EXPECT_EQ(RenderError("{{ ['x' * 1000] * 10000 }}").code(), ErrorCode::kResourceExhausted);
  EXPECT_EQ(RenderError("{{ (['x' * 1000] * 10000) | tojson }}").code(),
            ErrorCode::kResourceExhausted);
}

TEST(ChatTemplate, LoopIterationsAreBounded) {
  Status st = RenderError(
      "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}");
  EXPECT_EQ(st.code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(st.message().find("max_loop_iterations=100000"), std::string::npos) << st.message();
  ChatTemplateOptions few;
  few.max_loop_iterations = 10;
  EXPECT_TRUE(Render("{% for i in range(10) %}{% endfor %}", few).ok());
  EXPECT_EQ(RenderError("{% for i in range(11) %}{% endfor %}", few).code(),
            ErrorCode::kResourceExhausted);
  EXPECT_EQ(RenderError("{% for i in range(20) if i > 100 %}{% endfor %}", few).code(),
            ErrorCode::kResourceExhausted);
}

TEST(ChatTemplate, WorkIsBounded) {
  // Few iterations and little output, but each compares two 1 MB strings.
  Status st = RenderError(
      "{% set big = 'x' * 1000000 %}{% set big2 = 'x' * 1000000 %}"
      "{% for i in range(100000) %}{% if big == big2 %}{% endif %}{% endfor %}");
  EXPECT_EQ(st.code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(st.message().find("max_work"), std::string::npos) << st.message();
}

TEST(ChatTemplate, NestingIsBounded) {
  std::string deep_parens = "{{ " + std::string(10000, '(') + "1" + std::string(10000, ')') + " }}";
  EXPECT_NE(CompileError(deep_parens).message().find("nested more than 64 deep"),
            std::string::npos);
  std::string long_chain = "{{ 1";
  for (int i = 0; i < 100000; ++i) long_chain += " + 1";
  EXPECT_NE(CompileError(long_chain + " }}").message().find("nests more than 256 deep"),
            std::string::npos);
  std::string deep_ifs;
  for (int i = 0; i < 1000; ++i) deep_ifs += "{% if true %}";
  EXPECT_NE(CompileError(deep_ifs).message().find("nested more than 64 deep"), std::string::npos);
  EXPECT_TRUE(
      ChatTemplate::Compile("{{ " + std::string(60, '[') + std::string(60, ']') + " }}").ok());
  // Values cannot nest without bound either (nor can a namespace hold itself).
  EXPECT_EQ(RenderError("{% set ns = namespace(x=[]) %}{% for i in range(1000) %}"
                        "{% set ns.x = [ns.x] %}{% endfor %}")
                .code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(RenderError("{% set ns = namespace() %}{% set ns.me = [ns] %}").message(),
            "chat template: line 1: a namespace attribute cannot hold a namespace");
}

// ---- semantics ----

TEST(ChatTemplate, UndefinedBehavesAsJinjasDefaultUndefined) {
  EXPECT_EQ(MustRender("[{{ nothing }}]"), "[]");
  EXPECT_EQ(MustRender("[{{ messages[0].missing }}][{{ messages[5] }}][{{ none.x }}]"), "[][][]");
  EXPECT_EQ(MustRender("{{ nothing ~ 'a' }}"), "a");
  EXPECT_EQ(MustRender("{{ nothing is defined }} {{ nothing is undefined }} {{ not nothing }}"),
            "False True True");
  EXPECT_EQ(MustRender("{% for x in nothing %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(
      MustRender("{{ nothing | length }} {{ nothing | default('d') }} [{{ nothing | trim }}]"),
      "0 d []");
  EXPECT_EQ(MustRender("{{ 'a' in nothing }} {{ nothing == nothing }} {{ nothing == none }}"),
            "False True False");
  EXPECT_EQ(MustRender("{% if nothing %}yes{% else %}no{% endif %}"), "no");
}

TEST(ChatTemplate, WhitespaceControl) {
  EXPECT_EQ(MustRender("a  {%- if true -%}  b  {%- endif -%}  c"), "abc");
  EXPECT_EQ(MustRender("a  {{- 'b' -}}  c"), "abc");
  EXPECT_EQ(MustRender("a {#- note -#} b"), "ab");
  // trim_blocks: a block tag eats the newline after it; lstrip_blocks: the indentation before.
  EXPECT_EQ(MustRender("{% if true %}\n  x\n  {% endif %}\ny"), "  x\ny");
  // Not for output tags, not mid-line, and not with '+'.
  EXPECT_EQ(MustRender("  {{ 'x' }}\n"), "  x");
  EXPECT_EQ(MustRender("a {% if true %}b{% endif %} c"), "a b c");
  EXPECT_EQ(MustRender("  {%+ if true +%}\nx{% endif %}"), "  \nx");
  // One final newline is dropped; CRLF reads as LF.
  EXPECT_EQ(MustRender("x\r\n\r\n"), "x\n");
  EXPECT_EQ(MustRender("{% if true %}\r\nx\r\n{% endif %}\r\n"), "x\n");
}

TEST(ChatTemplate, ScopingFollowsJinja) {
  // A set inside a loop body lasts one iteration; a namespace carries state out.
  EXPECT_EQ(MustRender("{% set x = 1 %}{% for i in [1, 2] %}{{ x }}{% set x = x + 10 %}{{ x }} "
                       "{% endfor %}{{ x }}"),
            "111 111 1");
  EXPECT_EQ(MustRender("{% set ns = namespace(n=0) %}{% for i in range(3) %}"
                       "{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"),
            "3");
  // if blocks do not open a scope.
  EXPECT_EQ(MustRender("{% if true %}{% set y = 'set' %}{% endif %}{{ y }}"), "set");
  // Variables shadow the built-in functions.
  EXPECT_EQ(MustRender("{% set range = 'mine' %}{{ range }}"), "mine");
}

TEST(ChatTemplate, ValuesPrintAsPython) {
  EXPECT_EQ(MustRender("{{ 1e16 }} {{ 1.5e-7 }} {{ 0.1 }} {{ -0.0 }} {{ 2 / 3 }} {{ 10 / 4 }}"),
            "1e+16 1.5e-07 0.1 -0.0 0.6666666666666666 2.5");
  EXPECT_EQ(MustRender("{{ ['a', \"it's\", 1, none, true] }}"), "['a', \"it's\", 1, None, True]");
  EXPECT_EQ(MustRender("{{ {'a': {'b': [1.0]}} }}"), "{'a': {'b': [1.0]}}");
  EXPECT_EQ(MustRender("{{ 'tab\\there' | tojson }}"), "\"tab\\there\"");
  EXPECT_EQ(MustRender("{{ {'é': '\\u00e9\\x01'} | tojson }}"), "{\"é\": \"é\\u0001\"}");
}

TEST(ChatTemplate, RendersWithJsonVariables) {
  auto compiled = ChatTemplate::Compile(
      "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.name is defined %}"
      "({{ m.name }}){% endif %};{% endfor %}{{ tools | tojson }}{{ ' ' ~ extra }}");
  ASSERT_TRUE(compiled.ok()) << compiled.status().ToString();
  Json variables = {
      {"messages", Json::array({{{"role", "user"}, {"content", "hi"}, {"name", "ann"}},
                                {{"role", "assistant"}, {"content", "hello"}}})},
      {"tools", Json::array({{{"type", "function"}, {"name", "f"}, {"n", 1.5}}})},
      {"extra", 7}};
  auto out = compiled->Render(variables);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(
      *out,
      "user:hi(ann);assistant:hello;[{\"type\": \"function\", \"name\": \"f\", \"n\": 1.5}] 7");
  EXPECT_FALSE(compiled->Render(Json::array()).ok());
}

TEST(ChatTemplate, CompiledTemplateRendersFromManyThreads) {
  const Json fixture = LoadFixture("namespace_loop_last");
  auto compiled = ChatTemplate::Compile(fixture["template"].get<std::string>());
  ASSERT_TRUE(compiled.ok()) << compiled.status().ToString();
  const Json& c = fixture["cases"][5];
  const std::string expected = c["expected"];
  const std::vector<ChatMessage> messages = Messages(c["messages"]);
  std::vector<std::thread> threads;
  std::vector<int> mismatches(8, 0);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        auto out = compiled->Render(messages, fixture["bos_token"], fixture["eos_token"],
                                    c["add_generation_prompt"]);
        if (!out.ok() || *out != expected) ++mismatches[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 8; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

TEST(ChatTemplate, RenderChatTemplateCompilesAndRenders) {
  auto out = RenderChatTemplate("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
                                {{"user", "a"}, {"assistant", "b"}}, "<s>", "</s>", false);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(*out, "<s>ab");
  EXPECT_FALSE(RenderChatTemplate("{% if %}", {}, "", "", false).ok());
}

}  // namespace
}  // namespace fmoe
