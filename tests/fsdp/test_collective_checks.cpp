// Ranks whose FSDP groups disagree (CTest labels: join_debug, regressions; UnchangedMoreDebug:
// unchanged_models): with debug mode off, different model shapes, ignored parameters or numbers of groups fail
// on every rank as a c10::Error (no Gloo abort) for the cost of one small all-reduce at the first forward, and a
// parameter unused on one rank is reduced; with FSDP_DEBUG=DETAIL, different weights, models or group dtypes
// fail on every rank with the same message on an unchanged model as on the holder model.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "multi_rank.h"
#include "two_level_model.h"
#include "unchanged_harness.h"

namespace fsdp::testing::two_level_model {
namespace {

// ---- Groups that disagree between ranks, debug mode off --------------------------------------------------
void expect_layout_error(const std::vector<std::string>& errors, const std::string& what) {
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_NE(errors[r].find("fully_shard: the ranks disagree about the collectives of their FSDP groups"),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find(what), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

TEST(RegressionsCollectiveCheck, DifferentModelShapesFailOnEveryRankWithoutAbort) {
  unsetenv("FSDP_DEBUG");
  auto errors = run_ranks_collect(
      2,
      [](ProcessGroupPtr pg) {
        ASSERT_FALSE(pg->debug_backend());
        FSDPModule<torch::nn::Linear> m(torch::nn::LinearOptions(kIn, pg->rank() == 0 ? 4 : 6));
        fully_shard(m, FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {2})));
        m(torch::ones({2, kIn})).sum().backward();
      },
      std::chrono::seconds(60), std::chrono::seconds(10));
  expect_layout_error(errors, "all_gather_into_tensor elements per rank 18 on rank 0 but 27 on rank 1");
}

TEST(RegressionsCollectiveCheck, DifferentIgnoredParamsFailOnEveryRank) {
  unsetenv("FSDP_DEBUG");
  auto errors = run_ranks_collect(
      2,
      [](ProcessGroupPtr pg) {
        FSDPModule<torch::nn::Linear> m(torch::nn::LinearOptions(kIn, kOut));
        auto opts = FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {2}));
        if (pg->rank() == 1) opts.ignored_params({m->bias});
        fully_shard(m, opts);
        m(torch::ones({2, kIn})).sum().backward();
      },
      std::chrono::seconds(60), std::chrono::seconds(10));
  expect_layout_error(errors, "number of parameters 2 on rank 0 but 1 on rank 1");
}

TEST(RegressionsCollectiveCheck, DifferentNumberOfGroupsFailOnEveryRank) {
  unsetenv("FSDP_DEBUG");
  auto errors = run_ranks_collect(
      2,
      [](ProcessGroupPtr pg) {
        TwoLevel model;
        FSDPModule<TwoLevel> m(model);
        auto mesh = init_device_mesh(torch::kCPU, {2});
        if (pg->rank() == 0) fully_shard(model->inner, FullyShardOptions().mesh(mesh));
        fully_shard(model, FullyShardOptions().mesh(mesh));
        m(torch::ones({2, kIn})).sum().backward();
      },
      std::chrono::seconds(60), std::chrono::seconds(10));
  expect_layout_error(errors, "FSDP groups per rank: rank 0: 2, rank 1: 1");
}

// Cost: one all-reduce of 2 x world int64 at the first forward, nothing afterwards (measured through
// the group's collective counters).
TEST(RegressionsCollectiveCheck, CostsOneSmallAllReduceOnTheFirstIterationOnly) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Net net;
    auto mesh = init_device_mesh(torch::kCPU, {2});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    FSDPModule<Net> model(net);
    auto b = make_batches(1, 4, 3)[0].slice(pg->rank() * 2, 2);
    std::vector<uint64_t> ar, bytes;
    for (int it = 0; it < 3; ++it) {
      auto ar0 = pg->collective_count("all_reduce");
      auto by0 = pg->collective_bytes("all_reduce");
      loss_fn(model(b.idx), b.targets).backward();
      ar.push_back(pg->collective_count("all_reduce") - ar0);
      bytes.push_back(pg->collective_bytes("all_reduce") - by0);
    }
    EXPECT_EQ(ar, (std::vector<uint64_t>{1, 0, 0}));
    EXPECT_EQ(bytes, (std::vector<uint64_t>{2 * 2 * 8, 0, 0}));
  });
}

}  // namespace
}  // namespace fsdp::testing::two_level_model

