// `fmoe status` without a network: the reports built from what the probes found (each process's
// state and the words for it), the table and the exit code.
#include "services/status_cmd.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

using Json = nlohmann::json;

// Host A: map service and router; group g0 of two ranks on B and C; g1 of one rank on C.
constexpr char kThreeHosts[] = R"(
model: {path: /models/tiny}
map_service: {endpoint: "tcp://10.0.0.1:5555"}
router: {listen: "10.0.0.1:8000", worker_endpoint: "tcp://10.0.0.1:5556"}
worker_groups:
  - name: g0
    rendezvous: 10.0.0.2:29500
    workers: [{host: 10.0.0.2}, {host: 10.0.0.3}]
  - name: g1
    workers: [{host: 10.0.0.3}]
launcher: {run_dir: /srv/run}
)";

Manifest Parse(const std::string& text) {
  Result<Manifest> m = ParseManifest(text, "/srv");
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? *m : Manifest{};
}

Json Rank(const std::string& group, int rank, bool alive = true) {
  return {{"group", group}, {"rank", rank}, {"alive", alive}, {"silence_ms", alive ? 120 : 9000}};
}

// Everything answered.
ProbeResults AllUp() {
  ProbeResults p;
  p.map_stats = {{"ranks", Json::array({Rank("g0", 0), Rank("g0", 1), Rank("g1", 0)})},
                 {"models", Json::array({Json::object()})}};
  p.health_code = 200;
  p.health = {{"status", "ok"},
              {"groups", Json::array({{{"name", "g0"}, {"alive", true}},
                                      {{"name", "g1"}, {"alive", true}}})}};
  p.rendezvous["g0"] = Status::Ok();
  return p;
}

const ProcessReport& Find(const std::vector<ProcessReport>& reports, const std::string& name) {
  for (const auto& r : reports) {
    if (r.name == name) return r;
  }
  static const ProcessReport kNone;
  ADD_FAILURE() << "no report for " << name;
  return kNone;
}

TEST(StatusReports, EveryProcessOfEveryHostUp) {
  const Manifest m = Parse(kThreeHosts);
  const std::vector<ProcessReport> reports = BuildReports(m, AllUp());
  ASSERT_EQ(reports.size(), 5u);
  for (const auto& r : reports) EXPECT_EQ(r.state, ProbeState::kUp) << r.name << ": " << r.detail;
  EXPECT_EQ(StatusExitCode(reports), kStatusAllUp);

  const ProcessReport& maps = Find(reports, "map-service");
  EXPECT_EQ(maps.host, "10.0.0.1");
  EXPECT_EQ(maps.address, "tcp://10.0.0.1:5555");
  EXPECT_EQ(maps.detail, "3 rank(s) registered, 1 model(s)");
  const ProcessReport& router = Find(reports, "router");
  EXPECT_EQ(router.address, "http://10.0.0.1:8000");
  EXPECT_EQ(router.detail, "/health 200 ok, 2 of 2 group(s) alive");
  const ProcessReport& leader = Find(reports, "worker-g0-0");
  EXPECT_EQ(leader.host, "10.0.0.2");
  EXPECT_EQ(leader.role, "rank 0 of group g0");
  EXPECT_EQ(leader.address, "10.0.0.2:29500 (rendezvous)");
  EXPECT_EQ(leader.detail,
            "registered at the map service, heard 120 ms ago; group alive at the router");
  EXPECT_EQ(Find(reports, "worker-g0-1").address, "10.0.0.3");
  EXPECT_EQ(Find(reports, "worker-g1-0").address, "10.0.0.3") << "one rank: no rendezvous";

  const std::string table = FormatStatusTable(reports);
  EXPECT_EQ(table.rfind("HOST", 0), 0u) << table;
  EXPECT_NE(table.find("5 of 5 process(es) up\n"), std::string::npos) << table;
  EXPECT_EQ(table.find("not reachable"), std::string::npos) << table;
}

TEST(StatusReports, ALeaderWhoseRendezvousTimesOutIsNotReachable) {
  const Manifest m = Parse(kThreeHosts);
  ProbeResults p = AllUp();
  p.rendezvous["g0"] = Timeout("timed out after 1000 ms");
  p.map_stats["ranks"] = Json::array({Rank("g0", 1), Rank("g1", 0)});
  const std::vector<ProcessReport> reports = BuildReports(m, p);
  const ProcessReport& leader = Find(reports, "worker-g0-0");
  EXPECT_EQ(leader.state, ProbeState::kUnreachable);
  EXPECT_EQ(leader.detail, "rendezvous 10.0.0.2:29500: timed out after 1000 ms");
  EXPECT_EQ(StatusExitCode(reports), kStatusUnreachable);

  const std::string table = FormatStatusTable(reports);
  EXPECT_NE(table.find("4 of 5 process(es) up, 1 not reachable\n"), std::string::npos) << table;
  EXPECT_NE(table.find("host 10.0.0.2 (rank 0 of group g0): not reachable: rendezvous "
                       "10.0.0.2:29500: timed out after 1000 ms\n"),
            std::string::npos)
      << table;
}

