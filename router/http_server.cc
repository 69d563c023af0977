#include "router/http_server.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include <spdlog/spdlog.h>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "common/json.h"

namespace fmoe {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

class Session;

// The responder of one request: forwards every call to its session's strand.
class Exchange final : public HttpResponder {
 public:
  Exchange(std::shared_ptr<Session> session, uint64_t serial)
      : session_(std::move(session)), serial_(serial) {}
  ~Exchange() override;

  void Respond(HttpResponse response) override;
  void BeginStream(int status, const std::string& content_type,
                   std::vector<std::pair<std::string, std::string>> headers) override;
  void Write(std::string chunk) override;
  void End() override;
  void OnClose(std::function<void()> callback) override;
  bool closed() const override { return closed_.load(); }

  // Strand only.
  void MarkClosed() {
    closed_ = true;
    std::function<void()> cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cb = std::move(on_close_);
      on_close_ = nullptr;
    }
    if (cb) cb();
  }
  bool answered() const { return answered_.load(); }

 private:
  friend class Session;
  std::shared_ptr<Session> session_;
  uint64_t serial_;
  std::atomic<bool> closed_{false};
  std::atomic<bool> answered_{false};  // Respond or BeginStream was called.
  std::mutex mu_;
  std::function<void()> on_close_;  // GUARDED_BY(mu_)
};

