// The map service process with its store: contexts in, directives out to every rank of the
// group, completed maps written and acknowledged; acknowledged maps survive 20 kill -9 cycles
// intact, and matching after a restart equals matching before it; export and import move a
// store to a new service; bad frames and wrong-shape contexts are counted while valid traffic
// is answered.
#include <signal.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include "common/json.h"
#include "common/wire/wire.h"
#include "map_service/map_matcher.h"
#include "map_service/map_store.h"
#include "schemas/export_generated.h"
#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using testing::BinDir;
using testing::Child;
using testing::FreeTcpPort;
using testing::ReadFile;
using Json = nlohmann::json;

constexpr uint32_t kL = 8, kJ = 8, kK = 2, kH = 64, kD = 3;
constexpr uint64_t kModel = 0xabcdef01;

struct Entry {
  std::vector<float> sem;
  std::vector<float> map;
};

// Maps drawn around a few cluster centres, so matching has real structure.
class MapSource {
 public:
  explicit MapSource(uint32_t seed) : rng_(seed) {
    for (int c = 0; c < 4; ++c) centres_.push_back(Raw());
  }
  Entry Next() {
    const Entry& c = centres_[rng_() % centres_.size()];
    Entry e = Raw();
    for (size_t i = 0; i < e.sem.size(); ++i) e.sem[i] = c.sem[i] + 0.3f * e.sem[i];
    for (uint32_t l = 0; l < kL; ++l) {
      float sum = 0;
      for (uint32_t j = 0; j < kJ; ++j) {
        float& p = e.map[l * kJ + j];
        p = c.map[l * kJ + j] + 0.2f * p;
        sum += p;
      }
      for (uint32_t j = 0; j < kJ; ++j) e.map[l * kJ + j] /= sum;
    }
    return e;
  }

 private:
  Entry Raw() {
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    Entry e{std::vector<float>(kH), std::vector<float>(kL * kJ)};
    for (float& x : e.sem) x = u(rng_) - 0.5f;
    for (float& x : e.map) x = u(rng_) * u(rng_);
    return e;
  }
  std::mt19937 rng_;
  std::vector<Entry> centres_;
};

// One rank's DEALER to the service.
class Rank {
 public:
  Rank(const std::string& endpoint, const std::string& id, uint32_t rank = 0, uint32_t world = 1,
       const std::string& group = "g0") {
    wire::SocketOptions o;
    o.routing_id = id;
    auto s = wire::MapSocket::Connect(context_, wire::Role::kDealer, endpoint, o);
    EXPECT_TRUE(s.ok());
    socket_ = std::move(*s);
    reg_.group = group;
    reg_.rank = rank;
    reg_.world_size = world;
    reg_.instance_id = 7 + rank;
    reg_.model_fingerprint = kModel;
    reg_.num_layers = kL;
    reg_.num_experts = kJ;
    reg_.top_k = kK;
    reg_.hidden_size = kH;
  }
  // Registers, retrying while the service starts.
  bool Join(int timeout_ms = 20000) {
    for (int waited = 0; waited < timeout_ms; waited += 200) {
      if (!socket_->Send(reg_).ok()) return false;
      while (auto in = socket_->Receive(200)) {
        if (auto* ack = std::get_if<RegisterAck>(&in->message)) return ack->accepted;
      }
    }
    return false;
  }
  fmoe::Register& registration() { return reg_; }
  void Send(const MapMessage& m) { ASSERT_TRUE(socket_->Send(m).ok()); }
  void SendRaw(std::span<const uint8_t> frame) { ASSERT_TRUE(socket_->SendRaw(frame).ok()); }
  // Streams one iteration's contexts.
  void Stream(uint64_t request, uint32_t iteration, const Entry& e, bool finished) {
    Send(IterationStart{request, iteration, e.sem});
    for (uint32_t l = 0; l < kL; ++l) {
      Send(LayerObserved{request, iteration, l,
                         std::vector<float>(e.map.begin() + l * kJ, e.map.begin() + (l + 1) * kJ)});
    }
    Send(IterationEnd{request, iteration, finished});
  }
  std::optional<MapMessage> Receive(int timeout_ms) {
    auto in = socket_->Receive(timeout_ms);
    if (!in) return std::nullopt;
    return in->message;
  }
  Json Stats() {
    AdminRequest r;
    r.id = ++admin_id_;
    r.op = AdminOp::kStats;
    auto reply = Admin(r);
    return reply ? Json::parse(reply->json) : Json();
  }
  std::optional<AdminReply> Admin(const AdminRequest& r) {
    Send(r);
    for (int i = 0; i < 1000; ++i) {
      auto m = Receive(5000);
      if (!m) return std::nullopt;
      if (auto* a = std::get_if<AdminReply>(&*m); a != nullptr && a->id == r.id) return *a;
    }
    return std::nullopt;
  }

