// Regressions of issue 17 for fully_shard's forward/backward hooks (CTest labels: fully_shard, regressions).
//
// - RegressionsMultiUse: a group's post-backward runs exactly once per backward, after every use of its
//   parameters produced its gradient, whatever the inputs of each call require (item 1).
// - RegressionsBypass: a forward that bypasses FSDP raises on every rank, naming the module (item 7).
// - RegressionsRetainGraph: a second backward over the same forward accumulates (item 8).
// - RegressionsApi: FSDPModule from register_module, FQN + type in errors, sharded_parameters names,
//   sharded gradients as DTensors, recovery from an exception inside backward (item 6).
//
// Gradients are compared with a single-process reference on the same global batch: each rank's loss
// is the mean over its slice, so the reference gradient is the mean over ranks (FSDP divides by ws).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "fsdp/fsdp_state.h"
#include "fsdp_test_model.h"
#include "trains_like_unsharded.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

// fp32: the sharded run sums in another order than the reference. bf16: both sides compute in bf16
// with the same casts per rank slice; the remaining difference is the order of the fp32 reduction
// and bf16 rounding of intermediate results that depend on it.
constexpr double kRtol = 1e-5, kAtol = 1e-6;
constexpr double kBf16Rtol = 2e-2, kBf16Atol = 2e-3;

// ---- A model with every shape of item 1 ------------------------------------------------------------
// dims 5 and 7: not divisible by 2, 3 or 4 (uneven and empty shards).
constexpr int64_t kV = 7, kD = 5;

struct SmallBlockImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  SmallBlockImpl() {
    fc = register_module("fc", torch::nn::Linear(kD, kD));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})));
  }
  torch::Tensor forward(torch::Tensor x) { return x + torch::tanh(fc(norm(x))); }
};
TORCH_MODULE(SmallBlock);

// The output projection tied to the embedding's weight (GPT-style), sharded with it as one group.
struct TiedOutImpl : torch::nn::Module {
  torch::Tensor weight;
  explicit TiedOutImpl(torch::Tensor w) { weight = register_parameter("weight", std::move(w)); }
  torch::Tensor forward(torch::Tensor x) { return torch::matmul(x, weight.t()); }
};
TORCH_MODULE(TiedOut);

struct ShapesNetImpl : torch::nn::Module {
  FSDPModule<torch::nn::Embedding> emb{nullptr};  // token ids: no input requires grad
  FSDPModule<TiedOut> out{nullptr};               // shares emb.weight: fully_shard({emb, out})
  FSDPModule<SmallBlock> blk{nullptr};            // called twice on inputs that require grad
  FSDPModule<torch::nn::Linear> lin{nullptr};     // issue 17 item 1: lin(tanh(lin(x))), x without grad
  FSDPModule<torch::nn::Linear> side{nullptr};    // its output feeds only a frozen module
  FSDPModule<torch::nn::Linear> frozen{nullptr};  // requires_grad false
  FSDPModule<torch::nn::Linear> unused{nullptr};  // its output is detached: gets no gradient
  torch::Tensor scale;                            // the root's own parameter
  ShapesNetImpl() {
    emb = register_module("emb", torch::nn::Embedding(kV, kD));
    out = register_module("out", TiedOut(emb->weight));
    blk = register_module("blk", SmallBlock());
    lin = register_module("lin", torch::nn::Linear(kD, kD));
    side = register_module("side", torch::nn::Linear(kD, kD));
    frozen = register_module("frozen", torch::nn::Linear(kD, kD));
    unused = register_module("unused", torch::nn::Linear(kD, kD));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
    scale = register_parameter("scale", torch::ones({kD}));
  }
  torch::Tensor forward(torch::Tensor ids, torch::Tensor xf) {
    auto h = emb(ids);
    h = blk(torch::tanh(blk(h)));
    auto a = lin(torch::tanh(lin(xf)));
    auto s = frozen(side(xf));
    auto u = unused(xf).detach();
    return out((h + a + s + 0 * u) * scale);
  }
};
TORCH_MODULE(ShapesNet);

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

