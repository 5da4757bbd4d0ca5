// dp_mesh_dims (CTest labels fully_shard, fsdp_api): fully_shard and replicate given the full mesh and the
// names of its data-parallel dimensions (PyTorch's DataParallelMeshDims), one or several per field
// (flattened), and replicate([m1, m2]) as one group. Each trains the blocks + root model against one process
// on the global batch on 4 ranks (full gradients every step at 1e-4 relative, final parameters at 1e-5);
// every refusal names what was wrong and the fix.
#include <gtest/gtest.h>

#include "error_message.h"
#include "fully_shard_test_util.h"

namespace fsdp::testing {
namespace {

Net fresh_net() {
  Net net;
  load_full(*net, initial_weights());
  return net;
}

TEST(DpMeshDims, HsdpFromTheFullMeshTrainsLikeOneProcess) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches);
  run_ranks(4, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"dp_replicate", "dp_shard"});
    auto opts = FullyShardOptions().mesh(mesh).dp_mesh_dims(
        DataParallelMeshDims().shard({"dp_shard"}).replicate({"dp_replicate"}));
    Net net = fresh_net();
    for (auto& b : net->blocks) fully_shard(b, opts);
    fully_shard(net, opts);
    EXPECT_EQ(fsdp_api(net).mesh()->shape(), (std::vector<int64_t>{2, 2}));
    train_vs_reference(pg, net, batches, ref, "HSDP via dp_mesh_dims");
  });
}

TEST(DpMeshDims, SeveralShardDimensionsAreFlattenedOnce) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches);
  run_ranks(4, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"a", "b"});
    auto opts = FullyShardOptions().mesh(mesh).dp_mesh_dims(DataParallelMeshDims().shard({"a", "b"}));
    Net net = fresh_net();
    for (auto& b : net->blocks) fully_shard(b, opts);
    fully_shard(net, opts);
    auto dp = fsdp_api(net).mesh();
    EXPECT_EQ(dp->shape(), (std::vector<int64_t>{4}));
    EXPECT_EQ(dp->dim_names(), (std::vector<std::string>{"a_b"}));
    EXPECT_EQ(dp.get(), net->blocks[0].fsdp().mesh().get()) << "one flattened mesh per (mesh, names)";
    EXPECT_EQ(dp->get_local_rank(0), pg->rank()) << "row-major in the mesh's order";
    train_vs_reference(pg, net, batches, ref, "FSDP over the flattened (a, b)");
  });
}

TEST(DpMeshDims, ReplicateOverFlattenedDimensionsTrainsLikeOneProcess) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches);
  run_ranks(4, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"a", "b"});
    Net net = fresh_net();
    replicate(net, ReplicateOptions().mesh(mesh).dp_mesh_dims(DataParallelMeshDims().replicate({"a", "b"})));
    EXPECT_EQ(fsdp_api(net).mesh()->shape(), (std::vector<int64_t>{4, 1}));
    train_vs_reference(pg, net, batches, ref, "replicate over the flattened (a, b)");
  });
}

// The embedding and the head replicated as one group (one all-reduce per backward for both), the blocks
// sharded, the root holding no parameter of its own.
TEST(DpMeshDims, ReplicateSeveralModulesAsOneGroup) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches);
  run_ranks(4, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {4}, {"dp"});
    Net net = fresh_net();
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    auto api = replicate({net->wte.ptr(), net->head.ptr()}, ReplicateOptions().mesh(mesh));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    std::vector<std::string> names;
    for (const auto& [name, dt] : api.sharded_parameters()) names.push_back(name);
    EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "1.weight", "1.bias"}));
    EXPECT_TRUE(is_replicated(*net->head));
    auto rep = api.mesh()->get_group(0);
    const auto ar0 = rep->collective_count("all_reduce");
    train_vs_reference(pg, net, batches, ref, "replicate([wte, head]) + sharded blocks");
    // One all-reduce per step for the two modules (the checks' full_tensor() calls add none on this group:
    // replicated gradients are local).
    EXPECT_EQ(rep->collective_count("all_reduce") - ar0, static_cast<uint64_t>(kSteps));
  });
}

TEST(DpMeshDims, RefusalsNameTheDimensionsAndTheFix) {
  run_ranks(4, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"dp_replicate", "dp_shard"});
    auto shard = [&](DataParallelMeshDims dims) {
      return error_message([&] { fully_shard(torch::nn::Linear(3, 2).ptr(), FullyShardOptions().mesh(mesh).dp_mesh_dims(dims)); });
    };
    auto m = shard(DataParallelMeshDims().shard({"dp"}));
    EXPECT_NE(m.find("dp_replicate"), std::string::npos) << "lists the mesh's names: " << m;
    m = shard(DataParallelMeshDims().shard({"dp_replicate"}).replicate({"dp_shard"}));
    EXPECT_NE(m.find("out of order"), std::string::npos) << m;
    m = shard(DataParallelMeshDims().replicate({"dp_replicate"}));
    EXPECT_NE(m.find("fsdp::replicate(module"), std::string::npos) << m;
    m = shard(DataParallelMeshDims());
    EXPECT_NE(m.find("at least one of shard or replicate"), std::string::npos) << m;
    m = error_message([&] {
      replicate(torch::nn::Linear(3, 2).ptr(),
                ReplicateOptions().mesh(mesh).dp_mesh_dims(DataParallelMeshDims().shard({"dp_shard"})));
    });
    EXPECT_NE(m.find("replicate does not shard"), std::string::npos) << m;
    m = error_message([&] {
      fully_shard(torch::nn::Linear(3, 2).ptr(),
                  FullyShardOptions().dp_mesh_dims(DataParallelMeshDims().shard({"dp_shard"})));
    });
    EXPECT_NE(m.find("no mesh was given"), std::string::npos) << m;
  });
}

}  // namespace
}  // namespace fsdp::testing
