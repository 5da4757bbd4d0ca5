// Tensor parallelism (src/tensor/parallel/tensor_parallel.cpp, src/tensor/parallel/tp_ops.cpp; CTest label: tensor_parallel):
// parallelize_module with ColwiseParallel and RowwiseParallel on Linear and Embedding trains like the
// same model in one process (losses, gradients and parameters, fp32, rtol 1e-5, 5 AdamW steps) on TP 2
// and 4, with the default layouts and with replicated layouts between the two linears; a bad plan throws
// the same message on every rank and changes nothing.
#include <gtest/gtest.h>

#include <mutex>

#include "fsdp/fsdp.h"
#include "multi_rank.h"
#include "tensor/parallel/tp_ops.h"
#include "tp_test_model.h"

namespace fsdp::testing {
namespace {

// This rank's piece of a reference (unsharded) tensor, as parameter `p` holds it.
torch::Tensor local_piece(const torch::Tensor& p, const torch::Tensor& ref) {
  if (p.sizes() == ref.sizes()) return ref;  // replicated (rowwise bias)
  auto dt = tp::tp_param_dtensor(p);
  const int64_t dim = dt.placements()[0].dim;
  const int64_t c = p.size(dim);
  return ref.narrow(dim, dt.device_mesh()->get_local_rank(0) * c, c);
}

void train_and_compare(int tp_size, const tp::ParallelizePlan& plan, int64_t seq = 5) {
  run_ranks(tp_size, [&](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {tp_size}, {"tp"});
    Net ref(kVocab, kDim, kHidden), model(kVocab, kDim, kHidden);
    tp::parallelize_module(model, mesh, plan);
    EXPECT_EQ(model->blocks[0]->as<MLPImpl>()->fc1->weight.sizes(), (std::vector<int64_t>{kHidden / tp_size, kDim}));
    EXPECT_EQ(model->emb->weight.sizes(), (std::vector<int64_t>{kVocab / tp_size, kDim}));
    torch::optim::AdamW opt_ref(ref->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
    auto ref_params = ref->named_parameters();
    auto params = model->named_parameters();
    for (int step = 0; step < 5; ++step) {
      auto ids = (torch::arange(3 * seq, torch::kInt64) * 3 + step).remainder(kVocab).view({3, seq});
      auto targets = (ids * 5 + 1).remainder(kVocab).view({-1});
      auto loss_ref = torch::cross_entropy_loss(ref(ids).view({-1, kVocab}), targets);
      auto loss = torch::cross_entropy_loss(model(ids).view({-1, kVocab}), targets);
      expect_close(loss, loss_ref, "loss at step " + std::to_string(step));
      loss_ref.backward();
      loss.backward();
      for (const auto& item : ref_params) {
        const auto& p = params[item.key()];
        ASSERT_TRUE(p.grad().defined()) << item.key();
        expect_close(p.grad(), local_piece(p, item.value().grad()), "grad of " + item.key() + " at step " + std::to_string(step));
      }
      opt_ref.step();
      opt.step();
      opt_ref.zero_grad();
      opt.zero_grad();
      for (const auto& item : ref_params) {
        const auto& p = params[item.key()];
        expect_close(p.detach(), local_piece(p, item.value().detach()), item.key() + " after step " + std::to_string(step));
      }
    }
    // full_tensor of a TP parameter reassembles the reference's.
    expect_close(tp::tp_param_dtensor(model->emb->weight).full_tensor(), ref->emb->weight.detach(), "full emb.weight");
    auto fc2 = model->blocks[1]->as<MLPImpl>()->fc2;
    expect_close(tp::tp_param_dtensor(fc2->weight).full_tensor(), ref->blocks[1]->as<MLPImpl>()->fc2->weight.detach(),
                 "full blocks.1.fc2.weight");
  });
}

TEST(TensorParallel, TrainsLikeOneProcessTp2) { train_and_compare(2, default_plan()); }
TEST(TensorParallel, TrainsLikeOneProcessTp4) { train_and_compare(4, default_plan()); }
TEST(TensorParallel, ReplicatedLayoutsTrainLikeOneProcessTp2) { train_and_compare(2, replicated_plan()); }
TEST(TensorParallel, ReplicatedLayoutsTrainLikeOneProcessTp4) { train_and_compare(4, replicated_plan()); }
TEST(TensorParallel, SequenceParallelTrainsLikeOneProcessTp2) { train_and_compare(2, sequence_parallel_plan(), 4); }
TEST(TensorParallel, SequenceParallelTrainsLikeOneProcessTp4) { train_and_compare(4, sequence_parallel_plan(), 8); }

// The boundary helpers: Replicate -> Shard(1) -> Replicate is the identity, forward and backward; the
// fused-projection helper gives each rank its heads' q, k, v and sums the gradient pieces back.
TEST(TensorParallel, SequenceBoundariesAndFusedHeadsRoundTrip) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto x = torch::arange(24, torch::kFloat32).view({2, 4, 3}).requires_grad_(true);
    auto local = tp::distribute_sequence(x, mesh);
    EXPECT_TRUE(torch::equal(local, x.detach().narrow(1, 2 * pg->rank(), 2)));
    auto back = tp::gather_sequence(local, mesh);
    EXPECT_TRUE(torch::equal(back, x.detach()));
    auto w = torch::arange(24, torch::kFloat32).view({2, 4, 3}) * 0.5;
    (back * w).sum().backward();
    EXPECT_TRUE(torch::equal(x.grad(), w)) << x.grad();
    EXPECT_THROW(tp::distribute_sequence(torch::zeros({2, 5, 3}), mesh), c10::Error);
    // Fused [q; k; v] of C = 4 (2 heads of 2): rank r's contiguous local output is features [6r, 6r + 6).
    auto full = torch::arange(12, torch::kFloat32).view({1, 1, 12});
    auto mine = full.narrow(-1, 6 * pg->rank(), 6).clone().requires_grad_(true);
    auto qkv = tp::local_heads_of_fused(mine, mesh);
    ASSERT_EQ(qkv.size(), 3u);
    for (int64_t j = 0; j < 3; ++j) {
      EXPECT_TRUE(torch::equal(qkv[j], full.narrow(-1, 4 * j + 2 * pg->rank(), 2))) << j << ": " << qkv[j];
    }
    // d(sum of every rank's q, k, v)/d(features) = 1 for every feature, summed onto its owner.
    (qkv[0].sum() + qkv[1].sum() + qkv[2].sum()).backward();
    EXPECT_TRUE(torch::equal(mine.grad(), torch::ones({1, 1, 6}))) << mine.grad();
  });
}

