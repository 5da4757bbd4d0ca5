// DTensor ops with sharding propagation (src/tensor/dtensor_ops.cpp; CTest label: tensor_parallel): every op
// under every combination of Shard/Replicate/Partial inputs (1-D meshes of 2 and 3 ranks, a 2x2 mesh), with
// dims that do not divide by the mesh and empty shards, against the same op on full tensors in one process:
// outputs and input gradients within 1e-5 (dtensor_parity.h). Plus the error of an op without a rule.
#include <gtest/gtest.h>

#include "dtensor_parity.h"
#include "multi_rank.h"

namespace fsdp::testing::dtensor_parity {
namespace {

namespace dt = fsdp::dtensor;

class DTensorOps : public ::testing::TestWithParam<int> {};

void report(const char* what) {
  std::lock_guard<std::mutex> lock(max_diff_mutex());
  std::cout << what << ": largest difference to one process so far " << max_diff_seen() << std::endl;
}

TEST_P(DTensorOps, Pointwise) {
  run_ranks(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    const auto two = layouts(mesh, 2), one = layouts(mesh, 1);
    // [5, 7]: 5 and 7 do not divide by 2, 3 or 4; [2, 4] leaves empty shards on 3 and 4 ranks.
    for (std::vector<int64_t> shape : {std::vector<int64_t>{5, 7}, std::vector<int64_t>{2, 4}}) {
      const std::vector<int64_t> row{shape[1]}, col{shape[0], 1};
      check_op(mesh, "add", {shape, shape}, {two, two}, [](auto& x) { return x[0] + x[1]; },
               [](auto& x) { return x[0] + x[1]; });
      check_op(mesh, "sub alpha", {shape, shape}, {two, two}, [](auto& x) { return dt::sub(x[0], x[1], 2.0); },
               [](auto& x) { return torch::sub(x[0], x[1], 2.0); });
      check_op(mesh, "mul", {shape, shape}, {two, two}, [](auto& x) { return x[0] * x[1]; },
               [](auto& x) { return x[0] * x[1]; });
      check_op(mesh, "div", {shape, shape}, {two, two}, [](auto& x) { return x[0] / x[1]; },
               [](auto& x) { return x[0] / x[1]; }, {false, true});
      // Broadcasting: a row vector (bias) and a column.
      check_op(mesh, "add row", {shape, row}, {two, one}, [](auto& x) { return x[0] + x[1]; },
               [](auto& x) { return x[0] + x[1]; });
      check_op(mesh, "mul row first", {row, shape}, {one, two}, [](auto& x) { return x[0] * x[1]; },
               [](auto& x) { return x[0] * x[1]; });
      check_op(mesh, "sub col", {shape, col}, {two, two}, [](auto& x) { return x[0] - x[1]; },
               [](auto& x) { return x[0] - x[1]; });
      // Scalars and plain tensors (implicitly replicated).
      check_op(mesh, "scalars", {shape}, {two}, [](auto& x) { return (2.0 * x[0] + 1.5) / 4.0 - 0.5; },
               [](auto& x) { return (2.0 * x[0] + 1.5) / 4.0 - 0.5; });
      auto plain = full_input(row, 99, false);
      check_op(mesh, "tensor operand", {shape}, {two}, [&](auto& x) { return x[0] * plain + plain; },
               [&](auto& x) { return x[0] * plain + plain; });
      check_op(mesh, "neg", {shape}, {two}, [](auto& x) { return -x[0]; }, [](auto& x) { return -x[0]; });
      check_op(mesh, "unary", {shape}, {two},
               [](auto& x) { return dt::exp(dt::tanh(x[0])) + dt::relu(x[0]) * dt::sigmoid(x[0]) + dt::gelu(x[0]) + dt::silu(x[0]); },
               [](auto& x) { return (x[0].tanh()).exp() + x[0].relu() * x[0].sigmoid() + torch::gelu(x[0]) + torch::silu(x[0]); });
      check_op(mesh, "unary positive", {shape}, {two},
               [](auto& x) { return dt::log(x[0]) + dt::sqrt(x[0]) + dt::pow(x[0], 3) + dt::abs(dt::sin(x[0])) * dt::cos(x[0]); },
               [](auto& x) { return x[0].log() + x[0].sqrt() + x[0].pow(3) + x[0].sin().abs() * x[0].cos(); }, {true});
    }
  });
  report("pointwise");
}

TEST_P(DTensorOps, Reductions) {
  run_ranks(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    const auto two = layouts(mesh, 2), three = layouts(mesh, 3);
    for (std::vector<int64_t> shape : {std::vector<int64_t>{5, 7}, std::vector<int64_t>{2, 4}}) {
      check_op(mesh, "sum", {shape}, {two}, [](auto& x) { return dt::sum(x[0]); }, [](auto& x) { return x[0].sum(); });
      check_op(mesh, "sum 0", {shape}, {two}, [](auto& x) { return dt::sum(x[0], {0}); }, [](auto& x) { return x[0].sum(0); });
      check_op(mesh, "sum -1 keepdim", {shape}, {two}, [](auto& x) { return dt::sum(x[0], {-1}, true); },
               [](auto& x) { return x[0].sum(-1, true); });
      check_op(mesh, "mean", {shape}, {two}, [](auto& x) { return dt::mean(x[0]); }, [](auto& x) { return x[0].mean(); });
      check_op(mesh, "mean 1", {shape}, {two}, [](auto& x) { return dt::mean(x[0], {1}); }, [](auto& x) { return x[0].mean(1); });
      check_op(mesh, "max", {shape}, {two}, [](auto& x) { return dt::max(x[0]); }, [](auto& x) { return x[0].max(); });
      check_op(mesh, "min", {shape}, {two}, [](auto& x) { return dt::min(x[0]); }, [](auto& x) { return x[0].min(); });
      check_op(mesh, "max 0 values", {shape}, {two}, [](auto& x) { return std::get<0>(dt::max(x[0], 0)); },
               [](auto& x) { return std::get<0>(x[0].max(0)); });
      check_op(mesh, "max 1 indices", {shape}, {two}, [](auto& x) { return std::get<1>(dt::max(x[0], 1, true)); },
               [](auto& x) { return std::get<1>(x[0].max(1, true)); });
      check_op(mesh, "min 1 values", {shape}, {two}, [](auto& x) { return std::get<0>(dt::min(x[0], 1)); },
               [](auto& x) { return std::get<0>(x[0].min(1)); });
    }
    check_op(mesh, "sum 0,2 of 3-D", {{3, 5, 4}}, {three}, [](auto& x) { return dt::sum(x[0], {0, 2}); },
             [](auto& x) { return x[0].sum({0, 2}); });
  });
  report("reductions");
}

