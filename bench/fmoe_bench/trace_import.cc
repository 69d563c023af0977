// fmoe-bench import-trace: converts routing recorded by other systems into our trace format
// (common/model/expert_trace.h), so the replay runs every policy on real routing.
//   deepseek-jsonl: {"id", "model", "num_layers", "num_experts", "top_k", "prompt", "tokens": [T],
//     "experts": [T][L][K]} per prompt (prefill routing, expert ids only). One iteration per
//     prompt token position; the map is derived from the ids (1/K on each picked expert).
//   mixtral-vllm: {"dataset", "problem_id", "layer", "token_pos" | "token_idx", "experts": [K],
//     "gating_probs": [K]} per (layer, token), from one or more files. One request per (dataset,
//     problem_id), one iteration per token position; the map is the given top-K weights. The
//     files do not say which phase they hold: --phase does (the header's iteration_unit then
//     starts "prefill token position" or "decode token position", which the replay reads).
// Semantic embeddings come from a model's input embedding layer (--embed-model, by default the
// shipped tiny model): the mean of the rows of the prompt's tokens for the first position, the
// mean of the rows of the position's own token text after it (DESIGN section 4's definition,
// with each position standing for one iteration). The mixtral traces carry no text: no
// embeddings (hidden 0).
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench/fmoe_bench/commands.h"
#include "common/json.h"
#include "common/model/expert_trace.h"
#include "common/model/safetensors.h"
#include "common/text/tokenizer.h"
#include "common/text/unicode.h"

namespace fmoe::bench {
namespace {

// Reads lines from a plain or gzip-compressed file (zlib reads both).
class LineReader {
 public:
  static Result<LineReader> Open(const std::string& path) {
    if (!std::filesystem::exists(path)) return NotFound(path + ": no such file");
    gzFile f = gzopen(path.c_str(), "rb");
    if (f == nullptr) return IoError(path + ": cannot open");
    gzbuffer(f, 1 << 20);
    return LineReader(f);
  }
  LineReader(LineReader&& o) noexcept : f_(std::exchange(o.f_, nullptr)) {}
  LineReader(const LineReader&) = delete;
  ~LineReader() {
    if (f_ != nullptr) gzclose(f_);
  }
  // False at the end of the file; kDataLoss for a read error (a corrupt gzip stream).
  Result<bool> Next(std::string* line) {
    line->clear();
    char buf[1 << 16];
    while (true) {
      if (gzgets(f_, buf, sizeof(buf)) == nullptr) {
        int err = 0;
        const char* msg = gzerror(f_, &err);
        if (err != Z_OK && err != Z_BUF_ERROR) return DataLoss(std::string("read failed: ") + msg);
        return !line->empty();
      }
      line->append(buf);
      if (!line->empty() && line->back() == '\n') {
        line->pop_back();
        return true;
      }
    }
  }

 private:
  explicit LineReader(gzFile f) : f_(f) {}
  gzFile f_;
};

// Mean input-embedding rows of a text's tokens.
class Embedder {
 public:
  static Result<Embedder> Load(const std::string& dir) {
    Embedder e;
    FMOE_ASSIGN_OR_RETURN(e.tokenizer_, Tokenizer::Load(dir));
    const std::string path = dir + "/model.safetensors";
    FMOE_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
    const TensorView* t = file->Find("model.embed_tokens.weight");
    if (t == nullptr || t->shape.size() != 2) {
      return InvalidArgument(path + ": no 2-d tensor model.embed_tokens.weight");
    }
    e.vocab_ = static_cast<size_t>(t->shape[0]);
    e.hidden_ = static_cast<uint32_t>(t->shape[1]);
    e.table_.resize(e.vocab_ * e.hidden_);
    FMOE_RETURN_IF_ERROR(ConvertToF32(t->dtype, t->data, e.table_).WithContext(path));
    e.name_ = std::filesystem::path(dir).filename().string();
    return e;
  }
  uint32_t hidden() const { return hidden_; }
  const std::string& name() const { return name_; }
  // nullopt when the text has no token.
  std::optional<std::vector<float>> Mean(std::string_view text) const {
    auto ids = tokenizer_->Encode(text, /*add_special_tokens=*/false);
    if (!ids.ok() || ids->empty()) return std::nullopt;
    std::vector<float> out(hidden_, 0.0f);
    size_t n = 0;
    for (int32_t id : *ids) {
      if (id < 0 || static_cast<size_t>(id) >= vocab_) continue;
      const float* row = table_.data() + static_cast<size_t>(id) * hidden_;
      for (uint32_t i = 0; i < hidden_; ++i) out[i] += row[i];
      ++n;
    }
    if (n == 0) return std::nullopt;
    for (float& v : out) v /= static_cast<float>(n);
    return out;
  }

