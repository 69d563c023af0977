// libFuzzer target for the wire decoder (common/wire/codec.cc), the trust boundary of both
// channels. Each input is decoded as a WorkerMessage and as a MapMessage, once with the default
// DecodeLimits and once with tight ones. Checked, besides ASan/UBSan/LeakSanitizer:
//   - a rejected frame comes with a DropReason below kCount and a non-empty detail;
//   - an accepted message re-encodes to a frame that decodes again, under the same limits, to the
//     same variant, and re-encoding that gives the same bytes (the codec round-trips whatever it
//     accepts).
// A violation aborts with __builtin_trap. Seeds: tests/fuzz/make_corpus.cc.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/wire/codec.h"

namespace fmoe::wire {
namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

// Small enough that the seeds both pass and trip each limit.
DecodeLimits TightLimits() {
  DecodeLimits l;
  l.max_bytes = 512;
  l.max_depth = 4;
  l.max_tables = 4;
  l.max_string_bytes = 8;
  l.max_admin_json_bytes = 16;
  l.max_token_ids = 4;
  l.max_stop_tokens = 2;
  l.max_stop_strings = 2;
  l.max_stop_string_bytes = 4;
  l.max_floats = 4;
  l.max_prefetch_entries = 2;
  l.max_layer = 3;
  l.max_ranks = 2;
  return l;
}

template <class Message>
void DecodeOne(std::span<const uint8_t> frame, const DecodeLimits& limits) {
  Message message;
  DecodeError error;
  if (!Decode(frame, limits, &message, &error)) {
    Check(error.reason < DropReason::kCount && !error.detail.empty());
    return;
  }
  // A re-encoded frame may be larger than a hand-packed one: only the size limit is relaxed.
  DecodeLimits again_limits = limits;
  again_limits.max_bytes = DecodeLimits{}.max_bytes;
  const std::vector<uint8_t> encoded = Encode(message);
  Message again;
  Check(Decode(encoded, again_limits, &again, &error));
  Check(again.index() == message.index());
  Check(Encode(again) == encoded);
}

void FuzzOne(std::span<const uint8_t> frame) {
  static const DecodeLimits kDefault{};
  static const DecodeLimits kTight = TightLimits();
  for (const DecodeLimits* limits : {&kDefault, &kTight}) {
    DecodeOne<WorkerMessage>(frame, *limits);
    DecodeOne<MapMessage>(frame, *limits);
  }
}

}  // namespace
}  // namespace fmoe::wire

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fmoe::wire::FuzzOne(std::span<const uint8_t>(data, size));
  return 0;
}
