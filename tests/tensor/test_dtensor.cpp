// DTensor (src/tensor/dtensor.cpp; CTest label: foundation): distribute_tensor, from_local and full_tensor over a
// 1-D mesh whose size does not divide the sharded dim.
#include <gtest/gtest.h>

#include "fsdp/fsdp.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

TEST(DTensor, DistributeFullTensorAndFromLocal) {
  run_ranks(3, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {3});
    auto full = torch::arange(2 * 7, torch::kFloat32).view({2, 7});
    for (int64_t dim : {0, 1}) {
      auto dt = distribute_tensor(full, mesh, {Shard(dim)});
      EXPECT_EQ(dt.to_local().size(dim), chunk_range(full.size(dim), 3, pg->rank()).length);
      EXPECT_TRUE(torch::equal(dt.full_tensor(), full));
      auto back = DTensor::from_local(dt.to_local(), mesh, {Shard(dim)});
      EXPECT_EQ(back.sizes(), full.sizes().vec());
    }
    auto rep = distribute_tensor(full, mesh, {Replicate()});
    EXPECT_TRUE(torch::equal(rep.full_tensor(), full));
    EXPECT_THROW(DTensor(torch::zeros({5, 7}), mesh, {Shard(0)}, {2, 7}), c10::Error);
  });
}

}  // namespace
}  // namespace fsdp::testing