 private:
  Embedder() = default;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::vector<float> table_;
  size_t vocab_ = 0;
  uint32_t hidden_ = 0;
  std::string name_;
};

struct ImportOptions {
  std::string format;
  std::vector<std::string> inputs;
  std::string phase;  // mixtral-vllm: prefill or decode.
  std::string out;
  std::string embed_model;
  uint32_t skip = 0;
  uint32_t limit = 0;  // 0 = all.
};

// Routing of one position: K distinct ids per layer into `it` (used_*, one token).
Status SetRouting(const nlohmann::json& layers, const TraceHeader& h, TraceIteration* it) {
  if (!layers.is_array() || layers.size() != h.num_layers) {
    return InvalidArgument("expected " + std::to_string(h.num_layers) + " layers of expert ids");
  }
  it->used_offsets.assign(1, 0);
  for (uint32_t l = 0; l < h.num_layers; ++l) {
    const auto& ids = layers[l];
    if (!ids.is_array() || ids.size() != h.top_k) {
      return InvalidArgument("layer " + std::to_string(l) + ": expected " +
                             std::to_string(h.top_k) + " expert ids");
    }
    std::vector<uint16_t> sorted;
    for (const auto& v : ids) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= h.num_experts) {
        return InvalidArgument("layer " + std::to_string(l) + ": expert id " + v.dump() +
                               " is not in 0.." + std::to_string(h.num_experts - 1));
      }
      sorted.push_back(static_cast<uint16_t>(v.get<int64_t>()));
    }
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
      return InvalidArgument("layer " + std::to_string(l) + ": an expert id repeats");
    }
    it->used_experts.insert(it->used_experts.end(), sorted.begin(), sorted.end());
    it->used_tokens.insert(it->used_tokens.end(), sorted.size(), 1);
    it->used_offsets.push_back(static_cast<uint32_t>(it->used_experts.size()));
  }
  return Status::Ok();
}

Status ImportDeepSeek(const ImportOptions& o, const Embedder& embed, uint64_t* requests,
                      uint64_t* iterations) {
  if (o.inputs.size() != 1) return InvalidArgument("deepseek-jsonl reads one --input");
  const std::string& input = o.inputs.front();
  FMOE_ASSIGN_OR_RETURN(auto reader, LineReader::Open(input));
  std::optional<TraceWriter> writer;
  TraceHeader h;
  std::string line;
  uint64_t line_no = 0;
  while (true) {
    FMOE_ASSIGN_OR_RETURN(bool more, reader.Next(&line));
    if (!more) break;
    ++line_no;
    if (line.empty()) continue;
    if (line_no <= o.skip) continue;
    if (o.limit != 0 && *requests >= o.limit) break;
    const std::string at = input + ": line " + std::to_string(line_no);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      return InvalidArgument(at + ": " + e.what());
    }
    uint64_t id = 0;
    std::string prompt;
    nlohmann::json tokens, experts;
    TraceHeader lh;
    try {
      id = j.at("id").get<uint64_t>();
      prompt = j.at("prompt").get<std::string>();
      tokens = j.at("tokens");
      experts = j.at("experts");
      lh.model = j.at("model").get<std::string>();
      lh.num_layers = j.at("num_layers").get<uint32_t>();
      lh.num_experts = j.at("num_experts").get<uint32_t>();
      lh.top_k = j.at("top_k").get<uint32_t>();
    } catch (const nlohmann::json::exception& e) {
      return InvalidArgument(at + ": " + e.what());
    }
    if (!writer) {
      h = lh;
      h.source = "import:deepseek-jsonl " + std::filesystem::path(input).filename().string();
      h.iteration_unit = "prompt token position (prefill routing, one iteration per position)";
      h.semantic = "input embedding of " + embed.name() +
                   " (model.embed_tokens.weight), mean over its tokenizer's tokens: the whole "
                   "prompt at position 0, the position's token text after";
      h.hidden = embed.hidden();
      FMOE_ASSIGN_OR_RETURN(auto w, TraceWriter::Create(o.out, h));
      writer.emplace(std::move(w));
    } else if (lh.num_layers != h.num_layers || lh.num_experts != h.num_experts ||
               lh.top_k != h.top_k) {
      return InvalidArgument(at + ": shape differs from the first line's");
    }
    if (!tokens.is_array() || !experts.is_array() || tokens.size() != experts.size() ||
        tokens.empty()) {
      return InvalidArgument(at + ": tokens and experts must be non-empty arrays of one length");
    }
    auto prompt_sem = embed.Mean(prompt);
    if (!prompt_sem) prompt_sem = std::vector<float>(h.hidden, 0.0f);
    for (size_t t = 0; t < tokens.size(); ++t) {
      TraceIteration it;
      it.request_id = id;
      it.iteration = static_cast<uint32_t>(t);
      it.tokens = 1;
      it.last = t + 1 == tokens.size();
      it.map_derived = true;
      std::optional<std::vector<float>> sem;
      if (t > 0 && tokens[t].is_string()) {
        const std::string token = tokens[t].get<std::string>();
        auto text = ByteLevelDecode(token);
        sem = embed.Mean(text ? *text : token);
      }
      it.sem = sem ? std::move(*sem) : *prompt_sem;
      Status s = SetRouting(experts[t], h, &it);
      if (!s.ok())
        return InvalidArgument(at + ": position " + std::to_string(t) + ": " + s.message());
      FMOE_RETURN_IF_ERROR(writer->Append(it).WithContext(at));
      ++*iterations;
    }
    ++*requests;
  }
  if (!writer) return InvalidArgument(input + ": no request to import");
  return writer->Close();
}

