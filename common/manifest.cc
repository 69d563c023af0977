// Cluster manifest parsing and validation (see manifest.h). yaml-cpp is used only here: its
// exceptions are caught in ParseManifest and become kInvalidArgument statuses. Every value error
// names the key path, e.g. "manifest: worker_groups[0].workers[1].device: ...".
#include "common/manifest.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <span>
#include <sstream>
#include <system_error>
#include <utility>

#include "common/policy_names.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;

using KeyList = std::span<const std::string_view>;

constexpr std::string_view kTopKeys[] = {"model",     "map_service", "worker_groups", "router",
                                         "heartbeat", "logging",     "launcher",      "security"};
constexpr std::string_view kSecurityKeys[] = {"curve", "key_file"};
constexpr std::string_view kModelKeys[] = {"path", "name", "dtype"};
constexpr std::string_view kMapServiceKeys[] = {"endpoint",          "data_dir", "store_capacity",
                                                "prefetch_distance", "sync",     "memory_limit_mb"};
constexpr std::string_view kGroupKeys[] = {"name",
                                           "policy",
                                           "max_batch",
                                           "max_batched_tokens",
                                           "chunk_overhead",
                                           "prefill_stream",
                                           "prefill_stream_slots",
                                           "queue_limit",
                                           "kv_cache_tokens",
                                           "prefix_caching",
                                           "expert_cache_gb",
                                           "expert_cache_fraction",
                                           "memory_utilization",
                                           "memory",
                                           "host_cache_gb",
                                           "host_cache_fraction",
                                           "link",
                                           "hybrid",
                                           "rendezvous",
                                           "collective_timeout_s",
                                           "rendezvous_timeout_s",
                                           "record_trace",
                                           "workers"};
constexpr std::string_view kStreamModes[] = {"off", "auto", "on"};
constexpr std::string_view kLinkKeys[] = {"gbps", "latency_us"};
constexpr std::string_view kHybridKeys[] = {"cpu_threads", "host_slowdown"};
constexpr std::string_view kMemoryKeys[] = {"device_gb", "device_fraction", "kv_floor",
                                            "expert_floor", "return_hold_s"};
constexpr std::string_view kWorkerKeys[] = {"device", "host"};
constexpr std::string_view kRouterKeys[] = {
    "listen",   "worker_endpoint",      "request_timeout_s", "drain_timeout_s",    "max_body_bytes",
    "api_keys", "cors_allowed_origins", "tool_call_parser",  "responses_capacity", "responses_dir"};
constexpr std::string_view kHeartbeatKeys[] = {"interval_ms", "timeout_ms"};
constexpr std::string_view kLoggingKeys[] = {"level"};
constexpr std::string_view kLauncherKeys[] = {"run_dir", "ready_timeout_s", "stop_timeout_s",
                                              "services_wait_s", "restart"};
constexpr std::string_view kRestartKeys[] = {"initial_backoff_ms", "max_backoff_ms", "max_restarts",
                                             "window_s"};
constexpr std::string_view kDtypes[] = {"auto", "float32", "bfloat16", "float16"};
constexpr std::string_view kLogLevels[] = {"trace", "debug", "info", "warn", "error"};

constexpr size_t kMaxGroups = 64;
constexpr size_t kMaxWorkers = 64;
constexpr int kRendezvousBasePort = 29500;
constexpr size_t kMaxIpcPathBytes = 107;  // sizeof(sockaddr_un::sun_path) - 1 on Linux.
constexpr uintmax_t kMaxManifestBytes = 16u << 20;
constexpr std::string_view kRedactedKey = "***";

// ---- small text helpers ----

std::string Join(KeyList items) {
  std::string out;
  for (std::string_view item : items) {
    if (!out.empty()) out += ", ";
    out += item;
  }
  return out;
}

bool Contains(KeyList items, std::string_view value) {
  for (std::string_view item : items) {
    if (item == value) return true;
  }
  return false;
}

// `text` in double quotes with control characters escaped, cut at 80 bytes, for messages.
std::string Quote(std::string_view text) {
  constexpr size_t kMaxShown = 80;
  std::string out = "\"";
  for (size_t i = 0; i < text.size() && i < kMaxShown; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (text.size() > kMaxShown) out += "...";
  out += '"';
  return out;
}

std::string FormatDouble(double value) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value);
  if (ec != std::errc()) return "?";
  return std::string(buf, end);
}

std::string JoinPath(std::string_view parent, std::string_view key) {
  if (parent.empty()) return std::string(key);
  std::string out(parent);
  out += '.';
  out += key;
  return out;
}

std::string IndexPath(std::string_view parent, size_t index) {
  return std::string(parent) + "[" + std::to_string(index) + "]";
}

Status Error(std::string_view path, std::string_view what) {
  std::string m = "manifest: ";
  m += path.empty() ? std::string_view("top level") : path;
  m += ": ";
  m += what;
  return InvalidArgument(std::move(m));
}

// ---- host and port syntax ----

bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsAlnum(char c) { return IsDigit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

bool IsIpv4(std::string_view host) {
  int octets = 0;
  size_t pos = 0;
  while (true) {
    size_t dot = host.find('.', pos);
    std::string_view part = host.substr(pos, dot == std::string_view::npos ? dot : dot - pos);
    if (part.empty() || part.size() > 3 || (part.size() > 1 && part[0] == '0')) return false;
    int value = 0;
    for (char c : part) {
      if (!IsDigit(c)) return false;
      value = value * 10 + (c - '0');
    }
    if (value > 255) return false;
    ++octets;
    if (dot == std::string_view::npos) break;
    pos = dot + 1;
  }
  return octets == 4;
}

// An IPv4 literal or a DNS-style host name (labels of [A-Za-z0-9_-], 1..63 bytes, not starting
// or ending with '-', 253 bytes in all). `*` only where `allow_wildcard` (ZMQ binds).
bool IsValidHost(std::string_view host, bool allow_wildcard) {
  if (host.empty() || host.size() > 253) return false;
  if (host == "*") return allow_wildcard;
  bool numeric = true;
  for (char c : host) {
    if (!IsDigit(c) && c != '.') numeric = false;
  }
  if (numeric) return IsIpv4(host);
  size_t pos = 0;
  while (true) {
    size_t dot = host.find('.', pos);
    std::string_view label = host.substr(pos, dot == std::string_view::npos ? dot : dot - pos);
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') {
      return false;
    }
    for (char c : label) {
      if (!IsAlnum(c) && c != '-' && c != '_') return false;
    }
    if (dot == std::string_view::npos) return true;
    pos = dot + 1;
  }
}

// Parses HOST:PORT; `shown` is the text named in messages (the whole endpoint for ZMQ).
Result<HostPort> ParseHostPortImpl(std::string_view text, std::string_view shown,
                                   bool allow_wildcard) {
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos) {
    return InvalidArgument(Quote(shown) + " is not HOST:PORT");
  }
  std::string_view host = text.substr(0, colon);
  std::string_view port = text.substr(colon + 1);
  if (host.empty()) return InvalidArgument(Quote(shown) + " has an empty host");
  if (!IsValidHost(host, allow_wildcard)) {
    return InvalidArgument(Quote(shown) + " has host " + Quote(host) +
                           ", which is not an IPv4 address or host name");
  }
  bool digits = !port.empty() && port.size() <= 5;
  for (char c : port) digits = digits && IsDigit(c);
  if (!digits) {
    return InvalidArgument(Quote(shown) + " has port " + Quote(port) +
                           "; expected a number 1..65535");
  }
  int value = 0;
  for (char c : port) value = value * 10 + (c - '0');
  if (value < 1 || value > 65535) {
    return InvalidArgument(Quote(shown) + " has port " + std::to_string(value) +
                           "; expected 1..65535");
  }
  return HostPort{std::string(host), static_cast<uint16_t>(value)};
}

