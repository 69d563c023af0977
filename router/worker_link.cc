#include "router/worker_link.h"

#include <algorithm>
#include <cstdio>

#include <spdlog/spdlog.h>

#include "common/json.h"
#include "common/model/model_config.h"
#include "common/process_util.h"

namespace fmoe {

int ClusterView::alive_groups() const {
  return static_cast<int>(
      std::count_if(groups.begin(), groups.end(), [](const GroupView& g) { return g.alive; }));
}

int ClusterView::loading_groups() const {
  return static_cast<int>(std::count_if(groups.begin(), groups.end(),
                                        [](const GroupView& g) { return !g.alive && g.loading; }));
}

std::string ClusterView::UnavailableReason() const {
  std::string out;
  for (const auto& g : groups) {
    if (g.alive) continue;
    if (!out.empty()) out += "; ";
    if (g.loading) {
      char buf[96];
      if (g.total_bytes > 0) {
        std::snprintf(buf, sizeof(buf), ": loading the model (%.0f%% of %.1f MB)",
                      100.0 * static_cast<double>(g.loaded_bytes) / g.total_bytes,
                      g.total_bytes / 1e6);
      } else {
        std::snprintf(buf, sizeof(buf), ": loading the model");
      }
      out += g.name + buf;
    } else if (!g.ever_connected) {
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
  options_.queue_limits.resize(options_.group_names.size(), 64);
  // Ids start at a random point: a restarted router never reuses an id a leader still runs.
  next_id_ = (RandomId() & 0xffffffffull) << 31 | 1;
  started_ms_ = clock_.NowMs();
  Publish();
}

WorkerLink::~WorkerLink() = default;

Status WorkerLink::Start() {
  auto workers = wire::WorkerSocket::Bind(context_, wire::Role::kRouter, options_.worker_endpoint);
  if (!workers.ok()) return workers.status().WithContext("router.worker_endpoint");
  workers_ = std::move(*workers);
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
  bool notified = false;
  while (!stop) {
    auto polled = wire::Poll(sockets, 50, &readable, &notifier_, &notified);
    if (polled.ok() && notified) notifier_.Drain();
    if (polled.ok() && *polled > 0) {
      if (readable[0]) {
        while (auto in = workers_->Receive(0)) {
          // One message's handling failing (a bug) must not end the link thread.
          try {
            HandleWorker(in->peer, in->message);
          } catch (const std::exception& e) {
            spdlog::error("peer={}: handling {} failed: {}", in->peer,
                          wire::MessageName(in->message), e.what());
          }
        }
      }
      if (readable[1]) {
        while (auto in = map_service_->Receive(0)) {
          if (const auto* reply = std::get_if<AdminReply>(&in->message)) {
            last_map_reply_ms_ = clock_.NowMs();
            // Ping answers carry the service's Stats: keep its match latency for /metrics.
            auto j = nlohmann::json::parse(reply->json, nullptr, false);
            if (j.is_object() && j.contains("match_latency_us") &&
                j["match_latency_us"].is_object()) {
              // Read by type: a reply of another shape is ignored, never thrown on.
              const auto& m = j["match_latency_us"];
              auto number = [&m](const char* key, double fallback) {
                auto it = m.find(key);
                return it != m.end() && it->is_number() ? it->get<double>() : fallback;
              };
              map_p50_us_ = number("p50", map_p50_us_);
              map_p99_us_ = number("p99", map_p99_us_);
              if (auto c = m.find("count"); c != m.end() && c->is_number_unsigned()) {
                map_count_ = c->get<uint64_t>();
              }
            }
          }
        }
      }
    }
    for (const auto& [id, entry] : leaders_.Expire()) {
      last_seen_by_group_[entry.info.group] = entry.last_seen_ms;
      spdlog::warn("group={} lost: no heartbeat for {} ms (instance={:016x})", entry.info.group,
                   clock_.NowMs() - entry.last_seen_ms, entry.info.instance_id);
      GroupLost(entry.info.group);
    }
    if (clock_.NowMs() - last_ping_ms_ >= options_.heartbeat_interval_ms) PingMapService();
    bool stopping = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping = stopping_;
    }
    if (stopping && !stop_ended_) {
      stop_ended_ = true;
      EndOpenRequests();
    }
    // Dispatch before publishing, so the view a client reads after its first token already
    // counts its request as running.
    Dispatch();
    Publish();
  }
  // Requests still open end now: the router is stopping.
  EndOpenRequests();
}

void WorkerLink::StopRequests() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  notifier_.Notify();
}

void WorkerLink::EndOpenRequests() {
  std::vector<std::pair<uint64_t, std::string>> open;  // (id, peer)
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, r] : requests_) open.emplace_back(id, r.peer);
  }
  if (!open.empty()) spdlog::info("ending {} open request(s): {}", open.size(), kStoppingError);
  for (const auto& [id, peer] : open) {
    if (!peer.empty()) {
      Status s = workers_->Send(fmoe::Cancel{id}, peer);
      if (!s.ok()) spdlog::debug("req={} cancel not sent: {}", id, s.ToString());
    }
    Finish(id, FinishReason::kError, kStoppingError);
  }
}

