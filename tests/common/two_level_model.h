// A root holding a separately sharded Linear (two FSDP groups; the inner one re-gathers in backward), used
// by the Join tests with gradient accumulation (tests/algorithms) and the collective checks (tests/fsdp),
// in namespace fsdp::testing::two_level_model.
#pragma once

#include "fsdp_test_model.h"

namespace fsdp::testing::two_level_model {

inline constexpr int64_t kIn = 8, kOut = 4;

// A Linear sharded as the root, or a root holding a separately sharded Linear (two groups: the inner
// one re-gathers in backward; its input needs no gradient).
struct TwoLevelImpl : torch::nn::Module {
  FSDPModule<torch::nn::Linear> inner{nullptr};
  torch::nn::Linear outer{nullptr};
  TwoLevelImpl() {
    inner = torch::nn::Linear(kIn, kIn);
    register_module("inner", inner.ptr());
    outer = register_module("outer", torch::nn::Linear(kIn, kOut));
  }
  torch::Tensor forward(torch::Tensor x) { return outer(torch::tanh(inner(x))); }
};
TORCH_MODULE(TwoLevel);

}  // namespace fsdp::testing::two_level_model
