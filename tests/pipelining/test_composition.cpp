// Pipeline parallelism composed with fully_shard and tensor parallelism inside the stages, on meshes
// (pp, dp), (pp, tp) and (pp, dp, tp) (CTest label: pipeline): losses, full gradients after each step and
// parameters after 3 AdamW steps against one process on the global batch; clip_grad_norm_ over the stages;
// activation checkpointing inside a stage; a rank that fails inside a schedule.
#include <gtest/gtest.h>

#include "fsdp/algorithms/checkpoint_wrapper.h"
#include "fsdp/fsdp/fully_shard.h"
#include "fsdp/pipelining/clip_grad.h"
#include "fsdp/pipelining/schedules.h"
#include "fsdp/pipelining/split.h"
#include "fsdp/tensor/device_mesh.h"
#include "fsdp/tensor/dtensor.h"
#include "fsdp/tensor/parallel/tensor_parallel.h"
#include "multi_rank.h"
#include "pipeline_test_model.h"

namespace fsdp::testing::pipeline_test_model {
namespace {

using namespace fsdp::pipelining;

constexpr int64_t kDim = 16, kWide = 32;

/// x + tanh(fc2(tanh(fc1(x)))): fc1 column-wise and fc2 row-wise under TP.
struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kDim, kWide))),
        fc2(register_module("fc2", torch::nn::Linear(kWide, kDim))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + torch::tanh(fc2->forward(torch::tanh(fc1->forward(x)))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Mlp);

/// "0": Linear(kIn, kDim), "1".."n": Mlp, "n+1": Linear(kDim, kOut).
torch::nn::Sequential make_mlp_model(int n_blocks) {
  torch::nn::Sequential seq;
  seq->push_back("0", torch::nn::Linear(kIn, kDim));
  for (int i = 1; i <= n_blocks; ++i) seq->push_back(std::to_string(i), Mlp());
  seq->push_back(std::to_string(n_blocks + 1), torch::nn::Linear(kDim, kOut));
  return seq;
}

Weights mlp_weights(int n_blocks) {
  torch::manual_seed(5);
  auto m = make_mlp_model(n_blocks);
  Weights w;
  for (auto& p : m->named_parameters()) w[p.key()] = p.value().detach().clone();
  return w;
}

struct Ref {
  std::vector<double> losses, norms;
  std::vector<Weights> grads;
  Weights final_weights;
};
Ref mlp_reference(int n_blocks, const std::vector<Batch>& data, double max_norm) {
  auto m = make_mlp_model(n_blocks);
  load(*m, mlp_weights(n_blocks));
  torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-2));
  Ref r;
  for (const auto& b : data) {
    opt.zero_grad();
    auto loss = mse(m->forward(b.x), b.y);
    loss.backward();
    r.losses.push_back(loss.item<double>());
    Weights g;
    for (auto& p : m->named_parameters()) g[p.key()] = p.value().grad().clone();
    r.grads.push_back(g);
    r.norms.push_back(torch::nn::utils::clip_grad_norm_(m->parameters(), max_norm));
    opt.step();
  }
  for (auto& p : m->named_parameters()) r.final_weights[p.key()] = p.value().detach().clone();
  return r;
}

/// The full value (or gradient) of a parameter of a stage: gathered over FSDP's mesh and/or TP's, as its
/// DTensor; a plain parameter as is. Collective when sharded.
torch::Tensor full_of(const torch::Tensor& p, bool grad) {
  bool fsdp_managed = true;
  try {
    sharded_param(p);
  } catch (const c10::Error&) {
    fsdp_managed = false;
  }
  if (fsdp_managed) return grad ? sharded_grad(p)->full_tensor() : sharded_param(p).full_tensor();
  std::optional<DTensor> d;
  try {
    d = tp::tp_param_dtensor(p);
  } catch (const c10::Error&) {
  }
  const torch::Tensor local = grad ? p.grad() : p.detach();
  if (!d) return local;
  return DTensor(local, d->device_mesh(), d->placements(), d->sizes()).full_tensor();
}

struct Layout {
  std::string schedule;
  int pp, dp, tp, stages_per_rank, n_microbatches;
  bool checkpoint_blocks = false;
  int n_blocks = 5;
};

