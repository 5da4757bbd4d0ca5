// Memory (CTest label: fully_shard), as FSDP2's test_fully_shard_memory.py: each rank holds about 1/N of the
// parameters and of Adam's state; the unsharded storage of every resharded group is freed after forward and
// after backward (RegressionsMemory, issue 17 item 10: labels fully_shard, regressions); an unchanged model
// keeps the same groups unsharded after forward as the holder model (UnchangedMemory: unchanged_models).
#include <gtest/gtest.h>

#include <cstdio>
#include <tuple>
#include <vector>

#include "fsdp/fsdp_state.h"
#include "fully_shard_test_util.h"
#include "resharding.h"
#include "unchanged_harness.h"

namespace fsdp::testing {
namespace {

TEST(Memory, EachRankHoldsAboutOneNthOfParametersAndAdamState) {
  const int ws = 4;
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    // A wider model so that padding is small relative to the whole.
    Net net(/*n_blocks=*/6);
    int64_t full_bytes = 0;
    int64_t max_padding = 0;  // at most one row per parameter per rank
    for (const auto& p : net->parameters()) {
      full_bytes += p.numel() * p.element_size();
      max_padding += p.numel() / p.size(0) * p.element_size();
    }
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    int64_t held = 0;
    for (auto& b : net->blocks) held += detail::fsdp_state(fully_shard(b, FullyShardOptions().mesh(mesh))).group->sharded_bytes();
    held += detail::fsdp_state(fully_shard(net, FullyShardOptions().mesh(mesh))).group->sharded_bytes();
    EXPECT_LE(held, full_bytes / ws + max_padding) << "bytes held " << held << " of " << full_bytes;
    // The parameters the optimizer sees are the local shards.
    int64_t visible = 0;
    for (const auto& p : net->parameters()) visible += p.numel() * p.element_size();
    EXPECT_LE(visible, held);
    FSDPModule<Net> model(net);
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
    auto b = make_batches(1, 8, kSeq)[0].slice(pg->rank() * 2, 2);
    loss_fn(model(b.idx), b.targets).backward();
    opt.step();
    int64_t state_bytes = 0;
    for (const auto& kv : opt.state()) {
      auto& s = static_cast<torch::optim::AdamParamState&>(*kv.second);
      state_bytes += s.exp_avg().numel() * s.exp_avg().element_size();
      state_bytes += s.exp_avg_sq().numel() * s.exp_avg_sq().element_size();
    }
    EXPECT_LE(state_bytes, 2 * held);
    EXPECT_LE(state_bytes, 2 * (full_bytes / ws + max_padding));
    if (pg->rank() == 0) {
      std::printf("[memory] 4 ranks: full params %lld B, held per rank %lld B (%.3f of full), Adam state %lld B\n",
                  static_cast<long long>(full_bytes), static_cast<long long>(held),
                  static_cast<double>(held) / full_bytes, static_cast<long long>(state_bytes));
    }
  });
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing::resharding {
namespace {

// ---- item 10: unsharded storage is freed ---------------------------------------------------------------
// A free_unsharded() that did nothing (every rank keeps the whole model) passed every numeric test.
TEST(RegressionsMemory, UnshardedStorageIsFreedAfterForwardAndAfterBackward) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto batches = make_batches(2, 4, kSeq);
    for (bool root_reshards : {false, true}) {
      FSDPModule<Net> model(shard_net(mesh, std::nullopt, ReshardAfterForward(root_reshards)));
      auto& root = *detail::fsdp_state(fsdp_api(model)).group;
      for (int it = 0; it < 2; ++it) {
        auto b = batches[it].slice(pg->rank() * 2, 2);
        auto loss = loss_fn(model(b.idx), b.targets);
        for (auto& blk : model->blocks) {
          auto& g = *detail::fsdp_state(blk.fsdp()).group;
          EXPECT_EQ(g.sharded_state(), detail::ShardedState::SHARDED);
          EXPECT_EQ(unsharded_bytes(g), 0) << "block group after forward, iteration " << it;
        }
        if (root_reshards) {
          EXPECT_EQ(unsharded_bytes(root), 0) << "root after forward with reshard_after_forward=true";
        } else {
          // The root keeps its parameters for backward: the positive control of the measurement.
          EXPECT_EQ(unsharded_bytes(root), full_unsharded_bytes(root)) << "root after forward";
          EXPECT_GT(unsharded_bytes(root), 0);
        }
        loss.backward();
        for (auto& blk : model->blocks) {
          EXPECT_EQ(unsharded_bytes(*detail::fsdp_state(blk.fsdp()).group), 0) << "block group after backward, iteration " << it;
        }
        EXPECT_EQ(unsharded_bytes(root), 0) << "root after backward, iteration " << it;
      }
      // An explicit unshard holds the full bytes; reshard frees them.
      model->blocks[0].unshard();
      auto& g0 = *detail::fsdp_state(model->blocks[0].fsdp()).group;
      EXPECT_EQ(unsharded_bytes(g0), full_unsharded_bytes(g0));
      model->blocks[0].reshard();
      EXPECT_EQ(unsharded_bytes(g0), 0) << "after FSDPModule::reshard()";
    }
  });
}

}  // namespace
}  // namespace fsdp::testing::resharding

