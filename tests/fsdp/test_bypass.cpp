// Forwards that bypass FSDP (issue 17 item 7; CTest labels: fully_shard, regressions): a module called
// directly instead of through its holder raises on every rank, naming the module, its parameter and the
// supported calls; children called by their container (Sequential) or through a plain member are implicit
// groups and train like one process; the root's forward graph check that detects bypasses is cheap.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "fsdp/fsdp_state.h"
#include "fsdp_test_model.h"
#include "multi_rank.h"
#include "trains_like_unsharded.h"

namespace fsdp::testing {
namespace {

// ---- Item 7: forwards that bypass FSDP ------------------------------------------------------------------
// Every rank must raise a c10::Error naming the module and the supported calls.
// `param_prefix`: the start of the parameter's quoted FQN (whichever of weight/bias gets its gradient first).
void expect_bypass_error(const std::vector<std::string>& errors, const std::string& module_text,
                         const std::string& param_prefix) {
  for (size_t r = 0; r < errors.size(); ++r) {
    const auto& e = errors[r];
    EXPECT_NE(e.find("outside the module's FSDP forward"), std::string::npos) << "rank " << r << ": " << e;
    EXPECT_NE(e.find(module_text), std::string::npos) << "rank " << r << ": " << e;
    EXPECT_TRUE(e.find("parameter '" + param_prefix + "weight'") != std::string::npos ||
                e.find("parameter '" + param_prefix + "bias'") != std::string::npos)
        << "rank " << r << ": " << e;
    EXPECT_NE(e.find("fsdp::FSDPModule<Holder>"), std::string::npos) << "rank " << r << ": " << e;
    EXPECT_NE(e.find("fsdp::fsdp_forward"), std::string::npos) << "rank " << r << ": " << e;
  }
}

// Issue 17 item 7 as filed: a sharded child of torch::nn::Sequential, which calls it directly. Since
// issue 13 the child is an implicit group (see [Note: implicit groups]) and trains like one process.
TEST(RegressionsBypass, SequentialChildCalledByTheContainer) {
  const auto x = torch::randn({4, 8}, at::make_generator<at::CPUGeneratorImpl>(3));
  for (int ws : {1, 2, 3}) {
    expect_trains_like_unsharded<FSDPModule<torch::nn::Sequential>>(
        ws, [] { return FSDPModule<torch::nn::Sequential>(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4)); },
        [](auto& m, const DeviceMeshPtr& mesh) {
          fully_shard(m->ptr(2), FullyShardOptions().mesh(mesh));
          fully_shard(m, FullyShardOptions().mesh(mesh));
          EXPECT_TRUE(detail::state_of(*m->ptr(2))->implicit);
        },
        [](auto& m, const torch::Tensor& in) { return m(in).pow(2).sum(); }, x);
  }
}

// The root called through ->forward (the Impl directly), on its first forward and after a normal one.
TEST(RegressionsBypass, RootCalledThroughArrowForward) {
  for (int ws : {1, 2}) {
    for (bool after_normal_step : {false, true}) {
      auto errors = run_ranks_collect(ws, [&](ProcessGroupPtr pg) {
        FSDPModule<torch::nn::Linear> m(8, 4);
        fully_shard(m, FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {ws})));
        auto x = torch::randn({4, 8});
        if (after_normal_step) m(x).pow(2).sum().backward();
        m->forward(x).pow(2).sum().backward();
      });
      expect_bypass_error(errors, after_normal_step ? "the root (torch::nn::LinearImpl)"
                                                    : "the module passed to fully_shard (torch::nn::LinearImpl)",
                          "");
    }
  }
}

