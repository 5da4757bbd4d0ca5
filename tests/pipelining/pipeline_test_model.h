// A tiny Sequential model for the pipelining tests, its one-process reference run, and the pipelined
// run's comparison with it. Names live in fsdp::testing::pipeline_test_model.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/pipelining/schedules.h"
#include "fsdp/pipelining/split.h"

namespace fsdp::testing::pipeline_test_model {

constexpr int64_t kIn = 12, kHidden = 20, kOut = 6;

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t in) : fc(register_module("fc", torch::nn::Linear(in, kHidden))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(fc->forward(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

/// n_children blocks: Linear+Tanh blocks ("0.fc.weight", ...), the last a Linear to kOut.
inline torch::nn::Sequential make_model(int n_children) {
  torch::nn::Sequential seq;
  for (int i = 0; i < n_children; ++i) {
    const int64_t in = i == 0 ? kIn : kHidden;
    if (i + 1 == n_children) {
      seq->push_back(std::to_string(i), torch::nn::Linear(in, kOut));
    } else {
      seq->push_back(std::to_string(i), Block(in));
    }
  }
  return seq;
}

using Weights = std::map<std::string, torch::Tensor>;

inline Weights initial_weights(int n_children, uint64_t seed = 7) {
  torch::manual_seed(seed);
  auto m = make_model(n_children);
  Weights w;
  for (auto& p : m->named_parameters()) w[p.key()] = p.value().detach().clone();
  return w;
}

inline void load(torch::nn::Module& m, const Weights& w) {
  torch::NoGradGuard g;
  for (auto& p : m.named_parameters()) p.value().copy_(w.at(p.key()));
}

inline torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

struct Batch {
  torch::Tensor x, y;
};
inline std::vector<Batch> batches(int steps, int64_t batch, uint64_t seed = 11) {
  torch::manual_seed(seed);
  std::vector<Batch> out;
  for (int i = 0; i < steps; ++i) out.push_back({torch::randn({batch, kIn}), torch::randn({batch, kOut})});
  return out;
}

/// One process, whole batch: per step the loss, the gradients (by FQN), then AdamW; and the final weights.
struct Reference {
  std::vector<double> losses;
  std::vector<Weights> grads;
  Weights final_weights;
};
inline Reference reference(int n_children, const std::vector<Batch>& data, double lr = 1e-2) {
  auto m = make_model(n_children);
  load(*m, initial_weights(n_children));
  torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(lr));
  Reference r;
  for (const auto& b : data) {
    opt.zero_grad();
    auto loss = mse(m->forward(b.x), b.y);
    loss.backward();
    r.losses.push_back(loss.item<double>());
    Weights g;
    for (auto& p : m->named_parameters()) g[p.key()] = p.value().grad().clone();
    r.grads.push_back(g);
    opt.step();
  }
  for (auto& p : m->named_parameters()) r.final_weights[p.key()] = p.value().detach().clone();
  return r;
}

inline void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what,
                         double rtol = 1e-5, double atol = 1e-7) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got - want).abs().max().item<double>();
  const double tol = atol + rtol * want.abs().max().item<double>();
  EXPECT_LE(err, tol) << what << ": max abs difference " << err << " > " << tol;
}

}  // namespace fsdp::testing::pipeline_test_model
