// fully_shard training: parity with a single-process reference (CTest label: fully_shard). The other
// files of this binary: test_fully_shard_init.cpp (initialisation and bad input) and
// test_fully_shard_comm.cpp (communication counts and memory); DTensor is tested by test_dtensor.
//
// Every test trains the same tiny model (tests/fsdp_test_model.h) from identical initial weights:
// once unsharded in one thread on the global batch (the reference), and sharded on N ranks (threads
// over Gloo), each rank on its slice of the global batch. Losses (averaged over ranks) must equal the
// reference's at every step and the parameters at the end, within kRtol relative. The full gradients
// (the sharded gradients gathered) and their global norm must equal the reference's at every step:
// AdamW normalises the update, so parameters alone cannot see a gradient off by a constant factor
// (x2, x0.5, the wrong divisor); the SGD runs make such a factor visible in the parameters too.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <mutex>
#include <tuple>

#include "fully_shard_test_util.h"

namespace fsdp::testing {
namespace {

// Trains a sharded model on this rank's slice of each global batch; checks every step's loss and
// the final parameters against the reference. Returns the largest relative differences seen.
// Trains a sharded model on this rank's slice of each global batch; checks every step's loss, full
// gradients and gradient norm, and the final parameters against the reference. Returns the largest
// relative loss difference, |param diff| and |grad diff| seen.
std::tuple<double, double, double> train_and_compare(const ShardConfig& cfg, ProcessGroupPtr pg,
                                                     const std::vector<Batch>& batches, const Reference& ref) {
  const int ws = pg->size();
  const int64_t local = kBatch / ws;
  std::unique_ptr<torch::optim::Optimizer> opt;
  Net net{nullptr};
  if (cfg.optimizer_before) {
    // The optimizer holds the parameter tensors; fully_shard keeps their identity and swaps their data.
    net = Net();
    net->calls_per_block = cfg.calls_per_block;
    load_full(*net, initial_weights());
    opt = make_optimizer(net->parameters(), cfg.opt);
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    fully_shard(net, FullyShardOptions().mesh(mesh));
  } else {
    net = build_sharded(cfg, pg);
    opt = make_optimizer(net->parameters(), cfg.opt);
  }
  FSDPModule<Net> model(net);
  if (cfg.explicit_prefetch) {
    auto& bl = net->blocks;
    bl[0].set_modules_to_forward_prefetch({bl[1].ptr()});
    bl[1].set_modules_to_backward_prefetch({bl[0].ptr()});
  }
  auto mesh = init_device_mesh(torch::kCPU, {ws});
  double max_loss = 0, max_grad = 0;
  for (size_t step = 0; step < batches.size(); ++step) {
    auto b = batches[step].slice(pg->rank() * local, local);
    opt->zero_grad();
    if (cfg.explicit_unshard) {
      auto h = model.unshard(/*async_op=*/true);
      h.wait();
    }
    auto loss = loss_fn(model(b.idx), b.targets);
    loss.backward();
    max_grad = std::max(max_grad, compare_gradients(*net, mesh, {Shard(0)}, ref, step, pg->rank()));
    opt->step();
    auto global = loss.detach().clone();
    all_reduce(global, *pg, ReduceOp::AVG);
    double d = std::abs(global.item<double>() - ref.losses[step]) / std::abs(ref.losses[step]);
    max_loss = std::max(max_loss, d);
    EXPECT_LE(d, kRtol) << "step " << step << ": loss " << global.item<float>() << " vs reference "
                        << ref.losses[step] << " on rank " << pg->rank();
  }
  // Compare the local shards with the reference's final parameters sliced the same way.
  double max_param = 0;
  for (const auto& p : net->named_parameters()) {
    auto expect = distribute_tensor(ref.final_params.at(p.key()), mesh, {Shard(0)}).to_local();
    EXPECT_EQ(p.value().sizes(), expect.sizes()) << p.key();
    if (p.value().sizes() != expect.sizes()) continue;
    max_param = std::max(max_param, max_abs_diff(p.value(), expect));
    EXPECT_TRUE(torch::allclose(p.value(), expect, kRtol, kAtol))
        << p.key() << " on rank " << pg->rank() << ": max |diff| " << max_abs_diff(p.value(), expect);
  }
  return {max_loss, max_param, max_grad};
}

void run_parity(int ws, const ShardConfig& cfg) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches, cfg.calls_per_block, cfg.opt);
  std::mutex mu;
  double worst_loss = 0, worst_param = 0, worst_grad = 0;
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto [l, p, g] = train_and_compare(cfg, pg, batches, ref);
    std::lock_guard<std::mutex> lock(mu);
    worst_loss = std::max(worst_loss, l);
    worst_param = std::max(worst_param, p);
    worst_grad = std::max(worst_grad, g);
  });
  std::printf("[parity] world size %d, %s: max relative loss diff %.3g (tolerance %.0e), max |param diff| %.3g "
              "(tolerance %.0e + %.0e * |ref|), max |grad diff| %.3g (tolerance %.0e + %.0e * |ref|)\n",
              ws, cfg.opt == Opt::SGD ? "SGD" : "AdamW", worst_loss, kRtol, worst_param, kAtol, kRtol, worst_grad,
              kGradAtol, kGradRtol);
}

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
TEST(RegressionsParitySGD, ReshardAfterForwardTwoOnFourRanks) {
  ShardConfig c{ReshardAfterForward(2)};
  c.opt = Opt::SGD;
  run_parity(4, c);
}

