// GPT-2-style decoder in plain LibTorch: token and position embeddings, pre-LayerNorm blocks with causal
// self-attention (scaled_dot_product_attention) and a GELU MLP, a final LayerNorm and a language-model
// head optionally tied to the token embedding. Parameter names follow GPT-2 (wte, wpe, h.N.ln_1,
// h.N.attn.c_attn, h.N.attn.c_proj, h.N.ln_2, h.N.mlp.c_fc, h.N.mlp.c_proj, ln_f, lm_head).
//
// The only FSDP-specific line is the type of `GPTImpl::blocks`: fsdp::FSDPModule<Block> instead of
// Block, so that each block's forward goes through fully_shard's hooks once the block is sharded.
// Sharding itself is applied outside the model, in parallelize() (parallelize.cpp). model_plain.h is
// the same model without even that line (--model-impl plain).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "fsdp/fsdp/fully_shard.h"
#include "fsdp/tensor/parallel/tensor_parallel.h"
#include "fsdp/tensor/random.h"

namespace train_gpt {

/// Shape of the model: GPT-2 (arch "gpt2", model.h) or Llama (arch "llama", model_llama.h). Byte-level
/// tokens by default: vocab_size 256 covers any UTF-8 text. The Llama-only fields are ignored for GPT-2.
struct GPTConfig {
  std::string arch = "gpt2";  ///< "gpt2" (GPT, PlainGPT) or "llama" (Llama)
  int64_t vocab_size = 256;
  int64_t block_size = 128;  ///< context length (tokens): GPT-2's learned positions; Llama's training window
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  double dropout = 0.0;
  bool tie_weights = true;  ///< lm_head.weight is wte.weight (Llama: model.embed_tokens.weight)
  // Llama only (Hugging Face LlamaConfig's names in the comments).
  int64_t n_kv_head = 0;           ///< num_key_value_heads (grouped-query attention); 0: n_head
  int64_t intermediate_size = 0;   ///< the SwiGLU MLP's width; 0: 4 * n_embd
  double norm_eps = 1e-5;          ///< rms_norm_eps (GPT-2: layer_norm_epsilon, fixed at 1e-5)
  double rope_theta = 10000.0;     ///< the RoPE base
  std::string rope_type = "default";  ///< "default" (none) or "llama3" (Llama 3.1's frequency scaling)
  double rope_factor = 8.0, rope_low_freq_factor = 1.0, rope_high_freq_factor = 4.0;  ///< llama3 scaling
  int64_t rope_original_max_positions = 8192;  ///< llama3: original_max_position_embeddings
  int64_t max_positions = 0;  ///< max_position_embeddings for config.json; 0: block_size