 private:
  wire::Context context_;
  std::unique_ptr<wire::MapSocket> socket_;
  fmoe::Register reg_;
  uint64_t admin_id_ = 100;
};

bool SameDirective(const PrefetchDirective& a, const PrefetchDirective& b) {
  if (a.request_id != b.request_id || a.iteration != b.iteration ||
      a.target_layer != b.target_layer || a.score != b.score ||
      a.entries.size() != b.entries.size()) {
    return false;
  }
  for (size_t i = 0; i < a.entries.size(); ++i) {
    if (a.entries[i].expert != b.entries[i].expert ||
        a.entries[i].probability != b.entries[i].probability ||
        a.entries[i].priority != b.entries[i].priority) {
      return false;
    }
  }
  return true;
}

std::string Describe(const std::vector<PrefetchDirective>& ds) {
  std::ostringstream s;
  for (const auto& d : ds) {
    s << "[L" << d.target_layer << " score " << d.score << ":";
    for (const auto& e : d.entries) s << ' ' << e.expert;
    s << ']';
  }
  return s.str();
}

// Streams a probe request and collects its directives (d at iteration start plus one per
// observed layer l < L - d, when the store is not empty) and the acknowledgement of its map.
std::vector<PrefetchDirective> Probe(Rank& rank, uint64_t request, const Entry& e,
                                     MapStored* stored = nullptr, size_t expect = kL) {
  rank.Stream(request, 0, e, true);
  std::vector<PrefetchDirective> out;
  bool acked = false;
  while (out.size() < expect || !acked) {
    auto m = rank.Receive(5000);
    if (!m) break;
    if (auto* d = std::get_if<PrefetchDirective>(&*m); d != nullptr && d->request_id == request) {
      out.push_back(*d);
    } else if (auto* s = std::get_if<MapStored>(&*m); s != nullptr && s->request_id == request) {
      acked = true;
      if (stored != nullptr) *stored = *s;
    }
  }
  return out;
}

// The directives a reference store holding `rows` (in row order) gives the probe.
std::vector<PrefetchDirective> Expected(const std::vector<std::pair<uint64_t, Entry>>& rows,
                                        uint32_t capacity, uint64_t request, const Entry& e) {
  auto store = MapStore::Create({kL, kJ, kK, kH, capacity, kD});
  EXPECT_TRUE(store.ok());
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_TRUE(
        store->Put(static_cast<uint32_t>(i), rows[i].first, rows[i].second.sem, rows[i].second.map)
            .ok());
  }
  MapMatcher matcher(*store, {.prefetch_distance = kD});
  std::vector<PrefetchDirective> out;
  matcher.OnIterationStart({request, 0, e.sem}, &out);
  for (uint32_t l = 0; l < kL; ++l) {
    matcher.OnLayerObserved(
        {request, 0, l, std::vector<float>(e.map.begin() + l * kJ, e.map.begin() + (l + 1) * kJ)},
        &out);
  }
  return out;
}

// Reads an export file: (id, entry) in row order.
std::vector<std::pair<uint64_t, Entry>> ReadExport(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<uint64_t> aligned((bytes.size() + 7) / 8);
  std::memcpy(aligned.data(), bytes.data(), bytes.size());
  const auto* buf = reinterpret_cast<const uint8_t*>(aligned.data());
  flatbuffers::Verifier v(buf, bytes.size());
  EXPECT_TRUE(store::VerifyMapExportBuffer(v)) << path;
  std::vector<std::pair<uint64_t, Entry>> out;
  const auto* ex = store::GetMapExport(buf);
  EXPECT_EQ(ex->fingerprint(), kModel);
  for (const auto* m : *ex->maps()) {
    out.push_back(
        {m->id(), {{m->sem()->begin(), m->sem()->end()}, {m->map()->begin(), m->map()->end()}}});
  }
  return out;
}

class MapServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::MakeTempDir("fmoe-map-service"); }
  void TearDown() override {
    std::error_code ec;
    if (!HasFailure()) std::filesystem::remove_all(dir_, ec);
  }

  std::string WriteManifest(const std::string& name, int port, int capacity,
                            const std::string& data = "maps") {
    std::string path = dir_ + "/" + name + ".yaml";
    testing::WriteFile(path,
                       "model:\n  path: " + std::string(FMOE_SOURCE_DIR) +
                           "/deploy/models/tiny-moe\n"
                           "map_service:\n  endpoint: tcp://127.0.0.1:" +
                           std::to_string(port) + "\n  data_dir: " + dir_ + "/" + data +
                           "\n  store_capacity: " + std::to_string(capacity) +
                           "\n  prefetch_distance: " + std::to_string(kD) +
                           "\nworker_groups:\n  - name: g0\n    workers:\n      - device: cpu\n"
                           "router:\n  listen: 127.0.0.1:" +
                           std::to_string(FreeTcpPort()) +
                           "\n  worker_endpoint: tcp://127.0.0.1:" + std::to_string(FreeTcpPort()) +
                           "\nheartbeat:\n  interval_ms: 100\n  timeout_ms: 30000\n");
    // This test's sockets speak with the service: with the cluster key.
    std::string error;
    EXPECT_TRUE(testing::UseClusterKeyOf(path, &error)) << error;
    return path;
  }
  std::unique_ptr<Child> StartService(const std::string& manifest, const std::string& log) {
    return std::make_unique<Child>(
        std::vector<std::string>{BinDir() + "/fmoe-map-service", "--manifest", manifest},
        dir_ + "/" + log);
  }

  std::string dir_;
};

TEST_F(MapServiceTest, DirectivesReachEveryRankAndMapsAreAcknowledged) {
  const int port = FreeTcpPort();
  const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(port);
  auto service = StartService(WriteManifest("m", port, 100), "ms.log");
  Rank r0(endpoint, "w/g0/0", 0, 2), r1(endpoint, "w/g0/1", 1, 2);
  ASSERT_TRUE(r0.Join()) << service->Log();
  ASSERT_TRUE(r1.Join());

  MapSource source(1);
  std::vector<std::pair<uint64_t, Entry>> stored;
  for (uint64_t req = 1; req <= 20; ++req) {
    Entry e = source.Next();
    r0.Stream(req, 0, e, true);
    bool acked = false;
    while (!acked) {
      auto m = r0.Receive(5000);
      ASSERT_TRUE(m.has_value()) << "no MapStored for request " << req;
      if (auto* s = std::get_if<MapStored>(&*m)) {
        EXPECT_EQ(s->request_id, req);
        EXPECT_EQ(s->replaced_id, 0u);
        stored.push_back({s->entry_id, e});
        acked = true;
      }
    }
  }
  // Drain the directives the first maps caused, then probe.
  while (r0.Receive(300)) {
  }
  while (r1.Receive(300)) {
  }
  Entry probe = source.Next();
  auto got = Probe(r0, 999, probe);
  auto want = Expected(stored, 100, 999, probe);
  ASSERT_EQ(want.size(), kL);
  ASSERT_EQ(got.size(), want.size()) << Describe(got);
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(SameDirective(got[i], want[i])) << Describe(got) << " vs " << Describe(want);
  }
  // Rank 1 of the same group gets the same directives.
  std::vector<PrefetchDirective> other;
  while (other.size() < kL) {
    auto m = r1.Receive(5000);
    if (!m) break;
    if (auto* d = std::get_if<PrefetchDirective>(&*m); d && d->request_id == 999) {
      other.push_back(*d);
    }
  }
  ASSERT_EQ(other.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(SameDirective(other[i], want[i]));

  Json stats = r0.Stats();
  EXPECT_EQ(stats["models"][0]["maps"], 21) << stats.dump();  // 20 + the probe.
  EXPECT_EQ(stats["counters"]["maps_stored"], 21);
  EXPECT_GE(stats["counters"]["directives_sent"].get<int>(), 2 * static_cast<int>(kL));
  EXPECT_GE(stats["match_latency_us"]["count"].get<int>(), static_cast<int>(kL));
  EXPECT_EQ(stats["requests_in_flight"], 0);
}

