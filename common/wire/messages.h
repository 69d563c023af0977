// Wire messages (DESIGN section 8) as plain structs. Two channels, each one FlatBuffers root
// with its own file identifier: router <-> worker leader ("FMWK", schemas/worker.fbs) and
// worker rank <-> map service ("FMMP", schemas/map.fbs). Encoding and decoding live in
// common/wire/codec.cc; nothing else sees FlatBuffers types.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace fmoe {

inline constexpr uint32_t kProtocolVersion = 1;

// ---- router <-> worker leader ----

// Leader -> router, on connect and after the router reports it unknown.
struct WorkerHello {
  std::string group;
  uint32_t world_size = 1;
  std::string model_name;
  uint64_t model_fingerprint = 0;
  uint64_t instance_id = 0;  // Random per process start: a change means the worker restarted.
  uint32_t max_batch = 0;
  uint32_t free_slots = 0;
  uint32_t protocol_version = kProtocolVersion;
};

// Router -> leader.
struct WorkerHelloAck {
  bool accepted = false;
  std::string reason;  // Why not accepted.
};

// Expert cache totals a worker reports (DESIGN section 6 statistics).
struct ExpertFigures {
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t prefetches_issued = 0;
  uint64_t prefetches_used = 0;
  uint64_t bytes_moved = 0;
  uint64_t stall_us = 0;
  uint64_t host_runs = 0;  // Hybrid execution: missing experts run on the host instead.
  uint64_t host_us = 0;    // Their time.
  uint64_t bytes_not_moved = 0;
  // The host tier (experts left on disk): misses read from disk first, their bytes, and the
  // compute's wait while one was still being read.
  uint64_t disk_reads = 0;
  uint64_t disk_bytes = 0;
  uint64_t disk_stall_us = 0;
  // Reads of an expert that failed (each try), and experts given up on after the retry: the
  // requests that needed one ended with an error.
  uint64_t failed_loads = 0;
  uint64_t failed_experts = 0;
};

// The leader's paged KV pool (gpu_worker/model/kv_pool.h).
struct KvFigures {
  uint64_t total_blocks = 0;
  uint64_t used_blocks = 0;     // Referenced by a sequence now (<= total_blocks).
  uint64_t prefix_queries = 0;  // Prompt tokens looked up in the prefix cache since start.
  uint64_t prefix_hits = 0;     // Of those, found (<= prefix_queries).
  uint64_t preemptions = 0;     // Running requests preempted since start.
  // One device budget (manifest `memory`; 0 without): the most blocks the pool may hold
  // (>= total_blocks), and the device bytes the KV pool and the expert cache hold now.
  uint64_t max_blocks = 0;
  uint64_t kv_bytes = 0;
  uint64_t expert_bytes = 0;
  // In a group of several ranks with one device budget: every rank's split (index = rank; rank
  // 0's equals the two above), as of the group's last iteration. Each rank's pool borrows from
  // its own expert cache, so the followers' splits differ from the leader's. Empty otherwise.
  struct RankSplit {
    uint64_t kv_bytes = 0;
    uint64_t expert_bytes = 0;
  };
  std::vector<RankSplit> ranks = {};
};

// The leader's engine (gpu_worker/engine/engine.h): its prompt chunks since start.
struct EngineFigures {
  uint64_t prompt_chunks = 0;  // Prompt chunks run (a prompt the budget does not cut is one).
  uint64_t chunks_grown = 0;   // Of those, chunks the expert-aware advisor grew past the budget's.
  uint64_t prompt_token_ns = 0;  // A prompt token's measured compute (moving average; 0 until
                                 // measured).
  // Iterations whose missing experts were streamed through the buffer beside the cache.
  uint64_t streamed_iterations = 0;
};

// Leader -> router, every heartbeat interval.
struct WorkerHeartbeat {
  std::string group;
  uint64_t instance_id = 0;
  uint64_t seq = 0;
  uint32_t free_slots = 0;
  uint32_t active_requests = 0;
  ExpertFigures experts;  // The expert cache since start.
  KvFigures kv;
  EngineFigures engine;
};

// Router -> leader, answering a heartbeat. known=false asks the worker to send Hello again.
struct WorkerHeartbeatAck {
  uint64_t seq = 0;
  bool known = false;
};

