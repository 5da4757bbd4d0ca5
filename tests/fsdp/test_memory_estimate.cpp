// fsdp::estimate_memory: the breakdown on hand-computed examples (uneven dim-0 padding on 3 ranks, bf16
// param_dtype, reshard_after_forward=false keeping every group), the model states it predicts equal what
// a sharded model really holds on 2 ranks, and bad input names itself. (CTest label large_model.)
#include <gtest/gtest.h>

#include <cstdio>

#include "counting_allocator.h"
#include "fsdp/fsdp.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

ParamInfo P(std::string fqn, std::vector<int64_t> shape) { return ParamInfo{std::move(fqn), std::move(shape)}; }

// root.w [5, 2], a.w [10, 4], a.b [10] (fp32): on 3 ranks each shard has ceil(dim0 / 3) rows:
// root.w 2 x 2 = 4, a.w 4 x 4 = 16, a.b 4 elements; 24 elements = 96 bytes per rank.
std::vector<ParamInfo> two_group_params() { return {P("root.w", {5, 2}), P("a.w", {10, 4}), P("a.b", {10})}; }
std::vector<ShardGroupInfo> two_groups() { return {{"", {"root.w"}, false}, {"a", {"a.w", "a.b"}, std::nullopt}}; }

// activation_peak_bytes: the two moments (the backward's start with the head's tensors; a checkpointed block's
// backward with its recomputed ones), for each mode. 4 blocks saving 16 units each, input 1, selective 9, the head
// 6 with 4 of loss gradients, 10 of block temporaries.
TEST(MemoryEstimate, ActivationPeakPerCheckpointingMode) {
  ActivationProfile p;
  p.blocks = 4, p.block_saved = 16, p.block_input = 1, p.block_selective = 9, p.other_saved = 6;
  p.head_backward_temporary = 4, p.block_backward_temporary = 10;
  using Mode = ActivationCheckpointing::Mode;
  EXPECT_EQ(activation_peak_bytes(p), 4 * 16 + 10);                           // max(74, 74)
  EXPECT_EQ(activation_peak_bytes(p, {Mode::full}), 4 * 1 + 15 + 10);          // max(14, 29)
  EXPECT_EQ(activation_peak_bytes(p, {Mode::selective}), 4 * 9 + 7 + 10);     // max(46, 53)
  EXPECT_EQ(activation_peak_bytes(p, {Mode::full, 2}), 2 * 16 + 2 * 1 + 15 + 10);  // blocks 2 and 4 checkpointed
  p.head_backward_temporary = 100;  // the loss's gradients dominate: the backward's start is the peak
  EXPECT_EQ(activation_peak_bytes(p, {Mode::full}), 4 * 1 + 6 + 100);
  EXPECT_THROW(activation_peak_bytes(p, {Mode::full, 0}), c10::Error);
  p.block_selective = 17;
  EXPECT_THROW(activation_peak_bytes(p, {Mode::selective}), c10::Error);
}

