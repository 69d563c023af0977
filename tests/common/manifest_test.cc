#include "common/manifest.h"
#include "common/policy_names.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

namespace fs = std::filesystem;

constexpr char kBase[] = "/srv/cluster";

constexpr char kMinimal[] = R"(
model:
  path: models/tiny
worker_groups:
  - name: g0
    workers:
      - device: cpu
)";

// Every key set to a non-default value.
constexpr char kFull[] = R"(
model:
  path: /opt/models/DeepSeek-V2-Lite/
  name: dsv2-lite
  dtype: bfloat16
map_service:
  endpoint: ipc:///tmp/fmoe/maps.sock
  data_dir: state/maps
  store_capacity: 50000
  prefetch_distance: 4
  sync: true
worker_groups:
  - name: gpu-a
    policy: fmoe-nextuse
    max_batch: 16
    max_batched_tokens: 2048
    chunk_overhead: 0.5
    prefill_stream: auto
    prefill_stream_slots: 48
    queue_limit: 256
    expert_cache_gb: 2.5
    link:
      gbps: 25.5
      latency_us: 0
    rendezvous: 10.0.0.1:30000
    collective_timeout_s: 2.5
    rendezvous_timeout_s: 3600
    record_trace: traces/gpu-a.trc
    workers:
      - device: cuda:0
        host: node-1
      - device: cuda:1
        host: node-1
      - device: cuda:0
        host: node-2
  - name: cpu_b
    policy: lru
    max_batch: 1
    queue_limit: 1
    expert_cache_fraction: 0.25
    link: {gbps: 0.5, latency_us: 1e-05}
    workers:
      - {device: cpu, host: localhost}
router:
  listen: 0.0.0.0:8080
  worker_endpoint: tcp://*:7000
  request_timeout_s: 30.5
  max_body_bytes: 4096
  api_keys: ["abcdefgh", "0123456789-secret"]
  cors_allowed_origins: ["https://chat.example.com", "http://localhost:3000"]
heartbeat:
  interval_ms: 100
  timeout_ms: 200
logging:
  level: debug
launcher:
  run_dir: /var/run/fmoe
  ready_timeout_s: 3600
  stop_timeout_s: 1
  services_wait_s: 0
  restart:
    initial_backoff_ms: 0
    max_backoff_ms: 600000
    max_restarts: 0
    window_s: 86400
)";

Manifest ParseOk(const std::string& text, const std::string& base = kBase) {
  Result<Manifest> m = ParseManifest(text, base);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? *m : Manifest{};
}

void ExpectManifestEq(const Manifest& a, const Manifest& b) {
  EXPECT_EQ(a.model.path, b.model.path);
  EXPECT_EQ(a.model.name, b.model.name);
  EXPECT_EQ(a.model.dtype, b.model.dtype);
  EXPECT_EQ(a.map_service.endpoint, b.map_service.endpoint);
  EXPECT_EQ(a.map_service.data_dir, b.map_service.data_dir);
  EXPECT_EQ(a.map_service.store_capacity, b.map_service.store_capacity);
  EXPECT_EQ(a.map_service.prefetch_distance, b.map_service.prefetch_distance);
  EXPECT_EQ(a.map_service.sync, b.map_service.sync);
  ASSERT_EQ(a.worker_groups.size(), b.worker_groups.size());
  for (size_t i = 0; i < a.worker_groups.size(); ++i) {
    SCOPED_TRACE("group " + std::to_string(i));
    const WorkerGroupSpec& x = a.worker_groups[i];
    const WorkerGroupSpec& y = b.worker_groups[i];
    EXPECT_EQ(x.name, y.name);
    EXPECT_EQ(x.policy, y.policy);
    EXPECT_EQ(x.max_batch, y.max_batch);
    EXPECT_EQ(x.max_batched_tokens, y.max_batched_tokens);
    EXPECT_EQ(x.chunk_overhead, y.chunk_overhead);
    EXPECT_EQ(x.prefill_stream, y.prefill_stream);
    EXPECT_EQ(x.prefill_stream_slots, y.prefill_stream_slots);
    EXPECT_EQ(x.queue_limit, y.queue_limit);
    EXPECT_EQ(x.kv_cache_tokens, y.kv_cache_tokens);
    EXPECT_EQ(x.prefix_caching, y.prefix_caching);
    EXPECT_EQ(x.expert_cache_gb, y.expert_cache_gb);
    EXPECT_EQ(x.expert_cache_fraction, y.expert_cache_fraction);
    EXPECT_EQ(x.expert_cache_auto, y.expert_cache_auto);
    EXPECT_EQ(x.memory_utilization, y.memory_utilization);
    EXPECT_EQ(x.host_cache_gb, y.host_cache_gb);
    EXPECT_EQ(x.host_cache_fraction, y.host_cache_fraction);
    EXPECT_EQ(x.host_cache_auto, y.host_cache_auto);
    EXPECT_EQ(x.memory.has_value(), y.memory.has_value());
    if (x.memory && y.memory) {
      EXPECT_EQ(x.memory->device_gb, y.memory->device_gb);
      EXPECT_EQ(x.memory->device_fraction, y.memory->device_fraction);
      EXPECT_EQ(x.memory->kv_floor, y.memory->kv_floor);
      EXPECT_EQ(x.memory->expert_floor, y.memory->expert_floor);
      EXPECT_EQ(x.memory->return_hold_s, y.memory->return_hold_s);
    }
    EXPECT_EQ(x.link.gbps, y.link.gbps);
    EXPECT_EQ(x.link.latency_us, y.link.latency_us);
    EXPECT_EQ(x.hybrid.enabled, y.hybrid.enabled);
    EXPECT_EQ(x.hybrid.cpu_threads, y.hybrid.cpu_threads);
    EXPECT_EQ(x.hybrid.host_slowdown, y.hybrid.host_slowdown);
    EXPECT_EQ(x.rendezvous, y.rendezvous);
    EXPECT_EQ(x.collective_timeout_s, y.collective_timeout_s);
    EXPECT_EQ(x.rendezvous_timeout_s, y.rendezvous_timeout_s);
    EXPECT_EQ(x.record_trace, y.record_trace);
    ASSERT_EQ(x.workers.size(), y.workers.size());
    for (size_t j = 0; j < x.workers.size(); ++j) {
      EXPECT_EQ(x.workers[j].device, y.workers[j].device);
      EXPECT_EQ(x.workers[j].cuda_index, y.workers[j].cuda_index);
      EXPECT_EQ(x.workers[j].host, y.workers[j].host);
    }
  }
  EXPECT_EQ(a.router.listen, b.router.listen);
  EXPECT_EQ(a.router.worker_endpoint, b.router.worker_endpoint);
  EXPECT_EQ(a.router.request_timeout_s, b.router.request_timeout_s);
  EXPECT_EQ(a.router.max_body_bytes, b.router.max_body_bytes);
  EXPECT_EQ(a.router.tool_call_parser, b.router.tool_call_parser);
  EXPECT_EQ(a.router.responses_capacity, b.router.responses_capacity);
  EXPECT_EQ(a.router.responses_dir, b.router.responses_dir);
  EXPECT_EQ(a.router.api_keys, b.router.api_keys);
  EXPECT_EQ(a.heartbeat.interval_ms, b.heartbeat.interval_ms);
  EXPECT_EQ(a.heartbeat.timeout_ms, b.heartbeat.timeout_ms);
  EXPECT_EQ(a.logging.level, b.logging.level);
  EXPECT_EQ(a.launcher.run_dir, b.launcher.run_dir);
  EXPECT_EQ(a.launcher.ready_timeout_s, b.launcher.ready_timeout_s);
  EXPECT_EQ(a.launcher.stop_timeout_s, b.launcher.stop_timeout_s);
  EXPECT_EQ(a.launcher.services_wait_s, b.launcher.services_wait_s);
  EXPECT_EQ(a.launcher.restart.initial_backoff_ms, b.launcher.restart.initial_backoff_ms);
  EXPECT_EQ(a.launcher.restart.max_backoff_ms, b.launcher.restart.max_backoff_ms);
  EXPECT_EQ(a.launcher.restart.max_restarts, b.launcher.restart.max_restarts);
  EXPECT_EQ(a.launcher.restart.window_s, b.launcher.restart.window_s);
}

