#include "common/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <string_view>
#include <utility>

#include "common/json.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

// The format's own cap on the JSON header (the reference implementation refuses larger ones).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
constexpr const char* kMetadataKey = "__metadata__";

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kF32, "F32", 4},   {DType::kF16, "F16", 2},        {DType::kBF16, "BF16", 2},
    {DType::kF64, "F64", 8},   {DType::kI64, "I64", 8},        {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},   {DType::kI8, "I8", 1},          {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1}, {DType::kF8E4M3, "F8_E4M3", 1},
};

const DTypeInfo* FindDType(std::string_view name) {
  for (const auto& d : kDTypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

std::string Quote(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  out.append(s);
  out.push_back('"');
  return out;
}

// A short description of a JSON value for messages: scalars verbatim (truncated), containers by
// kind, so a hostile header cannot make a message (or a recursive dump) arbitrarily large.
std::string Describe(const Json& v) {
  if (v.is_object()) return "an object";
  if (v.is_array()) return "a list";
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 64) s = s.substr(0, 61) + "...";
  return s;
}

// numel of `shape` and its size in bytes, or false on a negative dimension or an overflow.
bool ShapeBytes(const std::vector<int64_t>& shape, size_t dtype_size, uint64_t* numel,
                uint64_t* bytes) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d != 0 &&
        n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / static_cast<uint64_t>(d)) {
      return false;
    }
    n *= static_cast<uint64_t>(d);
  }
  if (n != 0 && dtype_size > std::numeric_limits<uint64_t>::max() / n) return false;
  *numel = n;
  *bytes = n * dtype_size;
  return true;
}

// Reads a JSON integer that must be >= 0 (nlohmann keeps large positives as unsigned).
bool NonNegativeInt(const Json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

// Parses `text` without exceptions; `*duplicate` names a key seen twice in one object.
Json ParseHeaderJson(std::string_view text, std::string* duplicate) {
  std::vector<std::set<std::string>> keys;  // One set per open object.
  Json::parser_callback_t cb = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        keys.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case Json::parse_event_t::key:
        if (!keys.empty() && parsed.is_string() &&
            !keys.back().insert(parsed.get_ref<const std::string&>()).second &&
            duplicate->empty()) {
          *duplicate = parsed.get<std::string>();
        }
        break;
      default:
        break;
    }
    return true;
  };
  return Json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/false);
}

Status ParseTensor(const std::string& name, const Json& entry, uint64_t data_bytes,
                   TensorView* view, uint64_t* begin, uint64_t* end) {
  const std::string where = "tensor " + Quote(name);
  if (!entry.is_object()) return DataLoss(where + ": " + Describe(entry) + " is not an object");

  auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end()) return DataLoss(where + ": dtype: missing");
  if (!dtype_it->is_string()) {
    return DataLoss(where + ": dtype: " + Describe(*dtype_it) + " is not a string");
  }
  const DTypeInfo* dtype = FindDType(dtype_it->get_ref<const std::string&>());
  if (dtype == nullptr) return DataLoss(where + ": unknown dtype " + Describe(*dtype_it));
  view->dtype = dtype->dtype;

  auto shape_it = entry.find("shape");
  if (shape_it == entry.end()) return DataLoss(where + ": shape: missing");
  if (!shape_it->is_array()) {
    return DataLoss(where + ": shape: " + Describe(*shape_it) + " is not a list");
  }
  view->shape.clear();
  for (const Json& d : *shape_it) {
    uint64_t v = 0;
    if (!NonNegativeInt(d, &v) || v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return DataLoss(where + ": shape: " + Describe(d) + " is not a non-negative integer");
    }
    view->shape.push_back(static_cast<int64_t>(v));
  }
  uint64_t numel = 0;
  uint64_t bytes = 0;
  if (!ShapeBytes(view->shape, dtype->size, &numel, &bytes)) {
    return DataLoss(where + ": shape " + ShapeString(view->shape) + " overflows");
  }

  auto offsets_it = entry.find("data_offsets");
  if (offsets_it == entry.end()) return DataLoss(where + ": data_offsets: missing");
  if (!offsets_it->is_array() || offsets_it->size() != 2 ||
      !NonNegativeInt((*offsets_it)[0], begin) || !NonNegativeInt((*offsets_it)[1], end)) {
    return DataLoss(where + ": data_offsets: not a list of two non-negative integers");
  }
  const std::string offsets = "[" + std::to_string(*begin) + ", " + std::to_string(*end) + "]";
  if (*begin > *end) return DataLoss(where + ": data_offsets " + offsets + ": begin > end");
  if (*end > data_bytes) {
    return DataLoss(where + ": data_offsets " + offsets + " run past the data section (" +
                    std::to_string(data_bytes) + " bytes)");
  }
  if (*end - *begin != bytes) {
    return DataLoss(where + ": data_offsets " + offsets + " do not match dtype " + dtype->name +
                    " and shape " + ShapeString(view->shape) + " (" + std::to_string(bytes) +
                    " bytes)");
  }
  return Status::Ok();
}

