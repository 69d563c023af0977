// The one place that knows every cache policy: builds a policy by its name (common/
// policy_names.h). Above cache_policy.h (the interface and the policies defined there) and
// moe_infinity_policy.h, which include nothing of it.
#pragma once

#include <memory>
#include <string_view>

#include "common/status.h"
#include "gpu_worker/cache/policies/cache_policy.h"

namespace fmoe {

// Builds the policy `name`, any name of common/policy_names.h (oracle needs options.future).
// kInvalidArgument listing the table's names for any other name.
Result<std::unique_ptr<CachePolicy>> MakePolicy(std::string_view name,
                                                const PolicyOptions& options);

}  // namespace fmoe
