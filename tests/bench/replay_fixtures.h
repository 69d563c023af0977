// Small routing traces for the replay's tests, built in memory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/model/expert_trace.h"

namespace fmoe::bench {

// requests[r][i][l]: the experts (ascending) request r's iteration i picks at layer l, one token
// each; sems[r][i] its embedding when hidden > 0; the map is derived.
inline Trace MakeTrace(uint32_t L, uint32_t J, uint32_t K,
                       const std::vector<std::vector<std::vector<std::vector<uint16_t>>>>& requests,
                       const std::vector<std::vector<std::vector<float>>>& sems = {},
                       uint32_t hidden = 0, const std::string& unit = "engine iteration") {
  Trace t;
  t.header = {"test", "test", unit, "test", L, J, K, hidden};
  for (size_t r = 0; r < requests.size(); ++r) {
    for (size_t i = 0; i < requests[r].size(); ++i) {
      TraceIteration it;
      it.request_id = r + 1;
      it.iteration = static_cast<uint32_t>(i);
      it.tokens = 1;
      it.last = i + 1 == requests[r].size();
      it.map_derived = true;
      it.sem = hidden ? sems[r][i] : std::vector<float>{};
      it.used_offsets = {0};
      for (uint32_t l = 0; l < L; ++l) {
        for (uint16_t e : requests[r][i][l]) {
          it.used_experts.push_back(e);
          it.used_tokens.push_back(1);
        }
        it.used_offsets.push_back(static_cast<uint32_t>(it.used_experts.size()));
      }
      EXPECT_TRUE(ValidateTraceIteration(t.header, it).ok());
      t.iterations.push_back(std::move(it));
    }
  }
  return t;
}

}  // namespace fmoe::bench
