#include "common/wire/curve_key.h"

namespace fmoe::wire {
namespace {

constexpr size_t kZ85KeyChars = 40;

bool IsZ85(char c) {
  static constexpr std::string_view kAlphabet =
      "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";
  return kAlphabet.find(c) != std::string_view::npos;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  return s;
}

}  // namespace

Result<CurveKey> ParseCurveKeyFile(std::string_view text) {
  if (text.size() > kMaxCurveKeyFileBytes) {
    return InvalidArgument("cluster key file: " + std::to_string(text.size()) +
                           " bytes; a key file is under " + std::to_string(kMaxCurveKeyFileBytes));
  }
  CurveKey key;
  size_t line_no = 0;
  while (!text.empty()) {
    ++line_no;
    const size_t end = text.find('\n');
    std::string_view line = Trim(text.substr(0, end));
    text = end == std::string_view::npos ? std::string_view() : text.substr(end + 1);
    if (line.empty() || line.front() == '#') continue;
    const std::string where = "cluster key file: line " + std::to_string(line_no) + ": ";
    const size_t eq = line.find('=');
    if (eq == std::string_view::npos) {
      return InvalidArgument(where + "expected \"public-key = ...\" or \"secret-key = ...\"");
    }
    const std::string_view name = Trim(line.substr(0, eq));
    const std::string_view value = Trim(line.substr(eq + 1));
    std::string* slot = nullptr;
    if (name == "public-key") {
      slot = &key.public_key;
    } else if (name == "secret-key") {
      slot = &key.secret_key;
    } else {
      return InvalidArgument(where + "unknown name \"" + std::string(name.substr(0, 40)) +
                             "\" (public-key or secret-key)");
    }
    if (!slot->empty()) return InvalidArgument(where + std::string(name) + " given twice");
    if (value.size() != kZ85KeyChars) {
      return InvalidArgument(where + std::string(name) + " has " + std::to_string(value.size()) +
                             " characters; a Z85 CURVE key has 40");
    }
    for (char c : value) {
      if (!IsZ85(c)) {
        return InvalidArgument(where + std::string(name) +
                               " holds a character outside Z85's alphabet");
      }
    }
    *slot = std::string(value);
  }
  if (key.public_key.empty()) return InvalidArgument("cluster key file: no public-key line");
  if (key.secret_key.empty()) return InvalidArgument("cluster key file: no secret-key line");
  return key;
}

std::string FormatCurveKeyFile(const CurveKey& key) {
  return "# fmoe cluster key (CURVE). Every process of the cluster holds this file; whoever has "
         "it\n"
         "# can join the cluster's ZeroMQ sockets. Keep it private (mode 0600).\n"
         "public-key = " +
         key.public_key + "\nsecret-key = " + key.secret_key + "\n";
}

}  // namespace fmoe::wire
