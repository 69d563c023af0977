// Writes the seed corpus of think_fuzz into the directory named on the command line: reasoning
// models' answers as they write them (DeepSeek-R1 from inside the thinking, Qwen3 opening it,
// thinking off, cut short, markers split, repeated and look-alikes, ill-formed UTF-8), each behind
// a first byte that picks the style and the cutting seed.
// Usage: make_think_corpus DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_think_corpus DIR\n");
    return 2;
  }
  const fs::path out = argv[1];
  fs::create_directories(out);
  const std::vector<std::string> seeds = {
      "Okay, 2+2.\nThat is 4.\n</think>\n\nThe answer is **4**.",
      "<think>\nThe user greets me.\n</think>\n\nHello!",
      "Paris is the capital of France.",
      "<think>\nStill thinking when the tokens ran out <",
      "<thin <think x</thinkx></th</think>after <think>again</think>",
      "<think><think></think></think><think>",
      "\xFF\xC3<think>\xE2\x82</think>\x80\xED\xA0\x80",
  };
  int n = 0;
  for (const std::string& s : seeds) {
    for (char first : {'\x00', '\x01', '\x7e', '\x7f'}) {
      std::ofstream(out / ("seed-" + std::to_string(n++)), std::ios::binary) << first << s;
    }
  }
  std::printf("%d seeds in %s\n", n, out.c_str());
  return 0;
}