// A fresh directory under the test temp dir, removed at destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = ::testing::TempDir() + "/manifest_test.XXXXXX";
    char* made = ::mkdtemp(tmpl.data());
    EXPECT_NE(made, nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path_, fs::perms::owner_all, ec);
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string Write(const std::string& name, const std::string& text) const {
    const std::string file = path_ + "/" + name;
    fs::create_directories(fs::path(file).parent_path());
    std::ofstream(file) << text;
    return file;
  }

 private:
  std::string path_;
};

// ---- valid manifests ----

TEST(Manifest, MinimalGetsAllDefaults) {
  const Manifest m = ParseOk(kMinimal);
  EXPECT_EQ(m.source_path, "");
  EXPECT_EQ(m.model.path, "/srv/cluster/models/tiny");
  EXPECT_EQ(m.model.name, "tiny");
  EXPECT_EQ(m.model.dtype, "auto");  // float32 on cpu (gpu_worker/rank.h ResolveDtype).
  EXPECT_EQ(m.map_service.endpoint, "tcp://127.0.0.1:5555");
  EXPECT_EQ(m.map_service.data_dir, "/srv/cluster/.fmoe/maps");
  EXPECT_EQ(m.map_service.store_capacity, 1000);
  EXPECT_EQ(m.map_service.prefetch_distance, 3);
  EXPECT_FALSE(m.map_service.sync);
  ASSERT_EQ(m.worker_groups.size(), 1u);
  const WorkerGroupSpec& g = m.worker_groups[0];
  EXPECT_EQ(g.name, "g0");
  EXPECT_EQ(g.policy, "fmoe");
  EXPECT_EQ(g.max_batch, 8);
  EXPECT_EQ(g.max_batched_tokens, 512);
  EXPECT_EQ(g.queue_limit, 64);
  EXPECT_FALSE(g.expert_cache_gb.has_value());
  EXPECT_EQ(g.expert_cache_fraction, 1.0);
  EXPECT_EQ(g.link.gbps, 16.0);
  EXPECT_EQ(g.link.latency_us, 10.0);
  EXPECT_EQ(g.rendezvous, "127.0.0.1:29500");
  EXPECT_EQ(g.collective_timeout_s, 60.0);
  EXPECT_EQ(g.rendezvous_timeout_s, 120.0);
  ASSERT_EQ(g.workers.size(), 1u);
  EXPECT_EQ(g.workers[0].device, "cpu");
  EXPECT_EQ(g.workers[0].cuda_index, -1);
  EXPECT_EQ(g.workers[0].host, "127.0.0.1");
  EXPECT_EQ(m.router.listen, "127.0.0.1:8000");
  EXPECT_EQ(m.router.worker_endpoint, "tcp://127.0.0.1:5556");
  EXPECT_EQ(m.router.request_timeout_s, 600.0);
  EXPECT_EQ(m.router.max_body_bytes, 1 << 20);
  EXPECT_TRUE(m.router.api_keys.empty());
  EXPECT_EQ(m.heartbeat.interval_ms, 500);
  EXPECT_EQ(m.heartbeat.timeout_ms, 3000);
  EXPECT_EQ(m.logging.level, "info");
  EXPECT_EQ(m.launcher.run_dir, "/srv/cluster/.fmoe/run");
  EXPECT_EQ(m.launcher.ready_timeout_s, 120);
  EXPECT_EQ(m.launcher.stop_timeout_s, 10);
  EXPECT_EQ(m.launcher.services_wait_s, 600);
  EXPECT_EQ(m.launcher.restart.initial_backoff_ms, 500);
  EXPECT_EQ(m.launcher.restart.max_backoff_ms, 10000);
  EXPECT_EQ(m.launcher.restart.max_restarts, 5);
  EXPECT_EQ(m.launcher.restart.window_s, 60);
  EXPECT_EQ(m.router.drain_timeout_s, 30.0);
  EXPECT_TRUE(m.security.curve);
  EXPECT_EQ(m.security.key_file, "/srv/cluster/.fmoe/run/cluster.key");
}

TEST(Manifest, SecurityAndDrainTakeTheirValues) {
  const Manifest m = ParseOk(std::string(kMinimal) + R"(
router: {drain_timeout_s: 0}
launcher: {run_dir: run}
security: {curve: false, key_file: keys/cluster.key}
)");
  EXPECT_EQ(m.router.drain_timeout_s, 0.0);
  EXPECT_FALSE(m.security.curve);
  EXPECT_EQ(m.security.key_file, "/srv/cluster/keys/cluster.key");
  const Manifest run_dir = ParseOk(std::string(kMinimal) + "launcher: {run_dir: /var/run/x}\n");
  EXPECT_EQ(run_dir.security.key_file, "/var/run/x/cluster.key") << "follows the run directory";
  auto bad = ParseManifest(std::string(kMinimal) + "security: {curve: maybe}\n", "/srv/cluster");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("security.curve"), std::string::npos)
      << bad.status().ToString();
  auto unknown = ParseManifest(std::string(kMinimal) + "security: {keyfile: x}\n", "/srv/cluster");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("security.keyfile: unknown key"), std::string::npos)
      << unknown.status().ToString();
  auto drain =
      ParseManifest(std::string(kMinimal) + "router: {drain_timeout_s: -1}\n", "/srv/cluster");
  ASSERT_FALSE(drain.ok());
  EXPECT_NE(drain.status().message().find("router.drain_timeout_s"), std::string::npos)
      << drain.status().ToString();
}

TEST(Manifest, EveryServablePolicyOfTheTableIsAccepted) {
  for (const PolicyName& p : kPolicyNames) {
    auto m = ParseManifest("model: {path: m}\nworker_groups:\n  - {name: g, policy: " +
                               std::string(p.name) + ", workers: [{}]}\n",
                           "/srv");
    EXPECT_EQ(m.ok(), p.servable) << p.name << ": " << m.status().message();
    if (m.ok()) {
      EXPECT_EQ(m->worker_groups[0].policy, p.name);
    }
  }
}

TEST(Manifest, WorkerEntryMayBeEmptyMap) {
  const Manifest m = ParseOk("model: {path: m}\nworker_groups: [{name: a, workers: [{}, {}]}]\n");
  ASSERT_EQ(m.worker_groups[0].workers.size(), 2u);
  EXPECT_EQ(m.worker_groups[0].workers[1].device, "cpu");
}

