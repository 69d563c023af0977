// fmoe-train: trains the tiny default model (deploy/models/tiny-moe) and prints greedy
// continuations of a saved model. Flags map onto TrainOptions here and nowhere else.
//   fmoe-train train --data /tmp/corpus --out /tmp/tiny-moe --steps 1500
//   fmoe-train generate --model deploy/models/tiny-moe --prompt "In the beginning"
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include "common/log.h"
#include "tools/trainer/trainer.h"

namespace {

// The command as typed, with the OpenMP wait policy when it was set (it changes throughput on
// a shared machine, never results).
std::string CommandLine(int argc, char** argv) {
  std::string out;
  if (const char* policy = std::getenv("OMP_WAIT_POLICY"); policy != nullptr) {
    out = std::string("OMP_WAIT_POLICY=") + policy + " ";
  }
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (i == 0) arg = "build-train/bin/fmoe-train";  // as the card's build line makes it
    const bool quote = arg.find_first_of(" \t\"'$\\") != std::string::npos || arg.empty();
    if (quote) {
      std::string q = "'";
      for (char c : arg) q += (c == '\'') ? std::string("'\\''") : std::string(1, c);
      arg = q + "'";
    }
    out += (i ? " " : "") + arg;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  using fmoe::trainer::TrainOptions;
  CLI::App app{"fmoe-train: trains fmoe's tiny Mixtral-format MoE on CPU"};
  app.require_subcommand(1);
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "trace | debug | info | warn | error");

  TrainOptions o;
  o.sample_prompts = {"In the beginning God created", "The history of the city",
                      "The word \"light\" means"};
  auto* train = app.add_subcommand("train", "train a model and write its directory");
  train->add_option("--data", o.data_dir, "directory with train.txt and val.txt")->required();
  train->add_option("--out", o.out_dir, "model directory to write")->required();
  train->add_option("--work-dir", o.work_dir, "checkpoints and caches (default: OUT.work)");
  train->add_option("--steps", o.steps, "optimizer steps")->capture_default_str();
  train->add_option("--batch", o.batch, "sequences per step")->capture_default_str();
  train->add_option("--seq-len", o.seq_len, "tokens per sequence")->capture_default_str();
  train->add_option("--lr", o.lr, "peak learning rate")->capture_default_str();
  train->add_option("--min-lr-ratio", o.min_lr_ratio, "cosine floor / lr")->capture_default_str();
  train->add_option("--warmup", o.warmup_steps, "warmup steps")->capture_default_str();
  train->add_option("--seed", o.seed)->capture_default_str();
  train->add_option("--threads", o.threads, "LibTorch threads")->capture_default_str();
  train->add_option("--log-every", o.log_every)->capture_default_str();
  train->add_option("--eval-every", o.eval_every, "0: never")->capture_default_str();
  train->add_option("--eval-windows", o.eval_windows)->capture_default_str();
  train->add_option("--checkpoint-every", o.checkpoint_every)->capture_default_str();
  train->add_flag("--resume", o.resume, "continue from the work directory's checkpoint");
  train->add_option("--bpe-max-bytes", o.bpe_max_bytes, "0: all")->capture_default_str();
  train->add_option("--final-train-windows", o.final_train_windows)->capture_default_str();
  train->add_option("--sample-prompt", o.sample_prompts, "prompts continued for the card");
  train->add_option("--sample-tokens", o.sample_tokens)->capture_default_str();
  train->add_option("--prepare-command", o.prepare_command, "recorded in the model card");
  auto& s = o.shape;
  train->add_option("--vocab", s.vocab_size)->capture_default_str();
  train->add_option("--hidden", s.hidden_size)->capture_default_str();
  train->add_option("--intermediate", s.intermediate_size)->capture_default_str();
  train->add_option("--layers", s.num_layers)->capture_default_str();
  train->add_option("--heads", s.num_heads)->capture_default_str();
  train->add_option("--kv-heads", s.num_kv_heads)->capture_default_str();
  train->add_option("--experts", s.num_experts)->capture_default_str();
  train->add_option("--top-k", s.top_k)->capture_default_str();
  train->add_option("--max-positions", s.max_position_embeddings)->capture_default_str();
  train->add_option("--rope-theta", s.rope_theta)->capture_default_str();
  train->add_option("--tie-embeddings", s.tie_word_embeddings)->capture_default_str();
  train->add_option("--aux-loss-coef", o.optim.aux_loss_coef)->capture_default_str();
  train->add_option("--z-loss-coef", o.optim.z_loss_coef)->capture_default_str();
  train->add_option("--weight-decay", o.optim.weight_decay)->capture_default_str();
  train->add_option("--grad-clip", o.optim.grad_clip)->capture_default_str();

  std::string model_dir, prompt;
  uint32_t max_new = 40, threads = 2;
  auto* gen = app.add_subcommand("generate", "greedy continuation from a saved model");
  gen->add_option("--model", model_dir, "model directory")->required();
  gen->add_option("--prompt", prompt, "text to continue")->required();
  gen->add_option("--max-tokens", max_new, "new tokens at most")->capture_default_str();
  gen->add_option("--threads", threads)->capture_default_str();

  CLI11_PARSE(app, argc, argv);
  if (auto st = fmoe::InitLogging("fmoe-train", log_level); !st.ok()) {
    std::fprintf(stderr, "fmoe-train: %s\n", st.ToString().c_str());
    return 2;
  }
  if (train->parsed()) {
    o.command_line = CommandLine(argc, argv);
    auto report = fmoe::trainer::RunTraining(o);
    if (!report.ok()) {
      spdlog::error("{}", report.status().ToString());
      return 1;
    }
    return 0;
  }
  fmoe::trainer::MoeModel::SetThreads(threads);
  std::vector<int32_t> ids;
  auto text = fmoe::trainer::GenerateGreedy(model_dir, prompt, max_new, &ids);
  if (!text.ok()) {
    spdlog::error("{}", text.status().ToString());
    return 1;
  }
  std::string id_list;
  for (int32_t id : ids) id_list += (id_list.empty() ? "" : " ") + std::to_string(id);
  std::printf("%s%s\n", prompt.c_str(), text->c_str());
  std::fprintf(stderr, "ids: %s\n", id_list.c_str());
  return 0;
}
