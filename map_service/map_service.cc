#include "map_service/map_service.h"

#include <chrono>
#include <cmath>

#include "common/json.h"
#include "common/log.h"
#include "common/model/model_config.h"
#include "map_service/export_file.h"

namespace fmoe {

MapService::MapService(MapServiceOptions options, const Clock& clock)
    : options_(std::move(options)),
      clock_(clock),
      ranks_(clock, options_.heartbeat_timeout_ms),
      models_(options_),
      writes_(
          options_, clock, models_, counters_, insert_us_,
          MapWritesHost{
              [this](const std::string& peer, const MapMessage& m) { Reply(peer, m); },
              [this](const std::string& peer, uint64_t id, const char* op, const std::string& path,
                     const Result<std::string>& body) { ReplyAdmin(peer, id, op, path, body); },
              [this](uint64_t fingerprint) { return DropRanksOf(fingerprint); },
              [this](int timeout_ms) { Turn(timeout_ms, /*read_socket=*/false); }}) {}

MapService::~MapService() {
  // Run() stops the writer after its drain; without Run, whatever is pending is abandoned here,
  // while every member its completions touch is still alive.
  if (writes_.open()) writes_.Abandon();
}

size_t MapService::DropRanksOf(uint64_t fingerprint) {
  std::vector<std::string> peers;
  for (const auto& [id, entry] : ranks_.peers()) {
    if (entry.info.model_fingerprint == fingerprint) peers.push_back(id);
  }
  for (const std::string& id : peers) DropPeer(id);
  return peers.size();
}

Status MapService::Start() {
  started_ms_ = clock_.NowMs();
  if (options_.max_pending_writes == 0) {
    return InvalidArgument("map service: max_pending_writes is 0 (must be at least 1)");
  }
  if (options_.writer_nice < 0 || options_.writer_nice > 19) {
    return InvalidArgument("map service: writer_nice " + std::to_string(options_.writer_nice) +
                           " is not in 0..19");
  }
  // Loaded here, on the service thread; from then on the store writer owns the database.
  FMOE_ASSIGN_OR_RETURN(std::unique_ptr<StoreDb> db,
                        StoreDb::Open({options_.data_dir, options_.sync}, options_.store_faults));
  if (!db->read_only_reason().empty()) writes_.health().StartDegraded(db->read_only_reason());
  FMOE_ASSIGN_OR_RETURN(StoreDb::Contents contents, db->LoadAll());
  for (const auto& bad : contents.corrupt) {
    spdlog::error("store: skipped corrupt record {}", bad);
  }
  // A model the limit or its shape keeps out stays on disk until it is dropped.
  auto not_loaded = [this](const ModelRow& m, const std::string& reason) {
    spdlog::error(
        "store: model {} (L={} J={} K={} h={}) not loaded: {}; its records stay on disk (remove "
        "them with fmoe maps MANIFEST --drop {})",
        FingerprintHex(m.fingerprint), m.num_layers, m.num_experts, m.top_k, m.hidden_size, reason,
        FingerprintHex(m.fingerprint));
    models_.SetNotLoaded(m, reason);
  };
  // Smallest first, so that a model too large for memory_limit_mb cannot keep the others out.
  std::vector<std::pair<uint64_t, ModelRow>> models;
  for (const ModelRow& m : contents.models) {
    if (m.num_layers == 0 || m.num_experts == 0 || m.hidden_size == 0 || m.top_k == 0 ||
        m.top_k > m.num_experts) {
      not_loaded(m, "its shape is not valid");
      continue;
    }
    models.emplace_back(MapStore::BytesFor(models_.StoreOptions(m)), m);
  }
  std::stable_sort(models.begin(), models.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  size_t corrupt_maps = 0;
  for (const auto& [bytes, m] : models) {
    auto opened = models_.Open(m);
    if (!opened.ok()) {
      not_loaded(m, opened.status().message());
      continue;
    }
    ModelMaps* model = *opened;
    model->recorded = true;
    FMOE_ASSIGN_OR_RETURN(StoreDb::MapContents maps,
                          db->LoadMaps(m.fingerprint, m.hidden_size,
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
  spdlog::info(
      "store: opened {}{}: {} models ({} not loaded, {} MiB of memory_limit_mb {}), {} past rank "
      "registrations, {} corrupt records",
      options_.data_dir, writes_.health().healthy() ? "" : " read-only", models_.models().size(),
      models_.not_loaded().size(), models_.memory_used() >> 20, options_.memory_limit_mb,
      contents.ranks.size(), contents.corrupt.size() + corrupt_maps);
  // The manifest key in the message: an address of another host is the usual mistake.
  auto socket = wire::MapSocket::Bind(context_, wire::Role::kRouter, options_.endpoint);
  if (!socket.ok()) return socket.status().WithContext("map_service.endpoint");
  socket_ = std::move(*socket);
  writes_.Open(std::move(db));
  spdlog::info("listening on {}", options_.endpoint);
  return Status::Ok();
}

void MapService::Run(const std::function<bool()>& stop) {
  last_expiry_ms_ = clock_.NowMs();
  rate_window_start_ms_ = last_expiry_ms_;
  while (!stop()) Turn(100, /*read_socket=*/true);
  writes_.Drain();
  spdlog::info("stopping: {} registrations, {} dropped frames", counters_.registrations,
               socket_->stats().dropped_total());
}

void MapService::Turn(int timeout_ms, bool read_socket) {
  // The loop is a boundary: what one message or one completion throws is logged, and the
  // service serves on.
  try {
    wire::SocketBase* sockets[] = {socket_.get()};
    std::span<wire::SocketBase* const> polled_sockets(sockets, read_socket ? 1 : 0);
    bool notified = false;
    auto polled =
        wire::Poll(polled_sockets, timeout_ms, &readable_, &writes_.notifier(), &notified);
    if (polled.ok() && notified) writes_.notifier().Drain();
    writes_.RunCompletions();
    if (read_socket && polled.ok() && readable_[0]) {
      // A bounded batch, so finished writes are acknowledged promptly under a flood.
      for (int i = 0; i < 256; ++i) {
        auto incoming = socket_->Receive(0);
        if (!incoming) break;
        try {
          Handle(incoming->peer, incoming->message);
        } catch (...) {
          spdlog::error("peer={} {}: handling threw: {}; serving on", incoming->peer,
                        wire::MessageName(incoming->message), CurrentExceptionText());
        }
      }
    }
    writes_.MaybeRecover();
  } catch (...) {
    spdlog::error("the service loop threw: {}; serving on", CurrentExceptionText());
  }
  writes_.health().Tick();
  const int64_t now = clock_.NowMs();
  if (now - last_expiry_ms_ >= 100) {
    ExpireRanks();
    last_expiry_ms_ = now;
  }
  if (now - rate_window_start_ms_ >= 10000) {
    ingest_rate_ = static_cast<double>(contexts_ - rate_window_start_count_) * 1000.0 /
                   static_cast<double>(now - rate_window_start_ms_);
    rate_window_start_ms_ = now;
    rate_window_start_count_ = contexts_;
  }
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
  if (auto held = held_.find(peer); held != held_.end()) {
    // Its registration is being written: what it sends meanwhile waits, so that a peer's
    // messages are handled in the order it sent them (ReleaseHeld).
    if (held->second.size() < kMaxHeldPerPeer) {
      held->second.push_back(message);
    } else {
      ++counters_.held_dropped;
    }
    return;
  }
  std::visit(
      [&](const auto& m) {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, Register>) {
          OnRegister(peer, m);
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

void MapService::OnRegister(const std::string& peer, const Register& reg) {
  auto refuse = [&](std::string reason) {
    ++counters_.registrations_refused;
    spdlog::warn("refused registration of {}/{} (peer={}): {}", reg.group, reg.rank, peer, reason);
    RegisterAck ack;
    ack.accepted = false;
    ack.reason = std::move(reason);
    Reply(peer, ack);
  };
  if (reg.group.empty()) return refuse("group is empty");
  if (reg.world_size == 0 || reg.rank >= reg.world_size) {
    return refuse("rank " + std::to_string(reg.rank) + " is not below world size " +
                  std::to_string(reg.world_size));
  }
  const ModelRow shape{reg.model_fingerprint, reg.num_layers, reg.num_experts, reg.top_k,
                       reg.hidden_size,       UnixMs()};
  if (const NotLoaded* skipped = models_.FindNotLoaded(reg.model_fingerprint); skipped != nullptr) {
    return refuse("model " + FingerprintHex(reg.model_fingerprint) +
                  " is stored but was not loaded at start (" + skipped->reason +
                  "); remove it with fmoe maps MANIFEST --drop " +
                  FingerprintHex(reg.model_fingerprint) + ", or raise map_service.memory_limit_mb");
  }
  const ModelMaps* known = models_.Find(reg.model_fingerprint);
  if (known != nullptr) {
    const ModelRow& k = known->shape;
    if (k.num_layers != reg.num_layers || k.num_experts != reg.num_experts ||
        k.top_k != reg.top_k || k.hidden_size != reg.hidden_size) {
      return refuse("model " + FingerprintHex(reg.model_fingerprint) +
                    " is stored with a different shape (L=" + std::to_string(k.num_layers) +
                    " J=" + std::to_string(k.num_experts) + " K=" + std::to_string(k.top_k) +
                    " h=" + std::to_string(k.hidden_size) + ")");
    }
    if (known->dropping) {
      return refuse("model " + FingerprintHex(reg.model_fingerprint) +
                    " is being dropped; register again later");
    }
  }
  if (!writes_.health().healthy()) {
    // Degraded: a model already on disk is served without writing the rank's record (nothing
    // reads it back but the start-up log); a new model cannot be recorded.
    if (known != nullptr && known->recorded) {
      writes_.health().Refused();
      return OnRegistered(peer, reg, Status::Ok(), /*recording=*/false);
    }
    return refuse(writes_.health().Why() +
                  "; a new model cannot be recorded; register again later");
  }
  if (std::string why; writes_.Busy(&why)) return refuse(why + "; register again later");
  // The in-memory store first (it can refuse a shape), then the durable record (on the store
  // writer), then the ack (OnRegistered).
  auto model = models_.Open(shape);
  if (!model.ok()) return refuse(model.status().message());
  const bool record_model = !(*model)->recorded;
  const RankRow row{reg.group, reg.rank, reg.world_size, reg.instance_id, reg.model_fingerprint,
                    UnixMs()};
  auto written = std::make_shared<Status>();
  StoreJob job;
  job.run = [written, shape, row, record_model](StoreDb& db, std::stop_token) {
    *written = db.RecordRegistration(record_model ? &shape : nullptr, row);
  };
  job.done = [this, written, peer, reg](const Status& ran) {
    OnRegistered(peer, reg, ran.ok() ? *written : ran, /*recording=*/true);
  };
  ++(*model)->recording;
  if (!writes_.Submit(std::move(job))) {
    --(*model)->recording;
    models_.ForgetIfUnrecorded(shape.fingerprint);
    return refuse("the map service is stopping");
  }
  held_.try_emplace(peer);
}

void MapService::ReleaseHeld(const std::string& peer) {
  auto it = held_.find(peer);
  if (it == held_.end()) return;
  std::deque<MapMessage> held = std::move(it->second);
  held_.erase(it);
  while (!held.empty()) {
    const MapMessage message = std::move(held.front());
    held.pop_front();
    Handle(peer, message);
    if (auto again = held_.find(peer); again != held_.end()) {
      // Another registration of this peer is being written now: the rest waits for that one.
      again->second = std::move(held);
      return;
    }
  }
}

void MapService::OnRegistered(const std::string& peer, const Register& reg, const Status& written,
                              bool recording) {
  auto refuse = [&](const std::string& reason) {
    ++counters_.registrations_refused;
    spdlog::warn("refused registration of {}/{} (peer={}): {}", reg.group, reg.rank, peer, reason);
    Reply(peer, RegisterAck{false, reason, 0});
    ReleaseHeld(peer);
  };
  ModelMaps* model = models_.Find(reg.model_fingerprint);
  if (model == nullptr)
    return refuse("model " + FingerprintHex(reg.model_fingerprint) + " is not stored");
  if (recording) --model->recording;
  if (!written.ok()) {
    const bool degraded = writes_.Failed(written);
    if (!degraded || !model->recorded) {
      models_.ForgetIfUnrecorded(reg.model_fingerprint);
      return refuse("store write failed: " + written.message());
    }
    // Only the rank's record is missing: the model is on disk, so the rank is served.
  }
  if (model->dropping) {
    return refuse("model " + FingerprintHex(reg.model_fingerprint) +
                  " is being dropped; register again later");
  }
  model->recorded = true;

  // A (re-)registration starts the rank's matching afresh; built before anything is published.
  MatcherOptions mo;
  mo.prefetch_distance = static_cast<uint32_t>(options_.prefetch_distance);
  mo.semantic = options_.semantic && reg.semantic;
  mo.delta = options_.delta && reg.delta;
  mo.max_requests = options_.max_requests_per_rank;
  auto matcher = std::make_unique<MapMatcher>(*model->store, mo);
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
  matchers_[peer] = std::move(matcher);
  ++counters_.registrations;
  spdlog::info("registered group={} rank={}/{} model={} L={} J={} K={} h={} peer={}", reg.group,
               reg.rank, reg.world_size, FingerprintHex(reg.model_fingerprint), reg.num_layers,
               reg.num_experts, reg.top_k, reg.hidden_size, peer);
  Reply(peer, RegisterAck{true, "", model->store->size()});
  ReleaseHeld(peer);
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
      return writes_.StartExport(peer, request);
    case AdminOp::kImport:
      return writes_.StartImport(peer, request);
    case AdminOp::kDrop:
      return writes_.StartDrop(peer, request);
  }
  Reply(peer, reply);
}

void MapService::ReplyAdmin(const std::string& peer, uint64_t id, const char* op,
                            const std::string& path, const Result<std::string>& body) {
  AdminReply reply;
  reply.id = id;
  reply.ok = body.ok();
  if (body.ok()) {
    reply.json = *body;
  } else {
    reply.error = body.status().message();
    spdlog::warn("admin {} {} failed: {}", op, path, reply.error);
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
      PendingMap map;
      map.row.request_id = done->request_id;
      map.row.iteration = done->iteration;
      map.row.sem = std::move(done->sem);
      map.row.map = std::move(done->map);
      map.peer = peer;
      map.completed = started;
      auto model = models_.Recorded(rank->model_fingerprint);
      if (model.ok()) {
        writes_.QueueCompletedMap(**model, std::move(map));
      } else {
        ++counters_.maps_failed;
        spdlog::error("req={} iteration {}: map not stored: {}", map.row.request_id,
                      map.row.iteration, model.status().message());
      }
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
  for (const auto& [fp, mm] : models_.models()) {
    if (!mm->recorded) continue;  // Its first registration is still being written.
    const ModelRow& m = mm->shape;
    models.push_back({{"fingerprint", FingerprintHex(fp)},
                      {"num_layers", m.num_layers},
                      {"num_experts", m.num_experts},
                      {"top_k", m.top_k},
                      {"hidden_size", m.hidden_size},
                      {"maps", mm->store->size()},
                      {"capacity", options_.store_capacity},
                      {"inserted", mm->inserted},
                      {"replaced", mm->replaced},
                      {"bytes", mm->bytes}});
  }
  Json not_loaded = Json::array();
  for (const auto& [fp, n] : models_.not_loaded()) {
    not_loaded.push_back({{"fingerprint", FingerprintHex(fp)},
                          {"num_layers", n.shape.num_layers},
                          {"num_experts", n.shape.num_experts},
                          {"top_k", n.shape.top_k},
                          {"hidden_size", n.shape.hidden_size},
                          {"reason", n.reason}});
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
  const StoreHealth& health = writes_.health();
  Json dropped = Json::object();
  for (size_t i = 0; i < ws.dropped.size(); ++i) {
    dropped[std::string(wire::DropReasonName(static_cast<wire::DropReason>(i)))] = ws.dropped[i];
  }
  Json body = {
      {"uptime_s", (clock_.NowMs() - started_ms_) / 1000.0},
      {"endpoint", options_.endpoint},
      {"data_dir", options_.data_dir},
      {"store_capacity", options_.store_capacity},
      {"prefetch_distance", options_.prefetch_distance},
      {"models", models},
      {"models_not_loaded", not_loaded},
      {"memory", {{"used_bytes", models_.memory_used()}, {"limit_mb", options_.memory_limit_mb}}},
      {"store",
       {{"state", StoreHealth::StateName(health.state())},
        {"reason", health.reason()},
        {"degraded_s", health.degraded_ms() / 1000.0},
        {"next_retry_ms", health.next_retry_in_ms()},
        {"writes_failed", health.failed_total()},
        {"retries", health.retries()},
        {"recoveries", health.recoveries()}}},
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
        {"maps_dropped", counters_.maps_dropped},
        {"maps_abandoned", counters_.maps_abandoned},
        {"busy_refusals", counters_.busy_refusals},
        {"held_dropped", counters_.held_dropped},
        {"admin_requests", counters_.admin_requests},
        {"models_dropped", counters_.models_dropped}}},
      {"contexts", contexts_},
      {"ingest_per_s", ingest_rate_},
      {"requests_in_flight", in_flight},
      {"match_latency_us", histogram(match_us_)},
      {"insert_latency_us", histogram(insert_us_)},
      {"store_writes",
       {{"pending", writes_.pending()},
        {"limit", options_.max_pending_writes},
        {"maps_waiting", writes_.completed_waiting()}}},
      {"wire",
       {{"received", ws.received},
        {"sent", ws.sent},
        {"send_failed", ws.send_failed},
        {"dropped", dropped}}}};
  return body.dump();
}

}  // namespace fmoe