// The fmoe-traj and fmoe-traj-sem ablations: a rank registered without semantic matching gets
// no directives at iteration start; one without delta gets exactly top-k experts.
TEST_F(MapServiceTest, RegistrationChoosesTheMatching) {
  const int port = FreeTcpPort();
  const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(port);
  auto service = StartService(WriteManifest("m", port, 100), "ms.log");
  Rank full(endpoint, "w/g0/0");
  Rank traj(endpoint, "w/traj/0", 0, 1, "traj");
  traj.registration().semantic = false;
  Rank nodelta(endpoint, "w/nodelta/0", 0, 1, "nodelta");
  nodelta.registration().delta = false;
  ASSERT_TRUE(full.Join()) << service->Log();
  ASSERT_TRUE(traj.Join());
  ASSERT_TRUE(nodelta.Join());
  MapSource source(9);
  for (uint64_t req = 1; req <= 10; ++req) full.Stream(req, 0, source.Next(), true);
  ASSERT_TRUE(
      testing::WaitUntil([&] { return full.Stats()["counters"]["maps_stored"] == 10; }, 10000));
  const Entry probe = source.Next();
  auto got = Probe(traj, 100, probe, nullptr, kL - kD);
  ASSERT_EQ(got.size(), kL - kD);
  for (const auto& d : got) EXPECT_GE(d.target_layer, kD);
  EXPECT_FALSE(traj.Receive(300).has_value());  // Nothing more.
  // Probe with an unlikely map (low similarity): with delta, more than top-k experts.
  // An embedding opposite to every stored one: semantic score near -1, delta 1.
  Entry odd = probe;
  std::reverse(odd.map.begin(), odd.map.end());
  for (float& x : odd.sem) x = -x;
  got = Probe(full, 102, odd);
  ASSERT_EQ(got.size(), kL);
  size_t wider = 0;
  for (const auto& d : got) wider += d.entries.size() > kK;
  EXPECT_GT(wider, 0u) << Describe(got);
  // Another unlikely map (the one above is stored now) for the rank without delta.
  Entry odd2 = source.Next();
  std::reverse(odd2.map.begin(), odd2.map.end());
  for (float& x : odd2.sem) x = -x;
  got = Probe(nodelta, 101, odd2);
  ASSERT_EQ(got.size(), kL);
  for (const auto& d : got) EXPECT_EQ(d.entries.size(), kK) << Describe(got);
}

