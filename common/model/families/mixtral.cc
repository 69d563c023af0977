// Mixtral (MixtralForCausalLM): softmax top-k routing, always renormalised; RMSNorm; plain
// grouped-query attention with an optional sliding window; experts w1/w3/w2 under
// "block_sparse_moe.".
#include "common/model/families/config_json.h"
#include "common/model/families/family.h"

namespace fmoe {
namespace {

using namespace config_json;

Status ParseMixtral(const Json& j, ModelInfo* info) {
  FMOE_RETURN_IF_ERROR(ReadCount(j, "intermediate_size", true, &info->intermediate_size));
  info->routing.normalize_topk = true;  // MixtralSparseMoeBlock always renormalises.
  return ReadSlidingWindow(j, &info->sliding_window);
}

}  // namespace

const ModelFamily& MixtralFamily() {
  static const ModelFamily kFamily{
      .architectures = {"MixtralForCausalLM"},
      .experts_key = "num_local_experts",
      .reads_head_dim = true,
      .parse = ParseMixtral,
      .tensors = {"block_sparse_moe.", "w1.weight", "w3.weight", "w2.weight", ""},
  };
  return kFamily;
}

}  // namespace fmoe
