// fsdp::saved_tensors_hooks and fsdp::save_on_cpu (CTest label: activation_checkpointing), as
// torch.autograd.graph's: every tensor autograd saves goes through pack in forward and unpack in backward
// (counted), the innermost hooks apply, nothing is packed with grad off or outside the scope, and the gradients
// are those without hooks, bit for bit (save_on_cpu on the CPU: copies in another allocation, with the strides).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "error_message.h"
#include "fsdp/utils/activation_checkpoint.h"
#include "fsdp/utils/saved_tensor_hooks.h"

namespace fsdp::testing {
namespace {

struct Net {
  torch::nn::Linear l1{nullptr}, l2{nullptr};
  Net() {
    torch::manual_seed(4);
    l1 = torch::nn::Linear(6, 12);
    l2 = torch::nn::Linear(12, 3);
  }
  torch::Tensor operator()(const torch::Tensor& x) { return l2(torch::tanh(l1(x))).pow(2).sum(); }
  std::vector<torch::Tensor> grads() {
    std::vector<torch::Tensor> g;
    for (auto* l : {&l1, &l2}) {
      for (auto& p : (*l)->parameters()) {
        g.push_back(p.grad().clone());
        p.mutable_grad() = torch::Tensor();
      }
    }
    return g;
  }
};

void expect_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << what << ": gradient " << i;
}

TEST(SavedTensorHooks, EverySavedTensorIsPackedAndUnpackedAndTheInnermostApplies) {
  Net net;
  auto x = torch::randn({5, 6});
  net(x).backward();
  auto ref = net.grads();
  int packs = 0, unpacks = 0, outer_packs = 0;
  torch::Tensor loss;
  {
    saved_tensors_hooks outer([&](const torch::Tensor& t) -> c10::IValue { ++outer_packs; return t; },
                              [](const c10::IValue& v) { return v.toTensor(); });
    {
      // Packs a copy: the backward uses what unpack returns.
      saved_tensors_hooks inner(
          [&](const torch::Tensor& t) -> c10::IValue {
            ++packs;
            return t.clone();
          },
          [&](const c10::IValue& v) {
            ++unpacks;
            return v.toTensor();
          });
      loss = net(x);
    }
    {
      torch::NoGradGuard no_grad;
      net(x);  // nothing is saved without grad
    }
  }
  EXPECT_GT(packs, 4) << "addmm, tanh, pow save their inputs or outputs";
  EXPECT_EQ(outer_packs, 0) << "the innermost hooks apply";
  EXPECT_EQ(unpacks, 0) << "unpacked in backward only";
  loss.backward();
  EXPECT_EQ(unpacks, packs) << "each saved tensor is unpacked once by one backward";
  expect_equal(net.grads(), ref, "saved_tensors_hooks");
  int after = packs;
  net(x).backward();  // outside the scope: no hooks
  EXPECT_EQ(packs, after);
  auto msg = error_message([] { saved_tensors_hooks h(nullptr, nullptr); });
  EXPECT_NE(msg.find("expected a pack and an unpack function"), std::string::npos) << msg;
}

TEST(SavedTensorHooks, SaveOnCpuAndCheckpointInsideIt) {
  Net net;
  auto x = torch::randn({5, 6}, torch::requires_grad());
  net(x).backward();
  auto ref = net.grads();
  auto ref_x = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  torch::Tensor loss;
  {
    save_on_cpu offload(/*pin_memory=*/true);  // (pins only with CUDA)
    loss = net(x);
  }
  loss.backward();
  expect_equal(net.grads(), ref, "save_on_cpu");
  EXPECT_TRUE(torch::equal(x.grad(), ref_x)) << "save_on_cpu keeps the saved tensors' strides, so the kernels too";
  // A non-reentrant checkpoint inside save_on_cpu: its region's tensors go to the checkpoint (innermost), the
  // rest to the host copies; same gradients.
  x.mutable_grad() = torch::Tensor();
  {
    save_on_cpu offload;
    loss = checkpoint([&](const torch::Tensor& in) { return torch::tanh(net.l1(in)); }, x).pow(2).sum() +
           net(x);
  }
  loss.backward();
  auto both = net.grads();
  net(x).backward();
  (torch::tanh(net.l1(x)).pow(2).sum()).backward();
  auto expect = net.grads();
  expect_equal(both, expect, "checkpoint inside save_on_cpu");
}

}  // namespace
}  // namespace fsdp::testing