// ---- Item 8: a second backward over the same forward --------------------------------------------------
void check_retain_graph(int ws, ReshardAfterForward raf) {
  constexpr int64_t kBatch = 12, kSeq = 3;
  auto batch = make_batches(1, kBatch, kSeq, 8)[0];
  torch::manual_seed(7);
  Net ref;
  auto w = snapshot(*ref);
  {
    auto loss = loss_fn(ref->forward(batch.idx), batch.targets);
    loss.backward({}, /*retain_graph=*/true);
    loss.backward();
  }
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    Net net;
    load_full(*net, w);
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh).reshard_after_forward(raf));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    FSDPModule<Net> model(net);
    auto b = batch.slice(pg->rank() * (kBatch / ws), kBatch / ws);
    auto loss = loss_fn(model(b.idx), b.targets);
    loss.backward({}, /*retain_graph=*/true);
    loss.backward();
    for (const auto& p : net->named_parameters()) {
      auto expect = distribute_tensor(ref->named_parameters()[p.key()].grad(), mesh, {Shard(0)}).to_local();
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      ASSERT_EQ(p.value().sizes(), expect.sizes()) << p.key() << " resharded after the second backward";
      EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6)) << p.key() << " on rank " << pg->rank();
    }
  });
}

TEST(RegressionsRetainGraph, SecondBackwardAccumulatesReshardTrue) {
  check_retain_graph(2, ReshardAfterForward(true));
  check_retain_graph(3, ReshardAfterForward(true));
}
TEST(RegressionsRetainGraph, SecondBackwardAccumulatesReshardFalse) {
  check_retain_graph(2, ReshardAfterForward(false));
  check_retain_graph(3, ReshardAfterForward(false));
}
TEST(RegressionsRetainGraph, SecondBackwardAccumulatesReshardInt) { check_retain_graph(4, ReshardAfterForward(2)); }

// ---- Item 7: forwards that bypass FSDP ------------------------------------------------------------------
// Every rank must raise a c10::Error naming the module and the supported calls.
// `param_prefix`: the start of the parameter's quoted FQN (whichever of weight/bias gets its gradient first).
void expect_bypass_error(const std::vector<std::string>& errors, const std::string& module_text,
                         const std::string& param_prefix) {
  for (size_t r = 0; r < errors.size(); ++r) {
    const auto& e = errors[r];
    EXPECT_NE(e.find("outside the module's FSDP forward"), std::string::npos) << "rank " << r << ": " << e;
    EXPECT_NE(e.find(module_text), std::string::npos) << "rank " << r << ": " << e;
    EXPECT_TRUE(e.find("parameter '" + param_prefix + "weight'") != std::string::npos ||
                e.find("parameter '" + param_prefix + "bias'") != std::string::npos)
        << "rank " << r << ": " << e;
    EXPECT_NE(e.find("fsdp::FSDPModule<Holder>"), std::string::npos) << "rank " << r << ": " << e;
    EXPECT_NE(e.find("fsdp::fsdp_forward"), std::string::npos) << "rank " << r << ": " << e;
  }
}

// Issue 17 item 7 as filed: a sharded child of torch::nn::Sequential, which calls it directly. Since
// issue 13 the child is an implicit group (see [Note: implicit groups]) and trains like one process.
TEST(RegressionsBypass, SequentialChildCalledByTheContainer) {
  const auto x = torch::randn({4, 8}, at::make_generator<at::CPUGeneratorImpl>(3));
  for (int ws : {1, 2, 3}) {
    expect_trains_like_unsharded<FSDPModule<torch::nn::Sequential>>(
        ws, [] { return FSDPModule<torch::nn::Sequential>(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4)); },
        [](auto& m, const DeviceMeshPtr& mesh) {
          fully_shard(m->ptr(2), FullyShardOptions().mesh(mesh));
          fully_shard(m, FullyShardOptions().mesh(mesh));
          EXPECT_TRUE(detail::state_of(*m->ptr(2))->implicit);
        },
        [](auto& m, const torch::Tensor& in) { return m(in).pow(2).sum(); }, x);
  }
}

