// FlatBuffers codec of the wire messages (see codec.h). Encode builds one envelope per message;
// Decode is the trust boundary: size and identifier checks, a copy into 8-byte-aligned memory,
// the FlatBuffers Verifier, then semantic range checks while the plain struct is filled in.
// Union tags are the variant index + 1 (0 is NONE); the static_asserts below keep
// schemas/*.fbs and common/wire/messages.h in step. Both channels go through one template over the
// envelope (Channel<WorkerMessage>, Channel<MapMessage>); each message has its Build and Read.
#include "common/wire/codec.h"

#include <array>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>

#include "schemas/map_generated.h"
#include "schemas/worker_generated.h"

namespace fmoe::wire {
namespace {

static_assert(FLATBUFFERS_LITTLEENDIAN, "the codec copies float and int vectors with memcpy");
static_assert(static_cast<uint8_t>(fb::FinishReason::MAX) == kFinishReasonMax);
static_assert(static_cast<uint8_t>(fb::AdminOp::MAX) == kAdminOpMax);
static_assert(static_cast<uint8_t>(fb::GrammarSyntax::MAX) == kGrammarSyntaxMax);
static_assert(static_cast<size_t>(fb::WorkerBody::MAX) == std::variant_size_v<WorkerMessage>);
static_assert(static_cast<size_t>(fb::MapBody::MAX) == std::variant_size_v<MapMessage>);
static_assert(sizeof(fb::PrefetchEntry) == 12);

template <class T>
struct OffsetTarget;
template <class T>
struct OffsetTarget<flatbuffers::Offset<T>> {
  using type = T;
};

template <class Variant, class Plain, size_t I = 0>
constexpr size_t IndexOf() {
  if constexpr (std::is_same_v<std::variant_alternative_t<I, Variant>, Plain>) {
    return I;
  } else {
    return IndexOf<Variant, Plain, I + 1>();
  }
}

// Union tag of a body table on either channel (the traits of the other channel give NONE = 0).
template <class Fb>
constexpr size_t TagOf() {
  return static_cast<size_t>(fb::WorkerBodyTraits<Fb>::enum_value) +
         static_cast<size_t>(fb::MapBodyTraits<Fb>::enum_value);
}

// ---------------------------------------------------------------------------------------------
// Encoding.

using Builder = flatbuffers::FlatBufferBuilder;

flatbuffers::Offset<flatbuffers::String> OptString(Builder& fbb, const std::string& s) {
  return s.empty() ? 0 : fbb.CreateString(s);
}

template <class T>
flatbuffers::Offset<flatbuffers::Vector<T>> OptVector(Builder& fbb, const std::vector<T>& v) {
  return v.empty() ? 0 : fbb.CreateVector(v);
}

// (id, value) pairs as two parallel vectors; both null when empty.
std::pair<flatbuffers::Offset<flatbuffers::Vector<int32_t>>,
          flatbuffers::Offset<flatbuffers::Vector<float>>>
SplitPairs(Builder& fbb, const std::vector<std::pair<int32_t, float>>& pairs) {
  if (pairs.empty()) return {0, 0};
  std::vector<int32_t> ids(pairs.size());
  std::vector<float> values(pairs.size());
  for (size_t i = 0; i < pairs.size(); ++i) std::tie(ids[i], values[i]) = pairs[i];
  return {fbb.CreateVector(ids), fbb.CreateVector(values)};
}

// Bytes of variable-length payload of each message, to size the builder once; 0 for the rest.
template <class T>
size_t PayloadBytes(const T&) {
  return 0;
}
size_t PayloadBytes(const WorkerHello& m) { return m.group.size() + m.model_name.size(); }
size_t PayloadBytes(const WorkerHelloAck& m) { return m.reason.size(); }
size_t PayloadBytes(const WorkerHeartbeat& m) { return m.group.size(); }
size_t PayloadBytes(const Generate& m) {
  size_t bytes = 4 * (m.token_ids.size() + m.sampling.stop_token_ids.size() +
                      m.sampling.constrain_after.size()) +
                 8 * m.sampling.logit_bias.size();
  for (const auto& s : m.sampling.stop) bytes += s.size() + 8;
  return bytes + m.sampling.json_schema.size() + m.sampling.grammar.size();
}
size_t PayloadBytes(const TokenEvent& m) {
  return m.error.size() + 8 * (m.top_logprobs.size() + m.prompt_top.size()) +
         4 * m.prompt_logprobs.size();
}
size_t PayloadBytes(const WorkerGoodbye& m) { return m.group.size() + m.reason.size(); }
size_t PayloadBytes(const WorkerLoading& m) { return m.group.size(); }
size_t PayloadBytes(const Register& m) { return m.group.size(); }
size_t PayloadBytes(const RegisterAck& m) { return m.reason.size(); }
size_t PayloadBytes(const RankHeartbeat& m) { return m.group.size(); }
size_t PayloadBytes(const IterationStart& m) { return 4 * m.sem.size(); }
size_t PayloadBytes(const LayerObserved& m) { return 4 * m.probs.size(); }
size_t PayloadBytes(const PrefetchDirective& m) {
  return sizeof(fb::PrefetchEntry) * m.entries.size();
}
size_t PayloadBytes(const AdminRequest& m) { return m.path.size(); }
size_t PayloadBytes(const AdminReply& m) { return m.error.size() + m.json.size(); }

flatbuffers::Offset<fb::WorkerHello> Build(Builder& fbb, const WorkerHello& m) {
  auto group = OptString(fbb, m.group);
  auto model_name = OptString(fbb, m.model_name);
  fb::WorkerHelloBuilder b(fbb);
  b.add_group(group);
  b.add_world_size(m.world_size);
  b.add_model_name(model_name);
  b.add_model_fingerprint(m.model_fingerprint);
  b.add_instance_id(m.instance_id);
  b.add_max_batch(m.max_batch);
  b.add_free_slots(m.free_slots);
  b.add_protocol_version(m.protocol_version);
  return b.Finish();
}

flatbuffers::Offset<fb::WorkerHelloAck> Build(Builder& fbb, const WorkerHelloAck& m) {
  auto reason = OptString(fbb, m.reason);
  fb::WorkerHelloAckBuilder b(fbb);
  b.add_accepted(m.accepted);
  b.add_reason(reason);
  return b.Finish();
}

flatbuffers::Offset<fb::WorkerHeartbeat> Build(Builder& fbb, const WorkerHeartbeat& m) {
  auto group = OptString(fbb, m.group);
  flatbuffers::Offset<flatbuffers::Vector<const fb::RankDeviceMemory*>> ranks = 0;
  if (!m.kv.ranks.empty()) {
    std::vector<fb::RankDeviceMemory> packed;
    packed.reserve(m.kv.ranks.size());
    for (const KvFigures::RankSplit& r : m.kv.ranks)
      packed.emplace_back(r.kv_bytes, r.expert_bytes);
    ranks = fbb.CreateVectorOfStructs(packed.data(), packed.size());
  }
  fb::WorkerHeartbeatBuilder b(fbb);
  b.add_group(group);
  b.add_instance_id(m.instance_id);
  b.add_seq(m.seq);
  b.add_free_slots(m.free_slots);
  b.add_active_requests(m.active_requests);
  b.add_expert_hits(m.experts.hits);
  b.add_expert_misses(m.experts.misses);
  b.add_expert_prefetches_issued(m.experts.prefetches_issued);
  b.add_expert_prefetches_used(m.experts.prefetches_used);
  b.add_expert_bytes_moved(m.experts.bytes_moved);
  b.add_expert_stall_us(m.experts.stall_us);
  b.add_expert_host_runs(m.experts.host_runs);
  b.add_expert_host_us(m.experts.host_us);
  b.add_expert_bytes_not_moved(m.experts.bytes_not_moved);
  b.add_expert_disk_reads(m.experts.disk_reads);
  b.add_expert_disk_bytes(m.experts.disk_bytes);
  b.add_expert_disk_stall_us(m.experts.disk_stall_us);
  b.add_expert_failed_loads(m.experts.failed_loads);
  b.add_expert_failed_experts(m.experts.failed_experts);
  b.add_kv_blocks_total(m.kv.total_blocks);
  b.add_kv_blocks_used(m.kv.used_blocks);
  b.add_prefix_cache_queries(m.kv.prefix_queries);
  b.add_prefix_cache_hits(m.kv.prefix_hits);
  b.add_preemptions(m.kv.preemptions);
  b.add_kv_blocks_max(m.kv.max_blocks);
  b.add_device_kv_bytes(m.kv.kv_bytes);
  b.add_device_expert_bytes(m.kv.expert_bytes);
  b.add_prompt_chunks(m.engine.prompt_chunks);
  b.add_prompt_chunks_grown(m.engine.chunks_grown);
  b.add_prompt_token_ns(m.engine.prompt_token_ns);
  b.add_streamed_iterations(m.engine.streamed_iterations);
  b.add_rank_device_memory(ranks);
  return b.Finish();
}

flatbuffers::Offset<fb::WorkerHeartbeatAck> Build(Builder& fbb, const WorkerHeartbeatAck& m) {
  fb::WorkerHeartbeatAckBuilder b(fbb);
  b.add_seq(m.seq);
  b.add_known(m.known);
  return b.Finish();
}

flatbuffers::Offset<fb::Generate> Build(Builder& fbb, const Generate& m) {
  auto token_ids = OptVector(fbb, m.token_ids);
  auto stop_token_ids = OptVector(fbb, m.sampling.stop_token_ids);
  auto constrain_after = OptVector(fbb, m.sampling.constrain_after);
  auto stop = m.sampling.stop.empty() ? 0 : fbb.CreateVectorOfStrings(m.sampling.stop);
  const auto [bias_ids, bias_values] = SplitPairs(fbb, m.sampling.logit_bias);
  auto json_schema = OptString(fbb, m.sampling.json_schema);
  auto grammar = OptString(fbb, m.sampling.grammar);
  fb::SamplingParamsBuilder sb(fbb);
  sb.add_temperature(m.sampling.temperature);
  sb.add_top_p(m.sampling.top_p);
  sb.add_top_k(m.sampling.top_k);
  sb.add_seed(m.sampling.seed);
  sb.add_max_tokens(m.sampling.max_tokens);
  sb.add_stop_token_ids(stop_token_ids);
  sb.add_stop(stop);
  sb.add_logit_bias_ids(bias_ids);
  sb.add_logit_bias_values(bias_values);
  sb.add_min_tokens(m.sampling.min_tokens);
  sb.add_ignore_eos(m.sampling.ignore_eos);
  sb.add_presence_penalty(m.sampling.presence_penalty);
  sb.add_frequency_penalty(m.sampling.frequency_penalty);
  sb.add_repetition_penalty(m.sampling.repetition_penalty);
  sb.add_min_p(m.sampling.min_p);
  sb.add_logprobs(m.sampling.logprobs);
  sb.add_prompt_logprobs(m.sampling.prompt_logprobs);
  sb.add_json_schema(json_schema);
  sb.add_grammar(grammar);
  sb.add_grammar_syntax(static_cast<fb::GrammarSyntax>(m.sampling.grammar_syntax));
  sb.add_constrain_after_tokens(constrain_after);
  auto sampling = sb.Finish();
  fb::GenerateBuilder b(fbb);
  b.add_request_id(m.request_id);
  b.add_token_ids(token_ids);
  b.add_sampling(sampling);
  return b.Finish();
}

flatbuffers::Offset<fb::Cancel> Build(Builder& fbb, const Cancel& m) {
  fb::CancelBuilder b(fbb);
  b.add_request_id(m.request_id);
  return b.Finish();
}

flatbuffers::Offset<fb::TokenEvent> Build(Builder& fbb, const TokenEvent& m) {
  auto error = OptString(fbb, m.error);
  const auto [top_ids, top_values] = SplitPairs(fbb, m.top_logprobs);
  auto prompt_logprobs = OptVector(fbb, m.prompt_logprobs);
  const auto [prompt_top_ids, prompt_top_values] = SplitPairs(fbb, m.prompt_top);
  fb::TokenEventBuilder b(fbb);
  b.add_request_id(m.request_id);
  b.add_token_id(m.token_id);
  b.add_index(m.index);
  b.add_finish(static_cast<fb::FinishReason>(m.finish));
  b.add_error(error);
  b.add_queue_us(m.queue_us);
  b.add_token_us(m.token_us);
  b.add_expert_hits(m.expert_hits);
  b.add_expert_misses(m.expert_misses);
  b.add_bytes_moved(m.bytes_moved);
  b.add_expert_host_runs(m.expert_host_runs);
  b.add_expert_host_us(m.expert_host_us);
  b.add_bytes_not_moved(m.bytes_not_moved);
  b.add_expert_disk_reads(m.expert_disk_reads);
  b.add_cached_tokens(m.cached_tokens);
  b.add_logprob(m.logprob);
  b.add_top_logprob_ids(top_ids);
  b.add_top_logprob_values(top_values);
  b.add_prompt_logprobs(prompt_logprobs);
  b.add_prompt_top_n(m.prompt_top_n);
  b.add_prompt_top_ids(prompt_top_ids);
  b.add_prompt_top_values(prompt_top_values);
  b.add_stop_token(m.stop_token);
  b.add_too_long(m.too_long);
  return b.Finish();
}

flatbuffers::Offset<fb::WorkerGoodbye> Build(Builder& fbb, const WorkerGoodbye& m) {
  auto group = OptString(fbb, m.group);
  auto reason = OptString(fbb, m.reason);
  fb::WorkerGoodbyeBuilder b(fbb);
  b.add_group(group);
  b.add_instance_id(m.instance_id);
  b.add_reason(reason);
  return b.Finish();
}

flatbuffers::Offset<fb::WorkerLoading> Build(Builder& fbb, const WorkerLoading& m) {
  auto group = OptString(fbb, m.group);
  fb::WorkerLoadingBuilder b(fbb);
  b.add_group(group);
  b.add_instance_id(m.instance_id);
  b.add_loaded_bytes(m.loaded_bytes);
  b.add_total_bytes(m.total_bytes);
  return b.Finish();
}

flatbuffers::Offset<fb::Register> Build(Builder& fbb, const Register& m) {
  auto group = OptString(fbb, m.group);
  fb::RegisterBuilder b(fbb);
  b.add_group(group);
  b.add_rank(m.rank);
  b.add_world_size(m.world_size);
  b.add_instance_id(m.instance_id);
  b.add_model_fingerprint(m.model_fingerprint);
  b.add_num_layers(m.num_layers);
  b.add_num_experts(m.num_experts);
  b.add_top_k(m.top_k);
  b.add_hidden_size(m.hidden_size);
  b.add_protocol_version(m.protocol_version);
  b.add_semantic(m.semantic);
  b.add_delta(m.delta);
  return b.Finish();
}

flatbuffers::Offset<fb::RegisterAck> Build(Builder& fbb, const RegisterAck& m) {
  auto reason = OptString(fbb, m.reason);
  fb::RegisterAckBuilder b(fbb);
  b.add_accepted(m.accepted);
  b.add_reason(reason);
  b.add_stored_maps(m.stored_maps);
  return b.Finish();
}

flatbuffers::Offset<fb::RankHeartbeat> Build(Builder& fbb, const RankHeartbeat& m) {
  auto group = OptString(fbb, m.group);
  fb::RankHeartbeatBuilder b(fbb);
  b.add_group(group);
  b.add_rank(m.rank);
  b.add_instance_id(m.instance_id);
  b.add_seq(m.seq);
  return b.Finish();
}

flatbuffers::Offset<fb::RankHeartbeatAck> Build(Builder& fbb, const RankHeartbeatAck& m) {
  fb::RankHeartbeatAckBuilder b(fbb);
  b.add_seq(m.seq);
  b.add_known(m.known);
  return b.Finish();
}

flatbuffers::Offset<fb::IterationStart> Build(Builder& fbb, const IterationStart& m) {
  auto sem = OptVector(fbb, m.sem);
  fb::IterationStartBuilder b(fbb);
  b.add_request_id(m.request_id);
  b.add_iteration(m.iteration);
  b.add_sem(sem);
  return b.Finish();
}

flatbuffers::Offset<fb::LayerObserved> Build(Builder& fbb, const LayerObserved& m) {
  auto probs = OptVector(fbb, m.probs);
  fb::LayerObservedBuilder b(fbb);
  b.add_request_id(m.request_id);
  b.add_iteration(m.iteration);
  b.add_layer(m.layer);
  b.add_probs(probs);
  return b.Finish();
}

flatbuffers::Offset<fb::IterationEnd> Build(Builder& fbb, const IterationEnd& m) {
  fb::IterationEndBuilder b(fbb);
  b.add_request_id(m.request_id);
  b.add_iteration(m.iteration);
  b.add_finished(m.finished);
  return b.Finish();
}

flatbuffers::Offset<fb::PrefetchDirective> Build(Builder& fbb, const PrefetchDirective& m) {
  flatbuffers::Offset<flatbuffers::Vector<const fb::PrefetchEntry*>> entries = 0;
  if (!m.entries.empty()) {
    // Not CreateUninitializedVectorOfStructs: it takes the 12-byte struct size as an alignment,
    // which leaves the builder's minimum alignment at 12 and misaligns 8-byte fields.
    std::vector<fb::PrefetchEntry> packed;
    packed.reserve(m.entries.size());
    for (const PrefetchEntry& e : m.entries) {
      packed.emplace_back(e.expert, e.probability, e.priority);
    }
    entries = fbb.CreateVectorOfStructs(packed.data(), packed.size());
  }
  fb::PrefetchDirectiveBuilder b(fbb);
  b.add_request_id(m.request_id);
  b.add_iteration(m.iteration);
  b.add_target_layer(m.target_layer);
  b.add_score(m.score);
  b.add_entries(entries);
  return b.Finish();
}

flatbuffers::Offset<fb::AdminRequest> Build(Builder& fbb, const AdminRequest& m) {
  auto path = OptString(fbb, m.path);
  fb::AdminRequestBuilder b(fbb);
  b.add_id(m.id);
  b.add_op(static_cast<fb::AdminOp>(m.op));
  b.add_model_fingerprint(m.model_fingerprint);
  b.add_path(path);
  return b.Finish();
}

flatbuffers::Offset<fb::AdminReply> Build(Builder& fbb, const AdminReply& m) {
  auto error = OptString(fbb, m.error);
  auto json = OptString(fbb, m.json);
  fb::AdminReplyBuilder b(fbb);
  b.add_id(m.id);
  b.add_ok(m.ok);
  b.add_error(error);
  b.add_json(json);
  return b.Finish();
}

flatbuffers::Offset<fb::MapStored> Build(Builder& fbb, const MapStored& m) {
  fb::MapStoredBuilder b(fbb);
  b.add_request_id(m.request_id);
  b.add_iteration(m.iteration);
  b.add_entry_id(m.entry_id);
  b.add_replaced_id(m.replaced_id);
  return b.Finish();
}

std::vector<uint8_t> Release(const Builder& fbb) {
  const uint8_t* data = fbb.GetBufferPointer();
  return std::vector<uint8_t>(data, data + fbb.GetSize());
}

// ---------------------------------------------------------------------------------------------
// Decoding.

bool Fail(DecodeError* error, DropReason reason, std::string detail) {
  if (error != nullptr) {
    error->reason = reason;
    error->detail = std::move(detail);
  }
  return false;
}

std::string FloatText(float v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return std::to_string(v);
}

// Range checks shared by every message; `field` is "Message.field". Each returns false after
// filling the error.
class Checker {
 public:
  Checker(const DecodeLimits& limits, DecodeError* error) : limits_(limits), error_(error) {}