Result<uint64_t> WorkerLink::Submit(Generate request, RequestSink sink, int64_t timeout_ms) {
  std::vector<Submission> one;
  one.push_back({std::move(request), std::move(sink)});
  FMOE_ASSIGN_OR_RETURN(std::vector<uint64_t> ids, SubmitAll(std::move(one), timeout_ms));
  return ids.front();
}

Result<std::vector<uint64_t>> WorkerLink::SubmitAll(std::vector<Submission> requests,
                                                    int64_t timeout_ms) {
  std::vector<uint64_t> ids;
  if (requests.empty()) return ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return Unavailable(kStoppingError);
    const int64_t deadline_ms = timeout_ms > 0 ? clock_.NowMs() + timeout_ms : 0;
    for (Submission& r : requests) {
      const std::string group = PickGroup();
      if (group.empty()) return Unavailable(kNoGroupError);
      auto& queue = queues_[group];
      if (ids.empty()) {
        // Admission, once per client request.
        size_t limit = 64;
        for (size_t i = 0; i < options_.group_names.size(); ++i) {
          if (options_.group_names[i] == group) {
            limit = static_cast<size_t>(options_.queue_limits[i]);
          }
        }
        if (queue.size() >= limit) {
          return ResourceExhausted("the queue of worker group " + group + " is full (" +
                                   std::to_string(limit) + " requests)");
        }
      }
      const uint64_t id = next_id_++;
      r.request.request_id = id;
      Pending p;
      p.request = std::move(r.request);
      p.sink = std::move(r.sink);
      p.deadline_ms = deadline_ms;
      p.group = group;
      requests_.emplace(id, std::move(p));
      queue.push_back(id);
      ids.push_back(id);
    }
  }
  notifier_.Notify();
  return ids;
}

void WorkerLink::Cancel(uint64_t request_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancels_.push_back(request_id);
  }
  notifier_.Notify();
}

std::string WorkerLink::PickGroup() const {
  std::string best;
  size_t best_load = 0;
  for (const auto& [group, leader] : live_) {
    auto q = queues_.find(group);
    auto r = running_.find(group);
    const size_t load =
        (q == queues_.end() ? 0 : q->second.size()) + (r == running_.end() ? 0 : r->second);
    if (best.empty() || load < best_load) {
      best = group;
      best_load = load;
    }
  }
  return best;
}

