#include "gpu_worker/model/model.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <tuple>

#include "common/model/checkpoint.h"
#include "common/model/families/family.h"
#include "common/model/routing.h"
#include "gpu_worker/experts/cpu_expert.h"
#include "gpu_worker/experts/quantized.h"
#include "gpu_worker/group/expert_group.h"
#include "gpu_worker/model/blocks.h"
#include "gpu_worker/sampling/sampler.h"

namespace fmoe {
namespace {

Result<at::ScalarType> ParseDType(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  return InvalidArgument("dtype \"" + name + "\" is not float32, bfloat16 or float16");
}

constexpr uint32_t kDense = UINT32_MAX;

// Expert `e` of MoE layer `l` could not be had: each sequence (by `offset`) owning one of `rows`
// fails, once (its first failure is kept).
void FailSequences(uint32_t l, uint32_t e, const Status& why, const std::vector<int64_t>& rows,
                   const std::vector<int64_t>& offset, std::vector<SequenceFailure>* failed) {
  for (int64_t r : rows) {
    const auto seq =
        static_cast<size_t>(std::upper_bound(offset.begin(), offset.end(), r) - offset.begin() - 1);
    const bool known = std::any_of(failed->begin(), failed->end(),
                                   [&](const SequenceFailure& f) { return f.sequence == seq; });
    if (known) continue;
    failed->push_back(
        {seq, l, e,
         Status(why.code(), "expert " + std::to_string(e) + " of MoE layer " + std::to_string(l) +
                                " could not be read: " + why.message())});
  }
}

}  // namespace

// One transformer layer: attention, then a dense MLP or a mixture of experts.
struct MoeModel::Layer {
  at::Tensor input_norm, post_norm;
  at::Tensor input_norm_bias, post_norm_bias;  // LayerNorm's (info.layer_norm), or undefined.
  AttentionWeights attention;                  // Grouped-query attention, or
  MlaWeights latent;                           // multi-head latent attention (info.mla).
  uint32_t moe = kDense;                       // The MoE layer index, or kDense.
  MlpWeights dense;                            // A dense layer's MLP.
  at::Tensor gate;                             // The router, [J, h].
  at::Tensor gate_bias;                        // Its bias [J] (gpt-oss), or undefined.
  MlpWeights shared;               // The shared expert (resident), if the family has one.
  at::Tensor shared_gate;          // [1, h], if gated.
  std::vector<float> router_bias;  // DeepSeek-V3's e_score_correction_bias [J], or empty.
};

struct MoeModel::Impl {
  RuntimeOptions options;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  at::Tensor embed;  // [V, h]
  at::Tensor final_norm;
  at::Tensor final_norm_bias;  // LayerNorm's, or undefined.
  at::Tensor lm_head;          // [V, h]; the embedding when tied.
  at::Tensor lm_head_bias;     // [V] (info.lm_head_bias), or undefined.
  std::vector<Layer> layers;
  at::Tensor inv_freq;            // [hd/2], float32
  double rope_factor = 1.0;       // YaRN's factor or LongRoPE's short mscale on cos and sin.
  at::Tensor long_inv_freq;       // LongRoPE's long factors, or undefined.
  double long_rope_factor = 1.0;  // LongRoPE's long mscale.
  RotaryTables rope;              // [positions, hd], compute dtype; grown on demand.