// A parsed ZMQ endpoint: tcp (host, port) or ipc (absolute path).
struct ZmqAddress {
  bool ipc = false;
  HostPort tcp;
  std::string ipc_path;
};

Result<ZmqAddress> ParseZmqEndpoint(std::string_view endpoint) {
  constexpr std::string_view kTcp = "tcp://";
  constexpr std::string_view kIpc = "ipc://";
  ZmqAddress address;
  if (endpoint.starts_with(kTcp)) {
    FMOE_ASSIGN_OR_RETURN(address.tcp,
                          ParseHostPortImpl(endpoint.substr(kTcp.size()), endpoint, true));
    return address;
  }
  if (endpoint.starts_with(kIpc)) {
    std::string_view path = endpoint.substr(kIpc.size());
    if (path.empty() || path.front() != '/' || path == "/") {
      return InvalidArgument(Quote(endpoint) +
                             " does not name an absolute path; expected ipc:///absolute/path");
    }
    if (path.find('\0') != std::string_view::npos) {
      return InvalidArgument(Quote(endpoint) + " contains a NUL byte");
    }
    if (path.size() > kMaxIpcPathBytes) {
      return InvalidArgument(Quote(endpoint) + " has a path of " + std::to_string(path.size()) +
                             " bytes; a Unix socket path holds at most " +
                             std::to_string(kMaxIpcPathBytes));
    }
    address.ipc = true;
    address.ipc_path = std::string(path);
    return address;
  }
  return InvalidArgument(Quote(endpoint) + " is not tcp://HOST:PORT or ipc:///absolute/path");
}

// The host as compared for port collisions: lower case, localhost as 127.0.0.1.
std::string CanonicalHost(std::string_view host) {
  std::string out(host);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  if (out == "localhost") return "127.0.0.1";
  return out;
}

bool IsWildcardHost(std::string_view canonical) {
  return canonical == "*" || canonical == "0.0.0.0";
}

// ---- YAML access with key paths ----

std::string KindOf(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null:
      return "null";
    case YAML::NodeType::Scalar:
      return "scalar " + Quote(node.Scalar());
    case YAML::NodeType::Sequence:
      return "a sequence";
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Undefined:
      break;
  }
  return "nothing";
}

// A value found (or not) under a key.
struct Field {
  YAML::Node node;
  std::string path;
  bool present = false;
};

// A YAML map whose keys were checked against an allowed list, in file order.
class Section {
 public:
  // An absent field gives an empty section (all defaults).
  static Result<Section> Read(const Field& field, KeyList allowed) {
    Section section;
    section.path_ = field.path;
    if (!field.present) return section;
    if (field.node.IsNull()) {
      return Error(field.path, "has no value; expected a map");
    }
    if (!field.node.IsMap()) {
      return Error(field.path, "expected a map, got " + KindOf(field.node));
    }
    for (auto it = field.node.begin(); it != field.node.end(); ++it) {
      const YAML::Node key = it->first;  // A copy: it-> returns a temporary proxy.
      if (!key.IsScalar()) {
        return Error(field.path, "keys must be strings, got " + KindOf(key));
      }
      const std::string& name = key.Scalar();
      const std::string path = JoinPath(field.path, name);
      if (!Contains(allowed, name)) {
        return Error(path, "unknown key; allowed keys: " + Join(allowed));
      }
      for (const auto& [seen, value] : section.entries_) {
        if (seen == name) return Error(path, "key is given twice");
      }
      const YAML::Node value = it->second;
      section.entries_.emplace_back(name, value);
    }
    return section;
  }

  Field Get(std::string_view key) const {
    for (const auto& [name, value] : entries_) {
      if (name == key) return Field{value, JoinPath(path_, key), true};
    }
    return Field{YAML::Node(), JoinPath(path_, key), false};
  }

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<std::pair<std::string, YAML::Node>> entries_;
};

// The scalar text of a present field. Quoted scalars are refused unless `allow_quoted`
// (numbers and booleans must be plain).
Status ScalarText(const Field& field, std::string_view expected, bool allow_quoted,
                  std::string* text) {
  if (field.node.IsNull()) {
    return Error(field.path, "has no value; expected " + std::string(expected));
  }
  if (!field.node.IsScalar()) {
    return Error(field.path, "expected " + std::string(expected) + ", got " + KindOf(field.node));
  }
  *text = field.node.Scalar();
  if (!allow_quoted && field.node.Tag() == "!") {
    return Error(field.path,
                 Quote(*text) + " is a quoted string; expected " + std::string(expected));
  }
  return Status::Ok();
}

// Non-empty string without NUL bytes; leaves *out alone when absent.
Status ReadString(const Field& field, std::string* out) {
  if (!field.present) return Status::Ok();
  std::string text;
  FMOE_RETURN_IF_ERROR(ScalarText(field, "a string", true, &text));
  if (text.empty()) return Error(field.path, "must not be empty");
  if (text.find('\0') != std::string::npos) return Error(field.path, "contains a NUL byte");
  *out = std::move(text);
  return Status::Ok();
}

Status ReadEnum(const Field& field, KeyList allowed, std::string* out) {
  if (!field.present) return Status::Ok();
  std::string text;
  FMOE_RETURN_IF_ERROR(ReadString(field, &text));
  if (!Contains(allowed, text)) {
    return Error(field.path, Quote(text) + " is not one of " + Join(allowed));
  }
  *out = std::move(text);
  return Status::Ok();
}

template <typename T>
Status ReadInt(const Field& field, int64_t lo, int64_t hi, T* out) {
  if (!field.present) return Status::Ok();
  std::string text;
  FMOE_RETURN_IF_ERROR(ScalarText(field, "an integer", false, &text));
  std::string_view digits = text;
  if (digits.size() > 1 && digits[0] == '+' && IsDigit(digits[1])) digits.remove_prefix(1);
  int64_t value = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  const std::string range = std::to_string(lo) + ".." + std::to_string(hi);
  if (ec == std::errc::result_out_of_range) {
    return Error(field.path, text + " is out of range " + range);
  }
  if (ec != std::errc() || end != digits.data() + digits.size()) {
    return Error(field.path, Quote(text) + " is not an integer");
  }
  if (value < lo || value > hi) return Error(field.path, text + " is out of range " + range);
  *out = static_cast<T>(value);
  return Status::Ok();
}

struct DoubleRange {
  double lo;
  bool lo_open;  // (lo, ... when true, [lo, ... when false.
  double hi;     // Always closed.
  std::string ToString() const {
    return std::string(lo_open ? "(" : "[") + FormatDouble(lo) + ", " + FormatDouble(hi) + "]";
  }
  bool Contains(double v) const { return (lo_open ? v > lo : v >= lo) && v <= hi; }
};

