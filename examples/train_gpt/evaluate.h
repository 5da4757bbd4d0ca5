// train_gpt's loss, evaluation and sampling, for either model code (--model-impl).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>

#include "data.h"
#include "fsdp/fsdp.h"
#include "sft.h"
#include "tokenizer.h"

namespace train_gpt {

/// Mean cross-entropy of logits [B, T, vocab] against targets [B, T]; with `vocab_mesh` (loss_parallel), of the
/// TP rank's vocabulary columns [B, T, vocab / tp] (fsdp::tp::vocab_parallel_cross_entropy: the same value).
inline torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets,
                             const fsdp::DeviceMeshPtr& vocab_mesh = nullptr) {
  // In fp32 whatever the compute dtype: a log-softmax over 256 classes in bf16 loses the small probabilities.
  auto flat = logits.to(torch::kFloat32).reshape({-1, logits.size(-1)});
  if (vocab_mesh) return fsdp::tp::vocab_parallel_cross_entropy(flat, targets.reshape({-1}), vocab_mesh);
  return torch::nn::functional::cross_entropy(flat, targets.reshape({-1}));
}

// `Model`, here and below: the model holder of --model-impl, fsdp::FSDPModule<GPT> (holder) or PlainGPT
// (plain). Both are called as `model(x)` and have the same members (cfg, num_params(), unique_parameters()).

/// Mean loss over the fixed evaluation batches of the validation split, averaged over ranks.
/// Every rank runs the same number of forwards (the blocks all-gather their parameters in each).
/// `token_mean` (--sft, whose targets are partly masked): the mean over every unmasked target of all the
/// batches and ranks instead of the mean of the batches' means (0 when every target is masked).
template <typename Model>
double evaluate(Model& model, const TokenWindows& val, int64_t num_batches, int64_t batch_size, int tp,
                fsdp::ProcessGroup& pg, bool token_mean = false) {
  model->eval();
  torch::NoGradGuard no_grad;
  auto sum = torch::zeros({token_mean ? 2 : 1}, torch::TensorOptions(torch::kDouble).device(pg.device()));
  for (int64_t b = 0; b < num_batches; ++b) {
    // The ranks of a TP group evaluate the same windows (each computes the same loss: the sum over all
    // ranks is tp x the data-parallel sum, and so is the divisor below).
    auto [x, y] = val.get(eval_indices(b, batch_size, pg.rank() / tp, pg.size() / tp));
    if (token_mean) {  // [summed loss, unmasked targets]
      sum[0] += lm_loss_sum(model(x.to(pg.device())), y.to(pg.device())).to(torch::kDouble);
      sum[1] += y.ne(-100).sum().item<double>();
    } else {
      sum += lm_loss(model(x.to(pg.device())), y.to(pg.device())).to(torch::kDouble);
    }
  }
  fsdp::all_reduce(sum, pg, fsdp::ReduceOp::SUM);
  model->train();
  if (token_mean) {
    const double n = sum[1].item<double>();
    return n > 0 ? sum[0].item<double>() / n : 0.0;
  }
  return sum.item<double>() / static_cast<double>(num_batches * pg.size());
}

/// Continues `prompt` by `num_tokens` tokens of `tok` (bytes by default) and returns the continuation's
/// text (decoded with `tok`). Every rank runs every forward in lockstep (each forward all-gathers the
/// blocks' parameters); rank 0 draws each token and broadcasts it, so all ranks extend the same text even
/// if their logits differed in the last bit. Deterministic given `seed`.
template <typename Model>
std::string generate(Model& model, const std::string& prompt, int64_t num_tokens,
                     double temperature, int64_t top_k, uint64_t seed, fsdp::ProcessGroup& pg, const Tokenizer& tok) {
  model->eval();
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<int64_t> tokens = tok.encode(prompt.empty() ? std::string("\n") : prompt);
  if (tokens.empty()) tokens.push_back(tok.eos_id().value_or(0));  // a tokenizer may encode "\n" to nothing
  const std::vector<int64_t> prompt_ids = tokens;
  const int64_t context = model->cfg.block_size;
  for (int64_t i = 0; i < num_tokens; ++i) {
    const auto begin = tokens.size() > static_cast<size_t>(context) ? tokens.end() - context : tokens.begin();
    auto idx = torch::tensor(std::vector<int64_t>(begin, tokens.end()), torch::kLong).unsqueeze(0);  // [1, T]
    const int64_t T = idx.size(1);
    // Sequence parallelism splits the sequence evenly over the TP ranks: pad on the right to a multiple
    // of tp (block_size is one). Exact: attention is causal, so no real position sees the padding.
    if (const auto& sp = model->sequence_parallel_mesh) {
      const int64_t tp = sp->size(0), padded = (T + tp - 1) / tp * tp;
      idx = torch::cat({idx, torch::zeros({1, padded - T}, torch::kLong)}, 1);
    }
    auto logits = model(idx.to(pg.device())).select(1, T - 1).squeeze(0).to(torch::kCPU, torch::kFloat32);  // [vocab]
    auto next = torch::zeros({1}, torch::kLong);
    if (pg.rank() == 0) {
      if (temperature == 0.0) {
        next = logits.argmax().reshape({1});
      } else {
        logits = logits / temperature;
        if (top_k > 0 && top_k < logits.size(0)) {
          auto kth = std::get<0>(logits.topk(top_k)).min();
          logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
        }
        next = torch::multinomial(torch::softmax(logits, 0), 1, /*replacement=*/false, gen);
      }
    }
    next = next.to(pg.device());  // NCCL broadcasts device tensors
    fsdp::broadcast(next, /*src=*/0, pg);
    tokens.push_back(next.item<int64_t>());
  }
  model->train();
  // Decoded whole and the prompt's text cut off: a subword's text can depend on its neighbours (a leading
  // space), so decoding the continuation alone could differ from its text after the prompt.
  const std::string all = tok.decode(tokens), head = tok.decode(prompt_ids);
  return all.compare(0, head.size(), head) == 0 ? all.substr(head.size()) : all;
}

}  // namespace train_gpt
