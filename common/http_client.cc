#include "common/http_client.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <optional>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace fmoe::http {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;
using SteadyTime = std::chrono::steady_clock::time_point;

bool SameName(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

// The server closed a kept connection before answering: worth one more try on a new one.
bool ClosedByPeer(const beast::error_code& ec) {
  return ec == bhttp::error::end_of_stream || ec == asio::error::eof ||
         ec == asio::error::connection_reset || ec == asio::error::broken_pipe;
}

}  // namespace

std::string Response::Field(std::string_view name) const {
  for (const auto& [n, v] : fields) {
    if (SameName(n, name)) return v;
  }
  return "";
}

struct Client::Impl {
  Impl(std::string h, int p, ClientOptions o)
      : host(std::move(h)), port(p), options(o), where(host + ":" + std::to_string(port)) {}

  std::string host;
  int port;
  ClientOptions options;
  std::string where;
  asio::io_context ioc;
  std::optional<beast::tcp_stream> stream;  // Engaged while a connection is open.
  beast::flat_buffer buffer;
  std::atomic<bool> cancelled{false};

  bool Aborted() const {
    return cancelled.load() || (options.abort != nullptr && options.abort->load());
  }

  void CloseStream() {
    if (!stream) return;
    beast::error_code ignored;
    stream->socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream->socket().close(ignored);
    stream.reset();
    buffer.clear();
  }

  // Runs the operation just started until its handler has run: the stream's timer ends it at its
  // deadline (beast::error::timeout), a cancel by closing the socket, seen before the operation
  // runs and every 50 ms while it waits (a stream whose pieces come faster than that still
  // stops at its next read).
  void Run() {
    ioc.restart();
    bool closed = false;
    while (!ioc.stopped()) {
      if (!closed && Aborted() && stream) {
        beast::error_code ignored;
        stream->socket().close(ignored);
        closed = true;
      }
      ioc.run_for(std::chrono::milliseconds(50));
    }
  }

  // The error of a failed step, as a Status naming the peer and the step.
  Status Failure(const beast::error_code& ec, const char* step) const {
    if (Aborted()) return Unavailable(where + ": cancelled");
    if (ec == beast::error::timeout) return Timeout(where + ": " + step + " timed out");
    if (ec == bhttp::error::body_limit) {
      return DataLoss(where + ": response body larger than " +
                      std::to_string(options.max_body_bytes) + " bytes");
    }
    if (ec.category() == bhttp::make_error_code(bhttp::error::end_of_stream).category() &&
        ec != bhttp::error::end_of_stream && ec != bhttp::error::partial_message) {
      return DataLoss(where + ": malformed HTTP response (" + ec.message() + ")");
    }
    return Unavailable(where + ": " + step + ": " + ec.message());
  }

  Status Connect(SteadyTime deadline) {
    CloseStream();
    tcp::resolver resolver(ioc);
    beast::error_code ec;
    const auto endpoints = resolver.resolve(host, std::to_string(port), ec);
    if (ec) return InvalidArgument("cannot resolve " + host + ": " + ec.message());
    stream.emplace(ioc);
    stream->expires_at(
        std::min(deadline, std::chrono::steady_clock::now() +
                               std::chrono::milliseconds(std::max(1, options.connect_timeout_ms))));
    stream->async_connect(endpoints,
                          [&](const beast::error_code& e, const tcp::endpoint&) { ec = e; });
    Run();
    if (ec) {
      Status s = Failure(ec, "connect");
      CloseStream();
      return s;
    }
    stream->socket().set_option(tcp::no_delay(true), ec);
    return Status::Ok();
  }

  Result<Response> Exchange(const Request& request, int timeout_ms, const BodyFn* on_body) {
    const SteadyTime deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(0, timeout_ms));
    if (Aborted()) {
      CloseStream();
      return Unavailable(where + ": cancelled");
    }
    bhttp::request<bhttp::string_body> req;
    req.method_string(request.method);
    req.target(request.target);
    req.version(11);
    req.set(bhttp::field::host, where);
    bool has_type = false;
    for (const auto& [name, value] : request.headers) {
      req.insert(name, value);
      has_type = has_type || SameName(name, "content-type");
    }
    if (!request.body.empty() && !has_type) req.set(bhttp::field::content_type, "application/json");
    req.body() = request.body;
    req.prepare_payload();
    req.keep_alive(options.keep_alive);

