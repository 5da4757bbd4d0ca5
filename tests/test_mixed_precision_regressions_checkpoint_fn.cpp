// Regressions of fsdp::checkpoint's functional form (issue 17 item 6): a `mutable` lambda, the usual
// way to call a module holder captured by value (ModuleHolder::operator() is not const), must compile
// and give the gradients of the same function without checkpointing.
#include <gtest/gtest.h>

#include <memory>

#include <torch/torch.h>

#include "fsdp/utils/activation_checkpoint.h"

namespace fsdp::testing {
namespace {

// Before the fix this file did not compile: checkpoint() stored `fn` in a non-mutable lambda, so it
// called a const copy, and a mutable lambda's operator() is non-const.
TEST(RegressionsCheckpointFn, MutableLambdaCapturingAModuleHolderByValue) {
  torch::manual_seed(3);
  torch::nn::Linear lin(8, 8);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  // Reference: the same function, no checkpointing.
  torch::tanh(lin(torch::tanh(lin(x)))).pow(2).sum().backward();
  const auto gx = x.grad().clone(), gw = lin->weight.grad().clone(), gb = lin->bias.grad().clone();
  x.mutable_grad() = torch::Tensor();
  lin->zero_grad();

  auto calls = std::make_shared<int>(0);
  int local_calls = 0;  // state of the lambda itself: mutable
  auto y = checkpoint(
      [lin, calls, local_calls](const torch::Tensor& in) mutable {
        ++local_calls;
        *calls = local_calls;  // the forward and the recomputation call one copy: 1, then 2
        return torch::tanh(lin(torch::tanh(lin(in))));
      },
      x);
  EXPECT_EQ(*calls, 1);
  y.pow(2).sum().backward();
  EXPECT_EQ(*calls, 2) << "the recomputation should call the same copy of the lambda as the forward";
  EXPECT_TRUE(torch::allclose(x.grad(), gx, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(lin->weight.grad(), gw, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(lin->bias.grad(), gb, 1e-6, 1e-7));
}

}  // namespace
}  // namespace fsdp::testing
