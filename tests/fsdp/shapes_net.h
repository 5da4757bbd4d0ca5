// A model with every shape of issue 17 item 1 (test_multi_use_modules.cpp): an embedding whose weight is tied
// to the output projection (one group of two modules), a block called twice, a Linear called twice on an input
// without gradient, a branch that feeds only a frozen module, a detached one and the root's own parameter; its
// SmallBlock serves other tests too. Namespace fsdp::testing::shapes_net.
#pragma once

#include "fsdp_test_model.h"

namespace fsdp::testing::shapes_net {

// ---- A model with every shape of item 1 ------------------------------------------------------------
// dims 5 and 7: not divisible by 2, 3 or 4 (uneven and empty shards).
inline constexpr int64_t kV = 7, kD = 5;

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

}  // namespace fsdp::testing::shapes_net
