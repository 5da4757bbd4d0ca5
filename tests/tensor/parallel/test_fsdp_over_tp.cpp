// fully_shard on the dp dimension of a tensor-parallel model (torchtitan's 2-D recipe; src/fsdp/fsdp_param.cpp
// [Note: FSDP over TP]; CTest label: tensor_parallel): parallelize_module over mesh["tp"], then fully_shard
// of every block and the root over mesh["dp"] trains like the same model in one process on the global
// batch (losses, gradients and parameters as full tensors, fp32, rtol 1e-5, 5 AdamW steps) on dp 2 x tp 2
// and dp 3 x tp 2 (uneven and empty dp shards), through the implicit path and with the root in an
// FSDPModule holder, with sequence parallelism, and HSDP + TP on a 3-D (rep 2, dp 2, tp 2) mesh; the 2-D DTensors put rows in order (Embedding(4, 1) = [0, 1, 2, 3]);
// clip_grad_norm_ over dp x tp returns the one-process norm; meshes that do not compose are refused.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <limits>
#include <map>
#include <sstream>
#include <mutex>
#include <optional>

#include "fsdp/fsdp.h"
#include "multi_rank.h"
#include "tp_test_model.h"

namespace fsdp::testing {
namespace {

constexpr int64_t kFsdpDim = 5;  // fc2's rows (5) split unevenly over dp

struct Layout {
  int rep, dp, tp;   // rep > 1: HSDP + TP on a 3-D (rep, dp, tp) mesh
  bool root_holder;  // the root group through an FSDPModule holder (TP params in holder mode)
  bool sequence_parallel = false;
};

std::string layout_name(const ::testing::TestParamInfo<Layout>& info) {
  const auto& c = info.param;
  return (c.rep > 1 ? "rep" + std::to_string(c.rep) + "_" : std::string()) + "dp" + std::to_string(c.dp) + "_tp" +
         std::to_string(c.tp) + (c.root_holder ? "_holder" : "_implicit") + (c.sequence_parallel ? "_sp" : "");
}

// The full tensor of `param` (a parameter of the 2-D model): its DTensor from the state dict is
// gathered over dp and tp; collective.
torch::Tensor full_param(const StateDict& sd, const std::string& name) {
  const auto& v = sd.at(name);
  const auto* d = std::get_if<DTensor>(&v);
  EXPECT_TRUE(d) << name << " is not a DTensor in the sharded state dict";
  return d ? d->full_tensor() : torch::Tensor();
}

class FsdpOverTp : public ::testing::TestWithParam<Layout> {};

TEST_P(FsdpOverTp, TrainsLikeOneProcessOnTheGlobalBatch) {
  const auto c = GetParam();
  const int world = c.rep * c.dp * c.tp;
  run_ranks(world, [&](ProcessGroupPtr) {
    auto mesh = c.rep > 1 ? init_device_mesh(torch::kCPU, {c.rep, c.dp, c.tp}, {"rep", "dp", "tp"})
                          : init_device_mesh(torch::kCPU, {c.dp, c.tp}, {"dp", "tp"});
    // FSDP's mesh: dp, or (rep, dp) for HSDP; its ranks split the batch.
    auto fsdp_mesh = c.rep > 1 ? mesh->slice({"rep", "dp"}) : (*mesh)["dp"];
    const int64_t n_data = c.rep * c.dp;
    const int64_t d = c.rep > 1 ? fsdp_mesh->get_local_rank(0) * c.dp + fsdp_mesh->get_local_rank(1)
                                : fsdp_mesh->get_local_rank(0);
    Net ref(kVocab, kFsdpDim, kHidden), net(kVocab, kFsdpDim, kHidden);
    tp::parallelize_module(net, (*mesh)["tp"], c.sequence_parallel ? sequence_parallel_plan() : default_plan());
    const auto opts = FullyShardOptions().mesh(fsdp_mesh);
    for (const auto& b : *net->blocks) fully_shard(b, opts);
    fully_shard(net.ptr(), opts);
    std::optional<FSDPModule<Net>> holder;  // a holder turns the root's group from implicit to holder mode
    if (c.root_holder) holder.emplace(net);
    auto forward = [&](const torch::Tensor& ids) { return holder ? (*holder)(ids) : net(ids); };
    torch::optim::AdamW opt_ref(ref->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    auto ref_params = ref->named_parameters();
    auto params = net->named_parameters();
    const int64_t rows = 2;  // sequences per data-parallel rank; the global batch has rows * n_data
    for (int step = 0; step < 5; ++step) {
      auto ids = (torch::arange(rows * n_data * 4, torch::kInt64) * 3 + step).remainder(kVocab).view({rows * n_data, 4});
      auto targets = (ids * 5 + 1).remainder(kVocab);
      auto loss_ref = torch::cross_entropy_loss(ref(ids).view({-1, kVocab}), targets.view({-1}));
      // This dp rank's rows; every TP rank of a dp rank sees the same batch.
      auto mine = ids.narrow(0, d * rows, rows), my_targets = targets.narrow(0, d * rows, rows);
      auto loss = torch::cross_entropy_loss(forward(mine).view({-1, kVocab}), my_targets.reshape({-1}));
      // The global loss is the mean of the dp ranks' losses (equal batches).
      auto global_loss = loss.detach().clone();
      all_reduce(global_loss, *fsdp_mesh->world(), ReduceOp::SUM);
      expect_close(global_loss / n_data, loss_ref.detach(), "loss at step " + std::to_string(step));
      loss_ref.backward();
      loss.backward();
      for (const auto& item : ref_params) {
        auto g = sharded_grad(params[item.key()]);
        ASSERT_TRUE(g.has_value()) << item.key();
        ASSERT_EQ(g->device_mesh()->ndim(), c.rep > 1 ? 3 : 2) << item.key() << ": " << g->device_mesh()->str();
        expect_close(g->full_tensor(), item.value().grad(), "grad of " + item.key() + " at step " + std::to_string(step));
      }
      opt_ref.step();
      opt.step();
      opt_ref.zero_grad();
      opt.zero_grad();
    }
    const auto sd = get_model_state_dict(*net);
    for (const auto& item : ref_params) {
      expect_close(full_param(sd, item.key()), item.value().detach(), item.key() + " after 5 steps");
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, FsdpOverTp,
                         ::testing::Values(Layout{1, 2, 2, false}, Layout{1, 2, 2, true}, Layout{1, 3, 2, false},
                                           Layout{2, 2, 2, false}, Layout{1, 2, 2, false, true},
                                           Layout{1, 2, 2, true, true}),
                         layout_name);

// The neighbours of the parity test: blocks kept unsharded after forward, gradient accumulation over
// two microbatches with the first one's reduction skipped (set_requires_gradient_sync(false)), and the
// same block called twice in one forward. dp 2 x tp 2, 3 AdamW steps, fp32, rtol 1e-5.
TEST(FsdpOverTpFeatures, NoReshardGradientAccumulationAndABlockCalledTwice) {
  run_ranks(4, [](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"dp", "tp"});
    const int64_t d = mesh->get_local_rank(0);
    Net ref(kVocab, kFsdpDim, kHidden), net(kVocab, kFsdpDim, kHidden);
    tp::parallelize_module(net, (*mesh)["tp"], default_plan());
    for (const auto& b : *net->blocks) fully_shard(b, FullyShardOptions().mesh((*mesh)["dp"]).reshard_after_forward(false));
    auto root = fully_shard(net.ptr(), FullyShardOptions().mesh((*mesh)["dp"]));
    // forward with block 0 applied twice (a shared block), as the reference does.
    auto twice = [](Net& m, const torch::Tensor& ids) {
      auto x = m->emb(ids);
      auto* b0 = m->blocks[0]->as<MLPImpl>();
      x = x + b0->forward(x);
      x = x + b0->forward(x);
      x = x + m->blocks[1]->as<MLPImpl>()->forward(x);
      return m->head(m->ln(x));
    };
    torch::optim::AdamW opt_ref(ref->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    auto params = net->named_parameters();
    for (int step = 0; step < 3; ++step) {
      for (int micro = 0; micro < 2; ++micro) {
        auto ids = (torch::arange(16, torch::kInt64) * 3 + step * 2 + micro).remainder(kVocab).view({4, 4});
        auto targets = (ids * 5 + 1).remainder(kVocab);
        (torch::cross_entropy_loss(twice(ref, ids).view({-1, kVocab}), targets.view({-1})) / 2).backward();
        root.set_requires_gradient_sync(micro == 1);
        (torch::cross_entropy_loss(twice(net, ids.narrow(0, 2 * d, 2)).view({-1, kVocab}),
                                   targets.narrow(0, 2 * d, 2).reshape({-1})) / 2)
            .backward();
      }
      for (const auto& item : ref->named_parameters()) {
        auto g = sharded_grad(params[item.key()]);
        ASSERT_TRUE(g.has_value()) << item.key();
        expect_close(g->full_tensor(), item.value().grad(), "grad of " + item.key() + " at step " + std::to_string(step));
      }
      opt_ref.step();
      opt.step();
      opt_ref.zero_grad();
      opt.zero_grad();
    }
  });
}

// Rows in order: TP splits the 4 rows first ([0, 1] | [2, 3]), FSDP then splits each TP shard, so
// rank (dp d, tp t) holds row 2t + d, and full_tensor gathers them back as [0, 1, 2, 3].
TEST(FsdpOverTpPlacement, EmbeddingRowsComeBackInOrder) {
  run_ranks(4, [](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"dp", "tp"});
    const int64_t d = mesh->get_local_rank(0), t = mesh->get_local_rank(1);
    torch::nn::Embedding emb(4, 1);
    {
      torch::NoGradGuard no_grad;
      emb->weight.copy_(torch::arange(4, torch::kFloat32).view({4, 1}));
    }
    tp::parallelize_module(emb, (*mesh)["tp"], tp::RowwiseParallel());
    fully_shard(emb.ptr(), FullyShardOptions().mesh((*mesh)["dp"]));
    auto sd = get_model_state_dict(*emb);
    const auto& dt = std::get<DTensor>(sd.at("weight"));
    EXPECT_EQ(dt.to_local().item<float>(), static_cast<float>(2 * t + d));
    EXPECT_EQ(dt.local_offsets(), (std::vector<int64_t>{2 * t + d, 0}));
    EXPECT_EQ(dt.sizes(), (std::vector<int64_t>{4, 1}));
    EXPECT_TRUE(torch::equal(dt.full_tensor(), torch::arange(4, torch::kFloat32).view({4, 1})))
        << dt.full_tensor().view({-1});
    // The forward uses the TP shard all-gathered over dp: ids 0..3 look up rows 0..3.
    auto out = emb(torch::arange(4, torch::kInt64));
    EXPECT_TRUE(torch::equal(out.detach(), torch::arange(4, torch::kFloat32).view({4, 1}))) << out;
  });
}

void clip_grad_norm_matches_one_process(const tp::ParallelizePlan& plan) {
  run_ranks(4, [&](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"dp", "tp"});
    const int64_t d = mesh->get_local_rank(0);
    Net ref(kVocab, kFsdpDim, kHidden), net(kVocab, kFsdpDim, kHidden);
    tp::parallelize_module(net, (*mesh)["tp"], plan);
    for (const auto& b : *net->blocks) fully_shard(b, FullyShardOptions().mesh((*mesh)["dp"]));
    fully_shard(net.ptr(), FullyShardOptions().mesh((*mesh)["dp"]));
    auto ids = (torch::arange(16, torch::kInt64) * 3).remainder(kVocab).view({4, 4});
    auto targets = (ids * 5 + 1).remainder(kVocab);
    torch::cross_entropy_loss(ref(ids).view({-1, kVocab}), targets.view({-1})).backward();
    torch::cross_entropy_loss(net(ids.narrow(0, 2 * d, 2)).view({-1, kVocab}), targets.narrow(0, 2 * d, 2).reshape({-1}))
        .backward();
    for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
      SCOPED_TRACE("norm_type " + std::to_string(norm_type));
      std::vector<torch::Tensor> saved_ref, saved;
      for (auto& p : ref->parameters()) saved_ref.push_back(p.grad().clone());
      for (auto& p : net->parameters()) saved.push_back(p.grad().clone());
      auto want = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.1, norm_type);
      auto got = clip_grad_norm_(net->parameters(), 0.1, norm_type);
      EXPECT_NEAR(got.item<double>(), want, 1e-5 * want);
      auto params = net->named_parameters();
      for (const auto& item : ref->named_parameters()) {
        expect_close(sharded_grad(params[item.key()])->full_tensor(), item.value().grad(), "clipped grad of " + item.key());
      }
      // Back to the unclipped gradients for the next norm type.
      torch::NoGradGuard no_grad;
      size_t i = 0;
      for (auto& p : ref->parameters()) p.mutable_grad().copy_(saved_ref[i++]);
      i = 0;
      for (auto& p : net->parameters()) p.mutable_grad().copy_(saved[i++]);
    }
  });
}

