// The map service in-process, its store writer held at a gate before each job: contexts are
// still matched while a write is stuck; at max_pending_writes completed maps are dropped and
// registrations and exports refused as busy; once released, the held maps are acknowledged in
// completion order. At stop the drain writes what it can within drain_timeout_ms and abandons
// the rest, and every acknowledged map is on disk after a restart. An import of a model that no
// rank registered creates it. Registration is bounded by memory_limit_mb and leaves nothing
// behind when refused; a stored model beyond the limit is not loaded; a model can be dropped.
// Disk trouble (write failures injected under RocksDB): the store turns read-only, matching and
// stats go on, the log is throttled, and it recovers with nothing acknowledged lost; a start on
// a disk that refuses writes serves read-only. (The process itself:
// tests/integration/map_service_test.cc.)
#include "map_service/map_service.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include <spdlog/sinks/ostream_sink.h>

#include "common/json.h"
#include "common/log.h"
#include "common/model/model_config.h"
#include "map_service/export_file.h"
#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;
constexpr uint32_t kL = 8, kJ = 8, kK = 2, kH = 16, kD = 3;
constexpr uint64_t kModel = 0x77;

// Holds the store writer before each job while closed.
class Gate {
 public:
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = false;
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void Pass() {
    std::unique_lock<std::mutex> lock(mu_);
    ++waiting_;
    cv_.notify_all();
    cv_.wait(lock, [this] { return open_; });
    --waiting_;
  }
  // True once a job waits at the closed gate.
  bool WaitForJob(int timeout_ms) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                        [this] { return waiting_ > 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
  int waiting_ = 0;
};

// A service running on its own thread.
class Service {
 public:
  Service(MapServiceOptions options, Gate* gate) {
    if (gate != nullptr) options.before_store_job = [gate](std::stop_token) { gate->Pass(); };
    service_ = std::make_unique<MapService>(options, SteadyClock::Get());
    Status s = service_->Start();
    EXPECT_TRUE(s.ok()) << s.ToString();
    thread_ = std::thread([this] { service_->Run([this] { return stop_.load(); }); });
  }
  ~Service() { Stop(); }
  void RequestStop() { stop_ = true; }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  const MapServiceCounters& counters() const { return service_->counters(); }  // After Stop.

 private:
  std::unique_ptr<MapService> service_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

std::vector<float> RandomMap(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(0.01f, 1.0f);
  std::vector<float> map(kL * kJ);
  for (uint32_t l = 0; l < kL; ++l) {
    float sum = 0;
    for (uint32_t j = 0; j < kJ; ++j) sum += map[l * kJ + j] = u(rng);
    for (uint32_t j = 0; j < kJ; ++j) map[l * kJ + j] /= sum;
  }
  return map;
}

std::vector<float> RandomSem(std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> sem(kH);
  for (float& x : sem) x = n(rng);
  return sem;
}

// One rank's DEALER.
class Client {
 public:
  Client(const std::string& endpoint, const std::string& id, const std::string& group = "g0") {
    wire::SocketOptions o;
    o.routing_id = id;
    auto s = wire::MapSocket::Connect(context_, wire::Role::kDealer, endpoint, o);
    EXPECT_TRUE(s.ok());
    socket_ = std::move(*s);
    reg_.group = group;
    reg_.world_size = 1;
    reg_.model_fingerprint = kModel;
    reg_.num_layers = kL;
    reg_.num_experts = kJ;
    reg_.top_k = kK;
    reg_.hidden_size = kH;
  }
  const fmoe::Register& registration() const { return reg_; }
  fmoe::Register& registration() { return reg_; }
  std::optional<RegisterAck> Register() {
    if (!socket_->Send(reg_).ok()) return std::nullopt;
    return Await<RegisterAck>([](const RegisterAck&) { return true; });
  }
  void Send(const MapMessage& m) { ASSERT_TRUE(socket_->Send(m).ok()); }
  // One whole iteration: a complete map.
  void Stream(uint64_t request, std::mt19937& rng) {
    Send(IterationStart{request, 0, RandomSem(rng)});
    const std::vector<float> map = RandomMap(rng);
    for (uint32_t l = 0; l < kL; ++l) {
      Send(LayerObserved{request, 0, l, {map.begin() + l * kJ, map.begin() + (l + 1) * kJ}});
    }
    Send(IterationEnd{request, 0, true});
  }
  // The next message of type T that `match` accepts; others are skipped (and counted).
  template <class T, class Match>
  std::optional<T> Await(Match match, int timeout_ms = 10000) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < deadline) {
      auto in = socket_->Receive(50);
      if (!in) continue;
      if (auto* s = std::get_if<MapStored>(&in->message)) stored_.push_back(s->request_id);
      if (auto* t = std::get_if<T>(&in->message); t != nullptr && match(*t)) return *t;
    }
    return std::nullopt;
  }
  std::optional<AdminReply> Admin(AdminOp op, const std::string& path = {}, uint64_t model = 0) {
    AdminRequest r;
    r.id = ++admin_id_;
    r.op = op;
    r.path = path;
    r.model_fingerprint = model;
    Send(r);
    return Await<AdminReply>([&](const AdminReply& a) { return a.id == r.id; });
  }
  // `fmoe maps --drop`.
  std::optional<AdminReply> Drop(uint64_t model) { return Admin(AdminOp::kDrop, "", model); }
  std::optional<RankHeartbeatAck> Heartbeat() {
    Send(RankHeartbeat{reg_.group, reg_.rank, reg_.instance_id, ++seq_});
    return Await<RankHeartbeatAck>([&](const RankHeartbeatAck& a) { return a.seq == seq_; });
  }
  // Directives for the first layers of a new iteration (the store must hold a map).
  bool Matched(uint64_t request, std::mt19937& rng) {
    Send(IterationStart{request, 0, RandomSem(rng)});
    const bool got = Await<PrefetchDirective>([&](const PrefetchDirective& d) {
                       return d.request_id == request;
                     }).has_value();
    Send(IterationEnd{request, 0, true});  // Incomplete: nothing to store.
    return got;
  }
  Json Stats() {
    auto reply = Admin(AdminOp::kStats);
    return reply ? Json::parse(reply->json) : Json();
  }
  // True once the MapStored of `request` arrived (before this call or within 10 s).
  bool AwaitStored(uint64_t request) {
    if (std::find(stored_.begin(), stored_.end(), request) != stored_.end()) return true;
    return Await<MapStored>([&](const MapStored& s) { return s.request_id == request; })
        .has_value();
  }
  // Request ids of every MapStored seen so far, in arrival order.
  const std::vector<uint64_t>& stored() const { return stored_; }
  void Drain(int ms) {
    Await<MapStored>([](const MapStored&) { return false; }, ms);
  }