TEST(TensorParallel, SequenceParallelNeedsASequenceDivisibleByTheTpSize) {
  run_ranks(2, [](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    Net model(kVocab, kDim, kHidden);
    tp::parallelize_module(model, mesh, sequence_parallel_plan());
    try {
      model(torch::zeros({2, 5}, torch::kInt64));
      ADD_FAILURE() << "expected a throw";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("RowwiseParallel on 'emb': the sequence (dim 1) of 5 positions is not "
                                           "divisible by the TP size 2"),
                std::string::npos)
          << e.what();
    }
  });
}


// Runs `plan` on 4 ranks and expects every rank to throw the same message containing `expect`, with the
// model unchanged (no parameter resized or turned into a TP parameter).
void expect_plan_error(const tp::ParallelizePlan& plan, const std::string& expect, int64_t hidden = kHidden,
                       std::vector<int64_t> mesh_shape = {4}) {
  std::vector<std::string> messages(4);
  std::mutex mu;
  run_ranks(4, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, mesh_shape);
    Net model(kVocab, kDim, hidden);
    std::vector<std::vector<int64_t>> sizes;
    for (const auto& p : model->parameters()) sizes.push_back(p.sizes().vec());
    std::string msg;
    try {
      tp::parallelize_module(model, mesh, plan);
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    size_t i = 0;
    for (const auto& p : model->parameters()) {
      EXPECT_EQ(p.sizes().vec(), sizes[i++]) << "a parameter changed before the error";
      EXPECT_THROW(tp::tp_param_dtensor(p), c10::Error);
    }
    std::lock_guard<std::mutex> lock(mu);
    messages[pg->rank()] = msg;
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_NE(messages[r].find(expect), std::string::npos) << "rank " << r << ": '" << messages[r] << "'";
    EXPECT_EQ(messages[r], messages[0]) << "rank " << r;
  }
}

TEST(TensorParallel, SequenceParallelOnlyOnNormsAndDropout) {
  expect_plan_error({{"head", tp::SequenceParallel()}},
                    "SequenceParallel on 'head' (a torch::nn::LinearImpl): expected a torch::nn::LayerNorm, a "
                    "torch::nn::Dropout, or a norm module without submodules whose parameters are a 1-D `weight` and "
                    "optionally a 1-D `bias` (e.g. an RMSNorm); it has parameters [ weight[8, 6] bias[8] ]");
}

TEST(TensorParallel, UnknownFqnThrowsOnEveryRankBeforeAnyChange) {
  expect_plan_error({{"emb", tp::RowwiseParallel()}, {"blocks.*.fc3", tp::ColwiseParallel()}},
                    "plan key 'blocks.*.fc3' matches no module of the model (its modules: emb, blocks, blocks.0, "
                    "blocks.0.fc1");
}

