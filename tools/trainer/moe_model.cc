#include "tools/trainer/moe_model.h"

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <utility>

#include "common/model/checkpoint.h"
#include "common/model/model_config.h"
#include "common/model/routing.h"
#include "common/model/safetensors.h"

namespace fmoe::trainer {
namespace {

// Mixtral's routing (softmax, top-k, renormalised) of each row of `logits` [N, J]: the chosen
// experts [N, K] as int64, by descending weight.
torch::Tensor ChooseExperts(const torch::Tensor& logits, int64_t experts, int64_t k) {
  const RoutingSpec spec{RouterScoring::kSoftmax, static_cast<uint32_t>(experts),
                         static_cast<uint32_t>(k), true};
  auto cpu = logits.detach().to(torch::kCPU, torch::kFloat).contiguous();
  const size_t n = static_cast<size_t>(cpu.size(0));
  std::vector<float> probs(n * experts), weights(n * k);
  std::vector<int32_t> chosen(n * k);
  Status s = RouteTokens(spec, n, {cpu.data_ptr<float>(), n * experts}, probs, chosen, weights);
  TORCH_CHECK(s.ok(), s.message());
  return torch::tensor(chosen, torch::kInt)
      .to(torch::kLong)
      .view({static_cast<int64_t>(n), k})
      .to(logits.device());
}

// One decoder layer. Experts are stacked along dim 0: w1/w3 [J, I, h], w2 [J, h, I].
struct Layer {
  torch::Tensor input_norm, wq, wk, wv, wo, post_norm, gate, w1, w2, w3;
};

// Routing statistics gathered by an evaluation pass, per layer.
struct RouteStats {
  std::vector<torch::Tensor> counts;  // [J] float64: top-k assignments per expert.
  std::vector<double> entropy_sum;    // Sum over tokens of the router softmax entropy.
  uint64_t tokens = 0;                // Tokens routed per layer.
};

// Router regularisers of one forward pass, summed over layers.
struct RouterLosses {
  torch::Tensor aux;  // Sum over layers of J * sum_j f_j P_j.
  torch::Tensor z;    // Sum over layers of mean(logsumexp(logits)^2).
};

Status TorchError(const std::string& what, const c10::Error& e) {
  return Internal(std::string("trainer: ") + what + ": " + e.what_without_backtrace());
}

torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * w;
}

torch::Tensor RotateHalf(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

torch::Tensor Param(torch::Tensor t) { return t.requires_grad_(true); }

}  // namespace

struct MoeModel::Impl {
  MoeShape shape;
  OptimizerOptions optim;
  torch::Tensor embed, final_norm, lm_head;  // lm_head undefined when tied.
  std::vector<Layer> layers;
  torch::Tensor cos, sin;  // [max_position_embeddings, head_dim]
  torch::Tensor causal;    // [max_pos, max_pos]: 0 on and below the diagonal, -inf above.
  std::unique_ptr<torch::optim::AdamW> optimizer;

  // Every parameter with a stable name (experts stacked), in a fixed order: the checkpoint and
  // the optimizer state rely on it.
  std::vector<std::pair<std::string, torch::Tensor*>> Named() {
    std::vector<std::pair<std::string, torch::Tensor*>> out;
    out.emplace_back("model.embed_tokens.weight", &embed);
    for (size_t i = 0; i < layers.size(); ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      Layer& l = layers[i];
      out.emplace_back(p + "input_layernorm.weight", &l.input_norm);
      out.emplace_back(p + "self_attn.q_proj.weight", &l.wq);
      out.emplace_back(p + "self_attn.k_proj.weight", &l.wk);
      out.emplace_back(p + "self_attn.v_proj.weight", &l.wv);
      out.emplace_back(p + "self_attn.o_proj.weight", &l.wo);
      out.emplace_back(p + "post_attention_layernorm.weight", &l.post_norm);
      out.emplace_back(p + "block_sparse_moe.gate.weight", &l.gate);
      out.emplace_back(p + "block_sparse_moe.experts.w1", &l.w1);
      out.emplace_back(p + "block_sparse_moe.experts.w2", &l.w2);
      out.emplace_back(p + "block_sparse_moe.experts.w3", &l.w3);
    }
    out.emplace_back("model.norm.weight", &final_norm);
    if (!shape.tie_word_embeddings) out.emplace_back("lm_head.weight", &lm_head);
    return out;
  }