  int64_t kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int64_t mlp_width() const { return intermediate_size > 0 ? intermediate_size : 4 * n_embd; }
  int64_t head_dim() const { return n_embd / n_head; }
  bool is_llama() const { return arch == "llama"; }
};

/// Names of the presets, smallest first ("tiny" is for tests).
const std::vector<std::string>& preset_names();
/// The preset `name`. Throws std::invalid_argument naming the known presets when unknown.
GPTConfig preset(const std::string& name);
/// Throws std::invalid_argument (naming the value and the fix) if `cfg` cannot build a model,
/// e.g. n_embd % n_head != 0.
void validate(const GPTConfig& cfg);
/// "4 layers, 4 heads, 128 dims, context 128, vocab 256, tied".
std::string describe(const GPTConfig& cfg);

/// GPT-2's initialisation of `model`'s parameters, by name (both variants, GPT and PlainGPT, share their
/// parameter names): weights ~ N(0, 0.02), the residual projections (*.c_proj.weight) ~ N(0, 0.02 /
/// sqrt(2 * n_layer)), biases 0, LayerNorms (1, 0). Visits the parameters in registration order (a tied
/// weight once), so a seeded global generator fixes them. Returns the number of distinct elements.
int64_t init_gpt2_weights(torch::nn::Module& model, const GPTConfig& cfg);
/// `model`'s parameters without duplicates (a tied weight once): what the optimizer and gradient clipping
/// must see. Module::parameters() lists a tied weight under both of its names.
std::vector<torch::Tensor> unique_parameters(const torch::nn::Module& model);

/// Dropout from the DTensor RNG (issue 35; --tp with --dropout, or --dtensor-rng): each mask is this rank's
/// piece of the mask one process would draw for the whole global batch (fsdp::random::dropout), so every
/// layout (dp x tp, sequence parallel or not) trains alike and the TP ranks of a replicated activation drop
/// the same elements. Set by parallelize() on the modules that drop; null: LibTorch's own dropout.
struct TPDropout {
  fsdp::DeviceMeshPtr mesh;                  ///< the run's mesh (its root is seeded with fsdp::manual_seed)
  std::vector<fsdp::Placement> replicated;   ///< [B, T, C] replicated over tp: Shard(0) on the data dims
  std::vector<fsdp::Placement> residual;     ///< the blocks' residual stream: `replicated` or, with SP, Shard(1) on tp
  std::vector<fsdp::Placement> heads;        ///< attention probabilities [B, H / tp, T, T]: Shard(1) on tp
  /// `x` through dropout with probability p in training mode, its mask laid out as `placements` (even splits).
  torch::Tensor operator()(const torch::Tensor& x, double p, bool training,
                           const std::vector<fsdp::Placement>& placements) const {
    return fsdp::random::dropout(x, p, training, mesh, placements);
  }
};

/// Causal multi-head self-attention: one fused qkv projection (c_attn), SDPA with is_causal, c_proj.
struct CausalSelfAttentionImpl : torch::nn::Module {
  explicit CausalSelfAttentionImpl(const GPTConfig& cfg);
  torch::Tensor forward(const torch::Tensor& x);  // [B, T, C] -> [B, T, C]

  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};
  torch::nn::Dropout resid_dropout{nullptr};
  int64_t n_head;
  double dropout;
  /// Set by parallelize() under tensor parallelism (--tp): c_attn is column-parallel, and this rank
  /// computes n_head / tp heads (fsdp::tp::local_heads_of_fused), which the row-parallel c_proj sums.
  fsdp::DeviceMeshPtr tp_mesh;
  /// Set by parallelize() with the DTensor RNG: attention dropout on explicit probabilities (SDPA draws from
  /// the default generator), resid_dropout on the residual stream's layout.
  std::shared_ptr<const TPDropout> rng;
};
TORCH_MODULE(CausalSelfAttention);

/// Position-wise MLP: c_fc (C -> 4C), GELU (tanh approximation, as GPT-2), c_proj (4C -> C).
struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(const GPTConfig& cfg);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear c_fc{nullptr}, c_proj{nullptr};
  torch::nn::Dropout dropout{nullptr};
  std::shared_ptr<const TPDropout> rng;  ///< as CausalSelfAttentionImpl::rng
};
TORCH_MODULE(MLP);

/// Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). The unit of sharding.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const GPTConfig& cfg);
  torch::Tensor forward(torch::Tensor x);

  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  MLP mlp{nullptr};
};
TORCH_MODULE(Block);

