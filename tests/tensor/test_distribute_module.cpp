// distribute_module and local_map (src/tensor/distribute_module.cpp; CTest label: tensor_parallel): parameters
// replaced by their shards under the same names (rank 0's values), the rest replicated from rank 0, the
// module's forward through the returned wrapper with input_fn/output_fn, and a tensor-parallel MLP written with
// DTensor ops on parameter_dtensor() whose gradients equal one process's; local_map's placements and errors.
#include <gtest/gtest.h>

#include "dtensor_parity.h"
#include "multi_rank.h"

namespace fsdp::testing::dtensor_parity {
namespace {

namespace dt = fsdp::dtensor;

class DTensorDistributeModule : public ::testing::TestWithParam<int> {};
class DTensorLocalMap : public ::testing::TestWithParam<int> {};

std::string param_name(const ::testing::TestParamInfo<int>& info) {
  return info.param == 4 ? std::string("Mesh2x2") : "World" + std::to_string(info.param);
}

torch::nn::Sequential make_mlp(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(5, 7), torch::nn::ReLU(), torch::nn::Linear(7, 3));
}

TEST_P(DTensorDistributeModule, PartitionAndForward) {
  static std::mutex seed_mu;  // ranks are threads sharing the default generator
  run_ranks(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    const int64_t n = mesh->ndim(), last = n - 1;
    torch::nn::Sequential model{nullptr}, ref{nullptr};
    {
      std::lock_guard<std::mutex> lock(seed_mu);
      model = make_mlp(100 + pg->rank());  // different weights on every rank: rank 0's must win
      ref = make_mlp(100 + mesh->ranks()[0]);
    }
    auto names_before = model->named_parameters().keys();
    Placements col(n, Replicate()), row(n, Replicate());
    col[last] = Shard(0);
    row[last] = Shard(1);
    auto dm = distribute_module(
        model, mesh,
        [&](const std::string& name, torch::nn::Module& m, const DeviceMeshPtr& mesh) {
          if (name == "0") {
            distribute_parameter(m, "weight", mesh, col);
            distribute_parameter(m, "bias", mesh, col);
          } else if (name == "2") {
            distribute_parameter(m, "weight", mesh, row);  // "2.bias" is left: replicated
          }
        },
        // input_fn: the module receives twice its input; output_fn: the caller gets the output plus one.
        [](torch::nn::Module&, std::vector<torch::Tensor> in, const DeviceMeshPtr&) {
          for (auto& t : in) t = t * 2;
          return in;
        },
        [](torch::nn::Module&, torch::Tensor out, const DeviceMeshPtr&) { return out + 1; });
    EXPECT_EQ(model->named_parameters().keys(), names_before);
    auto params = model->named_parameters();
    auto ref_params = ref->named_parameters();
    for (const auto& p : params) {
      SCOPED_TRACE(p.key());
      auto d = parameter_dtensor(p.value());
      ASSERT_TRUE(d.has_value());
      EXPECT_TRUE(p.value().requires_grad());
      EXPECT_TRUE(torch::equal(d->full_tensor(), ref_params[p.key()]));
      const auto expect_ps = p.key() == "0.weight" || p.key() == "0.bias" ? col : p.key() == "2.weight" ? row : Placements(n, Replicate());
      EXPECT_EQ(d->placements(), expect_ps);
      EXPECT_TRUE(torch::equal(p.value(), distribute_tensor(ref_params[p.key()], mesh, expect_ps, std::nullopt).to_local()));
    }
    EXPECT_FALSE(parameter_dtensor(torch::zeros({2})).has_value());
    auto x = full_input({4, 5}, 61, false);
    // A tensor-parallel forward with DTensor ops on the parameters: gradients reach the registered parameters.
    auto w1 = *parameter_dtensor(model[0]->as<torch::nn::Linear>()->weight);
    auto b1 = *parameter_dtensor(model[0]->as<torch::nn::Linear>()->bias);
    auto w2 = *parameter_dtensor(model[2]->as<torch::nn::Linear>()->weight);
    auto b2 = *parameter_dtensor(model[2]->as<torch::nn::Linear>()->bias);
    auto X = distribute_tensor(x, mesh, Placements(n, Replicate()));
    auto y = dt::linear(dt::relu(dt::linear(X, w1, b1)), w2, b2);
    auto loss = (y.full_tensor() * full_input({4, 3}, 62, false)).sum();
    auto ref_loss = (ref->forward(x) * full_input({4, 3}, 62, false)).sum();
    EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-5);
    loss.backward();
    ref_loss.backward();
    for (const auto& p : params) {
      auto d = *parameter_dtensor(p.value());
      auto expect = distribute_tensor(ref_params[p.key()].grad(), mesh, d.placements(), std::nullopt).to_local();
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      note_diff(p.value().grad(), expect);
      EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6)) << p.key();
    }
    // input_fn/output_fn through the wrapper: a replicated module gives ref(2x) + 1.
    torch::nn::Linear lin{nullptr}, lin_ref{nullptr};
    {
      std::lock_guard<std::mutex> lock(seed_mu);
      torch::manual_seed(200 + pg->rank());
      lin = torch::nn::Linear(5, 2);
      torch::manual_seed(200 + mesh->ranks()[0]);
      lin_ref = torch::nn::Linear(5, 2);
    }
    auto wrapped = distribute_module(
        lin, mesh, nullptr,
        [](torch::nn::Module&, std::vector<torch::Tensor> in, const DeviceMeshPtr&) {
          for (auto& t : in) t = t * 2;
          return in;
        },
        [](torch::nn::Module&, torch::Tensor out, const DeviceMeshPtr&) { return out + 1; });
    EXPECT_TRUE(torch::allclose(wrapped(x), lin_ref(x * 2) + 1, 1e-5, 1e-6));
  });
}

