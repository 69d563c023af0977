// The model runtime: a Mixture-of-Experts decoder in LibTorch (Mixtral, Qwen2-MoE, Qwen3-MoE,
// OLMoE, DeepSeek-V2/V3: a stack of blocks.h's blocks picked by the ModelInfo flags that the
// family's file in common/model/families/ sets, found by the tensor names it gives), loaded from a
// Hugging Face checkpoint, running one iteration of a ragged batch: each sequence brings its new
// tokens (the whole prompt in prefill, one token in decode) and its own KV cache. Dense weights
// live here; routed experts are reached only through an ExpertSource. One owner thread (the
// engine's); nothing here is thread-safe.
//
// Batch invariance: a sequence's logits do not depend on what else is in the batch. Attention
// runs per sequence; every matrix product on the CPU runs through the host kernel
// (gpu_worker/kernels/cpu_gemm.h), whose accumulation order depends on nothing but the inner
// dimension, or (float16) over fixed blocks of `row_block` rows, the last one zero-padded, so a
// row meets the same BLAS kernel wherever it sits.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "common/clock.h"
#include "common/model/model_config.h"
#include "common/status.h"
#include "gpu_worker/experts/expert_source.h"
#include "gpu_worker/model/kv_pool.h"
#include "gpu_worker/model/tensor_loader.h"
#include "gpu_worker/observe/forward_observer.h"

namespace fmoe {

class Checkpoint;
class ExpertGroup;
struct AttentionWeights;
struct ExpertTensorNames;
struct MlaWeights;
struct MlpWeights;

struct RuntimeOptions {
  std::string dtype = "float32";  // Compute dtype: float32 | bfloat16 | float16. Default: float32
  int cuda_index = -1;            // -1 = cpu. Default: -1
  // Batch invariance of the CPU's matrix products: > 0 runs them through the host kernel
  // (float32, bfloat16) or LibTorch over fixed blocks of this many rows (other dtypes); 0 = one
  // LibTorch product over all rows (not invariant). Default: 4
  int row_block = 4;
  // Elements of one block of attention scores: a prefill whose [heads, tokens, keys] scores are
  // larger runs its queries in blocks (QueryBlockRows). Default: 2^26 (256 MiB in float32)
  int64_t attention_score_budget = int64_t{1} << 26;
  // Expert parallelism: Load reads only the routed experts with (l * J + j) % world == rank;
  // the others stay undefined in the table. Default: rank 0 of 1 (every expert)
  uint32_t expert_rank = 0;
  uint32_t expert_world_size = 1;
  // Leave this rank's routed experts on disk (the host tier reads them when needed, DESIGN
  // section 13): Load records where each expert's tensors are (ExpertWeights::disk) and reads
  // none of them. Experts must be used as stored (no dtype conversion); an expert fused into one
  // tensor per layer (gpt-oss) is its part of that tensor, split and scattered when read. Default:
  // off
  bool experts_on_disk = false;
};

struct SequenceInput {
  uint64_t request_id = 0;
  uint32_t iteration = 0;           // The request's Forwards before this one (SequenceInfo).
  std::span<const int32_t> tokens;  // New tokens, at positions kv->length() onwards.
  KvCache* kv = nullptr;
  bool prefill = false;     // `tokens` are prompt tokens (the prompt or a chunk of it).
  bool all_logits = false;  // Logits of every new token (tests), else of the last only.
  bool no_logits = false;   // No logits at all (a prompt chunk before the last).
  // >= 0: the log-probabilities of new tokens 1.. given the tokens before each (and of
  // `next_token` after the last, when it is >= 0), and the top `prompt_logprobs` there
  // (ForwardResult::prompt_logprobs), computed where the logits are.
  int32_t prompt_logprobs = -1;
  // A prompt chunk before the last: the prompt's token after the chunk, whose log-probability the
  // chunk's last row gives (prompt_logprobs). -1: none.
  int32_t next_token = -1;
};

// One sequence's log-probabilities of its new tokens after the first (TokenEvent's prompt
// logprobs): logprob[i] is token i + 1's; top[i * top_n ..] the top_n likeliest (id,
// log-probability) pairs there, likeliest first. From the raw logits' log_softmax.
struct PromptLogprobs {
  std::vector<float> logprob;
  uint32_t top_n = 0;
  std::vector<std::pair<int32_t, float>> top;
};

// A sequence of the batch that Forward could not compute: a routed expert its rows picked could
// not be had (the source handed it out failed: ExpertSource::Next).
struct SequenceFailure {
  size_t sequence = 0;  // Its index in the batch.
  uint32_t layer = 0;   // The MoE layer and the expert.
  uint32_t expert = 0;
  // "expert E of MoE layer L could not be read: " and the source's error (with a host tier:
  // "host tier: expert E of layer L: tensor \"NAME\": PATH: bytes [A, B): ...").
  Status error;
};

struct ForwardResult {
  // Per sequence: row-major [rows x vocab], rows = tokens.size() or 1 (0 with no_logits; 0 for
  // a failed sequence).
  std::vector<std::vector<float>> logits;
  // Per sequence: filled for those whose input asked (prompt_logprobs >= 0), else empty.
  std::vector<PromptLogprobs> prompt_logprobs;
  // With record_router: per MoE layer, [total new tokens x J] router probabilities and
  // [total new tokens x K] chosen experts, rows in batch order.
  std::vector<std::vector<float>> router_probs;
  std::vector<std::vector<int32_t>> router_topk;
  // The sequences an expert's failure touched, by ascending index, once each (the first
  // failure): no logits or prompt logprobs, the KV cache not advanced (what the Forward wrote
  // past its length is never read or published), no OnIterationEnd. Rows are independent in
  // every layer (attention per sequence, the MoE per row), so every other sequence's results
  // are exactly what they would have been had the expert been read.
  std::vector<SequenceFailure> failed;
};

class MoeModel {
 public:
  ~MoeModel();