// One connection: read a request, hand it to the handler, write its answer (whole or chunked)
// while watching the socket for the client leaving, repeat while keep-alive.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, const HttpServerOptions& options, const AsyncHttpHandler& handler,
          std::atomic<int>& open, const std::atomic<bool>& stopping)
      : stream_(std::move(socket)),
        options_(options),
        handler_(handler),
        open_(open),
        stopping_(stopping) {
    ++open_;
    beast::error_code ec;
    auto ep = stream_.socket().remote_endpoint(ec);
    if (!ec) remote_ = ep.address().to_string() + ":" + std::to_string(ep.port());
  }
  ~Session() { --open_; }

  void Start() {
    asio::dispatch(stream_.get_executor(),
                   beast::bind_front_handler(&Session::Read, shared_from_this()));
  }

  // Posted by Exchange; run on the strand. `serial` guards against a stale responder.
  void Post(std::function<void()> fn) { asio::post(stream_.get_executor(), std::move(fn)); }

  void DoRespond(uint64_t serial, HttpResponse res) {
    if (serial != serial_ || state_ != State::kWaiting) return;
    state_ = State::kFinal;
    auto out = std::make_shared<http::response<http::string_body>>();
    out->version(11);
    out->result(static_cast<unsigned>(res.status));
    if (res.status == 499) out->reason("Client Closed Request");  // nginx's; not in Beast's table
    out->set(http::field::server, "fmoe");
    if (!res.content_type.empty()) out->set(http::field::content_type, res.content_type);
    for (const auto& [k, v] : res.headers) out->set(k, v);
    out->body() = std::move(res.body);
    out->keep_alive(keep_alive_);
    out->prepare_payload();
    stream_.expires_after(std::chrono::seconds(options_.idle_timeout_s));
    http::async_write(stream_, *out,
                      [self = shared_from_this(), out](beast::error_code ec, std::size_t) {
                        self->Written(ec, /*last=*/true);
                      });
  }

  void DoBeginStream(uint64_t serial, int status, const std::string& content_type,
                     const std::vector<std::pair<std::string, std::string>>& headers) {
    if (serial != serial_ || state_ != State::kWaiting) return;
    if (closed_) {
      state_ = State::kDone;
      return Close();
    }
    state_ = State::kStreaming;
    std::string head = "HTTP/1.1 " + std::to_string(status) + " " +
                       std::string(http::obsolete_reason(static_cast<http::status>(status))) +
                       "\r\nServer: fmoe\r\nContent-Type: " + content_type +
                       "\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n";
    for (const auto& [k, v] : headers) head += k + ": " + v + "\r\n";
    head += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
    Queue(std::move(head), false);
  }

  void DoWrite(uint64_t serial, std::string chunk) {
    if (serial != serial_ || state_ != State::kStreaming || chunk.empty() || closed_) return;
    char size[20];
    std::snprintf(size, sizeof(size), "%zx\r\n", chunk.size());
    Queue(std::string(size) + chunk + "\r\n", false);
  }

  void DoEnd(uint64_t serial) {
    if (serial != serial_ || state_ != State::kStreaming) return;
    if (closed_) {
      state_ = State::kDone;
      if (!writing_) Close();
      return;
    }
    state_ = State::kFinal;
    Queue("0\r\n\r\n", true);
  }

  void DoOnClosed(uint64_t serial) {
    if (serial == serial_ && closed_) {
      if (auto e = exchange_.lock()) e->MarkClosed();
    }
  }

  bool closed() const { return closed_; }

  // The server stops: a connection waiting for its next request closes now; one with an
  // answer in progress closes after it.
  void StopIfIdle() {
    Post([self = shared_from_this()] {
      if (self->state_ == State::kReading) {
        beast::error_code ec;
        self->stream_.socket().close(ec);
      }
    });
  }

 private:
  enum class State { kReading, kWaiting, kStreaming, kFinal, kDone };

  void Read() {
    state_ = State::kReading;
    parser_.emplace();
    parser_->body_limit(options_.max_body_bytes);
    parser_->header_limit(static_cast<std::uint32_t>(options_.max_header_bytes));
    stream_.expires_after(std::chrono::seconds(options_.idle_timeout_s));
    http::async_read(stream_, buffer_, *parser_,
                     beast::bind_front_handler(&Session::OnRead, shared_from_this()));
  }

  void OnRead(beast::error_code ec, std::size_t) {
    if (ec == http::error::end_of_stream || ec == beast::error::timeout ||
        ec == asio::error::connection_reset || ec == asio::error::operation_aborted) {
      return Close();
    }
    keep_alive_ = false;
    ++serial_;
    state_ = State::kWaiting;
    if (ec == http::error::body_limit) {
      return DoRespond(serial_, ApiError(413,
                                         "request body is larger than the limit of " +
                                             std::to_string(options_.max_body_bytes) + " bytes",
                                         "invalid_request_error", "", "body_too_large"));
    }
    if (ec == http::error::header_limit) {
      return DoRespond(serial_, ApiError(431, "request headers are larger than the limit",
                                         "invalid_request_error", "", ""));
    }
    if (ec) {
      return DoRespond(serial_, ApiError(400, "malformed HTTP request: " + ec.message(),
                                         "invalid_request_error", "", ""));
    }
    const auto& msg = parser_->get();
    HttpRequest req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    req.path = req.target.substr(0, req.target.find('?'));
    for (const auto& field : msg) {
      std::string name(field.name_string());
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      req.headers[name] = std::string(field.value());
    }
    req.body = msg.body();
    req.remote = remote_;
    keep_alive_ = msg.keep_alive();
    // While the handler works, the answer may take long: no idle timeout, and watch the socket.
    stream_.expires_never();
    auto exchange = std::make_shared<Exchange>(shared_from_this(), serial_);
    exchange_ = exchange;
    try {
      handler_(req, exchange);
    } catch (const std::exception& e) {
      spdlog::error("handler failed on {} {}: {}", req.method, req.path, e.what());
      exchange->Respond(ApiError(500, "internal error", "server_error", "", ""));
    } catch (...) {
      spdlog::error("handler failed on {} {}: unknown exception", req.method, req.path);
      exchange->Respond(ApiError(500, "internal error", "server_error", "", ""));
    }
    // Watched after the handler: a stream it began (posted to this strand) has begun when the
    // watch can first report, so a half-close right after the request finds it streaming.
    Watch();
  }

  // A read that only notices the client leaving (or keeps the bytes of a pipelined request).
  // A half-close (end of file) after the whole request is not the client leaving while its
  // answer is under way: a stream goes on (a client that has really gone is noticed when a
  // write fails), a whole response being written is finished; no further request is read.
  // Before the answer has begun, an end of file cannot be told from a client that closed its
  // socket (nothing has been written that it would reset), so it is taken as the client
  // leaving (OnClose; the handler answers it as a client cancel, which a half-closed client
  // still receives).
  void Watch() {
    watching_ = true;
    stream_.async_read_some(
        buffer_.prepare(4096), [self = shared_from_this()](beast::error_code ec, std::size_t n) {
          self->watching_ = false;
          if (!ec) {
            self->buffer_.commit(n);  // A pipelined request: parsed when this one is done.
            if (self->state_ == State::kDone && !self->closing_) self->Read();
            return;
          }
          if (ec == asio::error::operation_aborted && self->state_ == State::kDone) {
            if (!self->closing_) self->Read();  // Cancelled after the answer: next request.
            return;
          }
          if (self->state_ == State::kDone) return;
          if (ec == asio::error::eof &&
              (self->state_ == State::kStreaming || self->state_ == State::kFinal)) {
            self->keep_alive_ = false;  // Half-closed: answered, then the connection ends.
            return;
          }
          // The client left before its answer was complete: its work can stop. A whole
          // response already on its way is still written; a stream is not continued.
          self->closed_ = true;
          if (auto e = self->exchange_.lock()) e->MarkClosed();
          if (self->state_ == State::kStreaming && !self->writing_) self->Close();
        });
  }

  void Queue(std::string bytes, bool last) {
    out_.push_back({std::make_shared<std::string>(std::move(bytes)), last});
    if (!writing_) WriteNext();
  }

  void WriteNext() {
    if (out_.empty()) {
      writing_ = false;
      return;
    }
    writing_ = true;
    auto piece = out_.front();
    out_.pop_front();
    stream_.expires_after(std::chrono::seconds(options_.idle_timeout_s));
    asio::async_write(stream_, asio::buffer(*piece.bytes),
                      [self = shared_from_this(), piece](beast::error_code ec, std::size_t) {
                        self->Written(ec, piece.last);
                      });
  }

  void Written(beast::error_code ec, bool last) {
    if (ec) {
      writing_ = false;
      out_.clear();
      closed_ = true;
      if (auto e = exchange_.lock()) e->MarkClosed();
      return Close();
    }
    if (!last) {
      if (out_.empty()) stream_.expires_never();  // Waiting for the next chunk.
      return WriteNext();
    }
    writing_ = false;
    state_ = State::kDone;
    exchange_.reset();
    if (!keep_alive_ || closed_ || stopping_) return Close();
    if (watching_) {
      beast::error_code ignored;
      stream_.socket().cancel(ignored);  // The watch completes, then reads the next request.
    } else {
      Read();
    }
  }

  // Ends the connection: our side is shut after what was written, and a pending watch read is
  // cancelled so the session goes away without waiting for the client to close.
  void Close() {
    closing_ = true;
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    stream_.socket().cancel(ec);
  }

  struct Piece {
    std::shared_ptr<std::string> bytes;
    bool last = false;
  };

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  const HttpServerOptions& options_;
  const AsyncHttpHandler& handler_;
  std::atomic<int>& open_;
  const std::atomic<bool>& stopping_;
  std::string remote_;
  // Strand only.
  State state_ = State::kReading;
  uint64_t serial_ = 0;  // Of the request being answered.
  bool keep_alive_ = false;
  bool watching_ = false;
  bool writing_ = false;
  bool closed_ = false;
  bool closing_ = false;
  std::deque<Piece> out_;
  std::weak_ptr<Exchange> exchange_;
};

