// The one HTTP client (common/http_client.h) against a scripted server on loopback: bodies
// sized, chunked and ended by close; keep-alive and the retry on a connection the server closed;
// the deadline, refusals, malformed and oversized answers; streaming, stopping and cancelling;
// and the server-sent event reader.
#include "common/http_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace fmoe::http {
namespace {

// Reads one request (head and Content-Length body) from fd; "" when the peer closed first.
std::string ReadRequest(int fd) {
  std::string in;
  char buf[4096];
  for (;;) {
    const size_t head = in.find("\r\n\r\n");
    if (head != std::string::npos) {
      size_t length = 0;
      const size_t cl = in.find("Content-Length: ");
      if (cl != std::string::npos && cl < head) length = std::stoul(in.substr(cl + 16));
      if (in.size() >= head + 4 + length) return in;
    }
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return "";
    in.append(buf, static_cast<size_t>(n));
  }
}

void Send(int fd, const std::string& s) { send(fd, s.data(), s.size(), MSG_NOSIGNAL); }

// Accepts connections on 127.0.0.1 and runs `handler` on each, one at a time, on its own thread.
class ScriptedServer {
 public:
  using Handler = std::function<void(int fd, int connection)>;
  explicit ScriptedServer(Handler handler) : handler_(std::move(handler)) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    socklen_t len = sizeof(addr);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    listen(listen_fd_, 16);
    thread_ = std::thread([this] {
      for (int connection = 0;; ++connection) {
        const int fd = accept(listen_fd_, nullptr, nullptr);
        if (fd < 0) return;
        accepted_.fetch_add(1);
        handler_(fd, connection);
        close(fd);
      }
    });
  }
  ~ScriptedServer() {
    shutdown(listen_fd_, SHUT_RDWR);
    close(listen_fd_);
    thread_.join();
  }
  int port() const { return port_; }
  int accepted() const { return accepted_.load(); }

 private:
  Handler handler_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<int> accepted_{0};
  std::thread thread_;
};

const std::string kOk = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Trace: abc\r\n\r\nhello";

TEST(HttpClient, ReadsASizedBodyAndTheHeadAsReceived) {
  std::string seen;
  ScriptedServer server([&](int fd, int) {
    seen = ReadRequest(fd);
    Send(fd, kOk);
  });
  Request req;
  req.method = "POST";
  req.target = "/v1/x";
  req.body = R"({"a":1})";
  req.headers.emplace_back("Authorization", "Bearer k");
  auto res = Fetch("127.0.0.1", server.port(), req, 10000);
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body, "hello");
  EXPECT_EQ(res->Field("x-trace"), "abc");
  EXPECT_EQ(res->Field("missing"), "");
  EXPECT_NE(res->head.find("HTTP/1.1 200 OK\r\n"), std::string::npos) << res->head;
  EXPECT_NE(res->head.find("X-Trace: abc\r\n"), std::string::npos) << res->head;
  EXPECT_NE(seen.find("POST /v1/x HTTP/1.1\r\n"), std::string::npos) << seen;
  EXPECT_NE(seen.find("Authorization: Bearer k\r\n"), std::string::npos) << seen;
  EXPECT_NE(seen.find("Content-Type: application/json\r\n"), std::string::npos) << seen;
  EXPECT_NE(seen.find("Connection: close\r\n"), std::string::npos) << seen;
  EXPECT_NE(seen.find("\r\n\r\n{\"a\":1}"), std::string::npos) << seen;
}

TEST(HttpClient, DechunksAndReadsABodyEndedByClose) {
  ScriptedServer server([&](int fd, int connection) {
    ReadRequest(fd);
    if (connection == 0) {
      Send(fd,
           "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n");
    } else {
      Send(fd, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end");
    }
  });
  auto a = Get("127.0.0.1", server.port(), "/", 10000);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->body, "abcde");
  auto b = Get("127.0.0.1", server.port(), "/", 10000);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->body, "until the end");
}

TEST(HttpClient, KeepsTheConnectionAndRetriesOnceWhenTheServerClosedIt) {
  ScriptedServer server([&](int fd, int connection) {
    // The first connection answers two requests, then closes while the client keeps it.
    const int answers = connection == 0 ? 2 : 1;
    for (int i = 0; i < answers; ++i) {
      if (ReadRequest(fd).empty()) return;
      Send(fd, kOk);
    }
  });
  Client client("127.0.0.1", server.port());
  for (int i = 0; i < 3; ++i) {
    auto res = client.Call(Request{}, 10000);
    ASSERT_TRUE(res.ok()) << i << ": " << res.status().ToString();
    EXPECT_EQ(res->body, "hello");
  }
  EXPECT_EQ(server.accepted(), 2) << "two calls on one kept connection, the third on a new one";
}

TEST(HttpClient, NamesRefusalsTimeoutsAndBadAnswers) {
  int free_port = 0;
  {
    ScriptedServer closed([](int, int) {});
    free_port = closed.port();
  }
  auto refused = Get("127.0.0.1", free_port, "/", 5000);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kUnavailable) << refused.status().ToString();

  auto unresolved = Get("no-such-host.invalid", 80, "/", 5000);
  ASSERT_FALSE(unresolved.ok());
  EXPECT_EQ(unresolved.status().code(), ErrorCode::kInvalidArgument);

  std::atomic<bool> release{false};
  {
    ScriptedServer silent([&](int fd, int) {
      ReadRequest(fd);
      while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    });
    const auto t0 = std::chrono::steady_clock::now();
    auto slow = Get("127.0.0.1", silent.port(), "/", 200);
    ASSERT_FALSE(slow.ok());
    EXPECT_EQ(slow.status().code(), ErrorCode::kTimeout) << slow.status().ToString();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
    release = true;
  }

  ScriptedServer garbage([](int fd, int) {
    ReadRequest(fd);
    Send(fd, "SMTP ready\r\n\r\n");
  });
  auto bad = Get("127.0.0.1", garbage.port(), "/", 5000);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), ErrorCode::kDataLoss) << bad.status().ToString();

  ScriptedServer truncated([](int fd, int) {
    ReadRequest(fd);
    Send(fd, "HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nshort");
  });
  auto cut = Get("127.0.0.1", truncated.port(), "/", 5000);
  ASSERT_FALSE(cut.ok());
  EXPECT_EQ(cut.status().code(), ErrorCode::kUnavailable) << cut.status().ToString();
}