TEST(Manifest, FullManifestSetsEveryKey) {
  const Manifest m = ParseOk(kFull);
  EXPECT_EQ(m.model.path, "/opt/models/DeepSeek-V2-Lite");
  EXPECT_EQ(m.model.name, "dsv2-lite");
  EXPECT_EQ(m.model.dtype, "bfloat16");
  EXPECT_EQ(m.map_service.endpoint, "ipc:///tmp/fmoe/maps.sock");
  EXPECT_EQ(m.map_service.data_dir, "/srv/cluster/state/maps");
  EXPECT_EQ(m.map_service.store_capacity, 50000);
  EXPECT_EQ(m.map_service.prefetch_distance, 4);
  EXPECT_TRUE(m.map_service.sync);
  ASSERT_EQ(m.worker_groups.size(), 2u);
  const WorkerGroupSpec& a = m.worker_groups[0];
  EXPECT_EQ(a.name, "gpu-a");
  EXPECT_EQ(a.policy, "fmoe-nextuse");
  EXPECT_EQ(a.max_batch, 16);
  EXPECT_EQ(a.max_batched_tokens, 2048);
  EXPECT_EQ(m.worker_groups[1].max_batched_tokens, 512);
  EXPECT_EQ(a.chunk_overhead, 0.5);
  EXPECT_EQ(m.worker_groups[1].chunk_overhead, 0.25);
  EXPECT_EQ(a.prefill_stream, "auto");
  EXPECT_EQ(a.prefill_stream_slots, 48);
  EXPECT_EQ(m.worker_groups[1].prefill_stream, "off");
  EXPECT_EQ(m.worker_groups[1].prefill_stream_slots, 0);
  EXPECT_EQ(a.queue_limit, 256);
  EXPECT_EQ(a.expert_cache_gb, 2.5);
  EXPECT_FALSE(a.expert_cache_fraction.has_value());
  EXPECT_EQ(a.link.gbps, 25.5);
  EXPECT_EQ(a.link.latency_us, 0.0);
  EXPECT_EQ(a.rendezvous, "10.0.0.1:30000");
  EXPECT_EQ(a.collective_timeout_s, 2.5);
  EXPECT_EQ(a.rendezvous_timeout_s, 3600.0);
  EXPECT_EQ(a.record_trace, "/srv/cluster/traces/gpu-a.trc");
  ASSERT_EQ(a.workers.size(), 3u);
  EXPECT_EQ(a.workers[0].device, "cuda:0");
  EXPECT_EQ(a.workers[0].cuda_index, 0);
  EXPECT_EQ(a.workers[1].cuda_index, 1);
  EXPECT_EQ(a.workers[2].cuda_index, 0);
  EXPECT_EQ(a.workers[2].host, "node-2");
  const WorkerGroupSpec& b = m.worker_groups[1];
  EXPECT_EQ(b.name, "cpu_b");
  EXPECT_EQ(b.policy, "lru");
  EXPECT_EQ(b.expert_cache_fraction, 0.25);
  EXPECT_FALSE(b.expert_cache_gb.has_value());
  EXPECT_EQ(b.link.gbps, 0.5);
  EXPECT_EQ(b.link.latency_us, 1e-05);
  EXPECT_EQ(b.rendezvous, "127.0.0.1:29501");
  EXPECT_EQ(b.collective_timeout_s, 60.0);  // The defaults, in a group that sets neither.
  EXPECT_EQ(b.rendezvous_timeout_s, 120.0);
  EXPECT_EQ(b.record_trace, "");
  EXPECT_EQ(b.workers[0].host, "localhost");
  EXPECT_EQ(m.router.listen, "0.0.0.0:8080");
  EXPECT_EQ(m.router.worker_endpoint, "tcp://*:7000");
  EXPECT_EQ(m.router.request_timeout_s, 30.5);
  EXPECT_EQ(m.router.max_body_bytes, 4096);
  EXPECT_EQ(m.router.api_keys, (std::vector<std::string>{"abcdefgh", "0123456789-secret"}));
  EXPECT_EQ(m.router.cors_allowed_origins,
            (std::vector<std::string>{"https://chat.example.com", "http://localhost:3000"}));
  EXPECT_EQ(m.heartbeat.interval_ms, 100);
  EXPECT_EQ(m.heartbeat.timeout_ms, 200);
  EXPECT_EQ(m.logging.level, "debug");
  EXPECT_EQ(m.launcher.run_dir, "/var/run/fmoe");
  EXPECT_EQ(m.launcher.ready_timeout_s, 3600);
  EXPECT_EQ(m.launcher.stop_timeout_s, 1);
  EXPECT_EQ(m.launcher.services_wait_s, 0);
  EXPECT_EQ(m.launcher.restart.initial_backoff_ms, 0);
  EXPECT_EQ(m.launcher.restart.max_backoff_ms, 600000);
  EXPECT_EQ(m.launcher.restart.max_restarts, 0);
  EXPECT_EQ(m.launcher.restart.window_s, 86400);
  EXPECT_EQ(FindGroup(m, "cpu_b"), &m.worker_groups[1]);
  EXPECT_EQ(FindGroup(m, "gpu-a"), &m.worker_groups[0]);
  EXPECT_EQ(FindGroup(m, "nope"), nullptr);
}

TEST(Manifest, RelativePathsResolveAgainstBaseDir) {
  const Manifest m = ParseOk(R"(
model: {path: ../models/./tiny/}
map_service: {data_dir: ./a/../maps, endpoint: "ipc:///run/x/../maps.sock"}
worker_groups: [{name: g, workers: [{device: cpu}]}]
launcher: {run_dir: run}
)",
                             "/srv/cluster/conf/");
  EXPECT_EQ(m.model.path, "/srv/cluster/models/tiny");
  EXPECT_EQ(m.model.name, "tiny");
  EXPECT_EQ(m.map_service.data_dir, "/srv/cluster/conf/maps");
  EXPECT_EQ(m.map_service.endpoint, "ipc:///run/x/../maps.sock");  // ipc stays as given.
  EXPECT_EQ(m.launcher.run_dir, "/srv/cluster/conf/run");
  // A relative base_dir is taken against the working directory.
  const Manifest rel = ParseOk(kMinimal, "sub");
  EXPECT_EQ(rel.model.path, (fs::current_path() / "sub/models/tiny").lexically_normal().string());
}

TEST(Manifest, RendezvousDefaultsFollowGroupIndex) {
  const Manifest m = ParseOk(R"(
model: {path: m}
worker_groups:
  - {name: a, workers: [{}]}
  - {name: b, rendezvous: "node-7:40000", workers: [{}]}
  - {name: c, workers: [{}]}
)");
  ASSERT_EQ(m.worker_groups.size(), 3u);
  EXPECT_EQ(m.worker_groups[0].rendezvous, "127.0.0.1:29500");
  EXPECT_EQ(m.worker_groups[1].rendezvous, "node-7:40000");
  EXPECT_EQ(m.worker_groups[2].rendezvous, "127.0.0.1:29502");
}

TEST(Manifest, GroupTimeoutsAcceptTheirRange) {
  const Manifest m = ParseOk(R"(
model: {path: m}
worker_groups:
  - {name: a, collective_timeout_s: 0.001, rendezvous_timeout_s: 1e-3, workers: [{}]}
  - {name: b, collective_timeout_s: 3600, rendezvous_timeout_s: +30, workers: [{}]}
)");
  ASSERT_EQ(m.worker_groups.size(), 2u);
  EXPECT_EQ(m.worker_groups[0].collective_timeout_s, 0.001);
  EXPECT_EQ(m.worker_groups[0].rendezvous_timeout_s, 0.001);
  EXPECT_EQ(m.worker_groups[1].collective_timeout_s, 3600.0);
  EXPECT_EQ(m.worker_groups[1].rendezvous_timeout_s, 30.0);
}

TEST(Manifest, RecordTraceIsOptionalAndResolvesAgainstBaseDir) {
  const Manifest m = ParseOk(R"(
model: {path: m}
worker_groups:
  - {name: a, workers: [{}]}
  - {name: b, record_trace: traces/../b.trc, workers: [{}]}
  - {name: c, record_trace: /var/traces/c.trc, workers: [{}]}
)");
  ASSERT_EQ(m.worker_groups.size(), 3u);
  EXPECT_EQ(m.worker_groups[0].record_trace, "");
  EXPECT_EQ(m.worker_groups[1].record_trace, "/srv/cluster/b.trc");
  EXPECT_EQ(m.worker_groups[2].record_trace, "/var/traces/c.trc");
  EXPECT_EQ(DescribeManifest(m).find("record_trace: \"\""), std::string::npos)
      << "an absent trace is not described";
}

TEST(Manifest, SameCudaIndexOnDifferentHostsOrGroupsIsFine) {
  ParseOk(R"(
model: {path: m}
worker_groups:
  - {name: a, workers: [{device: cuda:0, host: h1}, {device: cuda:0, host: h2}]}
  - {name: b, workers: [{device: cuda:0, host: h1}]}
)");
}

TEST(Manifest, DescribeRoundTripsToAnEqualManifest) {
  for (const char* text : {kMinimal, kFull}) {
    Manifest m = ParseOk(text);
    m.router.api_keys.clear();  // Keys are redacted in the description; see below.
    const std::string described = DescribeManifest(m);
    SCOPED_TRACE(described);
    Result<Manifest> again = ParseManifest(described, "/elsewhere");
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    ExpectManifestEq(m, *again);
    EXPECT_EQ(DescribeManifest(*again), described);
  }
}

