// DTensor as a tensor (CTest label: tensor_parallel): autograd through redistribute, to_local(grad_placements),
// full_tensor(grad_placements) and from_local against one process; Partial with sum/avg/max/min;
// distribute_tensor's broadcast from src_data_rank; the factories (rand/randn equal one process's draw).
// 1-D meshes of 2 and 3 ranks and a 2x2 mesh, dims that do not divide and empty shards.
#include <gtest/gtest.h>

#include "dtensor_parity.h"
#include "multi_rank.h"

namespace fsdp::testing::dtensor_parity {
namespace {

namespace dt = fsdp::dtensor;

class DTensorAutograd : public ::testing::TestWithParam<int> {};
class DTensorPartialOps : public ::testing::TestWithParam<int> {};
class DTensorDistribute : public ::testing::TestWithParam<int> {};
class DTensorFactories : public ::testing::TestWithParam<int> {};

std::string param_name(const ::testing::TestParamInfo<int>& info) {
  return info.param == 4 ? std::string("Mesh2x2") : "World" + std::to_string(info.param);
}

// Every source -> target pair (Shard(0), Shard(1), Replicate, Partial per mesh dim): the gradient of the
// source's local tensor through redistribute and full_tensor equals the chunk of one process's gradient.
TEST_P(DTensorAutograd, RedistributeAllPairs) {
  run_ranks(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    std::vector<Placements> all;
    const std::vector<Placement> one{Shard(0), Shard(1), Replicate(), Partial()};
    if (mesh->ndim() == 1) {
      for (auto& p : one) all.push_back({p});
    } else {
      for (auto& p : one)
        for (auto& q : one) all.push_back({p, q});
    }
    for (std::vector<int64_t> shape : {std::vector<int64_t>{5, 3}, std::vector<int64_t>{2, 7}}) {
      auto full = full_input(shape, 11, false);
      auto w = full_input(shape, 12, false);
      for (const auto& from : all) {
        for (const auto& to : all) {
          SCOPED_TRACE(describe(from) + " -> " + describe(to) + " rank " + std::to_string(pg->rank()));
          auto src = leaf(full, mesh, from);
          auto out = src.redistribute(to);
          EXPECT_EQ(out.placements(), to);
          auto got = out.full_tensor();
          note_diff(got, full);
          EXPECT_TRUE(torch::allclose(got, full, 1e-5, 1e-6));
          (got * w).sum().backward();
          auto expect = distribute_tensor(w, mesh, grad_layout(from), std::nullopt).to_local();
          ASSERT_TRUE(src.to_local().grad().defined());
          EXPECT_TRUE(torch::equal(src.to_local().grad(), expect)) << src.to_local().grad() << "\nexpected\n" << expect;
        }
      }
    }
  });
}

// to_local(grad_placements) and full_tensor(grad_placements): each rank's loss covers a different part, so
// the gradient of the replicated value is the sum of the ranks' gradients (Partial); backward reduces it
// into the source's layout (Shard: a reduce-scatter, Replicate: an all-reduce).
TEST_P(DTensorAutograd, GradPlacements) {
  run_ranks(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    const int64_t n = mesh->ndim();
    auto full = full_input({5, 3}, 21, false);
    // Rank r's loss weight; the global loss is the sum over ranks.
    auto w_of = [&](int r) { return full_input({5, 3}, 100 + r, false); };
    auto w_sum = torch::zeros({5, 3});
    for (int r = 0; r < pg->size(); ++r) w_sum += w_of(r);
    for (Placements from : {Placements(n, Shard(0)), Placements(n, Replicate()), Placements(n, Shard(1))}) {
      SCOPED_TRACE(describe(from));
      {  // to_local of a replicated DTensor with Partial gradients.
        auto src = leaf(full, mesh, from);
        auto rep = src.redistribute(Placements(n, Replicate()));
        (rep.to_local(Placements(n, Partial())) * w_of(pg->rank())).sum().backward();
        auto expect = distribute_tensor(w_sum, mesh, from, std::nullopt).to_local();
        note_diff(src.to_local().grad(), expect);
        EXPECT_TRUE(torch::allclose(src.to_local().grad(), expect, 1e-5, 1e-5));
      }
      {  // full_tensor with Partial gradients.
        auto src = leaf(full, mesh, from);
        (src.full_tensor(Placements(n, Partial())) * w_of(pg->rank())).sum().backward();
        auto expect = distribute_tensor(w_sum, mesh, from, std::nullopt).to_local();
        EXPECT_TRUE(torch::allclose(src.to_local().grad(), expect, 1e-5, 1e-5));
      }
      {  // to_local of a sharded DTensor whose gradient the caller produces replicated: the chunk is taken.
        auto src = leaf(full, mesh, from);
        auto sharded = src.redistribute(Placements(n, Shard(0)));
        auto w = w_of(0);
        auto mine = distribute_tensor(w, mesh, Placements(n, Shard(0)), std::nullopt).to_local();
        (sharded.to_local() * mine).sum().backward();
        auto expect = distribute_tensor(w, mesh, from, std::nullopt).to_local();
        EXPECT_TRUE(torch::allclose(src.to_local().grad(), expect, 1e-5, 1e-6));
      }
    }
  });
}