Status ReadDouble(const Field& field, const DoubleRange& range, double* out) {
  if (!field.present) return Status::Ok();
  std::string text;
  FMOE_RETURN_IF_ERROR(ScalarText(field, "a number", false, &text));
  std::string_view digits = text;
  if (digits.size() > 1 && digits[0] == '+' && (IsDigit(digits[1]) || digits[1] == '.')) {
    digits.remove_prefix(1);
  }
  double value = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (ec == std::errc::result_out_of_range) {
    return Error(field.path, text + " is out of range " + range.ToString());
  }
  if (ec != std::errc() || end != digits.data() + digits.size() || !std::isfinite(value)) {
    return Error(field.path, Quote(text) + " is not a finite number");
  }
  if (!range.Contains(value)) {
    return Error(field.path, text + " is out of range " + range.ToString());
  }
  *out = value;
  return Status::Ok();
}

Status ReadBool(const Field& field, bool* out) {
  if (!field.present) return Status::Ok();
  std::string text;
  FMOE_RETURN_IF_ERROR(ScalarText(field, "true or false", false, &text));
  if (text == "true") {
    *out = true;
  } else if (text == "false") {
    *out = false;
  } else {
    return Error(field.path, Quote(text) + " is not a boolean; use true or false");
  }
  return Status::Ok();
}

// `text` made absolute against `base_dir` and lexically normalised, without a trailing '/'.
std::string AbsolutePath(const std::string& base_dir, std::string_view text) {
  fs::path path{std::string(text)};
  if (path.is_relative()) path = fs::path(base_dir) / path;
  std::string out = path.lexically_normal().string();
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

Status ReadPath(const Field& field, const std::string& base_dir, std::string* out) {
  if (!field.present) return Status::Ok();
  std::string text;
  FMOE_RETURN_IF_ERROR(ReadString(field, &text));
  if (text.front() == '~') {
    return Error(field.path, Quote(text) +
                                 ": '~' is not expanded; give an absolute path or one relative "
                                 "to the manifest's directory");
  }
  *out = AbsolutePath(base_dir, text);
  return Status::Ok();
}

Status ReadHostPort(const Field& field, std::string* out) {
  if (!field.present) return Status::Ok();
  std::string text;
  FMOE_RETURN_IF_ERROR(ReadString(field, &text));
  Result<HostPort> parsed = ParseHostPortImpl(text, text, false);
  if (!parsed.ok()) return Error(field.path, parsed.status().message());
  *out = std::move(text);
  return Status::Ok();
}

Status ReadZmqEndpoint(const Field& field, std::string* out) {
  if (!field.present) return Status::Ok();
  std::string text;
  FMOE_RETURN_IF_ERROR(ReadString(field, &text));
  Status status = ValidateZmqEndpoint(text);
  if (!status.ok()) return Error(field.path, status.message());
  *out = std::move(text);
  return Status::Ok();
}

// A sequence with 1..max_size entries (required).
Status CheckSequence(const Field& field, size_t max_size, std::string_view entries) {
  if (!field.present) return Error(field.path, "required key is missing");
  if (field.node.IsNull()) return Error(field.path, "has no value; expected a sequence");
  if (!field.node.IsSequence()) {
    return Error(field.path, "expected a sequence, got " + KindOf(field.node));
  }
  if (field.node.size() == 0) return Error(field.path, "must not be empty");
  if (field.node.size() > max_size) {
    return Error(field.path, "has " + std::to_string(field.node.size()) + " " +
                                 std::string(entries) + "; at most " + std::to_string(max_size) +
                                 " are allowed");
  }
  return Status::Ok();
}

Field Element(const Field& sequence, size_t index) {
  return Field{sequence.node[index], IndexPath(sequence.path, index), true};
}

// ---- sections ----

Status ParseModel(const Field& field, const std::string& base_dir, ModelSpec* model) {
  if (!field.present) return Error(field.path, "required key is missing");
  FMOE_ASSIGN_OR_RETURN(Section section, Section::Read(field, kModelKeys));
  const Field path = section.Get("path");
  if (!path.present) return Error(path.path, "required key is missing");
  FMOE_RETURN_IF_ERROR(ReadPath(path, base_dir, &model->path));
  const Field name = section.Get("name");
  if (name.present) {
    FMOE_RETURN_IF_ERROR(ReadString(name, &model->name));
    for (char c : model->name) {
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
        return Error(name.path, Quote(model->name) + " contains a control character");
      }
    }
    if (model->name.size() > 256) return Error(name.path, "is longer than 256 bytes");
  } else {
    model->name = fs::path(model->path).filename().string();
    if (model->name.empty()) {
      return Error(path.path, Quote(model->path) + " has no base name to serve it under; set " +
                                  JoinPath(section.path(), "name"));
    }
  }
  return ReadEnum(section.Get("dtype"), kDtypes, &model->dtype);
}

Status ParseMapService(const Field& field, const std::string& base_dir, MapServiceSpec* spec) {
  FMOE_ASSIGN_OR_RETURN(Section section, Section::Read(field, kMapServiceKeys));
  FMOE_RETURN_IF_ERROR(ReadZmqEndpoint(section.Get("endpoint"), &spec->endpoint));
  spec->data_dir = AbsolutePath(base_dir, ".fmoe/maps");
  FMOE_RETURN_IF_ERROR(ReadPath(section.Get("data_dir"), base_dir, &spec->data_dir));
  FMOE_RETURN_IF_ERROR(ReadInt(section.Get("store_capacity"), 1, 1000000, &spec->store_capacity));
  FMOE_RETURN_IF_ERROR(ReadInt(section.Get("prefetch_distance"), 1, 16, &spec->prefetch_distance));
  FMOE_RETURN_IF_ERROR(
      ReadInt(section.Get("memory_limit_mb"), 16, 1 << 20, &spec->memory_limit_mb));
  return ReadBool(section.Get("sync"), &spec->sync);
}

Status ParseDevice(const Field& field, WorkerSpec* worker) {
  if (!field.present) return Status::Ok();
  std::string text;
  FMOE_RETURN_IF_ERROR(ReadString(field, &text));
  if (text == "cpu") {
    worker->device = text;
    worker->cuda_index = -1;
    return Status::Ok();
  }
  constexpr std::string_view kCuda = "cuda:";
  std::string_view index = std::string_view(text);
  bool ok = index.starts_with(kCuda);
  if (ok) index.remove_prefix(kCuda.size());
  ok = ok && !index.empty() && (index.size() == 1 || index[0] != '0');
  for (char c : index) ok = ok && IsDigit(c);
  int value = 0;
  if (ok) {
    auto [end, ec] = std::from_chars(index.data(), index.data() + index.size(), value);
    ok = ec == std::errc() && end == index.data() + index.size();
  }
  if (!ok) return Error(field.path, Quote(text) + " is not cpu or cuda:N");
  worker->device = text;
  worker->cuda_index = value;
  return Status::Ok();
}

