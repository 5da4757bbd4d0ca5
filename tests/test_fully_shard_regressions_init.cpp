// Regressions of issue 17 about fully_shard's setup and its observable state (CTest label `regressions`):
// item 9 (changes and modules that FSDP cannot honour are refused with a clear message, or reported)
// and item 10 (tests that see memory and resharding, not only numbers).
//
//   RegressionsInit:             model->to(dtype) after fully_shard, sparse embeddings, fully_shard_tree's
//                                min_num_params (wraps plain modules too), per-rank BatchNorm buffers.
//   RegressionsMemory:           the unsharded storage of every resharded group is freed (0 bytes).
//   RegressionsReshardAfterForward: rows, state and collectives after forward for true, false and 2.
#include <gtest/gtest.h>

#include <filesystem>
#include <mutex>

#include <unistd.h>

#include "fsdp/fsdp_state.h"
#include "fsdp_test_model.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

constexpr int64_t kSeq = 3;

std::map<std::string, torch::Tensor> init_weights() {
  static std::map<std::string, torch::Tensor> w = [] {
    torch::manual_seed(11);
    Net net;
    return snapshot(*net);
  }();
  return w;
}

// Blocks with `block_raf` (unset: the default), then the root with `root_raf`.
Net shard_net(const DeviceMeshPtr& mesh, std::optional<ReshardAfterForward> block_raf = std::nullopt,
              std::optional<ReshardAfterForward> root_raf = std::nullopt) {
  Net net;
  load_full(*net, init_weights());
  for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh).reshard_after_forward(block_raf));
  fully_shard(net, FullyShardOptions().mesh(mesh).reshard_after_forward(root_raf));
  return net;
}

// Bytes held by the unsharded parameters of a group (0 when they are freed).
int64_t unsharded_bytes(const detail::FSDPParamGroup& g) {
  int64_t b = 0;
  for (const auto& p : g.params()) {
    if (p.unsharded_padded.defined()) b += static_cast<int64_t>(p.unsharded_padded.storage().nbytes());
  }
  return b;
}

// Bytes the unsharded parameters of a group need (ws * padded rows of each, in the gather dtype).
int64_t full_unsharded_bytes(const detail::FSDPParamGroup& g) {
  int64_t b = 0;
  for (const auto& p : g.params()) {
    b += g.shard_size() * p.padded_numel() * static_cast<int64_t>(c10::elementSize(p.param_dtype));
  }
  return b;
}

std::string what_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// Collects the warnings raised on this thread (c10's warning handler is thread-local).
struct WarningCollector : c10::WarningHandler {
  std::vector<std::string> messages;
  void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
};

// ---- item 9: model->to(dtype) after fully_shard ---------------------------------------------------------
// Module::to replaces every parameter's data with a converted copy, but FSDP gathers from the shards it
// holds: the change was silently undone by the next all-gather, then failed with a bare dtype error.
TEST(RegressionsInit, ModuleToDtypeAfterFullyShardIsRefusedAtTheNextForward) {
  auto errors = run_ranks_collect(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    FSDPModule<Net> model(shard_net(mesh));
    auto b = make_batches(1, 4, kSeq)[0].slice(pg->rank() * 2, 2);
    model->to(torch::kFloat64);
    auto msg = what_of([&] { model(b.idx); });
    EXPECT_NE(msg.find("fully_shard: parameter 'wte.weight'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank " + std::to_string(pg->rank())), std::string::npos) << msg;
    EXPECT_NE(msg.find("Double"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Float"), std::string::npos) << msg;
    EXPECT_NE(msg.find("before fully_shard"), std::string::npos) << msg;
    EXPECT_NE(msg.find("mp_policy"), std::string::npos) << msg;
    // Also after a completed iteration (the parameters hold their shards again), and for an explicit
    // unshard; a same-dtype to() is a no-op and keeps working.
    FSDPModule<Net> other(shard_net(mesh));
    loss_fn(other(b.idx), b.targets).backward();
    other->to(torch::kFloat32);
    loss_fn(other(b.idx), b.targets).backward();
    other->blocks[1]->to(torch::kFloat64);
    msg = what_of([&] { other->blocks[1].unshard(); });
    EXPECT_NE(msg.find("fully_shard: parameter 'blocks.1.scale'"), std::string::npos) << msg;
    // While unsharded: an evaluation forward leaves the root (reshard_after_forward=false) unsharded.
    FSDPModule<Net> third(shard_net(mesh));
    {
      torch::NoGradGuard no_grad;
      third(b.idx);
    }
    ASSERT_EQ(third->wte->weight.size(0), kVocab) << "the root stays unsharded after an evaluation forward";
    third->to(torch::kFloat64);
    msg = what_of([&] { third(b.idx); });
    EXPECT_NE(msg.find("fully_shard: parameter 'wte.weight'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(unsharded)"), std::string::npos) << msg;
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// ---- item 9: sparse gradients ------------------------------------------------------------------------
struct SparseEmbImpl : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};
  explicit SparseEmbImpl(bool sparse) {
    emb = register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(kVocab, kDim).sparse(sparse)));
    head = register_module("head", torch::nn::Linear(kDim, kClasses));
  }
  torch::Tensor forward(torch::Tensor idx) { return head(emb(idx)); }
};
TORCH_MODULE(SparseEmb);