// from_local: gradients reach the caller's local tensors through redistribute and ops.
TEST_P(DTensorAutograd, FromLocal) {
  run_ranks(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    const int64_t n = mesh->ndim();
    auto full = full_input({7, 4}, 31, false), w = full_input({7, 4}, 32, false);
    auto local = distribute_tensor(full, mesh, Placements(n, Shard(0)), std::nullopt).to_local().clone().requires_grad_();
    auto d = DTensor::from_local(local, mesh, Placements(n, Shard(0)));
    EXPECT_EQ(d.sizes(), (std::vector<int64_t>{7, 4}));
    auto y = dt::exp(d).full_tensor();
    (y * w).sum().backward();
    auto expect = distribute_tensor(full.exp() * w, mesh, Placements(n, Shard(0)), std::nullopt).to_local();
    EXPECT_TRUE(torch::allclose(local.grad(), expect, 1e-5, 1e-6));
    // Partial from_local: the gradient of each summand is the whole gradient.
    auto part = torch::full({3}, 1.0f + pg->rank()).requires_grad_();
    auto p = DTensor::from_local(part, mesh, Placements(n, Partial()));
    auto total = p.full_tensor();
    float expect_sum = 0;
    for (int r = 0; r < pg->size(); ++r) expect_sum += 1.0f + r;
    EXPECT_TRUE(torch::allclose(total, torch::full({3}, expect_sum)));
    (total * w[0].narrow(0, 0, 3)).sum().backward();
    EXPECT_TRUE(torch::allclose(part.grad(), w[0].narrow(0, 0, 3)));
  });
}