TEST_P(DTensorOps, Matmul) {
  run_ranks(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    const auto two = layouts(mesh, 2), three = layouts(mesh, 3);
    // Megatron's combinations and every other one, with sizes that do not divide (5 rows, 7 inner, 3 out).
    check_op(mesh, "mm", {{5, 7}, {7, 3}}, {two, two}, [](auto& x) { return dt::matmul(x[0], x[1]); },
             [](auto& x) { return torch::matmul(x[0], x[1]); });
    check_op(mesh, "3-D @ 2-D", {{2, 5, 7}, {7, 3}}, {three, two}, [](auto& x) { return dt::matmul(x[0], x[1]); },
             [](auto& x) { return torch::matmul(x[0], x[1]); });
    check_op(mesh, "batched", {{3, 2, 5}, {3, 5, 4}}, {three, three}, [](auto& x) { return dt::matmul(x[0], x[1]); },
             [](auto& x) { return torch::matmul(x[0], x[1]); });
    // linear: x [.., in] @ W [out, in]^T + b [out]; W colwise Shard(0), rowwise Shard(1), replicated.
    check_op(mesh, "linear", {{4, 7}, {5, 7}, {5}}, {two, two, layouts(mesh, 1)},
             [](auto& x) { return dt::linear(x[0], x[1], x[2]); },
             [](auto& x) { return torch::nn::functional::linear(x[0], x[1], x[2]); });
  });
  report("matmul");
}

TEST_P(DTensorOps, ShapeOps) {
  run_ranks(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    const auto two = layouts(mesh, 2), three = layouts(mesh, 3);
    check_op(mesh, "transpose", {{5, 7}}, {two}, [](auto& x) { return dt::transpose(x[0], 0, 1); },
             [](auto& x) { return x[0].transpose(0, 1); });
    check_op(mesh, "permute", {{3, 5, 2}}, {three}, [](auto& x) { return dt::permute(x[0], {2, 0, 1}); },
             [](auto& x) { return x[0].permute({2, 0, 1}); });
    // Reshapes that keep the sharded dim: [5, 3, 4] -> [5, 12] keeps dim 0; [6, 5] -> [2, 3, 5] keeps dim 1.
    std::vector<Placements> dim0, dim1;
    for (const auto& ps : three) {
      bool ok0 = true, ok1 = true;
      for (const auto& p : ps) ok0 = ok0 && !(p.is_shard() && p.dim != 0);
      for (const auto& p : ps) ok1 = ok1 && !(p.is_shard() && p.dim != 1);
      if (ok0) dim0.push_back(ps);
    }
    for (const auto& ps : two) {
      bool ok1 = true;
      for (const auto& p : ps) ok1 = ok1 && !(p.is_shard() && p.dim != 1);
      if (ok1) dim1.push_back(ps);
    }
    check_op(mesh, "view", {{5, 3, 4}}, {dim0}, [](auto& x) { return dt::view(x[0], {5, -1}); },
             [](auto& x) { return x[0].view({5, -1}); });
    check_op(mesh, "reshape", {{6, 5}}, {dim1}, [](auto& x) { return dt::reshape(dt::transpose(x[0], 0, 1), {5, 2, 3}); },
             [](auto& x) { return x[0].transpose(0, 1).reshape({5, 2, 3}); });
    check_op(mesh, "cat 0", {{5, 3}, {2, 3}}, {two, two}, [](auto& x) { return dt::cat({x[0], x[1]}, 0); },
             [](auto& x) { return torch::cat({x[0], x[1]}, 0); });
    check_op(mesh, "cat -1", {{5, 3}, {5, 4}}, {two, two}, [](auto& x) { return dt::cat({x[0], x[1]}, -1); },
             [](auto& x) { return torch::cat({x[0], x[1]}, -1); });
    for (int64_t d : {0, 1}) {
      // [7, 5] in pieces of 3: 3, 3, 1 rows (the last shorter than a 3-rank chunk) or 3, 2 columns.
      for (int piece = 0; piece < (d == 0 ? 3 : 2); ++piece) {
        check_op(mesh, "split", {{7, 5}}, {two}, [&](auto& x) { return dt::split(x[0], 3, d)[piece] * 2.0; },
                 [&](auto& x) { return x[0].split(3, d)[piece] * 2.0; });
      }
    }
    check_op(mesh, "softmax", {{5, 7}}, {two}, [](auto& x) { return dt::softmax(x[0], 1); },
             [](auto& x) { return torch::softmax(x[0], 1); });
    check_op(mesh, "log_softmax", {{5, 7}}, {two}, [](auto& x) { return dt::log_softmax(x[0], 0); },
             [](auto& x) { return torch::log_softmax(x[0], 0); });
  });
  report("shape ops");
}

