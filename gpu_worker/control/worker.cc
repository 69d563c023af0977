#include "gpu_worker/control/worker.h"

#include <algorithm>
#include <vector>

#include "common/log.h"
#include "common/process_util.h"

namespace fmoe {
namespace {

// At most `limit` bytes of `s`, cut before a UTF-8 continuation byte.
std::string Truncated(const std::string& s, size_t limit) {
  if (s.size() <= limit) return s;
  size_t n = limit;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xc0) == 0x80) --n;
  return s.substr(0, n);
}

}  // namespace

Worker::Worker(WorkerOptions options, ModelInfo model, const Clock& clock,
               RequestExecutor* executor, Outbox* outbox)
    : options_(std::move(options)),
      model_(std::move(model)),
      clock_(clock),
      executor_(executor),
      own_outbox_(outbox == nullptr ? std::make_unique<Outbox>(options_.context_queue) : nullptr),
      outbox_(outbox == nullptr ? own_outbox_.get() : outbox) {
  instance_id_ = RandomId();
}

Worker::~Worker() = default;

Status Worker::Start() {
  started_ms_ = clock_.NowMs();
  wire::SocketOptions socket_options;
  socket_options.routing_id = "w/" + options_.group + "/" + std::to_string(options_.rank);
  // Contexts and heartbeats are worth nothing late: keep queues short, never block inference.
  socket_options.send_hwm = 1000;
  socket_options.immediate = true;
  FMOE_ASSIGN_OR_RETURN(map_socket_,
                        wire::MapSocket::Connect(context_, wire::Role::kDealer,
                                                 options_.map_service_endpoint, socket_options));
  if (leader()) {
    FMOE_ASSIGN_OR_RETURN(router_socket_,
                          wire::WorkerSocket::Connect(context_, wire::Role::kDealer,
                                                      options_.router_endpoint, socket_options));
  }
  return Status::Ok();
}

void Worker::Run(const std::function<bool()>& stop, const std::function<void()>& on_ready) {
  if (!map_socket_) return;  // Not started, or finished by SendGoodbye.
  bool ready = false;
  std::vector<wire::SocketBase*> sockets = {map_socket_.get()};
  if (router_socket_) sockets.push_back(router_socket_.get());
  std::vector<bool> readable;
  bool notified = false;
  while (!stop()) {
    // The loop is a boundary: what one message or one send throws is logged, and the rank
    // serves on. Each message has its own boundary in Dispatch*.
    try {
      auto polled = wire::Poll(sockets, 50, &readable, &outbox_->notifier(), &notified);
      if (polled.ok() && notified) {
        outbox_->notifier().Drain();
        SendEvents();
        SendContexts();
      }
      if (polled.ok() && *polled > 0) {
        if (readable[0]) {
          while (auto in = map_socket_->Receive(0)) DispatchMap(in->message);
        }
        if (router_socket_ && readable[1]) {
          while (auto in = router_socket_->Receive(0)) DispatchRouter(in->message);
        }
      }
      Tick();
    } catch (...) {
      spdlog::error("group={} rank={}: the worker loop threw: {}; serving on", options_.group,
                    options_.rank, CurrentExceptionText());
    }
    if (!ready && (map_registered() || clock_.NowMs() - started_ms_ >= options_.register_wait_ms)) {
      if (!map_registered()) {
        spdlog::warn(
            "map service {} has not answered in {} ms; serving without prefetch "
            "guidance until it does",
            options_.map_service_endpoint, options_.register_wait_ms);
      }
      ready = true;
      on_ready();
    }
  }
}

void Worker::DispatchMap(const MapMessage& message) {
  try {
    OnMapMessage(message);
  } catch (...) {
    spdlog::error("{} from the map service threw: {}; ignored", wire::MessageName(message),
                  CurrentExceptionText());
  }
}

void Worker::DispatchRouter(const WorkerMessage& message) {
  try {
    OnRouterMessage(message);
    return;
  } catch (...) {
    const std::string what = CurrentExceptionText();
    const auto* gen = std::get_if<Generate>(&message);
    spdlog::error("{} from the router threw{}: {}", wire::MessageName(message),
                  gen != nullptr ? " for req=" + std::to_string(gen->request_id) : "", what);
    if (gen == nullptr) return;
    // The request was not taken: the router hears so rather than waiting for it.
    TokenEvent ev;
    ev.request_id = gen->request_id;
    ev.finish = FinishReason::kError;
    ev.error = Truncated("req=" + std::to_string(gen->request_id) +
                             ": the worker could not take the request: " + what,
                         wire::DecodeLimits{}.max_string_bytes);
    PostEvent(std::move(ev));
  }
}