  void BuildRope() {
    const int64_t hd = shape.head_dim();
    auto inv_freq =
        1.0 / torch::pow(shape.rope_theta, torch::arange(0, hd, 2, torch::kFloat64) / double(hd));
    auto pos = torch::arange(0, int64_t(shape.max_position_embeddings), torch::kFloat64);
    auto freqs = torch::outer(pos, inv_freq);
    auto emb = torch::cat({freqs, freqs}, -1);
    cos = emb.cos().to(torch::kFloat32);
    sin = emb.sin().to(torch::kFloat32);
    const int64_t p = shape.max_position_embeddings;
    causal = torch::full({p, p}, -std::numeric_limits<float>::infinity()).triu(1);
  }

  void BuildOptimizer() {
    std::vector<torch::Tensor> decay, no_decay;
    for (auto& [name, t] : Named()) (t->dim() >= 2 ? decay : no_decay).push_back(*t);
    auto opts = [&](double wd) {
      return std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1e-3)
                                                              .betas({optim.beta1, optim.beta2})
                                                              .eps(optim.eps)
                                                              .weight_decay(wd));
    };
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decay, opts(optim.weight_decay));
    groups.emplace_back(no_decay, opts(0.0));
    optimizer = std::make_unique<torch::optim::AdamW>(std::move(groups));
  }

  torch::Tensor Attention(const torch::Tensor& x, const Layer& l) const {
    const int64_t b = x.size(0), t = x.size(1);
    const int64_t heads = shape.num_heads, kv = shape.num_kv_heads, hd = shape.head_dim();
    auto q = torch::matmul(x, l.wq.t()).view({b, t, heads, hd}).transpose(1, 2);
    auto k = torch::matmul(x, l.wk.t()).view({b, t, kv, hd}).transpose(1, 2);
    auto v = torch::matmul(x, l.wv.t()).view({b, t, kv, hd}).transpose(1, 2);
    auto c = cos.narrow(0, 0, t), s = sin.narrow(0, 0, t);
    q = q * c + RotateHalf(q) * s;
    k = k * c + RotateHalf(k) * s;
    if (heads != kv) {  // HF repeat_kv: query head i reads KV head i / (heads / kv).
      k = k.repeat_interleave(heads / kv, 1);
      v = v.repeat_interleave(heads / kv, 1);
    }
    // Causal softmax(q k^T / sqrt(hd)) v; the scale is applied to q (fewer multiplies, same
    // result up to rounding) and the mask is an additive -inf upper triangle.
    auto scores = torch::matmul(q * (1.0 / std::sqrt(double(hd))), k.transpose(-2, -1));
    auto out =
        torch::matmul(torch::softmax(scores + causal.narrow(0, 0, t).narrow(1, 0, t), -1), v);
    return torch::matmul(out.transpose(1, 2).reshape({b, t, heads * hd}), l.wo.t());
  }

  torch::Tensor Moe(const torch::Tensor& x, const Layer& l, size_t layer, RouterLosses* losses,
                    RouteStats* stats) const {
    const int64_t h = x.size(-1), n = x.numel() / h;
    const int64_t experts = shape.num_experts, k = shape.top_k;
    auto xf = x.reshape({n, h});
    auto logits = torch::matmul(xf, l.gate.t());  // [N, J]
    auto probs = torch::softmax(logits, -1);      // over all experts
    // The experts each token uses, chosen as the model runtime chooses them
    // (common/model/routing.h); their weights stay in the graph so the router learns.
    auto top_i = ChooseExperts(logits, experts, k);
    auto top_w = probs.gather(-1, top_i);
    top_w = top_w / top_w.sum(-1, /*keepdim=*/true);
    auto out = torch::zeros_like(xf);
    for (int64_t j = 0; j < experts; ++j) {
      auto chosen = top_i.eq(j);  // [N, K]
      auto rows = chosen.any(-1).nonzero().squeeze(-1);
      if (rows.numel() == 0) continue;
      auto w = (top_w * chosen).sum(-1).index_select(0, rows).unsqueeze(-1);
      auto xe = xf.index_select(0, rows);
      auto mid = torch::silu(torch::matmul(xe, l.w1[j].t())) * torch::matmul(xe, l.w3[j].t());
      out = out.index_add(0, rows, torch::matmul(mid, l.w2[j].t()) * w);
    }
    if (losses != nullptr || stats != nullptr) {
      auto counts =  // [J]: top-k assignments per expert
          torch::one_hot(top_i, experts).reshape({-1, experts}).sum(0).to(torch::kFloat64);
      if (losses != nullptr) {
        auto f = (counts / double(n * k)).to(torch::kFloat32).detach();
        auto aux = double(experts) * (f * probs.mean(0)).sum();
        auto z = torch::logsumexp(logits, -1).pow(2).mean();
        losses->aux = losses->aux.defined() ? losses->aux + aux : aux;
        losses->z = losses->z.defined() ? losses->z + z : z;
      }
      if (stats != nullptr) {
        stats->counts[layer] = stats->counts[layer] + counts;
        stats->entropy_sum[layer] +=
            -(probs * torch::log(probs.clamp_min(1e-30))).sum().item<double>();
      }
    }
    return out.view(x.sizes());
  }

  // ids [B, T] int64 -> logits [B, T, V].
  torch::Tensor Forward(const torch::Tensor& ids, RouterLosses* losses, RouteStats* stats) const {
    auto x = torch::embedding(embed, ids);
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& l = layers[i];
      x = x + Attention(RmsNorm(x, l.input_norm, shape.rms_norm_eps), l);
      x = x + Moe(RmsNorm(x, l.post_norm, shape.rms_norm_eps), l, i, losses, stats);
    }
    if (stats != nullptr) stats->tokens += uint64_t(ids.numel());
    x = RmsNorm(x, final_norm, shape.rms_norm_eps);
    return torch::matmul(x, (shape.tie_word_embeddings ? embed : lm_head).t());
  }

  // HF tensors (experts unstacked) as contiguous float32 tensors, in checkpoint order.
  std::vector<std::pair<std::string, torch::Tensor>> HfTensors() {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (auto& [name, t] : Named()) {
      const auto pos = name.rfind(".experts.");
      if (pos == std::string::npos) {
        out.emplace_back(name, t->detach().contiguous());
        continue;
      }
      const std::string base = name.substr(0, pos) + ".experts.";
      const std::string which = name.substr(pos + 9);  // w1 | w2 | w3
      for (int64_t j = 0; j < t->size(0); ++j) {
        out.emplace_back(base + std::to_string(j) + "." + which + ".weight",
                         (*t)[j].detach().contiguous());
      }
    }
    // HF order: expert tensors grouped by expert, as Named() yields w1, w2, w3 per layer.
    return out;
  }
};

