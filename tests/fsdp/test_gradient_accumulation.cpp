// Gradient accumulation (CTest label: fully_shard): k microbatches with gradient sync off for the first k-1
// (set_requires_gradient_sync) give the gradient of one step on their concatenation, also with sync on every
// microbatch, with reshard_after_backward=false, and on an unchanged model (label unchanged_models).
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "fully_shard_test_util.h"
#include "unchanged_harness.h"

namespace fsdp::testing {
namespace {

// reshard_after_backward=false keeps the parameters unsharded between no-sync microbatches; after
// the synchronised one the optimizer sees shards with their gradients.
TEST(GradientAccumulation, ReshardAfterBackwardFalseStillStepsShards) {
  constexpr int k = 3;
  auto batches = make_batches(1, kBatch * k, kSeq, 99);
  Net ref;
  load_full(*ref, initial_weights());
  loss_fn(ref->forward(batches[0].idx), batches[0].targets).backward();
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    FSDPModule<Net> model(net);
    model.set_reshard_after_backward(false);
    for (int m = 0; m < k; ++m) {
      auto b = batches[0].slice(m * kBatch + pg->rank() * 6, 6);
      model.set_requires_gradient_sync(m == k - 1);
      (loss_fn(model(b.idx), b.targets) / k).backward();
      if (m < k - 1) EXPECT_EQ(net->blocks[0]->fc1->weight.size(0), kHidden) << "kept unsharded between microbatches";
    }
    auto mesh = init_device_mesh(torch::kCPU, {2});
    for (const auto& p : net->named_parameters()) {
      auto expect = distribute_tensor(ref->named_parameters()[p.key()].grad(), mesh, {Shard(0)}).to_local();
      ASSERT_EQ(p.value().sizes(), expect.sizes()) << p.key() << " is resharded after the synchronised backward";
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6)) << p.key();
    }
  });
}

// ---- Gradient accumulation ---------------------------------------------------------------------------
// Gradients of k microbatches (each loss divided by k) with sync off for the first k-1 must equal the
// gradient of one step on their concatenation; also with sync on every microbatch.
void check_accumulation(int ws, bool sync_each) {
  constexpr int k = 3;
  auto batches = make_batches(1, kBatch * k, kSeq, 99);
  // Reference gradient on the whole batch.
  Net ref;
  load_full(*ref, initial_weights());
  loss_fn(ref->forward(batches[0].idx), batches[0].targets).backward();
  std::map<std::string, torch::Tensor> ref_grads;
  for (const auto& p : ref->named_parameters()) ref_grads[p.key()] = p.value().grad().clone();

  run_ranks(ws, [&](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    FSDPModule<Net> model(net);
    const int64_t local = kBatch / ws;
    for (int m = 0; m < k; ++m) {
      // Microbatch m of this rank: rows of the global batch laid out as k global microbatches.
      auto b = batches[0].slice(m * kBatch + pg->rank() * local, local);
      model.set_requires_gradient_sync(sync_each || m == k - 1);
      (loss_fn(model(b.idx), b.targets) / k).backward();
    }
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    for (const auto& p : net->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      auto expect = distribute_tensor(ref_grads.at(p.key()), mesh, {Shard(0)}).to_local();
      ASSERT_EQ(p.value().grad().sizes(), expect.sizes()) << p.key();
      EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6)) << p.key() << " on rank " << pg->rank();
    }
  });
}

TEST(GradientAccumulation, NoSyncThenSyncEqualsConcatenation) {
  check_accumulation(2, false);
  check_accumulation(3, false);
}
TEST(GradientAccumulation, SyncEveryMicrobatchEqualsConcatenation) { check_accumulation(4, true); }

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing::unchanged_harness {
namespace {

// ---- Gradient accumulation without sync --------------------------------------------------------------

TEST_P(Unchanged, GradientAccumulationWithoutSyncMatchesReference) {
  const int ws = GetParam();
  auto batches = make_batches(kSteps3, kBatch, kSeq);
  auto ref = reference_run([] { return make_plain({}); }, batches);
  std::vector<Trace> traces(ws);
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    PlainNet net{nullptr};
    Model m = sharded_plain(pg, {}, &net);
    auto api = fsdp_api(net);
    auto opt = make_optimizer(net->parameters(), Opt::ADAMW);
    const int64_t local = kBatch / ws;
    Trace& t = traces[pg->rank()];
    for (const auto& global : batches) {
      auto mine = global.slice(pg->rank() * local, local);
      opt->zero_grad();
      torch::Tensor sum;
      for (int micro = 0; micro < 2; ++micro) {
        const bool last = micro == 1;
        api.set_requires_gradient_sync(last);
        const auto rs0 = pg->collective_count("reduce_scatter_tensor");
        auto b = mine.slice(micro * local / 2, local / 2);
        auto loss = loss_fn(m.forward(b.idx), b.targets) / 2;
        loss.backward();
        EXPECT_EQ(pg->collective_count("reduce_scatter_tensor") - rs0, last ? 3u : 0u) << "microbatch " << micro;
        sum = sum.defined() ? sum + loss.detach() : loss.detach();
      }
      t.grads.push_back(full_grads(*net));
      opt->step();
      t.losses.push_back(global_loss(sum, *pg));
    }
    t.final_params = full_params(*net);
  });
  for (int r = 0; r < ws; ++r) expect_parity(traces[r], ref, "accumulation, rank " + std::to_string(r));
}

}  // namespace
}  // namespace fsdp::testing::unchanged_harness
