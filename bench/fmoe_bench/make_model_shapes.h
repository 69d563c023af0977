// The shapes of real MoE models for `fmoe-bench make-model`: Mixtral-8x7B, Qwen1.5-MoE-A2.7B,
// Phi-3.5-MoE, Qwen3-30B-A3B, OLMoE-1B-7B, DeepSeek-V2-Lite, DeepSeek-V3, Kimi-K2, GLM-4.5-Air,
// MiniMax-M2, gpt-oss-20b and gpt-oss-120b as their Hugging Face
// config.json files give them, every tensor their checkpoints hold (names, shapes and order as
// transformers saves them), the tensors a quantized checkpoint stores instead (--quant: FP8 block,
// compressed-tensors INT4, GPTQ, AWQ as their published checkpoints lay them out, DESIGN section
// 12), and the config.json to write with the weights. Pure functions over constant tables; no I/O.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/model/quant.h"
#include "common/model/safetensors.h"
#include "common/status.h"

namespace fmoe::bench {

enum class ModelFamily {
  kMixtral,
  kQwen2Moe,
  kPhimoe,
  kQwen3Moe,
  kOlmoe,
  kDeepseekV2,
  kDeepseekV3,
  kGlm4Moe,
  kMinimaxM2,
  kGptOss
};

// What DeepSeek-V2/V3 add: multi-head latent attention, dense first layers, group-limited
// routing, YaRN (their config.json).
struct DeepseekShape {
  uint32_t q_lora_rank;  // 0: a plain q_proj (null in config.json).
  uint32_t kv_lora_rank;
  uint32_t qk_nope_head_dim;
  uint32_t qk_rope_head_dim;
  uint32_t v_head_dim;
  uint32_t first_k_dense_replace;    // Dense layers before the first MoE layer.
  uint32_t dense_intermediate_size;  // Their MLP width (config intermediate_size).
  uint32_t n_shared_experts;         // Of the routed experts' width each.
  uint32_t n_group;
  uint32_t topk_group;
  const char* topk_method;   // "greedy", "group_limited_greedy", "noaux_tc".
  const char* scoring_func;  // "softmax" or "sigmoid".
  bool norm_topk_prob;
  double routed_scaling_factor;
  double yarn_mscale;  // rope_scaling mscale and mscale_all_dim (equal in each model).
  double yarn_factor;  // rope_scaling factor.
  double yarn_beta_fast, yarn_beta_slow;
  double rope_theta;
  uint32_t max_position_embeddings;
};

// One real model's hyperparameters (its config.json on the Hub).
struct ModelShape {
  const char* name;    // --shape, e.g. "mixtral-8x7b".
  const char* hub_id;  // e.g. "mistralai/Mixtral-8x7B-v0.1".
  ModelFamily family;
  const char* architecture;  // config "architectures"[0], as our loader and transformers know it.
  const char* model_type;
  uint32_t hidden_size;
  uint32_t expert_intermediate_size;         // One routed expert's FFN width.
  uint32_t shared_expert_intermediate_size;  // 0: no shared expert.
  uint32_t num_hidden_layers;
  uint32_t num_attention_heads;
  uint32_t num_key_value_heads;
  uint32_t head_dim;     // 0: hidden_size / num_attention_heads (config.json has no head_dim).
  uint32_t num_experts;  // Routed experts per layer.
  uint32_t top_k;
  uint32_t vocab_size;
  std::optional<int32_t> bos_token_id;  // nullopt: null in config.json (OLMoE has none).
  int32_t eos_token_id;
  double published_params;  // The model card's total, e.g. 46.7e9.
  // How far the tensors' count may be from published_params: 0.005, or more where the card rounds
  // to whole billions (GLM-4.5-Air's "106B", MiniMax-M2's "230B": see kShapes).
  double published_tolerance;
  const DeepseekShape* deepseek;  // DeepSeek-V2/V3 only, else nullptr.
};

// The shapes, in --shape order.
const std::vector<ModelShape>& ModelShapes();
// nullptr when `name` is none of them.
const ModelShape* FindModelShape(std::string_view name);
// "mixtral-8x7b, qwen1.5-moe-a2.7b, phi-3.5-moe, qwen3-30b-a3b, olmoe-1b-7b, ...", for messages.
std::string ModelShapeNames();

// What make-model builds: a real shape, possibly cut down (fewer layers, experts or vocabulary).
struct ModelSize {
  uint32_t layers = 0;   // Decoder layers.
  uint32_t experts = 0;  // Routed experts per layer.
  uint32_t vocab = 0;
};
// The real model's size.
ModelSize RealSize(const ModelShape& shape);

// How a tensor is filled: weights small and random (initializer_range), norm weights 1, biases 0.
enum class TensorInit { kRandom, kOnes, kZeros };

enum class TensorRole { kDense, kRoutedExpert, kSharedExpert };

struct PlannedTensor {
  std::string name;
  std::vector<int64_t> shape;
  TensorInit init = TensorInit::kRandom;
  TensorRole role = TensorRole::kDense;
  // A decoder layer's linear weight [out, in] that quantized checkpoints store quantized; the
  // routers (and Qwen2-MoE's shared_expert_gate), embeddings, lm_head, norms and biases are not.
  bool quantizable = false;
  // Routed-expert projection matrices the tensor holds: 1 for an expert's own weight, gpt-oss's
  // fused gate_up_proj 2J and down_proj J, 0 for everything else (biases included).
  uint32_t expert_matrices = 0;
  uint64_t numel() const;
};

// Every tensor of the checkpoint, in transformers' state_dict order: the embedding, each layer
// (attention with its q/k norms, router, experts, shared expert, norms), the final norm,
// lm_head.
std::vector<PlannedTensor> PlanTensors(const ModelShape& shape, const ModelSize& size);

// Parameters of one routed expert (its three matrices, and gpt-oss's biases).
uint64_t RoutedExpertParams(const ModelShape& shape);

// --quant: a quantized format as published checkpoints store it (DESIGN section 12).
struct QuantFormat {
  const char* name;  // --quant, e.g. "fp8".
  const char* as;    // Whose checkpoints it lays out like, e.g. "DeepSeek-V3, Qwen3-FP8".
  QuantSpec spec;
  // Only the routed experts are quantized (Kimi-K2-Thinking's INT4); else every quantizable
  // linear (PlannedTensor::quantizable): attention, dense MLPs, shared and routed experts.
  bool routed_experts_only;
};

// fp8 (block e4m3 [128, 128], float32 weight_scale_inv), int4-g32 and int4-g128
// (compressed-tensors pack-quantized, symmetric, bf16 scales), gptq (4 bits, g128, sym, desc_act
// false, v1), awq (gemm, g128, zero point).
const std::vector<QuantFormat>& QuantFormats();
// nullptr when `name` is none of them.
const QuantFormat* FindQuantFormat(std::string_view name);
// "fp8, int4-g32, int4-g128, gptq, awq", for messages.
std::string QuantFormatNames();
// Whether `format` stores `t` quantized.
bool QuantizedBy(const QuantFormat& format, const PlannedTensor& t);

// What a stored tensor holds, for the writer.
enum class StoredKind {
  kFloat,        // A planned tensor in the float dtype.
  kQuantWeight,  // The packed or FP8 weight (QuantRole::kWeight).
  kQuantScale,   // QuantRole::kScale.
  kQuantZero,    // QuantRole::kZero.
  kGroupIndex,   // QuantRole::kGroupIndex: column i in group i / group_size.
  kWeightShape,  // compressed-tensors' weight_shape: I64 [out, in].
};

// One tensor of the checkpoint as written.
struct StoredTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  StoredKind kind = StoredKind::kFloat;
  size_t planned = 0;  // Index of the PlannedTensor it stores (or part of it).
  uint64_t numel() const;
  uint64_t bytes() const { return numel() * DTypeSize(dtype); }
};