TEST(Manifest, DescribeQuotesStringsThatLookLikeOtherTypes) {
  for (const char* name : {"null", "~", "true", "no", "1e5", "0x10", "a: b", "x #y", "[z]", "'q'",
                           "\"dq\"", "*star", "&amp", "-", "Tiny Model \xc3\xa9"}) {
    SCOPED_TRACE(name);
    Manifest m = ParseOk(kMinimal);
    m.model.name = name;
    m.model.path = std::string("/models/") + name + " dir";
    const std::string described = DescribeManifest(m);
    Result<Manifest> again = ParseManifest(described, "/");
    ASSERT_TRUE(again.ok()) << again.status().ToString() << "\n" << described;
    EXPECT_EQ(again->model.name, name);
    EXPECT_EQ(again->model.path, m.model.path);
  }
}

TEST(Manifest, DescribeListsEveryKeyAndRedactsApiKeys) {
  const Manifest m = ParseOk(kFull);
  const std::string described = DescribeManifest(m);
  for (const char* key : {"model:",
                          "path:",
                          "name:",
                          "dtype:",
                          "map_service:",
                          "endpoint:",
                          "data_dir:",
                          "store_capacity:",
                          "prefetch_distance:",
                          "sync:",
                          "worker_groups:",
                          "policy:",
                          "max_batch:",
                          "queue_limit:",
                          "expert_cache_gb:",
                          "expert_cache_fraction:",
                          "link:",
                          "gbps:",
                          "latency_us:",
                          "rendezvous:",
                          "collective_timeout_s:",
                          "rendezvous_timeout_s:",
                          "record_trace:",
                          "workers:",
                          "device:",
                          "host:",
                          "router:",
                          "listen:",
                          "worker_endpoint:",
                          "request_timeout_s:",
                          "max_body_bytes:",
                          "api_keys:",
                          "heartbeat:",
                          "interval_ms:",
                          "timeout_ms:",
                          "logging:",
                          "level:",
                          "launcher:",
                          "run_dir:",
                          "ready_timeout_s:",
                          "stop_timeout_s:",
                          "services_wait_s:",
                          "restart:",
                          "initial_backoff_ms:",
                          "max_backoff_ms:",
                          "max_restarts:",
                          "window_s:"}) {
    EXPECT_NE(described.find(key), std::string::npos) << key << "\n" << described;
  }
  EXPECT_NE(described.find(R"(api_keys: ["***", "***"])"), std::string::npos) << described;
  EXPECT_EQ(described.find("abcdefgh"), std::string::npos);
  EXPECT_EQ(described.find("secret"), std::string::npos);
  // The redacted form parses but is refused with a clear message.
  Result<Manifest> again = ParseManifest(described, "/");
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().message(),
            "manifest: router.api_keys[0]: \"***\" is a redacted key (as DescribeManifest writes "
            "it); give the real key");
}

TEST(Manifest, LoadManifestResolvesAgainstItsDirectory) {
  TempDir dir;
  const std::string file = dir.Write("conf/cluster.yaml", kMinimal);
  Result<Manifest> m = LoadManifest(file);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const std::string conf = (fs::path(dir.path()) / "conf").lexically_normal().string();
  EXPECT_EQ(m->source_path, conf + "/cluster.yaml");
  EXPECT_EQ(m->model.path, conf + "/models/tiny");
  EXPECT_EQ(m->map_service.data_dir, conf + "/.fmoe/maps");
  EXPECT_EQ(m->launcher.run_dir, conf + "/.fmoe/run");
}

TEST(Manifest, LoadManifestErrors) {
  TempDir dir;
  const std::string missing = dir.path() + "/nope.yaml";
  Result<Manifest> m = LoadManifest(missing);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), ErrorCode::kNotFound);
  EXPECT_EQ(m.status().message(), "manifest: " + missing + ": no such file");

  m = LoadManifest(dir.path());
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), ErrorCode::kIoError);
  EXPECT_EQ(m.status().message(), "manifest: " + dir.path() + ": is a directory");

  const std::string empty = dir.Write("empty.yaml", "");
  m = LoadManifest(empty);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(m.status().message(),
            "manifest: top level: the document is empty; expected a map with keys model, "
            "map_service, worker_groups, router, heartbeat, logging, launcher, security");

  if (::geteuid() != 0) {  // root reads anything.
    const std::string locked = dir.Write("locked.yaml", kMinimal);
    ASSERT_EQ(::chmod(locked.c_str(), 0), 0);
    m = LoadManifest(locked);
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), ErrorCode::kIoError);
    EXPECT_EQ(m.status().message().rfind("manifest: " + locked + ": cannot open", 0), 0u)
        << m.status().message();
  }
}

TEST(Manifest, HostPortAndZmqEndpoint) {
  Result<HostPort> hp = ParseHostPort("127.0.0.1:8000");
  ASSERT_TRUE(hp.ok());
  EXPECT_EQ(hp->host, "127.0.0.1");
  EXPECT_EQ(hp->port, 8000);
  EXPECT_TRUE(ParseHostPort("node-1.example:65535").ok());
  EXPECT_EQ(ParseHostPort("127.0.0.1").status().message(), "\"127.0.0.1\" is not HOST:PORT");
  EXPECT_EQ(ParseHostPort("127.0.0.1:0").status().message(),
            "\"127.0.0.1:0\" has port 0; expected 1..65535");
  EXPECT_EQ(ParseHostPort("h:65536").status().message(),
            "\"h:65536\" has port 65536; expected 1..65535");
  EXPECT_EQ(ParseHostPort(":80").status().message(), "\":80\" has an empty host");
  EXPECT_EQ(ParseHostPort("256.1.1.1:80").status().message(),
            "\"256.1.1.1:80\" has host \"256.1.1.1\", which is not an IPv4 address or host name");
  EXPECT_FALSE(ParseHostPort("*:80").ok());
  EXPECT_FALSE(ParseHostPort("h:8o").ok());
  EXPECT_FALSE(ParseHostPort("bad host:80").ok());

  EXPECT_TRUE(ValidateZmqEndpoint("tcp://127.0.0.1:5555").ok());
  EXPECT_TRUE(ValidateZmqEndpoint("tcp://*:5555").ok());
  EXPECT_TRUE(ValidateZmqEndpoint("ipc:///tmp/a.sock").ok());
  EXPECT_EQ(ValidateZmqEndpoint("ipc://a.sock").message(),
            "\"ipc://a.sock\" does not name an absolute path; expected ipc:///absolute/path");
  EXPECT_EQ(ValidateZmqEndpoint("inproc://x").message(),
            "\"inproc://x\" is not tcp://HOST:PORT or ipc:///absolute/path");
  EXPECT_EQ(ValidateZmqEndpoint("tcp://h:99999").message(),
            "\"tcp://h:99999\" has port 99999; expected 1..65535");
  EXPECT_FALSE(ValidateZmqEndpoint("ipc:///" + std::string(200, 'a')).ok());
}

// ---- invalid manifests ----

struct BadCase {
  const char* name;
  std::string yaml;
  std::string message;  // Exact message of the kInvalidArgument status.
};

// kMinimal with `extra` appended at the top level.
std::string Minimal(const std::string& extra) { return std::string(kMinimal) + extra; }

// A manifest with one group whose body (after "- ") is `group`.
std::string OneGroup(const std::string& group) {
  return "model: {path: m}\nworker_groups:\n  - " + group + "\n";
}