TEST(Parity, ReshardAfterForwardTwoOnFourRanks) { run_parity(4, ShardConfig{ReshardAfterForward(2)}); }

TEST(Parity, ExplicitPrefetchAndUnshard) {
  ShardConfig c;
  c.explicit_prefetch = true;
  c.explicit_unshard = true;
  run_parity(3, c);
}

TEST(Parity, OptimizerBuiltBeforeFullyShard) {
  ShardConfig c;
  c.optimizer_before = true;
  run_parity(2, c);
}

TEST(Parity, ModuleCalledTwiceInOneForward) {
  ShardConfig c;
  c.calls_per_block = 2;
  run_parity(3, c);
}

// HSDP: a 2 x 2 mesh (replicate, shard): shards over the shard dim, replicas over the other;
// gradients reduce-scattered over "shard", all-reduced over "replicate" and divided by the 4
// data-parallel ranks (not the 2 of the shard group: the full gradients and their norm see it).
void run_hsdp_parity(Opt opt_kind) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches, 1, opt_kind);
  run_ranks(4, [&](ProcessGroupPtr pg) {
    Net net;
    load_full(*net, initial_weights());
    auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"replicate", "shard"});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    FSDPModule<Net> model(net);
    auto opt = make_optimizer(net->parameters(), opt_kind);
    const int64_t local = kBatch / 4;
    for (size_t step = 0; step < batches.size(); ++step) {
      auto b = batches[step].slice(pg->rank() * local, local);
      opt->zero_grad();
      auto loss = loss_fn(model(b.idx), b.targets);
      loss.backward();
      compare_gradients(*net, mesh, {Replicate(), Shard(0)}, ref, step, pg->rank());
      opt->step();
      auto global = loss.detach().clone();
      all_reduce(global, *pg, ReduceOp::AVG);
      EXPECT_NEAR(global.item<double>(), ref.losses[step], kRtol * std::abs(ref.losses[step])) << "step " << step;
    }
    for (const auto& [name, dt] : fsdp_api(*net).sharded_parameters()) {
      EXPECT_EQ(dt.placements().size(), 2u);
      EXPECT_TRUE(dt.placements()[0].is_replicate());
    }
    for (const auto& p : net->named_parameters()) {
      auto expect = distribute_tensor(ref.final_params.at(p.key()), mesh, {Replicate(), Shard(0)}).to_local();
      EXPECT_TRUE(torch::allclose(p.value(), expect, kRtol, kAtol)) << p.key() << " on rank " << pg->rank();
    }
  });
}

TEST(Parity, HybridShardingOnTwoByTwoMesh) { run_hsdp_parity(Opt::ADAMW); }
TEST(RegressionsParitySGD, HybridShardingOnTwoByTwoMesh) { run_hsdp_parity(Opt::SGD); }

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

// reshard_after_backward=false keeps the parameters unsharded between no-sync microbatches; after
// the synchronised one the optimizer sees shards with their gradients.
TEST(GradientAccumulation, ReshardAfterBackwardFalseStillStepsShards) {
  constexpr int k = 3;
  auto batches = make_batches(1, kBatch * k, kSeq, 99);
  Net ref;
  load_full(*ref, initial_weights());
  loss_fn(ref->forward(batches[0].idx), batches[0].targets).backward();
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    FSDPModule<Net> model(net);
    model.set_reshard_after_backward(false);
    for (int m = 0; m < k; ++m) {
      auto b = batches[0].slice(m * kBatch + pg->rank() * 6, 6);
      model.set_requires_gradient_sync(m == k - 1);
      (loss_fn(model(b.idx), b.targets) / k).backward();
      if (m < k - 1) EXPECT_EQ(net->blocks[0]->fc1->weight.size(0), kHidden) << "kept unsharded between microbatches";
    }
    auto mesh = init_device_mesh(torch::kCPU, {2});
    for (const auto& p : net->named_parameters()) {
      auto expect = distribute_tensor(ref->named_parameters()[p.key()].grad(), mesh, {Shard(0)}).to_local();
      ASSERT_EQ(p.value().sizes(), expect.sizes()) << p.key() << " is resharded after the synchronised backward";
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6)) << p.key();
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

