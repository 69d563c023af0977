#include "gpu_worker/experts/cached_experts.h"
#include "common/process_util.h"
#include "gpu_worker/cache/policies/policy_factory.h"
#include "gpu_worker/cache/store/tiered_link.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <thread>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace fmoe {

namespace {

// A part of a split region no tensor has taken yet.
constexpr uint64_t kUnsetPart = std::numeric_limits<uint64_t>::max();

// expert_cache_gb: auto. The free memory is read after the dense weights and the host store are
// in place, so only the slots and the KV reserve come out of it.
Result<uint32_t> AutoSlots(const TransferEngine& link, const CachedExpertsOptions& options,
                           size_t expert_bytes, uint32_t owned) {
  if (!(options.memory_utilization > 0 && options.memory_utilization <= 1)) {
    return InvalidArgument("expert cache: memory_utilization " +
                           std::to_string(options.memory_utilization) + " is not in (0, 1]");
  }
  FMOE_ASSIGN_OR_RETURN(uint64_t free, link.FreeDeviceBytes());
  const double usable = options.memory_utilization * static_cast<double>(free) -
                        static_cast<double>(options.reserve_bytes);
  const double fits = std::floor(std::max(usable, 0.0) / static_cast<double>(expert_bytes));
  const auto slots = static_cast<uint32_t>(std::min<double>(fits, owned));
  spdlog::info(
      "expert cache: auto: {:.2f} GB free on the {} link x {:g} - {:.2f} GB KV reserve = {:.2f} "
      "GB for experts of {} bytes: {} slots of {} owned experts",
      static_cast<double>(free) / 1e9, link.name(), options.memory_utilization,
      static_cast<double>(options.reserve_bytes) / 1e9, std::max(usable, 0.0) / 1e9, expert_bytes,
      slots, owned);
  if (slots == 0) {
    return ResourceExhausted("expert cache: auto: " + std::to_string(free) + " free bytes x " +
                             std::to_string(options.memory_utilization) + " less a KV reserve of " +
                             std::to_string(options.reserve_bytes) + " bytes holds no expert of " +
                             std::to_string(expert_bytes) +
                             " bytes; lower max_batch or use a larger device");
  }
  return slots;
}

}  // namespace

