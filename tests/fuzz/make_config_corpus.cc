// Seeds for model_config_fuzz: every config.json in the source tree's fixtures and shipped model
// (each family, each quantized format), and each with its quantization_config replaced by every
// case of tests/fixtures/quant-kernels/cases.json. Usage: make_config_corpus DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/json.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const fs::path root = FMOE_SOURCE_DIR;
  std::vector<std::string> configs;
  for (const fs::path& dir : {root / "tests/fixtures", root / "deploy/models"}) {
    for (const auto& entry : fs::directory_iterator(dir)) {
      const fs::path config = entry.path() / "config.json";
      if (!fs::exists(config)) continue;
      std::ifstream in(config);
      std::stringstream text;
      text << in.rdbuf();
      configs.push_back(text.str());
    }
  }
  std::ifstream cases_in(root / "tests/fixtures/quant-kernels/cases.json");
  const nlohmann::json cases = nlohmann::json::parse(cases_in, nullptr, false);
  std::vector<std::string> seeds = configs;
  for (const std::string& c : configs) {
    nlohmann::json j = nlohmann::json::parse(c, nullptr, false);
    if (j.is_discarded() || !cases.is_array()) continue;
    for (const nlohmann::json& k : cases) {
      j["quantization_config"] = k["quantization_config"];
      seeds.push_back(j.dump());
    }
  }
  if (seeds.size() < 10) {
    std::fprintf(stderr, "make_config_corpus: only %zu seeds under %s\n", seeds.size(),
                 root.c_str());
    return 1;
  }
  for (size_t i = 0; i < seeds.size(); ++i) {
    std::ofstream out(std::string(argv[1]) + "/seed-" + std::to_string(i), std::ios::binary);
    out << seeds[i];
    if (!out) return 1;
  }
  return 0;
}