 private:
  wire::Context context_;
  std::unique_ptr<wire::MapSocket> socket_;
  fmoe::Register reg_;
  uint64_t admin_id_ = 0;
  uint64_t seq_ = 0;
  std::vector<uint64_t> stored_;
};

class MapServiceCoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("fmoe-map-service-core");
    options_.endpoint = "tcp://127.0.0.1:" + std::to_string(testing::FreeTcpPort());
    options_.data_dir = dir_ + "/db";
    options_.store_capacity = 100;
    options_.prefetch_distance = kD;
    options_.heartbeat_timeout_ms = 60000;
  }
  void TearDown() override {
    std::error_code ec;
    if (!HasFailure()) std::filesystem::remove_all(dir_, ec);
  }

  std::string dir_;
  MapServiceOptions options_;
  std::mt19937 rng_{5};
};

TEST_F(MapServiceCoreTest, MatchingGoesOnWhileAWriteIsHeldAndTheLimitDropsMaps) {
  Gate gate;
  options_.max_pending_writes = 4;
  Service service(options_, &gate);
  Client c(options_.endpoint, "w/g0/0");
  auto ack = c.Register();
  ASSERT_TRUE(ack && ack->accepted) << (ack ? ack->reason : "no ack");
  for (uint64_t req = 1; req <= 2; ++req) {
    c.Stream(req, rng_);
    ASSERT_TRUE(c.AwaitStored(req));
  }

  gate.Close();
  c.Stream(3, rng_);
  ASSERT_TRUE(gate.WaitForJob(10000));                          // Map 3's write holds the writer.
  for (uint64_t req = 4; req <= 7; ++req) c.Stream(req, rng_);  // 4..6 wait; 7 is one too many.

  // Matching goes on: an iteration's directives arrive while the write is held.
  c.Send(IterationStart{100, 0, RandomSem(rng_)});
  const std::vector<float> map = RandomMap(rng_);
  for (uint32_t l = 0; l < 3; ++l) {
    c.Send(LayerObserved{100, 0, l, {map.begin() + l * kJ, map.begin() + (l + 1) * kJ}});
  }
  for (uint32_t target = 0; target < 6; ++target) {
    EXPECT_TRUE(c.Await<PrefetchDirective>([&](const PrefetchDirective& d) {
      return d.request_id == 100 && d.target_layer == target;
    })) << "no directive for layer "
        << target << " while the write is held";
  }
  c.Send(IterationEnd{100, 0, true});  // Incomplete: nothing to store.

  Json stats = c.Stats();
  EXPECT_EQ(stats["store_writes"]["pending"], 4) << stats.dump();
  EXPECT_EQ(stats["store_writes"]["maps_waiting"], 3) << stats.dump();
  EXPECT_EQ(stats["counters"]["maps_dropped"], 1) << stats.dump();
  EXPECT_EQ(stats["counters"]["maps_stored"], 2) << stats.dump();

  // Registrations and exports are refused while the limit is reached.
  Client other(options_.endpoint, "w/g1/0", "g1");
  ack = other.Register();
  ASSERT_TRUE(ack.has_value());
  EXPECT_FALSE(ack->accepted);
  EXPECT_NE(ack->reason.find("map service busy: 4 store writes pending"), std::string::npos)
      << ack->reason;
  auto reply = c.Admin(AdminOp::kExport, dir_ + "/busy.fmx");
  ASSERT_TRUE(reply.has_value());
  EXPECT_FALSE(reply->ok);
  EXPECT_NE(reply->error.find("busy"), std::string::npos) << reply->error;

  // Released: the held maps are acknowledged in completion order, the dropped one never.
  gate.Open();
  ASSERT_TRUE(c.AwaitStored(6));
  c.Drain(300);
  EXPECT_EQ(c.stored(), (std::vector<uint64_t>{1, 2, 3, 4, 5, 6}));
  stats = c.Stats();
  EXPECT_EQ(stats["counters"]["maps_stored"], 6) << stats.dump();
  EXPECT_EQ(stats["counters"]["maps_dropped"], 1);
  EXPECT_EQ(stats["counters"]["busy_refusals"], 2);
  EXPECT_EQ(stats["store_writes"]["pending"], 0);
  ack = other.Register();
  ASSERT_TRUE(ack.has_value());
  EXPECT_TRUE(ack->accepted) << ack->reason;
}