// Every element counted once: TP-sharded weights summed over dp and tp, the norm's replicated (by TP,
// under sequence parallelism) parameters over dp only.
TEST(FsdpOverTpClipGradNorm, ReturnsTheOneProcessNormAndClipsTheSame) { clip_grad_norm_matches_one_process(default_plan()); }
TEST(FsdpOverTpClipGradNorm, SequenceParallelNormCountedOnce) {
  clip_grad_norm_matches_one_process(sequence_parallel_plan());
}

TEST(FsdpOverTpErrors, MeshesThatDoNotComposeAreRefused) {
  std::vector<std::string> other_root(4), same_dim(4);
  std::mutex mu;
  run_ranks(4, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"dp", "tp"});
    std::string a, b;
    {
      // TP on one mesh, FSDP on another mesh built separately.
      torch::nn::Linear lin(4, 4);
      tp::parallelize_module(lin, (*mesh)["tp"], tp::ColwiseParallel());
      auto other = init_device_mesh(torch::kCPU, {4}, {"dp"});
      try {
        fully_shard(lin.ptr(), FullyShardOptions().mesh(other));
      } catch (const c10::Error& e) {
        a = e.what_without_backtrace();
      }
    }
    {
      // FSDP over the TP dimension itself.
      torch::nn::Linear lin(4, 4);
      tp::parallelize_module(lin, (*mesh)["tp"], tp::ColwiseParallel());
      try {
        fully_shard(lin.ptr(), FullyShardOptions().mesh((*mesh)["tp"]));
      } catch (const c10::Error& e) {
        b = e.what_without_backtrace();
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    other_root[pg->rank()] = a;
    same_dim[pg->rank()] = b;
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_NE(other_root[r].find("parameter 'weight' on rank"), std::string::npos) << other_root[r];
    EXPECT_NE(other_root[r].find("is not a slice of the same mesh"), std::string::npos) << other_root[r];
    EXPECT_NE(other_root[r].find("mesh[\"dp\"]"), std::string::npos) << other_root[r];
    EXPECT_NE(same_dim[r].find("contains that same dimension"), std::string::npos) << same_dim[r];
  }
}

