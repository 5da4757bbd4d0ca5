// fully_shard parity with a single-process reference (CTest label: fully_shard).
//
// Every test trains the same tiny model (tests/fsdp_test_model.h) from identical initial weights:
// once unsharded in one thread on the global batch (the reference), and sharded on N ranks (threads
// over Gloo), each rank on its slice of the global batch. Losses (averaged over ranks) must equal the
// reference's at every step and the parameters at the end, within kRtol relative. The full gradients
// (the sharded gradients gathered) and their global norm must equal the reference's at every step:
// AdamW normalises the update, so parameters alone cannot see a gradient off by a constant factor
// (x2, x0.5, the wrong divisor); the SGD runs make such a factor visible in the parameters too.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <tuple>

#include "fsdp_test_model.h"
#include "fsdp_state.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

// fp32 parity tolerances. The sharded run sums gradients in another order than the reference
// (reduce-scatter over ranks), so bitwise equality is not expected. Losses: relative kRtol.
// Parameters: |a - b| <= kAtol + kRtol * |b| (torch.allclose); the absolute term covers parameters near
// zero, where Adam's normalised update amplifies last-bit gradient differences.
constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-6;
constexpr int kSteps = 10;
constexpr int64_t kBatch = 12;  // global batch: divides by 1, 2, 3 and 4 ranks
constexpr int64_t kSeq = 3;
// Gradients at step s: the sharded run's parameters differ from the reference's by up to kRtol after
// s AdamW steps, which moves the gradients a little more; measured max |diff| ~1e-7 against gradients
// of ~1e-2. A constant factor is a 50-100% difference.
constexpr double kGradRtol = 1e-4;
constexpr double kGradAtol = 1e-6;

struct Reference {
  std::vector<float> losses;
  std::vector<std::map<std::string, torch::Tensor>> grads;  // full gradients, per step
  std::vector<double> grad_norms;                            // their global 2-norm, per step
  std::map<std::string, torch::Tensor> final_params;
};

enum class Opt { ADAMW, SGD };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::vector<torch::Tensor>& params, Opt opt) {
  if (opt == Opt::SGD) return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
}

std::map<std::string, torch::Tensor> initial_weights() {
  static std::map<std::string, torch::Tensor> w = [] {
    torch::manual_seed(7);
    Net net;
    return snapshot(*net);
  }();
  return w;
}

// Trains the unsharded model on the global batches. `microbatches` > 1 splits each batch into that
// many pieces whose losses are divided by their number (gradient accumulation, same result).
Reference run_reference(const std::vector<Batch>& batches, int calls_per_block = 1, Opt opt_kind = Opt::ADAMW) {
  Net net;
  net->calls_per_block = calls_per_block;
  load_full(*net, initial_weights());
  auto opt = make_optimizer(net->parameters(), opt_kind);
  Reference ref;
  for (const auto& b : batches) {
    opt->zero_grad();
    auto loss = loss_fn(net->forward(b.idx), b.targets);
    loss.backward();
    std::map<std::string, torch::Tensor> grads;
    double sq = 0;
    for (const auto& p : net->named_parameters()) {
      grads[p.key()] = p.value().grad().clone();
      sq += p.value().grad().to(torch::kDouble).pow(2).sum().item<double>();
    }
    ref.grads.push_back(std::move(grads));
    ref.grad_norms.push_back(std::sqrt(sq));
    opt->step();
    ref.losses.push_back(loss.item<float>());
  }
  ref.final_params = snapshot(*net);
  return ref;
}

struct ShardConfig {
  std::optional<ReshardAfterForward> reshard_after_forward;  // for the blocks
  bool use_tree = false;          // fully_shard_tree instead of manual calls
  bool optimizer_before = false;  // build the optimizer before fully_shard
  bool explicit_prefetch = false;
  bool explicit_unshard = false;
  int calls_per_block = 1;
  Opt opt = Opt::ADAMW;
};

