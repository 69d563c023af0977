// Readers of config.json fields that the shared parser (common/model/model_config.cc) and the
// families' parsers use: each checks the type and range and names the key in its error.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>

#include "common/json.h"
#include "common/model/model_config.h"
#include "common/model/routing.h"
#include "common/status.h"

namespace fmoe::config_json {

using Json = nlohmann::json;

// A positive integer key that fits int32; `required` says whether absence is an error (absence
// or null otherwise keeps `*out`).
Status ReadCount(const Json& j, const char* key, bool required, uint32_t* out);
// The same for an integer in [min, 2^31) (ReadCount is min 1).
Status ReadInteger(const Json& j, const char* key, bool required, int64_t min, uint32_t* out);
// A finite number > 0; absence keeps `*out` (the default).
Status ReadPositiveDouble(const Json& j, const char* key, double* out);
// A finite number >= 0; absence keeps `*out`.
Status ReadNonNegativeDouble(const Json& j, const char* key, double* out);
// A boolean; absence or null keeps `*out` (the family's default).
Status ReadBool(const Json& j, const char* key, bool* out);
// A family's rope_scaling object: nullptr when absent or null; kInvalidArgument when it is not an
// object, its type ("type" or "rope_type") is not `type`, or it has a key outside `known`.
Result<const Json*> RopeScaling(const Json& j, std::string_view type,
                                const std::set<std::string>& known);
// A YaRN rope_scaling ({"type" or "rope_type": "yarn", "factor",
// "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
// "truncate"}) into info->yarn; absent or null: none. Another type or key is refused, naming it.
Status ReadYarnScaling(const Json& j, ModelInfo* info);
// norm_topk_prob (whether the top-k weights are renormalised), default off, into `routing`.
Status ReadNormTopkProb(const Json& j, RoutingSpec* routing);
// sliding_window, when set, into `*out`.
Status ReadSlidingWindow(const Json& j, std::optional<uint32_t>* out);

}  // namespace fmoe::config_json
