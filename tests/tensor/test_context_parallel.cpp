// Context parallelism (fsdp::experimental::context_parallel; CTest label context_parallel): the head-tail
// load-balanced layout as PyTorch 2.13's _HeadTailLoadBalancer; buffers sharded and restored in place; ring
// attention (all-gather of K/V) against one process's SDPA on the full sequence, forward and backward, causal
// and not, GQA, at cp 2 and 4; a model's loss and every gradient under CP, and under FSDP x CP x TP on 8 ranks
// (2 x 2 x 2), and with checkpointed blocks (non-reentrant, selective, reentrant; backward inside the region or
// after it), against one process on the same global batch (fp32, max abs diff <= 1e-5); the refusals.
#include <gtest/gtest.h>

#include "error_message.h"
#include "fsdp/fsdp.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

using experimental::context_parallel;
using experimental::context_parallel_load_balance_indices;
using experimental::context_parallel_positions;

constexpr double kTol = 1e-5;

// The largest difference each test measured, over every rank (printed at the end of the test, for the record).
std::mutex max_mu;
double max_seen = 0.0;
void note_diff(double d) {
  std::lock_guard<std::mutex> lock(max_mu);
  max_seen = std::max(max_seen, d);
}
struct PrintMaxDiff {
  PrintMaxDiff() { max_seen = 0.0; }
  ~PrintMaxDiff() { std::cout << "[ max abs diff ] " << max_seen << std::endl; }
};

// Deterministic values (the ranks are threads of one process: no shared RNG).
torch::Tensor det(std::vector<int64_t> shape, double a, double b) {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return torch::sin(torch::arange(n, torch::kFloat32) * a + b).view(shape);
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  return (a - b).abs().max().item<double>();
}

#define EXPECT_NEAR_T(got, want, what)                                               \
  do {                                                                               \
    const double d_ = max_diff((got), (want));                                       \
    note_diff(d_);                                                                   \
    EXPECT_LE(d_, kTol) << (what) << ": max abs diff " << d_;                       \
  } while (0)

TEST(ContextParallelLayout, HeadTailAsPyTorch) {
  // PyTorch 2.13: _HeadTailLoadBalancer(8, 2)._generate_indices() == [[0, 1, 6, 7, 2, 3, 4, 5]].
  EXPECT_TRUE(torch::equal(context_parallel_load_balance_indices(8, 2),
                           torch::tensor({0, 1, 6, 7, 2, 3, 4, 5}, torch::kLong)));
  // cp 4, chunks of 1: rank i holds i and 7 - i.
  EXPECT_TRUE(torch::equal(context_parallel_load_balance_indices(8, 4),
                           torch::tensor({0, 7, 1, 6, 2, 5, 3, 4}, torch::kLong)));
  auto idx = context_parallel_load_balance_indices(24, 3);
  auto restore = context_parallel_load_balance_indices(24, 3, /*restore=*/true);
  EXPECT_TRUE(torch::equal(idx.index_select(0, restore), torch::arange(24, torch::kLong)));
  EXPECT_TRUE(torch::equal(context_parallel_positions(8, 2, 1), torch::tensor({2, 3, 4, 5}, torch::kLong)));
  const auto msg = error_message([] { context_parallel_load_balance_indices(10, 2); });
  EXPECT_NE(msg.find("sequence length 10 is not a multiple of 2 * cp = 4"), std::string::npos) << msg;
}