Status ParseWorkers(const Field& field, std::vector<WorkerSpec>* workers) {
  FMOE_RETURN_IF_ERROR(CheckSequence(field, kMaxWorkers, "workers"));
  // (canonical host, cuda index) -> rank that uses it.
  std::map<std::pair<std::string, int>, size_t> cuda_owner;
  for (size_t rank = 0; rank < field.node.size(); ++rank) {
    FMOE_ASSIGN_OR_RETURN(Section section, Section::Read(Element(field, rank), kWorkerKeys));
    WorkerSpec worker;
    const Field device = section.Get("device");
    FMOE_RETURN_IF_ERROR(ParseDevice(device, &worker));
    const Field host = section.Get("host");
    FMOE_RETURN_IF_ERROR(ReadString(host, &worker.host));
    if (!IsValidHost(worker.host, false)) {
      return Error(host.path, Quote(worker.host) + " is not an IPv4 address or host name");
    }
    if (rank > 0 && (worker.cuda_index < 0) != (workers->front().cuda_index < 0)) {
      return Error(device.path, Quote(worker.device) +
                                    " mixes cpu and cuda devices in one group; workers[0] is " +
                                    Quote(workers->front().device));
    }
    if (worker.cuda_index >= 0) {
      auto [it, inserted] =
          cuda_owner.emplace(std::make_pair(CanonicalHost(worker.host), worker.cuda_index), rank);
      if (!inserted) {
        return Error(device.path, Quote(worker.device) + " on host " + worker.host +
                                      " is already used by workers[" + std::to_string(it->second) +
                                      "]");
      }
    }
    workers->push_back(std::move(worker));
  }
  return Status::Ok();
}

Status ParsePolicy(const Field& field, std::string* out) {
  if (!field.present) return Status::Ok();
  std::string text;
  FMOE_RETURN_IF_ERROR(ReadString(field, &text));
  const PolicyName* policy = FindPolicyName(text);
  const std::string valid = PolicyNameList(/*servable_only=*/true);
  if (policy != nullptr && !policy->servable) {
    return Error(field.path, Quote(text) +
                                 " is replay-only (it needs perfect knowledge of the future) and "
                                 "cannot be served; valid policies: " +
                                 valid);
  }
  if (policy == nullptr) {
    return Error(field.path, Quote(text) + " is not a policy; valid policies: " + valid);
  }
  *out = std::move(text);
  return Status::Ok();
}

bool IsValidGroupName(std::string_view name) {
  if (name.empty() || name.size() > 32) return false;
  for (char c : name) {
    if (!IsAlnum(c) && c != '_' && c != '-') return false;
  }
  return true;
}

// hybrid: off | auto | {cpu_threads: N, host_slowdown: x}
Status ParseHybrid(const Field& field, HybridSpec* spec) {
  if (!field.present) return Status::Ok();
  if (field.node.IsScalar()) {
    const std::string text = field.node.Scalar();
    if (text == "off") {
      spec->enabled = false;
      return Status::Ok();
    }
    if (text == "auto") {
      spec->enabled = true;
      return Status::Ok();
    }
    return Error(field.path,
                 Quote(text) + " is not off, auto or a map of cpu_threads and host_slowdown");
  }
  FMOE_ASSIGN_OR_RETURN(Section section, Section::Read(field, kHybridKeys));
  spec->enabled = true;
  FMOE_RETURN_IF_ERROR(ReadInt(section.Get("cpu_threads"), 1, 1024, &spec->cpu_threads));
  return ReadDouble(section.Get("host_slowdown"), {1, false, 1000000}, &spec->host_slowdown);
}

// The group's `memory` (one device budget), after the rest of the group.
Status ParseMemory(const Section& group_section, WorkerGroupSpec* group) {
  const Field field = group_section.Get("memory");
  if (!field.present) return Status::Ok();
  for (const char* key :
       {"expert_cache_gb", "expert_cache_fraction", "memory_utilization", "kv_cache_tokens"}) {
    if (group_section.Get(key).present) {
      return Error(field.path, std::string("sizes the expert cache and the KV pool together; ") +
                                   key + " cannot be set with it");
    }
  }
  FMOE_ASSIGN_OR_RETURN(Section section, Section::Read(field, kMemoryKeys));
  MemorySpec m;
  const Field gb = section.Get("device_gb");
  const Field fraction = section.Get("device_fraction");
  if (gb.present && fraction.present) {
    return Error(field.path, "device_gb and device_fraction are both set; set at most one");
  }
  if (gb.present) {
    double value = 0;
    FMOE_RETURN_IF_ERROR(ReadDouble(gb, {0, true, 100000}, &value));
    m.device_gb = value;
  }
  FMOE_RETURN_IF_ERROR(ReadDouble(fraction, {0, true, 1}, &m.device_fraction));
  FMOE_RETURN_IF_ERROR(ReadDouble(section.Get("kv_floor"), {0, false, 0.999}, &m.kv_floor));
  FMOE_RETURN_IF_ERROR(ReadDouble(section.Get("expert_floor"), {0, false, 0.999}, &m.expert_floor));
  FMOE_RETURN_IF_ERROR(
      ReadDouble(section.Get("return_hold_s"), {0, false, 3600}, &m.return_hold_s));
  if (m.kv_floor + m.expert_floor > 1) {
    return Error(field.path, "kv_floor " + std::to_string(m.kv_floor) + " + expert_floor " +
                                 std::to_string(m.expert_floor) + " exceed 1");
  }
  group->memory = m;
  group->expert_cache_fraction.reset();
  return Status::Ok();
}

