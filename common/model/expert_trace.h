// Expert routing traces (docs/TRACES.md): for each request and iteration, every MoE layer's
// routing (the experts the gate picked for the request's tokens, with token counts, and the gate
// distribution P_l), the semantic embedding, and the speculative predictions. Written by the
// worker (`--record-trace`) and by `fmoe-bench import-trace`; read by `fmoe-bench replay`.
// Torch-free; a TraceWriter is used from one thread.
//
// File layout (little-endian):
//   "FMOETRC1"                       8 bytes
//   u32 n, n bytes of JSON           the header (TraceHeader)
//   records until the end of the file, each:
//     u32 size                       bytes of the record after this field
//     u64 request_id, u32 iteration, u32 tokens, u8 flags, 3 bytes zero
//       flags bit 0: the request's last iteration; bit 1: the map is derived from the routing
//       (P_l[j] = tokens routed to j / (tokens * top_k)) and not stored
//     f32 x hidden                   semantic embedding
//     per MoE layer:
//       u16 n, u16 x n experts (ascending), u32 x n tokens routed to each (sum = tokens * top_k)
//       unless derived: u16 m, u16 x m experts (ascending), f32 x m probabilities (the others 0)
//     u16 s, then s speculative predictions:
//       u16 layer, u16 target (layer < target), u16 m, u16 x m experts, f32 x m fractions
#pragma once

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace fmoe {

struct TraceHeader {
  std::string model;           // The model whose routing this is.
  std::string source;          // What wrote it: "fmoe-worker", "import:deepseek-jsonl", ...
  std::string iteration_unit;  // "engine iteration" or "prompt token position".
  std::string semantic;        // How the semantic embeddings were computed.
  uint32_t num_layers = 0;     // L MoE layers, 1..1024.
  uint32_t num_experts = 0;    // J routed experts per layer, 1..65535.
  uint32_t top_k = 0;          // K, 1..J.
  uint32_t hidden = 0;         // Length of `sem`, 0..65536 (0: no embeddings).
};

// A speculative prediction made before `layer` ran: for `target`, the fraction of the
// iteration's tokens whose top-k would pick each listed expert.
struct TraceSpeculation {
  uint16_t layer = 0;
  uint16_t target = 0;
  std::vector<uint16_t> experts;
  std::vector<float> fractions;
};

// One request's iteration. Layers' routing and maps are flat: layer l's entries are
// [offsets[l], offsets[l + 1]).
struct TraceIteration {
  uint64_t request_id = 0;
  uint32_t iteration = 0;  // 0 = prefill (or the first position).
  uint32_t tokens = 0;     // Tokens of this request in this iteration, >= 1.
  bool last = false;       // The request's last iteration.
  // Prompt tokens: the engine's prefill or a chunk of it (a chunked prefill's iterations 0..c-1;
  // traces written before chunking leave it false, their iteration 0 being the prefill).
  bool prefill = false;
  std::vector<float> sem;              // hidden floats.
  std::vector<uint32_t> used_offsets;  // L + 1.
  std::vector<uint16_t> used_experts;
  std::vector<uint32_t> used_tokens;
  bool map_derived = false;           // P_l from the routing; map_* empty.
  std::vector<uint32_t> map_offsets;  // L + 1 (empty when derived).
  std::vector<uint16_t> map_experts;
  std::vector<float> map_probs;
  std::vector<TraceSpeculation> speculation;

  std::span<const uint16_t> used(uint32_t layer) const {
    return {used_experts.data() + used_offsets[layer],
            used_offsets[layer + 1] - used_offsets[layer]};
  }
  std::span<const uint32_t> used_counts(uint32_t layer) const {
    return {used_tokens.data() + used_offsets[layer],
            used_offsets[layer + 1] - used_offsets[layer]};
  }
  // The expert map [P_1 .. P_L] (L * J floats) into `out`.
  void FillMap(const TraceHeader& header, std::vector<float>* out) const;
};

struct Trace {
  TraceHeader header;
  std::vector<TraceIteration> iterations;  // In file order.
};

// Checks one iteration against the header: shapes, ranges, ascending experts, finite values,
// routed tokens = tokens * top_k per layer. kInvalidArgument naming the field.
Status ValidateTraceIteration(const TraceHeader& header, const TraceIteration& it);

// Reads and validates a whole trace. Errors name the file, the record and the field:
// kNotFound / kIoError for the file, kDataLoss for a bad magic, a truncated record or a value out
// of range, and for a request whose iterations do not go 0, 1, 2, ... or that continues after
// its last iteration.
Result<Trace> ReadTrace(const std::string& path);

class TraceWriter {
 public:
  // Creates (truncates) `path` and writes the header. kInvalidArgument for a bad header,
  // kIoError when the file cannot be written.
  static Result<TraceWriter> Create(const std::string& path, const TraceHeader& header);
  TraceWriter(TraceWriter&& other) noexcept;
  TraceWriter& operator=(TraceWriter&& other) noexcept;
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;
  ~TraceWriter();

  const TraceHeader& header() const { return header_; }
  // Validates and appends one iteration (buffered).
  Status Append(const TraceIteration& it);
  // Hands buffered records to the operating system.
  Status Flush();
  // Flushes and closes; later Appends fail.
  Status Close();
  uint64_t records() const { return records_; }

 private:
  TraceWriter() = default;
  std::string path_;
  TraceHeader header_;
  std::FILE* file_ = nullptr;
  std::vector<char> record_;  // Scratch.
  uint64_t records_ = 0;
};

}  // namespace fmoe