namespace fsdp::testing {
namespace {

// ---- A parameter unused on some ranks (e.g. an expert no token was routed to) ---------------------------
// One group holds three experts; rank 0 routes through `a` only, rank 1 through `a` and `b`, nobody
// through `c`. Before, the ranks' reduce-scatters differed in size (Gloo aborts the process); now every
// trainable parameter takes part, `b`'s gradient is the mean of (0, rank 1's), `c` keeps none.
struct ExpertsImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  bool use_b = false;
  ExpertsImpl() {
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 4));
    c = register_module("c", torch::nn::Linear(4, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto y = a(x);
    return use_b ? y + b(x) : y;
  }
};
TORCH_MODULE(Experts);

TEST(RegressionsCollectiveCheck, ParameterUnusedOnOneRankIsReducedNotAborted) {
  unsetenv("FSDP_DEBUG");
  torch::manual_seed(11);
  const auto init = snapshot(*Experts());
  auto x_of = [](int rank) { return torch::arange(8, torch::kFloat).reshape({2, 4}) * (rank + 1) / 8; };
  // Reference: the mean over ranks of each rank's gradient.
  Experts ref;
  load_full(*ref, init);
  for (int r = 0; r < 2; ++r) {
    ref->use_b = r == 1;
    (ref->forward(x_of(r)).pow(2).sum() / 2).backward();
  }
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Experts net;
    load_full(*net, init);
    net->use_b = pg->rank() == 1;
    FSDPModule<Experts> m(net);
    auto mesh = init_device_mesh(torch::kCPU, {2});
    fully_shard(m, FullyShardOptions().mesh(mesh));
    m(x_of(pg->rank())).pow(2).sum().backward();
    for (const auto& p : net->named_parameters()) {
      const auto& g = ref->named_parameters()[p.key()].grad();
      if (p.key().rfind("c.", 0) == 0) {
        EXPECT_FALSE(p.value().grad().defined()) << p.key() << " was used by no rank";
        continue;
      }
      ASSERT_TRUE(p.value().grad().defined()) << p.key() << " on rank " << pg->rank();
      auto expect = distribute_tensor(g, mesh, {Shard(0)}).to_local();
      EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6)) << p.key() << " on rank " << pg->rank();
    }
  });
}

// ---- 2. Debug mode: ranks that disagree ---------------------------------------------------------------
// FSDP_DEBUG=DETAIL. Each disagreement raises on every rank, with the same message on both paths
// (the root's type name aside), instead of hanging or training a mixture.

struct DebugEnv {
  DebugEnv() { setenv("FSDP_DEBUG", "DETAIL", 1); }
  ~DebugEnv() { unsetenv("FSDP_DEBUG"); }
};

enum class Disagree { WEIGHTS, BLOCK_COUNT, BLOCK_DTYPE };