// Checks this rank's gradients against the reference's at one step: the full gradient of every
// parameter (the sharded gradients gathered with DTensor::full_tensor, a collective over the mesh)
// and the global norm (fsdp::clip_grad_norm_ with an infinite max_norm: no clipping). Returns the
// largest |diff| of the gradients.
double compare_gradients(torch::nn::Module& net, const DeviceMeshPtr& mesh, const std::vector<Placement>& placements,
                         const Reference& ref, size_t step, int rank) {
  double worst = 0;
  std::vector<torch::Tensor> params;
  for (const auto& p : net.named_parameters()) {
    const auto& expect = ref.grads[step].at(p.key());
    if (!p.value().grad().defined()) {
      ADD_FAILURE() << p.key() << " has no gradient at step " << step << " on rank " << rank;
      continue;
    }
    auto full = DTensor(p.value().grad(), mesh, placements, expect.sizes().vec()).full_tensor();
    worst = std::max(worst, max_abs_diff(full, expect));
    EXPECT_TRUE(torch::allclose(full, expect, kGradRtol, kGradAtol))
        << "gradient of " << p.key() << " at step " << step << " on rank " << rank << ": max |diff| "
        << max_abs_diff(full, expect) << ", reference max |g| " << expect.abs().max().item<double>();
    params.push_back(p.value());
  }
  double norm = clip_grad_norm_(params, std::numeric_limits<double>::infinity()).item<double>();
  EXPECT_NEAR(norm, ref.grad_norms[step], kGradRtol * ref.grad_norms[step])
      << "gradient norm at step " << step << " on rank " << rank;
  return worst;
}

// Shards a fresh model bottom-up (blocks, then root). Returns it.
Net build_sharded(const ShardConfig& cfg, ProcessGroupPtr pg) {
  Net net;
  net->calls_per_block = cfg.calls_per_block;
  load_full(*net, initial_weights());
  auto mesh = init_device_mesh(torch::kCPU, {pg->size()});
  auto opts = FullyShardOptions().mesh(mesh);
  if (cfg.use_tree) {
    auto wrapped = fully_shard_tree(net, AutoWrapPolicy().module_types({"BlockImpl"}), opts);
    EXPECT_EQ(wrapped, (std::vector<std::string>{"blocks.0", "blocks.1", ""}));
  } else {
    auto bopts = opts;
    bopts.reshard_after_forward(cfg.reshard_after_forward);
    for (auto& b : net->blocks) fully_shard(b, bopts);
    fully_shard(net, opts);
  }
  return net;
}