TEST(MemoryEstimate, UnevenPaddingOnThreeRanks) {
  MemoryEstimateOptions o;
  o.world_size = 3;
  o.activation_bytes = 1000;
  o.cpu_shared_memory = false;  // Gloo's sockets: an all-gather output beside the parameters at the copy-out
  auto e = estimate_memory(two_group_params(), two_groups(), o);
  EXPECT_EQ(e.sharded_params, 96);
  EXPECT_EQ(e.padding, (2 * 1 + 2 * 4 + 2 * 1) * 4);  // root.w 6-5 rows x 2, a.w 12-10 rows x 4, a.b 12-10
  EXPECT_EQ(e.grads, 96);
  EXPECT_EQ(e.optimizer_state, 24 * 8);
  EXPECT_EQ(e.num_params, 10 + 40 + 10);
  EXPECT_EQ(e.largest_group, "a");
  // Unsharded: root 3 x 4 x 4 = 48 (kept: reshard false), a 3 x 20 x 4 = 240. With 1000 bytes of
  // activations the peak is a's backward copy-out (its all-gather buffer and its parameters beside the
  // root's) with every activation still saved and the root's full-size gradient (10 x 4) under way.
  EXPECT_EQ(e.peak_moment, "backward all-gather copy-out of 'a'");
  EXPECT_EQ(e.unsharded_params, 48 + 2 * 240);
  EXPECT_EQ(e.unsharded_grads, 40);
  EXPECT_EQ(e.reduce_scatter, 0);
  EXPECT_EQ(e.activations, 1000);
  EXPECT_EQ(e.peak_backward, 96 + 192 + 528 + 40 + 1000);
  EXPECT_EQ(e.peak_optimizer_step, 96 + 96 + 192 + 2 * 16 * 4);  // + AdamW's two fp32 temporaries of a.w's shard
  EXPECT_EQ(e.total_peak, e.peak_backward);
  // One host's shared memory (the default): a's all-gather writes straight into its parameters, so its
  // copy-out holds no buffer (48 + 240); the peak moves to the end of a's backward, where a's full-size
  // gradients (50 x 4 = 200) join the root's (40).
  o.cpu_shared_memory = true;
  e = estimate_memory(two_group_params(), two_groups(), o);
  EXPECT_EQ(e.peak_moment, "end of the backward of 'a'");
  EXPECT_EQ(e.unsharded_params, 48 + 240);
  EXPECT_EQ(e.unsharded_grads, 40 + 200);
  EXPECT_EQ(e.peak_backward, 96 + 192 + 288 + 240 + 1000);
}

TEST(MemoryEstimate, ReduceScatterPeakWithBf16ParamDtype) {
  MemoryEstimateOptions o;
  o.world_size = 3;
  o.param_dtype = torch::kBFloat16;
  o.cpu_shared_memory = false;  // Gloo's sockets: its all-to-all's receive buffer beside each input
  auto e = estimate_memory(two_group_params(), two_groups(), o);
  EXPECT_EQ(e.sharded_params, 96);  // shards stay fp32
  EXPECT_EQ(e.grads, 96);
  // No activations: the peak is the root's reduce-scatter, the last one, issued while a's is still in
  // flight. a's: input [3, 20 + 2] (132 bytes in bf16: reduce_dtype defaults to param_dtype), Gloo's
  // all-to-all receive buffer as large and the output (44); the root's: input [3, 4 + 1] (30), receive
  // buffer (30), output (10). Both groups are resharded by then and the full-size gradients were
  // released at their copy-in.
  EXPECT_EQ(e.peak_moment, "reduce-scatter of the root");
  EXPECT_EQ(e.unsharded_params, 0);
  EXPECT_EQ(e.unsharded_grads, 0);
  EXPECT_EQ(e.reduce_scatter, 30 + 30 + 10 + 132 + 132 + 44);
  EXPECT_EQ(e.peak_backward, 96 + 192 + 378);
  o.reduce_dtype = torch::kFloat32;
  e = estimate_memory(two_group_params(), two_groups(), o);
  // fp32 doubles every reduce-scatter buffer.
  EXPECT_EQ(e.peak_moment, "reduce-scatter of the root");
  EXPECT_EQ(e.reduce_scatter, 60 + 60 + 20 + 264 + 264 + 88);
  o.reduce_scatter_held_inputs = 1;  // a backend that keeps only the input (NCCL): no receive buffers
  e = estimate_memory(two_group_params(), two_groups(), o);
  EXPECT_EQ(e.peak_backward, 96 + 192 + 60 + 20 + 264 + 88);
  // Unset is 1 on one host too: its reduce-scatter reduces straight out of shared memory, no receive buffer.
  o.reduce_scatter_held_inputs.reset();
  o.cpu_shared_memory = true;
  EXPECT_EQ(estimate_memory(two_group_params(), two_groups(), o).peak_backward, e.peak_backward);
}