void expect_composed_trains_like_one_process(const Layout& c) {
  SCOPED_TRACE(c.schedule + " pp" + std::to_string(c.pp) + " dp" + std::to_string(c.dp) + " tp" +
               std::to_string(c.tp) + " x" + std::to_string(c.stages_per_rank) + " m" + std::to_string(c.n_microbatches) +
               (c.checkpoint_blocks ? " AC" : ""));
  std::cout << "[ case     ] " << c.schedule << " pp" << c.pp << " dp" << c.dp << " tp" << c.tp << " x"
            << c.stages_per_rank << " m" << c.n_microbatches << (c.checkpoint_blocks ? " AC" : "") << std::endl;
  const int64_t batch = 2 * c.n_microbatches * c.dp;
  const double max_norm = 0.05;  // below the gradients' norm: clipping is active
  auto data = batches(3, batch, 13);
  for (auto& b : data) b.x = b.x.contiguous();
  auto ref = mlp_reference(c.n_blocks, data, max_norm);
  const auto w0 = mlp_weights(c.n_blocks);
  run_ranks(c.pp * c.dp * c.tp, [&](ProcessGroupPtr) {
    std::vector<int64_t> shape{c.pp};
    std::vector<std::string> names{"pp"};
    if (c.dp > 1) shape.push_back(c.dp), names.push_back("dp");
    if (c.tp > 1) shape.push_back(c.tp), names.push_back("tp");
    auto mesh = init_device_mesh(torch::kCPU, shape, names);
    auto pp_group = mesh->get_group("pp");
    const int dp_rank = c.dp > 1 ? (*mesh)["dp"]->get_local_rank(0) : 0;
    auto model = make_mlp_model(c.n_blocks);
    load(*model, w0);
    const int num_stages = c.pp * c.stages_per_rank;
    auto parts = split_sequential(model, even_split_points(model, num_stages));
    auto ids = stage_ids_this_rank(c.schedule, pp_group->rank(), c.pp, num_stages);
    std::vector<std::unique_ptr<PipelineStage>> stages;
    std::vector<PipelineStage*> ptrs;
    std::vector<torch::Tensor> params;
    for (int id : ids) {
      auto part = parts[id];
      for (auto& child : part->named_children()) {
        auto mlp = std::dynamic_pointer_cast<MlpImpl>(child.value());
        if (!mlp) continue;
        if (c.tp > 1) tp::parallelize_module(mlp, (*mesh)["tp"], {{"fc1", tp::ColwiseParallel()}, {"fc2", tp::RowwiseParallel()}});
        if (c.checkpoint_blocks) checkpoint_wrapper(mlp);
        if (c.dp > 1) fully_shard(mlp, FullyShardOptions().mesh((*mesh)["dp"]));
      }
      if (c.dp > 1) fully_shard(part.ptr(), FullyShardOptions().mesh((*mesh)["dp"]));
      stages.push_back(std::make_unique<PipelineStage>(part, id, num_stages, torch::kCPU, pp_group));
      ptrs.push_back(stages.back().get());
      for (auto& p : part->parameters()) params.push_back(p);
    }
    auto schedule = make_schedule(c.schedule, ptrs, c.n_microbatches, mse);
    torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2));
    const int64_t local = batch / c.dp;
    for (size_t s = 0; s < data.size(); ++s) {
      opt.zero_grad();
      std::vector<torch::Tensor> losses;
      schedule->step(data[s].x.narrow(0, dp_rank * local, local), data[s].y.narrow(0, dp_rank * local, local), &losses);
      if (!losses.empty()) {
        // This dp rank's half of the batch: the mean over dp ranks is the reference's loss; check the
        // gradients, which FSDP averages over dp, instead of gathering losses here.
        ASSERT_EQ(static_cast<int>(losses.size()), c.n_microbatches);
        if (c.dp == 1) {
          EXPECT_NEAR(torch::stack(losses).mean().item<double>(), ref.losses[s], 1e-5 * ref.losses[s]) << "step " << s;
        }
      }
      for (int id : ids) {
        for (auto& p : parts[id]->named_parameters()) {
          expect_close(full_of(p.value(), true), ref.grads[s].at(p.key()), "step " + std::to_string(s) + " grad " + p.key());
        }
      }
      auto norm = clip_grad_norm_(params, max_norm, pp_group);
      EXPECT_NEAR(norm.item<double>(), ref.norms[s], 1e-5 * ref.norms[s]) << "step " << s;
      opt.step();
    }
    for (int id : ids) {
      for (auto& p : parts[id]->named_parameters()) {
        expect_close(full_of(p.value(), false), ref.final_weights.at(p.key()), "final " + p.key(), 1e-5, 3e-5);
      }
    }
  }, std::chrono::seconds(240));
}

