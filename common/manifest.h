// The cluster manifest (DESIGN section 9): YAML loaded into plain structs with strict validation.
// Unknown keys, wrong types and out-of-range values are rejected with the key's path, e.g.
//   manifest: worker_groups[0].workers[1].device: "cuda:x" is not cpu or cuda:N
// Relative paths in the file are resolved against the manifest's own directory. Pure functions;
// no threads, no global state. yaml-cpp is used only in manifest.cc.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace fmoe {

struct HostPort {
  std::string host;  // IPv4 literal or host name, e.g. "127.0.0.1".
  uint16_t port = 0;
};

// Parses "HOST:PORT" (PORT 1..65535). Errors name the text.
Result<HostPort> ParseHostPort(std::string_view text);
// Accepts "tcp://HOST:PORT" (PORT 1..65535) or "ipc:///absolute/path".
Status ValidateZmqEndpoint(std::string_view endpoint);

struct ModelSpec {
  std::string path;  // Required. Hugging Face model directory (absolute after load).
  std::string name;  // Served model id. Default: the directory's base name.
  // Compute dtype: auto | float32 | bfloat16 | float16. auto: the checkpoint's torch_dtype
  // (bfloat16 or float16) on cuda ranks, float32 on cpu ranks and in a group mixing the two.
  // Default: auto
  std::string dtype = "auto";
};

struct MapServiceSpec {
  std::string endpoint = "tcp://127.0.0.1:5555";  // ZMQ ROUTER bind. Default: tcp://127.0.0.1:5555
  std::string
      data_dir;  // RocksDB directory (absolute after load). Default: <manifest dir>/.fmoe/maps
  int store_capacity = 1000;  // Maps kept per model, 1..1000000. Default: 1000
  int prefetch_distance = 3;  // d, 1..16. Default: 3
  bool sync = false;          // fsync every RocksDB write. Default: false
  // Memory all models' expert map stores may take together (store_capacity x (16 + 6 h +
  // 8 L J + 16 L) bytes each), 16..1048576: a model beyond it is refused. Default: 4096
  int memory_limit_mb = 4096;
};

struct LinkSpec {            // Emulated host-to-device link for cpu workers (DESIGN section 2).
  double gbps = 16.0;        // (0, 10000]. Default: 16
  double latency_us = 10.0;  // [0, 1000000]. Default: 10
};

// Hybrid execution: a rank runs a missing expert on its host CPU instead of loading
// it when that finishes the layer sooner. Manifest: `hybrid: off` (the default) | `auto` (on,
// LibTorch's thread count) | a map of the keys below (on).
struct HybridSpec {
  bool enabled = false;  // Default: off
  // Host threads for expert runs on cuda ranks (LibTorch's intra-op pool), 1..1024; 0 = leave
  // LibTorch's default. cpu ranks keep their compute threads. Default: 0
  int cpu_threads = 0;
  // cpu ranks: the emulated host compute rate, a host run takes this many times its real time,
  // [1, 1000000] (as link.gbps paces the emulated link). Default: 1
  double host_slowdown = 1.0;
};

struct WorkerSpec {
  std::string device = "cpu";      // "cpu" or "cuda:N". Default: cpu
  int cuda_index = -1;             // N of cuda:N; -1 for cpu. Derived at load.
  std::string host = "127.0.0.1";  // Host the rank runs on. Default: 127.0.0.1
};

// One device budget per rank shared by the expert cache and the paged KV pool (DESIGN section
// 14): the KV pool borrows the cache's slots as sequences need blocks and gives them back as
// they finish; each keeps its floor (a fraction of the budget, at least one expert's bytes).
struct MemorySpec {
  std::optional<double> device_gb;  // (0, 100000]: the budget in 1e9 bytes; else
  double device_fraction = 0.9;     // (0, 1] of the device's free memory after the dense weights.
  double kv_floor = 0.1;            // [0, 1). Default: 0.1
  double expert_floor = 0.1;        // [0, 1); kv_floor + expert_floor <= 1. Default: 0.1
  // [0, 3600]: a page the KV pool borrowed goes back to the experts only once the pool has not
  // needed it for this long (0: as soon as a page of blocks is free). Default: 0
  double return_hold_s = 0.0;
};

