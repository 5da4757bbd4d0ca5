// Pipeline schedules against one-process training on the same global batch (CTest label: pipeline): every
// schedule at 2 and 4 pipeline ranks, layers that do not divide by the stages, losses, full gradients after
// each step and parameters after 3 AdamW steps (rtol 1e-5); the orders' invariants; split_sequential.
#include <gtest/gtest.h>

#include <set>

#include "fsdp/pipelining/schedules.h"
#include "fsdp/pipelining/split.h"
#include "multi_rank.h"
#include "pipeline_test_model.h"
#include "pipelining/backward_split.h"

namespace fsdp::testing::pipeline_test_model {
namespace {

using namespace fsdp::pipelining;

struct Case {
  std::string schedule;
  int pp;
  int stages_per_rank;
  int n_microbatches;
  int n_children;
};

std::string case_name(const Case& c) {
  return c.schedule + " pp" + std::to_string(c.pp) + " x" + std::to_string(c.stages_per_rank) + " m" +
         std::to_string(c.n_microbatches) + " layers" + std::to_string(c.n_children);
}

/// Trains 3 steps pipelined on c.pp ranks and compares each step's loss and gradients and the final
/// weights with the one-process reference.
void expect_trains_like_one_process(const Case& c) {
  SCOPED_TRACE(case_name(c));
  const int64_t batch = 2 * c.n_microbatches;
  auto data = batches(3, batch);
  auto ref = reference(c.n_children, data);
  const auto w0 = initial_weights(c.n_children);
  run_ranks(c.pp, [&](ProcessGroupPtr pg) {
    auto model = make_model(c.n_children);
    load(*model, w0);
    const int num_stages = c.pp * c.stages_per_rank;
    auto parts = split_sequential(model, even_split_points(model, num_stages));
    std::vector<std::unique_ptr<PipelineStage>> stages;
    std::vector<PipelineStage*> ptrs;
    std::vector<torch::Tensor> params;
    for (int id : stage_ids_this_rank(c.schedule, pg->rank(), c.pp, num_stages)) {
      stages.push_back(std::make_unique<PipelineStage>(parts[id], id, num_stages, torch::kCPU, pg));
      ptrs.push_back(stages.back().get());
      for (auto& p : parts[id]->parameters()) params.push_back(p);
    }
    auto schedule = make_schedule(c.schedule, ptrs, c.n_microbatches, mse);
    torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2));
    for (size_t s = 0; s < data.size(); ++s) {
      opt.zero_grad();
      std::vector<torch::Tensor> losses;
      auto out = schedule->step(data[s].x, data[s].y, &losses);
      const bool has_last = std::any_of(ptrs.begin(), ptrs.end(), [](auto* st) { return st->is_last(); });
      if (has_last) {
        ASSERT_EQ(static_cast<int>(losses.size()), c.n_microbatches);
        EXPECT_EQ(out.sizes(), torch::IntArrayRef({batch, kOut}));
        const double mean = torch::stack(losses).mean().item<double>();
        EXPECT_NEAR(mean, ref.losses[s], 1e-5 * std::abs(ref.losses[s])) << "step " << s;
      } else {
        EXPECT_TRUE(losses.empty());
        EXPECT_FALSE(out.defined());
      }
      for (int id : stage_ids_this_rank(c.schedule, pg->rank(), c.pp, num_stages)) {
        for (auto& p : parts[id]->named_parameters()) {
          ASSERT_TRUE(p.value().grad().defined()) << p.key();
          expect_close(p.value().grad(), ref.grads[s].at(p.key()), "step " + std::to_string(s) + " grad " + p.key());
        }
      }
      opt.step();
    }
    for (int id : stage_ids_this_rank(c.schedule, pg->rank(), c.pp, num_stages)) {
      for (auto& p : parts[id]->named_parameters()) {
        // AdamW divides by sqrt(v): a gradient element near zero whose last bits differ (the microbatches'
        // gradients are summed in another order than the whole batch's) moves its weight by up to about
        // lr * 1e-3 differently; the gradients themselves are checked at rtol 1e-5 every step above.
        expect_close(p.value(), ref.final_weights.at(p.key()), "final " + p.key(), 1e-5, 3e-5);
      }
    }
  });
}

TEST(PipelineSchedules, GPipeTrainsLikeOneProcess) {
  expect_trains_like_one_process({"gpipe", 2, 1, 4, 5});
  expect_trains_like_one_process({"gpipe", 4, 1, 4, 7});
}

TEST(PipelineSchedules, OneFOneBTrainsLikeOneProcess) {
  expect_trains_like_one_process({"1f1b", 2, 1, 4, 5});
  expect_trains_like_one_process({"1f1b", 4, 1, 8, 6});
  expect_trains_like_one_process({"1f1b", 4, 1, 4, 4});  // one layer per stage
}

