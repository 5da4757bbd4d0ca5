// fsdp::estimate_memory: the breakdown on hand-computed examples (uneven dim-0 padding on 3 ranks, bf16
// param_dtype, reshard_after_forward=false keeping every group), the model states it predicts equal what
// a sharded model really holds on 2 ranks, and bad input names itself. (CTest label large_model.)
#include <gtest/gtest.h>

#include "fsdp/fsdp.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

ParamInfo P(std::string fqn, std::vector<int64_t> shape) { return ParamInfo{std::move(fqn), std::move(shape)}; }

// root.w [5, 2], a.w [10, 4], a.b [10] (fp32): on 3 ranks each shard has ceil(dim0 / 3) rows:
// root.w 2 x 2 = 4, a.w 4 x 4 = 16, a.b 4 elements; 24 elements = 96 bytes per rank.
std::vector<ParamInfo> two_group_params() { return {P("root.w", {5, 2}), P("a.w", {10, 4}), P("a.b", {10})}; }
std::vector<ShardGroupInfo> two_groups() { return {{"", {"root.w"}, false}, {"a", {"a.w", "a.b"}, std::nullopt}}; }

TEST(MemoryEstimate, UnevenPaddingOnThreeRanks) {
  MemoryEstimateOptions o;
  o.world_size = 3;
  o.activation_bytes = 1000;
  const auto e = estimate_memory(two_group_params(), two_groups(), o);
  EXPECT_EQ(e.sharded_params, 96);
  EXPECT_EQ(e.padding, (2 * 1 + 2 * 4 + 2 * 1) * 4);  // root.w 6-5 rows x 2, a.w 12-10 rows x 4, a.b 12-10
  EXPECT_EQ(e.grads, 96);
  EXPECT_EQ(e.optimizer_state, 24 * 8);
  EXPECT_EQ(e.num_params, 10 + 40 + 10);
  EXPECT_EQ(e.largest_group, "a");
  // Unsharded: root 3 x 4 x 4 = 48 (kept: reshard false), a 3 x 20 x 4 = 240; a's copy-out holds its
  // all-gather buffer and its parameters beside the root: 48 + 2 x 240.
  EXPECT_EQ(e.unsharded_params, 48 + 2 * 240);
  // Full-size gradients: the root's 10 x 4 all backward + a's 50 x 4.
  EXPECT_EQ(e.unsharded_grads, 40 + 200);
  // a's reduce-scatter: input [3, 20 + 2] + output [22], fp32.
  EXPECT_EQ(e.reduce_scatter, 4 * 22 * 4);
  EXPECT_EQ(e.peak_backward, 96 + 192 + 1000 + 528 + 240 + 352);
  EXPECT_EQ(e.peak_optimizer_step, 96 + 96 + 192 + 3 * 16 * 4);
  EXPECT_EQ(e.total_peak, e.peak_backward);
}

TEST(MemoryEstimate, Bf16ParamDtypeHalvesUnshardedButNotShards) {
  MemoryEstimateOptions o;
  o.world_size = 3;
  o.param_dtype = torch::kBFloat16;
  auto e = estimate_memory(two_group_params(), two_groups(), o);
  EXPECT_EQ(e.sharded_params, 96);  // shards stay fp32
  EXPECT_EQ(e.grads, 96);
  EXPECT_EQ(e.unsharded_params, 24 + 2 * 120);
  EXPECT_EQ(e.unsharded_grads, 20 + 100);
  EXPECT_EQ(e.reduce_scatter, 4 * 22 * 2);  // reduce_dtype defaults to param_dtype
  o.reduce_dtype = torch::kFloat32;
  e = estimate_memory(two_group_params(), two_groups(), o);
  EXPECT_EQ(e.reduce_scatter, 4 * 22 * 4);
}

TEST(MemoryEstimate, ReshardFalseKeepsEveryGroupUnsharded) {
  // root [5, 2] and two [10, 4] groups on 3 ranks: unsharded 48, 192, 192 bytes.
  std::vector<ParamInfo> params = {P("r", {5, 2}), P("a", {10, 4}), P("b", {10, 4})};
  std::vector<ShardGroupInfo> groups = {{"", {"r"}, false}, {"a", {"a"}, std::nullopt}, {"b", {"b"}, std::nullopt}};
  MemoryEstimateOptions o;
  o.world_size = 3;
  o.reshard_after_forward = true;  // one block (+ its buffer, or the next prefetched) beside the root
  EXPECT_EQ(estimate_memory(params, groups, o).unsharded_params, 48 + 2 * 192);
  o.reshard_after_forward = false;  // every group stays until the backward; b's copy-out adds its buffer
  EXPECT_EQ(estimate_memory(params, groups, o).unsharded_params, 48 + 192 + 192 + 192);
}