// Trains a sharded model on this rank's slice of each global batch; checks every step's loss and
// the final parameters against the reference. Returns the largest relative differences seen.
// Trains a sharded model on this rank's slice of each global batch; checks every step's loss, full
// gradients and gradient norm, and the final parameters against the reference. Returns the largest
// relative loss difference, |param diff| and |grad diff| seen.
std::tuple<double, double, double> train_and_compare(const ShardConfig& cfg, ProcessGroupPtr pg,
                                                     const std::vector<Batch>& batches, const Reference& ref) {
  const int ws = pg->size();
  const int64_t local = kBatch / ws;
  std::unique_ptr<torch::optim::Optimizer> opt;
  Net net{nullptr};
  if (cfg.optimizer_before) {
    // The optimizer holds the parameter tensors; fully_shard keeps their identity and swaps their data.
    net = Net();
    net->calls_per_block = cfg.calls_per_block;
    load_full(*net, initial_weights());
    opt = make_optimizer(net->parameters(), cfg.opt);
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    fully_shard(net, FullyShardOptions().mesh(mesh));
  } else {
    net = build_sharded(cfg, pg);
    opt = make_optimizer(net->parameters(), cfg.opt);
  }
  FSDPModule<Net> model(net);
  if (cfg.explicit_prefetch) {
    auto& bl = net->blocks;
    bl[0].set_modules_to_forward_prefetch({bl[1].ptr()});
    bl[1].set_modules_to_backward_prefetch({bl[0].ptr()});
  }
  auto mesh = init_device_mesh(torch::kCPU, {ws});
  double max_loss = 0, max_grad = 0;
  for (size_t step = 0; step < batches.size(); ++step) {
    auto b = batches[step].slice(pg->rank() * local, local);
    opt->zero_grad();
    if (cfg.explicit_unshard) {
      auto h = model.unshard(/*async_op=*/true);
      h.wait();
    }
    auto loss = loss_fn(model(b.idx), b.targets);
    loss.backward();
    max_grad = std::max(max_grad, compare_gradients(*net, mesh, {Shard(0)}, ref, step, pg->rank()));
    opt->step();
    auto global = loss.detach().clone();
    all_reduce(global, *pg, ReduceOp::AVG);
    double d = std::abs(global.item<double>() - ref.losses[step]) / std::abs(ref.losses[step]);
    max_loss = std::max(max_loss, d);
    EXPECT_LE(d, kRtol) << "step " << step << ": loss " << global.item<float>() << " vs reference "
                        << ref.losses[step] << " on rank " << pg->rank();
  }
  // Compare the local shards with the reference's final parameters sliced the same way.
  double max_param = 0;
  for (const auto& p : net->named_parameters()) {
    auto expect = distribute_tensor(ref.final_params.at(p.key()), mesh, {Shard(0)}).to_local();
    EXPECT_EQ(p.value().sizes(), expect.sizes()) << p.key();
    if (p.value().sizes() != expect.sizes()) continue;
    max_param = std::max(max_param, max_abs_diff(p.value(), expect));
    EXPECT_TRUE(torch::allclose(p.value(), expect, kRtol, kAtol))
        << p.key() << " on rank " << pg->rank() << ": max |diff| " << max_abs_diff(p.value(), expect);
  }
  return {max_loss, max_param, max_grad};
}

void run_parity(int ws, const ShardConfig& cfg) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches, cfg.calls_per_block, cfg.opt);
  std::mutex mu;
  double worst_loss = 0, worst_param = 0, worst_grad = 0;
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto [l, p, g] = train_and_compare(cfg, pg, batches, ref);
    std::lock_guard<std::mutex> lock(mu);
    worst_loss = std::max(worst_loss, l);
    worst_param = std::max(worst_param, p);
    worst_grad = std::max(worst_grad, g);
  });
  std::printf("[parity] world size %d, %s: max relative loss diff %.3g (tolerance %.0e), max |param diff| %.3g "
              "(tolerance %.0e + %.0e * |ref|), max |grad diff| %.3g (tolerance %.0e + %.0e * |ref|)\n",
              ws, cfg.opt == Opt::SGD ? "SGD" : "AdamW", worst_loss, kRtol, worst_param, kAtol, kRtol, worst_grad,
              kGradAtol, kGradRtol);
}

class Parity : public ::testing::TestWithParam<int> {};

TEST_P(Parity, AdamWTenStepsMatchSingleProcess) { run_parity(GetParam(), {}); }
TEST_P(Parity, ReshardAfterForwardFalse) { run_parity(GetParam(), ShardConfig{ReshardAfterForward(false)}); }
TEST_P(Parity, AutoWrapTreeEqualsManual) {
  ShardConfig c;
  c.use_tree = true;
  run_parity(GetParam(), c);
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, Parity, ::testing::Values(1, 2, 3, 4));