Status MoeShape::Validate() const {
  if (vocab_size < 8 || hidden_size == 0 || intermediate_size == 0 || num_layers == 0) {
    return InvalidArgument("trainer: vocab >= 8 and hidden, intermediate, layers > 0 required");
  }
  if (num_heads == 0 || hidden_size % num_heads != 0 || head_dim() % 2 != 0) {
    return InvalidArgument("trainer: heads (" + std::to_string(num_heads) +
                           ") must divide hidden (" + std::to_string(hidden_size) +
                           ") into an even head_dim");
  }
  if (num_kv_heads == 0 || num_heads % num_kv_heads != 0) {
    return InvalidArgument("trainer: kv heads (" + std::to_string(num_kv_heads) +
                           ") must divide heads (" + std::to_string(num_heads) + ")");
  }
  if (num_experts == 0 || top_k == 0 || top_k > num_experts) {
    return InvalidArgument("trainer: need 0 < top_k (" + std::to_string(top_k) + ") <= experts (" +
                           std::to_string(num_experts) + ")");
  }
  if (max_position_embeddings < 2 || rms_norm_eps <= 0 || rope_theta <= 0) {
    return InvalidArgument("trainer: max positions >= 2, eps > 0 and rope theta > 0 required");
  }
  return Status::Ok();
}