Status ParseMetadata(const Json& value, std::map<std::string, std::string>* metadata) {
  if (!value.is_object()) {
    return DataLoss(std::string(kMetadataKey) + ": " + Describe(value) + " is not an object");
  }
  for (const auto& [key, v] : value.items()) {
    if (!v.is_string()) {
      return DataLoss(std::string(kMetadataKey) + ": " + Quote(key) + ": " + Describe(v) +
                      " is not a string");
    }
    (*metadata)[key] = v.get<std::string>();
  }
  return Status::Ok();
}

bool ValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t len = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      len = 2;
      cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3;
      cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3f);
    }
    const uint32_t min_cp[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += len;
  }
  return true;
}

Status WriteAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return IoError(std::string("write: ") + std::strerror(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (mant << 13));  // inf, nan (payload kept)
  if (exp != 0) return BitsFloat(sign | ((exp + 112) << 23) | (mant << 13));
  if (mant == 0) return BitsFloat(sign);  // +-0
  // Subnormal: mant * 2^-24; normalise so the leading one becomes the implicit bit.
  uint32_t e = 113;
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return BitsFloat(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

}  // namespace

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

const char* DTypeName(DType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

size_t DTypeSize(DType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.size;
  }
  return 0;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // Checked against overflow when the file was opened.
  return n;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, file_bytes_);
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return NotFound(path + ": no such file");
    return IoError(path + ": cannot open: " + std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    Status s = IoError(path + ": cannot stat: " + std::strerror(errno));
    ::close(fd);
    return s;
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return IoError(path + ": not a regular file");
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return DataLoss(path + ": " + std::to_string(size) +
                    " bytes, shorter than the 8-byte header length");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (map == MAP_FAILED) return IoError(path + ": mmap: " + std::strerror(map_errno));

  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->map_ = map;
  file->file_bytes_ = size;
  const auto* base = static_cast<const unsigned char*>(map);

  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | base[i];
  if (header_bytes == 0) return DataLoss(path + ": header length is 0");
  if (header_bytes > kMaxHeaderBytes) {
    return DataLoss(path + ": header length " + std::to_string(header_bytes) +
                    " exceeds the 100 MB limit");
  }
  if (header_bytes > size - 8) {
    return DataLoss(path + ": header length " + std::to_string(header_bytes) +
                    " runs past the end of the file (" + std::to_string(size) + " bytes)");
  }
  const std::string_view text(reinterpret_cast<const char*>(base + 8), header_bytes);
  if (text[0] != '{') {
    return DataLoss(path + ": header is not a JSON object: it does not start with '{'");
  }
  std::string duplicate;
  const Json header = ParseHeaderJson(text, &duplicate);
  if (header.is_discarded()) return DataLoss(path + ": header is not valid JSON");
  if (!header.is_object()) return DataLoss(path + ": header is not a JSON object");
  if (!duplicate.empty()) return DataLoss(path + ": header: key " + Quote(duplicate) + " repeats");

  const uint64_t data_start = 8 + header_bytes;
  const uint64_t data_bytes = size - data_start;
  struct Range {
    uint64_t begin, end;
    size_t index;
  };
  std::vector<Range> ranges;
  for (const auto& [name, value] : header.items()) {
    if (name == kMetadataKey) {
      Status s = ParseMetadata(value, &file->metadata_);
      if (!s.ok()) return s.WithContext(path);
      continue;
    }
    TensorView view;
    view.name = name;
    uint64_t begin = 0;
    uint64_t end = 0;
    Status s = ParseTensor(name, value, data_bytes, &view, &begin, &end);
    if (!s.ok()) return s.WithContext(path);
    view.data = std::span<const std::byte>(
        reinterpret_cast<const std::byte*>(base + data_start + begin), end - begin);
    ranges.push_back({begin, end, file->tensors_.size()});
    file->tensors_.push_back(std::move(view));
  }

  // The tensors must tile the data section: no overlap, no hole, nothing after the last one.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t covered = 0;
  const Range* previous = nullptr;
  for (const Range& r : ranges) {
    const std::string& name = file->tensors_[r.index].name;
    if (r.begin < covered) {
      return DataLoss(path + ": tensor " + Quote(name) + " overlaps tensor " +
                      Quote(file->tensors_[previous->index].name));
    }
    if (r.begin > covered) {
      return DataLoss(path + ": data bytes [" + std::to_string(covered) + ", " +
                      std::to_string(r.begin) + ") before tensor " + Quote(name) +
                      " belong to no tensor");
    }
    covered = r.end;
    previous = &r;
  }
  if (covered != data_bytes) {
    return DataLoss(path + ": data section has " + std::to_string(data_bytes) +
                    " bytes, the tensors cover " + std::to_string(covered));
  }

  std::sort(file->tensors_.begin(), file->tensors_.end(),
            [](const TensorView& a, const TensorView& b) { return a.name < b.name; });
  return file;
}

const TensorView* SafetensorsFile::Find(const std::string& name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorView& t, const std::string& n) { return t.name < n; });
  if (it == tensors_.end() || it->name != name) return nullptr;
  return &*it;
}

