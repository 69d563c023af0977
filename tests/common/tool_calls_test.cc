#include "common/text/tool_calls.h"

#include <cctype>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/manifest.h"
#include "common/text/harmony.h"
#include "common/text/unicode.h"

namespace fmoe {
namespace {

ToolCallOptions Seeded(uint64_t seed) {
  ToolCallOptions options;
  options.id_seed = seed;
  return options;
}

// The text fed in the pieces `cuts` delimit, then finished; the deltas joined.
ParsedToolCalls Stream(ToolCallFormat format, const std::string& text,
                       const std::vector<size_t>& cuts, const ToolCallOptions& options = {}) {
  ToolCallStream stream(format, options);
  ParsedToolCalls all;
  auto add = [&](ToolCallStreamDelta d) {
    all.content += d.content;
    for (ToolCallDelta& c : d.tool_calls) {
      EXPECT_EQ(c.index, all.calls.size());
      EXPECT_FALSE(c.id.empty());
      EXPECT_FALSE(c.name.empty());
      all.calls.push_back({c.id, c.name, c.arguments});
    }
  };
  size_t at = 0;
  for (size_t cut : cuts) {
    add(stream.Feed(text.substr(at, cut - at)));
    at = cut;
  }
  add(stream.Feed(text.substr(at)));
  add(stream.Finish());
  return all;
}

// Parses `text` whole, then checks that the stream gives the same at every cut (in two pieces,
// and byte by byte).
ParsedToolCalls Parse(ToolCallFormat format, const std::string& text,
                      const ToolCallOptions& options = {}) {
  ParsedToolCalls whole = ParseToolCalls(format, text, options);
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    ParsedToolCalls cut_once = Stream(format, text, {cut}, options);
    EXPECT_EQ(cut_once.content, whole.content) << "cut at " << cut;
    EXPECT_EQ(cut_once.calls, whole.calls) << "cut at " << cut;
  }
  std::vector<size_t> bytes;
  for (size_t i = 1; i < text.size(); ++i) bytes.push_back(i);
  ParsedToolCalls bytewise = Stream(format, text, bytes, options);
  EXPECT_EQ(bytewise.content, whole.content);
  EXPECT_EQ(bytewise.calls, whole.calls);
  return whole;
}

TEST(ToolCallFormat, NamesAndArchitectures) {
  EXPECT_EQ(*ParseToolCallFormat("hermes"), ToolCallFormat::kHermes);
  EXPECT_EQ(*ParseToolCallFormat("deepseek_v31"), ToolCallFormat::kDeepSeekV3);
  EXPECT_EQ(*ParseToolCallFormat("glm4_moe"), ToolCallFormat::kGlm45);
  EXPECT_EQ(*ParseToolCallFormat("openai"), ToolCallFormat::kGptOss);
  EXPECT_EQ(*ParseToolCallFormat("none"), ToolCallFormat::kNone);
  // Every name the manifest's router.tool_call_parser accepts is one.
  for (std::string_view name : kToolCallParsers) {
    EXPECT_TRUE(ParseToolCallFormat(name).ok()) << name;
  }
  Result<ToolCallFormat> bad = ParseToolCallFormat("llama3_json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("llama3_json"), std::string::npos);
  for (ToolCallFormat f :
       {ToolCallFormat::kNone, ToolCallFormat::kHermes, ToolCallFormat::kMistral,
        ToolCallFormat::kDeepSeekV3, ToolCallFormat::kKimiK2, ToolCallFormat::kGlm45,
        ToolCallFormat::kGptOss, ToolCallFormat::kMiniMaxM2}) {
    EXPECT_EQ(*ParseToolCallFormat(ToolCallFormatName(f)), f);
  }
  EXPECT_EQ(ToolCallFormatFor("Qwen3MoeForCausalLM"), ToolCallFormat::kHermes);
  EXPECT_EQ(ToolCallFormatFor("Qwen2MoeForCausalLM"), ToolCallFormat::kHermes);
  EXPECT_EQ(ToolCallFormatFor("MixtralForCausalLM"), ToolCallFormat::kMistral);
  EXPECT_EQ(ToolCallFormatFor("DeepseekV2ForCausalLM"), ToolCallFormat::kDeepSeekV3);
  EXPECT_EQ(ToolCallFormatFor("DeepseekV3ForCausalLM"), ToolCallFormat::kDeepSeekV3);
  EXPECT_EQ(ToolCallFormatFor("DeepseekV3ForCausalLM", /*kimi_tokenizer=*/true),
            ToolCallFormat::kKimiK2);
  EXPECT_EQ(ToolCallFormatFor("Glm4MoeForCausalLM"), ToolCallFormat::kGlm45);
  EXPECT_EQ(ToolCallFormatFor("GptOssForCausalLM"), ToolCallFormat::kGptOss);
  EXPECT_EQ(ToolCallFormatFor("MiniMaxM2ForCausalLM"), ToolCallFormat::kMiniMaxM2);
  EXPECT_EQ(ToolCallFormatFor("OlmoeForCausalLM"), ToolCallFormat::kNone);
}

TEST(ToolCalls, NoCallsIsContent) {
  const std::string text = "Plain answer with < and [brackets] and {\"json\": 1}.";
  for (ToolCallFormat f :
       {ToolCallFormat::kNone, ToolCallFormat::kHermes, ToolCallFormat::kMistral,
        ToolCallFormat::kDeepSeekV3, ToolCallFormat::kKimiK2, ToolCallFormat::kGlm45,
        ToolCallFormat::kGptOss, ToolCallFormat::kMiniMaxM2}) {
    ParsedToolCalls p = Parse(f, text);
    EXPECT_EQ(p.content, text) << ToolCallFormatName(f);
    EXPECT_TRUE(p.calls.empty());
  }
}

TEST(ToolCalls, HermesSeveralCallsWithContentAround) {
  const std::string text =
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Paris\", \"units\": [\"c\"]}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", "
      "\"arguments\": {}}\n</tool_call>\nDone.";
  ParsedToolCalls p = Parse(ToolCallFormat::kHermes, text);
  EXPECT_EQ(p.content, "Let me check.\nDone.");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, "{\"city\":\"Paris\",\"units\":[\"c\"]}");
  EXPECT_EQ(p.calls[1].name, "get_time");
  EXPECT_EQ(p.calls[1].arguments, "{}");
  EXPECT_EQ(p.calls[0].id.substr(0, 5), "call_");
  EXPECT_EQ(p.calls[0].id.size(), 29u);
  EXPECT_NE(p.calls[0].id, p.calls[1].id);
}

TEST(ToolCalls, HermesArgumentsAsStringAndUnterminatedLastCall) {
  ParsedToolCalls p = Parse(ToolCallFormat::kHermes,
                            "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}");
  EXPECT_EQ(p.content, "");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].arguments, "{\"a\":1}");
}