Status ParseGroup(const Field& field, size_t index, const std::string& base_dir,
                  WorkerGroupSpec* group) {
  FMOE_ASSIGN_OR_RETURN(Section section, Section::Read(field, kGroupKeys));
  const Field name = section.Get("name");
  if (!name.present) return Error(name.path, "required key is missing");
  FMOE_RETURN_IF_ERROR(ReadString(name, &group->name));
  if (!IsValidGroupName(group->name)) {
    return Error(name.path, Quote(group->name) + " does not match [A-Za-z0-9_-]{1,32}");
  }
  FMOE_RETURN_IF_ERROR(ParsePolicy(section.Get("policy"), &group->policy));
  FMOE_RETURN_IF_ERROR(ReadInt(section.Get("max_batch"), 1, 1024, &group->max_batch));
  group->max_batched_tokens = std::max(512, group->max_batch);
  const Field budget = section.Get("max_batched_tokens");
  FMOE_RETURN_IF_ERROR(ReadInt(budget, 0, 1 << 20, &group->max_batched_tokens));
  if (group->max_batched_tokens != 0 && group->max_batched_tokens < group->max_batch) {
    return Error(budget.path, std::to_string(group->max_batched_tokens) + " is below max_batch " +
                                  std::to_string(group->max_batch) +
                                  " (each running request needs a token of every step); 0 = "
                                  "no budget");
  }
  FMOE_RETURN_IF_ERROR(
      ReadDouble(section.Get("chunk_overhead"), {0, false, 1000}, &group->chunk_overhead));
  FMOE_RETURN_IF_ERROR(
      ReadEnum(section.Get("prefill_stream"), kStreamModes, &group->prefill_stream));
  FMOE_RETURN_IF_ERROR(
      ReadInt(section.Get("prefill_stream_slots"), 0, 65536, &group->prefill_stream_slots));
  FMOE_RETURN_IF_ERROR(ReadInt(section.Get("queue_limit"), 1, 100000, &group->queue_limit));
  if (const Field kv = section.Get("kv_cache_tokens"); kv.present) {
    FMOE_RETURN_IF_ERROR(ReadInt(kv, 16, int64_t{1} << 32, &group->kv_cache_tokens));
  }
  FMOE_RETURN_IF_ERROR(ReadBool(section.Get("prefix_caching"), &group->prefix_caching));
  const Field gb = section.Get("expert_cache_gb");
  const Field fraction = section.Get("expert_cache_fraction");
  if (gb.present && fraction.present) {
    return Error(section.path(),
                 "expert_cache_gb and expert_cache_fraction are both set; set at most one");
  }
  const Field utilization = section.Get("memory_utilization");
  if (gb.present && gb.node.IsScalar() && gb.node.Scalar() == "auto") {
    group->expert_cache_auto = true;
    group->expert_cache_gb.reset();
    group->expert_cache_fraction.reset();
    FMOE_RETURN_IF_ERROR(ReadDouble(utilization, {0, true, 1}, &group->memory_utilization));
  } else if (utilization.present) {
    return Error(utilization.path, "applies only with expert_cache_gb: auto");
  } else if (gb.present) {
    double value = 0;
    FMOE_RETURN_IF_ERROR(ReadDouble(gb, {0, true, 100000}, &value));
    group->expert_cache_gb = value;
    group->expert_cache_fraction.reset();
  } else {
    double value = 1.0;
    FMOE_RETURN_IF_ERROR(ReadDouble(fraction, {0, true, 1}, &value));
    group->expert_cache_fraction = value;
    group->expert_cache_gb.reset();
  }
  const Field host_gb = section.Get("host_cache_gb");
  const Field host_fraction = section.Get("host_cache_fraction");
  if (host_gb.present && host_fraction.present) {
    return Error(section.path(),
                 "host_cache_gb and host_cache_fraction are both set; set at most one");
  }
  if (host_gb.present && host_gb.node.IsScalar() && host_gb.node.Scalar() == "auto") {
    group->host_cache_auto = true;
  } else if (host_gb.present) {
    double value = 0;
    FMOE_RETURN_IF_ERROR(ReadDouble(host_gb, {0, true, 100000}, &value));
    group->host_cache_gb = value;
  } else if (host_fraction.present) {
    double value = 1.0;
    FMOE_RETURN_IF_ERROR(ReadDouble(host_fraction, {0, true, 1}, &value));
    group->host_cache_fraction = value;
  }
  FMOE_ASSIGN_OR_RETURN(Section link, Section::Read(section.Get("link"), kLinkKeys));
  FMOE_RETURN_IF_ERROR(ReadDouble(link.Get("gbps"), {0, true, 10000}, &group->link.gbps));
  FMOE_RETURN_IF_ERROR(
      ReadDouble(link.Get("latency_us"), {0, false, 1000000}, &group->link.latency_us));
  FMOE_RETURN_IF_ERROR(ParseHybrid(section.Get("hybrid"), &group->hybrid));
  group->rendezvous = "127.0.0.1:" + std::to_string(kRendezvousBasePort + index);
  FMOE_RETURN_IF_ERROR(ReadHostPort(section.Get("rendezvous"), &group->rendezvous));
  FMOE_RETURN_IF_ERROR(ReadDouble(section.Get("collective_timeout_s"), {0, true, 3600},
                                  &group->collective_timeout_s));
  FMOE_RETURN_IF_ERROR(ReadDouble(section.Get("rendezvous_timeout_s"), {0, true, 3600},
                                  &group->rendezvous_timeout_s));
  const Field trace = section.Get("record_trace");
  FMOE_RETURN_IF_ERROR(ReadPath(trace, base_dir, &group->record_trace));
  if (trace.present && trace.node.Scalar().back() == '/') {
    return Error(trace.path, Quote(trace.node.Scalar()) + " names a directory; expected a file");
  }
  FMOE_RETURN_IF_ERROR(ParseWorkers(section.Get("workers"), &group->workers));
  return ParseMemory(section, group);
}

Status ParseWorkerGroups(const Field& field, const std::string& base_dir,
                         std::vector<WorkerGroupSpec>* groups) {
  FMOE_RETURN_IF_ERROR(CheckSequence(field, kMaxGroups, "groups"));
  for (size_t i = 0; i < field.node.size(); ++i) {
    WorkerGroupSpec group;
    FMOE_RETURN_IF_ERROR(ParseGroup(Element(field, i), i, base_dir, &group));
    for (size_t j = 0; j < groups->size(); ++j) {
      if ((*groups)[j].name == group.name) {
        return Error(JoinPath(IndexPath(field.path, i), "name"),
                     Quote(group.name) + " is already used by " + IndexPath(field.path, j));
      }
      if (!group.record_trace.empty() && (*groups)[j].record_trace == group.record_trace) {
        return Error(JoinPath(IndexPath(field.path, i), "record_trace"),
                     Quote(group.record_trace) + " is already used by " +
                         JoinPath(IndexPath(field.path, j), "record_trace"));
      }
    }
    groups->push_back(std::move(group));
  }
  return Status::Ok();
}

// An optional sequence of strings: each element's text goes to `check`, which says what is
// wrong with it (an element that is not a string is refused here, its text never echoed).
Status ReadStrings(const Field& field,
                   const std::function<Status(const Field& element, std::string text)>& check) {
  if (!field.present) return Status::Ok();
  if (field.node.IsNull()) return Error(field.path, "has no value; expected a sequence");
  if (!field.node.IsSequence()) {
    return Error(field.path, "expected a sequence, got " + KindOf(field.node));
  }
  for (size_t i = 0; i < field.node.size(); ++i) {
    const Field element = Element(field, i);
    if (element.node.IsNull()) return Error(element.path, "has no value; expected a string");
    if (!element.node.IsScalar()) {
      return Error(element.path, "expected a string, got " +
                                     std::string(element.node.IsMap() ? "a map" : "a sequence"));
    }
    FMOE_RETURN_IF_ERROR(check(element, element.node.Scalar()));
  }
  return Status::Ok();
}

// "*" or an origin as browsers send it: scheme://host[:port], no path.
Status ParseCorsOrigins(const Field& field, std::vector<std::string>* origins) {
  origins->clear();
  return ReadStrings(field, [&](const Field& element, std::string origin) {
    const size_t scheme = origin.find("://");
    const bool ok =
        origin == "*" ||
        ((origin.rfind("http://", 0) == 0 || origin.rfind("https://", 0) == 0) &&
         origin.size() > scheme + 3 && origin.find('/', scheme + 3) == std::string::npos &&
         std::all_of(origin.begin(), origin.end(),
                     [](char c) { return c > 0x20 && c < 0x7f && c != ',' && c != '"'; }));
    if (!ok) {
      return Error(element.path,
                   "\"" + origin + "\" is not an origin (http[s]://host[:port], no path) or \"*\"");
    }
    origins->push_back(std::move(origin));
    return Status::Ok();
  });
}

