#include "gpu_worker/cache/store/host_tier.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/clock.h"

namespace fmoe {

namespace {

#if defined(__SSE2__)
// The 8 x 8 block of 16-bit elements at `src` (rows `stride` elements apart) transposed to `dst`
// (rows `dst_stride` apart).
void Transpose8x8(const uint16_t* src, uint64_t stride, uint16_t* dst, uint64_t dst_stride) {
  __m128i a[8];
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * stride));
  }
  __m128i b[8], c[8];
  for (int i = 0; i < 4; ++i) {
    b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    c[4 * i] = _mm_unpacklo_epi32(b[4 * i], b[4 * i + 2]);
    c[4 * i + 1] = _mm_unpackhi_epi32(b[4 * i], b[4 * i + 2]);
    c[4 * i + 2] = _mm_unpacklo_epi32(b[4 * i + 1], b[4 * i + 3]);
    c[4 * i + 3] = _mm_unpackhi_epi32(b[4 * i + 1], b[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * i) * dst_stride),
                     _mm_unpacklo_epi64(c[i], c[i + 4]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * i + 1) * dst_stride),
                     _mm_unpackhi_epi64(c[i], c[i + 4]));
  }
}

// The 4 x 4 block of 32-bit elements at `src` transposed to `dst`.
void Transpose4x4(const uint32_t* src, uint64_t stride, uint32_t* dst, uint64_t dst_stride) {
  __m128i a[4];
  for (int i = 0; i < 4; ++i) {
    a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * stride));
  }
  const __m128i b0 = _mm_unpacklo_epi32(a[0], a[1]), b1 = _mm_unpackhi_epi32(a[0], a[1]);
  const __m128i b2 = _mm_unpacklo_epi32(a[2], a[3]), b3 = _mm_unpackhi_epi32(a[2], a[3]);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_unpacklo_epi64(b0, b2));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + dst_stride), _mm_unpackhi_epi64(b0, b2));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * dst_stride), _mm_unpacklo_epi64(b1, b3));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 3 * dst_stride), _mm_unpackhi_epi64(b1, b3));
}
#endif

// Part p of `split`'s columns, transposed: out_p[c][r] = region[r][c * ways + p]. Tile by tile
// (kTile output rows of every part by kTile source rows): the tile's source rows are transposed
// into a local tile (by SSE2 register blocks where the build has them, 8 x 8 for 16-bit elements
// and 4 x 4 for 32-bit ones), and each output row's kTile elements are written from it in one
// run, so both matrices stream (bench/RESULTS.md, the host tier).
template <typename T>
void ScatterColumns(const RegionSplit& split, const char* region, char* expert) {
  constexpr uint64_t kTile = 64;
  const uint64_t ways = split.part_dst.size(), rows = split.rows, cols = split.cols;
  const uint64_t out_rows = cols / ways;
  std::vector<T> tile(kTile * kTile * ways);  // tile[s * kTile + r]: source column s, row r.
  for (uint64_t c0 = 0; c0 < out_rows; c0 += kTile) {
    const uint64_t c1 = std::min(out_rows, c0 + kTile);
    const uint64_t width = (c1 - c0) * ways;
    for (uint64_t r0 = 0; r0 < rows; r0 += kTile) {
      const uint64_t height = std::min(rows, r0 + kTile) - r0;
      uint64_t r = 0;
#if defined(__SSE2__)
      if constexpr (sizeof(T) == 2 || sizeof(T) == 4) {
        constexpr uint64_t kBlock = 16 / sizeof(T);
        const T* src = reinterpret_cast<const T*>(region) + r0 * cols + c0 * ways;
        const uint64_t whole = width / kBlock * kBlock;
        for (; r + kBlock <= height; r += kBlock) {
          for (uint64_t s = 0; s < whole; s += kBlock) {
            if constexpr (sizeof(T) == 2) {
              Transpose8x8(src + r * cols + s, cols, &tile[s * kTile + r], kTile);
            } else {
              Transpose4x4(src + r * cols + s, cols, &tile[s * kTile + r], kTile);
            }
          }
          for (uint64_t s = whole; s < width; ++s) {
            for (uint64_t i = 0; i < kBlock; ++i) {
              std::memcpy(&tile[s * kTile + r + i], src + (r + i) * cols + s, sizeof(T));
            }
          }
        }
      }
#endif
      for (; r < height; ++r) {
        const char* row = region + ((r0 + r) * cols + c0 * ways) * sizeof(T);
        for (uint64_t s = 0; s < width; ++s) {
          std::memcpy(&tile[s * kTile + r], row + s * sizeof(T), sizeof(T));
        }
      }
      for (uint64_t p = 0; p < ways; ++p) {
        char* out = expert + split.part_dst[p];
        for (uint64_t c = c0; c < c1; ++c) {
          std::memcpy(out + (c * rows + r0) * sizeof(T), &tile[((c - c0) * ways + p) * kTile],
                      height * sizeof(T));
        }
      }
    }
  }
}