// SGD applies the gradient as it is: a gradient off by a constant factor moves the parameters off too
// (issue 17, item 10). Regressions* suite: CTest label `regressions`.
class RegressionsParitySGD : public ::testing::TestWithParam<int> {};
TEST_P(RegressionsParitySGD, TenStepsMatchSingleProcess) {
  ShardConfig c;
  c.opt = Opt::SGD;
  run_parity(GetParam(), c);
}
TEST_P(RegressionsParitySGD, ReshardAfterForwardFalse) {
  ShardConfig c{ReshardAfterForward(false)};
  c.opt = Opt::SGD;
  run_parity(GetParam(), c);
}
INSTANTIATE_TEST_SUITE_P(RegressionsWorldSizes, RegressionsParitySGD, ::testing::Values(1, 2, 3));
TEST(RegressionsParitySGD, ReshardAfterForwardTwoOnFourRanks) {
  ShardConfig c{ReshardAfterForward(2)};
  c.opt = Opt::SGD;
  run_parity(4, c);
}

TEST(Parity, ReshardAfterForwardTwoOnFourRanks) { run_parity(4, ShardConfig{ReshardAfterForward(2)}); }

TEST(Parity, ExplicitPrefetchAndUnshard) {
  ShardConfig c;
  c.explicit_prefetch = true;
  c.explicit_unshard = true;
  run_parity(3, c);
}

TEST(Parity, OptimizerBuiltBeforeFullyShard) {
  ShardConfig c;
  c.optimizer_before = true;
  run_parity(2, c);
}

TEST(Parity, ModuleCalledTwiceInOneForward) {
  ShardConfig c;
  c.calls_per_block = 2;
  run_parity(3, c);
}

// HSDP: a 2 x 2 mesh (replicate, shard): shards over the shard dim, replicas over the other;
// gradients reduce-scattered over "shard", all-reduced over "replicate" and divided by the 4
// data-parallel ranks (not the 2 of the shard group: the full gradients and their norm see it).
void run_hsdp_parity(Opt opt_kind) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches, 1, opt_kind);
  run_ranks(4, [&](ProcessGroupPtr pg) {
    Net net;
    load_full(*net, initial_weights());
    auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"replicate", "shard"});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    FSDPModule<Net> model(net);
    auto opt = make_optimizer(net->parameters(), opt_kind);
    const int64_t local = kBatch / 4;
    for (size_t step = 0; step < batches.size(); ++step) {
      auto b = batches[step].slice(pg->rank() * local, local);
      opt->zero_grad();
      auto loss = loss_fn(model(b.idx), b.targets);
      loss.backward();
      compare_gradients(*net, mesh, {Replicate(), Shard(0)}, ref, step, pg->rank());
      opt->step();
      auto global = loss.detach().clone();
      all_reduce(global, *pg, ReduceOp::AVG);
      EXPECT_NEAR(global.item<double>(), ref.losses[step], kRtol * std::abs(ref.losses[step])) << "step " << step;
    }
    for (const auto& [name, dt] : fsdp_api(*net).sharded_parameters()) {
      EXPECT_EQ(dt.placements().size(), 2u);
      EXPECT_TRUE(dt.placements()[0].is_replicate());
    }
    for (const auto& p : net->named_parameters()) {
      auto expect = distribute_tensor(ref.final_params.at(p.key()), mesh, {Replicate(), Shard(0)}).to_local();
      EXPECT_TRUE(torch::allclose(p.value(), expect, kRtol, kAtol)) << p.key() << " on rank " << pg->rank();
    }
  });
}

TEST(Parity, HybridShardingOnTwoByTwoMesh) { run_hsdp_parity(Opt::ADAMW); }
TEST(RegressionsParitySGD, HybridShardingOnTwoByTwoMesh) { run_hsdp_parity(Opt::SGD); }