std::vector<BadCase> BadCases() {
  const std::string groups_top =
      "model, map_service, worker_groups, router, heartbeat, logging, launcher, security";
  const std::string policies =
      "fmoe, fmoe-traj, fmoe-traj-sem, fmoe-pfreq, fmoe-nextuse, moe-infinity, speculative, "
      "on-demand, "
      "lru, lfu";
  return {
      {"CudaX", OneGroup("{name: g, workers: [{device: cuda:0}, {device: \"cuda:x\"}]}"),
       "manifest: worker_groups[0].workers[1].device: \"cuda:x\" is not cpu or cuda:N"},
      {"CudaNegative", OneGroup("{name: g, workers: [{device: cuda:-1}]}"),
       "manifest: worker_groups[0].workers[0].device: \"cuda:-1\" is not cpu or cuda:N"},
      {"UnknownTopLevelKey", Minimal("modle: {}\n"),
       "manifest: modle: unknown key; allowed keys: " + groups_top},
      {"UnknownNestedKey", Minimal("launcher: {restart: {max_backof_ms: 5}}\n"),
       "manifest: launcher.restart.max_backof_ms: unknown key; allowed keys: initial_backoff_ms, "
       "max_backoff_ms, max_restarts, window_s"},
      {"UnknownWorkerKey", OneGroup("{name: g, workers: [{device: cpu, gpu: 1}]}"),
       "manifest: worker_groups[0].workers[0].gpu: unknown key; allowed keys: device, host"},
      {"MapWhereScalarExpected", Minimal("router: {listen: {host: a}}\n"),
       "manifest: router.listen: expected a string, got a map"},
      {"ScalarWhereMapExpected", Minimal("heartbeat: 5\n"),
       "manifest: heartbeat: expected a map, got scalar \"5\""},
      {"SectionWithoutValue", Minimal("heartbeat:\n"),
       "manifest: heartbeat: has no value; expected a map"},
      {"StringForInt", Minimal("map_service: {store_capacity: abc}\n"),
       "manifest: map_service.store_capacity: \"abc\" is not an integer"},
      {"FractionForInt", Minimal("map_service: {prefetch_distance: 1.5}\n"),
       "manifest: map_service.prefetch_distance: \"1.5\" is not an integer"},
      {"QuotedInt", Minimal("map_service: {prefetch_distance: \"4\"}\n"),
       "manifest: map_service.prefetch_distance: \"4\" is a quoted string; expected an integer"},
      {"ServicesWaitNegative", Minimal("launcher: {services_wait_s: -1}\n"),
       "manifest: launcher.services_wait_s: -1 is out of range 0..86400"},
      {"IntOverflow", Minimal("heartbeat: {interval_ms: 99999999999}\n"),
       "manifest: heartbeat.interval_ms: 99999999999 is out of range 10..60000"},
      {"Int64Overflow", Minimal("router: {max_body_bytes: 99999999999999999999999}\n"),
       "manifest: router.max_body_bytes: 99999999999999999999999 is out of range "
       "1024..268435456"},
      {"BoolYes", Minimal("map_service: {sync: yes}\n"),
       "manifest: map_service.sync: \"yes\" is not a boolean; use true or false"},
      {"BoolQuoted", Minimal("map_service: {sync: \"true\"}\n"),
       "manifest: map_service.sync: \"true\" is a quoted string; expected true or false"},
      {"IntOutOfRange", OneGroup("{name: g, max_batch: 0, workers: [{}]}"),
       "manifest: worker_groups[0].max_batch: 0 is out of range 1..1024"},
      {"BudgetBelowMaxBatch",
       OneGroup("{name: g, max_batch: 16, max_batched_tokens: 8, workers: [{}]}"),
       "manifest: worker_groups[0].max_batched_tokens: 8 is below max_batch 16 (each running "
       "request needs a token of every step); 0 = no budget"},
      {"BudgetOutOfRange", OneGroup("{name: g, max_batched_tokens: -1, workers: [{}]}"),
       "manifest: worker_groups[0].max_batched_tokens: -1 is out of range 0..1048576"},
      {"PrefillStreamUnknown", OneGroup("{name: g, prefill_stream: always, workers: [{}]}"),
       "manifest: worker_groups[0].prefill_stream: \"always\" is not one of off, auto, on"},
      {"PrefillStreamSlotsOutOfRange",
       OneGroup("{name: g, prefill_stream_slots: 70000, workers: [{}]}"),
       "manifest: worker_groups[0].prefill_stream_slots: 70000 is out of range 0..65536"},
      {"ChunkOverheadOutOfRange", OneGroup("{name: g, chunk_overhead: -0.5, workers: [{}]}"),
       "manifest: worker_groups[0].chunk_overhead: -0.5 is out of range [0, 1000]"},
      {"DoubleOutOfRange", OneGroup("{name: g, link: {gbps: 0}, workers: [{}]}"),
       "manifest: worker_groups[0].link.gbps: 0 is out of range (0, 10000]"},
      {"FractionAboveOne", OneGroup("{name: g, expert_cache_fraction: 1.5, workers: [{}]}"),
       "manifest: worker_groups[0].expert_cache_fraction: 1.5 is out of range (0, 1]"},
      {"SignedTwice", OneGroup("{name: g, link: {gbps: +-1}, workers: [{}]}"),
       "manifest: worker_groups[0].link.gbps: \"+-1\" is not a finite number"},
      {"NotANumber", Minimal("router: {request_timeout_s: .nan}\n"),
       "manifest: router.request_timeout_s: \".nan\" is not a finite number"},
      {"MissingModelPath", "model: {name: x}\nworker_groups: [{name: g, workers: [{}]}]\n",
       "manifest: model.path: required key is missing"},
      {"MissingModel", "worker_groups: [{name: g, workers: [{}]}]\n",
       "manifest: model: required key is missing"},
      {"MissingWorkerGroups", "model: {path: m}\n",
       "manifest: worker_groups: required key is missing"},
      {"MissingGroupName", OneGroup("{workers: [{}]}"),
       "manifest: worker_groups[0].name: required key is missing"},
      {"MissingWorkers", OneGroup("{name: g}"),
       "manifest: worker_groups[0].workers: required key is missing"},
      {"EmptyWorkerGroups", "model: {path: m}\nworker_groups: []\n",
       "manifest: worker_groups: must not be empty"},
      {"EmptyWorkers", OneGroup("{name: g, workers: []}"),
       "manifest: worker_groups[0].workers: must not be empty"},
      {"EmptyString", "model: {path: \"\"}\nworker_groups: [{name: g, workers: [{}]}]\n",
       "manifest: model.path: must not be empty"},
      {"DuplicateGroupName",
       "model: {path: m}\nworker_groups:\n  - {name: g, workers: [{}]}\n"
       "  - {name: g, workers: [{}]}\n",
       "manifest: worker_groups[1].name: \"g\" is already used by worker_groups[0]"},
      {"InvalidGroupName", OneGroup("{name: \"a b\", workers: [{}]}"),
       "manifest: worker_groups[0].name: \"a b\" does not match [A-Za-z0-9_-]{1,32}"},
      {"GroupNameTooLong", OneGroup("{name: " + std::string(33, 'a') + ", workers: [{}]}"),
       "manifest: worker_groups[0].name: \"" + std::string(33, 'a') +
           "\" does not match [A-Za-z0-9_-]{1,32}"},
      {"BadPolicy", OneGroup("{name: g, policy: belady, workers: [{}]}"),
       "manifest: worker_groups[0].policy: \"belady\" is not a policy; valid policies: " +
           policies},
      {"OraclePolicy", OneGroup("{name: g, policy: oracle, workers: [{}]}"),
       "manifest: worker_groups[0].policy: \"oracle\" is replay-only (it needs perfect knowledge "
       "of the future) and cannot be served; valid policies: " +
           policies},
      {"BothCacheKeys",
       OneGroup("{name: g, expert_cache_gb: 1, expert_cache_fraction: 0.5, workers: [{}]}"),
       "manifest: worker_groups[0]: expert_cache_gb and expert_cache_fraction are both set; set "
       "at most one"},
      {"MixedDevices", OneGroup("{name: g, workers: [{device: cpu}, {device: cuda:0}]}"),
       "manifest: worker_groups[0].workers[1].device: \"cuda:0\" mixes cpu and cuda devices in "
       "one group; workers[0] is \"cpu\""},
      {"SameCudaTwice",
       OneGroup("{name: g, workers: [{device: cuda:1, host: localhost}, {device: cuda:0}, "
                "{device: cuda:1, host: LOCALHOST}]}"),
       "manifest: worker_groups[0].workers[2].device: \"cuda:1\" on host LOCALHOST is already "
       "used by workers[0]"},
      {"BadWorkerHost", OneGroup("{name: g, workers: [{host: \"no such host\"}]}"),
       "manifest: worker_groups[0].workers[0].host: \"no such host\" is not an IPv4 address or "
       "host name"},
      {"BadZmqEndpoint", Minimal("map_service: {endpoint: \"tcp://127.0.0.1\"}\n"),
       "manifest: map_service.endpoint: \"tcp://127.0.0.1\" is not HOST:PORT"},
      {"BadZmqScheme", Minimal("router: {worker_endpoint: \"udp://h:1\"}\n"),
       "manifest: router.worker_endpoint: \"udp://h:1\" is not tcp://HOST:PORT or "
       "ipc:///absolute/path"},
      {"BadListen", Minimal("router: {listen: \"127.0.0.1:0\"}\n"),
       "manifest: router.listen: \"127.0.0.1:0\" has port 0; expected 1..65535"},
      {"CollectiveTimeoutZero", OneGroup("{name: g, collective_timeout_s: 0, workers: [{}]}"),
       "manifest: worker_groups[0].collective_timeout_s: 0 is out of range (0, 3600]"},
      {"CollectiveTimeoutNegative", OneGroup("{name: g, collective_timeout_s: -5, workers: [{}]}"),
       "manifest: worker_groups[0].collective_timeout_s: -5 is out of range (0, 3600]"},
      {"CollectiveTimeoutTooLong",
       OneGroup("{name: g, collective_timeout_s: 3600.5, workers: [{}]}"),
       "manifest: worker_groups[0].collective_timeout_s: 3600.5 is out of range (0, 3600]"},
      {"CollectiveTimeoutNotANumber",
       OneGroup("{name: g, collective_timeout_s: 60s, workers: [{}]}"),
       "manifest: worker_groups[0].collective_timeout_s: \"60s\" is not a finite number"},
      {"CollectiveTimeoutQuoted",
       OneGroup("{name: g, collective_timeout_s: \"60\", workers: [{}]}"),
       "manifest: worker_groups[0].collective_timeout_s: \"60\" is a quoted string; expected a "
       "number"},
      {"RendezvousTimeoutZero", OneGroup("{name: g, rendezvous_timeout_s: 0, workers: [{}]}"),
       "manifest: worker_groups[0].rendezvous_timeout_s: 0 is out of range (0, 3600]"},
      {"RendezvousTimeoutTooLong",
       "model: {path: m}\nworker_groups:\n  - {name: a, workers: [{}]}\n"
       "  - {name: b, rendezvous_timeout_s: 7200, workers: [{}]}\n",
       "manifest: worker_groups[1].rendezvous_timeout_s: 7200 is out of range (0, 3600]"},
      {"RendezvousTimeoutNotANumber",
       OneGroup("{name: g, rendezvous_timeout_s: [1], workers: [{}]}"),
       "manifest: worker_groups[0].rendezvous_timeout_s: expected a number, got a sequence"},
      {"RendezvousTimeoutInfinite",
       OneGroup("{name: g, rendezvous_timeout_s: .inf, workers: [{}]}"),
       "manifest: worker_groups[0].rendezvous_timeout_s: \".inf\" is not a finite number"},
      {"RendezvousTimeoutWithoutValue",
       "model: {path: m}\nworker_groups:\n  - name: g\n    rendezvous_timeout_s:\n"
       "    workers: [{}]\n",
       "manifest: worker_groups[0].rendezvous_timeout_s: has no value; expected a number"},
      {"UnknownGroupKey", OneGroup("{name: g, collective_timeout: 5, workers: [{}]}"),
       "manifest: worker_groups[0].collective_timeout: unknown key; allowed keys: name, policy, "
       "max_batch, max_batched_tokens, chunk_overhead, prefill_stream, prefill_stream_slots, "
       "queue_limit, kv_cache_tokens, "
       "prefix_caching, "
       "expert_cache_gb, expert_cache_fraction, "
       "memory_utilization, memory, host_cache_gb, host_cache_fraction, link, "
       "hybrid, rendezvous, "
       "collective_timeout_s, rendezvous_timeout_s, record_trace, workers"},
      {"RecordTraceEmpty", OneGroup("{name: g, record_trace: \"\", workers: [{}]}"),
       "manifest: worker_groups[0].record_trace: must not be empty"},
      {"RecordTraceNotAString", OneGroup("{name: g, record_trace: [a.trc], workers: [{}]}"),
       "manifest: worker_groups[0].record_trace: expected a string, got a sequence"},
      {"RecordTraceWithoutValue",
       "model: {path: m}\nworker_groups:\n  - name: g\n    record_trace:\n    workers: [{}]\n",
       "manifest: worker_groups[0].record_trace: has no value; expected a string"},
      {"RecordTraceDirectory", OneGroup("{name: g, record_trace: traces/, workers: [{}]}"),
       "manifest: worker_groups[0].record_trace: \"traces/\" names a directory; expected a file"},
      {"RecordTraceTilde", OneGroup("{name: g, record_trace: ~/t.trc, workers: [{}]}"),
       "manifest: worker_groups[0].record_trace: \"~/t.trc\": '~' is not expanded; give an "
       "absolute path or one relative to the manifest's directory"},
      {"RecordTraceSharedByTwoGroups",
       "model: {path: m}\nworker_groups:\n  - {name: a, record_trace: t.trc, workers: [{}]}\n"
       "  - {name: b, record_trace: ./x/../t.trc, workers: [{}]}\n",
       "manifest: worker_groups[1].record_trace: \"/srv/cluster/t.trc\" is already used by "
       "worker_groups[0].record_trace"},
      {"BadRendezvous", OneGroup("{name: g, rendezvous: \"h:x\", workers: [{}]}"),
       "manifest: worker_groups[0].rendezvous: \"h:x\" has port \"x\"; expected a number "
       "1..65535"},
      {"PortCollision", Minimal("router: {listen: \"localhost:5555\"}\n"),
       "manifest: router.listen: \"localhost:5555\" uses the same port as map_service.endpoint "
       "(\"tcp://127.0.0.1:5555\", the default)"},
      {"WildcardPortCollision", Minimal("router: {worker_endpoint: \"tcp://*:29500\"}\n"),
       "manifest: worker_groups[0].rendezvous: \"127.0.0.1:29500\" (the default) uses the same "
       "port as router.worker_endpoint (\"tcp://*:29500\")"},
      {"IpcCollision",
       Minimal("map_service: {endpoint: \"ipc:///run/a\"}\n"
               "router: {worker_endpoint: \"ipc:///run/a\"}\n"),
       "manifest: router.worker_endpoint: \"ipc:///run/a\" uses the same ipc path as "
       "map_service.endpoint (\"ipc:///run/a\")"},
      {"HeartbeatTimeoutTooSmall", Minimal("heartbeat: {interval_ms: 1000, timeout_ms: 1999}\n"),
       "manifest: heartbeat.timeout_ms: 1999 is less than 2 * interval_ms = 2000"},
      {"HeartbeatDefaultTimeoutTooSmall", Minimal("heartbeat: {interval_ms: 2000}\n"),
       "manifest: heartbeat.timeout_ms: 3000 (the default) is less than 2 * interval_ms = 4000"},
      {"BackoffInverted",
       Minimal("launcher: {restart: {initial_backoff_ms: 2000, max_backoff_ms: 1000}}\n"),
       "manifest: launcher.restart.max_backoff_ms: 1000 is less than initial_backoff_ms = 2000"},
      {"ApiKeyTooShort", Minimal("router: {api_keys: [short]}\n"),
       "manifest: router.api_keys[0]: has 5 characters; a key has 8..256 printable characters"},
      {"ApiKeyTooLong", Minimal("router: {api_keys: [" + std::string(257, 'k') + "]}\n"),
       "manifest: router.api_keys[0]: has 257 characters; a key has 8..256 printable characters"},
      {"ApiKeyNotPrintable", Minimal("router: {api_keys: [\"abcdefgh\", \"abcd\\tefgh\"]}\n"),
       "manifest: router.api_keys[1]: character 4 is not printable ASCII (spaces are not "
       "allowed)"},
      {"CorsOriginWithPath", Minimal("router: {cors_allowed_origins: [\"https://a.b/c\"]}\n"),
       "manifest: router.cors_allowed_origins[0]: \"https://a.b/c\" is not an origin "
       "(http[s]://host[:port], no path) or \"*\""},
      {"CorsOriginNotSequence", Minimal("router: {cors_allowed_origins: \"*\"}\n"),
       "manifest: router.cors_allowed_origins: expected a sequence, got scalar \"*\""},
      {"ApiKeysNotSequence", Minimal("router: {api_keys: abcdefghij}\n"),
       "manifest: router.api_keys: expected a sequence, got scalar \"abcdefghij\""},
      {"BadDtype", "model: {path: m, dtype: fp8}\nworker_groups: [{name: g, workers: [{}]}]\n",
       "manifest: model.dtype: \"fp8\" is not one of auto, float32, bfloat16, float16"},
      {"BadLogLevel", Minimal("logging: {level: verbose}\n"),
       "manifest: logging.level: \"verbose\" is not one of trace, debug, info, warn, error"},
      {"TildePath", "model: {path: ~/m}\nworker_groups: [{name: g, workers: [{}]}]\n",
       "manifest: model.path: \"~/m\": '~' is not expanded; give an absolute path or one relative "
       "to the manifest's directory"},
      {"RootPathHasNoName", "model: {path: /}\nworker_groups: [{name: g, workers: [{}]}]\n",
       "manifest: model.path: \"/\" has no base name to serve it under; set model.name"},
      {"DuplicateKey", "model: {path: m}\nmodel: {path: n}\n",
       "manifest: model: key is given twice"},
      {"DuplicateNestedKey", OneGroup("{name: g, name: h, workers: [{}]}"),
       "manifest: worker_groups[0].name: key is given twice"},
      {"NonScalarKey", Minimal("? [a, b]\n: 1\n"),
       "manifest: top level: keys must be strings, got a sequence"},
      {"TooManyWorkers",
       [] {
         std::string w = "{name: g, workers: [";
         for (int i = 0; i < 65; ++i) w += "{},";
         w.back() = ']';
         return OneGroup(w + "}");
       }(),
       "manifest: worker_groups[0].workers: has 65 workers; at most 64 are allowed"},
      {"WorkerGroupsNotSequence", "model: {path: m}\nworker_groups: {name: g}\n",
       "manifest: worker_groups: expected a sequence, got a map"},
      {"SyntaxError", "model:\n  path: m\nworker_groups: [{name: g, workers: [{}]}\n",
       "manifest: line 4, column 1: end of sequence flow not found"},
      {"SyntaxErrorMidFile", "model:\n  path: m\nrouter: {listen: [}\nlogging: {}\n",
       "manifest: line 3, column 19: illegal flow end"},
      {"BadIndentation", "model:\n  path: m\n    name: x\n",
       "manifest: line 3, column 9: illegal map value"},
      {"EmptyDocument", "",
       "manifest: top level: the document is empty; expected a map with keys " + groups_top},
      {"OnlyComments", "# nothing here\n\n",
       "manifest: top level: the document is empty; expected a map with keys " + groups_top},
      {"NonMapDocument", "- a\n- b\n", "manifest: top level: expected a map, got a sequence"},
      {"ScalarDocument", "hello\n", "manifest: top level: expected a map, got scalar \"hello\""},
      {"TwoDocuments", std::string(kMinimal) + "---\n" + kMinimal,
       "manifest: top level: found 2 YAML documents; expected one"},
  };
}

