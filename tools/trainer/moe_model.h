// The trainer's Mixtral model (HF MixtralForCausalLM, exactly): embedding; per layer RMSNorm,
// grouped-query attention with rotary embeddings (rotate_half), RMSNorm, top-k MoE with
// renormalised weights and SwiGLU experts; final RMSNorm; LM head (tied or not). Holds the
// parameters, the AdamW state and the forward/backward pass; LibTorch stays inside moe_model.cc.
// One thread owns a MoeModel; LibTorch's intra-op threads are set by the owner.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace fmoe::trainer {

// The model's shape and the HF config fields the export writes.
struct MoeShape {
  uint32_t vocab_size = 4096;               // Default: 4096
  uint32_t hidden_size = 256;               // Default: 256
  uint32_t intermediate_size = 128;         // Expert FFN width. Default: 128
  uint32_t num_layers = 8;                  // Default: 8
  uint32_t num_heads = 8;                   // Default: 8
  uint32_t num_kv_heads = 4;                // Default: 4
  uint32_t num_experts = 8;                 // Default: 8
  uint32_t top_k = 2;                       // Default: 2
  uint32_t max_position_embeddings = 1024;  // Default: 1024
  double rms_norm_eps = 1e-5;               // Default: 1e-5
  double rope_theta = 10000.0;              // Default: 10000
  bool tie_word_embeddings = true;          // Default: true
  uint32_t head_dim() const { return hidden_size / num_heads; }
  Status Validate() const;
  // Parameters, counting a tied head once.
  uint64_t ParameterCount() const;
};

struct OptimizerOptions {
  double weight_decay = 0.1;    // Matrices only; norms are not decayed. Default: 0.1
  double beta1 = 0.9;           // Default: 0.9
  double beta2 = 0.95;          // Default: 0.95
  double eps = 1e-8;            // Default: 1e-8
  double grad_clip = 1.0;       // Global L2 norm; 0 disables. Default: 1.0
  double aux_loss_coef = 0.02;  // Load-balancing loss weight. Default: 0.02
  double z_loss_coef = 1e-3;    // Router z-loss weight. Default: 1e-3
};

struct StepResult {
  double loss = 0;       // Cross-entropy (nats per token).
  double aux_loss = 0;   // Load-balancing loss, mean over layers (1.0 when perfectly balanced).
  double z_loss = 0;     // Router z-loss, mean over layers.
  double grad_norm = 0;  // Before clipping.
};

struct EvalResult {
  double loss = 0;  // Mean cross-entropy over every predicted token.
  uint64_t tokens = 0;
  // Per layer: entropy of the frequency of top-k assignments over experts / log(J) (1 = every
  // expert chosen equally often), and the mean over tokens of the entropy of the router's softmax
  // / log(J).
  std::vector<double> usage_entropy;
  std::vector<double> router_entropy;
  std::vector<std::vector<double>> usage_fraction;  // [layer][expert], sums to 1 per layer.
};

class MoeModel {
 public:
  ~MoeModel();
  MoeModel(const MoeModel&) = delete;
  MoeModel& operator=(const MoeModel&) = delete;

  // A fresh model (normal(0, 0.02) weights, residual projections scaled by 1/sqrt(2L), unit
  // norms) with its optimizer. `seed` fixes the initialisation.
  static Result<std::unique_ptr<MoeModel>> Create(const MoeShape& shape,
                                                  const OptimizerOptions& optim, uint64_t seed);
  // Reads a Hugging Face Mixtral directory (config.json + safetensors) through our own loader
  // (LoadModelInfo, Checkpoint). For evaluation and generation; the optimizer state is fresh.
  static Result<std::unique_ptr<MoeModel>> LoadHf(const std::string& dir);

  const MoeShape& shape() const;
  // LibTorch's intra-op thread count for the process.
  static void SetThreads(uint32_t threads);

  // One optimizer step on `batch` sequences of seq_len + 1 tokens each (row-major): inputs are
  // the first seq_len tokens, targets the last seq_len.
  Result<StepResult> TrainStep(std::span<const int32_t> tokens, uint32_t batch, uint32_t seq_len,
                               double lr);
  // Loss and routing statistics over `windows`: back-to-back windows of seq_len + 1 tokens,
  // `batch` windows per forward pass, no gradients.
  Result<EvalResult> Evaluate(std::span<const int32_t> windows, uint32_t seq_len,
                              uint32_t batch) const;
  // Greedy continuation (no sampling) of `prompt`, stopping after max_new tokens or at `eos`
  // (included). Returns the new tokens only.
  std::vector<int32_t> Greedy(std::span<const int32_t> prompt, uint32_t max_new, int32_t eos) const;

  // Rounds every weight to bfloat16 (and back to float32), as the shipped file stores them.
  void RoundToBF16();
  // Writes the weights under their HF names; bf16: BF16 tensors, else F32.
  Status SaveSafetensors(const std::string& path, bool bf16) const;
  // Training checkpoint: weights and optimizer state (LibTorch archives), written atomically.
  Status SaveState(const std::string& prefix) const;
  Status LoadState(const std::string& prefix);

 private:
  struct Impl;
  explicit MoeModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fmoe::trainer