struct WorkerGroupSpec {
  std::string name;  // Required, [A-Za-z0-9_-]{1,32}, unique across groups.
  // A servable name of common/policy_names.h (oracle is replay-only). Default: fmoe
  std::string policy = "fmoe";
  int max_batch = 8;  // Requests per iteration, 1..1024. Default: 8
  // Tokens one engine step runs (decode tokens first, then prompt chunks; a longer prompt is
  // prefilled in chunks); 0 = whole prompts at once, else max_batch..1048576. Default: the larger
  // of 512 and max_batch
  int max_batched_tokens = 512;
  // Expert-aware prefill chunks (gpu_worker/core/chunk_planner.h): a prompt chunk the budget
  // would cut grows (doubling, up to the rest of the prompt) while cutting the prompt at its size
  // is expected to make its prefill more than (1 + chunk_overhead) x its time whole, from the
  // expert loads each chunk repeats; 0 = chunks of the budget alone (always for models with
  // sliding-window layers, whose window pool the budget sizes). 0..1000. Default: 0.25
  double chunk_overhead = 0.25;
  // Long prefills bring each layer's missing experts through a buffer beside the expert cache,
  // loaded while the layer before computes, instead of into the cache (evicting the decode
  // working set) (DESIGN section 14, gpu_worker/core/chunk_planner.h): "off"; "auto", when the
  // engine's estimate says the iteration finishes sooner; "on", every iteration with prompt
  // tokens. The buffer is device memory beside the cache's budget (expert_cache_gb: auto and
  // memory.device_fraction size around it). Default: off
  std::string prefill_stream = "off";
  // The buffer's experts per rank, 1..65536; 0 = two layers of the experts the rank owns.
  // Default: 0
  int prefill_stream_slots = 0;
  int queue_limit = 64;  // Router admission queue for this group, 1..100000. Default: 64
  // Positions each rank's paged KV pool holds (common/model/model_config.h KvPoolTokens), 16..
  // 2^32; the router refuses a request whose prompt plus max_tokens exceed it. 0 = the
  // default: max(context, max_batch x min(context, 32768)). Default: 0
  int64_t kv_cache_tokens = 0;
  // Full KV blocks are shared by later requests that begin with the same tokens (groups of one
  // rank; models without sliding-window layers). Default: true
  bool prefix_caching = true;
  // Expert cache budget per rank: at most one of the two. Default: fraction 1.0 (all resident).
  // `expert_cache_gb: auto` (expert_cache_auto): each rank sizes its cache once its dense weights
  // are loaded, to memory_utilization x the free device memory (cpu: the host's available
  // memory) less a KV reserve of max_batch full contexts, at most every expert it owns.
  std::optional<double> expert_cache_gb;        // (0, 100000]
  std::optional<double> expert_cache_fraction;  // (0, 1]
  bool expert_cache_auto = false;
  double memory_utilization = 0.9;  // (0, 1], with expert_cache_gb: auto. Default: 0.9
  // One device budget for experts and KV (groups of one rank), instead of expert_cache_* and
  // kv_cache_tokens. Default: unset
  std::optional<MemorySpec> memory;
  // The host tier (DESIGN section 13): set, each rank leaves its experts in the checkpoint's
  // files and keeps a host cache of this budget in front of them, read from disk as needed; at
  // most one of the two. `host_cache_gb: auto` (host_cache_auto): every expert when they fit in
  // the host's available memory less 4 GiB, else what fits. Default: unset (every expert read
  // into host memory at start).
  std::optional<double> host_cache_gb;        // (0, 100000]
  std::optional<double> host_cache_fraction;  // (0, 1]
  bool host_cache_auto = false;
  LinkSpec link;
  HybridSpec hybrid;
  std::string rendezvous;  // c10d TCPStore HOST:PORT. Default: 127.0.0.1:(29500 + group index)
  // A collective of the group (per-layer all-reduce, iteration broadcast) that does not complete
  // within this time fails the group (every rank exits; the launcher restarts them together).
  double collective_timeout_s = 60;  // (0, 3600]. Default: 60
  // How long a rank waits at start for every rank of its group to join the rendezvous.
  double rendezvous_timeout_s = 120;  // (0, 3600]. Default: 120
  // The expert routing trace the group's leader writes (fmoe-worker --record-trace; a file path,
  // absolute after load, unique across groups). Default: "" (no trace)
  std::string record_trace;
  std::vector<WorkerSpec> workers;  // Required, 1..64 ranks; rank = index.
};

