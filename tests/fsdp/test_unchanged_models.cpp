// fully_shard on unchanged LibTorch models (issue 13; CTest label: unchanged_models): per-module groups driven at
// tensor level, no FSDPModule holder. Training parity of every model shape of unchanged_models.h (Sequential
// elements, ModuleList and ModuleDict entries reached through as<>() / at<>(), plain holder members, LSTM /
// MultiheadAttention / Conv) sharded per module by fully_shard, by fully_shard_tree with module_types and with
// min_num_params, on 2 and 3 ranks, against the single-process run: losses, full gradients (AdamW hides their
// scale) and final parameters. The same numbers as the holder model (bit for bit), reads of a parameter between
// steps, and checkpoint_wrapper refused on an unchanged module.
//
// The other features on unchanged models are tested beside the same feature on the holder model (mixed
// precision, memory, communication, prefetch, CPU offload, HSDP, reshard_after_forward, gradient accumulation,
// modules used twice, collective checks, optimizers; checkpoints in tests/checkpoint; Join and activation
// checkpointing in tests/algorithms), with common/unchanged_harness.h. This file instantiates its fixtures
// Unchanged and UnchangedMore for test_fsdp.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "unchanged_harness.h"
#include "unchanged_models.h"

namespace fsdp::testing {
namespace {

constexpr int kParitySteps = 3;

const std::vector<Case>& cases() {
  static const std::vector<Case> all = [] {
    std::vector<Case> c;
    // Sequential elements (those with parameters: 0, 2, 3, 4).
    c.push_back({"Sequential", [] { return as_model(seeded<SeqNet>()); },
                 [](const Model& m, const FullyShardOptions& o) {
                   auto body = std::dynamic_pointer_cast<SeqNetImpl>(m.module)->body;
                   for (size_t i : {0, 2, 3, 4}) fully_shard(body->ptr(i), o);
                   fully_shard(m.module, o);
                 },
                 {"LinearImpl", "LayerNormImpl"},
                 {"body.0", "body.2", "body.3", "body.4", "head", ""},
                 // wte (66 elements), body.0 (35), then the rest of body (42): a Sequential as a group
                 // around a sharded element.
                 20,
                 {"wte", "body.0", "body", ""}});
    // ModuleList iterated with `for (const auto& m : *blocks) m->as<Block>()->forward(x)`, and indexed.
    for (int style : {0, 1}) {
      c.push_back({style == 0 ? "ModuleListIterated" : "ModuleListIndexed",
                   [style] {
                     PlainNet net;
                     load_full(*net, initial_weights());
                     net->call_style = style;
                     return as_model(net);
                   },
                   [](const Model& m, const FullyShardOptions& o) {
                     auto net = std::dynamic_pointer_cast<PlainNetImpl>(m.module);
                     for (size_t i = 0; i < net->blocks->size(); ++i) fully_shard(net->blocks[i], o);
                     fully_shard(m.module, o);
                   },
                   {"BlockImpl"},
                   {"blocks.0", "blocks.1", ""},
                   // wte (66), and each block's fc1 (35) and fc2 (36): holder members inside a list entry.
                   30,
                   {"wte", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2", ""}});
    }
    // ModuleDict entries, reached through operator[] + as<>() and through at<>().
    c.push_back({"ModuleDict", [] { return as_model(seeded<DictNet>()); },
                 [](const Model& m, const FullyShardOptions& o) {
                   auto net = std::dynamic_pointer_cast<DictNetImpl>(m.module);
                   fully_shard(net->blocks["first"], o);
                   fully_shard(net->blocks["second"], o);
                   fully_shard(m.module, o);
                 },
                 {"BlockImpl"},
                 {"blocks.first", "blocks.second", ""},
                 60,
                 {"wte", "blocks.first", "blocks.second", ""}});
    // Plain torch::nn::Embedding / LayerNorm / Linear / Conv2d members.
    c.push_back({"HolderMembers", [] { return as_model(seeded<MembersNet>()); },
                 [](const Model& m, const FullyShardOptions& o) {
                   auto net = std::dynamic_pointer_cast<MembersNetImpl>(m.module);
                   fully_shard(net->emb, o);
                   fully_shard(net->ln, o);
                   fully_shard(net->fc, o);
                   fully_shard(net->conv, o);
                   fully_shard(m.module, o);
                 },
                 // head too: the root keeps no parameter.
                 {"EmbeddingImpl", "LayerNormImpl", "LinearImpl", "Conv2dImpl"},
                 {"emb", "ln", "fc", "conv", "head", ""},
                 20,
                 {"emb", "fc", "conv", "head", ""}});
    // LSTM, MultiheadAttention, Conv1d.
    c.push_back({"LstmAttentionConv", [] { return as_model(seeded<RichNet>()); },
                 [](const Model& m, const FullyShardOptions& o) {
                   auto net = std::dynamic_pointer_cast<RichNetImpl>(m.module);
                   fully_shard(net->lstm, o);
                   fully_shard(net->mha, o);
                   fully_shard(net->conv, o);
                   fully_shard(m.module, o);
                 },
                 // MultiheadAttentionImpl names itself "torch::nn::MultiheadAttention" (Module::name()), without "Impl".
                 {"LSTMImpl", "MultiheadAttention", "Conv1dImpl"},
                 {"lstm", "mha", "conv", ""},
                 60,
                 {"wte", "lstm", "mha", ""}});
    return c;
  }();
  return all;
}

const char* how_name(How h) {
  switch (h) {
    case How::MANUAL: return "FullyShardEach";
    case How::TREE_TYPES: return "TreeByType";
    case How::TREE_SIZE: return "TreeBySize";
  }
  return "?";
}

using ParityParam = std::tuple<size_t, How, int>;  // case, sharding, world size

class UnchangedParity : public ::testing::TestWithParam<ParityParam> {};

TEST_P(UnchangedParity, AdamWMatchesSingleProcess) {
  const auto& [ci, how, ws] = GetParam();
  const Case& c = cases().at(ci);
  const std::string what = c.name + " " + how_name(how) + " on " + std::to_string(ws) + " ranks";
  auto batches = make_batches(kParitySteps, kBatch, kSeq);
  auto ref = reference_run(c.make, batches);
  std::vector<Trace> traces(ws);
  run_ranks(ws, [&, how = how](ProcessGroupPtr pg) {
    Model m = c.make();
    shard(c, how, m, FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {pg->size()})));
    // No holder anywhere: every group is driven at tensor level.
    int groups = 0;
    for (const auto& sub : m.module->modules()) {
      if (!detail::state_of(*sub)) continue;
      ++groups;
      EXPECT_TRUE(is_implicit(fsdp_api(*sub))) << what << ": " << sub->name() << " is not an implicit group";
    }
    EXPECT_GE(groups, 3) << what;
    traces[pg->rank()] = train_sharded(m, pg, batches);
  });
  for (int r = 0; r < ws; ++r) expect_parity(traces[r], ref, what + ", rank " + std::to_string(r));
  if (!traces[0].losses.empty()) {
    double worst = 0;
    for (size_t s = 0; s < ref.losses.size(); ++s) {
      worst = std::max(worst, std::abs(double(traces[0].losses[s]) - ref.losses[s]) / std::abs(double(ref.losses[s])));
    }
    std::printf("[parity] %s: max relative loss diff %.3g (tolerance %.0e)\n", what.c_str(), worst, kRtol);
  }
}

std::vector<ParityParam> parity_params() {
  std::vector<ParityParam> out;
  for (size_t ci = 0; ci < cases().size(); ++ci) {
    for (How h : {How::MANUAL, How::TREE_TYPES, How::TREE_SIZE}) {
      for (int ws : {2, 3}) out.emplace_back(ci, h, ws);
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Shapes, UnchangedParity, ::testing::ValuesIn(parity_params()),
                         [](const ::testing::TestParamInfo<ParityParam>& info) {
                           return cases().at(std::get<0>(info.param)).name + "_" + how_name(std::get<1>(info.param)) +
                                  "_" + std::to_string(std::get<2>(info.param)) + "ranks";
                         });

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing::unchanged_harness {
namespace {

// ---- The holder path and the unchanged path give identical numbers ----------------------------------

TEST_P(Unchanged, HolderPathGivesBitIdenticalLossesGradientsParameters) {
  plain_vs_holder(GetParam(), {}, "fp32");
  Knobs indexed;
  indexed.call_style = 1;
  plain_vs_holder(GetParam(), indexed, "fp32, blocks indexed");
}

// ---- Outside forward: reads between steps ------------------------------------------------------------

// Under NoGradGuard between steps (and before the first), reading a parameter sees its local shard on this
// rank alone (shape and content agree; no collective): the values are the reference's rows after that
// step; training then continues to match. See [Note: reads of a sharded parameter].
TEST_P(UnchangedMore, ReadUnderNoGradBetweenStepsSeesTheLocalShardAndTrainingContinues) {
  const int ws = GetParam();
  auto batches = make_batches(3, kBatch, kSeq);
  auto ref = reference_with(adamw(), batches);
  std::vector<Trace> traces(ws);
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    PlainNet net{nullptr};
    Model m = plain_sharded(pg, {}, &net);
    torch::optim::Optimizer* opt = nullptr;
    auto check_reads = [&](const std::map<std::string, torch::Tensor>& expect, const std::string& when) {
      torch::NoGradGuard g;
      for (const auto& p : net->named_parameters()) {
        const auto& full = expect.at(p.key());
        const auto rows = chunk_range(full.size(0), ws, pg->rank());
        const auto mine = full.narrow(0, rows.offset, rows.length);
        const double sum = p.value().sum().item<double>();
        EXPECT_NEAR(sum, mine.sum().item<double>(), 1e-5 * (1 + mine.abs().sum().item<double>()))
            << p.key() << " " << when << ", rank " << pg->rank();
        auto copy = p.value().clone();
        EXPECT_EQ(copy.sizes(), mine.sizes()) << p.key() << " " << when << ": the read did not see the shard";
        if (copy.sizes() == mine.sizes()) {
          EXPECT_TRUE(torch::allclose(copy, mine, kRtol, kAtol))
              << p.key() << " " << when << ": max |diff| " << max_abs_diff(copy, mine);
        }
      }
    };
    check_reads(initial_weights(), "before training");
    auto make_opt = [&](const std::vector<torch::Tensor>& params) {
      auto o = make_optimizer(params, Opt::ADAMW);
      opt = o.get();
      return o;
    };
    traces[pg->rank()] = train_with(m, pg, batches, make_opt, [&](size_t s) {
      opt->zero_grad();
      check_reads(ref.params_after[s], "after step " + std::to_string(s));
    });
  });
  for (int r = 0; r < ws; ++r) expect_parity(traces[r], ref.ref, "reads between steps, rank " + std::to_string(r));
}

// ---- Errors ------------------------------------------------------------------------------------------

// An unchanged module has no call that libfsdp runs: checkpoint_wrapper and apply_activation_checkpointing
// checkpoint it from the ops on its parameters (non-reentrant; tests/algorithms/test_apply_activation_checkpointing.cpp),
// and refuse the reentrant form, which re-runs a call, naming the fix; all or nothing, each module named by its path.
// The holder path still accepts it.
TEST(UnchangedErrors, ReentrantCheckpointWrapperOnAModuleWithoutHolderIsRefused) {
  run_ranks(1, [](ProcessGroupPtr pg) {
    PlainNet net;
    auto opts = FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {pg->size()}));
    std::string msg;
    try {
      checkpoint_wrapper(net->blocks[0], CheckpointOptions().use_reentrant(true));
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    EXPECT_NE(msg.find("use_reentrant(true)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("BlockImpl"), std::string::npos) << "names the module type: " << msg;
    EXPECT_FALSE(detail::checkpoint_options(*net->blocks[0])) << "a refused call leaves the module unwrapped";
    auto is_block = [](torch::nn::Module& m) { return dynamic_cast<BlockImpl*>(&m) != nullptr; };
    msg.clear();
    try {
      apply_activation_checkpointing(*net, is_block, CheckpointOptions().use_reentrant(true));
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    EXPECT_NE(msg.find("2 of the 2 modules check_fn selected cannot be checkpointed"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'blocks.0' (fsdp::testing::BlockImpl) has no fsdp::FSDPModule holder, and the reentrant form"),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("'blocks.1' (fsdp::testing::BlockImpl)"), std::string::npos) << msg;
    EXPECT_FALSE(detail::checkpoint_options(*net->blocks[0]));
    Net holder_net;
    EXPECT_EQ(apply_activation_checkpointing(*holder_net, is_block, CheckpointOptions().use_reentrant(true)),
              static_cast<int64_t>(holder_net->blocks.size()));
    ASSERT_TRUE(detail::checkpoint_options(*holder_net->blocks[0]));
    EXPECT_TRUE(detail::checkpoint_options(*holder_net->blocks[0])->use_reentrant());
    EXPECT_NO_THROW(fully_shard(holder_net->blocks[0], opts));
  });
}

// The world sizes of the Unchanged and UnchangedMore tests of every file of test_fsdp.
INSTANTIATE_TEST_SUITE_P(WorldSizes, Unchanged, ::testing::Values(2, 3));
INSTANTIATE_TEST_SUITE_P(WorldSizes, UnchangedMore, ::testing::Values(2, 3));

}  // namespace
}  // namespace fsdp::testing::unchanged_harness
