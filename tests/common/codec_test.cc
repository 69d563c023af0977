// Tests of common/codec: round trips of every message of both channels, and the decoder's
// rejections (size, identifier, Verifier, range checks) with the exact DropReason. Invalid frames
// are made by encoding out-of-range plain structs, patching bytes of a valid frame, or building
// envelopes with the raw FlatBuffers builder (the generated headers are private to fmoe_wire).
#include "common/wire/codec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <variant>

#include <flatbuffers/flatbuffers.h>
#include <gtest/gtest.h>

namespace fmoe::wire {
namespace {

// Vtable slots (schemas/*.fbs field order) used to patch frames.
constexpr flatbuffers::voffset_t Slot(int field) {
  return static_cast<flatbuffers::voffset_t>(4 + 2 * field);
}
constexpr int kEnvelopeBodyType = 1;
constexpr int kEnvelopeBody = 2;

// Offset in `buf` of field `field` of the table at `table`, or 0 when absent.
size_t FieldPos(const std::vector<uint8_t>& buf, size_t table, int field) {
  const auto* t = reinterpret_cast<const flatbuffers::Table*>(buf.data() + table);
  const flatbuffers::voffset_t off = t->GetOptionalFieldOffset(Slot(field));
  return off == 0 ? 0 : table + off;
}
size_t RootPos(const std::vector<uint8_t>& buf) {
  return flatbuffers::ReadScalar<flatbuffers::uoffset_t>(buf.data());
}
size_t Follow(const std::vector<uint8_t>& buf, size_t pos) {
  return pos + flatbuffers::ReadScalar<flatbuffers::uoffset_t>(buf.data() + pos);
}

// A message with the fields `set` assigns, the rest default.
template <class T, class F>
T Make(F set) {
  T m;
  set(m);
  return m;
}

template <class Message>
DecodeError Reject(const std::vector<uint8_t>& frame, const DecodeLimits& limits = {}) {
  Message out;
  DecodeError error;
  EXPECT_FALSE(Decode(frame, limits, &out, &error)) << "decoded " << MessageName(out);
  return error;
}

template <class Message>
Message RoundTrip(const Message& in) {
  const std::vector<uint8_t> frame = Encode(in);
  Message out;
  DecodeError error;
  EXPECT_TRUE(Decode(frame, DecodeLimits{}, &out, &error))
      << DropReasonName(error.reason) << ": " << error.detail;
  EXPECT_EQ(out.index(), in.index());
  EXPECT_EQ(MessageName(out), MessageName(in));
  return out;
}

template <class T, class Message>
T RoundTripAs(const T& plain) {
  Message out = RoundTrip(Message(plain));
  if (!std::holds_alternative<T>(out)) {
    ADD_FAILURE() << "decoded " << MessageName(out);
    return T{};
  }
  return std::get<T>(out);
}

// ---- router <-> worker leader round trips ----

TEST(Codec, RoundTripWorkerHello) {
  WorkerHello in{.group = "g0",
                 .world_size = 4,
                 .model_name = "deepseek-moe-16b",
                 .model_fingerprint = 0x1122334455667788ull,
                 .instance_id = 0xdeadbeefcafeull,
                 .max_batch = 32,
                 .free_slots = 7,
                 .protocol_version = kProtocolVersion};
  auto out = RoundTripAs<WorkerHello, WorkerMessage>(in);
  EXPECT_EQ(out.group, in.group);
  EXPECT_EQ(out.world_size, in.world_size);
  EXPECT_EQ(out.model_name, in.model_name);
  EXPECT_EQ(out.model_fingerprint, in.model_fingerprint);
  EXPECT_EQ(out.instance_id, in.instance_id);
  EXPECT_EQ(out.max_batch, in.max_batch);
  EXPECT_EQ(out.free_slots, in.free_slots);
  EXPECT_EQ(out.protocol_version, in.protocol_version);
}

TEST(Codec, RoundTripWorkerHelloAck) {
  auto out = RoundTripAs<WorkerHelloAck, WorkerMessage>({.accepted = true, .reason = "welcome"});
  EXPECT_TRUE(out.accepted);
  EXPECT_EQ(out.reason, "welcome");
}

TEST(Codec, RoundTripWorkerHeartbeat) {
  WorkerHeartbeat in{
      .group = "grp",
      .instance_id = 99,
      .seq = 1ull << 40,
      .free_slots = 3,
      .active_requests = 12,
      .experts = {1, 2, 3, 4, 1ull << 35, 6, 7, 8, 1ull << 36, 9, 1ull << 37, 10, 11, 1ull << 39},
      .kv = {4096,
             17,
             1ull << 33,
             1ull << 32,
             5,
             8192,
             1ull << 34,
             1ull << 38,
             {{1ull << 34, 1ull << 38}, {1ull << 35, 1ull << 37}}},
      .engine = {1ull << 41, 13, 123456, 77}};
  auto out = RoundTripAs<WorkerHeartbeat, WorkerMessage>(in);
  ASSERT_EQ(out.kv.ranks.size(), 2u);
  EXPECT_EQ(out.kv.ranks[0].kv_bytes, 1ull << 34);
  EXPECT_EQ(out.kv.ranks[0].expert_bytes, 1ull << 38);
  EXPECT_EQ(out.kv.ranks[1].kv_bytes, 1ull << 35);
  EXPECT_EQ(out.kv.ranks[1].expert_bytes, 1ull << 37);
  EXPECT_EQ(out.engine.prompt_chunks, 1ull << 41);
  EXPECT_EQ(out.engine.chunks_grown, 13u);
  EXPECT_EQ(out.engine.prompt_token_ns, 123456u);
  EXPECT_EQ(out.engine.streamed_iterations, 77u);
  EXPECT_EQ(out.kv.total_blocks, 4096u);
  EXPECT_EQ(out.kv.used_blocks, 17u);
  EXPECT_EQ(out.kv.prefix_queries, 1ull << 33);
  EXPECT_EQ(out.kv.prefix_hits, 1ull << 32);
  EXPECT_EQ(out.kv.preemptions, 5u);
  EXPECT_EQ(out.kv.max_blocks, 8192u);
  EXPECT_EQ(out.kv.kv_bytes, 1ull << 34);
  EXPECT_EQ(out.kv.expert_bytes, 1ull << 38);
  EXPECT_EQ(out.experts.hits, 1u);
  EXPECT_EQ(out.experts.misses, 2u);
  EXPECT_EQ(out.experts.prefetches_issued, 3u);
  EXPECT_EQ(out.experts.prefetches_used, 4u);
  EXPECT_EQ(out.experts.bytes_moved, 1ull << 35);
  EXPECT_EQ(out.experts.stall_us, 6u);
  EXPECT_EQ(out.experts.host_runs, 7u);
  EXPECT_EQ(out.experts.host_us, 8u);
  EXPECT_EQ(out.experts.bytes_not_moved, 1ull << 36);
  EXPECT_EQ(out.experts.disk_reads, 9u);
  EXPECT_EQ(out.experts.disk_bytes, 1ull << 37);
  EXPECT_EQ(out.experts.disk_stall_us, 10u);
  EXPECT_EQ(out.experts.failed_loads, 11u);
  EXPECT_EQ(out.experts.failed_experts, 1ull << 39);
  EXPECT_EQ(out.group, in.group);
  EXPECT_EQ(out.instance_id, in.instance_id);
  EXPECT_EQ(out.seq, in.seq);
  EXPECT_EQ(out.free_slots, in.free_slots);
  EXPECT_EQ(out.active_requests, in.active_requests);
}

TEST(Codec, RoundTripWorkerHeartbeatAck) {
  auto out = RoundTripAs<WorkerHeartbeatAck, WorkerMessage>({.seq = 77, .known = true});
  EXPECT_EQ(out.seq, 77u);
  EXPECT_TRUE(out.known);
}

TEST(Codec, RoundTripGenerate) {
  Generate in{.request_id = 0xabcdef0123ull,
              .token_ids = {1, -2, 3, 151643, std::numeric_limits<int32_t>::max()},
              .sampling = {.temperature = 0.7f,
                           .top_p = 0.9f,
                           .top_k = 40,
                           .seed = 1234567,
                           .max_tokens = 256,
                           .stop_token_ids = {2, 151645},
                           .stop = {"\n\n", "User:", "\xe2\x9c\x93"},
                           .logit_bias = {{5, -100.0f}, {151643, 2.5f}, {0, 0.0f}},
                           .min_tokens = 3,
                           .ignore_eos = true,
                           .presence_penalty = 0.5f,
                           .frequency_penalty = -1.25f,
                           .repetition_penalty = 1.1f,
                           .min_p = 0.05f,
                           .logprobs = 5,
                           .prompt_logprobs = true,
                           .json_schema = R"({"type":"object","properties":{"a":{}}})",
                           .constrain_after = {200005, 17196, 200008}}};
  auto out = RoundTripAs<Generate, WorkerMessage>(in);
  EXPECT_EQ(out.request_id, in.request_id);
  EXPECT_EQ(out.token_ids, in.token_ids);
  EXPECT_EQ(out.sampling.temperature, in.sampling.temperature);
  EXPECT_EQ(out.sampling.top_p, in.sampling.top_p);
  EXPECT_EQ(out.sampling.top_k, in.sampling.top_k);
  EXPECT_EQ(out.sampling.seed, in.sampling.seed);
  EXPECT_EQ(out.sampling.max_tokens, in.sampling.max_tokens);
  EXPECT_EQ(out.sampling.stop_token_ids, in.sampling.stop_token_ids);
  EXPECT_EQ(out.sampling.stop, in.sampling.stop);
  EXPECT_EQ(out.sampling.logit_bias, in.sampling.logit_bias);
  EXPECT_EQ(out.sampling.min_tokens, in.sampling.min_tokens);
  EXPECT_EQ(out.sampling.ignore_eos, in.sampling.ignore_eos);
  EXPECT_EQ(out.sampling.presence_penalty, in.sampling.presence_penalty);
  EXPECT_EQ(out.sampling.frequency_penalty, in.sampling.frequency_penalty);
  EXPECT_EQ(out.sampling.repetition_penalty, in.sampling.repetition_penalty);
  EXPECT_EQ(out.sampling.min_p, in.sampling.min_p);
  EXPECT_EQ(out.sampling.logprobs, in.sampling.logprobs);
  EXPECT_TRUE(out.sampling.prompt_logprobs);
  EXPECT_EQ(out.sampling.json_schema, in.sampling.json_schema);
  EXPECT_EQ(out.sampling.constrain_after, (std::vector<int32_t>{200005, 17196, 200008}));
  // Values that happen to be the wire defaults are not lost either (logprobs 0 = the drawn
  // token only, repetition_penalty 1 written or not).
  in.sampling.logprobs = 0;
  in.sampling.repetition_penalty = 1.0f;
  out = RoundTripAs<Generate, WorkerMessage>(in);
  EXPECT_EQ(out.sampling.logprobs, 0);
  EXPECT_EQ(out.sampling.repetition_penalty, 1.0f);
}

TEST(Codec, RoundTripGenerateDefaults) {
  auto out = RoundTripAs<Generate, WorkerMessage>({});
  EXPECT_TRUE(out.token_ids.empty());
  EXPECT_EQ(out.sampling.top_p, 1.0f);
  EXPECT_EQ(out.sampling.max_tokens, 16u);
  EXPECT_TRUE(out.sampling.stop_token_ids.empty());
  EXPECT_TRUE(out.sampling.stop.empty());
  const SamplingParams neutral;
  EXPECT_TRUE(out.sampling.logit_bias.empty());
  EXPECT_EQ(out.sampling.min_tokens, neutral.min_tokens);
  EXPECT_EQ(out.sampling.ignore_eos, neutral.ignore_eos);
  EXPECT_EQ(out.sampling.presence_penalty, neutral.presence_penalty);
  EXPECT_EQ(out.sampling.frequency_penalty, neutral.frequency_penalty);
  EXPECT_EQ(out.sampling.repetition_penalty, neutral.repetition_penalty);
  EXPECT_EQ(out.sampling.min_p, neutral.min_p);
  EXPECT_EQ(out.sampling.logprobs, neutral.logprobs);
  EXPECT_EQ(out.sampling.prompt_logprobs, neutral.prompt_logprobs);
  EXPECT_TRUE(out.sampling.json_schema.empty());
  EXPECT_TRUE(out.sampling.constrain_after.empty());
}

TEST(CodecReject, JsonSchemaOverItsLimit) {
  Generate in;
  in.sampling.json_schema = std::string(100, ' ');
  DecodeLimits limits;
  limits.max_json_schema_bytes = 99;
  WorkerMessage out;
  DecodeError error;
  EXPECT_FALSE(Decode(Encode(WorkerMessage(in)), limits, &out, &error));
  EXPECT_NE(error.detail.find("Generate.sampling.json_schema: 100 bytes > limit 99"),
            std::string::npos)
      << error.detail;
  limits.max_json_schema_bytes = 100;
  EXPECT_TRUE(Decode(Encode(WorkerMessage(in)), limits, &out, &error)) << error.detail;
}

TEST(Codec, RoundTripCancel) {
  auto out = RoundTripAs<Cancel, WorkerMessage>({.request_id = 42});
  EXPECT_EQ(out.request_id, 42u);
}

TEST(Codec, RoundTripTokenEvent) {
  TokenEvent in{
      .request_id = 5,
      .token_id = 151643,
      .index = 17,
      .finish = FinishReason::kError,
      .error = "CUDA out of memory",
      .queue_us = 11,
      .token_us = 22,
      .expert_hits = 33,
      .expert_misses = 44,
      .bytes_moved = 1ull << 33,
      .expert_host_runs = 55,
      .expert_host_us = 66,
      .bytes_not_moved = 1ull << 34,
      .expert_disk_reads = 77,
      .logprob = -0.75f,
      .top_logprobs = {{151643, -0.75f}, {7, -1.5f}, {0, -9999.0f}},
      .prompt_logprobs = {-2.5f, -0.125f, -30.0f},
      .prompt_top_n = 2,
      .prompt_top = {{9, -1.0f}, {4, -2.0f}, {7, -0.125f}, {9, -3.0f}, {1, -0.5f}, {2, -0.75f}}};
  auto out = RoundTripAs<TokenEvent, WorkerMessage>(in);
  EXPECT_EQ(out.request_id, in.request_id);
  EXPECT_EQ(out.token_id, in.token_id);
  EXPECT_EQ(out.index, in.index);
  EXPECT_EQ(out.finish, in.finish);
  EXPECT_EQ(out.error, in.error);
  EXPECT_EQ(out.queue_us, in.queue_us);
  EXPECT_EQ(out.token_us, in.token_us);
  EXPECT_EQ(out.expert_hits, in.expert_hits);
  EXPECT_EQ(out.expert_misses, in.expert_misses);
  EXPECT_EQ(out.bytes_moved, in.bytes_moved);
  EXPECT_EQ(out.expert_host_runs, in.expert_host_runs);
  EXPECT_EQ(out.expert_host_us, in.expert_host_us);
  EXPECT_EQ(out.bytes_not_moved, in.bytes_not_moved);
  EXPECT_EQ(out.expert_disk_reads, in.expert_disk_reads);
  EXPECT_EQ(out.logprob, in.logprob);
  EXPECT_EQ(out.top_logprobs, in.top_logprobs);
  EXPECT_EQ(out.prompt_logprobs, in.prompt_logprobs);
  EXPECT_EQ(out.prompt_top_n, in.prompt_top_n);
  EXPECT_EQ(out.prompt_top, in.prompt_top);
  EXPECT_FALSE(out.stop_token);
  // The stop token that ended a request.
  TokenEvent stop;
  stop.request_id = 6;
  stop.token_id = 2;
  stop.index = 3;
  stop.finish = FinishReason::kStop;
  stop.stop_token = true;
  EXPECT_TRUE((RoundTripAs<TokenEvent, WorkerMessage>(stop).stop_token));
  const TokenEvent defaults = RoundTripAs<TokenEvent, WorkerMessage>({});
  EXPECT_EQ(defaults.token_id, -1);
  EXPECT_EQ(defaults.logprob, 0.0f);
  EXPECT_TRUE(defaults.top_logprobs.empty());
  EXPECT_TRUE(defaults.prompt_logprobs.empty());
  EXPECT_EQ(defaults.prompt_top_n, 0u);
  // The most a request may ask for.
  in.top_logprobs.assign(kMaxLogprobs, {3, -2.0f});
  EXPECT_EQ((RoundTripAs<TokenEvent, WorkerMessage>(in).top_logprobs.size()),
            static_cast<size_t>(kMaxLogprobs));
  // An admission refusal for length: no token, an error; anything else carrying it is refused.
  TokenEvent refusal{.request_id = 6, .finish = FinishReason::kError, .error = "too long"};
  refusal.too_long = true;
  EXPECT_TRUE((RoundTripAs<TokenEvent, WorkerMessage>(refusal).too_long));
  TokenEvent bad = refusal;
  bad.finish = FinishReason::kLength;
  DecodeError error = Reject<WorkerMessage>(Encode(WorkerMessage(bad)));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_NE(error.detail.find("TokenEvent.too_long"), std::string::npos) << error.detail;
}

TEST(Codec, RoundTripWorkerGoodbye) {
  WorkerGoodbye in{.group = "g1",
                   .instance_id = 0xfeedfacecafebeefull,
                   .reason = "rank 2 failed all_to_all: NCCL error: remote process exited"};
  auto out = RoundTripAs<WorkerGoodbye, WorkerMessage>(in);
  EXPECT_EQ(out.group, in.group);
  EXPECT_EQ(out.instance_id, in.instance_id);
  EXPECT_EQ(out.reason, in.reason);
  // The reason may be empty; a reason at the string limit passes.
  in.reason.clear();
  EXPECT_EQ((RoundTripAs<WorkerGoodbye, WorkerMessage>(in).reason), "");
  in.reason = std::string(4096, 'r');
  EXPECT_EQ((RoundTripAs<WorkerGoodbye, WorkerMessage>(in).reason.size()), 4096u);
}

TEST(Codec, RoundTripWorkerLoading) {
  WorkerLoading in{
      .group = "g0", .instance_id = 42, .loaded_bytes = 1 << 20, .total_bytes = 3 << 20};
  auto out = RoundTripAs<WorkerLoading, WorkerMessage>(in);
  EXPECT_EQ(out.group, "g0");
  EXPECT_EQ(out.instance_id, 42u);
  EXPECT_EQ(out.loaded_bytes, uint64_t{1} << 20);
  EXPECT_EQ(out.total_bytes, uint64_t{3} << 20);
  in.total_bytes = 0;  // Not known yet.
  EXPECT_EQ((RoundTripAs<WorkerLoading, WorkerMessage>(in).loaded_bytes), uint64_t{1} << 20);
  EXPECT_EQ(MessageName(WorkerMessage(in)), "WorkerLoading");
}

TEST(CodecReject, LoadingPastItsTotal) {
  WorkerLoading in{.group = "g0", .instance_id = 1, .loaded_bytes = 10, .total_bytes = 9};
  WorkerMessage out;
  DecodeError error;
  EXPECT_FALSE(Decode(Encode(WorkerMessage(in)), DecodeLimits{}, &out, &error));
  EXPECT_EQ(error.detail, "WorkerLoading.loaded_bytes: 10 > total_bytes 9");
  in.total_bytes = 10;
  in.group.clear();
  EXPECT_FALSE(Decode(Encode(WorkerMessage(in)), DecodeLimits{}, &out, &error));
  EXPECT_EQ(error.detail, "WorkerLoading.group: missing (required)");
}

// ---- worker rank <-> map service round trips ----

TEST(Codec, RoundTripRegister) {
  Register in{.group = "g1",
              .rank = 3,
              .world_size = 8,
              .instance_id = 0x55,
              .model_fingerprint = 0xfeedull,
              .num_layers = 27,
              .num_experts = 64,
              .top_k = 6,
              .hidden_size = 2048,
              .protocol_version = kProtocolVersion};
  auto out = RoundTripAs<Register, MapMessage>(in);
  EXPECT_TRUE(out.semantic);
  EXPECT_TRUE(out.delta);
  in.semantic = false;
  EXPECT_FALSE((RoundTripAs<Register, MapMessage>(in).semantic));
  EXPECT_TRUE((RoundTripAs<Register, MapMessage>(in).delta));
  in.semantic = true;
  in.delta = false;
  EXPECT_TRUE((RoundTripAs<Register, MapMessage>(in).semantic));
  EXPECT_FALSE((RoundTripAs<Register, MapMessage>(in).delta));
  EXPECT_EQ(out.group, in.group);
  EXPECT_EQ(out.rank, in.rank);
  EXPECT_EQ(out.world_size, in.world_size);
  EXPECT_EQ(out.instance_id, in.instance_id);
  EXPECT_EQ(out.model_fingerprint, in.model_fingerprint);
  EXPECT_EQ(out.num_layers, in.num_layers);
  EXPECT_EQ(out.num_experts, in.num_experts);
  EXPECT_EQ(out.top_k, in.top_k);
  EXPECT_EQ(out.hidden_size, in.hidden_size);
  EXPECT_EQ(out.protocol_version, in.protocol_version);
}

TEST(Codec, RoundTripRegisterAck) {
  auto out = RoundTripAs<RegisterAck, MapMessage>(
      {.accepted = true, .reason = "ok", .stored_maps = 123456});
  EXPECT_TRUE(out.accepted);
  EXPECT_EQ(out.reason, "ok");
  EXPECT_EQ(out.stored_maps, 123456u);
}

TEST(Codec, RoundTripRankHeartbeat) {
  RankHeartbeat in{.group = "g2", .rank = 1, .instance_id = 9, .seq = 10};
  auto out = RoundTripAs<RankHeartbeat, MapMessage>(in);
  EXPECT_EQ(out.group, in.group);
  EXPECT_EQ(out.rank, in.rank);
  EXPECT_EQ(out.instance_id, in.instance_id);
  EXPECT_EQ(out.seq, in.seq);
}

TEST(Codec, RoundTripRankHeartbeatAck) {
  auto out = RoundTripAs<RankHeartbeatAck, MapMessage>({.seq = 3, .known = true});
  EXPECT_EQ(out.seq, 3u);
  EXPECT_TRUE(out.known);
}

TEST(Codec, RoundTripIterationStart) {
  IterationStart in{.request_id = 8, .iteration = 2, .sem = {}};
  for (int i = 0; i < 256; ++i) in.sem.push_back(std::sin(0.1f * i) * 3.5f);
  auto out = RoundTripAs<IterationStart, MapMessage>(in);
  EXPECT_EQ(out.request_id, in.request_id);
  EXPECT_EQ(out.iteration, in.iteration);
  EXPECT_EQ(out.sem, in.sem);
}

TEST(Codec, RoundTripLayerObserved) {
  LayerObserved in{.request_id = 8, .iteration = 3, .layer = 26, .probs = {0.0f, 0.25f, 1.0f}};
  auto out = RoundTripAs<LayerObserved, MapMessage>(in);
  EXPECT_EQ(out.request_id, in.request_id);
  EXPECT_EQ(out.iteration, in.iteration);
  EXPECT_EQ(out.layer, in.layer);
  EXPECT_EQ(out.probs, in.probs);
}

TEST(Codec, RoundTripIterationEnd) {
  auto out =
      RoundTripAs<IterationEnd, MapMessage>({.request_id = 4, .iteration = 9, .finished = true});
  EXPECT_EQ(out.request_id, 4u);
  EXPECT_EQ(out.iteration, 9u);
  EXPECT_TRUE(out.finished);
}

TEST(Codec, RoundTripPrefetchDirective) {
  PrefetchDirective in{.request_id = 6,
                       .iteration = 1,
                       .target_layer = 12,
                       .score = 0.875f,
                       .entries = {{3, 0.5f, 2.0f}, {63, 1.0f, -1.5f}, {0, 0.0f, 0.0f}}};
  auto out = RoundTripAs<PrefetchDirective, MapMessage>(in);
  EXPECT_EQ(out.request_id, in.request_id);
  EXPECT_EQ(out.iteration, in.iteration);
  EXPECT_EQ(out.target_layer, in.target_layer);
  EXPECT_EQ(out.score, in.score);
  ASSERT_EQ(out.entries.size(), in.entries.size());
  for (size_t i = 0; i < in.entries.size(); ++i) {
    EXPECT_EQ(out.entries[i].expert, in.entries[i].expert) << i;
    EXPECT_EQ(out.entries[i].probability, in.entries[i].probability) << i;
    EXPECT_EQ(out.entries[i].priority, in.entries[i].priority) << i;
  }
}

TEST(Codec, RoundTripAdminRequest) {
  AdminRequest in{.id = 31, .op = AdminOp::kImport, .model_fingerprint = 0xabc, .path = "/tmp/x"};
  auto out = RoundTripAs<AdminRequest, MapMessage>(in);
  EXPECT_EQ(out.id, in.id);
  EXPECT_EQ(out.op, in.op);
  EXPECT_EQ(out.model_fingerprint, in.model_fingerprint);
  EXPECT_EQ(out.path, in.path);
  AdminRequest drop{.id = 32, .op = AdminOp::kDrop, .model_fingerprint = 0xdef, .path = ""};
  auto dropped = RoundTripAs<AdminRequest, MapMessage>(drop);
  EXPECT_EQ(dropped.op, AdminOp::kDrop);
  EXPECT_EQ(dropped.model_fingerprint, 0xdefu);
}

TEST(Codec, RoundTripAdminReply) {
  AdminReply in{.id = 31, .ok = true, .error = "none", .json = R"({"maps":3})"};
  auto out = RoundTripAs<AdminReply, MapMessage>(in);
  EXPECT_EQ(out.id, in.id);
  EXPECT_EQ(out.ok, in.ok);
  EXPECT_EQ(out.error, in.error);
  EXPECT_EQ(out.json, in.json);
}

// Every entry count and a zero (omitted) iteration: the struct vector must keep 8-byte fields
// aligned whatever the table's layout.
TEST(Codec, RoundTripPrefetchDirectiveAnyLayout) {
  for (uint32_t n = 0; n <= 9; ++n) {
    for (uint32_t iteration : {0u, 1u}) {
      PrefetchDirective in{.request_id = 999,
                           .iteration = iteration,
                           .target_layer = 3,
                           .score = 0.93f,
                           .entries = {}};
      for (uint32_t i = 0; i < n; ++i) in.entries.push_back({i, 0.1f * i, 0.05f * i});
      auto out = RoundTripAs<PrefetchDirective, MapMessage>(in);
      EXPECT_EQ(out.request_id, 999u) << n;
      EXPECT_EQ(out.iteration, iteration);
      ASSERT_EQ(out.entries.size(), n);
      for (uint32_t i = 0; i < n; ++i) EXPECT_EQ(out.entries[i].expert, i);
    }
  }
}

TEST(Codec, RoundTripMapStored) {
  MapStored in{.request_id = 77, .iteration = 5, .entry_id = 1234, .replaced_id = 99};
  auto out = RoundTripAs<MapStored, MapMessage>(in);
  EXPECT_EQ(out.request_id, in.request_id);
  EXPECT_EQ(out.iteration, in.iteration);
  EXPECT_EQ(out.entry_id, in.entry_id);
  EXPECT_EQ(out.replaced_id, in.replaced_id);
}

TEST(Codec, DecodesUnalignedFrames) {
  const std::vector<uint8_t> frame = Encode(MapMessage(LayerObserved{.probs = {0.5f, 0.5f}}));
  std::vector<uint8_t> shifted(frame.size() + 1);
  std::memcpy(shifted.data() + 1, frame.data(), frame.size());
  MapMessage out;
  DecodeError error;
  ASSERT_TRUE(Decode(std::span<const uint8_t>(shifted).subspan(1), {}, &out, &error))
      << error.detail;
  EXPECT_EQ(std::get<LayerObserved>(out).probs, (std::vector<float>{0.5f, 0.5f}));
}

TEST(Codec, Names) {
  EXPECT_EQ(MessageName(WorkerMessage(TokenEvent{})), "TokenEvent");
  EXPECT_EQ(MessageName(WorkerMessage(WorkerGoodbye{})), "WorkerGoodbye");
  EXPECT_EQ(MessageName(MapMessage(AdminReply{})), "AdminReply");
  EXPECT_EQ(MessageName(MapMessage(MapStored{})), "MapStored");
  EXPECT_EQ(DropReasonName(DropReason::kOversized), "oversized");
  EXPECT_EQ(DropReasonName(DropReason::kBadFraming), "bad_framing");
}

// ---- rejections: size, identifier, Verifier ----

TEST(CodecReject, Truncated) {
  EXPECT_EQ(Reject<WorkerMessage>({}).reason, DropReason::kTruncated);
  EXPECT_EQ(Reject<MapMessage>({1, 2, 3, 4, 'F', 'M', 'M'}).reason, DropReason::kTruncated);
}

// Every prefix of a valid frame is rejected (or, at full length, decodes the same message).
TEST(CodecReject, EveryPrefix) {
  Generate g{.request_id = 1,
             .token_ids = {1, 2, 3, 4, 5},
             .sampling = {.temperature = 0.5f, .stop_token_ids = {7}, .stop = {"\n"}}};
  const std::vector<uint8_t> frame = Encode(WorkerMessage(g));
  for (size_t n = 0; n < frame.size(); ++n) {
    std::vector<uint8_t> prefix(frame.begin(), frame.begin() + static_cast<ptrdiff_t>(n));
    WorkerMessage out;
    DecodeError error;
    if (Decode(prefix, {}, &out, &error)) {
      ASSERT_TRUE(std::holds_alternative<Generate>(out)) << n;
      EXPECT_EQ(std::get<Generate>(out).token_ids, g.token_ids) << n;
    } else if (n < 8) {
      EXPECT_EQ(error.reason, DropReason::kTruncated) << n;
    }
  }
  PrefetchDirective p{.request_id = 2, .entries = {{1, 0.5f, 1.0f}, {2, 0.25f, 0.5f}}};
  const std::vector<uint8_t> map_frame = Encode(MapMessage(p));
  for (size_t n = 0; n < map_frame.size(); ++n) {
    MapMessage out;
    DecodeError error;
    EXPECT_FALSE(Decode(std::span(map_frame).first(n), {}, &out, &error)) << n;
  }
}

// Flipping any byte of a valid frame must never crash (ASan/UBSan build checks the reads).
TEST(CodecReject, EveryByteFlipped) {
  const std::vector<uint8_t> frame =
      Encode(MapMessage(PrefetchDirective{.request_id = 3, .entries = {{1, 0.5f, 1.0f}}}));
  for (size_t i = 0; i < frame.size(); ++i) {
    for (uint8_t mask : {0x01, 0x80, 0xff}) {
      std::vector<uint8_t> bad = frame;
      bad[i] ^= mask;
      MapMessage out;
      DecodeError error;
      if (!Decode(bad, {}, &out, &error)) {
        EXPECT_FALSE(error.detail.empty());
      }
    }
  }
}

TEST(CodecReject, Oversized) {
  const std::vector<uint8_t> frame = Encode(MapMessage(IterationStart{.sem = {1, 2, 3, 4, 5}}));
  DecodeLimits limits;
  limits.max_bytes = frame.size() - 1;
  const DecodeError error = Reject<MapMessage>(frame, limits);
  EXPECT_EQ(error.reason, DropReason::kOversized);
  EXPECT_NE(error.detail.find("> limit"), std::string::npos) << error.detail;
  limits.max_bytes = frame.size();
  MapMessage out;
  EXPECT_TRUE(Decode(frame, limits, &out, nullptr));
}

TEST(CodecReject, RandomGarbage) {
  std::mt19937 rng(20240611);
  int with_identifier = 0;
  for (int i = 0; i < 4000; ++i) {
    std::vector<uint8_t> buf(rng() % 300);
    for (uint8_t& b : buf) b = static_cast<uint8_t>(rng());
    const bool map = (i & 1) != 0;
    if (buf.size() >= 8 && (i & 2) != 0) {  // Reach the Verifier: valid identifier, small root.
      std::memcpy(buf.data() + 4, map ? kMapIdentifier : kWorkerIdentifier, 4);
      const uint32_t root = rng() % static_cast<uint32_t>(buf.size());
      std::memcpy(buf.data(), &root, 4);
      ++with_identifier;
    }
    DecodeError error;
    if (map) {
      MapMessage out;
      EXPECT_FALSE(Decode(buf, {}, &out, &error)) << i;
    } else {
      WorkerMessage out;
      EXPECT_FALSE(Decode(buf, {}, &out, &error)) << i;
    }
  }
  EXPECT_GT(with_identifier, 1000);
}

TEST(CodecReject, WrongChannel) {
  const auto worker = Encode(WorkerMessage(Cancel{.request_id = 1}));
  const auto map = Encode(MapMessage(IterationEnd{.request_id = 1}));
  DecodeError error = Reject<MapMessage>(worker);
  EXPECT_EQ(error.reason, DropReason::kBadIdentifier);
  EXPECT_NE(error.detail.find("FMWK"), std::string::npos) << error.detail;
  EXPECT_EQ(Reject<WorkerMessage>(map).reason, DropReason::kBadIdentifier);
}

TEST(CodecReject, PatchedIdentifier) {
  auto frame = Encode(WorkerMessage(Cancel{.request_id = 1}));
  std::memcpy(frame.data() + 4, "FMXX", 4);
  EXPECT_EQ(Reject<WorkerMessage>(frame).reason, DropReason::kBadIdentifier);
}

TEST(CodecReject, RootOffsetOutOfBounds) {
  auto frame = Encode(WorkerMessage(Cancel{.request_id = 1}));
  const uint32_t root = 0x7ffffff0;
  std::memcpy(frame.data(), &root, 4);
  EXPECT_EQ(Reject<WorkerMessage>(frame).reason, DropReason::kMalformed);
}

TEST(CodecReject, VerifierTableAndDepthLimits) {
  const auto frame = Encode(
      WorkerMessage(Make<Generate>([](auto& m) { m.token_ids = {1}; })));  // 3 tables, depth 4.
  DecodeLimits limits;
  limits.max_tables = 2;
  EXPECT_EQ(Reject<WorkerMessage>(frame, limits).reason, DropReason::kMalformed);
  limits = {};
  limits.max_depth = 2;
  EXPECT_EQ(Reject<WorkerMessage>(frame, limits).reason, DropReason::kMalformed);
}

// ---- rejections: range checks after verification ----

TEST(CodecReject, UnknownUnionTagPatched) {
  auto frame = Encode(WorkerMessage(Cancel{.request_id = 1}));
  const size_t tag = FieldPos(frame, RootPos(frame), kEnvelopeBodyType);
  ASSERT_NE(tag, 0u);
  frame[tag] = static_cast<uint8_t>(std::variant_size_v<WorkerMessage> + 1);  // One past the last.
  DecodeError error = Reject<WorkerMessage>(frame);
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_NE(error.detail.find("WorkerEnvelope.body_type"), std::string::npos) << error.detail;
  frame[tag] = 0;  // NONE with a body.
  EXPECT_EQ(Reject<WorkerMessage>(frame).reason, DropReason::kOutOfRange);
}

// A frame codec_fuzz found (minimized): a heartbeat whose rank_device_memory structs sit at 4
// bytes past an 8-byte boundary, which the verifier allows (it checks a vector's length word).
// Read in place that is a misaligned 8-byte load (UBSan stops the sanitizer build); the decoder
// copies each field out, so it decodes or is refused like any other frame.
TEST(CodecReject, MisalignedRankSplitsAreReadSafely) {
  const std::string hex =
      "14000000464d574b00000a0010000c000b0004000a00000050000000000000030100000044002c00280000000800"
      "0000"
      "00000000000000000000000000000000000000001000080020000000000000000000000018001000080000000000"
      "0000"
      "00000000000004004400000014000000464d4d5000000100120028000b0004000a00000018000c000b0004000a00"
      "0000"
      "500000000000000301000044002c0028000000280000000000004000000000000000000000023000000000002c00"
      "0000"
      "80002800000000003000000000000000100000009c00140000000800000000000000000000003800000300000000"
      "0010"
      "000000000000000000ff000000000000100000000000000018001000080000000000002800000000000040000000"
      "0000"
      "00008000";
  std::vector<uint8_t> frame;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    frame.push_back(static_cast<uint8_t>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  WorkerMessage out;
  DecodeError error;
  if (Decode(frame, DecodeLimits{}, &out, &error)) {
    EXPECT_TRUE(std::holds_alternative<WorkerHeartbeat>(out)) << MessageName(out);
  } else {
    EXPECT_FALSE(error.detail.empty());
  }
}

// A heartbeat's KV figures must be consistent: no more blocks used than the pool has, no more
// prefix hits than lookups; and no more prompt chunks grown than run.
TEST(CodecReject, HeartbeatKvFiguresOutOfRange) {
  WorkerHeartbeat hb;
  hb.group = "g";
  hb.kv = {.total_blocks = 8, .used_blocks = 9};
  DecodeError error = Reject<WorkerMessage>(Encode(WorkerMessage(hb)));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_NE(error.detail.find("kv_blocks_used: 9 exceeds kv_blocks_total 8"), std::string::npos)
      << error.detail;
  hb.kv = {.total_blocks = 8, .used_blocks = 1, .prefix_queries = 16, .prefix_hits = 32};
  error = Reject<WorkerMessage>(Encode(WorkerMessage(hb)));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_NE(error.detail.find("prefix_cache_hits: 32 exceeds"), std::string::npos) << error.detail;
  hb.kv = {
      .total_blocks = 8, .used_blocks = 1, .max_blocks = 4};  // A pool's most below what it holds.
  error = Reject<WorkerMessage>(Encode(WorkerMessage(hb)));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_NE(error.detail.find("kv_blocks_max: 4 is below kv_blocks_total 8"), std::string::npos)
      << error.detail;
  hb.kv = {};
  hb.kv.ranks.resize(3);  // More ranks than the decoder takes.
  DecodeLimits two_ranks;
  two_ranks.max_ranks = 2;
  error = Reject<WorkerMessage>(Encode(WorkerMessage(hb)), two_ranks);
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_NE(error.detail.find("WorkerHeartbeat.rank_device_memory: 3 > limit 2"), std::string::npos)
      << error.detail;
  hb.kv = {};
  hb.engine = {3, 4, 0};  // More chunks grown than run.
  error = Reject<WorkerMessage>(Encode(WorkerMessage(hb)));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_NE(error.detail.find("prompt_chunks_grown: 4 exceeds prompt_chunks 3"), std::string::npos)
      << error.detail;
}

// An envelope built with the raw builder: protocol_version, body_type 200, body an empty table.
TEST(CodecReject, UnknownUnionTagBuilt) {
  flatbuffers::FlatBufferBuilder fbb;
  const flatbuffers::uoffset_t body_start = fbb.StartTable();
  const flatbuffers::Offset<void> body(fbb.EndTable(body_start));
  const flatbuffers::uoffset_t start = fbb.StartTable();
  fbb.AddElement<uint32_t>(Slot(0), kProtocolVersion, 0);
  fbb.AddElement<uint8_t>(Slot(kEnvelopeBodyType), 200, 0);
  fbb.AddOffset(Slot(kEnvelopeBody), body);
  fbb.Finish(flatbuffers::Offset<void>(fbb.EndTable(start)), kMapIdentifier);
  std::vector<uint8_t> frame(fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize());
  DecodeError error = Reject<MapMessage>(frame);
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_NE(error.detail.find("unknown tag 200"), std::string::npos) << error.detail;
}

TEST(CodecReject, MissingBody) {
  flatbuffers::FlatBufferBuilder fbb;
  const flatbuffers::uoffset_t start = fbb.StartTable();
  fbb.AddElement<uint32_t>(Slot(0), kProtocolVersion, 0);
  fbb.Finish(flatbuffers::Offset<void>(fbb.EndTable(start)), kWorkerIdentifier);
  std::vector<uint8_t> frame(fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize());
  DecodeError error = Reject<WorkerMessage>(frame);
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "WorkerEnvelope.body: missing");
}

TEST(CodecReject, EnumOutOfRange) {
  auto error = Reject<WorkerMessage>(Encode(WorkerMessage(Make<TokenEvent>(
      [](auto& m) { m.finish = static_cast<FinishReason>(kFinishReasonMax + 1); }))));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_NE(error.detail.find("TokenEvent.finish: 5"), std::string::npos) << error.detail;
  error = Reject<MapMessage>(
      Encode(MapMessage(Make<AdminRequest>([](auto& m) { m.op = static_cast<AdminOp>(200); }))));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_NE(error.detail.find("AdminRequest.op"), std::string::npos) << error.detail;
}

TEST(CodecReject, EnumPatchedInPlace) {
  auto frame =
      Encode(WorkerMessage(Make<TokenEvent>([](auto& m) { m.finish = FinishReason::kStop; })));
  const size_t body = Follow(frame, FieldPos(frame, RootPos(frame), kEnvelopeBody));
  const size_t finish = FieldPos(frame, body, 3);
  ASSERT_NE(finish, 0u);
  ASSERT_EQ(frame[finish], static_cast<uint8_t>(FinishReason::kStop));
  frame[finish] = 0xff;
  EXPECT_EQ(Reject<WorkerMessage>(frame).reason, DropReason::kOutOfRange);
}

TEST(CodecReject, TooManyFloats) {
  LayerObserved lo{.probs = std::vector<float>(70000, 0.0f)};
  auto error = Reject<MapMessage>(Encode(MapMessage(lo)));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "LayerObserved.probs: 70000 floats > limit 65536");
  DecodeLimits limits;
  limits.max_floats = 4;
  error = Reject<MapMessage>(Encode(MapMessage(IterationStart{.sem = {1, 2, 3, 4, 5}})), limits);
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "IterationStart.sem: 5 floats > limit 4");
}