Exchange::~Exchange() {
  if (!answered_) {
    // Released without an answer: a bug in a handler, answered rather than left hanging.
    session_->Post([s = session_, serial = serial_] {
      s->DoRespond(serial, ApiError(500, "internal error: no response", "server_error", "", ""));
    });
  }
}

void Exchange::Respond(HttpResponse response) {
  if (answered_.exchange(true)) return;
  session_->Post([s = session_, serial = serial_, r = std::move(response)]() mutable {
    s->DoRespond(serial, std::move(r));
  });
}

void Exchange::BeginStream(int status, const std::string& content_type,
                           std::vector<std::pair<std::string, std::string>> headers) {
  if (answered_.exchange(true)) return;
  session_->Post([s = session_, serial = serial_, status, content_type, h = std::move(headers)] {
    s->DoBeginStream(serial, status, content_type, h);
  });
}

void Exchange::Write(std::string chunk) {
  session_->Post([s = session_, serial = serial_, c = std::move(chunk)]() mutable {
    s->DoWrite(serial, std::move(c));
  });
}

void Exchange::End() {
  session_->Post([s = session_, serial = serial_] { s->DoEnd(serial); });
}

void Exchange::OnClose(std::function<void()> callback) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    on_close_ = std::move(callback);
  }
  // Already gone: run it on the strand now.
  session_->Post([s = session_, serial = serial_] { s->DoOnClosed(serial); });
}

}  // namespace

struct HttpServer::Impl {
  HttpServerOptions options;
  AsyncHttpHandler handler;
  asio::io_context ioc;
  tcp::acceptor acceptor{ioc};
  std::atomic<int> open_sessions{0};
  std::atomic<bool> stopping{false};
  std::mutex sessions_mu;
  std::vector<std::weak_ptr<Session>> sessions;  // GUARDED_BY(sessions_mu)
  uint16_t bound_port = 0;
  asio::steady_timer stop_timer{ioc};
  std::chrono::steady_clock::time_point stop_deadline;