Result<std::unique_ptr<CachedExperts>> CachedExperts::Create(ExpertTable experts,
                                                             const CachedExpertsOptions& options,
                                                             Clock& clock) {
  std::unique_ptr<CachedExperts> self(new CachedExperts());
  FMOE_ASSIGN_OR_RETURN(const uint32_t owned, self->TakeShape(experts, options));
  const uint32_t layers = static_cast<uint32_t>(experts.size());
  const uint32_t per_layer = static_cast<uint32_t>(experts[0].size());
  const size_t expert_bytes = self->expert_bytes();
  uint32_t slots = owned;
  if (!options.cache_auto && !options.shared) {
    FMOE_ASSIGN_OR_RETURN(
        slots, BudgetSlots(options.cache_gb, options.cache_fraction, expert_bytes, owned));
  }
  PolicyOptions policy_options = options.policy_options;
  FMOE_ASSIGN_OR_RETURN(std::unique_ptr<CachePolicy> policy,
                        MakePolicy(options.policy, policy_options));
  if (options.cuda_index >= 0) {
    FMOE_ASSIGN_OR_RETURN(self->link_, NewCudaLink(options.cuda_index, options.link));
  } else {
    FMOE_ASSIGN_OR_RETURN(self->link_, NewEmulatedLink(options.link));
  }
  std::vector<const void*> addresses;
  if (self->on_disk_) {
    FMOE_ASSIGN_OR_RETURN(addresses, self->MakeHostTier(experts, options, owned));
    experts.clear();
    FMOE_RETURN_IF_ERROR(
        self->link_->RegisterHost(self->tier_->memory(), self->tier_->memory_bytes()));
  } else {
    if (options.host_cache_gb || options.host_cache_fraction || options.host_cache_auto) {
      return InvalidArgument(
          "cached experts: a host cache budget is set but the experts were loaded into memory; "
          "the host tier needs them left on disk (RuntimeOptions::experts_on_disk)");
    }
    FMOE_ASSIGN_OR_RETURN(addresses, self->PackHost(&experts, options, owned));
    FMOE_RETURN_IF_ERROR(self->link_->RegisterHost(self->host_, self->host_bytes_));
    if (options.hybrid) self->host_addresses_ = addresses;
  }
  const at::Device device = options.cuda_index >= 0
                                ? at::Device(at::kCUDA, static_cast<int8_t>(options.cuda_index))
                                : at::Device(at::kCPU);
  // A budget that holds every expert it owns never streams: no buffer.
  const bool all_resident = !options.cache_auto && !options.shared && slots >= owned;
  if (options.stream_slots > 0 && !all_resident) {
    const size_t bytes = size_t{options.stream_slots} * expert_bytes;
    FMOE_ASSIGN_OR_RETURN(self->stream_, self->link_->AllocateDevice(bytes));
    // cpu mode: touched, so the host's available memory no longer counts it.
    if (options.cuda_index < 0) std::memset(self->stream_, 0, bytes);
    for (uint32_t s = 0; s < options.stream_slots; ++s) {
      self->stream_views_.push_back(
          self->ViewsAt(static_cast<char*>(self->stream_) + size_t{s} * expert_bytes, device));
    }
  }
  if (options.shared) {
    FMOE_ASSIGN_OR_RETURN(slots, self->PlanSharedBudget(options, owned));
    FMOE_ASSIGN_OR_RETURN(self->slots_,
                          self->link_->AllocateDevice(self->pages_ * self->page_bytes_));
  } else {
    if (options.cache_auto) {
      FMOE_ASSIGN_OR_RETURN(slots, AutoSlots(*self->link_, options, expert_bytes, owned));
    }
    FMOE_ASSIGN_OR_RETURN(self->slots_,
                          self->link_->AllocateDevice(static_cast<size_t>(slots) * expert_bytes));
  }
  self->MakeSlotViews(slots, options);

  ExpertCacheOptions cache_options;
  cache_options.num_layers = layers;
  cache_options.num_experts = per_layer;
  cache_options.top_k = options.top_k;
  cache_options.rank = options.rank;
  cache_options.world_size = options.world_size;
  cache_options.expert_bytes = expert_bytes;
  cache_options.slots = slots;
  cache_options.slot_stride = self->page_bytes_;  // 0 without a shared budget.
  cache_options.max_inflight_prefetches = options.max_inflight_prefetches;
  cache_options.preload = options.preload;
  cache_options.hybrid = options.hybrid;
  cache_options.admit_host_runs = options.admit_host_runs;
  cache_options.tiered = self->tier_ != nullptr;
  FMOE_ASSIGN_OR_RETURN(self->cache_,
                        ExpertCache::Create(cache_options, std::move(policy), self->link_.get(),
                                            std::move(addresses), self->SlotBase(), clock));
  if (self->stream_ != nullptr) {
    FMOE_RETURN_IF_ERROR(self->cache_->AttachStreamBuffer(self->stream_, options.stream_slots));
  }
  if (self->tier_ != nullptr) {
    // The host tier evicts by the device cache's score: the same predicted next use.
    const ExpertCache* cache = self->cache_.get();
    self->tier_->set_score([cache, per_layer](uint32_t key) {
      return cache->policy().EvictionScore(key / per_layer, key % per_layer);
    });
  }
  spdlog::info(
      "expert cache: policy={} rank={}/{} slots={} of {} experts ({:.1f} MB of {:.1f} MB) "
      "expert={} bytes link={} hybrid={} stream_slots={} ({:.1f} MB)",
      options.policy, options.rank, options.world_size, slots, owned, slots * expert_bytes / 1e6,
      owned * expert_bytes / 1e6, expert_bytes, self->link_->name(),
      !options.hybrid ? std::string("off")
      : self->cuda_   ? "on (" + std::to_string(at::get_num_threads()) + " host threads)"
                      : "on (emulated, host x" + std::to_string(options.host_slowdown) + ")",
      self->stream_views_.size(), self->stream_views_.size() * expert_bytes / 1e6);
  self->stats_ = self->cache_->stats();
  return self;
}