// Keeps gtest from printing the struct's bytes.
void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

class BadManifest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadManifest, IsRejectedWithKeyPath) {
  const BadCase& c = GetParam();
  SCOPED_TRACE(c.yaml);
  Result<Manifest> m = ParseManifest(c.yaml, kBase);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(m.status().message(), c.message);
}

INSTANTIATE_TEST_SUITE_P(Manifest, BadManifest, ::testing::ValuesIn(BadCases()),
                         [](const ::testing::TestParamInfo<BadCase>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace fmoe

namespace fmoe {
namespace {

TEST(Manifest, HybridIsOffAutoOrAMap) {
  auto m = ParseManifest(R"(model: {path: /m}
worker_groups:
  - {name: g0, workers: [{}]}
  - {name: g1, hybrid: off, workers: [{}]}
  - {name: g2, hybrid: auto, workers: [{}]}
  - {name: g3, hybrid: {cpu_threads: 12}, workers: [{}]}
  - {name: g4, hybrid: {host_slowdown: 4}, workers: [{}]}
)",
                         "/etc/fmoe.yaml");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const auto& g = m->worker_groups;
  EXPECT_FALSE(g[0].hybrid.enabled) << "the default";
  EXPECT_FALSE(g[1].hybrid.enabled);
  EXPECT_TRUE(g[2].hybrid.enabled);
  EXPECT_EQ(g[2].hybrid.cpu_threads, 0);
  EXPECT_TRUE(g[3].hybrid.enabled);
  EXPECT_EQ(g[3].hybrid.cpu_threads, 12);
  EXPECT_EQ(g[3].hybrid.host_slowdown, 1.0);
  EXPECT_EQ(g[4].hybrid.host_slowdown, 4.0);
  const std::string described = DescribeManifest(*m);
  auto again = ParseManifest(described, "/etc/fmoe.yaml");
  ASSERT_TRUE(again.ok()) << again.status().ToString() << "\n" << described;
  ExpectManifestEq(*m, *again);

  const std::pair<const char*, const char*> bad[] = {
      {"hybrid: on",
       "manifest: worker_groups[0].hybrid: \"on\" is not off, auto or a map of "
       "cpu_threads and host_slowdown"},
      {"hybrid: {cpu_threads: 0}",
       "manifest: worker_groups[0].hybrid.cpu_threads: 0 is out of range 1..1024"},
      {"hybrid: {host_slowdown: 0.5}",
       "manifest: worker_groups[0].hybrid.host_slowdown: 0.5 is out of range [1, 1e+06]"},
      {"hybrid: {threads: 4}", "manifest: worker_groups[0].hybrid.threads: unknown key"},
      {"hybrid: [auto]", "manifest: worker_groups[0].hybrid:"},
  };
  for (const auto& [text, error] : bad) {
    auto r = ParseManifest(std::string("model: {path: /m}\nworker_groups:\n  - name: g0\n    ") +
                               text + "\n    workers: [{}]\n",
                           "/etc/fmoe.yaml");
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().message().rfind(error, 0), 0u) << text << ": " << r.status().message();
  }
}

TEST(Manifest, ExpertCacheAutoSizesFromFreeMemory) {
  auto m = ParseManifest(R"(model: {path: /m}
worker_groups:
  - name: g0
    expert_cache_gb: auto
    memory_utilization: 0.8
    workers: [{}]
  - name: g1
    expert_cache_gb: auto
    workers: [{}]
)",
                         "/etc/fmoe.yaml");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const WorkerGroupSpec& g0 = m->worker_groups[0];
  EXPECT_TRUE(g0.expert_cache_auto);
  EXPECT_EQ(g0.memory_utilization, 0.8);
  EXPECT_FALSE(g0.expert_cache_gb.has_value());
  EXPECT_FALSE(g0.expert_cache_fraction.has_value());
  EXPECT_EQ(m->worker_groups[1].memory_utilization, 0.9) << "the default";
  const std::string described = DescribeManifest(*m);
  EXPECT_NE(described.find("expert_cache_gb: auto"), std::string::npos) << described;
  EXPECT_NE(described.find("memory_utilization: 0.8"), std::string::npos) << described;
  auto again = ParseManifest(described, "/etc/fmoe.yaml");
  ASSERT_TRUE(again.ok()) << again.status().ToString() << "\n" << described;
  EXPECT_TRUE(again->worker_groups[0].expert_cache_auto);

  for (const char* bad :
       {"expert_cache_fraction: 0.5\n    memory_utilization: 0.8",
        "expert_cache_gb: auto\n    memory_utilization: 1.5", "expert_cache_gb: automatic"}) {
    auto r = ParseManifest(std::string("model: {path: /m}\nworker_groups:\n  - name: g0\n    ") +
                               bad + "\n    workers: [{}]\n",
                           "/etc/fmoe.yaml");
    EXPECT_FALSE(r.ok()) << bad;
  }
  auto only = ParseManifest(
      "model: {path: /m}\nworker_groups:\n  - name: g0\n    memory_utilization: 0.8\n"
      "    workers: [{}]\n",
      "/etc/fmoe.yaml");
  ASSERT_FALSE(only.ok());
  EXPECT_NE(only.status().message().find("applies only with expert_cache_gb: auto"),
            std::string::npos)
      << only.status().message();
}

TEST(Manifest, OneDeviceBudgetForKvAndExperts) {
  auto m = ParseManifest(R"(model: {path: /m}
worker_groups:
  - name: g0
    memory: {device_gb: 70, kv_floor: 0.2, expert_floor: 0.3, return_hold_s: 2.5}
    workers: [{device: cuda:0}]
  - name: g1
    memory: {}
    workers: [{}]
)",
                         "/etc/fmoe.yaml");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const WorkerGroupSpec& g0 = m->worker_groups[0];
  ASSERT_TRUE(g0.memory.has_value());
  EXPECT_EQ(g0.memory->device_gb, 70.0);
  EXPECT_EQ(g0.memory->kv_floor, 0.2);
  EXPECT_EQ(g0.memory->expert_floor, 0.3);
  EXPECT_EQ(g0.memory->return_hold_s, 2.5);
  EXPECT_FALSE(g0.expert_cache_fraction.has_value());
  const WorkerGroupSpec& g1 = m->worker_groups[1];
  ASSERT_TRUE(g1.memory.has_value());
  EXPECT_FALSE(g1.memory->device_gb.has_value());
  EXPECT_EQ(g1.memory->device_fraction, 0.9) << "the default";
  EXPECT_EQ(g1.memory->kv_floor, 0.1);
  EXPECT_EQ(g1.memory->return_hold_s, 0.0);
  const std::string described = DescribeManifest(*m);
  auto again = ParseManifest(described, "/etc/fmoe.yaml");
  ASSERT_TRUE(again.ok()) << again.status().ToString() << "\n" << described;
  ExpectManifestEq(*m, *again);

  const std::pair<const char*, const char*> bad[] = {
      {"memory: {device_gb: 8}\n    expert_cache_fraction: 0.5",
       "expert_cache_fraction cannot be set with it"},
      {"memory: {device_gb: 8}\n    kv_cache_tokens: 4096",
       "kv_cache_tokens cannot be set with it"},
      {"memory: {device_gb: 8, device_fraction: 0.5}", "device_gb and device_fraction are both"},
      {"memory: {kv_floor: 0.6, expert_floor: 0.6}", "exceed 1"},
      {"memory: {kv_floor: 1}", "worker_groups[0].memory.kv_floor"},
      {"memory: {device_gb: 0}", "worker_groups[0].memory.device_gb"},
      {"memory: {return_hold_s: -1}", "worker_groups[0].memory.return_hold_s"},
      {"memory: {budget: 3}", "worker_groups[0].memory.budget: unknown key"},
      {"memory: 8", "worker_groups[0].memory: expected a map"},
  };
  for (const auto& [text, error] : bad) {
    auto r = ParseManifest(std::string("model: {path: /m}\nworker_groups:\n  - name: g0\n    ") +
                               text + "\n    workers: [{}]\n",
                           "/etc/fmoe.yaml");
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_NE(r.status().message().find(error), std::string::npos)
        << text << ": " << r.status().message();
  }
  // A group of several ranks: each has the budget (the group agrees on its KV pool's pages).
  auto two = ParseManifest(
      "model: {path: /m}\nworker_groups:\n  - name: g0\n    memory: {device_gb: 8}\n"
      "    workers: [{}, {}]\n",
      "/etc/fmoe.yaml");
  ASSERT_TRUE(two.ok()) << two.status().message();
  ASSERT_TRUE(two->worker_groups[0].memory.has_value());
  EXPECT_EQ(two->worker_groups[0].memory->device_gb, 8.0);
}

