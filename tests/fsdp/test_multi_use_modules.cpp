// Modules used several times in one forward (issue 17 item 1; CTest labels: fully_shard, regressions;
// Parity: fully_shard; Unchanged: unchanged_models): a group's post-backward runs exactly once per backward,
// after every use of its parameters produced its gradient, whatever the inputs of each call require; with
// reshard_after_forward true, false and an int, activation checkpointing (checkpoint_wrapper and the functional
// fsdp::checkpoint) and bf16 mixed precision. Gradients are compared with a single-process reference on the
// same global batch: each rank's loss is the mean over its slice, so the reference gradient is the mean over
// ranks (FSDP divides by ws).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <mutex>

#include "fully_shard_test_util.h"
#include "shapes_net.h"
#include "unchanged_harness.h"

namespace fsdp::testing {
namespace {

TEST(Parity, ModuleCalledTwiceInOneForward) {
  ShardConfig c;
  c.calls_per_block = 2;
  run_parity(3, c);
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing::shapes_net {
namespace {

// fp32: the sharded run sums in another order than the reference. bf16: both sides compute in bf16
// with the same casts per rank slice; the remaining difference is the order of the fp32 reduction
// and bf16 rounding of intermediate results that depend on it.
constexpr double kRtol = 1e-5, kAtol = 1e-6;
constexpr double kBf16Rtol = 2e-2, kBf16Atol = 2e-3;

struct ShapesConfig {
  ReshardAfterForward raf = true;  // for every non-root group
  bool checkpoint = false;         // checkpoint_wrapper on blk and lin (their calls are recomputed)
  bool bf16 = false;               // param_dtype bf16, reduce_dtype fp32
};

std::map<std::string, torch::Tensor> shapes_weights() {
  static auto w = [] {
    torch::manual_seed(17);
    ShapesNet n;
    return snapshot(*n);
  }();
  return w;
}

struct ShapesBatch {
  torch::Tensor ids, xf;
};
ShapesBatch shapes_batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  return {torch::randint(0, kV, {12, 3}, gen, torch::kLong), torch::randn({12, 3, kD}, gen)};
}

template <typename Model>  // ShapesNet (the reference) or FSDPModule<ShapesNet>
torch::Tensor shapes_loss(Model& m, const ShapesBatch& b, bool bf16) {
  auto xf = bf16 ? b.xf.to(torch::kBFloat16) : b.xf;
  return m(b.ids, xf).to(torch::kFloat32).pow(2).mean();
}

// Reference gradients of `steps` backwards (each on a fresh batch, accumulated) on one process. For
// bf16: each rank slice on a bf16 copy, gradients cast to fp32 and averaged (what bf16 FSDP computes).
std::map<std::string, torch::Tensor> shapes_reference(int ws, int steps, bool bf16) {
  ShapesNet ref;
  load_full(*ref, shapes_weights());
  if (bf16) ref->to(torch::kBFloat16);
  std::map<std::string, torch::Tensor> grads;  // fp32 sums, as FSDP accumulates its fp32 shards
  auto add_grads = [&](double factor) {
    for (const auto& p : ref->named_parameters()) {
      if (!p.value().grad().defined()) continue;
      auto g = p.value().grad().to(torch::kFloat32) * factor;
      grads[p.key()] = grads.count(p.key()) ? grads[p.key()] + g : g;
    }
    for (const auto& p : ref->parameters()) p.mutable_grad() = torch::Tensor();
  };
  for (int step = 0; step < steps; ++step) {
    auto b = shapes_batch(step);
    const int64_t local = 12 / ws;
    if (!bf16) {
      shapes_loss(ref, b, false).backward();
      add_grads(1.0);
      continue;
    }
    for (int r = 0; r < ws; ++r) {
      ShapesBatch s{b.ids.narrow(0, r * local, local), b.xf.narrow(0, r * local, local)};
      shapes_loss(ref, s, true).backward();
      add_grads(1.0 / ws);
    }
  }
  return grads;
}

// Shards ShapesNet bottom-up: every child, the tied pair as one group, the root last.
ShapesNet shard_shapes(const ShapesConfig& cfg, const DeviceMeshPtr& mesh) {
  ShapesNet net;
  load_full(*net, shapes_weights());
  auto opts = FullyShardOptions().mesh(mesh).reshard_after_forward(cfg.raf);
  if (cfg.bf16) opts.mp_policy(MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat32));
  if (cfg.checkpoint) {
    checkpoint_wrapper(net->blk);
    checkpoint_wrapper(net->lin);
  }
  fully_shard(net->blk, opts);
  fully_shard(net->lin, opts);
  fully_shard(net->side, opts);
  fully_shard(net->frozen, opts);
  fully_shard(net->unused, opts);
  fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{net->emb.ptr(), net->out.ptr()}, opts);
  auto root_opts = opts;
  root_opts.reshard_after_forward(std::nullopt);
  fully_shard(net, root_opts);
  return net;
}

// Two backwards (gradients accumulate across them) on `ws` ranks; every rank's gradient shards must
// equal the reference's, and every group that has gradients reduce-scatters exactly once per backward.
void check_shapes(int ws, const ShapesConfig& cfg) {
  constexpr int kSteps = 2;
  auto ref = shapes_reference(ws, kSteps, cfg.bf16);
  const double rtol = cfg.bf16 ? kBf16Rtol : kRtol, atol = cfg.bf16 ? kBf16Atol : kAtol;
  std::mutex mu;
  double worst = 0;
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    FSDPModule<ShapesNet> net = shard_shapes(cfg, mesh);
    const int64_t local = 12 / ws;
    for (int step = 0; step < kSteps; ++step) {
      auto b = shapes_batch(step);
      ShapesBatch mine{b.ids.narrow(0, pg->rank() * local, local), b.xf.narrow(0, pg->rank() * local, local)};
      auto rs0 = pg->collective_count("reduce_scatter_tensor");
      shapes_loss(net, mine, cfg.bf16).backward();
      // Groups with gradients: root (scale), {emb, out}, blk, lin, side. frozen and unused: none.
      EXPECT_EQ(pg->collective_count("reduce_scatter_tensor") - rs0, ws > 1 ? 5u : 0u)
          << "one reduce-scatter per group with gradients, step " << step;
    }
    for (const auto& p : net->named_parameters()) {
      auto it = ref.find(p.key());
      if (it == ref.end()) {
        EXPECT_FALSE(p.value().grad().defined()) << p.key() << " has a gradient the reference does not have";
        continue;
      }
      ASSERT_TRUE(p.value().grad().defined()) << p.key() << " on rank " << pg->rank();
      auto expect = distribute_tensor(it->second, mesh, {Shard(0)}).to_local();
      ASSERT_EQ(p.value().grad().sizes(), expect.sizes()) << p.key();
      auto got = p.value().grad().to(torch::kFloat32);
      double scale = it->second.abs().max().item<double>();
      EXPECT_TRUE(torch::allclose(got, expect, rtol, atol * std::max(1.0, scale)))
          << p.key() << " on rank " << pg->rank() << ": max |diff| " << max_abs_diff(got, expect);
      std::lock_guard<std::mutex> lock(mu);
      worst = std::max(worst, max_abs_diff(got, expect));
    }
  });
  std::printf("[multi-use] ws %d raf %s ckpt %d bf16 %d: max |grad diff| %.3g\n", ws,
              std::holds_alternative<bool>(cfg.raf) ? (std::get<bool>(cfg.raf) ? "true" : "false")
                                                    : std::to_string(std::get<int>(cfg.raf)).c_str(),
              cfg.checkpoint, cfg.bf16, worst);
}