TEST_P(DTensorDistributeModule, Errors) {
  auto errors = run_ranks_collect(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    distribute_module(torch::nn::Linear(3, 2), mesh, [](const std::string&, torch::nn::Module& m, const DeviceMeshPtr& mesh) {
      distribute_parameter(m, "weights", mesh, Placements(mesh->ndim(), Shard(0)));
    });
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("distribute_parameter: torch::nn::LinearImpl has no parameter \"weights\" of its own (it has: weight, bias)"),
              std::string::npos) << e;
  }
}

TEST_P(DTensorLocalMap, Placements) {
  run_ranks(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    const int64_t n = mesh->ndim();
    auto full = full_input({7, 4}, 71, false), w = full_input({7, 4}, 72, false);
    auto x = leaf(full, mesh, Placements(n, Shard(0)));
    // A row-wise function on local rows: out Shard(0), and a per-rank partial sum: out Partial.
    auto f = local_map(
        [](const std::vector<torch::Tensor>& t) { return std::vector<torch::Tensor>{t[0].relu() * 2, t[0].sum(0)}; },
        {Placements(n, Shard(0)), Placements(n, Partial())}, std::vector<OptionalPlacements>{Placements(n, Shard(0))});
    auto outs = f({x});
    ASSERT_EQ(outs.size(), 2u);
    EXPECT_EQ(outs[0].sizes(), (std::vector<int64_t>{7, 4}));
    EXPECT_TRUE(torch::allclose(outs[0].full_tensor(), full.relu() * 2));
    EXPECT_TRUE(torch::allclose(outs[1].full_tensor(), full.sum(0), 1e-5, 1e-5));
    (outs[0].full_tensor() * w).sum().backward();
    auto expect = distribute_tensor((full > 0).to(torch::kFloat) * 2 * w, mesh, Placements(n, Shard(0)), std::nullopt).to_local();
    EXPECT_TRUE(torch::allclose(x.to_local().grad(), expect));
    // A replicated input where Shard(0) is expected: an error, or a redistribution when asked for.
    auto rep = leaf(full, mesh, Placements(n, Replicate()));
    auto g = local_map([](const std::vector<torch::Tensor>& t) { return std::vector<torch::Tensor>{t[0] * 3}; },
                       {Placements(n, Shard(0))}, std::vector<OptionalPlacements>{Placements(n, Shard(0))}, nullptr, true);
    EXPECT_TRUE(torch::allclose(g({rep})[0].full_tensor(), full * 3));
    auto strict = local_map([](const std::vector<torch::Tensor>& t) { return t; }, {Placements(n, Shard(0))},
                            std::vector<OptionalPlacements>{Placements(n, Shard(0))});
    try {
      strict({rep});
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("local_map: input 0 has placements [Replicate()"), std::string::npos) << e.what();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, DTensorDistributeModule, ::testing::Values(2, 3, 4), param_name);
INSTANTIATE_TEST_SUITE_P(Ranks, DTensorLocalMap, ::testing::Values(2, 3, 4), param_name);

}  // namespace
}  // namespace fsdp::testing::dtensor_parity
