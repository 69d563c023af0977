// http_load: a bounded HTTP load generator for the router (our own, so the suite needs no wrk).
// Closed loop (--connections N: each keeps one request in flight on a keep-alive connection) or
// open loop (--rate R: requests started at R per second, each on its own connection, up to
// --max-inflight), for --seconds. Reports requests/s and latency p50/p99/max per status, so an
// overload run shows both the admitted requests and how fast the rest were refused (429).
//
//   build/bin/http_load --port 8000 --path /health --connections 8 --seconds 10
//   build/bin/http_load --port 8000 --path /v1/completions --key KEY --rate 200 --seconds 10
//       --body '{"model":"tiny-moe","prompt":"Hi","max_tokens":1}'
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/http_client.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  int port = 8000;
  std::string path = "/health";
  std::string body;  // Non-empty: POST with this JSON body.
  std::string key;
  int connections = 8;
  double rate = 0;  // > 0: open loop.
  int max_inflight = 512;
  double seconds = 10;
};

// Each request's answer within this long, or it counts as failed (status 0).
constexpr int kRequestTimeoutMs = 30000;

fmoe::http::Request BuildRequest(const Options& o) {
  fmoe::http::Request r;
  r.method = o.body.empty() ? "GET" : "POST";
  r.target = o.path;
  r.body = o.body;
  if (!o.key.empty()) r.headers.emplace_back("Authorization", "Bearer " + o.key);
  return r;
}

// The status of one whole response, or 0 when none came (refused, reset, timed out).
int StatusOf(const fmoe::Result<fmoe::http::Response>& res) { return res.ok() ? res->status : 0; }

struct Results {
  std::mutex mu;
  std::map<int, std::vector<double>> ms;  // Latencies by status (0 = failed).
  void Add(int status, double ms_value) {
    std::lock_guard<std::mutex> lock(mu);
    ms[status].push_back(ms_value);
  }
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"http_load: bounded HTTP load against the router"};
  app.add_option("--port", o.port, "router port")->capture_default_str();
  app.add_option("--path", o.path, "request path")->capture_default_str();
  app.add_option("--body", o.body, "JSON body (POST when set)");
  app.add_option("--key", o.key, "API key");
  app.add_option("--connections", o.connections, "closed loop: connections")->capture_default_str();
  app.add_option("--rate", o.rate, "open loop: requests per second (0 = closed loop)");
  app.add_option("--max-inflight", o.max_inflight, "open loop: bound on requests in flight")
      ->capture_default_str();
  app.add_option("--seconds", o.seconds, "duration")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  Results results;
  const auto start = Clock::now();
  const auto end = start + std::chrono::duration<double>(o.seconds);
  std::atomic<int> inflight{0};
  std::atomic<uint64_t> skipped{0};
  std::vector<std::thread> threads;
  const fmoe::http::Request request = BuildRequest(o);
  if (o.rate <= 0) {
    for (int c = 0; c < o.connections; ++c) {
      threads.emplace_back([&] {
        // Keep-alive: the client reconnects after a failure or a close by the router.
        fmoe::http::Client client("127.0.0.1", o.port);
        while (Clock::now() < end) {
          const auto t0 = Clock::now();
          const int status = StatusOf(client.Call(request, kRequestTimeoutMs));
          results.Add(status, std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
          if (status == 0) client.Close();
        }
      });
    }
  } else {
    const auto period = std::chrono::duration<double>(1.0 / o.rate);
    auto next = start;
    while (next < end) {
      std::this_thread::sleep_until(next);
      next += std::chrono::duration_cast<Clock::duration>(period);
      if (inflight.load() >= o.max_inflight) {
        ++skipped;
        continue;
      }
      ++inflight;
      std::thread([&] {
        const auto t0 = Clock::now();
        const int status =
            StatusOf(fmoe::http::Fetch("127.0.0.1", o.port, request, kRequestTimeoutMs));
        results.Add(status, std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        --inflight;
      }).detach();
    }
    while (inflight.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (auto& t : threads) t.join();
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();

  std::lock_guard<std::mutex> lock(results.mu);
  uint64_t total = 0;
  for (auto& [status, v] : results.ms) total += v.size();
  std::printf("%s %s: %llu requests in %.1f s = %.0f req/s (%s", o.body.empty() ? "GET" : "POST",
              o.path.c_str(), static_cast<unsigned long long>(total), elapsed,
              static_cast<double>(total) / elapsed, o.rate > 0 ? "open loop" : "closed loop");
  if (o.rate > 0) {
    std::printf(" at %.0f/s, %llu not started: in-flight bound", o.rate,
                static_cast<unsigned long long>(skipped.load()));
  } else {
    std::printf(", %d connections", o.connections);
  }
  std::printf(")\n");
  for (auto& [status, v] : results.ms) {
    std::sort(v.begin(), v.end());
    auto q = [&](double p) { return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))]; };
    std::printf("  status %3d: %8zu  (%.0f/s)  p50 %.2f ms  p99 %.2f ms  max %.2f ms\n", status,
                v.size(), static_cast<double>(v.size()) / elapsed, q(0.50), q(0.99), v.back());
  }
  return 0;
}
