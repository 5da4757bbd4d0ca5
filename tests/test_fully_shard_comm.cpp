// fully_shard communication and memory (CTest label: fully_shard): the collectives FSDP2 issues per
// iteration, and the bytes each rank holds for parameters and optimizer state.
#include <gtest/gtest.h>

#include <cstdio>

#include "fsdp/fsdp_state.h"
#include "fully_shard_test_util.h"

namespace fsdp::testing {
namespace {

// ---- Communication counts -------------------------------------------------------------------------
TEST(Communication, CountsMatchFSDP2ForBlocksPlusRoot) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    FSDPModule<Net> model(net);
    auto batches = make_batches(2, kBatch, kSeq);
    const int blocks = static_cast<int>(net->blocks.size());
    for (int it = 0; it < 2; ++it) {
      auto b = batches[it].slice(pg->rank() * 6, 6);
      auto ag0 = pg->collective_count("all_gather_into_tensor");
      auto rs0 = pg->collective_count("reduce_scatter_tensor");
      auto loss = loss_fn(model(b.idx), b.targets);
      auto ag1 = pg->collective_count("all_gather_into_tensor");
      loss.backward();
      auto ag2 = pg->collective_count("all_gather_into_tensor");
      auto rs2 = pg->collective_count("reduce_scatter_tensor");
      EXPECT_EQ(ag1 - ag0, blocks + 1u) << "forward all-gathers, iteration " << it;
      EXPECT_EQ(ag2 - ag1, static_cast<uint64_t>(blocks)) << "backward all-gathers, iteration " << it;
      EXPECT_EQ(rs2 - rs0, blocks + 1u) << "reduce-scatters, iteration " << it;
    }
  });
}

TEST(Communication, WorldSizeOneIssuesNoCollectives) {
  run_ranks(1, [](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    FSDPModule<Net> model(net);
    auto b = make_batches(1, 4, kSeq)[0];
    loss_fn(model(b.idx), b.targets).backward();
    EXPECT_EQ(pg->collective_count("all_gather_into_tensor"), 0u);
    EXPECT_EQ(pg->collective_count("reduce_scatter_tensor"), 0u);
    for (const auto& p : net->parameters()) EXPECT_TRUE(p.grad().defined());
  });
}

// ---- Memory -------------------------------------------------------------------------------------------
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