uint64_t MoeShape::ParameterCount() const {
  const uint64_t h = hidden_size, hd = head_dim();
  const uint64_t attn = h * hd * num_heads * 2 + h * hd * num_kv_heads * 2;
  const uint64_t moe = uint64_t(num_experts) * 3 * h * intermediate_size + num_experts * h;
  const uint64_t per_layer = attn + moe + 2 * h;
  return uint64_t(vocab_size) * h * (tie_word_embeddings ? 1 : 2) + num_layers * per_layer + h;
}

MoeModel::MoeModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MoeModel::~MoeModel() = default;

const MoeShape& MoeModel::shape() const { return impl_->shape; }

void MoeModel::SetThreads(uint32_t threads) { torch::set_num_threads(int(threads)); }

Result<std::unique_ptr<MoeModel>> MoeModel::Create(const MoeShape& shape,
                                                   const OptimizerOptions& optim, uint64_t seed) {
  FMOE_RETURN_IF_ERROR(shape.Validate());
  try {
    torch::manual_seed(seed);
    auto impl = std::make_unique<Impl>();
    impl->shape = shape;
    impl->optim = optim;
    const int64_t h = shape.hidden_size, hd = shape.head_dim(), in = shape.intermediate_size;
    const int64_t heads = shape.num_heads, kv = shape.num_kv_heads, ex = shape.num_experts;
    const double std = 0.02, out_std = 0.02 / std::sqrt(2.0 * shape.num_layers);
    auto normal = [](std::vector<int64_t> dims, double s) { return torch::randn(dims) * s; };
    impl->embed = Param(normal({int64_t(shape.vocab_size), h}, std));
    for (uint32_t i = 0; i < shape.num_layers; ++i) {
      Layer l;
      l.input_norm = Param(torch::ones({h}));
      l.wq = Param(normal({heads * hd, h}, std));
      l.wk = Param(normal({kv * hd, h}, std));
      l.wv = Param(normal({kv * hd, h}, std));
      l.wo = Param(normal({h, heads * hd}, out_std));
      l.post_norm = Param(torch::ones({h}));
      l.gate = Param(normal({ex, h}, std));
      l.w1 = Param(normal({ex, in, h}, std));
      l.w2 = Param(normal({ex, h, in}, out_std));
      l.w3 = Param(normal({ex, in, h}, std));
      impl->layers.push_back(std::move(l));
    }
    impl->final_norm = Param(torch::ones({h}));
    if (!shape.tie_word_embeddings) {
      impl->lm_head = Param(normal({int64_t(shape.vocab_size), h}, std));
    }
    impl->BuildRope();
    impl->BuildOptimizer();
    return std::unique_ptr<MoeModel>(new MoeModel(std::move(impl)));
  } catch (const c10::Error& e) {
    return TorchError("creating the model", e);
  }
}