struct RouterSpec {
  std::string listen = "127.0.0.1:8000";                 // HTTP HOST:PORT. Default: 127.0.0.1:8000
  std::string worker_endpoint = "tcp://127.0.0.1:5556";  // ZMQ ROUTER bind for worker leaders.
  double request_timeout_s = 600;                        // (0, 86400]. Default: 600
  // At SIGTERM the router stops accepting and lets open requests finish for up to this long (or
  // request_timeout_s, if shorter); then every open stream ends with an error event and [DONE].
  // The launcher waits this long plus 5 s before it kills the router. [0, 3600]. Default: 30
  double drain_timeout_s = 30;
  int64_t max_body_bytes = 1 << 20;   // 1 KiB..256 MiB. Default: 1 MiB
  std::vector<std::string> api_keys;  // Bearer keys, each 8..256 printable chars. Default: none
  // Origins browsers may call from (CORS): "https://host[:port]", or "*" for any. Default: none
  // (CORS off)
  std::vector<std::string> cors_allowed_origins;
  // The tool-call format chat answers are parsed in (vLLM's --tool-call-parser): one of
  // kToolCallParsers; empty = the model family's (common/text/tool_calls.h). Default: empty
  std::string tool_call_parser;
  // The Responses API's kept responses (previous_response_id): how many, 1..1000000, least
  // recently used dropped past it; and the directory they are stored in across restarts
  // (RocksDB; absolute after load; one router per directory). Default: 1024, in memory only
  int responses_capacity = 1024;
  std::string responses_dir;
};

// The names router.tool_call_parser accepts (common/text/tool_calls.h ParseToolCallFormat's).
inline constexpr std::string_view kToolCallParsers[] = {
    "none",    "hermes", "qwen3_coder", "mistral", "deepseek_v3", "deepseek_v31", "deepseekv3",
    "kimi_k2", "glm45",  "glm4_moe",    "gpt_oss", "openai",      "minimax_m2"};

struct HeartbeatSpec {
  int interval_ms = 500;  // 10..60000. Default: 500
  int timeout_ms = 3000;  // >= 2 * interval_ms, <= 600000. Default: 3000
};

struct LoggingSpec {
  std::string level = "info";  // trace | debug | info | warn | error. Default: info
};

struct RestartSpec {
  int initial_backoff_ms = 500;  // 0..600000. Default: 500
  int max_backoff_ms = 10000;    // >= initial_backoff_ms, <= 600000. Default: 10000
  int max_restarts = 5;          // Crashes tolerated within window_s, 0..1000. Default: 5
  int window_s = 60;             // 1..86400. Default: 60
};

struct LauncherSpec {
  std::string run_dir;  // Logs and state (absolute after load). Default: <manifest dir>/.fmoe/run
  int ready_timeout_s = 120;  // Per process, 1..3600. Default: 120
  // SIGTERM then SIGKILL after this, 1..600 (the router: at least router.drain_timeout_s + 5).
  // Default: 10
  int stop_timeout_s = 10;
  // `fmoe launch --workers-only`: how long it waits for the map service and the router's worker
  // endpoint to accept connections before it starts its ranks, 0..86400 (0: no wait). The router
  // not reachable by then is an error (exit 1); the map service only a warning, since serving
  // needs no map. Default: 600
  int services_wait_s = 600;
  RestartSpec restart;
};

// Who may speak on the cluster's ZeroMQ sockets (common/wire/curve_key.h).
struct SecuritySpec {
  // Every tcp and ipc ZeroMQ socket between the cluster's processes authenticates with the
  // cluster key (CURVE): a peer without it cannot connect. Default: true
  bool curve = true;
  // The cluster key; `fmoe launch` writes a new one when it is missing (hosts of one cluster
  // hold copies of one file). Default: <launcher.run_dir>/cluster.key
  std::string key_file;
};

struct Manifest {
  std::string source_path;  // Absolute path of the file it was loaded from ("" if parsed).
  ModelSpec model;
  MapServiceSpec map_service;
  std::vector<WorkerGroupSpec> worker_groups;  // Required, 1..64 groups.
  RouterSpec router;
  HeartbeatSpec heartbeat;
  LoggingSpec logging;
  LauncherSpec launcher;
  SecuritySpec security;
};

// Reads and validates the file. Errors: kNotFound / kIoError when it cannot be read,
// kInvalidArgument with "manifest: <key path>: <what is wrong>" otherwise.
Result<Manifest> LoadManifest(const std::string& path);
// Same for text; relative paths resolve against base_dir (absolute).
Result<Manifest> ParseManifest(std::string_view yaml_text, const std::string& base_dir);

// The effective configuration as YAML, every key with its value (defaults included), for logs.
std::string DescribeManifest(const Manifest& manifest);

// Finds a group by name; nullptr if absent.
const WorkerGroupSpec* FindGroup(const Manifest& manifest, std::string_view name);

}  // namespace fmoe
