// The C++ side of tests/python/test_tp_styles_vs_pytorch.py: a small model (embedding, two residual blocks of a
// user's RMSNorm and an MLP, LayerNorm, head) under the boundary styles (PrepareModuleInput on the first block,
// PrepareModuleOutput on the last, PrepareModuleInput on each MLP), SequenceParallel on the RMSNorms and the MLPs
// colwise/rowwise, on the TP group of every rank (launched by fsdprun). Weights from a formula both sides share;
// SGD steps on fixed batches; rank 0 writes one JSON line per step: the loss and every parameter's full gradient.
//   fsdprun --standalone --nproc-per-node 2 -- tp_styles_twin OUT.jsonl STEPS
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>

#include "fsdp/fsdp.h"
#include "tensor/parallel/tp_ops.h"

namespace {

constexpr int64_t kVocab = 16, kDim = 8, kHidden = 12, kBatch = 2, kSeq = 6;

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

struct BlockImpl : torch::nn::Module {
  BlockImpl() : norm(register_module("norm", RMSNorm(kDim))) { mlp = register_module("mlp", MLP()); }
  torch::Tensor forward(torch::Tensor x) { return x + mlp(norm(x)); }
  RMSNorm norm;
  fsdp::FSDPModule<MLP> mlp{nullptr};  // a call boundary for PrepareModuleInput
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    h = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) {
      blocks.push_back(Block());
      h->push_back(blocks.back());
    }
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    auto x = emb(ids);
    for (auto& b : blocks) x = b(x);
    return head(ln(x));
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::ModuleList h;
  std::vector<fsdp::FSDPModule<Block>> blocks;
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

// The parameters in name order get sin(0.7 k + i) * 0.5 (+1 for vectors): the twin's init_weights.
void init_weights(Net& net) {
  torch::NoGradGuard no_grad;
  std::map<std::string, torch::Tensor> sorted;
  for (const auto& item : net->named_parameters()) sorted[item.key()] = item.value();
  int i = 0;
  for (auto& [name, p] : sorted) {
    auto v = torch::sin(torch::arange(p.numel(), torch::kFloat64) * 0.7 + i++) * 0.5 + (p.dim() == 1 ? 1.0 : 0.0);
    p.copy_(v.to(torch::kFloat32).view_as(p));
  }
}

// The full gradient of `p` (a TP parameter's gradient is its local piece).
torch::Tensor full_grad(const torch::Tensor& p) {
  const auto* info = fsdp::tp::detail::find_tp_param(p);
  if (!info) return p.grad();
  return fsdp::DTensor(p.grad(), info->mesh, {info->placement}, info->global_shape).full_tensor();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: tp_styles_twin OUT.jsonl STEPS\n";
    return 2;
  }
  auto pg = fsdp::init_process_group();
  const int world = pg->size();
  auto mesh = fsdp::init_device_mesh(torch::kCPU, {world}, {"tp"});
  Net net;
  init_weights(net);
  using namespace fsdp::tp;
  using fsdp::Replicate;
  using fsdp::Shard;
  parallelize_module(net, mesh, {
      {"blocks.0", PrepareModuleInput().input_layouts({Replicate()}).desired_input_layouts({Shard(1)})
                       .use_local_output(true)},
      {"blocks.*.norm", SequenceParallel()},
      {"blocks.*.mlp", PrepareModuleInput().input_layouts({Shard(1)}).desired_input_layouts({Replicate()})
                           .use_local_output(true)},
      {"blocks.*.mlp.fc1", ColwiseParallel()},
      {"blocks.*.mlp.fc2", RowwiseParallel().output_layouts(Shard(1))},
      {"blocks.1", PrepareModuleOutput().output_layouts({Shard(1)}).desired_output_layouts({Replicate()})}});
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  std::ofstream out;
  if (pg->rank() == 0) out.open(argv[1]);
  const int steps = std::stoi(argv[2]);
  for (int step = 0; step < steps; ++step) {
    auto ids = (torch::arange(kBatch * kSeq, torch::kInt64) * 5 + step).remainder(kVocab).view({kBatch, kSeq});
    auto targets = (ids * 3 + 1).remainder(kVocab).view({-1});
    auto loss = torch::cross_entropy_loss(net(ids).view({-1, kVocab}), targets);
    loss.backward();
    std::ostringstream line;
    line << std::setprecision(9) << "{\"step\": " << step << ", \"loss\": " << loss.item<double>() << ", \"grads\": {";
    bool first = true;
    for (const auto& item : net->named_parameters()) {
      auto g = full_grad(item.value()).contiguous().to(torch::kFloat64);
      line << (first ? "" : ", ") << "\"" << item.key() << "\": [";
      first = false;
      for (int64_t k = 0; k < g.numel(); ++k) line << (k ? ", " : "") << g.data_ptr<double>()[k];
      line << "]";
    }
    line << "}}\n";
    if (pg->rank() == 0) out << line.str();
    opt.step();
    opt.zero_grad();
  }
  return 0;
}