Result<std::unique_ptr<MoeModel>> MoeModel::LoadHf(const std::string& dir) {
  FMOE_ASSIGN_OR_RETURN(ModelInfo info, LoadModelInfo(dir));
  if (info.architecture != "MixtralForCausalLM") {
    return InvalidArgument("trainer: " + dir + ": architecture " + info.architecture +
                           " is not MixtralForCausalLM");
  }
  MoeShape shape;
  shape.vocab_size = info.vocab_size;
  shape.hidden_size = info.hidden_size;
  shape.intermediate_size = info.intermediate_size;
  shape.num_layers = info.num_hidden_layers;
  shape.num_heads = info.num_attention_heads;
  shape.num_kv_heads = info.num_key_value_heads;
  shape.num_experts = info.num_experts;
  shape.top_k = info.top_k;
  shape.max_position_embeddings = info.max_position_embeddings;
  shape.rms_norm_eps = info.rms_norm_eps;
  shape.rope_theta = info.rope_theta;
  shape.tie_word_embeddings = info.tie_word_embeddings;
  FMOE_RETURN_IF_ERROR(shape.Validate());
  if (info.head_dim != shape.head_dim()) {
    return InvalidArgument("trainer: " + dir + ": head_dim " + std::to_string(info.head_dim) +
                           " is not hidden_size / num_attention_heads");
  }
  FMOE_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(dir));
  auto load = [&](const std::string& name, std::vector<int64_t> dims) -> Result<torch::Tensor> {
    FMOE_ASSIGN_OR_RETURN(const TensorView* view, ckpt->Get(name, dims));
    auto t = torch::empty(dims, torch::kFloat32);
    FMOE_RETURN_IF_ERROR(ConvertToF32(view->dtype, view->data,
                                      std::span<float>(t.data_ptr<float>(), size_t(t.numel()))));
    return t;
  };
  try {
    auto impl = std::make_unique<Impl>();
    impl->shape = shape;
    const int64_t h = shape.hidden_size, hd = shape.head_dim(), in = shape.intermediate_size;
    const int64_t heads = shape.num_heads, kv = shape.num_kv_heads;
    FMOE_ASSIGN_OR_RETURN(impl->embed,
                          load("model.embed_tokens.weight", {int64_t(shape.vocab_size), h}));
    for (uint32_t i = 0; i < shape.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      Layer l;
      FMOE_ASSIGN_OR_RETURN(l.input_norm, load(p + "input_layernorm.weight", {h}));
      FMOE_ASSIGN_OR_RETURN(l.wq, load(p + "self_attn.q_proj.weight", {heads * hd, h}));
      FMOE_ASSIGN_OR_RETURN(l.wk, load(p + "self_attn.k_proj.weight", {kv * hd, h}));
      FMOE_ASSIGN_OR_RETURN(l.wv, load(p + "self_attn.v_proj.weight", {kv * hd, h}));
      FMOE_ASSIGN_OR_RETURN(l.wo, load(p + "self_attn.o_proj.weight", {h, heads * hd}));
      FMOE_ASSIGN_OR_RETURN(l.post_norm, load(p + "post_attention_layernorm.weight", {h}));
      FMOE_ASSIGN_OR_RETURN(
          l.gate, load(p + "block_sparse_moe.gate.weight", {int64_t(shape.num_experts), h}));
      std::vector<torch::Tensor> w1, w2, w3;
      for (uint32_t j = 0; j < shape.num_experts; ++j) {
        const std::string e = p + "block_sparse_moe.experts." + std::to_string(j) + ".";
        FMOE_ASSIGN_OR_RETURN(auto a, load(e + "w1.weight", {in, h}));
        FMOE_ASSIGN_OR_RETURN(auto b, load(e + "w2.weight", {h, in}));
        FMOE_ASSIGN_OR_RETURN(auto c, load(e + "w3.weight", {in, h}));
        w1.push_back(a);
        w2.push_back(b);
        w3.push_back(c);
      }
      l.w1 = torch::stack(w1);
      l.w2 = torch::stack(w2);
      l.w3 = torch::stack(w3);
      impl->layers.push_back(std::move(l));
    }
    FMOE_ASSIGN_OR_RETURN(impl->final_norm, load("model.norm.weight", {h}));
    if (!shape.tie_word_embeddings) {
      FMOE_ASSIGN_OR_RETURN(impl->lm_head, load("lm_head.weight", {int64_t(shape.vocab_size), h}));
    }
    impl->BuildRope();
    return std::unique_ptr<MoeModel>(new MoeModel(std::move(impl)));
  } catch (const c10::Error& e) {
    return TorchError("loading " + dir, e);
  }
}