void WorkerLink::Dispatch() {
  const int64_t now = clock_.NowMs();
  std::vector<std::pair<uint64_t, std::string>> cancel_running;  // (id, peer)
  std::vector<uint64_t> finish_cancelled, finish_timeout;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint64_t id : cancels_) {
      auto it = requests_.find(id);
      if (it == requests_.end()) continue;
      if (it->second.peer.empty()) {
        finish_cancelled.push_back(id);
      } else {
        cancel_running.emplace_back(id, it->second.peer);
      }
    }
    cancels_.clear();
    for (auto& [id, r] : requests_) {
      if (r.deadline_ms == 0 || now < r.deadline_ms) continue;
      r.deadline_ms = 0;
      finish_timeout.push_back(id);
      if (!r.peer.empty()) cancel_running.emplace_back(id, r.peer);
    }
  }
  for (const auto& [id, peer] : cancel_running) {
    Status s = workers_->Send(fmoe::Cancel{id}, peer);
    if (!s.ok()) spdlog::debug("req={} cancel not sent: {}", id, s.ToString());
  }
  for (uint64_t id : finish_cancelled) Finish(id, FinishReason::kCancelled, "");
  for (uint64_t id : finish_timeout) Finish(id, FinishReason::kError, kTimeoutError);

  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [group, leader] : live_) {
    auto& queue = queues_[group];
    uint32_t& running = running_[group];
    while (!queue.empty() && running < leader.second) {
      const uint64_t id = queue.front();
      auto it = requests_.find(id);
      if (it == requests_.end()) {
        queue.pop_front();
        continue;
      }
      Status s = workers_->Send(it->second.request, leader.first);
      if (!s.ok()) {
        spdlog::warn("req={} not sent to group {}: {}", id, group, s.ToString());
        break;
      }
      queue.pop_front();
      it->second.peer = leader.first;
      it->second.group = group;
      ++running;
    }
  }
}

void WorkerLink::Deliver(const RequestSink& sink, const TokenEvent& event) {
  // A sink is one request's code: what it throws ends that request, never the link thread.
  try {
    sink(event);
    return;
  } catch (const std::exception& e) {
    spdlog::error("req={}: its event handler failed: {}", event.request_id, e.what());
  } catch (...) {
    spdlog::error("req={}: its event handler failed", event.request_id);
  }
  if (event.finish == FinishReason::kNone) Cancel(event.request_id);
}

void WorkerLink::Finish(uint64_t id, FinishReason reason, const std::string& error) {
  RequestSink sink;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = requests_.find(id);
    if (it == requests_.end()) return;
    Pending& r = it->second;
    sink = std::move(r.sink);
    r.sink = nullptr;
    if (r.peer.empty()) {
      auto& q = queues_[r.group];
      q.erase(std::remove(q.begin(), q.end(), id), q.end());
      requests_.erase(it);
    } else if (reason != FinishReason::kError || error != kTimeoutError) {
      // Ended for good (its leader is gone, or the router stops): free its slot.
      --running_[r.group];
      requests_.erase(it);
    }
    // A timed-out running request stays until its leader confirms the cancel (its slot).
  }
  if (sink) {
    TokenEvent ev;
    ev.request_id = id;
    ev.finish = reason;
    ev.error = error;
    Deliver(sink, ev);
  }
}

void WorkerLink::OnTokenEvent(const std::string& peer, const TokenEvent& event) {
  RequestSink sink;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = requests_.find(event.request_id);
    if (it == requests_.end() || it->second.peer != peer) return;  // Ended here already.
    Pending& r = it->second;
    if (event.token_id >= 0) r.started = true;
    sink = r.sink;
    if (event.finish != FinishReason::kNone) {
      --running_[r.group];
      requests_.erase(it);
    }
  }
  if (sink) Deliver(sink, event);
  if (event.finish != FinishReason::kNone) notifier_.Notify();  // A slot is free.
}

