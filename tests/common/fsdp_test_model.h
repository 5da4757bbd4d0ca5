// A tiny model for FSDP tests: an Embedding, blocks (LayerNorm, two Linears, a 1-element scale) and
// a 2-row head. Its shapes exercise uneven and empty shards on up to 4 ranks:
//   wte.weight [11, 6] (3,3,3,2 rows on 4 ranks), fc1.weight [5, 6] (2,2,1,0), scale [1] (1,0,0,0),
//   head.weight [2, 6] (1,1,0,0).
#pragma once

#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "fsdp/fsdp.h"

namespace fsdp::testing {

constexpr int64_t kVocab = 11;
constexpr int64_t kDim = 6;
constexpr int64_t kHidden = 5;
constexpr int64_t kClasses = 2;

struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::Tensor scale;
  BlockImpl() {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    fc1 = register_module("fc1", torch::nn::Linear(kDim, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kDim));
    scale = register_parameter("scale", torch::ones({1}));
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::gelu(fc1(norm(x)))) * scale; }
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  torch::nn::Embedding wte{nullptr};
  torch::nn::ModuleList block_list;          // registers the blocks as "blocks.0", "blocks.1", ...
  std::vector<FSDPModule<Block>> blocks;     // the same modules, called through FSDP
  torch::nn::Linear head{nullptr};
  int calls_per_block = 1;  // >1: every block runs several times in one forward
  int active_blocks = -1;   // >= 0: only the first active_blocks blocks run
  explicit NetImpl(int n_blocks = 2) {
    wte = register_module("wte", torch::nn::Embedding(kVocab, kDim));
    block_list = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < n_blocks; ++i) {
      blocks.push_back(Block());
      block_list->push_back(blocks.back());
    }
    head = register_module("head", torch::nn::Linear(kDim, kClasses));
  }
  torch::Tensor forward(torch::Tensor idx) {
    auto x = wte(idx);
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (active_blocks >= 0 && static_cast<int>(i) >= active_blocks) break;
      for (int c = 0; c < calls_per_block; ++c) x = blocks[i](x);
    }
    return head(x);
  }
};
TORCH_MODULE(Net);

/// Mean cross-entropy of the logits [B, T, C] against targets [B, T].
inline torch::Tensor loss_fn(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kClasses}), targets.reshape({-1}));
}

/// Parameters by name, cloned (the initial weights every rank and the reference start from).
inline std::map<std::string, torch::Tensor> snapshot(const torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

/// Copies full weights into an unsharded model.
inline void load_full(torch::nn::Module& m, const std::map<std::string, torch::Tensor>& w) {
  torch::NoGradGuard g;
  for (auto& p : m.named_parameters()) p.value().copy_(w.at(p.key()));
}

/// A deterministic global batch: tokens [B, T] and targets [B, T].
struct Batch {
  torch::Tensor idx, targets;
  Batch slice(int64_t begin, int64_t len) const { return {idx.narrow(0, begin, len), targets.narrow(0, begin, len)}; }
};
inline std::vector<Batch> make_batches(int steps, int64_t batch, int64_t seq, uint64_t seed = 1234) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<Batch> out;
  for (int i = 0; i < steps; ++i) {
    out.push_back({torch::randint(0, kVocab, {batch, seq}, gen, torch::kLong),
                   torch::randint(0, kClasses, {batch, seq}, gen, torch::kLong)});
  }
  return out;
}

/// Largest |a - b| (0 for empty tensors).
inline double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.numel() == 0) return 0.0;
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

}  // namespace fsdp::testing
