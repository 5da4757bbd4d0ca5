// Explicit prefetch and explicit unshard/reshard (CTest label: fully_shard; UnchangedMore, Unchanged:
// unchanged_models): set_modules_to_forward_prefetch / set_modules_to_backward_prefetch issue the all-gathers
// where they are set and keep the training's numbers; unshard() (also async) and reshard() change the group's
// state and not the loss.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fsdp/fsdp_state.h"
#include "fully_shard_test_util.h"
#include "unchanged_harness.h"

namespace fsdp::testing {
namespace {

TEST(Parity, ExplicitPrefetchAndUnshard) {
  ShardConfig c;
  c.explicit_prefetch = true;
  c.explicit_unshard = true;
  run_parity(3, c);
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing::unchanged_harness {
namespace {

// ---- 3. Explicit prefetch ------------------------------------------------------------------------------
// All-gathers seen at the taps (after wte and after each block in forward; when the gradient of those
// activations arrives in backward) with explicit prefetch lists. Forward prefetch is implicit from the
// second iteration on (the recorded order) and backward prefetch implicit always, so an empty list is
// a real setting ("no prefetch").

enum class Prefetch { NONE, ROOT_ALL, CHAIN };

struct PrefetchCounts {
  std::vector<uint64_t> forward;   // all-gathers at tap(-1), tap(0), tap(1)
  std::vector<uint64_t> backward;  // all-gathers when the gradients of tap(1), tap(0), tap(-1) arrive
  uint64_t forward_total = 0, backward_total = 0;
};

template <typename Blocks>
void set_prefetch(FSDPModuleAPI root, const Blocks& blocks, Prefetch p) {
  auto api = [&](size_t i) { return fsdp_api(*blocks[i]); };
  switch (p) {
    case Prefetch::NONE:
      root.set_modules_to_forward_prefetch({});
      root.set_modules_to_backward_prefetch({});
      for (size_t i = 0; i < 2; ++i) {
        api(i).set_modules_to_forward_prefetch({});
        api(i).set_modules_to_backward_prefetch({});
      }
      break;
    case Prefetch::ROOT_ALL:  // the root's pre-forward gathers both blocks, its pre-backward both too
      root.set_modules_to_forward_prefetch(Modules{blocks[0], blocks[1]});
      root.set_modules_to_backward_prefetch(Modules{blocks[1], blocks[0]});
      for (size_t i = 0; i < 2; ++i) {
        api(i).set_modules_to_forward_prefetch({});
        api(i).set_modules_to_backward_prefetch({});
      }
      break;
    case Prefetch::CHAIN:  // block 0 prefetches block 1 in forward, block 1 block 0 in backward; root none
      root.set_modules_to_forward_prefetch({});
      root.set_modules_to_backward_prefetch({});
      api(0).set_modules_to_forward_prefetch(Modules{blocks[1]});
      api(0).set_modules_to_backward_prefetch({});
      api(1).set_modules_to_forward_prefetch({});
      api(1).set_modules_to_backward_prefetch(Modules{blocks[0]});
      break;
  }
}

PrefetchCounts expected_counts(Prefetch p) {
  switch (p) {
    case Prefetch::NONE: return {{1, 2, 3}, {0, 1, 2}, 3, 2};
    case Prefetch::ROOT_ALL: return {{3, 3, 3}, {2, 2, 2}, 3, 2};
    case Prefetch::CHAIN: return {{1, 3, 3}, {0, 2, 2}, 3, 2};
  }
  return {};
}

TEST_P(UnchangedMore, ExplicitPrefetchIssuesAllGathersWhereSetAndMatchesHolderPath) {
  const int ws = GetParam();
  for (Prefetch p : {Prefetch::NONE, Prefetch::ROOT_ALL, Prefetch::CHAIN}) {
    const std::string what =
        "prefetch case " + std::to_string(static_cast<int>(p)) + " on " + std::to_string(ws) + " ranks";
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      // Where the all-gathers are issued (unchanged model: the taps see them).
      PlainNet net{nullptr};
      Model m = plain_sharded(pg, {}, &net);
      Modules blocks(net->blocks->begin(), net->blocks->end());
      set_prefetch(fsdp_api(net), blocks, p);
      auto b = make_batches(1, kBatch, kSeq)[0].slice(pg->rank() * (kBatch / ws), kBatch / ws);
      std::vector<uint64_t> holder_totals;
      for (int it = 0; it < 2; ++it) {
        PrefetchCounts c;
        const auto ag0 = pg->collective_count("all_gather_into_tensor");
        uint64_t ag1 = 0;
        net->tap = [&](int i, torch::Tensor x) {
          c.forward.push_back(pg->collective_count("all_gather_into_tensor") - ag0);
          x.register_hook([&](torch::Tensor g) {
            c.backward.push_back(pg->collective_count("all_gather_into_tensor") - ag1);
            return g;
          });
          return x;
        };
        auto loss = loss_fn(m.forward(b.idx), b.targets);
        ag1 = pg->collective_count("all_gather_into_tensor");
        c.forward_total = ag1 - ag0;
        loss.backward();
        c.backward_total = pg->collective_count("all_gather_into_tensor") - ag1;
        net->tap = nullptr;
        const auto e = expected_counts(p);
        EXPECT_EQ(c.forward, e.forward) << what << ", iteration " << it << ", rank " << pg->rank();
        EXPECT_EQ(c.backward, e.backward) << what << ", iteration " << it << ", rank " << pg->rank();
        EXPECT_EQ(c.forward_total, e.forward_total) << what;
        EXPECT_EQ(c.backward_total, e.backward_total) << what;
      }
      // The holder path with the same lists: the same totals.
      Net hnet{nullptr};
      Model h = holder_sharded(pg, {}, &hnet);
      Modules hblocks{hnet->blocks[0].ptr(), hnet->blocks[1].ptr()};
      set_prefetch(fsdp_api(hnet), hblocks, p);
      for (int it = 0; it < 2; ++it) {
        const auto ag0 = pg->collective_count("all_gather_into_tensor");
        auto loss = loss_fn(h.forward(b.idx), b.targets);
        const auto ag1 = pg->collective_count("all_gather_into_tensor");
        loss.backward();
        const auto e = expected_counts(p);
        EXPECT_EQ(ag1 - ag0, e.forward_total) << what << ": holder path, iteration " << it;
        EXPECT_EQ(pg->collective_count("all_gather_into_tensor") - ag1, e.backward_total)
            << what << ": holder path, iteration " << it;
      }
    });
  }
}

// Training with the lists set: bit-identical to the holder path with the same lists, and the reference.
TEST_P(UnchangedMore, ExplicitPrefetchTrainingParity) {
  const int ws = GetParam();
  auto batches = make_batches(3, kBatch, kSeq);
  auto ref = reference_with(adamw(), batches);
  for (Prefetch p : {Prefetch::ROOT_ALL, Prefetch::CHAIN}) {
    const std::string what = "prefetch case " + std::to_string(static_cast<int>(p));
    std::vector<Trace> plain(ws), holder(ws);
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      Net hnet{nullptr};
      Model h = holder_sharded(pg, {}, &hnet);
      set_prefetch(fsdp_api(hnet), Modules{hnet->blocks[0].ptr(), hnet->blocks[1].ptr()}, p);
      holder[pg->rank()] = train_with(h, pg, batches, adamw());
      PlainNet net{nullptr};
      Model m = plain_sharded(pg, {}, &net);
      set_prefetch(fsdp_api(net), Modules(net->blocks->begin(), net->blocks->end()), p);
      plain[pg->rank()] = train_with(m, pg, batches, adamw());
    });
    for (int r = 0; r < ws; ++r) {
      EXPECT_EQ(diff_traces(plain[r], holder[r]), "") << what << ": unchanged vs holder path, rank " << r;
      expect_parity(plain[r], ref.ref, what + ", rank " + std::to_string(r));
    }
  }
}

// ---- Explicit unshard / reshard ----------------------------------------------------------------------

TEST_P(Unchanged, ExplicitUnshardAndReshard) {
  const int ws = GetParam();
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    PlainNet net{nullptr};
    Model m = sharded_plain(pg, {}, &net);
    auto api = fsdp_api(*net->blocks[0]);
    auto& group = *detail::fsdp_state(api).group;
    const auto& w = net->blocks[0]->as<BlockImpl>()->fc1->weight;  // [5, 6]
    const int64_t rows = (kHidden + ws - 1) / ws;                   // torch.chunk
    const int64_t mine = std::max<int64_t>(0, std::min(rows, kHidden - pg->rank() * rows));
    EXPECT_EQ(group.sharded_state(), detail::ShardedState::SHARDED);
    EXPECT_EQ(w.size(0), mine);
    api.unshard();
    EXPECT_EQ(group.sharded_state(), detail::ShardedState::UNSHARDED);
    EXPECT_EQ(w.sizes(), (std::vector<int64_t>{kHidden, kDim}));
    {
      torch::NoGradGuard g;
      EXPECT_TRUE(torch::equal(w, initial_weights().at("blocks.0.fc1.weight")));
    }
    api.reshard();
    EXPECT_EQ(group.sharded_state(), detail::ShardedState::SHARDED);
    EXPECT_EQ(w.size(0), mine);
    // Forwards with and without an explicit (async) unshard of block 0 before them: the same loss, and
    // the all-gathers the holder path issues for the same sequence.
    auto b = make_batches(1, kBatch, kSeq)[0].slice(pg->rank() * 2, 2);
    auto counts = [&](const Model& model, FSDPModuleAPI block0) {
      std::vector<uint64_t> n;
      std::vector<torch::Tensor> losses;
      for (int it = 0; it < 3; ++it) {
        if (it == 2) block0.unshard(/*async_op=*/true).wait();
        auto ag0 = pg->collective_count("all_gather_into_tensor");
        auto loss = loss_fn(model.forward(b.idx), b.targets);
        n.push_back(pg->collective_count("all_gather_into_tensor") - ag0);
        loss.backward();
        losses.push_back(loss.detach());
      }
      EXPECT_TRUE(torch::equal(losses[2], losses[1])) << "the explicit unshard changed the loss";
      return n;
    };
    auto plain_counts = counts(m, api);
    EXPECT_EQ(group.sharded_state(), detail::ShardedState::SHARDED);
    Net hnet{nullptr};
    Model h = sharded_holder(pg, {}, &hnet);
    EXPECT_EQ(plain_counts, counts(h, fsdp_api(hnet->blocks[0]))) << "forward all-gathers per iteration";
  });
}

}  // namespace
}  // namespace fsdp::testing::unchanged_harness
