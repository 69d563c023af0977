// `fmoe-worker --record-trace` on the shipped tiny model (deploy/models/tiny-moe), the real
// process: this test binds the router's worker socket itself, sends Generate and Cancel over
// ZeroMQ, and reads the trace back with ReadTrace. Checked: the records (prefill tokens = prompt
// length, one decode token after, routing sums, maps summing to 1, speculation at the map
// service's distance although the policy is lru, each request's own even when batched: every
// fraction a multiple of 1 / the request's tokens), one record per iteration that produced a
// token, `last` on every request's final record whether it finished, was cancelled or was still
// running at SIGTERM; SIGKILL leaves a readable trace; recording changes neither the tokens nor
// the expert cache's hits and misses; a bad path fails the start naming it.
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/model/expert_trace.h"
#include "common/model/model_config.h"
#include "common/text/tokenizer.h"
#include "common/wire/wire.h"
#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using testing::BinDir;
using testing::Child;
using testing::FreeTcpPort;

const std::string kModelDir = std::string(FMOE_SOURCE_DIR) + "/deploy/models/tiny-moe";
constexpr int kDistance = 3;  // map_service.prefetch_distance in the manifest below.

struct Stream {
  std::vector<int32_t> tokens;
  FinishReason finish = FinishReason::kNone;
  std::string error;
  uint64_t hits = 0, misses = 0;
};

// One fmoe-worker (group g0, rank 0) with its own router socket; no map service runs (lru needs
// none, and its contexts are dropped).
class WorkerRun {
 public:
  WorkerRun(const std::string& dir, const std::string& name, std::vector<std::string> extra) {
    endpoint_ = "tcp://127.0.0.1:" + std::to_string(FreeTcpPort());
    const std::string manifest = dir + "/" + name + ".yaml";
    testing::WriteFile(manifest,
                       "model:\n  path: " + kModelDir + "\n  name: tiny-moe\nmap_service:\n" +
                           "  endpoint: tcp://127.0.0.1:" + std::to_string(FreeTcpPort()) +
                           "\n  data_dir: " + dir +
                           "/maps\n  prefetch_distance: " + std::to_string(kDistance) +
                           "\nworker_groups:\n  - name: g0\n    policy: lru\n    max_batch: 4\n"
                           "    expert_cache_fraction: 0.5\n    rendezvous: 127.0.0.1:" +
                           std::to_string(FreeTcpPort()) +
                           "\n    workers:\n      - device: cpu\nrouter:\n  listen: 127.0.0.1:" +
                           std::to_string(FreeTcpPort()) + "\n  worker_endpoint: " + endpoint_ +
                           "\nheartbeat:\n  interval_ms: 100\n  timeout_ms: 1000\n");
    // This test's socket poses as the router: with the cluster key.
    std::string error;
    EXPECT_TRUE(testing::UseClusterKeyOf(manifest, &error)) << error;
    context_ = std::make_unique<wire::Context>();
    auto bound = wire::WorkerSocket::Bind(*context_, wire::Role::kRouter, endpoint_);
    EXPECT_TRUE(bound.ok()) << bound.status().ToString();
    if (bound.ok()) socket_ = std::move(*bound);
    std::vector<std::string> argv = {
        BinDir() + "/fmoe-worker", "--manifest", manifest, "--group", "g0", "--rank", "0"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    worker_ = std::make_unique<Child>(argv, dir + "/" + name + ".log");
  }

  Child& worker() { return *worker_; }

  // Waits for the leader's Hello and accepts it.
  bool Connect() {
    if (!socket_) return false;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (peer_.empty() && std::chrono::steady_clock::now() < deadline) {
      auto in = socket_->Receive(100);
      if (in && std::holds_alternative<WorkerHello>(in->message)) {
        peer_ = in->peer;
        EXPECT_TRUE(socket_->Send(WorkerHelloAck{true, ""}, peer_).ok());
      }
    }
    return !peer_.empty();
  }

  void Send(const WorkerMessage& m) { EXPECT_TRUE(socket_->Send(m, peer_).ok()); }

  void Generate(uint64_t id, const std::vector<int32_t>& prompt, uint32_t max_tokens) {
    fmoe::Generate g;
    g.request_id = id;
    g.token_ids = prompt;
    g.sampling.max_tokens = max_tokens;  // Greedy (temperature 0).
    Send(g);
  }

  // Receives until `until()` holds (or 60 s); answers heartbeats; cancels `cancel_id` once it has
  // `cancel_after` tokens.
  bool Pump(const std::function<bool()>& until, uint64_t cancel_id = 0, size_t cancel_after = 0) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    bool cancelled = false;
    while (!until() && std::chrono::steady_clock::now() < deadline) {
      auto in = socket_->Receive(50);
      if (!in) continue;
      if (const auto* hb = std::get_if<WorkerHeartbeat>(&in->message)) {
        Send(WorkerHeartbeatAck{hb->seq, true});
      } else if (const auto* ev = std::get_if<TokenEvent>(&in->message)) {
        Stream& s = streams[ev->request_id];
        if (ev->token_id >= 0) s.tokens.push_back(ev->token_id);
        if (ev->finish != FinishReason::kNone) s.finish = ev->finish;
        s.error = ev->error;
        s.hits = ev->expert_hits;
        s.misses = ev->expert_misses;
        if (!cancelled && ev->request_id == cancel_id && s.tokens.size() >= cancel_after) {
          Send(Cancel{cancel_id});
          cancelled = true;
        }
      }
    }
    return until();
  }
  bool Finished(uint64_t id) {
    return streams.count(id) > 0 && streams[id].finish != FinishReason::kNone;
  }
  // Runs `id` alone to its end.
  bool RunAlone(uint64_t id, const std::vector<int32_t>& prompt, uint32_t max_tokens) {
    Generate(id, prompt, max_tokens);
    return Pump([&] { return Finished(id); });
  }

