#include "common/model/expert_trace.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <unordered_map>
#include <utility>

#include "common/json.h"

namespace fmoe {
namespace {

constexpr char kMagic[8] = {'F', 'M', 'O', 'E', 'T', 'R', 'C', '1'};
constexpr uint8_t kFlagLast = 1;
constexpr uint8_t kFlagDerived = 2;
constexpr uint8_t kFlagPrefill = 4;  // Prompt tokens (a prefill or a chunk of one).
constexpr uint32_t kMaxTraceHeaderBytes = 1 << 20;

Status CheckHeader(const TraceHeader& h) {
  if (h.num_layers < 1 || h.num_layers > 1024) {
    return InvalidArgument("num_layers " + std::to_string(h.num_layers) + " is not in 1..1024");
  }
  if (h.num_experts < 1 || h.num_experts > 65535) {
    return InvalidArgument("num_experts " + std::to_string(h.num_experts) + " is not in 1..65535");
  }
  if (h.top_k < 1 || h.top_k > h.num_experts) {
    return InvalidArgument("top_k " + std::to_string(h.top_k) + " is not in 1..num_experts");
  }
  if (h.hidden > 65536) {
    return InvalidArgument("hidden " + std::to_string(h.hidden) + " is not in 0..65536");
  }
  return Status::Ok();
}

// Checks experts ascending below J; `what` names the list.
Status CheckExperts(std::span<const uint16_t> experts, uint32_t num_experts,
                    const std::string& what) {
  for (size_t i = 0; i < experts.size(); ++i) {
    if (experts[i] >= num_experts) {
      return InvalidArgument(what + ": expert " + std::to_string(experts[i]) + " >= num_experts " +
                             std::to_string(num_experts));
    }
    if (i > 0 && experts[i] <= experts[i - 1]) {
      return InvalidArgument(what + ": experts are not strictly ascending");
    }
  }
  return Status::Ok();
}

Status CheckFractions(std::span<const float> values, const std::string& what) {
  for (float v : values) {
    if (!std::isfinite(v) || v < 0.0f || v > 1.0f + 1e-5f) {
      return InvalidArgument(what + ": value " + std::to_string(v) + " is not in [0, 1]");
    }
  }
  return Status::Ok();
}

template <class T>
void Put(std::vector<char>& out, T v) {
  const char* p = reinterpret_cast<const char*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}
template <class T>
void PutSpan(std::vector<char>& out, std::span<const T> v) {
  const char* p = reinterpret_cast<const char*>(v.data());
  out.insert(out.end(), p, p + v.size_bytes());
}

// Reads fields from one record; every read is bounds-checked.
class Cursor {
 public:
  Cursor(const char* data, size_t size) : data_(data), size_(size) {}
  template <class T>
  bool Get(T* v) {
    if (size_ - pos_ < sizeof(T)) return false;
    std::memcpy(v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  template <class T>
  bool GetN(size_t n, std::vector<T>* out) {
    if ((size_ - pos_) / sizeof(T) < n) return false;
    const size_t old = out->size();
    out->resize(old + n);
    std::memcpy(out->data() + old, data_ + pos_, n * sizeof(T));
    pos_ += n * sizeof(T);
    return true;
  }
  bool done() const { return pos_ == size_; }

 private:
  const char* data_;
  size_t size_;
  size_t pos_ = 0;
};

Status DecodeRecord(const TraceHeader& h, const char* data, size_t size, TraceIteration* it) {
  Cursor c(data, size);
  const auto truncated = [] { return DataLoss("record ends early"); };
  uint8_t flags = 0, pad[3];
  if (!c.Get(&it->request_id) || !c.Get(&it->iteration) || !c.Get(&it->tokens) || !c.Get(&flags) ||
      !c.Get(&pad[0]) || !c.Get(&pad[1]) || !c.Get(&pad[2])) {
    return truncated();
  }
  if ((flags & ~(kFlagLast | kFlagDerived | kFlagPrefill)) != 0) {
    return DataLoss("unknown flags " + std::to_string(flags));
  }
  it->last = (flags & kFlagLast) != 0;
  it->map_derived = (flags & kFlagDerived) != 0;
  it->prefill = (flags & kFlagPrefill) != 0;
  if (!c.GetN(h.hidden, &it->sem)) return truncated();
  it->used_offsets.assign(1, 0);
  if (!it->map_derived) it->map_offsets.assign(1, 0);
  for (uint32_t l = 0; l < h.num_layers; ++l) {
    uint16_t n = 0;
    if (!c.Get(&n) || !c.GetN(n, &it->used_experts) || !c.GetN(n, &it->used_tokens)) {
      return truncated();
    }
    it->used_offsets.push_back(static_cast<uint32_t>(it->used_experts.size()));
    if (!it->map_derived) {
      uint16_t m = 0;
      if (!c.Get(&m) || !c.GetN(m, &it->map_experts) || !c.GetN(m, &it->map_probs)) {
        return truncated();
      }
      it->map_offsets.push_back(static_cast<uint32_t>(it->map_experts.size()));
    }
  }
  uint16_t s = 0;
  if (!c.Get(&s)) return truncated();
  it->speculation.resize(s);
  for (auto& sp : it->speculation) {
    uint16_t m = 0;
    if (!c.Get(&sp.layer) || !c.Get(&sp.target) || !c.Get(&m) || !c.GetN(m, &sp.experts) ||
        !c.GetN(m, &sp.fractions)) {
      return truncated();
    }
  }
  if (!c.done()) return DataLoss("bytes left after the record's last field");
  Status valid = ValidateTraceIteration(h, *it);
  if (!valid.ok()) return DataLoss(valid.message());
  return Status::Ok();
}

}  // namespace

void TraceIteration::FillMap(const TraceHeader& header, std::vector<float>* out) const {
  const uint32_t J = header.num_experts;
  out->assign(static_cast<size_t>(header.num_layers) * J, 0.0f);
  for (uint32_t l = 0; l < header.num_layers; ++l) {
    float* row = out->data() + static_cast<size_t>(l) * J;
    if (map_derived) {
      const float scale = 1.0f / static_cast<float>(tokens * header.top_k);
      auto experts = used(l);
      auto counts = used_counts(l);
      for (size_t i = 0; i < experts.size(); ++i) row[experts[i]] = counts[i] * scale;
    } else {
      for (uint32_t i = map_offsets[l]; i < map_offsets[l + 1]; ++i) {
        row[map_experts[i]] = map_probs[i];
      }
    }
  }
}

Status ValidateTraceIteration(const TraceHeader& h, const TraceIteration& it) {
  const std::string at =
      "request " + std::to_string(it.request_id) + " iteration " + std::to_string(it.iteration);
  if (it.tokens < 1) return InvalidArgument(at + ": tokens is 0");
  if (it.sem.size() != h.hidden) {
    return InvalidArgument(at + ": sem has " + std::to_string(it.sem.size()) +
                           " values, hidden is " + std::to_string(h.hidden));
  }
  for (float v : it.sem) {
    if (!std::isfinite(v)) return InvalidArgument(at + ": sem has a non-finite value");
  }
  if (it.used_offsets.size() != h.num_layers + 1 || it.used_offsets[0] != 0 ||
      it.used_offsets.back() != it.used_experts.size() ||
      it.used_tokens.size() != it.used_experts.size()) {
    return InvalidArgument(at + ": routing offsets do not match num_layers and the experts");
  }
  const uint64_t routed = static_cast<uint64_t>(it.tokens) * h.top_k;
  for (uint32_t l = 0; l < h.num_layers; ++l) {
    if (it.used_offsets[l + 1] < it.used_offsets[l] ||
        it.used_offsets[l + 1] > it.used_experts.size()) {
      return InvalidArgument(at + ": routing offsets out of order at layer " + std::to_string(l));
    }
    const std::string where = at + ": layer " + std::to_string(l);
    FMOE_RETURN_IF_ERROR(CheckExperts(it.used(l), h.num_experts, where + " routing"));
    uint64_t sum = 0;
    for (uint32_t c : it.used_counts(l)) {
      if (c == 0 || c > it.tokens) {
        return InvalidArgument(where + ": an expert's token count " + std::to_string(c) +
                               " is not in 1..tokens");
      }
      sum += c;
    }
    if (sum != routed) {
      return InvalidArgument(where + ": " + std::to_string(sum) + " tokens routed, expected " +
                             "tokens * top_k = " + std::to_string(routed));
    }
  }
  if (it.map_derived) {
    if (!it.map_offsets.empty() || !it.map_experts.empty() || !it.map_probs.empty()) {
      return InvalidArgument(at + ": a derived map stores no map entries");
    }
  } else {
    if (it.map_offsets.size() != h.num_layers + 1 || it.map_offsets[0] != 0 ||
        it.map_offsets.back() != it.map_experts.size() ||
        it.map_probs.size() != it.map_experts.size()) {
      return InvalidArgument(at + ": map offsets do not match num_layers and the entries");
    }
    for (uint32_t l = 0; l < h.num_layers; ++l) {
      if (it.map_offsets[l + 1] < it.map_offsets[l] ||
          it.map_offsets[l + 1] > it.map_experts.size()) {
        return InvalidArgument(at + ": map offsets out of order at layer " + std::to_string(l));
      }
      const std::string where = at + ": layer " + std::to_string(l) + " map";
      FMOE_RETURN_IF_ERROR(
          CheckExperts(std::span<const uint16_t>(it.map_experts)
                           .subspan(it.map_offsets[l], it.map_offsets[l + 1] - it.map_offsets[l]),
                       h.num_experts, where));
      FMOE_RETURN_IF_ERROR(
          CheckFractions(std::span<const float>(it.map_probs)
                             .subspan(it.map_offsets[l], it.map_offsets[l + 1] - it.map_offsets[l]),
                         where));
    }
  }
  for (const auto& sp : it.speculation) {
    const std::string where =
        at + ": speculation " + std::to_string(sp.layer) + "->" + std::to_string(sp.target);
    if (sp.layer >= sp.target || sp.target >= h.num_layers) {
      return InvalidArgument(where + ": needs layer < target < num_layers");
    }
    if (sp.fractions.size() != sp.experts.size()) {
      return InvalidArgument(where + ": experts and fractions differ in length");
    }
    FMOE_RETURN_IF_ERROR(CheckExperts(sp.experts, h.num_experts, where));
    FMOE_RETURN_IF_ERROR(CheckFractions(sp.fractions, where));
  }
  return Status::Ok();
}

Result<Trace> ReadTrace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return errno == ENOENT ? NotFound(path + ": no such file")
                           : IoError(path + ": " + std::strerror(errno));
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return IoError(path + ": read failed");
  const auto fail = [&](size_t offset, const std::string& m) {
    return DataLoss(path + ": byte " + std::to_string(offset) + ": " + m);
  };
  if (bytes.size() < 12 || std::memcmp(bytes.data(), kMagic, 8) != 0) {
    return fail(0, "not an fmoe trace (no FMOETRC1 magic)");
  }
  uint32_t header_len = 0;
  std::memcpy(&header_len, bytes.data() + 8, 4);
  if (header_len > kMaxTraceHeaderBytes || header_len > bytes.size() - 12) {
    return fail(8, "header length " + std::to_string(header_len) + " runs past the file");
  }
  Trace trace;
  TraceHeader& h = trace.header;
  try {
    auto j = nlohmann::json::parse(bytes.begin() + 12, bytes.begin() + 12 + header_len);
    h.model = j.at("model").get<std::string>();
    h.source = j.at("source").get<std::string>();
    h.iteration_unit = j.at("iteration_unit").get<std::string>();
    h.semantic = j.at("semantic").get<std::string>();
    h.num_layers = j.at("num_layers").get<uint32_t>();
    h.num_experts = j.at("num_experts").get<uint32_t>();
    h.top_k = j.at("top_k").get<uint32_t>();
    h.hidden = j.at("hidden").get<uint32_t>();
  } catch (const nlohmann::json::exception& e) {
    return fail(12, std::string("header: ") + e.what());
  }
  if (Status s = CheckHeader(h); !s.ok()) return fail(12, "header: " + s.message());

