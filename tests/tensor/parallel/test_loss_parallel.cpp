// loss_parallel (src/tensor/parallel/loss.cpp; CTest label: tensor_parallel): vocab_parallel_cross_entropy on
// vocabulary-sharded logits gives the loss and the logits' gradient of torch's cross_entropy on the gathered
// logits (fp32, 1e-5) on tp 2, 3 and 4, with vocabularies that do not divide (torch.chunk shards, an empty one
// at V = 5, tp = 4), ignore_index (the default and a valid class id), label smoothing and each reduction; under a
// ColwiseParallel head (parallelize_module) the head's weight and input gradients equal one process's; bad
// input throws the same message on every rank. The loss_parallel() guard (src/tensor/parallel/loss_parallel.cpp):
// F::cross_entropy on a ColwiseParallel head's output (through flatten / view) inside it gives the explicit
// function's and one process's loss and gradients (logits, head weight and bias, input; plain and tied heads) on
// tp 2 and 3 for every case above (vocabularies that divide: ColwiseParallel refuses others); an unrelated cross_entropy inside it, and the head's output outside it, are
// computed as without it; class weights and views that lose the rows are refused on every rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <mutex>

#include <c10/core/impl/LocalDispatchKeySet.h>

#include "fsdp/fsdp.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

namespace F = torch::nn::functional;

// The largest difference any rank saw, printed by each test (the report's measured max diff).
struct MaxDiff {
  std::mutex mu;
  double value = 0;
  void see(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
    ASSERT_EQ(got.sizes(), want.sizes()) << what;
    const double d = got.numel() ? (got - want).abs().max().item<double>() : 0.0;
    EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-5)) << what << ": max diff " << d << "\ngot " << got << "\nwant " << want;
    std::lock_guard<std::mutex> lock(mu);
    value = std::max(value, d);
  }
};

struct Case {
  std::string reduction;
  int64_t ignore_index;
  double smoothing;
};

// Reference and sharded loss on the same global logits; the gradient of (loss * w).sum() (w: fixed weights,
// so that "none" gets a non-uniform incoming gradient) is compared column by column.
void compare(int tp, int64_t vocab, int64_t rows, const Case& c, MaxDiff& diff) {
  auto full = (torch::arange(rows * vocab, torch::kFloat32).view({rows, vocab}) * 0.37).sin() * 3.0;
  auto target = (torch::arange(rows, torch::kInt64) * 7 + 2).remainder(vocab);
  // Two ignored rows (ignore_index 4 or 0 is also a class id: those rows are ignored, not trained on).
  target.index_put_({1}, c.ignore_index);
  target.index_put_({3}, c.ignore_index);
  auto w = torch::arange(1, rows + 1, torch::kFloat32) / rows;
  auto opts = F::CrossEntropyFuncOptions().ignore_index(c.ignore_index).label_smoothing(c.smoothing);
  if (c.reduction == "sum") opts.reduction(torch::kSum);
  else if (c.reduction == "none") opts.reduction(torch::kNone);
  else opts.reduction(torch::kMean);
  auto ref_in = full.clone().requires_grad_(true);
  auto ref_loss = F::cross_entropy(ref_in, target, opts);
  (c.reduction == "none" ? (ref_loss * w).sum() : ref_loss * 1.5).backward();
  const auto ref_grad = ref_in.grad().clone();
  const std::string what = "tp " + std::to_string(tp) + " V " + std::to_string(vocab) + " " + c.reduction +
                           " ignore " + std::to_string(c.ignore_index) + " smoothing " + std::to_string(c.smoothing);
  run_ranks(tp, [&](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {tp}, {"tp"});
    const auto r = chunk_range(vocab, tp, mesh->get_local_rank(0));
    auto local = full.narrow(1, r.offset, r.length).clone().requires_grad_(true);
    auto loss = tp::vocab_parallel_cross_entropy(
        local, target, mesh,
        tp::LossParallelOptions().set_reduction(c.reduction).set_ignore_index(c.ignore_index).set_label_smoothing(c.smoothing));
    diff.see(loss.detach(), ref_loss.detach(), what + ": loss");
    (c.reduction == "none" ? (loss * w).sum() : loss * 1.5).backward();
    ASSERT_TRUE(local.grad().defined()) << what;
    diff.see(local.grad(), ref_grad.narrow(1, r.offset, r.length), what + ": logits gradient");
  });
}

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"mean", -100, 0.0}, {"sum", -100, 0.0}, {"none", -100, 0.0}, {"mean", 4, 0.0},
      {"mean", -100, 0.1}, {"sum", 4, 0.2},    {"none", 4, 0.1},    {"mean", 0, 0.3},
  };
  return all;
}

