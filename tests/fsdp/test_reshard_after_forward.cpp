// reshard_after_forward true, false and an int (CTest label: fully_shard; RegressionsReshardAfterForward,
// RegressionsParitySGD, issue 17 item 10: labels fully_shard, regressions; UnchangedMoreReshard:
// unchanged_models): after forward, the rows the parameters hold, the group's state and bytes; the all-gathers
// backward issues (over the shard group or the post-forward group of k ranks); and training parity.
#include <gtest/gtest.h>

#include <variant>
#include <vector>

#include "fully_shard_test_util.h"
#include "resharding.h"
#include "unchanged_harness.h"

namespace fsdp::testing {
namespace {

TEST(RegressionsParitySGD, ReshardAfterForwardTwoOnFourRanks) {
  ShardConfig c{ReshardAfterForward(2)};
  c.opt = Opt::SGD;
  run_parity(4, c);
}

TEST(Parity, ReshardAfterForwardTwoOnFourRanks) { run_parity(4, ShardConfig{ReshardAfterForward(2)}); }

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing::resharding {
namespace {

// ---- item 10: reshard_after_forward is honoured ---------------------------------------------------------
// The parity tests with false and 2 only check numbers, identical whatever the setting. Here: after
// forward, the rows the parameters hold, the group's state and bytes; and the all-gathers backward issues.
void check_reshard_after_forward(int ws, ReshardAfterForward raf) {
  auto batches = make_batches(1, 12, kSeq);
  Net ref;
  load_full(*ref, init_weights());
  loss_fn(ref->forward(batches[0].idx), batches[0].targets).backward();
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    FSDPModule<Net> model(shard_net(mesh, raf));
    const int64_t local = 12 / ws;
    auto b = batches[0].slice(pg->rank() * local, local);
    const bool keep = std::holds_alternative<bool>(raf) && !std::get<bool>(raf);
    const int k = std::holds_alternative<int>(raf) ? std::get<int>(raf) : 0;
    const uint64_t nblocks = model->blocks.size();
    auto ag0 = pg->collective_count("all_gather_into_tensor");
    auto rs0 = pg->collective_count("reduce_scatter_tensor");
    auto loss = loss_fn(model(b.idx), b.targets);
    auto ag1 = pg->collective_count("all_gather_into_tensor");
    EXPECT_EQ(ag1 - ag0, nblocks + 1) << "forward all-gathers";
    std::vector<uint64_t> pf0;
    for (auto& blk : model->blocks) {
      auto& st = detail::fsdp_state(blk.fsdp());
      auto& g = *st.group;
      const auto& fc1 = blk->fc1->weight;
      const int64_t local_rows = chunk_range(kHidden, ws, pg->rank()).length;
      if (keep) {
        EXPECT_EQ(g.sharded_state(), detail::ShardedState::UNSHARDED);
        EXPECT_EQ(fc1.size(0), kHidden) << "kept unsharded after forward";
        EXPECT_EQ(unsharded_bytes(g), full_unsharded_bytes(g));
      } else {
        EXPECT_EQ(fc1.size(0), local_rows) << "resharded after forward";
        EXPECT_EQ(unsharded_bytes(g), 0);
      }
      if (k > 1) {
        EXPECT_EQ(g.sharded_state(), detail::ShardedState::SHARDED_POST_FORWARD);
        ASSERT_TRUE(st.post_forward_group);
        EXPECT_EQ(st.post_forward_group->size(), k);
        for (const auto& p : g.params()) {
          ASSERT_TRUE(p.post_forward_shard.defined()) << p.fqn;
          EXPECT_EQ(p.post_forward_shard.numel(), ws / k * p.padded_numel()) << p.fqn << ": a 1/" << k << " slice";
        }
        pf0.push_back(st.post_forward_group->collective_count("all_gather_into_tensor"));
      } else if (!keep) {
        EXPECT_EQ(g.sharded_state(), detail::ShardedState::SHARDED);
      }
    }
    loss.backward();
    auto ag2 = pg->collective_count("all_gather_into_tensor");
    auto rs2 = pg->collective_count("reduce_scatter_tensor");
    // Backward all-gathers over the whole shard group: one per block with true, none with false (kept)
    // or k (gathered over the post-forward group of k ranks instead, one per block).
    EXPECT_EQ(ag2 - ag1, (keep || k > 1) ? 0u : nblocks) << "backward all-gathers over the shard group";
    for (size_t i = 0; i < pf0.size(); ++i) {
      auto& st = detail::fsdp_state(model->blocks[i].fsdp());
      EXPECT_EQ(st.post_forward_group->collective_count("all_gather_into_tensor") - pf0[i], 1u)
          << "block " << i << " gathers over its post-forward group in backward";
    }
    EXPECT_EQ(rs2 - rs0, nblocks + 1) << "reduce-scatters";
    // The numbers stay right: the sharded gradients are the reference's.
    for (const auto& p : model->named_parameters()) {
      auto expect = distribute_tensor(ref->named_parameters()[p.key()].grad(), mesh, {Shard(0)}).to_local();
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6)) << p.key() << " on rank " << pg->rank();
    }
  });
}

