// Selective activation checkpointing on one process (CTest label: activation_checkpointing), as PyTorch's
// test_checkpoint's selective tests: the gradients equal those without checkpointing bit for bit (fp32, dropout
// on, autocast), the saved ops are not run again in backward while the others are, a saved random op leaves the
// generators where the forward did, an in-place change of a saved output inside the region works (copied first)
// while one after it is refused naming the op (or allowed), a counting policy is asked in the first run only,
// nested regions, a retained graph, and bad input refused. With FSDP (holders and implicit groups, mixed
// precision, several world sizes) and the memory between none and full: tests/algorithms/.
#include <gtest/gtest.h>

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include <atomic>
#include <map>
#include <mutex>

#include "error_message.h"
#include "expect_tensors_equal.h"
#include "fsdp/utils/activation_checkpoint.h"
#include "fsdp/utils/selective_checkpoint.h"

namespace fsdp::testing {
namespace {

// A transformer-like block: layer norm, attention through scaled_dot_product_attention, a GELU MLP, dropout,
// residuals.
struct Block {
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
  double p = 0.0;
  explicit Block(double dropout = 0.0) : p(dropout) {
    torch::manual_seed(5);
    ln1 = torch::nn::LayerNorm(torch::nn::LayerNormOptions({16}));
    ln2 = torch::nn::LayerNorm(torch::nn::LayerNormOptions({16}));
    qkv = torch::nn::Linear(16, 48);
    proj = torch::nn::Linear(16, 16);
    fc1 = torch::nn::Linear(16, 64);
    fc2 = torch::nn::Linear(64, 16);
  }
  // at::linear as train_gpt's model (torch::nn::Linear's forward decomposes to matmul + add on 3-D inputs).
  static torch::Tensor linear(const torch::nn::Linear& l, const torch::Tensor& x) { return at::linear(x, l->weight, l->bias); }
  torch::Tensor operator()(torch::Tensor x) {
    auto parts = linear(qkv, ln1(x)).view({x.size(0), x.size(1), 3, 2, 8}).permute({2, 0, 3, 1, 4}).unbind(0);
    auto a = torch::scaled_dot_product_attention(parts[0], parts[1], parts[2], {}, 0.0, /*is_causal=*/true);
    a = a.transpose(1, 2).reshape({x.size(0), x.size(1), 16});
    x = x + torch::dropout(linear(proj, a), p, /*train=*/true);
    return x + torch::dropout(linear(fc2, torch::gelu(linear(fc1, ln2(x)))), p, /*train=*/true);
  }
  std::vector<torch::Tensor> params() const {
    std::vector<torch::Tensor> all;
    for (const auto* m : std::initializer_list<const torch::nn::Module*>{ln1.get(), ln2.get(), qkv.get(), proj.get(),
                                                                        fc1.get(), fc2.get()}) {
      for (const auto& t : m->parameters()) all.push_back(t);
    }
    return all;
  }
  std::vector<torch::Tensor> grads() const {
    std::vector<torch::Tensor> g;
    for (const auto& t : params()) g.push_back(t.grad().defined() ? t.grad().clone() : torch::Tensor());
    return g;
  }
  void zero() {
    for (auto t : params()) t.mutable_grad() = torch::Tensor();
  }
};

// Counts the dispatcher's calls of some ops on every thread (the recomputation runs in the backward).
class OpCounter {
 public:
  explicit OpCounter(std::vector<std::string> names) : names_(std::move(names)) {
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(
        [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          auto* self = current();
          if (self) {
            for (const auto& n : self->names_) {
              if (n == fn.name()) {
                std::lock_guard<std::mutex> lock(self->mu_);
                ++self->counts_[n];
              }
            }
          }
          return nullptr;
        }).scopes({at::RecordScope::FUNCTION}));
    current() = this;
  }
  ~OpCounter() {
    current() = nullptr;
    at::removeCallback(handle_);
  }
  int64_t count(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_[name];
  }
  void reset() {
    std::lock_guard<std::mutex> lock(mu_);
    counts_.clear();
  }