TEST_F(MapServiceTest, AcknowledgedMapsSurviveKillNineCycles) {
  const int port = FreeTcpPort();
  const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(port);
  constexpr uint32_t kCapacity = 48;  // Small: deduplication replaces maps during the run.
  const std::string manifest = WriteManifest("m", port, kCapacity);
  MapSource source(2);
  std::map<uint64_t, Entry> live;  // Acknowledged and not replaced since.
  std::map<uint64_t, Entry> sent;  // Per request id, what it streamed.
  uint64_t request = 1;
  std::mt19937 rng(3);
  uint64_t replaced_total = 0;
  for (int cycle = 0; cycle < 20; ++cycle) {
    SCOPED_TRACE("cycle " + std::to_string(cycle));
    auto service = StartService(manifest, "ms" + std::to_string(cycle) + ".log");
    // Distinct routing ids: a client of an earlier cycle reconnects to the new service too, and
    // must not take over this one's id.
    Rank rank(endpoint, "w/g0/0/c" + std::to_string(cycle));
    ASSERT_TRUE(rank.Join()) << service->Log();

    // After a restart: every acknowledged map is there, intact, in the export.
    AdminRequest ex;
    ex.id = 1;
    ex.op = AdminOp::kExport;
    ex.path = dir_ + "/export.fmx";
    auto reply = rank.Admin(ex);
    ASSERT_TRUE(reply.has_value() && reply->ok) << (reply ? reply->error : "no reply");
    auto rows = ReadExport(ex.path);
    std::map<uint64_t, const Entry*> by_id;
    for (const auto& [id, e] : rows) by_id[id] = &e;
    // A map stored just before the kill but not yet acknowledged is durable too, and may have
    // replaced an acknowledged one (deduplication): an acknowledged map may be missing only
    // where such a row is there, one each, and that row must be a map the rank sent.
    size_t unacknowledged_rows = 0;
    for (const auto& [id, e] : rows) {
      if (live.count(id) != 0) continue;
      ++unacknowledged_rows;
      bool was_sent = false;
      for (const auto& [req, s] : sent) {
        if (s.map == e.map && s.sem == e.sem) {
          was_sent = true;
          break;
        }
      }
      EXPECT_TRUE(was_sent) << "row " << id << " is no map the rank sent";
    }
    std::vector<uint64_t> missing;
    for (const auto& [id, e] : live) {
      auto it = by_id.find(id);
      if (it == by_id.end()) {
        missing.push_back(id);
        continue;
      }
      EXPECT_EQ(it->second->sem, e.sem) << "map " << id;
      EXPECT_EQ(it->second->map, e.map) << "map " << id;
    }
    ASSERT_LE(missing.size(), unacknowledged_rows)
        << "acknowledged map " << missing.front() << " is missing (" << missing.size()
        << " missing, " << unacknowledged_rows << " rows stored without acknowledgement)";
    // From here on the store's rows are what must survive.
    live.clear();
    for (const auto& [id, e] : rows) live[id] = e;
    Entry probe = source.Next();
    // The store was written before memory on every insert, so the rows rebuilt from disk are
    // the killed service's rows: the restarted service must match exactly as a reference over
    // them (same rows, same order).
    if (!rows.empty()) {
      const uint64_t probe_id = (uint64_t{1} << 40) + static_cast<uint64_t>(cycle);
      auto want = Expected(rows, kCapacity, probe_id, probe);
      MapStored probe_stored;
      auto got = Probe(rank, probe_id, probe, &probe_stored);
      ASSERT_EQ(got.size(), want.size()) << Describe(got);
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_TRUE(SameDirective(got[i], want[i])) << Describe(got) << " vs " << Describe(want);
      }
      live[probe_stored.entry_id] = probe;
      live.erase(probe_stored.replaced_id);
      probe = source.Next();
    }

    // Stream maps without waiting, kill -9 after a random number of acknowledgements.
    const int kill_after = 3 + static_cast<int>(rng() % 12);
    int acked = 0;
    for (int i = 0; i < 200 && acked < kill_after; ++i) {
      Entry e = source.Next();
      sent[request] = e;
      rank.Stream(request, 0, e, true);
      ++request;
      while (auto m = rank.Receive(i % 4 == 0 ? 20 : 0)) {
        if (auto* s = std::get_if<MapStored>(&*m)) {
          live[s->entry_id] = sent.at(s->request_id);
          if (s->replaced_id != 0) {
            live.erase(s->replaced_id);
            ++replaced_total;
          }
          ++acked;
        }
      }
    }
    service->Signal(SIGKILL);
    service->Wait(5000);

    // Every fifth cycle, also a quiet kill -9 (nothing in flight): the store is identical across
    // it, and the restarted service matches exactly as a reference over the rows exported
    // before the kill.
    if (cycle % 5 == 4) {
      auto quiet = StartService(manifest, "quiet" + std::to_string(cycle) + ".log");
      Rank q(endpoint, "w/g0/0/q" + std::to_string(cycle));
      ASSERT_TRUE(q.Join()) << quiet->Log();
      ASSERT_TRUE(q.Admin(ex).has_value());
      auto rows_before = ReadExport(ex.path);
      quiet->Signal(SIGKILL);
      quiet->Wait(5000);
      auto again = StartService(manifest, "again" + std::to_string(cycle) + ".log");
      Rank a(endpoint, "w/g0/0/a" + std::to_string(cycle));
      ASSERT_TRUE(a.Join()) << again->Log();
      ASSERT_TRUE(a.Admin(ex).has_value());
      auto rows_after = ReadExport(ex.path);
      ASSERT_EQ(rows_before.size(), rows_after.size());
      for (size_t i = 0; i < rows_before.size(); ++i) {
        EXPECT_EQ(rows_before[i].first, rows_after[i].first);
        EXPECT_EQ(rows_before[i].second.map, rows_after[i].second.map);
      }
      auto want = Expected(rows_before, kCapacity, 1u << 30, probe);
      MapStored probe_stored;
      auto got = Probe(a, 1u << 30, probe, &probe_stored);
      // The probe's own map is stored too (possibly replacing one).
      live[probe_stored.entry_id] = probe;
      live.erase(probe_stored.replaced_id);
      ASSERT_EQ(got.size(), want.size()) << Describe(got);
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_TRUE(SameDirective(got[i], want[i])) << Describe(got) << " vs " << Describe(want);
      }
      again->Signal(SIGKILL);
      again->Wait(5000);
    }
  }
  EXPECT_GT(live.size(), 20u);
  EXPECT_GT(replaced_total, 0u) << "deduplication never replaced a map";
}

