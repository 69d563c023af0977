// Writes the seed corpus of codec_fuzz: one valid encoded frame of every message of both wire
// channels (fields away from their defaults, vectors with a few elements, PrefetchDirective with
// 0, 1 and 5 entries, iterations 0 and non-zero) into the directory named on the command line,
// one file per frame. Each frame is decoded back before it is written; exits 1 if one fails.
// Usage: make_corpus DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#include "common/wire/codec.h"

namespace fmoe::wire {
namespace {

std::vector<WorkerMessage> WorkerSeeds() {
  return {
      WorkerHello{.group = "g0",
                  .world_size = 4,
                  .model_name = "mixtral",
                  .model_fingerprint = 0x1234abcd5678ef00,
                  .instance_id = 77,
                  .max_batch = 8,
                  .free_slots = 3},
      WorkerHelloAck{.accepted = true, .reason = "ok"},
      WorkerHelloAck{.accepted = false, .reason = "model fingerprint mismatch"},
      WorkerHeartbeat{.group = "g0",
                      .instance_id = 77,
                      .seq = 12,
                      .free_slots = 2,
                      .active_requests = 6,
                      .experts = {.hits = 100,
                                  .misses = 7,
                                  .prefetches_issued = 20,
                                  .prefetches_used = 15,
                                  .bytes_moved = 1u << 30,
                                  .stall_us = 4242}},
      WorkerHeartbeat{.group = "g1",
                      .kv = {.total_blocks = 8,
                             .max_blocks = 20,
                             .kv_bytes = 1u << 20,
                             .expert_bytes = 3u << 20,
                             .ranks = {{1u << 20, 3u << 20}, {2u << 20, 2u << 20}, {0, 4u << 20}}}},
      WorkerHeartbeatAck{.seq = 12, .known = true},
      Generate{.request_id = 9, .token_ids = {1, 2, 3}},
      Generate{.request_id = 10,
               .token_ids = {1, 15043, 29892, 3186, 2},
               .sampling = {.temperature = 0.7f,
                            .top_p = 0.9f,
                            .top_k = 40,
                            .seed = 1234,
                            .max_tokens = 128,
                            .stop_token_ids = {2, 32000},
                            .stop = {"\n\n", "###", "</s>"},
                            .logit_bias = {{2, -100.0f}, {3186, 1.5f}},
                            .min_tokens = 4,
                            .ignore_eos = true,
                            .presence_penalty = 0.5f,
                            .frequency_penalty = 0.25f,
                            .repetition_penalty = 1.2f,
                            .min_p = 0.1f,
                            .logprobs = 3,
                            .prompt_logprobs = true}},
      Cancel{.request_id = 10},
      TokenEvent{.request_id = 10,
                 .token_id = 3186,
                 .index = 4,
                 .queue_us = 150,
                 .token_us = 21000,
                 .expert_hits = 31,
                 .expert_misses = 2,
                 .bytes_moved = 4u << 20,
                 .logprob = -0.5f,
                 .top_logprobs = {{3186, -0.5f}, {29892, -1.25f}, {2, -3.0f}}},
      TokenEvent{.request_id = 13,
                 .token_id = 7,
                 .logprob = -0.25f,
                 .top_logprobs = {{7, -0.25f}},
                 .prompt_logprobs = {-3.5f, -0.75f},
                 .prompt_top_n = 1,
                 .prompt_top = {{15043, -1.5f}, {29892, -0.75f}}},
      TokenEvent{.request_id = 11,
                 .token_id = -1,
                 .index = 0,
                 .finish = FinishReason::kError,
                 .error = "worker out of memory"},
      TokenEvent{.request_id = 12, .token_id = 2, .index = 127, .finish = FinishReason::kLength},
      WorkerGoodbye{.group = "g0",
                    .instance_id = 77,
                    .reason = "rank 1 failed all_to_all: connection reset by peer"},
      WorkerGoodbye{.group = "g1", .instance_id = 78, .reason = ""},
      WorkerLoading{.group = "g0", .instance_id = 79, .loaded_bytes = 5, .total_bytes = 10},
  };
}

std::vector<PrefetchEntry> Entries(int n) {
  std::vector<PrefetchEntry> entries;
  for (int i = 0; i < n; ++i) {
    entries.push_back({.expert = static_cast<uint32_t>(3 * i + 1),
                       .probability = 0.9f / static_cast<float>(i + 1),
                       .priority = static_cast<float>(n - i)});
  }
  return entries;
}

std::vector<MapMessage> MapSeeds() {
  std::vector<MapMessage> seeds = {
      Register{.group = "g0",
               .rank = 1,
               .world_size = 2,
               .instance_id = 77,
               .model_fingerprint = 0x1234abcd5678ef00,
               .num_layers = 32,
               .num_experts = 8,
               .top_k = 2,
               .hidden_size = 4096},
      Register{.group = "traj",
               .rank = 0,
               .world_size = 1,
               .instance_id = 78,
               .model_fingerprint = 0x99,
               .num_layers = 24,
               .num_experts = 60,
               .top_k = 4,
               .hidden_size = 2048,
               .semantic = false,
               .delta = false},
      RegisterAck{.accepted = true, .reason = "registered", .stored_maps = 12345},
      RankHeartbeat{.group = "g0", .rank = 1, .instance_id = 77, .seq = 99},
      RankHeartbeatAck{.seq = 99, .known = true},
      AdminRequest{.id = 5, .op = AdminOp::kStats},
      AdminRequest{.id = 6,
                   .op = AdminOp::kExport,
                   .model_fingerprint = 0x1234abcd5678ef00,
                   .path = "/tmp/maps.fmoe"},
      AdminReply{.id = 5, .ok = true, .json = R"({"maps":12345,"models":1})"},
      AdminReply{.id = 6, .ok = false, .error = "export: /tmp/maps.fmoe: permission denied"},
  };
  for (uint32_t iteration : {0u, 7u}) {
    seeds.push_back(IterationStart{.request_id = 10,
                                   .iteration = iteration,
                                   .sem = {0.25f, -1.5f, 3.0f, 0.0f, -0.125f, 8.0f}});
    seeds.push_back(LayerObserved{.request_id = 10,
                                  .iteration = iteration,
                                  .layer = 2 + iteration,
                                  .probs = {0.5f, 0.25f, 0.125f, 0.0625f, 0.0625f}});
    seeds.push_back(IterationEnd{.request_id = 10, .iteration = iteration, .finished = true});
    seeds.push_back(MapStored{.request_id = 10,
                              .iteration = iteration,
                              .entry_id = 4000 + iteration,
                              .replaced_id = iteration});
    for (int n : {0, 1, 5}) {
      seeds.push_back(PrefetchDirective{.request_id = 10,
                                        .iteration = iteration,
                                        .target_layer = 3 + iteration,
                                        .score = 0.875f,
                                        .entries = Entries(n)});
    }
  }
  return seeds;
}

// Writes `frame` to dir/<prefix>-<index>-<message name>; false (after printing why) on failure.
template <class Message>
bool WriteSeeds(const std::filesystem::path& dir, const char* prefix,
                const std::vector<Message>& seeds) {
  for (size_t i = 0; i < seeds.size(); ++i) {
    const std::vector<uint8_t> frame = Encode(seeds[i]);
    Message decoded;
    DecodeError error;
    if (!Decode(frame, DecodeLimits{}, &decoded, &error) || decoded.index() != seeds[i].index()) {
      std::fprintf(stderr, "make_corpus: %s seed %zu does not decode: %s: %s\n", prefix, i,
                   std::string(DropReasonName(error.reason)).c_str(), error.detail.c_str());
      return false;
    }
    const std::filesystem::path path = dir / (std::string(prefix) + "-" + std::to_string(i) + "-" +
                                              std::string(MessageName(seeds[i])));
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(frame.data()),
              static_cast<std::streamsize>(frame.size()));
    if (!out.flush()) {
      std::fprintf(stderr, "make_corpus: %s: write failed\n", path.c_str());
      return false;
    }
  }
  return true;
}

int Main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_corpus DIR\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    std::fprintf(stderr, "make_corpus: %s: %s\n", dir.c_str(), ec.message().c_str());
    return 1;
  }
  const std::vector<WorkerMessage> worker = WorkerSeeds();
  const std::vector<MapMessage> map = MapSeeds();
  if (!WriteSeeds(dir, "worker", worker) || !WriteSeeds(dir, "map", map)) return 1;
  std::printf("make_corpus: %zu frames in %s\n", worker.size() + map.size(), dir.c_str());
  return 0;
}

}  // namespace
}  // namespace fmoe::wire

int main(int argc, char** argv) { return fmoe::wire::Main(argc, argv); }