void WorkerLink::GroupLost(const std::string& group) {
  std::vector<uint64_t> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(group);
    const std::string other = PickGroup();
    for (auto& [id, r] : requests_) {
      if (r.group != group || r.peer.empty()) continue;
      if (r.started || !r.sink) {
        failed.push_back(id);
        continue;
      }
      // Not started: back to the front of a queue, another live group's when there is one.
      --running_[group];
      r.peer.clear();
      r.group = other.empty() ? group : other;
      queues_[r.group].push_front(id);
    }
    if (!other.empty()) {
      auto& from = queues_[group];
      auto& to = queues_[other];
      to.insert(to.end(), from.begin(), from.end());
      for (uint64_t id : from) requests_[id].group = other;
      from.clear();
    }
  }
  for (uint64_t id : failed) Finish(id, FinishReason::kError, kGroupLostError);
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
      entry->info.experts = hb->experts;
      entry->info.kv = hb->kv;
      if (!entry->info.kv.ranks.empty() && entry->info.kv.ranks.size() != entry->info.world_size) {
        spdlog::debug(
            "group={}: heartbeat carries {} ranks' device split for a group of {}; "
            "ignored",
            hb->group, entry->info.kv.ranks.size(), entry->info.world_size);
        entry->info.kv.ranks.clear();
      }
      entry->info.engine = hb->engine;
    }
    Status s = workers_->Send(WorkerHeartbeatAck{hb->seq, known}, peer);
    if (!s.ok()) spdlog::debug("heartbeat ack to {} failed: {}", peer, s.ToString());
  } else if (const auto* ev = std::get_if<TokenEvent>(&message)) {
    OnTokenEvent(peer, *ev);
  } else if (const auto* bye = std::get_if<WorkerGoodbye>(&message)) {
    OnGoodbye(peer, *bye);
  } else if (const auto* loading = std::get_if<WorkerLoading>(&message)) {
    OnLoading(*loading);
  } else {
    spdlog::debug("peer={} sent {}, unexpected from a worker; ignored", peer,
                  wire::MessageName(message));
  }
}

void WorkerLink::OnHello(const std::string& peer, const WorkerHello& hello) {
  WorkerHelloAck ack;
  // A leader is accepted only when it serves what the manifest says its group serves: the
  // group, the model by name and by fingerprint, the group's world size. A refused Hello
  // changes nothing: the group's current leader stays.
  const auto group =
      std::find(options_.group_names.begin(), options_.group_names.end(), hello.group);
  const size_t index = static_cast<size_t>(group - options_.group_names.begin());
  const uint32_t world_size = index < options_.world_sizes.size() ? options_.world_sizes[index] : 0;
  std::string refused;  // The reason's label.
  if (group == options_.group_names.end()) {
    refused = "group";
    ack.reason = "group \"" + hello.group + "\" is not in the manifest";
  } else if (hello.model_name != options_.model_name) {
    refused = "model";
    ack.reason = "model \"" + hello.model_name + "\" is not the served model \"" +
                 options_.model_name + "\"";
  } else if (options_.model_fingerprint != 0 &&
             hello.model_fingerprint != options_.model_fingerprint) {
    refused = "fingerprint";
    ack.reason = "model fingerprint " + FingerprintHex(hello.model_fingerprint) +
                 " is not the served model's " + FingerprintHex(options_.model_fingerprint) +
                 " (another checkpoint or config.json)";
  } else if (world_size != 0 && hello.world_size != world_size) {
    refused = "world_size";
    ack.reason = "world size " + std::to_string(hello.world_size) + " is not group " + hello.group +
                 "'s " + std::to_string(world_size) + " ranks in the manifest";
  } else {
    ack.accepted = true;
  }
  if (!refused.empty()) ++hellos_refused_[refused];
  if (ack.accepted) {
    // One leader per group: a new instance (a restarted leader, under the same routing id or
    // another) replaces the old one.
    for (const auto& [id, entry] : leaders_.peers()) {
      if (entry.info.group == hello.group &&
          (id != peer || entry.info.instance_id != hello.instance_id)) {
        spdlog::info("group={} leader replaced (instance {:016x} -> {:016x})", hello.group,
                     entry.info.instance_id, hello.instance_id);
        leaders_.Erase(id);
        GroupLost(hello.group);  // The old leader's requests are gone with it.
        break;
      }
    }
    leaders_.Upsert(peer, Leader{hello.group,
                                 hello.instance_id,
                                 hello.model_fingerprint,
                                 hello.world_size,
                                 hello.max_batch,
                                 hello.free_slots,
                                 0,
                                 {},
                                 {},
                                 {}});
    last_seen_by_group_[hello.group] = clock_.NowMs();
    loading_.erase(hello.group);
    spdlog::info("group={} joined: world_size={} max_batch={} instance={:016x} peer={}",
                 hello.group, hello.world_size, hello.max_batch, hello.instance_id, peer);
  } else {
    spdlog::warn("refused worker peer={} group={} instance={:016x}: {}", peer, hello.group,
                 hello.instance_id, ack.reason);
  }
  Status s = workers_->Send(ack, peer);
  if (!s.ok()) spdlog::warn("hello ack to {} failed: {}", peer, s.ToString());
}