// Why `split` of a `bytes` region cannot go into an expert of `expert_bytes`; "" when it can.
std::string SplitError(const RegionSplit& split, uint64_t bytes, size_t expert_bytes) {
  const uint64_t ways = split.part_dst.size();
  if (split.elem_bytes != 1 && split.elem_bytes != 2 && split.elem_bytes != 4) {
    return "a split of " + std::to_string(split.elem_bytes) + "-byte elements (1, 2 or 4)";
  }
  if (split.rows == 0 || split.cols == 0 || split.cols > bytes / split.elem_bytes ||
      split.rows != bytes / split.elem_bytes / split.cols ||
      split.rows * split.cols * split.elem_bytes != bytes) {
    return "a split of " + std::to_string(split.rows) + " x " + std::to_string(split.cols) +
           " elements of " + std::to_string(split.elem_bytes) + " bytes is not its " +
           std::to_string(bytes) + " bytes";
  }
  if ((split.by_columns ? split.cols : split.rows) % ways != 0) {
    return std::string("its ") + (split.by_columns ? "columns" : "rows") + " do not split " +
           std::to_string(ways) + " ways";
  }
  for (uint64_t dst : split.part_dst) {
    if (dst > expert_bytes || bytes / ways > expert_bytes - dst) {
      return "a part at " + std::to_string(dst) + " does not fit";
    }
  }
  return "";
}

}  // namespace

void ScatterRegion(const RegionSplit& split, const char* region, char* expert) {
  const uint64_t ways = split.part_dst.size();
  if (!split.by_columns) {
    const uint64_t row_bytes = split.cols * split.elem_bytes;
    for (uint64_t r = 0; r < split.rows; ++r) {
      std::memcpy(expert + split.part_dst[r % ways] + (r / ways) * row_bytes,
                  region + r * row_bytes, row_bytes);
    }
    return;
  }
  switch (split.elem_bytes) {
    case 1:
      ScatterColumns<uint8_t>(split, region, expert);
      break;
    case 2:
      ScatterColumns<uint16_t>(split, region, expert);
      break;
    default:
      ScatterColumns<uint32_t>(split, region, expert);
      break;
  }
}