struct SparseBagImpl : torch::nn::Module {
  torch::nn::EmbeddingBag bag{nullptr};
  SparseBagImpl() {
    bag = register_module("bag", torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(kVocab, kDim).sparse(true)));
  }
  torch::Tensor forward(torch::Tensor idx) { return bag(idx); }
};
TORCH_MODULE(SparseBag);

// A custom module that asks for a sparse gradient through the functional form: only the backward can tell.
struct FunctionalSparseImpl : torch::nn::Module {
  torch::Tensor table;
  FunctionalSparseImpl() { table = register_parameter("table", torch::randn({kVocab, kDim})); }
  torch::Tensor forward(torch::Tensor idx) {
    return torch::embedding(table, idx, /*padding_idx=*/-1, /*scale_grad_by_freq=*/false, /*sparse=*/true);
  }
};
TORCH_MODULE(FunctionalSparse);

TEST(RegressionsInit, SparseEmbeddingIsRefusedAtFullyShard) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    SparseEmb m(true);
    auto msg = what_of([&] { fully_shard(m, FullyShardOptions().mesh(mesh)); });
    EXPECT_NE(msg.find("fully_shard: module 'emb' (torch::nn::EmbeddingImpl)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'emb.weight'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("sparse"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank " + std::to_string(pg->rank())), std::string::npos) << msg;
    EXPECT_EQ(m->emb->weight.size(0), kVocab) << "refused before anything was sharded";
    EXPECT_EQ(detail::state_of(*m), nullptr);
    // The embedding sharded by itself: same error, FQN relative to it.
    SparseEmb m2(true);
    msg = what_of([&] { fully_shard(m2->emb, FullyShardOptions().mesh(mesh)); });
    EXPECT_NE(msg.find("'weight'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("sparse"), std::string::npos) << msg;
    // EmbeddingBag too.
    SparseBag bag;
    msg = what_of([&] { fully_shard(bag, FullyShardOptions().mesh(mesh)); });
    EXPECT_NE(msg.find("'bag' (torch::nn::EmbeddingBagImpl)"), std::string::npos) << msg;
    // Ignoring the weight is a supported way out: it is not sharded, so no error.
    SparseEmb m3(true);
    fully_shard(m3, FullyShardOptions().mesh(mesh).ignored_params({m3->emb->weight}));
    EXPECT_EQ(m3->emb->weight.size(0), kVocab);
    // A dense embedding is fine.
    SparseEmb dense(false);
    fully_shard(dense, FullyShardOptions().mesh(mesh));
  });
}

TEST(RegressionsInit, SparseGradientInBackwardIsAClearErrorOnEveryRank) {
  auto errors = run_ranks_collect(2, [](ProcessGroupPtr pg) {
    FSDPModule<FunctionalSparse> m;
    fully_shard(m, FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {2})));
    m(torch::randint(0, kVocab, {2, 3})).pow(2).sum().backward();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("'table'"), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("sparse gradient"), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

// ---- item 9: fully_shard_tree with min_num_params ------------------------------------------------------
// Was MinNumParamsWarnsAboutModulesItCannotWrap: since issue 13 plain modules are wrapped too (implicit
// groups), so min_num_params selects exactly what PyTorch's size-based policy would, with no warning.
TEST(RegressionsInit, MinNumParamsWrapsPlainModulesToo) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    WarningCollector collect;
    c10::WarningUtils::WarningHandlerGuard guard(&collect);
    Net net;
    // wte: 66 elements, a plain torch::nn::Embedding; each block: 84 (FSDPModule<Block>); head: 14.
    auto wrapped = fully_shard_tree(net, AutoWrapPolicy().min_num_params(50), FullyShardOptions().mesh(mesh));
    EXPECT_EQ(wrapped, (std::vector<std::string>{"wte", "blocks.0", "blocks.1", ""}));
    EXPECT_TRUE(detail::state_of(*net->wte)->implicit);
    EXPECT_FALSE(detail::state_of(*net->blocks[0])->implicit);
    EXPECT_TRUE(collect.messages.empty()) << collect.messages[0];
  });
}