TEST(MemoryEstimate, BackwardPeaksWhereGradientsAndActivationsMeet) {
  // One rank, three [10, 4] fp32 groups (root kept, a and b resharded): 160 bytes each unsharded, 480 of
  // params, 960 of AdamW state; a reduce-scatter is [2 x 41] x 4 = 328 bytes.
  std::vector<ParamInfo> params = {P("r", {10, 4}), P("a", {10, 4}), P("b", {10, 4})};
  std::vector<ShardGroupInfo> groups = {{"", {"r"}, false}, {"a", {"a"}, std::nullopt}, {"b", {"b"}, std::nullopt}};
  MemoryEstimateOptions o;
  // No activations: the peak is at a's backward, where b's sharded gradient is back (160) beside the
  // root (160, kept), a's copy-out (2 x 160), the root's and a's full gradients (320) and a's reduce-scatter.
  EXPECT_EQ(estimate_memory(params, groups, o).peak_backward, 480 + 960 + 160 + 480 + 320 + 328);
  // Activations spread over the 3 groups: all 3000 at b's backward (no gradient back yet), 2000 at a's.
  o.activation_bytes = 3000;
  EXPECT_EQ(estimate_memory(params, groups, o).peak_backward, 480 + 960 + 3000 + 480 + 320 + 328);
}

TEST(MemoryEstimate, CpuOffloadOnAnAcceleratorMovesModelStatesToTheHost) {
  MemoryEstimateOptions o;
  o.world_size = 3;
  o.cpu_offload = true;
  o.device_is_cpu = false;
  const auto e = estimate_memory(two_group_params(), two_groups(), o);
  EXPECT_EQ(e.offloaded_host, 96 + 96 + 192);
  EXPECT_EQ(e.peak_backward, 528 + 240 + 352);
}

TEST(MemoryEstimate, BadInputNamesIt) {
  MemoryEstimateOptions o;
  o.world_size = 0;
  try {
    estimate_memory(two_group_params(), two_groups(), o);
    FAIL() << "world_size 0 accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("estimate_memory: world_size must be >= 1"), std::string::npos) << e.what();
  }
  o.world_size = 2;
  auto groups = two_groups();
  groups[1].fqns.push_back("a.nope");
  try {
    estimate_memory(two_group_params(), groups, o);
    FAIL() << "unknown FQN accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("group 'a' names parameter 'a.nope', which is not in params"),
              std::string::npos) << e.what();
  }
  torch::nn::Sequential seq(torch::nn::Linear(2, 2));
  try {
    shard_groups(*seq, {"", "x"});
    FAIL() << "unknown module path accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("module path 'x' is not a submodule"), std::string::npos) << e.what();
  }
}

// Rows that do not divide by 2 (7, 5, 3): rank 0 holds ceil(dim0 / 2) rows of each.
struct EstNetImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, head{nullptr};
  EstNetImpl() {
    a = register_module("a", torch::nn::Linear(6, 7));
    b = register_module("b", torch::nn::Linear(7, 5));
    head = register_module("head", torch::nn::Linear(5, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return head(torch::relu(b(torch::relu(a(x))))); }
};
TORCH_MODULE(EstNet);

TEST(MemoryEstimate, ModelStatesEqualWhatTwoRanksHold) {
  const int ws = 2;
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {ws}, {}, pg);
    torch::manual_seed(5);
    auto m = deferred_init([] { return EstNet(); });  // meta: the estimator reads sizes and dtypes only
    MemoryEstimateOptions o;
    o.world_size = ws;
    const auto e = estimate_memory(param_infos(*m), shard_groups(*m, {"", "a", "b"}), o);
    fully_shard(m->a.ptr(), FullyShardOptions().mesh(mesh));
    fully_shard(m->b.ptr(), FullyShardOptions().mesh(mesh));
    fully_shard(m.ptr(), FullyShardOptions().mesh(mesh));
    materialize_module(m);
    torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-3));
    m->forward(torch::randn({4, 6})).sum().backward();
    int64_t held_params = 0, held_grads = 0;
    for (const auto& p : m->parameters()) {
      held_params += static_cast<int64_t>(p.storage().nbytes());  // the padded shard
      held_grads += p.grad().numel() * p.grad().element_size();
    }
    opt.step();
    int64_t held_opt = 0;
    for (const auto& [key, state] : opt.state()) {
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(*state);
      held_opt += s.exp_avg().nbytes() + s.exp_avg_sq().nbytes();
    }
    if (pg->rank() == 0) {  // the estimate is rank 0's: it holds ceil(dim0 / 2) rows of each
      EXPECT_EQ(held_params, e.sharded_params);
      EXPECT_EQ(held_grads, e.grads);
      EXPECT_EQ(held_opt, e.optimizer_state);
    } else {  // rank 1 holds fewer rows (its padded shard storage is as large)
      EXPECT_EQ(held_params, e.sharded_params);
      EXPECT_LT(held_grads, e.grads);
      EXPECT_LT(held_opt, e.optimizer_state);
    }
    barrier(*pg);
  });
}

}  // namespace
}  // namespace fsdp::testing