Result<std::unique_ptr<HostTier>> HostTier::Create(const HostTierOptions& options,
                                                   std::vector<std::vector<ExpertExtent>> extents,
                                                   std::vector<std::string> file_paths,
                                                   std::unique_ptr<DiskReader> reader) {
  const auto bad = [](const std::string& what) { return InvalidArgument("host tier: " + what); };
  if (options.num_experts == 0 || options.expert_bytes == 0) {
    return bad("no experts or an expert of 0 bytes");
  }
  if (options.slots == 0) return bad("a budget of 0 slots holds no expert");
  if (options.max_prefetch_reads == 0) return bad("max_prefetch_reads is 0");
  if (reader == nullptr) return bad("no disk reader");
  if (extents.empty() || extents.size() % options.num_experts != 0) {
    return bad("extents for " + std::to_string(extents.size()) + " experts, not whole layers of " +
               std::to_string(options.num_experts));
  }
  uint32_t owned = 0;
  for (size_t key = 0; key < extents.size(); ++key) {
    owned += extents[key].empty() ? 0 : 1;
    for (const ExpertExtent& x : extents[key]) {
      const std::string name = "expert " + std::to_string(key % options.num_experts) +
                               " of layer " + std::to_string(key / options.num_experts) +
                               ": tensor \"" + x.tensor + "\": ";
      if (x.file >= file_paths.size() || x.bytes == 0) {
        return bad(name + std::to_string(x.bytes) + " bytes of file " + std::to_string(x.file) +
                   " (of " + std::to_string(file_paths.size()) + ")");
      }
      if (!x.split.part_dst.empty()) {
        if (std::string why = SplitError(x.split, x.bytes, options.expert_bytes); !why.empty()) {
          return bad(name + why + " (an expert of " + std::to_string(options.expert_bytes) +
                     " bytes)");
        }
        continue;
      }
      if (x.dst_offset > options.expert_bytes || x.bytes > options.expert_bytes - x.dst_offset) {
        return bad(name + std::to_string(x.bytes) + " bytes at " + std::to_string(x.dst_offset) +
                   " of file " + std::to_string(x.file) + " do not fit an expert of " +
                   std::to_string(options.expert_bytes) + " bytes");
      }
    }
  }
  if (owned == 0) return bad("no expert to hold");
  HostTierOptions o = options;
  o.slots = std::min(o.slots, owned);
  std::unique_ptr<HostTier> tier(
      new HostTier(o, std::move(extents), std::move(file_paths), std::move(reader)));
  tier->memory_bytes_ = (o.slots * o.expert_bytes + 4095) / 4096 * 4096;
  tier->memory_ = std::aligned_alloc(4096, tier->memory_bytes_);
  if (tier->memory_ == nullptr) {
    return ResourceExhausted("host tier: cannot allocate " + std::to_string(tier->memory_bytes_) +
                             " bytes for " + std::to_string(o.slots) + " experts");
  }
  // Padding between a quantized expert's tensors is copied to the device too: zero, never
  // garbage.
  std::memset(tier->memory_, 0, tier->memory_bytes_);
  tier->Publish();
  return tier;
}

HostTier::HostTier(const HostTierOptions& options, std::vector<std::vector<ExpertExtent>> extents,
                   std::vector<std::string> file_paths, std::unique_ptr<DiskReader> reader)
    : options_(options),
      extents_(std::move(extents)),
      paths_(std::move(file_paths)),
      reader_(std::move(reader)),
      entries_(extents_.size()),
      slot_owner_(options.slots, -1) {
  for (uint32_t s = options_.slots; s > 0; --s) free_slots_.push_back(static_cast<int32_t>(s - 1));
  counters_.slots = options_.slots;
}

HostTier::~HostTier() {
  // The reader's threads write into the slots and the staging buffers: stop them before the
  // memory goes.
  reader_.reset();
  staged_.clear();
  std::free(memory_);
}

std::string HostTier::Name(uint32_t key) const {
  return "expert " + std::to_string(key % options_.num_experts) + " of layer " +
         std::to_string(key / options_.num_experts);
}

bool HostTier::Resident(uint32_t key) const {
  return key < entries_.size() && entries_[key].state == State::kResident;
}

const void* HostTier::Pin(uint32_t key) {
  if (!Resident(key)) return nullptr;
  Entry& e = entries_[key];
  ++e.pins;
  e.held = false;
  e.last_use = ++clock_;
  ++counters_.hits;
  if (e.prefetched) {
    e.prefetched = false;
    ++counters_.prefetches_used;
  }
  Publish();
  return static_cast<const char*>(memory_) + static_cast<size_t>(e.slot) * options_.expert_bytes;
}

void HostTier::Unpin(uint32_t key) {
  if (key >= entries_.size() || entries_[key].pins == 0) return;
  if (--entries_[key].pins == 0 && !queued_.empty()) StartQueued();
}

