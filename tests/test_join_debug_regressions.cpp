// Issue 17, items 3, 4 and 6 (one bullet): Join with gradient accumulation; FSDP groups that disagree
// between ranks with debug mode off fail as c10::Error on every rank (no Gloo abort); debug-mode
// messages name reduce ops. (CTest labels: join_debug, regressions)
#include <gtest/gtest.h>

#include <cstdlib>

#include "fsdp/algorithms/join.h"
#include "fsdp_test_model.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

// ---- Join with gradient accumulation ------------------------------------------------------------------
// The input: 2 ranks, Linear(8, 4), SGD lr 0.1; rank 0 has 4 microbatches, rank 1 has 2;
// gradient sync off on the first microbatch of each pair, optimizer step after the second.
constexpr int64_t kIn = 8, kOut = 4, kMb = 3;  // rows per microbatch
constexpr double kLr = 0.1;
constexpr int kAccum = 2;

torch::Tensor mb_x(int rank, int i) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + 10 * rank + i);
  return torch::randn({kMb, kIn}, gen);
}
torch::Tensor mb_y(int rank, int i) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(900 + 10 * rank + i);
  return torch::randn({kMb, kOut}, gen);
}
std::map<std::string, torch::Tensor> init_weights() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
  return {{"weight", torch::randn({kOut, kIn}, gen)}, {"bias", torch::randn({kOut}, gen)}};
}

// A Linear sharded as the root, or a root holding a separately sharded Linear (two groups: the inner
// one re-gathers in backward; its input needs no gradient).
struct TwoLevelImpl : torch::nn::Module {
  FSDPModule<torch::nn::Linear> inner{nullptr};
  torch::nn::Linear outer{nullptr};
  TwoLevelImpl() {
    inner = torch::nn::Linear(kIn, kIn);
    register_module("inner", inner.ptr());
    outer = register_module("outer", torch::nn::Linear(kIn, kOut));
  }
  torch::Tensor forward(torch::Tensor x) { return outer(torch::tanh(inner(x))); }
};
TORCH_MODULE(TwoLevel);

std::map<std::string, torch::Tensor> two_level_init() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(43);
  return {{"inner.weight", torch::randn({kIn, kIn}, gen)},
          {"inner.bias", torch::randn({kIn}, gen)},
          {"outer.weight", torch::randn({kOut, kIn}, gen)},
          {"outer.bias", torch::randn({kOut}, gen)}};
}

int microbatches(int rank, int ws) { return rank == 0 ? 4 : (ws == 3 && rank == 2 ? 0 : 2); }

torch::Tensor mb_loss(const torch::Tensor& out, int rank, int i) { return (out - mb_y(rank, i)).pow(2).mean() / kAccum; }

// Single process: each optimizer step sums the gradients of every rank's microbatches of that step
// (joined ranks contribute nothing) and divides by the world size or by the ranks that still trained.
template <typename Model>
std::pair<std::map<std::string, torch::Tensor>, std::vector<std::map<std::string, torch::Tensor>>> join_reference(
    Model ref, int ws, bool divide_by_initial) {
  torch::optim::SGD opt(ref->parameters(), kLr);
  std::vector<std::map<std::string, torch::Tensor>> grads;
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    int active = 0;
    for (int r = 0; r < ws; ++r) {
      if (microbatches(r, ws) <= step * kAccum) continue;
      ++active;
      for (int i = step * kAccum; i < (step + 1) * kAccum; ++i) mb_loss(ref->forward(mb_x(r, i)), r, i).backward();
    }
    {
      torch::NoGradGuard g;
      for (auto& p : ref->parameters()) p.grad().div_(divide_by_initial ? ws : active);
    }
    std::map<std::string, torch::Tensor> g;
    for (const auto& p : ref->named_parameters()) g[p.key()] = p.value().grad().clone();
    grads.push_back(g);
    opt.step();
  }
  return {snapshot(*ref), grads};
}

struct JoinAccumCase {
  int ws = 2;
  bool notify_every_microbatch = true;
  bool divide_by_initial = true;
  bool reshard_after_backward = true;
  bool two_level = false;
  bool eval_after_step = false;  // a forward without autograd after every optimizer step
};