    for (int attempt = 0;; ++attempt) {
      const bool reused = stream.has_value();
      if (!stream) {
        if (Status s = Connect(deadline); !s.ok()) return s;
      }
      beast::error_code ec;
      stream->expires_at(deadline);
      bhttp::async_write(*stream, req, [&](const beast::error_code& e, size_t) { ec = e; });
      Run();
      bhttp::response_parser<bhttp::string_body> parser;
      parser.body_limit(options.max_body_bytes);
      if (request.method == "HEAD") parser.skip(true);
      if (!ec) {
        bhttp::async_read_header(*stream, buffer, parser,
                                 [&](const beast::error_code& e, size_t) { ec = e; });
        Run();
      }
      if (ec) {
        Status s = Failure(ec, "request");
        CloseStream();
        if (reused && attempt == 0 && ClosedByPeer(ec) && !Aborted() &&
            std::chrono::steady_clock::now() < deadline) {
          continue;  // The server had closed the kept connection: once more on a new one.
        }
        return s;
      }
      return ReadBody(parser, on_body);
    }
  }

  Result<Response> ReadBody(bhttp::response_parser<bhttp::string_body>& parser,
                            const BodyFn* on_body) {
    Response r;
    const auto& msg = parser.get();
    r.status = static_cast<int>(msg.result_int());
    r.head = "HTTP/" + std::to_string(msg.version() / 10) + "." +
             std::to_string(msg.version() % 10) + " " + std::to_string(r.status) + " " +
             std::string(msg.reason()) + "\r\n";
    for (const auto& f : msg) {
      r.fields.emplace_back(std::string(f.name_string()), std::string(f.value()));
      r.head += r.fields.back().first + ": " + r.fields.back().second + "\r\n";
    }
    beast::error_code ec;
    if (on_body == nullptr) {
      if (!parser.is_done()) {
        bhttp::async_read(*stream, buffer, parser,
                          [&](const beast::error_code& e, size_t) { ec = e; });
        Run();
      }
      if (ec) {
        Status s = Failure(ec, "response");
        CloseStream();
        return s;
      }
      r.body = std::move(parser.get().body());
    } else {
      while (!parser.is_done()) {
        bhttp::async_read_some(*stream, buffer, parser,
                               [&](const beast::error_code& e, size_t) { ec = e; });
        Run();
        std::string& piece = parser.get().body();
        if (!piece.empty()) {
          const bool more = (*on_body)(r, piece);
          piece.clear();
          if (!more) {
            CloseStream();
            return r;
          }
        }
        if (ec) {
          Status s = Failure(ec, "response");
          CloseStream();
          return s;
        }
      }
    }
    if (!options.keep_alive || !parser.get().keep_alive()) CloseStream();
    return r;
  }
};

Client::Client(std::string host, int port, ClientOptions options)
    : impl_(std::make_unique<Impl>(std::move(host), port, options)) {}

Client::~Client() { impl_->CloseStream(); }

Result<Response> Client::Call(const Request& request, int timeout_ms) {
  return impl_->Exchange(request, timeout_ms, nullptr);
}

Result<Response> Client::Stream(const Request& request, int timeout_ms, const BodyFn& on_body) {
  return impl_->Exchange(request, timeout_ms, &on_body);
}

void Client::Cancel() { impl_->cancelled.store(true); }

void Client::Close() { impl_->CloseStream(); }

Result<Response> Fetch(const std::string& host, int port, const Request& request, int timeout_ms) {
  ClientOptions options;
  options.keep_alive = false;
  options.connect_timeout_ms = timeout_ms;
  Client client(host, port, options);
  return client.Call(request, timeout_ms);
}

Result<Response> Get(const std::string& host, int port, const std::string& path, int timeout_ms) {
  Request request;
  request.target = path;
  request.headers.emplace_back("Accept", "*/*");
  return Fetch(host, port, request, timeout_ms);
}

std::vector<std::string> SseReader::Feed(std::string_view bytes) {
  std::vector<std::string> events;
  pending_.append(bytes);
  size_t at = 0;
  for (size_t eol; (eol = pending_.find('\n', at)) != std::string::npos; at = eol + 1) {
    std::string_view line(pending_.data() + at, eol - at);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) {  // The blank line ends an event.
      if (has_data_) events.push_back(std::move(data_));
      data_.clear();
      has_data_ = false;
      continue;
    }
    if (!line.starts_with("data:")) continue;  // Comments and other fields.
    line.remove_prefix(5);
    if (line.starts_with(' ')) line.remove_prefix(1);
    if (has_data_) data_ += '\n';
    data_.append(line);
    has_data_ = true;
  }
  pending_.erase(0, at);
  return events;
}

}  // namespace fmoe::http
