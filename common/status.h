// Status and Result<T>: the one error currency of the project. Library errors (yaml, zmq,
// rocksdb, torch, cuda, beast) are converted into these at the edge of the file that wraps the
// library; nothing throws across a component boundary.
#pragma once

#include <cassert>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace fmoe {

enum class ErrorCode {
  kOk = 0,
  kInvalidArgument,     // Input from outside (manifest, message, request) is malformed.
  kNotFound,            // A named thing (file, peer, key) does not exist.
  kAlreadyExists,       // Creating something that exists, or a resource held by another owner.
  kFailedPrecondition,  // The system is not in a state where the call makes sense.
  kUnavailable,         // A peer or resource is temporarily unreachable; retrying may help.
  kResourceExhausted,   // A queue, budget or high-water mark is full.
  kTimeout,             // A deadline passed before the operation finished.
  kIoError,             // The operating system refused a file or socket operation.
  kDataLoss,            // Stored data is corrupt or truncated.
  kInternal,            // A bug: an invariant of our own code does not hold.
};

std::string_view ErrorCodeName(ErrorCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid_argument: manifest: router.listen: ..." or "ok".
  std::string ToString() const;

  // Returns this status with `context` prepended to the message ("context: message").
  Status WithContext(std::string_view context) const;

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) { return {ErrorCode::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {ErrorCode::kNotFound, std::move(m)}; }
inline Status AlreadyExists(std::string m) { return {ErrorCode::kAlreadyExists, std::move(m)}; }
inline Status FailedPrecondition(std::string m) {
  return {ErrorCode::kFailedPrecondition, std::move(m)};
}
inline Status Unavailable(std::string m) { return {ErrorCode::kUnavailable, std::move(m)}; }
inline Status ResourceExhausted(std::string m) {
  return {ErrorCode::kResourceExhausted, std::move(m)};
}
inline Status Timeout(std::string m) { return {ErrorCode::kTimeout, std::move(m)}; }
inline Status IoError(std::string m) { return {ErrorCode::kIoError, std::move(m)}; }
inline Status DataLoss(std::string m) { return {ErrorCode::kDataLoss, std::move(m)}; }
inline Status Internal(std::string m) { return {ErrorCode::kInternal, std::move(m)}; }

template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    assert(!std::get<Status>(v_).ok() && "Result constructed from an ok Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }

  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace fmoe

#define FMOE_CONCAT_INNER_(a, b) a##b
#define FMOE_CONCAT_(a, b) FMOE_CONCAT_INNER_(a, b)

// Returns the Status of `expr` from the enclosing function if it is not ok.
#define FMOE_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::fmoe::Status fmoe_status_ = (expr);        \
    if (!fmoe_status_.ok()) return fmoe_status_; \
  } while (0)

// `lhs = *expr` when `expr` (a Result) is ok, otherwise returns its Status.
#define FMOE_ASSIGN_OR_RETURN(lhs, expr) \
  FMOE_ASSIGN_OR_RETURN_IMPL_(FMOE_CONCAT_(fmoe_result_, __LINE__), lhs, expr)
#define FMOE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()
