// Llama-family decoder in plain LibTorch, beside GPT-2 (model.h), for `--model llama-*` and `--init-from` a
// Hugging Face LlamaForCausalLM folder: token embedding, pre-RMSNorm decoder layers with rotary position
// embeddings (RoPE, optionally with Llama 3.1's frequency scaling) and grouped-query attention through
// scaled_dot_product_attention, a SwiGLU MLP, a final RMSNorm and an untied (or tied) head.
//
// Parameter names are Hugging Face's LlamaForCausalLM's, so that its safetensors map 1:1 (no renaming, no
// permutation: RoPE rotates halves, transformers' rotate_half convention, not interleaved pairs):
//   model.embed_tokens.weight                          [vocab, C]
//   model.layers.N.input_layernorm.weight              [C]
//   model.layers.N.self_attn.{q,k,v,o}_proj.weight     q, o: [C, C]; k, v: [n_kv_head * D, C] (D = C / n_head)
//   model.layers.N.post_attention_layernorm.weight     [C]
//   model.layers.N.mlp.{gate,up}_proj.weight           [I, C]; down_proj: [C, I]
//   model.norm.weight                                  [C]
//   lm_head.weight                                     [vocab, C] (absent from HF files when tied)
// The arithmetic is transformers' (modeling_llama.py) op for op: RMSNorm in fp32 then cast back, cos/sin from
// fp32 frequencies cast to the activations' dtype, silu(gate) * up. As GPT, the decoder layers are declared as
// fsdp::FSDPModule<LlamaDecoderLayer> (the units of fully_shard, parallelize.cpp); no other libfsdp type.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "fsdp/fsdp/fully_shard.h"
#include "model.h"  // GPTConfig (arch "llama"), LMHead, unique_parameters

namespace train_gpt {

// ---- The formulas, as functions (tests/python/test_llama.py checks each against transformers') ---------

/// RMSNorm as transformers' LlamaRMSNorm: x in fp32 times rsqrt(mean(x^2, -1) + eps), cast back to x's dtype,
/// times `weight`. x: [..., C] any floating dtype; weight: [C]. Returns x's shape, in the promoted dtype of
/// weight and x (x's when they agree). Example: `rms_norm(x, w, 1e-5)`.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

/// RoPE's inverse frequencies [D / 2] (fp32, on the CPU) for cfg.head_dim() = D: 1 / theta^(2i / D), then, with
/// cfg.rope_type "llama3", Llama 3.1's scaling (transformers' _compute_llama3_parameters): wavelengths longer than
/// original_max_positions / low_freq_factor divided by `factor`, those shorter than original / high_freq_factor
/// kept, those between interpolated smoothly. Throws std::invalid_argument for another rope_type.
/// Example: `rope_inv_freq(preset("llama3-8b"))`.
torch::Tensor rope_inv_freq(const GPTConfig& cfg);

/// cos and sin [T, D] (fp32) of positions 0..T-1: freqs = pos * inv_freq, duplicated (cat(freqs, freqs)) as
/// transformers' LlamaRotaryEmbedding. Example: `auto [cos, sin] = rope_cos_sin(rope_inv_freq(cfg), 16);`
std::pair<torch::Tensor, torch::Tensor> rope_cos_sin(const torch::Tensor& inv_freq, int64_t T);

/// cat(-x2, x1) of the halves x1, x2 of x's last dim (transformers' rotate_half: the halves, not interleaved pairs,
/// are rotated together, so Hugging Face's q_proj/k_proj rows need no permutation). x: [..., D], D even; same shape
/// and dtype out. Example: `rotate_half(torch::arange(4.))` is [-2, -3, 0, 1].
torch::Tensor rotate_half(const torch::Tensor& x);

/// x * cos + rotate_half(x) * sin: x [B, H, T, D]; cos, sin [T, D] in x's dtype (broadcast over B and H). Returns
/// [B, H, T, D]. Example: `auto [cos, sin] = cache.get(T, q.device(), q.scalar_type()); q = apply_rotary(q, cos, sin);`
torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

/// Causal grouped-query attention: q [B, H, T, D], k and v [B, KV, T, D] with H a multiple of KV (query head h
/// uses key/value head h / (H / KV), as transformers' repeat_kv), through torch::scaled_dot_product_attention
/// (is_causal, enable_gqa: no copy of k and v). Returns [B, H, T, D] in q's dtype. Throws c10::Error when KV does not
/// divide H. Example: `gqa_attention(q, k, v, /*dropout_p=*/0.0)` with q [2, 8, 16, 64], k and v [2, 2, 16, 64].
torch::Tensor gqa_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double dropout_p);