TEST(Manifest, KvPoolAndToolCallParserKeys) {
  auto m = ParseManifest(R"(model: {path: /m}
router: {tool_call_parser: qwen3_coder}
worker_groups:
  - {name: g0, kv_cache_tokens: 65536, prefix_caching: false, workers: [{}]}
  - {name: g1, workers: [{}]}
)",
                         "/etc/fmoe.yaml");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->router.tool_call_parser, "qwen3_coder");
  EXPECT_EQ(m->worker_groups[0].kv_cache_tokens, 65536);
  EXPECT_FALSE(m->worker_groups[0].prefix_caching);
  EXPECT_EQ(m->worker_groups[1].kv_cache_tokens, 0) << "the default pool";
  EXPECT_TRUE(m->worker_groups[1].prefix_caching);
  auto again = ParseManifest(DescribeManifest(*m), "/etc/fmoe.yaml");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  ExpectManifestEq(*m, *again);
  for (const auto& [yaml, message] : std::vector<std::pair<std::string, std::string>>{
           {"worker_groups:\n  - {name: g0, kv_cache_tokens: 8, workers: [{}]}\n",
            "worker_groups[0].kv_cache_tokens"},
           {"worker_groups:\n  - {name: g0, prefix_caching: sometimes, workers: [{}]}\n",
            "worker_groups[0].prefix_caching"},
           {"router: {tool_call_parser: llama3_json}\nworker_groups:\n  - {name: g0, workers: "
            "[{}]}\n",
            "router.tool_call_parser: \"llama3_json\" is not a tool-call format; one of none, "
            "hermes"}}) {
    auto r = ParseManifest("model: {path: /m}\n" + yaml, "/etc/fmoe.yaml");
    ASSERT_FALSE(r.ok()) << yaml;
    EXPECT_NE(r.status().message().find(message), std::string::npos) << r.status().ToString();
  }
}