// ---- item 9: BatchNorm buffers (documented behaviour, as PyTorch FSDP2) ---------------------------------
// Buffers are not sharded nor synchronised: train-mode BatchNorm keeps per-rank running statistics;
// get_model_state_dict holds each rank's own buffers and dcp::save writes rank 0's, which dcp::load
// gives every rank.
struct BNImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  BNImpl() {
    fc = register_module("fc", torch::nn::Linear(kDim, 4));
    bn = register_module("bn", torch::nn::BatchNorm1d(4));
  }
  torch::Tensor forward(torch::Tensor x) { return bn(fc(x)); }
};
TORCH_MODULE(BN);

TEST(RegressionsInit, BatchNormBuffersStayPerRankAndACheckpointHoldsRankZeros) {
  auto parent = std::filesystem::temp_directory_path() / ("fsdp_bn_" + std::to_string(::getpid()));
  std::filesystem::remove_all(parent);
  std::filesystem::create_directories(parent);
  auto dir = parent / "ckpt";
  std::vector<torch::Tensor> means(2);
  std::mutex mu;
  run_ranks(2, [&](ProcessGroupPtr pg) {
    torch::manual_seed(5);
    FSDPModule<BN> m;
    fully_shard(m, FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {2})));
    auto x = torch::randn({8, kDim}) + 3.0 * pg->rank();  // different data per rank
    m(x).sum().backward();
    auto mine = m->bn->running_mean.clone();
    {
      std::lock_guard<std::mutex> lock(mu);
      means[pg->rank()] = mine;
    }
    auto sd = get_model_state_dict(m);
    EXPECT_TRUE(torch::equal(std::get<torch::Tensor>(sd.at("bn.running_mean")), mine)) << "own buffers";
    dcp::save(sd, dir.string(), dcp::SaveOptions().update_latest(false));
    m->bn->running_mean.zero_();
    auto target = get_model_state_dict(m);
    dcp::load(target, dir.string());
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_TRUE(torch::equal(m->bn->running_mean, means[0])) << "rank " << pg->rank() << " loads rank 0's buffers";
  });
  EXPECT_FALSE(torch::allclose(means[0], means[1])) << "each rank keeps its own running statistics";
  std::filesystem::remove_all(parent);
}

// ---- item 10: unsharded storage is freed ---------------------------------------------------------------
// A free_unsharded() that did nothing (every rank keeps the whole model) passed every numeric test.
TEST(RegressionsMemory, UnshardedStorageIsFreedAfterForwardAndAfterBackward) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto batches = make_batches(2, 4, kSeq);
    for (bool root_reshards : {false, true}) {
      FSDPModule<Net> model(shard_net(mesh, std::nullopt, ReshardAfterForward(root_reshards)));
      auto& root = *detail::fsdp_state(fsdp_api(model)).group;
      for (int it = 0; it < 2; ++it) {
        auto b = batches[it].slice(pg->rank() * 2, 2);
        auto loss = loss_fn(model(b.idx), b.targets);
        for (auto& blk : model->blocks) {
          auto& g = *detail::fsdp_state(blk.fsdp()).group;
          EXPECT_EQ(g.sharded_state(), detail::ShardedState::SHARDED);
          EXPECT_EQ(unsharded_bytes(g), 0) << "block group after forward, iteration " << it;
        }
        if (root_reshards) {
          EXPECT_EQ(unsharded_bytes(root), 0) << "root after forward with reshard_after_forward=true";
        } else {
          // The root keeps its parameters for backward: the positive control of the measurement.
          EXPECT_EQ(unsharded_bytes(root), full_unsharded_bytes(root)) << "root after forward";
          EXPECT_GT(unsharded_bytes(root), 0);
        }
        loss.backward();
        for (auto& blk : model->blocks) {
          EXPECT_EQ(unsharded_bytes(*detail::fsdp_state(blk.fsdp()).group), 0) << "block group after backward, iteration " << it;
        }
        EXPECT_EQ(unsharded_bytes(root), 0) << "root after backward, iteration " << it;
      }
      // An explicit unshard holds the full bytes; reshard frees them.
      model->blocks[0].unshard();
      auto& g0 = *detail::fsdp_state(model->blocks[0].fsdp()).group;
      EXPECT_EQ(unsharded_bytes(g0), full_unsharded_bytes(g0));
      model->blocks[0].reshard();
      EXPECT_EQ(unsharded_bytes(g0), 0) << "after FSDPModule::reshard()";
    }
  });
}