void all_cases(int tp, std::vector<int64_t> vocabs) {
  MaxDiff diff;
  for (auto v : vocabs)
    for (const auto& c : cases()) compare(tp, v, 6, c, diff);
  std::cout << "[loss_parallel] tp " << tp << ": max |diff| over loss and logits gradient " << diff.value << std::endl;
}

// 11 divides by none of 2, 3, 4; 5 on 4 ranks leaves rank 3 an empty shard (chunks 2, 2, 1, 0); 12 divides.
TEST(LossParallel, MatchesGatheredCrossEntropyTp2) { all_cases(2, {11, 12}); }
TEST(LossParallel, MatchesGatheredCrossEntropyTp3) { all_cases(3, {11, 5}); }
TEST(LossParallel, MatchesGatheredCrossEntropyTp4) { all_cases(4, {11, 5}); }

// 1-D logits with a 0-D target, as torch's cross_entropy; every row ignored gives NaN for "mean", as torch.
TEST(LossParallel, OneRowAndAllIgnored) {
  run_ranks(3, [](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {3}, {"tp"});
    auto full = torch::linspace(-2, 3, 7);
    const auto r = chunk_range(7, 3, mesh->get_local_rank(0));
    auto target = torch::tensor(5, torch::kInt64);
    auto loss = tp::vocab_parallel_cross_entropy(full.narrow(0, r.offset, r.length), target, mesh);
    auto ref = torch::nn::functional::cross_entropy(full, target);
    EXPECT_TRUE(torch::allclose(loss, ref, 1e-5, 1e-5)) << loss << " vs " << ref;
    auto ignored = torch::full({4}, -100, torch::kInt64);
    auto logits = torch::ones({4, 7}).narrow(1, r.offset, r.length);
    EXPECT_TRUE(std::isnan(tp::vocab_parallel_cross_entropy(logits, ignored, mesh).item<double>()));
    EXPECT_EQ(tp::vocab_parallel_cross_entropy(logits, ignored, mesh, tp::LossParallelOptions().set_reduction("sum"))
                  .item<double>(), 0.0);
  });
}

// The DTensor overload: logits described as {Shard(1)} on the TP mesh.
TEST(LossParallel, DTensorLogits) {
  run_ranks(2, [](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2}, {"tp"});
    auto full = torch::arange(15, torch::kFloat32).view({3, 5}).cos();
    auto target = torch::tensor({0, 4, 2}, torch::kInt64);
    auto dt = distribute_tensor(full, mesh, {Shard(1)});
    auto loss = tp::vocab_parallel_cross_entropy(dt, target);
    auto ref = torch::nn::functional::cross_entropy(full, target);
    EXPECT_TRUE(torch::allclose(loss, ref, 1e-5, 1e-5)) << loss << " vs " << ref;
    EXPECT_THROW(tp::vocab_parallel_cross_entropy(distribute_tensor(full, mesh, {Shard(0)}), target), c10::Error);
  });
}

