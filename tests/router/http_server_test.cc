// The router's HTTP server over real sockets: whole answers now or later from another thread,
// chunked streams (server-sent events) followed by the next request on the same connection, a
// client that leaves noticed while its answer is pending, and a responder released without an
// answer turned into a 500.
#include "router/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

using namespace std::chrono_literals;

// A running server on a free port.
class Server {
 public:
  explicit Server(AsyncHttpHandler handler) : server_(Options(), std::move(handler)) {
    EXPECT_TRUE(server_.Start().ok());
    thread_ = std::thread([this] { server_.Run(); });
  }
  ~Server() {
    server_.Stop(200);
    thread_.join();
  }
  uint16_t port() const { return server_.port(); }

 private:
  static HttpServerOptions Options() {
    HttpServerOptions o;
    o.port = 0;
    o.threads = 2;
    return o;
  }
  HttpServer server_;
  std::thread thread_;
};

// A plain TCP client.
class Client {
 public:
  explicit Client(uint16_t port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    timeval tv{0, 100000};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~Client() { Close(); }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  void ShutdownWrite() { ASSERT_EQ(shutdown(fd_, SHUT_WR), 0); }
  void Send(const std::string& bytes) {
    ASSERT_EQ(send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }
  // Reads until `done(received)` or the timeout; returns what was received.
  std::string ReadUntil(const std::function<bool(const std::string&)>& done,
                        std::chrono::milliseconds timeout = 5000ms) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (!done(in_) && std::chrono::steady_clock::now() < end) {
      char buf[4096];
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n > 0) in_.append(buf, static_cast<size_t>(n));
      if (n == 0) break;
    }
    std::string out = std::move(in_);
    in_.clear();
    return out;
  }

 private:
  int fd_ = -1;
  std::string in_;
};

bool HasWholeResponse(const std::string& s) {
  const size_t head = s.find("\r\n\r\n");
  if (head == std::string::npos) return false;
  const size_t cl = s.find("Content-Length: ");
  if (cl == std::string::npos || cl > head) return false;
  return s.size() >= head + 4 + std::stoul(s.substr(cl + 16));
}

std::string Get(const std::string& path) { return "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n"; }

// Decodes a chunked body; empty if incomplete.
std::string Dechunk(const std::string& body, bool* complete) {
  std::string out;
  size_t at = 0;
  *complete = false;
  for (;;) {
    const size_t eol = body.find("\r\n", at);
    if (eol == std::string::npos) return out;
    const size_t n = std::stoul(body.substr(at, eol - at), nullptr, 16);
    if (n == 0) {
      *complete = body.size() >= eol + 4;
      return out;
    }
    if (body.size() < eol + 2 + n + 2) return out;
    out += body.substr(eol + 2, n);
    at = eol + 2 + n + 2;
  }
}

// router.listen on an address of another host (192.0.2.1, TEST-NET-1): named as such.
TEST(HttpServer, AnAddressOfAnotherHostIsNamed) {
  HttpServer server({.host = "192.0.2.1", .port = 8000},
                    [](const HttpRequest&) { return HttpResponse{}; });
  Status s = server.Start();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("cannot listen on 192.0.2.1:8000: "), std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("(192.0.2.1 is not an address of this host)"), std::string::npos)
      << s.message();
}

TEST(HttpServer, SyncAnswersKeepTheConnection) {
  HttpServer server({.host = "127.0.0.1", .port = 0}, [](const HttpRequest& r) {
    HttpResponse res;
    res.body = "path=" + r.path;
    return res;
  });
  ASSERT_TRUE(server.Start().ok());
  std::thread t([&] { server.Run(); });
  Client c(server.port());
  c.Send(Get("/a?x=1"));
  std::string r = c.ReadUntil(HasWholeResponse);
  EXPECT_NE(r.find("200 OK"), std::string::npos) << r;
  EXPECT_NE(r.find("path=/a"), std::string::npos) << r;
  c.Send(Get("/b"));
  r = c.ReadUntil(HasWholeResponse);
  EXPECT_NE(r.find("path=/b"), std::string::npos) << r;
  server.Stop(200);
  t.join();
}