Result<uint32_t> CachedExperts::TakeShape(const ExpertTable& experts,
                                          const CachedExpertsOptions& options) {
  const uint32_t layers = static_cast<uint32_t>(experts.size());
  const uint32_t per_layer = layers == 0 ? 0 : static_cast<uint32_t>(experts[0].size());
  if (layers == 0 || per_layer == 0) return InvalidArgument("cached experts: no experts");
  if (options.world_size == 0 || options.rank >= options.world_size) {
    return InvalidArgument("cached experts: rank " + std::to_string(options.rank) +
                           " is not below world size " + std::to_string(options.world_size));
  }
  // The shape and dtype of one expert, from the first one this rank owns.
  const ExpertWeights* first = nullptr;
  uint32_t owned = 0;
  for (uint32_t k = 0; k < layers * per_layer; ++k) {
    if (k % options.world_size != options.rank) continue;
    ++owned;
    const ExpertWeights& w = experts[k / per_layer][k % per_layer];
    if (!w.w1.defined()) {
      return InvalidArgument("cached experts: expert " + std::to_string(k % per_layer) +
                             " of layer " + std::to_string(k / per_layer) + " was not loaded");
    }
    if (first == nullptr) first = &w;
  }
  if (first == nullptr) return InvalidArgument("cached experts: this rank owns no expert");
  if (!(options.host_slowdown >= 1.0 && std::isfinite(options.host_slowdown))) {
    return InvalidArgument("cached experts: host_slowdown " +
                           std::to_string(options.host_slowdown) + " is not a finite number >= 1");
  }
  if (options.hybrid && options.cuda_index >= 0 && !first->quantized() &&
      first->w1.scalar_type() != at::kFloat && first->w1.scalar_type() != at::kBFloat16) {
    return InvalidArgument(
        "cached experts: hybrid execution runs experts on the host in float32, bfloat16 or their "
        "quantized format, and these are " +
        std::string(c10::toString(first->w1.scalar_type())));
  }
  cuda_ = options.cuda_index >= 0;
  host_slowdown_ = options.host_slowdown;
  on_disk_ = first->disk != nullptr;
  // The layout: each stored tensor after the last; a quantized expert's mixed dtypes each start
  // 64-byte aligned (a device reads them as their own type).
  const size_t align = first->quantized() ? 64 : 1;
  size_t offset = 0;
  for (const at::Tensor* t : first->Tensors()) {
    offset = (offset + align - 1) / align * align;
    layout_.push_back({t->sizes().vec(), t->scalar_type(), offset});
    offset += static_cast<size_t>(t->numel()) * t->element_size();
  }
  expert_bytes_ = (offset + align - 1) / align * align;
  quant_ = first->quant;
  const std::array<at::Tensor*, kExpertPlaces> places = const_cast<ExpertWeights*>(first)->Places();
  for (size_t i = 0; i < places.size(); ++i) present_[i] = places[i]->defined();
  return owned;
}