int32_t HostTier::TakeSlot(const double* below) {
  if (!free_slots_.empty()) {
    const int32_t slot = free_slots_.back();
    free_slots_.pop_back();
    return slot;
  }
  int32_t victim = -1;
  double victim_score = 0.0;
  for (int32_t owner : slot_owner_) {
    if (owner < 0) continue;
    const Entry& e = entries_[owner];
    if (e.state != State::kResident || e.pins > 0 || e.held) continue;
    const double score = score_ ? score_(static_cast<uint32_t>(owner)) : 0.0;
    if (below != nullptr && !(score < *below)) continue;
    if (victim < 0 || score < victim_score ||
        (score == victim_score && e.last_use < entries_[victim].last_use)) {
      victim = owner;
      victim_score = score;
    }
  }
  if (victim < 0) return -1;
  Entry& v = entries_[victim];
  const int32_t slot = v.slot;
  v = Entry{};
  slot_owner_[slot] = -1;
  ++counters_.evictions;
  --counters_.resident;
  return slot;
}

void HostTier::StartRead(uint32_t key, int32_t slot) {
  Entry& e = entries_[key];
  e.state = State::kReading;
  e.slot = slot;
  e.error = Status::Ok();
  e.start_ns = SteadyClock::Get().NowNs();
  slot_owner_[slot] = static_cast<int32_t>(key);
  char* base = static_cast<char*>(memory_) + static_cast<size_t>(slot) * options_.expert_bytes;
  const std::vector<ExpertExtent>& parts = extents_[key];
  e.parts_left = static_cast<uint32_t>(parts.size());
  ++reading_;
  for (size_t i = 0; i < parts.size(); ++i) {
    const uint64_t id = next_read_++;
    reads_.emplace(id, std::make_pair(key, i));
    char* dst = base + parts[i].dst_offset;
    std::function<void()> then;
    if (!parts[i].split.part_dst.empty()) {
      Staging buffer;
      if (!spare_staging_.empty()) {
        buffer = std::move(spare_staging_.back());
        spare_staging_.pop_back();
      }
      if (buffer.capacity < parts[i].bytes) {
        buffer.data = std::make_unique_for_overwrite<char[]>(parts[i].bytes);
        buffer.capacity = parts[i].bytes;
      }
      dst = buffer.data.get();
      staged_.emplace(id, std::move(buffer));
      // On the reader's finishing thread: the slot and the buffer stay this read's until it
      // comes back, and extents_ does not change.
      then = [split = &parts[i].split, region = dst, base] { ScatterRegion(*split, region, base); };
    }
    reader_->Submit(id, parts[i].file, parts[i].offset, parts[i].bytes, dst, e.urgent,
                    std::move(then));
  }
}

void HostTier::StartQueued() {
  // Urgent requests first, then in request order.
  for (int pass = 0; pass < 2 && !queued_.empty(); ++pass) {
    for (size_t i = 0; i < queued_.size();) {
      const uint32_t key = queued_[i];
      if (pass == 0 && !entries_[key].urgent) {
        ++i;
        continue;
      }
      const int32_t slot = TakeSlot(nullptr);
      if (slot < 0) return;
      queued_.erase(queued_.begin() + static_cast<std::ptrdiff_t>(i));
      StartRead(key, slot);
    }
  }
}

void HostTier::Request(uint32_t key, bool urgent) {
  if (!Owns(key)) {
    TierDone d;
    d.key = key;
    d.status = InvalidArgument("host tier: key " + std::to_string(key) + " (" +
                               (key < entries_.size() ? Name(key) : std::string("out of range")) +
                               ") is not held by this rank");
    kept_.push_back(std::move(d));
    return;
  }
  Entry& e = entries_[key];
  e.held = true;
  if (e.state == State::kResident) return;
  if (e.state == State::kQueued || e.state == State::kReading) {
    if (urgent && !e.urgent) {
      e.urgent = true;
      ++urgent_pending_;
      if (e.prefetched) {
        // A prefetch someone now waits for.
        e.prefetched = false;
        --prefetching_;
      }
    }
    return;
  }
  ++counters_.misses;
  e.urgent = urgent;
  e.prefetched = false;
  if (urgent) ++urgent_pending_;
  const int32_t slot = TakeSlot(nullptr);
  if (slot < 0) {
    e.state = State::kQueued;
    queued_.push_back(key);
    return;
  }
  StartRead(key, slot);
}

