// Boundary styles (src/tensor/parallel/prepare_module.cpp; CTest label: tensor_parallel): PrepareModuleInput,
// PrepareModuleOutput and PrepareModuleInputOutput through fsdp::FSDPModule holders and torch::nn::Sequential entries,
// SequenceParallel on a user's RMSNorm, user-defined styles. Each plan trains like the same model in one process
// (losses, every gradient, parameters after AdamW steps; fp32, rtol 1e-5) on TP 2 and 3, with sequences that do not
// divide by the TP size and empty shards where the layouts allow them; bad plans throw the same message on every
// rank before anything changes.
#include <gtest/gtest.h>

#include <mutex>

#include "fsdp/fsdp.h"
#include "fsdp/tensor/parallel/style.h"
#include "multi_rank.h"
#include "tensor/parallel/tp_ops.h"

namespace fsdp::testing::parallel_styles {
namespace {

constexpr int64_t kVocab = 6, kDim = 6, kHidden = 6;

// A user's RMSNorm (LibTorch has none): x * rsqrt(mean(x^2, -1) + eps) * weight.
struct RMSNormImpl : torch::nn::Module {
  explicit RMSNormImpl(int64_t d) : weight(register_parameter("weight", torch::ones({d}))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + 1e-5) * weight;
  }
  torch::Tensor weight;
};
TORCH_MODULE(RMSNorm);

struct MLPImpl : torch::nn::Module {
  MLPImpl() : fc1(register_module("fc1", torch::nn::Linear(kDim, kHidden))),
              fc2(register_module("fc2", torch::nn::Linear(kHidden, kDim))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(MLP);

// Holder model: the MLP of each block and the blocks are called through fsdp::FSDPModule holders (no fully_shard).
struct HBlockImpl : torch::nn::Module {
  HBlockImpl() : norm(register_module("norm", RMSNorm(kDim))) { mlp = register_module("mlp", MLP()); }
  torch::Tensor forward(torch::Tensor x) { return x + mlp(norm(x)); }  // the residual add sees the block's input
  RMSNorm norm;
  fsdp::FSDPModule<MLP> mlp{nullptr};
};
TORCH_MODULE(HBlock);

void init_weights(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  int i = 0;
  for (auto& p : m.parameters()) p.copy_(torch::sin(torch::arange(p.numel(), torch::kFloat32) * 0.7 + i++).view_as(p) * 0.5 + (p.dim() == 1 ? 1.0 : 0.0));
}

struct HNetImpl : torch::nn::Module {
  HNetImpl() {
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    h = register_module("h", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) {
      blocks.push_back(HBlock());
      h->push_back(blocks.back());
    }
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
    init_weights(*this);
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    auto x = emb(ids);
    for (auto& b : blocks) x = b(x);
    return head(ln(x));
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::ModuleList h;
  std::vector<fsdp::FSDPModule<HBlock>> blocks;
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(HNet);

// Sequential model: plain LibTorch modules, the blocks entries of a torch::nn::Sequential.
struct SBlockImpl : torch::nn::Module {
  SBlockImpl() : norm(register_module("norm", RMSNorm(kDim))), mlp(register_module("mlp", MLP())) {}
  torch::Tensor forward(torch::Tensor x) { return x + mlp(norm(x)); }
  RMSNorm norm;
  MLP mlp;
};
TORCH_MODULE(SBlock);

struct SNetImpl : torch::nn::Module {
  SNetImpl() {
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    blocks = register_module("blocks", torch::nn::Sequential(SBlock(), SBlock()));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
    init_weights(*this);
  }
  torch::Tensor forward(const torch::Tensor& ids) { return head(ln(blocks->forward(emb(ids)))); }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Sequential blocks{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(SNet);

// torchtitan's recipe: the embedding's output and the norms sequence-sharded, each MLP's input all-gathered by
// PrepareModuleInput, its output reduce-scattered by fc2, the head's input all-gathered. Sequences divide by tp.
tp::ParallelizePlan titan_plan() {
  return {{"emb", tp::RowwiseParallel().output_layouts(Shard(1))},
          {"h.*.norm", tp::SequenceParallel()},
          {"h.*.mlp", tp::PrepareModuleInput().input_layouts({Shard(1)}).desired_input_layouts({Replicate()})},
          {"h.*.mlp.fc1", tp::ColwiseParallel()},
          {"h.*.mlp.fc2", tp::RowwiseParallel().output_layouts(Shard(1))},
          {"ln", tp::SequenceParallel()},
          {"head", tp::ColwiseParallel().input_layouts(Shard(1)).output_layouts(Replicate())}};
}

// Every move through boundaries only (uneven sequences and empty shards allowed): the first block's input split,
// each MLP's input gathered and its output split again, the last block's output gathered.
tp::ParallelizePlan uneven_plan() {
  return {{"h.0", tp::PrepareModuleInput().input_layouts({Replicate()}).desired_input_layouts({Shard(1)})},
          {"h.*.norm", tp::SequenceParallel()},
          {"h.*.mlp", tp::PrepareModuleInputOutput()
                          .input_layouts({Shard(1)}).desired_input_layouts({Replicate()})
                          .output_layouts({Replicate()}).desired_output_layouts({Shard(1)})},
          {"h.*.mlp.fc1", tp::ColwiseParallel()},
          {"h.*.mlp.fc2", tp::RowwiseParallel()},
          {"h.1", tp::PrepareModuleOutput().output_layouts({Shard(1)}).desired_output_layouts({Replicate()})}};
}

// Sequential entries as boundaries: the sequence split at the first block, gathered after the last.
tp::ParallelizePlan sequential_plan() {
  return {{"blocks.0", tp::PrepareModuleInput().input_layouts({Replicate()}).desired_input_layouts({Shard(1)})},
          {"blocks.*.norm", tp::SequenceParallel()},
          {"blocks.*.mlp.fc1", tp::ColwiseParallel().input_layouts(Shard(1))},
          {"blocks.*.mlp.fc2", tp::RowwiseParallel().output_layouts(Shard(1))},
          {"blocks.1", tp::PrepareModuleOutput().output_layouts({Shard(1)}).desired_output_layouts({Replicate()})}};
}

std::mutex report_mu;
double max_diff = 0;  // over every comparison of a test: reported

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double d = got.numel() ? (got - want).abs().max().item<double>() : 0.0;
  {
    std::lock_guard<std::mutex> lock(report_mu);
    max_diff = std::max(max_diff, d);
  }
  EXPECT_TRUE(torch::allclose(got, want, /*rtol=*/1e-5, /*atol=*/1e-6)) << what << ": max abs diff " << d;
}

torch::Tensor local_piece(const torch::Tensor& p, const torch::Tensor& ref) {
  if (p.sizes() == ref.sizes()) return ref;  // replicated
  auto dt = tp::tp_param_dtensor(p);
  const int64_t dim = dt.placements()[0].dim;
  const int64_t c = p.size(dim);
  return ref.narrow(dim, dt.device_mesh()->get_local_rank(0) * c, c);
}

template <typename Net>
void train_and_compare(int tp_size, const tp::ParallelizePlan& plan, int64_t seq, int steps = 3) {
  max_diff = 0;
  run_ranks(tp_size, [&](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {tp_size}, {"tp"});
    Net ref, model;
    tp::parallelize_module(model, mesh, plan);
    torch::optim::AdamW opt_ref(ref->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
    auto ref_params = ref->named_parameters();
    auto params = model->named_parameters();
    for (int step = 0; step < steps; ++step) {
      auto ids = (torch::arange(3 * seq, torch::kInt64) * 5 + step).remainder(kVocab).view({3, seq});
      auto targets = (ids * 5 + 1).remainder(kVocab).view({-1});
      auto loss_ref = torch::cross_entropy_loss(ref(ids).view({-1, kVocab}), targets);
      auto loss = torch::cross_entropy_loss(model(ids).view({-1, kVocab}), targets);
      expect_close(loss, loss_ref, "loss at step " + std::to_string(step));
      loss_ref.backward();
      loss.backward();
      for (const auto& item : ref_params) {
        const auto& p = params[item.key()];
        ASSERT_TRUE(p.grad().defined()) << item.key();
        expect_close(p.grad(), local_piece(p, item.value().grad()),
                     "grad of " + item.key() + " at step " + std::to_string(step));
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
  });
  std::cout << "max abs diff against one process: " << max_diff << "\n";
}

TEST(ParallelStyles, TorchtitanRecipeThroughHoldersTp2) { train_and_compare<HNet>(2, titan_plan(), 4); }
TEST(ParallelStyles, TorchtitanRecipeThroughHoldersTp3) { train_and_compare<HNet>(3, titan_plan(), 6); }
TEST(ParallelStyles, UnevenSequenceThroughHoldersTp2) { train_and_compare<HNet>(2, uneven_plan(), 5); }
TEST(ParallelStyles, UnevenSequenceThroughHoldersTp3) { train_and_compare<HNet>(3, uneven_plan(), 7); }
TEST(ParallelStyles, EmptyShardThroughHoldersTp3) { train_and_compare<HNet>(3, uneven_plan(), 2); }
TEST(ParallelStyles, SequentialEntriesTp2) { train_and_compare<SNet>(2, sequential_plan(), 4); }
TEST(ParallelStyles, SequentialEntriesTp3) { train_and_compare<SNet>(3, sequential_plan(), 6); }

// The moves on their own, forward and backward, against the global tensor (uneven: 5 rows on 2 and 3 ranks).
TEST(ParallelStyles, RedistributeLocalMovesAndGradients) {
  for (int world : {2, 3}) {
    run_ranks(world, [world](ProcessGroupPtr pg) {
      auto mesh = init_device_mesh(torch::kCPU, {world});
      const int r = pg->rank();
      auto full = torch::arange(5 * 4, torch::kFloat32).view({5, 4});
      auto w = torch::cos(torch::arange(5 * 4, torch::kFloat32)).view({5, 4});
      auto rows = [&](const torch::Tensor& t, int64_t dim) {
        auto c = chunk_range(t.size(dim), world, r);
        return t.narrow(dim, c.offset, c.length);
      };
      // Replicate -> Shard(0): the rank's rows; the gradient of the replicated input is the full one.
      auto x = full.clone().requires_grad_(true);
      auto s = tp::redistribute_local(x, mesh, Replicate(), Shard(0));
      EXPECT_TRUE(torch::equal(s, rows(full, 0)));
      (s * rows(w, 0)).sum().backward();
      EXPECT_TRUE(torch::equal(x.grad(), w)) << x.grad();
      // Shard(0) -> Replicate (uneven rows gathered exactly); backward keeps the rank's rows.
      auto mine = rows(full, 0).clone().requires_grad_(true);
      auto g = tp::redistribute_local(mine, mesh, Shard(0), Replicate());
      EXPECT_TRUE(torch::equal(g, full));
      (g * w).sum().backward();
      EXPECT_TRUE(torch::equal(mine.grad(), rows(w, 0)));
      // Shard(0) -> Shard(1).
      auto t = tp::redistribute_local(rows(full, 0).contiguous(), mesh, Shard(0), Shard(1));
      EXPECT_TRUE(torch::equal(t, rows(full, 1)));
      // Partial -> Replicate and Partial -> Shard(-1): the sum over ranks; the gradient reaches each summand.
      auto part = (full * (r + 1)).requires_grad_(true);
      auto sum = tp::redistribute_local(part, mesh, Partial(), Replicate());
      const double k = world * (world + 1) / 2.0;
      EXPECT_TRUE(torch::allclose(sum, full * k));
      (sum * w).sum().backward();
      EXPECT_TRUE(torch::equal(part.grad(), w));
      auto ps = tp::redistribute_local(full * (r + 1), mesh, Partial(), Shard(-1));
      EXPECT_TRUE(torch::allclose(ps, rows(full * k, 1)));
      EXPECT_THROW(tp::redistribute_local(full, mesh, Replicate(), Partial()), c10::Error);
      EXPECT_THROW(tp::redistribute_local(full, mesh, Replicate(), Shard(2)), c10::Error);
    });
  }
}

// A user-defined style: its validate runs before any change, its _apply registers boundary hooks and parallelises
// submodules with built-in styles (nested parallelize_module).
struct ScaleAndShard : tp::UserParallelStyle {
  mutable int validated = 0, applied = 0;
  bool reject = false;
  void validate(const std::string& fqn, const std::shared_ptr<torch::nn::Module>&, const DeviceMeshPtr&) const override {
    ++validated;
    TORCH_CHECK(!reject, "ScaleAndShard on '", fqn, "': rejected");
  }
  void _apply(const std::shared_ptr<torch::nn::Module>& module, const DeviceMeshPtr& mesh) const override {
    ++applied;
    tp::parallelize_module(module, mesh, {{"fc1", tp::ColwiseParallel()}, {"fc2", tp::RowwiseParallel()}});
    tp::register_forward_pre_hook(module, [](const std::vector<torch::Tensor>& in) {
      return std::vector<torch::Tensor>{in[0] * 2};
    });
    tp::register_forward_hook(module, [](const std::vector<torch::Tensor>& out) {
      return std::vector<torch::Tensor>{out[0] + 1};
    });
  }
  std::string str() const override { return "ScaleAndShard()"; }
};

TEST(ParallelStyles, UserDefinedStyle) {
  run_ranks(2, [](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    HNet ref, model;
    auto style = std::make_shared<ScaleAndShard>();
    tp::parallelize_module(model, mesh, {{"h.*.mlp", tp::user_style(style)}});
    EXPECT_EQ(style->validated, 2);
    EXPECT_EQ(style->applied, 2);
    EXPECT_EQ(model->blocks[0]->mlp->fc1->weight.size(0), kHidden / 2);
    auto x = torch::sin(torch::arange(2 * 3 * kDim, torch::kFloat32)).view({2, 3, kDim}).requires_grad_(true);
    auto x_ref = x.detach().clone().requires_grad_(true);
    auto y = model->blocks[0]->mlp(x);
    auto y_ref = ref->blocks[0]->mlp(x_ref * 2) + 1;
    expect_close(y, y_ref, "user style's output");
    y.pow(2).sum().backward();
    y_ref.pow(2).sum().backward();
    expect_close(x.grad(), x_ref.grad(), "user style's input gradient");
    // A style whose validate throws leaves the model untouched.
    HNet untouched;
    auto bad = std::make_shared<ScaleAndShard>();
    bad->reject = true;
    EXPECT_THROW(tp::parallelize_module(untouched, mesh, {{"h.0.mlp.fc1", tp::ColwiseParallel()},
                                                          {"h.*.mlp", tp::user_style(bad)}}),
                 c10::Error);
    EXPECT_EQ(untouched->blocks[0]->mlp->fc1->weight.size(0), kHidden);
    EXPECT_EQ(bad->applied, 0);
  });
}

// The message of the c10::Error `fn` throws on every rank, checked to be the same on all of them.
std::string same_error_on_every_rank(int world, const std::function<void(const DeviceMeshPtr&)>& fn) {
  std::mutex mu;
  std::vector<std::string> msgs;
  run_ranks(world, [&](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {world});
    try {
      fn(mesh);
      ADD_FAILURE() << "expected a c10::Error";
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mu);
      msgs.push_back(e.what_without_backtrace());
    }
  });
  EXPECT_EQ(msgs.size(), static_cast<size_t>(world));
  for (const auto& m : msgs) EXPECT_EQ(m, msgs.front());
  return msgs.empty() ? "" : msgs.front();
}

void expect_has(const std::string& msg, const std::string& part) {
  EXPECT_NE(msg.find(part), std::string::npos) << "message: " << msg << "\nexpected to contain: " << part;
}

// A module without a boundary (a ModuleList entry called directly; its input also feeds the residual add).
struct LBlockImpl : torch::nn::Module {
  LBlockImpl() : norm(register_module("norm", RMSNorm(kDim))), mlp(register_module("mlp", MLP())) {}
  torch::Tensor forward(torch::Tensor x) { return x + mlp(norm(x)); }
  RMSNorm norm;
  MLP mlp;
};
TORCH_MODULE(LBlock);
struct LNetImpl : torch::nn::Module {
  LNetImpl() : h(register_module("h", torch::nn::ModuleList(LBlock(), LBlock()))) {}
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& b : *h) x = b->as<LBlockImpl>()->forward(x);
    return x;
  }
  torch::nn::ModuleList h;
};
TORCH_MODULE(LNet);

TEST(ParallelStylesErrors, NoBoundaryNamesTheModuleAndTheFix) {
  auto msg = same_error_on_every_rank(2, [](const DeviceMeshPtr& mesh) {
    LNet model;
    try {
      tp::parallelize_module(model, mesh, {{"h.*.mlp.fc1", tp::ColwiseParallel()},
                                           {"h.0", tp::PrepareModuleInput().input_layouts({Replicate()})
                                                       .desired_input_layouts({Shard(1)})}});
    } catch (...) {
      EXPECT_EQ(model->h[0]->as<LBlockImpl>()->mlp->fc1->weight.size(0), kHidden);  // nothing changed
      throw;
    }
  });
  expect_has(msg, "PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(dim=1),)) on 'h.0'");
  expect_has(msg, "has no call boundary");
  expect_has(msg, "Fix: declare it as fsdp::FSDPModule<");
  expect_has(msg, "torch::nn::Sequential");
}

// A module with boundary styles called around its holder (its Impl's forward): its first TP op throws on every rank,
// before any collective, naming the module, the parameter and the fix.
TEST(ParallelStylesErrors, CallAroundTheHolderThrows) {
  auto msg = same_error_on_every_rank(2, [](const DeviceMeshPtr& mesh) {
    HNet model;
    tp::parallelize_module(model, mesh, titan_plan());
    auto x = torch::sin(torch::arange(2 * 4 * kDim, torch::kFloat32)).view({2, 4, kDim});
    model->blocks[0]->mlp->forward(x);
  });
  expect_has(msg, "'h.0.mlp' has boundary styles");
  expect_has(msg, "parameter 'h.0.mlp.fc1.weight' was used in a forward outside a call through its boundary");
  expect_has(msg, "Fix: call it through the holder");
}

TEST(ParallelStylesErrors, BadLayouts) {
  auto m1 = same_error_on_every_rank(2, [](const DeviceMeshPtr& mesh) {
    HNet model;
    tp::parallelize_module(model, mesh, {{"h.0", tp::PrepareModuleInput().input_layouts({Replicate(), Replicate()})
                                                     .desired_input_layouts({Shard(1)})}});
  });
  expect_has(m1, "have different lengths");
  auto m2 = same_error_on_every_rank(2, [](const DeviceMeshPtr& mesh) {
    HNet model;
    tp::parallelize_module(model, mesh, {{"h.0", tp::PrepareModuleOutput().output_layouts({Replicate()})
                                                     .desired_output_layouts({Partial()})}});
  });
  expect_has(m2, "a move from Replicate() to Partial(sum) is not supported");
  auto m3 = same_error_on_every_rank(2, [](const DeviceMeshPtr& mesh) {
    HNet model;
    tp::parallelize_module(model, mesh, {{"h.0", tp::PrepareModuleInput().input_layouts({std::nullopt})
                                                     .desired_input_layouts({Shard(1)})}});
  });
  expect_has(m3, "both must be a placement or both std::nullopt");
  // Layouts for two arguments on a forward that takes one: at the call, on every rank.
  auto m4 = same_error_on_every_rank(2, [](const DeviceMeshPtr& mesh) {
    HNet model;
    tp::parallelize_module(model, mesh, {{"h.0", tp::PrepareModuleInput().input_layouts({Replicate(), std::nullopt})
                                                     .desired_input_layouts({Shard(1), std::nullopt})}});
    model(torch::zeros({1, 4}, torch::kInt64));
  });
  expect_has(m4, "PrepareModuleInput on 'h.0': expected 2 arguments");
}

TEST(ParallelStylesErrors, SequenceParallelOnAModuleThatIsNoNorm) {
  auto msg = same_error_on_every_rank(2, [](const DeviceMeshPtr& mesh) {
    HNet model;
    tp::parallelize_module(model, mesh, {{"h.0.mlp", tp::SequenceParallel()}});
  });
  expect_has(msg, "SequenceParallel on 'h.0.mlp'");
  expect_has(msg, "a norm module without submodules whose parameters are a 1-D `weight`");
}

}  // namespace
}  // namespace fsdp::testing::parallel_styles
