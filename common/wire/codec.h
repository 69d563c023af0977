// FlatBuffers encoding and decoding of the wire messages in common/wire/messages.h. The decoder is
// the trust boundary: it copies the frame to aligned memory, checks the file identifier, runs the
// FlatBuffers Verifier with tight limits, then range-checks union tags, enum values, vector
// lengths and floats before building plain structs. Stateless and thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/wire/messages.h"

namespace fmoe::wire {

inline constexpr char kWorkerIdentifier[] = "FMWK";
inline constexpr char kMapIdentifier[] = "FMMP";

// Why a received frame was dropped. Each reason has its own counter.
enum class DropReason : uint8_t {
  kOversized = 0,  // Larger than DecodeLimits::max_bytes.
  kTruncated,      // Too short to hold a root offset and identifier.
  kBadIdentifier,  // File identifier is not this channel's.
  kMalformed,      // The FlatBuffers Verifier rejected it.
  kOutOfRange,     // Verified, but a tag, enum, length or value is outside its range.
  kBadFraming,     // Wrong number of ZeroMQ frames for the socket type.
  kCount,
};
std::string_view DropReasonName(DropReason reason);

struct DecodeLimits {
  size_t max_bytes = 8u << 20;             // Whole frame. Default: 8 MiB
  unsigned max_depth = 8;                  // Verifier nesting depth. Default: 8
  unsigned max_tables = 64;                // Verifier table count. Default: 64
  size_t max_string_bytes = 4096;          // Any string field but the one below. Default: 4096
  size_t max_admin_json_bytes = 1u << 20;  // AdminReply.json. Default: 1 MiB
  size_t max_token_ids = 1u << 20;         // Generate.token_ids. Default: 1,048,576
  size_t max_stop_tokens = 64;             // SamplingParams.stop_token_ids. Default: 64
  size_t max_stop_strings = 16;            // SamplingParams.stop. Default: 16
  size_t max_stop_string_bytes = 256;      // Each stop string. Default: 256
  size_t max_logit_bias = 1024;            // SamplingParams.logit_bias entries. Default: 1024
  size_t max_floats = 1u << 16;            // sem, probs. Default: 65,536
  size_t max_prefetch_entries = 4096;      // PrefetchDirective.entries. Default: 4096
  uint32_t max_layer = 4096;               // layer, target_layer. Default: 4096
  size_t max_ranks = 4096;                 // WorkerHeartbeat.rank_device_memory. Default: 4096

  // SamplingParams.json_schema and .grammar (structured output). Default: 1 MiB
  size_t max_json_schema_bytes = 1u << 20;
};

struct DecodeError {
  DropReason reason = DropReason::kMalformed;
  std::string detail;  // e.g. "LayerObserved.probs: 70000 floats > 65536"
};

std::vector<uint8_t> Encode(const WorkerMessage& message);
std::vector<uint8_t> Encode(const MapMessage& message);

// On failure returns false and fills *error; *out is unspecified.
bool Decode(std::span<const uint8_t> frame, const DecodeLimits& limits, WorkerMessage* out,
            DecodeError* error);
bool Decode(std::span<const uint8_t> frame, const DecodeLimits& limits, MapMessage* out,
            DecodeError* error);

// Name of the alternative held, e.g. "WorkerHello", for logs.
std::string_view MessageName(const WorkerMessage& message);
std::string_view MessageName(const MapMessage& message);

}  // namespace fmoe::wire