Result<uint64_t> SafetensorsFile::FileOffset(const TensorView& tensor) const {
  const auto base = reinterpret_cast<uintptr_t>(map_);
  const auto data = reinterpret_cast<uintptr_t>(tensor.data.data());
  if (data < base || data - base > file_bytes_ ||
      tensor.data.size() > file_bytes_ - (data - base)) {
    return InvalidArgument(path_ + ": tensor " + Quote(tensor.name) +
                           ": its data is not in this file's mapping");
  }
  return static_cast<uint64_t>(data - base);
}

Status SafetensorsFile::ReleasePages(const TensorView& tensor, uint64_t offset,
                                     uint64_t bytes) const {
  const std::string where = path_ + ": tensor " + Quote(tensor.name);
  const auto base = reinterpret_cast<uintptr_t>(map_);
  const auto data = reinterpret_cast<uintptr_t>(tensor.data.data());
  if (data < base || data - base > file_bytes_ ||
      tensor.data.size() > file_bytes_ - (data - base)) {
    return InvalidArgument(where + ": its data is not in this file's mapping");
  }
  if (offset > tensor.data.size() || bytes > tensor.data.size() - offset) {
    return InvalidArgument(where + ": bytes [" + std::to_string(offset) + ", +" +
                           std::to_string(bytes) + ") run past its " +
                           std::to_string(tensor.data.size()));
  }
  if (bytes == 0) return Status::Ok();
  static const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  // The mapping starts on a page boundary; its last page, past the file's end, is whole too.
  const uintptr_t first = (data + offset) & ~(page - 1);
  const uintptr_t last = (data + offset + bytes + page - 1) & ~(page - 1);
  if (::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED) != 0) {
    return IoError(where + ": madvise(MADV_DONTNEED): " + std::strerror(errno));
  }
  return Status::Ok();
}

