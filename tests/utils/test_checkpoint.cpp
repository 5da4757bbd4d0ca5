// fsdp::checkpoint on one process (CTest label: activation_checkpointing), as torch.utils.checkpoint's tests:
// non-reentrant (the default) gives the gradients of the same code without checkpointing bit for bit, with the
// region re-run once in backward; inputs without grad and parameters inside, several inputs and outputs with
// non-tensor arguments, a backward through part of the outputs, nested regions, a second backward over a
// retained graph, the RNG (dropout) and autocast states restored, preserve_rng_state off, the determinism check
// naming the tensor, and the reentrant form kept. FSDP with checkpointing: tests/algorithms/.
#include <gtest/gtest.h>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "error_message.h"
#include "expect_tensors_equal.h"
#include "fsdp/utils/activation_checkpoint.h"

namespace fsdp::testing {
namespace {

// A region with parameters, a nonlinearity that saves its input and output, and dropout.
struct Mlp {
  torch::nn::Linear l1{nullptr}, l2{nullptr};
  torch::nn::Dropout drop{nullptr};
  int calls = 0;
  explicit Mlp(double p = 0.0) {
    torch::manual_seed(3);
    l1 = torch::nn::Linear(8, 16);
    l2 = torch::nn::Linear(16, 8);
    drop = torch::nn::Dropout(p);
  }
  torch::Tensor operator()(const torch::Tensor& x) {
    ++calls;
    return l2(drop(torch::tanh(l1(x)))) * torch::sigmoid(x);
  }
  std::vector<torch::Tensor> params() const { return {l1->weight, l1->bias, l2->weight, l2->bias}; }
  std::vector<torch::Tensor> grads() const {
    std::vector<torch::Tensor> g;
    for (const auto& p : params()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
    return g;
  }
  void zero() {
    for (auto p : params()) p.mutable_grad() = torch::Tensor();
  }
};

TEST(NonReentrantCheckpoint, GradientsBitIdenticalAndTheRegionRunsOnceMoreInBackward) {
  Mlp m;
  auto x = torch::randn({5, 8}, torch::requires_grad());
  m(x).pow(2).sum().backward();
  auto ref = m.grads();
  auto ref_x = x.grad().clone();
  m.zero();
  x.mutable_grad() = torch::Tensor();
  m.calls = 0;
  auto y = checkpoint([&](const torch::Tensor& in) { return m(in); }, x);
  EXPECT_EQ(m.calls, 1);
  EXPECT_TRUE(y.requires_grad());
  EXPECT_NE(y.grad_fn()->name().find("Mul"), std::string::npos) << "the region's own graph, not a checkpoint node";
  y.pow(2).sum().backward();
  EXPECT_EQ(m.calls, 2) << "recomputed once, at the first saved tensor the backward needed";
  expect_tensors_equal(m.grads(), ref, "non-reentrant");
  EXPECT_TRUE(torch::equal(x.grad(), ref_x));
  // The reentrant form is still there, with the same numbers.
  m.zero();
  x.mutable_grad() = torch::Tensor();
  checkpoint(CheckpointOptions().use_reentrant(true), [&](const torch::Tensor& in) { return m(in); }, x)
      .pow(2).sum().backward();
  expect_tensors_equal(m.grads(), ref, "reentrant");
  EXPECT_TRUE(torch::equal(x.grad(), ref_x));
}

TEST(NonReentrantCheckpoint, InputWithoutGradParametersInsideAndNonTensorArguments) {
  Mlp m;
  auto x = torch::randn({5, 8});  // no grad (token embeddings computed under no_grad, an image batch)
  auto fn = [&](const torch::Tensor& in, double scale, bool twice, const torch::Tensor& bias) {
    auto h = m(in) * scale + bias;
    if (twice) h = m(h);
    return std::make_tuple(h, h.sum(0), 7);
  };
  auto bias = torch::randn({8}, torch::requires_grad());
  auto [ra, rb, rc] = fn(x, 0.5, true, bias);
  (ra.pow(2).sum() + rb.sum()).backward();
  auto ref = m.grads();
  auto ref_bias = bias.grad().clone();
  m.zero();
  bias.mutable_grad() = torch::Tensor();
  auto [a, b, c] = checkpoint(fn, x, 0.5, true, bias);
  EXPECT_EQ(c, 7);
  (a.pow(2).sum() + b.sum()).backward();
  expect_tensors_equal(m.grads(), ref, "parameters inside, input without grad");
  EXPECT_TRUE(torch::equal(bias.grad(), ref_bias));
  // A backward through one output only.
  m.zero();
  auto [ra2, rb2, rc2] = fn(x, 0.5, false, bias);
  rb2.sum().backward();
  ref = m.grads();
  m.zero();
  auto [a2, b2, c2] = checkpoint(fn, x, 0.5, false, bias);
  b2.sum().backward();
  expect_tensors_equal(m.grads(), ref, "a backward through one of the outputs");
}

TEST(NonReentrantCheckpoint, NestedRegionsAndASecondBackwardOverARetainedGraph) {
  Mlp m;
  auto x = torch::randn({5, 8}, torch::requires_grad());
  auto plain = [&](const torch::Tensor& in) { return torch::relu(m(m(in))); };
  plain(x).pow(2).sum().backward();
  auto ref = m.grads();
  m.zero();
  m.calls = 0;
  auto nested = [&](const torch::Tensor& in) {
    auto h = checkpoint([&](const torch::Tensor& t) { return m(t); }, in);
    return torch::relu(m(h));
  };
  auto y = checkpoint(nested, x);
  EXPECT_EQ(m.calls, 2);
  auto loss = y.pow(2).sum();
  loss.backward({}, /*retain_graph=*/true);
  // The outer region once more (2 calls: its inner region runs as a first run again), the inner once more.
  EXPECT_EQ(m.calls, 5);
  expect_tensors_equal(m.grads(), ref, "nested");
  m.zero();
  loss.backward();  // the retained graph: recomputed again
  expect_tensors_equal(m.grads(), ref, "second backward over the retained graph");
}

TEST(NonReentrantCheckpoint, DropoutAndAutocastAsInTheForwardAndPreserveRngStateOff) {
  Mlp m(/*p=*/0.5);
  auto x = torch::randn({16, 8}, torch::requires_grad());
  torch::manual_seed(99);
  m(x).pow(2).sum().backward();
  auto ref = m.grads();
  for (bool preserve : {true, false}) {
    m.zero();
    torch::manual_seed(99);
    auto y = checkpoint(CheckpointOptions().preserve_rng_state(preserve), [&](const torch::Tensor& in) { return m(in); }, x);
    torch::manual_seed(12345);  // the recomputation must not see this state (unless preserve_rng_state is off)
    auto after = torch::rand({4});
    torch::manual_seed(12345);
    y.pow(2).sum().backward();
    if (preserve) {
      expect_tensors_equal(m.grads(), ref, "dropout with the forward's RNG state");
      EXPECT_TRUE(torch::equal(torch::rand({4}), after)) << "the caller's RNG state is put back after the recomputation";
    } else {
      EXPECT_FALSE(torch::equal(m.grads()[0], ref[0])) << "other dropout masks without preserve_rng_state";
    }
  }
  // Autocast: the forward under CPU bf16 autocast, the backward outside it; the recomputation casts as the
  // forward did (bf16 matmuls), so the gradients are those of the autocast run.
  Mlp a;
  auto run = [&](bool ckpt) {
    a.zero();
    torch::Tensor y;
    {
      at::autocast::set_autocast_enabled(at::kCPU, true);
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      y = ckpt ? checkpoint([&](const torch::Tensor& in) { return a(in); }, x) : a(x);
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
    }
    y.to(torch::kFloat32).pow(2).sum().backward();
    return a.grads();
  };
  auto autocast_ref = run(false);
  expect_tensors_equal(run(true), autocast_ref, "autocast restored for the recomputation");
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU)) << "and switched off again after it";
}

TEST(NonReentrantCheckpoint, ARecomputationThatDiffersIsRefusedNamingTheTensor) {
  Mlp m;
  auto x = torch::randn({4, 8}, torch::requires_grad());
  bool wide = false;  // state the region reads, changed between forward and backward
  auto fn = [&](const torch::Tensor& in) {
    auto t = wide ? torch::cat({in, in}) : in;
    return torch::sin(t).sum(0, /*keepdim=*/true);
  };
  auto y = checkpoint(fn, x);
  wide = true;
  auto msg = error_message([&] { y.sum().backward(); });
  EXPECT_NE(msg.find("recomputed tensor #0 differs from the forward's: shape [8, 8]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("instead of shape [4, 8]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("determinism_check(\"none\")"), std::string::npos) << msg;
  // More tensors in the recomputation than in the forward.
  wide = false;
  bool extra = false;
  auto y2 = checkpoint([&](const torch::Tensor& in) { return extra ? torch::sin(torch::sin(in)) : torch::sin(in); }, x);
  extra = true;
  msg = error_message([&] { y2.sum().backward(); });
  EXPECT_NE(msg.find("saved more tensors for backward than the forward did (1)"), std::string::npos) << msg;
  msg = error_message([&] { checkpoint(CheckpointOptions().determinism_check("always"), fn, x); });
  EXPECT_NE(msg.find("determinism_check must be \"default\" or \"none\", got \"always\""), std::string::npos) << msg;
}

// checkpoint_sequential: 7 modules in 3 segments (2, 2 and the last 3 run as is): the first two pieces are
// recomputed, once each, the last not; the gradients are those of the plain Sequential, bit for bit.
struct CountingImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  int calls = 0;
  CountingImpl() { fc = register_module("fc", torch::nn::Linear(6, 6)); }
  torch::Tensor forward(torch::Tensor x) {
    ++calls;
    return torch::tanh(fc(x));
  }
};
TORCH_MODULE(Counting);

TEST(NonReentrantCheckpoint, CheckpointSequentialRecomputesEveryPieceButTheLast) {
  torch::manual_seed(8);
  torch::nn::Sequential seq;
  std::vector<Counting> layers;
  for (int i = 0; i < 7; ++i) {
    layers.emplace_back();
    seq->push_back(layers.back());
  }
  auto x = torch::randn({4, 6}, torch::requires_grad());
  seq->forward(x).pow(2).sum().backward();
  std::vector<torch::Tensor> ref;
  for (auto& p : seq->parameters()) ref.push_back(p.grad().clone());
  auto ref_x = x.grad().clone();
  for (bool reentrant : {false, true}) {
    for (auto& p : seq->parameters()) p.mutable_grad() = torch::Tensor();
    x.mutable_grad() = torch::Tensor();
    for (auto& l : layers) l->calls = 0;
    checkpoint_sequential(seq, 3, x, CheckpointOptions().use_reentrant(reentrant)).pow(2).sum().backward();
    std::vector<int> calls;
    for (auto& l : layers) calls.push_back(l->calls);
    EXPECT_EQ(calls, (std::vector<int>{2, 2, 2, 2, 1, 1, 1})) << "reentrant " << reentrant;
    std::vector<torch::Tensor> got;
    for (auto& p : seq->parameters()) got.push_back(p.grad().clone());
    expect_tensors_equal(got, ref, reentrant ? "checkpoint_sequential, reentrant" : "checkpoint_sequential");
    EXPECT_TRUE(torch::equal(x.grad(), ref_x));
  }
  auto msg = error_message([&] { checkpoint_sequential(seq, 8, x); });
  EXPECT_NE(msg.find("8 segments for a Sequential of 7 modules; expected between 1 and 7"), std::string::npos) << msg;
}

}  // namespace
}  // namespace fsdp::testing
