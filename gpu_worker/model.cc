#include "gpu_worker/model.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "common/checkpoint.h"
#include "common/safetensors.h"
#include "gpu_worker/expert_group.h"
#include "gpu_worker/tensor_loader.h"

namespace fmoe {
namespace {

Result<at::ScalarType> ParseDType(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  return InvalidArgument("dtype \"" + name + "\" is not float32, bfloat16 or float16");
}

// y = x w^T over fixed blocks of `rows` rows (see the header): row i of y depends on row i of x
// only, never on how many rows surround it. x: [M, K] contiguous, w: [N, K].
at::Tensor BlockLinear(const at::Tensor& x, const at::Tensor& w, int64_t rows) {
  const int64_t m = x.size(0);
  if (rows <= 0 || !x.is_cpu() || m == 0) return at::linear(x, w);
  at::Tensor out = at::empty({m, w.size(0)}, x.options());
  const at::Tensor wt = w.t();
  const int64_t full = m - m % rows;
  for (int64_t r = 0; r < full; r += rows) {
    at::Tensor dst = out.narrow(0, r, rows);
    at::mm_out(dst, x.narrow(0, r, rows), wt);
  }
  if (full < m) {
    at::Tensor padded = at::zeros({rows, x.size(1)}, x.options());
    padded.narrow(0, 0, m - full).copy_(x.narrow(0, full, m - full));
    out.narrow(0, full, m - full).copy_(at::mm(padded, wt).narrow(0, 0, m - full));
  }
  return out;
}

// HF's MixtralRMSNorm: float32 variance, scaled by the weight in the compute dtype.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (xf * at::rsqrt(var + eps)).to(x.scalar_type());
}

// rotate_half(x) = cat(-x2, x1) over the last dimension.
at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

}  // namespace

struct MoeModel::Layer {
  at::Tensor input_norm, post_norm;
  at::Tensor wq, wk, wv, wo;  // [H*hd, h], [KV*hd, h], [KV*hd, h], [h, H*hd]
  at::Tensor gate;            // [J, h]
};

struct MoeModel::Impl {
  RuntimeOptions options;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  at::Tensor embed;  // [V, h]
  at::Tensor final_norm;
  at::Tensor lm_head;  // [V, h]; the embedding when tied.
  std::vector<Layer> layers;
  at::Tensor inv_freq;  // [hd/2], float32
  at::Tensor cos, sin;  // [positions, hd], compute dtype; grown on demand.

  at::TensorOptions opts() const { return at::TensorOptions().dtype(dtype).device(device); }
  at::Tensor Linear(const at::Tensor& x, const at::Tensor& w) const {
    return BlockLinear(x, w, options.row_block);
  }
};

MoeModel::MoeModel(ModelInfo info) : info_(std::move(info)), impl_(new Impl) {}
MoeModel::~MoeModel() = default;

size_t KvCache::bytes() const {
  size_t total = 0;
  for (const auto& t : k_) total += t.numel() * t.element_size();
  for (const auto& t : v_) total += t.numel() * t.element_size();
  return total;
}


