// Activation checkpointing (CTest label: mixed_precision; RegressionsCheckpointFn: mixed_precision, regressions;
// Unchanged: unchanged_models): checkpoint_wrapper under fully_shard gives bitwise the same losses and gradients
// and holds less memory after forward; fsdp::checkpoint (the functional form, torch.utils.checkpoint) restores the
// RNG for dropout and calls a mutable lambda's own copy; at the call site of an unchanged model it matches the
// reference and the holder model's checkpoint_wrapper.
#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdio>
#include <map>
#include <memory>
#include <mutex>

#include "fsdp/utils/activation_checkpoint.h"
#include "seed11_net.h"
#include "unchanged_harness.h"

namespace fsdp::testing::seed11_net {
namespace {

TEST(ActivationCheckpointing, ShardedLossesAndGradientsBitIdentical) {
  auto batches = make_batches(3, kBatch, kSeq, 31);
  std::map<bool, std::vector<std::map<std::string, torch::Tensor>>> grads;  // per rank
  std::map<bool, std::vector<float>> losses;
  std::mutex mu;
  for (bool ac : {false, true}) {
    grads[ac].resize(2);
    run_ranks(2, [&](ProcessGroupPtr pg) {
      Net net;
      load_full(*net, initial_weights());
      auto mesh = init_device_mesh(torch::kCPU, {2});
      for (auto& b : net->blocks) {
        if (ac) checkpoint_wrapper(b);
        fully_shard(b, FullyShardOptions().mesh(mesh));
      }
      fully_shard(net, FullyShardOptions().mesh(mesh));
      FSDPModule<Net> model(net);
      torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
      for (const auto& gb : batches) {
        auto b = gb.slice(pg->rank() * 6, 6);
        opt.zero_grad();
        auto loss = loss_fn(model(b.idx), b.targets);
        loss.backward();
        if (pg->rank() == 0) {
          std::lock_guard<std::mutex> lock(mu);
          losses[ac].push_back(loss.item<float>());
        }
        opt.step();
      }
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& p : net->named_parameters()) grads[ac][pg->rank()][p.key()] = p.value().grad().clone();
    });
  }
  EXPECT_EQ(losses[false], losses[true]);
  for (int r = 0; r < 2; ++r) {
    for (const auto& [k, g] : grads[false][r]) EXPECT_TRUE(torch::equal(g, grads[true][r].at(k))) << k << " rank " << r;
  }
}

TEST(ActivationCheckpointing, DropoutMatchesThroughRngRestore) {
  torch::manual_seed(5);
  torch::nn::Sequential seq(torch::nn::Linear(8, 16), torch::nn::Dropout(0.5), torch::nn::Linear(16, 4));
  auto x = torch::randn({6, 8}, torch::requires_grad());
  torch::manual_seed(99);
  seq->forward(x).sum().backward();
  auto g_ref = x.grad().clone();
  std::vector<torch::Tensor> pg_ref;
  for (auto& p : seq->parameters()) pg_ref.push_back(p.grad().clone());
  x.mutable_grad() = torch::Tensor();
  seq->zero_grad();
  torch::manual_seed(99);
  auto y = checkpoint([&](const torch::Tensor& in) { return seq->forward(in); }, x);
  torch::manual_seed(12345);  // the recomputation must not see this state
  y.sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), g_ref));
  auto ps = seq->parameters();
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(torch::equal(ps[i].grad(), pg_ref[i]));
}

// Bytes the allocator holds (malloc'd + mmapped): what a forward keeps alive for backward.
int64_t heap_in_use() {
  auto mi = mallinfo2();
  return static_cast<int64_t>(mi.uordblks + mi.hblkhd);
}

TEST(ActivationCheckpointing, ActivationMemoryIsLower) {
  // A deeper, wider stack of blocks on one rank: activations dominate.
  std::map<bool, int64_t> held;
  for (bool ac : {false, true}) {
    run_ranks(1, [&](ProcessGroupPtr pg) {
      Net net(/*n_blocks=*/8);
      auto mesh = init_device_mesh(torch::kCPU, {1});
      for (auto& b : net->blocks) {
        if (ac) checkpoint_wrapper(b);
        fully_shard(b, FullyShardOptions().mesh(mesh));
      }
      fully_shard(net, FullyShardOptions().mesh(mesh));
      FSDPModule<Net> model(net);
      auto idx = torch::randint(0, kVocab, {256, 64});
      auto tgt = torch::randint(0, kClasses, {256, 64});
      loss_fn(model(idx), tgt).backward();  // warm-up: lazy init, allocator caches
      int64_t before = heap_in_use();
      auto loss = loss_fn(model(idx), tgt);
      held[ac] = heap_in_use() - before;
      loss.backward();
    });
  }
  std::printf("[activation checkpointing] memory held after forward, 8 blocks, batch 256x64: without %lld B, with %lld B\n",
              static_cast<long long>(held[false]), static_cast<long long>(held[true]));
  EXPECT_LT(held[true] * 2, held[false]);
}

}  // namespace
}  // namespace fsdp::testing::seed11_net

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

namespace fsdp::testing::unchanged_harness {
namespace {

// ---- Activation checkpointing at the call site ------------------------------------------------------

TEST_P(Unchanged, CallSiteCheckpointMatchesReferenceAndHolderCheckpointWrapper) {
  const int ws = GetParam();
  Knobs k;
  k.checkpoint = true;
  auto [plain, holder] = plain_vs_holder(ws, k, "activation checkpointing");
  auto ref = reference_run([] { return make_plain({}); }, make_batches(kSteps3, kBatch, kSeq));
  expect_parity(plain, ref, "activation checkpointing");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Unchanged, ::testing::Values(2, 3));

}  // namespace
}  // namespace fsdp::testing::unchanged_harness
