#include "common/model/families/qwen_layers.h"

#include <set>

namespace fmoe::config_json {

Status ReadQwenLayers(const Json& j, ModelInfo* info) {
  uint32_t sparse_step = 1;
  FMOE_RETURN_IF_ERROR(ReadCount(j, "decoder_sparse_step", false, &sparse_step));
  std::set<int64_t> dense_layers;
  if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return InvalidArgument("mlp_only_layers: not a list");
    for (const auto& v : *it) {
      if (!v.is_number_integer()) return InvalidArgument("mlp_only_layers: not integers");
      dense_layers.insert(v.get<int64_t>());
    }
  }
  info->moe_layers.clear();
  for (uint32_t i = 0; i < info->num_hidden_layers; ++i) {
    if (dense_layers.count(i) == 0 && (i + 1) % sparse_step == 0) info->moe_layers.push_back(i);
  }
  return Status::Ok();
}

Status RefuseQwenSlidingWindow(const Json& j) {
  bool use = false;
  FMOE_RETURN_IF_ERROR(ReadBool(j, "use_sliding_window", &use));
  if (use) {
    return InvalidArgument(
        "use_sliding_window: true is not implemented by the model runtime for this family");
  }
  return Status::Ok();
}

Status ReadQwenMoe(const Json& j, ModelInfo* info) {
  FMOE_RETURN_IF_ERROR(ReadQwenLayers(j, info));
  FMOE_RETURN_IF_ERROR(RefuseQwenSlidingWindow(j));
  return ReadCount(j, "moe_intermediate_size", true, &info->intermediate_size);
}

}  // namespace fmoe::config_json
