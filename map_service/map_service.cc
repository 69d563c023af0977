#include "map_service/map_service.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/model_config.h"
#include "map_service/export_file.h"

namespace fmoe {

MapService::MapService(MapServiceOptions options, const Clock& clock)
    : options_(std::move(options)), clock_(clock), ranks_(clock, options_.heartbeat_timeout_ms) {}

MapService::~MapService() = default;

Status MapService::Start() {
  started_ms_ = clock_.NowMs();
  FMOE_ASSIGN_OR_RETURN(db_, StoreDb::Open({options_.data_dir, options_.sync}));
  FMOE_ASSIGN_OR_RETURN(StoreDb::Contents contents, db_->LoadAll());
  for (const auto& bad : contents.corrupt) {
    spdlog::error("store: skipped corrupt record {}", bad);
  }
  size_t corrupt_maps = 0;
  for (const auto& m : contents.models) {
    models_[m.fingerprint] = m;
    FMOE_ASSIGN_OR_RETURN(ModelMaps * model, OpenModel(m));
    FMOE_ASSIGN_OR_RETURN(StoreDb::MapContents maps,
                          db_->LoadMaps(m.fingerprint, m.hidden_size,
                                        static_cast<size_t>(m.num_layers) * m.num_experts));
    for (const auto& bad : maps.corrupt) spdlog::error("store: skipped corrupt record {}", bad);
    corrupt_maps += maps.corrupt.size();
    size_t beyond = 0;
    for (const MapRow& row : maps.maps) {
      model->next_id = std::max(model->next_id, row.id + 1);
      if (model->store->size() >= model->store->options().capacity) {
        ++beyond;
        continue;
      }
      // Rows are rebuilt in their stored order; a gap left by a corrupt record closes up.
      FMOE_RETURN_IF_ERROR(model->store->Put(model->store->size(), row.id, row.sem, row.map));
    }
    if (beyond > 0) {
      spdlog::warn(
          "store: model {} has {} maps beyond store_capacity {}; they stay on disk, unused",
          FingerprintHex(m.fingerprint), beyond, options_.store_capacity);
    }
    spdlog::info("store: model {} (L={} J={} K={} h={}): {} maps loaded",
                 FingerprintHex(m.fingerprint), m.num_layers, m.num_experts, m.top_k, m.hidden_size,
                 model->store->size());
  }
  spdlog::info("store: opened {}: {} models, {} past rank registrations, {} corrupt records",
               options_.data_dir, contents.models.size(), contents.ranks.size(),
               contents.corrupt.size() + corrupt_maps);
  FMOE_ASSIGN_OR_RETURN(socket_,
                        wire::MapSocket::Bind(context_, wire::Role::kRouter, options_.endpoint));
  spdlog::info("listening on {}", options_.endpoint);
  return Status::Ok();
}

Result<MapService::ModelMaps*> MapService::OpenModel(const ModelRow& shape) {
  auto& slot = stores_[shape.fingerprint];
  if (slot) return slot.get();
  MapStoreOptions o;
  o.num_layers = shape.num_layers;
  o.num_experts = shape.num_experts;
  o.top_k = shape.top_k;
  o.hidden = shape.hidden_size;
  o.capacity = static_cast<uint32_t>(options_.store_capacity);
  o.prefetch_distance = static_cast<uint32_t>(options_.prefetch_distance);
  auto store = MapStore::Create(o);
  if (!store.ok()) {
    stores_.erase(shape.fingerprint);
    return store.status();
  }
  slot = std::make_unique<ModelMaps>();
  slot->shape = shape;
  slot->store = std::make_unique<MapStore>(std::move(*store));
  return slot.get();
}

uint32_t MapService::stored_maps(uint64_t fingerprint) const {
  auto it = stores_.find(fingerprint);
  return it == stores_.end() ? 0 : it->second->store->size();
}

void MapService::Run(const std::function<bool()>& stop) {
  int64_t last_expiry = clock_.NowMs();
  rate_window_start_ms_ = last_expiry;
  while (!stop()) {
    auto incoming = socket_->Receive(100);
    if (incoming) Handle(incoming->peer, incoming->message);
    const int64_t now = clock_.NowMs();
    if (now - last_expiry >= 100) {
      ExpireRanks();
      last_expiry = now;
    }
    if (now - rate_window_start_ms_ >= 10000) {
      ingest_rate_ = static_cast<double>(contexts_ - rate_window_start_count_) * 1000.0 /
                     static_cast<double>(now - rate_window_start_ms_);
      rate_window_start_ms_ = now;
      rate_window_start_count_ = contexts_;
    }
  }
  spdlog::info("stopping: {} registrations, {} dropped frames", counters_.registrations,
               socket_->stats().dropped_total());
}

void MapService::Reply(const std::string& peer, const MapMessage& message) {
  Status s = socket_->Send(message, peer);
  if (!s.ok()) spdlog::warn("reply to {} failed: {}", peer, s.ToString());
}

bool MapService::FromRegistered(const std::string& peer) {
  if (ranks_.Touch(peer)) return true;
  ++counters_.from_unregistered;
  return false;
}

void MapService::Handle(const std::string& peer, const MapMessage& message) {
  std::visit(
      [&](const auto& m) {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, Register>) {
          Reply(peer, OnRegister(peer, m));
        } else if constexpr (std::is_same_v<T, RankHeartbeat>) {
          bool known = ranks_.Touch(peer);
          Reply(peer, RankHeartbeatAck{m.seq, known});
        } else if constexpr (std::is_same_v<T, IterationStart> ||
                             std::is_same_v<T, LayerObserved> || std::is_same_v<T, IterationEnd>) {
          if (FromRegistered(peer)) OnContext(peer, message);
        } else if constexpr (std::is_same_v<T, AdminRequest>) {
          OnAdmin(peer, m);
        } else {
          spdlog::debug("peer={} sent {}, which only the map service sends; ignored", peer,
                        wire::MessageName(message));
        }
      },
      message);
}

