// libFuzzer target for the iteration plan a follower rank decodes from its leader's broadcast
// (gpu_worker/core/group_plan.cc): bytes from another process. Checked, besides ASan/UBSan: a
// plan the decoder takes encodes back to exactly the bytes it came from (the format has one
// spelling per plan), and every plan it takes respects the limits it was given. A violation
// aborts with __builtin_trap. Seeds: tests/fuzz/make_plan_corpus.cc.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "gpu_worker/core/group_plan.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fmoe::PlanLimits limits;
  limits.max_sequences = 64;
  limits.max_ended = 256;
  limits.max_tokens = 4096;
  limits.vocab_size = 1000;
  auto plan = fmoe::DecodePlan(std::span<const uint8_t>(data, size), limits);
  if (!plan.ok()) return 0;
  Check(plan->sequences.size() <= limits.max_sequences);
  Check(plan->ended.size() <= limits.max_ended);
  for (const fmoe::PlannedSequence& s : plan->sequences) {
    Check(!s.tokens.empty() && s.tokens.size() <= limits.max_tokens);
    Check(s.prefill || s.tokens.size() == 1);
    Check(s.prefill || s.iteration > 0);
    for (int32_t t : s.tokens) Check(t >= 0 && static_cast<uint32_t>(t) < limits.vocab_size);
  }
  const std::vector<uint8_t> again = fmoe::EncodePlan(*plan);
  Check(again.size() == size && std::equal(again.begin(), again.end(), data));
  return 0;
}