TEST(ContextParallelBuffers, ShardedInPlaceAndRestored) {
  for (int cp : {2, 4}) {
    run_ranks(cp, [&](ProcessGroupPtr) {
      auto mesh = init_device_mesh(torch::kCPU, {cp}, {"cp"});
      const int64_t T = 8 * cp / 2 * 2;  // 8 * cp: chunks of 4
      auto tokens = torch::arange(3 * T, torch::kLong).view({3, T});
      auto pos = torch::arange(T, torch::kLong);
      auto labels = tokens + 100;
      const auto tokens0 = tokens.clone(), labels0 = labels.clone();
      const auto r = mesh->get_local_rank(0);
      {
        context_parallel region(mesh, {tokens, labels, pos}, {1, 1, 0}, {labels});
        const auto mine = context_parallel_positions(T, cp, r);
        EXPECT_TRUE(torch::equal(region.positions(), mine));
        EXPECT_TRUE(torch::equal(pos, mine)) << pos;
        EXPECT_TRUE(torch::equal(tokens, tokens0.index_select(1, mine)));
        EXPECT_TRUE(torch::equal(labels, labels0.index_select(1, mine)));
        // The shards of all ranks, in rank order, are the load-balanced sequence.
        const int64_t c = T / (2 * cp);
        EXPECT_TRUE(torch::equal(pos.narrow(0, 0, c), torch::arange(r * c, (r + 1) * c, torch::kLong)));
        EXPECT_TRUE(torch::equal(pos.narrow(0, c, c),
                                 torch::arange((2 * cp - 1 - r) * c, (2 * cp - r) * c, torch::kLong)));
        // context_parallel_unshard puts the shards of all ranks back in original order.
        auto whole = experimental::context_parallel_unshard(mesh, {tokens, pos}, {1, -1});
        EXPECT_TRUE(torch::equal(whole[0], tokens0));
        EXPECT_TRUE(torch::equal(whole[1], torch::arange(T, torch::kLong)));
      }
      EXPECT_TRUE(torch::equal(tokens, tokens0));
      EXPECT_TRUE(torch::equal(pos, torch::arange(T, torch::kLong)));
      EXPECT_EQ(labels.size(1), T / cp);  // in no_restore_buffers: left sharded
    });
  }
}

TEST(ContextParallelErrors, RefusedWithTheSizes) {
  run_ranks(2, [&](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2}, {"cp"});
    auto odd = torch::zeros({2, 6}, torch::kLong);
    auto msg = error_message([&] { context_parallel r(mesh, {odd}, {1}); });
    EXPECT_NE(msg.find("sequence length 6 is not a multiple of 2 * cp = 2 * 2 = 4"), std::string::npos) << msg;
    EXPECT_TRUE(torch::equal(odd, torch::zeros({2, 6}, torch::kLong)));  // untouched
    auto a = torch::zeros({2, 8}), b = torch::zeros({12});
    msg = error_message([&] { context_parallel r(mesh, {a, b}, {1, 0}); });
    EXPECT_NE(msg.find("buffer 0 has 8 and buffer 1"), std::string::npos) << msg;
    msg = error_message([&] { context_parallel r(mesh, {a}, {1, 0}); });
    EXPECT_NE(msg.find("1 buffers and 2 seq dims"), std::string::npos) << msg;
    msg = error_message([&] { context_parallel r(mesh, {a}, {2}); });
    EXPECT_NE(msg.find("buffer_seq_dims[0] = 2 is out of range"), std::string::npos) << msg;
    auto w = torch::zeros({8}, torch::requires_grad());
    msg = error_message([&] { context_parallel r(mesh, {w}, {0}); });
    EXPECT_NE(msg.find("requires grad"), std::string::npos) << msg;
    msg = error_message([&] { context_parallel r(mesh, {a}, {1}, {b}); });
    EXPECT_NE(msg.find("no_restore_buffers[0] is not one of buffers"), std::string::npos) << msg;
    auto mesh2 = init_device_mesh(torch::kCPU, {1, 2}, {"dp", "cp"});
    msg = error_message([&] { context_parallel r(mesh2, {a}, {1}); });
    EXPECT_NE(msg.find("expected a 1-D cp_mesh"), std::string::npos) << msg;
    {
      context_parallel outer(mesh);
      msg = error_message([&] { context_parallel inner(mesh); });
      EXPECT_NE(msg.find("already alive on this thread"), std::string::npos) << msg;
      // SDPA under CP: dropout, masks, odd local lengths.
      auto q = det({1, 2, 4, 4}, 0.3, 0.1);
      msg = error_message([&] { torch::scaled_dot_product_attention(q, q, q, {}, 0.1, true); });
      EXPECT_NE(msg.find("dropout_p must be 0 under context parallelism, found 0.1"), std::string::npos) << msg;
      msg = error_message([&] { torch::scaled_dot_product_attention(q, q, q, torch::ones({4, 4}, torch::kBool)); });
      EXPECT_NE(msg.find("an attn_mask is not supported"), std::string::npos) << msg;
      auto q3 = det({1, 2, 3, 4}, 0.3, 0.1);
      msg = error_message([&] { torch::scaled_dot_product_attention(q3, q3, q3, {}, 0.0, true); });
      EXPECT_NE(msg.find("local sequence length 3 is odd"), std::string::npos) << msg;
    }
    // Outside the region SDPA is one process's again (no collective: it would hang or fail here).
    auto q = det({1, 2, 6, 4}, 0.3, 0.1);
    auto out = torch::scaled_dot_product_attention(q, q, q, {}, 0.0, true);
    EXPECT_EQ(out.sizes(), q.sizes());
  });
}