 private:
  static OpCounter*& current() {
    static OpCounter* c = nullptr;
    return c;
  }
  std::vector<std::string> names_;
  std::mutex mu_;
  std::map<std::string, int64_t> counts_;
  at::CallbackHandle handle_;
};

CheckpointOptions save_ops(std::vector<std::string> ops, bool allow_mutation = false) {
  return CheckpointOptions().context_fn(
      [ops, allow_mutation] { return create_selective_checkpoint_contexts(ops, allow_mutation); });
}

TEST(SelectiveCheckpoint, GradientsBitIdenticalAndSavedOpsAreNotRecomputed) {
  Block b(/*dropout=*/0.1);
  auto x = torch::randn({2, 6, 16}, torch::requires_grad());
  auto run = [&](std::optional<CheckpointOptions> o) {
    b.zero();
    x.mutable_grad() = torch::Tensor();
    torch::manual_seed(42);
    auto y = o ? checkpoint(*o, [&](torch::Tensor t) { return b(t); }, x) : b(x);
    torch::manual_seed(1000);  // the recomputation must use the forward's RNG state, not this one
    y.pow(2).sum().backward();
    auto g = b.grads();
    g.push_back(x.grad().clone());
    return g;
  };
  const auto ref = run(std::nullopt);
  // The dispatcher records an op's call before any kernel runs, a skipped one too: count what linear runs
  // inside (addmm: 3-D input with bias; the backward multiplies with mm).
  OpCounter counter({"aten::addmm"});
  run(std::nullopt);
  const int64_t addmm0 = counter.count("aten::addmm");
  ASSERT_EQ(addmm0, 4);
  // Full (non-reentrant) checkpointing runs the linears twice; saving them runs them once.
  counter.reset();
  expect_tensors_equal(run(CheckpointOptions()), ref, "full");
  EXPECT_EQ(counter.count("aten::addmm"), 2 * addmm0);
  counter.reset();
  expect_tensors_equal(run(save_ops({"aten::linear"})), ref, "selective: linear saved");
  EXPECT_EQ(counter.count("aten::addmm"), addmm0) << "a saved op is not run again in backward";
  // Every other linear saved (a counting policy): 6 runs.
  auto every_other = CheckpointOptions().context_fn([] {
    auto n = std::make_shared<int>(0);
    return create_selective_checkpoint_contexts(
        [n](const SelectiveCheckpointContext&, const c10::OperatorHandle& op, const std::vector<c10::IValue>&) {
          if (op.schema().name() != "aten::linear") return CheckpointPolicy::PREFER_RECOMPUTE;
          return ++*n % 2 == 1 ? CheckpointPolicy::MUST_SAVE : CheckpointPolicy::PREFER_RECOMPUTE;
        });
  });
  counter.reset();
  expect_tensors_equal(run(every_other), ref, "selective: every other linear saved");
  EXPECT_EQ(counter.count("aten::addmm"), addmm0 + addmm0 / 2);
  // Saving the attention kernel (whichever this build picks), the matmuls and gelu: only the norms and the
  // dropouts run again.
  std::vector<std::string> more = default_selective_save_list();
  more.push_back("aten::gelu");
  counter.reset();
  expect_tensors_equal(run(save_ops(more)), ref, "selective: matmuls, attention, gelu saved");
  EXPECT_EQ(counter.count("aten::addmm"), addmm0);
}

TEST(SelectiveCheckpoint, ASavedRandomOpLeavesTheGeneratorsWhereTheForwardDid) {
  // Two random draws; the first saved, the second recomputed after it: the recomputation must not draw the
  // second mask from where the first one was drawn.
  auto x = torch::randn({64, 8}, torch::requires_grad());
  auto fn = [](torch::Tensor t) {
    auto h = torch::sin(t * torch::bernoulli(torch::full_like(t, 0.7)));
    return torch::sin(h * torch::bernoulli(torch::full_like(t, 0.7)));
  };
  torch::manual_seed(3);
  fn(x).sum().backward();  // (y.pow(2) would hide a wrong second mask: y is 0 where it drops)
  const auto ref = x.grad().clone();
  int draws = 0;
  auto first_draw = CheckpointOptions().context_fn([&draws] {
    draws = 0;
    return create_selective_checkpoint_contexts(
        [&draws](const SelectiveCheckpointContext& ctx, const c10::OperatorHandle& op, const std::vector<c10::IValue>&) {
          EXPECT_FALSE(ctx.is_recompute) << "asked in the first run only";
          if (op.schema().name() != "aten::bernoulli") return CheckpointPolicy::PREFER_RECOMPUTE;
          return ++draws == 1 ? CheckpointPolicy::MUST_SAVE : CheckpointPolicy::PREFER_RECOMPUTE;
        });
  });
  x.mutable_grad() = torch::Tensor();
  torch::manual_seed(3);
  auto y = checkpoint(first_draw, fn, x);
  EXPECT_EQ(draws, 2);
  torch::manual_seed(77);
  const auto after = torch::rand({3});
  torch::manual_seed(77);
  y.sum().backward();
  EXPECT_EQ(draws, 2) << "the policy is not asked in the recomputation";
  EXPECT_TRUE(torch::equal(x.grad(), ref)) << "max diff " << (x.grad() - ref).abs().max().item<float>();
  EXPECT_TRUE(torch::equal(torch::rand({3}), after)) << "the caller's RNG state is put back after the recomputation";
}

TEST(SelectiveCheckpoint, AutocastNestedRegionsAndARetainedGraph) {
  Block b;
  auto x = torch::randn({2, 6, 16}, torch::requires_grad());
  // Autocast (CPU bf16): the saved linears' outputs are the bf16 ones of the forward.
  auto run = [&](std::optional<CheckpointOptions> o) {
    b.zero();
    torch::Tensor y;
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    y = o ? checkpoint(*o, [&](torch::Tensor t) { return b(t); }, x) : b(x);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    y.to(torch::kFloat32).pow(2).sum().backward();
    return b.grads();
  };
  expect_tensors_equal(run(save_ops({"aten::linear"})), run(std::nullopt), "autocast");
  // A full region nested in a selective one, and the other way round; a second backward over a retained graph.
  auto twice = [&](CheckpointOptions outer, CheckpointOptions inner) {
    b.zero();
    auto y = checkpoint(outer, [&](torch::Tensor t) { return b(checkpoint(inner, [&](torch::Tensor u) { return b(u); }, t)); }, x);
    auto loss = y.pow(2).sum();
    loss.backward({}, /*retain_graph=*/true);
    auto first = b.grads();
    b.zero();
    loss.backward();
    expect_tensors_equal(b.grads(), first, "second backward over the retained graph");
    return first;
  };
  b.zero();
  b(b(x)).pow(2).sum().backward();
  const auto ref = b.grads();
  expect_tensors_equal(twice(save_ops({"aten::linear"}), CheckpointOptions()), ref, "full inside selective");
  expect_tensors_equal(twice(CheckpointOptions(), save_ops({"aten::linear", "aten::gelu"})), ref, "selective inside full");
  expect_tensors_equal(twice(save_ops({"aten::linear"}), save_ops({"aten::gelu"})), ref, "selective inside selective");
}

TEST(SelectiveCheckpoint, InPlaceChangesOfASavedOutput) {
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto x = torch::randn({4, 8}, torch::requires_grad());
  // Inside the region (as torch::nn::Linear adds its bias to matmul's output on 3-D inputs): the saved value is
  // copied before the change, and the recomputation changes a copy of its own; gradients as without checkpointing,
  // also over a retained graph.
  auto inside = [&](torch::Tensor t) {
    auto h = torch::mm(t, w);
    h.add_(1.5);
    return (torch::sigmoid(h) * h).sum();
  };
  inside(x).backward();
  const auto ref_w = w.grad().clone(), ref_x = x.grad().clone();
  w.mutable_grad() = torch::Tensor();
  x.mutable_grad() = torch::Tensor();
  auto loss = checkpoint(save_ops({"aten::mm"}), inside, x);
  loss.backward({}, /*retain_graph=*/true);
  EXPECT_TRUE(torch::equal(w.grad(), ref_w));
  EXPECT_TRUE(torch::equal(x.grad(), ref_x));
  loss.backward();
  EXPECT_TRUE(torch::equal(w.grad(), 2 * ref_w)) << "the second backward recomputes from the unchanged saved value";
  // After the region (the caller changes an output the region saved): the recomputation would serve the changed
  // value, so it is refused naming the op, unless allowed.
  auto outside = [&](torch::Tensor t) {
    auto h = torch::mm(t, w);
    return std::make_tuple(torch::sigmoid(h).sum(), h);
  };
  auto [y, h] = checkpoint(save_ops({"aten::mm"}), outside, x);
  h.mul_(2);
  auto msg = error_message([&] { y.backward(); });
  EXPECT_NE(msg.find("the output of aten::mm (op #0 of the region) that the first run saved was modified in place"),
            std::string::npos) << msg;
  EXPECT_NE(msg.find("allow_cache_entry_mutation"), std::string::npos) << msg;
  auto [y2, h2] = checkpoint(save_ops({"aten::mm"}, /*allow_mutation=*/true), outside, x);
  h2.mul_(2);
  EXPECT_NO_THROW(y2.backward());  // (PyTorch's semantics: the changed value is served)
}

TEST(SelectiveCheckpoint, BadInputIsRefused) {
  auto msg = error_message([] { create_selective_checkpoint_contexts({"aten::mm", "aten::matmull"}); });
  EXPECT_NE(msg.find("no registered op is named 'aten::matmull'"), std::string::npos) << msg;
  EXPECT_NO_THROW(create_selective_checkpoint_contexts({"aten::add.Tensor", "aten::mm"}));
  msg = error_message([] { create_selective_checkpoint_contexts(SelectiveCheckpointPolicyFn()); });
  EXPECT_NE(msg.find("expected a policy function"), std::string::npos) << msg;
  auto x = torch::randn({2, 2}, torch::requires_grad());
  msg = error_message([&] {
    checkpoint(save_ops({"aten::mm"}).use_reentrant(true), [](torch::Tensor t) { return t * 2; }, x);
  });
  EXPECT_NE(msg.find("context_fn (selective checkpointing) needs the non-reentrant form"), std::string::npos) << msg;
  // A recomputation that reaches another op where the first run saved one is refused naming both.
  bool other = false;
  auto w = torch::randn({2, 2});
  auto y = checkpoint(save_ops({"aten::mm", "aten::mul"}),
                      [&](torch::Tensor t) { return other ? torch::sin(t * 3) : torch::sin(torch::mm(t, w)); }, x);
  other = true;
  msg = error_message([&] { y.sum().backward(); });
  EXPECT_NE(msg.find("op #0 of the region's recomputation is aten::mul.Scalar, but the first run saved aten::mm there"),
            std::string::npos) << msg;
  // A recomputation that ends before a saved op.
  bool stop = false;
  auto y2 = checkpoint(save_ops({"aten::mm"}), [&](torch::Tensor t) {
    auto a = torch::sin(t);
    return stop ? a : torch::mm(a, w);
  }, x);
  stop = true;
  msg = error_message([&] { y2.sum().backward(); });
  EXPECT_NE(msg.find("reached 0 of the 1 ops the first run saved (the next: aten::mm, op #1)"), std::string::npos) << msg;
}

}  // namespace
}  // namespace fsdp::testing
