// train_gpt's optimizer: AdamW with weight decay on matrices and embeddings only, PyTorch's foreach
// kernels on CUDA, and the learning-rate schedule (linear warmup, cosine decay).
#pragma once

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "options.h"

namespace train_gpt {

/// AdamW's two parameter groups: weight decay on matrices and embeddings (dim >= 2), not on biases and
/// LayerNorms. Decided on the full shapes, before sharding (fully_shard keeps the tensors' identity).
struct DecayGroups {
  std::vector<torch::Tensor> decay, no_decay;
};
/// `model` is either variant (GPT or PlainGPT).
DecayGroups decay_groups(const torch::nn::Module& model);

/// AdamW over `groups` with betas (0.9, 0.95) (those --dump-batches' run.json records).
torch::optim::AdamW make_adamw(const DecayGroups& groups, const Options& o);

/// Linear warmup to `lr` over warmup_steps, then cosine decay to min_lr at the last step. step >= 1.
double lr_at(int64_t step, const Options& o);

/// One step of torch.optim.AdamW's foreach implementation (PyTorch's default on CUDA, _multi_tensor_adam with
/// decoupled weight decay), on LibTorch's AdamW state: the same exp_avg / exp_avg_sq / step that checkpoints
/// save and load, created lazily as torch::optim::AdamW::step does. Per parameter group, a handful of
/// multi-tensor kernels instead of ~8 kernels per parameter: on a GPU that is the difference between a few
/// and a few hundred launches per step. Arithmetic as PyTorch's (the first moment by lerp_; LibTorch's step
/// uses mul_ + add_, which rounds differently).
void foreach_adamw_step(torch::optim::AdamW& opt);

}  // namespace train_gpt