TEST(ToolCalls, HermesMalformedCallsAreContent) {
  for (std::string text : {
           "a <tool_call>{\"name\": \"f\", \"arguments\": {</tool_call> b",  // bad JSON
           "<tool_call>{\"arguments\": {}}</tool_call>",                     // no name
           "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",   // not an object
           "<tool_call>{\"name\": \"a b\", \"arguments\": {}}</tool_call>",  // not a name
           "x <tool_call>{\"name\": \"f\", \"argu",                          // unterminated
       }) {
    ParsedToolCalls p = Parse(ToolCallFormat::kHermes, text);
    EXPECT_EQ(p.content, text);
    EXPECT_TRUE(p.calls.empty()) << text;
  }
}

TEST(ToolCalls, HermesTakesQwen3CoderXml) {
  const std::string text =
      "I'll run it.\n<tool_call>\n<function=run>\n<parameter=cmd>\nls -l\n  /tmp\n</parameter>\n"
      "<parameter=timeout>\n30\n</parameter>\n<parameter=env>null</parameter>\n</function>\n"
      "</tool_call>";
  ParsedToolCalls p = Parse(ToolCallFormat::kHermes, text);
  EXPECT_EQ(p.content, "I'll run it.\n");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].name, "run");
  EXPECT_EQ(p.calls[0].arguments, "{\"cmd\":\"ls -l\\n  /tmp\",\"timeout\":\"30\",\"env\":null}");
  ToolCallOptions options;
  options.arg_types["run"]["timeout"] = "integer";
  p = ParseToolCalls(ToolCallFormat::kHermes, text, options);
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].arguments, "{\"cmd\":\"ls -l\\n  /tmp\",\"timeout\":30,\"env\":null}");
  EXPECT_EQ(*ParseToolCallFormat("qwen3_coder"), ToolCallFormat::kHermes);
  const std::string bad = "<tool_call><function=run><parameter=cmd>ls</tool_call>";
  p = Parse(ToolCallFormat::kHermes, bad);
  EXPECT_EQ(p.content, bad);
  EXPECT_TRUE(p.calls.empty());
}