void HostTier::Release(uint32_t key) {
  if (key >= entries_.size()) return;
  Entry& e = entries_[key];
  e.held = false;
  if (e.state == State::kQueued) {
    // Nobody waits for it: it does not take a slot.
    queued_.erase(std::find(queued_.begin(), queued_.end(), key));
    if (e.urgent) --urgent_pending_;
    e = Entry{};
  }
}

void HostTier::Prefetch(uint32_t key, int64_t use_in_ns) {
  if (!Owns(key) || entries_[key].state != State::kAbsent) return;
  // Spare time only: a read a load waits for would share the disk with this one.
  if (urgent_pending_ > 0) {
    ++counters_.prefetches_yielded;
    Publish();
    return;
  }
  // Worth it only when it can end before the use (the reader takes one read at a time).
  if (use_in_ns >= 0 &&
      static_cast<double>(use_in_ns) < read_ns_mean_ * static_cast<double>(prefetching_ + 1)) {
    ++counters_.prefetches_late;
    Publish();
    return;
  }
  if (prefetching_ >= options_.max_prefetch_reads) return;
  const double own = score_ ? score_(key) : 0.0;
  const int32_t slot = TakeSlot(&own);
  if (slot < 0) return;
  Entry& e = entries_[key];
  e.urgent = false;
  e.prefetched = true;
  ++prefetching_;
  ++counters_.prefetches;
  StartRead(key, slot);
  Publish();
}

void HostTier::Drain(const std::vector<ReadDone>& reads, std::vector<TierDone>* out) {
  for (const ReadDone& r : reads) {
    auto it = reads_.find(r.id);
    if (it == reads_.end()) continue;
    const auto [key, part] = it->second;
    reads_.erase(it);
    Entry& e = entries_[key];
    const ExpertExtent& x = extents_[key][part];
    if (!r.status.ok() && e.error.ok()) {
      e.error = Status(r.status.code(), "host tier: " + Name(key) + ": tensor \"" + x.tensor +
                                            "\": " + r.status.message());
    }
    if (auto staged = staged_.find(r.id); staged != staged_.end()) {
      // Scattered into the slot before the read came back. A few buffers kept for the next
      // reads; the rest go.
      if (spare_staging_.size() < 4) spare_staging_.push_back(std::move(staged->second));
      staged_.erase(staged);
    }
    if (r.status.ok()) counters_.bytes_read += x.bytes;
    if (--e.parts_left > 0) continue;
    --reading_;
    if (e.prefetched && e.state == State::kReading) --prefetching_;
    if (e.urgent) {
      e.urgent = false;
      --urgent_pending_;
    }
    TierDone d;
    d.key = key;
    d.start_ns = e.start_ns;
    d.end_ns = SteadyClock::Get().NowNs();
    ++counters_.reads;
    counters_.read_ns += d.end_ns - d.start_ns;
    // A moving mean (1/8 per read), so the expected read time follows the disk's load.
    const auto took = static_cast<double>(d.end_ns - d.start_ns);
    read_ns_mean_ = read_ns_mean_ == 0.0 ? took : read_ns_mean_ + (took - read_ns_mean_) / 8.0;
    if (e.error.ok()) {
      e.state = State::kResident;
      ++counters_.resident;
      e.last_use = ++clock_;
    } else {
      ++counters_.read_errors;
      d.status = e.error;
      free_slots_.push_back(e.slot);
      slot_owner_[e.slot] = -1;
      e = Entry{};
    }
    out->push_back(std::move(d));
  }
  if (!queued_.empty()) StartQueued();
}

