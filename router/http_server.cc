#include "router/http_server.h"

#include <atomic>
#include <chrono>
#include <optional>
#include <thread>

#include <spdlog/spdlog.h>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

namespace fmoe {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

// One connection: read a request, answer it, repeat while keep-alive.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, const HttpServerOptions& options, const HttpHandler& handler,
          std::atomic<int>& open)
      : stream_(std::move(socket)), options_(options), handler_(handler), open_(open) {
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

 private:
  void Read() {
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
    if (ec == http::error::body_limit) {
      return Send(ErrorResponse(413,
                                "request body is larger than the limit of " +
                                    std::to_string(options_.max_body_bytes) + " bytes",
                                "invalid_request_error", "body_too_large"),
                  /*keep_alive=*/false);
    }
    if (ec == http::error::header_limit) {
      return Send(
          ErrorResponse(431, "request headers are larger than the limit", "invalid_request_error"),
          false);
    }
    if (ec) {
      return Send(
          ErrorResponse(400, "malformed HTTP request: " + ec.message(), "invalid_request_error"),
          false);
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
    bool keep_alive = msg.keep_alive();
    HttpResponse res;
    try {
      res = handler_(req);
    } catch (const std::exception& e) {
      spdlog::error("handler failed on {} {}: {}", req.method, req.path, e.what());
      res = ErrorResponse(500, "internal error", "server_error");
    }
    Send(std::move(res), keep_alive);
  }

  void Send(HttpResponse res, bool keep_alive) {
    auto out = std::make_shared<http::response<http::string_body>>();
    out->version(11);
    out->result(static_cast<unsigned>(res.status));
    out->set(http::field::server, "fmoe");
    out->set(http::field::content_type, res.content_type);
    for (const auto& [k, v] : res.headers) out->set(k, v);
    out->body() = std::move(res.body);
    out->keep_alive(keep_alive);
    out->prepare_payload();
    stream_.expires_after(std::chrono::seconds(options_.idle_timeout_s));
    http::async_write(stream_, *out,
                      [self = shared_from_this(), out](beast::error_code ec, std::size_t) {
                        if (ec || !out->keep_alive()) return self->Close();
                        self->Read();
                      });
  }

  void Close() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  const HttpServerOptions& options_;
  const HttpHandler& handler_;
  std::atomic<int>& open_;
  std::string remote_;
};

}  // namespace

HttpResponse ErrorResponse(int status, const std::string& message, const std::string& type,
                           const std::string& code) {
  nlohmann::json body = {
      {"error",
       {{"message", message},
        {"type", type},
        {"param", nullptr},
        {"code", code.empty() ? nlohmann::json(nullptr) : nlohmann::json(code)}}}};
  HttpResponse res;
  res.status = status;
  res.body = body.dump();
  return res;
}

struct HttpServer::Impl {
  HttpServerOptions options;
  HttpHandler handler;
  asio::io_context ioc;
  tcp::acceptor acceptor{ioc};
  std::atomic<int> open_sessions{0};
  std::atomic<bool> stopping{false};
  uint16_t bound_port = 0;
  asio::steady_timer stop_timer{ioc};
  std::chrono::steady_clock::time_point stop_deadline;

  // Stops the loop once no session is open or the grace period has ended.
  void WaitDrained() {
    if (open_sessions == 0 || std::chrono::steady_clock::now() >= stop_deadline) {
      ioc.stop();
      return;
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
        std::make_shared<Session>(std::move(s), options, handler, open_sessions)->Start();
      }
      Accept();
    });
  }
};

HttpServer::HttpServer(HttpServerOptions options, HttpHandler handler)
    : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->handler = std::move(handler);
}

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

void HttpServer::Stop(int grace_ms) {
  asio::post(impl_->ioc, [this, grace_ms] {
    impl_->stopping = true;
    beast::error_code ec;
    impl_->acceptor.close(ec);
    impl_->stop_deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms);
    impl_->WaitDrained();
  });
}

}  // namespace fmoe