TEST(TensorParallel, WrongModuleTypeThrowsOnEveryRank) {
  expect_plan_error({{"emb", tp::RowwiseParallel()}, {"blocks.0", tp::ColwiseParallel()}},
                    "ColwiseParallel on 'blocks.0' (a ");
  expect_plan_error({{"blocks", tp::RowwiseParallel()}}, "expected a torch::nn::Linear or torch::nn::Embedding");
}

TEST(TensorParallel, DimNotDivisibleThrowsOnEveryRank) {
  // hidden 6 on 4 ranks: fc1's out_features (colwise) does not divide.
  expect_plan_error({{"emb", tp::RowwiseParallel()}, {"blocks.*.fc1", tp::ColwiseParallel()}},
                    "ColwiseParallel on 'blocks.0.fc1' shards out_features = 6 (weight dim 0) over a TP mesh of 4 "
                    "ranks, but 6 is not divisible by 4",
                    /*hidden=*/6);
}

TEST(TensorParallel, BadMeshAndLayoutsThrow) {
  expect_plan_error({{"head", tp::ColwiseParallel()}}, "expected a 1-D TP mesh", kHidden, {2, 2});
  expect_plan_error({{"blocks.*.fc1", tp::ColwiseParallel()}, {"blocks.0.fc1", tp::ColwiseParallel()}},
                    "module 'blocks.0.fc1' is matched by plan keys 'blocks.*.fc1' and 'blocks.0.fc1'");
  expect_plan_error({{"head", tp::RowwiseParallel().output_layouts(Shard(-1))}},
                    "output_layouts Shard(dim=-1) is not supported");
  expect_plan_error({{"emb", tp::ColwiseParallel().input_layouts(Shard(1))}},
                    "input_layouts Shard(dim=1) is not supported; use Replicate(), or Shard(1) (a sequence-sharded "
                    "input, Linear only)");
  run_ranks(4, [](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"dp", "tp"});
    EXPECT_THROW((*mesh)["model"], c10::Error);  // a mesh dim name that does not exist
    Net model(kVocab, kDim, kHidden);
    tp::parallelize_module(model, (*mesh)["tp"], default_plan());  // the sub-mesh is 1-D: fine
    EXPECT_THROW(tp::parallelize_module(model->head, (*mesh)["tp"], tp::ColwiseParallel()), c10::Error)
        << "a module parallelised twice";
  });
}

TEST(TensorParallel, RowwiseLinearGivenTheFullInputSaysHowToFixIt) {
  run_ranks(2, [](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    torch::nn::Linear lin(4, 3);
    tp::parallelize_module(lin, mesh, tp::RowwiseParallel());
    try {
      lin(torch::ones({2, 4}));
      ADD_FAILURE() << "expected a throw";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("use RowwiseParallel().input_layouts(Replicate())"), std::string::npos)
          << e.what();
    }
  });
}

// parallelize_module after fully_shard cannot compose (FSDP's shards are rows of the whole tensor, not of
// the TP part): refused on every rank before anything changes, naming the parameter and the order that
// works, for an eager and for a deferred model (issue 28 item 2). The supported deferred order is tested
// in test_fsdp_over_tp.cpp (FsdpOverTpDeferredInit).
TEST(TensorParallel, ParallelizeAfterFullyShardIsRefusedNamingTheParameterAndTheOrder) {
  for (bool deferred : {false, true}) {
    run_ranks(4, [&](ProcessGroupPtr pg) {
      auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"dp", "tp"}, pg);
      auto make = [] { return torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::Linear(6, 4)); };
      auto model = deferred ? deferred_init(make) : make();
      fully_shard(model.ptr(), FullyShardOptions().mesh((*mesh)["dp"]));
      const auto sizes = model[0]->as<torch::nn::Linear>()->weight.sizes().vec();
      const tp::ParallelizePlan plan{{"0", tp::ColwiseParallel()}, {"1", tp::RowwiseParallel()}};
      try {
        tp::parallelize_module(model.ptr(), (*mesh)["tp"], plan);
        ADD_FAILURE() << "parallelize_module accepted a model sharded by fully_shard";
      } catch (const c10::Error& e) {
        const std::string msg = e.what_without_backtrace();
        EXPECT_NE(msg.find("parameter '0.weight' is already sharded by fully_shard"), std::string::npos) << msg;
        EXPECT_NE(msg.find("deferred_init, parallelize_module, fully_shard, materialize_module"), std::string::npos) << msg;
      }
      for (const auto& p : model->parameters()) EXPECT_FALSE(tp::detail::find_tp_param(p));  // nothing changed
      EXPECT_EQ(model[0]->as<torch::nn::Linear>()->weight.sizes().vec(), sizes);
      if (deferred) materialize_module(model.ptr());
    });
  }
}

}  // namespace
}  // namespace fsdp::testing
