// Join for uneven inputs (CTest label: join_debug): joined ranks shadow the collectives of those still
// training; the gradient is divided by the initial world size or by the active ranks; throw_on_early_termination
// raises on every rank. With gradient accumulation (RegressionsJoinAccumulation, issue 17 item 3: labels
// join_debug, regressions): notified every microbatch or once per optimizer step, reshard_after_backward false,
// evaluation forwards, a rank without data from the start, mixed patterns refused. On an unchanged model
// (UnchangedMore: unchanged_models) the same as on the holder model.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "fsdp/algorithms/join.h"
#include "multi_rank.h"
#include "two_level_model.h"
#include "unchanged_harness.h"

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

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing::two_level_model {
namespace {

// ---- Join with gradient accumulation ------------------------------------------------------------------
// The input: 2 ranks, Linear(8, 4), SGD lr 0.1; rank 0 has 4 microbatches, rank 1 has 2;
// gradient sync off on the first microbatch of each pair, optimizer step after the second.

constexpr int64_t kMb = 3;  // rows per microbatch
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
    // Gradients of the steps this rank took itself, then parameters, against the reference. This rank's rows of the
    // reference, sliced locally: ranks take different numbers of steps, so a collective (distribute_tensor's
    // broadcast from rank 0, its default since issue 35) would pair different tensors across ranks.
    auto my_rows = [&](const torch::Tensor& full) {
      return distribute_tensor(full, mesh, {Shard(0)}, /*src_data_rank=*/std::nullopt).to_local();
    };
    for (size_t s = 0; s < grads_before_step.size(); ++s) {
      for (const auto& [name, g] : grads_before_step[s]) {
        auto expect = my_rows(ref_grads[s].at(name));
        EXPECT_TRUE(torch::allclose(g, expect, 1e-5, 1e-6)) << "gradient of " << name << " at step " << s << " on rank "
                                                            << rank;
      }
    }
    for (const auto& p : model->named_parameters()) {
      auto expect = my_rows(ref_params.at(p.key()));
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

}  // namespace
}  // namespace fsdp::testing::two_level_model

namespace fsdp::testing::unchanged_harness {
namespace {

// ---- 1. Join with uneven inputs ----------------------------------------------------------------------
// Rank r trains on its slice of the first n(r) global batches (2 ranks: 3, 2; 3 ranks: 3, 1, 0 -- the
// last rank never trains and shadows from the start, lazy init included); SGD (its update keeps the
// gradient's scale, which tells the divide factor apart). Reference: each step sums the losses of the
// ranks still training and divides by the initial world size or by those ranks.

int join_batches(int rank, int ws) {
  static const std::vector<int> two{3, 2}, three{3, 1, 0};
  return (ws == 2 ? two : three).at(rank);
}

struct JoinRun {
  std::vector<std::map<std::string, torch::Tensor>> local_grads;  // this rank's steps
  std::map<std::string, torch::Tensor> final_params;
};

void run_join_case(int ws, bool divide_by_initial) {
  const std::string what =
      std::to_string(ws) + " ranks, divide_by_initial_world_size " + std::to_string(divide_by_initial);
  auto batches = make_batches(3, kBatch, kSeq);
  const int64_t local = kBatch / ws;
  // Reference.
  Model ref = plain_reference();
  torch::optim::SGD ref_opt(ref.module->parameters(), 0.1);
  std::vector<std::map<std::string, torch::Tensor>> ref_grads;
  for (int s = 0; s < 3; ++s) {
    ref_opt.zero_grad();
    torch::Tensor sum;
    int active = 0;
    for (int r = 0; r < ws; ++r) {
      if (s >= join_batches(r, ws)) continue;
      ++active;
      auto b = batches[s].slice(r * local, local);
      auto l = loss_fn(ref.forward(b.idx), b.targets);
      sum = sum.defined() ? sum + l : l;
    }
    (sum / (divide_by_initial ? ws : active)).backward();
    std::map<std::string, torch::Tensor> g;
    for (const auto& p : ref.module->named_parameters()) g[p.key()] = p.value().grad().clone();
    ref_grads.push_back(g);
    ref_opt.step();
  }
  const auto ref_final = snapshot(*ref.module);

  std::vector<JoinRun> plain(ws), holder(ws);
  std::vector<uint64_t> plain_ag(ws), holder_ag(ws);
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    const int rank = pg->rank();
    auto run = [&](const Model& m, JoinRun& out, uint64_t& ag) {
      torch::optim::SGD opt(m.module->parameters(), 0.1);
      auto sample = batches[0].slice(rank * local, local);
      FSDPJoinable joinable(m.module, opt, [&] { return loss_fn(m.forward(sample.idx), sample.targets); });
      const auto ag0 = pg->collective_count("all_gather_into_tensor");
      {
        Join join({&joinable}, JoinOptions().divide_by_initial_world_size(divide_by_initial));
        for (int s = 0; s < join_batches(rank, ws); ++s) {
          join.notify_join_context(joinable);
          auto b = batches[s].slice(rank * local, local);
          opt.zero_grad();
          loss_fn(m.forward(b.idx), b.targets).backward();
          std::map<std::string, torch::Tensor> g;
          for (const auto& p : m.module->named_parameters()) {
            if (p.value().grad().defined()) g[p.key()] = p.value().grad().clone();
          }
          out.local_grads.push_back(g);
          opt.step();
        }
      }
      ag = pg->collective_count("all_gather_into_tensor") - ag0;
      out.final_params = full_params(*m.module);
    };
    Net hnet{nullptr};
    run(holder_sharded(pg, {}, &hnet), holder[rank], holder_ag[rank]);
    PlainNet pnet{nullptr};
    run(plain_sharded(pg, {}, &pnet), plain[rank], plain_ag[rank]);
    // This rank's gradient shards of the steps it trained itself: the reference's, sliced locally (ranks trained
    // different numbers of steps: a collective such as distribute_tensor's default broadcast would not pair up).
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    for (size_t s = 0; s < plain[rank].local_grads.size(); ++s) {
      EXPECT_EQ(plain[rank].local_grads[s].size(), ref_grads[s].size()) << what << ": gradients at step " << s;
      for (const auto& [k, g] : plain[rank].local_grads[s]) {
        auto expect = distribute_tensor(ref_grads[s].at(k), mesh, {Shard(0)}, /*src_data_rank=*/std::nullopt).to_local();
        EXPECT_TRUE(torch::allclose(g, expect, kGradRtol, kGradAtol))
            << what << ": gradient of " << k << " at step " << s << " on rank " << rank << ": max |diff| "
            << max_abs_diff(g, expect);
      }
    }
  });
  for (int r = 0; r < ws; ++r) {
    EXPECT_EQ(plain[r].local_grads.size(), static_cast<size_t>(join_batches(r, ws))) << what;
    EXPECT_EQ(plain_ag[r], holder_ag[r]) << what << ": all-gathers (joined ranks shadow the same), rank " << r;
    for (size_t s = 0; s < plain[r].local_grads.size(); ++s) {
      Trace a, b;
      a.final_params = plain[r].local_grads[s];
      b.final_params = holder[r].local_grads.at(s);
      EXPECT_EQ(diff_traces(a, b), "") << what << ": gradient shards at step " << s << " vs holder path, rank " << r;
    }
    Trace a, b;
    a.final_params = plain[r].final_params;
    b.final_params = holder[r].final_params;
    EXPECT_EQ(diff_traces(a, b), "") << what << ": final parameters vs holder path, rank " << r;
    EXPECT_EQ(a.final_params.size(), ref_final.size()) << what;
    for (const auto& [k, p] : ref_final) {
      auto it = a.final_params.find(k);
      if (it == a.final_params.end()) continue;
      EXPECT_TRUE(torch::allclose(it->second, p, kRtol, kAtol))
          << what << ": final " << k << " rank " << r << ": max |diff| " << max_abs_diff(it->second, p);
    }
  }
}

TEST_P(UnchangedMore, JoinUnevenInputsMatchesReferenceAndHolderPath) {
  run_join_case(GetParam(), /*divide_by_initial=*/true);
  run_join_case(GetParam(), /*divide_by_initial=*/false);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, UnchangedMore, ::testing::Values(2, 3));

}  // namespace
}  // namespace fsdp::testing::unchanged_harness