namespace {

// Lays out the header of `tensors`, in the order given: the JSON text padded with spaces so the
// data starts 8-byte aligned, and the data section's size. `data_sizes`, when not empty, holds
// the bytes of each tensor's data (WriteSafetensors), checked against its dtype and shape.
Status LayOutHeader(const std::string& path, std::span<const TensorSpec> tensors,
                    std::span<const size_t> data_sizes,
                    const std::map<std::string, std::string>& metadata, std::string* text,
                    uint64_t* data_bytes) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) {
      if (!ValidUtf8(k) || !ValidUtf8(v)) {
        return InvalidArgument(path + ": " + kMetadataKey + ": " + Quote(k) + ": not UTF-8");
      }
      meta[k] = v;
    }
    header[kMetadataKey] = std::move(meta);
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    const std::string where = path + ": tensor " + Quote(t.name);
    if (t.name == kMetadataKey) return InvalidArgument(where + ": the name is reserved");
    if (!ValidUtf8(t.name)) return InvalidArgument(where + ": the name is not UTF-8");
    if (!names.insert(t.name).second) return InvalidArgument(where + ": written twice");
    uint64_t numel = 0;
    uint64_t bytes = 0;
    if (!ShapeBytes(t.shape, DTypeSize(t.dtype), &numel, &bytes) ||
        offset > std::numeric_limits<uint64_t>::max() - bytes) {
      return InvalidArgument(where + ": shape " + ShapeString(t.shape) +
                             " is negative or overflows");
    }
    if (!data_sizes.empty() && bytes != data_sizes[i]) {
      return InvalidArgument(where + ": " + std::to_string(data_sizes[i]) +
                             " bytes of data, dtype " + DTypeName(t.dtype) + " and shape " +
                             ShapeString(t.shape) + " need " + std::to_string(bytes));
    }
    header[t.name] = {{"dtype", DTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  *text = header.dump();
  text->append((8 - (text->size() % 8)) % 8, ' ');  // 8 + header length stays 8-byte aligned.
  *data_bytes = offset;
  return Status::Ok();
}

}  // namespace

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

Result<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::span<const TensorSpec> tensors,
    const std::map<std::string, std::string>& metadata) {
  std::string text;
  uint64_t data_bytes = 0;
  FMOE_RETURN_IF_ERROR(LayOutHeader(path, tensors, {}, metadata, &text, &data_bytes));
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(text.size() >> (8 * i));

  static std::atomic<uint64_t> counter{0};
  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter());
  w->path_ = path;
  const std::string tmp =
      path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
  w->fd_ = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (w->fd_ < 0) return IoError(tmp + ": cannot create: " + std::strerror(errno));
  w->tmp_ = tmp;
  w->data_start_ = 8 + text.size();
  w->data_bytes_ = data_bytes;
  Status s = WriteAll(w->fd_, len_bytes, sizeof(len_bytes));
  if (s.ok()) s = WriteAll(w->fd_, text.data(), text.size());
  if (!s.ok()) return s.WithContext(path);  // The destructor removes the temporary file.
  return w;
}

Status SafetensorsWriter::Fail(Status s) {
  spent_ = true;
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
  tmp_.clear();
  return s;
}

Status SafetensorsWriter::Append(std::span<const std::byte> data) {
  if (spent_) return FailedPrecondition(path_ + ": the writer is finished or failed");
  if (data.size() > data_bytes_ - appended_) {
    return Fail(InvalidArgument(path_ + ": " + std::to_string(appended_ + data.size()) +
                                " bytes of data appended, the tensors hold " +
                                std::to_string(data_bytes_)));
  }
  Status s = WriteAll(fd_, data.data(), data.size());
  if (!s.ok()) return Fail(s.WithContext(path_));
  appended_ += data.size();
  return Status::Ok();
}

