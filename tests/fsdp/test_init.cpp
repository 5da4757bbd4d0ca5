// fully_shard's initialisation and what it refuses (CTest label: fully_shard): the sharded layout (torch.chunk
// rows, empty shards, ignored parameters), parameters FSDP cannot shard (scalars, non-contiguous, different
// gather dtypes: the module is left unchanged), a child's forward before the root's, and (RegressionsInit,
// RegressionsApi, issue 17 items 6 and 9: labels fully_shard, regressions) model->to(dtype) after fully_shard,
// sparse embeddings and gradients, fully_shard_tree's min_num_params, per-rank BatchNorm buffers.
#include <gtest/gtest.h>

#include <filesystem>
#include <mutex>
#include <string>

#include <unistd.h>

#include "fsdp/fsdp_state.h"
#include "fully_shard_test_util.h"
#include "resharding.h"

namespace fsdp::testing {
namespace {

TEST(BadInput, FailedFullyShardLeavesTheModuleUnchanged) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto m = std::make_shared<torch::nn::Module>();
    m->register_parameter("a", torch::ones({4, 3}));
    m->register_parameter("b", torch::ones({4, 3}).t());  // non-contiguous: rejected
    EXPECT_THROW(fully_shard(m, FullyShardOptions().mesh(mesh)), c10::Error);
    EXPECT_EQ(m->named_parameters()["a"].size(0), 4) << "validated before sharding";
    // Trainable parameters of different dtypes are refused at fully_shard, as in PyTorch (one reduction
    // dtype per group; frozen ones of other dtypes are gathered as bytes: MixedDtypeGroups).
    auto n = std::make_shared<torch::nn::Module>();
    n->register_parameter("w", torch::ones({4, 3}));
    n->register_parameter("v", torch::ones({4}, torch::kBFloat16));
    try {
      fully_shard(n, FullyShardOptions().mesh(mesh));
      FAIL();
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("different dtypes"), std::string::npos) << e.what();
    }
    EXPECT_EQ(n->named_parameters()["w"].size(0), 4);
  });
}

// Ignored parameters are neither sharded nor reduced.
TEST(Layout, IgnoredParamsStayFull) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Net net;
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto api = fully_shard(net, FullyShardOptions().mesh(mesh).ignored_params({net->head->weight}));
    EXPECT_EQ(net->head->weight.size(0), kClasses);
    EXPECT_EQ(net->wte->weight.size(0), pg->rank() == 0 ? 6 : 5);
    for (const auto& [name, dt] : api.sharded_parameters()) EXPECT_NE(name, "head.weight");
  });
}

TEST(Layout, ShardsFollowTorchChunkWithEmptyShards) {
  run_ranks(4, [](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    auto full = initial_weights();
    auto mesh = init_device_mesh(torch::kCPU, {4});
    // fc1.weight [5, 6] on 4 ranks: 2, 2, 1, 0 rows; head.weight [2, 6]: 1, 1, 0, 0.
    std::vector<int64_t> fc1_rows{2, 2, 1, 0}, head_rows{1, 1, 0, 0};
    EXPECT_EQ(net->blocks[0]->fc1->weight.size(0), fc1_rows[pg->rank()]);
    EXPECT_EQ(net->head->weight.size(0), head_rows[pg->rank()]);
    EXPECT_EQ(net->head->weight.size(1), kDim);
    // The local shards (the root here has no FSDPModule holder: its parameters read as full tensors
    // outside forward, as FSDP2's DTensor parameters, so the shards come from the state dict).
    for (const auto& [key, value] : get_model_state_dict(*net)) {
      const auto& local = std::get<DTensor>(value).to_local();
      auto chunks = full.at(key).chunk(4, 0);
      auto expect = pg->rank() < static_cast<int>(chunks.size()) ? chunks[pg->rank()] : full.at(key).narrow(0, 0, 0);
      EXPECT_TRUE(torch::equal(local, expect)) << key << " on rank " << pg->rank();
    }
    // Full tensors gather back exactly.
    for (const auto& [name, dt] : fsdp_api(*net).sharded_parameters()) {
      EXPECT_TRUE(torch::equal(dt.full_tensor(), full.at(name))) << name;
    }
  });
}

TEST(BadInput, ScalarAndNonContiguousParametersNameTheParameter) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto m = std::make_shared<torch::nn::Module>();
    m->register_parameter("temperature", torch::ones({}));
    try {
      fully_shard(m, FullyShardOptions().mesh(mesh));
      FAIL();
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("'temperature'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("scalar"), std::string::npos) << e.what();
    }
    auto n = std::make_shared<torch::nn::Module>();
    n->register_parameter("w", torch::ones({4, 3}).t());
    try {
      fully_shard(n, FullyShardOptions().mesh(mesh));
      FAIL();
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("not contiguous"), std::string::npos) << e.what();
    }
  });
}