TEST(HttpServer, AnswersLaterFromAnotherThread) {
  std::thread worker;
  Server server([&](const HttpRequest&, std::shared_ptr<HttpResponder> r) {
    worker = std::thread([r] {
      std::this_thread::sleep_for(100ms);
      HttpResponse res;
      res.status = 202;
      res.body = "later";
      r->Respond(res);
    });
  });
  Client c(server.port());
  c.Send(Get("/x"));
  const std::string r = c.ReadUntil(HasWholeResponse);
  EXPECT_NE(r.find("202 Accepted"), std::string::npos) << r;
  EXPECT_NE(r.find("later"), std::string::npos) << r;
  worker.join();
}

TEST(HttpServer, StreamsChunksThenServesTheNextRequest) {
  std::thread worker;
  Server server([&](const HttpRequest& req, std::shared_ptr<HttpResponder> r) {
    if (req.path == "/plain") {
      r->Respond({200, "text/plain", "plain", {}});
      return;
    }
    worker = std::thread([r] {
      r->BeginStream(200, "text/event-stream");
      for (const char* event : {"data: one\n\n", "data: two\n\n", "data: [DONE]\n\n"}) {
        std::this_thread::sleep_for(30ms);
        r->Write(event);
      }
      r->End();
    });
  });
  Client c(server.port());
  c.Send(Get("/stream"));
  std::string body;
  const std::string r = c.ReadUntil([&](const std::string& s) {
    const size_t head = s.find("\r\n\r\n");
    if (head == std::string::npos) return false;
    bool complete = false;
    body = Dechunk(s.substr(head + 4), &complete);
    return complete;
  });
  EXPECT_NE(r.find("Content-Type: text/event-stream"), std::string::npos) << r;
  EXPECT_NE(r.find("Transfer-Encoding: chunked"), std::string::npos) << r;
  EXPECT_EQ(body, "data: one\n\ndata: two\n\ndata: [DONE]\n\n");
  worker.join();
  c.Send(Get("/plain"));
  EXPECT_NE(c.ReadUntil(HasWholeResponse).find("plain"), std::string::npos);
}

TEST(HttpServer, ClientLeavingIsNoticedWhileTheAnswerWaits) {
  std::mutex mu;
  std::condition_variable cv;
  bool noticed = false;
  std::shared_ptr<HttpResponder> held;
  Server server([&](const HttpRequest&, std::shared_ptr<HttpResponder> r) {
    r->OnClose([&] {
      std::lock_guard<std::mutex> lock(mu);
      noticed = true;
      cv.notify_all();
    });
    std::lock_guard<std::mutex> lock(mu);
    held = r;
    cv.notify_all();
  });
  {
    Client c(server.port());
    c.Send(Get("/wait"));
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, 5s, [&] { return held != nullptr; }));
  }  // The client goes away.
  std::unique_lock<std::mutex> lock(mu);
  EXPECT_TRUE(cv.wait_for(lock, 5s, [&] { return noticed; }));
  EXPECT_TRUE(held->closed());
  // Answers after the client left are ignored.
  held->BeginStream(200, "text/event-stream");
  held->Write("data: late\n\n");
  held->End();
  held.reset();
}

TEST(HttpServer, AResponderReleasedWithoutAnAnswerSends500) {
  Server server([](const HttpRequest&, std::shared_ptr<HttpResponder>) {});
  Client c(server.port());
  c.Send(Get("/forgot"));
  const std::string r = c.ReadUntil(HasWholeResponse);
  EXPECT_NE(r.find("500 Internal Server Error"), std::string::npos) << r;
  EXPECT_NE(r.find("no response"), std::string::npos) << r;
}