Result<StepResult> MoeModel::TrainStep(std::span<const int32_t> tokens, uint32_t batch,
                                       uint32_t seq_len, double lr) {
  if (tokens.size() != size_t(batch) * (seq_len + 1)) {
    return InvalidArgument("trainer: TrainStep got " + std::to_string(tokens.size()) +
                           " tokens, expected batch * (seq_len + 1)");
  }
  if (!impl_->optimizer) return FailedPrecondition("trainer: model has no optimizer");
  try {
    auto all = torch::from_blob(const_cast<int32_t*>(tokens.data()),
                                {int64_t(batch), int64_t(seq_len) + 1}, torch::kInt32)
                   .to(torch::kInt64);
    auto inputs = all.narrow(1, 0, seq_len);
    auto targets = all.narrow(1, 1, seq_len).reshape({-1});
    RouterLosses router;
    auto logits = impl_->Forward(inputs, &router, nullptr);
    auto ce = torch::nn::functional::cross_entropy(
        logits.reshape({-1, int64_t(impl_->shape.vocab_size)}), targets);
    const double layers = impl_->shape.num_layers;
    auto aux = router.aux / layers;
    auto z = router.z / layers;
    auto loss = ce + impl_->optim.aux_loss_coef * aux + impl_->optim.z_loss_coef * z;
    impl_->optimizer->zero_grad();
    loss.backward();
    std::vector<torch::Tensor> params;
    for (auto& [name, t] : impl_->Named()) params.push_back(*t);
    const double max_norm = impl_->optim.grad_clip > 0 ? impl_->optim.grad_clip : 1e30;
    const double grad_norm = torch::nn::utils::clip_grad_norm_(params, max_norm);
    for (auto& group : impl_->optimizer->param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    }
    impl_->optimizer->step();
    StepResult r;
    r.loss = ce.item<double>();
    r.aux_loss = aux.item<double>();
    r.z_loss = z.item<double>();
    r.grad_norm = grad_norm;
    return r;
  } catch (const c10::Error& e) {
    return TorchError("train step", e);
  }
}

Result<EvalResult> MoeModel::Evaluate(std::span<const int32_t> windows, uint32_t seq_len,
                                      uint32_t batch) const {
  const size_t row = size_t(seq_len) + 1;
  if (windows.empty() || windows.size() % row != 0 || batch == 0) {
    return InvalidArgument("trainer: evaluation needs whole windows of seq_len + 1 tokens");
  }
  const size_t count = windows.size() / row;
  const uint32_t layers = impl_->shape.num_layers;
  const double log_j = std::log(double(impl_->shape.num_experts));
  try {
    torch::NoGradGuard no_grad;
    RouteStats stats;
    stats.counts.assign(layers, torch::zeros({int64_t(impl_->shape.num_experts)}, torch::kFloat64));
    stats.entropy_sum.assign(layers, 0.0);
    double loss_sum = 0;
    uint64_t predicted = 0;
    for (size_t w0 = 0; w0 < count; w0 += batch) {
      const int64_t b = int64_t(std::min<size_t>(batch, count - w0));
      auto all = torch::from_blob(const_cast<int32_t*>(windows.data() + w0 * row),
                                  {b, int64_t(row)}, torch::kInt32)
                     .to(torch::kInt64);
      auto logits = impl_->Forward(all.narrow(1, 0, seq_len), nullptr, &stats);
      auto ce = torch::nn::functional::cross_entropy(
          logits.reshape({-1, int64_t(impl_->shape.vocab_size)}),
          all.narrow(1, 1, seq_len).reshape({-1}),
          torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
      loss_sum += ce.item<double>();
      predicted += uint64_t(b) * seq_len;
    }
    EvalResult r;
    r.loss = loss_sum / double(predicted);
    r.tokens = predicted;
    for (uint32_t l = 0; l < layers; ++l) {
      auto f = stats.counts[l] / stats.counts[l].sum();
      std::vector<double> frac(f.data_ptr<double>(), f.data_ptr<double>() + f.numel());
      double h = 0;
      for (double p : frac) h -= p > 0 ? p * std::log(p) : 0.0;
      r.usage_entropy.push_back(h / log_j);
      r.router_entropy.push_back(stats.entropy_sum[l] / double(stats.tokens) / log_j);
      r.usage_fraction.push_back(std::move(frac));
    }
    return r;
  } catch (const c10::Error& e) {
    return TorchError("evaluation", e);
  }
}

std::vector<int32_t> MoeModel::Greedy(std::span<const int32_t> prompt, uint32_t max_new,
                                      int32_t eos) const {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> ctx(prompt.begin(), prompt.end());
  std::vector<int32_t> out;
  const size_t max_pos = impl_->shape.max_position_embeddings;
  for (uint32_t i = 0; i < max_new && !ctx.empty(); ++i) {
    const size_t start = ctx.size() > max_pos ? ctx.size() - max_pos : 0;
    auto ids =
        torch::from_blob(ctx.data() + start, {1, int64_t(ctx.size() - start)}, torch::kInt64);
    auto logits = impl_->Forward(ids, nullptr, nullptr);
    const int32_t next = int32_t(logits[0][ids.size(1) - 1].argmax().item<int64_t>());
    out.push_back(next);
    ctx.push_back(next);
    if (next == eos) break;
  }
  return out;
}

void MoeModel::RoundToBF16() {
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : impl_->Named()) t->copy_(t->to(torch::kBFloat16).to(torch::kFloat32));
}