Result<std::vector<const void*>> CachedExperts::PackHost(ExpertTable* experts,
                                                         const CachedExpertsOptions& options,
                                                         uint32_t owned) {
  const uint32_t layers = static_cast<uint32_t>(experts->size());
  const uint32_t per_layer = static_cast<uint32_t>((*experts)[0].size());
  const size_t expert_bytes = this->expert_bytes();
  host_bytes_ = (static_cast<size_t>(owned) * expert_bytes + 63) / 64 * 64;
  host_ = std::aligned_alloc(64, host_bytes_);
  if (host_ == nullptr) {
    return ResourceExhausted("cached experts: cannot allocate " + std::to_string(host_bytes_) +
                             " bytes of host memory");
  }
  std::memset(host_, 0, host_bytes_);  // Alignment padding included: copies move no garbage.
  std::vector<const void*> addresses(static_cast<size_t>(layers) * per_layer, nullptr);
  char* cursor = static_cast<char*>(host_);
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t j = 0; j < per_layer; ++j) {
      ExpertWeights& w = (*experts)[l][j];
      if ((l * per_layer + j) % options.world_size != options.rank) {
        w = ExpertWeights{};
        continue;
      }
      const std::vector<const at::Tensor*> tensors = std::as_const(w).Tensors();
      bool same = tensors.size() == layout_.size() && w.quant == quant_;
      for (size_t i = 0; same && i < tensors.size(); ++i) {
        same = tensors[i]->sizes() == at::IntArrayRef(layout_[i].sizes) &&
               tensors[i]->scalar_type() == layout_[i].dtype;
      }
      if (!same) {
        return InvalidArgument("cached experts: expert " + std::to_string(j) + " of layer " +
                               std::to_string(l) + " differs in shape or dtype from the others");
      }
      addresses[static_cast<size_t>(l) * per_layer + j] = cursor;
      for (size_t i = 0; i < tensors.size(); ++i) {
        at::Tensor c = tensors[i]->contiguous();
        const size_t n = static_cast<size_t>(c.numel()) * c.element_size();
        std::memcpy(cursor + layout_[i].offset, c.data_ptr(), n);
      }
      cursor += expert_bytes;
      w = ExpertWeights{};  // The packed copy is the only one from here.
    }
    (*experts)[l].clear();
  }
  return addresses;
}

ExpertWeights CachedExperts::ViewsAt(char* base, at::Device device) const {
  ExpertWeights w;
  w.quant = quant_;
  std::array<at::Tensor*, kExpertPlaces> places = w.Places();
  size_t part = 0;
  for (size_t i = 0; i < places.size() && part < layout_.size(); ++i) {
    if (!present_[i]) continue;
    const PartLayout& p = layout_[part++];
    *places[i] =
        at::from_blob(base + p.offset, p.sizes, at::TensorOptions().dtype(p.dtype).device(device));
  }
  return w;
}

void CachedExperts::MakeSlotViews(uint32_t slots, const CachedExpertsOptions& options) {
  const at::Device device = options.cuda_index >= 0
                                ? at::Device(at::kCUDA, static_cast<int8_t>(options.cuda_index))
                                : at::Device(at::kCPU);
  const size_t stride = page_bytes_ != 0 ? page_bytes_ : expert_bytes();
  for (uint32_t s = 0; s < slots; ++s) {
    slot_views_.push_back(ViewsAt(SlotBase() + static_cast<size_t>(s) * stride, device));
  }
}