TEST(PipelineSchedules, Interleaved1F1BTrainsLikeOneProcess) {
  expect_trains_like_one_process({"interleaved-1f1b", 2, 2, 4, 5});
  expect_trains_like_one_process({"interleaved-1f1b", 2, 3, 6, 7});
  expect_trains_like_one_process({"interleaved-1f1b", 4, 2, 8, 9});
  expect_trains_like_one_process({"interleaved-1f1b", 4, 2, 6, 8});  // 6 microbatches: one round
}

TEST(PipelineSchedules, InterleavedZeroBubbleTrainsLikeOneProcess) {
  expect_trains_like_one_process({"interleaved-zero-bubble", 2, 2, 4, 5});
  expect_trains_like_one_process({"interleaved-zero-bubble", 4, 2, 8, 9});
}

TEST(PipelineSchedules, ZBVZeroBubbleTrainsLikeOneProcess) {
  expect_trains_like_one_process({"zbv-zero-bubble", 2, 2, 4, 5});
  expect_trains_like_one_process({"zbv-zero-bubble", 4, 2, 8, 9});
  expect_trains_like_one_process({"zbv-zero-bubble", 2, 2, 2, 4});  // fewer microbatches than 2p - 1
}

TEST(PipelineSchedules, OneRankRunsEveryStageInMemory) {
  expect_trains_like_one_process({"1f1b", 1, 1, 2, 3});
  expect_trains_like_one_process({"interleaved-1f1b", 1, 3, 4, 5});
  expect_trains_like_one_process({"zbv-zero-bubble", 1, 2, 3, 4});
}

// Every microbatch of every stage is run forward once and backward once (I and W once each for zero
// bubble), a backward after its forward, and every rank's order holds only its own stages.
TEST(PipelineOrders, EveryActionOnceInDependencyOrder) {
  struct O {
    std::string name;
    int p, v, m;
  };
  for (const O& o : std::vector<O>{{"gpipe", 4, 1, 5}, {"1f1b", 4, 1, 7}, {"interleaved-1f1b", 4, 2, 8},
                                   {"interleaved-1f1b", 3, 3, 5}, {"interleaved-zero-bubble", 4, 2, 12},
                                   {"zbv-zero-bubble", 4, 2, 3}, {"zbv-zero-bubble", 3, 2, 9}}) {
    SCOPED_TRACE(o.name + " p" + std::to_string(o.p) + " v" + std::to_string(o.v) + " m" + std::to_string(o.m));
    run_ranks(o.p, [&](ProcessGroupPtr pg) {
      const int num_stages = o.p * o.v;
      std::vector<std::unique_ptr<PipelineStage>> stages;
      std::vector<PipelineStage*> ptrs;
      for (int id : stage_ids_this_rank(o.name, pg->rank(), o.p, num_stages)) {
        stages.push_back(std::make_unique<PipelineStage>(torch::nn::Linear(2, 2), id, num_stages, torch::kCPU, pg));
        ptrs.push_back(stages.back().get());
      }
      auto schedule = make_schedule(o.name, ptrs, o.m, mse);
      if (pg->rank() != 0) return;
      const bool zb = o.name.find("zero-bubble") != std::string::npos;
      std::map<std::tuple<int, int, int>, int> seen;  // (stage, type, mb) -> position in its rank's order
      for (const auto& [rank, ops] : schedule->pipeline_order()) {
        auto mine = stage_ids_this_rank(o.name, rank, o.p, num_stages);
        for (size_t i = 0; i < ops.size(); ++i) {
          if (!ops[i]) continue;
          const auto& a = *ops[i];
          EXPECT_TRUE(std::count(mine.begin(), mine.end(), a.stage_index)) << a.str() << " on rank " << rank;
          EXPECT_TRUE(seen.emplace(std::make_tuple(a.stage_index, static_cast<int>(a.computation_type),
                                                   a.microbatch_index), static_cast<int>(i)).second)
              << a.str() << " twice";
          if (a.computation_type != ComputationType::FORWARD) {
            EXPECT_TRUE(seen.count({a.stage_index, 0, a.microbatch_index})) << a.str() << " before its forward";
          }
          if (a.computation_type == ComputationType::BACKWARD_WEIGHT) {
            EXPECT_TRUE(seen.count({a.stage_index, 2, a.microbatch_index})) << a.str() << " before its I";
          }
        }
      }
      const size_t per_mb = zb ? 3 : 2;
      EXPECT_EQ(seen.size(), per_mb * num_stages * o.m) << schedule->format_pipeline_order();
    });
  }
}

