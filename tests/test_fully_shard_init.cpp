// fully_shard initialisation and bad input (CTest label: fully_shard): the sharded layout, ignored and
// tied parameters, and the errors for parameters FSDP cannot shard and for forwards that bypass FSDP.
#include <gtest/gtest.h>

#include <string>

#include "fully_shard_test_util.h"
#include "trains_like_unsharded.h"

namespace fsdp::testing {
namespace {

TEST(BadInput, FailedFullyShardLeavesTheModuleUnchanged) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto m = std::make_shared<torch::nn::Module>();
    m->register_parameter("a", torch::ones({4, 3}));
    m->register_parameter("b", torch::ones({4, 3}).t());  // non-contiguous: rejected
    EXPECT_THROW(fully_shard(m, FullyShardOptions().mesh(mesh)), c10::Error);
    EXPECT_EQ(m->named_parameters()["a"].size(0), 4) << "validated before sharding";
    // Parameters that would be gathered in different dtypes are refused at fully_shard.
    auto n = std::make_shared<torch::nn::Module>();
    n->register_parameter("w", torch::ones({4, 3}));
    n->register_parameter("ids", torch::zeros({4}, torch::kLong), /*requires_grad=*/false);
    try {
      fully_shard(n, FullyShardOptions().mesh(mesh));
      FAIL();
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("different dtypes"), std::string::npos) << e.what();
    }
    EXPECT_EQ(n->named_parameters()["w"].size(0), 4);
  });
}

// Ignored parameters are neither sharded nor reduced.
TEST(Layout, IgnoredParamsStayFull) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Net net;
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto api = fully_shard(net, FullyShardOptions().mesh(mesh).ignored_params({net->head->weight}));
    EXPECT_EQ(net->head->weight.size(0), kClasses);
    EXPECT_EQ(net->wte->weight.size(0), pg->rank() == 0 ? 6 : 5);
    for (const auto& [name, dt] : api.sharded_parameters()) EXPECT_NE(name, "head.weight");
  });
}

TEST(Layout, ShardsFollowTorchChunkWithEmptyShards) {
  run_ranks(4, [](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    auto full = initial_weights();
    auto mesh = init_device_mesh(torch::kCPU, {4});
    // fc1.weight [5, 6] on 4 ranks: 2, 2, 1, 0 rows; head.weight [2, 6]: 1, 1, 0, 0.
    std::vector<int64_t> fc1_rows{2, 2, 1, 0}, head_rows{1, 1, 0, 0};
    EXPECT_EQ(net->blocks[0]->fc1->weight.size(0), fc1_rows[pg->rank()]);
    EXPECT_EQ(net->head->weight.size(0), head_rows[pg->rank()]);
    EXPECT_EQ(net->head->weight.size(1), kDim);
    // The local shards (the root here has no FSDPModule holder: its parameters read as full tensors
    // outside forward, as FSDP2's DTensor parameters, so the shards come from the state dict).
    for (const auto& [key, value] : get_model_state_dict(*net)) {
      const auto& local = std::get<DTensor>(value).to_local();
      auto chunks = full.at(key).chunk(4, 0);
      auto expect = pg->rank() < static_cast<int>(chunks.size()) ? chunks[pg->rank()] : full.at(key).narrow(0, 0, 0);
      EXPECT_TRUE(torch::equal(local, expect)) << key << " on rank " << pg->rank();
    }
    // Full tensors gather back exactly.
    for (const auto& [name, dt] : fsdp_api(*net).sharded_parameters()) {
      EXPECT_TRUE(torch::equal(dt.full_tensor(), full.at(name))) << name;
    }
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

TEST(BadInput, ScalarAndNonContiguousParametersNameTheParameter) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto m = std::make_shared<torch::nn::Module>();
    m->register_parameter("temperature", torch::ones({}));
    try {
      fully_shard(m, FullyShardOptions().mesh(mesh));
      FAIL();
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("'temperature'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("scalar"), std::string::npos) << e.what();
    }
    auto n = std::make_shared<torch::nn::Module>();
    n->register_parameter("w", torch::ones({4, 3}).t());
    try {
      fully_shard(n, FullyShardOptions().mesh(mesh));
      FAIL();
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("not contiguous"), std::string::npos) << e.what();
    }
  });
}

// A parent that calls a sharded child through its plain holder bypasses FSDP.
struct PlainMemberImpl : torch::nn::Module {
  Block inner{nullptr};  // a plain holder member (no FSDPModule): an implicit group since issue 13
  PlainMemberImpl() { inner = register_module("inner", Block()); }
  torch::Tensor forward(torch::Tensor x) { return inner(x); }
};
TORCH_MODULE(PlainMember);

// Was BadInput.ForwardThatBypassesFSDPSaysSo: a plain member called as `inner(x)` now trains.
TEST(BadInput, PlainMemberChildTrainsLikeOneProcess) {
  const auto x = torch::randn({4, kDim}, at::make_generator<at::CPUGeneratorImpl>(5));
  for (int ws : {2, 3}) {
    expect_trains_like_unsharded<FSDPModule<PlainMember>>(
        ws, [] { return FSDPModule<PlainMember>(); },
        [](auto& m, const DeviceMeshPtr& mesh) {
          fully_shard(m->inner, FullyShardOptions().mesh(mesh));
          fully_shard(m, FullyShardOptions().mesh(mesh));
        },
        [](auto& m, const torch::Tensor& in) { return m(in).pow(2).sum(); }, x);
  }
}

TEST(BadInput, ChildForwardBeforeRootIsAnError) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    net->blocks[0](torch::randn({2, kDim}));
    FSDPModule<Net> model(net);
    try {
      model(torch::zeros({2, 3}, torch::kLong));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("running forward through the root module first"), std::string::npos)
          << e.what();
    }
  });
}

}  // namespace
}  // namespace fsdp::testing