TEST(MemoryEstimate, PlacedReduceScatterHoldsTheGradientsNotAnInput) {
  MemoryEstimateOptions o;
  o.world_size = 3;  // fp32, one host's shared memory (the default)
  auto e = estimate_memory(two_group_params(), two_groups(), o);
  // a's reduce-scatter reads its gradients where they are ([Note: placed reduce-scatter]): no input [3, 20 + 2]
  // (264 bytes) beside them, so the copy-in moment the copy path peaks at (the root's 48 unsharded, both groups'
  // full-size gradients 40 + 200, the input 264: 552) is gone. The peak is the end of a's backward: the root (48)
  // and a (240) unsharded, their gradients (40 + 200), nothing of the reduce-scatter yet.
  EXPECT_EQ(e.peak_moment, "end of the backward of 'a'");
  EXPECT_EQ(e.unsharded_grads, 40 + 200);
  EXPECT_EQ(e.reduce_scatter, 0);
  EXPECT_EQ(e.peak_backward, 96 + 192 + 48 + 240 + 40 + 200);
  // With activations (1000) the same moment stays the peak.
  o.activation_bytes = 1000;
  EXPECT_EQ(estimate_memory(two_group_params(), two_groups(), o).peak_backward, 96 + 192 + 48 + 240 + 40 + 200 + 1000);
}

TEST(MemoryEstimate, ReshardFalseCostsOnlyUntilThePostBackward) {
  // root r [5, 2] kept and two [10, 4] groups a, b on 3 ranks: unsharded 48, 192, 192 bytes.
  std::vector<ParamInfo> params = {P("r", {5, 2}), P("a", {10, 4}), P("b", {10, 4})};
  std::vector<ShardGroupInfo> groups = {{"", {"r"}, false}, {"a", {"a"}, std::nullopt}, {"b", {"b"}, std::nullopt}};
  MemoryEstimateOptions o;
  o.world_size = 3;
  o.cpu_shared_memory = false;  // Gloo's sockets: its all-to-all's receive buffer beside each input
  // States: 36 shard elements (144 bytes) + AdamW 288. Without activations both settings peak at a's
  // reduce-scatter, after a's and b's post-backwards resharded them: the root (48), its full-size
  // gradients (40; a's were released at the copy-in), a's input [3, 17] (204), Gloo's receive buffer (204)
  // and output (68), and b's reduce-scatter still in flight (the same 476).
  for (bool reshard : {true, false}) {
    o.reshard_after_forward = reshard;
    const auto e = estimate_memory(params, groups, o);
    EXPECT_EQ(e.peak_moment, "reduce-scatter of 'a'") << reshard;
    EXPECT_EQ(e.peak_backward, 432 + 48 + 40 + 476 + 476) << reshard;
  }
  // With activations the peak moves to the end of b's backward: with reshard_after_forward=true b is
  // gathered again beside the prefetched a; with false both stayed from the forward: the same bytes.
  o.activation_bytes = 3000;
  for (bool reshard : {true, false}) {
    o.reshard_after_forward = reshard;
    const auto e = estimate_memory(params, groups, o);
    EXPECT_EQ(e.peak_moment, "end of the backward of 'b'") << reshard;
    EXPECT_EQ(e.unsharded_params, 48 + 192 + 192) << reshard;
  }
}

