#include "gpu_worker/core/chunk_planner.h"

#include <algorithm>
#include <cmath>

namespace fmoe {

double ExpectedExperts(uint32_t experts, uint32_t top_k, double tokens) {
  if (experts == 0 || top_k == 0 || tokens <= 0.0) return 0.0;
  const double k = std::min<double>(top_k, experts);
  const double j = experts;
  return j * (1.0 - std::pow(1.0 - k / j, tokens));
}

double PrefillNs(const ChunkCosts& c, uint32_t chunk, uint32_t rest) {
  if (rest == 0) return 0.0;
  chunk = std::clamp<uint32_t>(chunk, 1, rest);
  const uint32_t full = rest / chunk;
  const uint32_t tail = rest % chunk;
  const double experts =
      full * ExpectedExperts(c.experts, c.top_k, chunk) + ExpectedExperts(c.experts, c.top_k, tail);
  const double miss = std::clamp(c.miss, 0.0, 1.0);
  return experts * c.moe_layers * miss * c.load_ns + rest * c.token_ns;
}

uint32_t ExpertAwareChunk(const ChunkCosts& c, uint32_t chunk, uint32_t rest, double max_overhead) {
  if (chunk == 0 || chunk >= rest || !(max_overhead > 0.0) || !c.Known()) return chunk;
  const double limit = (1.0 + max_overhead) * PrefillNs(c, rest, rest);
  for (uint64_t t = chunk; t < rest; t *= 2) {
    if (PrefillNs(c, static_cast<uint32_t>(t), rest) <= limit) return static_cast<uint32_t>(t);
  }
  return rest;
}

uint32_t AdvisedChunk(const ChunkAdvisor& advisor, uint32_t chunk, uint32_t rest, bool first) {
  if (!advisor || chunk == 0 || chunk >= rest) return chunk;
  const uint32_t want = std::clamp(advisor(chunk, rest), chunk, rest);
  if (want == chunk) return chunk;
  return first ? want : 0;
}

std::optional<StreamMode> StreamModeFromName(std::string_view name) {
  if (name == "off") return StreamMode::kOff;
  if (name == "auto") return StreamMode::kAuto;
  if (name == "on") return StreamMode::kOn;
  return std::nullopt;
}

const char* StreamModeName(StreamMode mode) {
  switch (mode) {
    case StreamMode::kOff:
      return "off";
    case StreamMode::kAuto:
      return "auto";
    case StreamMode::kOn:
      return "on";
  }
  return "off";
}

double CachedIterationNs(const ChunkCosts& c, uint32_t prompt_tokens, uint32_t decode_tokens) {
  const double miss = std::clamp(c.miss, 0.0, 1.0);
  const double tokens = static_cast<double>(prompt_tokens) + decode_tokens;
  const double loads = ExpectedExperts(c.experts, c.top_k, tokens) * miss;
  double ns = c.moe_layers * loads * c.load_ns + tokens * c.token_ns;
  if (decode_tokens > 0 && c.experts > 0) {
    const double evicted = std::min(loads, c.experts * (1.0 - miss));
    const double reused = ExpectedExperts(c.experts, c.top_k, decode_tokens) / c.experts;
    ns += c.moe_layers * evicted * reused * c.load_ns;
  }
  return ns;
}

double StreamedIterationNs(const ChunkCosts& c, uint32_t prompt_tokens, uint32_t decode_tokens) {
  const double miss = std::clamp(c.miss, 0.0, 1.0);
  const double tokens = static_cast<double>(prompt_tokens) + decode_tokens;
  const double load = c.experts * miss * c.load_ns;  // A layer's loads.
  const double compute = c.moe_layers == 0 ? 0.0 : tokens * c.token_ns / c.moe_layers;
  return c.moe_layers * std::max(load, compute) + std::min(load, compute);
}

bool StreamSooner(const ChunkCosts& c, uint32_t prompt_tokens, uint32_t decode_tokens) {
  if (prompt_tokens == 0 || !c.Known()) return false;
  return StreamedIterationNs(c, prompt_tokens, decode_tokens) <
         CachedIterationNs(c, prompt_tokens, decode_tokens);
}

}  // namespace fmoe