// The tensors the checkpoint stores, in order: each planned tensor in `dtype`, or, where `quant`
// (nullptr: none) quantizes it, the tensors QuantTensorsOf lists for it (with the format's usual
// dtypes; g_idx always, as AutoGPTQ writes it), then compressed-tensors' weight_shape.
// kInvalidArgument naming the tensor when the format cannot pack its shape (QuantShapeError).
Result<std::vector<StoredTensor>> StoreTensors(const std::vector<PlannedTensor>& planned,
                                               DType dtype, const QuantFormat* quant);

// config.json as transformers writes it for the model (keys sorted), with `size` applied,
// torch_dtype set, and the given bos/eos ids; with `quant`, its quantization_config as the
// format's checkpoints write it (compressed-tensors' ignore list and AWQ's
// modules_to_not_convert name the linear layers left in float). Every key our loader
// (common/model/model_config.h) reads is present and valid, and so is every key of the family's
// transformers config class that changes the computation (attention biases, head_dim, clip_qkv,
// norm_topk_prob, dense layers, sliding window, rope_scaling), at the real model's value, so a
// loader can refuse what it does not implement.
std::string ConfigJson(const ModelShape& shape, const ModelSize& size,
                       const std::string& torch_dtype, std::optional<int32_t> bos_token_id,
                       std::optional<int32_t> eos_token_id, const QuantFormat* quant = nullptr);

}  // namespace fmoe::bench