// Builds the model for `rank` with the disagreement on rank 1, shards it and runs one step.
template <typename NetT>
void disagreeing_step(ProcessGroupPtr pg, Disagree d) {
  const int rank = pg->rank();
  NetT net(d == Disagree::BLOCK_COUNT && rank == 1 ? 3 : 2);
  {
    torch::NoGradGuard g;
    const auto init = initial_weights();
    for (auto& p : net->named_parameters()) {
      auto it = init.find(p.key());
      if (it != init.end()) {
        p.value().copy_(it->second);
      } else {
        p.value().fill_(0.5);  // blocks.2 of the longer model
      }
    }
    if (d == Disagree::WEIGHTS && rank == 1) net->named_parameters()["blocks.1.fc1.weight"][0][0].add_(1.0);
  }
  std::optional<FSDPModule<NetT>> holder;
  if constexpr (std::is_same_v<NetT, Net>) holder.emplace(net);
  auto mesh = init_device_mesh(torch::kCPU, {pg->size()});
  auto opts = FullyShardOptions().mesh(mesh);
  std::vector<std::shared_ptr<torch::nn::Module>> blocks;
  if constexpr (std::is_same_v<NetT, Net>) {
    for (auto& b : net->blocks) blocks.push_back(b.ptr());
  } else {
    blocks.assign(net->blocks->begin(), net->blocks->end());
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    auto o = opts;
    if (d == Disagree::BLOCK_DTYPE && rank == 1 && i == 1) {
      o.mp_policy(MixedPrecisionPolicy().param_dtype(torch::kBFloat16));
    }
    fully_shard(blocks[i], o);
  }
  fully_shard(net, opts);
  if constexpr (std::is_same_v<NetT, Net>) {
    EXPECT_FALSE(is_implicit(fsdp_api(net)));
  } else {
    EXPECT_TRUE(is_implicit(fsdp_api(net)));
  }
  auto b = make_batches(1, kBatch, kSeq)[0].slice(rank * 2, 2);
  auto out = holder ? (*holder)(b.idx) : net->forward(b.idx);
  loss_fn(out.to(torch::kFloat), b.targets).backward();
}

// The unchanged model's root type named as the holder model's (the only expected difference).
std::string normalized(std::string s) {
  const std::string from = "PlainNetImpl", to = "NetImpl";
  for (size_t pos; (pos = s.find(from)) != std::string::npos;) s.replace(pos, from.size(), to);
  return s;
}

void check_disagreement(Disagree d, const std::vector<std::string>& phrases) {
  DebugEnv debug;
  const int ws = 2;
  auto collect = [&](auto tag) {
    using NetT = decltype(tag);
    return run_ranks_collect(
        ws,
        [&](ProcessGroupPtr pg) {
          ASSERT_TRUE(pg->debug_backend());
          disagreeing_step<NetT>(pg, d);
        },
        std::chrono::seconds(60), std::chrono::seconds(10));
  };
  auto holder = collect(Net{nullptr});
  auto plain = collect(PlainNet{nullptr});
  for (int r = 0; r < ws; ++r) {
    EXPECT_NE(plain[r], "") << "rank " << r << " did not fail";
    for (const auto& ph : phrases) EXPECT_NE(plain[r].find(ph), std::string::npos) << "rank " << r << ": " << plain[r];
    EXPECT_EQ(normalized(plain[r]), holder[r]) << "rank " << r << ": unchanged vs holder path";
  }
}

TEST(UnchangedMoreDebug, DifferentWeightsOnOneRankNamedAtFullyShard) {
  check_disagreement(Disagree::WEIGHTS, {"fully_shard: parameter 'fc1.weight'", "differs between rank 0 and rank 1",
                                         "FSDP_DEBUG checksum check"});
}

// Rank 1 has a third block: the checksum exchanges of fully_shard meet with different lengths (the
// root's 3 parameters on rank 0, blocks.2's 7 on rank 1), which debug mode names.
TEST(UnchangedMoreDebug, DifferentModelOnOneRankFailsEveryRank) {
  check_disagreement(Disagree::BLOCK_COUNT,
                     {"FSDP_DEBUG: collective mismatch", "rank 0 calls all_reduce #2(input [2, 3]",
                      "rank 1 calls all_reduce #2(input [2, 7]", "(input shape differs)"});
}

// Rank 1 gathers blocks.1 in bf16: the implicit root's lazy init (at the first op of the forward)
// compares the groups before any all-gather.
TEST(UnchangedMoreDebug, DifferentGroupDtypeOnOneRankFailsEveryRankAtFirstForward) {
  check_disagreement(Disagree::BLOCK_DTYPE,
                     {"fully_shard: the ranks disagree about the collectives of their FSDP groups",
                      "all-gather dtype Float on rank 0 but BFloat16 on rank 1",
                      "group #2 is 'blocks.1' (fsdp::testing::BlockImpl)"});
}

}  // namespace
}  // namespace fsdp::testing