// Partial with each reduce op: -> Replicate, -> Shard (uneven), Replicate -> Partial(op), Partial(a) ->
// Partial(b); str() and equality.
TEST_P(DTensorPartialOps, ReduceOps) {
  EXPECT_EQ(Partial().str(), "Partial(sum)");
  EXPECT_EQ(Partial("avg").str(), "Partial(avg)");
  EXPECT_EQ(Partial(), Partial("sum"));
  EXPECT_NE(Partial("max"), Partial("min"));
  EXPECT_THROW(Partial("prod"), c10::Error);
  run_ranks(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    const int64_t n = mesh->ndim();
    // Rank-dependent locals: rank r holds base + r * step (same shape everywhere).
    auto base = full_input({5, 3}, 41, false), step = full_input({5, 3}, 42, false);
    std::vector<torch::Tensor> locals;
    for (int r = 0; r < pg->size(); ++r) locals.push_back(base + r * step);
    auto stack = torch::stack(locals);
    const std::map<std::string, torch::Tensor> expect{{"sum", stack.sum(0)},
                                                      {"avg", stack.mean(0)},
                                                      {"max", std::get<0>(stack.max(0))},
                                                      {"min", std::get<0>(stack.min(0))}};
    for (const std::string op : {"sum", "avg", "max", "min"}) {
      SCOPED_TRACE(op);
      auto d = DTensor(locals[pg->rank()], mesh, Placements(n, Partial(op)), {5, 3});
      auto rep = d.redistribute(Placements(n, Replicate()));
      note_diff(rep.to_local(), expect.at(op));
      EXPECT_TRUE(torch::allclose(rep.to_local(), expect.at(op), 1e-5, 1e-5)) << rep.to_local() << expect.at(op);
      for (int64_t k : {0, 1}) {
        auto sh = d.redistribute(Placements(n, Shard(k)));
        EXPECT_TRUE(torch::allclose(sh.full_tensor(), expect.at(op), 1e-5, 1e-5));
        auto mine = distribute_tensor(expect.at(op), mesh, Placements(n, Shard(k)), std::nullopt).to_local();
        EXPECT_TRUE(torch::allclose(sh.to_local(), mine, 1e-5, 1e-5));
      }
      // Replicate -> Partial(op) -> Replicate is the value; avg/max/min keep it on every rank.
      auto back = rep.redistribute(Placements(n, Partial(op)));
      if (op != "sum") EXPECT_TRUE(torch::equal(back.to_local(), rep.to_local()));
      EXPECT_TRUE(torch::allclose(back.full_tensor(), expect.at(op), 1e-5, 1e-5));
      for (const std::string other : {"sum", "avg", "max", "min"}) {
        EXPECT_TRUE(torch::allclose(d.redistribute(Placements(n, Partial(other))).full_tensor(), expect.at(op), 1e-5, 1e-5))
            << op << " -> " << other;
      }
    }
    // distribute_tensor with Partial(avg) keeps the value on every rank.
    auto avg = distribute_tensor(base, mesh, Placements(n, Partial("avg")));
    EXPECT_TRUE(torch::equal(avg.to_local(), base));
  });
}

// distribute_tensor broadcasts from mesh rank src_data_rank (default 0): ranks passing different tensors end
// with that rank's pieces; std::nullopt keeps each rank's own; a bad src_data_rank throws on every rank.
TEST_P(DTensorDistribute, SrcDataRank) {
  run_ranks(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    const int64_t n = mesh->ndim();
    auto of_rank = [](int r) { return full_input({7, 3}, 50 + r, false); };
    auto mine = of_rank(pg->rank());
    const auto before = mine.clone();
    for (Placements ps : {Placements(n, Shard(0)), Placements(n, Replicate()), Placements(n, Shard(1))}) {
      auto d = distribute_tensor(mine, mesh, ps);
      EXPECT_TRUE(torch::equal(d.full_tensor(), of_rank(0))) << describe(ps);
      EXPECT_TRUE(torch::equal(d.to_local(), distribute_tensor(of_rank(0), mesh, ps, std::nullopt).to_local()));
      const int64_t last = mesh->size() - 1;
      auto from_last = distribute_tensor(mine, mesh, ps, last);
      EXPECT_TRUE(torch::equal(from_last.full_tensor(), of_rank(mesh->ranks()[last])));
      auto own = distribute_tensor(mine, mesh, ps, std::nullopt);
      EXPECT_TRUE(torch::equal(own.to_local(), distribute_tensor(mine, mesh, ps, std::nullopt).to_local()));
    }
    EXPECT_TRUE(torch::equal(mine, before)) << "distribute_tensor changed the caller's tensor";
    // A leaf with requires_grad as the input's.
    auto leafy = distribute_tensor(mine.clone().requires_grad_(), mesh, Placements(n, Shard(0)));
    EXPECT_TRUE(leafy.to_local().requires_grad());
    EXPECT_TRUE(leafy.to_local().is_leaf());
  });
  auto errors = run_ranks_collect(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    distribute_tensor(torch::zeros({4}), mesh, Placements(mesh->ndim(), Replicate()), 9);
  });
  for (const auto& e : errors) EXPECT_NE(e.find("distribute_tensor: src_data_rank 9 is not a position of"), std::string::npos) << e;
}

