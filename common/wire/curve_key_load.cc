#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>

#include "common/wire/curve_key.h"
#include "common/wire/wire.h"

namespace fmoe::wire {
namespace {

std::string ErrnoText(int err) { return std::strerror(err); }

// Writes `text` to a new file beside `path` and links it there: fails with EEXIST when another
// process got there first.
Status CreateKeyFile(const std::string& path, const std::string& text) {
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (!dir.empty()) std::filesystem::create_directories(dir, ec);
  if (ec) return IoError("cluster key: cannot create " + dir.string() + ": " + ec.message());
  std::random_device rd;
  const std::string tmp = path + ".tmp." + std::to_string(getpid()) + "." + std::to_string(rd());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return IoError("cluster key: cannot write " + tmp + ": " + ErrnoText(errno));
  size_t done = 0;
  int err = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = errno;
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (err == 0 && fsync(fd) != 0) err = errno;
  close(fd);
  if (err != 0) {
    unlink(tmp.c_str());
    return IoError("cluster key: cannot write " + tmp + ": " + ErrnoText(err));
  }
  const int rc = link(tmp.c_str(), path.c_str());
  err = errno;
  unlink(tmp.c_str());
  if (rc != 0 && err != EEXIST) {
    return IoError("cluster key: cannot create " + path + ": " + ErrnoText(err));
  }
  return Status::Ok();
}

}  // namespace

Result<CurveKey> LoadCurveKey(const std::string& path, bool create) {
  if (path.empty()) return InvalidArgument("cluster key: no key file named");
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT && create) {
    FMOE_ASSIGN_OR_RETURN(CurveKey fresh, NewCurveKey());
    FMOE_RETURN_IF_ERROR(CreateKeyFile(path, FormatCurveKeyFile(fresh)));
    fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  }
  if (fd < 0) {
    const int err = errno;
    return err == ENOENT ? NotFound("cluster key: " + path +
                                    " does not exist (copy it from the host that ran `fmoe "
                                    "launch` first: every host of a cluster holds the same key)")
                         : IoError("cluster key: cannot read " + path + ": " + ErrnoText(err));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return InvalidArgument("cluster key: " + path + " is not a regular file");
  }
  if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    close(fd);
    return FailedPrecondition("cluster key: " + path +
                              " may be read by its group or others; chmod 600 it");
  }
  std::string text(kMaxCurveKeyFileBytes + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      close(fd);
      return IoError("cluster key: cannot read " + path + ": " + ErrnoText(err));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  close(fd);
  text.resize(got);
  Result<CurveKey> key = ParseCurveKeyFile(text);
  if (!key.ok()) return key.status().WithContext(path);
  FMOE_RETURN_IF_ERROR(CheckCurveKey(*key).WithContext(path));
  return key;
}

Status UseClusterKey(bool enabled, const std::string& path, bool create) {
  if (!enabled) {
    SetDefaultCurveKey(std::nullopt);
    return Status::Ok();
  }
  FMOE_ASSIGN_OR_RETURN(CurveKey key, LoadCurveKey(path, create));
  SetDefaultCurveKey(key);
  return Status::Ok();
}

}  // namespace fmoe::wire
