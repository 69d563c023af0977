#include "gpu_worker/cache/policies/policy_factory.h"

#include <string>

#include "common/policy_names.h"
#include "gpu_worker/cache/policies/moe_infinity_policy.h"

namespace fmoe {

Result<std::unique_ptr<CachePolicy>> MakePolicy(std::string_view name,
                                                const PolicyOptions& options) {
  if (FindPolicyName(name) == nullptr) {
    return InvalidArgument("unknown policy \"" + std::string(name) +
                           "\"; valid: " + PolicyNameList(/*servable_only=*/false));
  }
  if (name == "moe-infinity") {
    // The paper prefetches across every later layer (section 5.1, multi-layer prefetching),
    // weighted by proximity, rather than to a fixed distance.
    PolicyOptions all_layers = options;
    all_layers.prefetch_distance = 0;
    return NewMoeInfinityPolicy(all_layers);
  }
  FMOE_ASSIGN_OR_RETURN(std::unique_ptr<CachePolicy> policy, MakeBuiltinPolicy(name, options));
  if (policy) return policy;
  // cache_policy_test builds every name of the table, so this is a bug caught there.
  return Internal("policy \"" + std::string(name) +
                  "\" is in common/policy_names.h but MakePolicy cannot build it");
}

}  // namespace fmoe