RegisterAck MapService::OnRegister(const std::string& peer, const Register& reg) {
  RegisterAck ack;
  auto refuse = [&](std::string reason) {
    ++counters_.registrations_refused;
    spdlog::warn("refused registration of {}/{} (peer={}): {}", reg.group, reg.rank, peer, reason);
    ack.accepted = false;
    ack.reason = std::move(reason);
    return ack;
  };
  if (reg.group.empty()) return refuse("group is empty");
  if (reg.world_size == 0 || reg.rank >= reg.world_size) {
    return refuse("rank " + std::to_string(reg.rank) + " is not below world size " +
                  std::to_string(reg.world_size));
  }
  if (reg.num_layers == 0 || reg.num_experts == 0 || reg.hidden_size == 0 || reg.top_k == 0 ||
      reg.top_k > reg.num_experts) {
    return refuse("model shape L=" + std::to_string(reg.num_layers) +
                  " J=" + std::to_string(reg.num_experts) + " K=" + std::to_string(reg.top_k) +
                  " h=" + std::to_string(reg.hidden_size) + " is not valid");
  }
  ModelRow shape{reg.model_fingerprint, reg.num_layers, reg.num_experts, reg.top_k,
                 reg.hidden_size,       UnixMs()};
  const ModelRow* new_model = nullptr;
  auto known = models_.find(reg.model_fingerprint);
  if (known != models_.end()) {
    const ModelRow& k = known->second;
    if (k.num_layers != reg.num_layers || k.num_experts != reg.num_experts ||
        k.top_k != reg.top_k || k.hidden_size != reg.hidden_size) {
      return refuse("model " + FingerprintHex(reg.model_fingerprint) +
                    " is stored with a different shape (L=" + std::to_string(k.num_layers) +
                    " J=" + std::to_string(k.num_experts) + " K=" + std::to_string(k.top_k) +
                    " h=" + std::to_string(k.hidden_size) + ")");
    }
  } else {
    new_model = &shape;
  }
  RankRow row{reg.group, reg.rank, reg.world_size, reg.instance_id, reg.model_fingerprint,
              UnixMs()};
  // The in-memory store first (it can refuse a shape), then the durable record, then the ack.
  auto model = OpenModel(new_model != nullptr ? shape : known->second);
  if (!model.ok()) return refuse(model.status().message());
  Status s = db_->RecordRegistration(new_model, row);
  if (!s.ok()) {
    if (new_model != nullptr) stores_.erase(shape.fingerprint);
    return refuse("store write failed: " + s.message());
  }
  if (new_model != nullptr) models_[shape.fingerprint] = shape;

  // A restarted rank reconnects with a new routing id: drop its stale entry.
  std::string stale;
  for (const auto& [id, entry] : ranks_.peers()) {
    if (id != peer && entry.info.group == reg.group && entry.info.rank == reg.rank) {
      stale = id;
      break;
    }
  }
  if (!stale.empty()) DropPeer(stale);
  ranks_.Upsert(
      peer, RankState{reg.group, reg.rank, reg.world_size, reg.instance_id, reg.model_fingerprint});
  // A (re-)registration starts the rank's matching afresh.
  MatcherOptions mo;
  mo.prefetch_distance = static_cast<uint32_t>(options_.prefetch_distance);
  mo.semantic = options_.semantic && reg.semantic;
  mo.delta = options_.delta && reg.delta;
  mo.max_requests = options_.max_requests_per_rank;
  matchers_[peer] = std::make_unique<MapMatcher>(*(*model)->store, mo);
  ++counters_.registrations;
  ack.accepted = true;
  ack.stored_maps = (*model)->store->size();
  spdlog::info("registered group={} rank={}/{} model={} L={} J={} K={} h={} peer={}", reg.group,
               reg.rank, reg.world_size, FingerprintHex(reg.model_fingerprint), reg.num_layers,
               reg.num_experts, reg.top_k, reg.hidden_size, peer);
  return ack;
}