  bool OutOfRange(std::string detail) const {
    return Fail(error_, DropReason::kOutOfRange, std::move(detail));
  }

  bool String(const flatbuffers::String* s, const char* field, std::string* out,
              bool required = false, size_t limit = 0) const {
    if (limit == 0) limit = limits_.max_string_bytes;
    if (s == nullptr || s->size() == 0) {
      if (required) return OutOfRange(std::string(field) + ": missing (required)");
      out->clear();
      return true;
    }
    if (s->size() > limit) {
      return OutOfRange(std::string(field) + ": " + std::to_string(s->size()) + " bytes > limit " +
                        std::to_string(limit));
    }
    out->assign(s->c_str(), s->size());
    return true;
  }

  bool Int32s(const flatbuffers::Vector<int32_t>* v, const char* field, size_t limit,
              std::vector<int32_t>* out) const {
    if (v == nullptr) {
      out->clear();
      return true;
    }
    if (v->size() > limit) {
      return OutOfRange(std::string(field) + ": " + std::to_string(v->size()) + " ids > limit " +
                        std::to_string(limit));
    }
    out->resize(v->size());
    if (!out->empty()) std::memcpy(out->data(), v->Data(), v->size() * sizeof(int32_t));
    return true;
  }

  // Finite floats, at most max_floats; `unit` also requires each in [0, 1].
  bool Floats(const flatbuffers::Vector<float>* v, const char* field, bool unit,
              std::vector<float>* out) const {
    if (v == nullptr) {
      out->clear();
      return true;
    }
    if (v->size() > limits_.max_floats) {
      return OutOfRange(std::string(field) + ": " + std::to_string(v->size()) + " floats > limit " +
                        std::to_string(limits_.max_floats));
    }
    out->resize(v->size());
    if (out->empty()) return true;
    std::memcpy(out->data(), v->Data(), v->size() * sizeof(float));
    for (size_t i = 0; i < out->size(); ++i) {
      const float f = (*out)[i];
      if (!std::isfinite(f)) {
        return OutOfRange(std::string(field) + "[" + std::to_string(i) + "]: " + FloatText(f) +
                          " is not finite");
      }
      if (unit && (f < 0.0f || f > 1.0f)) {
        return OutOfRange(std::string(field) + "[" + std::to_string(i) + "]: " + FloatText(f) +
                          " is outside [0, 1]");
      }
    }
    return true;
  }