// The model side: a ColwiseParallel head (Shard(-1) output, the local logits) and loss_parallel on its output
// train like one process's head + cross_entropy on the full logits: loss, head weight and bias gradients (this
// rank's rows) and the input's gradient (all-reduced by the head's backward).
TEST(LossParallel, ColwiseHeadGradientsMatchOneProcess) {
  const int64_t d = 6, vocab = 12, rows = 10;
  MaxDiff diff;
  for (int tp : {2, 3, 4}) {
    run_ranks(tp, [&](ProcessGroupPtr) {
      auto mesh = init_device_mesh(torch::kCPU, {tp}, {"tp"});
      torch::nn::Linear ref(d, vocab), head(d, vocab);
      {
        torch::NoGradGuard no_grad;
        auto wfull = (torch::arange(vocab * d, torch::kFloat32).view({vocab, d}) * 0.31).sin();
        auto bfull = torch::linspace(-0.5, 0.5, vocab);
        ref->weight.copy_(wfull);
        head->weight.copy_(wfull);
        ref->bias.copy_(bfull);
        head->bias.copy_(bfull);
      }
      tp::parallelize_module(head, mesh, tp::ColwiseParallel());
      auto x_ref = (torch::arange(rows * d, torch::kFloat32).view({rows, d}) * 0.13).cos().requires_grad_(true);
      auto x = x_ref.detach().clone().requires_grad_(true);
      auto target = (torch::arange(rows, torch::kInt64) * 5 + 1).remainder(vocab);
      target.index_put_({2}, -100);
      auto opts = torch::nn::functional::CrossEntropyFuncOptions().label_smoothing(0.1);
      auto ref_loss = torch::nn::functional::cross_entropy(ref(x_ref), target, opts);
      ref_loss.backward();
      auto loss = tp::vocab_parallel_cross_entropy(head(x), target, mesh, tp::LossParallelOptions().set_label_smoothing(0.1));
      loss.backward();
      const auto r = chunk_range(vocab, tp, mesh->get_local_rank(0));
      const std::string what = "tp " + std::to_string(tp);
      diff.see(loss.detach(), ref_loss.detach(), what + " loss");
      diff.see(head->weight.grad(), ref->weight.grad().narrow(0, r.offset, r.length), what + " head.weight grad");
      diff.see(head->bias.grad(), ref->bias.grad().narrow(0, r.offset, r.length), what + " head.bias grad");
      diff.see(x.grad(), x_ref.grad(), what + " input grad");
    });
  }
  std::cout << "[loss_parallel] ColwiseParallel head, tp 2/3/4: max |diff| " << diff.value << std::endl;
}

// A tied head ([Note: tied TP styles]): an Embedding RowwiseParallel and a custom head module whose only parameter
// is the Embedding's weight, planned ColwiseParallel, under loss_parallel: the loss and the tied weight's gradient
// (the sum of both uses', this rank's vocabulary rows) equal one process's, on tp 2 and 4 (vocab 12). A custom
// module whose weight is its own is refused, naming the module and what a tied head is.
struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(torch::Tensor w) { weight = register_parameter("weight", std::move(w)); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::nn::functional::linear(x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(TiedHead);

struct TiedLMImpl : torch::nn::Module {
  TiedLMImpl(int64_t vocab, int64_t d)
      : emb(register_module("emb", torch::nn::Embedding(vocab, d))), head(register_module("head", TiedHead(emb->weight))) {
    torch::NoGradGuard no_grad;
    emb->weight.copy_((torch::arange(vocab * d, torch::kFloat32).view({vocab, d}) * 0.27).sin());
  }
  torch::Tensor forward(const torch::Tensor& ids) { return head(torch::tanh(emb(ids))); }
  torch::nn::Embedding emb;
  TiedHead head;
};
TORCH_MODULE(TiedLM);

TEST(LossParallel, TiedEmbeddingAndHead) {
  const int64_t vocab = 12, d = 5;
  MaxDiff diff;
  for (int tp : {2, 4}) {
    run_ranks(tp, [&](ProcessGroupPtr) {
      auto mesh = init_device_mesh(torch::kCPU, {tp}, {"tp"});
      TiedLM ref(vocab, d), model(vocab, d);
      tp::parallelize_module(model, mesh, {{"emb", tp::RowwiseParallel()}, {"head", tp::ColwiseParallel()}});
      auto ids = (torch::arange(14, torch::kInt64) * 5 + 1).remainder(vocab).view({2, 7});
      auto target = (ids * 3 + 2).remainder(vocab).view(-1);
      auto ref_loss = torch::nn::functional::cross_entropy(ref(ids).view({-1, vocab}), target);
      ref_loss.backward();
      auto local = model(ids);
      ASSERT_EQ(local.size(-1), vocab / tp);
      auto loss = tp::vocab_parallel_cross_entropy(local.view({-1, vocab / tp}), target, mesh);
      loss.backward();
      const auto r = chunk_range(vocab, tp, mesh->get_local_rank(0));
      diff.see(loss.detach(), ref_loss.detach(), "tied tp " + std::to_string(tp) + " loss");
      diff.see(model->emb->weight.grad(), ref->emb->weight.grad().narrow(0, r.offset, r.length),
               "tied tp " + std::to_string(tp) + " weight grad");
      EXPECT_TRUE(model->head->weight.is_same(model->emb->weight));
    });
  }
  std::cout << "[loss_parallel] tied Embedding + head, tp 2/4: max |diff| " << diff.value << std::endl;
  auto errors = run_ranks_collect(2, [](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2}, {"tp"});
    torch::nn::Sequential untied(TiedHead(torch::zeros({4, 3})));
    tp::parallelize_module(untied, mesh, {{"0", tp::ColwiseParallel()}});
  });
  for (const auto& e : errors) EXPECT_NE(e.find("is not the weight of an Embedding planned RowwiseParallel"), std::string::npos) << e;
}

