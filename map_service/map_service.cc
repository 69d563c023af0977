#include "map_service/map_service.h"

#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/model_config.h"

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
  for (const auto& m : contents.models) models_[m.fingerprint] = m;
  spdlog::info("store: opened {}: {} models, {} past rank registrations, {} corrupt records",
               options_.data_dir, contents.models.size(), contents.ranks.size(),
               contents.corrupt.size());
  FMOE_ASSIGN_OR_RETURN(socket_,
                        wire::MapSocket::Bind(context_, wire::Role::kRouter, options_.endpoint));
  spdlog::info("listening on {}", options_.endpoint);
  return Status::Ok();
}

void MapService::Run(const std::function<bool()>& stop) {
  int64_t last_expiry = clock_.NowMs();
  while (!stop()) {
    auto incoming = socket_->Receive(100);
    if (incoming) Handle(incoming->peer, incoming->message);
    if (clock_.NowMs() - last_expiry >= 100) {
      ExpireRanks();
      last_expiry = clock_.NowMs();
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
        } else if constexpr (std::is_same_v<T, IterationStart>) {
          if (FromRegistered(peer)) ++counters_.iteration_starts;
        } else if constexpr (std::is_same_v<T, LayerObserved>) {
          if (FromRegistered(peer)) ++counters_.layers_observed;
        } else if constexpr (std::is_same_v<T, IterationEnd>) {
          if (FromRegistered(peer)) ++counters_.iteration_ends;
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
  // Durable before acknowledged.
  Status s = db_->RecordRegistration(new_model, row);
  if (!s.ok()) return refuse("store write failed: " + s.message());
  if (new_model != nullptr) models_[shape.fingerprint] = shape;

  // A restarted rank reconnects with a new routing id: drop its stale entry.
  for (const auto& [id, entry] : ranks_.peers()) {
    if (id != peer && entry.info.group == reg.group && entry.info.rank == reg.rank) {
      ranks_.Erase(id);
      break;
    }
  }
  ranks_.Upsert(
      peer, RankState{reg.group, reg.rank, reg.world_size, reg.instance_id, reg.model_fingerprint});
  ++counters_.registrations;
  ack.accepted = true;
  ack.stored_maps = db_->CountMaps(reg.model_fingerprint);
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
    case AdminOp::kImport:
      reply.ok = false;
      reply.error = "export and import need the expert map store, which this build lacks";
      break;
  }
  Reply(peer, reply);
}

void MapService::ExpireRanks() {
  for (const auto& [id, entry] : ranks_.Expire()) {
    ++counters_.ranks_expired;
    spdlog::warn("rank group={} rank={} lost: no heartbeat for {} ms (peer={})", entry.info.group,
                 entry.info.rank, clock_.NowMs() - entry.last_seen_ms, id);
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
  for (const auto& [fp, m] : models_) {
    models.push_back({{"fingerprint", FingerprintHex(fp)},
                      {"num_layers", m.num_layers},
                      {"num_experts", m.num_experts},
                      {"top_k", m.top_k},
                      {"hidden_size", m.hidden_size}});
  }
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
                 {"admin_requests", counters_.admin_requests}}},
               {"wire",
                {{"received", ws.received},
                 {"sent", ws.sent},
                 {"send_failed", ws.send_failed},
                 {"dropped", dropped}}}};
  return body.dump();
}

}  // namespace fmoe