/// The head: logits = x @ weight^T. A module of its own (not a torch::nn::Linear) so that its weight
/// can be registered as the very tensor of wte.weight when tied: one parameter under two names, which
/// fully_shard shards once (both names live in the root group).
struct LMHeadImpl : torch::nn::Module {
  /// A fresh [vocab, n_embd] weight, or `tied` (registered as is) when defined.
  LMHeadImpl(const GPTConfig& cfg, torch::Tensor tied);
  torch::Tensor forward(const torch::Tensor& x) { return torch::nn::functional::linear(x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(LMHead);

struct GPTImpl : torch::nn::Module {
  /// Builds the model with GPT-2's initialisation (draws from the global torch generator: seed it with
  /// torch::manual_seed first so that every rank builds the same weights).
  explicit GPTImpl(const GPTConfig& cfg);
  /// Logits [B, T, vocab] of the tokens `idx` [B, T] (int64, T <= block_size). With loss_parallel_mesh set
  /// and in training mode: this TP rank's vocabulary columns [B, T, vocab / tp] (for lm_loss's
  /// vocab_parallel_cross_entropy); in eval mode gathered whole.
  torch::Tensor forward(const torch::Tensor& idx);

  /// Parameters without duplicates (a tied weight appears once): see train_gpt::unique_parameters.
  std::vector<torch::Tensor> unique_parameters() const { return train_gpt::unique_parameters(*this); }
  /// Number of distinct parameter elements (the full model, whether or not it is sharded).
  int64_t num_params() const { return num_params_; }

  GPTConfig cfg;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleList h;                       // registers the blocks as "h.0", "h.1", ...
  std::vector<fsdp::FSDPModule<Block>> blocks;   // the same modules, called through FSDP
  torch::nn::LayerNorm ln_f{nullptr};
  LMHead lm_head{nullptr};
  /// Set by parallelize() with --sequence-parallel: the TP mesh over which the residual stream is split along
  /// the sequence between the first and the last block. The split and the gather are plan entries
  /// (tp::PrepareModuleInput on h.0, tp::PrepareModuleOutput on the last block, run by the blocks' holders);
  /// the forward does not read this field (generate() does: it pads the sequence to a multiple of tp).
  fsdp::DeviceMeshPtr sequence_parallel_mesh;
  /// The tokens' positions for wpe, int64 [T], when defined; undefined (the default): 0..T-1. Set by train_gpt
  /// with --cp around each microbatch: fsdp::experimental::context_parallel shards it with the tokens, so that
  /// each CP rank embeds its load-balanced positions (PyTorch's models take it as a buffer, e.g. freqs_cis).
  torch::Tensor positions;
  /// Set by parallelize() with loss_parallel (issue 35): wte and the tied lm_head are vocabulary-parallel over
  /// this TP mesh, and forward returns vocabulary-sharded logits in training mode.
  fsdp::DeviceMeshPtr loss_parallel_mesh;
  std::shared_ptr<const TPDropout> rng;  ///< as CausalSelfAttentionImpl::rng (the embeddings' dropout)

 private:
  int64_t num_params_ = 0;
};
TORCH_MODULE(GPT);

/// The blocks [begin, end) of `n_layer` that pipeline stage `stage` of `num_stages` holds: an even split,
/// the first n_layer % num_stages stages one block more (torchtitan's default split of the layers).
std::pair<int64_t, int64_t> stage_layers(int64_t n_layer, int stage, int num_stages);

/// The head of a last pipeline stage: `head` itself when untied or when the stage is also the first; tied, a
/// new LMHead whose weight is a copy of the tied weight (a parameter of its own, same name lm_head.weight).
LMHead stage_head(const GPTConfig& cfg, const LMHead& head, bool is_first);

/// One pipeline stage of a GPT (--pp, pipeline.h): the model's own modules (shared, not copied) of blocks
/// [first_layer, end_layer), with the embeddings (wte, wpe) on the first stage and the final LayerNorm and
/// the head (ln_f, lm_head) on the last. Its parameters keep the whole model's names ("h.5.attn.c_attn.weight"
/// stays that, wte and ln_f keep theirs), so a stage's state dict and optimizer keys are the unpipelined
/// model's. forward maps one tensor to one: token ids [B, T] -> hidden states [B, T, C] on the first stage,
/// hidden states -> hidden states in between, -> logits [B, T, vocab] on the last (all three on one stage
/// when it is both). Tied weights: the last stage's lm_head.weight is a copy of wte.weight (stage_head), which
/// the trainer keeps equal to the first stage's by summing their gradients (pipeline.h).
struct GPTStageImpl : torch::nn::Module {
  GPTStageImpl(const GPTImpl& model, int64_t first_layer, int64_t end_layer, bool is_first, bool is_last);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Embedding wte{nullptr}, wpe{nullptr};  // first stage only
  torch::nn::Dropout drop{nullptr};
  /// The blocks under their index in the whole model ("h.5"): a ModuleDict keyed "5", not a ModuleList,
  /// which would renumber them from 0.
  torch::nn::ModuleDict h;
  std::vector<fsdp::FSDPModule<Block>> blocks;  // the same modules, called through FSDP
  torch::nn::LayerNorm ln_f{nullptr};  // last stage only
  LMHead lm_head{nullptr};             // last stage only
  int64_t block_size;
  /// --sequence-parallel (set by parallelize()): the first stage's h.0 splits the residual stream along the
  /// sequence, the stages pass their sequence shards on, the last block gathers it (plan entries, as GPTImpl's).
  fsdp::DeviceMeshPtr sequence_parallel_mesh;
};
TORCH_MODULE(GPTStage);

}  // namespace train_gpt