// Bad input: the same c10::Error on every rank (validated from the all-gathered shapes), naming what was
// expected, what was found and the fix.
TEST(LossParallel, BadInputThrowsOnEveryRank) {
  auto expect_all = [](int tp, const std::function<void(const DeviceMeshPtr&, int64_t)>& fn, const std::string& needle) {
    auto errors = run_ranks_collect(tp, [&](ProcessGroupPtr) {
      auto mesh = init_device_mesh(torch::kCPU, {tp}, {"tp"});
      fn(mesh, mesh->get_local_rank(0));
    });
    for (int r = 0; r < tp; ++r) {
      EXPECT_NE(errors[r].find(needle), std::string::npos) << "rank " << r << ": " << errors[r];
      EXPECT_EQ(errors[r], errors[0]) << "rank " << r;
    }
  };
  auto target = torch::tensor({0, 1, 2}, torch::kInt64);
  // Rank 1 holds 4 columns where torch.chunk of 7 over 2 gives it 3 (so V = 8 -> 4, 4: rank 0's 3 is wrong).
  expect_all(2, [&](const DeviceMeshPtr& m, int64_t r) {
    tp::vocab_parallel_cross_entropy(torch::zeros({3, r == 0 ? 3 : 5}), target, m);
  }, "are not torch.chunk's pieces of a vocabulary of 8 over 2 ranks");
  expect_all(2, [&](const DeviceMeshPtr& m, int64_t r) {
    tp::vocab_parallel_cross_entropy(torch::zeros({r == 0 ? 3 : 4, 2}), target, m);
  }, "have different rows");
  expect_all(2, [&](const DeviceMeshPtr& m, int64_t) {
    tp::vocab_parallel_cross_entropy(torch::zeros({3, 2}), torch::tensor({0, 4, 1}, torch::kInt64), m);
  }, "target 4 is out of bounds: expected class indices in [0, 4)");
  expect_all(2, [&](const DeviceMeshPtr& m, int64_t) {
    tp::vocab_parallel_cross_entropy(torch::zeros({3, 2, 2}), target, m);
  }, "flatten a [B, T, V_r] head output");
  expect_all(2, [&](const DeviceMeshPtr& m, int64_t) {
    tp::vocab_parallel_cross_entropy(torch::zeros({3, 2}), target, m, tp::LossParallelOptions().set_reduction("avg"));
  }, "reduction 'avg' is not supported");
}


// ---- the loss_parallel() guard ----