  struct Progress {
    uint32_t next = 0;
    bool ended = false;
  };
  std::unordered_map<uint64_t, Progress> requests;
  size_t pos = 12 + header_len;
  while (pos < bytes.size()) {
    const std::string record = "record " + std::to_string(trace.iterations.size());
    uint32_t size = 0;
    if (bytes.size() - pos < 4) return fail(pos, record + ": truncated size field");
    std::memcpy(&size, bytes.data() + pos, 4);
    if (size > bytes.size() - pos - 4) {
      return fail(pos, record + ": truncated (" + std::to_string(size) + " bytes announced, " +
                           std::to_string(bytes.size() - pos - 4) + " left)");
    }
    TraceIteration it;
    if (Status s = DecodeRecord(h, bytes.data() + pos + 4, size, &it); !s.ok()) {
      return fail(pos, record + ": " + s.message());
    }
    Progress& p = requests[it.request_id];
    if (p.ended) {
      return fail(pos, record + ": request " + std::to_string(it.request_id) +
                           " continues after its last iteration");
    }
    if (it.iteration != p.next) {
      return fail(pos, record + ": request " + std::to_string(it.request_id) + " iteration " +
                           std::to_string(it.iteration) + ", expected " + std::to_string(p.next));
    }
    p.next = it.iteration + 1;
    p.ended = it.last;
    trace.iterations.push_back(std::move(it));
    pos += 4 + size;
  }
  return trace;
}

Result<TraceWriter> TraceWriter::Create(const std::string& path, const TraceHeader& header) {
  FMOE_RETURN_IF_ERROR(CheckHeader(header).WithContext("trace header"));
  TraceWriter w;
  w.path_ = path;
  w.header_ = header;
  w.file_ = std::fopen(path.c_str(), "wb");
  if (w.file_ == nullptr) return IoError(path + ": " + std::strerror(errno));
  nlohmann::json j = {{"model", header.model},
                      {"source", header.source},
                      {"iteration_unit", header.iteration_unit},
                      {"semantic", header.semantic},
                      {"num_layers", header.num_layers},
                      {"num_experts", header.num_experts},
                      {"top_k", header.top_k},
                      {"hidden", header.hidden}};
  const std::string text = j.dump();
  const uint32_t n = static_cast<uint32_t>(text.size());
  if (std::fwrite(kMagic, 1, 8, w.file_) != 8 || std::fwrite(&n, 4, 1, w.file_) != 1 ||
      std::fwrite(text.data(), 1, n, w.file_) != n) {
    return IoError(path + ": write failed: " + std::strerror(errno));
  }
  return w;
}

TraceWriter::TraceWriter(TraceWriter&& o) noexcept
    : path_(std::move(o.path_)),
      header_(std::move(o.header_)),
      file_(std::exchange(o.file_, nullptr)),
      record_(std::move(o.record_)),
      records_(o.records_) {}

TraceWriter& TraceWriter::operator=(TraceWriter&& o) noexcept {
  if (this != &o) {
    if (file_ != nullptr) std::fclose(file_);
    path_ = std::move(o.path_);
    header_ = std::move(o.header_);
    file_ = std::exchange(o.file_, nullptr);
    record_ = std::move(o.record_);
    records_ = o.records_;
  }
  return *this;
}

TraceWriter::~TraceWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

Status TraceWriter::Append(const TraceIteration& it) {
  if (file_ == nullptr) return FailedPrecondition(path_ + ": trace is closed");
  FMOE_RETURN_IF_ERROR(ValidateTraceIteration(header_, it));
  if (it.speculation.size() > 65535) return InvalidArgument("more than 65535 speculations");
  record_.clear();
  Put<uint32_t>(record_, 0);  // Size, patched below.
  Put(record_, it.request_id);
  Put(record_, it.iteration);
  Put(record_, it.tokens);
  Put<uint8_t>(record_, (it.last ? kFlagLast : 0) | (it.map_derived ? kFlagDerived : 0) |
                            (it.prefill ? kFlagPrefill : 0));
  Put<uint8_t>(record_, 0);
  Put<uint16_t>(record_, 0);
  PutSpan<float>(record_, it.sem);
  for (uint32_t l = 0; l < header_.num_layers; ++l) {
    auto experts = it.used(l);
    Put<uint16_t>(record_, static_cast<uint16_t>(experts.size()));
    PutSpan<uint16_t>(record_, experts);
    PutSpan<uint32_t>(record_, it.used_counts(l));
    if (!it.map_derived) {
      const uint32_t b = it.map_offsets[l], e = it.map_offsets[l + 1];
      Put<uint16_t>(record_, static_cast<uint16_t>(e - b));
      PutSpan<uint16_t>(record_, std::span<const uint16_t>(it.map_experts).subspan(b, e - b));
      PutSpan<float>(record_, std::span<const float>(it.map_probs).subspan(b, e - b));
    }
  }
  Put<uint16_t>(record_, static_cast<uint16_t>(it.speculation.size()));
  for (const auto& sp : it.speculation) {
    Put(record_, sp.layer);
    Put(record_, sp.target);
    Put<uint16_t>(record_, static_cast<uint16_t>(sp.experts.size()));
    PutSpan<uint16_t>(record_, sp.experts);
    PutSpan<float>(record_, sp.fractions);
  }
  const uint32_t size = static_cast<uint32_t>(record_.size() - 4);
  std::memcpy(record_.data(), &size, 4);
  if (std::fwrite(record_.data(), 1, record_.size(), file_) != record_.size()) {
    return IoError(path_ + ": write failed: " + std::strerror(errno));
  }
  ++records_;
  return Status::Ok();
}

Status TraceWriter::Flush() {
  if (file_ == nullptr) return FailedPrecondition(path_ + ": trace is closed");
  if (std::fflush(file_) != 0) return IoError(path_ + ": flush failed: " + std::strerror(errno));
  return Status::Ok();
}

Status TraceWriter::Close() {
  if (file_ == nullptr) return Status::Ok();
  const int flushed = std::fflush(file_);
  const int closed = std::fclose(file_);
  file_ = nullptr;
  if (flushed != 0 || closed != 0) {
    return IoError(path_ + ": close failed: " + std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace fmoe