TEST(CodecReject, TooManyTokensAndStops) {
  DecodeLimits limits;
  limits.max_token_ids = 3;
  auto error = Reject<WorkerMessage>(Encode(WorkerMessage(Make<Generate>([](auto& m) {
                                       m.token_ids = {1, 2, 3, 4};
                                     }))),
                                     limits);
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "Generate.token_ids: 4 ids > limit 3");
  Generate g;
  g.sampling.stop_token_ids.assign(65, 1);
  error = Reject<WorkerMessage>(Encode(WorkerMessage(g)));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "Generate.sampling.stop_token_ids: 65 ids > limit 64");
  g.sampling.stop_token_ids.clear();
  g.sampling.stop.assign(17, "x");
  error = Reject<WorkerMessage>(Encode(WorkerMessage(g)));
  EXPECT_EQ(error.detail, "Generate.sampling.stop: 17 strings > limit 16");
  g.sampling.stop = {"ok", std::string(257, 'y')};
  error = Reject<WorkerMessage>(Encode(WorkerMessage(g)));
  EXPECT_EQ(error.detail, "Generate.sampling.stop[]: 257 bytes > limit 256");
  g.sampling.stop = {"ok", ""};
  error = Reject<WorkerMessage>(Encode(WorkerMessage(g)));
  EXPECT_EQ(error.detail, "Generate.sampling.stop[]: missing (required)");
}

