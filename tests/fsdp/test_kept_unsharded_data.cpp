// Kept unsharded data (CTest labels fully_shard, fsdp_api; [Note: kept unsharded data],
// src/fsdp/fsdp_param_group_kept.cpp): set_reshard_after_backward(false) keeps the gathered parameters after
// every backward, also a synchronised one, as FSDP2, and an explicit unshard() before the root's forward is
// kept for it. The next unshard reuses the data only if no rank's shard changed: microbatches skip the
// all-gathers, an optimizer step (or a write on one rank) makes every rank gather again. Each trains the
// blocks + root model against one process on the global batch (full gradients at 1e-4 relative, parameters
// at 1e-5), on 2, 3 and 4 ranks (4: empty shards).
#include <gtest/gtest.h>

#include "fsdp/fsdp_param_group.h"
#include "fsdp/fsdp_state.h"
#include "fully_shard_test_util.h"

namespace fsdp::testing {
namespace {

uint64_t all_gathers(const DeviceMeshPtr& mesh) { return mesh->get_group(0)->collective_count("all_gather_into_tensor"); }

// Two microbatches per step, each reduce-scattered (FSDP2's default accumulation), reshard_after_backward
// false on every module: the second microbatch's forward reuses every group's gathered data (3 all-gathers
// fewer: the blocks and the root), and after the optimizer step the next forward gathers again. A stale
// reuse would make the gradients of step 1 differ from one process's.
void check_synced_microbatches(int ws) {
  constexpr int kMicro = 2;
  constexpr int64_t kMicroRows = kBatch;  // divides by 2, 3 and 4 ranks
  auto batches = make_batches(4, kMicro * kMicroRows, kSeq, 31);
  auto ref = run_reference(batches);
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    FSDPModule<Net> model(net);
    model.set_reshard_after_backward(false);  // recursive: the blocks too
    auto mesh = fsdp_api(net).mesh();
    auto opt = make_optimizer(net->parameters(), Opt::ADAMW);
    const int64_t local = kMicroRows / ws;
    for (size_t step = 0; step < batches.size(); ++step) {
      opt->zero_grad();
      uint64_t gathers[kMicro];
      for (int m = 0; m < kMicro; ++m) {
        auto b = batches[step].slice(m * kMicroRows + pg->rank() * local, local);
        const auto before = all_gathers(mesh);
        (loss_fn(model(b.idx), b.targets) / kMicro).backward();
        gathers[m] = all_gathers(mesh) - before;
        EXPECT_TRUE(fsdp::detail::fsdp_state(net->blocks[0].fsdp()).group->keeps_unsharded())
            << "microbatch " << m << " of step " << step;
      }
      EXPECT_EQ(gathers[1] + 3, gathers[0]) << "step " << step << " on rank " << pg->rank()
                                            << ": the second microbatch must reuse the 3 groups' gathers";
      expect_gradients_match(*net, ref, step, "synced microbatches, reshard_after_backward=false");
      opt->step();
    }
    expect_params_match(*net, ref.final_params, "synced microbatches, reshard_after_backward=false");
  });
}

TEST(KeptUnsharded, ReshardAfterBackwardFalseReusesGathersBetweenSyncedMicrobatchesNotAfterSteps) {
  check_synced_microbatches(2);
  check_synced_microbatches(3);
  check_synced_microbatches(4);
}

// block.unshard() before the root's forward (to overlap it with the batch loading): the block's forward uses
// that gather (5 all-gathers per step with it instead of 5 without and 6 gathered again), every step, with
// the optimizer step between two such unshards.
TEST(KeptUnsharded, ExplicitUnshardBeforeTheRootForwardIsUsedByTheForward) {
  auto batches = make_batches(4, kBatch, kSeq, 32);
  auto ref = run_reference(batches);
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    auto mesh = fsdp_api(net).mesh();
    uint64_t before = 0;
    train_vs_reference(pg, net, batches, ref, "explicit unshard before the forward", [&](size_t step, bool after) {
      if (!after) {
        before = all_gathers(mesh);
        net->blocks[1].unshard(/*async_op=*/true);  // waited by its forward
        return;
      }
      EXPECT_EQ(all_gathers(mesh) - before, 5u) << "step " << step << ": 3 in forward (one of them the explicit one), "
                                                << "2 in backward";
    });
  });
}

// A shard written on one rank only, behind autograd's back (.data(): no version bump): every rank gathers
// again (the ranks agree by an all-reduce; a rank that would reuse alone would leave the others' all-gather
// without a peer), and the forward computes with the new value.
TEST(KeptUnsharded, AShardChangedOnOneRankIsGatheredAgainOnEveryRank) {
  auto batches = make_batches(1, kBatch, kSeq, 33);
  for (int ws : {2, 4}) {
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      Net net = build_sharded({}, pg);
      FSDPModule<Net> model(net);
      model.set_reshard_after_backward(false);
      auto mesh = fsdp_api(net).mesh();
      const auto& b = batches[0];
      loss_fn(model(b.idx), b.targets).backward();
      ASSERT_TRUE(fsdp::detail::fsdp_state(net->blocks[0].fsdp()).group->keeps_unsharded());
      if (pg->rank() == 1) {
        torch::NoGradGuard no_grad;
        net->blocks[0]->fc1->weight.data().add_(0.5);  // rank 1's rows of fc1.weight (2 or 2 of 5 rows)
      }
      std::map<std::string, torch::Tensor> full;
      for (const auto& p : net->named_parameters()) full[p.key()] = sharded_param(p.value()).full_tensor();
      Net expect;
      load_full(*expect, full);
      const auto before = all_gathers(mesh);
      torch::NoGradGuard no_grad;
      auto out = model(b.idx);
      EXPECT_EQ(all_gathers(mesh) - before, 1u) << "rank " << pg->rank() << ": blocks[0] gathered again on every "
                                                << "rank, the other groups reused";
      EXPECT_TRUE(torch::allclose(out, expect->forward(b.idx), 1e-5, 1e-6))
          << "world size " << ws << ", rank " << pg->rank() << ": the forward used stale data, max |diff| "
          << max_abs_diff(out, expect->forward(b.idx));
    });
  }
}

// module.reshard() drops the kept data; the next forward gathers.
TEST(KeptUnsharded, ReshardDropsTheKeptData) {
  auto batches = make_batches(1, kBatch, kSeq, 34);
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    FSDPModule<Net> model(net);
    model.set_reshard_after_backward(false);
    auto b = batches[0].slice(pg->rank() * 6, 6);
    loss_fn(model(b.idx), b.targets).backward();
    auto& group = *fsdp::detail::fsdp_state(net->blocks[0].fsdp()).group;
    ASSERT_TRUE(group.keeps_unsharded());
    net->blocks[0].reshard();
    EXPECT_FALSE(group.keeps_unsharded());
    EXPECT_EQ(group.params()[0].unsharded_padded.storage().nbytes(), 0u) << "freed";
    auto mesh = fsdp_api(net).mesh();
    const auto before = all_gathers(mesh);
    loss_fn(model(b.idx), b.targets).backward();
    EXPECT_EQ(all_gathers(mesh) - before, 3u) << "forward: blocks[0] gathered again, blocks[1] and the root reused; "
                                              << "backward: both blocks (resharded after forward)";
  });
}

}  // namespace
}  // namespace fsdp::testing