TEST(BadInput, ChildForwardBeforeRootIsAnError) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Net net = build_sharded({}, pg);
    net->blocks[0](torch::randn({2, kDim}));
    FSDPModule<Net> model(net);
    try {
      model(torch::zeros({2, 3}, torch::kLong));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("running forward through the root module first"), std::string::npos)
          << e.what();
    }
  });
}

// A child's forward before the root's: the error names the child by its path and type (it used to
// call the child "the root").
TEST(RegressionsApi, ChildBeforeRootErrorNamesPathAndType) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Net net;
    auto mesh = init_device_mesh(torch::kCPU, {2});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    fully_shard(net, FullyShardOptions().mesh(mesh));
    net->blocks[1](torch::randn({2, kDim}));
    FSDPModule<Net> model(net);
    try {
      model(torch::zeros({2, 3}, torch::kLong));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("'blocks.1' (fsdp::testing::BlockImpl) ran forward before the root"), std::string::npos) << msg;
    }
  });
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing::resharding {
namespace {

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
// Module::to replaces every parameter's data with a converted copy; FSDP takes the copies over as its shards at
// the next unshard, as PyTorch's FSDPModule._apply (issue 30; [Note: module->to() after fully_shard]). Before
// the first forward and after a completed iteration, the model then trains in fp64 like one process in fp64; a
// partial conversion of a group, and a conversion while a group is unsharded, are refused naming the fix.
TEST(RegressionsInit, ModuleToDtypeAfterFullyShardConvertsTheShards) {
  const auto batches = make_batches(4, 4, kSeq);
  // One process in fp64, from the same weights.
  std::vector<std::map<std::string, torch::Tensor>> ref_grads;
  {
    Net ref;
    load_full(*ref, initial_weights());
    ref->to(torch::kFloat64);
    auto opt = make_optimizer(ref->parameters(), Opt::SGD);
    for (const auto& b : batches) {
      opt->zero_grad();
      loss_fn(ref(b.idx), b.targets).backward();
      std::map<std::string, torch::Tensor> g;
      for (const auto& p : ref->named_parameters()) g[p.key()] = p.value().grad().clone();
      ref_grads.push_back(g);
      opt->step();
    }
  }
  auto errors = run_ranks_collect(2, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    for (bool after_a_step : {false, true}) {
      const std::string what = after_a_step ? "converted after a step" : "converted before the first forward";
      Net net;
      load_full(*net, initial_weights());
      for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
      fully_shard(net, FullyShardOptions().mesh(mesh));
      FSDPModule<Net> model(net);
      if (after_a_step) {  // an fp32 evaluation step first (the weights do not change)
        torch::NoGradGuard no_grad;
        model(batches[0].slice(pg->rank() * 2, 2).idx);
        model.reshard();
      }
      model->to(torch::kFloat64);
      auto opt = make_optimizer(net->parameters(), Opt::SGD);
      for (size_t s = 0; s < batches.size(); ++s) {
        auto b = batches[s].slice(pg->rank() * 2, 2);
        opt->zero_grad();
        loss_fn(model(b.idx), b.targets).backward();
        for (const auto& p : net->named_parameters()) {
          EXPECT_EQ(p.value().scalar_type(), torch::kFloat64) << p.key() << " (" << what << ")";
          auto full = sharded_grad(p.value())->full_tensor();
          EXPECT_EQ(full.scalar_type(), torch::kFloat64) << p.key();
          EXPECT_TRUE(torch::allclose(full, ref_grads[s].at(p.key()), 1e-10, 1e-12))
              << p.key() << " at step " << s << " (" << what << "): max |diff| "
              << max_abs_diff(full, ref_grads[s].at(p.key()));
        }
        opt->step();
      }
    }
    auto b = batches[0].slice(pg->rank() * 2, 2);
    // Part of a group converted: refused before the all-gather, on every rank.
    FSDPModule<Net> other(shard_net(mesh));
    loss_fn(other(b.idx), b.targets).backward();
    other->to(torch::kFloat32);  // a same-dtype to() is a no-op and keeps working
    loss_fn(other(b.idx), b.targets).backward();
    other->blocks[1]->fc1->to(torch::kFloat64);  // one module of the group
    auto msg = what_of([&] { other->blocks[1].unshard(); });
    EXPECT_NE(msg.find("some parameters were converted after fully_shard"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank " + std::to_string(pg->rank())), std::string::npos) << msg;
    EXPECT_NE(msg.find("convert the whole module"), std::string::npos) << msg;
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

}  // namespace
}  // namespace fsdp::testing::resharding