TEST(RegressionsReshardAfterForward, TrueReshardsAfterForwardAndGathersAgainInBackward) {
  check_reshard_after_forward(2, ReshardAfterForward(true));
  check_reshard_after_forward(3, ReshardAfterForward(true));
}
TEST(RegressionsReshardAfterForward, FalseKeepsUnshardedAndSkipsTheBackwardAllGather) {
  check_reshard_after_forward(2, ReshardAfterForward(false));
  check_reshard_after_forward(3, ReshardAfterForward(false));
}
TEST(RegressionsReshardAfterForward, TwoOnFourRanksKeepsAHalfAndGathersOverPairs) {
  check_reshard_after_forward(4, ReshardAfterForward(2));
}

}  // namespace
}  // namespace fsdp::testing::resharding

namespace fsdp::testing::unchanged_harness {
namespace {

// ---- 5. reshard_after_forward = 2 on 4 ranks ----------------------------------------------------------
// After forward each block holds the post-forward state (a 1/2 slice gathered over pairs of ranks),
// its parameters show the shard; backward gathers over the pairs, not the shard group.
TEST(UnchangedMoreReshard, IntTwoOnFourRanksPostForwardStateAndParity) {
  Config s;
  s.block_raf = ReshardAfterForward(2);
  plain_vs_holder_vs_reference(4, s, "reshard_after_forward 2");
  const int ws = 4, k = 2;
  auto batches = make_batches(1, kBatch, kSeq);
  Model ref = plain_reference();
  loss_fn(ref.forward(batches[0].idx), batches[0].targets).backward();
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    PlainNet net{nullptr};
    Model m = plain_sharded(pg, s, &net);
    auto b = batches[0].slice(pg->rank() * (kBatch / ws), kBatch / ws);
    for (int it = 0; it < 2; ++it) {
      const uint64_t nblocks = net->blocks->size();
      auto ag0 = pg->collective_count("all_gather_into_tensor");
      auto rs0 = pg->collective_count("reduce_scatter_tensor");
      auto loss = loss_fn(m.forward(b.idx), b.targets);
      auto ag1 = pg->collective_count("all_gather_into_tensor");
      EXPECT_EQ(ag1 - ag0, nblocks + 1) << "forward all-gathers, iteration " << it;
      std::vector<uint64_t> pf0;
      for (size_t i = 0; i < nblocks; ++i) {
        auto& st = detail::fsdp_state(fsdp_api(*net->blocks[i]));
        auto& g = *st.group;
        EXPECT_EQ(g.sharded_state(), detail::ShardedState::SHARDED_POST_FORWARD)
            << "block " << i << ", iteration " << it;
        EXPECT_EQ(net->blocks[i]->as<BlockImpl>()->fc1->weight.size(0), chunk_range(kHidden, ws, pg->rank()).length)
            << "block " << i << " shows its shard after forward";
        ASSERT_TRUE(st.post_forward_group);
        EXPECT_EQ(st.post_forward_group->size(), k);
        for (const auto& p : g.params()) {
          ASSERT_TRUE(p.post_forward_shard.defined()) << p.fqn;
          EXPECT_EQ(p.post_forward_shard.numel(), ws / k * p.padded_numel()) << p.fqn << ": a 1/" << k << " slice";
        }
        pf0.push_back(st.post_forward_group->collective_count("all_gather_into_tensor"));
      }
      EXPECT_EQ(detail::fsdp_state(fsdp_api(net)).group->sharded_state(), detail::ShardedState::UNSHARDED);
      loss.backward();
      EXPECT_EQ(pg->collective_count("all_gather_into_tensor") - ag1, 0u)
          << "backward all-gathers over the shard group";
      for (size_t i = 0; i < nblocks; ++i) {
        auto& st = detail::fsdp_state(fsdp_api(*net->blocks[i]));
        EXPECT_EQ(st.post_forward_group->collective_count("all_gather_into_tensor") - pf0[i], 1u)
            << "block " << i << " gathers over its pair in backward";
        EXPECT_EQ(st.group->sharded_state(), detail::ShardedState::SHARDED) << "block " << i << " after backward";
      }
      EXPECT_EQ(pg->collective_count("reduce_scatter_tensor") - rs0, nblocks + 1) << "reduce-scatters";
      auto mesh = init_device_mesh(torch::kCPU, {ws});
      for (const auto& p : net->named_parameters()) {
        auto expect = distribute_tensor(ref.module->named_parameters()[p.key()].grad(), mesh, {Shard(0)}).to_local();
        ASSERT_TRUE(p.value().grad().defined()) << p.key();
        // Iteration 1 accumulates onto iteration 0's gradient (no zero_grad): twice the reference.
        EXPECT_TRUE(torch::allclose(p.value().grad(), expect * (it + 1), kGradRtol, kGradAtol))
            << p.key() << " on rank " << pg->rank() << ", iteration " << it;
      }
    }
  });
}

}  // namespace
}  // namespace fsdp::testing::unchanged_harness
