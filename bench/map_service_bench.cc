// map_service_bench: the map service over ZeroMQ on loopback (Google Benchmark). The service
// runs in this process on its own thread, with a RocksDB store in a temporary directory, filled
// with C random maps through the Import admin request; one client plays a worker rank.
//   RoundTrip: LayerObserved sent -> its PrefetchDirective (target l + d) received, one at a
//     time; p50 and p99 over every layer of every iteration. Only layers that produce a
//     directive are timed; the iteration start (semantic search) is not.
//   Ingest: a stream of contexts (IterationStart, then every layer's LayerObserved) sent as fast
//     as the socket takes them; the time until the service has handled them all (a Stats
//     request queued behind them is answered). Iterations are left incomplete, so nothing is
//     inserted and the store stays as filled.
// Shapes: Mixtral-8x7B (L=32, J=8, h=4096), Qwen1.5-MoE-A2.7B (L=24, J=60, h=2048), Phi-3.5-MoE
// (L=32, J=16, h=4096); C = 1K and 10K; d = 3.
//
//   build/bin/map_service_bench --benchmark_min_time=1
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "map_service/export_file.h"
#include "map_service/map_service.h"

namespace {

using namespace fmoe;
using Clock = std::chrono::steady_clock;

struct Shape {
  const char* name;
  uint32_t layers, experts, top_k, hidden;
};
const Shape kShapes[] = {{"mixtral", 32, 8, 2, 4096},
                         {"qwen1.5-moe", 24, 60, 4, 2048},
                         {"phi-3.5-moe", 32, 16, 2, 4096}};
constexpr uint32_t kDistance = 3;
constexpr uint64_t kFingerprint = 0x5eed;

int FreeTcpPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

std::vector<float> Random(std::mt19937& rng, size_t n, bool distribution) {
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = distribution ? u(rng) * u(rng) * u(rng) : u(rng) - 0.5f;
  return v;
}

// A running service with a filled store and a registered client.
struct Bench {
  Shape shape{};
  uint32_t capacity = 0;
  std::string dir;
  std::unique_ptr<MapService> service;
  std::thread thread;
  std::atomic<bool> stop{false};
  wire::Context context;
  std::unique_ptr<wire::MapSocket> client;
  std::mt19937 rng{7};
  uint64_t next_request = 1;
  uint64_t admin_id = 1;

  ~Bench() {
    client.reset();
    stop = true;
    if (thread.joinable()) thread.join();
    service.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }

