#include "tools/trainer/trainer.h"

#include <chrono>
#include <cmath>
#include <deque>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>

#include <spdlog/spdlog.h>

#include "common/json.h"
#include "common/text/tokenizer.h"
#include "tools/trainer/bpe_trainer.h"
#include "tools/trainer/corpus.h"
#include "tools/trainer/model_export.h"

namespace fmoe::trainer {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// Warmup then cosine from lr to lr * min_ratio over the run.
double LearningRate(const TrainOptions& o, uint32_t step) {
  if (step < o.warmup_steps) return o.lr * double(step + 1) / double(o.warmup_steps);
  const double span = std::max<double>(1.0, double(o.steps) - o.warmup_steps);
  const double progress = std::min(1.0, double(step - o.warmup_steps) / span);
  const double floor = o.lr * o.min_lr_ratio;
  return floor + 0.5 * (o.lr - floor) * (1.0 + std::cos(M_PI * progress));
}

Status Validate(const TrainOptions& o) {
  if (o.data_dir.empty() || o.out_dir.empty()) {
    return InvalidArgument("trainer: --data and --out are required");
  }
  if (o.steps == 0 || o.batch == 0 || o.seq_len < 2) {
    return InvalidArgument("trainer: steps, batch > 0 and seq_len >= 2 required");
  }
  if (o.seq_len > o.shape.max_position_embeddings) {
    return InvalidArgument("trainer: seq_len " + std::to_string(o.seq_len) +
                           " > max_position_embeddings " +
                           std::to_string(o.shape.max_position_embeddings));
  }
  if (o.lr <= 0 || o.min_lr_ratio < 0 || o.min_lr_ratio > 1) {
    return InvalidArgument("trainer: lr > 0 and 0 <= min_lr_ratio <= 1 required");
  }
  return o.shape.Validate();
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Trains the BPE on the training documents (evenly spread ones up to max_bytes when set) and
// writes tokenizer.json and tokenizer_config.json into `dir`.
Status TrainTokenizer(const std::vector<std::string>& docs, const TrainOptions& o,
                      const std::string& dir) {
  BpeTrainerOptions bpe;
  bpe.vocab_size = o.shape.vocab_size;
  BpeTrainer trainer(bpe);
  uint64_t total = 0;
  for (const auto& d : docs) total += d.size();
  const double keep = (o.bpe_max_bytes == 0 || total <= o.bpe_max_bytes)
                          ? 1.0
                          : double(o.bpe_max_bytes) / double(total);
  double acc = 0;
  uint64_t used = 0;
  for (const auto& d : docs) {
    acc += keep;
    if (acc < 1.0) continue;
    acc -= 1.0;
    FMOE_RETURN_IF_ERROR(trainer.Add(d));
    used += d.size();
  }
  spdlog::info("trainer: BPE on {} of {} bytes, vocab {}", used, total, bpe.vocab_size);
  const auto start = Clock::now();
  FMOE_RETURN_IF_ERROR(trainer.Train([&](size_t done, size_t wanted) {
    if (done % 512 == 0) spdlog::info("trainer: BPE merges {}/{}", done, wanted);
  }));
  spdlog::info("trainer: BPE trained in {:.1f} s", Seconds(start));
  FMOE_RETURN_IF_ERROR(trainer.Save(dir + "/tokenizer.json"));
  return WriteTokenizerConfig(dir + "/tokenizer_config.json", o.shape.max_position_embeddings);
}

Result<std::vector<int32_t>> LoadOrTokenize(const Tokenizer& tok, const std::string& text_path,
                                            const std::string& cache, bool reuse) {
  if (reuse && fs::exists(cache)) {
    auto cached = ReadTokens(cache);
    if (cached.ok()) return cached;
    spdlog::warn("trainer: {}; tokenizing again", cached.status().ToString());
  }
  FMOE_ASSIGN_OR_RETURN(auto docs, ReadDocuments(text_path));
  const auto start = Clock::now();
  FMOE_ASSIGN_OR_RETURN(auto ids, TokenizeDocuments(tok, docs));
  spdlog::info("trainer: {}: {} documents -> {} tokens in {:.1f} s", text_path, docs.size(),
               ids.size(), Seconds(start));
  FMOE_RETURN_IF_ERROR(WriteTokens(cache, ids));
  return ids;
}

struct RunState {
  uint32_t step = 0;
  uint64_t tokens_seen = 0;
  double wall_seconds = 0;
  std::string command;             // The command that started the run (for the card).
  std::deque<double> recent_loss;  // The last 50 steps' losses, kept so that a resumed run (or
  std::deque<double> recent_aux;   // a re-export after the last step) still reports them.
};

Status SaveRunState(const std::string& path, const RunState& s) {
  nlohmann::json j = {
      {"step", s.step},
      {"tokens_seen", s.tokens_seen},
      {"wall_seconds", s.wall_seconds},
      {"command", s.command},
      {"recent_loss", std::vector<double>(s.recent_loss.begin(), s.recent_loss.end())},
      {"recent_aux", std::vector<double>(s.recent_aux.begin(), s.recent_aux.end())}};
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << j.dump(2) << "\n";
    if (!out.flush()) return IoError("trainer: writing " + tmp + " failed");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return IoError("trainer: renaming " + tmp + ": " + ec.message());
  return Status::Ok();
}

Result<RunState> LoadRunState(const std::string& path) {
  try {
    auto j = nlohmann::json::parse(ReadAll(path));
    RunState s;
    s.step = j.at("step").get<uint32_t>();
    s.tokens_seen = j.at("tokens_seen").get<uint64_t>();
    s.wall_seconds = j.at("wall_seconds").get<double>();
    s.command = j.value("command", std::string());
    for (double v : j.value("recent_loss", std::vector<double>())) s.recent_loss.push_back(v);
    for (double v : j.value("recent_aux", std::vector<double>())) s.recent_aux.push_back(v);
    return s;
  } catch (const nlohmann::json::exception& e) {
    return DataLoss("trainer: " + path + ": " + e.what());
  }
}

std::string Join(const std::vector<double>& v, int digits) {
  std::string out;
  char buf[32];
  for (double x : v) {
    std::snprintf(buf, sizeof(buf), "%s%.*f", out.empty() ? "" : " ", digits, x);
    out += buf;
  }
  return out;
}

}  // namespace

Result<TrainReport> RunTraining(const TrainOptions& options) {
  TrainOptions o = options;
  FMOE_RETURN_IF_ERROR(Validate(o));
  if (o.work_dir.empty()) o.work_dir = fs::path(o.out_dir).lexically_normal().string() + ".work";
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (!ec) fs::create_directories(o.work_dir, ec);
  if (ec)
    return IoError("trainer: creating " + o.out_dir + " / " + o.work_dir + ": " + ec.message());
  MoeModel::SetThreads(o.threads);
  spdlog::info(
      "trainer: data={} out={} work={} steps={} batch={} seq_len={} lr={} seed={} "
      "threads={} params={}",
      o.data_dir, o.out_dir, o.work_dir, o.steps, o.batch, o.seq_len, o.lr, o.seed, o.threads,
      o.shape.ParameterCount());

  // (a) vocabulary, (b) tokens.
  const std::string train_txt = o.data_dir + "/train.txt", val_txt = o.data_dir + "/val.txt";
  const bool reuse = o.resume && fs::exists(o.out_dir + "/tokenizer.json");
  if (!reuse) {
    FMOE_ASSIGN_OR_RETURN(auto docs, ReadDocuments(train_txt));
    FMOE_RETURN_IF_ERROR(TrainTokenizer(docs, o, o.out_dir));
  }
  FMOE_ASSIGN_OR_RETURN(auto tokenizer, Tokenizer::Load(o.out_dir));
  if (tokenizer->vocab_size() > o.shape.vocab_size) {
    return FailedPrecondition("trainer: tokenizer has " + std::to_string(tokenizer->vocab_size()) +
                              " tokens, more than the model's vocab " +
                              std::to_string(o.shape.vocab_size));
  }
  FMOE_ASSIGN_OR_RETURN(auto train,
                        LoadOrTokenize(*tokenizer, train_txt, o.work_dir + "/train.tokens", reuse));
  FMOE_ASSIGN_OR_RETURN(auto val,
                        LoadOrTokenize(*tokenizer, val_txt, o.work_dir + "/val.tokens", reuse));
  if (train.size() < size_t(o.seq_len) + 1 || val.size() < size_t(o.seq_len) + 1) {
    return InvalidArgument("trainer: train and val need at least seq_len + 1 tokens each");
  }
  const std::vector<int32_t> val_probe = SpreadWindows(val, o.seq_len, o.eval_windows);

  // (c) model and optimizer; resume when asked and a checkpoint exists.
  FMOE_ASSIGN_OR_RETURN(auto model, MoeModel::Create(o.shape, o.optim, o.seed));
  const std::string ckpt = o.work_dir + "/ckpt", state_path = o.work_dir + "/state.json";
  RunState state;
  if (o.resume && fs::exists(state_path)) {
    FMOE_ASSIGN_OR_RETURN(state, LoadRunState(state_path));
    FMOE_RETURN_IF_ERROR(model->LoadState(ckpt));
    spdlog::info("trainer: resumed at step {} ({} tokens, {:.0f} s)", state.step, state.tokens_seen,
                 state.wall_seconds);
  }
  if (state.command.empty()) state.command = o.command_line;
  o.command_line = state.command;
  TrainReport report;
  report.train_tokens = train.size();
  report.val_tokens = val.size();
  WindowOrder order(train.size(), o.seq_len, o.seed);
  const size_t row = size_t(o.seq_len) + 1;
  std::vector<int32_t> batch(size_t(o.batch) * row);
  std::deque<double>& recent_loss = state.recent_loss;
  std::deque<double>& recent_aux = state.recent_aux;
  double interval_loss = 0, interval_aux = 0;
  uint32_t interval_steps = 0;
  auto interval_start = Clock::now();
  const auto run_start = Clock::now();
  const double wall_before = state.wall_seconds;
  for (uint32_t step = state.step; step < o.steps; ++step) {
    for (uint32_t b = 0; b < o.batch; ++b) {
      const size_t start = order.Start(uint64_t(step) * o.batch + b);
      std::copy_n(train.begin() + long(start), row, batch.begin() + long(b * row));
    }
    const double lr = LearningRate(o, step);
    FMOE_ASSIGN_OR_RETURN(StepResult r, model->TrainStep(batch, o.batch, o.seq_len, lr));
    if (!std::isfinite(r.loss) || !std::isfinite(r.aux_loss)) {
      return Internal("trainer: step " + std::to_string(step) + ": loss is not finite");
    }
    state.step = step + 1;
    state.tokens_seen += uint64_t(o.batch) * o.seq_len;
    state.wall_seconds = wall_before + Seconds(run_start);
    recent_loss.push_back(r.loss);
    recent_aux.push_back(r.aux_loss);
    if (recent_loss.size() > 50) {
      recent_loss.pop_front();
      recent_aux.pop_front();
    }
    interval_loss += r.loss;
    interval_aux += r.aux_loss;
    ++interval_steps;
    const bool last = state.step == o.steps;
    if (state.step % o.log_every == 0 || last) {
      const double secs = Seconds(interval_start);
      const double mean = interval_loss / interval_steps;
      if (report.logged_loss.empty()) report.first_loss = mean;
      report.logged_loss.push_back(mean);
      spdlog::info(
          "step={} loss={:.4f} aux={:.4f} z={:.3f} gnorm={:.3f} lr={:.2e} tok/s={:.0f} "
          "tokens={} elapsed={:.0f}s",
          state.step, mean, interval_aux / interval_steps, r.z_loss, r.grad_norm, lr,
          double(interval_steps) * o.batch * o.seq_len / std::max(secs, 1e-9), state.tokens_seen,
          state.wall_seconds);
      interval_loss = interval_aux = 0;
      interval_steps = 0;
      interval_start = Clock::now();
    }
    if (o.eval_every > 0 && (state.step % o.eval_every == 0) && !last) {
      FMOE_ASSIGN_OR_RETURN(EvalResult ev, model->Evaluate(val_probe, o.seq_len, o.batch));
      spdlog::info("step={} val_loss={:.4f} val_ppl={:.1f} usage_entropy=[{}]", state.step, ev.loss,
                   std::exp(ev.loss), Join(ev.usage_entropy, 2));
    }
    if ((o.checkpoint_every > 0 && state.step % o.checkpoint_every == 0) || last) {
      FMOE_RETURN_IF_ERROR(model->SaveState(ckpt));
      FMOE_RETURN_IF_ERROR(SaveRunState(state_path, state));
    }
  }
  report.steps = state.step;
  report.tokens_seen = state.tokens_seen;
  report.wall_seconds = state.wall_seconds;
  if (!recent_loss.empty()) {
    report.last_train_loss =
        std::accumulate(recent_loss.begin(), recent_loss.end(), 0.0) / recent_loss.size();
    report.last_aux_loss =
        std::accumulate(recent_aux.begin(), recent_aux.end(), 0.0) / recent_aux.size();
  }

  // (d) evaluate what ships: BF16-rounded weights.
  model->RoundToBF16();
  const auto eval_start = Clock::now();
  const auto val_all = SpreadWindows(val, o.seq_len, 0);
  FMOE_ASSIGN_OR_RETURN(report.val_bf16, model->Evaluate(val_all, o.seq_len, o.batch));
  const auto train_probe = SpreadWindows(train, o.seq_len, o.final_train_windows);
  FMOE_ASSIGN_OR_RETURN(EvalResult tr, model->Evaluate(train_probe, o.seq_len, o.batch));
  report.train_loss_bf16 = tr.loss;
  spdlog::info(
      "trainer: BF16 weights: val_loss={:.4f} val_ppl={:.1f} train_loss={:.4f} "
      "usage_entropy=[{}] router_entropy=[{}] ({:.0f} s)",
      report.val_bf16.loss, std::exp(report.val_bf16.loss), tr.loss,
      Join(report.val_bf16.usage_entropy, 3), Join(report.val_bf16.router_entropy, 3),
      Seconds(eval_start));
  const int32_t eos = tokenizer->eos_id().value_or(-1);
  for (const auto& prompt : o.sample_prompts) {
    FMOE_ASSIGN_OR_RETURN(auto ids, tokenizer->Encode(prompt, /*add_special_tokens=*/true));
    const auto out = model->Greedy(ids, o.sample_tokens, eos);
    std::string text = tokenizer->Decode(out, /*skip_special_tokens=*/true);
    spdlog::info("trainer: sample: {:?} -> {:?}", prompt, text);
    report.samples.emplace_back(prompt, std::move(text));
  }

  SpecialIds special;
  special.bos = tokenizer->bos_id().value_or(1);
  special.eos = eos;
  special.pad = tokenizer->TokenToId("<pad>").value_or(special.eos);
  const std::string weights = o.out_dir + "/model.safetensors";
  FMOE_RETURN_IF_ERROR(model->SaveSafetensors(weights, /*bf16=*/true));
  FMOE_RETURN_IF_ERROR(
      WriteHfConfig(o.out_dir + "/config.json", o.shape, special, o.optim.aux_loss_coef));
  const uint64_t model_bytes = fs::file_size(weights, ec);
  std::string stats;
  if (fs::exists(o.data_dir + "/corpus_stats.tsv"))
    stats = ReadAll(o.data_dir + "/corpus_stats.tsv");
  FMOE_RETURN_IF_ERROR(WriteModelCard(o.out_dir + "/MODEL_CARD.md", o, report, stats, model_bytes));
  spdlog::info("trainer: wrote {} (model.safetensors {} bytes)", o.out_dir, model_bytes);
  return report;
}

Result<std::string> GenerateGreedy(const std::string& model_dir, const std::string& prompt,
                                   uint32_t max_new_tokens, std::vector<int32_t>* ids) {
  FMOE_ASSIGN_OR_RETURN(auto tokenizer, Tokenizer::Load(model_dir));
  FMOE_ASSIGN_OR_RETURN(auto model, MoeModel::LoadHf(model_dir));
  FMOE_ASSIGN_OR_RETURN(auto input, tokenizer->Encode(prompt, /*add_special_tokens=*/true));
  const auto out = model->Greedy(input, max_new_tokens, tokenizer->eos_id().value_or(-1));
  if (ids != nullptr) *ids = out;
  return tokenizer->Decode(out, /*skip_special_tokens=*/true);
}

}  // namespace fmoe::trainer