  std::function<void()> at_deadline;  // Stop's; called once, at the end of the grace period.
  int final_ms = 0;

  // Stops the loop once no session is open or the grace period has ended; at its end, answers
  // still open get at_deadline and final_ms to be written.
  void WaitDrained() {
    if (open_sessions == 0) {
      ioc.stop();
      return;
    }
    if (std::chrono::steady_clock::now() >= stop_deadline) {
      if (!at_deadline) {
        ioc.stop();
        return;
      }
      spdlog::info("{} connection(s) still open at the end of the drain: ending their answers",
                   open_sessions.load());
      auto ending = std::move(at_deadline);
      at_deadline = nullptr;
      stop_deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(final_ms);
      ending();
    }
    stop_timer.expires_after(std::chrono::milliseconds(20));
    stop_timer.async_wait([this](beast::error_code) { WaitDrained(); });
  }

  void Accept() {
    acceptor.async_accept(asio::make_strand(ioc), [this](beast::error_code ec, tcp::socket s) {
      if (ec) {
        if (ec == asio::error::operation_aborted || stopping) return;
        spdlog::warn("accept failed: {}", ec.message());
      } else {
        auto session =
            std::make_shared<Session>(std::move(s), options, handler, open_sessions, stopping);
        {
          std::lock_guard<std::mutex> lock(sessions_mu);
          std::erase_if(sessions, [](const std::weak_ptr<Session>& w) { return w.expired(); });
          sessions.push_back(session);
        }
        session->Start();
      }
      Accept();
    });
  }
};

HttpServer::HttpServer(HttpServerOptions options, AsyncHttpHandler handler)
    : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->handler = std::move(handler);
}

HttpServer::HttpServer(HttpServerOptions options, HttpHandler handler)
    : HttpServer(std::move(options),
                 AsyncHttpHandler([h = std::move(handler)](const HttpRequest& request,
                                                           std::shared_ptr<HttpResponder> r) {
                   r->Respond(h(request));
                 })) {}

HttpServer::~HttpServer() = default;

uint16_t HttpServer::port() const { return impl_->bound_port; }

Status HttpServer::Start() {
  const std::string where = impl_->options.host + ":" + std::to_string(impl_->options.port);
  beast::error_code ec;
  tcp::resolver resolver(impl_->ioc);
  auto results = resolver.resolve(impl_->options.host, std::to_string(impl_->options.port), ec);
  if (ec || results.empty()) {
    return InvalidArgument("cannot listen on " + where + ": cannot resolve host");
  }
  tcp::endpoint endpoint = results.begin()->endpoint();
  auto fail = [&](const char* step) -> Status {
    std::string msg = "cannot listen on " + where + ": " + ec.message();
    if (ec == beast::errc::address_not_available) {
      msg += " (" + impl_->options.host + " is not an address of this host)";
    }
    if (ec == asio::error::address_in_use) return AlreadyExists(msg);
    return IoError(msg + " (" + step + ")");
  };
  impl_->acceptor.open(endpoint.protocol(), ec);
  if (ec) return fail("open");
  impl_->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (ec) return fail("reuse_address");
  impl_->acceptor.bind(endpoint, ec);
  if (ec) return fail("bind");
  impl_->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return fail("listen");
  impl_->bound_port = impl_->acceptor.local_endpoint().port();
  impl_->Accept();
  return Status::Ok();
}

void HttpServer::Run() {
  std::vector<std::thread> extra;
  for (int i = 1; i < impl_->options.threads; ++i) {
    extra.emplace_back([this] { impl_->ioc.run(); });
  }
  impl_->ioc.run();
  for (auto& t : extra) t.join();
}

void HttpServer::Stop(int grace_ms, std::function<void()> at_deadline, int final_ms) {
  asio::post(impl_->ioc, [this, grace_ms, at_deadline = std::move(at_deadline), final_ms] {
    if (impl_->stopping) return;  // A second Stop changes nothing.
    impl_->stopping = true;
    impl_->at_deadline = at_deadline;
    impl_->final_ms = final_ms;
    {
      std::lock_guard<std::mutex> lock(impl_->sessions_mu);
      for (auto& w : impl_->sessions) {
        if (auto session = w.lock()) session->StopIfIdle();
      }
    }
    beast::error_code ec;
    impl_->acceptor.close(ec);
    impl_->stop_deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms);
    impl_->WaitDrained();
  });
}

}  // namespace fmoe
