// shard_placement_fn (CTest labels fully_shard, fsdp_api): parameters sharded on dim 1 instead of 0 (FSDP2's
// Shard(1)), beside dim-0 ones in the same group. Training matches one process (fp32: full gradients every
// step at 1e-4 relative, final parameters at 1e-5) on 2, 3 and 4 ranks, with reshard_after_forward true,
// false and 2 (of 4), on holder and unchanged models; the parameters are DTensors with Shard(1); a DCP
// checkpoint saved from Shard(1) loads into a Shard(0) model bit for bit; refusals (uneven dim 1, a dim out
// of range, another placement) name the parameter and the fix.
#include <gtest/gtest.h>

#include "checkpoint_test_util.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "error_message.h"
#include "fully_shard_test_util.h"

namespace fsdp::testing {
namespace {

// Shard(1) for every 2-D parameter whose dim 1 divides by `ws`, Shard(0) for the others.
ShardPlacementFn dim1_where_even(int ws) {
  return [ws](const std::string&, const torch::Tensor& p) -> std::optional<Placement> {
    if (p.dim() == 2 && p.size(1) % ws == 0) return Shard(1);
    return std::nullopt;
  };
}

void run_shard1_parity(int ws, ReshardAfterForward raf) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches);
  const std::string what = std::to_string(ws) + " ranks, reshard_after_forward " +
                           (std::holds_alternative<bool>(raf) ? (std::get<bool>(raf) ? "true" : "false")
                                                              : std::to_string(std::get<int>(raf)));
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    auto opts = FullyShardOptions().mesh(mesh).shard_placement_fn(dim1_where_even(ws));
    Net net;
    load_full(*net, initial_weights());
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions(opts).reshard_after_forward(raf));
    fully_shard(net, opts);
    // The placements as PyTorch's: Shard(1) where chosen (a 6-wide dim 1 over 2 or 3 ranks), else Shard(0).
    int dim1 = 0;
    for (const auto& p : net->named_parameters()) {
      auto dt = sharded_param(p.value());
      const bool want1 = p.value().dim() == 2 && initial_weights().at(p.key()).size(1) % ws == 0;
      dim1 += want1;
      EXPECT_TRUE(dt.placements().back().is_shard(want1 ? 1 : 0)) << p.key() << ": " << dt.placements().back().str();
      EXPECT_TRUE(p.value().is_contiguous()) << p.key();
    }
    EXPECT_GE(dim1, ws == 4 ? 0 : 3) << "wte, fc1 and head weights are 6 wide on dim 1";
    FSDPModule<Net> model(net);
    auto opt = make_optimizer(net->parameters(), Opt::ADAMW);
    const int64_t local = kBatch / ws;
    for (size_t step = 0; step < batches.size(); ++step) {
      auto b = batches[step].slice(pg->rank() * local, local);
      opt->zero_grad();
      loss_fn(model(b.idx), b.targets).backward();
      expect_gradients_match(*net, ref, step, what);
      opt->step();
    }
    expect_params_match(*net, ref.final_params, what);
  });
}

TEST(ShardPlacement, Shard1TrainsLikeOneProcess) {
  for (int ws : {2, 3}) {
    for (ReshardAfterForward raf : {ReshardAfterForward(true), ReshardAfterForward(false)}) run_shard1_parity(ws, raf);
  }
}

// An unchanged model whose weights' dim 1 divides by 4: Shard(1) on 4 ranks, reshard_after_forward=2 (the
// backward gathers flat post-forward slices over 2 ranks).
struct WideImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  WideImpl() {
    a = register_module("a", torch::nn::Linear(8, 12));
    b = register_module("b", torch::nn::Linear(12, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return b(torch::tanh(a(x))); }
};
TORCH_MODULE(Wide);

TEST(ShardPlacement, Shard1OnAnUnchangedModelWithReshardAfterForward2) {
  torch::manual_seed(3);
  Wide init;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> data;
  for (int i = 0; i < 4; ++i) data.emplace_back(torch::randn({8, 8}, gen), torch::randn({8, 3}, gen));
  // One process.
  Wide ref_model;
  for (size_t i = 0; i < ref_model->parameters().size(); ++i) {
    torch::NoGradGuard g;
    ref_model->parameters()[i].copy_(init->parameters()[i]);
  }
  torch::optim::SGD ref_opt(ref_model->parameters(), 0.1);
  std::vector<std::vector<torch::Tensor>> ref_grads;
  for (auto& [x, y] : data) {
    ref_opt.zero_grad();
    torch::mse_loss(ref_model(x), y).backward();
    std::vector<torch::Tensor> g;
    for (auto& p : ref_model->parameters()) g.push_back(p.grad().clone());
    ref_grads.push_back(g);
    ref_opt.step();
  }
  run_ranks(4, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {4});
    Wide m;
    for (size_t i = 0; i < m->parameters().size(); ++i) {
      torch::NoGradGuard g;
      m->parameters()[i].copy_(init->parameters()[i]);
    }
    auto opts = FullyShardOptions().mesh(mesh).shard_placement_fn(dim1_where_even(4));
    fully_shard(m->a.ptr(), FullyShardOptions(opts).reshard_after_forward(2));
    fully_shard(m.ptr(), opts);
    EXPECT_TRUE(sharded_param(m->a->weight).placements()[0].is_shard(1));
    EXPECT_EQ(m->a->weight.sizes(), (std::vector<int64_t>{12, 2}));
    torch::optim::SGD opt(m->parameters(), 0.1);
    for (size_t s = 0; s < data.size(); ++s) {
      opt.zero_grad();
      auto x = data[s].first.slice(0, pg->rank() * 2, pg->rank() * 2 + 2);
      auto y = data[s].second.slice(0, pg->rank() * 2, pg->rank() * 2 + 2);
      torch::mse_loss(m->forward(x), y).backward();
      auto params = m->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        auto full = sharded_grad(params[i])->full_tensor();
        EXPECT_TRUE(torch::allclose(full, ref_grads[s][i], kGradRtol, kGradAtol))
            << "parameter " << i << " at step " << s << ": max |diff| " << max_abs_diff(full, ref_grads[s][i]);
      }
      opt.step();
    }
  });
}