// An optimizer built after a forward that left the root unsharded (reshard_after_forward=false for
// the root): it holds the same parameter tensors, which are sharded again after backward.
TEST(Parity, OptimizerBuiltAfterForwardWithUnshardedRoot) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches);
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    FSDPModule<Net> model(net);
    auto b0 = batches[0].slice(pg->rank() * 6, 6);
    auto loss0 = loss_fn(model(b0.idx), b0.targets);
    EXPECT_EQ(net->head->weight.size(0), kClasses);  // the root is unsharded now
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
    loss0.backward();
    EXPECT_EQ(net->head->weight.size(0), 1);  // sharded again: the optimizer sees the shard
    opt.step();
    for (size_t step = 1; step < batches.size(); ++step) {
      auto b = batches[step].slice(pg->rank() * 6, 6);
      opt.zero_grad();
      loss_fn(model(b.idx), b.targets).backward();
      opt.step();
    }
    auto mesh = init_device_mesh(torch::kCPU, {2});
    for (const auto& p : net->named_parameters()) {
      auto expect = distribute_tensor(ref.final_params.at(p.key()), mesh, {Shard(0)}).to_local();
      EXPECT_TRUE(torch::allclose(p.value(), expect, kRtol, kAtol)) << p.key();
    }
  });
}

// reshard_after_backward=false keeps the parameters unsharded between no-sync microbatches; after
// the synchronised one the optimizer sees shards with their gradients.
TEST(GradientAccumulation, ReshardAfterBackwardFalseStillStepsShards) {
  constexpr int k = 3;
  auto batches = make_batches(1, kBatch * k, kSeq, 99);
  Net ref;
  load_full(*ref, initial_weights());
  loss_fn(ref->forward(batches[0].idx), batches[0].targets).backward();
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    FSDPModule<Net> model(net);
    model.set_reshard_after_backward(false);
    for (int m = 0; m < k; ++m) {
      auto b = batches[0].slice(m * kBatch + pg->rank() * 6, 6);
      model.set_requires_gradient_sync(m == k - 1);
      (loss_fn(model(b.idx), b.targets) / k).backward();
      if (m < k - 1) EXPECT_EQ(net->blocks[0]->fc1->weight.size(0), kHidden) << "kept unsharded between microbatches";
    }
    auto mesh = init_device_mesh(torch::kCPU, {2});
    for (const auto& p : net->named_parameters()) {
      auto expect = distribute_tensor(ref->named_parameters()[p.key()].grad(), mesh, {Shard(0)}).to_local();
      ASSERT_EQ(p.value().sizes(), expect.sizes()) << p.key() << " is resharded after the synchronised backward";
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6)) << p.key();
    }
  });
}

TEST(BadInput, FailedFullyShardLeavesTheModuleUnchanged) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto m = std::make_shared<torch::nn::Module>();
    m->register_parameter("a", torch::ones({4, 3}));
    m->register_parameter("b", torch::ones({4, 3}).t());  // non-contiguous: rejected
    EXPECT_THROW(fully_shard(m, FullyShardOptions().mesh(mesh)), c10::Error);
    EXPECT_EQ(m->named_parameters()["a"].size(0), 4) << "validated before sharding";
    // Parameters that would be gathered in different dtypes are refused at fully_shard.
    auto n = std::make_shared<torch::nn::Module>();
    n->register_parameter("w", torch::ones({4, 3}));
    n->register_parameter("ids", torch::zeros({4}, torch::kLong), /*requires_grad=*/false);
    try {
      fully_shard(n, FullyShardOptions().mesh(mesh));
      FAIL();
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("different dtypes"), std::string::npos) << e.what();
    }
    EXPECT_EQ(n->named_parameters()["w"].size(0), 4);
  });
}

// Ignored parameters are neither sharded nor reduced.
TEST(Layout, IgnoredParamsStayFull) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Net net;
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto api = fully_shard(net, FullyShardOptions().mesh(mesh).ignored_params({net->head->weight}));
    EXPECT_EQ(net->head->weight.size(0), kClasses);
    EXPECT_EQ(net->wte->weight.size(0), pg->rank() == 0 ? 6 : 5);
    for (const auto& [name, dt] : api.sharded_parameters()) EXPECT_NE(name, "head.weight");
  });
}

