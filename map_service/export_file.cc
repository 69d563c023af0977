#include "map_service/export_file.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

#include <flatbuffers/flatbuffers.h>

#include "common/clock.h"
#include "common/model_config.h"
#include "schemas/export_generated.h"

namespace fmoe {
namespace {

namespace fbs = fmoe::store;

constexpr size_t kChunkBytes = 64u << 20;  // Reads and writes between two looks at `stop`.

Status Cancelled(const std::string& what) {
  return Unavailable(what + " cancelled: the map service is stopping");
}

bool Finite(const flatbuffers::Vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

}  // namespace

Result<uint64_t> WriteMapExport(const std::string& path, const ModelRow& shape,
                                const std::vector<MapRow>& maps, std::stop_token stop) {
  const std::string what = "export to " + path;
  flatbuffers::FlatBufferBuilder b(1024);
  std::vector<flatbuffers::Offset<fbs::StoredMap>> offsets;
  offsets.reserve(maps.size());
  for (const MapRow& m : maps) {
    if (stop.stop_requested()) return Cancelled(what);
    auto sem = b.CreateVector(m.sem);
    auto map = b.CreateVector(m.map);
    offsets.push_back(fbs::CreateStoredMap(b, m.id, m.row, m.request_id, m.iteration,
                                           m.stored_unix_ms, sem, map));
  }
  auto vec = b.CreateVector(offsets);
  b.Finish(fbs::CreateMapExport(b, 1, shape.fingerprint, shape.num_layers, shape.num_experts,
                                shape.top_k, shape.hidden_size, UnixMs(), vec),
           fbs::MapExportIdentifier());
  // Written beside the target and renamed over it: a reader never sees half a file.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    const char* data = reinterpret_cast<const char*>(b.GetBufferPointer());
    for (size_t at = 0; out && at < b.GetSize(); at += kChunkBytes) {
      if (stop.stop_requested()) {
        out.close();
        std::remove(tmp.c_str());
        return Cancelled(what);
      }
      out.write(data + at, static_cast<std::streamsize>(std::min(kChunkBytes, b.GetSize() - at)));
    }
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      return IoError("cannot write " + tmp);
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return IoError("cannot rename " + tmp + " to " + path);
  }
  return static_cast<uint64_t>(b.GetSize());
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
  // 8-byte aligned storage for the FlatBuffers verifier.
  std::vector<uint64_t> storage((size + 7) / 8);
  {
    std::ifstream in(path, std::ios::binary);
    char* data = reinterpret_cast<char*>(storage.data());
    for (size_t at = 0; in && at < size; at += kChunkBytes) {
      if (stop.stop_requested()) return Cancelled("import of " + path);
      in.read(data + at, static_cast<std::streamsize>(std::min(kChunkBytes, size - at)));
    }
    if (!in) return IoError("cannot read " + path);
  }
  const auto* buf = reinterpret_cast<const uint8_t*>(storage.data());
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