// A DCP checkpoint saved from Shard(1) shards (3 ranks) loads into Shard(0) shards (2 ranks) bit for bit.
TEST(ShardPlacement, CheckpointFromShard1LoadsIntoShard0) {
  const auto dir = temp_dir("shard_placement_dim1") + "/ckpt";
  std::map<std::string, torch::Tensor> saved;
  std::mutex mu;
  auto batches = make_batches(2, kBatch, kSeq);
  run_ranks(3, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {3});
    auto opts = FullyShardOptions().mesh(mesh).shard_placement_fn(dim1_where_even(3));
    Net net;
    load_full(*net, initial_weights());
    for (auto& b : net->blocks) fully_shard(b, opts);
    fully_shard(net, opts);
    FSDPModule<Net> model(net);
    auto opt = make_optimizer(net->parameters(), Opt::ADAMW);
    for (const auto& b : batches) {
      opt->zero_grad();
      auto mine = b.slice(pg->rank() * 4, 4);
      loss_fn(model(mine.idx), mine.targets).backward();
      opt->step();
    }
    dcp::save(get_model_state_dict(net), dir);
    std::map<std::string, torch::Tensor> full;
    for (const auto& p : net->named_parameters()) full[p.key()] = sharded_param(p.value()).full_tensor();
    std::lock_guard<std::mutex> lock(mu);
    if (pg->rank() == 0) saved = full;
  });
  run_ranks(2, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    Net net;  // other weights (seeded differently), Shard(0)
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    auto sd = get_model_state_dict(net);
    dcp::load(sd, dir);
    set_model_state_dict(net, sd);
    for (const auto& p : net->named_parameters()) {
      EXPECT_TRUE(torch::equal(sharded_param(p.value()).full_tensor(), saved.at(p.key()))) << p.key();
    }
  });
}

TEST(ShardPlacement, RefusalsNameTheParameterAndTheFix) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto shard_with = [&](ShardPlacementFn fn) {
      auto lin = torch::nn::Linear(5, 4);  // weight [4, 5]: dim 1 is odd
      auto m = error_message([&] { fully_shard(lin.ptr(), FullyShardOptions().mesh(mesh).shard_placement_fn(fn)); });
      EXPECT_EQ(lin->weight.sizes(), (std::vector<int64_t>{4, 5})) << "a refused fully_shard shards nothing";
      return m;
    };
    auto m = shard_with([](const std::string& n, const torch::Tensor&) -> std::optional<Placement> {
      if (n == "weight") return Shard(1);
      return std::nullopt;
    });
    EXPECT_NE(m.find("parameter 'weight'"), std::string::npos) << m;
    EXPECT_NE(m.find("does not divide evenly"), std::string::npos) << m;
    m = shard_with([](const std::string&, const torch::Tensor&) -> std::optional<Placement> { return Shard(2); });
    EXPECT_NE(m.find("expected a dim in [-"), std::string::npos) << m;
    m = shard_with([](const std::string&, const torch::Tensor&) -> std::optional<Placement> { return Replicate(); });
    EXPECT_NE(m.find("expected fsdp::Shard(dim)"), std::string::npos) << m;
    // Shard(-1) is the last dim: for the [4, 5] weight that is dim 1 (odd: refused as above).
    m = shard_with([](const std::string& n, const torch::Tensor&) -> std::optional<Placement> {
      if (n == "weight") return Shard(-1);
      return std::nullopt;
    });
    EXPECT_NE(m.find("cannot be sharded on dim 1"), std::string::npos) << m;
    // ShardPlacementResult: a per-parameter mesh other than fully_shard's is refused (the fix: a fully_shard
    // call of its own); fully_shard's mesh, or an equal one, is accepted.
    auto other = init_device_mesh(torch::kCPU, {1, 2}, {"ep", "dp"});
    m = shard_with([&](const std::string& n, const torch::Tensor&) -> ShardPlacementResult {
      if (n == "weight") return ShardPlacementResult(Shard(0), other);
      return std::nullopt;
    });
    EXPECT_NE(m.find("parameter 'weight'"), std::string::npos) << m;
    EXPECT_NE(m.find("per-parameter"), std::string::npos) << m;
    EXPECT_NE(m.find("call fully_shard on the module that owns"), std::string::npos) << m;
    auto same = init_device_mesh(torch::kCPU, {2});
    auto lin = torch::nn::Linear(4, 4);
    fully_shard(lin.ptr(), FullyShardOptions().mesh(mesh).shard_placement_fn(
                               [&](const std::string&, const torch::Tensor& p) -> ShardPlacementResult {
                                 if (p.dim() == 2) return ShardPlacementResult(Shard(1), same);
                                 return std::nullopt;
                               }));
    EXPECT_EQ(sharded_param(lin->weight).placements()[0].str(), Shard(1).str());
  });
}

}  // namespace
}  // namespace fsdp::testing
