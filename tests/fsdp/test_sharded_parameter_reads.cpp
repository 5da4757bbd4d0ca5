// Reads and uses of a sharded parameter outside its group's forward (issue 28, items 5 and 8). The rule
// ([Note: reads of a sharded parameter], src/fsdp/fsdp_interception.cpp): a parameter's shape and content
// agree, no plain read is a hidden collective, and a use that would compute a forward on a shard raises at
// the use on every rank.
// - Item 8 (unchanged models): between steps a read sees the local shard on this rank alone, so a helper
//   that copies p.detach() into the rows it owns, skipped by the rank whose shard is empty, neither fails
//   nor makes the ranks wait in mismatched collectives; training continues like one process.
// - Item 5 (holders): a holder parameter used in the root's forward outside its module's forward (a tied
//   head read as matmul(h, head->weight.t())) raises at the use, in train and eval mode, with a holder root
//   and with an unchanged (implicit) root; the model still trains afterwards.
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "multi_rank.h"
#include "fsdp/fsdp.h"

namespace fsdp::testing::sharded_parameter_reads {
namespace {

// fc2's weight [2, 4] and bias [2] have an empty shard on rank 2 of 3.
struct TinyImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  TinyImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(3, 4));
    fc2 = register_module("fc2", torch::nn::Linear(4, 2));
    torch::NoGradGuard g;
    for (auto& p : parameters()) p.copy_(torch::linspace(-0.7, 0.9, p.numel()).reshape(p.sizes()));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
};
TORCH_MODULE(Tiny);

torch::Tensor batch(int step) {
  return torch::linspace(-1, 1, 6 * 3).reshape({6, 3}) * (step + 1) + 0.1 * step;  // 6 rows: 2 per rank on 3
}
torch::Tensor loss_of(const torch::Tensor& out) { return out.pow(2).mean(); }

// The one-process run on the same global batches: parameters after each step.
std::vector<std::map<std::string, torch::Tensor>> reference(int steps) {
  Tiny m;
  torch::optim::SGD opt(m->parameters(), 0.1);
  std::vector<std::map<std::string, torch::Tensor>> after;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    loss_of(m(batch(s))).backward();
    opt.step();
    std::map<std::string, torch::Tensor> snap;
    for (const auto& p : m->named_parameters()) snap[p.key()] = p.value().detach().clone();
    after.push_back(std::move(snap));
  }
  return after;
}

// Item 8: the helper, on 3 ranks: every rank copies the rows it owns into a full-size buffer, the
// rank with an empty shard skips the read, then one explicit all_reduce assembles the full parameter.
TEST(ShardedParameterReads, RankDependentReadsBetweenStepsOnThreeRanksWithAnEmptyShard) {
  constexpr int kSteps = 3;
  const auto ref = reference(kSteps);
  for (bool no_grad : {true, false}) {
    run_ranks(3, [&](ProcessGroupPtr pg) {
      const int r = pg->rank();
      Tiny m;
      auto mesh = init_device_mesh(torch::kCPU, {3}, {}, pg);
      fully_shard(m->fc2, FullyShardOptions().mesh(mesh));
      fully_shard(m, FullyShardOptions().mesh(mesh));
      torch::optim::SGD opt(m->parameters(), 0.1);
      for (int s = 0; s < kSteps; ++s) {
        opt.zero_grad();
        loss_of(m(batch(s).narrow(0, 2 * r, 2))).backward();
        opt.step();
        for (const auto& p : m->named_parameters()) {
          const auto& full = ref[s].at(p.key());
          const auto rows = chunk_range(full.size(0), 3, r);
          ASSERT_EQ(p.value().size(0), rows.length) << p.key() << " rank " << r << ": sizes() is the local shard's";
          auto assembled = torch::zeros_like(full);
          if (p.value().numel() > 0) {  // rank-dependent: the empty shard skips the read
            std::optional<torch::NoGradGuard> g;
            if (no_grad) g.emplace();
            assembled.narrow(0, rows.offset, rows.length).copy_(p.value().detach());
            // p.detach() is the local shard, also combined with other tensors.
            EXPECT_TRUE(p.value().detach().equal(full.narrow(0, rows.offset, rows.length).clone()) ||
                        torch::allclose(p.value().detach(), full.narrow(0, rows.offset, rows.length), 1e-5, 1e-6))
                << p.key() << " rank " << r;
            EXPECT_NEAR(p.value().detach().sum().item<double>(), full.narrow(0, rows.offset, rows.length).sum().item<double>(),
                        1e-5)
                << p.key() << " rank " << r;
          }
          all_reduce(assembled, *pg, ReduceOp::SUM);  // the explicit collective, made by every rank
          EXPECT_TRUE(torch::allclose(assembled, full, 1e-5, 1e-6))
              << p.key() << " after step " << s << ", rank " << r << ": max |diff| " << (assembled - full).abs().max();
        }
      }
    });
  }
}