// Issue 17 item 1, as filed: lin(tanh(lin(x))) with x not requiring grad, 2 ranks.
struct TwiceImpl : torch::nn::Module {
  FSDPModule<torch::nn::Linear> lin{nullptr};
  TwiceImpl() { lin = register_module("lin", torch::nn::Linear(8, 8)); }
  torch::Tensor forward(torch::Tensor x) { return lin(torch::tanh(lin(x))); }
};
TORCH_MODULE(Twice);

TEST(RegressionsMultiUse, LinearCalledTwiceOnInputWithoutGrad) {
  for (int ws : {2, 3}) {
    torch::manual_seed(1);
    Twice ref;
    auto w = snapshot(*ref);
    auto x = torch::randn({6, 8});
    ref->forward(x).pow(2).sum().backward();
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      FSDPModule<Twice> m;
      load_full(*m.ptr(), w);
      auto mesh = init_device_mesh(torch::kCPU, {ws});
      fully_shard(m->lin, FullyShardOptions().mesh(mesh));
      fully_shard(m, FullyShardOptions().mesh(mesh));
      const int64_t local = 6 / ws;
      // The sum over ranks of the per-rank losses is the reference loss: scale by ws (FSDP averages).
      (m(x.narrow(0, pg->rank() * local, local)).pow(2).sum() * ws).backward();
      for (const auto& name : {"weight", "bias"}) {
        auto expect = distribute_tensor(ref->lin->named_parameters()[name].grad(), mesh, {Shard(0)}).to_local();
        auto got = m->lin->named_parameters()[name].grad();
        ASSERT_TRUE(got.defined()) << name;
        EXPECT_TRUE(torch::allclose(got, expect, 1e-5, 1e-5)) << name << " on rank " << pg->rank();
      }
    });
  }
}