Status Worker::SendGoodbye(const std::string& reason) {
  if (!leader() || !router_socket_) return Status::Ok();
  WorkerGoodbye bye;
  bye.group = options_.group;
  bye.instance_id = instance_id_;
  bye.reason = Truncated(reason, wire::DecodeLimits{}.max_string_bytes);
  const Status sent = router_socket_->Send(bye).WithContext(
      "group=" + options_.group + " goodbye not sent, the router waits for its heartbeat timeout");
  if (sent.ok()) {
    spdlog::info("group={} told router {} it is leaving: {}", options_.group,
                 options_.router_endpoint, bye.reason);
  }
  // The sockets use LINGER 0, which would drop the goodbye still queued at close. The router
  // socket gets a short linger instead; terminating the context waits for it to be sent (or the
  // linger to pass) on libzmq's I/O thread, so the goodbye is out when this returns.
  if (Status s = router_socket_->SetLinger(kGoodbyeLingerMs); !s.ok()) {
    spdlog::debug("to router: {}", s.ToString());
  }
  router_socket_.reset();
  map_socket_.reset();
  context_.Close();
  return sent;
}

ContextStats Worker::context_stats() const {
  ContextStats stats;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats = context_stats_;
  }
  const Outbox::Counts counts = outbox_->counts();
  stats.published = counts.published;
  stats.dropped_full = counts.dropped_full;
  return stats;
}

void Worker::SendContexts() {
  const std::deque<MapMessage> batch = outbox_->TakeContexts();
  if (!map_registered()) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    context_stats_.dropped_offline += batch.size();
    return;
  }
  uint64_t sent = 0, failed = 0;
  for (const MapMessage& m : batch) {
    if (map_socket_->Send(m).ok()) {
      ++sent;
    } else {
      ++failed;
    }
  }
  std::lock_guard<std::mutex> lock(stats_mu_);
  context_stats_.sent += sent;
  context_stats_.send_failed += failed;
}

void Worker::SendEvents() {
  const std::vector<TokenEvent> events = outbox_->TakeEvents();
  for (const TokenEvent& ev : events) {
    if (!router_socket_) continue;
    // The router may be restarting: its requests are gone with it, so the event is dropped.
    if (Status s = router_socket_->Send(ev); !s.ok()) {
      spdlog::debug("req={} token event not sent: {}", ev.request_id, s.ToString());
    }
  }
}

void Worker::Tick() {
  const int64_t now = clock_.NowMs();
  auto due = [&](const Link& link) {
    return link.last_sent_ms < 0 || now - link.last_sent_ms >= options_.heartbeat_interval_ms;
  };
  if (due(map_)) {
    map_.last_sent_ms = now;
    Status s;
    if (map_.state == LinkState::kUnregistered) {
      Register reg;
      reg.group = options_.group;
      reg.rank = options_.rank;
      reg.world_size = options_.world_size;
      reg.instance_id = instance_id_;
      reg.model_fingerprint = model_.fingerprint;
      reg.num_layers = model_.num_moe_layers;
      reg.num_experts = model_.num_experts;
      reg.top_k = model_.top_k;
      reg.hidden_size = model_.hidden_size;
      reg.semantic = options_.semantic;
      reg.delta = options_.delta;
      s = map_socket_->Send(reg);
    } else {
      s = map_socket_->Send(RankHeartbeat{options_.group, options_.rank, instance_id_, ++map_.seq});
    }
    if (!s.ok()) spdlog::debug("to map service: {}", s.ToString());
    CheckLost(map_);
  }
  if (router_socket_ && due(router_)) {
    router_.last_sent_ms = now;
    Status s;
    if (router_.state == LinkState::kUnregistered) {
      WorkerHello hello;
      hello.group = options_.group;
      hello.world_size = options_.world_size;
      hello.model_name = options_.model_name;
      hello.model_fingerprint = model_.fingerprint;
      hello.instance_id = instance_id_;
      hello.max_batch = options_.max_batch;
      hello.free_slots = options_.max_batch;
      s = router_socket_->Send(hello);
    } else {
      WorkerHeartbeat hb;
      hb.group = options_.group;
      hb.instance_id = instance_id_;
      hb.seq = ++router_.seq;
      const uint32_t active = executor_ != nullptr ? executor_->active() : 0;
      hb.free_slots = options_.max_batch - std::min(active, options_.max_batch);
      hb.active_requests = active;
      if (options_.expert_figures) hb.experts = options_.expert_figures();
      if (options_.kv_figures) hb.kv = options_.kv_figures();
      if (options_.engine_figures) hb.engine = options_.engine_figures();
      s = router_socket_->Send(hb);
    }
    if (!s.ok()) spdlog::debug("to router: {}", s.ToString());
    CheckLost(router_);
  }
}

