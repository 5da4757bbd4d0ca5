// The tiny model and plans of the tensor-parallel tests (test_tensor_parallel.cpp, test_fsdp_over_tp.cpp):
// unchanged LibTorch model code (Embedding -> 2 residual MLP blocks in a ModuleList -> LayerNorm -> head),
// deterministic weights. Its fsdp::testing::NetImpl is not fsdp_test_model.h's: a binary that links both
// would break the one-definition rule, so these tests have their binary (test_tensor) without that header.
#pragma once

#include <gtest/gtest.h>

#include "fsdp/fsdp.h"

namespace fsdp::testing {

struct MLPImpl : torch::nn::Module {
  MLPImpl(int64_t d, int64_t h)
      : fc1(register_module("fc1", torch::nn::Linear(d, h))), fc2(register_module("fc2", torch::nn::Linear(h, d))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(MLP);

// Unchanged model code: Embedding -> 2 residual MLP blocks -> LayerNorm -> head.
struct NetImpl : torch::nn::Module {
  NetImpl(int64_t vocab, int64_t d, int64_t h)
      : emb(register_module("emb", torch::nn::Embedding(vocab, d))),
        blocks(register_module("blocks", torch::nn::ModuleList(MLP(d, h), MLP(d, h)))),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        head(register_module("head", torch::nn::Linear(d, vocab))) {
    // Deterministic weights (no RNG: the ranks are threads of one process).
    torch::NoGradGuard no_grad;
    int i = 0;
    for (auto& p : parameters()) {
      p.copy_(torch::sin(torch::arange(p.numel(), torch::kFloat32) * 0.7 + i++).view_as(p) * 0.5);
    }
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    auto x = emb(ids);
    for (const auto& b : *blocks) x = x + b->as<MLPImpl>()->forward(x);
    return head(ln(x));
  }
  torch::nn::Embedding emb;
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

constexpr int64_t kVocab = 8, kDim = 6, kHidden = 8;

inline tp::ParallelizePlan default_plan() {
  return {{"emb", tp::RowwiseParallel()},
          {"blocks.*.fc1", tp::ColwiseParallel()},
          {"blocks.*.fc2", tp::RowwiseParallel()},
          {"head", tp::ColwiseParallel().output_layouts(Replicate())}};
}

// Replicated activations between fc1 and fc2 (all-gather after fc1, each rank takes its columns in fc2).
inline tp::ParallelizePlan replicated_plan() {
  return {{"emb", tp::RowwiseParallel()},
          {"blocks.?.fc1", tp::ColwiseParallel().output_layouts(Replicate())},
          {"blocks.*.fc2", tp::RowwiseParallel().input_layouts(Replicate())},
          {"h*", tp::ColwiseParallel().output_layouts(Replicate())}};
}

// Sequence parallelism: activations between the blocks sharded on the sequence (dim 1); the blocks'
// inputs all-gathered, their outputs and the embedding's reduce-scattered; the norm on each rank's
// positions. Needs a sequence length divisible by the TP size.
inline tp::ParallelizePlan sequence_parallel_plan() {
  return {{"emb", tp::RowwiseParallel().output_layouts(Shard(1))},
          {"blocks.*.fc1", tp::ColwiseParallel().input_layouts(Shard(1))},
          {"blocks.*.fc2", tp::RowwiseParallel().output_layouts(Shard(1))},
          {"ln", tp::SequenceParallel()},
          {"head", tp::ColwiseParallel().input_layouts(Shard(1)).output_layouts(Replicate())}};
}

inline void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(torch::allclose(got, want, /*rtol=*/1e-5, /*atol=*/1e-6))
      << what << ": max abs diff " << (got - want).abs().max().item<float>();
}

}  // namespace fsdp::testing
