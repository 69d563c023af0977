// fmoe-router: the HTTP front end. Reads the manifest, binds the HTTP listener and the worker
// socket, reports readiness to the launcher, serves until SIGINT/SIGTERM.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <optional>
#include <thread>

#include <CLI/CLI.hpp>

#include "common/log.h"
#include "common/manifest.h"
#include "common/model/model_config.h"
#include "common/process_util.h"
#include "common/service_setup.h"
#include "common/text/think_splitter.h"
#include "common/text/tokenizer.h"
#include "common/wire/curve_key.h"
#include "router/api.h"
#include "router/completions.h"
#include "router/http_server.h"
#include "router/worker_link.h"

namespace {

// The longest prompt plus max_tokens the router admits: the model's context, or less where a
// group's KV pool holds fewer positions (a request must fit the pool even alone).
uint32_t RouterContextLength(const fmoe::ModelInfo& model, const fmoe::Manifest& manifest,
                             std::string* why) {
  uint64_t context = model.max_position_embeddings > 0 ? model.max_position_embeddings : 4096;
  for (const fmoe::WorkerGroupSpec& g : manifest.worker_groups) {
    const uint64_t pool = fmoe::KvPoolTokens(model, static_cast<uint32_t>(g.max_batch),
                                             static_cast<uint64_t>(g.kv_cache_tokens));
    if (pool < context) {
      spdlog::info(
          "group {}: its KV pool's {} positions limit prompt plus max_tokens (the "
          "model's context is {})",
          g.name, pool, context);
      context = pool;
      *why = " (the KV pool of group " + g.name + " holds " + std::to_string(pool) +
             " positions: kv_cache_tokens)";
    }
  }
  return static_cast<uint32_t>(context);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace fmoe;
  CLI::App app{"fmoe-router: OpenAI-compatible HTTP front end of an fmoe cluster"};
  std::string manifest_path;
  int ready_fd = -1;
  app.add_option("--manifest", manifest_path, "cluster manifest (YAML)")->required();
  app.add_option("--ready-fd", ready_fd, "file descriptor to write READY to once serving");
  CLI11_PARSE(app, argc, argv);

  Manifest manifest;
  if (int rc = SetUpService("fmoe-router", manifest_path, "router", &manifest); rc != 0) {
    return rc;
  }
  // Every ZeroMQ socket of this process authenticates with the cluster key.
  if (Status s = wire::UseClusterKey(manifest.security.curve, manifest.security.key_file, true);
      !s.ok()) {
    spdlog::error("{}", s.message());
    return 2;
  }
  StopSignals& signals = StopSignals::Install();

  // Manifest -> component options, in this one place.
  auto listen = ParseHostPort(manifest.router.listen);
  if (!listen.ok()) {
    std::fprintf(stderr, "fmoe-router: %s\n", listen.status().message().c_str());
    return 2;
  }
  HttpServerOptions http;
  http.host = listen->host;
  http.port = listen->port;
  http.max_body_bytes = static_cast<size_t>(manifest.router.max_body_bytes);
  WorkerLinkOptions link_options;
  link_options.worker_endpoint = manifest.router.worker_endpoint;
  link_options.map_service_endpoint = manifest.map_service.endpoint;
  link_options.model_name = manifest.model.name;
  for (const auto& g : manifest.worker_groups) {
    link_options.group_names.push_back(g.name);
    link_options.queue_limits.push_back(g.queue_limit);
    link_options.world_sizes.push_back(static_cast<uint32_t>(g.workers.size()));
  }
  link_options.heartbeat_interval_ms = manifest.heartbeat.interval_ms;
  link_options.heartbeat_timeout_ms = manifest.heartbeat.timeout_ms;
  spdlog::info(
      "effective config: listen={}:{} worker_endpoint={} map_service={} model={} groups={} "
      "max_body_bytes={} request_timeout_s={} api_keys={} heartbeat={}ms/{}ms",
      http.host, http.port, link_options.worker_endpoint, link_options.map_service_endpoint,
      link_options.model_name, link_options.group_names.size(), http.max_body_bytes,
      manifest.router.request_timeout_s, manifest.router.api_keys.size(),
      link_options.heartbeat_interval_ms, link_options.heartbeat_timeout_ms);

  // The router tokenizes and detokenizes: it loads the model's shape and tokenizer (no weights).
  // Its fingerprint is the one every leader must report (the workers compute it the same way).
  auto model = LoadModelInfo(manifest.model.path);
  if (!model.ok()) {
    spdlog::error("{}", model.status().message());
    return 1;
  }
  link_options.model_fingerprint = model->fingerprint;
  spdlog::info("model fingerprint {}: leaders reporting another are refused",
               FingerprintHex(model->fingerprint));
  WorkerLink link(link_options, SteadyClock::Get());
  if (Status s = link.Start(); !s.ok()) {
    spdlog::error("{}", s.message());
    return 1;
  }
  auto tokenizer = Tokenizer::Load(model->dir);
  if (!tokenizer.ok()) {
    spdlog::error("{}", tokenizer.status().message());
    return 1;
  }
  CompletionsOptions completions_options;
  completions_options.model_name = manifest.model.name;
  completions_options.responses_capacity = static_cast<size_t>(manifest.router.responses_capacity);
  completions_options.responses_dir = manifest.router.responses_dir;
  completions_options.context_length =
      RouterContextLength(*model, manifest, &completions_options.context_limit);
  completions_options.request_timeout_ms =
      static_cast<int64_t>(manifest.router.request_timeout_s * 1000.0);
  // The model's chat template, compiled once; a template this router cannot compile leaves
  // /v1/chat/completions answering 400 with the reason, and the rest serving.
  std::optional<ChatTemplate> chat_template;
  if (!(*tokenizer)->chat_template().empty()) {
    auto compiled = ChatTemplate::Compile((*tokenizer)->chat_template());
    if (compiled.ok()) {
      chat_template.emplace(std::move(*compiled));
      completions_options.chat_template = &*chat_template;
    } else {
      spdlog::error("the model's chat template is not supported ({}); /v1/chat/completions is off",
                    compiled.status().message());
    }
  } else {
    spdlog::warn("the model has no chat template; /v1/chat/completions is off");
  }
  if (auto bos = (*tokenizer)->bos_id())
    completions_options.bos_token = (*tokenizer)->IdToToken(*bos);
  if (auto eos = (*tokenizer)->eos_id())
    completions_options.eos_token = (*tokenizer)->IdToToken(*eos);
  // gpt-oss answers in harmony channels; its analysis channel goes to reasoning_content.
  completions_options.harmony_channels = model->architecture == "GptOssForCausalLM" &&
                                         (*tokenizer)->TokenToId("<|channel|>").has_value() &&
                                         (*tokenizer)->TokenToId("<|message|>").has_value();
  if (completions_options.harmony_channels) {
    spdlog::info("chat answers: gpt-oss's analysis channel is reasoning_content");
  }
  // Reasoning models (DeepSeek-R1, Qwen3, GLM-4.5, MiniMax-M2, Kimi-K2-Thinking): the thinking
  // between <think> and </think> goes to reasoning_content, in the style of the template's
  // generation prompt (common/text/think_splitter.h).
  if (!completions_options.harmony_channels && chat_template) {
    completions_options.think_style = ThinkStyleFor(
        **tokenizer, *chat_template, completions_options.bos_token, completions_options.eos_token);
  }
  if (completions_options.think_style) {
    const bool starts = *completions_options.think_style == ThinkStyle::kStartsThinking;
    spdlog::info(
        "chat answers: <think>...</think> is reasoning_content ({} style: {}; architecture {})",
        ThinkStyleName(*completions_options.think_style),
        starts ? "the prompt opens the thinking, output before </think> is reasoning"
               : "the model opens the thinking, output without <think> is content",
        model->architecture);
  }
  // Tool calls: the model family's format (common/text/tool_calls.h); Kimi-K2 shares
  // DeepSeek-V3's architecture and is told apart by its tokenizer's tool tokens.
  if (chat_template) {
    const bool kimi = (*tokenizer)->TokenToId("<|tool_calls_section_begin|>").has_value();
    completions_options.tool_call_format = ToolCallFormatFor(model->architecture, kimi);
    if (!manifest.router.tool_call_parser.empty()) {
      auto chosen = ParseToolCallFormat(manifest.router.tool_call_parser);
      if (!chosen.ok()) {
        spdlog::error("manifest: router.tool_call_parser: {}", chosen.status().message());
        return 1;
      }
      completions_options.tool_call_format = *chosen;
      spdlog::info("chat tools: router.tool_call_parser {} replaces the {} format of {}",
                   manifest.router.tool_call_parser,
                   ToolCallFormatName(ToolCallFormatFor(model->architecture, kimi)),
                   model->architecture);
    }
    spdlog::info("chat tools: {} ({})",
                 completions_options.tool_call_format == ToolCallFormat::kNone
                     ? std::string("no tool-call format for this architecture; tool_choice auto "
                                   "is refused")
                     : "calls parsed in the " +
                           std::string(ToolCallFormatName(completions_options.tool_call_format)) +
                           " format",
                 model->architecture);
  }
  RouterMetrics metrics;
  metrics.SetModel(*model, manifest.model.name);
  Completions completions(completions_options, **tokenizer, link, &metrics);
  RouterApi api({manifest.model.name, model->max_position_embeddings, manifest.router.api_keys,
                 manifest.router.cors_allowed_origins},
                link, &completions, &metrics);
  HttpServer server(http, AsyncHttpHandler([&api](const HttpRequest& r,
                                                  std::shared_ptr<HttpResponder> responder) {
                      api.Handle(r, std::move(responder));
                    }));
  if (Status s = server.Start(); !s.ok()) {
    spdlog::error("router.listen: {}", s.message());
    return 1;
  }

  std::atomic<bool> stop{false};
  std::thread link_thread([&] { link.Run(stop); });
  // SIGTERM: stop accepting, let in-flight answers (streams included) finish for up to
  // router.drain_timeout_s or the request timeout, whichever is shorter, then exit.
  const int grace_ms = static_cast<int>(
      std::min(manifest.router.drain_timeout_s, manifest.router.request_timeout_s) * 1000);
  // At the end of the drain every request still open ends at once (an error event and [DONE]
  // in a stream, 503 otherwise; its leader told to cancel it), and those answers get 2 s to be
  // written before the router exits.
  signals.OnStop([&server, &link, grace_ms] {
    server.Stop(
        grace_ms, [&link] { link.StopRequests(); }, 2000);
  });
  spdlog::info("serving http://{}:{}", http.host, server.port());
  NotifyReady(ready_fd);
  server.Run();
  stop = true;
  link_thread.join();
  spdlog::info("stopped (signal {})", signals.last_signal());
  return 0;
}