// A worker envelope whose body (union tag `tag`) is the table `body` builds with the raw builder.
template <class F>
std::vector<uint8_t> RawWorkerFrame(uint8_t tag, F body) {
  flatbuffers::FlatBufferBuilder fbb;
  const flatbuffers::Offset<void> table = body(fbb);
  const flatbuffers::uoffset_t start = fbb.StartTable();
  fbb.AddElement<uint32_t>(Slot(0), kProtocolVersion, 0);
  fbb.AddElement<uint8_t>(Slot(kEnvelopeBodyType), tag, 0);
  fbb.AddOffset(Slot(kEnvelopeBody), table);
  fbb.Finish(flatbuffers::Offset<void>(fbb.EndTable(start)), kWorkerIdentifier);
  return {fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize()};
}

// WorkerBody tags: the variant index + 1.
const uint8_t kGenerateTag = static_cast<uint8_t>(WorkerMessage(Generate{}).index() + 1);
const uint8_t kTokenEventTag = static_cast<uint8_t>(WorkerMessage(TokenEvent{}).index() + 1);
constexpr int kGenerateSampling = 2;  // Generate.sampling.
constexpr int kLogitBiasIds = 7;      // SamplingParams.logit_bias_ids, then _values.
constexpr int kTopLogprobIds = 11;    // TokenEvent.top_logprob_ids, then _values.