Status ImportMixtral(const ImportOptions& o, uint64_t* requests, uint64_t* iterations,
                     uint64_t* dropped) {
  if (o.phase != "prefill" && o.phase != "decode") {
    return InvalidArgument(
        "mixtral-vllm needs --phase prefill or decode (the files do not say: in "
        "mixtral-8x7b-vllm/, gsm8k_2_routing.jsonl and humaneval_2_routing.jsonl hold decode "
        "steps, routing_raw.jsonl a prefill)");
  }
  // (request key) -> position -> layer -> (experts, probs).
  struct Position {
    std::map<uint32_t, std::pair<std::vector<int64_t>, std::vector<float>>> layers;
  };
  std::map<std::pair<std::string, int64_t>, std::map<uint32_t, Position>> problems;
  std::vector<std::pair<std::string, int64_t>> order;
  uint32_t max_layer = 0, k = 0;
  std::string line, names;
  for (const std::string& input : o.inputs) {
    names += (names.empty() ? "" : ", ") + std::filesystem::path(input).filename().string();
    FMOE_ASSIGN_OR_RETURN(auto reader, LineReader::Open(input));
    uint64_t line_no = 0;
    while (true) {
      FMOE_ASSIGN_OR_RETURN(bool more, reader.Next(&line));
      if (!more) break;
      ++line_no;
      if (line.empty()) continue;
      const std::string at = input + ": line " + std::to_string(line_no);
      try {
        auto j = nlohmann::json::parse(line);
        auto key =
            std::make_pair(j.at("dataset").get<std::string>(), j.at("problem_id").get<int64_t>());
        const uint32_t layer = j.at("layer").get<uint32_t>();
        const uint32_t pos = j.contains("token_pos") ? j.at("token_pos").get<uint32_t>()
                                                     : j.at("token_idx").get<uint32_t>();
        auto ids = j.at("experts").get<std::vector<int64_t>>();
        auto probs = j.at("gating_probs").get<std::vector<float>>();
        if (ids.empty() || ids.size() != probs.size() || (k != 0 && ids.size() != k) ||
            layer > 1023) {
          return InvalidArgument(at + ": experts and gating_probs must have the same top-k length");
        }
        k = static_cast<uint32_t>(ids.size());
        max_layer = std::max(max_layer, layer);
        if (!problems.contains(key)) order.push_back(key);
        problems[key][pos].layers[layer] = {std::move(ids), std::move(probs)};
      } catch (const nlohmann::json::exception& e) {
        return InvalidArgument(at + ": " + e.what());
      }
    }
  }
  if (order.empty()) return InvalidArgument(names + ": no routing to import");
  TraceHeader h;
  h.model = "Mixtral-8x7B-Instruct";
  h.source = "import:mixtral-vllm " + names;
  h.iteration_unit = o.phase == "decode"
                         ? "decode token position (decode steps only, one iteration per "
                           "generated token; positions with a layer missing left out)"
                         : "prefill token position (prompt routing, one iteration per position; "
                           "positions with a layer missing left out)";
  h.semantic = "none (the trace has no text)";
  h.num_layers = max_layer + 1;
  h.num_experts = 8;
  h.top_k = k;
  h.hidden = 0;
  FMOE_ASSIGN_OR_RETURN(auto writer, TraceWriter::Create(o.out, h));
  uint64_t index = 0;
  for (const auto& key : order) {
    if (index++ < o.skip) continue;
    if (o.limit != 0 && *requests >= o.limit) break;
    // Positions with a layer missing (the recording dropped some rows) are left out.
    std::vector<const Position*> complete;
    for (const auto& [pos, p] : problems[key]) {
      if (p.layers.size() == h.num_layers) {
        complete.push_back(&p);
      } else {
        ++*dropped;
      }
    }
    const uint64_t id = index;
    for (uint32_t pos = 0; pos < complete.size(); ++pos) {
      const Position& p = *complete[pos];
      const std::string at = names + ": " + key.first + " problem " + std::to_string(key.second) +
                             " position " + std::to_string(pos);
      TraceIteration it;
      it.request_id = id;
      it.iteration = pos;
      it.tokens = 1;
      it.last = pos + 1 == complete.size();
      nlohmann::json ids = nlohmann::json::array();
      it.map_offsets.assign(1, 0);
      for (const auto& [layer, routing] : p.layers) {
        ids.push_back(routing.first);
        std::vector<std::pair<int64_t, float>> entries;
        for (size_t i = 0; i < routing.first.size(); ++i) {
          entries.emplace_back(routing.first[i], routing.second[i]);
        }
        std::sort(entries.begin(), entries.end());
        for (const auto& [e, prob] : entries) {
          if (e < 0 || e >= h.num_experts) break;  // SetRouting names it below.
          it.map_experts.push_back(static_cast<uint16_t>(e));
          it.map_probs.push_back(prob);
        }
        it.map_offsets.push_back(static_cast<uint32_t>(it.map_experts.size()));
      }
      FMOE_RETURN_IF_ERROR(SetRouting(ids, h, &it).WithContext(at));
      FMOE_RETURN_IF_ERROR(writer.Append(it).WithContext(at));
      ++*iterations;
    }
    ++*requests;
  }
  return writer.Close();
}

}  // namespace

