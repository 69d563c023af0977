// group_bench: decode TPOT and tokens/s of an expert-parallel group against its world size, and
// what each rank moves: the expert outputs and plans through the group's collectives (c10d;
// Gloo over loopback in cpu mode) and the experts over the (emulated) link. Each rank is its
// own process, as in a served group, forked before anything touches LibTorch, and assembled as a
// worker's rank is (gpu_worker/rank.h); rank 0 runs the engine (the leader), the others the
// follower loop; they join through a TCPStore on 127.0.0.1. Every configuration checks that the
// tokens equal world size 1's.
//
// With --rank R the process runs that one rank of one configuration (one value each of --worlds,
// --batch, --budget) and prints its result as one JSON line on stdout, binding Gloo to --host and
// joining rank 0's TCPStore at --rendezvous: the ranks run on different hosts (network
// namespaces: bench/multihost_bench.py starts them and prints the table).
//
// For each world size, batch size and budget: --prompts prompts, --tokens tokens each, greedy;
// batch 1 runs the prompts one after another, batch B runs B at once. TPOT = decode time /
// decode tokens per request, averaged; tokens/s = all decode tokens / the decode wall time.
// Prints a Markdown table.
//
//   build/bin/group_bench --model deploy/models/tiny-moe --worlds 1,2,3 --batch 1,4
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include "bench/bench_prompts.h"
#include "common/json.h"
#include "common/log.h"
#include "gpu_worker/group/expert_group.h"
#include "gpu_worker/rank.h"