Result<std::unique_ptr<MoeModel>> MoeModel::Load(const ModelInfo& info,
                                                         const RuntimeOptions& options,
                                                         const LoadProgress& progress,
                                                         ExpertTable* experts) {
  if (info.architecture != "MixtralForCausalLM") {
    return FailedPrecondition("model: " + info.dir + "/config.json: architectures: \"" +
                              info.architecture +
                              "\" is not supported by the model runtime yet (supported: "
                              "MixtralForCausalLM)");
  }
  if (info.num_moe_layers != info.num_hidden_layers) {
    return FailedPrecondition("model: " + info.dir +
                              "/config.json: Mixtral with dense layers is not supported");
  }
  if (options.expert_world_size == 0 || options.expert_rank >= options.expert_world_size) {
    return InvalidArgument("model: expert rank " + std::to_string(options.expert_rank) +
                           " is not below the group's size " +
                           std::to_string(options.expert_world_size));
  }
  if (info.head_dim % 2 != 0) {
    return InvalidArgument("model: " + info.dir + "/config.json: head_dim " +
                           std::to_string(info.head_dim) +
                           " is odd; rotary embeddings need it even");
  }
  c10::InferenceMode guard;
  std::unique_ptr<MoeModel> model(new MoeModel(info));
  Impl& m = *model->impl_;
  m.options = options;
  FMOE_ASSIGN_OR_RETURN(m.dtype, ParseDType(options.dtype));
  if (options.cuda_index >= 0) {
    m.device = at::Device(at::kCUDA, static_cast<at::DeviceIndex>(options.cuda_index));
  }

  FMOE_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(info.dir));
  TensorLoader loader(*ckpt, m.dtype, m.device, progress);
  const int64_t h = info.hidden_size, v = info.vocab_size, inter = info.intermediate_size;
  const int64_t q_dim = int64_t{info.num_attention_heads} * info.head_dim;
  const int64_t kv_dim = int64_t{info.num_key_value_heads} * info.head_dim;
  const int64_t j = info.num_experts;

  FMOE_ASSIGN_OR_RETURN(m.embed, loader.Load("model.embed_tokens.weight", {v, h}));
  m.layers.resize(info.num_hidden_layers);
  experts->assign(info.num_hidden_layers, {});
  for (uint32_t l = 0; l < info.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    Layer& layer = m.layers[l];
    FMOE_ASSIGN_OR_RETURN(layer.input_norm, loader.Load(p + "input_layernorm.weight", {h}));
    FMOE_ASSIGN_OR_RETURN(layer.post_norm, loader.Load(p + "post_attention_layernorm.weight", {h}));
    FMOE_ASSIGN_OR_RETURN(layer.wq, loader.Load(p + "self_attn.q_proj.weight", {q_dim, h}));
    FMOE_ASSIGN_OR_RETURN(layer.wk, loader.Load(p + "self_attn.k_proj.weight", {kv_dim, h}));
    FMOE_ASSIGN_OR_RETURN(layer.wv, loader.Load(p + "self_attn.v_proj.weight", {kv_dim, h}));
    FMOE_ASSIGN_OR_RETURN(layer.wo, loader.Load(p + "self_attn.o_proj.weight", {h, q_dim}));
    FMOE_ASSIGN_OR_RETURN(layer.gate, loader.Load(p + "block_sparse_moe.gate.weight", {j, h}));
    auto& layer_experts = (*experts)[l];
    layer_experts.resize(info.num_experts);
    for (uint32_t e = 0; e < info.num_experts; ++e) {
      const std::string q = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
      if ((int64_t{l} * j + e) % options.expert_world_size != options.expert_rank) {
        // Another rank of the group owns it (DESIGN section 7).
        FMOE_RETURN_IF_ERROR(loader.Skip(q + "w1.weight", {inter, h}));
        FMOE_RETURN_IF_ERROR(loader.Skip(q + "w2.weight", {h, inter}));
        FMOE_RETURN_IF_ERROR(loader.Skip(q + "w3.weight", {inter, h}));
        continue;
      }
      // Routed experts stay in host memory: the expert source decides where they live.
      FMOE_ASSIGN_OR_RETURN(layer_experts[e].w1,
                            loader.Load(q + "w1.weight", {inter, h}, at::kCPU));
      FMOE_ASSIGN_OR_RETURN(layer_experts[e].w2,
                            loader.Load(q + "w2.weight", {h, inter}, at::kCPU));
      FMOE_ASSIGN_OR_RETURN(layer_experts[e].w3,
                            loader.Load(q + "w3.weight", {inter, h}, at::kCPU));
    }
  }
  FMOE_ASSIGN_OR_RETURN(m.final_norm, loader.Load("model.norm.weight", {h}));
  if (info.tie_word_embeddings && ckpt->Find("lm_head.weight") == nullptr) {
    m.lm_head = m.embed;
  } else {
    FMOE_ASSIGN_OR_RETURN(m.lm_head, loader.Load("lm_head.weight", {v, h}));
  }
  // HF's rotary inverse frequencies, computed the same way in float32.
  m.inv_freq =
      1.0 /
      at::pow(info.rope_theta,
              at::arange(int64_t{0}, int64_t{info.head_dim}, int64_t{2}, at::kLong).to(at::kFloat) /
                  static_cast<double>(info.head_dim));
  return model;
}

std::unique_ptr<KvCache> MoeModel::NewKvCache() const {
  auto kv = std::make_unique<KvCache>();
  kv->k_.resize(info_.num_hidden_layers);
  kv->v_.resize(info_.num_hidden_layers);
  return kv;
}

