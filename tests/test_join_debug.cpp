// Join for uneven inputs, debug-mode mismatch detection, timeouts and the flight recorder
// (CTest label: join_debug). Every test runs under the harness's timeout.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "fsdp/algorithms/join.h"
#include "fsdp_test_model.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

// ---- Join ------------------------------------------------------------------------------------------
// One weight w (a Linear(1, 1) without bias: rank 0 holds it, rank 1 an empty shard), loss
// (w x - y)^2 on one sample per batch, SGD(lr). Rank 0 has 5 batches, rank 1 has 3.
struct JoinCase {
  static constexpr double lr = 0.1;
  static double x(int rank, int i) { return 1.0 + 0.5 * i + rank; }
  static double y(int rank, int i) { return 2.0 - 0.25 * i + rank; }
  static int batches(int rank) { return rank == 0 ? 5 : 3; }
  // PyTorch's Join semantics: joined ranks contribute zero; the sum is divided by the initial world
  // size (2), or by the number of ranks still training.
  static double expected_final(double w, bool divide_by_initial) {
    for (int i = 0; i < 5; ++i) {
      double sum = 0;
      int active = 0;
      for (int r = 0; r < 2; ++r) {
        if (i >= batches(r)) continue;
        sum += 2 * (w * x(r, i) - y(r, i)) * x(r, i);
        ++active;
      }
      w -= lr * sum / (divide_by_initial ? 2 : active);
    }
    return w;
  }
};

void run_join(bool divide_by_initial) {
  const double w0 = 0.3;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    FSDPModule<torch::nn::Linear> model(torch::nn::LinearOptions(1, 1).bias(false));
    {
      torch::NoGradGuard g;
      model->weight.fill_(w0);
    }
    auto mesh = init_device_mesh(torch::kCPU, {2});
    fully_shard(model, FullyShardOptions().mesh(mesh));
    torch::optim::SGD opt(model->parameters(), JoinCase::lr);
    auto loss_of = [&](int i) {
      auto xb = torch::full({1, 1}, JoinCase::x(pg->rank(), i));
      auto yb = torch::full({1, 1}, JoinCase::y(pg->rank(), i));
      return (model(xb) - yb).pow(2).mean();
    };
    FSDPJoinable joinable(model, opt, [&] { return loss_of(0); });
    {
      Join join({&joinable}, JoinOptions().divide_by_initial_world_size(divide_by_initial));
      for (int i = 0; i < JoinCase::batches(pg->rank()); ++i) {
        join.notify_join_context(joinable);
        opt.zero_grad();
        loss_of(i).backward();
        opt.step();
      }
    }
    // Identical full weights on both ranks, equal to the hand-computed Join semantics.
    auto full = fsdp_api(model).sharded_parameters()[0].second.full_tensor();
    double expect = JoinCase::expected_final(w0, divide_by_initial);
    EXPECT_NEAR(full.item<double>(), expect, 1e-5) << "rank " << pg->rank();
    auto both = torch::empty({2});
    all_gather_into_tensor(both, full.reshape({1}), *pg);
    EXPECT_EQ(both[0].item<float>(), both[1].item<float>());
  });
}

TEST(Join, UnevenInputsDivideByInitialWorldSize) { run_join(true); }
TEST(Join, UnevenInputsDivideByActiveRanks) { run_join(false); }

TEST(Join, ThrowOnEarlyTerminationRaisesOnEveryRank) {
  auto errors = run_ranks_collect(2, [](ProcessGroupPtr pg) {
    FSDPModule<torch::nn::Linear> model(torch::nn::LinearOptions(1, 1).bias(false));
    fully_shard(model, FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {2})));
    torch::optim::SGD opt(model->parameters(), 0.1);
    FSDPJoinable joinable(model, opt, [&] { return model(torch::ones({1, 1})).sum(); });
    Join join({&joinable}, JoinOptions().throw_on_early_termination(true));
    for (int i = 0; i < (pg->rank() == 0 ? 5 : 3); ++i) {
      join.notify_join_context(joinable);
      opt.zero_grad();
      model(torch::ones({1, 1})).sum().backward();
      opt.step();
    }
    join.finish();
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(errors[r].find("ran out of inputs"), std::string::npos) << errors[r];
}

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

// ---- Timeouts and the flight recorder -------------------------------------------------------------
TEST(Timeout, SkippedCollectiveNamesTheMissingRankAndDumpsTheFlightRecorder) {
  auto dir = std::filesystem::temp_directory_path() / ("fsdp_fr_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  setenv("FSDP_FLIGHT_RECORDER_DIR", dir.c_str(), 1);
  const auto timeout = std::chrono::seconds(2);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<double> failed_after(3, 0);
  auto errors = run_ranks_collect(
      3,
      [&](ProcessGroupPtr pg) {
        barrier(*pg);
        if (pg->rank() == 2) {
          // Skips the all-reduce; stays alive past the others' timeout.
          std::this_thread::sleep_for(timeout + std::chrono::seconds(3));
          return;
        }
        auto t = torch::ones({4, 2});
        try {
          all_reduce(t, *pg);
        } catch (...) {
          failed_after[pg->rank()] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          throw;
        }
      },
      std::chrono::seconds(60), timeout);
  unsetenv("FSDP_FLIGHT_RECORDER_DIR");
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("all_reduce #1"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("[4, 2] Float"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("ranks that have not reached it: [2]"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("flight recorder written to"), std::string::npos) << errors[r];
    EXPECT_LT(failed_after[r], 2.0 + 5.0);
    EXPECT_TRUE(std::filesystem::exists(dir / ("fsdp_flight_recorder_default_rank" + std::to_string(r) + ".json")));
  }
  EXPECT_EQ(errors[2], "");
  std::filesystem::remove_all(dir);
}

TEST(FlightRecorder, KeepsTheLastCollectivesInOrder) {
  FlightRecorder fr(4);
  for (uint64_t s = 0; s < 6; ++s) fr.issued(s, "all_reduce", "tensor [1] Float");
  fr.completed(5);
  auto recs = fr.records();
  ASSERT_EQ(recs.size(), 4u);
  EXPECT_EQ(recs.front().seq, 2u);
  EXPECT_EQ(recs.back().seq, 5u);
  EXPECT_EQ(recs.back().state, "completed");
  EXPECT_EQ(recs[2].state, "issued");
}

}  // namespace
}  // namespace fsdp::testing