TEST(MemoryEstimate, BackwardPeaksWhereGradientsAndActivationsMeet) {
  // One rank, three [10, 4] fp32 groups (root kept, a and b resharded): 160 bytes each unsharded and as
  // full-size gradients, 480 of params, 960 of AdamW state; a reduce-scatter output is 41 x 4 = 164 bytes
  // and, on one rank, so is its input (no backend is called: no copy).
  std::vector<ParamInfo> params = {P("r", {10, 4}), P("a", {10, 4}), P("b", {10, 4})};
  std::vector<ShardGroupInfo> groups = {{"", {"r"}, false}, {"a", {"a"}, std::nullopt}, {"b", {"b"}, std::nullopt}};
  MemoryEstimateOptions o;
  // No activations: the peak is a's reduce-scatter: the root kept (160), the root's full-size gradients
  // (160; a's were released at the copy-in), a's input and output and b's output still in flight (3 x 164).
  auto e = estimate_memory(params, groups, o);
  EXPECT_EQ(e.peak_moment, "reduce-scatter of 'a'");
  EXPECT_EQ(e.peak_backward, 1440 + 160 + 160 + 492);
  // Activations spread over the 3 groups: all 3000 until b's backward ends, where b and the prefetched a
  // are gathered beside the root (480) with the root's and b's gradients (320).
  o.activation_bytes = 3000;
  e = estimate_memory(params, groups, o);
  EXPECT_EQ(e.peak_moment, "end of the backward of 'b'");
  EXPECT_EQ(e.peak_backward, 1440 + 3000 + 480 + 320);
}

TEST(MemoryEstimate, CpuOffloadOnAnAcceleratorMovesModelStatesToTheHost) {
  MemoryEstimateOptions o;
  o.world_size = 3;
  o.cpu_offload = true;
  o.device_is_cpu = false;
  const auto e = estimate_memory(two_group_params(), two_groups(), o);
  EXPECT_EQ(e.offloaded_host, 96 + 96 + 192);
  // On the device only what a step gathers and reduces: the peak is a's backward copy-out (the root kept
  // 48, a's all-gather buffer and parameters 2 x 240) with the root's full-size gradients (40).
  EXPECT_EQ(e.peak_moment, "backward all-gather copy-out of 'a'");
  EXPECT_EQ(e.peak_backward, 528 + 40);
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

// A parameter-dominated model (issue 14's accuracy test): an input layer, six residual MLP blocks and a
// head, all 501 wide (odd: on 2 ranks every shard is padded), 8 rows per batch: 3.3M parameters (13 MiB
// in fp32, 50 MiB of model states with AdamW) against ~200 KiB of activations. Six groups: holding every
// group's reduce-scatter buffers until the end of the backward would be ~17 MiB over the estimate.
constexpr int64_t kWide = 501, kRows = 8, kOut = 10, kBlocks = 6;
struct WideBlockImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  WideBlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kWide, kWide));
    fc2 = register_module("fc2", torch::nn::Linear(kWide, kWide));
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::relu(fc1(x))); }
};
TORCH_MODULE(WideBlock);
struct WideNetImpl : torch::nn::Module {
  torch::nn::Linear inp{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks;
  WideNetImpl() {
    inp = register_module("inp", torch::nn::Linear(kWide, kWide));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < kBlocks; ++i) blocks->push_back(WideBlock());
    head = register_module("head", torch::nn::Linear(kWide, kOut));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = inp(x);
    for (const auto& b : *blocks) x = b->as<WideBlock>()->forward(x);
    return head(x);
  }
};
TORCH_MODULE(WideNet);

struct MeasuredConfig {
  int world_size;
  std::optional<torch::ScalarType> param_dtype;
  bool reshard_after_forward;
  torch::ScalarType reduce_dtype = torch::kFloat32;  // with param_dtype
};