// ---- Deferred init with tensor parallelism ------------------------------------------------------------
// torchtitan's order: build the model deferred (meta), parallelize_module over mesh["tp"], fully_shard over
// mesh["dp"] (HSDP: (rep, dp)), materialize_module. On every layout the full tensors are bit-identical to
// eager init with the same seed (LibTorch's own random init; fc2's and the norm's 5 rows split unevenly
// over dp 2 and 3), and the model then trains bit for bit like the eagerly built one on the same layout.

// LibTorch's own random init (tp_test_model.h's Net overwrites its weights without the RNG).
struct RandNetImpl : torch::nn::Module {
  RandNetImpl()
      : emb(register_module("emb", torch::nn::Embedding(kVocab, kFsdpDim))),
        fc1(register_module("fc1", torch::nn::Linear(kFsdpDim, kHidden))),
        fc2(register_module("fc2", torch::nn::Linear(kHidden, kFsdpDim))),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kFsdpDim})))),
        head(register_module("head", torch::nn::Linear(kFsdpDim, kVocab))) {}
  torch::Tensor forward(const torch::Tensor& ids) {
    auto x = emb(ids);
    x = x + fc2(torch::gelu(fc1(x)));
    return head(ln(x));
  }
  torch::nn::Embedding emb;
  torch::nn::Linear fc1, fc2;
  torch::nn::LayerNorm ln;
  torch::nn::Linear head;
};
TORCH_MODULE(RandNet);