void MapService::OnAdmin(const std::string& peer, const AdminRequest& request) {
  ++counters_.admin_requests;
  AdminReply reply;
  reply.id = request.id;
  switch (request.op) {
    case AdminOp::kPing:
    case AdminOp::kStats:
      reply.ok = true;
      reply.json = StatsJson();
      break;
    case AdminOp::kExport:
    case AdminOp::kImport: {
      auto body = request.op == AdminOp::kExport ? Export(request) : Import(request);
      reply.ok = body.ok();
      if (body.ok()) {
        reply.json = std::move(*body);
      } else {
        reply.error = body.status().message();
        spdlog::warn("admin {} {} failed: {}", request.op == AdminOp::kExport ? "export" : "import",
                     request.path, reply.error);
      }
      break;
    }
  }
  Reply(peer, reply);
}

void MapService::ExpireRanks() {
  for (const auto& [id, entry] : ranks_.Expire()) {
    ++counters_.ranks_expired;
    auto m = matchers_.find(id);
    spdlog::warn(
        "rank group={} rank={} lost: no heartbeat for {} ms (peer={}); {} requests in flight "
        "forgotten",
        entry.info.group, entry.info.rank, clock_.NowMs() - entry.last_seen_ms, id,
        m == matchers_.end() ? 0 : m->second->in_flight());
    matchers_.erase(id);
  }
}

void MapService::DropPeer(const std::string& peer) {
  ranks_.Erase(peer);
  matchers_.erase(peer);
}

void MapService::OnContext(const std::string& peer, const MapMessage& message) {
  const auto started = std::chrono::steady_clock::now();
  ++contexts_;
  auto it = matchers_.find(peer);
  const auto* entry = ranks_.Find(peer);
  if (it == matchers_.end() || entry == nullptr) {
    ++counters_.from_unregistered;
    return;
  }
  const RankState* rank = &entry->info;
  MapMatcher& matcher = *it->second;
  const MatcherCounters before = matcher.counters();
  directives_.clear();
  if (const auto* start = std::get_if<IterationStart>(&message)) {
    ++counters_.iteration_starts;
    matcher.OnIterationStart(*start, &directives_);
  } else if (const auto* layer = std::get_if<LayerObserved>(&message)) {
    ++counters_.layers_observed;
    matcher.OnLayerObserved(*layer, &directives_);
  } else if (const auto* end = std::get_if<IterationEnd>(&message)) {
    ++counters_.iteration_ends;
    std::optional<CompletedMap> done = matcher.OnIterationEnd(*end);
    if (done) {
      auto model = ModelFor(rank->model_fingerprint);
      MapRow row;
      row.request_id = done->request_id;
      row.iteration = done->iteration;
      row.sem = std::move(done->sem);
      row.map = std::move(done->map);
      auto stored = model.ok() ? StoreMap(**model, &row) : Result<InsertResult>(model.status());
      if (stored.ok()) {
        Reply(peer, MapStored{row.request_id, row.iteration, row.id,
                              stored->replaced ? stored->replaced_id : 0});
      } else {
        ++counters_.maps_failed;
        spdlog::error("req={} iteration {}: map not stored: {}", row.request_id, row.iteration,
                      stored.status().message());
      }
      insert_us_.Add(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - started)
              .count());
    }
  }
  const MatcherCounters& after = matcher.counters();
  counters_.contexts_invalid += after.invalid - before.invalid;
  counters_.contexts_refused += after.refused - before.refused;
  counters_.maps_incomplete += after.incomplete - before.incomplete;
  if (!directives_.empty()) {
    SendDirectives(rank->group, directives_);
    match_us_.Add(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - started)
            .count());
  }
}

