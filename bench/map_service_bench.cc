// map_service_bench: the map service over ZeroMQ on loopback (Google Benchmark). The service
// runs in this process on its own thread, with a RocksDB store in a temporary directory, filled
// with C random maps through the Import admin request; one client plays a worker rank.
//   RoundTrip: LayerObserved sent -> its PrefetchDirective (target l + d) received, one at a
//     time; p50 and p99 over every layer of every iteration. Only layers that produce a
//     directive are timed; the iteration start (semantic search) is not.
//   RoundTripDuringExport (C = 10K): the same while a second client alternates an Export of the
//     whole store to a file with a pause as long; the round trips made while an export was in
//     flight ("_export") and those made while none was ("_idle") are counted apart, so both
//     p99s come from the same minutes of a shared machine.
//   Ingest: a stream of contexts (IterationStart, then every layer's LayerObserved) sent as fast
//     as the socket takes them; the time until the service has handled them all (a Stats
//     request queued behind them is answered). Iterations are left incomplete, so nothing is
//     inserted and the store stays as filled.
// Shapes: Mixtral-8x7B (L=32, J=8, h=4096), Qwen1.5-MoE-A2.7B (L=24, J=60, h=2048), Phi-3.5-MoE
// (L=32, J=16, h=4096); C = 1K and 10K; d = 3.
//
//   build/bin/map_service_bench --benchmark_min_time=1 [--writer_nice=N (default: the service's)]
//     [--curve (every socket with a cluster key, as fmoe launch runs them; default: plain)]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string_view>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>

#include "common/json.h"
#include "common/log.h"
#include "common/wire/wire.h"
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
int g_writer_nice = MapServiceOptions{}.writer_nice;

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
  std::string endpoint;
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
  b->endpoint = o.endpoint;
  o.data_dir = b->dir + "/db";
  o.store_capacity = static_cast<int>(capacity);
  o.prefetch_distance = kDistance;
  o.heartbeat_timeout_ms = 600000;
  o.writer_nice = g_writer_nice;
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
  const auto import_start = Clock::now();
  auto reply = b->Admin(AdminOp::kImport, path);
  if (!reply || !reply->ok) {
    *error = reply ? reply->error : "no import reply";
    return nullptr;
  }
  std::fprintf(stderr, "%s C=%u: the Import that fills the store took %.2f s\n", s.name, capacity,
               std::chrono::duration<double>(Clock::now() - import_start).count());
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

// p50 and p99 of a sample, as counters "p50_us<suffix>" and "p99_us<suffix>".
void Percentiles(benchmark::State& state, std::vector<double> us, const std::string& suffix) {
  if (us.empty()) return;
  std::sort(us.begin(), us.end());
  if (suffix.empty()) state.counters["max_us"] = us.back();
  state.counters["p50_us" + suffix] = us[us.size() / 2];
  state.counters["p99_us" + suffix] = us[std::min(us.size() - 1, us.size() * 99 / 100)];
}

// The round trip, timed per layer: every sample ("p50_us", "p99_us", "max_us"). With `phase`,
// also apart by the phase at its send and at its directive when both are the same: odd (an
// export running throughout: "_export"), even (none running: "_idle"). A round trip held up
// across the end of an export counts in neither, only in the first.
void RoundTrip(benchmark::State& state, Bench* b, const std::atomic<uint64_t>* phase = nullptr) {
  const Shape& s = b->shape;
  std::vector<double> all, idle, exporting;
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
    const uint64_t phase_before = phase != nullptr ? phase->load() : 0;
    const auto t0 = Clock::now();
    (void)b->client->Send(m);
    if (!drain_until(layer + kDistance)) {
      state.SkipWithError("no directive");
      return;
    }
    const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(elapsed);
    all.push_back(elapsed * 1e6);
    if (phase != nullptr && phase->load() == phase_before) {
      (phase_before % 2 == 1 ? exporting : idle).push_back(elapsed * 1e6);
    }
    ++layer;
  }
  (void)b->client->Send(IterationEnd{request, 0, true});
  Percentiles(state, std::move(all), "");
  Percentiles(state, std::move(idle), "_idle");
  Percentiles(state, std::move(exporting), "_export");
  state.SetLabel(s.name);
}