// Key text is never echoed: it is a secret.
Status ParseApiKeys(const Field& field, std::vector<std::string>* keys) {
  keys->clear();
  return ReadStrings(field, [&](const Field& element, std::string key) {
    if (key == kRedactedKey) {
      return Error(element.path,
                   "\"***\" is a redacted key (as DescribeManifest writes it); give the real key");
    }
    if (key.size() < 8 || key.size() > 256) {
      return Error(element.path, "has " + std::to_string(key.size()) +
                                     " characters; a key has 8..256 printable characters");
    }
    for (size_t c = 0; c < key.size(); ++c) {
      const auto byte = static_cast<unsigned char>(key[c]);
      if (byte <= 0x20 || byte >= 0x7f) {
        return Error(element.path, "character " + std::to_string(c) +
                                       " is not printable ASCII (spaces are not allowed)");
      }
    }
    for (size_t j = 0; j < keys->size(); ++j) {
      if ((*keys)[j] == key) {
        return Error(element.path, "repeats " + IndexPath(field.path, j));
      }
    }
    keys->push_back(std::move(key));
    return Status::Ok();
  });
}

Status ParseRouter(const Field& field, const std::string& base_dir, RouterSpec* spec) {
  FMOE_ASSIGN_OR_RETURN(Section section, Section::Read(field, kRouterKeys));
  FMOE_RETURN_IF_ERROR(ReadHostPort(section.Get("listen"), &spec->listen));
  FMOE_RETURN_IF_ERROR(ReadZmqEndpoint(section.Get("worker_endpoint"), &spec->worker_endpoint));
  FMOE_RETURN_IF_ERROR(
      ReadDouble(section.Get("request_timeout_s"), {0, true, 86400}, &spec->request_timeout_s));
  FMOE_RETURN_IF_ERROR(
      ReadDouble(section.Get("drain_timeout_s"), {0, false, 3600}, &spec->drain_timeout_s));
  FMOE_RETURN_IF_ERROR(ReadInt(section.Get("max_body_bytes"), int64_t{1} << 10, int64_t{256} << 20,
                               &spec->max_body_bytes));
  FMOE_RETURN_IF_ERROR(ParseApiKeys(section.Get("api_keys"), &spec->api_keys));
  FMOE_RETURN_IF_ERROR(
      ReadInt(section.Get("responses_capacity"), 1, 1000000, &spec->responses_capacity));
  FMOE_RETURN_IF_ERROR(ReadPath(section.Get("responses_dir"), base_dir, &spec->responses_dir));
  if (const Field parser = section.Get("tool_call_parser"); parser.present) {
    FMOE_RETURN_IF_ERROR(ReadString(parser, &spec->tool_call_parser));
    if (std::find(std::begin(kToolCallParsers), std::end(kToolCallParsers),
                  spec->tool_call_parser) == std::end(kToolCallParsers)) {
      std::string names;
      for (std::string_view n : kToolCallParsers)
        names += (names.empty() ? "" : ", ") + std::string(n);
      return Error(parser.path,
                   Quote(spec->tool_call_parser) + " is not a tool-call format; one of " + names);
    }
  }
  return ParseCorsOrigins(section.Get("cors_allowed_origins"), &spec->cors_allowed_origins);
}

Status ParseHeartbeat(const Field& field, HeartbeatSpec* spec) {
  FMOE_ASSIGN_OR_RETURN(Section section, Section::Read(field, kHeartbeatKeys));
  FMOE_RETURN_IF_ERROR(ReadInt(section.Get("interval_ms"), 10, 60000, &spec->interval_ms));
  const Field timeout = section.Get("timeout_ms");
  FMOE_RETURN_IF_ERROR(ReadInt(timeout, 1, 600000, &spec->timeout_ms));
  if (spec->timeout_ms < 2 * spec->interval_ms) {
    return Error(timeout.path,
                 std::to_string(spec->timeout_ms) + (timeout.present ? "" : " (the default)") +
                     " is less than 2 * interval_ms = " + std::to_string(2 * spec->interval_ms));
  }
  return Status::Ok();
}

Status ParseLauncher(const Field& field, const std::string& base_dir, LauncherSpec* spec) {
  FMOE_ASSIGN_OR_RETURN(Section section, Section::Read(field, kLauncherKeys));
  spec->run_dir = AbsolutePath(base_dir, ".fmoe/run");
  FMOE_RETURN_IF_ERROR(ReadPath(section.Get("run_dir"), base_dir, &spec->run_dir));
  FMOE_RETURN_IF_ERROR(ReadInt(section.Get("ready_timeout_s"), 1, 3600, &spec->ready_timeout_s));
  FMOE_RETURN_IF_ERROR(ReadInt(section.Get("stop_timeout_s"), 1, 600, &spec->stop_timeout_s));
  FMOE_RETURN_IF_ERROR(ReadInt(section.Get("services_wait_s"), 0, 86400, &spec->services_wait_s));
  FMOE_ASSIGN_OR_RETURN(Section restart, Section::Read(section.Get("restart"), kRestartKeys));
  RestartSpec& r = spec->restart;
  FMOE_RETURN_IF_ERROR(
      ReadInt(restart.Get("initial_backoff_ms"), 0, 600000, &r.initial_backoff_ms));
  const Field max_backoff = restart.Get("max_backoff_ms");
  FMOE_RETURN_IF_ERROR(ReadInt(max_backoff, 0, 600000, &r.max_backoff_ms));
  if (r.max_backoff_ms < r.initial_backoff_ms) {
    return Error(max_backoff.path,
                 std::to_string(r.max_backoff_ms) + (max_backoff.present ? "" : " (the default)") +
                     " is less than initial_backoff_ms = " + std::to_string(r.initial_backoff_ms));
  }
  FMOE_RETURN_IF_ERROR(ReadInt(restart.Get("max_restarts"), 0, 1000, &r.max_restarts));
  return ReadInt(restart.Get("window_s"), 1, 86400, &r.window_s);
}

// One address something binds, for the collision check.
struct Binding {
  std::string path;  // Key path, e.g. "router.listen".
  std::string text;  // As written (or defaulted).
  bool defaulted = false;
  ZmqAddress address;
};

bool Collides(const ZmqAddress& a, const ZmqAddress& b) {
  if (a.ipc != b.ipc) return false;
  if (a.ipc) return a.ipc_path == b.ipc_path;
  if (a.tcp.port != b.tcp.port) return false;
  const std::string host_a = CanonicalHost(a.tcp.host);
  const std::string host_b = CanonicalHost(b.tcp.host);
  return host_a == host_b || IsWildcardHost(host_a) || IsWildcardHost(host_b);
}