TEST_F(MapServiceTest, ExportImportWarmsANewService) {
  const int port = FreeTcpPort(), port2 = FreeTcpPort();
  const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(port);
  const std::string endpoint2 = "tcp://127.0.0.1:" + std::to_string(port2);
  auto first = StartService(WriteManifest("a", port, 32, "maps-a"), "a.log");
  Rank r(endpoint, "w/g0/0");
  ASSERT_TRUE(r.Join()) << first->Log();
  MapSource source(4);
  for (uint64_t req = 1; req <= 40; ++req) r.Stream(req, 0, source.Next(), true);
  ASSERT_TRUE(
      testing::WaitUntil([&] { return r.Stats()["counters"]["maps_stored"] == 40; }, 10000));
  AdminRequest ex{
      .id = 5, .op = AdminOp::kExport, .model_fingerprint = 0, .path = dir_ + "/store.fmx"};
  auto reply = r.Admin(ex);
  ASSERT_TRUE(reply && reply->ok) << (reply ? reply->error : "none");
  EXPECT_EQ(Json::parse(reply->json)["maps"], 32);

  // A relative path and a missing file are refused with a reason.
  AdminRequest bad = ex;
  bad.id = 6;
  bad.path = "store.fmx";
  reply = r.Admin(bad);
  ASSERT_TRUE(reply.has_value());
  EXPECT_FALSE(reply->ok);
  EXPECT_NE(reply->error.find("must be absolute"), std::string::npos) << reply->error;

  auto second = StartService(WriteManifest("b", port2, 32, "maps-b"), "b.log");
  Rank r2(endpoint2, "w/g0/0");
  ASSERT_TRUE(r2.Join()) << second->Log();
  AdminRequest im{.id = 7, .op = AdminOp::kImport, .model_fingerprint = 0, .path = ex.path};
  im.path = dir_ + "/missing.fmx";
  reply = r2.Admin(im);
  ASSERT_TRUE(reply.has_value());
  EXPECT_FALSE(reply->ok);
  EXPECT_NE(reply->error.find("does not exist"), std::string::npos) << reply->error;
  testing::WriteFile(dir_ + "/junk.fmx", "this is not an export at all");
  im.path = dir_ + "/junk.fmx";
  reply = r2.Admin(im);
  ASSERT_TRUE(reply.has_value());
  EXPECT_FALSE(reply->ok);
  EXPECT_NE(reply->error.find("not an fmoe map export"), std::string::npos) << reply->error;

  im.path = ex.path;
  reply = r2.Admin(im);
  ASSERT_TRUE(reply && reply->ok) << (reply ? reply->error : "none");
  EXPECT_EQ(Json::parse(reply->json)["imported"], 32);
  EXPECT_EQ(Json::parse(reply->json)["maps"], 32);

  // Both services now match a probe alike.
  Entry probe = source.Next();
  auto a = Probe(r, 500, probe);
  auto b = Probe(r2, 500, probe);
  ASSERT_EQ(a.size(), kL);
  ASSERT_EQ(b.size(), kL);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].target_layer, b[i].target_layer);
    EXPECT_EQ(a[i].score, b[i].score);
    ASSERT_EQ(a[i].entries.size(), b[i].entries.size());
    for (size_t k = 0; k < a[i].entries.size(); ++k) {
      EXPECT_EQ(a[i].entries[k].expert, b[i].entries[k].expert);
    }
  }
}