  std::map<uint64_t, Stream> streams;

 private:
  std::string endpoint_, peer_;
  std::unique_ptr<wire::Context> context_;
  std::unique_ptr<wire::WorkerSocket> socket_;
  std::unique_ptr<Child> worker_;
};

std::vector<std::vector<int32_t>> Prompts() {
  auto tok = Tokenizer::Load(kModelDir);
  EXPECT_TRUE(tok.ok()) << tok.status().ToString();
  std::vector<std::vector<int32_t>> out;
  if (!tok.ok()) return out;
  for (const char* text :
       {"In the beginning", "The king said to his daughter that",
        "Once upon a time there was a little girl who lived in a village near the forest.",
        "The old man and the sea", "She opened the door and saw"}) {
    auto ids = (*tok)->Encode(text, true);
    EXPECT_TRUE(ids.ok());
    if (ids.ok()) out.push_back(*ids);
  }
  return out;
}

bool ExitedWith(Child& c, int code) {
  auto status = c.Wait(30000);
  return status && WIFEXITED(*status) && WEXITSTATUS(*status) == code;
}

// Records of one request, in order.
std::map<uint64_t, std::vector<const TraceIteration*>> ByRequest(const Trace& t) {
  std::map<uint64_t, std::vector<const TraceIteration*>> out;
  for (const auto& it : t.iterations) out[it.request_id].push_back(&it);
  return out;
}