void Worker::CheckLost(Link& link) {
  if (link.state != LinkState::kRegistered) return;
  if (clock_.NowMs() - link.last_ack_ms > options_.heartbeat_timeout_ms) {
    link.state = LinkState::kLost;
    spdlog::warn("{} lost: no answer for {} ms; still serving, reconnecting", link.name,
                 clock_.NowMs() - link.last_ack_ms);
  }
}

void Worker::Acked(Link& link, bool known) {
  link.last_ack_ms = clock_.NowMs();
  if (!known) {
    if (link.state != LinkState::kUnregistered) {
      spdlog::info("{} does not know this rank (it restarted); registering again", link.name);
    }
    link.state = LinkState::kUnregistered;
    link.last_sent_ms = -1;  // Register at the next tick.
    return;
  }
  if (link.state == LinkState::kLost) spdlog::info("{} is back", link.name);
  link.state = LinkState::kRegistered;
}

void Worker::OnMapMessage(const MapMessage& message) {
  if (const auto* ack = std::get_if<RegisterAck>(&message)) {
    if (ack->accepted) {
      spdlog::info("registered with map service {} ({} stored maps for model {})",
                   options_.map_service_endpoint, ack->stored_maps,
                   FingerprintHex(model_.fingerprint));
      map_.refused_logged = false;
      Acked(map_, true);
    } else if (!map_.refused_logged) {
      spdlog::error("map service refused registration: {}", ack->reason);
      map_.refused_logged = true;
    }
  } else if (const auto* hb = std::get_if<RankHeartbeatAck>(&message)) {
    Acked(map_, hb->known);
  } else if (const auto* directive = std::get_if<PrefetchDirective>(&message)) {
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++context_stats_.directives;
    }
    if (options_.on_directive) options_.on_directive(*directive);
  } else if (std::holds_alternative<MapStored>(message)) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++context_stats_.maps_stored;
  } else {
    spdlog::debug("map service sent {}; ignored", wire::MessageName(message));
  }
}

void Worker::OnRouterMessage(const WorkerMessage& message) {
  if (const auto* ack = std::get_if<WorkerHelloAck>(&message)) {
    if (ack->accepted) {
      spdlog::info("joined router {} as leader of group {}", options_.router_endpoint,
                   options_.group);
      router_.refused_logged = false;
      Acked(router_, true);
    } else if (!router_.refused_logged) {
      spdlog::error("router refused this group: {}", ack->reason);
      router_.refused_logged = true;
    }
  } else if (const auto* hb = std::get_if<WorkerHeartbeatAck>(&message)) {
    Acked(router_, hb->known);
  } else if (const auto* gen = std::get_if<Generate>(&message)) {
    if (executor_ != nullptr) {
      executor_->Submit(*gen);
      return;
    }
    TokenEvent ev;
    ev.request_id = gen->request_id;
    ev.finish = FinishReason::kError;
    ev.error = "this rank runs no model";
    Status s = router_socket_->Send(ev);
    if (!s.ok()) spdlog::warn("req={} error event not sent: {}", gen->request_id, s.ToString());
  } else if (const auto* cancel = std::get_if<Cancel>(&message)) {
    if (executor_ != nullptr) executor_->Cancel(cancel->request_id);
  } else {
    spdlog::debug("router sent {}; ignored", wire::MessageName(message));
  }
}

}  // namespace fmoe
