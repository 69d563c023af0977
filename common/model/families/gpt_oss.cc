// gpt-oss (GptOssForCausalLM): grouped-query attention with q/k/v/o biases and a learned sink
// logit per head, layers alternating sliding-window and full attention by layer_types, YaRN
// rotary scaling (truncate false in the released configs), a router with a bias whose top-k
// logits are weighted by a softmax over those k, and experts with biases computing the clamped
// SwiGLU (swiglu_limit). A layer's experts are stored fused: "mlp.experts.gate_up_proj"
// [J, h, 2I] with gate and up columns interleaved and "mlp.experts.down_proj" [J, I, h] (bfloat16
// checkpoints), or their MXFP4 blocks and scales; the router is "mlp.router".
#include <string>
#include <vector>

#include "common/model/families/config_json.h"
#include "common/model/families/family.h"

namespace fmoe {
namespace {

using namespace config_json;

Status ReadLayerTypes(const Json& j, ModelInfo* info) {
  const uint32_t n = info->num_hidden_layers;
  info->sliding_layers.assign(n, false);
  auto it = j.find("layer_types");
  if (it == j.end() || it->is_null()) {
    // GptOssConfig's default: sliding, full, sliding, ...
    for (uint32_t i = 0; i < n; ++i) info->sliding_layers[i] = (i + 1) % 2 != 0;
    return Status::Ok();
  }
  if (!it->is_array() || it->size() != n) {
    return InvalidArgument("layer_types: not a list of " + std::to_string(n) +
                           " layer types (num_hidden_layers)");
  }
  for (uint32_t i = 0; i < n; ++i) {
    const Json& t = (*it)[i];
    const std::string type = t.is_string() ? t.get<std::string>() : std::string();
    if (type == "sliding_attention") {
      info->sliding_layers[i] = true;
    } else if (type != "full_attention") {
      return InvalidArgument("layer_types[" + std::to_string(i) + "]: " + t.dump() +
                             " is not \"sliding_attention\" or \"full_attention\"");
    }
  }
  return Status::Ok();
}

Status ParseGptOss(const Json& j, ModelInfo* info) {
  FMOE_RETURN_IF_ERROR(ReadCount(j, "intermediate_size", true, &info->intermediate_size));
  FMOE_RETURN_IF_ERROR(ReadSlidingWindow(j, &info->sliding_window));
  FMOE_RETURN_IF_ERROR(ReadLayerTypes(j, info));
  bool any_sliding = false;
  for (bool s : info->sliding_layers) any_sliding = any_sliding || s;
  if (any_sliding && !info->sliding_window) {
    return InvalidArgument("sliding_window: missing, and layer_types has sliding layers");
  }
  FMOE_RETURN_IF_ERROR(ReadYarnScaling(j, info));
  // GptOssConfig sets attention_bias true whatever config.json says.
  info->qkv_bias = true;
  info->o_bias = true;
  info->attention_sinks = true;
  info->router_bias = true;
  info->expert_bias = true;
  double limit = 7.0;  // GptOssConfig's default.
  FMOE_RETURN_IF_ERROR(ReadPositiveDouble(j, "swiglu_limit", &limit));
  info->swiglu_limit = limit;
  info->routing.scoring = RouterScoring::kSoftmaxTopK;
  info->routing.normalize_topk = false;
  return Status::Ok();
}

}  // namespace

const ModelFamily& GptOssFamily() {
  static const ModelFamily kFamily{
      .architectures = {"GptOssForCausalLM"},
      .experts_key = "num_local_experts",
      .reads_head_dim = true,
      .reads_rope_scaling = true,
      .parse = ParseGptOss,
      .tensors = {.moe = "mlp.",
                  .expert_gate = "gate_up_proj",
                  .expert_up = "gate_up_proj",
                  .expert_down = "down_proj",
                  .shared_expert = "",
                  .router = "router",
                  .fused_experts = true},
  };
  return kFamily;
}

}  // namespace fmoe