// ---- Modules ------------------------------------------------------------------------------------------

/// RMSNorm with a learned scale (`weight` [dim], initialised to ones): forward is rms_norm(x, weight, eps), x [..., dim].
/// Example: `RMSNorm norm(4096, 1e-5); auto y = norm(x);`
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x) { return rms_norm(x, weight, eps); }
  torch::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

/// cos/sin of one model, computed once per (length, device, dtype) and shared by its layers: not a module and no
/// buffer, so that state dicts and checkpoints hold exactly Hugging Face's keys (its inv_freq is not persistent).
class RotaryCache {
 public:
  /// Nothing is computed yet (the model may be built on the meta device by deferred_init).
  explicit RotaryCache(const GPTConfig& cfg) : cfg_(cfg) {}
  /// cos and sin [T, D] on `device` in `dtype` (computed in fp32 on the CPU, then cast and moved, as transformers;
  /// kept until another T, device or dtype is asked for). Throws std::invalid_argument for an unknown rope_type.
  /// Example: `auto [cos, sin] = rope->get(x.size(1), x.device(), x.scalar_type());`
  std::pair<torch::Tensor, torch::Tensor> get(int64_t T, const torch::Device& device, torch::ScalarType dtype);

 private:
  GPTConfig cfg_;
  torch::Tensor inv_freq_;  // fp32, CPU
  torch::Tensor cos_, sin_;  // the last ones handed out
};

/// Multi-head attention with grouped key/value heads and RoPE on q and k; no biases. Weights q_proj [H * D, C],
/// k_proj and v_proj [KV * D, C], o_proj [C, H * D]. forward: [B, T, C] -> [B, T, C] in x's dtype.
struct LlamaAttentionImpl : torch::nn::Module {
  LlamaAttentionImpl(const GPTConfig& cfg, std::shared_ptr<RotaryCache> rope);
  torch::Tensor forward(const torch::Tensor& x);  // [B, T, C] -> [B, T, C]

  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  int64_t n_head, n_kv_head, head_dim;
  double dropout;
  std::shared_ptr<RotaryCache> rope;
};
TORCH_MODULE(LlamaAttention);

/// SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)); no biases. gate_proj and up_proj [I, C], down_proj [C, I];
/// forward: [..., C] -> [..., C].
struct LlamaMLPImpl : torch::nn::Module {
  explicit LlamaMLPImpl(const GPTConfig& cfg);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

/// x + self_attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)): [B, T, C] -> [B, T, C]. The unit
/// of sharding (one fully_shard group per layer). Its modules are registered in Hugging Face's order.
struct LlamaDecoderLayerImpl : torch::nn::Module {
  LlamaDecoderLayerImpl(const GPTConfig& cfg, std::shared_ptr<RotaryCache> rope);
  torch::Tensor forward(torch::Tensor x);

  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

/// Hugging Face's LlamaModel: embed_tokens, layers, norm (the "model." of the parameter names).
struct LlamaModelImpl : torch::nn::Module {
  LlamaModelImpl(const GPTConfig& cfg, const std::shared_ptr<RotaryCache>& rope);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers;  // "layers.0", ...
  RMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaModel);

/// Hugging Face's LlamaForCausalLM: `model` and `lm_head`. The same members as GPTImpl that the trainer uses
/// (cfg, blocks, num_params(), unique_parameters(), sequence_parallel_mesh), so main.cpp's one train() runs both.
struct LlamaImpl : torch::nn::Module {
  /// Builds the model with Hugging Face's initialisation for Llama (every matrix ~ N(0, 0.02), norms 1), drawn
  /// from the global torch generator in registration order (seed it first: every rank builds the same weights).
  /// Throws std::invalid_argument (validate()) for a shape it cannot build.
  explicit LlamaImpl(const GPTConfig& cfg);
  /// Logits [B, T, vocab] (in the compute dtype) of the tokens `idx` [B, T] (int64, T <= block_size; a longer
  /// sequence throws c10::Error). Example: `fsdp::FSDPModule<Llama> model(preset("llama-tiny")); auto y = model(idx);`
  torch::Tensor forward(const torch::Tensor& idx);

  /// Parameters without duplicates (a tied head once): what the optimizer and clipping see.
  std::vector<torch::Tensor> unique_parameters() const { return train_gpt::unique_parameters(*this); }
  /// Distinct parameter elements of the full model (sharded or not).
  int64_t num_params() const { return num_params_; }