TEST(TraceE2e, RecordsEveryIterationAndChangesNothing) {
  const std::string dir = testing::MakeTempDir("fmoe-trace");
  const std::string path = dir + "/g0.trc";
  const auto prompts = Prompts();
  ASSERT_EQ(prompts.size(), 5u);
  auto info = LoadModelInfo(kModelDir);
  ASSERT_TRUE(info.ok());

  // Recording: three requests alone, two together, one cancelled, one running at SIGTERM.
  WorkerRun on(dir, "on", {"--record-trace", path});
  ASSERT_TRUE(on.Connect()) << on.worker().Log();
  for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(on.RunAlone(1 + i, prompts[i], 12));
  on.Generate(10, prompts[3], 8);
  on.Generate(11, prompts[4], 8);
  ASSERT_TRUE(on.Pump([&] { return on.Finished(10) && on.Finished(11); }));
  on.Generate(20, prompts[0], 200);
  ASSERT_TRUE(on.Pump([&] { return on.Finished(20); }, /*cancel_id=*/20, /*cancel_after=*/2));
  EXPECT_EQ(on.streams[20].finish, FinishReason::kCancelled);
  on.Generate(30, prompts[1], 500);
  ASSERT_TRUE(on.Pump([&] { return on.streams[30].tokens.size() >= 3; }));
  on.worker().Signal(SIGTERM);
  ASSERT_TRUE(ExitedWith(on.worker(), 0)) << on.worker().Log();
  const std::string log = on.worker().Log();
  EXPECT_NE(log.find("recording the expert trace to " + path), std::string::npos) << log;

  // The same requests without recording: the same tokens, and (requests run alone, lru) the
  // same expert hits and misses.
  WorkerRun off(dir, "off", {});
  ASSERT_TRUE(off.Connect()) << off.worker().Log();
  for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(off.RunAlone(1 + i, prompts[i], 12));
  off.Generate(10, prompts[3], 8);
  off.Generate(11, prompts[4], 8);
  ASSERT_TRUE(off.Pump([&] { return off.Finished(10) && off.Finished(11); }));
  for (uint64_t id : {1, 2, 3, 10, 11}) {
    SCOPED_TRACE("req " + std::to_string(id));
    EXPECT_EQ(on.streams[id].tokens, off.streams[id].tokens);
    EXPECT_EQ(on.streams[id].finish, off.streams[id].finish);
    EXPECT_FALSE(on.streams[id].tokens.empty());
  }
  for (uint64_t id : {1, 2, 3}) {
    EXPECT_EQ(on.streams[id].hits, off.streams[id].hits) << "req " << id;
    EXPECT_EQ(on.streams[id].misses, off.streams[id].misses) << "req " << id;
  }
  off.worker().Signal(SIGTERM);
  EXPECT_TRUE(ExitedWith(off.worker(), 0));

  // The trace.
  Result<Trace> read = ReadTrace(path);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  const Trace& t = *read;
  EXPECT_EQ(t.header.model, "tiny-moe");
  EXPECT_EQ(t.header.source, "fmoe-worker g0 rank 0");
  EXPECT_EQ(t.header.num_layers, info->num_moe_layers);
  EXPECT_EQ(t.header.num_experts, info->num_experts);
  EXPECT_EQ(t.header.top_k, info->top_k);
  EXPECT_EQ(t.header.hidden, info->hidden_size);
  const uint32_t L = t.header.num_layers, J = t.header.num_experts, K = t.header.top_k;
  std::map<uint64_t, std::vector<int32_t>> prompt_of = {
      {1, prompts[0]},  {2, prompts[1]},  {3, prompts[2]}, {10, prompts[3]},
      {11, prompts[4]}, {20, prompts[0]}, {30, prompts[1]}};
  const auto requests = ByRequest(t);
  ASSERT_EQ(requests.size(), prompt_of.size());
  uint64_t tokens_total = 0;
  for (const auto& [id, its] : requests) {
    SCOPED_TRACE("req " + std::to_string(id));
    ASSERT_TRUE(prompt_of.count(id));
    const Stream& s = on.streams[id];
    // Every iteration produced one sampled token: the ones streamed, plus the eos a stop drops.
    // The one running at SIGTERM may have run one more iteration than the test received.
    const size_t produced = s.tokens.size() + (s.finish == FinishReason::kStop ? 1 : 0);
    if (id == 30) {
      EXPECT_GE(its.size(), 3u);
    } else {
      EXPECT_EQ(its.size(), produced);
    }
    for (size_t i = 0; i < its.size(); ++i) {
      const TraceIteration& it = *its[i];
      SCOPED_TRACE("iteration " + std::to_string(i));
      EXPECT_EQ(it.iteration, i);
      EXPECT_EQ(it.last, i + 1 == its.size());
      EXPECT_EQ(it.tokens, i == 0 ? prompt_of[id].size() : 1u);
      tokens_total += it.tokens;
      EXPECT_FALSE(it.map_derived);
      std::vector<float> map;
      it.FillMap(t.header, &map);
      for (uint32_t l = 0; l < L; ++l) {
        EXPECT_EQ(it.map_offsets[l + 1] - it.map_offsets[l], J);
        double row = 0;
        for (uint32_t j = 0; j < J; ++j) row += map[l * J + j];
        EXPECT_NEAR(row, 1.0, 1e-4) << "layer " << l;
        uint64_t routed = 0;
        for (uint32_t c : it.used_counts(l)) routed += c;
        EXPECT_EQ(routed, uint64_t{it.tokens} * K) << "layer " << l;
      }
      double sem_norm = 0;
      for (float v : it.sem) sem_norm += double{v} * v;
      EXPECT_GT(sem_norm, 0.0);
      // Speculation at d = 3 although lru asks for none: targets l+1..l+3 below L.
      size_t expected = 0;
      for (uint32_t l = 0; l < L; ++l) expected += std::min<uint32_t>(kDistance, L - 1 - l);
      EXPECT_EQ(it.speculation.size(), expected);
      for (const TraceSpeculation& sp : it.speculation) {
        EXPECT_LT(sp.layer, sp.target);
        EXPECT_LE(sp.target, sp.layer + kDistance);
        double sum = 0;
        for (float f : sp.fractions) sum += f;
        EXPECT_NEAR(sum, K, 1e-3) << "every token picks K experts";
        // The request's own tokens only: with requests 10 and 11 batched, a share of the batch
        // (e.g. 1/2 in a decode step where one of them picks an expert) is not one of these.
        for (float f : sp.fractions) {
          const double picks = double{f} * it.tokens;
          EXPECT_NEAR(picks, std::round(picks), 1e-3) << sp.layer << "->" << sp.target << ": " << f
                                                      << " is not a multiple of 1/" << it.tokens;
          EXPECT_GE(std::round(picks), 1.0);
        }
      }
    }
  }
  const auto bytes = std::filesystem::file_size(path);
  std::cout << "trace: " << t.iterations.size() << " records, " << tokens_total << " tokens, "
            << bytes << " bytes (" << bytes / t.iterations.size() << " bytes per record)\n";
  std::filesystem::remove_all(dir);
}

