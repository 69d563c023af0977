#include "gpu_worker/model_families.h"

namespace fmoe {
namespace {

// Router: "<moe>gate.weight". Qwen2-MoE's shared expert: "mlp.shared_expert.{gate,up,down}_proj"
// and "mlp.shared_expert_gate.weight"; a dense layer: "mlp.{gate,up,down}_proj" (model.cc).
constexpr FamilyTensors kFamilies[] = {
    {"MixtralForCausalLM", "block_sparse_moe.", "w1.weight", "w3.weight", "w2.weight"},
    {"Qwen2MoeForCausalLM", "mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight"},
    {"Qwen3MoeForCausalLM", "mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight"},
    {"OlmoeForCausalLM", "mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight"},
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
