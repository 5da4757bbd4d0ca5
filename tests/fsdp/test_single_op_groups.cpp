// Groups whose forward is a single op (issue 28, item 1): fully_shard on a module that runs only a
// LayerNorm, torch::layer_norm, BatchNorm1d, an embedding, a conv, a linear or an elementwise op, as
// unchanged LibTorch modules (implicit groups: the interception hooks the autograd node the op creates,
// and that node is the group's only way into its backward). Found: the hook was skipped when a new
// node sat at the address of the previous step's freed node, so from step 2 on a group's backward
// never ran (its full-size gradient reached the optimizer, or the ranks disagreed). Trained 10 steps on
// 2 and 3 ranks (16 features: uneven on 3), reshard_after_forward true and false, against the
// single-process run on the same global batches: losses, full gradients each step and final parameters.
// See [Note: identity by address] (src/fsdp/fsdp_interception.cpp).
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "unchanged_models.h"

namespace fsdp::testing {
namespace {

constexpr int64_t kC = 16;

// One parameterised elementwise op: x * w.
struct ScaleImpl : torch::nn::Module {
  torch::Tensor w;
  ScaleImpl() { w = register_parameter("w", torch::linspace(0.5, 1.5, kC)); }
  torch::Tensor forward(const torch::Tensor& x) { return x * w; }
};
TORCH_MODULE(Scale);

// torch::layer_norm called directly on the module's own parameters.
struct FunctionalNormImpl : torch::nn::Module {
  torch::Tensor weight, bias;
  FunctionalNormImpl() {
    weight = register_parameter("weight", torch::linspace(0.8, 1.2, kC));
    bias = register_parameter("bias", torch::linspace(-0.1, 0.1, kC));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::layer_norm(x, {kC}, weight, bias); }
};
TORCH_MODULE(FunctionalNorm);

// Every member is its own group and runs exactly one op; the root keeps the head and the transposes.
struct OneOpNetImpl : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc{nullptr}, head{nullptr};
  Scale scale{nullptr};
  FunctionalNorm fln{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::nn::Conv1d conv{nullptr};
  OneOpNetImpl() {
    emb = register_module("emb", torch::nn::Embedding(kVocab, kC));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kC})));
    fc = register_module("fc", torch::nn::Linear(kC, kC));
    scale = register_module("scale", Scale());
    fln = register_module("fln", FunctionalNorm());
    // Eval mode: normalised with the running statistics, so a rank's batch gives the global batch's
    // numbers (train mode would normalise each rank's batch by its own statistics).
    bn = register_module("bn", torch::nn::BatchNorm1d(kC));
    bn->eval();
    conv = register_module("conv", torch::nn::Conv1d(torch::nn::Conv1dOptions(kC, kC, 3).padding(1)));
    head = register_module("head", torch::nn::Linear(kC, kClasses));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = scale(fc(ln(emb(idx))));
    x = fln(x).transpose(1, 2);  // [B, C, T]
    x = conv(bn(x)).transpose(1, 2);
    return head(x);
  }
};
TORCH_MODULE(OneOpNet);

Model make_model() { return as_model(seeded<OneOpNet>()); }

void shard_each(const Model& m, const FullyShardOptions& o) {
  auto net = std::dynamic_pointer_cast<OneOpNetImpl>(m.module);
  fully_shard(net->emb, o);
  fully_shard(net->ln, o);
  fully_shard(net->fc, o);
  fully_shard(net->scale, o);
  fully_shard(net->fln, o);
  fully_shard(net->bn, o);
  fully_shard(net->conv, o);
  fully_shard(m.module, o);
}

class OneOpGroups : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(OneOpGroups, TrainLikeOneProcessForTenSteps) {
  const auto [ws, raf] = GetParam();
  const auto batches = make_batches(/*steps=*/10, /*batch=*/6, /*seq=*/5);
  const Reference ref = reference_run(make_model, batches);
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    Model m = make_model();
    auto mesh = init_device_mesh(torch::kCPU, {ws}, {}, pg);
    shard_each(m, FullyShardOptions().mesh(mesh).reshard_after_forward(raf));
    Trace t = train_sharded(m, pg, batches);
    // The full state dict also holds bn's buffers (its running statistics, unchanged in eval mode); the
    // reference's snapshot holds the parameters only.
    for (auto it = t.final_params.begin(); it != t.final_params.end();) {
      it = ref.final_params.count(it->first) ? std::next(it) : t.final_params.erase(it);
    }
    EXPECT_EQ(t.final_params.size(), ref.final_params.size());
    expect_parity(t, ref, std::to_string(ws) + " ranks, reshard_after_forward " + (raf ? "true" : "false") +
                              ", rank " + std::to_string(pg->rank()));
  });
}

INSTANTIATE_TEST_SUITE_P(WorldAndReshard, OneOpGroups,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& i) {
                           return "ws" + std::to_string(std::get<0>(i.param)) +
                                  (std::get<1>(i.param) ? "_reshard" : "_keep");
                         });

}  // namespace
}  // namespace fsdp::testing