// Item 8: an evaluation forward has no end the library sees; the root's reshard() ends it, and reads after
// it are local again (rank 2 skips them, as above).
TEST(ShardedParameterReads, ReadsAfterAnEvaluationForwardAndTheRootsReshardAreLocal) {
  run_ranks(3, [&](ProcessGroupPtr pg) {
    Tiny m;
    auto mesh = init_device_mesh(torch::kCPU, {3}, {}, pg);
    fully_shard(m->fc2, FullyShardOptions().mesh(mesh));
    auto root = fully_shard(m, FullyShardOptions().mesh(mesh));
    torch::NoGradGuard g;
    auto out = m(batch(0).narrow(0, 2 * pg->rank(), 2));
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 2}));
    root.reshard();
    const auto rows = chunk_range(2, 3, pg->rank());
    EXPECT_EQ(m->fc2->weight.size(0), rows.length);
    if (rows.length > 0) EXPECT_TRUE(torch::equal(m->fc2->weight.clone(), Tiny()->fc2->weight.narrow(0, rows.offset, rows.length)));
    auto t = torch::ones({1});
    all_reduce(t, *pg, ReduceOp::SUM);  // every rank reaches this collective: no read issued one
    EXPECT_EQ(t.item<float>(), 3.0f);
  });
}

// ---- Item 5: a holder parameter used outside its module's forward --------------------------------------

// The model: the head is a holder; the root reads its weight directly (a tied output projection).
struct TiedImpl : torch::nn::Module {
  torch::nn::Linear body{nullptr};
  FSDPModule<torch::nn::Linear> head{nullptr};
  bool bypass = true;
  TiedImpl() {
    body = register_module("body", torch::nn::Linear(6, 4));
    head = register_module("head", torch::nn::Linear(4, 10));
    torch::NoGradGuard g;
    for (auto& p : parameters()) p.copy_(torch::linspace(-0.5, 0.8, p.numel()).reshape(p.sizes()));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(body(x));
    return bypass ? torch::matmul(h, head->weight.t()) : head(h);
  }
};
TORCH_MODULE(Tied);

void expect_use_error(const std::vector<std::string>& errors, const std::string& when) {
  for (size_t r = 0; r < errors.size(); ++r) {
    const auto& e = errors[r];
    EXPECT_NE(e.find("parameter 'head.weight'"), std::string::npos) << when << ", rank " << r << ": " << e;
    EXPECT_NE(e.find("during a forward, while it holds only its shard"), std::string::npos) << when << ", rank " << r << ": " << e;
    EXPECT_NE(e.find("on rank " + std::to_string(r)), std::string::npos) << when << ": " << e;
    EXPECT_NE(e.find("fsdp::fsdp_forward"), std::string::npos) << when << ": " << e;
  }
}

TEST(ShardedParameterReads, HolderParameterUsedOutsideItsForwardRaisesAtTheUseOnEveryRank) {
  for (bool holder_root : {true, false}) {
    for (bool eval : {false, true}) {
      const std::string when = std::string(holder_root ? "holder root" : "implicit root") + (eval ? ", eval" : ", train");
      auto errors = run_ranks_collect(2, [&](ProcessGroupPtr pg) {
        Tied plain;
        std::optional<FSDPModule<Tied>> held;
        if (holder_root) held.emplace(plain);
        auto mesh = init_device_mesh(torch::kCPU, {2}, {}, pg);
        fully_shard(plain->head, FullyShardOptions().mesh(mesh));
        fully_shard(plain.ptr(), FullyShardOptions().mesh(mesh));
        auto x = torch::randn({3, 6});
        auto call = [&] { return holder_root ? (*held)(x) : plain->forward(x); };
        std::optional<torch::NoGradGuard> g;
        if (eval) {
          plain->eval();
          g.emplace();
        }
        torch::Tensor out;
        try {
          out = call();
        } catch (const c10::Error&) {
          // The model is left usable: the same forward through the head's holder trains.
          plain->bypass = false;
          g.reset();
          plain->train();
          auto y = call();
          EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, 10})) << when;
          y.pow(2).sum().backward();
          EXPECT_EQ(plain->head->weight.grad().sizes(), plain->head->weight.sizes()) << when;
          throw;
        }
        ADD_FAILURE() << when << ": no error; the output has shape " << out.sizes();
      });
      expect_use_error(errors, when);
    }
  }
}

// Between steps a holder parameter reads as its local shard (with grad enabled too: a holder's forward
// opens explicitly, so there is nothing to confuse it with); no collective.
TEST(ShardedParameterReads, HolderParameterReadBetweenStepsIsTheLocalShard) {
  run_ranks(3, [&](ProcessGroupPtr pg) {
    Tied plain;
    plain->bypass = false;
    FSDPModule<Tied> held(plain);
    auto mesh = init_device_mesh(torch::kCPU, {3}, {}, pg);
    fully_shard(plain->head, FullyShardOptions().mesh(mesh));
    fully_shard(held, FullyShardOptions().mesh(mesh));
    Tied fresh;
    held(torch::randn({2, 6})).sum().backward();  // gradients only: the values stay the initial ones
    const auto rows = chunk_range(10, 3, pg->rank());
    const auto& w = plain->head->weight;
    EXPECT_EQ(w.size(0), rows.length);
    EXPECT_TRUE(torch::equal(w.clone(), fresh->head->weight.narrow(0, rows.offset, rows.length)));
    auto t = torch::ones({1});
    all_reduce(t, *pg, ReduceOp::SUM);
    EXPECT_EQ(t.item<float>(), 3.0f);
  });
}

}  // namespace
}  // namespace fsdp::testing::sharded_parameter_reads
