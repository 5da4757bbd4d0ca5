// The FSDPModule holder and its API (issue 17 item 6; CTest labels: fully_shard, regressions): an
// FSDPModule<Block> assigned from register_module, sharded_parameters() names relative to the module
// fully_shard was called on, sharded gradients as DTensors.
#include <gtest/gtest.h>

#include <algorithm>

#include "multi_rank.h"
#include "shapes_net.h"

namespace fsdp::testing::shapes_net {
namespace {

// ---- Item 6: API --------------------------------------------------------------------------------------
// `b = register_module("b", Block(...))` assigns an FSDPModule<Block> (the LibTorch idiom).
struct RegisteredImpl : torch::nn::Module {
  FSDPModule<SmallBlock> b{nullptr};
  RegisteredImpl() { b = register_module("b", SmallBlock()); }
  torch::Tensor forward(torch::Tensor x) { return b(x); }
};
TORCH_MODULE(Registered);

TEST(RegressionsApi, FSDPModuleAssignableFromRegisterModule) {
  torch::manual_seed(9);
  Registered ref;
  auto w = snapshot(*ref);
  auto x = torch::randn({4, kD});
  ref->forward(x).pow(2).sum().backward();
  run_ranks(2, [&](ProcessGroupPtr pg) {
    FSDPModule<Registered> m;
    load_full(*m.ptr(), w);
    auto mesh = init_device_mesh(torch::kCPU, {2});
    fully_shard(m->b, FullyShardOptions().mesh(mesh));
    fully_shard(m, FullyShardOptions().mesh(mesh));
    (m(x.narrow(0, pg->rank() * 2, 2)).pow(2).sum() * 2).backward();
    for (const auto& p : m->named_parameters()) {
      auto expect = distribute_tensor(ref->named_parameters()[p.key()].grad(), mesh, {Shard(0)}).to_local();
      EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-5)) << p.key();
    }
  });
}

// sharded_parameters(): names relative to the module fully_shard was called on, before and after
// the first forward.
TEST(RegressionsApi, ShardedParameterNamesStayModuleRelative) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Net net;
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto api = fully_shard(net->blocks[1], FullyShardOptions().mesh(mesh));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    auto names = [&] {
      std::vector<std::string> out;
      for (const auto& [n, dt] : api.sharded_parameters()) out.push_back(n);
      std::sort(out.begin(), out.end());
      return out;
    };
    const std::vector<std::string> expect{"fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight",
                                          "norm.bias", "norm.weight", "scale"};
    EXPECT_EQ(names(), expect) << "before the first forward";
    FSDPModule<Net> model(net);
    auto b = make_batches(1, 4, 3)[0];
    loss_fn(model(b.idx), b.targets).backward();
    EXPECT_EQ(names(), expect) << "after the first forward";
  });
}

// Sharded gradients as DTensors: their full tensors are the reference gradients.
TEST(RegressionsApi, ShardedGradientsAsDTensors) {
  auto batch = make_batches(1, 12, 3, 21)[0];
  torch::manual_seed(4);
  Net ref;
  auto w = snapshot(*ref);
  loss_fn(ref->forward(batch.idx), batch.targets).backward();
  for (int ws : {2, 3}) {
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      Net net;
      load_full(*net, w);
      auto mesh = init_device_mesh(torch::kCPU, {ws});
      for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
      auto root_api = fully_shard(net, FullyShardOptions().mesh(mesh));
      FSDPModule<Net> model(net);
      EXPECT_TRUE(root_api.sharded_gradients().empty()) << "no gradient yet";
      EXPECT_FALSE(sharded_grad(net->head->weight).has_value());
      auto b = batch.slice(pg->rank() * (12 / ws), 12 / ws);
      loss_fn(model(b.idx), b.targets).backward();
      size_t n = 0;
      for (const auto& [name, dt] : root_api.sharded_gradients()) {
        EXPECT_EQ(dt.sizes(), ref->named_parameters()[name].sizes().vec()) << name;
        EXPECT_TRUE(torch::allclose(dt.full_tensor(), ref->named_parameters()[name].grad(), 1e-5, 1e-6)) << name;
        ++n;
      }
      EXPECT_EQ(n, 3u) << "wte.weight, head.weight, head.bias";
      auto g = sharded_grad(net->blocks[0]->fc1->weight);
      ASSERT_TRUE(g.has_value());
      EXPECT_TRUE(g->to_local().is_same(net->blocks[0]->fc1->weight.grad())) << "aliases the local gradient";
      EXPECT_TRUE(torch::allclose(g->full_tensor(), ref->blocks[0]->fc1->weight.grad(), 1e-5, 1e-6));
      EXPECT_THROW(sharded_grad(torch::zeros({3})), c10::Error);
    });
  }
}

}  // namespace
}  // namespace fsdp::testing::shapes_net