  GPTConfig cfg;
  LlamaModel model{nullptr};
  LMHead lm_head{nullptr};
  std::vector<fsdp::FSDPModule<LlamaDecoderLayer>> blocks;  // model->layers, called through FSDP
  /// model->embed_tokens and lm_head, called through FSDP too: untied, each is a fully_shard group of its own
  /// (torchtitan's layout: an 8B model's 1B embedding and head parameters are not all gathered at once).
  fsdp::FSDPModule<torch::nn::Embedding> embed{nullptr};
  fsdp::FSDPModule<LMHead> head{nullptr};
  /// --sequence-parallel: the TP mesh (set by parallelize()). The split and the gather of the sequence are plan
  /// entries on `embed` and `head` ([Note: sequence boundaries in train_gpt]); only generate() reads it (padding).
  fsdp::DeviceMeshPtr sequence_parallel_mesh;

 private:
  int64_t num_params_ = 0;
  std::shared_ptr<RotaryCache> rope_;
};
TORCH_MODULE(Llama);

/// The same Llama as unchanged LibTorch code (--model-impl plain): no libfsdp type, the decoder layers called through
/// the ModuleList (`->as<LlamaDecoderLayerImpl>()`), as any LibTorch model is written; fully_shard follows the layers'
/// parameters at tensor level (implicit groups, include/fsdp/fsdp/fully_shard.h). Same names, registration order,
/// initialisation from a seed, arithmetic and checkpoints as Llama.
struct PlainLlamaImpl : torch::nn::Module {
  /// As LlamaImpl(cfg).
  explicit PlainLlamaImpl(const GPTConfig& cfg);
  /// Logits [B, T, vocab] of the tokens `idx` [B, T] (int64, T <= block_size).
  torch::Tensor forward(const torch::Tensor& idx);

  std::vector<torch::Tensor> unique_parameters() const { return train_gpt::unique_parameters(*this); }
  int64_t num_params() const { return num_params_; }

  GPTConfig cfg;
  LlamaModel model{nullptr};
  LMHead lm_head{nullptr};
  /// --sequence-parallel: the TP mesh over which forward splits the sequence after the embedding and gathers it
  /// before model.norm (no call boundary in this unchanged model for plan entries to do it).
  fsdp::DeviceMeshPtr sequence_parallel_mesh;

 private:
  int64_t num_params_ = 0;
  std::shared_ptr<RotaryCache> rope_;
};
TORCH_MODULE(PlainLlama);

/// One pipeline stage of a Llama (--pp, pipeline.h), as GPTStage (model.h): the model's own modules of decoder
/// layers [first_layer, end_layer) under Hugging Face's names ("model.layers.5.self_attn.q_proj.weight"; a
/// "model" container holding a ModuleDict "layers" keyed by the layer's index), model.embed_tokens on the first
/// stage, model.norm and lm_head on the last (tied: lm_head a copy, stage_head). Holder variant: the embedding,
/// the layers and the head are called through FSDPModule holders, as Llama's forward calls them.
struct LlamaStageImpl : torch::nn::Module {
  LlamaStageImpl(const LlamaImpl& model, int64_t first_layer, int64_t end_layer, bool is_first, bool is_last);
  torch::Tensor forward(const torch::Tensor& x);

  GPTConfig cfg;
  std::shared_ptr<torch::nn::Module> model;  // "model": embed_tokens, layers, norm (those of this stage)
  torch::nn::ModuleDict layers;
  LMHead lm_head{nullptr};  // last stage only
  std::vector<fsdp::FSDPModule<LlamaDecoderLayer>> blocks;
  fsdp::FSDPModule<torch::nn::Embedding> embed{nullptr};  // first stage only
  RMSNorm norm{nullptr};                                  // last stage only
  fsdp::FSDPModule<LMHead> head{nullptr};                 // last stage only
  fsdp::DeviceMeshPtr sequence_parallel_mesh;  ///< as Llama's (plan entries split and gather)
};
TORCH_MODULE(LlamaStage);

/// The same for PlainLlama (--model-impl plain): the layers called directly, as PlainLlama's forward does.
struct PlainLlamaStageImpl : torch::nn::Module {
  PlainLlamaStageImpl(const PlainLlamaImpl& model, int64_t first_layer, int64_t end_layer, bool is_first, bool is_last);
  torch::Tensor forward(const torch::Tensor& x);

  GPTConfig cfg;
  std::shared_ptr<torch::nn::Module> model;
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleDict layers;
  RMSNorm norm{nullptr};
  LMHead lm_head{nullptr};
  fsdp::DeviceMeshPtr sequence_parallel_mesh;  ///< as PlainLlama's: forward splits after embed_tokens, gathers before norm
};
TORCH_MODULE(PlainLlamaStage);

}  // namespace train_gpt
