#include "common/log.h"

#include <unistd.h>

#include <exception>
#include <memory>
#include <string>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>

namespace fmoe {
namespace {

// The length of the well-formed UTF-8 sequence at text[i] (2-4), or 0.
size_t Utf8Length(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char b = byte(i);
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // The allowed range of the second byte.
  if (b >= 0xC2 && b <= 0xDF) {
    n = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    n = 3;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;  // No surrogates.
  } else if (b >= 0xF0 && b <= 0xF4) {
    n = 4;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  if (byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
  }
  return n;
}

template <class Out>
void AppendEscaped(std::string_view text, Out& out) {
  static constexpr char kHex[] = "0123456789abcdef";
  const auto put = [&](std::string_view s) { out.append(s.data(), s.data() + s.size()); };
  size_t i = 0;
  while (i < text.size()) {
    const unsigned char b = static_cast<unsigned char>(text[i]);
    if (b >= 0x20 && b < 0x7F) {
      size_t j = i + 1;
      while (j < text.size() && static_cast<unsigned char>(text[j]) >= 0x20 &&
             static_cast<unsigned char>(text[j]) < 0x7F) {
        ++j;
      }
      put(text.substr(i, j - i));
      i = j;
      continue;
    }
    if (b == '\n') {
      put("\\n");
    } else if (b == '\r') {
      put("\\r");
    } else if (b == '\t') {
      put("\\t");
    } else if (b < 0x80) {
      const char hex[] = {'\\', 'x', kHex[b >> 4], kHex[b & 15]};
      put(std::string_view(hex, 4));
    } else if (const size_t n = Utf8Length(text, i); n == 0) {
      const char hex[] = {'\\', 'x', kHex[b >> 4], kHex[b & 15]};
      put(std::string_view(hex, 4));
    } else {
      const unsigned char b1 = static_cast<unsigned char>(text[i + 1]);
      if (n == 2 && b == 0xC2 && b1 < 0xA0) {
        // A C1 control (U+0080..U+009F): CSI and NEL among them.
        const char c1[] = {'\\', 'u', '{', '0', '0', kHex[b1 >> 4], kHex[b1 & 15], '}'};
        put(std::string_view(c1, 8));
      } else {
        put(text.substr(i, n));
      }
      i += n;
      continue;
    }
    ++i;
  }
}

// %* in the pattern: the message, escaped.
class EscapedMessage final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm& /*time*/,
              spdlog::memory_buf_t& dest) override {
    AppendEscaped(std::string_view(msg.payload.data(), msg.payload.size()), dest);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<EscapedMessage>();
  }
};

}  // namespace

std::string EscapeForLog(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  AppendEscaped(text, out);
  return out;
}

Status InitLogging(std::string_view process_name, std::string_view level) {
  spdlog::level::level_enum lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") {
    return InvalidArgument("log level \"" + std::string(level) +
                           "\" is not trace, debug, info, warn or error");
  }
  auto logger = spdlog::stderr_logger_mt(std::string(process_name));
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  formatter->add_flag<EscapedMessage>('*').set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%-5l%$ " +
                                                       EscapeForLog(process_name) + "[" +
                                                       std::to_string(getpid()) + "] %*");
  logger->set_formatter(std::move(formatter));
  logger->set_level(lvl);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
  return Status::Ok();
}

std::string CurrentExceptionText() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace fmoe