// zeros/ones/empty/full with placements; rand/randn give one process's draw with the same seed.
TEST_P(DTensorFactories, Factories) {
  run_ranks(GetParam(), [](ProcessGroupPtr pg) {
    auto mesh = test_mesh(pg);
    const int64_t n = mesh->ndim();
    for (Placements ps : {Placements(n, Shard(0)), Placements(n, Shard(1)), Placements(n, Replicate()), Placements(n, Partial()),
                          Placements(n, Partial("max"))}) {
      SCOPED_TRACE(describe(ps));
      std::vector<int64_t> size{2, 7};  // empty shards on 3 and 4 ranks
      auto z = dt::zeros(size, mesh, ps);
      EXPECT_EQ(z.placements(), ps);
      EXPECT_TRUE(torch::equal(z.full_tensor(), torch::zeros(size)));
      EXPECT_TRUE(torch::equal(dt::ones(size, mesh, ps).full_tensor(), torch::ones(size)));
      EXPECT_TRUE(torch::equal(dt::full(size, 2.5, mesh, ps).full_tensor(), torch::full(size, 2.5)));
      auto e = dt::empty(size, mesh, ps, torch::kFloat64);
      EXPECT_EQ(e.to_local().scalar_type(), torch::kFloat64);
      EXPECT_EQ(e.to_local().sizes(), dt::zeros(size, mesh, ps).to_local().sizes());
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
      auto r = dt::rand(size, mesh, ps, {}, gen);
      EXPECT_TRUE(torch::equal(r.full_tensor(), torch::rand(size, at::make_generator<at::CPUGeneratorImpl>(1234))));
      // The default generator, seeded alike on every rank (ranks are threads here: one generator, so each
      // rank seeds and draws under a lock).
      static std::mutex mu;
      torch::Tensor mine, ref;
      {
        std::lock_guard<std::mutex> lock(mu);
        torch::manual_seed(7);
        mine = dt::randn(size, mesh, ps).to_local();
        torch::manual_seed(7);
        ref = torch::randn(size);
      }
      EXPECT_TRUE(torch::equal(DTensor(mine, mesh, ps, size).full_tensor(), ref));
    }
    auto g = dt::ones({3}, mesh, {}, torch::TensorOptions().requires_grad(true));
    EXPECT_TRUE(g.to_local().requires_grad());
    EXPECT_EQ(g.placements(), Placements(n, Replicate()));
  });
  auto errors = run_ranks_collect(GetParam(), [](ProcessGroupPtr pg) { dt::zeros({3}, test_mesh(pg), Placements(test_mesh(pg)->ndim(), Shard(1))); });
  for (const auto& e : errors) EXPECT_NE(e.find("fsdp::dtensor::zeros: Shard(dim=1) is out of range for a 1-D tensor"), std::string::npos) << e;
}

INSTANTIATE_TEST_SUITE_P(Ranks, DTensorAutograd, ::testing::Values(2, 3, 4), param_name);
INSTANTIATE_TEST_SUITE_P(Ranks, DTensorPartialOps, ::testing::Values(2, 3, 4), param_name);
INSTANTIATE_TEST_SUITE_P(Ranks, DTensorDistribute, ::testing::Values(2, 3, 4), param_name);
INSTANTIATE_TEST_SUITE_P(Ranks, DTensorFactories, ::testing::Values(2, 3, 4), param_name);

}  // namespace
}  // namespace fsdp::testing::dtensor_parity