// SDPA on this rank's shard of q/k/v under context_parallel against one process's SDPA on the full sequence:
// the output rows and the gradients of q, k and v at this rank's positions.
struct SdpaCase {
  int cp;
  bool causal;
  int64_t kv_heads;  // < 4: GQA (enable_gqa)
  int64_t seq;
  bool three_d = false;  // q/k/v [B * H, T, E]: the one-call path with the additive mask (the non-CPU path)
};

class ContextParallelSdpa : public ::testing::TestWithParam<SdpaCase> {};

TEST_P(ContextParallelSdpa, MatchesOneProcessForwardAndBackward) {
  PrintMaxDiff print;
  const auto c = GetParam();
  run_ranks(c.cp, [&](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {c.cp}, {"cp"});
    const int64_t B = 2, H = 4, E = 8, T = c.seq;
    const bool gqa = c.kv_heads != H;
    auto qf = det({B, H, T, E}, 0.37, 0.1), kf = det({B, c.kv_heads, T, E}, 0.53, 0.7),
         vf = det({B, c.kv_heads, T, E}, 0.71, 1.3), wf = det({B, H, T, E}, 0.19, 0.4);
    if (c.three_d) {
      qf = qf.view({B * H, T, E}), kf = kf.view({B * c.kv_heads, T, E}), vf = vf.view({B * c.kv_heads, T, E});
      wf = wf.view({B * H, T, E});
    }
    const int64_t seq_dim = c.three_d ? 1 : 2;
    // One process.
    auto q_ref = qf.clone().requires_grad_(), k_ref = kf.clone().requires_grad_(), v_ref = vf.clone().requires_grad_();
    auto out_ref = torch::scaled_dot_product_attention(q_ref, k_ref, v_ref, {}, 0.0, c.causal, std::nullopt, gqa);
    (out_ref * wf).sum().backward();
    // CP: the buffers are the inputs of the attention here (a model shards its token ids instead).
    auto q = qf.clone(), k = kf.clone(), v = vf.clone(), w = wf.clone();
    torch::Tensor out, qs, ks, vs, mine;
    {
      context_parallel region(mesh, {q, k, v, w}, {seq_dim, seq_dim, seq_dim, seq_dim});
      mine = region.positions();
      qs = q.clone().requires_grad_();
      ks = k.clone().requires_grad_();
      vs = v.clone().requires_grad_();
      out = torch::scaled_dot_product_attention(qs, ks, vs, {}, 0.0, c.causal, std::nullopt, gqa);
      (out * w).sum().backward();
    }
    EXPECT_NEAR_T(out.detach(), out_ref.detach().index_select(seq_dim, mine), "output rows");
    EXPECT_NEAR_T(qs.grad(), q_ref.grad().index_select(seq_dim, mine), "dq");
    EXPECT_NEAR_T(ks.grad(), k_ref.grad().index_select(seq_dim, mine), "dk");
    EXPECT_NEAR_T(vs.grad(), v_ref.grad().index_select(seq_dim, mine), "dv");
    EXPECT_TRUE(torch::equal(q, qf));  // restored
  });
}

INSTANTIATE_TEST_SUITE_P(Cases, ContextParallelSdpa,
                         ::testing::Values(SdpaCase{2, true, 4, 12}, SdpaCase{2, false, 4, 12},
                                           SdpaCase{4, true, 4, 24}, SdpaCase{4, false, 4, 24},
                                           SdpaCase{2, true, 2, 20}, SdpaCase{4, true, 1, 8},
                                           SdpaCase{2, true, 4, 12, true}, SdpaCase{4, true, 4, 16, true},
                                           SdpaCase{4, false, 4, 16, true}),
                         [](const ::testing::TestParamInfo<SdpaCase>& info) {
                           const auto& c = info.param;
                           return "cp" + std::to_string(c.cp) + (c.causal ? "_causal" : "_full") + "_kv" +
                                  std::to_string(c.kv_heads) + "_T" + std::to_string(c.seq) + (c.three_d ? "_3d_mask" : "");
                         });

