// The cluster key (common/wire/curve_key.h): the key file's strict parser, creation and loading,
// and authenticated sockets: a peer holding the cluster key talks to a bound socket both ways
// over tcp and ipc; one with another key is refused by the ZAP handler (counted), and one with no
// key at all never gets a message through; the same key gives the same answers to every context
// of a process (the default key).
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <zmq.hpp>

#include "common/wire/curve_key.h"
#include "common/wire/wire.h"

namespace fmoe::wire {
namespace {

namespace fs = std::filesystem;
constexpr int kWaitMs = 10000;

CurveKey MustNewKey() {
  auto k = NewCurveKey();
  EXPECT_TRUE(k.ok()) << k.status().ToString();
  return k.ok() ? *k : CurveKey{};
}

fs::path TempDir(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("fmoe-curve-" + name + "-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

WorkerHello Hello(std::string group) {
  WorkerHello h;
  h.group = std::move(group);
  h.model_name = "tiny";
  return h;
}

TEST(CurveKeyFile, RoundTripsAndChecksThePair) {
  const CurveKey key = MustNewKey();
  EXPECT_EQ(key.public_key.size(), 40u);
  EXPECT_EQ(key.secret_key.size(), 40u);
  EXPECT_TRUE(CheckCurveKey(key).ok());
  auto parsed = ParseCurveKeyFile(FormatCurveKeyFile(key));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(*parsed, key);
  // Either order, spaces and CRLF.
  auto swapped = ParseCurveKeyFile("secret-key=" + key.secret_key +
                                   "\r\n\n  # note\npublic-key =  " + key.public_key + "  \r\n");
  ASSERT_TRUE(swapped.ok()) << swapped.status().ToString();
  EXPECT_EQ(*swapped, key);
  // Two halves of different pairs.
  const CurveKey other = MustNewKey();
  const Status mixed = CheckCurveKey({key.public_key, other.secret_key});
  EXPECT_EQ(mixed.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(mixed.message().find("does not belong"), std::string::npos) << mixed.ToString();
}

TEST(CurveKeyFile, BadFilesNameTheLine) {
  const std::string pub(40, 'a');
  const std::string sec(40, 'b');
  const struct {
    std::string text;
    std::string error;
  } cases[] = {
      {"", "no public-key line"},
      {"public-key = " + pub + "\n", "no secret-key line"},
      {"public-key = " + pub + "\nsecret-key = " + sec + "\npublic-key = " + pub,
       "line 3: public-key given twice"},
      {"public-key " + pub, "line 1: expected"},
      {"# c\nprivate-key = " + sec, "line 2: unknown name \"private-key\""},
      {"public-key = " + pub + "x\nsecret-key = " + sec, "line 1: public-key has 41 characters"},
      {"public-key = " + pub + "\nsecret-key = " + std::string(39, 'b') + "\"",
       "line 2: secret-key holds a character outside Z85"},
      {std::string(5000, '#'), "5000 bytes"},
  };
  for (const auto& c : cases) {
    auto r = ParseCurveKeyFile(c.text);
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(c.error), std::string::npos)
        << r.status().ToString() << " vs " << c.error;
  }
}

TEST(CurveKeyFile, LoadCreatesOncePrivatelyAndRefusesAReadableFile) {
  const fs::path dir = TempDir("load");
  const std::string path = (dir / "sub" / "cluster.key").string();
  auto missing = LoadCurveKey(path, /*create=*/false);
  EXPECT_EQ(missing.status().code(), ErrorCode::kNotFound);
  auto created = LoadCurveKey(path, /*create=*/true);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto again = LoadCurveKey(path, /*create=*/true);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *created) << "an existing key is kept";
  // Racing creators agree on one key.
  const std::string raced = (dir / "raced.key").string();
  std::vector<CurveKey> seen(4);
  std::vector<std::thread> threads;
  for (auto& k : seen) {
    threads.emplace_back([&k, &raced] {
      auto r = LoadCurveKey(raced, true);
      if (r.ok()) k = *r;
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& k : seen) EXPECT_EQ(k, seen[0]);
  EXPECT_FALSE(seen[0].public_key.empty());
  // Readable by others: refused.
  ASSERT_EQ(chmod(path.c_str(), 0644), 0);
  auto open_file = LoadCurveKey(path, true);
  EXPECT_EQ(open_file.status().code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(open_file.status().message().find("chmod 600"), std::string::npos);
  // A broken pair on disk: refused, naming the file.
  const std::string broken = (dir / "broken.key").string();
  {
    std::ofstream out(broken);
    out << "public-key = " << MustNewKey().public_key << "\nsecret-key = " << created->secret_key
        << "\n";
  }
  ASSERT_EQ(chmod(broken.c_str(), 0600), 0);
  auto bad = LoadCurveKey(broken, true);
  EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find(broken), std::string::npos) << bad.status().ToString();
  fs::remove_all(dir);
}

// Both ways over tcp and ipc between two contexts holding the cluster key.
TEST(CurveSockets, PeersWithTheClusterKeyTalkBothWays) {
  const CurveKey key = MustNewKey();
  const fs::path dir = TempDir("ipc");
  for (const std::string& endpoint :
       {std::string("tcp://127.0.0.1:*"), "ipc://" + (dir / "w.sock").string()}) {
    Context server_ctx(key);
    Context client_ctx(key);
    ASSERT_TRUE(server_ctx.curve());
    auto router = WorkerSocket::Bind(server_ctx, Role::kRouter, endpoint);
    ASSERT_TRUE(router.ok()) << router.status().ToString();
    SocketOptions o;
    o.routing_id = "leader";
    auto dealer = WorkerSocket::Connect(client_ctx, Role::kDealer, (*router)->endpoint(), o);
    ASSERT_TRUE(dealer.ok()) << dealer.status().ToString();
    ASSERT_TRUE((*dealer)->Send(Hello("g0")).ok());
    auto in = (*router)->Receive(kWaitMs);
    ASSERT_TRUE(in.has_value()) << endpoint;
    EXPECT_EQ(in->peer, "leader");
    Cancel c;
    c.request_id = 9;
    ASSERT_TRUE((*router)->Send(c, "leader").ok());
    auto back = (*dealer)->Receive(kWaitMs);
    ASSERT_TRUE(back.has_value()) << endpoint;
    EXPECT_EQ(std::get<Cancel>(back->message).request_id, 9u);
    EXPECT_EQ(server_ctx.curve_refused(), 0u);
  }
  fs::remove_all(dir);
}

TEST(CurveSockets, PeersWithoutTheClusterKeyAreRefused) {
  const CurveKey key = MustNewKey();
  Context server_ctx(key);
  auto router = WorkerSocket::Bind(server_ctx, Role::kRouter, "tcp://127.0.0.1:*");
  ASSERT_TRUE(router.ok()) << router.status().ToString();
  const std::string endpoint = (*router)->endpoint();

  // A peer that knows the cluster's public key (say, it leaked) but not its secret: its own
  // client pair gets through the handshake's cryptography to the ZAP handler, which refuses it.
  const CurveKey own = MustNewKey();
  zmq::context_t raw_ctx;
  zmq::socket_t stranger(raw_ctx, zmq::socket_type::dealer);
  stranger.set(zmq::sockopt::linger, 0);
  stranger.set(zmq::sockopt::curve_serverkey, key.public_key);
  stranger.set(zmq::sockopt::curve_publickey, own.public_key);
  stranger.set(zmq::sockopt::curve_secretkey, own.secret_key);
  stranger.connect(endpoint);
  const std::string junk = "forged hello";
  stranger.send(zmq::buffer(junk), zmq::send_flags::dontwait);
  // Another cluster's key: the handshake fails before any message.
  Context other_ctx(MustNewKey());
  auto other = WorkerSocket::Connect(other_ctx, Role::kDealer, endpoint);
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE((*other)->Send(Hello("other")).ok());
  // No key at all: the handshake fails (CURVE against NULL).
  Context plain_ctx(std::nullopt);
  EXPECT_FALSE(plain_ctx.curve());
  auto plain = WorkerSocket::Connect(plain_ctx, Role::kDealer, endpoint);
  ASSERT_TRUE(plain.ok());
  ASSERT_TRUE((*plain)->Send(Hello("plain")).ok());
  for (int i = 0; i < 1000 && server_ctx.curve_refused() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GT(server_ctx.curve_refused(), 0u);
  // A member of the cluster gets through; the others' messages never arrive.
  Context member_ctx(key);
  auto member = WorkerSocket::Connect(member_ctx, Role::kDealer, endpoint);
  ASSERT_TRUE(member.ok());
  ASSERT_TRUE((*member)->Send(Hello("member")).ok());
  auto in = (*router)->Receive(kWaitMs);
  ASSERT_TRUE(in.has_value());
  EXPECT_EQ(std::get<WorkerHello>(in->message).group, "member");
  EXPECT_FALSE((*router)->Receive(300).has_value()) << "a peer without the key got through";
  stranger.close();
}

TEST(CurveSockets, TheDefaultKeyIsEveryNewContextsKey) {
  const CurveKey key = MustNewKey();
  SetDefaultCurveKey(key);
  {
    Context a;
    Context b;
    EXPECT_TRUE(a.curve());
    auto router = WorkerSocket::Bind(a, Role::kRouter, "tcp://127.0.0.1:*");
    ASSERT_TRUE(router.ok());
    auto dealer = WorkerSocket::Connect(b, Role::kDealer, (*router)->endpoint());
    ASSERT_TRUE(dealer.ok());
    ASSERT_TRUE((*dealer)->Send(Hello("g")).ok());
    EXPECT_TRUE((*router)->Receive(kWaitMs).has_value());
  }
  SetDefaultCurveKey(std::nullopt);
  Context plain;
  EXPECT_FALSE(plain.curve());
  // A context given a broken key cannot open sockets, and says why.
  Context broken(CurveKey{key.public_key, MustNewKey().secret_key});
  auto socket = WorkerSocket::Bind(broken, Role::kRouter, "tcp://127.0.0.1:*");
  ASSERT_FALSE(socket.ok());
  EXPECT_NE(socket.status().message().find("does not belong"), std::string::npos);
}

}  // namespace
}  // namespace fmoe::wire
