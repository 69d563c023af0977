#include "common/model/families/config_json.h"

#include <cmath>
#include <limits>
#include <set>
#include <string>

namespace fmoe::config_json {

Status ReadCount(const Json& j, const char* key, bool required, uint32_t* out) {
  return ReadInteger(j, key, required, 1, out);
}

Status ReadInteger(const Json& j, const char* key, bool required, int64_t min, uint32_t* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) return InvalidArgument(std::string(key) + ": missing");
    return Status::Ok();
  }
  if (!it->is_number_integer()) {
    return InvalidArgument(std::string(key) + ": " + it->dump() + " is not an integer");
  }
  int64_t v = it->get<int64_t>();
  if (v < min || v > std::numeric_limits<int32_t>::max()) {
    return InvalidArgument(std::string(key) + ": " + std::to_string(v) + " is out of range");
  }
  *out = static_cast<uint32_t>(v);
  return Status::Ok();
}

Status ReadPositiveDouble(const Json& j, const char* key, double* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_number())
    return InvalidArgument(std::string(key) + ": " + it->dump() + " is not a number");
  double v = it->get<double>();
  if (!std::isfinite(v) || v <= 0) {
    return InvalidArgument(std::string(key) + ": " + it->dump() + " is out of range");
  }
  *out = v;
  return Status::Ok();
}

Status ReadNonNegativeDouble(const Json& j, const char* key, double* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < 0) {
    return InvalidArgument(std::string(key) + ": " + it->dump() + " is not a number >= 0");
  }
  *out = it->get<double>();
  return Status::Ok();
}

Status ReadBool(const Json& j, const char* key, bool* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_boolean())
    return InvalidArgument(std::string(key) + ": " + it->dump() + " is not a boolean");
  *out = it->get<bool>();
  return Status::Ok();
}

Result<const Json*> RopeScaling(const Json& j, std::string_view type,
                                const std::set<std::string>& known) {
  auto it = j.find("rope_scaling");
  if (it == j.end() || it->is_null()) return static_cast<const Json*>(nullptr);
  if (!it->is_object()) return InvalidArgument("rope_scaling: " + it->dump() + " is not an object");
  std::string got;
  for (const char* key : {"type", "rope_type"}) {
    if (auto t = it->find(key); t != it->end() && t->is_string()) got = t->get<std::string>();
  }
  if (got != type) {
    return InvalidArgument("rope_scaling: type \"" + got +
                           "\" is not implemented by the model runtime for this family (only \"" +
                           std::string(type) + "\" is)");
  }
  for (const auto& [key, value] : it->items()) {
    if (known.count(key) == 0) {
      return InvalidArgument("rope_scaling: " + key + " is not implemented by the model runtime");
    }
  }
  return &*it;
}

Status ReadNormTopkProb(const Json& j, RoutingSpec* routing) {
  routing->normalize_topk = false;
  return ReadBool(j, "norm_topk_prob", &routing->normalize_topk);
}

Status ReadSlidingWindow(const Json& j, std::optional<uint32_t>* out) {
  if (auto it = j.find("sliding_window"); it != j.end() && !it->is_null()) {
    uint32_t window = 0;
    FMOE_RETURN_IF_ERROR(ReadCount(j, "sliding_window", true, &window));
    *out = window;
  }
  return Status::Ok();
}

Status ReadYarnScaling(const Json& j, ModelInfo* info) {
  static const std::set<std::string> kKnown = {
      "type",      "rope_type", "factor", "original_max_position_embeddings",
      "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
      "truncate"};
  FMOE_ASSIGN_OR_RETURN(const Json* scaling, RopeScaling(j, "yarn", kKnown));
  if (scaling == nullptr) return Status::Ok();
  const Json& r = *scaling;
  YarnSpec y;
  FMOE_RETURN_IF_ERROR(ReadPositiveDouble(r, "factor", &y.factor).WithContext("rope_scaling"));
  if (r.find("factor") == r.end()) return InvalidArgument("rope_scaling: factor: missing");
  FMOE_RETURN_IF_ERROR(
      ReadCount(r, "original_max_position_embeddings", true, &y.original_max_position_embeddings)
          .WithContext("rope_scaling"));
  FMOE_RETURN_IF_ERROR(
      ReadPositiveDouble(r, "beta_fast", &y.beta_fast).WithContext("rope_scaling"));
  FMOE_RETURN_IF_ERROR(
      ReadPositiveDouble(r, "beta_slow", &y.beta_slow).WithContext("rope_scaling"));
  FMOE_RETURN_IF_ERROR(ReadNonNegativeDouble(r, "mscale", &y.mscale).WithContext("rope_scaling"));
  FMOE_RETURN_IF_ERROR(
      ReadNonNegativeDouble(r, "mscale_all_dim", &y.mscale_all_dim).WithContext("rope_scaling"));
  FMOE_RETURN_IF_ERROR(ReadBool(r, "truncate", &y.truncate).WithContext("rope_scaling"));
  info->yarn = y;
  return Status::Ok();
}

}  // namespace fmoe::config_json
