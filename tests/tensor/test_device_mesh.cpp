// DeviceMesh: a 2 x 2 mesh's groups and collectives, its shape against the world size, and slices of a
// 3-D mesh (transposed, partial) with their coordinates, groups and global ranks (CTest labels: foundation;
// DeviceMeshSlice: tensor_parallel).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/c10d/collectives.h"
#include "fsdp/tensor/device_mesh.h"
#include "multi_rank.h"

using fsdp::testing::run_ranks;

namespace {

TEST(DeviceMesh, TwoByTwoGroupsAndCollectives) {
  run_ranks(4, [](fsdp::ProcessGroupPtr world) {
    auto mesh = fsdp::init_device_mesh(torch::kCPU, {2, 2}, {"replicate", "shard"});
    int g = world->rank();
    EXPECT_EQ(mesh->ndim(), 2);
    EXPECT_EQ(mesh->size(), 4);
    EXPECT_EQ(mesh->size(1), 2);
    EXPECT_EQ(mesh->get_local_rank(0), g / 2);
    EXPECT_EQ(mesh->get_local_rank(1), g % 2);
    // Shard groups are rows {0,1} {2,3}; replicate groups are columns {0,2} {1,3}.
    std::vector<int> row = {g / 2 * 2, g / 2 * 2 + 1};
    std::vector<int> col = {g % 2, g % 2 + 2};
    EXPECT_EQ(mesh->get_group("shard")->global_ranks(), row);
    EXPECT_EQ(mesh->get_group("replicate")->global_ranks(), col);
    EXPECT_EQ(mesh->get_group(1)->rank(), g % 2);

    auto t = torch::full({1}, static_cast<float>(g));
    fsdp::all_reduce(t, *mesh->get_group("shard"));
    EXPECT_EQ(t.item<float>(), row[0] + row[1]);
    auto u = torch::full({1}, static_cast<float>(g));
    fsdp::all_reduce(u, *mesh->get_group("replicate"));
    EXPECT_EQ(u.item<float>(), col[0] + col[1]);

    auto shard = (*mesh)["shard"];
    EXPECT_EQ(shard->ndim(), 1);
    EXPECT_EQ(shard->size(), 2);
    EXPECT_EQ(shard->get_local_rank(), g % 2);
    EXPECT_EQ(shard->ranks(), row);
    auto out = torch::empty({2});
    fsdp::all_gather_into_tensor(out, torch::full({1}, static_cast<float>(g)), *shard->get_group());
    EXPECT_EQ(out[0].item<float>(), row[0]);
    EXPECT_EQ(out[1].item<float>(), row[1]);
    EXPECT_EQ(mesh->str(), "DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('replicate', 'shard'))");
    EXPECT_THROW((*mesh)["dp"], c10::Error);
  });
}

TEST(DeviceMesh, ShapeMustMatchWorldSize) {
  run_ranks(4, [](fsdp::ProcessGroupPtr world) {
    try {
      fsdp::init_device_mesh(torch::kCPU, {2, 3});
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("mesh shape 2 x 3 = 6 != WORLD_SIZE(4)"), std::string::npos)
          << e.what();
    }
    auto mesh = fsdp::init_device_mesh(torch::kCPU, {4});
    EXPECT_EQ(mesh->get_group().get(), world.get());  // a 1-D mesh reuses the world group
  });
}

}  // namespace

namespace fsdp::testing {
namespace {

TEST(DeviceMeshSlice, TransposedAndPartialSlicesOfThreeDims) {
  run_ranks(8, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2, 2, 2}, {"rep", "shard", "tp"});
    const auto coord = mesh->get_coordinate();
    auto t = mesh->slice({"tp", "rep", "shard"});
    EXPECT_EQ(t->get_coordinate(), (std::vector<int64_t>{coord[2], coord[0], coord[1]}));
    EXPECT_EQ(t->world(), mesh->world());
    EXPECT_EQ(t->get_group("tp"), mesh->get_group("tp"));
    // Row-major in the slice's order: (tp, rep, shard) -> rank 4 rep + 2 shard + tp.
    std::vector<int> want;
    for (int a = 0; a < 2; ++a)
      for (int b = 0; b < 2; ++b)
        for (int s = 0; s < 2; ++s) want.push_back(4 * b + 2 * s + a);
    EXPECT_EQ(t->ranks(), want);
    auto dp = mesh->slice({"rep", "shard"});
    EXPECT_EQ(dp->root_mesh(), mesh);
    EXPECT_EQ(dp->root_dims(), (std::vector<int64_t>{0, 1}));
    EXPECT_EQ(dp->world()->size(), 4);
    // The dp world holds the ranks with this rank's tp coordinate; a sum over it counts them.
    auto x = torch::full({1}, static_cast<float>(pg->rank()));
    all_reduce(x, *dp->world(), ReduceOp::SUM);
    EXPECT_EQ(x.item<float>(), static_cast<float>(0 + 2 + 4 + 6 + 4 * coord[2]));
    EXPECT_EQ((*dp)["shard"]->root_mesh(), mesh);
    // The global rank on every slice (messages name it), not the rank in the slice's group.
    EXPECT_EQ(dp->get_rank(), pg->rank());
    EXPECT_EQ((*mesh)["tp"]->get_rank(), pg->rank());
    EXPECT_EQ(t->get_rank(), pg->rank());
    EXPECT_THROW(mesh->slice({"rep", "rep"}), c10::Error);
    EXPECT_THROW(mesh->slice({"pp"}), c10::Error);
  });
}

}  // namespace
}  // namespace fsdp::testing