// Per-rank peak of live CPU bytes in a steady-state step (the second: AdamW state exists, zero_grad set
// the gradients to none), counted by the allocator, against estimate_memory's total_peak for the same
// model, groups and options. Activations are counted from the forward: per block fc1's input, its output
// (relu's input), relu's output (fc2's input) and the residual sum, plus the input layer's input and
// output; in the compute dtype. LibTorch's CPU kernels allocate nothing else large through the allocator.
void expect_estimate_within_10_percent(const MeasuredConfig& c) {
  static CountingAllocator counting;
  // Fresh counters for each run, never destroyed: tensors may be freed after the ranks (or after a later
  // run started), and their frees must not be credited to another run.
  auto* counters = new CountingAllocator::Counter[c.world_size];
  std::vector<int64_t> measured(c.world_size);
  MemoryEstimate predicted;
  {
    UseCountingAllocator use(counting);
    run_ranks(c.world_size, [&](ProcessGroupPtr pg) {
      auto& counter = counters[pg->rank()];
      CountingAllocator::current() = &counter;
      {
        auto mesh = init_device_mesh(torch::kCPU, {c.world_size}, {}, pg);
        torch::manual_seed(3);
        WideNet m;
        MemoryEstimateOptions o;
        o.world_size = c.world_size;
        o.reshard_after_forward = c.reshard_after_forward;
        MixedPrecisionPolicy mp;
        int64_t e = 4;
        if (c.param_dtype) {
          o.param_dtype = *c.param_dtype;
          o.reduce_dtype = c.reduce_dtype;
          mp = mp.param_dtype(*c.param_dtype).reduce_dtype(c.reduce_dtype);
          e = static_cast<int64_t>(c10::elementSize(*c.param_dtype));
        }
        o.activation_bytes = (2 + kBlocks * 4) * kRows * kWide * e + kRows * kOut * 4;
        std::vector<std::string> sharded = {""};  // forward order: the root's input layer first
        for (int i = 0; i < kBlocks; ++i) sharded.push_back("blocks." + std::to_string(i));
        auto groups = shard_groups(*m, sharded);
        groups[0].reshard_after_forward = false;  // the root's default
        const auto est = estimate_memory(param_infos(*m), groups, o);
        auto opts = FullyShardOptions().mesh(mesh).mp_policy(mp).reshard_after_forward(
            ReshardAfterForward(c.reshard_after_forward));
        for (const auto& b : *m->blocks) fully_shard(b, opts);
        fully_shard(m.ptr(), FullyShardOptions().mesh(mesh).mp_policy(mp));
        torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-3));
        auto step = [&] {
          auto x = torch::randn({kRows, kWide});
          auto y = torch::randint(kOut, {kRows});
          torch::nn::functional::cross_entropy(m->forward(x).to(torch::kFloat32), y).backward();
          opt.step();
          opt.zero_grad();
        };
        step();
        counter.reset_peak();
        step();
        measured[pg->rank()] = counter.peak.load();
        if (pg->rank() == 0) predicted = est;
        barrier(*pg);
      }
      CountingAllocator::current() = nullptr;
    });
  }
  for (int r = 0; r < c.world_size; ++r) {
    const double err = (static_cast<double>(predicted.total_peak) - measured[r]) / measured[r];
    std::printf("[memory] %d rank(s), %s, reshard_after_forward %d: rank %d measured %.2f MiB, predicted %.2f MiB "
                "(%+.1f%%)\n%s",
                c.world_size, !c.param_dtype ? "fp32" : c.reduce_dtype == torch::kBFloat16 ? "bf16 reduced in bf16" : "bf16",
                c.reshard_after_forward, r, measured[r] / 1048576.0,
                predicted.total_peak / 1048576.0, 100 * err, r == 0 ? format_memory_estimate(predicted).c_str() : "");
    EXPECT_LE(std::abs(err), 0.10) << "rank " << r << ": predicted " << predicted.total_peak << " bytes, measured "
                                   << measured[r];
  }
}

TEST(MemoryEstimateVsMeasured, OneRankFp32) { expect_estimate_within_10_percent({1, std::nullopt, true}); }

TEST(MemoryEstimateVsMeasured, TwoRanksBf16ReshardFalse) {
  expect_estimate_within_10_percent({2, torch::kBFloat16, false});
}

TEST(MemoryEstimateVsMeasured, TwoRanksFp32) { expect_estimate_within_10_percent({2, std::nullopt, true}); }

// Reduced in bf16: the reduce-scatter reads the gradients where they are ([Note: placed reduce-scatter]), no
// input and no copy-in.
TEST(MemoryEstimateVsMeasured, TwoRanksBf16ReducedInBf16ReshardFalse) {
  expect_estimate_within_10_percent({2, torch::kBFloat16, false, torch::kBFloat16});
}

}  // namespace
}  // namespace fsdp::testing