namespace {

using namespace fmoe;
using BenchClock = std::chrono::steady_clock;
using Json = nlohmann::json;

const std::vector<std::string>& kFallback = bench::kFallbackPrompts;

struct Config {
  std::string model_dir;
  std::string device = "cpu";  // Every rank's: cpu | cuda:N.
  std::string dtype = "float32";
  std::vector<std::string> prompts;
  uint32_t tokens = 32;
  uint32_t world = 1;
  uint32_t batch = 1;
  double budget = 1.0;
  std::string policy = "lru";
  double gbps = 16;
  int threads = 1;
  std::string host = "127.0.0.1";             // This rank's address: Gloo binds to it.
  std::string rendezvous_host = "127.0.0.1";  // Rank 0's TCPStore.
  uint16_t port = 0;
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// One rank of one configuration; the result as one JSON line on `out_fd`.
int RankMain(const Config& c, uint32_t rank, int out_fd) {
  spdlog::set_level(spdlog::level::warn);
  Json result = {{"rank", rank}};
  auto fail = [&](const std::string& why) {
    result["error"] = why;
    const std::string line = result.dump() + "\n";
    if (write(out_fd, line.data(), line.size()) < 0) return 1;
    return 1;
  };
  std::map<uint64_t, std::vector<int32_t>> tokens;
  std::map<uint64_t, BenchClock::time_point> first, last;
  std::vector<double> gaps_ms;  // Between successive tokens of a request: decode only.
  size_t finished = 0;
  RankOptions o;
  o.model_dir = c.model_dir;
  o.threads = c.threads;
  o.device = c.device;
  o.dtype = c.dtype;
  o.experts = RankExperts::kCached;
  o.cache.policy = c.policy;
  o.cache.cache_fraction = c.budget;
  o.cache.link.gbps = c.gbps;
  o.cache.link.latency_us = 10;
  o.group = "bench";
  o.rank = rank;
  o.world_size = c.world;
  o.host = c.host;
  o.rendezvous_host = c.rendezvous_host;
  o.rendezvous_port = c.port;
  o.rendezvous_timeout = std::chrono::seconds(60);
  o.collective_timeout = std::chrono::seconds(60);
  o.max_batch = c.batch;
  o.stop_at_eos = false;  // Every request runs to --tokens.
  o.on_token = [&](const TokenEvent& ev) {
    if (ev.token_id >= 0) {
      tokens[ev.request_id].push_back(ev.token_id);
      const auto now = BenchClock::now();
      if (tokens[ev.request_id].size() > 1) {
        const auto prev =
            tokens[ev.request_id].size() == 2 ? first[ev.request_id] : last[ev.request_id];
        gaps_ms.push_back(std::chrono::duration<double, std::milli>(now - prev).count());
      }
      (tokens[ev.request_id].size() == 1 ? first : last)[ev.request_id] = now;
    }
    if (ev.finish != FinishReason::kNone) ++finished;
  };
  auto assembled = Rank::Assemble(std::move(o));
  if (!assembled.ok()) return fail(assembled.status().message());
  Rank& r = **assembled;
  ExpertGroup& group = r.group();

  if (rank == 0) {
    std::vector<std::vector<int32_t>> prompts;
    for (const std::string& p : c.prompts) prompts.push_back(*r.tokenizer()->Encode(p, true));
    Engine& engine = *r.engine();
    // Batches of `batch` requests, one batch after another.
    BenchClock::time_point decode_start{}, decode_end{};
    double decode_wall = 0;
    const GroupStats before = group.stats();
    for (size_t at = 0; at < prompts.size(); at += c.batch) {
      const size_t n = std::min<size_t>(c.batch, prompts.size() - at);
      for (size_t i = 0; i < n; ++i) {
        Generate req;
        req.request_id = at + i + 1;
        req.token_ids = prompts[at + i];
        req.sampling.max_tokens = c.tokens;
        engine.Submit(std::move(req));
      }
      const size_t want = finished + n;
      while (finished < want && engine.Step()) {
      }
      decode_start = BenchClock::time_point::max();
      decode_end = BenchClock::time_point::min();
      for (size_t i = 0; i < n; ++i) {
        decode_start = std::min(decode_start, first[at + i + 1]);
        decode_end = std::max(decode_end, last[at + i + 1]);
      }
      decode_wall += std::chrono::duration<double>(decode_end - decode_start).count();
    }
    // Tell the followers to stop: Run sends the stop plan once its predicate holds.
    engine.Run([] { return true; });
    double tpot_sum = 0;
    uint64_t decode_tokens = 0, generated = 0;
    Json all_tokens = Json::object();
    for (const auto& [id, t] : tokens) {
      generated += t.size();
      if (t.size() > 1) {
        tpot_sum += std::chrono::duration<double>(last[id] - first[id]).count() / (t.size() - 1);
        decode_tokens += t.size() - 1;
      }
      all_tokens[std::to_string(id)] = t;
    }
    result["tpot_ms"] = 1e3 * tpot_sum / std::max<size_t>(1, tokens.size());
    result["tpot_p50_ms"] = Median(gaps_ms);
    result["tokens_per_s"] = decode_tokens / std::max(decode_wall, 1e-9);
    result["generated"] = generated;
    result["tokens"] = all_tokens;
    const GroupStats after = group.stats();
    result["leader_wait_ms"] = (after.wait_us - before.wait_us) / 1e3;
  } else {
    Status s = r.follower()->Run([] { return false; }, std::chrono::milliseconds(0));
    if (!s.ok()) return fail(s.message());
  }
  const GroupStats gs = group.stats();
  const CacheStats cs = r.cached()->stats();
  result["payload_bytes"] = gs.payload_bytes;
  result["combines"] = gs.combines;
  result["wait_ms"] = gs.wait_us / 1e3;
  result["link_bytes"] = cs.total.bytes_moved;
  result["owned"] = cs.slots;
  const std::string line = result.dump() + "\n";
  return write(out_fd, line.data(), line.size()) < 0 ? 1 : 0;
}

// The collectives alone: microseconds per call on rank 0, for each way of summing.
int CollectivesMain(const Config& c, uint32_t rank, int out_fd) {
  spdlog::set_level(spdlog::level::warn);
  at::set_num_threads(1);
  Json result = {{"rank", rank}};
  auto time_us = [](const std::function<Status()>& op, int n) {
    bool ok = true;
    for (int i = 0; i < 20; ++i) ok = op().ok() && ok;
    const auto t0 = BenchClock::now();
    for (int i = 0; i < n; ++i) ok = op().ok() && ok;
    if (!ok) return -1.0;
    return std::chrono::duration<double, std::micro>(BenchClock::now() - t0).count() / n;
  };
  uint16_t port = c.port;
  for (auto [name, algorithm] : {std::pair{"all-reduce", SumAlgorithm::kAllReduce},
                                 std::pair{"all-gather", SumAlgorithm::kAllGather}}) {
    ExpertGroupOptions g;
    g.group = "bench";
    g.rank = rank;
    g.world_size = c.world;
    g.host = c.host;
    g.rendezvous_host = c.rendezvous_host;
    g.rendezvous_port = port++;
    g.sum_algorithm = algorithm;
    auto group = ExpertGroup::Join(g);
    if (!group.ok()) {
      result["error"] = group.status().message();
      break;
    }
    // A decode step's expert slots: batch x K rows of h floats (tiny model: h = 256, K = 2).
    for (int64_t batch : {1, 4}) {
      at::Tensor slots = at::zeros({batch * 2, 256});
      result[fmt::format("combine_b{}_{}", batch, name)] =
          time_us([&] { return (*group)->CombineDisjoint(slots); }, 300);
    }
    std::vector<int64_t> counters(15, 1);
    result[fmt::format("sum_{}", name)] =
        time_us([&] { return (*group)->SumCounters(counters); }, 300);
    std::vector<uint8_t> plan(100, 1);
    result["broadcast"] = time_us([&] { return (*group)->Broadcast(&plan); }, 300);
  }
  const std::string line = result.dump() + "\n";
  return write(out_fd, line.data(), line.size()) < 0 ? 1 : 0;
}

uint16_t PickPort(uint32_t seed) {
  return static_cast<uint16_t>(30000 + (getpid() * 7 + seed * 13) % 20000);
}

// Forks `world` ranks and gathers their JSON lines, rank order.
std::vector<Json> RunConfig(Config c, uint32_t seed, bool collectives = false) {
  c.port = PickPort(seed);
  int fds[2];
  if (pipe(fds) != 0) return {};
  std::vector<pid_t> pids;
  for (uint32_t r = 0; r < c.world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      _exit(collectives ? CollectivesMain(c, r, fds[1]) : RankMain(c, r, fds[1]));
    }
    pids.push_back(pid);
  }
  close(fds[1]);
  std::string text;
  char buf[65536];
  for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) > 0;)
    text.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  for (pid_t pid : pids) waitpid(pid, nullptr, 0);
  std::vector<Json> out(c.world);
  size_t at = 0;
  while (at < text.size()) {
    const size_t eol = text.find('\n', at);
    Json j = Json::parse(text.substr(at, eol - at), nullptr, false);
    if (j.is_object() && j.contains("rank") && j["rank"].get<uint32_t>() < c.world) {
      out[j["rank"].get<uint32_t>()] = j;
    }
    at = eol == std::string::npos ? text.size() : eol + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  // Logs go to stderr: stdout carries the tables.
  if (fmoe::Status s = fmoe::InitLogging("group_bench", "info"); !s.ok()) return 2;
  CLI::App app{"group_bench: decode TPOT and bytes moved per rank against the group's world size"};
  Config base;
  base.model_dir = "deploy/models/tiny-moe";
  std::string prompts_file;
  size_t num_prompts = 8;
  std::vector<uint32_t> worlds = {1, 2, 3};
  std::vector<uint32_t> batches = {1, 4};
  std::vector<double> budgets = {1.0, 0.5};
  app.add_option("--model", base.model_dir, "model directory");
  app.add_option("--prompts-file", prompts_file, "JSONL with a \"prompt\" field per line");
  app.add_option("--prompts", num_prompts, "prompts");
  app.add_option("--tokens", base.tokens, "tokens generated per prompt");
  app.add_option("--worlds", worlds, "world sizes")->delimiter(',');
  app.add_option("--batch", batches, "batch sizes")->delimiter(',');
  app.add_option("--budget", budgets, "expert budgets per rank, fractions")->delimiter(',');
  app.add_option("--policy", base.policy, "cache policy below 100%");
  app.add_option("--gbps", base.gbps, "emulated link GB/s (cpu)");
  app.add_option("--device", base.device, "every rank's device: cpu | cuda:N")
      ->capture_default_str();
  app.add_option("--dtype", base.dtype, "auto | float32 | bfloat16 | float16")
      ->capture_default_str();
  bool collectives = false;
  app.add_flag("--collectives", collectives,
               "time the group's collectives alone (each way of summing) instead");
  int one_rank = -1;
  std::string rendezvous;
  int threads = 0;
  app.add_option("--rank", one_rank,
                 "run this one rank of one configuration (one world, batch and budget) and print "
                 "its result as a JSON line; the other ranks run elsewhere with the same flags");
  app.add_option("--host", base.host, "this rank's address, Gloo binds to it (with --rank)")
      ->capture_default_str();
  app.add_option("--rendezvous", rendezvous, "rank 0's TCPStore, HOST:PORT (with --rank)");
  app.add_option("--threads", threads,
                 "intra-op threads per rank (default: max(1, cores / world))");
  CLI11_PARSE(app, argc, argv);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  if (one_rank >= 0) {
    if (worlds.size() != 1 || batches.size() != 1 || budgets.size() != 1) {
      std::fprintf(stderr, "--rank: give one value each of --worlds, --batch and --budget\n");
      return 2;
    }
    const size_t colon = rendezvous.rfind(':');
    const int rdzv_port =
        colon == std::string::npos ? 0 : std::atoi(rendezvous.c_str() + colon + 1);
    if (colon == 0 || rdzv_port <= 0 || rdzv_port > 65535) {
      std::fprintf(stderr, "--rendezvous: \"%s\" is not HOST:PORT\n", rendezvous.c_str());
      return 2;
    }
    if (static_cast<uint32_t>(one_rank) >= worlds[0]) {
      std::fprintf(stderr, "--rank %d: not below --worlds %u\n", one_rank, worlds[0]);
      return 2;
    }
    Config c = base;
    c.world = worlds[0];
    c.batch = batches[0];
    c.budget = budgets[0];
    c.threads = threads > 0 ? threads : static_cast<int>(std::max(1u, cores / c.world));
    c.rendezvous_host = rendezvous.substr(0, colon);
    c.port = static_cast<uint16_t>(rdzv_port);
    if (!collectives) c.prompts = bench::ReadPrompts(prompts_file, num_prompts, kFallback, 600);
    const uint32_t rank = static_cast<uint32_t>(one_rank);
    return collectives ? CollectivesMain(c, rank, STDOUT_FILENO) : RankMain(c, rank, STDOUT_FILENO);
  }
  if (collectives) {
    std::printf(
        "c10d Gloo over loopback, ranks are processes; microseconds per call on rank 0\n\n| "
        "world | combine 2 KB (batch 1), all-reduce | all-gather + sum | combine 8 KB (batch "
        "4), all-reduce | all-gather + sum | 15 counters, all-reduce | all-gather + sum | 100 "
        "B plan broadcast |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    uint32_t seed = 100;
    for (uint32_t world : worlds) {
      if (world < 2) continue;
      Config c = base;
      c.world = world;
      std::vector<Json> ranks = RunConfig(c, ++seed, true);
      const Json& r = ranks[0];
      if (!r.is_object() || r.contains("error")) {
        std::fprintf(stderr, "world %u: %s\n", world, r.dump().c_str());
        continue;
      }
      std::printf("| %u | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f |\n", world,
                  r["combine_b1_all-reduce"].get<double>(),
                  r["combine_b1_all-gather"].get<double>(),
                  r["combine_b4_all-reduce"].get<double>(),
                  r["combine_b4_all-gather"].get<double>(), r["sum_all-reduce"].get<double>(),
                  r["sum_all-gather"].get<double>(), r["broadcast"].get<double>());
    }
    return 0;
  }
  base.prompts = bench::ReadPrompts(prompts_file, num_prompts, kFallback, 600);

  std::printf(
      "model %s; %zu prompts x %u tokens, greedy; ranks are processes on %u cores (each "
      "max(1, cores / world) intra-op threads); collectives: c10d Gloo over loopback; link: "
      "emulated, %.0f GB/s + 10 us; policy %s below 100%%\n\n",
      base.model_dir.c_str(), base.prompts.size(), base.tokens, cores, base.gbps,
      base.policy.c_str());
  std::printf(
      "| world | batch | budget | TPOT ms | decode tok/s | leader in collectives ms/token | "
      "collective payload KB/token per rank | link MB/token per rank | identical tokens |\n"
      "|---:|---:|---:|---:|---:|---:|---|---|---|\n");
  std::fflush(stdout);
  std::map<std::pair<uint32_t, double>, Json> reference;  // (batch, budget) -> world 1's tokens.
  uint32_t seed = 0;
  for (double budget : budgets) {
    for (uint32_t batch : batches) {
      for (uint32_t world : worlds) {
        Config c = base;
        c.world = world;
        c.batch = batch;
        c.budget = budget;
        c.threads = threads > 0 ? threads : static_cast<int>(std::max(1u, cores / world));
        std::vector<Json> ranks = RunConfig(c, ++seed);
        bool ok = true;
        for (const Json& r : ranks) {
          if (!r.is_object() || r.contains("error")) {
            std::fprintf(stderr, "world %u batch %u: %s\n", world, batch,
                         r.is_object() ? r.value("error", "").c_str() : "no result");
            ok = false;
          }
        }
        if (!ok) continue;
        const Json& lead = ranks[0];
        const double generated = std::max(1.0, lead["generated"].get<double>());
        std::string payload, link;
        for (const Json& r : ranks) {
          payload += (payload.empty() ? "" : " / ") +
                     fmt::format("{:.1f}", r["payload_bytes"].get<double>() / generated / 1e3);
          link += (link.empty() ? "" : " / ") +
                  fmt::format("{:.2f}", r["link_bytes"].get<double>() / generated / 1e6);
        }
        auto& ref = reference[{batch, budget}];
        if (ref.is_null()) ref = lead["tokens"];
        std::printf("| %u | %u | %.0f%% | %.2f | %.0f | %.2f | %s | %s | %s |\n", world, batch,
                    budget * 100, lead["tpot_ms"].get<double>(), lead["tokens_per_s"].get<double>(),
                    lead["leader_wait_ms"].get<double>() / generated, payload.c_str(), link.c_str(),
                    ref == lead["tokens"] ? "yes" : "NO");
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