  // Two parallel vectors (ids, values) of the same length, at most `limit`, values finite.
  bool Pairs(const flatbuffers::Vector<int32_t>* ids, const flatbuffers::Vector<float>* values,
             const char* field, size_t limit, std::vector<std::pair<int32_t, float>>* out) const {
    const size_t n = ids != nullptr ? ids->size() : 0;
    const size_t n_values = values != nullptr ? values->size() : 0;
    if (n != n_values) {
      return OutOfRange(std::string(field) + ": " + std::to_string(n) + " ids but " +
                        std::to_string(n_values) + " values");
    }
    if (n > limit) {
      return OutOfRange(std::string(field) + ": " + std::to_string(n) + " entries > limit " +
                        std::to_string(limit));
    }
    out->resize(n);
    for (flatbuffers::uoffset_t i = 0; i < n; ++i) {
      const float v = values->Get(i);
      if (!std::isfinite(v)) {
        return OutOfRange(std::string(field) + "[" + std::to_string(i) + "]: " + FloatText(v) +
                          " is not finite");
      }
      (*out)[i] = {ids->Get(i), v};
    }
    return true;
  }

  bool Finite(float f, const char* field) const {
    if (std::isfinite(f)) return true;
    return OutOfRange(std::string(field) + ": " + FloatText(f) + " is not finite");
  }