TEST(ToolCalls, MarkerPrefixIsHeldBackUntilKnown) {
  ToolCallStream s(ToolCallFormat::kHermes);
  EXPECT_EQ(s.Feed("Hi <tool_").content, "Hi ");
  EXPECT_EQ(s.Feed("box>").content, "<tool_box>");
  EXPECT_EQ(s.Feed(" <tool_ca").content, " ");
  ToolCallStreamDelta end = s.Finish();
  EXPECT_EQ(end.content, "<tool_ca");
  EXPECT_TRUE(end.tool_calls.empty());
}

TEST(ToolCalls, StreamReportsACallWhenItEnds) {
  ToolCallStream s(ToolCallFormat::kHermes, Seeded(7));
  ToolCallStreamDelta a = s.Feed("Sure.<tool_call>{\"name\": \"f\", \"arguments\": {\"x\"");
  EXPECT_EQ(a.content, "Sure.");
  EXPECT_TRUE(a.tool_calls.empty());
  ToolCallStreamDelta b = s.Feed(": 1}}</tool_call>");
  ASSERT_EQ(b.tool_calls.size(), 1u);
  EXPECT_EQ(b.tool_calls[0].index, 0u);
  EXPECT_EQ(b.tool_calls[0].name, "f");
  EXPECT_EQ(b.tool_calls[0].arguments, "{\"x\":1}");
  EXPECT_EQ(
      b.tool_calls[0].id,
      ParseToolCalls(ToolCallFormat::kHermes, "<tool_call>{\"name\": \"g\"}</tool_call>", Seeded(7))
          .calls[0]
          .id);
  EXPECT_NE(
      b.tool_calls[0].id,
      ParseToolCalls(ToolCallFormat::kHermes, "<tool_call>{\"name\": \"g\"}</tool_call>", Seeded(8))
          .calls[0]
          .id);
  EXPECT_TRUE(s.Finish().empty());
  EXPECT_EQ(s.calls(), 1u);
}

TEST(ToolCalls, MistralListForm) {
  const std::string text =
      "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, "
      "{\"name\": \"get_time\", \"arguments\": {\"tz\": \"[CET]\"}}]";
  ParsedToolCalls p = Parse(ToolCallFormat::kMistral, text);
  EXPECT_EQ(p.content, "");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[1].arguments, "{\"tz\":\"[CET]\"}");
  for (const ToolCall& c : p.calls) {
    EXPECT_EQ(c.id.size(), 9u);
    for (char ch : c.id) EXPECT_TRUE(isalnum(static_cast<unsigned char>(ch))) << c.id;
  }
}

TEST(ToolCalls, MistralNamedForms) {
  const std::string text =
      "Checking.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"}{\\\"\"}[TOOL_CALLS]get_time"
      "[CALL_ID]abc123XYZ[ARGS]{}[TOOL_CALLS]add{\"a\": 3.5, \"b\": [4]} Done.";
  ParsedToolCalls p = Parse(ToolCallFormat::kMistral, text);
  EXPECT_EQ(p.content, "Checking.Done.");
  ASSERT_EQ(p.calls.size(), 3u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, "{\"city\":\"}{\\\"\"}");
  EXPECT_EQ(p.calls[1].name, "get_time");
  EXPECT_EQ(p.calls[2].name, "add");
  EXPECT_EQ(p.calls[2].arguments, "{\"a\":3.5,\"b\":[4]}");
}