TEST(HttpClient, RefusesABodyAboveTheLimit) {
  ScriptedServer server([](int fd, int) {
    ReadRequest(fd);
    Send(fd, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + std::string(100, 'x'));
  });
  ClientOptions options;
  options.max_body_bytes = 10;
  Client client("127.0.0.1", server.port(), options);
  auto res = client.Call(Request{}, 5000);
  ASSERT_FALSE(res.ok());
  EXPECT_EQ(res.status().code(), ErrorCode::kDataLoss) << res.status().ToString();
  EXPECT_NE(res.status().message().find("larger than 10 bytes"), std::string::npos);
}

TEST(HttpClient, StreamsPiecesAsTheyArriveAndStopsWhenAsked) {
  std::atomic<int> step{0};
  ScriptedServer server([&](int fd, int) {
    ReadRequest(fd);
    Send(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n");
    // The second piece only after the client has seen the first: it came as it arrived.
    for (int i = 0; i < 20000 && step.load() == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    Send(fd, "6\r\nsecond\r\n5\r\nthird\r\n0\r\n\r\n");
  });
  Client client("127.0.0.1", server.port());
  std::vector<std::string> pieces;
  auto res = client.Stream(Request{}, 10000, [&](const Response& head, std::string_view piece) {
    EXPECT_EQ(head.status, 200);
    pieces.emplace_back(piece);
    step = 1;
    return pieces.size() < 2 || pieces[0] + pieces[1] != "firstsecond";
  });
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  ASSERT_GE(pieces.size(), 2u);
  EXPECT_EQ(pieces[0], "first");
  std::string all;
  for (const auto& p : pieces) all += p;
  EXPECT_EQ(all.substr(0, 11), "firstsecond");
  EXPECT_TRUE(res->body.empty());
}

TEST(HttpClient, CancelAndAbortEndAStreamInProgress) {
  std::atomic<bool> stop_server{false};
  ScriptedServer server([&](int fd, int) {
    ReadRequest(fd);
    Send(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n");
    // Never finishes; returns once the client has gone.
    char c;
    while (!stop_server.load() && recv(fd, &c, 1, 0) > 0) {
    }
  });
  {
    Client client("127.0.0.1", server.port());
    std::atomic<bool> started{false};
    std::thread canceller([&] {
      while (!started.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      client.Cancel();
    });
    auto res = client.Stream(Request{}, 60000, [&](const Response&, std::string_view) {
      started = true;
      return true;
    });
    canceller.join();
    ASSERT_FALSE(res.ok());
    EXPECT_EQ(res.status().code(), ErrorCode::kUnavailable);
    EXPECT_NE(res.status().message().find("cancelled"), std::string::npos);
    auto later = client.Call(Request{}, 1000);
    EXPECT_FALSE(later.ok()) << "a cancelled client stays cancelled";
  }
  {
    std::atomic<bool> abort{false};
    ClientOptions options;
    options.abort = &abort;
    Client client("127.0.0.1", server.port(), options);
    auto res = client.Stream(Request{}, 60000, [&](const Response&, std::string_view) {
      abort = true;
      return true;
    });
    ASSERT_FALSE(res.ok());
    EXPECT_EQ(res.status().code(), ErrorCode::kUnavailable) << res.status().ToString();
  }
  stop_server = true;
}

// A cancel while the pieces keep coming (faster than the client's 50 ms checks) ends the stream
// at its next read, not at the stream's end.
TEST(HttpClient, CancelEndsAStreamWhosePiecesKeepComing) {
  constexpr int kPieces = 5000;
  ScriptedServer server([&](int fd, int) {
    ReadRequest(fd);
    Send(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
    for (int i = 0; i < kPieces; ++i) {
      if (send(fd, "1\r\nx\r\n", 6, MSG_NOSIGNAL) < 0) return;  // The client left.
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    Send(fd, "0\r\n\r\n");
  });
  Client client("127.0.0.1", server.port());
  int pieces = 0;
  auto res = client.Stream(Request{}, 60000, [&](const Response&, std::string_view piece) {
    pieces += static_cast<int>(piece.size());
    client.Cancel();
    return true;
  });
  ASSERT_FALSE(res.ok()) << pieces << " pieces: the whole stream was read";
  EXPECT_NE(res.status().message().find("cancelled"), std::string::npos) << res.status().ToString();
  EXPECT_LT(pieces, kPieces);
}

TEST(SseReader, SplitsEventsAcrossPiecesAndLineEndings) {
  SseReader reader;
  std::vector<std::string> events;
  for (std::string_view piece :
       {"data: {\"a\"", ":1}\n", "\n: a comment\n\ndata: one\r\ndata: two\r\n\r\n", "event: x\n\n",
        "data:[DONE]\n", "\n"}) {
    for (auto& e : reader.Feed(piece)) events.push_back(std::move(e));
  }
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0], R"({"a":1})");
  EXPECT_EQ(events[1], "one\ntwo");
  EXPECT_EQ(events[2], "[DONE]");
  EXPECT_TRUE(reader.Feed("data: not yet ended\n").empty());
}

}  // namespace
}  // namespace fmoe::http
