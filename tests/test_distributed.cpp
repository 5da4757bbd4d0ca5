// Process groups, collectives and DeviceMesh (CTest label: foundation).
#include <cstdlib>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/c10d/collectives.h"
#include "fsdp/tensor/device_mesh.h"
#include "fsdp/c10d/distributed.h"
#include "multi_rank.h"

using fsdp::testing::run_ranks;
using fsdp::testing::run_ranks_collect;

namespace {

// A deterministic tensor that differs per rank: value = 100 * rank + index.
torch::Tensor rank_tensor(int rank, int64_t n) {
  return torch::arange(n, torch::kFloat32) + 100.0f * static_cast<float>(rank);
}

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, AllGatherIntoTensorUnevenSizes) {
  int world = GetParam();
  run_ranks(world, [world](fsdp::ProcessGroupPtr pg) {
    for (int64_t n : {1, 5, 7}) {  // 5 and 7 do not divide by 2, 3 or 4
      auto in = rank_tensor(pg->rank(), n);
      auto out = torch::empty({world * n});
      fsdp::all_gather_into_tensor(out, in, *pg);
      for (int r = 0; r < world; ++r) {
        ASSERT_TRUE(torch::equal(out.narrow(0, r * n, n), rank_tensor(r, n))) << "n=" << n << " chunk " << r;
      }
      // In place: the input is this rank's slice of the output.
      auto out2 = torch::zeros({world * n});
      out2.narrow(0, pg->rank() * n, n).copy_(in);
      fsdp::all_gather_into_tensor(out2, out2.narrow(0, pg->rank() * n, n), *pg, /*async_op=*/true).wait();
      ASSERT_TRUE(torch::equal(out2, out));
    }
  });
}

TEST_P(Collectives, ReduceScatterSumAndAvg) {
  int world = GetParam();
  run_ranks(world, [world](fsdp::ProcessGroupPtr pg) {
    for (int64_t n : {1, 3, 5}) {
      auto in = rank_tensor(pg->rank(), world * n);
      auto out = torch::empty({n});
      fsdp::reduce_scatter_tensor(out, in, *pg, fsdp::ReduceOp::SUM);
      auto expected = torch::zeros({world * n});
      for (int r = 0; r < world; ++r) expected += rank_tensor(r, world * n);
      auto mine = expected.narrow(0, pg->rank() * n, n);
      ASSERT_TRUE(torch::allclose(out, mine)) << out << " vs " << mine;
      auto work = fsdp::reduce_scatter_tensor(out, in, *pg, fsdp::ReduceOp::AVG, /*async_op=*/true);
      work.wait();
      work.wait();  // idempotent: divides once
      ASSERT_TRUE(torch::allclose(out, mine / world));
    }
  });
}

TEST_P(Collectives, AllReduceBroadcastBarrier) {
  int world = GetParam();
  run_ranks(world, [world](fsdp::ProcessGroupPtr pg) {
    auto t = rank_tensor(pg->rank(), 5);
    fsdp::all_reduce(t, *pg);
    auto expected = torch::zeros({5});
    for (int r = 0; r < world; ++r) expected += rank_tensor(r, 5);
    ASSERT_TRUE(torch::equal(t, expected));

    auto m = torch::full({2}, static_cast<float>(pg->rank()));
    fsdp::all_reduce(m, *pg, fsdp::ReduceOp::MAX);
    ASSERT_EQ(m[0].item<float>(), world - 1);
    auto a = torch::full({3}, static_cast<float>(pg->rank()));
    fsdp::all_reduce(a, *pg, fsdp::ReduceOp::AVG);
    ASSERT_FLOAT_EQ(a[0].item<float>(), (world - 1) / 2.0f);

    auto b = rank_tensor(pg->rank(), 4);
    int src = world - 1;
    fsdp::broadcast(b, src, *pg);
    ASSERT_TRUE(torch::equal(b, rank_tensor(src, 4)));
    fsdp::barrier(*pg);
    // Every rank issued the same number of collectives.
    ASSERT_EQ(pg->seq(), 5u);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives, ::testing::Values(1, 2, 3, 4));

TEST(Collectives, ShapeMismatchIsAClearError) {
  run_ranks(2, [](fsdp::ProcessGroupPtr pg) {
    auto in = torch::zeros({3});
    auto out = torch::empty({5});
    try {
      fsdp::all_gather_into_tensor(out, in, *pg);
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("all_gather_into_tensor"), std::string::npos) << msg;
      EXPECT_NE(msg.find("[3] Float"), std::string::npos) << msg;
      EXPECT_NE(msg.find("[5] Float"), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank=" + std::to_string(pg->rank())), std::string::npos) << msg;
    }
  });
}

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

// ---- Bad input from the environment ---------------------------------------------------------------
class Env : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                          "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "TORCHELASTIC_USE_AGENT_STORE", "FSDP_TIMEOUT_S"})
      unsetenv(v);
  }
  static std::string error_of(const std::function<void()>& fn) {
    try {
      fn();
    } catch (const c10::Error& e) {
      return e.what();
    }
    return "";
  }
};