// A rank retries its Register and streams at once: everything it sends while its registration
// is being written waits for it and is then handled in order, so neither the contexts nor the
// map they complete are lost to the second registration's fresh matcher.
TEST_F(MapServiceCoreTest, APeersMessagesWaitForItsRegistrationInOrder) {
  Gate gate;
  Service service(options_, &gate);
  Client c(options_.endpoint, "w/g0/0");
  gate.Close();
  c.Send(c.registration());
  ASSERT_TRUE(gate.WaitForJob(10000));
  c.Send(c.registration());  // A retry.
  c.Stream(1, rng_);
  AdminRequest ping;
  ping.id = 42;
  ping.op = AdminOp::kPing;
  c.Send(ping);  // Waits behind the registration too.
  EXPECT_FALSE(c.Await<AdminReply>([](const AdminReply&) { return true; }, 300));
  gate.Open();
  auto ack = c.Await<RegisterAck>([](const RegisterAck&) { return true; });
  ASSERT_TRUE(ack && ack->accepted);
  ack = c.Await<RegisterAck>([](const RegisterAck&) { return true; });
  ASSERT_TRUE(ack && ack->accepted);
  EXPECT_TRUE(c.Await<AdminReply>([](const AdminReply& a) { return a.id == 42; }));
  EXPECT_TRUE(c.AwaitStored(1));
  const Json stats = c.Stats();
  EXPECT_EQ(stats["counters"]["maps_stored"], 1) << stats.dump();
  EXPECT_EQ(stats["counters"]["from_unregistered"], 0) << stats.dump();
  EXPECT_EQ(stats["counters"]["contexts_invalid"], 0) << stats.dump();
  EXPECT_EQ(stats["counters"]["registrations"], 2) << stats.dump();
}

TEST_F(MapServiceCoreTest, TheDrainAtStopWritesWhatItCanAndAbandonsTheRest) {
  Gate gate;
  {
    // Released during the drain: all three are written and acknowledged before Run returns.
    options_.drain_timeout_ms = 10000;
    Service service(options_, &gate);
    Client c(options_.endpoint, "w/g0/0");
    ASSERT_TRUE(c.Register());
    gate.Close();
    for (uint64_t req = 1; req <= 3; ++req) c.Stream(req, rng_);
    ASSERT_TRUE(gate.WaitForJob(10000));
    ASSERT_TRUE(
        testing::WaitUntil([&] { return c.Stats()["store_writes"]["pending"] == 3; }, 10000));
    service.RequestStop();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    gate.Open();
    service.Stop();
    EXPECT_EQ(service.counters().maps_stored, 3u);
    EXPECT_EQ(service.counters().maps_abandoned, 0u);
    c.Drain(500);
    EXPECT_EQ(c.stored(), (std::vector<uint64_t>{1, 2, 3}));
  }
  {
    // Not released within the drain: the write in progress finishes, the two waiting maps are
    // abandoned, neither stored nor acknowledged.
    options_.drain_timeout_ms = 100;
    Service service(options_, &gate);
    Client c(options_.endpoint, "w/g0/0/2");
    ASSERT_TRUE(c.Register());
    gate.Close();
    for (uint64_t req = 11; req <= 13; ++req) c.Stream(req, rng_);
    ASSERT_TRUE(gate.WaitForJob(10000));
    ASSERT_TRUE(
        testing::WaitUntil([&] { return c.Stats()["store_writes"]["pending"] == 3; }, 10000));
    service.RequestStop();
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // Past the drain.
    gate.Open();
    service.Stop();
    EXPECT_EQ(service.counters().maps_stored, 1u);
    EXPECT_EQ(service.counters().maps_abandoned, 2u);
    c.Drain(500);
    EXPECT_EQ(c.stored(), (std::vector<uint64_t>{11}));
  }
  // Every acknowledged map is on disk.
  Service service(options_, nullptr);
  Client c(options_.endpoint, "w/g0/0/3");
  ASSERT_TRUE(c.Register());
  EXPECT_EQ(c.Stats()["models"][0]["maps"], 4);
}

