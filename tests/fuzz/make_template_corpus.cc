// Writes the seed corpus of chat_template_fuzz into the directory named on the command line: the
// template of every fixture in tests/fixtures/chat_templates (the families' real templates and
// the renderer's own cases), each one as it is and cut in half (a truncated template must fail
// cleanly). Each template must compile: exits 1 if a fixture's does not, or if none is found.
// Usage: make_template_corpus DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "common/json.h"
#include "common/text/chat_template.h"

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_template_corpus DIR\n");
    return 2;
  }
  const fs::path out = argv[1];
  fs::create_directories(out);
  const fs::path fixtures = fs::path(FMOE_SOURCE_DIR) / "tests/fixtures/chat_templates";
  int written = 0;
  for (const auto& entry : fs::directory_iterator(fixtures)) {
    if (entry.path().extension() != ".json") continue;
    std::ifstream in(entry.path());
    std::stringstream ss;
    ss << in.rdbuf();
    const nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, false);
    if (j.is_discarded() || !j.contains("template") || !j["template"].is_string()) continue;
    const std::string source = j["template"].get<std::string>();
    if (!fmoe::ChatTemplate::Compile(source).ok()) {
      std::fprintf(stderr, "%s: the template does not compile\n", entry.path().c_str());
      return 1;
    }
    const std::string stem = entry.path().stem().string();
    std::ofstream(out / (stem + ".jinja"), std::ios::binary) << source;
    std::ofstream(out / (stem + "-half.jinja"), std::ios::binary)
        << source.substr(0, source.size() / 2);
    written += 2;
  }
  if (written == 0) {
    std::fprintf(stderr, "no templates under %s\n", fixtures.c_str());
    return 1;
  }
  std::printf("%d seeds in %s\n", written, out.c_str());
  return 0;
}