Result<uint32_t> CachedExperts::PlanSharedBudget(const CachedExpertsOptions& options,
                                                 uint32_t owned) {
  const CachedExpertsOptions::SharedBudget& b = *options.shared;
  const auto bad = [](const std::string& what) { return InvalidArgument("memory: " + what); };
  if (b.page_quantum == 0) return bad("no KV block size (page_quantum)");
  if (!(b.kv_floor >= 0 && b.kv_floor < 1) || !(b.expert_floor >= 0 && b.expert_floor < 1) ||
      !(b.kv_floor + b.expert_floor <= 1)) {
    return bad("kv_floor " + std::to_string(b.kv_floor) + " and expert_floor " +
               std::to_string(b.expert_floor) + " must be in [0, 1) and sum to at most 1");
  }
  double budget = 0;
  std::string source;
  if (b.device_gb) {
    budget = *b.device_gb * 1e9;
    source = fmt::format("device_gb {:g}", *b.device_gb);
  } else {
    if (!(b.device_fraction > 0 && b.device_fraction <= 1)) {
      return bad("device_fraction " + std::to_string(b.device_fraction) + " is not in (0, 1]");
    }
    FMOE_ASSIGN_OR_RETURN(const uint64_t free, link_->FreeDeviceBytes());
    budget = b.device_fraction * static_cast<double>(free);
    source = fmt::format("device_fraction {:g} of {:.2f} GB free on the {} link", b.device_fraction,
                         static_cast<double>(free) / 1e9, link_->name());
  }
  // A page holds an expert or whole KV blocks, and starts 256-byte aligned.
  const uint64_t unit = std::lcm<uint64_t>(b.page_quantum, 256);
  page_bytes_ = (expert_bytes() + unit - 1) / unit * unit;
  const double pages = std::floor(budget / static_cast<double>(page_bytes_));
  const auto at_least = [&](double fraction) {
    return static_cast<uint32_t>(std::max(1.0, std::ceil(fraction * pages - 1e-9)));
  };
  const uint32_t kv_floor = at_least(b.kv_floor);
  const uint32_t expert_floor = at_least(b.expert_floor);
  if (pages < 2 || kv_floor + expert_floor > pages) {
    return ResourceExhausted(fmt::format(
        "memory: a budget of {:.3f} GB ({}) holds {} pages of {} bytes (an expert of {} bytes, or "
        "{} KV blocks); it needs {} for the KV floor and {} for the experts' floor",
        budget / 1e9, source, pages, page_bytes_, expert_bytes(), page_bytes_ / b.page_quantum,
        kv_floor, expert_floor));
  }
  pages_ = static_cast<uint32_t>(std::min<double>(pages, UINT32_MAX / 2));
  // Pages beyond one per owned expert are the pool's for good.
  const uint32_t slots = std::min(pages_ - kv_floor, owned);
  kv_floor_pages_ = pages_ - slots;
  expert_floor_slots_ = std::min(expert_floor, slots);
  spdlog::info(
      "memory: one device budget of {:.3f} GB ({}): {} pages of {:.2f} MB (an expert, or {} KV "
      "blocks of 16 positions); the KV pool keeps {} and may borrow up to {} of the {} expert "
      "slots ({} stay experts')",
      budget / 1e9, source, pages_, static_cast<double>(page_bytes_) / 1e6,
      page_bytes_ / b.page_quantum, kv_floor_pages_, slots - expert_floor_slots_, slots,
      expert_floor_slots_);
  return slots;
}

std::optional<KvArena> CachedExperts::kv_arena() {
  if (pages_ == 0) return std::nullopt;
  KvArena a;
  a.base = slots_;
  a.page_bytes = page_bytes_;
  a.pages = pages_;
  a.floor_pages = kv_floor_pages_;
  a.max_pages = pages_ - expert_floor_slots_;
  a.lender = this;
  return a;
}

std::optional<uint32_t> CachedExperts::Lend() {
  std::optional<uint32_t> slot = cache_->LendSlot(expert_floor_slots_);
  if (!slot) return std::nullopt;
  return kv_floor_pages_ + *slot;
}

void CachedExperts::Return(uint32_t page) {
  if (page >= kv_floor_pages_) cache_->ReturnSlot(page - kv_floor_pages_);
}

CachedExperts::~CachedExperts() {
  cache_.reset();  // Cancels what is still on the link.
  if (link_ != nullptr) {
    if (slots_ != nullptr) link_->FreeDevice(slots_);
    if (stream_ != nullptr) link_->FreeDevice(stream_);
    if (host_ != nullptr) link_->UnregisterHost(host_);
    if (tier_ != nullptr) link_->UnregisterHost(tier_->memory());
  }
  link_.reset();
  tier_.reset();
  std::free(host_);
}

void CachedExperts::BeginIteration(std::span<const SequenceInfo> sequences) {
  cache_->BeginIteration(sequences);
}

uint32_t CachedExperts::speculation_distance() const { return cache_->speculation_distance(); }

void CachedExperts::Speculate(uint32_t layer, uint32_t target, std::span<const float> probs) {
  cache_->Speculate(layer, target, probs);
}

