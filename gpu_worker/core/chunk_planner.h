// Expert-aware prefill chunks (DESIGN section 14): how large a prompt's next chunk should be
// when the experts it routes to must come over the link. Chunking bounds the tokens a step
// computes, not the experts it loads: a chunk of T tokens needs about J (1 - (1 - K/J)^T) of a
// layer's J experts (K per token), which nears J within a few dozen tokens, so every chunk of a
// long prompt loads nearly what the whole prompt does. Where loads dominate, small chunks
// multiply a prefill's time (and every decode step sharing those steps waits for it); where
// compute dominates (experts resident, a fast link) they cost almost nothing and cut the decode
// steps' worst stall. The planner keeps the token budget's chunk unless the prefill cut at that
// size would take more than (1 + max_overhead) times its time whole, and then takes the smallest
// larger chunk (doubling) that does not, up to the whole rest of the prompt.
//
// The estimate assumes uniform routing (real routing is skewed, so it errs toward more loads)
// and a device cache that misses `miss` of each layer's experts. Torch-free; pure functions.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>

namespace fmoe {

struct ChunkCosts {
  uint32_t experts = 0;     // Routed experts per MoE layer (J).
  uint32_t top_k = 0;       // Experts per token (K).
  uint32_t moe_layers = 0;  // MoE layers.
  double miss = 0.0;        // Fraction of a layer's experts a chunk must load, [0, 1].
  double load_ns = 0.0;     // One expert over the link.
  double token_ns = 0.0;    // One prompt token's compute through the whole model.

  // Every figure is there (a miss of 0 is a figure: nothing to load).
  bool Known() const {
    return experts > 0 && top_k > 0 && moe_layers > 0 && load_ns > 0.0 && token_ns > 0.0;
  }
};

// Expected distinct experts `tokens` tokens route to in one layer, uniform routing.
double ExpectedExperts(uint32_t experts, uint32_t top_k, double tokens);

// Estimated time to prefill `rest` tokens in chunks of `chunk` (the last one shorter): each
// chunk's loads (its expected experts x miss x load_ns per layer) plus every token's compute.
double PrefillNs(const ChunkCosts& c, uint32_t chunk, uint32_t rest);

// The next chunk of a prompt with `rest` tokens left when the token budget allows `chunk`:
// `chunk` itself when it is the whole rest, the costs are not known, max_overhead <= 0, or
// chunking at that size costs at most (1 + max_overhead) x the whole rest's time; else the
// smallest of chunk x 2, x 4, ... that does, or `rest`.
uint32_t ExpertAwareChunk(const ChunkCosts& c, uint32_t chunk, uint32_t rest, double max_overhead);

// A scheduler's chunk advisor: the chunk to run (>= chunk, <= rest) of a prompt with `rest`
// tokens left when the token budget allows `chunk` (< rest).
using ChunkAdvisor = std::function<uint32_t(uint32_t chunk, uint32_t rest)>;

// The chunk a scheduler runs under `advisor` (the engine's Scheduler and the replay's batcher):
// `chunk` without an advisor, when it is the rest of the prompt or when the advisor keeps it;
// the advisor's larger one when `first` (the step's first prompt chunk, which may pass the
// budget as an uncut prompt does); else 0: it waits for a step where it is first.
uint32_t AdvisedChunk(const ChunkAdvisor& advisor, uint32_t chunk, uint32_t rest, bool first);

// Streaming an iteration's experts (DESIGN section 14; the expert cache's stream buffer): a long
// prefill needs nearly every expert of each layer, so loading each layer's missing experts into a
// buffer beside the cache while the layer before computes (before the layer's routing is known)
// costs few wasted loads and hides the loads behind compute, and it evicts nothing the decode
// steps use. off: never; auto: when StreamSooner says so; on: every iteration with prompt
// tokens.
enum class StreamMode : uint8_t { kOff, kAuto, kOn };
// "off", "auto", "on"; nullopt for another name.
std::optional<StreamMode> StreamModeFromName(std::string_view name);
const char* StreamModeName(StreamMode mode);

// An iteration of `prompt_tokens` prompt tokens and `decode_tokens` decode steps, estimated two
// ways (uniform routing, the cache missing `miss` of each layer's experts). Through the cache:
// per layer the expected experts x miss loads, then the compute, one after the other; with
// decode steps, the loads that bring back what the iteration evicted and the next decode step
// uses (evicted experts x its expected experts / J). Streamed: per layer every missing expert
// (J x miss) loads while the layer before computes: L x max(loads, compute) + the smaller of
// the two once (the pipeline's fill).
double CachedIterationNs(const ChunkCosts& c, uint32_t prompt_tokens, uint32_t decode_tokens);
double StreamedIterationNs(const ChunkCosts& c, uint32_t prompt_tokens, uint32_t decode_tokens);
// Whether streaming is the sooner way: prompt tokens, known costs, and a streamed estimate
// below the cached one.
bool StreamSooner(const ChunkCosts& c, uint32_t prompt_tokens, uint32_t decode_tokens);

}  // namespace fmoe