TEST(CodecReject, ParallelVectorsOfDifferentLengths) {
  const std::vector<int32_t> two_ids = {1, 2};
  const std::vector<float> one_value = {-0.5f};
  auto event = RawWorkerFrame(kTokenEventTag, [&](flatbuffers::FlatBufferBuilder& fbb) {
    auto ids = fbb.CreateVector(two_ids);
    auto values = fbb.CreateVector(one_value);
    const flatbuffers::uoffset_t start = fbb.StartTable();
    fbb.AddOffset(Slot(kTopLogprobIds), ids);
    fbb.AddOffset(Slot(kTopLogprobIds + 1), values);
    return flatbuffers::Offset<void>(fbb.EndTable(start));
  });
  DecodeError error = Reject<WorkerMessage>(event);
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "TokenEvent.top_logprobs: 2 ids but 1 values");

  auto generate = RawWorkerFrame(kGenerateTag, [&](flatbuffers::FlatBufferBuilder& fbb) {
    auto values = fbb.CreateVector(one_value);  // Values without ids.
    flatbuffers::uoffset_t start = fbb.StartTable();
    fbb.AddOffset(Slot(kLogitBiasIds + 1), values);
    const flatbuffers::Offset<void> sampling(fbb.EndTable(start));
    start = fbb.StartTable();
    fbb.AddOffset(Slot(kGenerateSampling), sampling);
    return flatbuffers::Offset<void>(fbb.EndTable(start));
  });
  error = Reject<WorkerMessage>(generate);
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "Generate.sampling.logit_bias: 0 ids but 1 values");
}