  at::TensorOptions opts() const { return at::TensorOptions().dtype(dtype).device(device); }
  at::Tensor Linear(const at::Tensor& x, const at::Tensor& w) const {
    return BlockLinear(x, w, options.row_block);
  }
};

// The ragged batch of one Forward: sequence i owns rows [offset[i], offset[i + 1]).
struct MoeModel::Batch {
  std::span<const SequenceInput> inputs;
  std::vector<int64_t> offset;
  int64_t rows = 0;
  ForwardObserver* observer = nullptr;
  ForwardResult* out = nullptr;
  bool record_router = false;
  // Per KV layer group, per sequence: the pool rows of the positions its attention reads, from
  // first[g][i] to the end of its new tokens.
  std::vector<std::vector<at::Tensor>> slots;
  std::vector<std::vector<int64_t>> first;
};

MoeModel::MoeModel(ModelInfo info) : info_(std::move(info)), impl_(new Impl) {}
MoeModel::~MoeModel() = default;

Result<std::unique_ptr<MoeModel>> MoeModel::Load(const ModelInfo& info,
                                                 const RuntimeOptions& options,
                                                 const LoadProgress& progress,
                                                 ExpertTable* experts) {
  try {
    return LoadImpl(info, options, progress, experts);
  } catch (const c10::Error& e) {
    return Internal("model: " + info.dir + ": LibTorch: " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Internal("model: " + info.dir + ": " + e.what());
  }
}

Result<std::unique_ptr<MoeModel>> MoeModel::LoadImpl(const ModelInfo& info,
                                                     const RuntimeOptions& options,
                                                     const LoadProgress& progress,
                                                     ExpertTable* experts) {
  FMOE_RETURN_IF_ERROR(CheckLoadable(info, options));
  FMOE_ASSIGN_OR_RETURN(const ModelFamily* family, FindModelFamily(info.architecture));
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
  loader.set_quant(info.quant);
  const int64_t h = info.hidden_size;
  FMOE_ASSIGN_OR_RETURN(m.embed,
                        loader.Load("model.embed_tokens.weight", {int64_t{info.vocab_size}, h}));
  m.layers.resize(info.num_hidden_layers);
  for (uint32_t l = 0; l < info.num_moe_layers; ++l) m.layers[info.moe_layers[l]].moe = l;
  experts->assign(info.num_moe_layers, {});
  for (uint32_t i = 0; i < info.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer& layer = m.layers[i];
    FMOE_ASSIGN_OR_RETURN(layer.input_norm, loader.Load(p + "input_layernorm.weight", {h}));
    FMOE_ASSIGN_OR_RETURN(layer.post_norm, loader.Load(p + "post_attention_layernorm.weight", {h}));
    if (info.layer_norm) {
      FMOE_ASSIGN_OR_RETURN(layer.input_norm_bias, loader.Load(p + "input_layernorm.bias", {h}));
      FMOE_ASSIGN_OR_RETURN(layer.post_norm_bias,
                            loader.Load(p + "post_attention_layernorm.bias", {h}));
    }
    if (info.mla) {
      FMOE_RETURN_IF_ERROR(LoadLatentAttention(info, loader, p + "self_attn.", &layer.latent));
    } else {
      FMOE_RETURN_IF_ERROR(LoadAttention(info, loader, p + "self_attn.", &layer.attention));
      const bool sliding = info.sliding_layers.empty() || info.sliding_layers[i];
      layer.attention.window = sliding ? int64_t{info.sliding_window.value_or(0)} : 0;
    }
    if (layer.moe == kDense) {
      FMOE_RETURN_IF_ERROR(
          LoadMlp(loader, p + "mlp.", info.dense_intermediate_size, h, &layer.dense));
      continue;
    }
    FMOE_RETURN_IF_ERROR(LoadMoeBlock(info, family->tensors, options, loader,
                                      p + family->tensors.moe, &layer, &(*experts)[layer.moe]));
  }
  FMOE_RETURN_IF_ERROR(LoadOutput(info, *ckpt, loader, &m));
  LogSkippedLayers(info, *ckpt);
  return model;
}

// Layers the checkpoint stores beyond num_hidden_layers (GLM-4.5's and DeepSeek-V3's
// multi-token-prediction layers, num_nextn_predict_layers) are not part of the forward: they are
// left on disk, and the log says which.
void MoeModel::LogSkippedLayers(const ModelInfo& info, const Checkpoint& ckpt) {
  std::map<uint64_t, size_t> extra;  // Layer -> tensors.
  const std::string prefix = "model.layers.";
  for (const std::string& name : ckpt.TensorNames()) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    uint64_t layer = 0;
    size_t i = prefix.size(), digits = 0;
    for (; i < name.size() && digits < 9 && name[i] >= '0' && name[i] <= '9'; ++i, ++digits) {
      layer = layer * 10 + static_cast<uint64_t>(name[i] - '0');
    }
    if (digits > 0 && layer >= info.num_hidden_layers) ++extra[layer];
  }
  for (const auto& [layer, tensors] : extra) {
    spdlog::info(
        "model {}: skipping layer {} of the checkpoint ({} tensors): beyond num_hidden_layers {} "
        "(a multi-token-prediction layer is not part of the forward)",
        info.dir, layer, tensors, info.num_hidden_layers);
  }
}

Status MoeModel::CheckLoadable(const ModelInfo& info, const RuntimeOptions& options) {
  if (!info.runtime_unsupported.empty()) {
    return FailedPrecondition("model: " + info.dir + "/config.json: " + info.runtime_unsupported);
  }
  if (options.expert_world_size == 0 || options.expert_rank >= options.expert_world_size) {
    return InvalidArgument("model: expert rank " + std::to_string(options.expert_rank) +
                           " is not below the group's size " +
                           std::to_string(options.expert_world_size));
  }
  if (info.mla && info.num_key_value_heads != info.num_attention_heads) {
    return InvalidArgument("model: " + info.dir + "/config.json: num_key_value_heads " +
                           std::to_string(info.num_key_value_heads) +
                           " differs from num_attention_heads; MLA needs them equal");
  }
  if (RotaryDim(info) % 2 != 0 || RotaryDim(info) > info.head_dim) {
    return InvalidArgument("model: " + info.dir + "/config.json: rotary width " +
                           std::to_string(RotaryDim(info)) + " of head_dim " +
                           std::to_string(info.head_dim) + " is odd or too wide");
  }
  if (info.head_dim % 2 != 0) {
    return InvalidArgument("model: " + info.dir + "/config.json: head_dim " +
                           std::to_string(info.head_dim) +
                           " is odd; rotary embeddings need it even");
  }
  return info.routing.Validate();
}

Status MoeModel::LoadMlp(TensorLoader& loader, const std::string& p, int64_t width, int64_t h,
                         MlpWeights* w) {
  FMOE_ASSIGN_OR_RETURN(w->gate, loader.Load(p + "gate_proj.weight", {width, h}));
  FMOE_ASSIGN_OR_RETURN(w->up, loader.Load(p + "up_proj.weight", {width, h}));
  FMOE_ASSIGN_OR_RETURN(w->down, loader.Load(p + "down_proj.weight", {h, width}));
  return Status::Ok();
}

Status MoeModel::LoadAttention(const ModelInfo& info, TensorLoader& loader, const std::string& p,
                               AttentionWeights* a) {
  const int64_t h = info.hidden_size, hd = info.head_dim;
  const int64_t q_dim = int64_t{info.num_attention_heads} * hd;
  const int64_t kv_dim = int64_t{info.num_key_value_heads} * hd;
  FMOE_ASSIGN_OR_RETURN(a->wq, loader.Load(p + "q_proj.weight", {q_dim, h}));
  FMOE_ASSIGN_OR_RETURN(a->wk, loader.Load(p + "k_proj.weight", {kv_dim, h}));
  FMOE_ASSIGN_OR_RETURN(a->wv, loader.Load(p + "v_proj.weight", {kv_dim, h}));
  FMOE_ASSIGN_OR_RETURN(a->wo, loader.Load(p + "o_proj.weight", {h, q_dim}));
  if (info.qkv_bias) {
    FMOE_ASSIGN_OR_RETURN(a->bq, loader.Load(p + "q_proj.bias", {q_dim}));
    FMOE_ASSIGN_OR_RETURN(a->bk, loader.Load(p + "k_proj.bias", {kv_dim}));
    FMOE_ASSIGN_OR_RETURN(a->bv, loader.Load(p + "v_proj.bias", {kv_dim}));
  }
  if (info.o_bias) {
    FMOE_ASSIGN_OR_RETURN(a->bo, loader.Load(p + "o_proj.bias", {h}));
  }
  if (info.qk_norm == QkNorm::kPerHead) {
    FMOE_ASSIGN_OR_RETURN(a->q_norm, loader.Load(p + "q_norm.weight", {hd}));
    FMOE_ASSIGN_OR_RETURN(a->k_norm, loader.Load(p + "k_norm.weight", {hd}));
  } else if (info.qk_norm == QkNorm::kWhole) {
    FMOE_ASSIGN_OR_RETURN(a->q_norm, loader.Load(p + "q_norm.weight", {q_dim}));
    FMOE_ASSIGN_OR_RETURN(a->k_norm, loader.Load(p + "k_norm.weight", {kv_dim}));
  }
  if (info.attention_sinks) {
    FMOE_ASSIGN_OR_RETURN(a->sinks, loader.Load(p + "sinks", {int64_t{info.num_attention_heads}}));
  }
  return Status::Ok();
}

Status MoeModel::LoadMoeBlock(const ModelInfo& info, const ExpertTensorNames& names,
                              const RuntimeOptions& options, TensorLoader& loader,
                              const std::string& moe, Layer* layer,
                              std::vector<ExpertWeights>* layer_experts) {
  const int64_t h = info.hidden_size, inter = info.intermediate_size, j = info.num_experts;
  const std::string router = moe + names.router;
  if (loader.StoredQuantized(router + ".weight")) {
    return InvalidArgument("model: " + info.dir + ": \"" + router +
                           "\": a quantized router is not implemented (" + info.quant.Describe() +
                           "); the router must be stored in float");
  }
  FMOE_ASSIGN_OR_RETURN(layer->gate, loader.Load(router + ".weight", {j, h}));
  if (info.router_bias) {
    FMOE_ASSIGN_OR_RETURN(layer->gate_bias, loader.Load(router + ".bias", {j}));
  }
  if (info.router_correction_bias) {
    FMOE_ASSIGN_OR_RETURN(at::Tensor bias, loader.Load(moe + names.correction_bias, {j}, at::kCPU));
    at::Tensor bf = bias.to(at::kFloat).contiguous();
    layer->router_bias.assign(bf.data_ptr<float>(), bf.data_ptr<float>() + j);
  }
  if (info.shared_expert_intermediate_size > 0) {
    FMOE_RETURN_IF_ERROR(LoadMlp(loader, moe + names.shared_expert,
                                 info.shared_expert_intermediate_size, h, &layer->shared));
    if (info.shared_expert_gated) {
      FMOE_ASSIGN_OR_RETURN(layer->shared_gate,
                            loader.Load(moe + "shared_expert_gate.weight", {1, h}));
    }
  }
  layer_experts->resize(info.num_experts);
  if (names.fused_experts) {
    return LoadFusedExperts(info, names, options, loader, moe, layer->moe, layer_experts);
  }
  for (uint32_t e = 0; e < info.num_experts; ++e) {
    const std::string q = moe + "experts." + std::to_string(e) + ".";
    const bool owned =
        (int64_t{layer->moe} * j + e) % options.expert_world_size == options.expert_rank;
    TensorLoader::DiskSink sink;
    loader.set_disk_sink(owned && options.experts_on_disk ? &sink : nullptr);
    struct SinkOff {
      TensorLoader& loader;
      ~SinkOff() { loader.set_disk_sink(nullptr); }
    } sink_off{loader};
    if (info.quant.quantized()) {
      // Kept as stored (DESIGN section 12), in host memory like any routed expert.
      ExpertWeights& w = (*layer_experts)[e];
      w.quant = info.quant;
      struct Projection {
        const char* name;
        int64_t out, in;
        at::Tensor* weight;
        ProjectionParts* parts;
      } projections[] = {{names.expert_gate, inter, h, &w.w1, &w.q[0]},
                         {names.expert_down, h, inter, &w.w2, &w.q[1]},
                         {names.expert_up, inter, h, &w.w3, &w.q[2]}};
      for (const Projection& p : projections) {
        const std::string prefix = q + LinearPrefix(p.name);
        FMOE_RETURN_IF_ERROR(owned ? loader.LoadQuantized(prefix, p.out, p.in, p.weight, p.parts)
                                   : loader.SkipQuantized(prefix, p.out, p.in));
      }
      if (!owned) w = ExpertWeights{};
      if (owned && options.experts_on_disk) FMOE_RETURN_IF_ERROR(KeepOnDisk(sink, &w));
      continue;
    }
    if (!owned) {
      // Another rank of the group owns it (DESIGN section 7).
      FMOE_RETURN_IF_ERROR(loader.Skip(q + names.expert_gate, {inter, h}));
      FMOE_RETURN_IF_ERROR(loader.Skip(q + names.expert_down, {h, inter}));
      FMOE_RETURN_IF_ERROR(loader.Skip(q + names.expert_up, {inter, h}));
      continue;
    }
    // Routed experts stay in host memory: the expert source decides where they live.
    ExpertWeights& w = (*layer_experts)[e];
    FMOE_ASSIGN_OR_RETURN(w.w1, loader.Load(q + names.expert_gate, {inter, h}, at::kCPU));
    FMOE_ASSIGN_OR_RETURN(w.w2, loader.Load(q + names.expert_down, {h, inter}, at::kCPU));
    FMOE_ASSIGN_OR_RETURN(w.w3, loader.Load(q + names.expert_up, {inter, h}, at::kCPU));
    if (options.experts_on_disk) FMOE_RETURN_IF_ERROR(KeepOnDisk(sink, &w));
  }
  return Status::Ok();
}

Status MoeModel::KeepOnDisk(const TensorLoader::DiskSink& sink, ExpertWeights* w) {
  auto extents = std::make_shared<std::vector<DiskExtent>>();
  for (const at::Tensor* t : std::as_const(*w).Tensors()) {
    auto it = sink.find(t->unsafeGetTensorImpl());
    if (it == sink.end()) return Internal("model: an expert tensor left on disk was not located");
    extents->push_back(it->second);
  }
  w->disk = std::move(extents);
  return Status::Ok();
}

Status MoeModel::LoadFusedExperts(const ModelInfo& info, const ExpertTensorNames& names,
                                  const RuntimeOptions& options, TensorLoader& loader,
                                  const std::string& moe, uint32_t moe_layer,
                                  std::vector<ExpertWeights>* layer_experts) {
  const int64_t h = info.hidden_size, inter = info.intermediate_size, j = info.num_experts;
  if (info.quant.quantized() && info.quant.method != QuantMethod::kMxfp4) {
    return InvalidArgument("model: " + info.dir + ": fused experts stored as " +
                           info.quant.Describe() + " are not implemented (mxfp4 is)");
  }
  const std::string x = moe + "experts.";
  const std::string gate_up = x + names.expert_gate, down = x + names.expert_down;
  const auto owned = [&](uint32_t e) {
    return (int64_t{moe_layer} * j + e) % options.expert_world_size == options.expert_rank;
  };
  if (info.quant.method == QuantMethod::kMxfp4 && (h % 32 != 0 || inter % 32 != 0)) {
    return InvalidArgument("model: " + info.dir + ": mxfp4 experts of " + std::to_string(h) +
                           " x " + std::to_string(inter) + ": not multiples of 32");
  }
  if (options.experts_on_disk) {
    return LeaveFusedExpertsOnDisk(info, names, loader, moe, owned, layer_experts);
  }
  // The layer's tensors whole, in host memory; each expert sliced out of them.
  at::Tensor gu_bias, dn_bias;
  if (info.expert_bias) {
    FMOE_ASSIGN_OR_RETURN(gu_bias, loader.Load(gate_up + "_bias", {j, 2 * inter}, at::kCPU));
    FMOE_ASSIGN_OR_RETURN(dn_bias, loader.Load(down + "_bias", {j, h}, at::kCPU));
  }
  auto set_biases = [&](uint32_t e, ExpertWeights* w) {
    if (!info.expert_bias) return;
    w->q[0].bias = gu_bias.select(0, e).slice(0, 0, 2 * inter, 2).contiguous();
    w->q[2].bias = gu_bias.select(0, e).slice(0, 1, 2 * inter, 2).contiguous();
    w->q[1].bias = dn_bias.select(0, e).contiguous();
  };
  if (info.quant.method == QuantMethod::kMxfp4) {
    // "<name>_blocks" [J, out, in/32, 16] and "<name>_scales" [J, out, in/32] in nn.Linear's
    // [out, in] order; gate_up's rows interleave gate (2i) and up (2i + 1). Kept as stored.
    FMOE_ASSIGN_OR_RETURN(at::Tensor gu_blocks, loader.LoadRaw(gate_up + "_blocks", DType::kU8,
                                                               {j, 2 * inter, h / 32, 16}));
    FMOE_ASSIGN_OR_RETURN(at::Tensor gu_scales,
                          loader.LoadRaw(gate_up + "_scales", DType::kU8, {j, 2 * inter, h / 32}));
    FMOE_ASSIGN_OR_RETURN(at::Tensor dn_blocks,
                          loader.LoadRaw(down + "_blocks", DType::kU8, {j, h, inter / 32, 16}));
    FMOE_ASSIGN_OR_RETURN(at::Tensor dn_scales,
                          loader.LoadRaw(down + "_scales", DType::kU8, {j, h, inter / 32}));
    for (uint32_t e = 0; e < info.num_experts; ++e) {
      if (!owned(e)) continue;
      ExpertWeights& w = (*layer_experts)[e];
      w.quant = info.quant;
      const at::Tensor b = gu_blocks.select(0, e).reshape({2 * inter, h / 2});
      const at::Tensor sc = gu_scales.select(0, e);
      w.w1 = b.slice(0, 0, 2 * inter, 2).contiguous();
      w.q[0].scale = sc.slice(0, 0, 2 * inter, 2).contiguous();
      w.w3 = b.slice(0, 1, 2 * inter, 2).contiguous();
      w.q[2].scale = sc.slice(0, 1, 2 * inter, 2).contiguous();
      w.w2 = dn_blocks.select(0, e).reshape({h, inter / 2}).contiguous();
      w.q[1].scale = dn_scales.select(0, e).contiguous();
      set_biases(e, &w);
    }
    return Status::Ok();
  }
  // bfloat16 layout: gate_up_proj [J, h, 2I] with gate and up interleaved in its last dim;
  // down_proj [J, I, h]: x times them.
  FMOE_ASSIGN_OR_RETURN(at::Tensor gu, loader.Load(gate_up, {j, h, 2 * inter}, at::kCPU));
  FMOE_ASSIGN_OR_RETURN(at::Tensor dn, loader.Load(down, {j, inter, h}, at::kCPU));
  for (uint32_t e = 0; e < info.num_experts; ++e) {
    if (!owned(e)) continue;
    ExpertWeights& w = (*layer_experts)[e];
    const at::Tensor g = gu.select(0, e);                 // [h, 2I]
    w.w1 = g.slice(1, 0, 2 * inter, 2).t().contiguous();  // [I, h]
    w.w3 = g.slice(1, 1, 2 * inter, 2).t().contiguous();
    w.w2 = dn.select(0, e).t().contiguous();  // [h, I]
    set_biases(e, &w);
  }
  return Status::Ok();
}

Status MoeModel::LeaveFusedExpertsOnDisk(const ModelInfo& info, const ExpertTensorNames& names,
                                         TensorLoader& loader, const std::string& moe,
                                         const std::function<bool(uint32_t)>& owned,
                                         std::vector<ExpertWeights>* layer_experts) {
  const int64_t h = info.hidden_size, inter = info.intermediate_size, j = info.num_experts;
  const std::string x = moe + "experts.";
  const std::string gate_up = x + names.expert_gate, down = x + names.expert_down;
  // The fused tensors, checked as the in-memory load checks them (a float one must be stored in
  // the compute dtype), and where each is: meta tensors from the loader's sink.
  TensorLoader::DiskSink whole;
  loader.set_disk_sink(&whole);
  struct SinkOff {
    TensorLoader& loader;
    ~SinkOff() { loader.set_disk_sink(nullptr); }
  } sink_off{loader};
  struct Fused {
    at::Tensor meta;
    DiskExtent at;
  };
  std::map<std::string, Fused> fused;
  const auto locate = [&](const std::string& name, Result<at::Tensor> loaded) -> Status {
    if (!loaded.ok()) return loaded.status();
    auto it = whole.find(loaded->unsafeGetTensorImpl());
    if (it == whole.end() || it->second.bytes % static_cast<uint64_t>(j) != 0) {
      return Internal("model: fused expert tensor \"" + name + "\" was not located on disk");
    }
    fused[name] = Fused{*loaded, it->second};
    return Status::Ok();
  };
  const bool mxfp4 = info.quant.method == QuantMethod::kMxfp4;
  if (mxfp4) {
    for (const auto& [name, rows, in] :
         {std::tuple{gate_up, 2 * inter, h}, std::tuple{down, h, inter}}) {
      FMOE_RETURN_IF_ERROR(locate(
          name + "_blocks", loader.LoadRaw(name + "_blocks", DType::kU8, {j, rows, in / 32, 16})));
      FMOE_RETURN_IF_ERROR(locate(
          name + "_scales", loader.LoadRaw(name + "_scales", DType::kU8, {j, rows, in / 32})));
    }
  } else {
    FMOE_RETURN_IF_ERROR(locate(gate_up, loader.Load(gate_up, {j, h, 2 * inter}, at::kCPU)));
    FMOE_RETURN_IF_ERROR(locate(down, loader.Load(down, {j, inter, h}, at::kCPU)));
  }
  if (info.expert_bias) {
    FMOE_RETURN_IF_ERROR(
        locate(gate_up + "_bias", loader.Load(gate_up + "_bias", {j, 2 * inter}, at::kCPU)));
    FMOE_RETURN_IF_ERROR(locate(down + "_bias", loader.Load(down + "_bias", {j, h}, at::kCPU)));
  }
  for (uint32_t e = 0; e < info.num_experts; ++e) {
    if (!owned(e)) continue;
    ExpertWeights& w = (*layer_experts)[e];
    w.quant = info.quant;
    TensorLoader::DiskSink sink;
    // `name`'s region of expert e (the fused tensor's e-th of J equal parts) as the tensor
    // `shape`: part `part` of `ways` (0: all of it), by rows or columns of [rows, cols].
    const auto part = [&](const std::string& name, std::vector<int64_t> shape, uint32_t ways,
                          uint32_t index, bool by_columns, int64_t rows, int64_t cols) {
      const Fused& f = fused.at(name);
      DiskExtent d = f.at;
      d.bytes /= static_cast<uint64_t>(j);
      d.offset += d.bytes * e;
      d.ways = ways;
      d.part = index;
      d.by_columns = by_columns;
      d.rows = static_cast<uint64_t>(rows);
      d.cols = static_cast<uint64_t>(cols);
      d.elem_bytes = static_cast<uint32_t>(f.meta.element_size());
      at::Tensor t = at::empty(shape, f.meta.options());
      sink.emplace(t.unsafeGetTensorImpl(), std::move(d));
      return t;
    };
    if (mxfp4) {
      // Blocks [2I, h/2] and scales [2I, h/32] bytes per expert: gate the even rows, up the odd.
      w.w1 = part(gate_up + "_blocks", {inter, h / 2}, 2, 0, false, 2 * inter, h / 2);
      w.w3 = part(gate_up + "_blocks", {inter, h / 2}, 2, 1, false, 2 * inter, h / 2);
      w.q[0].scale = part(gate_up + "_scales", {inter, h / 32}, 2, 0, false, 2 * inter, h / 32);
      w.q[2].scale = part(gate_up + "_scales", {inter, h / 32}, 2, 1, false, 2 * inter, h / 32);
      w.w2 = part(down + "_blocks", {h, inter / 2}, 0, 0, false, 0, 0);
      w.q[1].scale = part(down + "_scales", {h, inter / 32}, 0, 0, false, 0, 0);
    } else {
      // [h, 2I] per expert: gate the even columns, up the odd, each transposed to [I, h]; down
      // [I, h] transposed to [h, I].
      w.w1 = part(gate_up, {inter, h}, 2, 0, true, h, 2 * inter);
      w.w3 = part(gate_up, {inter, h}, 2, 1, true, h, 2 * inter);
      w.w2 = part(down, {h, inter}, 1, 0, true, inter, h);
    }
    if (info.expert_bias) {
      w.q[0].bias = part(gate_up + "_bias", {inter}, 2, 0, false, 2 * inter, 1);
      w.q[2].bias = part(gate_up + "_bias", {inter}, 2, 1, false, 2 * inter, 1);
      w.q[1].bias = part(down + "_bias", {h}, 0, 0, false, 0, 0);
    }
    FMOE_RETURN_IF_ERROR(KeepOnDisk(sink, &w));
  }
  return Status::Ok();
}

Status MoeModel::LoadOutput(const ModelInfo& info, const Checkpoint& ckpt, TensorLoader& loader,
                            Impl* m) {
  const int64_t h = info.hidden_size, v = info.vocab_size;
  FMOE_ASSIGN_OR_RETURN(m->final_norm, loader.Load("model.norm.weight", {h}));
  if (info.layer_norm) {
    FMOE_ASSIGN_OR_RETURN(m->final_norm_bias, loader.Load("model.norm.bias", {h}));
  }
  if (info.lm_head_bias) {
    FMOE_ASSIGN_OR_RETURN(m->lm_head_bias, loader.Load("lm_head.bias", {v}));
  }
  if (info.tie_word_embeddings && ckpt.Find("lm_head.weight") == nullptr) {
    m->lm_head = m->embed;
  } else {
    FMOE_ASSIGN_OR_RETURN(m->lm_head, loader.Load("lm_head.weight", {v, h}));
  }
  // HF's rotary inverse frequencies, computed the same way in float32.
  m->inv_freq = RotaryInverseFrequencies(info);
  m->rope_factor = RotaryAttentionFactor(info);
  if (info.longrope) {
    m->long_inv_freq = RotaryInverseFrequencies(info, /*long_factors=*/true);
    m->long_rope_factor = RotaryAttentionFactor(info, /*long_factors=*/true);
  }
  return Status::Ok();
}

Status MoeModel::LoadLatentAttention(const ModelInfo& info, TensorLoader& loader,
                                     const std::string& p, MlaWeights* w) {
  const MlaSpec& a = *info.mla;
  const int64_t h = info.hidden_size, n_heads = info.num_attention_heads;
  const int64_t q_dim = n_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim);
  const int64_t r = a.kv_lora_rank, nope = a.qk_nope_head_dim, vd = a.v_head_dim;
  if (a.q_lora_rank == 0) {
    FMOE_ASSIGN_OR_RETURN(w->wq, loader.Load(p + "q_proj.weight", {q_dim, h}));
  } else {
    const int64_t rq = a.q_lora_rank;
    FMOE_ASSIGN_OR_RETURN(w->wq_a, loader.Load(p + "q_a_proj.weight", {rq, h}));
    FMOE_ASSIGN_OR_RETURN(w->q_a_norm, loader.Load(p + "q_a_layernorm.weight", {rq}));
    FMOE_ASSIGN_OR_RETURN(w->wq_b, loader.Load(p + "q_b_proj.weight", {q_dim, rq}));
  }
  FMOE_ASSIGN_OR_RETURN(w->wkv_a,
                        loader.Load(p + "kv_a_proj_with_mqa.weight", {r + a.qk_rope_head_dim, h}));
  FMOE_ASSIGN_OR_RETURN(w->kv_a_norm, loader.Load(p + "kv_a_layernorm.weight", {r}));
  FMOE_ASSIGN_OR_RETURN(at::Tensor kv_b,
                        loader.Load(p + "kv_b_proj.weight", {n_heads * (nope + vd), r}));
  at::Tensor per_head = kv_b.view({n_heads, nope + vd, r});
  // On the host the attention's products run in float32 (ProductDType, blocks.h): these two
  // are only ever used there, so they are kept in it rather than converted at every call.
  const at::ScalarType product = ProductDType(kv_b);
  w->w_uk = per_head.narrow(1, 0, nope).to(product).contiguous();
  w->w_uv = per_head.narrow(1, nope, vd).to(product).contiguous();
  FMOE_ASSIGN_OR_RETURN(w->wo, loader.Load(p + "o_proj.weight", {h, n_heads * vd}));
  return Status::Ok();
}