TEST(ToolCalls, MistralMalformed) {
  for (std::string text : {
           "[TOOL_CALLS]Sure, here it is.",
           "[TOOL_CALLS][{\"name\": 1, \"arguments\": {}}]",
           "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}",
           "[TOOL_CALLS][ARGS]{}",
           "[TOOL_CALLS]f[ARGS]nope",
           "[TOOL_CALLS]",
           "[TOOL_CA",
       }) {
    ParsedToolCalls p = Parse(ToolCallFormat::kMistral, text);
    EXPECT_EQ(p.content, text);
    EXPECT_TRUE(p.calls.empty()) << text;
  }
}

TEST(ToolCalls, DeepSeekV3) {
  const std::string text =
      "I'll check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
      "```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function"
      "<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  ParsedToolCalls p = Parse(ToolCallFormat::kDeepSeekV3, text);
  EXPECT_EQ(p.content, "I'll check.");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, "{\"city\":\"Paris\"}");
  EXPECT_EQ(p.calls[1].name, "get_time");
}

TEST(ToolCalls, DeepSeekV31) {
  const std::string text =
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}"
      "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
      "<｜tool▁calls▁end｜>";
  ParsedToolCalls p = Parse(ToolCallFormat::kDeepSeekV3, text);
  EXPECT_EQ(p.content, "");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[1].arguments, "{}");
}

TEST(ToolCalls, DeepSeekMalformedCallIsContentAndTheNextStands) {
  const std::string bad = "<｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops<｜tool▁call▁end｜>";
  const std::string text = "<｜tool▁calls▁begin｜>" + bad +
                           "<｜tool▁call▁begin｜>g<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
                           "<｜tool▁calls▁end｜>";
  ParsedToolCalls p = Parse(ToolCallFormat::kDeepSeekV3, text);
  EXPECT_EQ(p.content, bad);
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].name, "g");
  // Unterminated at the end: content.
  const std::string cut =
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Pa";
  p = Parse(ToolCallFormat::kDeepSeekV3, cut);
  EXPECT_EQ(p.content, "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Pa");
  EXPECT_TRUE(p.calls.empty());
}

TEST(ToolCalls, KimiK2) {
  const std::string text =
      "Let me look.<|tool_calls_section_begin|> <|tool_call_begin|> functions.get_weather:0 "
      "<|tool_call_argument_begin|> {\"city\": \"Paris\"} <|tool_call_end|> <|tool_call_begin|>"
      "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
      "<|tool_calls_section_end|>";
  ParsedToolCalls p = Parse(ToolCallFormat::kKimiK2, text);
  EXPECT_EQ(p.content, "Let me look.");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].id, "functions.get_weather:0");
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, "{\"city\":\"Paris\"}");
  EXPECT_EQ(p.calls[1].id, "functions.get_time:1");
  EXPECT_EQ(p.calls[1].name, "get_time");
}

TEST(ToolCalls, KimiK2Malformed) {
  const std::string bad =
      "<|tool_call_begin|>functions.get_weather<|tool_call_argument_begin|>{}<|tool_call_end|>";
  ParsedToolCalls p = Parse(ToolCallFormat::kKimiK2, "<|tool_calls_section_begin|>" + bad +
                                                         "<|tool_calls_section_end|>after");
  EXPECT_EQ(p.content, bad + "after");
  EXPECT_TRUE(p.calls.empty());
}

TEST(ToolCalls, Glm45) {
  const std::string text =
      "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
      "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts</arg_key>\n"
      "<arg_value>{\"unit\": \"c\"}</arg_value>\n</tool_call>\n<tool_call>list_files\n"
      "</tool_call>";
  ParsedToolCalls p = Parse(ToolCallFormat::kGlm45, text);
  EXPECT_EQ(p.content, "Checking.\n");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, "{\"city\":\"Paris\",\"days\":3,\"opts\":{\"unit\":\"c\"}}");
  EXPECT_EQ(p.calls[1].name, "list_files");
  EXPECT_EQ(p.calls[1].arguments, "{}");
  // A string-typed argument stays a string.
  ToolCallOptions options;
  options.arg_types["get_weather"]["days"] = "string";
  p = ParseToolCalls(ToolCallFormat::kGlm45, text, options);
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].arguments, "{\"city\":\"Paris\",\"days\":\"3\",\"opts\":{\"unit\":\"c\"}}");
  // Malformed: a key without a value.
  const std::string bad = "<tool_call>f\n<arg_key>a</arg_key>\n</tool_call>";
  p = Parse(ToolCallFormat::kGlm45, bad);
  EXPECT_EQ(p.content, bad);
  EXPECT_TRUE(p.calls.empty());
}

