// Writes the seed corpus of tiktoken_fuzz into the directory named on the command line: the
// Kimi-style fixture's tiktoken.model (tests/fixtures/tokenizers/kimi) behind each of the four
// config bytes, the 256 single bytes alone, the fixture with CRLF line ends and empty lines, and
// malformed variants (no space, bad base64, bad rank, a duplicate token and rank, a gap, a
// missing byte). Each seed is loaded first, as tiktoken_fuzz does, and must load or fail as
// listed; exits 1 if one does not. Usage: make_tiktoken_corpus DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "common/text/tiktoken_tokenizer.h"

namespace fmoe {
namespace {

struct Seed {
  std::string name;
  char mode;  // The config byte (see tiktoken_fuzz.cc).
  std::string file;
  bool loads;
};

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string Join(const std::vector<std::string>& lines, const std::string& end = "\n") {
  std::string out;
  for (const std::string& l : lines) out += l + end;
  return out;
}

std::vector<Seed> Seeds(const std::string& fixture) {
  const std::vector<std::string> lines = Lines(fixture);
  const std::vector<std::string> bytes(lines.begin(), lines.begin() + 256);
  auto with = [&](size_t index, const std::string& line) {
    std::vector<std::string> l = lines;
    l[index] = line;
    return Join(l);
  };
  std::vector<std::string> spaced = lines;
  spaced.insert(spaced.begin() + 300, "");
  std::vector<std::string> no_newline = lines;
  no_newline.erase(no_newline.begin() + 10);
  for (size_t i = 10; i < no_newline.size(); ++i) {
    no_newline[i] = no_newline[i].substr(0, no_newline[i].find(' ')) + " " + std::to_string(i);
  }
  return {
      {"fixture-plain", 0, fixture, true},
      {"fixture-kimi", 1, fixture, true},
      {"fixture-collide", 2, fixture, false},
      {"fixture-prefixes", 3, fixture, true},
      {"bytes-only", 1, Join(bytes), true},
      {"crlf-and-empty-lines", 0, Join(spaced, "\r\n"), true},
      {"no-space", 0, with(299, "ZWw=299"), false},
      {"bad-base64", 0, with(299, "ZW*= 299"), false},
      {"bad-rank", 0, with(299, "ZWw= -299"), false},
      {"duplicate-token", 0, with(299, "IA== 299"), false},
      {"duplicate-rank", 0, with(299, "ZWw= 12"), false},
      {"gap", 0, with(299, "ZWw= 531"), false},
      {"missing-byte", 0, Join(no_newline), false},
  };
}

int Main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_tiktoken_corpus DIR\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    std::fprintf(stderr, "make_tiktoken_corpus: %s: %s\n", dir.c_str(), ec.message().c_str());
    return 1;
  }
  const char* fixture_path = FMOE_SOURCE_DIR "/tests/fixtures/tokenizers/kimi/tiktoken.model";
  std::ifstream in(fixture_path, std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  if (!in || buf.str().empty()) {
    std::fprintf(stderr, "make_tiktoken_corpus: %s: cannot read\n", fixture_path);
    return 1;
  }
  const std::vector<Seed> seeds = Seeds(buf.str());
  for (const Seed& seed : seeds) {
    // The config tiktoken_fuzz builds for mode 1 and 3 names ids from N on; none collides with
    // a rank, so the seeds load or fail on the file alone (and mode 2 always fails).
    TokenizerConfig config;
    if (seed.mode == 2) config.added_tokens.push_back({0, "[X]", true});
    auto tok = TiktokenTokenizer::Create(seed.file, "/fuzz/tiktoken.model", config);
    if (tok.ok() != seed.loads) {
      std::fprintf(stderr, "make_tiktoken_corpus: seed %s %s: %s\n", seed.name.c_str(),
                   seed.loads ? "does not load" : "loads",
                   tok.ok() ? "ok" : tok.status().ToString().c_str());
      return 1;
    }
    const std::filesystem::path path = dir / seed.name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.put(seed.mode);
    out.write(seed.file.data(), static_cast<std::streamsize>(seed.file.size()));
    if (!out.flush()) {
      std::fprintf(stderr, "make_tiktoken_corpus: %s: write failed\n", path.c_str());
      return 1;
    }
  }
  std::printf("make_tiktoken_corpus: %zu files in %s\n", seeds.size(), dir.c_str());
  return 0;
}

}  // namespace
}  // namespace fmoe

int main(int argc, char** argv) { return fmoe::Main(argc, argv); }