tp::ParallelizePlan rand_net_plan(bool sequence_parallel) {
  if (sequence_parallel) {
    return {{"emb", tp::RowwiseParallel().output_layouts(Shard(1))},
            {"fc1", tp::ColwiseParallel().input_layouts(Shard(1))},
            {"fc2", tp::RowwiseParallel().output_layouts(Shard(1))},
            {"ln", tp::SequenceParallel()},
            {"head", tp::ColwiseParallel().input_layouts(Shard(1)).output_layouts(Replicate())}};
  }
  return {{"emb", tp::RowwiseParallel()},
          {"fc1", tp::ColwiseParallel()},
          {"fc2", tp::RowwiseParallel()},
          {"head", tp::ColwiseParallel().output_layouts(Replicate())}};
}

struct DeferredLayout {
  int rep, dp, tp;
  bool sequence_parallel = false;
  bool fsdp = true;  // false: tensor parallelism alone (dp 1)
};

std::string deferred_layout_name(const ::testing::TestParamInfo<DeferredLayout>& info) {
  const auto& c = info.param;
  return (c.rep > 1 ? "rep" + std::to_string(c.rep) + "_" : std::string()) + (c.fsdp ? "dp" + std::to_string(c.dp) + "_" : "") +
         "tp" + std::to_string(c.tp) + (c.sequence_parallel ? "_sp" : "");
}

