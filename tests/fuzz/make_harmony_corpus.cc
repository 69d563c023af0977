// Writes the seed corpus of harmony_fuzz into the directory named on the command line: gpt-oss
// answers as the model writes them (analysis then final, commentary to a tool with <|constrain|>,
// cut short, without headers, markers split and look-alikes), each behind a cutting seed byte.
// Usage: make_harmony_corpus DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_harmony_corpus DIR\n");
    return 2;
  }
  const fs::path out = argv[1];
  fs::create_directories(out);
  const std::vector<std::string> seeds = {
      "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>"
      "Answer.<|return|>",
      "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\":1}<|call|>",
      "<|channel|>analysis<|message|>cut short<|en",
      "plain text without any header at all",
      "<|channel|>final<|message|>a <|b <|en|> <|endx|> c<|end|>",
      "<|channel|>analysis<|message|>r<|start|>assistant<|channel|>final<|message|>c",
      "<|start|><|start|><|channel|><|message|><|end|><|return|><|call|><|constrain|>",
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