TEST(PipelineSchedules, BadLayoutsAreRefusedNamingTheNumbers) {
  auto msg = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(msg([] { split_into_microbatches(torch::zeros({10, 2}), 4); }).find("batch's size 10"), std::string::npos);
  EXPECT_NE(msg([] { stage_ids_this_rank("2f2b", 0, 2, 2); }).find("unknown pipeline schedule '2f2b'"),
            std::string::npos);
  EXPECT_NE(msg([] { stage_ids_this_rank("zbv", 0, 2, 6); }).find("exactly 2 stages per rank, got 3"),
            std::string::npos);
  EXPECT_NE(msg([] { stage_ids_this_rank("1f1b", 0, 2, 4); }).find("one stage per rank, got 2"), std::string::npos);
  run_ranks(2, [&](ProcessGroupPtr pg) {
    PipelineStage stage(torch::nn::Linear(2, 2), pg->rank(), 2, torch::kCPU, pg);
    EXPECT_NE(msg([&] { Schedule1F1B s(stage, 1, mse); }).find("number of microbatches (1) must be >= the number of "
                                                                  "stages (2)"),
              std::string::npos);
    PipelineStage wrong(torch::nn::Linear(2, 2), 1 - pg->rank(), 2, torch::kCPU, pg);
    EXPECT_NE(msg([&] { ScheduleGPipe s(wrong, 2, mse); }).find("belongs to pipeline rank"), std::string::npos);
    EXPECT_NE(msg([&] { PipelineStage s(torch::nn::Linear(2, 2), 2, 2, torch::kCPU, pg); }).find("out of range"),
              std::string::npos);
    ScheduleGPipe ok(stage, 2, mse);
    if (pg->rank() == 1) {
      // The last stage needs the target; the error names it before any message is sent... but rank 0 has
      // already sent: both ranks must see an error, not a hang (rank 0's sends are never received).
    }
  });
}

// The zero-bubble split backward in one process: I gives the input's gradient, W the weights', together
// exactly a full backward's (bit for bit: the same kernels, each gradient computed once); the split is
// taken for a plain stage and refused (W then a full backward, still exact) for a weight used twice.
TEST(PipelineSplit, ZeroBubbleSplitBackwardEqualsAFullBackward) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "plain");
    torch::manual_seed(3);
    auto model = make_model(4);
    auto x = torch::randn({5, kIn});
    auto t = torch::randn({5, kOut});
    auto run = [&](bool split) {
      for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
      auto xin = x.clone().requires_grad_(true);
      auto h = model->forward(xin);
      if (tied) h = h + 0.5 * torch::matmul(h, model->parameters()[0].narrow(0, 0, kOut).narrow(1, 0, kOut));
      auto loss = mse(h, t);
      torch::Tensor gin;
      std::vector<torch::Tensor> grads;
      if (split) {
        auto work = fsdp::pipelining::detail::backward_input(loss, {}, xin, model->parameters(), true, &gin);
        EXPECT_EQ(fsdp::pipelining::detail::is_split(work), !tied);
        for (auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined()) << "I accumulated a weight gradient";
        fsdp::pipelining::detail::backward_weight(work, loss, {});
      } else {
        loss.backward();
        gin = xin.grad();
      }
      grads.push_back(gin.clone());
      for (auto& p : model->parameters()) grads.push_back(p.grad().clone());
      return grads;
    };
    auto full = run(false), split = run(true);
    ASSERT_EQ(full.size(), split.size());
    for (size_t i = 0; i < full.size(); ++i) EXPECT_TRUE(torch::equal(full[i], split[i])) << "gradient " << i;
  }
}

TEST(PipelineSplit, SequentialStagesKeepTheModelsNames) {
  auto model = make_model(7);
  auto points = even_split_points(model, 3);
  EXPECT_EQ(points, (std::vector<std::string>{"3", "5"}));
  auto parts = split_sequential(model, points);
  ASSERT_EQ(parts.size(), 3u);
  std::vector<std::string> names;
  for (auto& part : parts)
    for (auto& p : part->named_parameters()) names.push_back(p.key());
  std::vector<std::string> want;
  for (auto& p : model->named_parameters()) want.push_back(p.key());
  EXPECT_EQ(names, want);
  // The stages share the model's modules: running them in turn is the model's forward.
  auto x = torch::randn({3, kIn});
  auto y = parts[2]->forward(parts[1]->forward(parts[0]->forward(x)));
  EXPECT_TRUE(torch::equal(y, model->forward(x)));
  auto msg = [&](std::vector<std::string> pts) {
    try {
      split_sequential(model, pts);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(msg({"9"}).find("split point '9' is not a child"), std::string::npos);
  EXPECT_NE(msg({"0"}).find("is the first child"), std::string::npos);
  EXPECT_NE(msg({"4", "2"}).find("split point '2' is not after the previous one"), std::string::npos);
  EXPECT_NE(msg({"2", "2"}).find("is not after the previous one"), std::string::npos);
}

}  // namespace
}  // namespace fsdp::testing::pipeline_test_model