namespace fsdp::testing::unchanged_harness {
namespace {

// ---- Memory: after forward only the root group is unsharded, as with holders ------------------------

// Group states ([blocks..., root]) and the parameter elements held, after forward and after backward.
struct MemorySnapshot {
  std::vector<detail::ShardedState> after_forward, after_backward;
  std::vector<char> in_flight_after_forward;  // an all-gather in flight holds a full buffer too
  int64_t numel_after_forward = 0;
};

MemorySnapshot memory_of(const torch::nn::Module& root, const std::vector<std::shared_ptr<torch::nn::Module>>& blocks,
                         const Model& m, ProcessGroupPtr pg) {
  auto states = [&] {
    std::vector<detail::ShardedState> s;
    for (const auto& b : blocks) s.push_back(detail::fsdp_state(fsdp_api(*b)).group->sharded_state());
    s.push_back(detail::fsdp_state(fsdp_api(root)).group->sharded_state());
    return s;
  };
  MemorySnapshot snap;
  auto b = make_batches(1, kBatch, kSeq)[0].slice(pg->rank() * 2, 2);
  for (int it = 0; it < 2; ++it) {  // the second iteration runs with the orders recorded
    auto loss = loss_fn(m.forward(b.idx), b.targets);
    snap.after_forward = states();
    snap.in_flight_after_forward.clear();
    for (const auto& b : blocks) {
      snap.in_flight_after_forward.push_back(detail::fsdp_state(fsdp_api(*b)).group->unshard_in_flight());
    }
    snap.numel_after_forward = 0;
    for (const auto& p : root.parameters()) snap.numel_after_forward += p.numel();
    loss.backward();
    snap.after_backward = states();
  }
  return snap;
}

class UnchangedMemory : public ::testing::TestWithParam<std::tuple<int, int>> {};  // ws, reshard (0 false, 1 true, k)

TEST_P(UnchangedMemory, AfterForwardSameGroupsUnshardedAsHolderPath) {
  const int ws = std::get<0>(GetParam());
  const int reshard = std::get<1>(GetParam());
  Knobs k;
  k.block_reshard = reshard <= 1 ? ReshardAfterForward(reshard == 1) : ReshardAfterForward(reshard);
  std::vector<MemorySnapshot> plain(ws), holder(ws);
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    Net hnet{nullptr};
    Model h = sharded_holder(pg, k, &hnet);
    std::vector<std::shared_ptr<torch::nn::Module>> hblocks;
    for (auto& b : hnet->blocks) hblocks.push_back(b.ptr());
    holder[pg->rank()] = memory_of(*hnet, hblocks, h, pg);
    PlainNet pnet{nullptr};
    Model p = sharded_plain(pg, k, &pnet);
    std::vector<std::shared_ptr<torch::nn::Module>> pblocks(pnet->blocks->begin(), pnet->blocks->end());
    plain[pg->rank()] = memory_of(*pnet, pblocks, p, pg);
  });
  using S = detail::ShardedState;
  for (int r = 0; r < ws; ++r) {
    EXPECT_EQ(plain[r].after_forward, holder[r].after_forward) << "rank " << r;
    EXPECT_EQ(plain[r].numel_after_forward, holder[r].numel_after_forward) << "rank " << r;
    EXPECT_EQ(plain[r].in_flight_after_forward, holder[r].in_flight_after_forward)
        << "blocks with an all-gather in flight after forward, rank " << r;
    EXPECT_EQ(plain[r].after_backward, holder[r].after_backward) << "rank " << r;
    EXPECT_EQ(plain[r].after_backward, std::vector<S>(3, S::SHARDED)) << "rank " << r;
    if (reshard == 1) {
      EXPECT_EQ(plain[r].after_forward, (std::vector<S>{S::SHARDED, S::SHARDED, S::UNSHARDED}))
          << "only the root group may be unsharded after forward, rank " << r;
    } else if (reshard == 0) {
      EXPECT_EQ(plain[r].after_forward, std::vector<S>(3, S::UNSHARDED)) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, UnchangedMemory,
                         ::testing::Values(std::make_tuple(2, 1), std::make_tuple(3, 1), std::make_tuple(2, 0),
                                           std::make_tuple(2, 2), std::make_tuple(3, 3)));

}  // namespace
}  // namespace fsdp::testing::unchanged_harness