// How SamplingParams.grammar is read (fmoe.wire.fb.GrammarSyntax).
enum class GrammarSyntax : uint8_t { kGbnf = 0, kRegex, kStructuralTag };
inline constexpr uint8_t kGrammarSyntaxMax = static_cast<uint8_t>(GrammarSyntax::kStructuralTag);

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy.
  float top_p = 1.0f;
  int32_t top_k = 0;  // 0 = off.
  uint64_t seed = 0;
  uint32_t max_tokens = 16;
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop;  // Always empty: the router matches stop strings (refused).
  // Logits processing, in vLLM's order: logit_bias, min_tokens, the penalties, temperature,
  // min_p, top_k, top_p. Greedy decoding takes the highest processed logit.
  // Added to a token's logit; -100 to 100. ({} keeps designated initializers warning-free.)
  std::vector<std::pair<int32_t, float>> logit_bias{};
  uint32_t min_tokens = 0;         // Until this many tokens, eos and stop_token_ids cannot be drawn
                                   // (nor are the router's stop strings looked for in their text).
  bool ignore_eos = false;         // The model's eos tokens do not end generation.
  float presence_penalty = 0.0f;   // -2 to 2: subtracted once from each token of the output.
  float frequency_penalty = 0.0f;  // -2 to 2: subtracted per occurrence in the output.
  float repetition_penalty = 1.0f;  // > 0: divides positive, multiplies negative logits of
                                    // tokens in the prompt or the output.
  float min_p = 0.0f;  // 0 to 1: drops tokens less likely than min_p x the likeliest one.
  // -1: no logprobs. N >= 0: every event carries the drawn token's log-probability and the N
  // likeliest tokens' (N <= 20), from the model's raw logits (log_softmax, as vLLM reports).
  int32_t logprobs = -1;
  // With logprobs >= 0: the first event also carries the prompt's logprobs (completions' echo):
  // for each prompt token after the first, its log-probability given the tokens before it and
  // the `logprobs` likeliest tokens' there.
  bool prompt_logprobs = false;
  // Structured output: the JSON Schema (JSON text) the completion must be an instance of ("":
  // unconstrained). The worker compiles it (common/text/json_schema.h) and masks the tokens
  // that cannot continue a matching text; a schema it cannot compile fails the request.
  std::string json_schema{};
  // Structured output by a grammar instead ("": none; never beside json_schema): GBNF, a regex
  // the whole output matches, or a structural tag's spec (JSON), as grammar_syntax says
  // (common/text/grammar.h). The router sends a choice as the GBNF of its strings.
  std::string grammar{};
  GrammarSyntax grammar_syntax = GrammarSyntax::kGbnf;
  // With json_schema or grammar: the constraint applies only once these tokens have been drawn one
  // after another (a reasoning model's end-of-thinking token, gpt-oss's `<|channel|>final
  // <|message|>`: it thinks freely, then answers in the format); empty: from the first token. At
  // most kMaxConstrainAfter tokens; the worker refuses an id outside the vocabulary.
  std::vector<int32_t> constrain_after{};
};
inline constexpr int32_t kMaxLogprobs = 20;       // SamplingParams.logprobs at most.
inline constexpr size_t kMaxConstrainAfter = 16;  // SamplingParams.constrain_after's tokens.

// Router -> leader.
struct Generate {
  uint64_t request_id = 0;
  std::vector<int32_t> token_ids;
  SamplingParams sampling;
};

// Router -> leader.
struct Cancel {
  uint64_t request_id = 0;
};

enum class FinishReason : uint8_t { kNone = 0, kStop, kLength, kCancelled, kError };
inline constexpr uint8_t kFinishReasonMax = static_cast<uint8_t>(FinishReason::kError);

// Leader -> router, one per generated token (and one final event when finished).
struct TokenEvent {
  uint64_t request_id = 0;
  int32_t token_id = -1;  // -1 when the event carries no token (error, cancel).
  uint32_t index = 0;     // Position in the completion.
  FinishReason finish = FinishReason::kNone;
  std::string error;         // When finish == kError.
  uint64_t queue_us = 0;     // Time queued before prefill (first event only).
  uint64_t token_us = 0;     // Time spent producing this token.
  uint64_t expert_hits = 0;  // Per-request expert figures so far.
  uint64_t expert_misses = 0;
  uint64_t bytes_moved = 0;
  uint64_t expert_host_runs = 0;  // Hybrid execution: see RequestUsage.
  uint64_t expert_host_us = 0;
  uint64_t bytes_not_moved = 0;
  uint64_t expert_disk_reads = 0;  // Host tier: its misses read from disk first.
  uint32_t cached_tokens = 0;      // Prompt tokens found in the prefix cache (first event only).
  // With sampling.logprobs >= 0, on events that carry a token: the token's log-probability and
  // the top sampling.logprobs (id, log-probability), likeliest first.
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top_logprobs{};
  // With sampling.prompt_logprobs, on the request's first event only: prompt token i + 1's
  // log-probability (i = 0 .. prompt length - 2), and prompt_top_n (id, log-probability) pairs
  // per entry, likeliest first, in prompt_top[i * prompt_top_n ..].
  std::vector<float> prompt_logprobs{};
  uint32_t prompt_top_n = 0;
  std::vector<std::pair<int32_t, float>> prompt_top{};
  // token_id is the stop token that ended the request (an eos id or one of stop_token_ids; then
  // finish == kStop): it counts in the usage and the logprobs, as vLLM counts it, but its text
  // is not part of the completion.
  bool stop_token = false;
  // finish == kError at admission: the prompt plus max_tokens exceed what the worker holds (the
  // model's context, or the KV pool's positions): a client error.
  bool too_long = false;
};

