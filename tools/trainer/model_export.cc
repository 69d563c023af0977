#include "tools/trainer/model_export.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/json.h"

namespace fmoe::trainer {
namespace {

Status WriteText(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return IoError("trainer: cannot write " + tmp);
    out << text;
    if (!out.flush()) return IoError("trainer: writing " + tmp + " failed");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return IoError("trainer: renaming " + tmp + " to " + path + " failed");
  }
  return Status::Ok();
}

std::string Fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

// "Intel(R) Xeon(R) ... (2 cores)" from /proc/cpuinfo.
std::string MachineDescription() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) model = line.substr(colon + 2);
      break;
    }
  }
  return model + ", " + std::to_string(std::thread::hardware_concurrency()) +
         " hardware threads visible";
}

// corpus_stats.tsv as a Markdown table.
std::string StatsTable(const std::string& tsv) {
  std::istringstream in(tsv);
  std::string line, out;
  bool first = true;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::string row = "|";
    size_t cols = 0;
    std::istringstream cells(line);
    std::string cell;
    while (std::getline(cells, cell, '\t')) {
      row += " " + cell + " |";
      ++cols;
    }
    out += row + "\n";
    if (first) {
      out += "|";
      for (size_t i = 0; i < cols; ++i) out += "---|";
      out += "\n";
      first = false;
    }
  }
  return out;
}

}  // namespace

const char* ChatTemplate() {
  return "{{ bos_token }}{% for message in messages %}"
         "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
         "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n' }}"
         "{% elif message['role'] == 'assistant' %}"
         "{{ 'Assistant: ' + message['content'] + eos_token + '\\n' }}"
         "{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}";
}

Status WriteHfConfig(const std::string& path, const MoeShape& shape, const SpecialIds& ids,
                     double aux_loss_coef) {
  nlohmann::ordered_json c;
  c["architectures"] = {"MixtralForCausalLM"};
  c["model_type"] = "mixtral";
  c["vocab_size"] = shape.vocab_size;
  c["hidden_size"] = shape.hidden_size;
  c["intermediate_size"] = shape.intermediate_size;
  c["num_hidden_layers"] = shape.num_layers;
  c["num_attention_heads"] = shape.num_heads;
  c["num_key_value_heads"] = shape.num_kv_heads;
  c["head_dim"] = shape.head_dim();
  c["num_local_experts"] = shape.num_experts;
  c["num_experts_per_tok"] = shape.top_k;
  c["max_position_embeddings"] = shape.max_position_embeddings;
  c["rms_norm_eps"] = shape.rms_norm_eps;
  c["rope_theta"] = shape.rope_theta;
  c["hidden_act"] = "silu";
  c["tie_word_embeddings"] = shape.tie_word_embeddings;
  c["router_aux_loss_coef"] = aux_loss_coef;
  c["router_jitter_noise"] = 0.0;
  c["output_router_logits"] = false;
  c["sliding_window"] = nullptr;
  c["attention_dropout"] = 0.0;
  c["initializer_range"] = 0.02;
  c["use_cache"] = true;
  c["bos_token_id"] = ids.bos;
  c["eos_token_id"] = ids.eos;
  c["pad_token_id"] = ids.pad;
  c["torch_dtype"] = "bfloat16";
  return WriteText(path, c.dump(2) + "\n");
}

Status WriteTokenizerConfig(const std::string& path, uint32_t model_max_length) {
  nlohmann::ordered_json c;
  c["tokenizer_class"] = "PreTrainedTokenizerFast";
  c["bos_token"] = "<s>";
  c["eos_token"] = "</s>";
  c["unk_token"] = "<unk>";
  c["pad_token"] = "<pad>";
  c["add_bos_token"] = true;
  c["add_eos_token"] = false;
  c["clean_up_tokenization_spaces"] = false;
  c["model_max_length"] = model_max_length;
  c["chat_template"] = ChatTemplate();
  return WriteText(path, c.dump(2) + "\n");
}

