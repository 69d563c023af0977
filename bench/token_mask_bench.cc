// Micro-benchmarks of structured output's token mask (common/text/token_mask.h): one step's
// allowed set (TokenMasker::Fill) in the states a JSON answer passes through, over the tiny
// model's vocabulary (deploy/models/tiny-moe, 4,096 tokens) and a synthetic byte-level vocabulary
// of 150,000 tokens shaped like a large BPE one (every byte, then words with and without a
// leading space, capitalised, digit runs, punctuation and JSON pieces, whitespace runs, CJK).
// Run: build/bench/token_mask_bench [--benchmark_filter=Synthetic]
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "common/text/grammar.h"
#include "common/text/json_schema.h"
#include "common/text/token_mask.h"
#include "common/text/tokenizer.h"

namespace fmoe {
namespace {

std::shared_ptr<const TokenVocab> Synthetic(size_t n) {
  std::mt19937_64 rng(42);
  std::set<std::string> seen;
  std::vector<std::string> tokens;
  auto add = [&](std::string t) {
    if (!t.empty() && seen.insert(t).second) tokens.push_back(std::move(t));
  };
  for (int b = 0; b < 256; ++b) add(std::string(1, static_cast<char>(b)));
  for (const char* t : {"{\"", "\":", "\",", "\"}", " \"", "\":\"", "\", \"", "\": ", "},", "}]",
                        "[{", "\n", "\n  ", "\n    ", "  ", "    ", "true", "false", "null"}) {
    add(t);
  }
  const std::string letters = "etaoinshrdlcumwfgypbvkjxqz";
  while (tokens.size() < n) {
    const int kind = static_cast<int>(rng() % 10);
    std::string t;
    if (kind < 7) {  // A word piece, maybe with a leading space or a capital.
      const size_t len = 2 + rng() % 9;
      for (size_t i = 0; i < len; ++i) t += letters[std::min<size_t>(rng() % 26, rng() % 26)];
      if (rng() % 2) t[0] = static_cast<char>(t[0] - 'a' + 'A');
      if (rng() % 2) t = " " + t;
    } else if (kind == 7) {  // Digits.
      for (size_t i = 0, len = 1 + rng() % 3; i < len; ++i)
        t += static_cast<char>('0' + rng() % 10);
    } else if (kind == 8) {  // Punctuation runs.
      const std::string p = ".,;:!?'\"()[]{}-_/\\*#@ ";
      for (size_t i = 0, len = 2 + rng() % 3; i < len; ++i) t += p[rng() % p.size()];
    } else {  // A CJK character or two (3 UTF-8 bytes each).
      for (size_t i = 0, len = 1 + rng() % 2; i < len; ++i) {
        const uint32_t cp = 0x4E00 + rng() % 0x5000;
        t += static_cast<char>(0xE0 | (cp >> 12));
        t += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        t += static_cast<char>(0x80 | (cp & 0x3F));
      }
    }
    add(std::move(t));
  }
  std::vector<bool> special(tokens.size(), false);
  return std::make_shared<const TokenVocab>(std::move(tokens), std::move(special));
}

const std::shared_ptr<const TokenVocab>& TinyVocab() {
  static const std::shared_ptr<const TokenVocab> vocab = [] {
    auto tok = Tokenizer::Load(FMOE_SOURCE_DIR "/deploy/models/tiny-moe");
    return tok.ok() ? TokenVocab::FromTokenizer(**tok) : nullptr;
  }();
  return vocab;
}

const std::shared_ptr<const TokenVocab>& SyntheticVocab() {
  static const std::shared_ptr<const TokenVocab> vocab = Synthetic(150000);
  return vocab;
}

// The states: before the answer, in a key, inside a free string value, after a value, in a
// number.
const char* const kPrefixes[] = {"", "{\"na", "{\"name\": \"Ann Smi", "{\"name\": \"Ann\"",
                                 "{\"name\": \"Ann\", \"age\": 4"};

// response_format json_object (any object): in a free key, in a string value, in a number.
const char* const kObjectPrefixes[] = {"{\"ke", "{\"k\": \"va", "{\"k\": [1, {\"x\": 12"};

// Grammars (guided_regex, guided_choice, guided_grammar, a structural tag) and a prefix each: free
// text of a class, one of 500 choices, a list grammar inside a number, a structural tag's free
// text (two triggers, after a partial one) and inside its structure's JSON.
std::shared_ptr<const JsonGrammar> GuidedGrammar(int64_t which, const char** prefix) {
  static const auto regex = *CompileRegex("[a-zA-Z ,.]{0,200}");
  static const auto choice = [] {
    std::vector<std::string> items;
    for (int i = 0; i < 500; ++i) items.push_back("item-" + std::to_string(i));
    return *CompileChoice(items);
  }();
  static const auto list = *CompileGrammar(
      "root ::= \"[\" item (\", \" item)* \"]\"\nitem ::= [0-9]+ | \"\\\"\" [a-z]* \"\\\"\"");
  static const auto tag = *CompileStructuralTag(R"({"triggers": ["<function=", "<tool>"],
      "structures": [
        {"begin": "<function=get_weather>", "end": "</function>", "schema": {"type": "object",
          "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}},
        {"begin": "<tool>", "end": "</tool>", "schema": {"type": "object",
          "properties": {"name": {"type": "string"}}, "required": ["name"]}}]})");
  switch (which) {
    case 0:
      *prefix = "Some words, ";
      return regex;
    case 1:
      *prefix = "item-1";
      return choice;
    case 3:
      *prefix = "Let me look that up. <func";
      return tag;
    case 4:
      *prefix = "Sure. <function=get_weather>{\"city\": \"Par";
      return tag;
    default:
      *prefix = "[12, 3";
      return list;
  }
}

void Mask(benchmark::State& state, const std::shared_ptr<const TokenVocab>& vocab,
          bool any_object = false, bool guided = false) {
  if (vocab == nullptr) {
    state.SkipWithError("no vocabulary");
    return;
  }
  static const auto schema = *CompileJsonSchema(R"({"type": "object",
      "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                     "tags": {"type": "array", "items": {"type": "string"}}},
      "required": ["name", "age"]})");
  auto grammar = any_object ? AnyJsonObjectGrammar() : schema;
  const char* prefix = any_object ? kObjectPrefixes[state.range(0)] : kPrefixes[state.range(0)];
  if (guided) grammar = GuidedGrammar(state.range(0), &prefix);
  // Feeds the prefix byte by byte through single-byte tokens (every vocabulary has them).
  std::vector<int32_t> byte_token(256, -1);
  for (size_t id = 0; id < vocab->size(); ++id) {
    const std::string& b = vocab->bytes(static_cast<int32_t>(id));
    if (b.size() == 1 && byte_token[static_cast<uint8_t>(b[0])] < 0) {
      byte_token[static_cast<uint8_t>(b[0])] = static_cast<int32_t>(id);
    }
  }
  TokenMasker masker(grammar, vocab, {}, /*remember=*/0);  // The walk's cost, every time.
  for (char c : std::string(prefix)) {
    if (!masker.Accept(byte_token[static_cast<uint8_t>(c)])) {
      state.SkipWithError("prefix refused");
      return;
    }
  }
  std::vector<uint8_t> allowed;
  size_t count = 0;
  for (auto _ : state) {
    count = masker.Fill(vocab->size(), &allowed);
    benchmark::DoNotOptimize(allowed.data());
  }
  state.counters["allowed"] = static_cast<double>(count);
  state.counters["vocab"] = static_cast<double>(vocab->size());
  state.counters["trie_nodes"] = static_cast<double>(vocab->nodes().size());
}

void BM_TinyModel(benchmark::State& state) { Mask(state, TinyVocab()); }
BENCHMARK(BM_TinyModel)->DenseRange(0, 4)->Unit(benchmark::kMicrosecond);

void BM_Synthetic150k(benchmark::State& state) { Mask(state, SyntheticVocab()); }
BENCHMARK(BM_Synthetic150k)->DenseRange(0, 4)->Unit(benchmark::kMicrosecond);

// Building the vocabulary's trie and string scans (once per tokenizer, when the engine starts).
void BM_BuildVocab150k(benchmark::State& state) {
  std::vector<std::string> bytes;
  for (size_t id = 0; id < SyntheticVocab()->size(); ++id) {
    bytes.push_back(SyntheticVocab()->bytes(static_cast<int32_t>(id)));
  }
  for (auto _ : state) {
    TokenVocab vocab(bytes, std::vector<bool>(bytes.size(), false));
    benchmark::DoNotOptimize(vocab.nodes().data());
  }
}
BENCHMARK(BM_BuildVocab150k)->Iterations(3)->Unit(benchmark::kMillisecond);

void BM_Synthetic150kJsonObject(benchmark::State& state) { Mask(state, SyntheticVocab(), true); }
BENCHMARK(BM_Synthetic150kJsonObject)->DenseRange(0, 2)->Unit(benchmark::kMicrosecond);

void BM_TinyModelGuided(benchmark::State& state) {
  Mask(state, TinyVocab(), false, /*guided=*/true);
}
BENCHMARK(BM_TinyModelGuided)->DenseRange(0, 4)->Unit(benchmark::kMicrosecond);

void BM_Synthetic150kGuided(benchmark::State& state) {
  Mask(state, SyntheticVocab(), false, /*guided=*/true);
}
BENCHMARK(BM_Synthetic150kGuided)->DenseRange(0, 4)->Unit(benchmark::kMicrosecond);

// Decoding steps of free text (a draw, then the next mask), without (0) and with (1) the masks
// remembered by state: the regex's class (case 0 of GuidedGrammar) and the structural tag's
// free text (case 3's grammar after "Let me look that up. "). The text drawn cycles through
// single-byte tokens of letters and spaces, so the state after each is free text again.
void FreeTextSteps(benchmark::State& state, bool tag) {
  const std::shared_ptr<const TokenVocab>& vocab = SyntheticVocab();
  const char* prefix = nullptr;
  auto grammar = GuidedGrammar(tag ? 3 : 0, &prefix);
  std::vector<int32_t> byte_token(256, -1);
  for (size_t id = 0; id < vocab->size(); ++id) {
    const std::string& b = vocab->bytes(static_cast<int32_t>(id));
    if (b.size() == 1 && byte_token[static_cast<uint8_t>(b[0])] < 0) {
      byte_token[static_cast<uint8_t>(b[0])] = static_cast<int32_t>(id);
    }
  }
  const size_t remember = state.range(0) == 0 ? 0 : TokenMasker::kRememberedMasks;
  TokenMasker masker(grammar, vocab, {}, remember);
  for (char c : std::string("Let me look that up. ")) {
    if (!masker.Accept(byte_token[static_cast<uint8_t>(c)])) {
      state.SkipWithError("prefix refused");
      return;
    }
  }
  const std::string text = "some words and more words ";
  std::vector<uint8_t> allowed;
  size_t i = 0;
  uint64_t steps = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(masker.Fill(vocab->size(), &allowed));
    // The regex allows 200 characters: start again before its end.
    if (!tag && ++steps % 150 == 0) {
      state.PauseTiming();
      masker = TokenMasker(grammar, vocab, {}, remember);
      state.ResumeTiming();
    }
    if (!masker.Accept(byte_token[static_cast<uint8_t>(text[i++ % text.size()])])) {
      state.SkipWithError("a free-text token was refused");
      return;
    }
  }
  state.counters["remembered"] = static_cast<double>(masker.remembered());
}
void BM_Synthetic150kFreeTextSteps(benchmark::State& state) { FreeTextSteps(state, false); }
BENCHMARK(BM_Synthetic150kFreeTextSteps)->DenseRange(0, 1)->Unit(benchmark::kMicrosecond);
void BM_Synthetic150kTagFreeTextSteps(benchmark::State& state) { FreeTextSteps(state, true); }
BENCHMARK(BM_Synthetic150kTagFreeTextSteps)->DenseRange(0, 1)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace fmoe