TEST(ToolCalls, GptOssCallsAndTheRestForHarmony) {
  const std::string text =
      "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
      "commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}"
      "<|call|>";
  ParsedToolCalls p = Parse(ToolCallFormat::kGptOss, text);
  EXPECT_EQ(p.content, "<|channel|>analysis<|message|>Need the weather.<|end|>");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, "{\"city\":\"Paris\"}");
  HarmonySplitter split;
  HarmonySplitter::Pieces a = split.Feed(p.content);
  HarmonySplitter::Pieces b = split.Finish();
  EXPECT_EQ(a.reasoning + b.reasoning, "Need the weather.");
  EXPECT_EQ(a.content + b.content, "");
}

TEST(ToolCalls, GptOssRecipientInTheRoleAndNoCallToken) {
  // The prompt ends in "<|start|>assistant"; <|call|> is a stop token, so it may be missing.
  ParsedToolCalls p =
      Parse(ToolCallFormat::kGptOss,
            " to=functions.lookup<|channel|>commentary json<|message|>{\"q\": \"x\"}");
  EXPECT_EQ(p.content, "");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].name, "lookup");
  // A final answer passes through verbatim; a call whose body is not JSON is content.
  const std::string text =
      "<|channel|>final<|message|>Hi.<|return|><|start|>assistant<|channel|>commentary "
      "to=functions.f<|message|>not json<|call|>";
  p = Parse(ToolCallFormat::kGptOss, text);
  EXPECT_EQ(p.content, text);
  EXPECT_TRUE(p.calls.empty());
}

TEST(ToolCalls, MiniMaxM2) {
  const std::string text =
      "Checking.\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">"
      "Paris</parameter>\n<parameter name=\"days\">3</parameter>\n</invoke>\n<invoke "
      "name=\"get_time\">\n</invoke>\n</minimax:tool_call>";
  ParsedToolCalls p = Parse(ToolCallFormat::kMiniMaxM2, text);
  EXPECT_EQ(p.content, "Checking.\n");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, "{\"city\":\"Paris\",\"days\":\"3\"}");
  EXPECT_EQ(p.calls[1].name, "get_time");
  EXPECT_EQ(p.calls[1].arguments, "{}");
  ToolCallOptions options;
  options.arg_types["get_weather"]["days"] = "integer";
  p = ParseToolCalls(ToolCallFormat::kMiniMaxM2, text, options);
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].arguments, "{\"city\":\"Paris\",\"days\":3}");
}

TEST(ToolCalls, InvalidUtf8IsReplaced) {
  const std::string text = "caf\xC3\xA9 \xFF<tool_call>{\"name\": \"f\"}</tool_call>\xE2\x82";
  ParsedToolCalls p = Parse(ToolCallFormat::kHermes, text);
  EXPECT_EQ(p.content, "caf\xC3\xA9 \xEF\xBF\xBD\xEF\xBF\xBD");
  ASSERT_EQ(p.calls.size(), 1u);
  p = Parse(ToolCallFormat::kHermes, "<tool_call>{\"name\": \"f\xFF\"}</tool_call>");
  EXPECT_TRUE(p.calls.empty());
}