// Another entry point than forward goes through FSDP with fsdp_forward (register_fsdp_forward_method).
struct WithScoreImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  WithScoreImpl() { fc = register_module("fc", torch::nn::Linear(kDim, 3)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  torch::Tensor score(torch::Tensor x) { return fc(x).sum(-1); }
};
TORCH_MODULE(WithScore);

TEST(Hooks, OtherEntryPointsThroughFsdpForward) {
  torch::manual_seed(2);
  WithScore ref;
  auto x = torch::randn({4, kDim});
  ref->score(x).sum().backward();
  run_ranks(2, [&](ProcessGroupPtr pg) {
    FSDPModule<WithScore> m;
    load_full(*m.ptr(), snapshot(*ref));
    fully_shard(m, FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {2})));
    auto y = fsdp_forward(*m, [&] { return m->score(x); });
    EXPECT_TRUE(torch::allclose(y, ref->score(x).detach()));
    (y.sum() / 2).backward();  // each rank's contribution; the reduce-scatter sums both
    auto expect = distribute_tensor(ref->fc->weight.grad(), init_device_mesh(torch::kCPU, {2}), {Shard(0)});
    EXPECT_TRUE(torch::allclose(m->fc->weight.grad(), expect.to_local() / 2, 1e-5, 1e-6));
  });
}

// ---- Gradient accumulation ---------------------------------------------------------------------------
// Gradients of k microbatches (each loss divided by k) with sync off for the first k-1 must equal the
// gradient of one step on their concatenation; also with sync on every microbatch.
void check_accumulation(int ws, bool sync_each) {
  constexpr int k = 3;
  auto batches = make_batches(1, kBatch * k, kSeq, 99);
  // Reference gradient on the whole batch.
  Net ref;
  load_full(*ref, initial_weights());
  loss_fn(ref->forward(batches[0].idx), batches[0].targets).backward();
  std::map<std::string, torch::Tensor> ref_grads;
  for (const auto& p : ref->named_parameters()) ref_grads[p.key()] = p.value().grad().clone();

  run_ranks(ws, [&](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    FSDPModule<Net> model(net);
    const int64_t local = kBatch / ws;
    for (int m = 0; m < k; ++m) {
      // Microbatch m of this rank: rows of the global batch laid out as k global microbatches.
      auto b = batches[0].slice(m * kBatch + pg->rank() * local, local);
      model.set_requires_gradient_sync(sync_each || m == k - 1);
      (loss_fn(model(b.idx), b.targets) / k).backward();
    }
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    for (const auto& p : net->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      auto expect = distribute_tensor(ref_grads.at(p.key()), mesh, {Shard(0)}).to_local();
      ASSERT_EQ(p.value().grad().sizes(), expect.sizes()) << p.key();
      EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6)) << p.key() << " on rank " << pg->rank();
    }
  });
}

TEST(GradientAccumulation, NoSyncThenSyncEqualsConcatenation) {
  check_accumulation(2, false);
  check_accumulation(3, false);
}
TEST(GradientAccumulation, SyncEveryMicrobatchEqualsConcatenation) { check_accumulation(4, true); }

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
    for (auto& b : net->blocks) held += fully_shard(b, FullyShardOptions().mesh(mesh)).state().group->sharded_bytes();
    held += fully_shard(net, FullyShardOptions().mesh(mesh)).state().group->sharded_bytes();
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

