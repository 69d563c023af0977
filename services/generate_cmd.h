// `fmoe generate --model DIR --prompt TEXT`: a quick local check of a checkpoint. Loads the model
// in this process (a progress bar while the weights load), runs one request through the same
// engine a worker uses with every expert resident, streams the text to stdout and prints timings
// to stderr. Needs a LibTorch build.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fmoe {

struct GenerateCommand {
  std::string model_dir;
  std::string prompt;
  uint32_t max_tokens = 64;       // Default: 64
  float temperature = 0.0f;       // Default: 0 (greedy)
  float top_p = 1.0f;             // Default: 1
  int32_t top_k = 0;              // Default: 0 (off)
  uint64_t seed = 0;              // Default: 0
  std::vector<std::string> stop;  // Stop strings. Default: none
  std::string dtype = "float32";  // Default: float32
  int threads = 0;                // Intra-op threads; 0 = LibTorch's choice. Default: 0
  bool no_bos = false;            // Do not add the tokenizer's BOS. Default: false
};

// Returns the process exit code: 0 done, 1 load or run failure, 2 bad arguments.
int RunGenerate(const GenerateCommand& command);

}  // namespace fmoe