// Leader -> router, once, when the group is dead (a rank failed a collective) and the leader is
// about to exit: the router fails the group's started requests and moves the others to another
// group at once, without waiting for the heartbeat timeout.
struct WorkerGoodbye {
  std::string group;
  uint64_t instance_id = 0;  // As in WorkerHello: a goodbye from an older instance is ignored.
  std::string reason;        // For the router's log, e.g. "rank 1 failed all_to_all: ...".
};

// Leader -> router, every heartbeat interval while the leader loads the model (before its
// Hello): the router answers /health 503 "loading" with this progress meanwhile. Not answered.
struct WorkerLoading {
  std::string group;
  uint64_t instance_id = 0;  // As in the Hello that follows.
  uint64_t loaded_bytes = 0;
  uint64_t total_bytes = 0;  // 0 while unknown.
};

using WorkerMessage = std::variant<WorkerHello, WorkerHelloAck, WorkerHeartbeat, WorkerHeartbeatAck,
                                   Generate, Cancel, TokenEvent, WorkerGoodbye, WorkerLoading>;

// ---- worker rank <-> map service ----

// Rank -> map service, on connect and after the service reports it unknown.
struct Register {
  std::string group;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint64_t instance_id = 0;
  uint64_t model_fingerprint = 0;
  uint32_t num_layers = 0;   // L: MoE layers.
  uint32_t num_experts = 0;  // J: routed experts per layer.
  uint32_t top_k = 0;        // K.
  uint32_t hidden_size = 0;  // h.
  uint32_t protocol_version = kProtocolVersion;
  // How the service matches this rank's contexts (the fmoe-traj / fmoe-traj-sem ablations).
  bool semantic = true;  // Semantic search at iteration start.
  bool delta = true;     // Similarity-aware selection; off = exactly top-k.
};

// Map service -> rank, after the registration is durably recorded.
struct RegisterAck {
  bool accepted = false;
  std::string reason;
  uint64_t stored_maps = 0;  // Maps already stored for this model.
};

struct RankHeartbeat {
  std::string group;
  uint32_t rank = 0;
  uint64_t instance_id = 0;
  uint64_t seq = 0;
};

struct RankHeartbeatAck {
  uint64_t seq = 0;
  bool known = false;  // false: send Register again.
};

struct IterationStart {
  uint64_t request_id = 0;
  uint32_t iteration = 0;  // 0 = prefill.
  std::vector<float> sem;  // Semantic embedding, length h.
};

struct LayerObserved {
  uint64_t request_id = 0;
  uint32_t iteration = 0;
  uint32_t layer = 0;        // 0-based MoE layer index.
  std::vector<float> probs;  // Gate distribution P_l, length J.
};

struct IterationEnd {
  uint64_t request_id = 0;
  uint32_t iteration = 0;
  bool finished = false;  // The request ended: free its state.
};

struct PrefetchEntry {
  uint32_t expert = 0;
  float probability = 0.0f;
  float priority = 0.0f;
};

struct PrefetchDirective {
  uint64_t request_id = 0;
  uint32_t iteration = 0;
  uint32_t target_layer = 0;
  float score = 0.0f;  // Similarity of the matched map.
  std::vector<PrefetchEntry> entries;
};

// kDrop removes the model `model_fingerprint` (its record, maps and ranks) from the store.
enum class AdminOp : uint8_t { kPing = 0, kStats, kExport, kImport, kDrop };
inline constexpr uint8_t kAdminOpMax = static_cast<uint8_t>(AdminOp::kDrop);

// Any client (fmoe CLI, router) -> map service.
struct AdminRequest {
  uint64_t id = 0;  // Echoed in the reply.
  AdminOp op = AdminOp::kPing;
  uint64_t model_fingerprint = 0;  // For export/import; 0 = all.
  std::string path;                // File for export/import.
};

struct AdminReply {
  uint64_t id = 0;
  bool ok = false;
  std::string error;
  std::string json;  // Op-specific body (JSON object text).
};

// Map service -> the rank whose IterationEnd completed a map: the map is durably stored.
struct MapStored {
  uint64_t request_id = 0;
  uint32_t iteration = 0;
  uint64_t entry_id = 0;
  uint64_t replaced_id = 0;  // The entry deduplication replaced; 0 = none.
};

using MapMessage = std::variant<Register, RegisterAck, RankHeartbeat, RankHeartbeatAck,
                                IterationStart, LayerObserved, IterationEnd, PrefetchDirective,
                                AdminRequest, AdminReply, MapStored>;

}  // namespace fmoe