Status WriteModelCard(const std::string& path, const TrainOptions& o, const TrainReport& r,
                      const std::string& corpus_stats, uint64_t model_bytes) {
  const MoeShape& s = o.shape;
  std::ostringstream md;
  md << "# tiny-moe\n\n"
     << "A small Mixtral-format mixture-of-experts language model (`MixtralForCausalLM`), trained "
        "from scratch on CPU by fmoe's own C++ trainer (`tools/trainer`, LibTorch autograd) with "
        "a load-balancing loss, so its routing is learned. It is fmoe's default model: small "
        "enough to ship in the repository, real enough to exercise the expert cache. It is a "
        "toy: it continues English text with recognisable words and phrases, not with facts.\n\n";
  md << "## Shape\n\n"
     << "| field | value |\n|---|---|\n"
     << "| layers | " << s.num_layers << " (every layer MoE) |\n"
     << "| experts / top-k | " << s.num_experts << " / " << s.top_k
     << " (softmax over all experts, top-k weights renormalised) |\n"
     << "| hidden / expert intermediate | " << s.hidden_size << " / " << s.intermediate_size
     << " |\n"
     << "| attention heads / KV heads / head_dim | " << s.num_heads << " / " << s.num_kv_heads
     << " / " << s.head_dim() << " |\n"
     << "| vocabulary | " << s.vocab_size
     << " (byte-level BPE trained on the training split; specials `<unk>` `<s>` `</s>` `<pad>`) |\n"
     << "| positions / rope_theta | " << s.max_position_embeddings << " / " << s.rope_theta
     << " |\n"
     << "| tied embeddings | " << (s.tie_word_embeddings ? "yes" : "no") << " |\n"
     << "| parameters | " << s.ParameterCount() << " |\n"
     << "| model.safetensors | " << model_bytes << " bytes, BF16 |\n\n";
  md << "## Data\n\n"
     << "Built by `tools/trainer/prepare_corpus.sh` (deterministic); about 1.6% of each domain's "
        "documents (every 64th) are held out for validation. Long documents are cut into ~8 KB "
        "pieces at paragraph ends first, so the hold-out covers every domain.\n\n"
     << "| source | licence |\n|---|---|\n"
     << "| OLMoE domain samples: arXiv, C4, GitHub (the Stack), Wikipedia (partly non-English) "
        "(allenai/OLMoE) | Apache-2.0 |\n"
     << "| King James Bible (Debian `bible-kjv`, `bible-kjv-text`), verse numbers stripped, one "
        "document per chapter, capped by evenly spaced chapters | public domain |\n"
     << "| GNU Collaborative International Dictionary of English (Debian `dict-gcide`), "
        "entries as plain text, header entries dropped, capped by evenly spaced entries | "
        "GPL-2+ |\n"
     << "| Puffin user prompts with id > 2000 as `User: ...` (ids 1-2000 are fmoe's evaluation "
        "prompts and are not trained on) | Apache-2.0 |\n\n";
  if (!corpus_stats.empty()) md << "Bytes per domain:\n\n" << StatsTable(corpus_stats) << "\n";
  md << "Tokens: " << r.train_tokens << " training, " << r.val_tokens
     << " validation (each document is `<s> text </s>`).\n\n";
  md << "## Training\n\n"
     << "- Loss: cross-entropy + " << o.optim.aux_loss_coef << " x load-balancing loss + "
     << o.optim.z_loss_coef
     << " x router z-loss. The load-balancing loss is, per layer, J * sum_j f_j * P_j (f_j the "
        "fraction of the top-k assignments that went to expert j, P_j the mean router "
        "probability of expert j), averaged over layers: 1.0 when perfectly balanced. "
        "(Hugging Face's `load_balancing_loss_func` counts f_j per top-k slot, so its value is "
        "top_k times ours.)\n"
     << "- AdamW (betas " << o.optim.beta1 << ", " << o.optim.beta2 << ", weight decay "
     << o.optim.weight_decay << " on matrices), peak learning rate " << o.lr << ", "
     << o.warmup_steps << " warmup steps, cosine decay to " << o.min_lr_ratio * o.lr
     << ", gradient clipping at " << o.optim.grad_clip << ", seed " << o.seed
     << ", deterministic data order (seeded permutation of " << o.seq_len
     << "-token windows per epoch).\n"
     << "- Steps: " << r.steps << " x " << o.batch << " sequences x " << o.seq_len
     << " tokens = " << r.tokens_seen << " tokens seen ("
     << Fixed(double(r.tokens_seen) / double(std::max<uint64_t>(r.train_tokens, 1)), 2)
     << " epochs).\n"
     << "- Wall time: " << Fixed(r.wall_seconds / 60.0, 1) << " min ("
     << Fixed(double(r.tokens_seen) / std::max(r.wall_seconds, 1e-9), 0) << " tokens/s) on "
     << MachineDescription() << ", LibTorch CPU, " << o.threads
     << " intra-op threads, the cores shared with other builds.\n\n";
  md << "| | loss (nats/token) | perplexity |\n|---|---|---|\n"
     << "| train, mean of the last 50 steps (fp32 weights) | " << Fixed(r.last_train_loss, 3)
     << " | " << Fixed(std::exp(r.last_train_loss), 1) << " |\n"
     << "| train, " << o.final_train_windows << " windows, shipped BF16 weights | "
     << Fixed(r.train_loss_bf16, 3) << " | " << Fixed(std::exp(r.train_loss_bf16), 1) << " |\n"
     << "| validation, all " << r.val_bf16.tokens << " tokens, shipped BF16 weights | "
     << Fixed(r.val_bf16.loss, 3) << " | " << Fixed(std::exp(r.val_bf16.loss), 1) << " |\n\n"
     << "Load-balancing loss over the last 50 steps: " << Fixed(r.last_aux_loss, 4) << ".\n\n";
  md << "## Routing on the validation set (BF16 weights)\n\n"
     << "Expert-usage entropy: the entropy of how often each expert is among a token's top-"
     << s.top_k << ", divided by log(" << s.num_experts
     << ") (1 = all experts used equally). Router entropy: the mean over tokens of the entropy "
        "of the router's softmax, divided by log("
     << s.num_experts << ") (low = confident routing).\n\n"
     << "| layer | usage entropy | router entropy | usage per expert (%) |\n|---|---|---|---|\n";
  double mean_usage = 0, mean_router = 0;
  for (size_t l = 0; l < r.val_bf16.usage_entropy.size(); ++l) {
    md << "| " << l << " | " << Fixed(r.val_bf16.usage_entropy[l], 3) << " | "
       << Fixed(r.val_bf16.router_entropy[l], 3) << " |";
    for (double f : r.val_bf16.usage_fraction[l]) md << " " << Fixed(100.0 * f, 1);
    md << " |\n";
    mean_usage += r.val_bf16.usage_entropy[l];
    mean_router += r.val_bf16.router_entropy[l];
  }
  const double layers = std::max<size_t>(r.val_bf16.usage_entropy.size(), 1);
  md << "| mean | " << Fixed(mean_usage / layers, 3) << " | " << Fixed(mean_router / layers, 3)
     << " | |\n\n";
  if (!r.samples.empty()) {
    md << "## Greedy continuations\n\n"
       << "Shipped BF16 weights, the trainer's own forward pass, " << o.sample_tokens
       << " new tokens at most, prompt encoded with `<s>` first (`fmoe-train generate`):\n\n";
    for (const auto& [prompt, text] : r.samples) {
      md << "```text\n" << prompt << text << "\n```\n\n";
    }
  }
  md << "## Reproduce\n\n"
     << "```sh\n"
     << "source deploy/lib.sh && fmoe_build build-train -DFMOE_BUILD_BENCH=OFF -- fmoe-train\n"
     << "# the data lives beside the repository: FMOE_CORPUS_DIR / FMOE_PROMPTS_FILE override it\n"
     << (o.prepare_command.empty() ? "tools/trainer/prepare_corpus.sh /tmp/corpus"
                                   : o.prepare_command)
     << "\n"
     << o.command_line << "\n"
     << "```\n\n"
     << "The run is deterministic given the data, the seed and the thread count, up to "
        "floating-point differences between machines. `--resume` continues from the last "
        "checkpoint in the work directory. `fmoe-train generate --model DIR --prompt TEXT` "
        "prints a greedy continuation from the saved directory.\n";
  return WriteText(path, md.str());
}

}  // namespace fmoe::trainer