// A small attention model written as any LibTorch model: token and position embeddings (positions are an
// argument, so that CP can shard them), one attention block (SDPA, optional GQA) with an MLP, a head.
constexpr int64_t kVocab = 11, kD = 16, kHeads = 4, kHeadDim = 4, kHidden = 12, kMaxT = 32;

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t kv_heads, bool causal)
      : wq(register_module("wq", torch::nn::Linear(kD, kHeads * kHeadDim))),
        wk(register_module("wk", torch::nn::Linear(kD, kv_heads * kHeadDim))),
        wv(register_module("wv", torch::nn::Linear(kD, kv_heads * kHeadDim))),
        wo(register_module("wo", torch::nn::Linear(kHeads * kHeadDim, kD))),
        fc1(register_module("fc1", torch::nn::Linear(kD, kHidden))),
        fc2(register_module("fc2", torch::nn::Linear(kHidden, kD))),
        gqa(kv_heads != kHeads),
        causal(causal) {}
  torch::Tensor forward(torch::Tensor x) {
    const int64_t B = x.size(0), T = x.size(1);
    // -1 heads: under TP each rank has its share of the heads.
    auto q = wq(x).view({B, T, -1, kHeadDim}).transpose(1, 2);
    auto k = wk(x).view({B, T, -1, kHeadDim}).transpose(1, 2);
    auto v = wv(x).view({B, T, -1, kHeadDim}).transpose(1, 2);
    auto y = torch::scaled_dot_product_attention(q, k, v, {}, 0.0, causal, std::nullopt, gqa);
    x = x + wo(y.transpose(1, 2).reshape({B, T, -1}));
    return x + fc2(torch::gelu(fc1(x)));
  }
  torch::nn::Linear wq, wk, wv, wo, fc1, fc2;
  bool gqa, causal;
};
TORCH_MODULE(Block);

struct AttnNetImpl : torch::nn::Module {
  AttnNetImpl(int64_t kv_heads, bool causal)
      : tok(register_module("tok", torch::nn::Embedding(kVocab, kD))),
        pos(register_module("pos", torch::nn::Embedding(kMaxT, kD))),
        blocks(register_module("blocks", torch::nn::ModuleList(Block(kv_heads, causal), Block(kv_heads, causal)))),
        head(register_module("head", torch::nn::Linear(kD, kVocab))) {
    torch::NoGradGuard no_grad;
    int i = 0;
    for (auto& p : parameters()) p.copy_(torch::sin(torch::arange(p.numel(), torch::kFloat32) * 0.61 + i++).view_as(p) * 0.4);
  }
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions) {
    auto x = tok(ids) + pos(positions);
    for (const auto& b : *blocks) x = b->as<BlockImpl>()->forward(x);
    return head(x);
  }
  torch::nn::Embedding tok, pos;
  torch::nn::ModuleList blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(AttnNet);

torch::Tensor batch_ids(int64_t B, int64_t T, int step) {
  return (torch::arange(B * T, torch::kLong) * 7 + step * 3 + torch::div(torch::arange(B * T, torch::kLong), 5, "floor")).remainder(kVocab).view({B, T});
}

struct ModelCase {
  int cp;
  bool causal;
  int64_t kv_heads;
  int64_t seq;
};
class ContextParallelModel : public ::testing::TestWithParam<ModelCase> {};