// A ColwiseParallel head on [B, T, d] inputs: one process's loss (cross_entropy on the full logits) against
// F::cross_entropy under loss_parallel() on the head's local output (through `view`: .flatten(0, 1) or
// .view({-1, V_r})) and against the explicit vocab_parallel_cross_entropy: loss, logits gradient (through a
// retained view), head weight and bias gradients (this rank's rows) and the input gradient.
void guard_cases(int tp, int64_t vocab, MaxDiff& diff) {
  const int64_t b = 2, t = 5, d = 6, rows = b * t;
  auto wfull = (torch::arange(vocab * d, torch::kFloat32).view({vocab, d}) * 0.31).sin();
  auto bfull = torch::linspace(-0.5, 0.5, vocab);
  auto xfull = (torch::arange(rows * d, torch::kFloat32).view({b, t, d}) * 0.13).cos();
  auto w_none = torch::arange(1, rows + 1, torch::kFloat32) / rows;
  for (size_t ci = 0; ci < cases().size(); ++ci) {
    const Case& c = cases()[ci];
    auto target = (torch::arange(rows, torch::kInt64) * 7 + 2).remainder(vocab);
    target.index_put_({1}, c.ignore_index);
    target.index_put_({6}, c.ignore_index);
    auto opts = F::CrossEntropyFuncOptions().ignore_index(c.ignore_index).label_smoothing(c.smoothing);
    if (c.reduction == "sum") opts.reduction(torch::kSum);
    else if (c.reduction == "none") opts.reduction(torch::kNone);
    else opts.reduction(torch::kMean);
    auto finish = [&](const torch::Tensor& loss) { return c.reduction == "none" ? (loss * w_none).sum() : loss * 1.5; };
    // One process.
    torch::nn::Linear ref(d, vocab);
    {
      torch::NoGradGuard no_grad;
      ref->weight.copy_(wfull);
      ref->bias.copy_(bfull);
    }
    auto x_ref = xfull.clone().requires_grad_(true);
    auto ref_logits = ref(x_ref);
    ref_logits.retain_grad();
    auto ref_loss = F::cross_entropy(ref_logits.flatten(0, 1), target, opts);
    finish(ref_loss).backward();
    const bool use_view = ci % 2 == 1;
    const std::string what = "guard tp " + std::to_string(tp) + " V " + std::to_string(vocab) + " " + c.reduction +
                             " ignore " + std::to_string(c.ignore_index) + " smoothing " + std::to_string(c.smoothing) +
                             (use_view ? " view" : " flatten");
    run_ranks(tp, [&](ProcessGroupPtr) {
      auto mesh = init_device_mesh(torch::kCPU, {tp}, {"tp"});
      const auto r = chunk_range(vocab, tp, mesh->get_local_rank(0));
      auto make_head = [&] {
        torch::nn::Linear head(d, vocab);
        {
          torch::NoGradGuard no_grad;
          head->weight.copy_(wfull);
          head->bias.copy_(bfull);
        }
        tp::parallelize_module(head, mesh, tp::ColwiseParallel());
        return head;
      };
      auto flat = [&](const torch::Tensor& y) {
        // view({-1, 0}) is ambiguous for an empty shard: flatten there.
        return use_view && r.length > 0 ? y.view({-1, r.length}) : y.flatten(0, 1);
      };
      // The guard.
      auto head = make_head();
      auto x = xfull.clone().requires_grad_(true);
      auto logits = head(x);
      logits.retain_grad();
      torch::Tensor loss;
      {
        auto guard = tp::loss_parallel();
        loss = F::cross_entropy(flat(logits), target, opts);
      }
      finish(loss).backward();
      // The explicit function.
      auto head2 = make_head();
      auto x2 = xfull.clone().requires_grad_(true);
      auto loss2 = tp::vocab_parallel_cross_entropy(
          flat(head2(x2)), target, mesh,
          tp::LossParallelOptions().set_reduction(c.reduction).set_ignore_index(c.ignore_index).set_label_smoothing(c.smoothing));
      finish(loss2).backward();
      diff.see(loss.detach(), ref_loss.detach(), what + ": loss vs one process");
      diff.see(loss.detach(), loss2.detach(), what + ": loss vs vocab_parallel_cross_entropy");
      ASSERT_TRUE(logits.grad().defined()) << what;
      diff.see(logits.grad(), ref_logits.grad().narrow(2, r.offset, r.length), what + ": logits grad");
      diff.see(head->weight.grad(), ref->weight.grad().narrow(0, r.offset, r.length), what + ": head.weight grad");
      diff.see(head->bias.grad(), ref->bias.grad().narrow(0, r.offset, r.length), what + ": head.bias grad");
      diff.see(x.grad(), x_ref.grad(), what + ": input grad");
      diff.see(head->weight.grad(), head2->weight.grad(), what + ": head.weight grad vs explicit");
      diff.see(x.grad(), x2.grad(), what + ": input grad vs explicit");
    });
  }
}

// ColwiseParallel refuses an out_features that the TP size does not divide (parallelize_module), so a head's
// vocabulary always divides: the uneven and empty shards are the explicit function's tests above.
TEST(LossParallelGuard, MatchesExplicitAndOneProcessTp2) {
  MaxDiff diff;
  guard_cases(2, 12, diff);
  guard_cases(2, 6, diff);
  std::cout << "[loss_parallel guard] tp 2: max |diff| " << diff.value << std::endl;
}
TEST(LossParallelGuard, MatchesExplicitAndOneProcessTp3) {
  MaxDiff diff;
  guard_cases(3, 12, diff);
  guard_cases(3, 9, diff);
  std::cout << "[loss_parallel guard] tp 3: max |diff| " << diff.value << std::endl;
}