TEST(RegressionsMultiUse, EveryShapeTwoAndThreeRanks) {
  for (int ws : {2, 3}) {
    check_shapes(ws, {ReshardAfterForward(true)});
    check_shapes(ws, {ReshardAfterForward(false)});
  }
}
TEST(RegressionsMultiUse, EveryShapeReshardAfterForwardInt) {
  check_shapes(2, {ReshardAfterForward(1)});
  check_shapes(4, {ReshardAfterForward(2)});
}
TEST(RegressionsMultiUse, EveryShapeWithActivationCheckpointing) {
  for (int ws : {2, 3}) {
    check_shapes(ws, {ReshardAfterForward(true), true});
    check_shapes(ws, {ReshardAfterForward(false), true});
  }
  check_shapes(4, {ReshardAfterForward(2), true});
}
TEST(RegressionsMultiUse, EveryShapeWithBf16MixedPrecision) {
  for (int ws : {2, 3}) {
    check_shapes(ws, {ReshardAfterForward(true), false, true});
    check_shapes(ws, {ReshardAfterForward(false), true, true});
  }
}

// fsdp::checkpoint around two calls of a block in one region (the functional form; the block's
// calls are recomputed inside the region's backward, a nested backward).
struct CkptRegionImpl : torch::nn::Module {
  FSDPModule<SmallBlock> blk{nullptr};
  torch::nn::Linear head{nullptr};
  CkptRegionImpl() {
    blk = register_module("blk", SmallBlock());
    head = register_module("head", torch::nn::Linear(kD, 2));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto* b = &blk;  // (a pointer: fsdp::checkpoint calls its function as const)
    auto y = fsdp::checkpoint([b](torch::Tensor t) { return (*b)((*b)(t)); }, x);
    return head(y);
  }
};
TORCH_MODULE(CkptRegion);

TEST(RegressionsMultiUse, BlockTwiceInsideFunctionalCheckpoint) {
  torch::manual_seed(5);
  CkptRegion ref;
  auto w = snapshot(*ref);
  auto x = torch::randn({6, kD});
  ref->forward(x).pow(2).mean().backward();
  for (int ws : {2, 3}) {
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      FSDPModule<CkptRegion> m;
      load_full(*m.ptr(), w);
      auto mesh = init_device_mesh(torch::kCPU, {ws});
      fully_shard(m->blk, FullyShardOptions().mesh(mesh));
      fully_shard(m, FullyShardOptions().mesh(mesh));
      const int64_t local = 6 / ws;
      for (int it = 0; it < 2; ++it) {
        for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
        m(x.narrow(0, pg->rank() * local, local)).pow(2).mean().backward();
        for (const auto& p : m->named_parameters()) {
          auto expect = distribute_tensor(ref->named_parameters()[p.key()].grad(), mesh, {Shard(0)}).to_local();
          ASSERT_TRUE(p.value().grad().defined()) << p.key();
          EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6)) << p.key() << " iteration " << it;
        }
      }
    });
  }
}

