// One streamed completion for `fmoe-bench serve`: POST /v1/completions with "stream": true over
// its own HTTP/1.1 connection ("Connection: close"; the project's client, common/http_client.h),
// the server-sent events parsed as the body arrives, each timed when its bytes are received.
// Thread-safe: every call owns its connection, so one thread per in-flight request may call it
// concurrently.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

namespace fmoe::bench {

using BenchClock = std::chrono::steady_clock;

struct StreamResult {
  bool ok = false;                // 200, a finish reason, usage and [DONE], no error event.
  int http_status = 0;            // 0: no HTTP answer (refused, reset, timed out before the head).
  std::string error;              // Why it is not ok (the API's error message when there is one).
  BenchClock::time_point sent{};  // Just before connecting.
  BenchClock::time_point first_content{};  // First event with non-empty text.
  BenchClock::time_point last_content{};   // Last event with non-empty text.
  // The event with the finish reason: the last token's, text or not (a stop token that ends the
  // answer counts in completion_tokens but has no text).
  BenchClock::time_point finished{};
  BenchClock::time_point done{};  // [DONE], the end of the body, or the failure.
  int content_events = 0;         // Events with non-empty text.
  std::string finish_reason;      // "length", "stop" or "" when none came.
  bool has_usage = false;
  int64_t prompt_tokens = 0;  // From usage.
  int64_t cached_tokens = 0;  // usage.prompt_tokens_details.cached_tokens.
  int64_t completion_tokens = 0;
  uint64_t expert_hits = 0;  // usage.fmoe_experts.
  uint64_t expert_misses = 0;
  uint64_t bytes_moved = 0;
};

// Sends `body` (a JSON completion request that asks for a stream with usage) to
// http://127.0.0.1:port/v1/completions and reads the stream to its end. `authorization` is the
// header's value ("" for none). Gives up with an error after timeout_s, or within ~100 ms once
// `abort` becomes true.
StreamResult StreamCompletion(int port, const std::string& body, const std::string& authorization,
                              double timeout_s, const std::atomic<bool>& abort);

}  // namespace fmoe::bench