// The tied head ([Note: tied TP styles]) under the guard: loss and the tied weight's gradient equal one process's.
TEST(LossParallelGuard, TiedHead) {
  const int64_t vocab = 12, d = 5;
  MaxDiff diff;
  for (int tp : {2, 3}) {
    run_ranks(tp, [&](ProcessGroupPtr) {
      auto mesh = init_device_mesh(torch::kCPU, {tp}, {"tp"});
      TiedLM ref(vocab, d), model(vocab, d);
      tp::parallelize_module(model, mesh, {{"emb", tp::RowwiseParallel()}, {"head", tp::ColwiseParallel()}});
      auto ids = (torch::arange(14, torch::kInt64) * 5 + 1).remainder(vocab).view({2, 7});
      auto target = (ids * 3 + 2).remainder(vocab).view(-1);
      auto opts = F::CrossEntropyFuncOptions().label_smoothing(0.1);
      auto ref_loss = F::cross_entropy(ref(ids).view({-1, vocab}), target, opts);
      ref_loss.backward();
      torch::Tensor loss;
      {
        auto guard = tp::loss_parallel();
        loss = F::cross_entropy(model(ids).flatten(0, 1), target, opts);
      }
      loss.backward();
      const auto r = chunk_range(vocab, tp, mesh->get_local_rank(0));
      diff.see(loss.detach(), ref_loss.detach(), "guard tied tp " + std::to_string(tp) + " loss");
      diff.see(model->emb->weight.grad(), ref->emb->weight.grad().narrow(0, r.offset, r.length),
               "guard tied tp " + std::to_string(tp) + " weight grad");
    });
  }
  std::cout << "[loss_parallel guard] tied Embedding + head, tp 2/3: max |diff| " << diff.value << std::endl;
}