  // Loads the dense weights from info.dir and the routed experts into `experts` (host memory,
  // compute dtype; experts[l] is MoE layer l). Errors name the file and tensor: "model:
  // /m/model.safetensors: tensor \"model.layers.0.self_attn.q_proj.weight\": shape [64, 32],
  // expected [64, 64]"; a family the runtime does not run is kFailedPrecondition; a LibTorch
  // error becomes kInternal naming the model.
  static Result<std::unique_ptr<MoeModel>> Load(const ModelInfo& info,
                                                const RuntimeOptions& options,
                                                const LoadProgress& progress, ExpertTable* experts);

  const ModelInfo& info() const { return info_; }
  // The paged KV pool (kv_pool.h), replacing the one before (caches made from it keep it). Until
  // this is called the pool grows on demand.
  void ConfigureKv(const KvPoolOptions& options);
  // A fixed pool's tensors allocated now (at start, not at the first request): kResourceExhausted
  // naming the bytes when the device cannot hold them; kInvalidArgument for an arena whose pages
  // do not hold whole blocks.
  Status MaterializeKv();
  // Bytes of one KV block (16 positions) of the full-attention layers at the compute dtype: the
  // page quantum of one device budget (KvPoolOptions::arena).
  uint64_t kv_block_bytes() const;
  // One device budget: borrowed pages nobody references go back to the expert cache
  // (KvPool::ReturnIdle, on the steady clock). Between Forwards.
  uint32_t ReturnIdleKv() { return pool_ ? pool_->ReturnIdle(SteadyNowUs() / 1000) : 0; }
  // The pool's arena (one device budget), or null.
  const KvArena* kv_arena() const { return pool_ && pool_->arena() ? &*pool_->arena() : nullptr; }
  // An empty cache in the pool.
  std::unique_ptr<KvCache> NewKvCache();
  KvPoolFigures kv_figures() const;
  // Positions one sequence can reach in a fixed pool; 0 when it grows on demand.
  uint64_t kv_capacity_tokens() const;