// Loss and every parameter's gradient under CP (gradients averaged over cp: the loss of each rank is the mean
// over its tokens, and all ranks hold as many) against one process on the full sequence, over 3 SGD steps.
TEST_P(ContextParallelModel, LossAndGradientsMatchOneProcess) {
  PrintMaxDiff print;
  const auto c = GetParam();
  run_ranks(c.cp, [&](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {c.cp}, {"cp"});
    auto& pg = *mesh->get_group(0);
    AttnNet ref(c.kv_heads, c.causal), net(c.kv_heads, c.causal);
    torch::optim::SGD opt_ref(ref->parameters(), 0.1), opt(net->parameters(), 0.1);
    const int64_t B = 2, T = c.seq;
    for (int step = 0; step < 3; ++step) {
      auto ids = batch_ids(B, T, step), labels = (ids * 3 + 1).remainder(kVocab);
      auto positions = torch::arange(T, torch::kLong).unsqueeze(0).expand({B, T}).contiguous();
      auto loss_ref = torch::cross_entropy_loss(ref(ids, positions).view({-1, kVocab}), labels.view({-1}));
      loss_ref.backward();
      torch::Tensor loss;
      {
        context_parallel region(mesh, {ids, labels, positions}, {1, 1, 1});
        loss = torch::cross_entropy_loss(net(ids, positions).view({-1, kVocab}), labels.reshape({-1}));
        loss.backward();
      }
      auto global = loss.detach().clone();
      all_reduce(global, pg, ReduceOp::AVG).wait();
      EXPECT_NEAR_T(global, loss_ref.detach(), "loss at step " + std::to_string(step));
      auto ref_params = ref->named_parameters();
      for (auto& item : net->named_parameters()) {
        auto g = item.value().grad();
        ASSERT_TRUE(g.defined()) << item.key();
        all_reduce(g, pg, ReduceOp::AVG).wait();  // what FSDP/DDP over a dp x cp group does
        EXPECT_NEAR_T(g, ref_params[item.key()].grad(), "grad of " + item.key() + " at step " + std::to_string(step));
      }
      opt_ref.step();
      opt.step();
      opt_ref.zero_grad();
      opt.zero_grad();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Cases, ContextParallelModel,
                         ::testing::Values(ModelCase{2, true, 4, 12}, ModelCase{4, true, 4, 24},
                                           ModelCase{2, false, 4, 12}, ModelCase{4, true, 2, 16}),
                         [](const ::testing::TestParamInfo<ModelCase>& info) {
                           const auto& c = info.param;
                           return "cp" + std::to_string(c.cp) + (c.causal ? "_causal" : "_full") + "_kv" +
                                  std::to_string(c.kv_heads) + "_T" + std::to_string(c.seq);
                         });

// Checkpointed blocks under CP ([Note: regions a recomputation re-enters]): each block of the model above in
// fsdp::checkpoint (non-reentrant, selective, reentrant), the forward in a CP region and backward inside it or
// after it ended: the recomputation is ring attention again, so the loss and every gradient equal one process's.
// (Before the re-entry, backward after the region recomputed plain attention over the local rows: same shapes,
// other values, silently wrong gradients.)
TEST(ContextParallelCheckpoint, RecomputationIsRingAttentionInsideOrAfterTheRegion) {
  PrintMaxDiff print;
  const int64_t B = 2, T = 24, kv = 2;  // T: a multiple of 2 x cp for cp 2 and 4
  auto ids_full = batch_ids(B, T, 0), labels_full = (ids_full * 3 + 1).remainder(kVocab);
  auto positions_full = torch::arange(T, torch::kLong).unsqueeze(0).expand({B, T}).contiguous();
  AttnNet ref(kv, true);
  auto loss_ref = torch::cross_entropy_loss(ref(ids_full, positions_full).view({-1, kVocab}), labels_full.view({-1}));
  loss_ref.backward();
  const std::vector<std::string> kinds = {"non-reentrant", "selective", "reentrant"};
  for (const int cp : {2, 4}) {
  for (const auto& kind : kinds) {
    for (const bool backward_inside : {true, false}) {
      const std::string what = "cp " + std::to_string(cp) + ", " + kind +
                               (backward_inside ? ", backward in the region" : ", backward after the region");
      run_ranks(cp, [&](ProcessGroupPtr) {
        auto mesh = init_device_mesh(torch::kCPU, {cp}, {"cp"});
        auto& pg = *mesh->get_group(0);
        AttnNet net(kv, true);
        auto options = kind == "reentrant" ? CheckpointOptions().use_reentrant(true)
                       : kind == "selective"
                           ? CheckpointOptions().context_fn([] { return create_selective_checkpoint_contexts({"aten::mm"}); })
                           : CheckpointOptions();
        auto ids = ids_full.clone(), labels = labels_full.clone(), positions = positions_full.clone();
        torch::Tensor loss;
        {
          context_parallel region(mesh, {ids, labels, positions}, {1, 1, 1});
          // Copies of the sharded buffers: the region restores the buffers in place at its end, which a backward
          // after it would see as a modification of the embedding's saved indices.
          auto x = net->tok(ids.clone()) + net->pos(positions.clone());
          for (const auto& b : *net->blocks) {
            auto* block = b->as<BlockImpl>();
            x = checkpoint(options, [block](const torch::Tensor& t) { return block->forward(t); }, x);
          }
          loss = torch::cross_entropy_loss(net->head(x).view({-1, kVocab}), labels.clone().reshape({-1}));
          if (backward_inside) loss.backward();
        }
        if (!backward_inside) loss.backward();
        auto global = loss.detach().clone();
        all_reduce(global, pg, ReduceOp::AVG).wait();
        EXPECT_NEAR_T(global, loss_ref.detach(), what + ": loss");
        auto ref_params = ref->named_parameters();
        for (auto& item : net->named_parameters()) {
          auto g = item.value().grad();
          ASSERT_TRUE(g.defined()) << what << ": " << item.key();
          g = g.clone();
          all_reduce(g, pg, ReduceOp::AVG).wait();
          EXPECT_NEAR_T(g, ref_params[item.key()].grad(), what + ": grad of " + item.key());
        }
      });
    }
  }
  }
}

// FSDP x CP x TP on 8 ranks, mesh (dp 2, cp 2, tp 2) in torchtitan's order: TP splits the heads and the MLP,
// CP the sequence, dp the batch; fully_shard takes the (dp, cp) slice as an HSDP mesh, so that the gradient
// reduction averages over dp x cp (PyTorch flattens dp_shard and cp into one FSDP dim: same gradients).
TEST(ContextParallelComposition, FsdpCpTpOn8RanksMatchesOneProcess) {
  PrintMaxDiff print;
  run_ranks(
      8,
      [&](ProcessGroupPtr) {
        auto mesh = init_device_mesh(torch::kCPU, {2, 2, 2}, {"dp", "cp", "tp"});
        auto fsdp_mesh = mesh->slice({"dp", "cp"});
        const int64_t kv = 2;
        AttnNet ref(kv, true), net(kv, true);
        tp::parallelize_module(net, (*mesh)["tp"],
                               {{"blocks.*.wq", tp::ColwiseParallel()},
                                {"blocks.*.wk", tp::ColwiseParallel()},
                                {"blocks.*.wv", tp::ColwiseParallel()},
                                {"blocks.*.wo", tp::RowwiseParallel()},
                                {"blocks.*.fc1", tp::ColwiseParallel()},
                                {"blocks.*.fc2", tp::RowwiseParallel()}});
        const auto opts = FullyShardOptions().mesh(fsdp_mesh);
        for (const auto& b : *net->blocks) fully_shard(b, opts);
        fully_shard(net.ptr(), opts);
        torch::optim::AdamW opt_ref(ref->parameters(), torch::optim::AdamWOptions(1e-2));
        torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
        auto ref_params = ref->named_parameters();
        auto params = net->named_parameters();
        const int64_t rows = 2, dp = 2, T = 12;  // T = 12: chunks of 3 over 2 * cp = 4
        const int64_t d = mesh->get_local_rank(0);
        for (int step = 0; step < 3; ++step) {
          auto ids = batch_ids(rows * dp, T, step), labels = (ids * 3 + 1).remainder(kVocab);
          auto positions = torch::arange(T, torch::kLong).unsqueeze(0).expand({rows * dp, T}).contiguous();
          auto loss_ref = torch::cross_entropy_loss(ref(ids, positions).view({-1, kVocab}), labels.view({-1}));
          loss_ref.backward();
          auto my_ids = ids.narrow(0, d * rows, rows).clone(), my_labels = labels.narrow(0, d * rows, rows).clone(),
               my_pos = positions.narrow(0, d * rows, rows).clone();
          torch::Tensor loss;
          {
            context_parallel region((*mesh)["cp"], {my_ids, my_labels, my_pos}, {1, 1, 1});
            loss = torch::cross_entropy_loss(net(my_ids, my_pos).view({-1, kVocab}), my_labels.reshape({-1}));
            loss.backward();
          }
          auto global = loss.detach().clone();
          all_reduce(global, *fsdp_mesh->world(), ReduceOp::AVG).wait();
          EXPECT_NEAR_T(global, loss_ref.detach(), "loss at step " + std::to_string(step));
          for (const auto& item : ref_params) {
            auto g = sharded_grad(params[item.key()]);
            ASSERT_TRUE(g.has_value()) << item.key();
            EXPECT_NEAR_T(g->full_tensor(), item.value().grad(), "grad of " + item.key() + " at step " + std::to_string(step));
          }
          opt_ref.step();
          opt.step();
          opt_ref.zero_grad();
          opt.zero_grad();
        }
      },
      std::chrono::seconds(110));
}

}  // namespace
}  // namespace fsdp::testing