std::vector<KvPool::LayerShape> MoeModel::KvShapes() const {
  const Impl& m = *impl_;
  const ModelInfo& info = info_;
  std::vector<KvPool::LayerShape> shapes(m.layers.size());
  for (size_t l = 0; l < m.layers.size(); ++l) {
    KvPool::LayerShape& s = shapes[l];
    if (info.mla) {
      s = {1, int64_t{info.mla->kv_lora_rank}, int64_t{info.mla->qk_rope_head_dim}, 0};
    } else {
      s = {int64_t{info.num_key_value_heads}, int64_t{info.head_dim}, int64_t{info.head_dim},
           m.layers[l].attention.window};
    }
  }
  return shapes;
}

uint64_t MoeModel::kv_block_bytes() const {
  return KvPool::BlockBytes(KvShapes(), c10::typeMetaToScalarType(impl_->opts().dtype()));
}

void MoeModel::ConfigureKv(const KvPoolOptions& options) {
  const Impl& m = *impl_;
  const ModelInfo& info = info_;
  std::vector<KvPool::LayerShape> shapes = KvShapes();
  KvPoolOptions kv = options;
  // LongRoPE rotates a prompt's keys by the sequence's length at the Forward that computes them,
  // so a cached prefix's keys are not those a longer prompt would compute: no prefix caching.
  if (info.longrope) kv.prefix_caching = false;
  pool_ = std::make_shared<KvPool>(std::move(shapes), m.opts(), kv);
}