TEST(CodecReject, LogprobsAndSamplingFloats) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  TokenEvent ev;
  ev.request_id = 1;
  ev.token_id = 2;
  ev.top_logprobs.assign(kMaxLogprobs + 1, {3, -1.0f});
  auto error = Reject<WorkerMessage>(Encode(WorkerMessage(ev)));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "TokenEvent.top_logprobs: 21 entries > limit 20");
  ev.top_logprobs = {{3, -1.0f}, {4, -inf}};
  EXPECT_EQ(Reject<WorkerMessage>(Encode(WorkerMessage(ev))).detail,
            "TokenEvent.top_logprobs[1]: -inf is not finite");
  ev.top_logprobs.clear();
  ev.logprob = nan;
  EXPECT_EQ(Reject<WorkerMessage>(Encode(WorkerMessage(ev))).detail,
            "TokenEvent.logprob: nan is not finite");
  ev.logprob = 0.0f;
  // The prompt's logprobs: finite, prompt_top_n pairs per entry, at most kMaxLogprobs each.
  ev.prompt_logprobs = {-1.0f, nan};
  EXPECT_EQ(Reject<WorkerMessage>(Encode(WorkerMessage(ev))).detail,
            "TokenEvent.prompt_logprobs[]: nan is not finite");
  ev.prompt_logprobs = {-1.0f, -2.0f};
  ev.prompt_top_n = 1;
  ev.prompt_top = {{3, -1.0f}};
  EXPECT_EQ(Reject<WorkerMessage>(Encode(WorkerMessage(ev))).detail,
            "TokenEvent.prompt_top: 1 pairs for 2 entries of 1");
  ev.prompt_top = {{3, -1.0f}, {4, -1.0f}, {5, -1.0f}};
  EXPECT_EQ(Reject<WorkerMessage>(Encode(WorkerMessage(ev))).detail,
            "TokenEvent.prompt_top: 3 entries > limit 2");
  ev.prompt_top_n = kMaxLogprobs + 1;
  EXPECT_EQ(Reject<WorkerMessage>(Encode(WorkerMessage(ev))).detail,
            "TokenEvent.prompt_top_n: 21 > limit 20");
  ev.prompt_top_n = 0;
  ev.prompt_logprobs.clear();
  ev.prompt_top.clear();
  ev.stop_token = true;  // On an event that does not end the request.
  EXPECT_EQ(Reject<WorkerMessage>(Encode(WorkerMessage(ev))).detail,
            "TokenEvent.stop_token: set on an event that does not end with a token");
  ev.stop_token = false;
  ev.prompt_logprobs.clear();
  ev.prompt_top.clear();
  ev.prompt_top_n = 0;

  Generate g;
  g.token_ids = {1};
  g.sampling.logit_bias = {{1, 1.0f}, {2, nan}};
  error = Reject<WorkerMessage>(Encode(WorkerMessage(g)));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "Generate.sampling.logit_bias[1]: nan is not finite");
  DecodeLimits limits;
  limits.max_logit_bias = 1;
  g.sampling.logit_bias = {{1, 1.0f}, {2, 2.0f}};
  EXPECT_EQ(Reject<WorkerMessage>(Encode(WorkerMessage(g)), limits).detail,
            "Generate.sampling.logit_bias: 2 entries > limit 1");
  g.sampling.logit_bias.clear();
  struct Case {
    float SamplingParams::*field;
    const char* detail;
  } cases[] = {
      {&SamplingParams::presence_penalty, "Generate.sampling.presence_penalty: inf is not finite"},
      {&SamplingParams::frequency_penalty,
       "Generate.sampling.frequency_penalty: inf is not finite"},
      {&SamplingParams::repetition_penalty,
       "Generate.sampling.repetition_penalty: inf is not finite"},
      {&SamplingParams::min_p, "Generate.sampling.min_p: inf is not finite"},
  };
  for (const Case& c : cases) {
    Generate bad = g;
    bad.sampling.*c.field = inf;
    EXPECT_EQ(Reject<WorkerMessage>(Encode(WorkerMessage(bad))).detail, c.detail);
  }
  // Out-of-range but finite values pass: the worker's ValidateSampling answers them with an error
  // event naming the field.
  g.sampling.min_p = 1.5f;
  g.sampling.logprobs = 50;
  EXPECT_EQ((RoundTripAs<Generate, WorkerMessage>(g).sampling.logprobs), 50);
}