  bool AtMost(uint64_t value, uint64_t limit, const char* field) const {
    if (value <= limit) return true;
    return OutOfRange(std::string(field) + ": " + std::to_string(value) + " > limit " +
                      std::to_string(limit));
  }

  bool Layer(uint32_t layer, const char* field) const {
    return AtMost(layer, limits_.max_layer, field);
  }

  bool Version(uint32_t version, const char* field) const {
    if (version == kProtocolVersion) return true;
    return OutOfRange(std::string(field) + ": peer speaks protocol " + std::to_string(version) +
                      ", this build speaks " + std::to_string(kProtocolVersion));
  }

  bool WorldRank(uint32_t rank, uint32_t world_size, const char* message) const {
    if (world_size == 0) return OutOfRange(std::string(message) + ".world_size: 0 (must be >= 1)");
    if (rank >= world_size) {
      return OutOfRange(std::string(message) + ".rank: " + std::to_string(rank) +
                        " >= world_size " + std::to_string(world_size));
    }
    return true;
  }

  const DecodeLimits& limits() const { return limits_; }

 private:
  const DecodeLimits& limits_;
  DecodeError* error_;
};

bool Read(const fb::WorkerHello& t, const Checker& c, WorkerHello* m) {
  m->world_size = t.world_size();
  m->model_fingerprint = t.model_fingerprint();
  m->instance_id = t.instance_id();
  m->max_batch = t.max_batch();
  m->free_slots = t.free_slots();
  m->protocol_version = t.protocol_version();
  return c.Version(m->protocol_version, "WorkerHello.protocol_version") &&
         c.String(t.group(), "WorkerHello.group", &m->group, /*required=*/true) &&
         c.String(t.model_name(), "WorkerHello.model_name", &m->model_name) &&
         c.WorldRank(0, m->world_size, "WorkerHello");
}

bool Read(const fb::WorkerHelloAck& t, const Checker& c, WorkerHelloAck* m) {
  m->accepted = t.accepted();
  return c.String(t.reason(), "WorkerHelloAck.reason", &m->reason);
}

bool Read(const fb::WorkerHeartbeat& t, const Checker& c, WorkerHeartbeat* m) {
  m->instance_id = t.instance_id();
  m->seq = t.seq();
  m->free_slots = t.free_slots();
  m->active_requests = t.active_requests();
  m->experts = {t.expert_hits(),
                t.expert_misses(),
                t.expert_prefetches_issued(),
                t.expert_prefetches_used(),
                t.expert_bytes_moved(),
                t.expert_stall_us(),
                t.expert_host_runs(),
                t.expert_host_us(),
                t.expert_bytes_not_moved(),
                t.expert_disk_reads(),
                t.expert_disk_bytes(),
                t.expert_disk_stall_us(),
                t.expert_failed_loads(),
                t.expert_failed_experts()};
  m->kv = {t.kv_blocks_total(),   t.kv_blocks_used(),      t.prefix_cache_queries(),
           t.prefix_cache_hits(), t.preemptions(),         t.kv_blocks_max(),
           t.device_kv_bytes(),   t.device_expert_bytes(), {}};
  if (m->kv.max_blocks != 0 && m->kv.max_blocks < m->kv.total_blocks) {
    return c.OutOfRange("WorkerHeartbeat.kv_blocks_max: " + std::to_string(m->kv.max_blocks) +
                        " is below kv_blocks_total " + std::to_string(m->kv.total_blocks));
  }
  if (m->kv.used_blocks > m->kv.total_blocks) {
    return c.OutOfRange("WorkerHeartbeat.kv_blocks_used: " + std::to_string(m->kv.used_blocks) +
                        " exceeds kv_blocks_total " + std::to_string(m->kv.total_blocks));
  }
  m->engine = {t.prompt_chunks(), t.prompt_chunks_grown(), t.prompt_token_ns(),
               t.streamed_iterations()};
  if (m->engine.chunks_grown > m->engine.prompt_chunks) {
    return c.OutOfRange(
        "WorkerHeartbeat.prompt_chunks_grown: " + std::to_string(m->engine.chunks_grown) +
        " exceeds prompt_chunks " + std::to_string(m->engine.prompt_chunks));
  }
  if (m->kv.prefix_hits > m->kv.prefix_queries) {
    return c.OutOfRange("WorkerHeartbeat.prefix_cache_hits: " + std::to_string(m->kv.prefix_hits) +
                        " exceeds prefix_cache_queries " + std::to_string(m->kv.prefix_queries));
  }
  if (const auto* ranks = t.rank_device_memory(); ranks != nullptr) {
    if (!c.AtMost(ranks->size(), c.limits().max_ranks, "WorkerHeartbeat.rank_device_memory")) {
      return false;
    }
    // The verifier checks a vector's length word, not that its 8-byte structs are 8-byte
    // aligned: a hostile frame can misalign them, so each field is copied out, not read in place.
    static_assert(sizeof(fb::RankDeviceMemory) == 16);
    const uint8_t* data = ranks->Data();
    m->kv.ranks.resize(ranks->size());
    for (flatbuffers::uoffset_t i = 0; i < ranks->size(); ++i) {
      uint64_t kv = 0, experts = 0;
      std::memcpy(&kv, data + size_t{i} * 16, 8);
      std::memcpy(&experts, data + size_t{i} * 16 + 8, 8);
      m->kv.ranks[i] = {flatbuffers::EndianScalar(kv), flatbuffers::EndianScalar(experts)};
    }
  }
  return c.String(t.group(), "WorkerHeartbeat.group", &m->group, /*required=*/true);
}

bool Read(const fb::WorkerHeartbeatAck& t, const Checker&, WorkerHeartbeatAck* m) {
  m->seq = t.seq();
  m->known = t.known();
  return true;
}

bool Read(const fb::Generate& t, const Checker& c, Generate* m) {
  m->request_id = t.request_id();
  if (!c.Int32s(t.token_ids(), "Generate.token_ids", c.limits().max_token_ids, &m->token_ids)) {
    return false;
  }
  SamplingParams& s = m->sampling;
  s = SamplingParams{};
  const fb::SamplingParams* sp = t.sampling();
  if (sp == nullptr) return true;  // Plain defaults.
  s.temperature = sp->temperature();
  s.top_p = sp->top_p();
  s.top_k = sp->top_k();
  s.seed = sp->seed();
  s.max_tokens = sp->max_tokens();
  if (!c.Finite(s.temperature, "Generate.sampling.temperature") ||
      !c.Finite(s.top_p, "Generate.sampling.top_p")) {
    return false;
  }
  if (!c.Int32s(sp->stop_token_ids(), "Generate.sampling.stop_token_ids",
                c.limits().max_stop_tokens, &s.stop_token_ids)) {
    return false;
  }
  if (const auto* stops = sp->stop(); stops != nullptr) {
    if (stops->size() > c.limits().max_stop_strings) {
      return c.OutOfRange("Generate.sampling.stop: " + std::to_string(stops->size()) +
                          " strings > limit " + std::to_string(c.limits().max_stop_strings));
    }
    s.stop.resize(stops->size());
    for (flatbuffers::uoffset_t i = 0; i < stops->size(); ++i) {
      if (!c.String(stops->Get(i), "Generate.sampling.stop[]", &s.stop[i], /*required=*/true,
                    c.limits().max_stop_string_bytes)) {
        return false;
      }
    }
  }
  if (!c.Pairs(sp->logit_bias_ids(), sp->logit_bias_values(), "Generate.sampling.logit_bias",
               c.limits().max_logit_bias, &s.logit_bias)) {
    return false;
  }
  // Ranges are ValidateSampling's (common/wire/sampling_limits.h), which the worker answers with
  // an error event naming the field; here only structure: sizes and finite floats. (Stop strings
  // keep their wire field and its limits, but the router sends none and the worker refuses them.)
  s.min_tokens = sp->min_tokens();
  s.ignore_eos = sp->ignore_eos();
  s.presence_penalty = sp->presence_penalty();
  s.frequency_penalty = sp->frequency_penalty();
  s.repetition_penalty = sp->repetition_penalty();
  s.min_p = sp->min_p();
  s.logprobs = sp->logprobs();
  s.prompt_logprobs = sp->prompt_logprobs();
  // Compiled (and refused with an error event) by the worker; here only its size.
  if (!c.String(sp->json_schema(), "Generate.sampling.json_schema", &s.json_schema,
                /*required=*/false, c.limits().max_json_schema_bytes)) {
    return false;
  }
  if (!c.String(sp->grammar(), "Generate.sampling.grammar", &s.grammar, /*required=*/false,
                c.limits().max_json_schema_bytes)) {
    return false;
  }
  if (static_cast<uint8_t>(sp->grammar_syntax()) > kGrammarSyntaxMax) {
    return c.OutOfRange("Generate.sampling.grammar_syntax: " +
                        std::to_string(static_cast<int>(sp->grammar_syntax())) +
                        " is not a syntax");
  }
  s.grammar_syntax = static_cast<GrammarSyntax>(sp->grammar_syntax());
  if (!c.Int32s(sp->constrain_after_tokens(), "Generate.sampling.constrain_after_tokens",
                kMaxConstrainAfter, &s.constrain_after)) {
    return false;
  }
  return c.Finite(s.presence_penalty, "Generate.sampling.presence_penalty") &&
         c.Finite(s.frequency_penalty, "Generate.sampling.frequency_penalty") &&
         c.Finite(s.repetition_penalty, "Generate.sampling.repetition_penalty") &&
         c.Finite(s.min_p, "Generate.sampling.min_p");
}

bool Read(const fb::Cancel& t, const Checker&, Cancel* m) {
  m->request_id = t.request_id();
  return true;
}

bool Read(const fb::TokenEvent& t, const Checker& c, TokenEvent* m) {
  m->request_id = t.request_id();
  m->token_id = t.token_id();
  m->index = t.index();
  const auto finish = static_cast<uint8_t>(t.finish());
  if (finish > kFinishReasonMax) {
    return c.OutOfRange("TokenEvent.finish: " + std::to_string(finish) + " > max " +
                        std::to_string(kFinishReasonMax));
  }
  m->finish = static_cast<FinishReason>(finish);
  m->queue_us = t.queue_us();
  m->token_us = t.token_us();
  m->expert_hits = t.expert_hits();
  m->expert_misses = t.expert_misses();
  m->bytes_moved = t.bytes_moved();
  m->expert_host_runs = t.expert_host_runs();
  m->expert_host_us = t.expert_host_us();
  m->bytes_not_moved = t.bytes_not_moved();
  m->expert_disk_reads = t.expert_disk_reads();
  m->cached_tokens = t.cached_tokens();
  m->logprob = t.logprob();
  m->stop_token = t.stop_token();
  m->too_long = t.too_long();
  if (m->too_long && (m->token_id >= 0 || m->finish != FinishReason::kError)) {
    return c.OutOfRange("TokenEvent.too_long: set on an event that is not an error");
  }
  if (m->stop_token && (m->token_id < 0 || m->finish != FinishReason::kStop)) {
    return c.OutOfRange("TokenEvent.stop_token: set on an event that does not end with a token");
  }
  if (!c.String(t.error(), "TokenEvent.error", &m->error) ||
      !c.Finite(m->logprob, "TokenEvent.logprob") ||
      !c.Pairs(t.top_logprob_ids(), t.top_logprob_values(), "TokenEvent.top_logprobs", kMaxLogprobs,
               &m->top_logprobs)) {
    return false;
  }
  // The prompt's logprobs: one per prompt token after the first, prompt_top_n pairs each.
  m->prompt_top_n = t.prompt_top_n();
  if (!c.AtMost(m->prompt_top_n, kMaxLogprobs, "TokenEvent.prompt_top_n")) return false;
  const size_t n = t.prompt_logprobs() != nullptr ? t.prompt_logprobs()->size() : 0;
  if (!c.AtMost(n, c.limits().max_token_ids, "TokenEvent.prompt_logprobs")) return false;
  m->prompt_logprobs.resize(n);
  for (flatbuffers::uoffset_t i = 0; i < n; ++i) {
    m->prompt_logprobs[i] = t.prompt_logprobs()->Get(i);
    if (!c.Finite(m->prompt_logprobs[i], "TokenEvent.prompt_logprobs[]")) return false;
  }
  if (!c.Pairs(t.prompt_top_ids(), t.prompt_top_values(), "TokenEvent.prompt_top",
               n * m->prompt_top_n, &m->prompt_top)) {
    return false;
  }
  if (m->prompt_top.size() != n * m->prompt_top_n) {
    return c.OutOfRange("TokenEvent.prompt_top: " + std::to_string(m->prompt_top.size()) +
                        " pairs for " + std::to_string(n) + " entries of " +
                        std::to_string(m->prompt_top_n));
  }
  return true;
}

bool Read(const fb::WorkerGoodbye& t, const Checker& c, WorkerGoodbye* m) {
  m->instance_id = t.instance_id();
  return c.String(t.group(), "WorkerGoodbye.group", &m->group, /*required=*/true) &&
         c.String(t.reason(), "WorkerGoodbye.reason", &m->reason);
}

bool Read(const fb::WorkerLoading& t, const Checker& c, WorkerLoading* m) {
  m->instance_id = t.instance_id();
  m->loaded_bytes = t.loaded_bytes();
  m->total_bytes = t.total_bytes();
  if (m->total_bytes != 0 && m->loaded_bytes > m->total_bytes) {
    return c.OutOfRange("WorkerLoading.loaded_bytes: " + std::to_string(m->loaded_bytes) +
                        " > total_bytes " + std::to_string(m->total_bytes));
  }
  return c.String(t.group(), "WorkerLoading.group", &m->group, /*required=*/true);
}

bool Read(const fb::Register& t, const Checker& c, Register* m) {
  m->rank = t.rank();
  m->world_size = t.world_size();
  m->instance_id = t.instance_id();
  m->model_fingerprint = t.model_fingerprint();
  m->num_layers = t.num_layers();
  m->num_experts = t.num_experts();
  m->top_k = t.top_k();
  m->hidden_size = t.hidden_size();
  m->protocol_version = t.protocol_version();
  m->semantic = t.semantic();
  m->delta = t.delta();
  const DecodeLimits& l = c.limits();
  // A shape whose IterationStart/LayerObserved could never pass the limits is refused up front.
  return c.Version(m->protocol_version, "Register.protocol_version") &&
         c.String(t.group(), "Register.group", &m->group, /*required=*/true) &&
         c.WorldRank(m->rank, m->world_size, "Register") &&
         c.AtMost(m->num_layers, uint64_t{l.max_layer} + 1, "Register.num_layers") &&
         c.AtMost(m->num_experts, l.max_floats, "Register.num_experts") &&
         c.AtMost(m->hidden_size, l.max_floats, "Register.hidden_size");
}

bool Read(const fb::RegisterAck& t, const Checker& c, RegisterAck* m) {
  m->accepted = t.accepted();
  m->stored_maps = t.stored_maps();
  return c.String(t.reason(), "RegisterAck.reason", &m->reason);
}

bool Read(const fb::RankHeartbeat& t, const Checker& c, RankHeartbeat* m) {
  m->rank = t.rank();
  m->instance_id = t.instance_id();
  m->seq = t.seq();
  return c.String(t.group(), "RankHeartbeat.group", &m->group, /*required=*/true);
}

bool Read(const fb::RankHeartbeatAck& t, const Checker&, RankHeartbeatAck* m) {
  m->seq = t.seq();
  m->known = t.known();
  return true;
}

bool Read(const fb::IterationStart& t, const Checker& c, IterationStart* m) {
  m->request_id = t.request_id();
  m->iteration = t.iteration();
  return c.Floats(t.sem(), "IterationStart.sem", /*unit=*/false, &m->sem);
}

bool Read(const fb::LayerObserved& t, const Checker& c, LayerObserved* m) {
  m->request_id = t.request_id();
  m->iteration = t.iteration();
  m->layer = t.layer();
  return c.Layer(m->layer, "LayerObserved.layer") &&
         c.Floats(t.probs(), "LayerObserved.probs", /*unit=*/true, &m->probs);
}

bool Read(const fb::IterationEnd& t, const Checker&, IterationEnd* m) {
  m->request_id = t.request_id();
  m->iteration = t.iteration();
  m->finished = t.finished();
  return true;
}

bool Read(const fb::PrefetchDirective& t, const Checker& c, PrefetchDirective* m) {
  m->request_id = t.request_id();
  m->iteration = t.iteration();
  m->target_layer = t.target_layer();
  m->score = t.score();
  if (!c.Layer(m->target_layer, "PrefetchDirective.target_layer") ||
      !c.Finite(m->score, "PrefetchDirective.score")) {
    return false;
  }
  m->entries.clear();
  const auto* entries = t.entries();
  if (entries == nullptr) return true;
  if (entries->size() > c.limits().max_prefetch_entries) {
    return c.OutOfRange("PrefetchDirective.entries: " + std::to_string(entries->size()) +
                        " entries > limit " + std::to_string(c.limits().max_prefetch_entries));
  }
  m->entries.resize(entries->size());
  for (flatbuffers::uoffset_t i = 0; i < entries->size(); ++i) {
    const fb::PrefetchEntry* e = entries->Get(i);
    PrefetchEntry& out = m->entries[i];
    out.expert = e->expert();
    out.probability = e->probability();
    out.priority = e->priority();
    if (!std::isfinite(out.probability) || out.probability < 0.0f || out.probability > 1.0f) {
      return c.OutOfRange("PrefetchDirective.entries[" + std::to_string(i) + "].probability: " +
                          FloatText(out.probability) + " is not a finite value in [0, 1]");
    }
    if (!std::isfinite(out.priority)) {
      return c.OutOfRange("PrefetchDirective.entries[" + std::to_string(i) +
                          "].priority: " + FloatText(out.priority) + " is not finite");
    }
  }
  return true;
}

bool Read(const fb::AdminRequest& t, const Checker& c, AdminRequest* m) {
  m->id = t.id();
  const auto op = static_cast<uint8_t>(t.op());
  if (op > kAdminOpMax) {
    return c.OutOfRange("AdminRequest.op: " + std::to_string(op) + " > max " +
                        std::to_string(kAdminOpMax));
  }
  m->op = static_cast<AdminOp>(op);
  m->model_fingerprint = t.model_fingerprint();
  return c.String(t.path(), "AdminRequest.path", &m->path);
}

bool Read(const fb::AdminReply& t, const Checker& c, AdminReply* m) {
  m->id = t.id();
  m->ok = t.ok();
  return c.String(t.error(), "AdminReply.error", &m->error) &&
         c.String(t.json(), "AdminReply.json", &m->json, false, c.limits().max_admin_json_bytes);
}

bool Read(const fb::MapStored& t, const Checker&, MapStored* m) {
  m->request_id = t.request_id();
  m->iteration = t.iteration();
  m->entry_id = t.entry_id();
  m->replaced_id = t.replaced_id();
  return true;
}

// The FlatBuffers table of a plain message: what its Build returns an offset to.
template <class Plain>
using FbOf = typename OffsetTarget<decltype(Build(std::declval<Builder&>(),
                                                  std::declval<const Plain&>()))>::type;

// Reads body table Fb into the variant alternative Plain.
template <class Plain, class Variant>
bool ReadBody(const void* body, const Checker& c, Variant* out) {
  using Fb = FbOf<Plain>;
  static_assert(TagOf<Fb>() == IndexOf<Variant, Plain>() + 1, "union tag != variant index + 1");
  Plain& plain = out->template emplace<Plain>();
  return Read(*static_cast<const Fb*>(body), c, &plain);
}

// ReadBody of every alternative, indexed by union tag - 1.
template <class Variant>
using BodyReader = bool (*)(const void* body, const Checker& c, Variant* out);
template <class Variant, size_t... I>
constexpr std::array<BodyReader<Variant>, sizeof...(I)> BodyReaders(std::index_sequence<I...>) {
  return {&ReadBody<std::variant_alternative_t<I, Variant>, Variant>...};
}

// Size, identifier and Verifier checks. On success returns the root table, which points into
// *storage (8-byte-aligned copy of the frame).
template <class Envelope>
const Envelope* VerifyFrame(std::span<const uint8_t> frame, const DecodeLimits& limits,
                            const char* identifier, const char* envelope_name,
                            std::vector<uint64_t>* storage, DecodeError* error) {
  if (frame.size() > limits.max_bytes) {
    Fail(error, DropReason::kOversized,
         std::string(envelope_name) + ": " + std::to_string(frame.size()) + " bytes > limit " +
             std::to_string(limits.max_bytes));
    return nullptr;
  }
  constexpr size_t kMinBytes = sizeof(flatbuffers::uoffset_t) + flatbuffers::kFileIdentifierLength;
  if (frame.size() < kMinBytes) {
    Fail(error, DropReason::kTruncated,
         std::string(envelope_name) + ": " + std::to_string(frame.size()) + " bytes < " +
             std::to_string(kMinBytes));
    return nullptr;
  }
  if (!flatbuffers::BufferHasIdentifier(frame.data(), identifier)) {
    std::string got;
    for (size_t i = 4; i < kMinBytes; ++i) {
      const char ch = static_cast<char>(frame[i]);
      got += (ch >= 0x20 && ch < 0x7f) ? ch : '?';
    }
    Fail(error, DropReason::kBadIdentifier,
         std::string(envelope_name) + ": file identifier \"" + got + "\" is not \"" + identifier +
             "\"");
    return nullptr;
  }
  storage->resize((frame.size() + sizeof(uint64_t) - 1) / sizeof(uint64_t));
  auto* buf = reinterpret_cast<uint8_t*>(storage->data());
  std::memcpy(buf, frame.data(), frame.size());
  flatbuffers::Verifier::Options opts;
  opts.max_depth = limits.max_depth;
  opts.max_tables = limits.max_tables;
  opts.check_alignment = true;
  opts.check_nested_flatbuffers = false;
  flatbuffers::Verifier verifier(buf, frame.size(), opts);
  if (!verifier.VerifyBuffer<Envelope>(identifier)) {
    Fail(error, DropReason::kMalformed,
         std::string(envelope_name) + ": FlatBuffers verification failed (" +
             std::to_string(frame.size()) + " bytes)");
    return nullptr;
  }
  return flatbuffers::GetRoot<Envelope>(buf);
}

template <class Tag>
bool MissingOrUnknownBody(Tag tag, const void* body, const char* envelope_name, const Checker& c) {
  if (tag == Tag::NONE || body == nullptr) {
    return !c.OutOfRange(std::string(envelope_name) + ".body: missing");
  }
  if (static_cast<uint8_t>(tag) > static_cast<uint8_t>(Tag::MAX)) {
    return !c.OutOfRange(std::string(envelope_name) + ".body_type: unknown tag " +
                         std::to_string(static_cast<unsigned>(tag)) + " > max " +
                         std::to_string(static_cast<unsigned>(Tag::MAX)));
  }
  return false;
}

// What tells the two channels apart: the envelope table (its builder and union tag come with
// it), the union's traits and names, the file identifier and the name errors use.
template <class Env, template <class> class Traits, auto kBodyName, const char* kId,
          const char* kEnvelopeName>
struct ChannelOf {
  using Envelope = Env;
  using EnvelopeBuilder = typename Env::Builder;
  using Body = decltype(std::declval<const Env&>().body_type());
  template <class Fb>
  static constexpr Body kTag = Traits<Fb>::enum_value;
  static constexpr const char* kIdentifier = kId;
  static constexpr const char* kName = kEnvelopeName;
  static const char* BodyName(Body tag) { return kBodyName(tag); }
};

constexpr char kWorkerEnvelopeName[] = "WorkerEnvelope";
constexpr char kMapEnvelopeName[] = "MapEnvelope";

template <class Variant>
struct Channel;
template <>
struct Channel<WorkerMessage>
    : ChannelOf<fb::WorkerEnvelope, fb::WorkerBodyTraits, fb::EnumNameWorkerBody, kWorkerIdentifier,
                kWorkerEnvelopeName> {};
template <>
struct Channel<MapMessage> : ChannelOf<fb::MapEnvelope, fb::MapBodyTraits, fb::EnumNameMapBody,
                                       kMapIdentifier, kMapEnvelopeName> {};

template <class Variant>
std::vector<uint8_t> EncodeEnvelope(const Variant& message) {
  using C = Channel<Variant>;
  Builder fbb(256 + std::visit([](const auto& m) { return PayloadBytes(m); }, message));
  typename C::Body tag = C::Body::NONE;
  flatbuffers::Offset<void> body;
  std::visit(
      [&](const auto& m) {
        auto offset = Build(fbb, m);
        tag = C::template kTag<typename OffsetTarget<decltype(offset)>::type>;
        body = offset.Union();
      },
      message);
  typename C::EnvelopeBuilder b(fbb);
  b.add_protocol_version(kProtocolVersion);
  b.add_body_type(tag);
  b.add_body(body);
  fbb.Finish(b.Finish(), C::kIdentifier);  // As flatc's Finish<Envelope>Buffer does.
  return Release(fbb);
}

template <class Variant>
bool DecodeEnvelope(std::span<const uint8_t> frame, const DecodeLimits& limits, Variant* out,
                    DecodeError* error) {
  using C = Channel<Variant>;
  static constexpr auto kReaders =
      BodyReaders<Variant>(std::make_index_sequence<std::variant_size_v<Variant>>{});
  std::vector<uint64_t> storage;
  const auto* env =
      VerifyFrame<typename C::Envelope>(frame, limits, C::kIdentifier, C::kName, &storage, error);
  if (env == nullptr) return false;
  const Checker c(limits, error);
  const typename C::Body tag = env->body_type();
  const void* body = env->body();
  if (MissingOrUnknownBody(tag, body, C::kName, c)) return false;
  // NONE and tags past MAX were refused above; the static_asserts make the table cover the rest.
  return kReaders[static_cast<size_t>(tag) - 1](body, c, out);
}

template <class Variant>
std::string_view NameOf(const Variant& message) {
  using C = Channel<Variant>;
  return C::BodyName(static_cast<typename C::Body>(message.index() + 1));
}

}  // namespace

std::string_view DropReasonName(DropReason reason) {
  switch (reason) {
    case DropReason::kOversized:
      return "oversized";
    case DropReason::kTruncated:
      return "truncated";
    case DropReason::kBadIdentifier:
      return "bad_identifier";
    case DropReason::kMalformed:
      return "malformed";
    case DropReason::kOutOfRange:
      return "out_of_range";
    case DropReason::kBadFraming:
      return "bad_framing";
    case DropReason::kCount:
      break;
  }
  return "unknown";
}

std::vector<uint8_t> Encode(const WorkerMessage& message) { return EncodeEnvelope(message); }
std::vector<uint8_t> Encode(const MapMessage& message) { return EncodeEnvelope(message); }

bool Decode(std::span<const uint8_t> frame, const DecodeLimits& limits, WorkerMessage* out,
            DecodeError* error) {
  return DecodeEnvelope(frame, limits, out, error);
}
bool Decode(std::span<const uint8_t> frame, const DecodeLimits& limits, MapMessage* out,
            DecodeError* error) {
  return DecodeEnvelope(frame, limits, out, error);
}

std::string_view MessageName(const WorkerMessage& message) { return NameOf(message); }
std::string_view MessageName(const MapMessage& message) { return NameOf(message); }

}  // namespace fmoe::wire
