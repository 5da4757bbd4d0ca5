// Tied (shared) parameters (CTest label: fully_shard): in one group they train like the reference, managed
// once; in separate groups fully_shard refuses them naming both modules by path and type (RegressionsApi,
// issue 17 item 6: labels fully_shard, regressions).
#include <gtest/gtest.h>

#include <string>

#include "fully_shard_test_util.h"
#include "shapes_net.h"

namespace fsdp::testing {
namespace {

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

TEST(Tied, InSeparateGroupsIsAClearError) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Tied m;
    auto mesh = init_device_mesh(torch::kCPU, {2});
    fully_shard(m->emb.ptr(), FullyShardOptions().mesh(mesh));
    try {
      fully_shard(m.ptr(), FullyShardOptions().mesh(mesh));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("'out.weight'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("torch::nn::EmbeddingImpl"), std::string::npos) << msg;
      EXPECT_NE(msg.find("fully_shard({module_a, module_b})"), std::string::npos) << msg;
    }
  });
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing::shapes_net {
namespace {

// Tied parameters in separate groups: the error names the other module by path and type.
TEST(RegressionsApi, TiedErrorNamesModuleByPathAndType) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    ShapesNet net;
    auto mesh = init_device_mesh(torch::kCPU, {2});
    fully_shard(net->emb, FullyShardOptions().mesh(mesh));
    try {
      fully_shard(net, FullyShardOptions().mesh(mesh));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("'out.weight'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("'emb.weight' of 'emb' (torch::nn::EmbeddingImpl)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("fully_shard({module_a, module_b})"), std::string::npos) << msg;
    }
  });
}

}  // namespace
}  // namespace fsdp::testing::shapes_net