TEST_F(MapServiceTest, FmoeMapsShowsExportsAndImports) {
  const int port = FreeTcpPort();
  const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(port);
  const std::string manifest = WriteManifest("m", port, 16);
  auto service = StartService(manifest, "ms.log");
  Rank r(endpoint, "w/g0/0");
  ASSERT_TRUE(r.Join()) << service->Log();
  MapSource source(6);
  for (uint64_t req = 1; req <= 5; ++req) r.Stream(req, 0, source.Next(), true);
  ASSERT_TRUE(testing::WaitUntil([&] { return r.Stats()["counters"]["maps_stored"] == 5; }, 10000));
  const std::string fmoe = BinDir() + "/fmoe";

  auto [code, out] = testing::RunCommand({fmoe, "maps", manifest}, 20000);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("abcdef01"), std::string::npos) << out;
  EXPECT_NE(out.find("5/16"), std::string::npos) << out;

  std::tie(code, out) =
      testing::RunCommand({fmoe, "maps", manifest, "--export", dir_ + "/cli.fmx"}, 20000);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("exported 5 maps of model 00000000abcdef01"), std::string::npos) << out;
  EXPECT_EQ(ReadExport(dir_ + "/cli.fmx").size(), 5u);

  // Importing its own export deduplicates into the store: 5 more maps, 10 in all.
  std::tie(code, out) =
      testing::RunCommand({fmoe, "maps", manifest, "--import", dir_ + "/cli.fmx"}, 20000);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("imported 5 maps"), std::string::npos) << out;
  EXPECT_NE(out.find("the store holds 10"), std::string::npos) << out;

  std::tie(code, out) =
      testing::RunCommand({fmoe, "maps", manifest, "--import", dir_ + "/nothing.fmx"}, 20000);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("does not exist"), std::string::npos) << out;
  std::tie(code, out) = testing::RunCommand({fmoe, "maps", manifest, "--model", "xyz"}, 20000);
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("is not a fingerprint"), std::string::npos) << out;
  std::tie(code, out) = testing::RunCommand({fmoe, "maps", manifest, "--model", "1234"}, 20000);
  EXPECT_EQ(code, 0) << out;  // Stats ignore the model.
  std::tie(code, out) =
      testing::RunCommand({fmoe, "maps", manifest, "--model", "1234", "--export", "/tmp/x"}, 20000);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("model 0000000000001234 is not stored"), std::string::npos) << out;
}

// Corrupt RocksDB records (garbage, a map of the wrong shape, an id that is not its key, junk in
// the default column family) are reported and skipped at start; every other map loads, and
// the service serves and stores new maps with fresh ids.
TEST_F(MapServiceTest, CorruptRecordsAreSkippedAndReported) {
  const int port = FreeTcpPort();
  const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(port);
  const std::string manifest = WriteManifest("m", port, 100);
  MapSource source(11);
  std::vector<uint64_t> ids;
  {
    auto service = StartService(manifest, "ms1.log");
    Rank r(endpoint, "w/g0/0/1");
    ASSERT_TRUE(r.Join()) << service->Log();
    for (uint64_t req = 1; req <= 10; ++req) {
      r.Stream(req, 0, source.Next(), true);
      for (;;) {
        auto m = r.Receive(5000);
        ASSERT_TRUE(m.has_value());
        if (auto* st = std::get_if<MapStored>(&*m)) {
          ids.push_back(st->entry_id);
          break;
        }
      }
    }
    service->Signal(SIGKILL);
    service->Wait(5000);
  }
  {
    // Damage the database directly.
    const std::string path = dir_ + "/maps";
    std::vector<std::string> names;
    ASSERT_TRUE(rocksdb::DB::ListColumnFamilies(rocksdb::Options(), path, &names).ok());
    std::vector<rocksdb::ColumnFamilyDescriptor> families;
    for (const auto& n : names) families.emplace_back(n, rocksdb::ColumnFamilyOptions());
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), path, families, &handles, &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    rocksdb::ColumnFamilyHandle* maps = nullptr;
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i].rfind("maps/", 0) == 0) maps = handles[i];
    }
    ASSERT_NE(maps, nullptr);
    auto key = [](uint64_t id) {
      std::string k(8, '\0');
      for (int i = 0; i < 8; ++i) k[static_cast<size_t>(i)] = static_cast<char>(id >> (56 - 8 * i));
      return k;
    };
    std::string value;
    ASSERT_TRUE(db->Get(rocksdb::ReadOptions(), maps, key(ids[3]), &value).ok());
    // Garbage under a real id; a real record under a key that is not its id; a truncated one.
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), maps, key(ids[2]), "not a record at all").ok());
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), maps, key(999999), value).ok());
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), maps, key(ids[5]), value.substr(0, 40)).ok());
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), maps, "short", value).ok());
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), "model/zz", "junk").ok());
    for (auto* h : handles) db->DestroyColumnFamilyHandle(h);
    ASSERT_TRUE(db->Close().ok());
  }
  auto service = StartService(manifest, "ms2.log");
  Rank r(endpoint, "w/g0/0/2");
  ASSERT_TRUE(r.Join()) << service->Log();
  const std::string log = service->Log();
  size_t reported = 0;
  for (size_t at = log.find("skipped corrupt record"); at != std::string::npos;
       at = log.find("skipped corrupt record", at + 1)) {
    ++reported;
  }
  EXPECT_EQ(reported, 5u) << log;
  EXPECT_NE(log.find("/999999: holds id " + std::to_string(ids[3])), std::string::npos) << log;
  EXPECT_NE(log.find("model/zz"), std::string::npos) << log;
  EXPECT_NE(log.find("8 maps loaded"), std::string::npos) << log;
  EXPECT_NE(log.find("5 corrupt records"), std::string::npos) << log;
  // It serves, and a new map gets an id beyond every stored one.
  r.Stream(100, 0, source.Next(), true);
  for (;;) {
    auto m = r.Receive(5000);
    ASSERT_TRUE(m.has_value());
    if (auto* st = std::get_if<MapStored>(&*m)) {
      EXPECT_GT(st->entry_id, ids.back());
      break;
    }
  }
  EXPECT_EQ(r.Stats()["models"][0]["maps"], 9);
}

