// Writes the seed corpus of tool_calls_fuzz into the directory named on the command line: each
// format's calls as the models write them (several, with content around, malformed, cut short,
// markers split and look-alikes), each behind a cutting seed byte. tool_calls_fuzz runs every
// input through every format.
// Usage: make_tool_calls_corpus DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_tool_calls_corpus DIR\n");
    return 2;
  }
  const fs::path out = argv[1];
  fs::create_directories(out);
  // Headers about as long as the parsers take (512 bytes before <|message|> or the arguments).
  const std::string pad(510, ' ');
  const std::vector<std::string> seeds = {
      "<|start|>assistant" + pad + "<|channel|>commentary to=functions.f<|message|>{}<|call|>",
      "[TOOL_CALLS]" + pad + "f[ARGS]{}[TOOL_CALLS]" + pad + "   [{\"name\": \"f\"}]",
      // hermes
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": \"{}\"}\n"
      "</tool_call>",
      "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": [1, {\"b\": null}]}}",
      "a <tool_ca <tool_call>{bad</tool_call> <tool_call>",
      "<tool_call>\n<function=run>\n<parameter=cmd>\nls\n</parameter>\n<parameter=n>3\n"
      "</function>\n</tool_call>",
      // mistral
      "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"a\": \"]\"}}, {\"name\": \"g\", "
      "\"arguments\": {}}]",
      "Ok.[TOOL_CALLS]f[ARGS]{\"a\": 1}[TOOL_CALLS]g[CALL_ID]abc123xyz[ARGS]{}[TOOL_CALLS]h{}",
      "[TOOL_CALLS]Sure [TOOL_CALLS][ARGS]{} [TOOL_CA",
      // deepseek_v3 and V3.1
      "Hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
      "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
      "g\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜>"
      "<｜tool▁call▁begin｜>g<｜tool▁sep｜>{oops<｜tool▁call▁end｜><｜tool▁calls▁end｜>after",
      // kimi_k2
      "x<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
      "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_call_begin|>"
      "functions.f:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
      // glm45
      "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>"
      "\n<arg_key>n</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>\n<tool_call>f"
      "</tool_call>",
      // gpt_oss
      "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary "
      "to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>",
      " to=functions.f<|channel|>commentary json<|message|>{\"q\": 1}",
      "<|channel|>final<|message|>Hi<|return|><|start|>assistant to=functions.g<|channel|>"
      "commentary<|message|>nope<|call|>",
      // minimax_m2
      "Ok.\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris"
      "</parameter>\n<parameter name=\"n\">3</parameter>\n</invoke>\n<invoke name=\"f\">"
      "</invoke>\n</minimax:tool_call>",
      // none of them
      "plain text \xFF\xE2\x82 with [brackets] {\"json\": 1} and <tags>",
  };
  int n = 0;
  for (const std::string& s : seeds) {
    for (char cut : {'\x01', '\x7f'}) {
      std::ofstream(out / ("seed-" + std::to_string(n++)), std::ios::binary) << cut << s;
    }
  }
  std::printf("%d seeds in %s\n", n, out.c_str());
  return 0;
}