TEST(CodecReject, TooManyPrefetchEntries) {
  DecodeLimits limits;
  limits.max_prefetch_entries = 2;
  PrefetchDirective p{.entries = {{1, 0.1f, 0}, {2, 0.2f, 0}, {3, 0.3f, 0}}};
  auto error = Reject<MapMessage>(Encode(MapMessage(p)), limits);
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "PrefetchDirective.entries: 3 entries > limit 2");
}

TEST(CodecReject, StringTooLong) {
  auto error = Reject<MapMessage>(Encode(MapMessage(AdminRequest{.path = std::string(4097, 'a')})));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "AdminRequest.path: 4097 bytes > limit 4096");
  WorkerMessage ok;
  EXPECT_TRUE(Decode(Encode(WorkerMessage(WorkerHelloAck{.reason = std::string(4096, 'r')})), {},
                     &ok, nullptr));
}

TEST(CodecReject, GoodbyeStringsTooLong) {
  WorkerGoodbye bye{.group = "g0", .instance_id = 7, .reason = std::string(4097, 'r')};
  auto error = Reject<WorkerMessage>(Encode(WorkerMessage(bye)));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "WorkerGoodbye.reason: 4097 bytes > limit 4096");
  bye.reason = "ok";
  bye.group = std::string(4097, 'g');
  error = Reject<WorkerMessage>(Encode(WorkerMessage(bye)));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "WorkerGoodbye.group: 4097 bytes > limit 4096");
  DecodeLimits limits;
  limits.max_string_bytes = 16;
  bye.group = "g0";
  bye.reason = std::string(17, 'r');
  error = Reject<WorkerMessage>(Encode(WorkerMessage(bye)), limits);
  EXPECT_EQ(error.detail, "WorkerGoodbye.reason: 17 bytes > limit 16");
}

