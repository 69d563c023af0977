// The expert cache policies by name (DESIGN section 6): one table for the manifest's validation
// (common/manifest.h), the policy factory (gpu_worker/cache/policies/policy_factory.h MakePolicy,
// which builds every name here), the benchmarks' option checks and every help text that lists
// policies. Header only, Torch-free, no state.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

namespace fmoe {

struct PolicyName {
  std::string_view name;
  std::string_view description;  // One line, for help texts.
  // Accepted in a manifest; false = replay only (it needs the future access sequence).
  bool servable = true;
};

inline constexpr PolicyName kPolicyNames[] = {
    {"fmoe", "the map service's directives; evicts the expert whose next use is furthest away"},
    {"fmoe-traj", "fmoe, the map service matching trajectories only (no semantic search)"},
    {"fmoe-traj-sem", "fmoe, the map service without similarity-aware selection"},
    {"fmoe-pfreq", "fmoe's directives with the paper's p * freq eviction"},
    {"fmoe-nextuse", "fmoe's directives; evicts by the directives' next use, deadline-admitted"},
    {"moe-infinity", "MoE-Infinity: activation-matrix matching, multi-layer prefetch"},
    {"speculative", "later layers' gates on the current hidden state; LRU eviction"},
    {"on-demand", "no prefetch; evicts the expert loaded longest ago"},
    {"lru", "no prefetch; evicts the least recently used"},
    {"lfu", "no prefetch; evicts the least frequently used"},
    {"oracle", "replay only: the recorded future accesses (Belady)", /*servable=*/false},
};

// Every name, in table order.
inline std::vector<std::string> AllPolicyNames() {
  std::vector<std::string> out;
  for (const PolicyName& p : kPolicyNames) out.emplace_back(p.name);
  return out;
}

// The table entry for `name`; nullptr when there is none.
inline const PolicyName* FindPolicyName(std::string_view name) {
  for (const PolicyName& p : kPolicyNames) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

// "fmoe, fmoe-traj, ..., lfu" (servable only) or every name, in table order.
inline std::string PolicyNameList(bool servable_only) {
  std::string out;
  for (const PolicyName& p : kPolicyNames) {
    if (servable_only && !p.servable) continue;
    if (!out.empty()) out += ", ";
    out += p.name;
  }
  return out;
}

// One line per policy, "  name  description", for a command's help.
inline std::string PolicyHelp(bool servable_only) {
  size_t width = 0;
  for (const PolicyName& p : kPolicyNames) width = std::max(width, p.name.size());
  std::string out;
  for (const PolicyName& p : kPolicyNames) {
    if (servable_only && !p.servable) continue;
    out += "  ";
    out += p.name;
    out.append(width + 2 - p.name.size(), ' ');
    out += p.description;
    out += '\n';
  }
  return out;
}

}  // namespace fmoe