TEST_F(Env, MissingRankNamesTheVariableAndTheFix) {
  auto msg = error_of([] { fsdp::read_launch_env(); });
  EXPECT_NE(msg.find("RANK is not set"), std::string::npos) << msg;
  EXPECT_NE(msg.find("fsdprun"), std::string::npos) << msg;
}

TEST_F(Env, WorldSizeZero) {
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "0", 1);
  auto msg = error_of([] { fsdp::read_launch_env(); });
  EXPECT_NE(msg.find("WORLD_SIZE=0"), std::string::npos) << msg;
}

TEST_F(Env, RankOutOfRangeAndGarbage) {
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "2", 1);
  EXPECT_NE(error_of([] { fsdp::read_launch_env(); }).find("RANK=3"), std::string::npos);
  setenv("RANK", "one", 1);
  EXPECT_NE(error_of([] { fsdp::read_launch_env(); }).find("RANK=one is not an integer"), std::string::npos);
}

TEST_F(Env, MissingMasterAddr) {
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "2", 1);
  auto msg = error_of([] { fsdp::read_launch_env(); });
  EXPECT_NE(msg.find("MASTER_ADDR is not set"), std::string::npos) << msg;
}

TEST_F(Env, SlurmAndOpenMpi) {
  setenv("SLURM_PROCID", "2", 1);
  setenv("SLURM_NTASKS", "4", 1);
  setenv("SLURM_LOCALID", "0", 1);
  setenv("SLURM_STEP_ID", "0", 1);  // a task of an srun step (test_slurm_env.cpp: the batch script is refused)
  setenv("MASTER_ADDR", "10.0.0.1", 1);
  setenv("MASTER_PORT", "1234", 1);
  auto env = fsdp::read_launch_env();
  EXPECT_EQ(env.source, "slurm");
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.master_port, 1234);
  unsetenv("SLURM_PROCID");
  setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "3", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  env = fsdp::read_launch_env();
  EXPECT_EQ(env.source, "openmpi");
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 3);
}

TEST_F(Env, UnreachableMasterFailsWithinTheTimeout) {
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "1", 1);  // nothing listens on port 1
  fsdp::InitOptions opts;
  opts.timeout(std::chrono::seconds(2));
  auto t0 = std::chrono::steady_clock::now();
  auto msg = error_of([&] { fsdp::init_process_group(opts); });
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(msg.find("MASTER_ADDR:MASTER_PORT = 127.0.0.1:1"), std::string::npos) << msg;
  // Bounded by the 2 s timeout, not by the 30 min default. c10d's TCPStore client makes a second attempt
  // after a jittered backoff when the first one times out (a host that drops the SYN instead of refusing
  // it: CI saw 2 s + 3.4 s + 2 s = 7.1 s), so the bound allows two attempts and the largest backoff.
  EXPECT_LT(s, 3 * 2.0 + 10.0) << "took " << s << " s";
}

TEST_F(Env, UnresolvableMasterAddrFailsAtOnce) {
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_ADDR", "no-such-host.invalid", 1);
  setenv("MASTER_PORT", "29500", 1);
  auto msg = error_of([] { fsdp::init_process_group(); });
  EXPECT_NE(msg.find("MASTER_ADDR=no-such-host.invalid cannot be resolved"), std::string::npos) << msg;
}

TEST_F(Env, SingleProcessNeedsNoMaster) {
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  setenv("MASTER_PORT", "0", 1);  // let the store pick a free port
  auto pg = fsdp::init_process_group();
  EXPECT_EQ(pg->size(), 1);
  EXPECT_EQ(pg->device(), torch::Device(torch::kCPU));
  EXPECT_TRUE(fsdp::is_initialized());
  auto t = torch::ones({3});
  fsdp::all_reduce(t, *pg);
  EXPECT_TRUE(torch::equal(t, torch::ones({3})));
  fsdp::set_default_process_group(nullptr);
}

}  // namespace
