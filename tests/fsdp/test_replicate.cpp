// replicate: data parallelism without sharding (CTest labels fully_shard, fsdp_api). Every rank keeps the
// whole parameters; each replicate group's gradients are all-reduced once per backward (no all-gather and
// no reduce-scatter collective) and averaged; the training matches one process on the global batch, on
// holder and unchanged models, alone or mixed with fully_shard in one model, with gradient accumulation
// (no_sync), and from differently seeded ranks (rank 0's weights are broadcast, as DDP does).
#include <gtest/gtest.h>

#include "fully_shard_test_util.h"
#include "unchanged_models.h"

namespace fsdp::testing {
namespace {

enum class Layout { kAllReplicated, kReplicatedRootShardedBlocks, kShardedRootReplicatedBlocks };

std::string name_of(Layout l, bool holder, int ws) {
  std::string s = l == Layout::kAllReplicated                 ? "replicate everywhere"
                  : l == Layout::kReplicatedRootShardedBlocks ? "replicate root, fully_shard blocks"
                                                              : "fully_shard root, replicate blocks";
  return s + (holder ? ", holders" : ", unchanged model") + ", " + std::to_string(ws) + " ranks";
}

// Applies the layout bottom-up (blocks, then the root). Returns the number of replicate groups.
template <typename Root, typename Block>
int apply_layout(Layout layout, const Root& root, const std::vector<Block>& blocks, const DeviceMeshPtr& mesh) {
  int replicated = 0;
  for (const auto& b : blocks) {
    if (layout == Layout::kReplicatedRootShardedBlocks) {
      fully_shard(b, FullyShardOptions().mesh(mesh));
    } else {
      replicate(b, ReplicateOptions().mesh(mesh));
      ++replicated;
    }
  }
  if (layout == Layout::kShardedRootReplicatedBlocks) {
    fully_shard(root, FullyShardOptions().mesh(mesh));
  } else {
    replicate(root, ReplicateOptions().mesh(mesh));
    ++replicated;
  }
  return replicated;
}

// The full gradient of every parameter against the reference's (a replicated parameter's is its local
// gradient; a sharded one's is gathered: a collective every rank makes in the same order).
void expect_gradients(torch::nn::Module& net, const Reference& ref, size_t step, const std::string& what) {
  // The global norm, as fsdp::clip_grad_norm_ computes it from replicated and sharded gradients alike.
  const double norm = clip_grad_norm_(net.parameters(), std::numeric_limits<double>::infinity()).item<double>();
  EXPECT_NEAR(norm, ref.grad_norms[step], kGradRtol * ref.grad_norms[step]) << "gradient norm at step " << step
                                                                            << " (" << what << ")";
  for (const auto& p : net.named_parameters()) {
    auto dt = sharded_grad(p.value());
    ASSERT_TRUE(dt.has_value()) << p.key() << " has no gradient at step " << step << " (" << what << ")";
    auto full = dt->full_tensor();
    const auto& expect = ref.grads[step].at(p.key());
    EXPECT_TRUE(torch::allclose(full, expect, kGradRtol, kGradAtol))
        << "gradient of " << p.key() << " at step " << step << " (" << what << "): max |diff| "
        << max_abs_diff(full, expect);
  }
}

void expect_params(torch::nn::Module& net, const std::map<std::string, torch::Tensor>& expect, const std::string& what) {
  for (const auto& p : net.named_parameters()) {
    auto full = sharded_param(p.value()).full_tensor();
    EXPECT_TRUE(torch::allclose(full, expect.at(p.key()), kRtol, kAtol))
        << p.key() << " (" << what << "): max |diff| " << max_abs_diff(full, expect.at(p.key()));
  }
}

// Trains `ws` ranks on their slices of the global batches and compares every step's gradients and the final
// parameters with one process. Each backward of an all-replicated model issues exactly one all-reduce per
// replicate group over "replicate", and nothing over the one-rank "shard" dimension. `accumulate`: two
// microbatches per step, the first under set_requires_gradient_sync(false) (DDP's no_sync), which
// communicates nothing.
void run_replicate_parity(int ws, bool holder, Layout layout, bool accumulate = false) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches, 1, Opt::ADAMW);
  const auto what = name_of(layout, holder, ws) + (accumulate ? ", no_sync microbatch" : "");
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {ws}, {"dp"});
    std::shared_ptr<torch::nn::Module> root, first_block;
    std::function<torch::Tensor(const torch::Tensor&)> forward;
    int groups = 0;
    Net net{nullptr};
    PlainNet plain{nullptr};
    if (holder) {
      net = Net();
      load_full(*net, initial_weights());
      groups = apply_layout(layout, net, net->blocks, mesh);
      auto model = std::make_shared<FSDPModule<Net>>(net);
      forward = [model](const torch::Tensor& x) { return (*model)(x); };
      root = net.ptr();
      first_block = net->blocks[0].ptr();
    } else {
      plain = PlainNet();
      load_full(*plain, initial_weights());
      std::vector<std::shared_ptr<torch::nn::Module>> blocks;
      for (const auto& b : *plain->blocks) blocks.push_back(b);
      groups = apply_layout(layout, plain.ptr(), blocks, mesh);
      forward = [impl = plain.ptr()](const torch::Tensor& x) { return impl->forward(x); };
      root = plain.ptr();
      first_block = blocks[0];
    }
    EXPECT_EQ(is_replicated(*root), layout != Layout::kShardedRootReplicatedBlocks) << what;
    // The groups' meshes: the derived (ws, 1) mesh of the replicate groups.
    auto rep_mesh = fsdp_api(*(layout == Layout::kShardedRootReplicatedBlocks ? first_block : root)).mesh();
    ASSERT_EQ(rep_mesh->shape(), (std::vector<int64_t>{ws, 1})) << what;
    auto opt = make_optimizer(root->parameters(), Opt::ADAMW);
    const int64_t local = kBatch / ws;
    for (size_t step = 0; step < batches.size(); ++step) {
      auto mine = batches[step].slice(pg->rank() * local, local);
      opt->zero_grad();
      const auto ar0 = rep_mesh->get_group(0)->collective_count("all_reduce");
      const int micro = accumulate ? 2 : 1;
      for (int m = 0; m < micro; ++m) {
        const bool last = m == micro - 1;
        fsdp_api(*root).set_requires_gradient_sync(last);
        const int64_t begin = accumulate ? m * (local / 2) : 0;
        const int64_t rows = accumulate ? (last ? local - local / 2 : local / 2) : local;
        auto b = mine.slice(begin, rows);
        const auto before = rep_mesh->get_group(0)->collective_count("all_reduce");
        (loss_fn(forward(b.idx), b.targets) * (static_cast<double>(rows) / local)).backward();
        if (!last) {
          EXPECT_EQ(rep_mesh->get_group(0)->collective_count("all_reduce"), before) << "no_sync microbatch, " << what;
        }
      }
      if (layout == Layout::kAllReplicated) {
        EXPECT_EQ(rep_mesh->get_group(0)->collective_count("all_reduce") - ar0, static_cast<uint64_t>(groups))
            << "all-reduces per step, " << what;
      }
      EXPECT_EQ(rep_mesh->get_group(1)->collective_count("all_gather_into_tensor"), 0u) << what;
      EXPECT_EQ(rep_mesh->get_group(1)->collective_count("reduce_scatter_tensor"), 0u) << what;
      expect_gradients(*root, ref, step, what + ", rank " + std::to_string(pg->rank()));
      opt->step();
    }
    expect_params(*root, ref.final_params, what + " after training, rank " + std::to_string(pg->rank()));
  });
}