// A small MLP as DTensor ops (colwise then rowwise, the Megatron block) trained by hand: gradients of the
// local weight shards equal one process's, chained through relu, softmax and mean.
TEST_P(DTensorOps, MegatronChain) {
  run_ranks(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    auto x = full_input({6, 5}, 1, false), w1 = full_input({7, 5}, 2, false), w2 = full_input({3, 7}, 3, false);
    auto b1 = full_input({7}, 4, false);
    std::vector<torch::Tensor> ref{w1.clone().requires_grad_(), w2.clone().requires_grad_(), b1.clone().requires_grad_()};
    auto ref_out = torch::softmax(torch::nn::functional::linear(torch::relu(torch::nn::functional::linear(x, ref[0], ref[2])), ref[1]), -1).mean();
    ref_out.backward();
    const int64_t last = mesh->ndim() - 1;
    Placements col(mesh->ndim(), Replicate()), row(mesh->ndim(), Replicate()), rep(mesh->ndim(), Replicate());
    col[last] = Shard(0);
    row[last] = Shard(1);
    auto W1 = leaf(w1, mesh, col), W2 = leaf(w2, mesh, row), B1 = leaf(b1, mesh, col);
    auto X = distribute_tensor(x, mesh, rep);
    auto h = dt::relu(dt::linear(X, W1, B1));  // Shard(-1)
    EXPECT_EQ(h.placements()[last], Shard(1));
    auto y = dt::linear(h, W2);  // Partial(sum)
    EXPECT_EQ(y.placements()[last], Partial());
    auto loss = dt::mean(dt::softmax(y, -1));
    auto l = loss.full_tensor();
    EXPECT_NEAR(l.item<double>(), ref_out.item<double>(), 1e-6);
    l.backward();
    for (auto [t, r] : std::vector<std::pair<DTensor, torch::Tensor>>{{W1, ref[0]}, {W2, ref[1]}, {B1, ref[2]}}) {
      auto expect = distribute_tensor(r.grad(), mesh, t.placements(), std::nullopt).to_local();
      note_diff(t.to_local().grad(), expect);
      EXPECT_TRUE(torch::allclose(t.to_local().grad(), expect, 1e-5, 1e-6)) << t.str();
    }
  });
  report("megatron chain");
}

// An op without a rule raises on every rank, naming the op, the placements and the fix.
TEST_P(DTensorOps, NoRuleError) {
  auto errors = run_ranks_collect(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    Placements ps(mesh->ndim(), Replicate());
    ps[0] = Shard(0);
    auto t = distribute_tensor(full_input({4, 6}, 5, false), mesh, ps);
    dt::view(t, {24});
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("fsdp::DTensor: no sharding rule for aten::view with placements input 0 [Shard(dim=0)"), std::string::npos) << e;
    EXPECT_NE(e.find("splits or merges sharded dim 0"), std::string::npos) << e;
    EXPECT_NE(e.find("Fix: redistribute mesh dim 0 to Replicate()"), std::string::npos) << e;
  }
  auto errors2 = run_ranks_collect(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    auto a = dt::zeros({4}, mesh), b = dt::zeros({4, 2}, mesh);
    dt::matmul(a, b);
  });
  for (const auto& e : errors2) EXPECT_NE(e.find("no sharding rule for aten::matmul"), std::string::npos) << e;
}

INSTANTIATE_TEST_SUITE_P(Ranks, DTensorOps, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return info.param == 4 ? std::string("Mesh2x2") : "World" + std::to_string(info.param); });

}  // namespace
}  // namespace fsdp::testing::dtensor_parity