TEST(TraceE2e, AKilledWorkerLeavesAReadableTrace) {
  const std::string dir = testing::MakeTempDir("fmoe-trace-kill");
  const std::string path = dir + "/g0.trc";
  const auto prompts = Prompts();
  ASSERT_FALSE(prompts.empty());
  WorkerRun run(dir, "kill", {"--record-trace", path});
  ASSERT_TRUE(run.Connect()) << run.worker().Log();
  ASSERT_TRUE(run.RunAlone(1, prompts[0], 6));
  run.Generate(2, prompts[1], 500);
  ASSERT_TRUE(run.Pump([&] { return run.streams[2].tokens.size() >= 4; }));
  run.worker().Signal(SIGKILL);
  ASSERT_TRUE(run.worker().Wait(10000).has_value());
  Result<Trace> read = ReadTrace(path);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  const auto requests = ByRequest(*read);
  ASSERT_EQ(requests.count(1), 1u);
  EXPECT_TRUE(requests.at(1).back()->last) << "the finished request is complete";
  ASSERT_EQ(requests.count(2), 1u);
  EXPECT_GE(requests.at(2).size(), 3u) << "every iteration but the held one is in the file";
  EXPECT_FALSE(requests.at(2).back()->last);
  std::filesystem::remove_all(dir);
}

TEST(TraceE2e, ABadPathFailsTheStartNamingIt) {
  const std::string dir = testing::MakeTempDir("fmoe-trace-bad");
  const std::string path = dir + "/no/such/dir/g0.trc";
  WorkerRun run(dir, "bad", {"--record-trace", path});
  ASSERT_TRUE(ExitedWith(run.worker(), 1)) << run.worker().Log();
  EXPECT_NE(run.worker().Log().find("--record-trace: cannot write the trace: " + path +
                                    ": No such file or directory"),
            std::string::npos)
      << run.worker().Log();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fmoe
