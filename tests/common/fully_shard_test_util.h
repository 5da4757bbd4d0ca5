// Shared by the fully_shard tests (tests/fsdp: training, initialisation, communication, memory, ...): the
// parity tolerances, the single-process reference run, the sharded model builder and run_parity, which trains
// the sharded model against the reference.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "fsdp_test_model.h"
#include "multi_rank.h"

namespace fsdp::testing {

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

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::vector<torch::Tensor>& params, Opt opt) {
  if (opt == Opt::SGD) return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
}

inline std::map<std::string, torch::Tensor> initial_weights() {
  static std::map<std::string, torch::Tensor> w = [] {
    torch::manual_seed(7);
    Net net;
    return snapshot(*net);
  }();
  return w;
}

// Trains the unsharded model on the global batches. `microbatches` > 1 splits each batch into that
// many pieces whose losses are divided by their number (gradient accumulation, same result).
inline Reference run_reference(const std::vector<Batch>& batches, int calls_per_block = 1, Opt opt_kind = Opt::ADAMW) {
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
inline double compare_gradients(torch::nn::Module& net, const DeviceMeshPtr& mesh, const std::vector<Placement>& placements,
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
inline Net build_sharded(const ShardConfig& cfg, ProcessGroupPtr pg) {
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

// ---- The parity harness of the training tests (test_training.cpp and the features that check parity) ----

// Trains a sharded model on this rank's slice of each global batch; checks every step's loss, full
// gradients and gradient norm, and the final parameters against the reference. Returns the largest
// relative loss difference, |param diff| and |grad diff| seen.
inline std::tuple<double, double, double> train_and_compare(const ShardConfig& cfg, ProcessGroupPtr pg,
                                                            const std::vector<Batch>& batches,
                                                            const Reference& ref) {
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

// Every parameter's full gradient at `step` (sharded_grad(p)->full_tensor(): a collective over the parameter's
// mesh, any placements) against the reference's, at kGradRtol / kGradAtol.
inline void expect_gradients_match(torch::nn::Module& net, const Reference& ref, size_t step, const std::string& what) {
  for (const auto& p : net.named_parameters()) {
    auto g = sharded_grad(p.value());
    ASSERT_TRUE(g.has_value()) << p.key() << " has no gradient at step " << step << " (" << what << ")";
    auto full = g->full_tensor();
    const auto& expect = ref.grads[step].at(p.key());
    EXPECT_TRUE(torch::allclose(full, expect, kGradRtol, kGradAtol))
        << "gradient of " << p.key() << " at step " << step << " (" << what << "): max |diff| "
        << max_abs_diff(full, expect);
  }
}

// Every parameter's full value (sharded_param(p).full_tensor()) against `expect`, at kRtol / kAtol.
inline void expect_params_match(torch::nn::Module& net, const std::map<std::string, torch::Tensor>& expect,
                                const std::string& what) {
  for (const auto& p : net.named_parameters()) {
    auto full = sharded_param(p.value()).full_tensor();
    EXPECT_TRUE(torch::allclose(full, expect.at(p.key()), kRtol, kAtol))
        << p.key() << " after training (" << what << "): max |diff| " << max_abs_diff(full, expect.at(p.key()));
  }
}

// Trains `net` (already sharded or replicated, on any mesh) with this rank of `pg` on its slice of each global
// batch, AdamW as run_reference; checks every step's full gradients and the final parameters against `ref`.
// `around(step, after)` runs before each forward (after = false) and after each backward (collective counts).
inline void train_vs_reference(ProcessGroupPtr pg, Net& net, const std::vector<Batch>& batches, const Reference& ref,
                               const std::string& what, const std::function<void(size_t, bool)>& around = {}) {
  FSDPModule<Net> model(net);
  auto opt = make_optimizer(net->parameters(), Opt::ADAMW);
  const int64_t local = kBatch / pg->size();
  for (size_t step = 0; step < batches.size(); ++step) {
    auto b = batches[step].slice(pg->rank() * local, local);
    opt->zero_grad();
    if (around) around(step, false);
    loss_fn(model(b.idx), b.targets).backward();
    if (around) around(step, true);
    expect_gradients_match(*net, ref, step, what);
    opt->step();
  }
  expect_params_match(*net, ref.final_params, what);
}

inline void run_parity(int ws, const ShardConfig& cfg) {
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

}  // namespace fsdp::testing
