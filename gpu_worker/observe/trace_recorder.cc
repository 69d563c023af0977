#include "gpu_worker/observe/trace_recorder.h"

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <utility>

#include "common/log.h"

namespace fmoe {
namespace fs = std::filesystem;

namespace {

// Moves an existing regular file at `path` to the first free PATH.N; sets *kept to that name.
Status KeepExisting(const std::string& path, std::string* kept) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) return Status::Ok();  // Nothing there (or Create will say why).
  if (fs::is_directory(st)) return IoError(path + ": is a directory");
  if (!fs::is_regular_file(st)) return Status::Ok();  // A device or FIFO: written as it is.
  for (int n = 1; n < 100000; ++n) {
    const std::string candidate = path + "." + std::to_string(n);
    if (fs::exists(fs::symlink_status(candidate, ec))) continue;
    fs::rename(path, candidate, ec);
    if (ec) {
      return IoError(path + ": cannot keep the existing trace as " + candidate + ": " +
                     ec.message());
    }
    *kept = candidate;
    return Status::Ok();
  }
  return IoError(path + ": cannot keep the existing trace: " + path + ".1 .. .99999 all exist");
}

}  // namespace

TraceHeader WorkerTraceHeader(const ModelInfo& model, const std::string& model_name,
                              const std::string& group, uint32_t rank,
                              uint32_t speculation_distance) {
  TraceHeader h;
  h.model = model_name;
  h.source = "fmoe-worker " + group + " rank " + std::to_string(rank);
  h.iteration_unit =
      "engine iteration (0 = prefill of the whole prompt, then one decode step each)";
  h.semantic =
      "sem: mean over the request's new tokens of the iteration (the prompt in prefill, the new "
      "token in decode) of the model's input embeddings (embed_tokens rows), float32; map: the "
      "request's gate softmax over all experts, mean over its new tokens, stored per layer; "
      "speculation: per request, the gates of layers l+1..l+" +
      std::to_string(speculation_distance) +
      " applied to layer l's hidden state, per expert the fraction of the request's own new "
      "tokens of the iteration whose top-k picks it (other requests in the batch do not count)";
  h.num_layers = model.num_moe_layers;
  h.num_experts = model.num_experts;
  h.top_k = model.top_k;
  h.hidden = model.hidden_size;
  return h;
}

Result<std::unique_ptr<TraceRecorder>> TraceRecorder::Open(const TraceRecorderOptions& options) {
  if (options.path.empty()) return InvalidArgument("trace: no path given");
  std::string kept;
  FMOE_RETURN_IF_ERROR(KeepExisting(options.path, &kept));
  FMOE_ASSIGN_OR_RETURN(TraceWriter writer, TraceWriter::Create(options.path, options.header));
  std::unique_ptr<TraceRecorder> recorder(new TraceRecorder(options, std::move(writer)));
  recorder->kept_previous_ = std::move(kept);
  return recorder;
}

TraceRecorder::TraceRecorder(TraceRecorderOptions options, TraceWriter writer)
    : options_(std::move(options)), writer_(std::move(writer)) {}

TraceRecorder::~TraceRecorder() {
  if (!closed_) (void)Close();
}

void TraceRecorder::Write(const TraceIteration& it) {
  Status s = writer_.Append(it);
  if (s.ok()) s = writer_.Flush();
  if (!s.ok()) {
    error_ = s;
    spdlog::error("trace {}: {}; recording stops here ({} records written)", options_.path,
                  s.message(), stats_.records);
    return;
  }
  ++stats_.records;
  if (it.last) ++stats_.requests;
}

void TraceRecorder::Drop(uint64_t request_id, uint32_t iteration, const std::string& why) {
  ++stats_.dropped;
  spdlog::warn("trace: req={} iteration {} not recorded: {}", request_id, iteration, why);
}

TraceRecorder::Assembling* TraceRecorder::Find(uint64_t request_id, uint32_t iteration) {
  auto it = assembling_.find(request_id);
  if (it == assembling_.end() || it->second.it.iteration != iteration) return nullptr;
  return &it->second;
}

void TraceRecorder::OnBatchStart(std::span<const SequenceInfo> sequences) {
  if (!active()) return;
  // Anything still assembling belongs to a Forward that failed; its requests end with the
  // iteration before it.
  for (const auto& [id, a] : assembling_) {
    Drop(id, a.it.iteration, "its iteration did not complete");
  }
  assembling_.clear();
  const uint32_t L = options_.header.num_layers;
  for (const SequenceInfo& s : sequences) {
    Assembling a;
    a.it.request_id = s.request_id;
    a.it.iteration = s.iteration;
    a.it.tokens = s.tokens;
    a.it.prefill = s.in_prefill();
    a.it.used_offsets.reserve(L + 1);
    a.it.used_offsets.push_back(0);
    a.it.map_offsets.reserve(L + 1);
    a.it.map_offsets.push_back(0);
    a.it.map_experts.reserve(static_cast<size_t>(L) * options_.header.num_experts);
    a.it.map_probs.reserve(static_cast<size_t>(L) * options_.header.num_experts);
    if (!assembling_.emplace(s.request_id, std::move(a)).second) {
      assembling_[s.request_id].ok = false;  // Twice in one batch: never written.
    }
  }
}

void TraceRecorder::OnIterationStart(uint64_t request_id, uint32_t iteration,
                                     std::span<const float> sem) {
  if (!active()) return;
  Assembling* a = Find(request_id, iteration);
  if (a == nullptr) return;
  if (sem.size() != options_.header.hidden || a->has_sem) {
    a->ok = false;
    return;
  }
  a->it.sem.assign(sem.begin(), sem.end());
  a->has_sem = true;
}

