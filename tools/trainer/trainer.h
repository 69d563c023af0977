// fmoe-train's pipeline: train a byte-level BPE vocabulary on train.txt, tokenize train/val,
// train the Mixtral model with AdamW (warmup + cosine, clipping, load-balancing and z losses),
// checkpoint periodically, then evaluate with the BF16-rounded weights and write a Hugging Face
// model directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
// MODEL_CARD.md). Torch-free interface; RunTraining runs on the caller's thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "tools/trainer/moe_model.h"

namespace fmoe::trainer {

struct TrainOptions {
  std::string data_dir;  // Holds train.txt and val.txt (and corpus_stats.tsv). Required.
  std::string out_dir;   // The model directory written at the end. Required.
  std::string work_dir;  // Checkpoints, tokenizer and token caches. Default: <out_dir>.work
  MoeShape shape;
  OptimizerOptions optim;
  uint32_t steps = 1000;               // Optimizer steps in the whole run. Default: 1000
  uint32_t batch = 8;                  // Sequences per step. Default: 8
  uint32_t seq_len = 256;              // Tokens per sequence. Default: 256
  double lr = 2e-3;                    // Peak learning rate. Default: 2e-3
  double min_lr_ratio = 0.1;           // Cosine floor as a fraction of lr. Default: 0.1
  uint32_t warmup_steps = 50;          // Linear warmup. Default: 50
  uint64_t seed = 1234;                // Initialisation and data order. Default: 1234
  uint32_t log_every = 10;             // Default: 10
  uint32_t eval_every = 100;           // Validation during training (0: never). Default: 100
  uint32_t eval_windows = 32;          // Windows per periodic validation. Default: 32
  uint32_t checkpoint_every = 100;     // Default: 100 (0: only at the end)
  uint32_t threads = 2;                // LibTorch intra-op threads. Default: 2
  bool resume = false;                 // Continue from work_dir's checkpoint. Default: false
  uint64_t bpe_max_bytes = 0;          // Train the BPE on at most this much text (evenly spread
                                       // documents); 0: all. Default: 0
  uint32_t final_train_windows = 128;  // Train-set windows for the final BF16 loss. Default: 128
  std::vector<std::string> sample_prompts;  // Greedy continuations for the card.
  uint32_t sample_tokens = 40;              // Default: 40
  std::string command_line;                 // Recorded in the model card.
  std::string prepare_command;              // Recorded in the model card.
};

struct TrainReport {
  uint32_t steps = 0;               // Optimizer steps done in total (including resumed ones).
  uint64_t tokens_seen = 0;         // Training tokens consumed (batch * seq_len per step).
  double wall_seconds = 0;          // Training wall time (including before a resume).
  double first_loss = 0;            // Mean of the first logged interval of this process.
  std::vector<double> logged_loss;  // Mean training loss of each logged interval (this process).
  double last_train_loss = 0;       // Mean training loss over the last 50 steps (fp32 weights).
  double last_aux_loss = 0;         // Mean aux loss over the last 50 steps.
  double train_loss_bf16 = 0;       // Train windows, BF16 weights.
  EvalResult val_bf16;              // Validation, BF16 weights.
  uint64_t train_tokens = 0;        // Size of the tokenized training set.
  uint64_t val_tokens = 0;
  std::vector<std::pair<std::string, std::string>> samples;  // (prompt, greedy continuation)
};

Result<TrainReport> RunTraining(const TrainOptions& options);

// Greedy continuation of `prompt` by the model in `model_dir`, loaded through the project's
// loader; returns the generated text (and the ids through `ids` when not null).
Result<std::string> GenerateGreedy(const std::string& model_dir, const std::string& prompt,
                                   uint32_t max_new_tokens, std::vector<int32_t>* ids);

}  // namespace fmoe::trainer