Status CachedExperts::BeginLayer(const LayerRouting& routing) {
  return cache_->BeginLayer(routing);
}

Result<SourcedExpert> CachedExperts::Next() {
  FMOE_ASSIGN_OR_RETURN(ReadyExpert ready, cache_->Next());
  if (!ready.error.ok()) return SourcedExpert{ready.expert, {}, std::move(ready.error)};
  if (ready.streamed) return SourcedExpert{ready.expert, stream_views_[ready.slot], Status::Ok()};
  if (!ready.on_host) return SourcedExpert{ready.expert, slot_views_[ready.slot], Status::Ok()};
  // A host run: views of the packed host copy (read into the host tier first, with one).
  const size_t key =
      static_cast<size_t>(cache_->current_layer()) * cache_->num_experts() + ready.expert;
  const void* base = nullptr;
  if (tier_ != nullptr) {
    // A failed read is tried once more (a transient error passes), as the cache does its loads;
    // then the layer goes on without the expert.
    Result<const void*> acquired = AcquireHostSlot(static_cast<uint32_t>(key));
    if (!acquired.ok()) {
      spdlog::warn("cached experts: layer={} expert={}: host run's read failed ({}): {}",
                   cache_->current_layer(), ready.expert, "retrying once",
                   acquired.status().ToString());
      acquired = AcquireHostSlot(static_cast<uint32_t>(key));
      cache_->RecordHostReadFailure(ready.expert, acquired.ok() ? 1 : 2, !acquired.ok());
    }
    if (!acquired.ok()) {
      spdlog::warn("cached experts: layer={} expert={}: host run's read failed ({}): {}",
                   cache_->current_layer(), ready.expert, "the running layer goes on without it",
                   acquired.status().ToString());
      return SourcedExpert{ready.expert, {}, acquired.status()};
    }
    base = *acquired;
    host_key_ = static_cast<int64_t>(key);
  } else if (key < host_addresses_.size()) {
    base = host_addresses_[key];
  }
  if (base == nullptr) {
    return Internal("cached experts: no host copy of expert " + std::to_string(ready.expert) +
                    " of layer " + std::to_string(cache_->current_layer()));
  }
  ExpertWeights w = ViewsAt(static_cast<char*>(const_cast<void*>(base)), at::Device(at::kCPU));
  host_expert_ = ready.expert;
  host_start_ns_ = SteadyClock::Get().NowNs();
  return SourcedExpert{ready.expert, std::move(w), Status::Ok()};
}

Result<const void*> CachedExperts::AcquireHostSlot(uint32_t key) {
  Result<const void*> acquired = tier_->Acquire(key);
  // Every host slot held by loads on their way to the device (read, or waiting to be copied):
  // each transfer the link finishes releases one.
  while (!acquired.ok() && acquired.status().code() == ErrorCode::kResourceExhausted) {
    if (Status s = cache_->AwaitTransfer(); !s.ok()) {
      if (s.code() == ErrorCode::kNotFound) return acquired;
      return s;
    }
    acquired = tier_->Acquire(key);
  }
  return acquired;
}

void CachedExperts::Done(uint32_t expert) {
  if (host_expert_ == static_cast<int64_t>(expert)) {
    const int64_t real = SteadyClock::Get().NowNs() - host_start_ns_;
    // cpu mode: the emulated host compute rate, as the emulated link paces its copies.
    if (!cuda_ && host_slowdown_ > 1.0 && real > 0) {
      std::this_thread::sleep_for(
          std::chrono::nanoseconds(static_cast<int64_t>(real * (host_slowdown_ - 1.0))));
    }
    cache_->RecordHostRun(expert, SteadyClock::Get().NowNs() - host_start_ns_);
    host_expert_ = -1;
    ReleaseHostKey();
  }
  cache_->Done(expert);
}

bool CachedExperts::HostRunsPlanned() const { return cache_->host_runs_planned() > 0; }