TEST_F(MapServiceCoreTest, AnImportCreatesAModelNoRankRegistered) {
  std::vector<MapRow> maps(5);
  for (size_t i = 0; i < maps.size(); ++i) {
    maps[i].id = i + 1;
    maps[i].row = static_cast<uint32_t>(i);
    maps[i].sem = RandomSem(rng_);
    maps[i].map = RandomMap(rng_);
  }
  maps[2].map[0] = std::nanf("");  // Skipped.
  const std::string path = dir_ + "/in.fmx";
  ASSERT_TRUE(WriteMapExport(path, {kModel, kL, kJ, kK, kH, 0}, maps).ok());
  {
    Service service(options_, nullptr);
    Client admin(options_.endpoint, "admin");
    auto reply = admin.Admin(AdminOp::kImport, path);
    ASSERT_TRUE(reply && reply->ok) << (reply ? reply->error : "no reply");
    const Json body = Json::parse(reply->json);
    EXPECT_EQ(body["imported"], 4) << reply->json;
    EXPECT_EQ(body["skipped"], 1) << reply->json;
    EXPECT_EQ(body["maps"], 4) << reply->json;
  }
  Service service(options_, nullptr);
  Client admin(options_.endpoint, "admin/2");
  const Json stats = admin.Stats();
  ASSERT_EQ(stats["models"].size(), 1u) << stats.dump();
  EXPECT_EQ(stats["models"][0]["maps"], 4) << stats.dump();
  auto reply = admin.Admin(AdminOp::kExport, dir_ + "/out.fmx");
  ASSERT_TRUE(reply && reply->ok) << (reply ? reply->error : "no reply");
  EXPECT_EQ(Json::parse(reply->json)["maps"], 4);
  auto back = ReadMapExport(dir_ + "/out.fmx", 1u << 20, kModel);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->maps.size(), 4u);
  EXPECT_EQ(back->maps[0].sem, maps[0].sem);
  EXPECT_EQ(back->maps[3].map, maps[4].map);
}

