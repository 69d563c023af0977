#include "gpu_worker/model/model_families.h"

namespace fmoe {
namespace {

// Router: "<moe>gate.weight" (DeepSeek-V3 adds "<moe>gate.e_score_correction_bias"). Shared
// experts: "<moe><shared_expert>{gate,up,down}_proj" and Qwen2-MoE's
// "mlp.shared_expert_gate.weight"; a dense layer: "mlp.{gate,up,down}_proj"; MLA:
// "self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm,
// kv_b_proj, o_proj" (model.cc).
constexpr FamilyTensors kFamilies[] = {
    {"MixtralForCausalLM", "block_sparse_moe.", "w1.weight", "w3.weight", "w2.weight", ""},
    {"Qwen2MoeForCausalLM", "mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
     "shared_expert."},
    {"Qwen3MoeForCausalLM", "mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight", ""},
    {"PhimoeForCausalLM", "block_sparse_moe.", "w1.weight", "w3.weight", "w2.weight", ""},
    {"PhiMoEForCausalLM", "block_sparse_moe.", "w1.weight", "w3.weight", "w2.weight", ""},
    {"OlmoeForCausalLM", "mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight", ""},
    {"DeepseekV2ForCausalLM", "mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
     "shared_experts."},
    {"DeepseekV3ForCausalLM", "mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
     "shared_experts."},
};

}  // namespace

Result<const FamilyTensors*> FindFamilyTensors(const std::string& architecture) {
  std::string names;
  for (const FamilyTensors& f : kFamilies) {
    if (architecture == f.architecture) return &f;
    names += (names.empty() ? "" : ", ") + std::string(f.architecture);
  }
  return FailedPrecondition("architectures: \"" + architecture +
                            "\" is not supported by the model runtime (supported: " + names + ")");
}

}  // namespace fmoe