TEST(Replicate, HolderModelTrainsLikeOneProcess) {
  for (int ws : {2, 3}) run_replicate_parity(ws, /*holder=*/true, Layout::kAllReplicated);
}

TEST(Replicate, UnchangedModelTrainsLikeOneProcess) {
  for (int ws : {2, 3}) run_replicate_parity(ws, /*holder=*/false, Layout::kAllReplicated);
}

TEST(Replicate, MixedWithFullyShardInOneModelTrainsLikeOneProcess) {
  for (bool holder : {true, false}) {
    run_replicate_parity(3, holder, Layout::kReplicatedRootShardedBlocks);
    run_replicate_parity(2, holder, Layout::kShardedRootReplicatedBlocks);
  }
}

TEST(Replicate, NoSyncMicrobatchCommunicatesNothingAndTrainsLikeOneProcess) {
  run_replicate_parity(2, /*holder=*/true, Layout::kAllReplicated, /*accumulate=*/true);
  run_replicate_parity(3, /*holder=*/false, Layout::kAllReplicated, /*accumulate=*/true);
}

// DDP's constructor broadcasts rank 0's parameters: ranks whose models were built from different seeds
// hold rank 0's weights after replicate, whole (no shard), and stay equal while training.
TEST(Replicate, RanksWithDifferentWeightsStartFromRankZerosWeights) {
  auto batches = make_batches(3, kBatch, kSeq);
  run_ranks(3, [&](ProcessGroupPtr pg) {
    // Rank-dependent weights without the global generator (the ranks are threads of one process).
    auto weights_of = [](int rank) {
      std::map<std::string, torch::Tensor> w;
      int i = 0;
      for (const auto& [name, t] : initial_weights()) {
        w[name] = (torch::linspace(-1, 1, t.numel()) * (1 + rank) + 0.01 * i++).view(t.sizes());
      }
      return w;
    };
    Net net;
    load_full(*net, weights_of(pg->rank()));
    const auto rank0 = weights_of(0);
    replicate(net, ReplicateOptions().mesh(init_device_mesh(torch::kCPU, {3})));
    for (const auto& p : net->named_parameters()) {
      EXPECT_EQ(p.value().sizes(), rank0.at(p.key()).sizes()) << p.key() << ": a replicated parameter is whole";
      EXPECT_TRUE(torch::equal(p.value().detach(), rank0.at(p.key()))) << p.key() << " on rank " << pg->rank();
    }
    FSDPModule<Net> model(net);
    auto opt = make_optimizer(net->parameters(), Opt::SGD);
    for (const auto& b : batches) {
      opt->zero_grad();
      loss_fn(model(b.slice(pg->rank() * 4, 4).idx), b.slice(pg->rank() * 4, 4).targets).backward();
      opt->step();
    }
    for (const auto& p : net->named_parameters()) {
      auto mine = p.value().detach().clone();
      auto first = mine.clone();
      broadcast(first, 0, *pg);
      EXPECT_TRUE(torch::equal(mine, first)) << p.key() << " on rank " << pg->rank() << " drifted from rank 0's";
    }
  });
}

