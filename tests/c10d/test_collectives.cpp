// The collectives of a process group: all_gather_into_tensor with uneven sizes, reduce_scatter_tensor,
// all_reduce, broadcast, barrier on 1 to 4 ranks, and shape mismatches (CTest label: foundation).
#include <cstdlib>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/c10d/collectives.h"
#include "fsdp/c10d/distributed.h"
#include "multi_rank.h"

using fsdp::testing::run_ranks;

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

}  // namespace
