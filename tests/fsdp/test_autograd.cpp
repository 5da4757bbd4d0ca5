// fully_shard and autograd (issue 17 items 6 and 8; CTest labels: fully_shard, regressions; RegressionsZeroGrad:
// unchanged_models, regressions): a second backward over the same forward accumulates, an exception inside
// backward leaves the model trainable, zero_grad() after a read or an evaluation forward clears the gradient.
#include <gtest/gtest.h>

#include <optional>
#include <stdexcept>

#include "fsdp_test_model.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

// ---- Item 8: a second backward over the same forward --------------------------------------------------
void check_retain_graph(int ws, ReshardAfterForward raf) {
  constexpr int64_t kBatch = 12, kSeq = 3;
  auto batch = make_batches(1, kBatch, kSeq, 8)[0];
  torch::manual_seed(7);
  Net ref;
  auto w = snapshot(*ref);
  {
    auto loss = loss_fn(ref->forward(batch.idx), batch.targets);
    loss.backward({}, /*retain_graph=*/true);
    loss.backward();
  }
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    Net net;
    load_full(*net, w);
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh).reshard_after_forward(raf));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    FSDPModule<Net> model(net);
    auto b = batch.slice(pg->rank() * (kBatch / ws), kBatch / ws);
    auto loss = loss_fn(model(b.idx), b.targets);
    loss.backward({}, /*retain_graph=*/true);
    loss.backward();
    for (const auto& p : net->named_parameters()) {
      auto expect = distribute_tensor(ref->named_parameters()[p.key()].grad(), mesh, {Shard(0)}).to_local();
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      ASSERT_EQ(p.value().sizes(), expect.sizes()) << p.key() << " resharded after the second backward";
      EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6)) << p.key() << " on rank " << pg->rank();
    }
  });
}

TEST(RegressionsRetainGraph, SecondBackwardAccumulatesReshardTrue) {
  check_retain_graph(2, ReshardAfterForward(true));
  check_retain_graph(3, ReshardAfterForward(true));
}
TEST(RegressionsRetainGraph, SecondBackwardAccumulatesReshardFalse) {
  check_retain_graph(2, ReshardAfterForward(false));
  check_retain_graph(3, ReshardAfterForward(false));
}
TEST(RegressionsRetainGraph, SecondBackwardAccumulatesReshardInt) { check_retain_graph(4, ReshardAfterForward(2)); }

// An exception thrown inside backward (a user hook) leaves the model trainable: after zero_grad, the
// next forward/backward gives the reference gradients, on every reshard setting, whether the hook
// throws before any reduce-scatter or after some were issued.
void check_recovery(int ws, ReshardAfterForward raf, bool throw_late) {
  auto batch = make_batches(1, 12, 3, 31)[0];
  torch::manual_seed(6);
  Net ref;
  auto w = snapshot(*ref);
  loss_fn(ref->forward(batch.idx), batch.targets).backward();
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    Net net;
    load_full(*net, w);
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh).reshard_after_forward(raf));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    FSDPModule<Net> model(net);
    torch::optim::SGD opt(net->parameters(), 0.1);
    auto b = batch.slice(pg->rank() * (12 / ws), 12 / ws);
    // A first, normal step leaves sharded gradients that the failed backward must not corrupt.
    loss_fn(model(b.idx), b.targets).backward();
    opt.zero_grad();
    bool armed = true;
    auto hook_target = throw_late ? net->blocks[0]->fc1->weight : torch::Tensor();
    if (throw_late) {
      // Runs mid-backward, after blocks.1's post-backward issued its reduce-scatter.
      hook_target.register_hook([&armed](const torch::Tensor&) {
        if (armed) throw std::runtime_error("user hook failed");
      });
    }
    auto out = model(b.idx);
    if (!throw_late) {
      out.register_hook([&armed](const torch::Tensor&) {
        if (armed) throw std::runtime_error("user hook failed");
      });
    }
    EXPECT_THROW(loss_fn(out, b.targets).backward(), std::exception);
    armed = false;
    opt.zero_grad();
    for (int it = 0; it < 2; ++it) {
      loss_fn(model(b.idx), b.targets).backward();
      for (const auto& p : net->named_parameters()) {
        auto expect = distribute_tensor(ref->named_parameters()[p.key()].grad(), mesh, {Shard(0)}).to_local();
        ASSERT_TRUE(p.value().grad().defined()) << p.key();
        ASSERT_EQ(p.value().grad().sizes(), expect.sizes()) << p.key();
        EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6))
            << p.key() << " on rank " << pg->rank() << " iteration " << it;
      }
      opt.zero_grad();
    }
  });
}

TEST(RegressionsApi, TrainableAfterExceptionInsideBackward) {
  for (bool late : {false, true}) {
    check_recovery(2, ReshardAfterForward(true), late);
    check_recovery(2, ReshardAfterForward(false), late);
    check_recovery(3, ReshardAfterForward(true), late);
  }
}

// Was a bug of both paths: a forward use outside training -- a read under NoGradGuard on an implicit
// group, or an evaluation forward of the root on either path -- unsharded the group and moved its
// sharded gradients aside (p.grad() was then undefined); opt.zero_grad() afterwards cleared nothing,
// and the next backward added the old gradient to the new one (measured: exactly g0 + g1). The sharded
// gradient now stays in .grad outside a backward, whatever the data.
TEST(RegressionsZeroGrad, ZeroGradAfterReadOrEvaluationForwardClearsTheGradient) {
  for (int variant = 0; variant < 3; ++variant) {  // 0: read (implicit); 1: eval forward (implicit); 2: holder
    run_ranks(2, [&](ProcessGroupPtr pg) {
      torch::nn::Linear lin(4, 4);
      {
        torch::NoGradGuard g;
        lin->weight.copy_(torch::arange(16, torch::kFloat).reshape({4, 4}) / 16);
        lin->bias.fill_(0.1);
      }
      std::optional<FSDPModule<torch::nn::Linear>> holder;
      if (variant == 2) holder.emplace(lin);
      fully_shard(lin, FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {2})));
      auto fwd = [&](const torch::Tensor& x) { return holder ? (*holder)(x) : lin(x); };
      auto x = torch::arange(8, torch::kFloat).reshape({2, 4}) * (pg->rank() + 1);
      fwd(x).pow(2).sum().backward();
      const auto g0 = lin->weight.grad().clone();
      {
        torch::NoGradGuard g;
        if (variant == 0) {
          lin->weight.sum();
        } else {
          fwd(x);
        }
      }
      for (auto& p : lin->parameters()) p.mutable_grad() = torch::Tensor();  // opt.zero_grad()
      fwd(x).pow(2).sum().backward();
      EXPECT_TRUE(torch::allclose(lin->weight.grad(), g0))
          << "variant " << variant << ", rank " << pg->rank() << ": second gradient " << lin->weight.grad() << " first "
          << g0;
    });
  }
}

}  // namespace
}  // namespace fsdp::testing