void TraceRecorder::OnLayerGates(uint64_t request_id, uint32_t iteration, uint32_t layer,
                                 std::span<const float> probs) {
  if (!active()) return;
  Assembling* a = Find(request_id, iteration);
  if (a == nullptr) return;
  const uint32_t J = options_.header.num_experts;
  if (layer != a->layers_gated || layer >= options_.header.num_layers || probs.size() != J) {
    a->ok = false;
    return;
  }
  for (uint32_t j = 0; j < J; ++j) {
    a->it.map_experts.push_back(static_cast<uint16_t>(j));
    // A mean of probabilities may round a hair above 1; NaN stays NaN and fails validation.
    a->it.map_probs.push_back(probs[j] > 1.0f ? 1.0f : probs[j]);
  }
  a->it.map_offsets.push_back(static_cast<uint32_t>(a->it.map_experts.size()));
  ++a->layers_gated;
}

void TraceRecorder::OnLayerRouting(uint64_t request_id, uint32_t iteration, uint32_t layer,
                                   std::span<const uint32_t> experts,
                                   std::span<const uint32_t> tokens) {
  if (!active()) return;
  Assembling* a = Find(request_id, iteration);
  if (a == nullptr) return;
  if (layer != a->layers_routed || layer >= options_.header.num_layers ||
      experts.size() != tokens.size()) {
    a->ok = false;
    return;
  }
  for (size_t i = 0; i < experts.size(); ++i) {
    if (experts[i] >= options_.header.num_experts) {
      a->ok = false;
      return;
    }
    a->it.used_experts.push_back(static_cast<uint16_t>(experts[i]));
    a->it.used_tokens.push_back(tokens[i]);
  }
  a->it.used_offsets.push_back(static_cast<uint32_t>(a->it.used_experts.size()));
  ++a->layers_routed;
}

void TraceRecorder::OnSpeculation(uint64_t request_id, uint32_t iteration, uint32_t layer,
                                  uint32_t target, std::span<const float> fractions) {
  if (!active()) return;
  Assembling* a = Find(request_id, iteration);
  if (a == nullptr) return;
  const uint32_t L = options_.header.num_layers, J = options_.header.num_experts;
  if (layer >= target || target >= L || fractions.size() != J) {
    a->ok = false;
    return;
  }
  if (target > layer + options_.speculation_distance) return;  // Not asked for.
  TraceSpeculation sp;
  sp.layer = static_cast<uint16_t>(layer);
  sp.target = static_cast<uint16_t>(target);
  for (uint32_t j = 0; j < J; ++j) {
    if (!(fractions[j] > 0.0f)) continue;
    sp.experts.push_back(static_cast<uint16_t>(j));
    sp.fractions.push_back(std::min(fractions[j], 1.0f));  // Rounding must not break [0, 1].
  }
  a->it.speculation.push_back(std::move(sp));
}

void TraceRecorder::OnIterationEnd(uint64_t request_id, uint32_t iteration) {
  if (!active()) return;
  auto found = assembling_.find(request_id);
  if (found == assembling_.end() || found->second.it.iteration != iteration) return;
  Assembling a = std::move(found->second);
  assembling_.erase(found);

  Request& r = requests_[request_id];
  if (r.ended) {
    Drop(request_id, iteration, "an earlier iteration of the request was not recorded");
    return;
  }
  const uint32_t L = options_.header.num_layers;
  Status valid;
  if (!a.ok || !a.has_sem || a.layers_gated != L || a.layers_routed != L) {
    valid = InvalidArgument(
        "the forward pass did not report every field of every layer, or one that did not fit");
  } else if (iteration != r.next) {
    valid = InvalidArgument("expected iteration " + std::to_string(r.next));
  } else {
    valid = ValidateTraceIteration(options_.header, a.it);
  }
  if (!valid.ok()) {
    // The request's trace ends with the iteration before: the file stays contiguous.
    Drop(request_id, iteration, valid.message());
    r.ended = true;
    if (r.held) {
      r.held->last = true;
      Write(*r.held);
      r.held.reset();
    }
    return;
  }
  if (r.held) Write(*r.held);
  r.held = std::move(a.it);
  r.next = iteration + 1;
}

void TraceRecorder::OnRequestEnd(uint64_t request_id) {
  if (!active()) return;
  if (auto a = assembling_.find(request_id); a != assembling_.end()) {
    Drop(request_id, a->second.it.iteration, "its iteration did not complete");
    assembling_.erase(a);
  }
  auto found = requests_.find(request_id);
  if (found == requests_.end()) return;
  if (found->second.held) {
    found->second.held->last = true;
    Write(*found->second.held);
  }
  requests_.erase(found);
}

Status TraceRecorder::Close() {
  if (closed_) return error_;
  if (error_.ok()) {
    for (const auto& [id, a] : assembling_) {
      Drop(id, a.it.iteration, "the worker stopped during its iteration");
    }
    // Requests still running when the worker stopped: their last recorded iteration is marked
    // last, in request order so the file does not depend on hashing.
    std::vector<uint64_t> ids;
    for (const auto& [id, r] : requests_) {
      if (r.held) ids.push_back(id);
    }
    std::sort(ids.begin(), ids.end());
    for (uint64_t id : ids) {
      if (!error_.ok()) break;
      TraceIteration& held = *requests_[id].held;
      held.last = true;
      Write(held);
    }
  }
  assembling_.clear();
  requests_.clear();
  closed_ = true;
  Status s = writer_.Close();
  if (error_.ok() && !s.ok()) error_ = s;
  return error_;
}

}  // namespace fmoe