std::unique_ptr<KvCache> MoeModel::NewKvCache() {
  if (!pool_) ConfigureKv({});
  return std::make_unique<KvCache>(pool_);
}

Status MoeModel::MaterializeKv() {
  if (!pool_) ConfigureKv({});
  if (const std::optional<KvArena>& a = pool_->arena()) {
    const uint64_t block = kv_block_bytes();
    if (block == 0 || a->page_bytes % block != 0 || a->page_bytes < block || a->base == nullptr ||
        a->floor_pages == 0 || a->max_pages == 0 || a->floor_pages > a->pages ||
        a->max_pages > a->pages) {
      return InvalidArgument("model: a KV arena of " + std::to_string(a->pages) + " pages of " +
                             std::to_string(a->page_bytes) + " bytes (floor " +
                             std::to_string(a->floor_pages) + ", at most " +
                             std::to_string(a->max_pages) + ") does not hold whole KV blocks of " +
                             std::to_string(block) + " bytes");
    }
  }
  const std::string what = "model: the KV pool's " + std::to_string(pool_->figures().bytes) +
                           " bytes could not be allocated (lower kv_cache_tokens): ";
  try {
    pool_->Materialize();
  } catch (const c10::Error& e) {
    return ResourceExhausted(what + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return ResourceExhausted(what + e.what());
  }
  return Status::Ok();
}

KvPoolFigures MoeModel::kv_figures() const { return pool_ ? pool_->figures() : KvPoolFigures{}; }

uint64_t MoeModel::kv_capacity_tokens() const {
  return pool_ && pool_->fixed() ? pool_->capacity_tokens() : 0;
}

Status MoeModel::Forward(std::span<const SequenceInput> batch, ExpertSource& experts,
                         ForwardObserver* observer, ForwardResult* out, bool record_router) {
  // A LibTorch error (a shape, a device, memory) ends this batch with a Status, never the
  // process (the engine ends the batch's requests with an error event).
  try {
    return ForwardImpl(batch, experts, observer, out, record_router);
  } catch (const c10::Error& e) {
    return Internal(std::string("model: forward: LibTorch: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Internal(std::string("model: forward: ") + e.what());
  }
}

Status MoeModel::ForwardImpl(std::span<const SequenceInput> inputs, ExpertSource& experts,
                             ForwardObserver* observer, ForwardResult* out, bool record_router) {
  c10::InferenceMode guard;
  Impl& m = *impl_;
  Batch batch;
  batch.inputs = inputs;
  batch.observer = observer;
  batch.out = out;
  batch.record_router = record_router && out != nullptr;
  std::vector<int64_t> ids;
  int64_t max_end = 0;
  FMOE_RETURN_IF_ERROR(LayOutBatch(&batch, &ids, &max_end));
  if (out != nullptr) {
    out->logits.assign(inputs.size(), {});
    out->prompt_logprobs.assign(inputs.size(), {});
    out->router_probs.clear();
    out->router_topk.clear();
    out->failed.clear();
  }
  if (batch.rows == 0) return Status::Ok();
  GrowRotaryTables(max_end);
  FMOE_RETURN_IF_ERROR(ReserveKv(&batch));

  at::Tensor id_tensor = at::tensor(ids, at::TensorOptions().dtype(at::kLong)).to(m.device);
  at::Tensor x = m.embed.index_select(0, id_tensor);  // [rows, h]
  std::vector<SequenceInfo> sequences(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    sequences[i] = {inputs[i].request_id, inputs[i].iteration,
                    static_cast<uint32_t>(inputs[i].tokens.size()),
                    inputs[i].prefill || inputs[i].iteration == 0};
  }
  if (observer != nullptr) ObserveIterationStart(x, batch, sequences);

  experts.BeginIteration(sequences);
  struct IterationEnd {
    ExpertSource& source;
    ~IterationEnd() { source.EndIteration(); }
  } iteration_end{experts};
  std::vector<SequenceFailure> failed;
  FMOE_RETURN_IF_ERROR(RunLayers(batch, experts, &x, &failed));
  // No one to tell which sequences failed: the batch fails, as any Forward error.
  if (out == nullptr && !failed.empty()) return failed.front().error;
  std::sort(failed.begin(), failed.end(), [](const SequenceFailure& a, const SequenceFailure& b) {
    return a.sequence < b.sequence;
  });
  std::vector<bool> ok(inputs.size(), true);
  for (const SequenceFailure& f : failed) ok[f.sequence] = false;

  if (out != nullptr) {
    CollectLogits(x, batch, out);
    for (const SequenceFailure& f : failed) {
      out->logits[f.sequence].clear();
      out->prompt_logprobs[f.sequence] = {};
    }
    out->failed = std::move(failed);
  }
  // A failed sequence's hidden state went wrong at the failure, so the keys and values written
  // after it are wrong too: its KV cache keeps its length (nothing published for the prefix
  // cache), and the observer does not see the iteration end (as for a failed Forward).
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (ok[i]) inputs[i].kv->Advance(inputs[i].tokens);
  }
  if (observer != nullptr) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (ok[i]) observer->OnIterationEnd(inputs[i].request_id, inputs[i].iteration);
    }
  }
  return Status::Ok();
}