TEST(CodecReject, AdminJsonHasItsOwnLimit) {
  // Stats bodies grow with the number of ranks: they are bounded by max_admin_json_bytes, not
  // by the small limit on names.
  AdminReply big{.id = 1, .ok = true, .error = "", .json = std::string(100000, 'j')};
  EXPECT_EQ((RoundTripAs<AdminReply, MapMessage>(big).json.size()), 100000u);
  DecodeLimits limits;
  limits.max_admin_json_bytes = 99999;
  auto error = Reject<MapMessage>(Encode(MapMessage(big)), limits);
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "AdminReply.json: 100000 bytes > limit 99999");
}

TEST(CodecReject, NonFiniteAndOutOfUnitFloats) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  auto error = Reject<MapMessage>(Encode(MapMessage(LayerObserved{.probs = {0.5f, nan}})));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "LayerObserved.probs[1]: nan is not finite");
  error = Reject<MapMessage>(Encode(MapMessage(LayerObserved{.probs = {1.5f}})));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_NE(error.detail.find("outside [0, 1]"), std::string::npos) << error.detail;
  error = Reject<MapMessage>(Encode(MapMessage(IterationStart{.sem = {-inf}})));
  EXPECT_EQ(error.detail, "IterationStart.sem[0]: -inf is not finite");
  error = Reject<MapMessage>(Encode(MapMessage(PrefetchDirective{.entries = {{1, nan, 0}}})));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_NE(error.detail.find("PrefetchDirective.entries[0].probability"), std::string::npos);
  error = Reject<MapMessage>(
      Encode(MapMessage(Make<PrefetchDirective>([&](auto& m) { m.score = inf; }))));
  EXPECT_NE(error.detail.find("PrefetchDirective.score"), std::string::npos);
  Generate g;
  g.sampling.temperature = nan;
  EXPECT_EQ(Reject<WorkerMessage>(Encode(WorkerMessage(g))).reason, DropReason::kOutOfRange);
}