// ---- Gradient accumulation ---------------------------------------------------------------------------
// Gradients of k microbatches (each loss divided by k) with sync off for the first k-1 must equal the
// gradient of one step on their concatenation; also with sync on every microbatch.
void check_accumulation(int ws, bool sync_each) {
  constexpr int k = 3;
  auto batches = make_batches(1, kBatch * k, kSeq, 99);
  // Reference gradient on the whole batch.
  Net ref;
  load_full(*ref, initial_weights());
  loss_fn(ref->forward(batches[0].idx), batches[0].targets).backward();
  std::map<std::string, torch::Tensor> ref_grads;
  for (const auto& p : ref->named_parameters()) ref_grads[p.key()] = p.value().grad().clone();

  run_ranks(ws, [&](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    FSDPModule<Net> model(net);
    const int64_t local = kBatch / ws;
    for (int m = 0; m < k; ++m) {
      // Microbatch m of this rank: rows of the global batch laid out as k global microbatches.
      auto b = batches[0].slice(m * kBatch + pg->rank() * local, local);
      model.set_requires_gradient_sync(sync_each || m == k - 1);
      (loss_fn(model(b.idx), b.targets) / k).backward();
    }
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    for (const auto& p : net->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      auto expect = distribute_tensor(ref_grads.at(p.key()), mesh, {Shard(0)}).to_local();
      ASSERT_EQ(p.value().grad().sizes(), expect.sizes()) << p.key();
      EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6)) << p.key() << " on rank " << pg->rank();
    }
  });
}

TEST(GradientAccumulation, NoSyncThenSyncEqualsConcatenation) {
  check_accumulation(2, false);
  check_accumulation(3, false);
}
TEST(GradientAccumulation, SyncEveryMicrobatchEqualsConcatenation) { check_accumulation(4, true); }

// ---- Tied and frozen parameters -----------------------------------------------------------------------
TEST(Tied, InOneGroupTrainsLikeTheReference) {
  torch::manual_seed(3);
  Tied ref;
  auto w0 = snapshot(*ref);
  auto idx = torch::randint(0, kVocab, {4, 3});
  auto tgt = torch::randint(0, kVocab, {4, 3});
  torch::optim::SGD ref_opt(ref->parameters(), 0.1);
  for (int s = 0; s < 3; ++s) {
    ref_opt.zero_grad();
    torch::nn::functional::cross_entropy(ref->forward(idx).view({-1, kVocab}), tgt.view({-1})).backward();
    ref_opt.step();
  }
  run_ranks(2, [&](ProcessGroupPtr pg) {
    FSDPModule<Tied> m;
    load_full(*m.ptr(), w0);
    fully_shard(m, FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {2})));
    EXPECT_EQ(fsdp_api(*m).sharded_parameters().size(), 1u);  // one tensor, managed once
    torch::optim::SGD opt(m->parameters(), 0.1);
    auto li = idx.narrow(0, pg->rank() * 2, 2), lt = tgt.narrow(0, pg->rank() * 2, 2);
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      torch::nn::functional::cross_entropy(m(li).view({-1, kVocab}), lt.view({-1})).backward();
      opt.step();
    }
    auto expect = distribute_tensor(ref->emb->weight.detach(), init_device_mesh(torch::kCPU, {2}), {Shard(0)});
    EXPECT_TRUE(torch::allclose(m->emb->weight, expect.to_local(), 1e-5, 1e-6));
  });
}

TEST(Frozen, FrozenAndTrainableShareAGroup) {
  auto batches = make_batches(3, kBatch, kSeq);
  // Reference with wte frozen.
  Net ref;
  load_full(*ref, initial_weights());
  ref->wte->weight.set_requires_grad(false);
  torch::optim::SGD ref_opt(ref->parameters(), 0.1);
  for (const auto& b : batches) {
    ref_opt.zero_grad();
    loss_fn(ref->forward(b.idx), b.targets).backward();
    ref_opt.step();
  }
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Net net;
    load_full(*net, initial_weights());
    net->wte->weight.set_requires_grad(false);
    auto mesh = init_device_mesh(torch::kCPU, {2});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    FSDPModule<Net> model(net);
    torch::optim::SGD opt(net->parameters(), 0.1);
    for (const auto& gb : batches) {
      auto b = gb.slice(pg->rank() * 6, 6);
      opt.zero_grad();
      loss_fn(model(b.idx), b.targets).backward();
      opt.step();
    }
    EXPECT_FALSE(net->wte->weight.grad().defined());
    for (const auto& p : net->named_parameters()) {
      auto expect = distribute_tensor(ref->named_parameters()[p.key()].detach(), mesh, {Shard(0)}).to_local();
      EXPECT_TRUE(torch::allclose(p.value(), expect, 1e-5, 1e-6)) << p.key();
    }
  });
}

}  // namespace
}  // namespace fsdp::testing