// Lines the default logger writes while it lives.
class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(out_)) {
    spdlog::default_logger()->sinks().push_back(sink_);
  }
  ~LogCapture() {
    auto& sinks = spdlog::default_logger()->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  // Lines holding `text`.
  size_t Count(const std::string& text) {
    sink_->flush();
    std::istringstream in(out_.str());
    size_t n = 0;
    for (std::string line; std::getline(in, line);) n += line.find(text) != std::string::npos;
    return n;
  }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

// Issue 28: a Register whose store cannot be allocated (L=4097, J=65536) threw bad_alloc after
// publishing half a model, and the next Stats crashed; h=65536 added hundreds of MB that stayed.
// Both are refused by memory_limit_mb with the reason, and nothing of them remains, in memory
// or on disk.
TEST_F(MapServiceCoreTest, ARegistrationBeyondTheMemoryLimitIsRefusedAndLeavesNothingBehind) {
  options_.memory_limit_mb = 32;
  {
    Service service(options_, nullptr);
    Client huge(options_.endpoint, "w/huge/0", "huge");
    huge.registration().model_fingerprint = 0xbad1;
    huge.registration().num_layers = 4097;
    huge.registration().num_experts = 65536;
    huge.registration().top_k = 1;
    huge.registration().hidden_size = 1;
    auto ack = huge.Register();
    ASSERT_TRUE(ack.has_value());
    EXPECT_FALSE(ack->accepted);
    EXPECT_NE(ack->reason.find("memory_limit_mb 32"), std::string::npos) << ack->reason;
    Json stats = huge.Stats();  // Crashed here.
    ASSERT_TRUE(stats.is_object());
    EXPECT_EQ(stats["models"].size(), 0u) << stats.dump();

    Client wide(options_.endpoint, "w/wide/0", "wide");
    wide.registration().model_fingerprint = 0xbad2;
    wide.registration().hidden_size = 65536;  // 100 maps x 6 bytes x 65536: 38 MiB.
    ack = wide.Register();
    ASSERT_TRUE(ack.has_value());
    EXPECT_FALSE(ack->accepted);
    EXPECT_NE(ack->reason.find("needs 38 MiB"), std::string::npos) << ack->reason;

    // The service serves on: a model within the limit registers and stores maps.
    Client c(options_.endpoint, "w/g0/0");
    ack = c.Register();
    ASSERT_TRUE(ack && ack->accepted) << (ack ? ack->reason : "no ack");
    c.Stream(1, rng_);
    ASSERT_TRUE(c.AwaitStored(1));
    stats = c.Stats();
    EXPECT_EQ(stats["models"].size(), 1u) << stats.dump();
    EXPECT_EQ(stats["counters"]["registrations_refused"], 2) << stats.dump();
    EXPECT_GT(stats["memory"]["used_bytes"], 0) << stats.dump();
  }
  // Nothing of the refused models was persisted.
  Service service(options_, nullptr);
  Client admin(options_.endpoint, "admin");
  const Json stats = admin.Stats();
  ASSERT_EQ(stats["models"].size(), 1u) << stats.dump();
  EXPECT_EQ(stats["models"][0]["fingerprint"], FingerprintHex(kModel));
  EXPECT_EQ(stats["models_not_loaded"].size(), 0u) << stats.dump();
}

// A model record that is beyond the limit (written before there was one) is not loaded at start:
// the service starts, says why, refuses the model's registration with the reason, and drops it.
TEST_F(MapServiceCoreTest, AStoredModelBeyondTheLimitIsNotLoadedAndCanBeDropped) {
  {
    Service service(options_, nullptr);
    Client c(options_.endpoint, "w/g0/0");
    ASSERT_TRUE(c.Register());
    c.Stream(1, rng_);
    ASSERT_TRUE(c.AwaitStored(1));
  }
  {
    auto db = StoreDb::Open({options_.data_dir, false});
    ASSERT_TRUE(db.ok()) << db.status().ToString();
    ASSERT_TRUE((*db)->RecordModel({0xbad1, 4097, 65536, 1, 1, 0}).ok());
  }
  LogCapture log;
  Service service(options_, nullptr);
  EXPECT_EQ(log.Count("model 000000000000bad1 (L=4097 J=65536 K=1 h=1) not loaded"), 1u);
  Client huge(options_.endpoint, "w/huge/0", "huge");
  huge.registration().model_fingerprint = 0xbad1;
  huge.registration().num_layers = 4097;
  huge.registration().num_experts = 65536;
  huge.registration().top_k = 1;
  huge.registration().hidden_size = 1;
  auto ack = huge.Register();
  ASSERT_TRUE(ack.has_value());
  EXPECT_FALSE(ack->accepted);
  EXPECT_NE(ack->reason.find("not loaded at start"), std::string::npos) << ack->reason;
  Json stats = huge.Stats();
  ASSERT_EQ(stats["models_not_loaded"].size(), 1u) << stats.dump();
  EXPECT_EQ(stats["models"].size(), 1u) << stats.dump();
  EXPECT_EQ(stats["models"][0]["maps"], 1) << stats.dump();

  auto reply = huge.Drop(0xbad1);
  ASSERT_TRUE(reply && reply->ok) << (reply ? reply->error : "no reply");
  stats = huge.Stats();
  EXPECT_EQ(stats["models_not_loaded"].size(), 0u) << stats.dump();
  EXPECT_EQ(stats["counters"]["models_dropped"], 1) << stats.dump();
  reply = huge.Drop(0xbad1);
  ASSERT_TRUE(reply.has_value());
  EXPECT_FALSE(reply->ok);
  EXPECT_NE(reply->error.find("is not stored"), std::string::npos) << reply->error;
}

// `fmoe maps --drop`: the model's maps, record and rank records leave the disk, its memory is
// freed, its ranks are told to register again (and get a fresh store); other models stay.
TEST_F(MapServiceCoreTest, ADroppedModelLeavesMemoryAndDisk) {
  {
    Service service(options_, nullptr);
    Client c(options_.endpoint, "w/g0/0");
    ASSERT_TRUE(c.Register());
    for (uint64_t req = 1; req <= 3; ++req) c.Stream(req, rng_);
    ASSERT_TRUE(c.AwaitStored(3));
    Client other(options_.endpoint, "w/g1/0", "g1");
    other.registration().model_fingerprint = 0x88;
    ASSERT_TRUE(other.Register());
    other.Stream(10, rng_);
    ASSERT_TRUE(other.AwaitStored(10));

    Client admin(options_.endpoint, "admin");
    auto reply = admin.Drop(kModel);
    ASSERT_TRUE(reply && reply->ok) << (reply ? reply->error : "no reply");
    const Json body = Json::parse(reply->json);
    EXPECT_EQ(body["maps_removed"], 3) << reply->json;
    EXPECT_GT(body["bytes_freed"], 0) << reply->json;
    auto beat = c.Heartbeat();
    ASSERT_TRUE(beat.has_value());
    EXPECT_FALSE(beat->known);  // Register again.
    const Json stats = admin.Stats();
    ASSERT_EQ(stats["models"].size(), 1u) << stats.dump();
    EXPECT_EQ(stats["models"][0]["fingerprint"], FingerprintHex(0x88)) << stats.dump();
    auto ack = c.Register();
    ASSERT_TRUE(ack && ack->accepted);
    EXPECT_EQ(ack->stored_maps, 0u);
  }
  Service service(options_, nullptr);
  Client admin(options_.endpoint, "admin/2");
  const Json stats = admin.Stats();
  ASSERT_EQ(stats["models"].size(), 2u) << stats.dump();
  for (const Json& m : stats["models"]) {
    EXPECT_EQ(m["maps"], m["fingerprint"] == FingerprintHex(0x88) ? 1 : 0) << stats.dump();
  }
}

TEST(StoreHealth, BacksOffAndLogsOncePerInterval) {
  ManualClock clock(1000);
  StoreHealth health(clock, {100, 400, 1000});
  LogCapture log;
  EXPECT_FALSE(health.Failed(Internal("not a disk error")));
  EXPECT_TRUE(health.healthy());
  EXPECT_TRUE(health.Failed(IoError("No space left on device")));
  EXPECT_EQ(health.state(), StoreHealth::State::kDegraded);
  for (int i = 0; i < 1000; ++i) health.Refused();
  health.Tick();
  EXPECT_EQ(log.Count("store:"), 1u);  // The first failure, at once.
  EXPECT_FALSE(health.RetryDue());
  clock.AdvanceMs(100);
  ASSERT_TRUE(health.RetryDue());
  EXPECT_FALSE(health.RetryDue());  // One attempt at a time.
  health.RetryDone(IoError("still full"));
  EXPECT_EQ(health.next_retry_in_ms(), 200);  // Doubled.
  clock.AdvanceMs(200);
  ASSERT_TRUE(health.RetryDue());
  health.RetryDone(IoError("still full"));
  EXPECT_EQ(health.next_retry_in_ms(), 400);
  clock.AdvanceMs(400);
  ASSERT_TRUE(health.RetryDue());
  health.RetryDone(IoError("still full"));
  EXPECT_EQ(health.next_retry_in_ms(), 400);  // At retry_max_ms.
  health.Tick();                              // 700 ms since the first line: none yet.
  EXPECT_EQ(log.Count("store:"), 1u);
  clock.AdvanceMs(300);
  health.Tick();
  EXPECT_EQ(log.Count("store:"), 2u);
  EXPECT_EQ(log.Count("1000 writes failed or refused in the last 1 s"), 1u);
  clock.AdvanceMs(100);
  ASSERT_TRUE(health.RetryDue());
  health.RetryDone(Status::Ok());
  EXPECT_TRUE(health.healthy());
  EXPECT_EQ(health.recoveries(), 1u);
  EXPECT_EQ(log.Count("store: writable again after 1.1 s degraded (1001 writes"), 1u);
  EXPECT_EQ(health.failed_total(), 1001u);
}

// Issue 28: on a full disk RocksDB's info LOG aborted the service and each failed write was
// logged (3,489 lines in 20 s). With writes failing under RocksDB (ENOSPC, EIO, EROFS) the store
// turns read-only: matching and stats go on, the state is reported, a registration of a stored
// model is served, the log is throttled; when the disk takes writes again the store recovers,
// new maps are stored, and every acknowledged map is there after a restart.
TEST_F(MapServiceCoreTest, DiskTroubleMakesTheStoreReadOnlyUntilItRecovers) {
  auto faults = std::make_shared<StoreFaults>();
  options_.store_faults = faults;
  options_.sync = true;
  options_.store_health = {50, 200, 60000};
  std::set<uint64_t> acknowledged;
  {
    LogCapture log;
    Service service(options_, nullptr);
    Client c(options_.endpoint, "w/g0/0");
    ASSERT_TRUE(c.Register());
    for (uint64_t req = 1; req <= 3; ++req) c.Stream(req, rng_);
    ASSERT_TRUE(c.AwaitStored(3));

    uint64_t base = 0;
    for (int err : {ENOSPC, EIO, EROFS}) {
      SCOPED_TRACE(std::strerror(err));
      faults->FailWrites(err);
      base += 100;
      for (uint64_t req = base; req < base + 40; ++req) c.Stream(req, rng_);
      ASSERT_TRUE(testing::WaitUntil(
          [&] {
            const Json st = c.Stats();
            return st["store"]["state"] != "ok" && st["counters"]["maps_failed"] >= 40;
          },
          10000));
      // Matching goes on against what is stored.
      EXPECT_TRUE(c.Matched(base + 99, rng_));
      Json stats = c.Stats();
      EXPECT_NE(stats["store"]["reason"].get<std::string>().find(std::strerror(err)),
                std::string::npos)
          << stats.dump();
      EXPECT_GE(stats["store"]["writes_failed"], 40) << stats.dump();
      // A rank of a stored model is served; a new model cannot be recorded.
      Client again(options_.endpoint, "w/g0/1/" + std::to_string(err));
      again.registration().rank = 1;
      again.registration().world_size = 2;
      auto ack = again.Register();
      ASSERT_TRUE(ack && ack->accepted) << (ack ? ack->reason : "no ack");
      Client fresh(options_.endpoint, "w/new/0/" + std::to_string(err), "new");
      fresh.registration().model_fingerprint = 0x99;
      ack = fresh.Register();
      ASSERT_TRUE(ack.has_value());
      EXPECT_FALSE(ack->accepted);
      EXPECT_NE(ack->reason.find("read-only"), std::string::npos) << ack->reason;
      // Retries go on while the disk refuses.
      const uint64_t retries = stats["store"]["retries"];
      ASSERT_TRUE(testing::WaitUntil(
          [&] { return again.Stats()["store"]["retries"] > retries + 1; }, 10000));

      faults->Heal();
      ASSERT_TRUE(
          testing::WaitUntil([&] { return again.Stats()["store"]["state"] == "ok"; }, 10000));
      for (uint64_t req = base + 50; req < base + 53; ++req) again.Stream(req, rng_);
      ASSERT_TRUE(again.AwaitStored(base + 52));
      for (uint64_t r : again.stored()) acknowledged.insert(r);
    }
    for (uint64_t r : c.stored()) acknowledged.insert(r);
    const Json stats = c.Stats();
    EXPECT_EQ(stats["store"]["recoveries"], 3) << stats.dump();
    // Once when each trouble began, once at each recovery: not a line per write.
    EXPECT_EQ(log.Count("store: a write failed"), 3u);
    EXPECT_EQ(log.Count("store: writable again"), 3u);
    EXPECT_EQ(log.Count("map not stored"), 0u);
    EXPECT_LE(log.Count("rocksdb:"), 20u);
  }
  EXPECT_GT(faults->refused(), 0u);
  EXPECT_FALSE(std::filesystem::exists(options_.data_dir + "/LOG"));  // Its log is ours.
  ASSERT_EQ(acknowledged.size(), 12u);
  // Every acknowledged map is on disk.
  faults->Heal();
  Service service(options_, nullptr);
  Client admin(options_.endpoint, "admin");
  auto reply = admin.Admin(AdminOp::kExport, dir_ + "/after.fmx");
  ASSERT_TRUE(reply && reply->ok) << (reply ? reply->error : "no reply");
  auto back = ReadMapExport(dir_ + "/after.fmx", 1u << 20, kModel);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  std::set<uint64_t> on_disk;
  for (const MapRow& m : back->maps) on_disk.insert(m.request_id);
  EXPECT_EQ(on_disk, acknowledged);
}

// A start on a disk that refuses writes serves what is stored, read-only, and turns writable
// when the disk does; the registration of a new model that failed there left nothing behind.
TEST_F(MapServiceCoreTest, AStartOnADiskThatRefusesWritesServesReadOnly) {
  auto faults = std::make_shared<StoreFaults>();
  options_.store_faults = faults;
  options_.store_health = {50, 100, 60000};
  {
    Service service(options_, nullptr);
    Client c(options_.endpoint, "w/g0/0");
    ASSERT_TRUE(c.Register());
    c.Stream(1, rng_);
    ASSERT_TRUE(c.AwaitStored(1));
  }
  faults->FailWrites(ENOSPC);
  {
    Service service(options_, nullptr);
    Client c(options_.endpoint, "w/g0/0");
    Json stats = c.Stats();
    EXPECT_NE(stats["store"]["state"], "ok") << stats.dump();
    ASSERT_EQ(stats["models"].size(), 1u) << stats.dump();
    EXPECT_EQ(stats["models"][0]["maps"], 1);
    auto ack = c.Register();
    ASSERT_TRUE(ack && ack->accepted) << (ack ? ack->reason : "no ack");
    EXPECT_EQ(ack->stored_maps, 1u);
    // Read-only, the directory is still its own.
    MapServiceOptions second = options_;
    second.endpoint = "tcp://127.0.0.1:" + std::to_string(testing::FreeTcpPort());
    MapService other(second, SteadyClock::Get());
    const Status started = other.Start();
    EXPECT_EQ(started.code(), ErrorCode::kAlreadyExists) << started.ToString();
    EXPECT_TRUE(c.Matched(50, rng_));
    c.Stream(2, rng_);
    ASSERT_TRUE(
        testing::WaitUntil([&] { return c.Stats()["counters"]["maps_failed"] == 1; }, 10000));
    faults->Heal();
    ASSERT_TRUE(testing::WaitUntil([&] { return c.Stats()["store"]["state"] == "ok"; }, 10000));
    c.Stream(3, rng_);
    ASSERT_TRUE(c.AwaitStored(3));
    // A new model whose record cannot be written leaves nothing, in memory or on disk.
    faults->FailWrites(EIO);
    Client fresh(options_.endpoint, "w/new/0", "new");
    fresh.registration().model_fingerprint = 0x99;
    ack = fresh.Register();
    ASSERT_TRUE(ack.has_value());
    EXPECT_FALSE(ack->accepted);
    stats = c.Stats();
    EXPECT_EQ(stats["models"].size(), 1u) << stats.dump();
    faults->Heal();
  }
  Service service(options_, nullptr);
  Client admin(options_.endpoint, "admin");
  const Json stats = admin.Stats();
  ASSERT_EQ(stats["models"].size(), 1u) << stats.dump();
  EXPECT_EQ(stats["models"][0]["maps"], 2) << stats.dump();
  EXPECT_EQ(stats["store"]["state"], "ok") << stats.dump();
}

// The same on a real disk: a 2 MiB tmpfs (mounting needs root; skipped otherwise), filled up
// while the service stores maps, then freed; then a start on the full disk serves read-only.
class FullDisk {
 public:
  explicit FullDisk(const std::string& dir) : dir_(dir) {
    std::filesystem::create_directories(dir);
    mounted_ = ::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=2m") == 0;
    if (!mounted_) why_ = std::strerror(errno);
  }
  ~FullDisk() {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  const std::string& why() const { return why_; }
  // Writes a filler file until the disk is full.
  void Fill() {
    const int fd = ::open((dir_ + "/filler").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    ASSERT_GE(fd, 0);
    const std::vector<char> block(4096, 'x');
    while (::write(fd, block.data(), block.size()) > 0) {
    }
    ::close(fd);
  }
  void Free() { std::filesystem::remove(dir_ + "/filler"); }

 private:
  std::string dir_;
  bool mounted_ = false;
  std::string why_;
};

TEST_F(MapServiceCoreTest, OnAFullTmpfsTheStoreTurnsReadOnlyAndRecovers) {
  FullDisk disk(dir_ + "/disk");
  if (!disk.mounted()) GTEST_SKIP() << "cannot mount a tmpfs: " << disk.why();
  options_.data_dir = dir_ + "/disk/db";
  options_.store_health = {50, 200, 60000};
  std::set<uint64_t> acknowledged;
  {
    LogCapture log;
    Service service(options_, nullptr);
    Client c(options_.endpoint, "w/g0/0");
    ASSERT_TRUE(c.Register());
    for (uint64_t req = 1; req <= 3; ++req) c.Stream(req, rng_);
    ASSERT_TRUE(c.AwaitStored(3));
    disk.Fill();
    // Maps until the WAL needs a page the disk does not have.
    uint64_t req = 100;
    ASSERT_TRUE(testing::WaitUntil(
        [&] {
          for (int i = 0; i < 20; ++i) c.Stream(req++, rng_);
          return c.Stats()["store"]["state"] != "ok";
        },
        20000, 10));
    for (int i = 0; i < 50; ++i) c.Stream(req++, rng_);
    EXPECT_TRUE(c.Matched(99, rng_));
    Json stats = c.Stats();
    EXPECT_NE(stats["store"]["reason"].get<std::string>().find("No space left on device"),
              std::string::npos)
        << stats.dump();
    disk.Free();
    ASSERT_TRUE(testing::WaitUntil([&] { return c.Stats()["store"]["state"] == "ok"; }, 10000));
    for (uint64_t r = 1000; r < 1003; ++r) c.Stream(r, rng_);
    ASSERT_TRUE(c.AwaitStored(1002));
    c.Drain(200);
    acknowledged.insert(c.stored().begin(), c.stored().end());
    EXPECT_EQ(log.Count("store: a write failed"), 1u);
    EXPECT_EQ(log.Count("map not stored"), 0u);
    EXPECT_LE(log.Count("rocksdb:"), 10u);
  }
  EXPECT_FALSE(std::filesystem::exists(options_.data_dir + "/LOG"));
  // A start on the full disk serves what is stored, read-only, and recovers once it has room.
  disk.Fill();
  {
    Service service(options_, nullptr);
    Client c(options_.endpoint, "w/g0/0");
    Json stats = c.Stats();
    ASSERT_NE(stats["store"]["state"], "ok") << stats.dump();
    ASSERT_EQ(stats["models"].size(), 1u) << stats.dump();
    EXPECT_EQ(stats["models"][0]["maps"], acknowledged.size()) << stats.dump();
    auto ack = c.Register();
    ASSERT_TRUE(ack && ack->accepted) << (ack ? ack->reason : "no ack");
    EXPECT_TRUE(c.Matched(98, rng_));
    disk.Free();
    ASSERT_TRUE(testing::WaitUntil([&] { return c.Stats()["store"]["state"] == "ok"; }, 10000));
    c.Stream(2000, rng_);
    ASSERT_TRUE(c.AwaitStored(2000));
    acknowledged.insert(2000);
  }
  Service service(options_, nullptr);
  Client admin(options_.endpoint, "admin");
  auto reply = admin.Admin(AdminOp::kExport, dir_ + "/after.fmx");
  ASSERT_TRUE(reply && reply->ok) << (reply ? reply->error : "no reply");
  auto back = ReadMapExport(dir_ + "/after.fmx", 1u << 20, kModel);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  std::set<uint64_t> on_disk;
  for (const MapRow& m : back->maps) on_disk.insert(m.request_id);
  EXPECT_EQ(on_disk, acknowledged);
}

}  // namespace
}  // namespace fmoe