Status MoeModel::SaveSafetensors(const std::string& path, bool bf16) const {
  try {
    auto tensors = impl_->HfTensors();
    std::vector<std::vector<uint16_t>> halves;
    std::vector<TensorToWrite> out;
    halves.reserve(tensors.size());
    for (auto& [name, t] : tensors) {
      TensorToWrite w;
      w.name = name;
      w.shape.assign(t.sizes().begin(), t.sizes().end());
      const float* src = t.data_ptr<float>();
      const size_t n = size_t(t.numel());
      if (bf16) {
        halves.emplace_back(n);
        for (size_t i = 0; i < n; ++i) halves.back()[i] = F32ToBF16(src[i]);
        w.dtype = DType::kBF16;
        w.data = std::as_bytes(std::span<const uint16_t>(halves.back()));
      } else {
        w.dtype = DType::kF32;
        w.data = std::as_bytes(std::span<const float>(src, n));
      }
      out.push_back(std::move(w));
    }
    return WriteSafetensors(path, out, {{"format", "pt"}});
  } catch (const c10::Error& e) {
    return TorchError("writing " + path, e);
  }
}

Status MoeModel::SaveState(const std::string& prefix) const {
  if (!impl_->optimizer) return FailedPrecondition("trainer: a loaded model has no optimizer");
  try {
    torch::serialize::OutputArchive weights;
    for (auto& [name, t] : impl_->Named()) weights.write(name, *t);
    weights.save_to(prefix + ".model.pt.tmp");
    torch::serialize::OutputArchive optim;
    impl_->optimizer->save(optim);
    optim.save_to(prefix + ".optim.pt.tmp");
    std::error_code ec;
    std::filesystem::rename(prefix + ".model.pt.tmp", prefix + ".model.pt", ec);
    if (!ec) std::filesystem::rename(prefix + ".optim.pt.tmp", prefix + ".optim.pt", ec);
    if (ec) return IoError("trainer: renaming checkpoint " + prefix + ": " + ec.message());
    return Status::Ok();
  } catch (const c10::Error& e) {
    return TorchError("saving checkpoint " + prefix, e);
  }
}

Status MoeModel::LoadState(const std::string& prefix) {
  if (!impl_->optimizer) return FailedPrecondition("trainer: a loaded model has no optimizer");
  try {
    torch::serialize::InputArchive weights;
    weights.load_from(prefix + ".model.pt");
    for (auto& [name, t] : impl_->Named()) {
      torch::Tensor loaded;
      weights.read(name, loaded);
      if (!loaded.sizes().equals(t->sizes())) {
        return InvalidArgument("trainer: checkpoint " + prefix + ": " + name +
                               " has another shape than the model");
      }
      torch::NoGradGuard no_grad;
      t->copy_(loaded);
    }
    torch::serialize::InputArchive optim;
    optim.load_from(prefix + ".optim.pt");
    impl_->optimizer->load(optim);
    return Status::Ok();
  } catch (const c10::Error& e) {
    return TorchError("loading checkpoint " + prefix, e);
  }
}

}  // namespace fmoe::trainer