Status MoeModel::LayOutBatch(Batch* batch, std::vector<int64_t>* ids, int64_t* max_end) const {
  const ModelInfo& info = info_;
  const int64_t vocab = info.vocab_size;
  const std::span<const SequenceInput> inputs = batch->inputs;
  batch->offset.assign(inputs.size() + 1, 0);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const SequenceInput& s = inputs[i];
    if (s.kv == nullptr || s.tokens.empty()) {
      return InvalidArgument("req=" + std::to_string(s.request_id) + ": no tokens or no KV cache");
    }
    const int64_t end = s.kv->length() + static_cast<int64_t>(s.tokens.size());
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
      ids->push_back(s.tokens[t]);
    }
    if (s.next_token >= vocab) {
      return InvalidArgument("req=" + std::to_string(s.request_id) + ": the next prompt token " +
                             std::to_string(s.next_token) + " is out of range (vocab " +
                             std::to_string(vocab) + ")");
    }
    batch->offset[i + 1] = batch->offset[i] + static_cast<int64_t>(s.tokens.size());
    *max_end = std::max(*max_end, end);
  }
  batch->rows = batch->offset.back();
  return Status::Ok();
}

void MoeModel::GrowRotaryTables(int64_t max_end) {
  Impl& m = *impl_;
  if (m.rope.cos.defined() && m.rope.cos.size(0) >= max_end) return;
  const int64_t n = std::max<int64_t>(max_end, m.rope.cos.defined() ? 2 * m.rope.cos.size(0) : 256);
  at::Tensor freqs = at::outer(at::arange(n, at::kLong).to(at::kFloat), m.inv_freq);
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  m.rope.cos = (emb.cos() * m.rope_factor).to(m.device, m.dtype);
  m.rope.sin = (emb.sin() * m.rope_factor).to(m.device, m.dtype);
  if (m.long_inv_freq.defined()) {
    at::Tensor long_freqs = at::outer(at::arange(n, at::kLong).to(at::kFloat), m.long_inv_freq);
    at::Tensor long_emb = at::cat({long_freqs, long_freqs}, -1);
    m.rope.long_cos = (long_emb.cos() * m.long_rope_factor).to(m.device, m.dtype);
    m.rope.long_sin = (long_emb.sin() * m.long_rope_factor).to(m.device, m.dtype);
    m.rope.long_after = info_.longrope->original_max_position_embeddings;
  }
}