TEST_F(MapServiceTest, BadFramesAndWrongShapesAreCountedWhileValidTrafficFlows) {
  const int port = FreeTcpPort();
  const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(port);
  auto service = StartService(WriteManifest("m", port, 16), "ms.log");
  Rank r(endpoint, "w/g0/0");
  ASSERT_TRUE(r.Join()) << service->Log();
  MapSource source(5);

  // Garbage, a truncated valid frame, an oversized frame.
  const std::vector<uint8_t> junk = {9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9};
  r.SendRaw(junk);
  Entry e = source.Next();
  std::vector<uint8_t> valid = wire::Encode(MapMessage(IterationStart{1, 0, e.sem}));
  r.SendRaw(std::span<const uint8_t>(valid).first(valid.size() / 2));
  std::vector<uint8_t> huge(12u << 20, 0x5a);  // Above the 8 MiB frame limit.
  r.SendRaw(huge);
  // Wrong shapes: a gate distribution of J + 1 floats, an embedding of h - 1, a layer out of
  // order, and an end for a request never started.
  r.Send(IterationStart{2, 0, std::vector<float>(kH - 1, 0.1f)});
  r.Send(IterationStart{3, 0, e.sem});
  r.Send(LayerObserved{3, 0, 0, std::vector<float>(kJ + 1, 0.1f)});
  r.Send(LayerObserved{3, 0, 4, std::vector<float>(kJ, 0.1f)});
  r.Send(IterationEnd{12345, 0, true});
  // Valid traffic still gets its answers.
  r.Stream(4, 0, e, true);
  bool acked = false;
  for (int i = 0; i < 100 && !acked; ++i) {
    auto m = r.Receive(5000);
    ASSERT_TRUE(m.has_value()) << service->Log();
    acked = std::holds_alternative<MapStored>(*m);
  }
  EXPECT_TRUE(acked);
  Json stats = r.Stats();
  const Json& dropped = stats["wire"]["dropped"];
  EXPECT_GE(dropped["bad_identifier"].get<int>() + dropped["malformed"].get<int>() +
                dropped["truncated"].get<int>(),
            2)
      << stats.dump();
  EXPECT_EQ(dropped["oversized"], 1) << stats.dump();
  EXPECT_EQ(stats["counters"]["contexts_invalid"], 4) << stats.dump();
  EXPECT_EQ(stats["counters"]["maps_stored"], 1);
  EXPECT_TRUE(testing::ProcessAlive(service->pid()));
}

}  // namespace
}  // namespace fmoe