void WorkerLink::OnGoodbye(const std::string& peer, const WorkerGoodbye& goodbye) {
  const auto* entry = leaders_.Find(peer);
  if (entry == nullptr || entry->info.group != goodbye.group ||
      entry->info.instance_id != goodbye.instance_id) {
    // A leader already replaced or expired, or a peer that never joined: nothing to take down.
    spdlog::debug("peer={} goodbye for group={} instance={:016x} is not from its leader; ignored",
                  peer, goodbye.group, goodbye.instance_id);
    return;
  }
  spdlog::warn("group={} leader left: {}", goodbye.group, goodbye.reason);
  last_seen_by_group_[goodbye.group] = clock_.NowMs();
  leaders_.Erase(peer);  // Its restart says Hello again (same routing id, new instance id).
  GroupLost(goodbye.group);
}

void WorkerLink::OnLoading(const WorkerLoading& loading) {
  if (std::find(options_.group_names.begin(), options_.group_names.end(), loading.group) ==
      options_.group_names.end()) {
    spdlog::debug("loading report for group={}, not in the manifest; ignored", loading.group);
    return;
  }
  auto [it, fresh] = loading_.try_emplace(loading.group);
  if (fresh) spdlog::info("group={} is loading the model", loading.group);
  it->second = {loading.loaded_bytes, loading.total_bytes, clock_.NowMs()};
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
  view->map_match_p50_us = map_p50_us_;
  view->map_match_p99_us = map_p99_us_;
  view->map_match_count = map_count_;
  view->hellos_refused = hellos_refused_;
  int64_t now = clock_.NowMs();
  if (last_map_reply_ms_ >= 0) {
    view->map_service_silence_ms = now - last_map_reply_ms_;
    view->map_service_alive = view->map_service_silence_ms <= options_.heartbeat_timeout_ms;
  }
  view->map_service_state =
      view->map_service_alive                                                        ? "up"
      : last_map_reply_ms_ < 0 && now - started_ms_ <= options_.heartbeat_timeout_ms ? "connecting"
                                                                                     : "down";
  for (const auto& name : options_.group_names) {
    GroupView g;
    g.name = name;
    auto seen = last_seen_by_group_.find(name);
    g.ever_connected = seen != last_seen_by_group_.end();
    if (g.ever_connected) g.silence_ms = now - seen->second;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto q = queues_.find(name);
      g.queued = q == queues_.end() ? 0 : static_cast<uint32_t>(q->second.size());
      auto r = running_.find(name);
      g.running = r == running_.end() ? 0 : r->second;
    }
    if (auto l = loading_.find(name); l != loading_.end()) {
      if (now - l->second.last_ms <= options_.heartbeat_timeout_ms) {
        g.loading = true;
        g.loaded_bytes = l->second.loaded_bytes;
        g.total_bytes = l->second.total_bytes;
      } else {
        spdlog::warn("group={} stopped reporting its loading for {} ms", name,
                     now - l->second.last_ms);
        loading_.erase(l);
      }
    }
    for (const auto& [id, entry] : leaders_.peers()) {
      if (entry.info.group != name) continue;
      g.alive = leaders_.IsAlive(id);
      g.silence_ms = now - entry.last_seen_ms;
      g.world_size = entry.info.world_size;
      g.max_batch = entry.info.max_batch;
      g.free_slots = entry.info.free_slots;
      g.active_requests = entry.info.active_requests;
      g.experts = entry.info.experts;
      g.kv = entry.info.kv;
      g.engine = entry.info.engine;
      g.instance_id = entry.info.instance_id;
      g.model_fingerprint = entry.info.model_fingerprint;
    }
    view->groups.push_back(std::move(g));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_.clear();
    for (const auto& [id, entry] : leaders_.peers()) {
      if (leaders_.IsAlive(id)) live_[entry.info.group] = {id, std::max(1u, entry.info.max_batch)};
    }
  }
  std::lock_guard<std::mutex> lock(view_mu_);
  view_ = std::move(view);
}

}  // namespace fmoe