Status MoeModel::ReserveKv(Batch* batch) const {
  const std::span<const SequenceInput> inputs = batch->inputs;
  const Impl& m = *impl_;
  for (const SequenceInput& s : inputs) {
    if (&s.kv->pool() != pool_.get()) {
      return FailedPrecondition("req=" + std::to_string(s.request_id) +
                                ": its KV cache is in a pool the model no longer uses");
    }
    if (!s.kv->Reserve(static_cast<int64_t>(s.tokens.size()))) {
      const KvPoolFigures f = pool_->figures();
      return ResourceExhausted("req=" + std::to_string(s.request_id) +
                               ": the KV pool has no room for " + std::to_string(s.tokens.size()) +
                               " more positions (" +
                               std::to_string(f.total_blocks - f.used_blocks) + " of " +
                               std::to_string(f.total_blocks) + " blocks free)");
    }
  }
  const size_t groups = pool_->groups();
  batch->slots.assign(groups, std::vector<at::Tensor>(inputs.size()));
  batch->first.assign(groups, std::vector<int64_t>(inputs.size(), 0));
  for (size_t g = 0; g < groups; ++g) {
    const int64_t window = pool_->window(static_cast<int>(g));
    for (size_t i = 0; i < inputs.size(); ++i) {
      const int64_t p0 = inputs[i].kv->length();
      const int64_t end = p0 + static_cast<int64_t>(inputs[i].tokens.size());
      // A sliding layer's first new query (position p0) sees positions > p0 - window.
      const int64_t first = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0;
      batch->first[g][i] = first;
      batch->slots[g][i] = inputs[i].kv->Slots(static_cast<int>(g), first, end, m.device);
    }
  }
  return Status::Ok();
}

void MoeModel::ObserveIterationStart(const at::Tensor& x, const Batch& batch,
                                     const std::vector<SequenceInfo>& sequences) const {
  ForwardObserver* observer = batch.observer;
  observer->OnBatchStart(sequences);
  at::Tensor xf = x.to(at::kCPU, at::kFloat);
  for (size_t i = 0; i < batch.inputs.size(); ++i) {
    at::Tensor sem =
        xf.narrow(0, batch.offset[i], batch.offset[i + 1] - batch.offset[i]).mean(0).contiguous();
    observer->OnIterationStart(batch.inputs[i].request_id, batch.inputs[i].iteration,
                               {sem.data_ptr<float>(), static_cast<size_t>(info_.hidden_size)});
  }
}

Status MoeModel::RunLayers(const Batch& batch, ExpertSource& experts, at::Tensor* hidden,
                           std::vector<SequenceFailure>* failed) {
  const Impl& m = *impl_;
  const ModelInfo& info = info_;
  at::Tensor& x = *hidden;
  std::vector<AttentionSpan> spans(batch.inputs.size());
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const Layer& layer = m.layers[l];
    const int g = pool_->group_of(l);
    for (size_t i = 0; i < batch.inputs.size(); ++i) {
      spans[i] = {batch.offset[i],
                  batch.offset[i + 1] - batch.offset[i],
                  batch.inputs[i].kv->length(),
                  &pool_->k(l),
                  &pool_->v(l),
                  batch.slots[g][i],
                  batch.first[g][i]};
    }
    at::Tensor normed = DecoderNorm(info, x, layer.input_norm, layer.input_norm_bias);
    x = x + (info.mla ? LatentAttention(info, layer.latent, normed, spans, m.rope,
                                        m.options.row_block, m.options.attention_score_budget)
                      : Attention(info, layer.attention, normed, spans, m.rope, m.options.row_block,
                                  m.options.attention_score_budget));
    at::Tensor hn = DecoderNorm(info, x, layer.post_norm, layer.post_norm_bias);
    if (layer.moe == kDense) {
      x = x + SwiGlu(hn, layer.dense.gate, layer.dense.up, layer.dense.down, m.options.row_block);
      continue;
    }
    FMOE_ASSIGN_OR_RETURN(at::Tensor moe,
                          MixtureOfExperts(layer.moe, x, hn, batch, experts, failed));
    x = x + moe;
  }
  return Status::Ok();
}

void MoeModel::CollectLogits(const at::Tensor& x, const Batch& batch, ForwardResult* out) const {
  const Impl& m = *impl_;
  const std::span<const SequenceInput> inputs = batch.inputs;
  const int64_t vocab = info_.vocab_size;
  // Logits of the rows asked for.
  std::vector<int64_t> logit_rows;
  auto rows_of = [&](size_t i) -> int64_t {
    if (inputs[i].no_logits) return 0;
    return inputs[i].all_logits ? batch.offset[i + 1] - batch.offset[i] : 1;
  };
  for (size_t i = 0; i < inputs.size(); ++i) {
    for (int64_t r = batch.offset[i + 1] - rows_of(i); r < batch.offset[i + 1]; ++r) {
      logit_rows.push_back(r);
    }
  }
  if (!logit_rows.empty()) {
    at::Tensor sel = x.index_select(
        0, at::tensor(logit_rows, at::TensorOptions().dtype(at::kLong)).to(m.device));
    at::Tensor logits = LogitsOf(sel).to(at::kCPU, at::kFloat).contiguous();
    const float* lp = logits.data_ptr<float>();
    size_t row = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto n = static_cast<size_t>(rows_of(i));
      out->logits[i].assign(lp + row * vocab, lp + (row + n) * vocab);
      row += n;
    }
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].prompt_logprobs < 0) continue;
    PromptLogprobsOf(x, batch.offset[i], inputs[i], &out->prompt_logprobs[i]);
  }
}

at::Tensor MoeModel::LogitsOf(const at::Tensor& hidden) const {
  const Impl& m = *impl_;
  return BlockLinear(DecoderNorm(info_, hidden, m.final_norm, m.final_norm_bias), m.lm_head,
                     m.options.row_block, m.lm_head_bias);
}

