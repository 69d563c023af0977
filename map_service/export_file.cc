#include "map_service/export_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include <flatbuffers/flatbuffers.h>

#include "common/clock.h"
#include "common/model/model_config.h"
#include "schemas/export_generated.h"

namespace fmoe {
namespace {

namespace fbs = fmoe::store;

constexpr size_t kChunkBytes = 1u << 20;  // One read or write call, between two looks at `stop`.
constexpr size_t kBlock = 4096;           // O_DIRECT alignment of buffers, offsets and sizes.

Status Cancelled(const std::string& what) {
  return Unavailable(what + " cancelled: the map service is stopping");
}

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

size_t RoundUp(size_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<uint8_t[], FreeDeleter>;

AlignedBuffer AllocateAligned(size_t bytes) {
  return AlignedBuffer(static_cast<uint8_t*>(std::aligned_alloc(kBlock, RoundUp(bytes))));
}

// Export files bypass the page cache (O_DIRECT, as RocksDB's direct I/O for background writes):
// on the 2-core VM of bench/RESULTS.md, hundreds of MB going through the page cache stalled the
// matching thread for milliseconds (p99 x6), direct writes did not. A file system that refuses
// O_DIRECT (tmpfs) gets buffered I/O.
int OpenMaybeDirect(const std::string& path, int flags, mode_t mode = 0) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC | O_DIRECT, mode);
  if (fd < 0 && errno == EINVAL) fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  return fd;
}

// Writes `size` bytes to a new file `path` in aligned blocks; the last block is padded, then the
// file is cut to `size`.
Status WriteWholeFile(const std::string& path, const uint8_t* data, size_t size,
                      const std::string& what, std::stop_token stop) {
  const int fd = OpenMaybeDirect(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return IoError(Errno("cannot create " + path));
  AlignedBuffer block = AllocateAligned(kChunkBytes);
  Status status;
  for (size_t at = 0; status.ok() && at < size; at += kChunkBytes) {
    if (stop.stop_requested()) {
      status = Cancelled(what);
      break;
    }
    const size_t n = std::min(kChunkBytes, size - at);
    std::memcpy(block.get(), data + at, n);
    std::memset(block.get() + n, 0, RoundUp(n) - n);
    if (::pwrite(fd, block.get(), RoundUp(n), static_cast<off_t>(at)) !=
        static_cast<ssize_t>(RoundUp(n))) {
      status = IoError(Errno("cannot write " + path));
    }
  }
  if (status.ok() && ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    status = IoError(Errno("cannot write " + path));
  }
  if (::close(fd) != 0 && status.ok()) status = IoError(Errno("cannot write " + path));
  if (!status.ok()) ::unlink(path.c_str());
  return status;
}

// Reads a whole file of `size` bytes into block-aligned memory.
Result<AlignedBuffer> ReadWholeFile(const std::string& path, size_t size, const std::string& what,
                                    std::stop_token stop) {
  const int fd = OpenMaybeDirect(path, O_RDONLY);
  if (fd < 0) return IoError(Errno("cannot read " + path));
  AlignedBuffer data = AllocateAligned(size + 1);  // Room for the last block, and never null.
  Status status;
  for (size_t at = 0; status.ok() && at < size; at += kChunkBytes) {
    if (stop.stop_requested()) {
      status = Cancelled(what);
      break;
    }
    // Whole blocks: the last read comes back short at the end of the file.
    const ssize_t n = ::pread(fd, data.get() + at, RoundUp(std::min(kChunkBytes, size - at)),
                              static_cast<off_t>(at));
    if (n < static_cast<ssize_t>(std::min(kChunkBytes, size - at))) {
      status = IoError(n < 0 ? Errno("cannot read " + path)
                             : "cannot read " + path + ": it changed while read");
    }
  }
  ::close(fd);
  if (!status.ok()) return status;
  return data;
}

bool Finite(const flatbuffers::Vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

}  // namespace

struct MapExportBuilder::Impl {
  ModelRow shape;
  flatbuffers::FlatBufferBuilder b;
  struct Entry {
    uint32_t row;
    uint64_t id;
    flatbuffers::Offset<fbs::StoredMap> offset;
  };
  std::vector<Entry> maps;
  bool too_large = false;

  Impl(const ModelRow& s, size_t initial_bytes) : shape(s), b(initial_bytes) {}
};

MapExportBuilder::MapExportBuilder(const ModelRow& shape, size_t expected_maps) {
  const size_t per_map =
      4 * (shape.hidden_size + static_cast<size_t>(shape.num_layers) * shape.num_experts) + 96;
  const size_t initial =
      std::min<size_t>(1024 + expected_maps * per_map, FLATBUFFERS_MAX_BUFFER_SIZE / 2);
  impl_ = std::make_unique<Impl>(shape, initial);
  impl_->maps.reserve(expected_maps);
}

MapExportBuilder::~MapExportBuilder() = default;

size_t MapExportBuilder::maps() const { return impl_->maps.size(); }

void MapExportBuilder::Add(const MapView& m) {
  Impl& x = *impl_;
  // A FlatBuffer holds at most 2 GiB; past it the builder's behaviour is undefined.
  const size_t bytes = 4 * (m.sem.size() + m.map.size()) + 96 + 8 * x.maps.size();
  if (x.too_large || x.b.GetSize() + bytes > FLATBUFFERS_MAX_BUFFER_SIZE - 1024) {
    x.too_large = true;
    return;
  }
  auto sem = x.b.CreateVector(m.sem.data(), m.sem.size());
  auto map = x.b.CreateVector(m.map.data(), m.map.size());
  x.maps.push_back({m.row, m.id,
                    fbs::CreateStoredMap(x.b, m.id, m.row, m.request_id, m.iteration,
                                         m.stored_unix_ms, sem, map)});
}

Result<uint64_t> MapExportBuilder::Write(const std::string& path, std::stop_token stop) {
  Impl& x = *impl_;
  const std::string what = "export to " + path;
  if (x.too_large) {
    return ResourceExhausted(what + ": the maps do not fit in one export file (2 GiB)");
  }
  std::sort(x.maps.begin(), x.maps.end(), [](const Impl::Entry& a, const Impl::Entry& b) {
    return a.row != b.row ? a.row < b.row : a.id < b.id;
  });
  std::vector<flatbuffers::Offset<fbs::StoredMap>> offsets;
  offsets.reserve(x.maps.size());
  for (const Impl::Entry& e : x.maps) offsets.push_back(e.offset);
  auto vec = x.b.CreateVector(offsets);
  const ModelRow& s = x.shape;
  x.b.Finish(fbs::CreateMapExport(x.b, 1, s.fingerprint, s.num_layers, s.num_experts, s.top_k,
                                  s.hidden_size, UnixMs(), vec),
             fbs::MapExportIdentifier());
  // Written beside the target and renamed over it: a reader never sees half a file.
  const std::string tmp = path + ".tmp";
  FMOE_RETURN_IF_ERROR(WriteWholeFile(tmp, x.b.GetBufferPointer(), x.b.GetSize(), what, stop));
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return IoError("cannot rename " + tmp + " to " + path);
  }
  return static_cast<uint64_t>(x.b.GetSize());
}

Result<uint64_t> WriteMapExport(const std::string& path, const ModelRow& shape,
                                const std::vector<MapRow>& maps, std::stop_token stop) {
  MapExportBuilder file(shape, maps.size());
  for (const MapRow& m : maps) {
    if (stop.stop_requested()) return Cancelled("export to " + path);
    file.Add({m.id, m.row, m.request_id, m.iteration, m.stored_unix_ms, m.sem, m.map});
  }
  return file.Write(path, stop);
}

Result<MapExportContents> ReadMapExport(const std::string& path, uint64_t max_bytes,
                                        uint64_t fingerprint, std::stop_token stop) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return NotFound("import file " + path + " does not exist or is not a file");
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return InvalidArgument("import file " + path + " is " + std::to_string(st.st_size) +
                           " bytes, above the limit of " + std::to_string(max_bytes));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  // Block-aligned, which the FlatBuffers verifier's alignment checks need too.
  FMOE_ASSIGN_OR_RETURN(AlignedBuffer storage,
                        ReadWholeFile(path, size, "import of " + path, stop));
  const uint8_t* buf = storage.get();
  if (size < 8 || !fbs::MapExportBufferHasIdentifier(buf)) {
    return InvalidArgument(path + " is not an fmoe map export (bad identifier)");
  }
  flatbuffers::Verifier verifier(buf, size, /*max_depth=*/8, /*max_tables=*/4000000);
  if (!fbs::VerifyMapExportBuffer(verifier)) {
    return InvalidArgument(path + " is a damaged map export (fails verification)");
  }
  const fbs::MapExport* ex = fbs::GetMapExport(buf);
  if (fingerprint != 0 && fingerprint != ex->fingerprint()) {
    return InvalidArgument(path + " holds model " + FingerprintHex(ex->fingerprint()) + ", not " +
                           FingerprintHex(fingerprint));
  }
  MapExportContents out;
  out.shape = {ex->fingerprint(), ex->num_layers(),  ex->num_experts(),
               ex->top_k(),       ex->hidden_size(), 0};
  const ModelRow& shape = out.shape;
  if (shape.fingerprint == 0 || shape.num_layers == 0 || shape.num_experts == 0 ||
      shape.hidden_size == 0 || shape.top_k == 0 || shape.top_k > shape.num_experts) {
    return InvalidArgument(path + ": model shape L=" + std::to_string(shape.num_layers) + " J=" +
                           std::to_string(shape.num_experts) + " K=" + std::to_string(shape.top_k) +
                           " h=" + std::to_string(shape.hidden_size) + " is not valid");
  }
  if (ex->maps() == nullptr) return out;
  const size_t width = static_cast<size_t>(shape.num_layers) * shape.num_experts;
  out.maps.reserve(ex->maps()->size());
  for (const fbs::StoredMap* m : *ex->maps()) {
    if (stop.stop_requested()) return Cancelled("import of " + path);
    if (m->sem() == nullptr || m->map() == nullptr || m->sem()->size() != shape.hidden_size ||
        m->map()->size() != width || !Finite(*m->sem()) || !Finite(*m->map())) {
      ++out.skipped;
      continue;
    }
    MapRow row;
    row.id = m->id();
    row.row = m->row();
    row.request_id = m->request_id();
    row.iteration = m->iteration();
    row.stored_unix_ms = m->stored_unix_ms();
    row.sem.assign(m->sem()->begin(), m->sem()->end());
    row.map.assign(m->map()->begin(), m->map()->end());
    out.maps.push_back(std::move(row));
  }
  return out;
}

}  // namespace fmoe