// A module reached through as<>() and called directly, inside a root that goes through FSDP.
struct AsImpl : torch::nn::Module {
  torch::nn::ModuleList list;
  AsImpl() {
    list = register_module("list", torch::nn::ModuleList());
    list->push_back(torch::nn::Linear(8, 6));
    list->push_back(torch::nn::Linear(6, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    return list[1]->as<torch::nn::Linear>()->forward(torch::relu(list[0]->as<torch::nn::Linear>()->forward(x)));
  }
};
TORCH_MODULE(As);

TEST(RegressionsBypass, ModuleReachedThroughAs) {
  const auto x = torch::randn({4, 8}, at::make_generator<at::CPUGeneratorImpl>(3));
  for (int ws : {1, 2, 3}) {
    expect_trains_like_unsharded<FSDPModule<As>>(
        ws, [] { return FSDPModule<As>(); },
        [](auto& m, const DeviceMeshPtr& mesh) {
          fully_shard(m->list[1], FullyShardOptions().mesh(mesh));
          fully_shard(m, FullyShardOptions().mesh(mesh));
        },
        [](auto& m, const torch::Tensor& in) { return m(in).pow(2).sum(); }, x);
  }
}

// A module of a group of several modules (fully_shard({a, b})) called directly: the message names
// its parameter by its real path ('b.weight', not a made-up 'a.1.weight').
struct PairImpl : torch::nn::Module {
  FSDPModule<torch::nn::Linear> a{nullptr};
  torch::nn::Linear b{nullptr};  // NOT through FSDP
  PairImpl() {
    a = register_module("a", torch::nn::Linear(8, 6));
    b = register_module("b", torch::nn::Linear(6, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return b(a(x)); }
};
TORCH_MODULE(Pair);

TEST(RegressionsBypass, ModuleOfAMultiModuleGroupNamedByItsPath) {
  for (int ws : {1, 2}) {
    auto errors = run_ranks_collect(ws, [&](ProcessGroupPtr pg) {
      FSDPModule<Pair> m;
      auto mesh = init_device_mesh(torch::kCPU, {ws});
      fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{m->a.ptr(), m->b.ptr()}, FullyShardOptions().mesh(mesh));
      fully_shard(m, FullyShardOptions().mesh(mesh));
      m(torch::randn({4, 8})).pow(2).sum().backward();
    });
    expect_bypass_error(errors, "'b' (torch::nn::LinearImpl", "b.");
    for (const auto& e : errors) EXPECT_EQ(e.find("a.1."), std::string::npos) << e;
  }
}

// A parent that calls a sharded child through its plain holder bypasses FSDP.
struct PlainMemberImpl : torch::nn::Module {
  Block inner{nullptr};  // a plain holder member (no FSDPModule): an implicit group since issue 13
  PlainMemberImpl() { inner = register_module("inner", Block()); }
  torch::Tensor forward(torch::Tensor x) { return inner(x); }
};
TORCH_MODULE(PlainMember);

// Was BadInput.ForwardThatBypassesFSDPSaysSo: a plain member called as `inner(x)` now trains.
TEST(BadInput, PlainMemberChildTrainsLikeOneProcess) {
  const auto x = torch::randn({4, kDim}, at::make_generator<at::CPUGeneratorImpl>(5));
  for (int ws : {2, 3}) {
    expect_trains_like_unsharded<FSDPModule<PlainMember>>(
        ws, [] { return FSDPModule<PlainMember>(); },
        [](auto& m, const DeviceMeshPtr& mesh) {
          fully_shard(m->inner, FullyShardOptions().mesh(mesh));
          fully_shard(m, FullyShardOptions().mesh(mesh));
        },
        [](auto& m, const torch::Tensor& in) { return m(in).pow(2).sum(); }, x);
  }
}

// The root's forward graph check (bypass detection before backward) costs one visit per autograd
// node. Measured against the forward itself on a 24-block model; it must find nothing to report.
TEST(RegressionsBypass, ForwardGraphCheckIsCheapAndQuiet) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Net net(/*n_blocks=*/24);
    auto mesh = init_device_mesh(torch::kCPU, {2});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    auto api = fully_shard(net, FullyShardOptions().mesh(mesh));
    FSDPModule<Net> model(net);
    auto b = make_batches(1, 8, 16)[0];
    constexpr int kIters = 20;
    double fwd = 0, check = 0;
    for (int i = 0; i < kIters; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      auto out = model(b.idx);
      auto t1 = std::chrono::steady_clock::now();
      detail::fsdp_state(api).check_forward_graph({out});  // what the root's post-forward ran inside `fwd`
      auto t2 = std::chrono::steady_clock::now();
      fwd += std::chrono::duration<double, std::micro>(t1 - t0).count();
      check += std::chrono::duration<double, std::micro>(t2 - t1).count();
      loss_fn(out, b.targets).backward();
    }
    if (pg->rank() == 0) {
      std::printf("[bypass check] 24 blocks, 2 ranks: forward %.0f us (including the check), check %.0f us (%.1f%%)\n",
                  fwd / kIters, check / kIters, 100.0 * check / fwd);
    }
    EXPECT_LT(check, fwd) << "the check must cost less than the forward it guards";
  });
}

}  // namespace
}  // namespace fsdp::testing