// Refused before anything changes, on every rank alike, naming the module and the fix.
TEST(Replicate, RefusalsNameTheModuleAndTheFix) {
  run_ranks(2, [&](ProcessGroupPtr pg) {
    auto expect_refusal = [&](const std::function<void()>& fn, const std::vector<std::string>& parts) {
      try {
        fn();
        ADD_FAILURE() << "not refused: expected " << parts[0];
      } catch (const c10::Error& e) {
        for (const auto& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
      }
    };
    torch::nn::Linear a(4, 6);
    auto before = a->weight.detach().clone();
    expect_refusal([&] { replicate(a, ReplicateOptions().mesh(init_device_mesh(torch::kCPU, {1, 2}))); },
                   {"replicate expects a 1-D DeviceMesh", "Fix:"});
    EXPECT_FALSE(is_replicated(*a));
    EXPECT_TRUE(torch::equal(a->weight.detach(), before)) << "a refused replicate changed the module";

    torch::nn::Linear b(4, 6);
    fully_shard(b);
    expect_refusal([&] { replicate(b); }, {"LinearImpl", "already managed by fully_shard", "Fix:"});

    torch::nn::Linear c(4, 6);
    replicate(c);
    EXPECT_TRUE(is_replicated(*c));
    expect_refusal([&] { fully_shard(c); }, {"LinearImpl", "already managed by replicate", "Fix:"});
    expect_refusal([&] { replicate(c); }, {"already managed by replicate"});
  });
}

}  // namespace
}  // namespace fsdp::testing