// The root called through ->forward (the Impl directly), on its first forward and after a normal one.
TEST(RegressionsBypass, RootCalledThroughArrowForward) {
  for (int ws : {1, 2}) {
    for (bool after_normal_step : {false, true}) {
      auto errors = run_ranks_collect(ws, [&](ProcessGroupPtr pg) {
        FSDPModule<torch::nn::Linear> m(8, 4);
        fully_shard(m, FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {ws})));
        auto x = torch::randn({4, 8});
        if (after_normal_step) m(x).pow(2).sum().backward();
        m->forward(x).pow(2).sum().backward();
      });
      expect_bypass_error(errors, after_normal_step ? "the root (torch::nn::LinearImpl)"
                                                    : "the module passed to fully_shard (torch::nn::LinearImpl)",
                          "");
    }
  }
}

// A module reached through as<>() and called directly, inside a root that goes through FSDP.
struct AsImpl : torch::nn::Module {
  torch::nn::ModuleList list;
  AsImpl() {
    list = register_module("list", torch::nn::ModuleList());
    list->push_back(torch::nn::Linear(8, 6));
    list->push_back(torch::nn::Linear(6, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    return list[1]->as<torch::nn::Linear>()->forward(torch::relu(list[0]->as<torch::nn::Linear>()->forward(x)));
  }
};
TORCH_MODULE(As);

TEST(RegressionsBypass, ModuleReachedThroughAs) {
  const auto x = torch::randn({4, 8}, at::make_generator<at::CPUGeneratorImpl>(3));
  for (int ws : {1, 2, 3}) {
    expect_trains_like_unsharded<FSDPModule<As>>(
        ws, [] { return FSDPModule<As>(); },
        [](auto& m, const DeviceMeshPtr& mesh) {
          fully_shard(m->list[1], FullyShardOptions().mesh(mesh));
          fully_shard(m, FullyShardOptions().mesh(mesh));
        },
        [](auto& m, const torch::Tensor& in) { return m(in).pow(2).sum(); }, x);
  }
}

// A module of a group of several modules (fully_shard({a, b})) called directly: the message names
// its parameter by its real path ('b.weight', not a made-up 'a.1.weight').
struct PairImpl : torch::nn::Module {
  FSDPModule<torch::nn::Linear> a{nullptr};
  torch::nn::Linear b{nullptr};  // NOT through FSDP
  PairImpl() {
    a = register_module("a", torch::nn::Linear(8, 6));
    b = register_module("b", torch::nn::Linear(6, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return b(a(x)); }
};
TORCH_MODULE(Pair);

TEST(RegressionsBypass, ModuleOfAMultiModuleGroupNamedByItsPath) {
  for (int ws : {1, 2}) {
    auto errors = run_ranks_collect(ws, [&](ProcessGroupPtr pg) {
      FSDPModule<Pair> m;
      auto mesh = init_device_mesh(torch::kCPU, {ws});
      fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{m->a.ptr(), m->b.ptr()}, FullyShardOptions().mesh(mesh));
      fully_shard(m, FullyShardOptions().mesh(mesh));
      m(torch::randn({4, 8})).pow(2).sum().backward();
    });
    expect_bypass_error(errors, "'b' (torch::nn::LinearImpl", "b.");
    for (const auto& e : errors) EXPECT_EQ(e.find("a.1."), std::string::npos) << e;
  }
}

// ---- Item 6: API --------------------------------------------------------------------------------------
// `b = register_module("b", Block(...))` assigns an FSDPModule<Block> (the LibTorch idiom).
struct RegisteredImpl : torch::nn::Module {
  FSDPModule<SmallBlock> b{nullptr};
  RegisteredImpl() { b = register_module("b", SmallBlock()); }
  torch::Tensor forward(torch::Tensor x) { return b(x); }
};
TORCH_MODULE(Registered);

TEST(RegressionsApi, FSDPModuleAssignableFromRegisterModule) {
  torch::manual_seed(9);
  Registered ref;
  auto w = snapshot(*ref);
  auto x = torch::randn({4, kD});
  ref->forward(x).pow(2).sum().backward();
  run_ranks(2, [&](ProcessGroupPtr pg) {
    FSDPModule<Registered> m;
    load_full(*m.ptr(), w);
    auto mesh = init_device_mesh(torch::kCPU, {2});
    fully_shard(m->b, FullyShardOptions().mesh(mesh));
    fully_shard(m, FullyShardOptions().mesh(mesh));
    (m(x.narrow(0, pg->rank() * 2, 2)).pow(2).sum() * 2).backward();
    for (const auto& p : m->named_parameters()) {
      auto expect = distribute_tensor(ref->named_parameters()[p.key()].grad(), mesh, {Shard(0)}).to_local();
      EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-5)) << p.key();
    }
  });
}

// Tied parameters in separate groups: the error names the other module by path and type.
TEST(RegressionsApi, TiedErrorNamesModuleByPathAndType) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    ShapesNet net;
    auto mesh = init_device_mesh(torch::kCPU, {2});
    fully_shard(net->emb, FullyShardOptions().mesh(mesh));
    try {
      fully_shard(net, FullyShardOptions().mesh(mesh));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("'out.weight'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("'emb.weight' of 'emb' (torch::nn::EmbeddingImpl)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("fully_shard({module_a, module_b})"), std::string::npos) << msg;
    }
  });
}

