// The shape of a Hugging Face MoE checkpoint, read from its config.json, and the model's
// fingerprint (the map service keys its stores by it). Families: Mixtral, Qwen2-MoE, Qwen3-MoE,
// OLMoE, Phi-3.5-MoE, DeepSeek-V2, DeepSeek-V3, GLM-4.5, MiniMax-M2 and gpt-oss, all run by the
// model runtime
// (`runtime_unsupported` is for a family whose shapes only are known). The full loader (weights,
// tokenizer) belongs to the worker's model runtime; this file reads what every process needs to
// agree on and the hyperparameters the runtime builds the model from, and refuses a config field
// that changes the computation in a way the runtime does not implement (rope_scaling other than
// DeepSeek's YaRN and Phi's LongRoPE, an activation other than SiLU, Qwen's sliding window,
// quantized weights), naming it. docs/MODELS.md lists what each family reads. Pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/model/quant.h"
#include "common/model/routing.h"
#include "common/status.h"

namespace fmoe {

// How attention normalises queries and keys before RoPE.
enum class QkNorm : uint8_t {
  kNone,
  kPerHead,  // RMSNorm over each head's head_dim values (Qwen3-MoE).
  kWhole,    // RMSNorm over the whole projection (OLMoE: H*hd for q, KV*hd for k).
};

// Multi-head latent attention (DeepSeek-V2/V3). Queries: q_proj, or with q_lora_rank > 0
// q_b_proj(RMSNorm(q_a_proj x)); keys and values come from one latent per token,
// RMSNorm(kv_a_proj_with_mqa x [:kv_lora_rank]), expanded per head by kv_b_proj, plus one rotary
// key of qk_rope_head_dim shared by every head. The KV cache keeps the latent and the rotary key.
struct MlaSpec {
  uint32_t q_lora_rank = 0;  // 0: a plain q_proj (config null).
  uint32_t kv_lora_rank = 0;
  uint32_t qk_nope_head_dim = 0;
  uint32_t qk_rope_head_dim = 0;
  uint32_t v_head_dim = 0;
  // The rotary part of q and k is stored interleaved (pairs 2i, 2i+1 rotate together:
  // DeepSeek-V2 always, V3 by rope_interleave, default true); false: halves (i, i + d/2).
  bool rope_interleave = true;
};

// YaRN rotary scaling (rope_scaling {"type" or "rope_type": "yarn", ...}): DeepSeek's (MLA) and
// gpt-oss's, as transformers' _compute_yarn_parameters computes it.
struct YarnSpec {
  double factor = 1.0;                            // > 0.
  uint32_t original_max_position_embeddings = 0;  // Required.
  double beta_fast = 32.0;                        // Default: 32
  double beta_slow = 1.0;                         // Default: 1
  double mscale = 1.0;                            // Default: 1
  double mscale_all_dim = 0.0;                    // Default: 0 (no softmax correction)
  // Whether the ramp's ends are rounded to whole dims (floor / ceil). Default: true; gpt-oss
  // says false.
  bool truncate = true;
};

// LongRoPE (Phi-3.5-MoE's rope_scaling {"type": "longrope", ...}), as transformers'
// PhimoeRotaryEmbedding computes it: the inverse frequencies 1 / (factor_i * theta^(2i / hd)) with
// the short factors while a forward's sequence (every cached and new token) is at most
// original_max_position_embeddings long, the long factors beyond; cos and sin multiplied by
// short_mscale or long_mscale by the same rule. Keys already cached keep the rotation they were
// written with (transformers never rotates them again).
struct LongRopeSpec {
  std::vector<double> short_factor;               // head_dim / 2 values, each > 0.
  std::vector<double> long_factor;                // head_dim / 2 values, each > 0.
  uint32_t original_max_position_embeddings = 0;  // Required.
  double short_mscale = 1.0;                      // Required (PhimoeConfig).
  double long_mscale = 1.0;                       // Required (PhimoeConfig).
};

struct ModelInfo {
  std::string dir;                 // Absolute model directory.
  std::string architecture;        // e.g. "MixtralForCausalLM".
  uint32_t num_hidden_layers = 0;  // Transformer layers.
  uint32_t num_moe_layers = 0;     // L: layers with routed experts.
  // The transformer layer of each MoE layer, ascending (size L): MoE layer l is transformer layer
  // moe_layers[l]. Maps, caches and traces count MoE layers; the others are dense.
  std::vector<uint32_t> moe_layers;
  uint32_t num_experts = 0;  // J: routed experts per MoE layer.
  uint32_t top_k = 0;        // K.
  uint32_t hidden_size = 0;  // h.
  uint32_t vocab_size = 0;
  uint32_t max_position_embeddings = 0;
  uint32_t intermediate_size = 0;  // One routed expert's FFN width. Required.
  // A dense layer's MLP width (Qwen's intermediate_size); 0 when every layer is sparse.
  uint32_t dense_intermediate_size = 0;
  // Shared experts (Qwen2-MoE): one dense MLP of this width in every MoE layer, always resident,
  // never in the expert cache; 0 = none. `shared_expert_gated`: its output is scaled by
  // sigmoid(shared_expert_gate(x)).
  uint32_t shared_expert_intermediate_size = 0;
  bool shared_expert_gated = false;
  // DeepSeek-V3: each MoE layer's router carries e_score_correction_bias [J].
  bool router_correction_bias = false;
  std::optional<MlaSpec> mla;            // Multi-head latent attention instead of grouped-query.
  std::optional<YarnSpec> yarn;          // YaRN rotary scaling; absent: plain RoPE.
  std::optional<LongRopeSpec> longrope;  // LongRoPE (Phi-3.5-MoE); absent: plain RoPE.
  RoutingSpec routing;                   // The router's function (common/model/routing.h).
  bool qkv_bias = false;                 // q/k/v projections carry biases.
  bool o_bias = false;                   // The output projection carries a bias.
  // LayerNorm (weight and bias, eps rms_norm_eps) instead of RMSNorm for the layers' and the
  // final norm (Phi-3.5-MoE).
  bool layer_norm = false;
  bool lm_head_bias = false;  // lm_head carries a bias [V] (Phi-3.5-MoE's lm_head_bias).
  QkNorm qk_norm = QkNorm::kNone;
  std::optional<double> clip_qkv;  // OLMoE: q, k and v clamped to [-c, c].
  // Why the model runtime cannot run this model ("" = it can): a family whose shapes are known
  // (maps, replay, make-model) but whose computation is not implemented.
  std::string runtime_unsupported;
  uint32_t num_attention_heads = 0;  // Required.
  uint32_t num_key_value_heads = 0;  // Default: num_attention_heads; divides it.
  // Default: hidden_size / num_attention_heads (exact). With MLA: qk_rope_head_dim, the rotary
  // width (as transformers' DeepseekV3Config sets head_dim).
  uint32_t head_dim = 0;
  // The leading dims of each query and key head that RoPE rotates (GLM-4.5's
  // partial_rotary_factor, MiniMax-M2's rotary_dim); the rest pass through unrotated. 0 means
  // head_dim (every other family). Even, at most head_dim: use RotaryDim().
  uint32_t rotary_dim = 0;
  double rms_norm_eps = 1e-5;           // Default: 1e-5; > 0.
  double rope_theta = 1e6;              // Default: 1e6 (HF MixtralConfig); > 0.
  bool tie_word_embeddings = false;     // Default: false.
  std::optional<int32_t> bos_token_id;  // Absent or null: none.
  std::vector<int32_t> eos_token_ids;   // config "eos_token_id": an int, a list or null.
  std::string torch_dtype;              // "" when absent.
  // quantization_config (DESIGN section 12): the routed experts' stored format, kept native by
  // the worker; dense weights in it are dequantized at load. kNone: float weights.
  QuantSpec quant;
  std::optional<uint32_t> sliding_window;  // Absent or null: full attention.
  // Which layers use sliding_window (gpt-oss's layer_types: "sliding_attention" or
  // "full_attention"); empty: every layer does when sliding_window is set.
  std::vector<bool> sliding_layers;
  // gpt-oss: a learned logit per query head joins each row of scores before the softmax and is
  // dropped after it ("sinks" [H]).
  bool attention_sinks = false;
  bool router_bias = false;  // The router carries a bias [J] (gpt-oss).
  // gpt-oss's experts: biases on their projections, and the clamped SwiGLU: gate clamped above at
  // the limit, up to [-limit, limit], out = (up + 1) * gate * sigmoid(1.702 gate).
  bool expert_bias = false;
  std::optional<double> swiglu_limit;
  std::vector<std::string> weight_files;  // *.safetensors present, sorted.
  uint64_t fingerprint = 0;               // FNV-1a over config.json and the safetensors headers.
};

// The rotated width of a head: rotary_dim, or head_dim when 0.
inline uint32_t RotaryDim(const ModelInfo& info) {
  return info.rotary_dim != 0 ? info.rotary_dim : info.head_dim;
}

// Parameters of one routed expert (its gate, up and down matrices: 3 * intermediate * hidden;
// gpt-oss adds their biases, 2 * intermediate + hidden).
uint64_t RoutedExpertParams(const ModelInfo& info);
// Bytes of one routed expert as stored: its three projections in the quantized format, else
// RoutedExpertParams x CheckpointBytesPerParam. What the expert cache, usage and /metrics count.
uint64_t RoutedExpertBytes(const ModelInfo& info);
// Parameters of one MoE layer's shared expert with its gate (0 without one).
uint64_t SharedExpertParams(const ModelInfo& info);
// KV cache bytes one token takes over every layer at `bytes_per_value` per element: MLA keeps
// kv_lora_rank + qk_rope_head_dim values per layer; grouped-query attention 2 x KV x head_dim.
uint64_t KvBytesPerToken(const ModelInfo& info, uint32_t bytes_per_value);
// Positions a rank's paged KV pool holds (DESIGN section 14): `requested` rounded up to whole
// 16-position blocks, or when 0, max(context, max_batch x min(context, 32768)), context being
// max_position_embeddings (4096 when unset): one sequence can always reach the whole context.
// The router takes the smallest group's as the longest prompt plus max_tokens it admits.
uint64_t KvPoolTokens(const ModelInfo& info, uint32_t max_batch, uint64_t requested);
// Positions the pool's sliding-window layers hold (gpt-oss): with a token budget per step, each
// running sequence keeps its window and a block either side, and a step adds at most the budget:
// max_batch x (window rounded up to blocks + 32) + the budget rounded up, at most `pool_tokens`.
// Without a budget (whole prompts) or sliding layers: `pool_tokens`.
uint64_t KvSlidingPoolTokens(const ModelInfo& info, uint32_t max_batch, uint32_t max_batched_tokens,
                             uint64_t pool_tokens);
// KV bytes per position of the full-attention (and MLA) layers and of the sliding-window
// layers, at `bytes_per_value`; their sum is KvBytesPerToken.
std::pair<uint64_t, uint64_t> KvBytesPerTokenSplit(const ModelInfo& info, uint32_t bytes_per_value);
// The same for MLA's keys and values expanded per head (a plain cache of the same model:
// H x (qk_nope + qk_rope + v_head_dim) per layer); equal to KvBytesPerToken without MLA.
uint64_t ExpandedKvBytesPerToken(const ModelInfo& info, uint32_t bytes_per_value);
// Bytes per parameter of the checkpoint's torch_dtype (float32: 4, bfloat16/float16: 2; 4 when
// absent or unknown).
uint32_t CheckpointBytesPerParam(const ModelInfo& info);

// A few lines for `fmoe validate`: the family (and whether the runtime runs it), L among the
// transformer layers, J, K and the routing, a routed and a shared expert's size, the attention
// variant, the fingerprint.
std::string DescribeModel(const ModelInfo& info);

// Reads DIR/config.json. Errors name the file and key:
//   "model: /m/config.json: num_experts_per_tok (9) > number of experts (8)".
Result<ModelInfo> LoadModelInfo(const std::string& dir);

// Same from text, for tests; `dir` is only recorded.
Result<ModelInfo> ParseModelConfig(const std::string& json_text, const std::string& dir);

// 16 lowercase hex digits.
std::string FingerprintHex(uint64_t fingerprint);

}  // namespace fmoe