TEST(PipelineComposition, FullyShardInsideStages) {
  expect_composed_trains_like_one_process({"1f1b", 2, 2, 1, 1, 4});
  expect_composed_trains_like_one_process({"gpipe", 2, 2, 1, 1, 2});
  expect_composed_trains_like_one_process({"interleaved-1f1b", 2, 2, 1, 2, 4});
  expect_composed_trains_like_one_process({"zbv-zero-bubble", 2, 2, 1, 2, 4});
  // dp 3: rows of 16 and 6 (the blocks' and the head's) do not divide by 3.
  expect_composed_trains_like_one_process({"1f1b", 2, 3, 1, 1, 2});
}

TEST(PipelineComposition, TensorParallelInsideStages) {
  expect_composed_trains_like_one_process({"1f1b", 2, 1, 2, 1, 4});
  expect_composed_trains_like_one_process({"zbv-zero-bubble", 2, 1, 2, 2, 4});
}

TEST(PipelineComposition, ThreeDimensionalMesh) {
  expect_composed_trains_like_one_process({"1f1b", 2, 2, 2, 1, 2});
}

TEST(PipelineComposition, ActivationCheckpointingInsideStages) {
  // Several stages per rank with the blocks' implicit regions (checkpoint_wrapper on an unchanged module):
  // the region of stage 0's last block once took in the receive buffer of stage 2's input (created while
  // it was open, filled by the transport), and its replay gave the buffer back empty.
  expect_composed_trains_like_one_process({"interleaved-1f1b", 1, 1, 1, 2, 4, /*checkpoint_blocks=*/true});
  expect_composed_trains_like_one_process({"interleaved-1f1b", 2, 1, 1, 2, 4, /*checkpoint_blocks=*/true});
  expect_composed_trains_like_one_process({"zbv-zero-bubble", 2, 1, 1, 2, 4, /*checkpoint_blocks=*/true});
  expect_composed_trains_like_one_process({"zbv-zero-bubble", 2, 2, 1, 2, 4, /*checkpoint_blocks=*/true});
  expect_composed_trains_like_one_process({"gpipe", 2, 1, 1, 1, 2, /*checkpoint_blocks=*/true});
  expect_composed_trains_like_one_process({"1f1b", 2, 1, 1, 1, 4, /*checkpoint_blocks=*/true});
  expect_composed_trains_like_one_process({"1f1b", 2, 2, 1, 1, 2, /*checkpoint_blocks=*/true});
}