// A child's forward before the root's: the error names the child by its path and type (it used to
// call the child "the root").
TEST(RegressionsApi, ChildBeforeRootErrorNamesPathAndType) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Net net;
    auto mesh = init_device_mesh(torch::kCPU, {2});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    net->blocks[1](torch::randn({2, kDim}));
    FSDPModule<Net> model(net);
    try {
      model(torch::zeros({2, 3}, torch::kLong));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("'blocks.1' (fsdp::testing::BlockImpl) ran forward before the root"), std::string::npos) << msg;
    }
  });
}

// sharded_parameters(): names relative to the module fully_shard was called on, before and after
// the first forward.
TEST(RegressionsApi, ShardedParameterNamesStayModuleRelative) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Net net;
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto api = fully_shard(net->blocks[1], FullyShardOptions().mesh(mesh));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    auto names = [&] {
      std::vector<std::string> out;
      for (const auto& [n, dt] : api.sharded_parameters()) out.push_back(n);
      std::sort(out.begin(), out.end());
      return out;
    };
    const std::vector<std::string> expect{"fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight",
                                          "norm.bias", "norm.weight", "scale"};
    EXPECT_EQ(names(), expect) << "before the first forward";
    FSDPModule<Net> model(net);
    auto b = make_batches(1, 4, 3)[0];
    loss_fn(model(b.idx), b.targets).backward();
    EXPECT_EQ(names(), expect) << "after the first forward";
  });
}

// Sharded gradients as DTensors: their full tensors are the reference gradients.
TEST(RegressionsApi, ShardedGradientsAsDTensors) {
  auto batch = make_batches(1, 12, 3, 21)[0];
  torch::manual_seed(4);
  Net ref;
  auto w = snapshot(*ref);
  loss_fn(ref->forward(batch.idx), batch.targets).backward();
  for (int ws : {2, 3}) {
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      Net net;
      load_full(*net, w);
      auto mesh = init_device_mesh(torch::kCPU, {ws});
      for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
      auto root_api = fully_shard(net, FullyShardOptions().mesh(mesh));
      FSDPModule<Net> model(net);
      EXPECT_TRUE(root_api.sharded_gradients().empty()) << "no gradient yet";
      EXPECT_FALSE(sharded_grad(net->head->weight).has_value());
      auto b = batch.slice(pg->rank() * (12 / ws), 12 / ws);
      loss_fn(model(b.idx), b.targets).backward();
      size_t n = 0;
      for (const auto& [name, dt] : root_api.sharded_gradients()) {
        EXPECT_EQ(dt.sizes(), ref->named_parameters()[name].sizes().vec()) << name;
        EXPECT_TRUE(torch::allclose(dt.full_tensor(), ref->named_parameters()[name].grad(), 1e-5, 1e-6)) << name;
        ++n;
      }
      EXPECT_EQ(n, 3u) << "wte.weight, head.weight, head.bias";
      auto g = sharded_grad(net->blocks[0]->fc1->weight);
      ASSERT_TRUE(g.has_value());
      EXPECT_TRUE(g->to_local().is_same(net->blocks[0]->fc1->weight.grad())) << "aliases the local gradient";
      EXPECT_TRUE(torch::allclose(g->full_tensor(), ref->blocks[0]->fc1->weight.grad(), 1e-5, 1e-6));
      EXPECT_THROW(sharded_grad(torch::zeros({3})), c10::Error);
    });
  }
}