  std::optional<AdminReply> Admin(AdminOp op, const std::string& path = {}) {
    AdminRequest r;
    r.id = ++admin_id;
    r.op = op;
    r.path = path;
    if (!client->Send(r).ok()) return std::nullopt;
    for (;;) {
      auto in = client->Receive(600000);
      if (!in) return std::nullopt;
      if (auto* a = std::get_if<AdminReply>(&in->message); a && a->id == r.id) return *a;
    }
  }
};

std::unique_ptr<Bench> Start(int shape_index, uint32_t capacity, std::string* error) {
  auto b = std::make_unique<Bench>();
  b->shape = kShapes[shape_index];
  b->capacity = capacity;
  char tmpl[] = "/tmp/fmoe-map-bench-XXXXXX";
  b->dir = mkdtemp(tmpl);
  MapServiceOptions o;
  o.endpoint = "tcp://127.0.0.1:" + std::to_string(FreeTcpPort());
  o.data_dir = b->dir + "/db";
  o.store_capacity = static_cast<int>(capacity);
  o.prefetch_distance = kDistance;
  o.heartbeat_timeout_ms = 600000;
  b->service = std::make_unique<MapService>(o, SteadyClock::Get());
  if (Status s = b->service->Start(); !s.ok()) {
    *error = s.ToString();
    return nullptr;
  }
  b->thread = std::thread([p = b.get()] { p->service->Run([p] { return p->stop.load(); }); });
  wire::SocketOptions so;
  so.routing_id = "w/bench/0";
  auto c = wire::MapSocket::Connect(b->context, wire::Role::kDealer, o.endpoint, so);
  if (!c.ok()) {
    *error = c.status().ToString();
    return nullptr;
  }
  b->client = std::move(*c);
  Register reg;
  reg.group = "bench";
  reg.model_fingerprint = kFingerprint;
  reg.num_layers = b->shape.layers;
  reg.num_experts = b->shape.experts;
  reg.top_k = b->shape.top_k;
  reg.hidden_size = b->shape.hidden;
  (void)b->client->Send(reg);
  auto ack = b->client->Receive(10000);
  if (!ack || !std::holds_alternative<RegisterAck>(ack->message) ||
      !std::get<RegisterAck>(ack->message).accepted) {
    *error = "registration failed";
    return nullptr;
  }
  // Fill the store: an export file of C random maps, imported.
  const Shape& s = b->shape;
  std::vector<MapRow> maps(capacity);
  for (uint32_t i = 0; i < capacity; ++i) {
    maps[i].id = i + 1;
    maps[i].row = i;
    maps[i].request_id = i;
    maps[i].sem = Random(b->rng, s.hidden, false);
    maps[i].map = Random(b->rng, static_cast<size_t>(s.layers) * s.experts, true);
  }
  const std::string path = b->dir + "/fill.fmx";
  if (auto written =
          WriteMapExport(path, {kFingerprint, s.layers, s.experts, s.top_k, s.hidden, 0}, maps);
      !written.ok()) {
    *error = written.status().ToString();
    return nullptr;
  }
  auto reply = b->Admin(AdminOp::kImport, path);
  if (!reply || !reply->ok) {
    *error = reply ? reply->error : "no import reply";
    return nullptr;
  }
  // Let RocksDB's background flush of the import finish before timing anything.
  std::this_thread::sleep_for(std::chrono::seconds(3));
  return b;
}

// One service at a time, kept while consecutive benchmarks use the same shape and C.
Bench* Get(int shape, uint32_t capacity, std::string* error) {
  static std::unique_ptr<Bench> current;
  static std::pair<int, uint32_t> key{-1, 0};
  if (current && key == std::make_pair(shape, capacity)) return current.get();
  current.reset();
  current = Start(shape, capacity, error);
  key = {shape, capacity};
  return current.get();
}

std::vector<float> LayerProbs(std::mt19937& rng, uint32_t experts) {
  std::vector<float> p = Random(rng, experts, true);
  float sum = 0;
  for (float x : p) sum += x;
  for (float& x : p) x /= sum;
  return p;
}

void BM_RoundTrip(benchmark::State& state) {
  std::string error;
  Bench* b = Get(static_cast<int>(state.range(0)), static_cast<uint32_t>(state.range(1)), &error);
  if (b == nullptr) {
    state.SkipWithError(error.c_str());
    return;
  }
  const Shape& s = b->shape;
  std::vector<double> us;
  uint64_t request = 0;
  uint32_t layer = s.layers;  // Start a new iteration at once.
  auto drain_until = [&](uint32_t target) {
    for (;;) {
      auto in = b->client->Receive(10000);
      if (!in) return false;
      if (auto* d = std::get_if<PrefetchDirective>(&in->message);
          d && d->request_id == request && d->target_layer == target) {
        return true;
      }
    }
  };
  for (auto _ : state) {
    if (layer + kDistance >= s.layers) {
      // A new iteration, untimed: its start triggers the semantic search and d directives.
      if (request != 0) (void)b->client->Send(IterationEnd{request, 0, true});
      request = b->next_request++;
      (void)b->client->Send(IterationStart{request, 0, Random(b->rng, s.hidden, false)});
      if (!drain_until(kDistance - 1)) {
        state.SkipWithError("no directive for the iteration start");
        return;
      }
      layer = 0;
    }
    LayerObserved m{request, 0, layer, LayerProbs(b->rng, s.experts)};
    const auto t0 = Clock::now();
    (void)b->client->Send(m);
    if (!drain_until(layer + kDistance)) {
      state.SkipWithError("no directive");
      return;
    }
    const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(elapsed);
    us.push_back(elapsed * 1e6);
    ++layer;
  }
  (void)b->client->Send(IterationEnd{request, 0, true});
  std::sort(us.begin(), us.end());
  if (!us.empty()) {
    state.counters["p50_us"] = us[us.size() / 2];
    state.counters["p99_us"] = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  }
  state.SetLabel(s.name);
}

void BM_Ingest(benchmark::State& state) {
  std::string error;
  Bench* b = Get(static_cast<int>(state.range(0)), static_cast<uint32_t>(state.range(1)), &error);
  if (b == nullptr) {
    state.SkipWithError(error.c_str());
    return;
  }
  const Shape& s = b->shape;
  // Pre-built messages: 20 iterations of contexts.
  constexpr int kIterations = 20;
  std::vector<std::vector<uint8_t>> frames;
  for (int i = 0; i < kIterations; ++i) {
    const uint64_t request = 1000000 + static_cast<uint64_t>(i);
    frames.push_back(
        wire::Encode(MapMessage(IterationStart{request, 0, Random(b->rng, s.hidden, false)})));
    for (uint32_t l = 0; l < s.layers; ++l) {
      frames.push_back(
          wire::Encode(MapMessage(LayerObserved{request, 0, l, LayerProbs(b->rng, s.experts)})));
    }
  }
  uint64_t messages = 0;
  for (auto _ : state) {
    for (const auto& f : frames) (void)b->client->SendRaw(f);
    messages += frames.size();
    // Answered after every context before it (one service thread, in order).
    if (!b->Admin(AdminOp::kPing)) {
      state.SkipWithError("no reply");
      return;
    }
  }
  // Directives that were sent back meanwhile.
  while (b->client->Receive(0)) {
  }
  state.counters["contexts_per_s"] =
      benchmark::Counter(static_cast<double>(messages), benchmark::Counter::kIsRate);
  state.SetLabel(s.name);
}

}  // namespace

int main(int argc, char** argv) {
  spdlog::set_level(spdlog::level::warn);
  // Both benchmarks of one (shape, C) run back to back on the same filled service.
  for (int shape = 0; shape < 3; ++shape) {
    for (int c : {1000, 10000}) {
      benchmark::RegisterBenchmark("BM_RoundTrip", BM_RoundTrip)
          ->Args({shape, c})
          ->ArgNames({"shape", "C"})
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark("BM_Ingest", BM_Ingest)
          ->Args({shape, c})
          ->ArgNames({"shape", "C"})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