// ---- item 10: reshard_after_forward is honoured ---------------------------------------------------------
// The parity tests with false and 2 only check numbers, identical whatever the setting. Here: after
// forward, the rows the parameters hold, the group's state and bytes; and the all-gathers backward issues.
void check_reshard_after_forward(int ws, ReshardAfterForward raf) {
  auto batches = make_batches(1, 12, kSeq);
  Net ref;
  load_full(*ref, init_weights());
  loss_fn(ref->forward(batches[0].idx), batches[0].targets).backward();
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    FSDPModule<Net> model(shard_net(mesh, raf));
    const int64_t local = 12 / ws;
    auto b = batches[0].slice(pg->rank() * local, local);
    const bool keep = std::holds_alternative<bool>(raf) && !std::get<bool>(raf);
    const int k = std::holds_alternative<int>(raf) ? std::get<int>(raf) : 0;
    const uint64_t nblocks = model->blocks.size();
    auto ag0 = pg->collective_count("all_gather_into_tensor");
    auto rs0 = pg->collective_count("reduce_scatter_tensor");
    auto loss = loss_fn(model(b.idx), b.targets);
    auto ag1 = pg->collective_count("all_gather_into_tensor");
    EXPECT_EQ(ag1 - ag0, nblocks + 1) << "forward all-gathers";
    std::vector<uint64_t> pf0;
    for (auto& blk : model->blocks) {
      auto& st = detail::fsdp_state(blk.fsdp());
      auto& g = *st.group;
      const auto& fc1 = blk->fc1->weight;
      const int64_t local_rows = chunk_range(kHidden, ws, pg->rank()).length;
      if (keep) {
        EXPECT_EQ(g.sharded_state(), detail::ShardedState::UNSHARDED);
        EXPECT_EQ(fc1.size(0), kHidden) << "kept unsharded after forward";
        EXPECT_EQ(unsharded_bytes(g), full_unsharded_bytes(g));
      } else {
        EXPECT_EQ(fc1.size(0), local_rows) << "resharded after forward";
        EXPECT_EQ(unsharded_bytes(g), 0);
      }
      if (k > 1) {
        EXPECT_EQ(g.sharded_state(), detail::ShardedState::SHARDED_POST_FORWARD);
        ASSERT_TRUE(st.post_forward_group);
        EXPECT_EQ(st.post_forward_group->size(), k);
        for (const auto& p : g.params()) {
          ASSERT_TRUE(p.post_forward_shard.defined()) << p.fqn;
          EXPECT_EQ(p.post_forward_shard.numel(), ws / k * p.padded_numel()) << p.fqn << ": a 1/" << k << " slice";
        }
        pf0.push_back(st.post_forward_group->collective_count("all_gather_into_tensor"));
      } else if (!keep) {
        EXPECT_EQ(g.sharded_state(), detail::ShardedState::SHARDED);
      }
    }
    loss.backward();
    auto ag2 = pg->collective_count("all_gather_into_tensor");
    auto rs2 = pg->collective_count("reduce_scatter_tensor");
    // Backward all-gathers over the whole shard group: one per block with true, none with false (kept)
    // or k (gathered over the post-forward group of k ranks instead, one per block).
    EXPECT_EQ(ag2 - ag1, (keep || k > 1) ? 0u : nblocks) << "backward all-gathers over the shard group";
    for (size_t i = 0; i < pf0.size(); ++i) {
      auto& st = detail::fsdp_state(model->blocks[i].fsdp());
      EXPECT_EQ(st.post_forward_group->collective_count("all_gather_into_tensor") - pf0[i], 1u)
          << "block " << i << " gathers over its post-forward group in backward";
    }
    EXPECT_EQ(rs2 - rs0, nblocks + 1) << "reduce-scatters";
    // The numbers stay right: the sharded gradients are the reference's.
    for (const auto& p : model->named_parameters()) {
      auto expect = distribute_tensor(ref->named_parameters()[p.key()].grad(), mesh, {Shard(0)}).to_local();
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, 1e-6)) << p.key() << " on rank " << pg->rank();
    }
  });
}

TEST(RegressionsReshardAfterForward, TrueReshardsAfterForwardAndGathersAgainInBackward) {
  check_reshard_after_forward(2, ReshardAfterForward(true));
  check_reshard_after_forward(3, ReshardAfterForward(true));
}
TEST(RegressionsReshardAfterForward, FalseKeepsUnshardedAndSkipsTheBackwardAllGather) {
  check_reshard_after_forward(2, ReshardAfterForward(false));
  check_reshard_after_forward(3, ReshardAfterForward(false));
}
TEST(RegressionsReshardAfterForward, TwoOnFourRanksKeepsAHalfAndGathersOverPairs) {
  check_reshard_after_forward(4, ReshardAfterForward(2));
}

}  // namespace
}  // namespace fsdp::testing