// loss_parallel and activation checkpointing (both use the intercept key; [Note: regions a recomputation
// re-enters]): the region inside a selectively checkpointed function, a checkpointed head + loss inside the region
// with backward after the region ended (non-reentrant with a selective policy, and reentrant), give one process's
// loss and gradients on tp 2 and 3; a checkpointed local loss whose forward ran outside any region is recomputed as
// the local loss when backward runs inside one; a checkpoint_wrapper'd head (an implicit region) followed by the
// loss in a region gives one process's loss and gradients (the region ends the head's implicit region).
TEST(LossParallelGuard, WithActivationCheckpointing) {
  const int64_t vocab = 12, d = 5;
  auto xfull = (torch::arange(3 * 4 * d, torch::kFloat32).view({3, 4, d}) * 0.37).sin();
  auto target = (torch::arange(12, torch::kInt64) * 5 + 1).remainder(vocab);
  auto wfull = (torch::arange(vocab * d, torch::kFloat32).view({vocab, d}) * 0.23).cos();
  torch::nn::Linear ref(torch::nn::LinearOptions(d, vocab).bias(false));
  {
    torch::NoGradGuard no_grad;
    ref->weight.copy_(wfull);
  }
  auto x_ref = xfull.clone().requires_grad_(true);
  auto ref_loss = F::cross_entropy(ref(torch::relu(x_ref)).flatten(0, 1), target);
  ref_loss.backward();
  enum Mode { REGION_INSIDE, CHECKPOINT_INSIDE, REENTRANT_INSIDE, FORWARD_OUTSIDE, IMPLICIT_HEAD };
  MaxDiff diff;
  for (const Mode mode : {REGION_INSIDE, CHECKPOINT_INSIDE, REENTRANT_INSIDE, FORWARD_OUTSIDE, IMPLICIT_HEAD}) {
    const std::string what = mode == REGION_INSIDE       ? "region inside a selective checkpoint"
                             : mode == CHECKPOINT_INSIDE ? "selective checkpoint inside the region"
                             : mode == REENTRANT_INSIDE  ? "reentrant checkpoint inside the region"
                             : mode == FORWARD_OUTSIDE   ? "forward outside, backward inside the region"
                                                         : "checkpoint_wrapper'd head (implicit region), then the region";
    for (const int tp : {2, 3}) {
    run_ranks(tp, [&](ProcessGroupPtr) {
      auto mesh = init_device_mesh(torch::kCPU, {tp}, {"tp"});
      const auto r = chunk_range(vocab, tp, mesh->get_local_rank(0));
      torch::nn::Linear head(torch::nn::LinearOptions(d, vocab).bias(false));
      {
        torch::NoGradGuard no_grad;
        head->weight.copy_(wfull);
      }
      tp::parallelize_module(head, mesh, tp::ColwiseParallel());
      auto x = xfull.clone().requires_grad_(true);
      // relu gives the policy an op to recompute; mm is saved. (relu after the head would be a copy: cross_entropy
      // on it is the ordinary local one, as PyTorch's to_local() would give.)
      auto options = mode == REENTRANT_INSIDE
                         ? CheckpointOptions().use_reentrant(true)
                         : CheckpointOptions().context_fn([] { return create_selective_checkpoint_contexts({"aten::mm"}); });
      auto body = [&](const torch::Tensor& in) {
        auto flat = head(torch::relu(in)).flatten(0, 1);
        if (mode == FORWARD_OUTSIDE) return F::cross_entropy(flat, target.remainder(r.length));  // the local loss
        if (mode != REGION_INSIDE) return F::cross_entropy(flat, target);
        auto guard = tp::loss_parallel();
        return F::cross_entropy(flat, target);
      };
      if (mode == IMPLICIT_HEAD) {
        // The head checkpointed as an unchanged module (an implicit region, opened by its first op), the loss in
        // a region begun after the forward (PyTorch's pattern), backward after it: the loss must not be recorded
        // into the head's region (which would replay it without the region).
        checkpoint_wrapper(head.ptr());
        auto flat = head(torch::relu(x)).flatten(0, 1);
        torch::Tensor loss;
        {
          auto guard = tp::loss_parallel();
          loss = F::cross_entropy(flat, target);
        }
        loss.backward();
        diff.see(loss.detach(), ref_loss.detach(), what + ": loss");
        diff.see(head->weight.grad(), ref->weight.grad().narrow(0, r.offset, r.length), what + ": head.weight grad");
        diff.see(x.grad(), x_ref.grad(), what + ": input grad");
        return;
      }
      if (mode == FORWARD_OUTSIDE) {
        // The local loss of the local logits, checkpointed, then backward in a region: as without checkpointing.
        auto loss = checkpoint(options, body, x);
        {
          auto guard = tp::loss_parallel();
          loss.backward();
        }
        torch::nn::Linear plain(torch::nn::LinearOptions(d, r.length).bias(false));
        {
          torch::NoGradGuard no_grad;
          plain->weight.copy_(wfull.narrow(0, r.offset, r.length));
        }
        auto x_plain = xfull.clone().requires_grad_(true);
        auto want = F::cross_entropy(plain(torch::relu(x_plain)).flatten(0, 1), target.remainder(r.length));
        want.backward();
        auto x_plain_grad = x_plain.grad().clone();
        all_reduce(x_plain_grad, *mesh->get_group(0), ReduceOp::SUM).wait();  // ColwiseParallel's input gradient
        diff.see(loss.detach(), want.detach(), what + ": loss");
        diff.see(head->weight.grad(), plain->weight.grad(), what + ": head.weight grad");
        diff.see(x.grad(), x_plain_grad, what + ": input grad");
        return;
      }
      torch::Tensor loss;
      if (mode == REGION_INSIDE) {
        loss = checkpoint(options, body, x);
      } else {
        auto guard = tp::loss_parallel();
        loss = checkpoint(options, body, x);
      }
      loss.backward();  // outside the region
      diff.see(loss.detach(), ref_loss.detach(), what + ": loss");
      diff.see(head->weight.grad(), ref->weight.grad().narrow(0, r.offset, r.length), what + ": head.weight grad");
      diff.see(x.grad(), x_ref.grad(), what + ": input grad");
    });
    }
  }
  std::cout << "[loss_parallel guard] with activation checkpointing, tp 2 and 3: max |diff| " << diff.value << std::endl;
}

