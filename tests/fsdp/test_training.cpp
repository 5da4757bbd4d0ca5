// fully_shard training: parity with a single-process reference (CTest label: fully_shard), as FSDP2's
// test_fully_shard_training.py. Every test trains the same tiny model (common/fsdp_test_model.h) from identical
// initial weights: once unsharded in one thread on the global batch (the reference), and sharded on N ranks
// (threads over Gloo), each rank on its slice of the global batch (run_parity, common/fully_shard_test_util.h).
// Losses (averaged over ranks) must equal the reference's at every step and the parameters at the end, within
// kRtol relative. The full gradients (the sharded gradients gathered) and their global norm must equal the
// reference's at every step: AdamW normalises the update, so parameters alone cannot see a gradient off by a
// constant factor (x2, x0.5, the wrong divisor); the SGD runs make such a factor visible in the parameters too.
// Also: when the optimizer is built, another entry point than forward (fsdp_forward), and optimizers that read
// the parameter (SGD with momentum and weight decay, Adam with weight decay) on an unchanged model.
#include <gtest/gtest.h>

#include <memory>

#include "fully_shard_test_util.h"
#include "unchanged_harness.h"

namespace fsdp::testing {
namespace {

class Parity : public ::testing::TestWithParam<int> {};

TEST_P(Parity, AdamWTenStepsMatchSingleProcess) { run_parity(GetParam(), {}); }
TEST_P(Parity, ReshardAfterForwardFalse) { run_parity(GetParam(), ShardConfig{ReshardAfterForward(false)}); }
TEST_P(Parity, AutoWrapTreeEqualsManual) {
  ShardConfig c;
  c.use_tree = true;
  run_parity(GetParam(), c);
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, Parity, ::testing::Values(1, 2, 3, 4));

// SGD applies the gradient as it is: a gradient off by a constant factor moves the parameters off too
// (issue 17, item 10). Regressions* suite: CTest label `regressions`.
class RegressionsParitySGD : public ::testing::TestWithParam<int> {};
TEST_P(RegressionsParitySGD, TenStepsMatchSingleProcess) {
  ShardConfig c;
  c.opt = Opt::SGD;
  run_parity(GetParam(), c);
}
TEST_P(RegressionsParitySGD, ReshardAfterForwardFalse) {
  ShardConfig c{ReshardAfterForward(false)};
  c.opt = Opt::SGD;
  run_parity(GetParam(), c);
}
INSTANTIATE_TEST_SUITE_P(RegressionsWorldSizes, RegressionsParitySGD, ::testing::Values(1, 2, 3));

TEST(Parity, OptimizerBuiltBeforeFullyShard) {
  ShardConfig c;
  c.optimizer_before = true;
  run_parity(2, c);
}

// An optimizer built after a forward that left the root unsharded (reshard_after_forward=false for
// the root): it holds the same parameter tensors, which are sharded again after backward.
TEST(Parity, OptimizerBuiltAfterForwardWithUnshardedRoot) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches);
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    FSDPModule<Net> model(net);
    auto b0 = batches[0].slice(pg->rank() * 6, 6);
    auto loss0 = loss_fn(model(b0.idx), b0.targets);
    EXPECT_EQ(net->head->weight.size(0), kClasses);  // the root is unsharded now
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
    loss0.backward();
    EXPECT_EQ(net->head->weight.size(0), 1);  // sharded again: the optimizer sees the shard
    opt.step();
    for (size_t step = 1; step < batches.size(); ++step) {
      auto b = batches[step].slice(pg->rank() * 6, 6);
      opt.zero_grad();
      loss_fn(model(b.idx), b.targets).backward();
      opt.step();
    }
    auto mesh = init_device_mesh(torch::kCPU, {2});
    for (const auto& p : net->named_parameters()) {
      auto expect = distribute_tensor(ref.final_params.at(p.key()), mesh, {Shard(0)}).to_local();
      EXPECT_TRUE(torch::allclose(p.value(), expect, kRtol, kAtol)) << p.key();
    }
  });
}

// Another entry point than forward goes through FSDP with fsdp_forward (register_fsdp_forward_method).
struct WithScoreImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  WithScoreImpl() { fc = register_module("fc", torch::nn::Linear(kDim, 3)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  torch::Tensor score(torch::Tensor x) { return fc(x).sum(-1); }
};
TORCH_MODULE(WithScore);

TEST(Hooks, OtherEntryPointsThroughFsdpForward) {
  torch::manual_seed(2);
  WithScore ref;
  auto x = torch::randn({4, kDim});
  ref->score(x).sum().backward();
  run_ranks(2, [&](ProcessGroupPtr pg) {
    FSDPModule<WithScore> m;
    load_full(*m.ptr(), snapshot(*ref));
    fully_shard(m, FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {2})));
    auto y = fsdp_forward(*m, [&] { return m->score(x); });
    EXPECT_TRUE(torch::allclose(y, ref->score(x).detach()));
    (y.sum() / 2).backward();  // each rank's contribution; the reduce-scatter sums both
    auto expect = distribute_tensor(ref->fc->weight.grad(), init_device_mesh(torch::kCPU, {2}), {Shard(0)});
    EXPECT_TRUE(torch::allclose(m->fc->weight.grad(), expect.to_local() / 2, 1e-5, 1e-6));
  });
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing::unchanged_harness {
namespace {

// ---- Optimizers that read the parameter, on an unchanged model (issue 13) ---------------------------

// torch::optim::SGD with momentum and weight decay (`d_p = p.grad().data(); d_p.add(p, wd)`, a
// momentum buffer cloned from it) and torch::optim::Adam with weight decay (`grad.add(p, wd)`, state
// from zeros_like(p)) step the shards: the same numbers as the holder path and the reference.
TEST_P(UnchangedMore, SgdMomentumWeightDecayStepsShards) {
  Config s;
  s.opt = [](const std::vector<torch::Tensor>& p) {
    return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  };
  plain_vs_holder_vs_reference(GetParam(), s, "SGD momentum 0.9 weight_decay 0.01");
}

TEST_P(UnchangedMore, AdamWeightDecayStepsShards) {
  Config s;
  s.opt = [](const std::vector<torch::Tensor>& p) {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-2).weight_decay(0.01));
  };
  plain_vs_holder_vs_reference(GetParam(), s, "Adam weight_decay 0.01");
}

}  // namespace
}  // namespace fsdp::testing::unchanged_harness