// ---- Sharding layout and DTensor ------------------------------------------------------------------------
TEST(Layout, ShardsFollowTorchChunkWithEmptyShards) {
  run_ranks(4, [](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    auto full = initial_weights();
    auto mesh = init_device_mesh(torch::kCPU, {4});
    for (const auto& p : net->named_parameters()) {
      auto chunks = full.at(p.key()).chunk(4, 0);
      auto expect = pg->rank() < static_cast<int>(chunks.size()) ? chunks[pg->rank()] : full.at(p.key()).narrow(0, 0, 0);
      EXPECT_TRUE(torch::equal(p.value(), expect)) << p.key() << " on rank " << pg->rank();
    }
    // fc1.weight [5, 6] on 4 ranks: 2, 2, 1, 0 rows; head.weight [2, 6]: 1, 1, 0, 0.
    std::vector<int64_t> fc1_rows{2, 2, 1, 0}, head_rows{1, 1, 0, 0};
    EXPECT_EQ(net->blocks[0]->fc1->weight.size(0), fc1_rows[pg->rank()]);
    EXPECT_EQ(net->head->weight.size(0), head_rows[pg->rank()]);
    EXPECT_EQ(net->head->weight.size(1), kDim);
    // Full tensors gather back exactly.
    for (const auto& [name, dt] : fsdp_api(*net).sharded_parameters()) {
      EXPECT_TRUE(torch::equal(dt.full_tensor(), full.at(name))) << name;
    }
  });
}

TEST(DTensor, DistributeFullTensorAndFromLocal) {
  run_ranks(3, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {3});
    auto full = torch::arange(2 * 7, torch::kFloat32).view({2, 7});
    for (int64_t dim : {0, 1}) {
      auto dt = distribute_tensor(full, mesh, {Shard(dim)});
      EXPECT_EQ(dt.to_local().size(dim), chunk_range(full.size(dim), 3, pg->rank()).length);
      EXPECT_TRUE(torch::equal(dt.full_tensor(), full));
      auto back = DTensor::from_local(dt.to_local(), mesh, {Shard(dim)});
      EXPECT_EQ(back.sizes(), full.sizes().vec());
    }
    auto rep = distribute_tensor(full, mesh, {Replicate()});
    EXPECT_TRUE(torch::equal(rep.full_tensor(), full));
    EXPECT_THROW(DTensor(torch::zeros({5, 7}), mesh, {Shard(0)}, {2, 7}), c10::Error);
  });
}

// ---- Tied, frozen and bad parameters -------------------------------------------------------------------
// An embedding and an output projection sharing one weight (GPT-style weight tying).
struct TiedImpl : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  std::shared_ptr<torch::nn::Module> out;
  TiedImpl() {
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    out = register_module("out", std::make_shared<torch::nn::Module>());
    out->register_parameter("weight", emb->weight);  // the same tensor under two names
  }
  torch::Tensor forward(torch::Tensor idx) { return torch::matmul(emb(idx), emb->weight.t()); }
};
TORCH_MODULE(Tied);

TEST(Tied, InOneGroupTrainsLikeTheReference) {
  torch::manual_seed(3);
  Tied ref;
  auto w0 = snapshot(*ref);
  auto idx = torch::randint(0, kVocab, {4, 3});
  auto tgt = torch::randint(0, kVocab, {4, 3});
  torch::optim::SGD ref_opt(ref->parameters(), 0.1);
  for (int s = 0; s < 3; ++s) {
    ref_opt.zero_grad();
    torch::nn::functional::cross_entropy(ref->forward(idx).view({-1, kVocab}), tgt.view({-1})).backward();
    ref_opt.step();
  }
  run_ranks(2, [&](ProcessGroupPtr pg) {
    FSDPModule<Tied> m;
    load_full(*m.ptr(), w0);
    fully_shard(m, FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {2})));
    EXPECT_EQ(fsdp_api(*m).sharded_parameters().size(), 1u);  // one tensor, managed once
    torch::optim::SGD opt(m->parameters(), 0.1);
    auto li = idx.narrow(0, pg->rank() * 2, 2), lt = tgt.narrow(0, pg->rank() * 2, 2);
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      torch::nn::functional::cross_entropy(m(li).view({-1, kVocab}), lt.view({-1})).backward();
      opt.step();
    }
    auto expect = distribute_tensor(ref->emb->weight.detach(), init_device_mesh(torch::kCPU, {2}), {Shard(0)});
    EXPECT_TRUE(torch::allclose(m->emb->weight, expect.to_local(), 1e-5, 1e-6));
  });
}