Status SafetensorsWriter::Finish() {
  if (spent_) return FailedPrecondition(path_ + ": the writer is finished or failed");
  if (appended_ != data_bytes_) {
    return Fail(InvalidArgument(path_ + ": " + std::to_string(appended_) +
                                " bytes of data appended, the tensors hold " +
                                std::to_string(data_bytes_)));
  }
  Status s;
  if (::fsync(fd_) != 0) s = IoError(std::string("fsync: ") + std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0 && s.ok()) s = IoError(std::string("close: ") + std::strerror(errno));
  if (s.ok() && ::rename(tmp_.c_str(), path_.c_str()) != 0) {
    s = IoError(std::string("rename: ") + std::strerror(errno));
  }
  if (!s.ok()) return Fail(s.WithContext(path_));
  tmp_.clear();
  spent_ = true;
  // Make the rename itself durable.
  std::string dir = std::filesystem::path(path_).parent_path().string();
  if (dir.empty()) dir = ".";
  int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    const bool synced = ::fsync(dir_fd) == 0;
    const int sync_errno = errno;
    ::close(dir_fd);
    if (!synced) return IoError(path_ + ": fsync of " + dir + ": " + std::strerror(sync_errno));
  }
  return Status::Ok();
}

Status WriteSafetensors(const std::string& path, std::span<const TensorToWrite> tensors,
                        const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  std::vector<size_t> sizes;
  specs.reserve(tensors.size());
  sizes.reserve(tensors.size());
  for (const TensorToWrite& t : tensors) {
    specs.push_back({t.name, t.dtype, t.shape});
    sizes.push_back(t.data.size());
  }
  std::string text;
  uint64_t data_bytes = 0;
  FMOE_RETURN_IF_ERROR(LayOutHeader(path, specs, sizes, metadata, &text, &data_bytes));
  FMOE_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> writer,
                        SafetensorsWriter::Create(path, specs, metadata));
  for (const TensorToWrite& t : tensors) FMOE_RETURN_IF_ERROR(writer->Append(t.data));
  return writer->Finish();
}

Status ConvertToF32(DType dtype, std::span<const std::byte> data, std::span<float> out) {
  const size_t size = DTypeSize(dtype);
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) {
    return InvalidArgument(std::string("ConvertToF32: dtype ") + DTypeName(dtype) +
                           " is not F32, F16 or BF16");
  }
  if (data.size() != out.size() * size) {
    return InvalidArgument("ConvertToF32: " + std::to_string(data.size()) + " bytes of " +
                           DTypeName(dtype) + " for " + std::to_string(out.size()) + " floats");
  }
  if (dtype == DType::kF32) {
    if (!out.empty()) std::memcpy(out.data(), data.data(), data.size());
    return Status::Ok();
  }
  for (size_t i = 0; i < out.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, data.data() + 2 * i, 2);  // Little-endian host, as the format.
    out[i] = dtype == DType::kF16 ? F16ToF32(h) : BitsFloat(static_cast<uint32_t>(h) << 16);
  }
  return Status::Ok();
}

uint16_t F32ToBF16(float value) {
  const uint32_t bits = FloatBits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // NaN stays NaN (quiet).
  }
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);  // Ties to even.
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

uint16_t F32ToF16(float value) {
  const uint32_t bits = FloatBits(value);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t x = bits & 0x7fffffffu;
  if (x > 0x7f800000u) {  // NaN: keep the top payload bits, force quiet.
    return static_cast<uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  }
  // 65520 = 0x477ff000 is half-way between 65504 (odd mantissa) and 2^16: ties round up to inf.
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  const uint32_t exp = x >> 23;
  uint32_t mant = x & 0x7fffffu;
  uint32_t q;
  uint32_t rem;
  uint32_t half;
  if (exp >= 113) {  // Normal half: exponent exp - 112 in 1..30.
    q = ((exp - 112) << 10) | (mant >> 13);
    rem = mant & 0x1fffu;
    half = 0x1000u;
  } else {  // Subnormal half (or zero): the value in units of 2^-24 is mant * 2^(exp - 126).
    if (exp == 0) return sign;  // f32 subnormals are far below half's smallest subnormal.
    mant |= 0x800000u;
    const uint32_t shift = 126 - exp;  // >= 14
    if (shift > 24) return sign;       // < 2^-25: rounds to zero.
    q = mant >> shift;
    rem = mant & ((1u << shift) - 1);
    half = 1u << (shift - 1);
  }
  if (rem > half || (rem == half && (q & 1u))) ++q;  // A carry moves into the exponent, correctly.
  return static_cast<uint16_t>(sign | q);
}

}  // namespace fmoe