TEST(CodecReject, LayerOutOfRange) {
  auto error =
      Reject<MapMessage>(Encode(MapMessage(Make<LayerObserved>([](auto& m) { m.layer = 4097; }))));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_EQ(error.detail, "LayerObserved.layer: 4097 > limit 4096");
  error = Reject<MapMessage>(
      Encode(MapMessage(Make<PrefetchDirective>([](auto& m) { m.target_layer = 5000; }))));
  EXPECT_NE(error.detail.find("PrefetchDirective.target_layer"), std::string::npos);
}

TEST(CodecReject, ProtocolVersion) {
  auto error = Reject<WorkerMessage>(Encode(WorkerMessage(Make<WorkerHello>([](auto& m) {
    m.group = "g";
    m.protocol_version = kProtocolVersion + 1;
  }))));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_NE(error.detail.find("WorkerHello.protocol_version: peer speaks protocol 2"),
            std::string::npos)
      << error.detail;
  error = Reject<MapMessage>(Encode(MapMessage(Make<Register>([](auto& m) {
    m.group = "g";
    m.protocol_version = 0;
  }))));
  EXPECT_EQ(error.reason, DropReason::kOutOfRange);
  EXPECT_NE(error.detail.find("Register.protocol_version"), std::string::npos) << error.detail;
}

TEST(CodecReject, RequiredGroupAndRank) {
  EXPECT_EQ(Reject<WorkerMessage>(Encode(WorkerMessage(WorkerHello{}))).detail,
            "WorkerHello.group: missing (required)");
  EXPECT_EQ(Reject<WorkerMessage>(Encode(WorkerMessage(WorkerHeartbeat{}))).detail,
            "WorkerHeartbeat.group: missing (required)");
  WorkerGoodbye nameless;
  nameless.reason = "x";
  EXPECT_EQ(Reject<WorkerMessage>(Encode(WorkerMessage(nameless))).detail,
            "WorkerGoodbye.group: missing (required)");
  EXPECT_EQ(Reject<MapMessage>(Encode(MapMessage(RankHeartbeat{}))).detail,
            "RankHeartbeat.group: missing (required)");
  EXPECT_EQ(
      Reject<MapMessage>(Encode(MapMessage(Register{.group = "g", .rank = 2, .world_size = 2})))
          .detail,
      "Register.rank: 2 >= world_size 2");
}

}  // namespace
}  // namespace fmoe::wire
