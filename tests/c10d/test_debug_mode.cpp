// Debug mode (FSDP_DEBUG=DETAIL): collectives that differ between ranks (shapes, reduce ops) fail on every
// rank naming both sides, and matching collectives and a training step raise no false alarm (CTest label:
// join_debug; RegressionsDebugMode, issue 17: join_debug, regressions).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>

#include "fsdp_test_model.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

// ---- Debug mode ----------------------------------------------------------------------------------------
struct DebugEnv {
  DebugEnv() { setenv("FSDP_DEBUG", "DETAIL", 1); }
  ~DebugEnv() { unsetenv("FSDP_DEBUG"); }
};

TEST(DebugMode, ShapeMismatchFailsEveryRankWithBothShapes) {
  DebugEnv debug;
  auto t0 = std::chrono::steady_clock::now();
  auto errors = run_ranks_collect(
      3,
      [](ProcessGroupPtr pg) {
        ASSERT_TRUE(pg->debug_backend());
        barrier(*pg);
        auto t = pg->rank() == 1 ? torch::ones({10, 20}) : torch::ones({20, 10});
        all_reduce(t, *pg);
      },
      std::chrono::seconds(60), std::chrono::seconds(30));
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 10.0);
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("collective mismatch"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("[20, 10]"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("[10, 20]"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("input shape differs"), std::string::npos) << errors[r];
  }
}

TEST(DebugMode, MatchingCollectivesAndTrainingRaiseNoFalseAlarm) {
  DebugEnv debug;
  // Every rank starts from the same weights (debug mode checks it at fully_shard).
  torch::manual_seed(3);
  const auto weights = snapshot(*Net());
  run_ranks(3, [&](ProcessGroupPtr pg) {
    for (int i = 0; i < 3; ++i) barrier(*pg);
    auto t = torch::ones({5, 3});
    all_reduce(t, *pg);
    auto out = torch::empty({3 * 4});
    all_gather_into_tensor(out, torch::ones({4}), *pg);
    auto rs = torch::empty({2});
    reduce_scatter_tensor(rs, torch::ones({6}), *pg);
    broadcast(t, 2, *pg);
    // A sharded training step: all-gathers and reduce-scatters of uneven shards.
    Net net;
    load_full(*net, weights);
    auto mesh = init_device_mesh(torch::kCPU, {3});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    FSDPModule<Net> model(net);
    auto b = make_batches(1, 6, 3)[0].slice(pg->rank() * 2, 2);
    loss_fn(model(b.idx), b.targets).backward();
  });
}

// ---- Debug mode: reduce ops by name -------------------------------------------------------------------------
TEST(RegressionsDebugMode, ReduceOpMismatchNamesTheOps) {
  setenv("FSDP_DEBUG", "DETAIL", 1);
  auto errors = run_ranks_collect(
      2,
      [](ProcessGroupPtr pg) {
        auto t = torch::ones({4});
        all_reduce(t, *pg, pg->rank() == 0 ? ReduceOp::SUM : ReduceOp::MAX);
      },
      std::chrono::seconds(60), std::chrono::seconds(10));
  auto rs_errors = run_ranks_collect(
      2,
      [](ProcessGroupPtr pg) {
        auto out = torch::empty({2});
        reduce_scatter_tensor(out, torch::ones({4}), *pg, pg->rank() == 0 ? ReduceOp::AVG : ReduceOp::MIN);
      },
      std::chrono::seconds(60), std::chrono::seconds(10));
  unsetenv("FSDP_DEBUG");
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("reduce op SUM)"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("reduce op MAX)"), std::string::npos) << errors[r];
    EXPECT_NE(rs_errors[r].find("reduce op AVG)"), std::string::npos) << rs_errors[r];
    EXPECT_NE(rs_errors[r].find("reduce op MIN)"), std::string::npos) << rs_errors[r];
  }
}

}  // namespace
}  // namespace fsdp::testing
