// The same GPT as model.h (--model-impl plain), written as any LibTorch model is, with no libfsdp type:
// the blocks in a torch::nn::ModuleList called through `->as<PlainBlock>()`, the MLP a
// torch::nn::Sequential (c_fc, GELU, c_proj, dropout). fully_shard works on it unchanged, as PyTorch's
// fully_shard works on any nn.Module: it sees the blocks' parameters being used at tensor level (see
// include/fsdp/fsdp/fully_shard.h), so nothing in the model has to route its calls through FSDP.
//
// Same parameter names (h.N.mlp.c_fc.weight, ... the Sequential's children are named), same registration
// order, hence the same initialisation from a seed and the same distributed checkpoints as GPT: a
// checkpoint written by either variant resumes in the other. Same arithmetic to the bit (see
// PlainBlockImpl::forward for the one place that takes care).
#pragma once

#include <torch/torch.h>

#include "model.h"  // GPTConfig, CausalSelfAttention, LMHead, init_gpt2_weights (plain LibTorch modules)

namespace train_gpt {

/// Pre-LayerNorm transformer block, as BlockImpl, with the MLP as a torch::nn::Sequential.
struct PlainBlockImpl : torch::nn::Module {
  explicit PlainBlockImpl(const GPTConfig& cfg);
  torch::Tensor forward(torch::Tensor x);  // [B, T, C] -> [B, T, C]

  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::Sequential mlp{nullptr};  // c_fc (C -> 4C), gelu (tanh), c_proj (4C -> C), dropout
};
TORCH_MODULE(PlainBlock);

struct PlainGPTImpl : torch::nn::Module {
  /// Builds the model with GPT-2's initialisation (seed the global torch generator first): the same
  /// weights as GPT(cfg) from the same seed.
  explicit PlainGPTImpl(const GPTConfig& cfg);
  /// Logits [B, T, vocab] of the tokens `idx` [B, T] (int64, T <= block_size).
  torch::Tensor forward(const torch::Tensor& idx);

  /// Parameters without duplicates (a tied weight once): see train_gpt::unique_parameters.
  std::vector<torch::Tensor> unique_parameters() const { return train_gpt::unique_parameters(*this); }
  int64_t num_params() const { return num_params_; }

  GPTConfig cfg;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleList h;  // the blocks, "h.0", "h.1", ...: what parallelize() shards one by one
  torch::nn::LayerNorm ln_f{nullptr};
  LMHead lm_head{nullptr};
  /// As GPTImpl::sequence_parallel_mesh (--sequence-parallel).
  fsdp::DeviceMeshPtr sequence_parallel_mesh;

 private:
  int64_t num_params_ = 0;
};
TORCH_MODULE(PlainGPT);

/// One pipeline stage of a PlainGPT (--pp with --model-impl plain), as GPTStage (model.h): the model's own
/// modules of blocks [first_layer, end_layer) under their whole-model names (a ModuleDict "h" keyed by the
/// block's index), wte/wpe on the first stage, ln_f/lm_head on the last; the blocks are called as the model
/// calls them (no libfsdp type: fully_shard follows them at tensor level).
struct PlainGPTStageImpl : torch::nn::Module {
  PlainGPTStageImpl(const PlainGPTImpl& model, int64_t first_layer, int64_t end_layer, bool is_first, bool is_last);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleDict h;
  torch::nn::LayerNorm ln_f{nullptr};
  LMHead lm_head{nullptr};
  int64_t block_size;
  /// --sequence-parallel (set by parallelize()): the first stage splits the residual stream along the sequence
  /// after the embeddings, the stages pass their sequence shards on, the last gathers it before ln_f.
  fsdp::DeviceMeshPtr sequence_parallel_mesh;
};
TORCH_MODULE(PlainGPTStage);

}  // namespace train_gpt
