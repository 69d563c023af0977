// The cluster key: one CURVE key pair (ZeroMQ's CurveZMQ, Z85 text) that every process of a
// cluster holds, so that only they can speak on its sockets. A socket bound by a process with the
// key is a CURVE server that proves the secret key; a socket that connects presents the same
// pair as its client key, and the binding side's ZAP handler (wire.cc) admits no other public
// key: a peer needs the secret to connect at all. `fmoe launch` writes the key file once per
// cluster (security.key_file in the manifest); hosts of one cluster hold copies of the same file.
// Outside input: the file is parsed strictly, every error names its line.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "common/status.h"

namespace fmoe::wire {

// The largest key file read; a key file is under 200 bytes.
inline constexpr size_t kMaxCurveKeyFileBytes = 4096;

struct CurveKey {
  std::string public_key;  // Z85, 40 characters.
  std::string secret_key;  // Z85, 40 characters.
  bool operator==(const CurveKey&) const = default;
};

// The file's text: '#' comment lines and blank lines, then exactly one "public-key = <Z85>" and
// one "secret-key = <Z85>" line, in either order. Checks the form only (wire.h's CheckCurveKey
// checks that the two belong together).
Result<CurveKey> ParseCurveKeyFile(std::string_view text);
std::string FormatCurveKeyFile(const CurveKey& key);

// curve_key_load.cc: reads the key at `path` and checks it. When the file does not exist and
// `create` is set, a new key is written there first (mode 0600, its directory created): of several
// processes racing to create it, one key wins and every one reads it. A file that its group or
// others may read is refused (the secret would not be one).
Result<CurveKey> LoadCurveKey(const std::string& path, bool create);

// For a process of the cluster, in main() before any Context: loads the key at `path` (making it
// first when missing and `create`) and makes it the process's default (wire.h's
// SetDefaultCurveKey); `enabled` false (security.curve: false) leaves the sockets plain. The
// error names the file.
Status UseClusterKey(bool enabled, const std::string& path, bool create);

}  // namespace fmoe::wire