class FsdpOverTpDeferredInit : public ::testing::TestWithParam<DeferredLayout> {};

TEST_P(FsdpOverTpDeferredInit, FullTensorsEqualEagerInitAndTrainTheSame) {
  const auto c = GetParam();
  const int world = c.rep * c.dp * c.tp;
  torch::manual_seed(11);
  std::map<std::string, torch::Tensor> eager;
  {
    RandNet m;
    for (const auto& p : m->named_parameters()) eager[p.key()] = p.value().detach().clone();
  }
  run_ranks(world, [&](ProcessGroupPtr pg) {
    auto mesh = c.rep > 1 ? init_device_mesh(torch::kCPU, {c.rep, c.dp, c.tp}, {"rep", "dp", "tp"})
                          : init_device_mesh(torch::kCPU, {c.dp, c.tp}, {"dp", "tp"});
    auto fsdp_mesh = c.rep > 1 ? mesh->slice({"rep", "dp"}) : (*mesh)["dp"];
    torch::manual_seed(11);
    auto net = deferred_init([] { return RandNet(); });
    barrier(*pg);  // every rank has read the seed before any rank's materialize_module moves it on
    RandNet built;  // the same values, built eagerly (copied from `eager`), on the same layout
    {
      torch::NoGradGuard no_grad;
      for (auto& p : built->named_parameters()) p.value().copy_(eager.at(p.key()));
    }
    for (auto* m : {&net, &built}) {
      tp::parallelize_module(*m, (*mesh)["tp"], rand_net_plan(c.sequence_parallel));
      if (c.fsdp) {
        fully_shard((*m)->fc1, FullyShardOptions().mesh(fsdp_mesh));
        fully_shard(m->ptr(), FullyShardOptions().mesh(fsdp_mesh));
      }
    }
    for (const auto& p : net->parameters()) EXPECT_TRUE(is_deferred(p));
    materialize_module(net.ptr());
    for (const auto& p : net->parameters()) EXPECT_FALSE(is_deferred(p) || p.is_meta());
    for (const auto& [k, v] : get_model_state_dict(*net)) {
      const auto* d = std::get_if<DTensor>(&v);
      const auto full = d ? d->full_tensor() : std::get<torch::Tensor>(v);
      EXPECT_TRUE(torch::equal(full, eager.at(k))) << k << " on rank " << pg->rank();
    }
    // Trains like the eagerly built model on the same layout, bit for bit.
    const int64_t n_data = c.rep * c.dp, rows = 2;
    const int64_t d = c.rep > 1 ? fsdp_mesh->get_local_rank(0) * c.dp + fsdp_mesh->get_local_rank(1)
                                : fsdp_mesh->get_local_rank(0);
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt_built(built->parameters(), torch::optim::AdamWOptions(1e-2));
    auto params = net->named_parameters();
    auto built_params = built->named_parameters();
    for (int step = 0; step < 2; ++step) {
      auto ids = (torch::arange(rows * n_data * 4, torch::kInt64) * 3 + step).remainder(kVocab).view({rows * n_data, 4});
      auto mine = ids.narrow(0, d * rows, rows), targets = (mine * 5 + 1).remainder(kVocab).reshape({-1});
      auto loss = torch::cross_entropy_loss(net(mine).view({-1, kVocab}), targets);
      auto loss_built = torch::cross_entropy_loss(built(mine).view({-1, kVocab}), targets);
      EXPECT_EQ(loss.item<float>(), loss_built.item<float>()) << "step " << step << " rank " << pg->rank();
      loss.backward();
      loss_built.backward();
      for (const auto& item : built_params) {
        const auto& g = params[item.key()].grad();
        ASSERT_TRUE(g.defined()) << item.key();
        EXPECT_TRUE(torch::equal(g, item.value().grad())) << "grad of " << item.key() << " at step " << step;
      }
      opt.step();
      opt_built.step();
      opt.zero_grad();
      opt_built.zero_grad();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, FsdpOverTpDeferredInit,
                         ::testing::Values(DeferredLayout{1, 2, 2}, DeferredLayout{1, 1, 4}, DeferredLayout{1, 3, 2},
                                           DeferredLayout{2, 2, 2}, DeferredLayout{1, 2, 2, true},
                                           DeferredLayout{1, 1, 2, false, false}, DeferredLayout{1, 1, 4, true, false}),
                         deferred_layout_name);

// ---- Checkpoints of 2-D sharded parameters and optimizer state --------------------------------------

// The model of one layout: TP over mesh["tp"] when tp > 1, then fully_shard of the blocks and the root
// over mesh["dp"]; AdamW.
struct Trained2D {
  DeviceMeshPtr mesh;
  Net net{kVocab, kFsdpDim, kHidden};
  std::unique_ptr<torch::optim::AdamW> opt;
  // fsdp false: TP alone (dp must be 1), the TP parameters' DTensors come from tensor parallelism.
  Trained2D(int dp, int tp, float weight_shift, bool fsdp = true) {
    mesh = init_device_mesh(torch::kCPU, {dp, tp}, {"dp", "tp"});
    {
      torch::NoGradGuard no_grad;  // a different start, so that a load must change every value
      for (auto& p : net->parameters()) p.add_(weight_shift);
    }
    if (tp > 1) tp::parallelize_module(net, (*mesh)["tp"], default_plan());
    if (fsdp) {
      for (const auto& b : *net->blocks) fully_shard(b, FullyShardOptions().mesh((*mesh)["dp"]));
      fully_shard(net.ptr(), FullyShardOptions().mesh((*mesh)["dp"]));
    }
    opt = std::make_unique<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(1e-2));
  }
  void train(int steps) {
    const int64_t dp = mesh->size(0), d = mesh->get_local_rank(0);
    for (int step = 0; step < steps; ++step) {
      auto ids = (torch::arange(4 * 5, torch::kInt64) * 3 + step).remainder(kVocab).view({4, 5});
      auto targets = (ids * 5 + 1).remainder(kVocab);
      const int64_t rows = 4 / dp;
      torch::cross_entropy_loss(net(ids.narrow(0, d * rows, rows)).view({-1, kVocab}),
                                targets.narrow(0, d * rows, rows).reshape({-1}))
          .backward();
      opt->step();
      opt->zero_grad();
    }
  }
  // The loss of one fixed batch, the same on every rank (collective): the model's function, which a
  // load into the wrong rows would change even where the full tensors of the state dict agree.
  float eval_loss() {
    torch::NoGradGuard no_grad;
    auto ids = (torch::arange(4 * 5, torch::kInt64) * 7 + 1).remainder(kVocab).view({4, 5});
    return torch::cross_entropy_loss(net(ids).view({-1, kVocab}), ((ids * 3) + 2).remainder(kVocab).view({-1}))
        .item<float>();
  }
  // Every tensor of the model and optimizer state dict as a full tensor (collective).
  std::map<std::string, torch::Tensor> full_state() {
    std::map<std::string, torch::Tensor> out;
    for (const auto& [key, v] : get_state_dict(net, *opt)) {
      if (const auto* d = std::get_if<DTensor>(&v)) out[key] = d->full_tensor();
      if (const auto* t = std::get_if<torch::Tensor>(&v)) out[key] = t->clone();
    }
    return out;
  }
};

std::string diff(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want) {
  std::ostringstream os;
  for (const auto& [k, w] : want) {
    auto it = got.find(k);
    if (it == got.end()) {
      os << k << " missing; ";
    } else if (!torch::equal(it->second, w)) {
      os << k << " differs; ";
    }
  }
  if (got.size() != want.size()) os << got.size() << " entries vs " << want.size() << "; ";
  return os.str();
}

// Saves (dp_from, tp_from) after 2 steps; loads into (dp_to, tp_to) from another start; the full state
// must be bit-identical.
void save_and_reload(int dp_from, int tp_from, int dp_to, int tp_to, const std::string& dir, bool fsdp_from = true,
                     bool fsdp_to = true) {
  std::map<std::string, torch::Tensor> saved;
  float saved_loss = 0;
  std::mutex mu;
  run_ranks(dp_from * tp_from, [&](ProcessGroupPtr pg) {
    Trained2D t(dp_from, tp_from, 0.0f, fsdp_from);
    t.train(2);
    dcp::save(get_state_dict(t.net, *t.opt), dir);
    auto s = t.full_state();
    const float loss = t.eval_loss();
    std::lock_guard<std::mutex> lock(mu);
    if (pg->rank() == 0) saved = s, saved_loss = loss;
  });
  run_ranks(dp_to * tp_to, [&](ProcessGroupPtr pg) {
    Trained2D t(dp_to, tp_to, 0.25f, fsdp_to);
    t.train(1);  // optimizer state exists, with other values
    auto sd = get_state_dict(t.net, *t.opt);
    dcp::load(sd, dir);
    set_state_dict(t.net, *t.opt, sd);
    EXPECT_EQ(diff(t.full_state(), saved), "") << "(" << dp_from << ", " << tp_from << ") -> (" << dp_to << ", "
                                               << tp_to << "), rank " << pg->rank();
    EXPECT_NEAR(t.eval_loss(), saved_loss, 1e-5 * saved_loss)
        << "(" << dp_from << ", " << tp_from << ") -> (" << dp_to << ", " << tp_to << "), rank " << pg->rank();
  });
}

TEST(FsdpOverTpCheckpoint, SavedOnDp2Tp2LoadsOnEveryOtherLayoutAndBack) {
  const auto root = std::filesystem::temp_directory_path() / ("fsdp_tp_ckpt_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  save_and_reload(2, 2, 4, 1, (root / "a").string());
  save_and_reload(2, 2, 1, 4, (root / "b").string());
  save_and_reload(2, 2, 1, 1, (root / "c").string());
  save_and_reload(4, 1, 2, 2, (root / "d").string());
  save_and_reload(1, 1, 2, 2, (root / "e").string());
  save_and_reload(1, 4, 2, 2, (root / "f").string());
  std::filesystem::remove_all(root);
}

// A model with TP alone has DTensor state dicts too: its checkpoints load under FSDP + TP and back.
TEST(FsdpOverTpCheckpoint, TensorParallelAloneSavesDTensorsThatLoadUnderFsdpAndBack) {
  const auto root = std::filesystem::temp_directory_path() / ("fsdp_tp_only_ckpt_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  save_and_reload(1, 4, 2, 2, (root / "a").string(), /*fsdp_from=*/false, /*fsdp_to=*/true);
  save_and_reload(2, 2, 1, 2, (root / "b").string(), /*fsdp_from=*/true, /*fsdp_to=*/false);
  run_ranks(2, [](ProcessGroupPtr) {
    Trained2D t(1, 2, 0.0f, /*fsdp=*/false);
    const auto sd = get_model_state_dict(*t.net);
    const auto* w = std::get_if<DTensor>(&sd.at("blocks.0.fc1.weight"));
    ASSERT_TRUE(w) << kind_name(sd.at("blocks.0.fc1.weight"));
    EXPECT_EQ(w->sizes(), (std::vector<int64_t>{kHidden, kFsdpDim}));
    EXPECT_EQ(w->placements()[0], Shard(0));
    EXPECT_TRUE(std::holds_alternative<torch::Tensor>(sd.at("blocks.0.fc2.bias")));  // replicated by TP
  });
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace fsdp::testing
