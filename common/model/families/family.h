// A model family: everything fmoe knows of one architecture in one file (common/model/families/
// <family>.cc): which config.json "architectures" names it serves, what its config.json says
// beyond the fields every family shares (the parser, which also sets the ModelInfo flags that
// pick the runtime's blocks: routing, norms, q/k norm, biases, MLA, rotary scaling, shared
// experts, dense layers), and where its checkpoint keeps a layer's experts. Adding a family is
// its file plus its line in AllModelFamilies() (families.cc); a new kind of block also needs
// gpu_worker/model/blocks.h (docs/MODELS.md). Torch-free: the router, the map service and the
// launcher read configs through it as the worker does.
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "common/json.h"
#include "common/model/model_config.h"
#include "common/status.h"

namespace fmoe {

// Where a family's checkpoint keeps its MoE tensors. The router is "<moe>gate.weight"
// (DeepSeek-V3 adds "<moe>gate.e_score_correction_bias"); shared experts
// "<moe><shared_expert>{gate,up,down}_proj" (Qwen2-MoE adds "mlp.shared_expert_gate.weight");
// a dense layer "mlp.{gate,up,down}_proj"; MLA "self_attn.{q_proj | q_a_proj, q_a_layernorm,
// q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj" (gpu_worker/model/model.cc).
struct ExpertTensorNames {
  // Under "model.layers.N.": the MoE block ("block_sparse_moe." or "mlp."); a routed expert's
  // three matrices are under "<moe>experts.E.".
  const char* moe;
  const char* expert_gate;  // e.g. "w1.weight" or "gate_proj.weight"
  const char* expert_up;    // e.g. "w3.weight" or "up_proj.weight"
  const char* expert_down;  // e.g. "w2.weight" or "down_proj.weight"
  // Under "<moe>": the shared experts' MLP ("shared_expert." Qwen2-MoE, "shared_experts."
  // DeepSeek), when config.json gives them a width; "" for none.
  const char* shared_expert;
  // Under "<moe>": DeepSeek-V3's router correction bias [J] (where the family has one).
  const char* correction_bias = "gate.e_score_correction_bias";
  // Under "<moe>": the router's linear layer ("<router>.weight", "<router>.bias").
  const char* router = "gate";
  // gpt-oss: a layer's experts in two tensors, "<moe>experts.<expert_gate>" [J, h, 2I] with gate
  // and up columns interleaved (2i gate, 2i + 1 up) and "<moe>experts.<expert_down>" [J, I, h]
  // (x times them, not nn.Linear's transpose), biases "<name>_bias" [J, 2I] and [J, h]; or, MXFP4,
  // "<name>_blocks" and "<name>_scales" in nn.Linear's [out, in] order.
  bool fused_experts = false;
};

struct ModelFamily {
  // config.json "architectures"[0] names this family serves (the first is its own).
  std::vector<const char*> architectures;
  const char* experts_key;  // The config key holding J, the routed experts per layer.
  // Whether the family's attention reads config "head_dim"; otherwise it is always
  // hidden_size / num_attention_heads (transformers' Qwen2-MoE and OLMoE), or with MLA the
  // rotary width.
  bool reads_head_dim = false;
  // Whether the parser reads rope_scaling (DeepSeek's YaRN, Phi's LongRoPE); otherwise a
  // rope_scaling is refused as not implemented.
  bool reads_rope_scaling = false;
  // Whether RoPE may rotate only part of each head: the fraction config.json's
  // partial_rotary_factor gives (or rotary_dim, the width), this default when neither is there
  // (GLM-4.5: 0.5). 0: the family rotates whole heads, and either key is refused unless it says
  // so (1.0, or head_dim).
  double partial_rotary_default = 0.0;
  // What config.json says beyond the shared fields, into `info` (whose shared counts, the
  // architecture and moe_layers = every layer are already set). Defaults are transformers'.
  Status (*parse)(const nlohmann::json& config, ModelInfo* info) = nullptr;
  ExpertTensorNames tensors;
};

// Every family, in the order error messages list them.
std::span<const ModelFamily* const> AllModelFamilies();

// The family serving `architecture`; kInvalidArgument naming the supported ones otherwise.
Result<const ModelFamily*> FindModelFamily(std::string_view architecture);

// One per file of this folder.
const ModelFamily& MixtralFamily();     // mixtral.cc
const ModelFamily& Qwen2MoeFamily();    // qwen2_moe.cc
const ModelFamily& Qwen3MoeFamily();    // qwen3_moe.cc
const ModelFamily& OlmoeFamily();       // olmoe.cc
const ModelFamily& PhimoeFamily();      // phimoe.cc
const ModelFamily& DeepseekV2Family();  // deepseek.cc (V2 and V3 share one code path)
const ModelFamily& DeepseekV3Family();  // deepseek.cc
const ModelFamily& Glm4MoeFamily();     // glm4_moe.cc
const ModelFamily& MinimaxM2Family();   // minimax_m2.cc
const ModelFamily& GptOssFamily();      // gpt_oss.cc

}  // namespace fmoe
