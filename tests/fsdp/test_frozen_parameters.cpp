// Frozen parameters (requires_grad false) in a group with trainable ones: no gradient for them, the others
// train like the reference (CTest label: fully_shard).
#include <gtest/gtest.h>

#include "fully_shard_test_util.h"

namespace fsdp::testing {
namespace {

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