void MoeModel::PromptLogprobsOf(const at::Tensor& x, int64_t first_row, const SequenceInput& in,
                                PromptLogprobs* out) const {
  // Row r predicts new token r + 1, or next_token after the last new token.
  const int64_t n = static_cast<int64_t>(in.tokens.size()) - (in.next_token >= 0 ? 0 : 1);
  const int64_t vocab = info_.vocab_size;
  const int64_t top_n = std::min<int64_t>(in.prompt_logprobs, vocab);
  out->top_n = static_cast<uint32_t>(top_n);
  out->logprob.resize(static_cast<size_t>(std::max<int64_t>(n, 0)));
  out->top.resize(out->logprob.size() * static_cast<size_t>(top_n));
  // Rows of at most kChunk tokens at a time, so a long prompt never holds [tokens x vocab]
  // logits; each row's logits are the ones the last token's come from (the same row blocks).
  constexpr int64_t kChunk = 256;
  for (int64_t r0 = 0; r0 < n; r0 += kChunk) {
    const int64_t rows = std::min(kChunk, n - r0);
    at::Tensor h = x.narrow(0, first_row + r0, rows);
    at::Tensor logprobs = at::log_softmax(LogitsOf(h).to(at::kFloat), -1);
    // Finite on the wire whatever the model gave, as the sampler's (kMinLogprob).
    logprobs = at::nan_to_num(logprobs, kMinLogprob, 0.0, kMinLogprob).clamp_min(kMinLogprob);
    std::vector<int64_t> next(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      const auto t = static_cast<size_t>(r0 + r + 1);
      next[static_cast<size_t>(r)] = t < in.tokens.size() ? in.tokens[t] : in.next_token;
    }
    at::Tensor targets =
        at::tensor(next, at::TensorOptions().dtype(at::kLong)).to(logprobs.device()).unsqueeze(1);
    at::Tensor picked = logprobs.gather(1, targets).squeeze(1).to(at::kCPU).contiguous();
    std::copy_n(picked.data_ptr<float>(), rows, out->logprob.begin() + r0);
    if (top_n == 0) continue;
    auto [values, ids] = logprobs.topk(top_n, -1);
    at::Tensor v = values.to(at::kCPU).contiguous();
    at::Tensor d = ids.to(at::kCPU).contiguous();
    const float* vp = v.data_ptr<float>();
    const int64_t* dp = d.data_ptr<int64_t>();
    for (int64_t k = 0; k < rows * top_n; ++k) {
      out->top[static_cast<size_t>(r0 * top_n + k)] = {static_cast<int32_t>(dp[k]), vp[k]};
    }
  }
}

// One MoE layer's routing: per row the gate distribution over all J experts, the top-k picked
// and their weights (common/model/routing.h).
struct MoeModel::LayerRoute {
  std::vector<float> probs;     // [rows, J]
  std::vector<int32_t> chosen;  // [rows, K]
  std::vector<float> weights;   // [rows, K]
};

// Rows (ascending) and weights per expert; each sequence's tokens per expert. A row's k picked
// experts fill its k slots in ascending expert order: slot r * K + s holds the weighted output
// of row r's s-th smallest expert.
struct MoeModel::ExpertAssignment {
  std::vector<std::vector<int64_t>> rows;   // Per expert.
  std::vector<std::vector<int64_t>> slots;  // Per expert.
  std::vector<std::vector<float>> weights;  // Per expert.
  std::vector<uint32_t> sequence_counts;    // [sequences, J]
  std::vector<uint32_t> used, used_tokens;  // The experts picked, ascending, and their rows.
};

Result<at::Tensor> MoeModel::MixtureOfExperts(uint32_t l, const at::Tensor& x, const at::Tensor& hn,
                                              const Batch& batch, ExpertSource& experts,
                                              std::vector<SequenceFailure>* failed) {
  const Layer& layer = impl_->layers[info_.moe_layers[l]];
  FMOE_ASSIGN_OR_RETURN(LayerRoute route, RouteLayer(l, layer, hn, batch));
  const ExpertAssignment assignment = AssignExperts(l, route, batch);
  Speculate(l, x, batch, experts);
  const LayerRouting routing{l, assignment.used, assignment.used_tokens,
                             assignment.sequence_counts};
  FMOE_RETURN_IF_ERROR(experts.BeginLayer(routing));
  at::Tensor slots;
  const Status status = RunRoutedExperts(l, hn, batch, assignment, experts, &slots, failed);
  experts.EndLayer();
  FMOE_RETURN_IF_ERROR(status);
  return CombineExperts(layer, hn, batch.rows, &slots);
}

Result<MoeModel::LayerRoute> MoeModel::RouteLayer(uint32_t l, const Layer& layer,
                                                  const at::Tensor& hn, const Batch& batch) const {
  const Impl& m = *impl_;
  const int64_t rows = batch.rows, n_experts = info_.num_experts, top_k = info_.top_k;
  // On the CPU in float32, as every family's reference does.
  at::Tensor logits_cpu = BlockLinear(hn, layer.gate, m.options.row_block, layer.gate_bias)
                              .to(at::kCPU, at::kFloat)
                              .contiguous();
  LayerRoute route;
  route.probs.resize(static_cast<size_t>(rows * n_experts));
  route.chosen.resize(static_cast<size_t>(rows * top_k));
  route.weights.resize(static_cast<size_t>(rows * top_k));
  FMOE_RETURN_IF_ERROR(
      RouteTokens(info_.routing, static_cast<size_t>(rows),
                  {logits_cpu.data_ptr<float>(), static_cast<size_t>(rows * n_experts)},
                  route.probs, route.chosen, route.weights, layer.router_bias));
  if (batch.observer != nullptr) {
    for (size_t i = 0; i < batch.inputs.size(); ++i) {
      // The mean over the sequence's rows, as torch's mean(0) in float32.
      at::Tensor seq = at::from_blob(route.probs.data() + batch.offset[i] * n_experts,
                                     {batch.offset[i + 1] - batch.offset[i], n_experts}, at::kFloat)
                           .mean(0)
                           .contiguous();
      batch.observer->OnLayerGates(batch.inputs[i].request_id, batch.inputs[i].iteration, l,
                                   {seq.data_ptr<float>(), static_cast<size_t>(n_experts)});
    }
  }
  if (batch.record_router) {
    batch.out->router_probs.push_back(route.probs);
    batch.out->router_topk.push_back(route.chosen);
  }
  return route;
}

MoeModel::ExpertAssignment MoeModel::AssignExperts(uint32_t l, const LayerRoute& route,
                                                   const Batch& batch) const {
  const std::span<const SequenceInput> inputs = batch.inputs;
  const int64_t n_experts = info_.num_experts, top_k = info_.top_k;
  ExpertAssignment a;
  a.rows.resize(n_experts);
  a.slots.resize(n_experts);
  a.weights.resize(n_experts);
  a.sequence_counts.assign(inputs.size() * n_experts, 0);
  for (size_t i = 0; i < inputs.size(); ++i) {
    for (int64_t r = batch.offset[i]; r < batch.offset[i + 1]; ++r) {
      for (int64_t s = 0; s < top_k; ++s) {
        const int64_t e = route.chosen[r * top_k + s];
        int64_t smaller = 0;
        for (int64_t o = 0; o < top_k; ++o) smaller += route.chosen[r * top_k + o] < e ? 1 : 0;
        a.rows[e].push_back(r);
        a.slots[e].push_back(r * top_k + smaller);
        a.weights[e].push_back(route.weights[r * top_k + s]);
        ++a.sequence_counts[i * n_experts + e];
      }
    }
  }
  for (int64_t e = 0; e < n_experts; ++e) {
    if (a.rows[e].empty()) continue;
    a.used.push_back(static_cast<uint32_t>(e));
    a.used_tokens.push_back(static_cast<uint32_t>(a.rows[e].size()));
  }
  if (batch.observer != nullptr) {
    std::vector<uint32_t> seq_experts, seq_tokens;
    for (size_t i = 0; i < inputs.size(); ++i) {
      seq_experts.clear();
      seq_tokens.clear();
      for (int64_t e = 0; e < n_experts; ++e) {
        const uint32_t n = a.sequence_counts[i * n_experts + e];
        if (n == 0) continue;
        seq_experts.push_back(static_cast<uint32_t>(e));
        seq_tokens.push_back(n);
      }
      batch.observer->OnLayerRouting(inputs[i].request_id, inputs[i].iteration, l, seq_experts,
                                     seq_tokens);
    }
  }
  return a;
}