TEST(Tied, InSeparateGroupsIsAClearError) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Tied m;
    auto mesh = init_device_mesh(torch::kCPU, {2});
    fully_shard(m->emb.ptr(), FullyShardOptions().mesh(mesh));
    try {
      fully_shard(m.ptr(), FullyShardOptions().mesh(mesh));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("'out.weight'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("torch::nn::EmbeddingImpl"), std::string::npos) << msg;
      EXPECT_NE(msg.find("fully_shard({module_a, module_b})"), std::string::npos) << msg;
    }
  });
}

TEST(Frozen, FrozenAndTrainableShareAGroup) {
  auto batches = make_batches(3, kBatch, kSeq);
  // Reference with wte frozen.
  Net ref;
  load_full(*ref, initial_weights());
  ref->wte->weight.set_requires_grad(false);
  torch::optim::SGD ref_opt(ref->parameters(), 0.1);
  for (const auto& b : batches) {
    ref_opt.zero_grad();
    loss_fn(ref->forward(b.idx), b.targets).backward();
    ref_opt.step();
  }
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Net net;
    load_full(*net, initial_weights());
    net->wte->weight.set_requires_grad(false);
    auto mesh = init_device_mesh(torch::kCPU, {2});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    FSDPModule<Net> model(net);
    torch::optim::SGD opt(net->parameters(), 0.1);
    for (const auto& gb : batches) {
      auto b = gb.slice(pg->rank() * 6, 6);
      opt.zero_grad();
      loss_fn(model(b.idx), b.targets).backward();
      opt.step();
    }
    EXPECT_FALSE(net->wte->weight.grad().defined());
    for (const auto& p : net->named_parameters()) {
      auto expect = distribute_tensor(ref->named_parameters()[p.key()].detach(), mesh, {Shard(0)}).to_local();
      EXPECT_TRUE(torch::allclose(p.value(), expect, 1e-5, 1e-6)) << p.key();
    }
  });
}

TEST(BadInput, ScalarAndNonContiguousParametersNameTheParameter) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto m = std::make_shared<torch::nn::Module>();
    m->register_parameter("temperature", torch::ones({}));
    try {
      fully_shard(m, FullyShardOptions().mesh(mesh));
      FAIL();
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("'temperature'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("scalar"), std::string::npos) << e.what();
    }
    auto n = std::make_shared<torch::nn::Module>();
    n->register_parameter("w", torch::ones({4, 3}).t());
    try {
      fully_shard(n, FullyShardOptions().mesh(mesh));
      FAIL();
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("not contiguous"), std::string::npos) << e.what();
    }
  });
}

// A parent that calls a sharded child through its plain holder bypasses FSDP.
struct BypassImpl : torch::nn::Module {
  Block inner{nullptr};  // NOT FSDPModule<Block>: its forward cannot be intercepted
  BypassImpl() { inner = register_module("inner", Block()); }
  torch::Tensor forward(torch::Tensor x) { return inner(x); }
};
TORCH_MODULE(Bypass);

TEST(BadInput, ForwardThatBypassesFSDPSaysSo) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    FSDPModule<Bypass> m;
    fully_shard(m->inner, FullyShardOptions().mesh(mesh));
    fully_shard(m, FullyShardOptions().mesh(mesh));
    try {
      m(torch::randn({2, kDim}));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("did not go through FSDP"), std::string::npos) << msg;
      EXPECT_NE(msg.find("'inner'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("fsdp::FSDPModule<Holder>"), std::string::npos) << msg;
    }
  });
}

TEST(BadInput, ChildForwardBeforeRootIsAnError) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    net->blocks[0](torch::randn({2, kDim}));
    FSDPModule<Net> model(net);
    try {
      model(torch::zeros({2, 3}, torch::kLong));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("running forward through the root module first"), std::string::npos)
          << e.what();
    }
  });
}

}  // namespace
}  // namespace fsdp::testing