void MapService::SendDirectives(const std::string& group,
                                const std::vector<PrefetchDirective>& directives) {
  for (const auto& [id, entry] : ranks_.peers()) {
    if (entry.info.group != group || !ranks_.IsAlive(id)) continue;
    for (const PrefetchDirective& d : directives) {
      if (socket_->Send(d, id).ok()) {
        ++counters_.directives_sent;
      } else {
        ++counters_.directives_failed;
      }
    }
  }
}

Result<MapService::ModelMaps*> MapService::ModelFor(uint64_t fingerprint) {
  if (fingerprint == 0) {
    if (stores_.size() == 1) return stores_.begin()->second.get();
    if (stores_.empty()) return NotFound("no model is stored");
    return InvalidArgument(std::to_string(stores_.size()) +
                           " models are stored; name one by its fingerprint");
  }
  auto it = stores_.find(fingerprint);
  if (it == stores_.end())
    return NotFound("model " + FingerprintHex(fingerprint) + " is not stored");
  return it->second.get();
}

Result<InsertResult> MapService::StoreMap(ModelMaps& model, MapRow* row) {
  FMOE_ASSIGN_OR_RETURN(InsertResult plan, model.store->PlanInsert(row->sem, row->map));
  row->id = model.next_id;
  row->row = plan.index;
  row->stored_unix_ms = UnixMs();
  // Durable first: a failed write leaves the in-memory store as it was.
  FMOE_RETURN_IF_ERROR(
      db_->PutMap(model.shape.fingerprint, *row, plan.replaced ? plan.replaced_id : 0));
  ++model.next_id;
  FMOE_RETURN_IF_ERROR(model.store->Put(plan.index, row->id, row->sem, row->map));
  ++model.inserted;
  ++counters_.maps_stored;
  if (plan.replaced) {
    ++model.replaced;
    ++counters_.maps_replaced;
  }
  return plan;
}

Result<std::string> MapService::Export(const AdminRequest& request) {
  if (request.path.empty() || request.path[0] != '/') {
    return InvalidArgument("export path \"" + request.path +
                           "\" must be absolute (it is written by the map service)");
  }
  FMOE_ASSIGN_OR_RETURN(ModelMaps * model, ModelFor(request.model_fingerprint));
  const ModelRow& shape = model->shape;
  FMOE_ASSIGN_OR_RETURN(StoreDb::MapContents contents,
                        db_->LoadMaps(shape.fingerprint, shape.hidden_size,
                                      static_cast<size_t>(shape.num_layers) * shape.num_experts));
  FMOE_ASSIGN_OR_RETURN(uint64_t bytes, WriteMapExport(request.path, shape, contents.maps));
  spdlog::info("exported {} maps of model {} to {} ({} bytes)", contents.maps.size(),
               FingerprintHex(shape.fingerprint), request.path, bytes);
  nlohmann::json body = {{"model", FingerprintHex(shape.fingerprint)},
                         {"maps", contents.maps.size()},
                         {"corrupt_skipped", contents.corrupt.size()},
                         {"path", request.path},
                         {"bytes", bytes}};
  return body.dump();
}

Result<std::string> MapService::Import(const AdminRequest& request) {
  if (request.path.empty() || request.path[0] != '/') {
    return InvalidArgument("import path \"" + request.path +
                           "\" must be absolute (it is read by the map service)");
  }
  FMOE_ASSIGN_OR_RETURN(
      MapExportContents file,
      ReadMapExport(request.path, options_.max_import_bytes, request.model_fingerprint));
  ModelRow shape = file.shape;
  shape.first_seen_unix_ms = UnixMs();
  auto known = models_.find(shape.fingerprint);
  if (known != models_.end()) {
    const ModelRow& k = known->second;
    if (k.num_layers != shape.num_layers || k.num_experts != shape.num_experts ||
        k.top_k != shape.top_k || k.hidden_size != shape.hidden_size) {
      return FailedPrecondition(request.path + " holds model " + FingerprintHex(shape.fingerprint) +
                                " with a different shape than the one stored");
    }
  } else {
    FMOE_ASSIGN_OR_RETURN(ModelMaps * created, OpenModel(shape));
    (void)created;
    if (Status s = db_->RecordModel(shape); !s.ok()) {
      stores_.erase(shape.fingerprint);
      return s;
    }
    models_[shape.fingerprint] = shape;
  }
  FMOE_ASSIGN_OR_RETURN(ModelMaps * model, ModelFor(shape.fingerprint));
  uint64_t imported = 0, replaced = 0, skipped = file.skipped;
  for (MapRow& row : file.maps) {
    auto stored = StoreMap(*model, &row);
    if (!stored.ok()) {
      if (stored.status().code() == ErrorCode::kInvalidArgument) {
        ++skipped;
        continue;
      }
      return Status(stored.status().code(), "import stopped after " + std::to_string(imported) +
                                                " maps: " + stored.status().message());
    }
    ++imported;
    if (stored->replaced) ++replaced;
  }
  spdlog::info("imported {} maps of model {} from {} ({} replaced by deduplication, {} skipped)",
               imported, FingerprintHex(shape.fingerprint), request.path, replaced, skipped);
  nlohmann::json body = {{"model", FingerprintHex(shape.fingerprint)},
                         {"imported", imported},
                         {"replaced", replaced},
                         {"skipped", skipped},
                         {"maps", model->store->size()}};
  return body.dump();
}