Status MoeModel::RunRoutedExperts(uint32_t l, const at::Tensor& hn, const Batch& batch,
                                  const ExpertAssignment& a, ExpertSource& experts,
                                  at::Tensor* slots, std::vector<SequenceFailure>* failed) const {
  const Impl& m = *impl_;
  const int64_t rows = batch.rows;
  const int64_t n_experts = info_.num_experts;
  const ExpertActivation activation{info_.swiglu_limit.value_or(0.0)};
  // Hybrid execution on a device: the activations come down once, before the device's work on
  // the resident experts is queued, so the host runs overlap with it.
  at::Tensor hn_host;
  if (!hn.is_cpu() && experts.HostRunsPlanned()) hn_host = hn.to(at::kCPU);
  // Experts arrive in the order the source has them ready; each output goes to its own slots,
  // so the result never depends on that order.
  *slots = at::zeros({rows * info_.top_k, int64_t{info_.hidden_size}}, m.opts());
  std::vector<bool> done(static_cast<size_t>(n_experts), false);
  while (true) {
    Result<SourcedExpert> next = experts.Next();
    if (!next.ok()) {
      if (next.status().code() != ErrorCode::kNotFound) return next.status();
      return Status::Ok();
    }
    const uint32_t e = next->expert;
    const ExpertWeights& w = next->weights;
    if (e >= n_experts || a.rows[e].empty() || done[e]) {
      return Internal("model: expert source handed out expert " + std::to_string(e) +
                      " of MoE layer " + std::to_string(l) + ", which the gate did not pick");
    }
    if (!next->failed.ok()) {
      // Nothing is computed for it: its slots stay zero. Only the sequences whose rows picked it
      // fail; the other rows never meet its slots (a row sums its own slots only).
      FailSequences(l, e, next->failed, a.rows[e], batch.offset, failed);
      done[e] = true;
      experts.Done(e);
      continue;
    }
    at::Tensor ye;
    // The CPU kernel: a host run of hybrid execution, and in cpu mode every quantized expert,
    // computed from its stored bytes (DESIGN section 12) in the compute dtypes it takes.
    const bool cpu_kernel_dtype = m.dtype == at::kFloat || m.dtype == at::kBFloat16;
    if (w.w1.is_cpu() && (!hn.is_cpu() || (w.quantized() && cpu_kernel_dtype))) {
      if (!hn.is_cpu() && !hn_host.defined()) hn_host = hn.to(at::kCPU);
      const at::Tensor& x = hn.is_cpu() ? hn : hn_host;
      FMOE_ASSIGN_OR_RETURN(at::Tensor host, CpuSwiGlu(SelectRows(x, a.rows[e]), w, activation));
      ye = host.to(m.device, m.dtype);
    } else {
      // A quantized expert's stored bytes are dequantized for its product only. cpu mode computes
      // a float expert's host run with the same function as any other expert, so hybrid
      // execution there changes no value.
      FMOE_ASSIGN_OR_RETURN(const ExpertWeights f, DequantizeExpert(w, m.dtype));
      ye = ExpertGlu(SelectRows(hn, a.rows[e]), f.w1, f.w3, f.w2, f.q[0].bias, f.q[2].bias,
                     f.q[1].bias, activation.swiglu_limit, m.options.row_block);
    }
    PlaceWeightedRows(ye, a.slots[e], a.weights[e], *slots);
    done[e] = true;
    experts.Done(e);
  }
}

Result<at::Tensor> MoeModel::CombineExperts(const Layer& layer, const at::Tensor& hn, int64_t rows,
                                            at::Tensor* slots) const {
  const Impl& m = *impl_;
  const int64_t top_k = info_.top_k;
  // Expert parallelism (DESIGN section 7): this rank filled the slots of the experts it owns;
  // every slot has one owner, so the combination is exact and the same on every rank.
  if (group_ != nullptr) FMOE_RETURN_IF_ERROR(group_->CombineDisjoint(*slots));
  // Each row's experts summed in ascending expert order, whatever the group's size.
  at::Tensor moe = SumSlots(*slots, rows, top_k);
  if (layer.shared.gate.defined()) {
    // The shared expert: dense, resident, computed by every rank of a group.
    at::Tensor shared =
        SwiGlu(hn, layer.shared.gate, layer.shared.up, layer.shared.down, m.options.row_block);
    if (layer.shared_gate.defined()) shared = at::sigmoid(m.Linear(hn, layer.shared_gate)) * shared;
    moe = moe + shared;
  }
  return moe;
}

// Speculative prediction (DESIGN section 6): the gates of the next d MoE layers applied to this
// layer's hidden state; per expert, the fraction of tokens whose top-k would pick it: over the
// whole batch for the source, over each sequence's own rows for the observer (a trace recorder
// records per request). The source gets its own distance's targets only, the observer its own:
// the products beyond the source's distance change nothing but what the observer sees.
void MoeModel::Speculate(uint32_t l, const at::Tensor& x, const Batch& batch,
                         ExpertSource& experts) {
  Impl& m = *impl_;
  const ModelInfo& info = info_;
  ForwardObserver* observer = batch.observer;
  const int64_t rows = batch.rows, n_experts = info.num_experts, top_k = info.top_k;
  const size_t source_distance = experts.speculation_distance();
  const size_t observer_distance = observer != nullptr ? observer->speculation_distance() : 0;
  const size_t distance = std::max(source_distance, observer_distance);
  for (size_t t = l + 1; t < info.num_moe_layers && t <= l + distance; ++t) {
    const Layer& ahead = m.layers[info.moe_layers[t]];
    at::Tensor logits = BlockLinear(DecoderNorm(info, x, ahead.post_norm, ahead.post_norm_bias),
                                    ahead.gate, m.options.row_block, ahead.gate_bias);
    std::vector<int64_t> picked(static_cast<size_t>(rows * top_k));
    const RoutingSpec& spec = info.routing;
    if (spec.scoring != RouterScoring::kSigmoid && spec.groups == GroupScoring::kNone &&
        !spec.correction_bias) {
      // The softmax keeps the logits' order, and sparsemixer picks the two largest logits: their
      // top-k is the router's.
      at::Tensor top = std::get<1>(logits.topk(top_k, -1)).to(at::kCPU).contiguous();
      std::copy_n(top.data_ptr<int64_t>(), picked.size(), picked.begin());
    } else {
      // Sigmoid scores, a correction bias or groups: the router's own choice.
      at::Tensor lc = logits.to(at::kCPU, at::kFloat).contiguous();
      std::vector<float> probs(static_cast<size_t>(rows * n_experts));
      std::vector<int32_t> chosen(picked.size());
      std::vector<float> weights(picked.size());
      if (!RouteTokens(spec, static_cast<size_t>(rows),
                       {lc.data_ptr<float>(), static_cast<size_t>(rows * n_experts)}, probs, chosen,
                       weights, ahead.router_bias)
               .ok()) {
        return;  // A guess only: the layer's own routing reports the error.
      }
      std::copy(chosen.begin(), chosen.end(), picked.begin());
    }
    std::vector<float> share(static_cast<size_t>(n_experts), 0.0f);
    const int64_t* pk = picked.data();
    for (int64_t k = 0; k < rows * top_k; ++k) share[pk[k]] += 1.0f / static_cast<float>(rows);
    if (t <= l + source_distance) experts.Speculate(l, static_cast<uint32_t>(t), share);
    if (t <= l + observer_distance) {
      std::vector<uint32_t> counts(static_cast<size_t>(n_experts));
      std::vector<float> own(static_cast<size_t>(n_experts));
      for (size_t i = 0; i < batch.inputs.size(); ++i) {
        std::fill(counts.begin(), counts.end(), 0u);
        for (int64_t k = batch.offset[i] * top_k; k < batch.offset[i + 1] * top_k; ++k) {
          ++counts[pk[k]];
        }
        const float seq_rows = static_cast<float>(batch.offset[i + 1] - batch.offset[i]);
        for (int64_t e = 0; e < n_experts; ++e) own[e] = static_cast<float>(counts[e]) / seq_rows;
        observer->OnSpeculation(batch.inputs[i].request_id, batch.inputs[i].iteration, l,
                                static_cast<uint32_t>(t), own);
      }
    }
  }
}

}  // namespace fmoe