// Stop: no new connections, an idle keep-alive connection is closed at once, a stream in
// progress runs to its end within the grace period, then Run returns.
TEST(HttpServer, StopLetsAStreamFinishAndClosesIdleConnections) {
  std::thread worker;
  std::atomic<bool> streaming_began{false};
  HttpServerOptions o;
  o.port = 0;
  HttpServer server(o,
                    AsyncHttpHandler([&](const HttpRequest& req, std::shared_ptr<HttpResponder> r) {
                      if (req.path == "/quick") {
                        r->Respond({200, "text/plain", "quick", {}});
                        return;
                      }
                      worker = std::thread([r, &streaming_began] {
                        r->BeginStream(200, "text/event-stream");
                        streaming_began = true;
                        for (int i = 0; i < 5; ++i) {
                          std::this_thread::sleep_for(100ms);
                          r->Write("data: " + std::to_string(i) + "\n\n");
                        }
                        r->End();
                      });
                    }));
  ASSERT_TRUE(server.Start().ok());
  std::thread run([&] { server.Run(); });
  Client idle(server.port());
  idle.Send(Get("/quick"));
  ASSERT_NE(idle.ReadUntil(HasWholeResponse).find("quick"), std::string::npos);
  Client streaming(server.port());
  streaming.Send(Get("/stream"));
  // Stop once the stream is in progress (a state, not a time: a loaded machine may take long).
  const auto began_by = std::chrono::steady_clock::now() + 30s;
  while (!streaming_began && std::chrono::steady_clock::now() < began_by) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_TRUE(streaming_began);
  const auto stop_at = std::chrono::steady_clock::now();
  server.Stop(5000);
  std::string body;
  streaming.ReadUntil([&](const std::string& s) {
    const size_t head = s.find("\r\n\r\n");
    if (head == std::string::npos) return false;
    bool complete = false;
    body = Dechunk(s.substr(head + 4), &complete);
    return complete;
  });
  EXPECT_EQ(body, "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n");
  run.join();
  // Run returned once the stream ended, long before the 5 s grace.
  EXPECT_LT(std::chrono::steady_clock::now() - stop_at, 3s);
  // The idle connection was closed by the server.
  EXPECT_EQ(idle.ReadUntil([](const std::string&) { return false; }, 500ms), "");
  worker.join();
}

// Stop with answers still open at the end of the grace period: the deadline hook ends them (a
// stream gets its last event and its end, a waiting request its whole answer), they are written,
// then Run returns. A client that half-closed after its request still gets its stream.
TEST(HttpServer, StopEndsAnswersStillOpenThroughItsDeadlineHook) {
  std::mutex mu;
  std::vector<std::shared_ptr<HttpResponder>> open;
  HttpServerOptions o;
  o.port = 0;
  HttpServer server(o,
                    AsyncHttpHandler([&](const HttpRequest& req, std::shared_ptr<HttpResponder> r) {
                      if (req.path == "/stream") {
                        r->BeginStream(200, "text/event-stream");
                        r->Write("data: first\n\n");
                      }
                      std::lock_guard<std::mutex> lock(mu);
                      open.push_back(std::move(r));
                    }));
  ASSERT_TRUE(server.Start().ok());
  std::thread run([&] { server.Run(); });
  Client streaming(server.port());
  auto first = [](const std::string& s) { return s.find("data: first") != std::string::npos; };
  streaming.Send(Get("/stream"));
  std::string received[2];
  received[0] = streaming.ReadUntil(first);
  ASSERT_TRUE(first(received[0])) << received[0];
  Client half_closed(server.port());
  half_closed.Send(Get("/stream"));
  half_closed.ShutdownWrite();
  received[1] = half_closed.ReadUntil(first);
  ASSERT_TRUE(first(received[1])) << received[1];
  Client waiting(server.port());
  waiting.Send(Get("/whole"));
  const auto all_open_by = std::chrono::steady_clock::now() + 30s;
  auto count = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return open.size();
  };
  while (count() < 3 && std::chrono::steady_clock::now() < all_open_by) {
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_EQ(count(), 3u);
  std::atomic<int> hooked{0};
  server.Stop(100, [&] {
    ++hooked;
    std::lock_guard<std::mutex> lock(mu);
    for (auto& r : open) {
      r->Respond({503, "application/json", "{\"stopping\": true}", {}});  // The waiting one.
      r->Write("data: {\"error\": \"stopping\"}\n\ndata: [DONE]\n\n");    // The streams.
      r->End();
    }
    open.clear();
  });
  Client* clients[2] = {&streaming, &half_closed};
  for (int i = 0; i < 2; ++i) {
    std::string body;
    received[i] += clients[i]->ReadUntil([&](const std::string& s) {
      const std::string all = received[i] + s;
      const size_t head = all.find("\r\n\r\n");
      if (head == std::string::npos) return false;
      bool complete = false;
      body = Dechunk(all.substr(head + 4), &complete);
      return complete;
    });
    EXPECT_EQ(body, "data: first\n\ndata: {\"error\": \"stopping\"}\n\ndata: [DONE]\n\n") << i;
  }
  const std::string whole = waiting.ReadUntil(HasWholeResponse);
  EXPECT_NE(whole.find("503"), std::string::npos) << whole;
  EXPECT_NE(whole.find("stopping"), std::string::npos) << whole;
  run.join();
  EXPECT_EQ(hooked, 1);
}

}  // namespace
}  // namespace fmoe