Status CheckCollisions(const Manifest& m) {
  std::vector<Binding> bindings;
  auto add_zmq = [&](std::string path, const std::string& text, bool is_default) {
    Result<ZmqAddress> address = ParseZmqEndpoint(text);
    if (address.ok()) bindings.push_back({std::move(path), text, is_default, *address});
  };
  auto add_tcp = [&](std::string path, const std::string& text, bool is_default) {
    Result<HostPort> hp = ParseHostPortImpl(text, text, false);
    if (!hp.ok()) return;
    ZmqAddress address;
    address.tcp = *hp;
    bindings.push_back({std::move(path), text, is_default, std::move(address)});
  };
  const MapServiceSpec default_map;
  const RouterSpec default_router;
  add_zmq("map_service.endpoint", m.map_service.endpoint,
          m.map_service.endpoint == default_map.endpoint);
  add_zmq("router.worker_endpoint", m.router.worker_endpoint,
          m.router.worker_endpoint == default_router.worker_endpoint);
  add_tcp("router.listen", m.router.listen, m.router.listen == default_router.listen);
  for (size_t i = 0; i < m.worker_groups.size(); ++i) {
    const std::string& text = m.worker_groups[i].rendezvous;
    add_tcp(JoinPath(IndexPath("worker_groups", i), "rendezvous"), text,
            text == "127.0.0.1:" + std::to_string(kRendezvousBasePort + i));
  }
  for (size_t k = 1; k < bindings.size(); ++k) {
    for (size_t j = 0; j < k; ++j) {
      if (!Collides(bindings[k].address, bindings[j].address)) continue;
      const char* kind = bindings[k].address.ipc ? "the same ipc path as " : "the same port as ";
      return Error(bindings[k].path,
                   Quote(bindings[k].text) + (bindings[k].defaulted ? " (the default)" : "") +
                       " uses " + kind + bindings[j].path + " (" + Quote(bindings[j].text) +
                       (bindings[j].defaulted ? ", the default" : "") + ")");
    }
  }
  return Status::Ok();
}

Result<Manifest> ParseDocument(std::string_view yaml_text, const std::string& base_dir) {
  const std::vector<YAML::Node> docs = YAML::LoadAll(std::string(yaml_text));
  if (docs.empty() || (docs.size() == 1 && docs[0].IsNull())) {
    return Error("", "the document is empty; expected a map with keys " + Join(kTopKeys));
  }
  if (docs.size() > 1) {
    return Error("", "found " + std::to_string(docs.size()) + " YAML documents; expected one");
  }
  FMOE_ASSIGN_OR_RETURN(Section top, Section::Read(Field{docs[0], "", true}, kTopKeys));
  Manifest m;
  FMOE_RETURN_IF_ERROR(ParseModel(top.Get("model"), base_dir, &m.model));
  FMOE_RETURN_IF_ERROR(ParseMapService(top.Get("map_service"), base_dir, &m.map_service));
  FMOE_RETURN_IF_ERROR(ParseWorkerGroups(top.Get("worker_groups"), base_dir, &m.worker_groups));
  FMOE_RETURN_IF_ERROR(ParseRouter(top.Get("router"), base_dir, &m.router));
  FMOE_RETURN_IF_ERROR(ParseHeartbeat(top.Get("heartbeat"), &m.heartbeat));
  FMOE_ASSIGN_OR_RETURN(Section logging, Section::Read(top.Get("logging"), kLoggingKeys));
  FMOE_RETURN_IF_ERROR(ReadEnum(logging.Get("level"), kLogLevels, &m.logging.level));
  FMOE_RETURN_IF_ERROR(ParseLauncher(top.Get("launcher"), base_dir, &m.launcher));
  FMOE_ASSIGN_OR_RETURN(Section security, Section::Read(top.Get("security"), kSecurityKeys));
  FMOE_RETURN_IF_ERROR(ReadBool(security.Get("curve"), &m.security.curve));
  m.security.key_file = (fs::path(m.launcher.run_dir) / "cluster.key").string();
  FMOE_RETURN_IF_ERROR(ReadPath(security.Get("key_file"), base_dir, &m.security.key_file));
  FMOE_RETURN_IF_ERROR(CheckCollisions(m));
  return m;
}

// ---- DescribeManifest ----

void EmitDouble(YAML::Emitter& out, std::string_view key, double value) {
  out << YAML::Key << std::string(key) << YAML::Value << FormatDouble(value);
}

template <typename T>
void EmitValue(YAML::Emitter& out, std::string_view key, const T& value) {
  out << YAML::Key << std::string(key) << YAML::Value << value;
}

}  // namespace

Result<HostPort> ParseHostPort(std::string_view text) {
  return ParseHostPortImpl(text, text, false);
}

Status ValidateZmqEndpoint(std::string_view endpoint) {
  Result<ZmqAddress> address = ParseZmqEndpoint(endpoint);
  return address.status();
}

Result<Manifest> ParseManifest(std::string_view yaml_text, const std::string& base_dir) {
  std::error_code ec;
  fs::path base = fs::absolute(fs::path(base_dir.empty() ? "." : base_dir), ec);
  if (ec) {
    return IoError("manifest: cannot resolve base directory " + Quote(base_dir) + ": " +
                   ec.message());
  }
  const std::string base_text = AbsolutePath("/", base.string());
  try {
    return ParseDocument(yaml_text, base_text);
  } catch (const YAML::Exception& e) {
    if (e.mark.is_null()) return InvalidArgument("manifest: " + e.msg);
    return InvalidArgument("manifest: line " + std::to_string(e.mark.line + 1) + ", column " +
                           std::to_string(e.mark.column + 1) + ": " + e.msg);
  } catch (const std::exception& e) {
    return Internal(std::string("manifest: ") + e.what());
  }
}

Result<Manifest> LoadManifest(const std::string& path) {
  if (path.empty()) return NotFound("manifest: (empty path): no such file");
  std::error_code ec;
  fs::path absolute = fs::absolute(fs::path(path), ec);
  if (ec) return IoError("manifest: " + path + ": " + ec.message());
  absolute = absolute.lexically_normal();
  const fs::file_status status = fs::status(absolute, ec);
  if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory) {
    return IoError("manifest: " + path + ": " + ec.message());
  }
  if (!fs::exists(status)) return NotFound("manifest: " + path + ": no such file");
  if (fs::is_directory(status)) return IoError("manifest: " + path + ": is a directory");
  if (!fs::is_regular_file(status)) return IoError("manifest: " + path + ": is not a regular file");
  const uintmax_t size = fs::file_size(absolute, ec);
  if (!ec && size > kMaxManifestBytes) {
    return InvalidArgument("manifest: " + path + ": is " + std::to_string(size) +
                           " bytes; a manifest is at most 16 MiB");
  }
  std::ifstream in(absolute, std::ios::binary);
  if (!in) {
    return IoError("manifest: " + path + ": cannot open: " + std::strerror(errno));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return IoError("manifest: " + path + ": read failed: " + std::strerror(errno));
  FMOE_ASSIGN_OR_RETURN(Manifest manifest,
                        ParseManifest(text.str(), absolute.parent_path().string()));
  manifest.source_path = absolute.string();
  return manifest;
}