// Inside the guard, cross_entropy on anything but a head's output (a plain tensor, a copy of the head's output
// with class weights) is the ordinary loss, value and gradient; outside it, cross_entropy on the head's output is
// the ordinary local one (nothing changes); the guard restores the thread's dispatch state.
TEST(LossParallelGuard, UnrelatedCrossEntropyUnchanged) {
  run_ranks(2, [](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2}, {"tp"});
    torch::nn::Linear head(4, 10);
    tp::parallelize_module(head, mesh, tp::ColwiseParallel());
    auto logits = torch::randn({6, 5}, torch::TensorOptions().dtype(torch::kFloat32));
    auto target = torch::tensor({0, 4, 2, 1, 3, 0}, torch::kInt64);
    auto class_w = torch::linspace(0.5, 1.5, 5);
    auto opts = F::CrossEntropyFuncOptions().weight(class_w).label_smoothing(0.05);
    auto a = logits.clone().requires_grad_(true), b = logits.clone().requires_grad_(true);
    auto want = F::cross_entropy(a, target, opts);
    want.backward();
    auto x = torch::randn({6, 4});
    auto y = head(x);  // [6, 5] on each rank
    const bool was_included = c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::DeferredInit);
    torch::Tensor got, got_copy, want_copy;
    {
      auto guard = tp::loss_parallel();
      got = F::cross_entropy(b, target, opts);
      got_copy = F::cross_entropy(y.detach().clone(), target);  // a copy: a storage of its own
    }
    EXPECT_EQ(c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::DeferredInit), was_included);
    got.backward();
    EXPECT_TRUE(torch::equal(got, want)) << got << " vs " << want;
    EXPECT_TRUE(torch::equal(b.grad(), a.grad()));
    want_copy = F::cross_entropy(y.detach().clone(), target);
    EXPECT_TRUE(torch::equal(got_copy, want_copy)) << got_copy << " vs " << want_copy;
    // Outside the guard: the head's own output is the local logits (the ordinary local cross_entropy).
    auto outside = F::cross_entropy(head(x), target);
    EXPECT_TRUE(torch::allclose(outside, want_copy, 1e-6, 1e-6)) << outside << " vs " << want_copy;
  });
}

// Under the guard, on a head's output: class weights, a view that loses the rows (a slice of the class dim) and
// a 3-D input throw the same c10::Error on every rank, naming what was found and the fix.
TEST(LossParallelGuard, RefusalsOnEveryRank) {
  auto expect_all = [](int tp, int64_t vocab, const std::function<void(const torch::Tensor&, int64_t)>& fn,
                       const std::string& needle, bool same) {
    auto errors = run_ranks_collect(tp, [&](ProcessGroupPtr) {
      auto mesh = init_device_mesh(torch::kCPU, {tp}, {"tp"});
      torch::nn::Linear head(4, vocab);
      tp::parallelize_module(head, mesh, tp::ColwiseParallel());
      auto y = head(torch::randn({2, 3, 4}));
      auto guard = tp::loss_parallel();
      fn(y, chunk_range(vocab, tp, mesh->get_local_rank(0)).length);
    });
    for (int r = 0; r < tp; ++r) {
      EXPECT_NE(errors[r].find(needle), std::string::npos) << "rank " << r << ": " << errors[r];
      if (same) EXPECT_EQ(errors[r], errors[0]) << "rank " << r;
    }
  };
  auto target = torch::tensor({0, 1, 2, 3, 1, 0}, torch::kInt64);
  for (const auto& tv : std::vector<std::pair<int, int64_t>>{{2, 12}, {3, 12}}) {
    const int tp = tv.first;
    const int64_t vocab = tv.second;
    const bool same = true;
    expect_all(tp, vocab, [&](const torch::Tensor& y, int64_t) {
      F::cross_entropy(y.flatten(0, 1), target, F::CrossEntropyFuncOptions().weight(torch::ones({vocab})));
    }, "class weights are not supported", same);
    expect_all(tp, vocab, [&](const torch::Tensor& y, int64_t v_r) {
      F::cross_entropy(y.flatten(0, 1).narrow(1, 0, v_r - 1), target);
    }, "expected a view that keeps the head's rows", same);
    expect_all(tp, vocab, [&](const torch::Tensor& y, int64_t) {
      F::cross_entropy(y, target.view({2, 3}));
    }, "flatten a [B, T, V_r] head output with logits.flatten(0, 1)", same);
  }
}

}  // namespace
}  // namespace fsdp::testing