// reshard_after_forward inside a pipeline stage: with true (the default) the stage's parameters are
// all-gathered again for every microbatch's forward and backward; with false once per step (the
// unsharded parameters stay until the stage's last backward: one stage of parameters in memory for the
// whole step). Both train the same. The all-gather counts are the measurement docs/PIPELINING.md quotes.
TEST(PipelineComposition, ReshardAfterForwardFalseGathersAStageOncePerStep) {
  constexpr int kMicro = 4;
  std::map<bool, std::vector<uint64_t>> gathers;  // by reshard_after_forward: per rank
  std::map<bool, std::vector<double>> weights;
  std::mutex mu;
  for (bool raf : {true, false}) {
    gathers[raf].assign(4, 0);
    auto data = batches(2, 4 * kMicro, 13);
    const auto w0 = mlp_weights(3);
    run_ranks(4, [&](ProcessGroupPtr) {
      auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"pp", "dp"});
      auto model = make_mlp_model(3);
      load(*model, w0);
      auto parts = split_sequential(model, even_split_points(model, 2));
      const int pp_rank = mesh->get_group("pp")->rank(), dp_rank = (*mesh)["dp"]->get_local_rank(0);
      auto part = parts[pp_rank];
      const auto opts = FullyShardOptions().mesh((*mesh)["dp"]).reshard_after_forward(raf);
      for (auto& child : part->children())
        if (std::dynamic_pointer_cast<MlpImpl>(child)) fully_shard(child, opts);
      fully_shard(part.ptr(), opts);
      PipelineStage stage(part, pp_rank, 2, torch::kCPU, mesh->get_group("pp"));
      Schedule1F1B schedule(stage, kMicro, mse);
      torch::optim::SGD opt(part->parameters(), 0.1);
      auto& dp = *(*mesh)["dp"]->get_group(0);
      const uint64_t before = dp.collective_count("all_gather_into_tensor");
      for (const auto& b : data) {
        opt.zero_grad();
        schedule.step(b.x.narrow(0, dp_rank * 2 * kMicro, 2 * kMicro), b.y.narrow(0, dp_rank * 2 * kMicro, 2 * kMicro));
        opt.step();
      }
      const uint64_t n = dp.collective_count("all_gather_into_tensor") - before;
      double sum = 0;
      for (auto& p : part->parameters()) sum += full_of(p, false).sum().item<double>();
      std::lock_guard<std::mutex> lock(mu);
      gathers[raf][mesh->get_rank()] = n;
      weights[raf].push_back(sum);
    });
  }
  for (int r = 0; r < 4; ++r) {
    std::cout << "[ measured ] rank " << r << ": all-gathers in 2 steps of " << kMicro
              << " microbatches: reshard_after_forward=true " << gathers[true][r] << ", false " << gathers[false][r]
              << std::endl;
    // false: each group once per step (2 steps); true: forward and backward of every microbatch.
    EXPECT_LT(gathers[false][r] * (kMicro / 2), gathers[true][r]) << "rank " << r;
  }
  std::sort(weights[true].begin(), weights[true].end());
  std::sort(weights[false].begin(), weights[false].end());
  for (size_t i = 0; i < weights[true].size(); ++i) EXPECT_NEAR(weights[true][i], weights[false][i], 1e-5);
}

// A rank that fails inside a schedule (its loss_fn throws at microbatch 2 on the last stage): every rank
// fails within the pipeline group's timeout, naming its stage and action, instead of hanging.
TEST(PipelineFailures, ARankThatFailsMidStepFailsEveryRankNamingTheAction) {
  const auto w0 = initial_weights(5);
  auto data = batches(1, 8);
  const auto t0 = std::chrono::steady_clock::now();
  auto errors = run_ranks_collect(
      3,
      [&](ProcessGroupPtr pg) {
        auto model = make_model(5);
        load(*model, w0);
        auto parts = split_sequential(model, even_split_points(model, 3));
        PipelineStage stage(parts[pg->rank()], pg->rank(), 3, torch::kCPU, pg);
        int calls = 0;
        Schedule1F1B schedule(stage, 4, [&](const torch::Tensor& out, const torch::Tensor& y) {
          if (++calls == 3) throw std::runtime_error("injected loss failure");
          return mse(out, y);
        });
        schedule.step(data[0].x, data[0].y);
      },
      std::chrono::seconds(60), std::chrono::seconds(3));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, 30) << "the ranks took " << took << " s to fail";
  ASSERT_EQ(errors.size(), 3u);
  EXPECT_NE(errors[2].find("stage 2, action 2F2 (forward of microbatch 2)"), std::string::npos) << errors[2];
  EXPECT_NE(errors[2].find("injected loss failure"), std::string::npos) << errors[2];
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("stage " + std::to_string(r) + ", action "), std::string::npos) << r << ": " << errors[r];
    // Waiting for a peer that is gone, or sending to the next stage after it failed and closed its connections
    // (found under load on rank 1: 1F1B's stage 1 sends microbatch 3's activations before it waits for
    // microbatch 2's gradient).
    const bool receiving = errors[r].find("receiving") != std::string::npos;
    const bool sending_to_the_dead = errors[r].find("isend of the activations") != std::string::npos &&
                                     errors[r].find("to rank " + std::to_string(r + 1)) != std::string::npos;
    EXPECT_TRUE(receiving || sending_to_the_dead) << r << ": " << errors[r];
  }
}

