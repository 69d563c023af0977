// Where each supported architecture keeps its tensors in a Hugging Face checkpoint. What a family
// computes is read from config.json (common/model/model_config.h: routing, q/k norm, biases, shared
// experts, dense layers); how its tensors are named is here. Adding a family: its config parser
// in common/model/model_config.cc, an entry below, and blocks.h for any new kind of block.
#pragma once

#include <string>

#include "common/status.h"

namespace fmoe {

struct FamilyTensors {
  const char* architecture;  // config.json "architectures"[0].
  // Under "model.layers.N.": the MoE block ("block_sparse_moe." or "mlp."), and a routed
  // expert's three matrices under "<moe>experts.E.".
  const char* moe;
  const char* expert_gate;  // e.g. "w1.weight" or "gate_proj.weight"
  const char* expert_up;    // e.g. "w3.weight" or "up_proj.weight"
  const char* expert_down;  // e.g. "w2.weight" or "down_proj.weight"
  // Under "<moe>": the shared experts' MLP ("shared_expert." Qwen2-MoE, "shared_experts."
  // DeepSeek), when config.json gives them a width.
  const char* shared_expert;
};

// The entry for `architecture`; kFailedPrecondition naming the supported ones when the model
// runtime does not run it.
Result<const FamilyTensors*> FindFamilyTensors(const std::string& architecture);

}  // namespace fmoe