size_t HostTier::Poll(std::vector<TierDone>* out) {
  const size_t before = out->size();
  for (TierDone& d : kept_) out->push_back(std::move(d));
  kept_.clear();
  scratch_.clear();
  reader_->Poll(&scratch_);
  Drain(scratch_, out);
  Publish();
  return out->size() - before;
}

size_t HostTier::Wait(std::vector<TierDone>* out, std::chrono::milliseconds timeout) {
  const size_t before = out->size();
  if (Poll(out) > 0) return out->size() - before;
  if (reading_ == 0) return 0;
  scratch_.clear();
  reader_->Wait(&scratch_, timeout);
  Drain(scratch_, out);
  Publish();
  return out->size() - before;
}

Result<const void*> HostTier::Acquire(uint32_t key) {
  if (const void* p = Pin(key)) return p;
  Request(key, /*urgent=*/true);
  const int64_t start = SteadyClock::Get().NowNs();
  std::vector<TierDone> done, others;
  Status failed;
  while (failed.ok() && !Resident(key)) {
    if (!Owns(key)) {
      failed = InvalidArgument("host tier: key " + std::to_string(key) + " is not held here");
      break;
    }
    if (entries_[key].state == State::kQueued && reading_ == 0) {
      failed = ResourceExhausted("host tier: " + Name(key) + ": every one of the " +
                                 std::to_string(options_.slots) + " host slots is pinned");
      break;
    }
    scratch_.clear();
    reader_->Wait(&scratch_, std::chrono::milliseconds(100));
    done.clear();
    Drain(scratch_, &done);
    // Every finished read stays for the next Poll/Wait too: a tiered link may wait for it.
    for (TierDone& d : done) {
      if (d.key == key && !d.status.ok() && failed.ok()) failed = d.status;
      others.push_back(std::move(d));
    }
  }
  for (TierDone& d : others) kept_.push_back(std::move(d));
  counters_.stall_ns += SteadyClock::Get().NowNs() - start;
  Publish();
  if (!failed.ok()) return failed;
  const void* p = Pin(key);
  --counters_.hits;  // The miss's own use, not a hit.
  return p;
}

void HostTier::Publish() {
  std::lock_guard<std::mutex> lock(stats_mu_);
  published_ = counters_;
}

HostTierStats HostTier::stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return published_;
}

Status HostTier::CheckInvariants() const {
  size_t used = 0;
  for (size_t s = 0; s < slot_owner_.size(); ++s) {
    const int32_t owner = slot_owner_[s];
    if (owner < 0) continue;
    ++used;
    const Entry& e = entries_[owner];
    if (e.slot != static_cast<int32_t>(s)) {
      return Internal("host tier: slot " + std::to_string(s) + " owned by " + Name(owner) +
                      " which is in slot " + std::to_string(e.slot));
    }
    if (e.state != State::kResident && e.state != State::kReading) {
      return Internal("host tier: " + Name(owner) + " holds a slot while absent or queued");
    }
  }
  if (used + free_slots_.size() != slot_owner_.size()) {
    return Internal("host tier: " + std::to_string(used) + " used + " +
                    std::to_string(free_slots_.size()) + " free slots of " +
                    std::to_string(slot_owner_.size()));
  }
  uint32_t urgent = 0;
  for (size_t key = 0; key < entries_.size(); ++key) {
    const Entry& e = entries_[key];
    urgent += e.urgent && (e.state == State::kQueued || e.state == State::kReading) ? 1 : 0;
    if (e.pins > 0 && e.state != State::kResident) {
      return Internal("host tier: " + Name(static_cast<uint32_t>(key)) +
                      " pinned but not resident");
    }
    if ((e.state == State::kQueued) !=
        (std::find(queued_.begin(), queued_.end(), key) != queued_.end())) {
      return Internal("host tier: " + Name(static_cast<uint32_t>(key)) + " queue mismatch");
    }
  }
  if (urgent != urgent_pending_) {
    return Internal("host tier: " + std::to_string(urgent) + " urgent reads, counted " +
                    std::to_string(urgent_pending_));
  }
  return Status::Ok();
}

}  // namespace fmoe