// A rank that stalls inside a schedule (its loss_fn sleeps past the pipeline group's 3 s timeout at
// microbatch 1): its neighbours fail within the timeout naming their stage, action and the peer they wait
// for, and the stalled rank fails too when it wakes (its peers are gone), instead of anything hanging.
TEST(PipelineFailures, ARankThatStallsFailsItsNeighboursWithinTheTimeout) {
  const auto w0 = initial_weights(5);
  auto data = batches(1, 8);
  const auto t0 = std::chrono::steady_clock::now();
  auto errors = run_ranks_collect(
      3,
      [&](ProcessGroupPtr pg) {
        auto model = make_model(5);
        load(*model, w0);
        auto parts = split_sequential(model, even_split_points(model, 3));
        PipelineStage stage(parts[pg->rank()], pg->rank(), 3, torch::kCPU, pg);
        int calls = 0;
        Schedule1F1B schedule(stage, 4, [&](const torch::Tensor& out, const torch::Tensor& y) {
          if (++calls == 2) std::this_thread::sleep_for(std::chrono::seconds(7));
          return mse(out, y);
        });
        schedule.step(data[0].x, data[0].y);
      },
      std::chrono::seconds(60), std::chrono::seconds(3));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, 30) << "the ranks took " << took << " s to fail";
  ASSERT_EQ(errors.size(), 3u);
  // Stage 1 waits for stage 2's gradient of microbatch 0 or 1, stage 0 for stage 1's: both time out.
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("stage " + std::to_string(r) + ", action "), std::string::npos) << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("receiving"), std::string::npos) << r << ": " << errors[r];
  }
  EXPECT_NE(errors[1].find("from stage 2 (pipeline rank 2)"), std::string::npos) << errors[1];
  EXPECT_FALSE(errors[2].empty()) << "the stalled rank finished its step although its neighbours had failed";
}

// Mixed precision inside stages: fully_shard's bf16 parameters make bf16 activations, which the messages
// between stages carry as bf16 (the shape header names the dtype); the pipelined run equals the same
// model run unpipelined under the same policy on the same dp ranks and microbatches (pp 2 x dp 2 against
// pp 1 x dp 2, both GPipe over 4 microbatches), and stays near the fp32 reference.
TEST(PipelineComposition, MixedPrecisionInsideStages) {
  constexpr int kMicro = 4;
  auto data = batches(2, 4 * kMicro, 17);
  const auto w0 = mlp_weights(3);
  std::map<int, std::vector<double>> losses;  // by pp degree: the last stage's mean loss per step, dp rank 0
  std::mutex mu;
  for (int pp : {1, 2}) {
    run_ranks(pp * 2, [&](ProcessGroupPtr) {
      auto mesh = init_device_mesh(torch::kCPU, {pp, 2}, {"pp", "dp"});
      auto model = make_mlp_model(3);
      load(*model, w0);
      auto parts = split_sequential(model, even_split_points(model, pp));
      const int pp_rank = mesh->get_group("pp")->rank(), dp_rank = (*mesh)["dp"]->get_local_rank(0);
      auto part = parts[pp_rank];
      const auto opts = FullyShardOptions().mesh((*mesh)["dp"]).mp_policy(
          MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat32));
      for (auto& child : part->children())
        if (std::dynamic_pointer_cast<MlpImpl>(child)) fully_shard(child, opts);
      fully_shard(part.ptr(), opts);
      PipelineStage stage(part, pp_rank, pp, torch::kCPU, mesh->get_group("pp"));
      ScheduleGPipe schedule(stage, kMicro, [](const torch::Tensor& out, const torch::Tensor& y) {
        return mse(out.to(torch::kFloat32), y);
      });
      torch::optim::SGD opt(part->parameters(), 0.1);
      for (const auto& b : data) {
        opt.zero_grad();
        std::vector<torch::Tensor> l;
        auto out = schedule.step(b.x.narrow(0, dp_rank * 2 * kMicro, 2 * kMicro),
                                 b.y.narrow(0, dp_rank * 2 * kMicro, 2 * kMicro), &l);
        if (stage.is_last()) {
          EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
          if (dp_rank == 0) {
            std::lock_guard<std::mutex> lock(mu);
            losses[pp].push_back(torch::stack(l).mean().item<double>());
          }
        }
        opt.step();
      }
    });
  }
  ASSERT_EQ(losses[1].size(), 2u);
  ASSERT_EQ(losses[2].size(), 2u);
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_EQ(losses[1][s], losses[2][s]) << "step " << s;  // the same bf16 ops on the same rows
  }
}

}  // namespace
}  // namespace fsdp::testing::pipeline_test_model
