#include "bench/fmoe_bench/make_model_shapes.h"

#include <algorithm>
#include <utility>

#include "common/json.h"

namespace fmoe::bench {
namespace {

using Json = nlohmann::json;

// deepseek-ai/DeepSeek-V2-Lite: q without LoRA, 2 shared experts, one dense first layer, greedy
// softmax routing; YaRN factor 40 with mscale 0.707.
constexpr DeepseekShape kDeepseekV2Lite = {
    /*q_lora_rank=*/0,
    /*kv_lora_rank=*/512,
    /*qk_nope_head_dim=*/128,
    /*qk_rope_head_dim=*/64,
    /*v_head_dim=*/128,
    /*first_k_dense_replace=*/1,
    /*dense_intermediate_size=*/10944,
    /*n_shared_experts=*/2,
    /*n_group=*/1,
    /*topk_group=*/1,
    "greedy",
    "softmax",
    /*norm_topk_prob=*/false,
    /*routed_scaling_factor=*/1.0,
    /*yarn_mscale=*/0.707,
    /*yarn_factor=*/40,
    /*yarn_beta_fast=*/32,
    /*yarn_beta_slow=*/1,
    /*rope_theta=*/10000,
    /*max_position_embeddings=*/163840};
// deepseek-ai/DeepSeek-V3 (the 61 layers; its multi-token-prediction layer 61 is not written):
// q LoRA 1536, 1 shared expert, 3 dense layers, sigmoid routing with noaux_tc over 8 groups.
constexpr DeepseekShape kDeepseekV3 = {
    /*q_lora_rank=*/1536,
    /*kv_lora_rank=*/512,
    /*qk_nope_head_dim=*/128,
    /*qk_rope_head_dim=*/64,
    /*v_head_dim=*/128,
    /*first_k_dense_replace=*/3,
    /*dense_intermediate_size=*/18432,
    /*n_shared_experts=*/1,
    /*n_group=*/8,
    /*topk_group=*/4,
    "noaux_tc",
    "sigmoid",
    /*norm_topk_prob=*/true,
    /*routed_scaling_factor=*/2.5,
    /*yarn_mscale=*/1.0,
    /*yarn_factor=*/40,
    /*yarn_beta_fast=*/32,
    /*yarn_beta_slow=*/1,
    /*rope_theta=*/10000,
    /*max_position_embeddings=*/163840};
// moonshotai/Kimi-K2-Instruct (DeepseekV3ForCausalLM; Kimi-K2-Thinking ships it in INT4 g32):
// V3's attention and expert shapes with 64 heads, 384 experts, one dense layer, one group,
// routed scaling 2.827, YaRN factor 32 with beta 1/1, rope theta 50000.
constexpr DeepseekShape kKimiK2 = {
    /*q_lora_rank=*/1536,
    /*kv_lora_rank=*/512,
    /*qk_nope_head_dim=*/128,
    /*qk_rope_head_dim=*/64,
    /*v_head_dim=*/128,
    /*first_k_dense_replace=*/1,
    /*dense_intermediate_size=*/18432,
    /*n_shared_experts=*/1,
    /*n_group=*/1,
    /*topk_group=*/1,
    "noaux_tc",
    "sigmoid",
    /*norm_topk_prob=*/true,
    /*routed_scaling_factor=*/2.827,
    /*yarn_mscale=*/1.0,
    /*yarn_factor=*/32,
    /*yarn_beta_fast=*/1,
    /*yarn_beta_slow=*/1,
    /*rope_theta=*/50000,
    /*max_position_embeddings=*/131072};

// Checked against each model's config.json on the Hub and the transformers model definitions
// (modeling_mixtral, modeling_qwen2_moe, modeling_phimoe, modeling_qwen3_moe, modeling_olmoe,
// modeling_deepseek_v2, modeling_deepseek_v3).
const std::vector<ModelShape> kShapes = {
    {"mixtral-8x7b",
     "mistralai/Mixtral-8x7B-v0.1",
     ModelFamily::kMixtral,
     "MixtralForCausalLM",
     "mixtral",
     /*hidden=*/4096,
     /*expert_inter=*/14336,
     /*shared_inter=*/0,
     /*layers=*/32,
     /*heads=*/32,
     /*kv_heads=*/8,
     /*head_dim=*/0,
     /*experts=*/8,
     /*top_k=*/2,
     /*vocab=*/32000,
     /*bos=*/1,
     /*eos=*/2,
     46.7e9,
     0.005,
     nullptr},
    {"qwen1.5-moe-a2.7b",
     "Qwen/Qwen1.5-MoE-A2.7B",
     ModelFamily::kQwen2Moe,
     "Qwen2MoeForCausalLM",
     "qwen2_moe",
     /*hidden=*/2048,
     /*expert_inter=*/1408,
     /*shared_inter=*/5632,
     /*layers=*/24,
     /*heads=*/16,
     /*kv_heads=*/16,
     /*head_dim=*/0,
     /*experts=*/60,
     /*top_k=*/4,
     /*vocab=*/151936,
     /*bos=*/151643,
     /*eos=*/151643,
     14.3e9,
     0.005,
     nullptr},
    // The Hub's remote code names it "PhiMoEForCausalLM"; transformers (and our loader) name the
    // same checkpoint layout "PhimoeForCausalLM".
    {"phi-3.5-moe",
     "microsoft/Phi-3.5-MoE-instruct",
     ModelFamily::kPhimoe,
     "PhimoeForCausalLM",
     "phimoe",
     /*hidden=*/4096,
     /*expert_inter=*/6400,
     /*shared_inter=*/0,
     /*layers=*/32,
     /*heads=*/32,
     /*kv_heads=*/8,
     /*head_dim=*/0,
     /*experts=*/16,
     /*top_k=*/2,
     /*vocab=*/32064,
     /*bos=*/1,
     /*eos=*/32000,
     41.9e9,
     0.005,
     nullptr},
    // head_dim 128 is set in config.json: 32 heads of 128 are twice the hidden size.
    {"qwen3-30b-a3b",
     "Qwen/Qwen3-30B-A3B",
     ModelFamily::kQwen3Moe,
     "Qwen3MoeForCausalLM",
     "qwen3_moe",
     /*hidden=*/2048,
     /*expert_inter=*/768,
     /*shared_inter=*/0,
     /*layers=*/48,
     /*heads=*/32,
     /*kv_heads=*/4,
     /*head_dim=*/128,
     /*experts=*/128,
     /*top_k=*/8,
     /*vocab=*/151936,
     /*bos=*/151643,
     /*eos=*/151645,
     30.5e9,
     0.005,
     nullptr},
    // The 0924 release; its config.json has no bos_token_id.
    {"olmoe-1b-7b",
     "allenai/OLMoE-1B-7B-0924",
     ModelFamily::kOlmoe,
     "OlmoeForCausalLM",
     "olmoe",
     /*hidden=*/2048,
     /*expert_inter=*/1024,
     /*shared_inter=*/0,
     /*layers=*/16,
     /*heads=*/16,
     /*kv_heads=*/16,
     /*head_dim=*/0,
     /*experts=*/64,
     /*top_k=*/8,
     /*vocab=*/50304,
     /*bos=*/std::nullopt,
     /*eos=*/50279,
     6.9e9,
     0.005,
     nullptr},
    // expert_inter is moe_intermediate_size; shared_inter = n_shared_experts x it.
    {"deepseek-v2-lite",
     "deepseek-ai/DeepSeek-V2-Lite",
     ModelFamily::kDeepseekV2,
     "DeepseekV2ForCausalLM",
     "deepseek_v2",
     /*hidden=*/2048,
     /*expert_inter=*/1408,
     /*shared_inter=*/2816,
     /*layers=*/27,
     /*heads=*/16,
     /*kv_heads=*/16,
     /*head_dim=*/0,
     /*experts=*/64,
     /*top_k=*/6,
     /*vocab=*/102400,
     /*bos=*/100000,
     /*eos=*/100001,
     15.7e9,
     0.005,
     &kDeepseekV2Lite},
    // The model card's 671B main-model parameters (685B with the MTP module, not written).
    {"deepseek-v3",
     "deepseek-ai/DeepSeek-V3",
     ModelFamily::kDeepseekV3,
     "DeepseekV3ForCausalLM",
     "deepseek_v3",
     /*hidden=*/7168,
     /*expert_inter=*/2048,
     /*shared_inter=*/2048,
     /*layers=*/61,
     /*heads=*/128,
     /*kv_heads=*/128,
     /*head_dim=*/0,
     /*experts=*/256,
     /*top_k=*/8,
     /*vocab=*/129280,
     /*bos=*/0,
     /*eos=*/1,
     671e9,
     0.005,
     &kDeepseekV3},
    {"kimi-k2",
     "moonshotai/Kimi-K2-Instruct",
     ModelFamily::kDeepseekV3,
     "DeepseekV3ForCausalLM",
     "kimi_k2",
     /*hidden=*/7168,
     /*expert_inter=*/2048,
     /*shared_inter=*/2048,
     /*layers=*/61,
     /*heads=*/64,
     /*kv_heads=*/64,
     /*head_dim=*/0,
     /*experts=*/384,
     /*top_k=*/8,
     /*vocab=*/163840,
     /*bos=*/163584,
     /*eos=*/163585,
     1e12,
     0.005,
     &kKimiK2},
    // zai-org/GLM-4.5-Air: one dense first layer (intermediate 10944), a shared expert, q/k/v
    // biases, RoPE on half of each head. Its card says "106B"; the tensors count 106.85 B
    // (without the multi-token-prediction layer, not written here): within 1%.
    {"glm-4.5-air",
     "zai-org/GLM-4.5-Air",
     ModelFamily::kGlm4Moe,
     "Glm4MoeForCausalLM",
     "glm4_moe",
     /*hidden=*/4096,
     /*expert_inter=*/1408,
     /*shared_inter=*/1408,
     /*layers=*/46,
     /*heads=*/96,
     /*kv_heads=*/8,
     /*head_dim=*/128,
     /*experts=*/128,
     /*top_k=*/8,
     /*vocab=*/151552,
     /*bos=*/std::nullopt,
     /*eos=*/151329,
     106e9,
     0.01,
     nullptr},
    // MiniMaxAI/MiniMax-M2 (its bfloat16 layout; the release is FP8): q/k norms over the whole
    // projections, RoPE on 64 of 128 dims. Its card says "230B"; the tensors count 228.69 B
    // (the Hub's 229 B): within 1%.
    {"minimax-m2",
     "MiniMaxAI/MiniMax-M2",
     ModelFamily::kMinimaxM2,
     "MiniMaxM2ForCausalLM",
     "minimax_m2",
     /*hidden=*/3072,
     /*expert_inter=*/1536,
     /*shared_inter=*/0,
     /*layers=*/62,
     /*heads=*/48,
     /*kv_heads=*/8,
     /*head_dim=*/128,
     /*experts=*/256,
     /*top_k=*/8,
     /*vocab=*/200064,
     /*bos=*/200034,
     /*eos=*/200020,
     230e9,
     0.01,
     nullptr},
    // openai/gpt-oss-20b and -120b in the bfloat16 layout (the release stores the experts in
    // MXFP4): fused experts with biases, attention sinks, alternating sliding layers. The model
    // card's totals: 20.9 B and 116.8 B.
    {"gpt-oss-20b",
     "openai/gpt-oss-20b",
     ModelFamily::kGptOss,
     "GptOssForCausalLM",
     "gpt_oss",
     /*hidden=*/2880,
     /*expert_inter=*/2880,
     /*shared_inter=*/0,
     /*layers=*/24,
     /*heads=*/64,
     /*kv_heads=*/8,
     /*head_dim=*/64,
     /*experts=*/32,
     /*top_k=*/4,
     /*vocab=*/201088,
     /*bos=*/199998,
     /*eos=*/200002,
     20.9e9,
     0.005,
     nullptr},
    {"gpt-oss-120b",
     "openai/gpt-oss-120b",
     ModelFamily::kGptOss,
     "GptOssForCausalLM",
     "gpt_oss",
     /*hidden=*/2880,
     /*expert_inter=*/2880,
     /*shared_inter=*/0,
     /*layers=*/36,
     /*heads=*/64,
     /*kv_heads=*/8,
     /*head_dim=*/64,
     /*experts=*/128,
     /*top_k=*/4,
     /*vocab=*/201088,
     /*bos=*/199998,
     /*eos=*/200002,
     116.8e9,
     0.005,
     nullptr},
};

void Add(std::vector<PlannedTensor>* out, std::string name, std::vector<int64_t> shape,
         TensorInit init = TensorInit::kRandom, TensorRole role = TensorRole::kDense) {
  out->push_back({std::move(name), std::move(shape), init, role});
}

// A decoder layer's linear layer: its weight [out, in] (quantizable) and, with `bias`, its bias
// [out].
void AddLinear(std::vector<PlannedTensor>* out, const std::string& prefix, int64_t out_features,
               int64_t in_features, bool bias, TensorRole role = TensorRole::kDense) {
  Add(out, prefix + ".weight", {out_features, in_features}, TensorInit::kRandom, role);
  out->back().quantizable = true;
  if (role == TensorRole::kRoutedExpert) out->back().expert_matrices = 1;
  if (bias) Add(out, prefix + ".bias", {out_features}, TensorInit::kZeros, role);
}

// A linear weight that stays float in quantized checkpoints: a router, Qwen2-MoE's
// shared_expert_gate, lm_head.
void AddFloatLinear(std::vector<PlannedTensor>* out, const std::string& prefix,
                    int64_t out_features, int64_t in_features,
                    TensorRole role = TensorRole::kDense) {
  Add(out, prefix + ".weight", {out_features, in_features}, TensorInit::kRandom, role);
}

// RMSNorm: weight [h]; LayerNorm (Phi-3.5-MoE): weight and bias [h].
void AddNorm(std::vector<PlannedTensor>* out, const std::string& prefix, int64_t h,
             bool layer_norm) {
  Add(out, prefix + ".weight", {h}, TensorInit::kOnes);
  if (layer_norm) Add(out, prefix + ".bias", {h}, TensorInit::kZeros);
}

// The dense first layers of a DeepSeek model cut to `layers`: at least one MoE layer stays.
uint32_t DeepseekDenseLayers(const DeepseekShape& d, uint32_t layers) {
  return std::min(d.first_k_dense_replace, layers - 1);
}

// DeepSeek's groups for `experts` routed experts: the real ones when they still divide them (two
// experts per group at least), else one group.
std::pair<uint32_t, uint32_t> DeepseekGroups(const DeepseekShape& d, uint32_t experts) {
  if (experts % d.n_group == 0 && experts / d.n_group >= 2) return {d.n_group, d.topk_group};
  return {1, 1};
}

// One DeepSeek decoder layer: MLA, then a dense MLP or experts, gate (with V3's correction
// bias) and shared experts, in transformers' state_dict order.
void PlanDeepseekLayer(std::vector<PlannedTensor>* out, const ModelShape& shape,
                       const ModelSize& size, uint32_t l) {
  const DeepseekShape& d = *shape.deepseek;
  const int64_t h = shape.hidden_size, heads = shape.num_attention_heads;
  const int64_t qk = int64_t{d.qk_nope_head_dim} + d.qk_rope_head_dim;
  const std::string p = "model.layers." + std::to_string(l) + ".";
  const std::string a = p + "self_attn.";
  if (d.q_lora_rank == 0) {
    AddLinear(out, a + "q_proj", heads * qk, h, false);
  } else {
    AddLinear(out, a + "q_a_proj", d.q_lora_rank, h, false);
    AddNorm(out, a + "q_a_layernorm", d.q_lora_rank, false);
    AddLinear(out, a + "q_b_proj", heads * qk, d.q_lora_rank, false);
  }
  AddLinear(out, a + "kv_a_proj_with_mqa", int64_t{d.kv_lora_rank} + d.qk_rope_head_dim, h, false);
  AddNorm(out, a + "kv_a_layernorm", d.kv_lora_rank, false);
  AddLinear(out, a + "kv_b_proj", heads * (int64_t{d.qk_nope_head_dim} + d.v_head_dim),
            d.kv_lora_rank, false);
  AddLinear(out, a + "o_proj", h, heads * d.v_head_dim, false);
  const std::string m = p + "mlp.";
  if (l < DeepseekDenseLayers(d, size.layers)) {
    AddLinear(out, m + "gate_proj", d.dense_intermediate_size, h, false);
    AddLinear(out, m + "up_proj", d.dense_intermediate_size, h, false);
    AddLinear(out, m + "down_proj", h, d.dense_intermediate_size, false);
  } else {
    const int64_t inter = shape.expert_intermediate_size;
    for (int64_t e = 0; e < size.experts; ++e) {
      const std::string q = m + "experts." + std::to_string(e) + ".";
      AddLinear(out, q + "gate_proj", inter, h, false, TensorRole::kRoutedExpert);
      AddLinear(out, q + "up_proj", inter, h, false, TensorRole::kRoutedExpert);
      AddLinear(out, q + "down_proj", h, inter, false, TensorRole::kRoutedExpert);
    }
    AddFloatLinear(out, m + "gate", size.experts, h);
    if (shape.family == ModelFamily::kDeepseekV3) {
      Add(out, m + "gate.e_score_correction_bias", {int64_t{size.experts}}, TensorInit::kZeros);
    }
    const int64_t shared = shape.shared_expert_intermediate_size;
    AddLinear(out, m + "shared_experts.gate_proj", shared, h, false, TensorRole::kSharedExpert);
    AddLinear(out, m + "shared_experts.up_proj", shared, h, false, TensorRole::kSharedExpert);
    AddLinear(out, m + "shared_experts.down_proj", h, shared, false, TensorRole::kSharedExpert);
  }
  AddNorm(out, p + "input_layernorm", h, false);
  AddNorm(out, p + "post_attention_layernorm", h, false);
}

}  // namespace

const std::vector<ModelShape>& ModelShapes() { return kShapes; }

const ModelShape* FindModelShape(std::string_view name) {
  for (const ModelShape& s : kShapes) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

std::string ModelShapeNames() {
  std::string out;
  for (const ModelShape& s : kShapes) out += (out.empty() ? "" : ", ") + std::string(s.name);
  return out;
}

ModelSize RealSize(const ModelShape& shape) {
  return {shape.num_hidden_layers, shape.num_experts, shape.vocab_size};
}

uint64_t PlannedTensor::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

uint64_t RoutedExpertParams(const ModelShape& shape) {
  const uint64_t h = shape.hidden_size, inter = shape.expert_intermediate_size;
  // gpt-oss's experts carry biases: 2I on gate_up, h on down.
  return 3 * h * inter + (shape.family == ModelFamily::kGptOss ? 2 * inter + h : 0);
}

int64_t HeadDim(const ModelShape& shape) {
  return shape.head_dim != 0 ? shape.head_dim : shape.hidden_size / shape.num_attention_heads;
}

std::vector<PlannedTensor> PlanTensors(const ModelShape& shape, const ModelSize& size) {
  const int64_t h = shape.hidden_size;
  const int64_t head_dim = HeadDim(shape);
  const int64_t q_dim = int64_t{shape.num_attention_heads} * head_dim;
  const int64_t kv_dim = int64_t{shape.num_key_value_heads} * head_dim;
  const int64_t inter = shape.expert_intermediate_size;
  const int64_t experts = size.experts;
  const bool qwen = shape.family == ModelFamily::kQwen2Moe;
  const bool phi = shape.family == ModelFamily::kPhimoe;
  const bool glm = shape.family == ModelFamily::kGlm4Moe;
  const bool minimax = shape.family == ModelFamily::kMinimaxM2;
  const bool gpt_oss = shape.family == ModelFamily::kGptOss;
  // Qwen2-MoE and GLM-4.5: bias on q, k and v only; Phi-3.5-MoE and gpt-oss: on all four.
  const bool qkv_bias = qwen || phi || glm || gpt_oss;
  const bool o_bias = phi || gpt_oss;
  // RMSNorm of the projected queries and keys, between the projection and RoPE: Qwen3-MoE's over
  // each head (weight [head_dim], shared by the heads), OLMoE's over the whole projection.
  int64_t q_norm = 0, k_norm = 0;
  if (shape.family == ModelFamily::kQwen3Moe) q_norm = k_norm = head_dim;
  if (shape.family == ModelFamily::kOlmoe || minimax) {
    q_norm = q_dim;
    k_norm = kv_dim;
  }
  // Mixtral, Phi-3.5-MoE and MiniMax-M2: block_sparse_moe, experts w1 (gate), w2 (down), w3
  // (up). The Qwen families, OLMoE and GLM-4.5: mlp, experts gate_proj, up_proj, down_proj.
  const bool block_sparse_moe =
      shape.family == ModelFamily::kMixtral || shape.family == ModelFamily::kPhimoe || minimax;
  // GLM-4.5-Air: one dense first layer, of this width.
  const uint32_t glm_dense_layers = glm ? std::min<uint32_t>(1, size.layers - 1) : 0;
  constexpr int64_t kGlmDenseWidth = 10944;

  std::vector<PlannedTensor> out;
  Add(&out, "model.embed_tokens.weight", {int64_t{size.vocab}, h});
  if (shape.deepseek != nullptr) {
    for (uint32_t l = 0; l < size.layers; ++l) PlanDeepseekLayer(&out, shape, size, l);
    AddNorm(&out, "model.norm", h, false);
    AddFloatLinear(&out, "lm_head", size.vocab, h);
    return out;
  }
  for (uint32_t l = 0; l < size.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    AddLinear(&out, p + "self_attn.q_proj", q_dim, h, qkv_bias);
    AddLinear(&out, p + "self_attn.k_proj", kv_dim, h, qkv_bias);
    AddLinear(&out, p + "self_attn.v_proj", kv_dim, h, qkv_bias);
    AddLinear(&out, p + "self_attn.o_proj", h, q_dim, o_bias);
    if (q_norm > 0) {
      AddNorm(&out, p + "self_attn.q_norm", q_norm, false);
      AddNorm(&out, p + "self_attn.k_norm", k_norm, false);
    }
    if (gpt_oss) Add(&out, p + "self_attn.sinks", {int64_t{shape.num_attention_heads}});
    if (l < glm_dense_layers) {
      const std::string m = p + "mlp.";
      AddLinear(&out, m + "gate_proj", kGlmDenseWidth, h, false);
      AddLinear(&out, m + "up_proj", kGlmDenseWidth, h, false);
      AddLinear(&out, m + "down_proj", h, kGlmDenseWidth, false);
    } else if (gpt_oss) {
      // GptOssMLP: router with a bias; experts fused, x times them ([J, h, 2I], [J, I, h]).
      const std::string m = p + "mlp.";
      AddFloatLinear(&out, m + "router", experts, h);
      Add(&out, m + "router.bias", {experts}, TensorInit::kZeros);
      Add(&out, m + "experts.gate_up_proj", {experts, h, 2 * inter}, TensorInit::kRandom,
          TensorRole::kRoutedExpert);
      out.back().expert_matrices = static_cast<uint32_t>(2 * experts);
      out.back().quantizable = true;  // By --quant mxfp4 only (QuantizedBy).
      Add(&out, m + "experts.gate_up_proj_bias", {experts, 2 * inter}, TensorInit::kZeros,
          TensorRole::kRoutedExpert);
      Add(&out, m + "experts.down_proj", {experts, inter, h}, TensorInit::kRandom,
          TensorRole::kRoutedExpert);
      out.back().expert_matrices = static_cast<uint32_t>(experts);
      out.back().quantizable = true;
      Add(&out, m + "experts.down_proj_bias", {experts, h}, TensorInit::kZeros,
          TensorRole::kRoutedExpert);
    } else if (block_sparse_moe) {
      const std::string m = p + "block_sparse_moe.";
      AddFloatLinear(&out, m + "gate", experts, h);
      // MiniMax-M2's correction bias sits on the block.
      if (minimax) Add(&out, m + "e_score_correction_bias", {experts}, TensorInit::kZeros);
      for (int64_t e = 0; e < experts; ++e) {
        const std::string q = m + "experts." + std::to_string(e) + ".";
        AddLinear(&out, q + "w1", inter, h, false, TensorRole::kRoutedExpert);
        AddLinear(&out, q + "w2", h, inter, false, TensorRole::kRoutedExpert);
        AddLinear(&out, q + "w3", inter, h, false, TensorRole::kRoutedExpert);
      }
    } else {
      // Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock, OlmoeSparseMoeBlock: gate, experts; Qwen2
      // MoE's also shared_expert and shared_expert_gate.
      const std::string m = p + "mlp.";
      AddFloatLinear(&out, m + "gate", experts, h);
      if (glm) Add(&out, m + "gate.e_score_correction_bias", {experts}, TensorInit::kZeros);
      for (int64_t e = 0; e < experts; ++e) {
        const std::string q = m + "experts." + std::to_string(e) + ".";
        AddLinear(&out, q + "gate_proj", inter, h, false, TensorRole::kRoutedExpert);
        AddLinear(&out, q + "up_proj", inter, h, false, TensorRole::kRoutedExpert);
        AddLinear(&out, q + "down_proj", h, inter, false, TensorRole::kRoutedExpert);
      }
      const int64_t shared = shape.shared_expert_intermediate_size;
      if (glm) {
        AddLinear(&out, m + "shared_experts.gate_proj", shared, h, false,
                  TensorRole::kSharedExpert);
        AddLinear(&out, m + "shared_experts.up_proj", shared, h, false, TensorRole::kSharedExpert);
        AddLinear(&out, m + "shared_experts.down_proj", h, shared, false,
                  TensorRole::kSharedExpert);
      } else if (shared > 0) {
        AddLinear(&out, m + "shared_expert.gate_proj", shared, h, false, TensorRole::kSharedExpert);
        AddLinear(&out, m + "shared_expert.up_proj", shared, h, false, TensorRole::kSharedExpert);
        AddLinear(&out, m + "shared_expert.down_proj", h, shared, false, TensorRole::kSharedExpert);
        AddFloatLinear(&out, m + "shared_expert_gate", 1, h, TensorRole::kSharedExpert);
      }
    }
    AddNorm(&out, p + "input_layernorm", h, phi);
    AddNorm(&out, p + "post_attention_layernorm", h, phi);
  }
  AddNorm(&out, "model.norm", h, phi);
  AddFloatLinear(&out, "lm_head", size.vocab, h);
  if (phi) Add(&out, "lm_head.bias", {int64_t{size.vocab}}, TensorInit::kZeros);  // lm_head_bias.
  return out;
}

const std::vector<QuantFormat>& QuantFormats() {
  static const std::vector<QuantFormat> formats = [] {
    QuantSpec fp8;
    fp8.method = QuantMethod::kFp8Block;
    fp8.block_out = fp8.block_in = 128;
    QuantSpec int4_g32;
    int4_g32.method = QuantMethod::kInt4Packed;
    int4_g32.group_size = 32;
    QuantSpec int4_g128 = int4_g32;
    int4_g128.group_size = 128;
    QuantSpec gptq;
    gptq.method = QuantMethod::kGptq;
    gptq.group_size = 128;
    QuantSpec mxfp4;
    mxfp4.method = QuantMethod::kMxfp4;
    mxfp4.group_size = 32;
    QuantSpec awq;
    awq.method = QuantMethod::kAwq;
    awq.group_size = 128;
    awq.symmetric = false;
    return std::vector<QuantFormat>{
        {"fp8", "DeepSeek-V3 / Qwen3-FP8", fp8, /*routed_experts_only=*/false},
        {"int4-g32", "Kimi-K2-Thinking", int4_g32, /*routed_experts_only=*/true},
        {"int4-g128", "llm-compressor W4A16 g128", int4_g128,
         /*routed_experts_only=*/true},
        {"gptq", "AutoGPTQ", gptq, /*routed_experts_only=*/false},
        {"awq", "AutoAWQ", awq, /*routed_experts_only=*/false},
        {"mxfp4", "gpt-oss", mxfp4, /*routed_experts_only=*/true},
    };
  }();
  return formats;
}

const QuantFormat* FindQuantFormat(std::string_view name) {
  for (const QuantFormat& q : QuantFormats()) {
    if (name == q.name) return &q;
  }
  return nullptr;
}

std::string QuantFormatNames() {
  std::string out;
  for (const QuantFormat& q : QuantFormats())
    out += (out.empty() ? "" : ", ") + std::string(q.name);
  return out;
}

bool QuantizedBy(const QuantFormat& format, const PlannedTensor& t) {
  if (!t.quantizable) return false;
  // MXFP4 is gpt-oss's fused experts' format ([J, in, out] tensors); the others store 2-D linears.
  if (format.spec.method == QuantMethod::kMxfp4) return t.shape.size() == 3;
  if (t.shape.size() != 2) return false;
  return !format.routed_experts_only || t.role == TensorRole::kRoutedExpert;
}

uint64_t StoredTensor::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

Result<std::vector<StoredTensor>> StoreTensors(const std::vector<PlannedTensor>& planned,
                                               DType dtype, const QuantFormat* quant) {
  std::vector<StoredTensor> out;
  out.reserve(planned.size());
  for (size_t i = 0; i < planned.size(); ++i) {
    const PlannedTensor& t = planned[i];
    if (quant == nullptr || !QuantizedBy(*quant, t)) {
      out.push_back({t.name, dtype, t.shape, StoredKind::kFloat, i});
      continue;
    }
    if (t.shape.size() == 3) {
      // gpt-oss's fused experts [J, in, out] as MXFP4: "<name>_blocks" [J, out, in/32, 16] and
      // "<name>_scales" [J, out, in/32].
      const int64_t j = t.shape[0], in = t.shape[1], outs = t.shape[2];
      if (std::string why = QuantShapeError(quant->spec, outs, in); !why.empty()) {
        return InvalidArgument("--quant " + std::string(quant->name) + ": tensor " + t.name + " " +
                               why);
      }
      out.push_back(
          {t.name + "_blocks", DType::kU8, {j, outs, in / 32, 16}, StoredKind::kQuantWeight, i});
      out.push_back(
          {t.name + "_scales", DType::kU8, {j, outs, in / 32}, StoredKind::kQuantScale, i});
      continue;
    }
    const int64_t rows = t.shape[0], cols = t.shape[1];
    if (std::string why = QuantShapeError(quant->spec, rows, cols); !why.empty()) {
      return InvalidArgument("--quant " + std::string(quant->name) + ": tensor " + t.name + " " +
                             why + "; this shape cannot be stored in " + quant->spec.Describe());
    }
    // "model.layers.0.mlp.experts.3.up_proj.weight" -> "model.layers.0.mlp.experts.3.up_proj.".
    const std::string prefix = t.name.substr(0, t.name.size() - std::string_view("weight").size());
    for (const QuantTensorSpec& q : QuantTensorsOf(quant->spec, rows, cols)) {
      StoredKind kind = StoredKind::kQuantWeight;
      if (q.role == QuantRole::kScale) kind = StoredKind::kQuantScale;
      if (q.role == QuantRole::kZero) kind = StoredKind::kQuantZero;
      if (q.role == QuantRole::kGroupIndex) kind = StoredKind::kGroupIndex;
      out.push_back({prefix + q.suffix, q.dtypes.front(), q.shape, kind, i});
    }
    if (quant->spec.method == QuantMethod::kInt4Packed) {
      out.push_back({prefix + "weight_shape", DType::kI64, {2}, StoredKind::kWeightShape, i});
    }
  }
  return out;
}

namespace {

// config.json's quantization_config for `quant`, as its checkpoints write it.
Json QuantizationConfig(const QuantFormat& quant, const ModelShape& shape, const ModelSize& size) {
  const QuantSpec& q = quant.spec;
  // The linear modules left in float ("model.layers.0.self_attn.q_proj", "lm_head"). DeepSeek's
  // router (MoEGate) is not an nn.Linear, so compressed-tensors' "Linear" target misses it anyway.
  Json float_linears = Json::array();
  Json routers = Json::array();
  for (const PlannedTensor& t : PlanTensors(shape, size)) {
    if (t.shape.size() != 2 || !t.name.ends_with(".weight") ||
        t.role == TensorRole::kRoutedExpert) {
      continue;
    }
    const std::string module = t.name.substr(0, t.name.size() - std::string_view(".weight").size());
    if (module == "model.embed_tokens" || QuantizedBy(quant, t)) continue;
    const bool router = !t.quantizable && module != "lm_head";
    if (router) routers.push_back(module);
    if (!router || shape.deepseek == nullptr) float_linears.push_back(module);
  }
  switch (q.method) {
    case QuantMethod::kFp8Block:
      return {{"quant_method", "fp8"},
              {"fmt", "e4m3"},
              {"activation_scheme", "dynamic"},
              {"weight_block_size", {q.block_out, q.block_in}}};
    case QuantMethod::kInt4Packed: {
      const Json weights = {{"actorder", nullptr},
                            {"block_structure", nullptr},
                            {"dynamic", false},
                            {"group_size", q.group_size},
                            {"num_bits", 4},
                            {"observer", "minmax"},
                            {"observer_kwargs", Json::object()},
                            {"strategy", "group"},
                            {"symmetric", true},
                            {"type", "int"}};
      return {{"quant_method", "compressed-tensors"},
              {"format", "pack-quantized"},
              {"quantization_status", "compressed"},
              {"config_groups",
               {{"group_0",
                 {{"input_activations", nullptr},
                  {"output_activations", nullptr},
                  {"targets", {"Linear"}},
                  {"weights", weights}}}}},
              {"ignore", float_linears},
              {"kv_cache_scheme", nullptr},
              {"sparsity_config", Json::object()}};
    }
    case QuantMethod::kGptq:
      return {{"quant_method", "gptq"},
              {"bits", 4},
              {"group_size", q.group_size},
              {"desc_act", false},
              {"sym", true},
              {"checkpoint_format", "gptq"},
              {"damp_percent", 0.01},
              {"static_groups", false},
              {"true_sequential", true}};
    case QuantMethod::kAwq:
      return {{"quant_method", "awq"}, {"bits", 4},         {"group_size", q.group_size},
              {"zero_point", true},    {"version", "gemm"}, {"modules_to_not_convert", routers}};
    case QuantMethod::kMxfp4:
      return {{"quant_method", "mxfp4"},
              {"modules_to_not_convert",
               {"model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                "lm_head"}}};
    default:
      return nullptr;
  }
}

}  // namespace

std::string ConfigJson(const ModelShape& shape, const ModelSize& size,
                       const std::string& torch_dtype, std::optional<int32_t> bos_token_id,
                       std::optional<int32_t> eos_token_id, const QuantFormat* quant) {
  // nlohmann::json keeps keys sorted, as transformers' to_json_string does.
  Json c = {
      {"architectures", {shape.architecture}},
      {"model_type", shape.model_type},
      {"attention_dropout", 0.0},
      {"hidden_act", "silu"},
      {"hidden_size", shape.hidden_size},
      {"initializer_range", 0.02},
      {"num_attention_heads", shape.num_attention_heads},
      {"num_key_value_heads", shape.num_key_value_heads},
      {"num_experts_per_tok", shape.top_k},
      {"num_hidden_layers", size.layers},
      {"vocab_size", size.vocab},
      {"output_router_logits", false},
      {"tie_word_embeddings", false},
      {"torch_dtype", torch_dtype},
      {"use_cache", true},
  };
  c["bos_token_id"] = bos_token_id ? Json(*bos_token_id) : Json(nullptr);
  c["eos_token_id"] = eos_token_id ? Json(*eos_token_id) : Json(nullptr);
  switch (shape.family) {
    case ModelFamily::kMixtral:
      c["intermediate_size"] = shape.expert_intermediate_size;
      c["num_local_experts"] = size.experts;
      c["max_position_embeddings"] = 32768;
      c["rms_norm_eps"] = 1e-5;
      c["rope_theta"] = 1e6;
      c["router_aux_loss_coef"] = 0.02;
      c["sliding_window"] = nullptr;
      break;
    case ModelFamily::kQwen2Moe:
      // intermediate_size is the dense MLP width (the shared expert's here); the routed experts'
      // is moe_intermediate_size.
      c["intermediate_size"] = shape.shared_expert_intermediate_size;
      c["moe_intermediate_size"] = shape.expert_intermediate_size;
      c["shared_expert_intermediate_size"] = shape.shared_expert_intermediate_size;
      c["num_experts"] = size.experts;
      c["decoder_sparse_step"] = 1;
      // Not in the Hub's config.json: Qwen2MoeConfig's defaults, written so a loader sees them.
      c["mlp_only_layers"] = Json::array();
      c["qkv_bias"] = true;
      c["rope_scaling"] = nullptr;
      c["norm_topk_prob"] = false;
      c["max_position_embeddings"] = 8192;
      c["max_window_layers"] = 21;
      c["rms_norm_eps"] = 1e-6;
      c["rope_theta"] = 1e6;
      c["router_aux_loss_coef"] = 0.001;
      c["sliding_window"] = 32768;
      c["use_sliding_window"] = false;
      break;
    case ModelFamily::kQwen3Moe:
      // As Qwen/Qwen3-30B-A3B's config.json: intermediate_size is the width of a dense layer's
      // MLP (mlp_only_layers; none here), moe_intermediate_size the routed experts'.
      c["intermediate_size"] = 6144;
      c["moe_intermediate_size"] = shape.expert_intermediate_size;
      c["num_experts"] = size.experts;
      c["head_dim"] = shape.head_dim;
      c["attention_bias"] = false;
      c["decoder_sparse_step"] = 1;
      c["mlp_only_layers"] = Json::array();
      c["norm_topk_prob"] = true;
      c["max_position_embeddings"] = 40960;
      c["max_window_layers"] = 48;
      c["rms_norm_eps"] = 1e-6;
      c["rope_scaling"] = nullptr;
      c["rope_theta"] = 1e6;
      c["router_aux_loss_coef"] = 0.001;
      c["sliding_window"] = nullptr;
      c["use_sliding_window"] = false;
      break;
    case ModelFamily::kOlmoe:
      // As allenai/OLMoE-1B-7B-0924's config.json.
      c["intermediate_size"] = shape.expert_intermediate_size;
      c["num_experts"] = size.experts;
      c["attention_bias"] = false;
      c["clip_qkv"] = nullptr;
      c["norm_topk_prob"] = false;
      c["max_position_embeddings"] = 4096;
      c["pad_token_id"] = 1;
      c["rms_norm_eps"] = 1e-5;
      c["rope_scaling"] = nullptr;
      c["rope_theta"] = 10000.0;
      c["router_aux_loss_coef"] = 0.01;
      break;
    case ModelFamily::kPhimoe:
      c["intermediate_size"] = shape.expert_intermediate_size;
      c["num_local_experts"] = size.experts;
      c["attention_bias"] = true;
      c["lm_head_bias"] = true;
      c["hidden_dropout"] = 0.0;
      c["input_jitter_noise"] = 0.01;
      c["router_jitter_noise"] = 0.01;
      c["router_aux_loss_coef"] = 0.0;
      c["max_position_embeddings"] = 131072;
      c["original_max_position_embeddings"] = 4096;
      c["rms_norm_eps"] = 1e-5;  // LayerNorm eps, under this name.
      c["rope_theta"] = 10000.0;
      // The real model's LongRoPE factors are left out (null = plain RoPE): they change no
      // tensor, and random weights have no long context to keep.
      c["rope_scaling"] = nullptr;
      c["sliding_window"] = 131072;
      break;
    case ModelFamily::kDeepseekV2:
    case ModelFamily::kDeepseekV3: {
      // As the Hub's config.json (V3's FP8 quantization_config only with --quant fp8).
      const DeepseekShape& d = *shape.deepseek;
      const auto [n_group, topk_group] = DeepseekGroups(d, size.experts);
      c["intermediate_size"] = d.dense_intermediate_size;
      c["moe_intermediate_size"] = shape.expert_intermediate_size;
      c["n_routed_experts"] = size.experts;
      c["n_shared_experts"] = d.n_shared_experts;
      c["first_k_dense_replace"] = DeepseekDenseLayers(d, size.layers);
      c["moe_layer_freq"] = 1;
      c["n_group"] = n_group;
      c["topk_group"] = topk_group;
      c["topk_method"] = d.topk_method;
      c["scoring_func"] = d.scoring_func;
      c["norm_topk_prob"] = d.norm_topk_prob;
      c["routed_scaling_factor"] = d.routed_scaling_factor;
      c["q_lora_rank"] = d.q_lora_rank == 0 ? Json(nullptr) : Json(d.q_lora_rank);
      c["kv_lora_rank"] = d.kv_lora_rank;
      c["qk_nope_head_dim"] = d.qk_nope_head_dim;
      c["qk_rope_head_dim"] = d.qk_rope_head_dim;
      c["v_head_dim"] = d.v_head_dim;
      c["attention_bias"] = false;
      c["aux_loss_alpha"] = 0.001;
      c["seq_aux"] = true;
      c["ep_size"] = 1;
      c["pretraining_tp"] = 1;
      c["max_position_embeddings"] = d.max_position_embeddings;
      c["rms_norm_eps"] = 1e-6;
      c["rope_theta"] = d.rope_theta;
      c["rope_scaling"] = {{"beta_fast", d.yarn_beta_fast},
                           {"beta_slow", d.yarn_beta_slow},
                           {"factor", d.yarn_factor},
                           {"mscale", d.yarn_mscale},
                           {"mscale_all_dim", d.yarn_mscale},
                           {"original_max_position_embeddings", 4096},
                           {"type", "yarn"}};
      if (shape.family == ModelFamily::kDeepseekV3) c["num_nextn_predict_layers"] = 0;
      break;
    }
    case ModelFamily::kGlm4Moe:
      // As zai-org/GLM-4.5-Air's config.json (its MTP layer not written: 0 of them).
      c["intermediate_size"] = 10944;
      c["moe_intermediate_size"] = shape.expert_intermediate_size;
      c["n_routed_experts"] = size.experts;
      c["n_shared_experts"] = 1;
      c["first_k_dense_replace"] = std::min<uint32_t>(1, size.layers - 1);
      c["head_dim"] = shape.head_dim;
      c["partial_rotary_factor"] = 0.5;
      c["attention_bias"] = true;
      c["use_qk_norm"] = false;
      c["n_group"] = 1;
      c["topk_group"] = 1;
      c["norm_topk_prob"] = true;
      c["routed_scaling_factor"] = 1.0;
      c["num_nextn_predict_layers"] = 0;
      c["max_position_embeddings"] = 131072;
      c["rms_norm_eps"] = 1e-5;
      c["rope_scaling"] = nullptr;
      c["rope_theta"] = 1e6;
      c["pad_token_id"] = 151329;
      break;
    case ModelFamily::kMinimaxM2:
      // As MiniMaxAI/MiniMax-M2's config.json (bfloat16; no MTP modules written).
      c["intermediate_size"] = shape.expert_intermediate_size;
      c["num_local_experts"] = size.experts;
      c["head_dim"] = shape.head_dim;
      c["rotary_dim"] = 64;
      c["use_qk_norm"] = true;
      c["qk_norm_type"] = "per_layer";
      c["scoring_func"] = "sigmoid";
      c["use_routing_bias"] = true;
      c["shared_intermediate_size"] = 0;
      c["num_mtp_modules"] = 0;
      c["max_position_embeddings"] = 196608;
      c["rms_norm_eps"] = 1e-6;
      c["rope_theta"] = 5e6;
      c["router_jitter_noise"] = 0.0;
      break;
    case ModelFamily::kGptOss: {
      // As openai/gpt-oss-20b's config.json, without its MXFP4 quantization_config.
      Json layer_types = Json::array();
      for (uint32_t l = 0; l < size.layers; ++l) {
        layer_types.push_back(l % 2 == 0 ? "sliding_attention" : "full_attention");
      }
      c["intermediate_size"] = shape.expert_intermediate_size;
      c["num_local_experts"] = size.experts;
      c["experts_per_token"] = shape.top_k;
      c["head_dim"] = shape.head_dim;
      c["attention_bias"] = true;
      c["layer_types"] = layer_types;
      c["sliding_window"] = 128;
      c["swiglu_limit"] = 7.0;
      c["initial_context_length"] = 4096;
      c["max_position_embeddings"] = 131072;
      c["rms_norm_eps"] = 1e-5;
      c["rope_theta"] = 150000;
      c["rope_scaling"] = {{"beta_fast", 32.0},   {"beta_slow", 1.0},
                           {"factor", 32.0},      {"original_max_position_embeddings", 4096},
                           {"rope_type", "yarn"}, {"truncate", false}};
      c["router_aux_loss_coef"] = 0.9;
      c["pad_token_id"] = 199999;
      break;
    }
  }
  if (quant != nullptr) c["quantization_config"] = QuantizationConfig(*quant, shape, size);
  return c.dump(2) + "\n";
}

}  // namespace fmoe::bench