Status MoeModel::Forward(std::span<const SequenceInput> batch, ExpertSource& experts,
                             ForwardObserver* observer, ForwardResult* out, bool record_router) {
  c10::InferenceMode guard;
  Impl& m = *impl_;
  const ModelInfo& info = info_;
  const int64_t h = info.hidden_size, hd = info.head_dim;
  const int64_t n_heads = info.num_attention_heads, n_kv = info.num_key_value_heads;
  const int64_t group = n_heads / n_kv;
  const int64_t vocab = info.vocab_size;
  const int64_t n_experts = info.num_experts, top_k = info.top_k;

  // Validate and lay out the ragged batch: sequence i owns rows [offset[i], offset[i] + T_i).
  std::vector<int64_t> offset(batch.size() + 1, 0);
  std::vector<int64_t> ids;
  int64_t max_end = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const SequenceInput& s = batch[i];
    if (s.kv == nullptr || s.tokens.empty()) {
      return InvalidArgument("req=" + std::to_string(s.request_id) + ": no tokens or no KV cache");
    }
    const int64_t end = s.kv->length_ + static_cast<int64_t>(s.tokens.size());
    if (info.max_position_embeddings > 0 && end > info.max_position_embeddings) {
      return InvalidArgument("req=" + std::to_string(s.request_id) + ": " + std::to_string(end) +
                             " positions exceed max_position_embeddings " +
                             std::to_string(info.max_position_embeddings));
    }
    for (size_t t = 0; t < s.tokens.size(); ++t) {
      if (s.tokens[t] < 0 || s.tokens[t] >= vocab) {
        return InvalidArgument("req=" + std::to_string(s.request_id) + ": token id " +
                               std::to_string(s.tokens[t]) + " at position " + std::to_string(t) +
                               " is out of range (vocab " + std::to_string(vocab) + ")");
      }
      ids.push_back(s.tokens[t]);
    }
    offset[i + 1] = offset[i] + static_cast<int64_t>(s.tokens.size());
    max_end = std::max(max_end, end);
  }
  const int64_t rows = offset.back();
  if (out != nullptr) {
    out->logits.assign(batch.size(), {});
    out->router_probs.clear();
    out->router_topk.clear();
  }
  record_router = record_router && out != nullptr;
  if (rows == 0) return Status::Ok();

  // Rotary tables up to the furthest position; KV caches large enough for their new tokens.
  if (!m.cos.defined() || m.cos.size(0) < max_end) {
    const int64_t n = std::max<int64_t>(max_end, m.cos.defined() ? 2 * m.cos.size(0) : 256);
    at::Tensor freqs = at::outer(at::arange(n, at::kLong).to(at::kFloat), m.inv_freq);
    at::Tensor emb = at::cat({freqs, freqs}, -1);
    m.cos = emb.cos().to(m.device, m.dtype);
    m.sin = emb.sin().to(m.device, m.dtype);
  }
  for (const SequenceInput& s : batch) {
    KvCache& kv = *s.kv;
    const int64_t need = kv.length_ + static_cast<int64_t>(s.tokens.size());
    if (need <= kv.capacity_) continue;
    const int64_t cap = std::max<int64_t>((need + 63) / 64 * 64, 2 * kv.capacity_);
    for (size_t l = 0; l < kv.k_.size(); ++l) {
      at::Tensor k = at::zeros({n_kv, cap, hd}, m.opts());
      at::Tensor v = at::zeros({n_kv, cap, hd}, m.opts());
      if (kv.length_ > 0) {
        k.narrow(1, 0, kv.length_).copy_(kv.k_[l].narrow(1, 0, kv.length_));
        v.narrow(1, 0, kv.length_).copy_(kv.v_[l].narrow(1, 0, kv.length_));
      }
      kv.k_[l] = k;
      kv.v_[l] = v;
    }
    kv.capacity_ = cap;
  }

  at::Tensor id_tensor = at::tensor(ids, at::TensorOptions().dtype(at::kLong)).to(m.device);
  at::Tensor x = m.embed.index_select(0, id_tensor);  // [rows, h]
  std::vector<SequenceInfo> sequences(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    sequences[i] = {batch[i].request_id, batch[i].iteration,
                    static_cast<uint32_t>(batch[i].tokens.size())};
  }
  if (observer != nullptr) {
    observer->OnBatchStart(sequences);
    at::Tensor xf = x.to(at::kCPU, at::kFloat);
    for (size_t i = 0; i < batch.size(); ++i) {
      at::Tensor sem = xf.narrow(0, offset[i], offset[i + 1] - offset[i]).mean(0).contiguous();
      observer->OnIterationStart(batch[i].request_id, batch[i].iteration,
                                 {sem.data_ptr<float>(), static_cast<size_t>(h)});
    }
  }

  experts.BeginIteration(sequences);
  struct IterationEnd {
    ExpertSource& source;
    ~IterationEnd() { source.EndIteration(); }
  } iteration_end{experts};

  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const Layer& layer = m.layers[l];
    // ---- attention, per sequence ----
    at::Tensor hn = RmsNorm(x, layer.input_norm, info.rms_norm_eps);
    at::Tensor q = m.Linear(hn, layer.wq);
    at::Tensor k = m.Linear(hn, layer.wk);
    at::Tensor v = m.Linear(hn, layer.wv);
    at::Tensor attn = at::empty({rows, n_heads * hd}, m.opts());
    for (size_t i = 0; i < batch.size(); ++i) {
      KvCache& kv = *batch[i].kv;
      const int64_t t = offset[i + 1] - offset[i], p0 = kv.length_, len = p0 + t;
      at::Tensor cos = m.cos.narrow(0, p0, t).unsqueeze(1);  // [t, 1, hd]
      at::Tensor sin = m.sin.narrow(0, p0, t).unsqueeze(1);
      at::Tensor qi = q.narrow(0, offset[i], t).view({t, n_heads, hd});
      at::Tensor ki = k.narrow(0, offset[i], t).view({t, n_kv, hd});
      at::Tensor vi = v.narrow(0, offset[i], t).view({t, n_kv, hd});
      qi = qi * cos + RotateHalf(qi) * sin;
      ki = ki * cos + RotateHalf(ki) * sin;
      kv.k_[l].narrow(1, p0, t).copy_(ki.permute({1, 0, 2}));
      kv.v_[l].narrow(1, p0, t).copy_(vi.permute({1, 0, 2}));
      at::Tensor keys = kv.k_[l].narrow(1, 0, len);  // [KV, len, hd]
      at::Tensor values = kv.v_[l].narrow(1, 0, len);
      // Query head qh uses KV head qh / group: [t, KV, group, hd] -> [KV, group * t, hd].
      at::Tensor qg =
          qi.reshape({t, n_kv, group, hd}).permute({1, 2, 0, 3}).reshape({n_kv, group * t, hd});
      at::Tensor scores = at::matmul(qg, keys.transpose(1, 2)) * scale;  // [KV, group*t, len]
      const int64_t window = info.sliding_window.value_or(0);
      if (t > 1 || (window > 0 && len > window)) {
        // Row r of a group is new token r % t at position p = p0 + r % t: it sees keys k with
        // k <= p and, with a sliding window, p - k < window.
        at::Tensor ones = at::ones({t, len}, at::TensorOptions().dtype(at::kBool).device(m.device));
        at::Tensor mask = ones.triu(p0 + 1);
        if (window > 0 && len > window) mask = mask.logical_or(ones.tril(p0 - window));
        scores =
            scores.masked_fill(mask.repeat({group, 1}), -std::numeric_limits<float>::infinity());
      }
      at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(m.dtype);
      at::Tensor o = at::matmul(probs, values);  // [KV, group*t, hd]
      attn.narrow(0, offset[i], t)
          .copy_(o.reshape({n_kv, group, t, hd}).permute({2, 0, 1, 3}).reshape({t, n_heads * hd}));
    }
    x = x + m.Linear(attn, layer.wo);

    // ---- mixture of experts ----
    hn = RmsNorm(x, layer.post_norm, info.rms_norm_eps);
    at::Tensor router = at::softmax(m.Linear(hn, layer.gate), -1, at::kFloat);  // [rows, J]
    auto [top_w, top_i] = router.topk(top_k, -1);
    top_w = top_w / top_w.sum(-1, /*keepdim=*/true);
    at::Tensor router_cpu = router.to(at::kCPU).contiguous();
    at::Tensor top_i_cpu = top_i.to(at::kCPU).contiguous();
    at::Tensor top_w_cpu = top_w.to(at::kCPU).contiguous();
    if (observer != nullptr) {
      for (size_t i = 0; i < batch.size(); ++i) {
        at::Tensor mean =
            router_cpu.narrow(0, offset[i], offset[i + 1] - offset[i]).mean(0).contiguous();
        observer->OnLayerGates(batch[i].request_id, batch[i].iteration, static_cast<uint32_t>(l),
                               {mean.data_ptr<float>(), static_cast<size_t>(n_experts)});
      }
    }
    if (record_router) {
      const float* p = router_cpu.data_ptr<float>();
      out->router_probs.emplace_back(p, p + rows * n_experts);
      std::vector<int32_t> chosen(static_cast<size_t>(rows * top_k));
      const int64_t* c = top_i_cpu.data_ptr<int64_t>();
      for (size_t r = 0; r < chosen.size(); ++r) chosen[r] = static_cast<int32_t>(c[r]);
      out->router_topk.push_back(std::move(chosen));
    }
    // Rows (ascending) and weights per expert; each sequence's tokens per expert. A row's k
    // picked experts fill its k slots in ascending expert order: slot r * K + s holds the
    // weighted output of row r's s-th smallest expert.
    std::vector<std::vector<int64_t>> expert_rows(n_experts);
    std::vector<std::vector<int64_t>> expert_slots(n_experts);
    std::vector<std::vector<float>> expert_weights(n_experts);
    std::vector<uint32_t> sequence_counts(batch.size() * n_experts, 0);
    const int64_t* chosen = top_i_cpu.data_ptr<int64_t>();
    const float* weights = top_w_cpu.data_ptr<float>();
    for (size_t i = 0; i < batch.size(); ++i) {
      for (int64_t r = offset[i]; r < offset[i + 1]; ++r) {
        for (int64_t s = 0; s < top_k; ++s) {
          const int64_t e = chosen[r * top_k + s];
          int64_t smaller = 0;
          for (int64_t o = 0; o < top_k; ++o) smaller += chosen[r * top_k + o] < e ? 1 : 0;
          expert_rows[e].push_back(r);
          expert_slots[e].push_back(r * top_k + smaller);
          expert_weights[e].push_back(weights[r * top_k + s]);
          ++sequence_counts[i * n_experts + e];
        }
      }
    }
    std::vector<uint32_t> used, used_tokens;
    for (int64_t e = 0; e < n_experts; ++e) {
      if (expert_rows[e].empty()) continue;
      used.push_back(static_cast<uint32_t>(e));
      used_tokens.push_back(static_cast<uint32_t>(expert_rows[e].size()));
    }
    if (observer != nullptr) {
      std::vector<uint32_t> seq_experts, seq_tokens;
      for (size_t i = 0; i < batch.size(); ++i) {
        seq_experts.clear();
        seq_tokens.clear();
        for (int64_t e = 0; e < n_experts; ++e) {
          const uint32_t n = sequence_counts[i * n_experts + e];
          if (n == 0) continue;
          seq_experts.push_back(static_cast<uint32_t>(e));
          seq_tokens.push_back(n);
        }
        observer->OnLayerRouting(batch[i].request_id, batch[i].iteration, static_cast<uint32_t>(l),
                                 seq_experts, seq_tokens);
      }
    }
    // Speculative prediction (DESIGN section 6): the gates of the next d layers applied to this
    // layer's hidden state; per expert, the fraction of tokens whose top-k would pick it: over
    // the whole batch for the source, over each sequence's own rows for the observer (a trace
    // recorder records per request). The source gets its own distance's targets only, the
    // observer its own: the products beyond the source's distance change nothing but what the
    // observer sees.
    const size_t source_distance = experts.speculation_distance();
    const size_t observer_distance = observer != nullptr ? observer->speculation_distance() : 0;
    const size_t distance = std::max(source_distance, observer_distance);
    for (size_t t = l + 1; t < m.layers.size() && t <= l + distance; ++t) {
      const Layer& ahead = m.layers[t];
      auto guess =
          m.Linear(RmsNorm(x, ahead.post_norm, info.rms_norm_eps), ahead.gate).topk(top_k, -1);
      at::Tensor picked = std::get<1>(guess).to(at::kCPU).contiguous();
      std::vector<float> share(static_cast<size_t>(n_experts), 0.0f);
      const int64_t* pk = picked.data_ptr<int64_t>();
      for (int64_t k = 0; k < rows * top_k; ++k) share[pk[k]] += 1.0f / static_cast<float>(rows);
      if (t <= l + source_distance) {
        experts.Speculate(static_cast<uint32_t>(l), static_cast<uint32_t>(t), share);
      }
      if (t <= l + observer_distance) {
        std::vector<uint32_t> counts(static_cast<size_t>(n_experts));
        std::vector<float> own(static_cast<size_t>(n_experts));
        for (size_t i = 0; i < batch.size(); ++i) {
          std::fill(counts.begin(), counts.end(), 0u);
          for (int64_t k = offset[i] * top_k; k < offset[i + 1] * top_k; ++k) ++counts[pk[k]];
          const float seq_rows = static_cast<float>(offset[i + 1] - offset[i]);
          for (int64_t e = 0; e < n_experts; ++e) {
            own[e] = static_cast<float>(counts[e]) / seq_rows;
          }
          observer->OnSpeculation(batch[i].request_id, batch[i].iteration, static_cast<uint32_t>(l),
                                  static_cast<uint32_t>(t), own);
        }
      }
    }
    const LayerRouting routing{static_cast<uint32_t>(l), used, used_tokens, sequence_counts};
    FMOE_RETURN_IF_ERROR(experts.BeginLayer(routing));
    // Experts arrive in the order the source has them ready; each output goes to its own slots,
    // so the result never depends on that order.
    at::Tensor slots = at::zeros({rows * top_k, h}, m.opts());
    std::vector<bool> done(static_cast<size_t>(n_experts), false);
    Status status;
    while (true) {
      Result<std::pair<uint32_t, ExpertWeights>> next = experts.Next();
      if (!next.ok()) {
        if (next.status().code() != ErrorCode::kNotFound) status = next.status();
        break;
      }
      const uint32_t e = next->first;
      const ExpertWeights& w = next->second;
      if (e >= n_experts || expert_rows[e].empty() || done[e]) {
        status = Internal("model: expert source handed out expert " + std::to_string(e) +
                          " of layer " + std::to_string(l) + ", which the gate did not pick");
        break;
      }
      at::Tensor idx =
          at::tensor(expert_rows[e], at::TensorOptions().dtype(at::kLong)).to(m.device);
      at::Tensor xe = hn.index_select(0, idx);
      at::Tensor act = at::silu(m.Linear(xe, w.w1)) * m.Linear(xe, w.w3);
      at::Tensor ye = m.Linear(act, w.w2);
      at::Tensor we = at::tensor(expert_weights[e], at::TensorOptions().dtype(at::kFloat))
                          .to(m.device, m.dtype)
                          .unsqueeze(1);
      slots.index_copy_(
          0, at::tensor(expert_slots[e], at::TensorOptions().dtype(at::kLong)).to(m.device),
          ye * we);
      done[e] = true;
      experts.Done(e);
    }
    experts.EndLayer();
    FMOE_RETURN_IF_ERROR(status);
    // Expert parallelism (DESIGN section 7): this rank filled the slots of the experts it owns;
    // every slot has one owner, so the combination is exact and the same on every rank.
    if (group_ != nullptr) FMOE_RETURN_IF_ERROR(group_->CombineDisjoint(slots));
    // Each row's experts summed in ascending expert order, whatever the group's size.
    at::Tensor per_row = slots.view({rows, top_k, h});
    at::Tensor moe = at::zeros({rows, h}, m.opts());
    for (int64_t s = 0; s < top_k; ++s) moe = moe + per_row.select(1, s);
    x = x + moe;
  }

  if (out == nullptr) {
    for (const SequenceInput& s : batch) s.kv->length_ += static_cast<int64_t>(s.tokens.size());
    if (observer != nullptr) {
      for (const SequenceInput& s : batch) observer->OnIterationEnd(s.request_id, s.iteration);
    }
    return Status::Ok();
  }
  // Logits of the rows asked for.
  std::vector<int64_t> logit_rows;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (batch[i].all_logits) {
      for (int64_t r = offset[i]; r < offset[i + 1]; ++r) logit_rows.push_back(r);
    } else {
      logit_rows.push_back(offset[i + 1] - 1);
    }
  }
  at::Tensor sel =
      x.index_select(0, at::tensor(logit_rows, at::TensorOptions().dtype(at::kLong)).to(m.device));
  at::Tensor logits = m.Linear(RmsNorm(sel, m.final_norm, info.rms_norm_eps), m.lm_head)
                          .to(at::kCPU, at::kFloat)
                          .contiguous();
  const float* lp = logits.data_ptr<float>();
  size_t row = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const size_t n = batch[i].all_logits ? static_cast<size_t>(offset[i + 1] - offset[i]) : 1;
    out->logits[i].assign(lp + row * vocab, lp + (row + n) * vocab);
    row += n;
  }
  for (const SequenceInput& s : batch) s.kv->length_ += static_cast<int64_t>(s.tokens.size());
  if (observer != nullptr) {
    for (const SequenceInput& s : batch) observer->OnIterationEnd(s.request_id, s.iteration);
  }
  return Status::Ok();
}

}  // namespace fmoe