TEST(Manifest, StoredResponsesKeys) {
  auto m = ParseManifest(R"(model: {path: /m}
router: {responses_capacity: 50, responses_dir: state/responses}
worker_groups:
  - {name: g0, workers: [{}]}
)",
                         "/etc/fmoe");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->router.responses_capacity, 50);
  EXPECT_EQ(m->router.responses_dir, "/etc/fmoe/state/responses");
  auto again = ParseManifest(DescribeManifest(*m), "/etc/fmoe");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  ExpectManifestEq(*m, *again);
  auto plain = ParseManifest("model: {path: /m}\nworker_groups:\n  - {name: g0, workers: [{}]}\n",
                             "/etc/fmoe.yaml");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->router.responses_capacity, 1024);
  EXPECT_TRUE(plain->router.responses_dir.empty()) << "in memory only by default";
  for (const auto& [yaml, message] : std::vector<std::pair<std::string, std::string>>{
           {"router: {responses_capacity: 0}\n", "router.responses_capacity"},
           {"router: {responses_dir: \"\"}\n", "router.responses_dir: must not be empty"},
           {"router: {responses_dir: ~/r}\n", "'~' is not expanded"}}) {
    auto r = ParseManifest(
        "model: {path: /m}\n" + yaml + "worker_groups:\n  - {name: g0, workers: [{}]}\n",
        "/etc/fmoe.yaml");
    ASSERT_FALSE(r.ok()) << yaml;
    EXPECT_NE(r.status().message().find(message), std::string::npos) << r.status().ToString();
  }
}

TEST(Manifest, HostCacheLeavesExpertsOnDisk) {
  auto m = ParseManifest(R"(model: {path: /m}
worker_groups:
  - {name: g0, host_cache_gb: 12.5, workers: [{}]}
  - {name: g1, host_cache_gb: auto, workers: [{}]}
  - {name: g2, host_cache_fraction: 0.25, workers: [{}]}
  - {name: g3, workers: [{}]}
)",
                         "/etc/fmoe.yaml");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->worker_groups[0].host_cache_gb, 12.5);
  EXPECT_TRUE(m->worker_groups[1].host_cache_auto);
  EXPECT_EQ(m->worker_groups[2].host_cache_fraction, 0.25);
  const WorkerGroupSpec& none = m->worker_groups[3];
  EXPECT_FALSE(none.host_cache_gb || none.host_cache_fraction || none.host_cache_auto);
  auto again = ParseManifest(DescribeManifest(*m), "/etc/fmoe.yaml");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  ExpectManifestEq(*m, *again);
  for (const char* bad : {"host_cache_gb: 0", "host_cache_gb: lots", "host_cache_fraction: 1.5",
                          "host_cache_gb: 4, host_cache_fraction: 0.5"}) {
    auto r = ParseManifest(std::string("model: {path: /m}\nworker_groups:\n  - {name: g0, ") + bad +
                               ", workers: [{}]}\n",
                           "/etc/fmoe.yaml");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("host_cache"), std::string::npos) << r.status().message();
  }
}

}  // namespace
}  // namespace fmoe