  // Expert parallelism (DESIGN section 7): every rank of `group` runs the same Forward; each
  // computes the routed experts it owns and the group combines their outputs after each layer.
  // Null (the default) or a group of one: this rank computes every expert.
  void set_group(ExpertGroup* group) { group_ = group; }

  // Runs one iteration. Appends each sequence's new tokens to its KV cache. kInvalidArgument for
  // a token id out of range or a sequence past max_position_embeddings; a LibTorch error is
  // kInternal (the KV caches of the batch are then unusable: end its requests). An expert the
  // source hands out failed fails only the sequences that picked it (ForwardResult::failed; the
  // Forward is Ok); with `out` null, the first such failure is returned as the Forward's error.
  // `out` may be null (a rank that does not sample): no logits are computed. `observer` (may be
  // null) is called as forward_observer.h describes; speculative gates are computed up to the
  // larger of the source's and the observer's distance, and each sees only the targets within its
  // own.
  Status Forward(std::span<const SequenceInput> batch, ExpertSource& experts,
                 ForwardObserver* observer, ForwardResult* out, bool record_router = false);

 private:
  struct Layer;
  struct Impl;
  struct Batch;
  explicit MoeModel(ModelInfo info);
  static Result<std::unique_ptr<MoeModel>> LoadImpl(const ModelInfo& info,
                                                    const RuntimeOptions& options,
                                                    const LoadProgress& progress,
                                                    ExpertTable* experts);
  // LoadImpl's steps: the checks before anything is read; per layer the attention (grouped-query
  // or latent), a SwiGLU MLP (dense layers, shared experts), the MoE block (router, shared
  // expert, the routed experts this rank owns, in host memory; the others skipped); the final
  // norm, lm_head and rotary frequencies.
  static Status LoadFusedExperts(const ModelInfo& info, const ExpertTensorNames& names,
                                 const RuntimeOptions& options, TensorLoader& loader,
                                 const std::string& moe, uint32_t moe_layer,
                                 std::vector<ExpertWeights>* layer_experts);
  static void LogSkippedLayers(const ModelInfo& info, const Checkpoint& ckpt);
  static Status CheckLoadable(const ModelInfo& info, const RuntimeOptions& options);
  static Status LoadAttention(const ModelInfo& info, TensorLoader& loader,
                              const std::string& prefix, AttentionWeights* w);
  static Status LoadLatentAttention(const ModelInfo& info, TensorLoader& loader,
                                    const std::string& prefix, MlaWeights* w);
  static Status LoadMlp(TensorLoader& loader, const std::string& prefix, int64_t width, int64_t h,
                        MlpWeights* w);
  static Status LoadMoeBlock(const ModelInfo& info, const ExpertTensorNames& names,
                             const RuntimeOptions& options, TensorLoader& loader,
                             const std::string& prefix, Layer* layer,
                             std::vector<ExpertWeights>* layer_experts);
  static Status LoadOutput(const ModelInfo& info, const Checkpoint& ckpt, TensorLoader& loader,
                           Impl* m);
  // An expert left on disk: its tensors' extents from the loader's sink, in Tensors() order.
  static Status KeepOnDisk(const TensorLoader::DiskSink& sink, ExpertWeights* w);
  // LoadFusedExperts with experts left on disk: each owned expert's tensors on the meta device in
  // the shapes the in-memory load slices out, each one's extent its expert's part of the fused
  // tensor (gate and up split by row or column, the float layout transposed).
  static Status LeaveFusedExpertsOnDisk(const ModelInfo& info, const ExpertTensorNames& names,
                                        TensorLoader& loader, const std::string& moe,
                                        const std::function<bool(uint32_t)>& owned,
                                        std::vector<ExpertWeights>* layer_experts);
  // Forward's steps, in order.
  Status ForwardImpl(std::span<const SequenceInput> batch, ExpertSource& experts,
                     ForwardObserver* observer, ForwardResult* out, bool record_router);
  // Checks the batch's sequences (a KV cache, tokens in the vocabulary, positions within
  // max_position_embeddings) and lays out their rows: batch->offset and rows, the token ids in
  // row order, the furthest position any sequence reaches.
  Status LayOutBatch(Batch* batch, std::vector<int64_t>* ids, int64_t* max_end) const;
  // The rotary tables up to position `max_end` (doubling).
  void GrowRotaryTables(int64_t max_end);
  std::vector<KvPool::LayerShape> KvShapes() const;
  // Each sequence's blocks for its new tokens (kResourceExhausted when a fixed pool is full),
  // and per layer group and sequence the pool rows its attention reads (Batch::slots).
  Status ReserveKv(Batch* batch) const;
  // The observer's OnBatchStart and each sequence's OnIterationStart (its mean embedding).
  void ObserveIterationStart(const at::Tensor& x, const Batch& batch,
                             const std::vector<SequenceInfo>& sequences) const;
  // Every decoder layer over the hidden state: norm, attention, norm, then the dense MLP or the
  // mixture of experts, each added to the residual.
  Status RunLayers(const Batch& batch, ExpertSource& experts, at::Tensor* hidden,
                   std::vector<SequenceFailure>* failed);
  // The logits of the rows asked for and the prompt logprobs, into `out`.
  void CollectLogits(const at::Tensor& x, const Batch& batch, ForwardResult* out) const;
  // MoE layer l over the normed hidden state `hn`: routing, observer calls, speculation (from the
  // residual `x`), the routed experts through the source, the group's combine, the shared expert.
  Result<at::Tensor> MixtureOfExperts(uint32_t l, const at::Tensor& x, const at::Tensor& hn,
                                      const Batch& batch, ExpertSource& experts,
                                      std::vector<SequenceFailure>* failed);
  // Its steps, in order: the gate (the observer's OnLayerGates, the router record); the rows,
  // slots and weights of each expert picked (the observer's OnLayerRouting); the routed experts
  // as the source hands them out, into their slots (hybrid host runs included; a failed one
  // leaves its slots zero and fails the sequences whose rows picked it); the group's
  // combine, each row's slots summed in expert order and the shared expert added.
  struct LayerRoute;
  struct ExpertAssignment;
  Result<LayerRoute> RouteLayer(uint32_t l, const Layer& layer, const at::Tensor& hn,
                                const Batch& batch) const;
  ExpertAssignment AssignExperts(uint32_t l, const LayerRoute& route, const Batch& batch) const;
  Status RunRoutedExperts(uint32_t l, const at::Tensor& hn, const Batch& batch,
                          const ExpertAssignment& a, ExpertSource& experts, at::Tensor* slots,
                          std::vector<SequenceFailure>* failed) const;
  Result<at::Tensor> CombineExperts(const Layer& layer, const at::Tensor& hn, int64_t rows,
                                    at::Tensor* slots) const;
  void Speculate(uint32_t l, const at::Tensor& x, const Batch& batch, ExpertSource& experts);
  // The final norm and lm_head over final hidden states: [rows, vocab] in the compute dtype.
  at::Tensor LogitsOf(const at::Tensor& hidden) const;
  // The prompt logprobs of `in`, whose new tokens' final hidden states are x's rows from
  // `first_row`.
  void PromptLogprobsOf(const at::Tensor& x, int64_t first_row, const SequenceInput& in,
                        PromptLogprobs* out) const;
  std::shared_ptr<KvPool> pool_;  // Made on first use when not configured.
  ModelInfo info_;
  std::unique_ptr<Impl> impl_;
  ExpertGroup* group_ = nullptr;
};

}  // namespace fmoe