TEST(ToolCalls, Bounds) {
  std::string many;
  for (size_t i = 0; i <= ToolCallStream::kMaxCalls; ++i) {
    many += "<tool_call>{\"name\": \"f\"}</tool_call>";
  }
  ParsedToolCalls p = ParseToolCalls(ToolCallFormat::kHermes, many);
  EXPECT_EQ(p.calls.size(), ToolCallStream::kMaxCalls);
  EXPECT_EQ(p.content, "<tool_call>{\"name\": \"f\"}</tool_call>");

  const std::string big = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"" +
                          std::string(ToolCallStream::kMaxCallBytes, 'x') + "\"}}</tool_call>";
  p = ParseToolCalls(ToolCallFormat::kHermes, big);
  EXPECT_TRUE(p.calls.empty());
  EXPECT_EQ(p.content, big);
  ToolCallStream s(ToolCallFormat::kHermes);
  std::string streamed;
  for (size_t at = 0; at < big.size(); at += 4096) streamed += s.Feed(big.substr(at, 4096)).content;
  streamed += s.Finish().content;
  EXPECT_EQ(streamed, big);

  const std::string deep =
      "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": " + std::string(10000, '[') +
      std::string(10000, ']') + "}}</tool_call>";
  p = ParseToolCalls(ToolCallFormat::kHermes, deep);
  EXPECT_TRUE(p.calls.empty());
  EXPECT_EQ(p.content, deep);
}

TEST(ToolCalls, LongHeadersAreNotCalls) {
  // Harmony's <|message|> and Mistral's arguments must start within 512 bytes of the header.
  for (size_t pad : {size_t{450}, size_t{530}}) {
    const std::string harmony =
        "<|channel|>commentary to=functions.f" + std::string(pad, ' ') + "<|message|>{}<|call|>";
    ParsedToolCalls p = Parse(ToolCallFormat::kGptOss, harmony);
    EXPECT_EQ(p.calls.size(), pad < 512 ? 1u : 0u);
    EXPECT_EQ(p.content, pad < 512 ? "" : harmony);
    const std::string mistral = "[TOOL_CALLS]" + std::string(pad, ' ') + "f[ARGS]{}";
    p = Parse(ToolCallFormat::kMistral, mistral);
    EXPECT_EQ(p.calls.size(), pad < 512 ? 1u : 0u);
    EXPECT_EQ(p.content, pad < 512 ? "" : mistral);
  }
}

// tool_choice required / named: the whole answer is JSON (decoded under a schema), held back
// until Finish and parsed into calls; anything else stays content, verbatim.
TEST(ToolCallStream, ForcedAnswersAreParsedAtFinish) {
  auto run = [](ToolCallOptions::Forced forced, std::string_view text) {
    ToolCallOptions options;
    options.forced = forced;
    options.forced_name = "get_weather";
    ToolCallStream stream(ToolCallFormat::kHermes, options);
    EXPECT_TRUE(stream.Feed(text.substr(0, text.size() / 2)).empty());
    EXPECT_TRUE(stream.Feed(text.substr(text.size() / 2)).empty());
    return stream.Finish();
  };
  using F = ToolCallOptions::Forced;
  ToolCallStreamDelta d = run(F::kNamed, R"({"city": "Paris"})");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_EQ(d.tool_calls[0].name, "get_weather");
  EXPECT_EQ(d.tool_calls[0].arguments, R"({"city":"Paris"})");
  EXPECT_EQ(d.tool_calls[0].id.substr(0, 5), "call_");
  EXPECT_TRUE(d.content.empty());
  d = run(F::kList, R"([{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"x": 1}}])");
  ASSERT_EQ(d.tool_calls.size(), 2u);
  EXPECT_EQ(d.tool_calls[1].index, 1u);
  EXPECT_EQ(d.tool_calls[1].name, "b");
  EXPECT_EQ(d.tool_calls[1].arguments, R"({"x":1})");
  for (auto [forced, text] : std::vector<std::pair<F, std::string>>{
           {F::kNamed, R"({"city": "Par)"},  // Cut by max_tokens.
           {F::kNamed, "[1]"},
           {F::kList, R"([{"name": "a"}])"},
           {F::kList, R"([{"name": "", "parameters": {}}])"},
           {F::kList, "[]"},
           {F::kList, "\xff{"}}) {
    d = run(forced, text);
    EXPECT_TRUE(d.tool_calls.empty()) << text;
    EXPECT_EQ(d.content, ToValidUtf8(text)) << text;
  }
}

}  // namespace
}  // namespace fmoe
