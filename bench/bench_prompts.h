// Prompts for the end-to-end benchmarks: the "prompt" field of each line of a JSONL file (the
// files in ../shared/data/prompts), each cut to `max_bytes`, then `fallbacks` in turn until
// there are `want` of them (no file, or too few lines).
#pragma once

#include <fstream>
#include <string>
#include <vector>

#include "common/json.h"

namespace fmoe::bench {

// Eight short prompts of different kinds, for when no prompts file is given.
inline const std::vector<std::string> kFallbackPrompts = {
    "The history of the city begins with a small settlement on the river",
    "In the beginning God created the heaven and the earth.",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "The theorem states that for every prime number p",
    "She opened the door and saw the garden covered in snow.",
    "Water boils at a lower temperature on a mountain because",
    "The committee published its report on the new railway line",
    "Abstract. We study the problem of learning sparse mixtures"};

inline std::vector<std::string> ReadPrompts(const std::string& path, size_t want,
                                            const std::vector<std::string>& fallbacks,
                                            size_t max_bytes = std::string::npos) {
  std::vector<std::string> prompts;
  std::ifstream in(path);
  std::string line;
  while (prompts.size() < want && std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("prompt") && j["prompt"].is_string()) {
      std::string p = j["prompt"].get<std::string>();
      if (p.size() > max_bytes) p.resize(max_bytes);
      prompts.push_back(std::move(p));
    }
  }
  for (size_t i = 0; prompts.size() < want && !fallbacks.empty(); ++i) {
    prompts.push_back(fallbacks[i % fallbacks.size()]);
  }
  return prompts;
}

}  // namespace fmoe::bench
