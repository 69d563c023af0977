// The shape of a Hugging Face MoE checkpoint, read from its config.json, and the model's
// fingerprint (the map service keys its stores by it). Families: Mixtral, Qwen2-MoE, Phi-3.5-MoE,
// OLMoE, Qwen3-MoE. The full loader (weights, tokenizer) belongs to the worker's model runtime;
// this file only reads what every process needs to agree on. Pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace fmoe {

struct ModelInfo {
  std::string dir;                 // Absolute model directory.
  std::string architecture;        // e.g. "MixtralForCausalLM".
  uint32_t num_hidden_layers = 0;  // Transformer layers.
  uint32_t num_moe_layers = 0;     // L: layers with routed experts.
  uint32_t num_experts = 0;        // J: routed experts per MoE layer.
  uint32_t top_k = 0;              // K.
  uint32_t hidden_size = 0;        // h.
  uint32_t vocab_size = 0;
  uint32_t max_position_embeddings = 0;
  std::vector<std::string> weight_files;  // *.safetensors present, sorted.
  uint64_t fingerprint = 0;               // FNV-1a over config.json and the safetensors headers.
};

// Reads DIR/config.json. Errors name the file and key:
//   "model: /m/config.json: num_experts_per_tok (9) > number of experts (8)".
Result<ModelInfo> LoadModelInfo(const std::string& dir);

// Same from text, for tests; `dir` is only recorded.
Result<ModelInfo> ParseModelConfig(const std::string& json_text, const std::string& dir);

// 16 lowercase hex digits.
std::string FingerprintHex(uint64_t fingerprint);

}  // namespace fmoe
