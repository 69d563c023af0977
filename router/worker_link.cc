#include "router/worker_link.h"

#include <algorithm>
#include <cstdio>

#include <spdlog/spdlog.h>

namespace fmoe {

int ClusterView::alive_groups() const {
  return static_cast<int>(
      std::count_if(groups.begin(), groups.end(), [](const GroupView& g) { return g.alive; }));
}

std::string ClusterView::UnavailableReason() const {
  std::string out;
  for (const auto& g : groups) {
    if (g.alive) continue;
    if (!out.empty()) out += "; ";
    if (!g.ever_connected) {
      out += g.name + ": never connected";
    } else if (g.silence_ms >= 0) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), ": no heartbeat for %.1f s", g.silence_ms / 1000.0);
      out += g.name + buf;
    } else {
      out += g.name + ": disconnected";
    }
  }
  return out.empty() ? "no worker group is configured" : "no worker group is alive: " + out;
}

WorkerLink::WorkerLink(WorkerLinkOptions options, const Clock& clock)
    : options_(std::move(options)), clock_(clock), leaders_(clock, options_.heartbeat_timeout_ms) {
  Publish();
}

WorkerLink::~WorkerLink() = default;

Status WorkerLink::Start() {
  FMOE_ASSIGN_OR_RETURN(
      workers_, wire::WorkerSocket::Bind(context_, wire::Role::kRouter, options_.worker_endpoint));
  wire::SocketOptions admin;
  admin.send_hwm = 4;  // Pings are periodic: never queue many for a map service that is down.
  FMOE_ASSIGN_OR_RETURN(map_service_,
                        wire::MapSocket::Connect(context_, wire::Role::kDealer,
                                                 options_.map_service_endpoint, admin));
  return Status::Ok();
}

std::shared_ptr<const ClusterView> WorkerLink::View() const {
  std::lock_guard<std::mutex> lock(view_mu_);
  return view_;
}

void WorkerLink::Run(const std::atomic<bool>& stop) {
  std::vector<wire::SocketBase*> sockets = {workers_.get(), map_service_.get()};
  std::vector<bool> readable;
  while (!stop) {
    auto polled = wire::Poll(sockets, 50, &readable);
    if (polled.ok() && *polled > 0) {
      if (readable[0]) {
        while (auto in = workers_->Receive(0)) HandleWorker(in->peer, in->message);
      }
      if (readable[1]) {
        while (auto in = map_service_->Receive(0)) {
          if (std::holds_alternative<AdminReply>(in->message)) {
            last_map_reply_ms_ = clock_.NowMs();
          }
        }
      }
    }
    for (const auto& [id, entry] : leaders_.Expire()) {
      last_seen_by_group_[entry.info.group] = entry.last_seen_ms;
      spdlog::warn("group={} lost: no heartbeat for {} ms (instance={:016x})", entry.info.group,
                   clock_.NowMs() - entry.last_seen_ms, entry.info.instance_id);
    }
    if (clock_.NowMs() - last_ping_ms_ >= options_.heartbeat_interval_ms) PingMapService();
    Publish();
  }
}

void WorkerLink::HandleWorker(const std::string& peer, const WorkerMessage& message) {
  if (const auto* hello = std::get_if<WorkerHello>(&message)) {
    OnHello(peer, *hello);
  } else if (const auto* hb = std::get_if<WorkerHeartbeat>(&message)) {
    auto* entry = leaders_.Find(peer);
    bool known = entry != nullptr && entry->info.group == hb->group &&
                 entry->info.instance_id == hb->instance_id;
    if (known) {
      leaders_.Touch(peer);
      entry->info.free_slots = hb->free_slots;
      entry->info.active_requests = hb->active_requests;
    }
    Status s = workers_->Send(WorkerHeartbeatAck{hb->seq, known}, peer);
    if (!s.ok()) spdlog::debug("heartbeat ack to {} failed: {}", peer, s.ToString());
  } else {
    spdlog::debug("peer={} sent {}, unexpected from a worker; ignored", peer,
                  wire::MessageName(message));
  }
}

void WorkerLink::OnHello(const std::string& peer, const WorkerHello& hello) {
  WorkerHelloAck ack;
  bool in_manifest = std::find(options_.group_names.begin(), options_.group_names.end(),
                               hello.group) != options_.group_names.end();
  if (!in_manifest) {
    ack.reason = "group \"" + hello.group + "\" is not in the manifest";
  } else if (hello.model_name != options_.model_name) {
    ack.reason = "model \"" + hello.model_name + "\" is not the served model \"" +
                 options_.model_name + "\"";
  } else {
    ack.accepted = true;
  }
  if (ack.accepted) {
    // One leader per group: a new instance (a restarted leader) replaces the old one.
    for (const auto& [id, entry] : leaders_.peers()) {
      if (id != peer && entry.info.group == hello.group) {
        spdlog::info("group={} leader replaced (instance {:016x} -> {:016x})", hello.group,
                     entry.info.instance_id, hello.instance_id);
        leaders_.Erase(id);
        break;
      }
    }
    leaders_.Upsert(peer, Leader{hello.group, hello.instance_id, hello.model_fingerprint,
                                 hello.world_size, hello.max_batch, hello.free_slots, 0});
    last_seen_by_group_[hello.group] = clock_.NowMs();
    spdlog::info("group={} joined: world_size={} max_batch={} instance={:016x} peer={}",
                 hello.group, hello.world_size, hello.max_batch, hello.instance_id, peer);
  } else {
    spdlog::warn("refused worker peer={}: {}", peer, ack.reason);
  }
  Status s = workers_->Send(ack, peer);
  if (!s.ok()) spdlog::warn("hello ack to {} failed: {}", peer, s.ToString());
}

void WorkerLink::PingMapService() {
  last_ping_ms_ = clock_.NowMs();
  AdminRequest ping;
  ping.id = ++ping_seq_;
  ping.op = AdminOp::kPing;
  Status s = map_service_->Send(ping);
  if (!s.ok()) spdlog::debug("map service ping not sent: {}", s.ToString());
}

void WorkerLink::Publish() {
  auto view = std::make_shared<ClusterView>();
  view->map_service_endpoint = options_.map_service_endpoint;
  int64_t now = clock_.NowMs();
  if (last_map_reply_ms_ >= 0) {
    view->map_service_silence_ms = now - last_map_reply_ms_;
    view->map_service_alive = view->map_service_silence_ms <= options_.heartbeat_timeout_ms;
  }
  for (const auto& name : options_.group_names) {
    GroupView g;
    g.name = name;
    auto seen = last_seen_by_group_.find(name);
    g.ever_connected = seen != last_seen_by_group_.end();
    if (g.ever_connected) g.silence_ms = now - seen->second;
    for (const auto& [id, entry] : leaders_.peers()) {
      if (entry.info.group != name) continue;
      g.alive = leaders_.IsAlive(id);
      g.silence_ms = now - entry.last_seen_ms;
      g.world_size = entry.info.world_size;
      g.max_batch = entry.info.max_batch;
      g.free_slots = entry.info.free_slots;
      g.active_requests = entry.info.active_requests;
      g.instance_id = entry.info.instance_id;
      g.model_fingerprint = entry.info.model_fingerprint;
    }
    view->groups.push_back(std::move(g));
  }
  std::lock_guard<std::mutex> lock(view_mu_);
  view_ = std::move(view);
}

}  // namespace fmoe