template <typename Model>
void run_join_accum(const JoinAccumCase& c, Model reference_model, std::function<Model()> make,
                    const std::map<std::string, torch::Tensor>& init) {
  load_full(*reference_model, init);
  auto [ref_params, ref_grads] = join_reference(reference_model, c.ws, c.divide_by_initial);
  run_ranks(c.ws, [&](ProcessGroupPtr pg) {
    const int rank = pg->rank();
    Model model = make();
    load_full(*model, init);
    auto mesh = init_device_mesh(torch::kCPU, {c.ws});
    FSDPModule<Model> m(model);
    if constexpr (std::is_same_v<Model, TwoLevel>) fully_shard(model->inner, FullyShardOptions().mesh(mesh));
    fully_shard(model, FullyShardOptions().mesh(mesh));
    if (!c.reshard_after_backward) m.set_reshard_after_backward(false);
    torch::optim::SGD opt(model->parameters(), kLr);
    FSDPJoinable joinable(model, opt, [&] { return mb_loss(m(mb_x(rank, 0)), rank, 0); });
    std::vector<std::map<std::string, torch::Tensor>> grads_before_step;
    {
      Join join({&joinable}, JoinOptions().divide_by_initial_world_size(c.divide_by_initial));
      for (int i = 0; i < microbatches(rank, c.ws); ++i) {
        if (c.notify_every_microbatch || i % kAccum == 0) join.notify_join_context(joinable);
        m.set_requires_gradient_sync(i % kAccum == kAccum - 1);
        mb_loss(m(mb_x(rank, i)), rank, i).backward();
        if (i % kAccum == kAccum - 1) {
          std::map<std::string, torch::Tensor> g;
          for (const auto& p : model->named_parameters()) g[p.key()] = p.value().grad().clone();
          grads_before_step.push_back(g);
          opt.step();
          opt.zero_grad();
          if (c.eval_after_step) {
            torch::NoGradGuard no_grad;
            m(mb_x(rank, i));
          }
        }
      }
    }
    // An evaluation forward leaves the root unsharded (reshard_after_forward false for the root).
    m.reshard();
    // Gradients of the steps this rank took itself, then parameters, against the reference.
    for (size_t s = 0; s < grads_before_step.size(); ++s) {
      for (const auto& [name, g] : grads_before_step[s]) {
        auto expect = distribute_tensor(ref_grads[s].at(name), mesh, {Shard(0)}).to_local();
        EXPECT_TRUE(torch::allclose(g, expect, 1e-5, 1e-6)) << "gradient of " << name << " at step " << s << " on rank "
                                                            << rank;
      }
    }
    for (const auto& p : model->named_parameters()) {
      auto expect = distribute_tensor(ref_params.at(p.key()), mesh, {Shard(0)}).to_local();
      EXPECT_TRUE(torch::allclose(p.value(), expect, 1e-5, 1e-6))
          << p.key() << " on rank " << rank << ": " << max_abs_diff(p.value(), expect);
    }
  });
}

void run_linear(const JoinAccumCase& c) {
  run_join_accum<torch::nn::Linear>(
      c, torch::nn::Linear(kIn, kOut), [] { return torch::nn::Linear(kIn, kOut); }, init_weights());
}
void run_two_level(const JoinAccumCase& c) {
  run_join_accum<TwoLevel>(c, TwoLevel(), [] { return TwoLevel(); }, two_level_init());
}

TEST(RegressionsJoinAccumulation, NotifyEveryMicrobatch) { run_linear({}); }
TEST(RegressionsJoinAccumulation, NotifyOncePerOptimizerStep) {
  JoinAccumCase c;
  c.notify_every_microbatch = false;
  run_linear(c);
}
TEST(RegressionsJoinAccumulation, DivideByActiveRanks) {
  JoinAccumCase c;
  c.divide_by_initial = false;
  run_linear(c);
  c.notify_every_microbatch = false;
  run_linear(c);
}
TEST(RegressionsJoinAccumulation, ReshardAfterBackwardFalseKeepsGroupsUnshardedBetweenMicrobatches) {
  JoinAccumCase c;
  c.reshard_after_backward = false;
  run_linear(c);
  c.notify_every_microbatch = false;
  run_linear(c);
}
TEST(RegressionsJoinAccumulation, EvaluationForwardsAfterStepsAreShadowedWithoutBackward) {
  for (bool every : {true, false}) {
    JoinAccumCase c;
    c.notify_every_microbatch = every;
    c.eval_after_step = true;
    run_linear(c);
  }
}

TEST(RegressionsJoinAccumulation, TwoGroupsOnThreeRanksOneWithoutData) {
  // Rank 0: 4 microbatches, rank 1: 2, rank 2: none (it shadows from the start, lazy init included).
  for (bool every : {true, false}) {
    for (bool rab : {true, false}) {
      JoinAccumCase c;
      c.ws = 3;
      c.notify_every_microbatch = every;
      c.reshard_after_backward = rab;
      c.two_level = true;
      run_two_level(c);
    }
  }
}

TEST(RegressionsJoinAccumulation, MixedNotificationPatternsFailOnEveryRank) {
  auto errors = run_ranks_collect(
      2,
      [](ProcessGroupPtr pg) {
        torch::nn::Linear model(kIn, kOut);
        load_full(*model, init_weights());
        FSDPModule<torch::nn::Linear> m(model);
        fully_shard(model, FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {2})));
        torch::optim::SGD opt(model->parameters(), kLr);
        FSDPJoinable joinable(model, opt, [&] { return m(mb_x(0, 0)).sum(); });
        Join join({&joinable});
        for (int i = 0; i < 4; ++i) {
          // Rank 0 notifies every microbatch, rank 1 once per step.
          if (pg->rank() == 0 || i % 2 == 0) join.notify_join_context(joinable);
          m.set_requires_gradient_sync(i % 2 == 1);
          m(mb_x(pg->rank(), i)).sum().backward();
          if (i % 2 == 1) opt.step();
        }
      },
      std::chrono::seconds(60), std::chrono::seconds(10));
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("Join: rank " + std::to_string(r) + ": the ranks still training are at different points"),
              std::string::npos)
        << errors[r];
  }
}

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

}  // namespace
}  // namespace fsdp::testing