TEST(StatusReports, RanksTheMapServiceDoesNotHearAreNotReachable) {
  const Manifest m = Parse(kThreeHosts);
  ProbeResults p = AllUp();
  // Rank 1 of g0 is silent; g1's rank never registered.
  p.map_stats["ranks"] = Json::array({Rank("g0", 0), Rank("g0", 1, false)});
  const std::vector<ProcessReport> reports = BuildReports(m, p);
  EXPECT_EQ(Find(reports, "worker-g0-0").state, ProbeState::kUp);
  const ProcessReport& silent = Find(reports, "worker-g0-1");
  EXPECT_EQ(silent.state, ProbeState::kUnreachable);
  EXPECT_EQ(silent.detail, "registered at the map service, but silent for 9000 ms");
  const ProcessReport& missing = Find(reports, "worker-g1-0");
  EXPECT_EQ(missing.state, ProbeState::kUnreachable);
  EXPECT_EQ(missing.detail, "not registered at the map service");
  EXPECT_EQ(StatusExitCode(reports), kStatusUnreachable);
}

TEST(StatusReports, AMapServiceNotReachableLeavesTheRanksUnknownUnlessTheRouterSeesThem) {
  const Manifest m = Parse(kThreeHosts);
  ProbeResults p = AllUp();
  p.map_service = Unavailable("connection refused");
  p.map_stats = Json();
  p.health["groups"][1]["alive"] = false;
  const std::vector<ProcessReport> reports = BuildReports(m, p);
  const ProcessReport& maps = Find(reports, "map-service");
  EXPECT_EQ(maps.state, ProbeState::kUnreachable);
  EXPECT_EQ(maps.detail, "connection refused");
  EXPECT_EQ(Find(reports, "worker-g0-0").state, ProbeState::kUp) << "its group is alive";
  EXPECT_EQ(Find(reports, "worker-g0-1").state, ProbeState::kUnreachable);
  EXPECT_EQ(Find(reports, "worker-g0-1").detail,
            "unknown: the map service, which reports the ranks, is not reachable");
  EXPECT_EQ(Find(reports, "worker-g1-0").state, ProbeState::kUnreachable);
  EXPECT_NE(FormatStatusTable(reports).find(
                "host 10.0.0.1 (map service): not reachable: connection refused\n"),
            std::string::npos);
}

TEST(StatusReports, ARouterAnswering503IsUnhealthyNotUnreachable) {
  const Manifest m = Parse(kThreeHosts);
  ProbeResults p = AllUp();
  p.health_code = 503;
  p.health = {{"status", "loading"},
              {"reason", "no live worker group"},
              {"groups", Json::array({{{"name", "g0"}, {"alive", false}}})}};
  const std::vector<ProcessReport> reports = BuildReports(m, p);
  const ProcessReport& router = Find(reports, "router");
  EXPECT_EQ(router.state, ProbeState::kUnhealthy);
  EXPECT_EQ(router.detail, "/health 503 loading, 0 of 1 group(s) alive; no live worker group");
  EXPECT_EQ(Find(reports, "worker-g0-0").state, ProbeState::kUnhealthy);
  EXPECT_EQ(StatusExitCode(reports), kStatusUnhealthy);
}

TEST(StatusReports, TheLocalLauncherAddsPidsAndAProcessGivenUpOn) {
  const Manifest m = Parse(kThreeHosts);
  ProbeResults p = AllUp();
  p.launcher_alive = true;
  p.launcher_state = {
      {"launcher_pid", 1},
      {"processes",
       Json::array({{{"name", "map-service"}, {"pid", 1}, {"state", "running"}, {"restarts", 2}},
                    {{"name", "router"},
                     {"pid", 1},
                     {"state", "backoff"},
                     {"restarts", 5},
                     {"given_up", true}}})}};
  const std::vector<ProcessReport> reports = BuildReports(m, p);
  const ProcessReport& maps = Find(reports, "map-service");
  EXPECT_EQ(maps.state, ProbeState::kUp);
  EXPECT_EQ(maps.detail, "3 rank(s) registered, 1 model(s); pid 1, 2 restart(s)");
  EXPECT_EQ(maps.pid, 1);
  EXPECT_EQ(maps.restarts, 2);
  EXPECT_EQ(Find(reports, "worker-g0-0").pid, -1) << "not run by this host's launcher";
  EXPECT_EQ(Find(reports, "router").state, ProbeState::kUnhealthy);
  EXPECT_NE(Find(reports, "router").detail.find("given up on"), std::string::npos);
  EXPECT_EQ(StatusExitCode(reports), kStatusUnhealthy);
}

}  // namespace
}  // namespace fmoe