void BM_RoundTrip(benchmark::State& state) {
  std::string error;
  Bench* b = Get(static_cast<int>(state.range(0)), static_cast<uint32_t>(state.range(1)), &error);
  if (b == nullptr) {
    state.SkipWithError(error.c_str());
    return;
  }
  RoundTrip(state, b);
}

// A second client (its own DEALER, on its own thread) alternating until stopped: one Export of
// the whole store, then a pause as long as that export took. `phase` counts the changes: odd
// while an export is in flight (from its request sent to its reply received), even between.
class Exporter {
 public:
  Exporter(Bench* b, const std::string& endpoint) {
    thread_ = std::thread([this, b, endpoint] { Loop(b, endpoint); });
    // Starts timing at the first export.
    while (phase_.load() == 0 && !done_) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~Exporter() {
    stop_ = true;
    thread_.join();
  }
  const std::atomic<uint64_t>& phase() const { return phase_; }
  uint64_t exports() const { return exports_; }
  uint64_t failures() const { return failures_; }

 private:
  void Loop(Bench* b, const std::string& endpoint) {
    wire::SocketOptions so;
    so.routing_id = "admin/exporter";
    auto socket = wire::MapSocket::Connect(b->context, wire::Role::kDealer, endpoint, so);
    for (uint64_t id = 1; !stop_; ++id) {
      AdminRequest r;
      r.id = id;
      r.op = AdminOp::kExport;
      r.path = b->dir + "/export.fmx";
      ++phase_;
      const auto t0 = Clock::now();
      if (!socket.ok() || !(*socket)->Send(r).ok()) break;
      std::optional<AdminReply> reply;
      while (!reply) {
        auto in = (*socket)->Receive(600000);
        if (!in) break;
        if (auto* a = std::get_if<AdminReply>(&in->message); a && a->id == id) reply = *a;
      }
      ++phase_;
      if (!reply || !reply->ok) break;
      ++exports_;
      const auto pause_end = Clock::now() + (Clock::now() - t0);
      while (!stop_ && Clock::now() < pause_end) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    if (!stop_) ++failures_;
    done_ = true;
  }

  std::thread thread_;
  std::atomic<uint64_t> phase_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> done_{false};
  std::atomic<uint64_t> exports_{0};
  std::atomic<uint64_t> failures_{0};
};

void BM_RoundTripDuringExport(benchmark::State& state) {
  std::string error;
  Bench* b = Get(static_cast<int>(state.range(0)), static_cast<uint32_t>(state.range(1)), &error);
  if (b == nullptr) {
    state.SkipWithError(error.c_str());
    return;
  }
  uint64_t exports = 0, failures = 0;
  {
    Exporter exporter(b, b->endpoint);
    RoundTrip(state, b, &exporter.phase());
    exports = exporter.exports();
    failures = exporter.failures();
  }  // Waits for the export in flight.
  if (failures > 0) state.SkipWithError("an export failed");
  state.counters["exports"] = static_cast<double>(exports);
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
  // Our own flag, taken out before Google Benchmark reads the rest.
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.starts_with("--writer_nice=")) {
      g_writer_nice = std::atoi(argv[i] + std::strlen("--writer_nice="));
    } else if (arg == "--curve") {
      // Every socket of the run (the service's and the clients') with a cluster key, as
      // `fmoe launch` runs them: the CURVE handshake and per-message encryption included.
      auto key = fmoe::wire::NewCurveKey();
      if (!key.ok()) {
        std::fprintf(stderr, "map_service_bench: %s\n", key.status().message().c_str());
        return 1;
      }
      fmoe::wire::SetDefaultCurveKey(*key);
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  // Both benchmarks of one (shape, C) run back to back on the same filled service.
  for (int shape = 0; shape < 3; ++shape) {
    for (int c : {1000, 10000}) {
      benchmark::RegisterBenchmark("BM_RoundTrip", BM_RoundTrip)
          ->Args({shape, c})
          ->ArgNames({"shape", "C"})
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
      if (c == 10000) {
        benchmark::RegisterBenchmark("BM_RoundTripDuringExport", BM_RoundTripDuringExport)
            ->Args({shape, c})
            ->ArgNames({"shape", "C"})
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond);
      }
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