std::string DescribeManifest(const Manifest& m) {
  YAML::Emitter out;
  out << YAML::Comment("fmoe manifest, effective configuration" +
                       (m.source_path.empty() ? std::string() : "; source: " + m.source_path));
  out << YAML::BeginMap;

  out << YAML::Key << "model" << YAML::Value << YAML::BeginMap;
  EmitValue(out, "path", m.model.path);
  EmitValue(out, "name", m.model.name);
  EmitValue(out, "dtype", m.model.dtype);
  out << YAML::EndMap;

  out << YAML::Key << "map_service" << YAML::Value << YAML::BeginMap;
  EmitValue(out, "endpoint", m.map_service.endpoint);
  EmitValue(out, "data_dir", m.map_service.data_dir);
  EmitValue(out, "store_capacity", m.map_service.store_capacity);
  EmitValue(out, "prefetch_distance", m.map_service.prefetch_distance);
  EmitValue(out, "sync", m.map_service.sync);
  EmitValue(out, "memory_limit_mb", m.map_service.memory_limit_mb);
  out << YAML::EndMap;

  out << YAML::Key << "worker_groups" << YAML::Value << YAML::BeginSeq;
  for (const WorkerGroupSpec& g : m.worker_groups) {
    out << YAML::BeginMap;
    EmitValue(out, "name", g.name);
    EmitValue(out, "policy", g.policy);
    EmitValue(out, "max_batch", g.max_batch);
    EmitValue(out, "max_batched_tokens", g.max_batched_tokens);
    EmitDouble(out, "chunk_overhead", g.chunk_overhead);
    EmitValue(out, "prefill_stream", g.prefill_stream);
    if (g.prefill_stream_slots > 0) EmitValue(out, "prefill_stream_slots", g.prefill_stream_slots);
    EmitValue(out, "queue_limit", g.queue_limit);
    if (g.kv_cache_tokens > 0) EmitValue(out, "kv_cache_tokens", g.kv_cache_tokens);
    EmitValue(out, "prefix_caching", g.prefix_caching);
    if (g.expert_cache_auto) {
      EmitValue(out, "expert_cache_gb", std::string("auto"));
      EmitDouble(out, "memory_utilization", g.memory_utilization);
    }
    if (g.expert_cache_gb) EmitDouble(out, "expert_cache_gb", *g.expert_cache_gb);
    if (g.memory) {
      out << YAML::Key << "memory" << YAML::Value << YAML::BeginMap;
      if (g.memory->device_gb) {
        EmitDouble(out, "device_gb", *g.memory->device_gb);
      } else {
        EmitDouble(out, "device_fraction", g.memory->device_fraction);
      }
      EmitDouble(out, "kv_floor", g.memory->kv_floor);
      EmitDouble(out, "expert_floor", g.memory->expert_floor);
      EmitDouble(out, "return_hold_s", g.memory->return_hold_s);
      out << YAML::EndMap;
    } else if (!g.expert_cache_auto && (g.expert_cache_fraction || !g.expert_cache_gb)) {
      EmitDouble(out, "expert_cache_fraction", g.expert_cache_fraction.value_or(1.0));
    }
    if (g.host_cache_auto) EmitValue(out, "host_cache_gb", std::string("auto"));
    if (g.host_cache_gb) EmitDouble(out, "host_cache_gb", *g.host_cache_gb);
    if (g.host_cache_fraction) EmitDouble(out, "host_cache_fraction", *g.host_cache_fraction);
    out << YAML::Key << "link" << YAML::Value << YAML::BeginMap;
    EmitDouble(out, "gbps", g.link.gbps);
    EmitDouble(out, "latency_us", g.link.latency_us);
    out << YAML::EndMap;
    if (!g.hybrid.enabled) {
      EmitValue(out, "hybrid", std::string("off"));
    } else {
      out << YAML::Key << "hybrid" << YAML::Value << YAML::BeginMap;
      if (g.hybrid.cpu_threads > 0) EmitValue(out, "cpu_threads", g.hybrid.cpu_threads);
      EmitDouble(out, "host_slowdown", g.hybrid.host_slowdown);
      out << YAML::EndMap;
    }
    EmitValue(out, "rendezvous", g.rendezvous);
    EmitDouble(out, "collective_timeout_s", g.collective_timeout_s);
    EmitDouble(out, "rendezvous_timeout_s", g.rendezvous_timeout_s);
    if (!g.record_trace.empty()) EmitValue(out, "record_trace", g.record_trace);
    out << YAML::Key << "workers" << YAML::Value << YAML::BeginSeq;
    for (const WorkerSpec& w : g.workers) {
      out << YAML::Flow << YAML::BeginMap;
      EmitValue(out, "device", w.device);
      EmitValue(out, "host", w.host);
      out << YAML::EndMap;
    }
    out << YAML::EndSeq;
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;

  out << YAML::Key << "router" << YAML::Value << YAML::BeginMap;
  EmitValue(out, "listen", m.router.listen);
  EmitValue(out, "worker_endpoint", m.router.worker_endpoint);
  EmitDouble(out, "request_timeout_s", m.router.request_timeout_s);
  EmitDouble(out, "drain_timeout_s", m.router.drain_timeout_s);
  EmitValue(out, "max_body_bytes", m.router.max_body_bytes);
  if (!m.router.tool_call_parser.empty()) {
    EmitValue(out, "tool_call_parser", m.router.tool_call_parser);
  }
  EmitValue(out, "responses_capacity", m.router.responses_capacity);
  if (!m.router.responses_dir.empty()) EmitValue(out, "responses_dir", m.router.responses_dir);
  out << YAML::Key << "api_keys" << YAML::Value << YAML::Flow << YAML::BeginSeq;
  for (size_t i = 0; i < m.router.api_keys.size(); ++i) out << std::string(kRedactedKey);
  out << YAML::EndSeq;
  out << YAML::Key << "cors_allowed_origins" << YAML::Value << YAML::Flow << YAML::BeginSeq;
  for (const auto& origin : m.router.cors_allowed_origins) out << origin;
  out << YAML::EndSeq;
  out << YAML::EndMap;

  out << YAML::Key << "heartbeat" << YAML::Value << YAML::BeginMap;
  EmitValue(out, "interval_ms", m.heartbeat.interval_ms);
  EmitValue(out, "timeout_ms", m.heartbeat.timeout_ms);
  out << YAML::EndMap;

  out << YAML::Key << "logging" << YAML::Value << YAML::BeginMap;
  EmitValue(out, "level", m.logging.level);
  out << YAML::EndMap;

  out << YAML::Key << "launcher" << YAML::Value << YAML::BeginMap;
  EmitValue(out, "run_dir", m.launcher.run_dir);
  EmitValue(out, "ready_timeout_s", m.launcher.ready_timeout_s);
  EmitValue(out, "stop_timeout_s", m.launcher.stop_timeout_s);
  EmitValue(out, "services_wait_s", m.launcher.services_wait_s);
  out << YAML::Key << "restart" << YAML::Value << YAML::BeginMap;
  EmitValue(out, "initial_backoff_ms", m.launcher.restart.initial_backoff_ms);
  EmitValue(out, "max_backoff_ms", m.launcher.restart.max_backoff_ms);
  EmitValue(out, "max_restarts", m.launcher.restart.max_restarts);
  EmitValue(out, "window_s", m.launcher.restart.window_s);
  out << YAML::EndMap;
  out << YAML::EndMap;

  out << YAML::Key << "security" << YAML::Value << YAML::BeginMap;
  EmitValue(out, "curve", m.security.curve);
  EmitValue(out, "key_file", m.security.key_file);
  out << YAML::EndMap;

  out << YAML::EndMap;
  if (!out.good()) return "# DescribeManifest failed: " + out.GetLastError() + "\n";
  return std::string(out.c_str()) + "\n";
}

const WorkerGroupSpec* FindGroup(const Manifest& manifest, std::string_view name) {
  for (const WorkerGroupSpec& group : manifest.worker_groups) {
    if (group.name == name) return &group;
  }
  return nullptr;
}

}  // namespace fmoe