// An exception thrown inside backward (a user hook) leaves the model trainable: after zero_grad, the
// next forward/backward gives the reference gradients, on every reshard setting, whether the hook
// throws before any reduce-scatter or after some were issued.
void check_recovery(int ws, ReshardAfterForward raf, bool throw_late) {
  auto batch = make_batches(1, 12, 3, 31)[0];
  torch::manual_seed(6);
  Net ref;
  auto w = snapshot(*ref);
  loss_fn(ref->forward(batch.idx), batch.targets).backward();
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    Net net;
    load_full(*net, w);
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh).reshard_after_forward(raf));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    FSDPModule<Net> model(net);
    torch::optim::SGD opt(net->parameters(), 0.1);
    auto b = batch.slice(pg->rank() * (12 / ws), 12 / ws);
    // A first, normal step leaves sharded gradients that the failed backward must not corrupt.
    loss_fn(model(b.idx), b.targets).backward();
    opt.zero_grad();
    bool armed = true;
    auto hook_target = throw_late ? net->blocks[0]->fc1->weight : torch::Tensor();
    if (throw_late) {
      // Runs mid-backward, after blocks.1's post-backward issued its reduce-scatter.
      hook_target.register_hook([&armed](const torch::Tensor&) {
        if (armed) throw std::runtime_error("user hook failed");
      });
    }
    auto out = model(b.idx);
    if (!throw_late) {
      out.register_hook([&armed](const torch::Tensor&) {
        if (armed) throw std::runtime_error("user hook failed");
      });
    }
    EXPECT_THROW(loss_fn(out, b.targets).backward(), std::exception);
    armed = false;
    opt.zero_grad();
    for (int it = 0; it < 2; ++it) {
      loss_fn(model(b.idx), b.targets).backward();
      for (const auto& p : net->named_parameters()) {
        auto expect = distribute_tensor(ref->named_parameters()[p.key()].grad(), mesh, {Shard(0)}).to_local();
        ASSERT_TRUE(p.value().grad().defined()) << p.key();
        ASSERT_EQ(p.value().grad().sizes(), expect.sizes()) << p.key();
        EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6))
            << p.key() << " on rank " << pg->rank() << " iteration " << it;
      }
      opt.zero_grad();
    }
  });
}

TEST(RegressionsApi, TrainableAfterExceptionInsideBackward) {
  for (bool late : {false, true}) {
    check_recovery(2, ReshardAfterForward(true), late);
    check_recovery(2, ReshardAfterForward(false), late);
    check_recovery(3, ReshardAfterForward(true), late);
  }
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing {
namespace {
// The root's forward graph check (bypass detection before backward) costs one visit per autograd
// node. Measured against the forward itself on a 24-block model; it must find nothing to report.
TEST(RegressionsBypass, ForwardGraphCheckIsCheapAndQuiet) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Net net(/*n_blocks=*/24);
    auto mesh = init_device_mesh(torch::kCPU, {2});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    auto api = fully_shard(net, FullyShardOptions().mesh(mesh));
    FSDPModule<Net> model(net);
    auto b = make_batches(1, 8, 16)[0];
    constexpr int kIters = 20;
    double fwd = 0, check = 0;
    for (int i = 0; i < kIters; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      auto out = model(b.idx);
      auto t1 = std::chrono::steady_clock::now();
      detail::fsdp_state(api).check_forward_graph({out});  // what the root's post-forward ran inside `fwd`
      auto t2 = std::chrono::steady_clock::now();
      fwd += std::chrono::duration<double, std::micro>(t1 - t0).count();
      check += std::chrono::duration<double, std::micro>(t2 - t1).count();
      loss_fn(out, b.targets).backward();
    }
    if (pg->rank() == 0) {
      std::printf("[bypass check] 24 blocks, 2 ranks: forward %.0f us (including the check), check %.0f us (%.1f%%)\n",
                  fwd / kIters, check / kIters, 100.0 * check / fwd);
    }
    EXPECT_LT(check, fwd) << "the check must cost less than the forward it guards";
  });
}
}  // namespace
}  // namespace fsdp::testing
