// What Qwen2-MoE and Qwen3-MoE read alike (qwen2_moe.cc, qwen3_moe.cc).
#pragma once

#include "common/model/families/config_json.h"
#include "common/model/model_config.h"

namespace fmoe::config_json {

// The MoE layers: Qwen's families interleave dense layers by decoder_sparse_step and
// mlp_only_layers (transformers: layer i is sparse when i is not in mlp_only_layers and
// (i + 1) % decoder_sparse_step == 0).
Status ReadQwenLayers(const Json& j, ModelInfo* info);

// use_sliding_window: true is refused (the Qwen MoE families' window is not implemented).
Status RefuseQwenSlidingWindow(const Json& j);

// What both Qwen MoE families read first: their MoE layers, the refused sliding window, and the
// routed experts' width (moe_intermediate_size).
Status ReadQwenMoe(const Json& j, ModelInfo* info);

}  // namespace fmoe::config_json