void CachedExperts::ReleaseHostKey() {
  if (tier_ != nullptr && host_key_ >= 0) tier_->Unpin(static_cast<uint32_t>(host_key_));
  host_key_ = -1;
}

void CachedExperts::EndLayer() {
  host_expert_ = -1;
  ReleaseHostKey();
  cache_->EndLayer();
}

void CachedExperts::EndIteration() {
  cache_->EndIteration();
  CacheStats s = cache_->stats();
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_ = std::move(s);
}

void CachedExperts::OnRequestEnd(uint64_t request_id) { cache_->OnRequestEnd(request_id); }

bool CachedExperts::StreamNextIteration() {
  // A cache that holds every expert it owns has nothing to stream.
  if (cache_->stream_slots() == 0 || cache_->holds_every_expert()) return false;
  cache_->StreamNextIteration();
  return true;
}

void CachedExperts::PostDirective(PrefetchDirective directive) {
  cache_->PostDirective(std::move(directive));
}

CacheStats CachedExperts::stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return stats_;
}

TransferStats CachedExperts::link_stats() const { return link_->stats(); }

std::optional<HostTierStats> CachedExperts::host_tier_stats() const {
  if (tier_ == nullptr) return std::nullopt;
  return tier_->stats();
}

Result<std::vector<const void*>> CachedExperts::MakeHostTier(const ExpertTable& experts,
                                                             const CachedExpertsOptions& options,
                                                             uint32_t owned) {
  const uint32_t layers = static_cast<uint32_t>(experts.size());
  const uint32_t per_layer = static_cast<uint32_t>(experts[0].size());
  const size_t expert_bytes = this->expert_bytes();
  uint32_t slots = owned;
  std::string budget = "every expert";
  if (options.host_cache_auto) {
    const Result<uint64_t> memory = HostAvailableBytes();
    const uint64_t available = memory.ok() ? *memory : 0;
    const uint64_t usable =
        available > options.host_reserve_bytes ? available - options.host_reserve_bytes : 0;
    slots = static_cast<uint32_t>(
        std::clamp<uint64_t>(usable / expert_bytes, 1, static_cast<uint64_t>(owned)));
    budget = fmt::format("auto: {:.2f} GB available - {:.2f} GB reserve", available / 1e9,
                         options.host_reserve_bytes / 1e9);
  } else if (options.host_cache_gb || options.host_cache_fraction) {
    if (options.host_cache_gb && options.host_cache_fraction) {
      return InvalidArgument(
          "cached experts: host_cache_gb and host_cache_fraction are both set; give one");
    }
    Result<uint32_t> budget_slots =
        BudgetSlots(options.host_cache_gb, options.host_cache_fraction, expert_bytes, owned);
    if (!budget_slots.ok()) {
      return InvalidArgument("host tier: " + budget_slots.status().message());
    }
    slots = *budget_slots;
    budget = options.host_cache_gb
                 ? fmt::format("host_cache_gb {:g}", *options.host_cache_gb)
                 : fmt::format("host_cache_fraction {:g}", *options.host_cache_fraction);
  }
  FMOE_ASSIGN_OR_RETURN(std::unique_ptr<DiskReader> reader, DiskReader::Create(options.disk));
  if (options.wrap_disk_reader) reader = options.wrap_disk_reader(std::move(reader));
  std::map<std::string, uint32_t> files;
  std::vector<std::string> paths;
  std::vector<std::vector<ExpertExtent>> extents(static_cast<size_t>(layers) * per_layer);
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t j = 0; j < per_layer; ++j) {
      const size_t key = static_cast<size_t>(l) * per_layer + j;
      if (key % options.world_size != options.rank) continue;
      const ExpertWeights& w = experts[l][j];
      const std::string name = "expert " + std::to_string(j) + " of layer " + std::to_string(l);
      const std::vector<const at::Tensor*> tensors = w.Tensors();
      if (w.disk == nullptr || w.disk->size() != tensors.size() ||
          tensors.size() != layout_.size() || !(w.quant == quant_)) {
        return InvalidArgument("cached experts: " + name +
                               " is not left on disk like the others, or differs in its tensors");
      }
      for (size_t i = 0; i < tensors.size(); ++i) {
        const DiskExtent& d = (*w.disk)[i];
        const uint64_t want = static_cast<uint64_t>(tensors[i]->numel()) *
                              static_cast<uint64_t>(tensors[i]->element_size());
        if (tensors[i]->sizes() != at::IntArrayRef(layout_[i].sizes) ||
            tensors[i]->scalar_type() != layout_[i].dtype ||
            d.bytes != want * std::max<uint64_t>(d.ways, 1) || (d.ways > 0 && d.part >= d.ways)) {
          return InvalidArgument("cached experts: " + name + ": tensor \"" + d.tensor + "\" (" +
                                 d.path + ") differs in shape, dtype or size from the others'");
        }
        auto [it, added] = files.emplace(d.path, 0);
        if (added) {
          FMOE_ASSIGN_OR_RETURN(it->second, reader->AddFile(d.path));
          paths.push_back(d.path);
        }
        std::vector<ExpertExtent>& parts = extents[key];
        if (d.ways == 0) {
          parts.push_back({it->second, d.offset, d.bytes, layout_[i].offset, d.tensor, {}});
          continue;
        }
        // A part of a split region: the region is read once, for all its parts.
        auto region = std::find_if(parts.begin(), parts.end(), [&](const ExpertExtent& x) {
          return x.file == it->second && x.offset == d.offset && x.bytes == d.bytes &&
                 !x.split.part_dst.empty();
        });
        if (region == parts.end()) {
          RegionSplit split{d.by_columns, d.rows, d.cols, d.elem_bytes,
                            std::vector<uint64_t>(d.ways, kUnsetPart)};
          parts.push_back({it->second, d.offset, d.bytes, 0, d.tensor, std::move(split)});
          region = parts.end() - 1;
        }
        if (region->split.part_dst.size() != d.ways || region->split.by_columns != d.by_columns ||
            region->split.rows != d.rows || region->split.cols != d.cols ||
            region->split.elem_bytes != d.elem_bytes ||
            region->split.part_dst[d.part] != kUnsetPart) {
          return InvalidArgument("cached experts: " + name + ": tensor \"" + d.tensor + "\" (" +
                                 d.path + "): its parts disagree on how they split its region");
        }
        region->split.part_dst[d.part] = layout_[i].offset;
      }
      for (const ExpertExtent& x : extents[key]) {
        if (std::find(x.split.part_dst.begin(), x.split.part_dst.end(), kUnsetPart) !=
            x.split.part_dst.end()) {
          return InvalidArgument("cached experts: " + name + ": tensor \"" + x.tensor +
                                 "\": a part of its region goes nowhere");
        }
      }
    }
  }
  const std::string_view backend = reader->backend();
  HostTierOptions t;
  t.num_experts = per_layer;
  t.expert_bytes = expert_bytes;
  t.slots = slots;
  t.max_prefetch_reads = std::max<uint32_t>(4, 2 * options.max_inflight_prefetches);
  FMOE_ASSIGN_OR_RETURN(
      tier_, HostTier::Create(t, std::move(extents), std::move(paths), std::move(reader)));
  link_ = std::make_unique<TieredLink>(std::move(link_), tier_.get());
  spdlog::info(
      "host tier: {} host slots of {} experts ({:.1f} MB of {:.1f} MB; {}), read from {} "
      "checkpoint files with {} (queue depth {}, {} KiB chunks)",
      slots, owned, slots * static_cast<double>(expert_bytes) / 1e6,
      owned * static_cast<double>(expert_bytes) / 1e6, budget, files.size(), backend,
      options.disk.queue_depth, options.disk.chunk_bytes >> 10);
  return std::vector<const void*>(static_cast<size_t>(layers) * per_layer, nullptr);
}

}  // namespace fmoe