std::string MapService::StatsJson() const {
  using Json = nlohmann::json;
  Json ranks = Json::array();
  for (const auto& [id, entry] : ranks_.peers()) {
    ranks.push_back({{"group", entry.info.group},
                     {"rank", entry.info.rank},
                     {"world_size", entry.info.world_size},
                     {"model", FingerprintHex(entry.info.model_fingerprint)},
                     {"alive", ranks_.IsAlive(id)},
                     {"silence_ms", clock_.NowMs() - entry.last_seen_ms}});
  }
  Json models = Json::array();
  for (const auto& [fp, m] : models_) {
    auto st = stores_.find(fp);
    const ModelMaps* mm = st == stores_.end() ? nullptr : st->second.get();
    models.push_back({{"fingerprint", FingerprintHex(fp)},
                      {"num_layers", m.num_layers},
                      {"num_experts", m.num_experts},
                      {"top_k", m.top_k},
                      {"hidden_size", m.hidden_size},
                      {"maps", mm ? mm->store->size() : 0},
                      {"capacity", options_.store_capacity},
                      {"inserted", mm ? mm->inserted : 0},
                      {"replaced", mm ? mm->replaced : 0}});
  }
  size_t in_flight = 0;
  for (const auto& [peer, matcher] : matchers_) in_flight += matcher->in_flight();
  auto histogram = [](const Histogram& h) {
    Json buckets = Json::array();
    for (size_t b = 0; b < h.counts().size(); ++b) {
      buckets.push_back({{"le", b < h.bounds().size() ? Json(h.bounds()[b]) : Json("+Inf")},
                         {"count", h.counts()[b]}});
    }
    return Json{{"count", h.count()},      {"sum", h.sum()}, {"p50", h.Quantile(0.50)},
                {"p99", h.Quantile(0.99)}, {"max", h.max()}, {"buckets", buckets}};
  };
  const wire::Stats& ws = socket_->stats();
  Json dropped = Json::object();
  for (size_t i = 0; i < ws.dropped.size(); ++i) {
    dropped[std::string(wire::DropReasonName(static_cast<wire::DropReason>(i)))] = ws.dropped[i];
  }
  Json body = {{"uptime_s", (clock_.NowMs() - started_ms_) / 1000.0},
               {"endpoint", options_.endpoint},
               {"data_dir", options_.data_dir},
               {"store_capacity", options_.store_capacity},
               {"prefetch_distance", options_.prefetch_distance},
               {"models", models},
               {"ranks", ranks},
               {"counters",
                {{"registrations", counters_.registrations},
                 {"registrations_refused", counters_.registrations_refused},
                 {"ranks_expired", counters_.ranks_expired},
                 {"iteration_starts", counters_.iteration_starts},
                 {"layers_observed", counters_.layers_observed},
                 {"iteration_ends", counters_.iteration_ends},
                 {"from_unregistered", counters_.from_unregistered},
                 {"contexts_invalid", counters_.contexts_invalid},
                 {"contexts_refused", counters_.contexts_refused},
                 {"directives_sent", counters_.directives_sent},
                 {"directives_failed", counters_.directives_failed},
                 {"maps_stored", counters_.maps_stored},
                 {"maps_replaced", counters_.maps_replaced},
                 {"maps_incomplete", counters_.maps_incomplete},
                 {"maps_failed", counters_.maps_failed},
                 {"admin_requests", counters_.admin_requests}}},
               {"contexts", contexts_},
               {"ingest_per_s", ingest_rate_},
               {"requests_in_flight", in_flight},
               {"match_latency_us", histogram(match_us_)},
               {"insert_latency_us", histogram(insert_us_)},
               {"wire",
                {{"received", ws.received},
                 {"sent", ws.sent},
                 {"send_failed", ws.send_failed},
                 {"dropped", dropped}}}};
  return body.dump();
}

}  // namespace fmoe