// Two root forwards before one backward (a loss summed over two batches): each group is reduced once in
// that backward (issue 28 item 6, "several forwards before one backward"), on inputs with and without
// grad, for both reshard_after_forward values, and the gradients match the same two forwards unsharded.
struct TwoForwardsImpl : torch::nn::Module {
  FSDPModule<SmallBlock> blk{nullptr};
  torch::nn::Linear head{nullptr};
  TwoForwardsImpl() {
    blk = register_module("blk", SmallBlock());
    head = register_module("head", torch::nn::Linear(kD, 2));
  }
  torch::Tensor forward(torch::Tensor x) { return head(blk(x)); }
};
TORCH_MODULE(TwoForwards);

TEST(RegressionsMultiUse, TwoForwardsBeforeOneBackwardReduceEachGroupOnce) {
  torch::manual_seed(9);
  TwoForwards ref;
  auto w = snapshot(*ref);
  auto x1 = torch::randn({6, kD}), x2 = torch::randn({6, kD});
  (ref->forward(x1).pow(2).mean() + ref->forward(x2).pow(3).mean()).backward();
  for (int ws : {2, 3}) {
    for (bool reshard : {true, false}) {
      for (bool input_grad : {true, false}) {
        run_ranks(ws, [&](ProcessGroupPtr pg) {
          FSDPModule<TwoForwards> m;
          load_full(*m.ptr(), w);
          auto mesh = init_device_mesh(torch::kCPU, {ws});
          fully_shard(m->blk, FullyShardOptions().mesh(mesh).reshard_after_forward(reshard));
          fully_shard(m, FullyShardOptions().mesh(mesh).reshard_after_forward(reshard));
          const int64_t local = 6 / ws;
          for (int it = 0; it < 2; ++it) {
            for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
            auto a = x1.narrow(0, pg->rank() * local, local).clone().requires_grad_(input_grad);
            auto b = x2.narrow(0, pg->rank() * local, local).clone().requires_grad_(input_grad);
            auto l1 = m(a).pow(2).mean();
            auto l2 = m(b).pow(3).mean();
            const auto rs0 = pg->collective_count("reduce_scatter_tensor");
            (l1 + l2).backward();
            EXPECT_EQ(pg->collective_count("reduce_scatter_tensor") - rs0, 2u)
                << "ws " << ws << " reshard " << reshard << " input_grad " << input_grad << " iteration " << it;
            for (const auto& p : m->named_parameters()) {
              auto expect = distribute_tensor(ref->named_parameters()[p.key()].grad(), mesh, {Shard(0)}).to_local();
              ASSERT_TRUE(p.value().grad().defined()) << p.key();
              EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6))
                  << p.key() << " ws " << ws << " reshard " << reshard << " input_grad " << input_grad;
            }
          }
        });
      }
    }
  }
}

}  // namespace
}  // namespace fsdp::testing::shapes_net

namespace fsdp::testing::unchanged_harness {
namespace {

// ---- A module called twice in one forward ------------------------------------------------------------

TEST_P(Unchanged, BlockCalledTwiceMatchesReferenceAndHolderPath) {
  Knobs k;
  k.calls_per_block = 2;
  auto [plain, holder] = plain_vs_holder(GetParam(), k, "blocks called twice");
  auto ref = reference_run([k] { return make_plain(k); }, make_batches(kSteps3, kBatch, kSeq));
  expect_parity(plain, ref, "blocks called twice");
}

}  // namespace
}  // namespace fsdp::testing::unchanged_harness