void AddImportTraceCommand(CLI::App& app, int& exit_code) {
  auto o = std::make_shared<ImportOptions>();
  o->embed_model = "deploy/models/tiny-moe";
  auto* cmd = app.add_subcommand("import-trace",
                                 "convert recorded routing of another system into an fmoe trace");
  cmd->add_option("--format", o->format, "deepseek-jsonl or mixtral-vllm")
      ->required()
      ->check(CLI::IsMember({"deepseek-jsonl", "mixtral-vllm"}));
  cmd->add_option("--input", o->inputs,
                  "the recorded routing (.jsonl, or .jsonl.gz); mixtral-vllm takes several, "
                  "requests keyed by (dataset, problem_id)")
      ->required();
  cmd->add_option("--phase", o->phase,
                  "mixtral-vllm: what the files hold, prefill or decode (gsm8k_2_routing and "
                  "humaneval_2_routing: decode; routing_raw: prefill)")
      ->check(CLI::IsMember({"prefill", "decode"}));
  cmd->add_option("--out", o->out, "the fmoe trace to write")->required();
  cmd->add_option("--embed-model", o->embed_model,
                  "model directory whose input embedding gives the semantic embeddings")
      ->capture_default_str();
  cmd->add_option("--skip", o->skip, "requests to skip at the start");
  cmd->add_option("--limit", o->limit, "requests to import (0: all)");
  cmd->callback([o, &exit_code] {
    uint64_t requests = 0, iterations = 0, dropped = 0;
    Status s;
    if (o->format == "deepseek-jsonl") {
      auto embed = Embedder::Load(o->embed_model);
      if (!embed.ok()) {
        std::fprintf(stderr, "fmoe-bench import-trace: %s\n", embed.status().message().c_str());
        exit_code = 2;
        return;
      }
      s = ImportDeepSeek(*o, *embed, &requests, &iterations);
    } else {
      s = ImportMixtral(*o, &requests, &iterations, &dropped);
    }
    if (!s.ok()) {
      std::fprintf(stderr, "fmoe-bench import-trace: %s\n", s.message().c_str());
      std::filesystem::remove(o->out);
      exit_code = s.code() == ErrorCode::kIoError ? 1 : 2;
      return;
    }
    std::printf("wrote %s: %llu requests, %llu iterations", o->out.c_str(),
                static_cast<unsigned long long>(requests),
                static_cast<unsigned long long>(iterations));
    if (dropped > 0) {
      std::printf(" (%llu positions with a layer missing left out)",
                  static_cast<unsigned long long>(dropped));
    }
    std::printf("\n");
  });
}

}  // namespace fmoe::bench
