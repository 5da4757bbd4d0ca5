// Implicit groups (fully_shard on modules without an FSDPModule holder), the mechanism: parity with one
// process and with the holder path, the forward stack, when the post-backward runs, what the optimizer
// and reads outside forward see, and the errors. (Users' model shapes: test_unchanged_models.cpp.)
#include "fully_shard_test_util.h"

#include "fsdp/fsdp_state.h"
#include "utils/implicit_checkpoint.h"

namespace fsdp::testing {
namespace {

// The test model of fsdp_test_model.h written as plain LibTorch: the blocks live in a ModuleList that
// the forward iterates with as<BlockImpl>(). Same parameter names as Net.
struct PlainNetImpl : torch::nn::Module {
  torch::nn::Embedding wte{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::Linear head{nullptr};
  explicit PlainNetImpl(int n_blocks = 2) {
    wte = register_module("wte", torch::nn::Embedding(kVocab, kDim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < n_blocks; ++i) blocks->push_back(Block());
    head = register_module("head", torch::nn::Linear(kDim, kClasses));
  }
  torch::Tensor forward(torch::Tensor idx) {
    auto x = wte(idx);
    for (const auto& b : *blocks) x = b->as<BlockImpl>()->forward(x);
    return head(x);
  }
};
TORCH_MODULE(PlainNet);

PlainNet build_plain(const DeviceMeshPtr& mesh, std::optional<ReshardAfterForward> raf = std::nullopt) {
  PlainNet net;
  load_full(*net, initial_weights());
  auto opts = FullyShardOptions().mesh(mesh);
  for (const auto& b : *net->blocks) fully_shard(b, FullyShardOptions(opts).reshard_after_forward(raf));
  fully_shard(net, opts);
  return net;
}

detail::FSDPState& state(const std::shared_ptr<torch::nn::Module>& m) { return detail::fsdp_state(fsdp_api(m)); }

// Each sharded parameter as a DTensor (outside forward an implicit group's parameter reads as the full
// tensor, as FSDP2's DTensor parameters do; the state dict gives the local shards).
std::map<std::string, DTensor> sharded_params(const torch::nn::Module& m) {
  std::map<std::string, DTensor> out;
  for (const auto& [k, v] : get_model_state_dict(m)) {
    if (const auto* d = std::get_if<DTensor>(&v)) out.emplace(k, *d);
  }
  return out;
}

class ImplicitWorldSizes : public ::testing::TestWithParam<int> {};

TEST_P(ImplicitWorldSizes, TrainsLikeOneProcessWithGradients) {
  const int ws = GetParam();
  const auto batches = make_batches(4, kBatch, kSeq);
  const auto ref = run_reference(batches);
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {ws}, {}, pg);
    auto net = build_plain(mesh);
    EXPECT_TRUE(state(net.ptr()).implicit);
    auto opt = make_optimizer(net->parameters(), Opt::ADAMW);
    const int64_t per = kBatch / ws;
    for (size_t s = 0; s < batches.size(); ++s) {
      opt->zero_grad();
      auto b = batches[s].slice(pg->rank() * per, per);
      auto loss = loss_fn(net->forward(b.idx), b.targets);
      loss.backward();
      compare_gradients(*net, mesh, {Shard(0)}, ref, s, pg->rank());
      opt->step();
      auto global = loss.detach().clone();
      all_reduce(global, *pg, ReduceOp::SUM);
      EXPECT_NEAR(global.item<float>() / ws, ref.losses[s], kRtol * std::abs(ref.losses[s])) << "step " << s;
    }
    for (const auto& [k, d] : sharded_params(*net)) {
      EXPECT_TRUE(torch::allclose(d.full_tensor(), ref.final_params.at(k), kRtol, kAtol)) << k;
      // Between steps a read of the parameter sees its local shard (shape and content agree), on this
      // rank alone: see [Note: reads of a sharded parameter].
      auto read = net->named_parameters()[k].detach().clone();
      EXPECT_EQ(read.sizes(), d.to_local().sizes()) << k;
      EXPECT_TRUE(torch::equal(read, d.to_local())) << k;
    }
  });
}

TEST_P(ImplicitWorldSizes, SameNumbersAsTheHolderPath) {
  const int ws = GetParam();
  const auto batches = make_batches(3, kBatch, kSeq);
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {ws}, {}, pg);
    auto plain = build_plain(mesh);
    FSDPModule<Net> holder;  // the holder path: every sharded module has an FSDPModule holder
    load_full(*holder, initial_weights());
    for (auto& b : holder->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
    fully_shard(holder, FullyShardOptions().mesh(mesh));
    EXPECT_FALSE(state(holder.ptr()).implicit);
    EXPECT_FALSE(state(holder->blocks[0].ptr()).implicit);
    auto o1 = make_optimizer(plain->parameters(), Opt::ADAMW);
    auto o2 = make_optimizer(holder->parameters(), Opt::ADAMW);
    const int64_t per = kBatch / ws;
    for (const auto& batch : batches) {
      auto b = batch.slice(pg->rank() * per, per);
      o1->zero_grad();
      o2->zero_grad();
      auto l1 = loss_fn(plain->forward(b.idx), b.targets);
      auto l2 = loss_fn(holder(b.idx), b.targets);
      EXPECT_EQ(l1.item<float>(), l2.item<float>());
      l1.backward();
      l2.backward();
      auto p1 = plain->named_parameters();
      auto p2 = holder->named_parameters();
      for (const auto& p : p1) {
        EXPECT_TRUE(torch::equal(p.value().grad(), p2[p.key()].grad())) << "gradient of " << p.key();
      }
      o1->step();
      o2->step();
    }
    auto s2 = sharded_params(*holder);
    for (const auto& [k, d] : sharded_params(*plain)) EXPECT_TRUE(torch::equal(d.to_local(), s2.at(k).to_local())) << k;
  });
}

INSTANTIATE_TEST_SUITE_P(Implicit, ImplicitWorldSizes, ::testing::Values(1, 2, 3, 4));

TEST(Implicit, AfterForwardOnlyTheRootIsUnshardedAndBlocksReduceDuringBackward) {
  run_ranks(2, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2}, {}, pg);
    auto net = build_plain(mesh);
    auto b = make_batches(1, 4, kSeq)[0];
    // Seen from the gradient of the embedding's output: the last node before the root's own.
    std::vector<detail::TrainingState> at_embedding;
    auto x = net->wte(b.idx);
    auto logits = net->forward(b.idx);
    (void)x;
    EXPECT_EQ(state(net.ptr()).group->sharded_state(), detail::ShardedState::UNSHARDED);
    for (const auto& blk : *net->blocks) {
      EXPECT_EQ(state(blk).group->sharded_state(), detail::ShardedState::SHARDED);
    }
    // Rebuild the graph with a probe on the embedding output to see the blocks' states in backward.
    logits = torch::Tensor();
    auto emb = net->wte(b.idx);
    emb.register_hook([&](const torch::Tensor& g) {
      for (const auto& blk : *net->blocks) at_embedding.push_back(state(blk).training_state);
      return g;
    });
    auto h = emb;
    for (const auto& blk : *net->blocks) h = blk->as<BlockImpl>()->forward(h);
    loss_fn(net->head(h), b.targets).backward();
    ASSERT_EQ(at_embedding.size(), 2u);
    for (auto s : at_embedding) EXPECT_EQ(s, detail::TrainingState::POST_BACKWARD);
    for (const auto& blk : *net->blocks) {
      EXPECT_EQ(state(blk).group->sharded_state(), detail::ShardedState::SHARDED);
    }
  });
}

// Between steps a read sees the local shard, on this rank alone, and leaves the group sharded; a read
// with grad enabled raises naming the parameter; in-place writes (optimizer, init) write the shard.
// See [Note: reads of a sharded parameter].
TEST(Implicit, ReadsBetweenStepsSeeTheLocalShardAndTheOptimizerStepsShards) {
  run_ranks(2, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2}, {}, pg);
    auto net = build_plain(mesh);
    auto full = initial_weights().at("blocks.0.fc1.weight");
    const auto rows = pg->rank() == 0 ? full.narrow(0, 0, 3) : full.narrow(0, 3, 2);
    auto fc1 = net->blocks[0]->as<BlockImpl>()->fc1;
    {
      torch::NoGradGuard g;
      EXPECT_NEAR(fc1->weight.sum().item<double>(), rows.sum().item<double>(), 1e-5);  // the shard
      EXPECT_TRUE(torch::equal(fc1->weight.clone(), rows));
    }
    EXPECT_TRUE(torch::equal(fc1->weight.detach().clone(), rows));  // detach: a read with grad enabled too
    EXPECT_EQ(state(net->blocks[0]).group->sharded_state(), detail::ShardedState::SHARDED);
    try {
      (void)fc1->weight.sum();
      ADD_FAILURE() << "a read with grad enabled did not raise";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("fc1.weight'"), std::string::npos) << msg;  // FQNs are from the root after lazy init
      EXPECT_NE(msg.find("with grad enabled"), std::string::npos) << msg;
      EXPECT_NE(msg.find("torch::NoGradGuard"), std::string::npos) << msg;
    }
    auto opt = torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.1).weight_decay(0.01));
    auto b = make_batches(1, 4, kSeq)[0];
    loss_fn(net->forward(b.idx), b.targets).backward();
    EXPECT_EQ(fc1->weight.grad().sizes(), fc1->weight.sizes());
    opt.step();  // weight decay reads p with its grad; updates write the shard
    EXPECT_EQ(state(net->blocks[0]).group->sharded_state(), detail::ShardedState::SHARDED);
    torch::NoGradGuard g;
    (void)fc1->weight.sum();
    torch::nn::init::zeros_(fc1->weight);  // a write after a read: the shard is zeroed
    EXPECT_EQ(fc1->weight.size(0), pg->rank() == 0 ? 3 : 2);
    EXPECT_EQ(fc1->weight.abs().sum().item<double>(), 0.0);
    auto shards = sharded_params(*net);
    EXPECT_EQ(shards.at("blocks.0.fc1.weight").full_tensor().abs().sum().item<double>(), 0.0);  // every shard
  });
}

TEST(Implicit, AnAliasOfTheShardUsedInForwardIsAnError) {
  run_ranks(2, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2}, {}, pg);
    auto net = build_plain(mesh);
    auto fc1 = net->blocks[0]->as<BlockImpl>()->fc1;
    auto stale = fc1->weight.data();  // an alias of the local shard
    auto b = make_batches(1, 4, kSeq)[0];
    (void)net->forward(b.idx);
    try {
      (void)torch::matmul(torch::ones({1, kDim}), stale.t());
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("'blocks.0.fc1.weight'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("alias of its local shard"), std::string::npos) << e.what();
    }
  });
}

TEST(Implicit, CheckpointWrapperOnAnImplicitModuleOpensRegionsFromItsParametersBeforeAndAfterSharding) {
  // Nothing calls an unchanged module's forward through libfsdp: checkpoint_wrapper marks its parameters, whose ops
  // open its regions ([Note: implicit checkpoint regions]); not the holder path's options. The reentrant form,
  // which re-runs a call, is refused naming the fix, before sharding and after it.
  run_ranks(1, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {1}, {}, pg);
    for (bool sharded : {false, true}) {
      PlainNet net;
      auto blk = net->blocks[0];
      if (sharded) fully_shard(blk, FullyShardOptions().mesh(mesh));
      try {
        checkpoint_wrapper(blk, CheckpointOptions().use_reentrant(true));
        ADD_FAILURE() << "no error";
      } catch (const c10::Error& e) {
        const std::string msg = e.what_without_backtrace();
        EXPECT_NE(msg.find("use_reentrant(true) for fsdp::testing::BlockImpl, which has no fsdp::FSDPModule holder"),
                  std::string::npos) << msg;
        EXPECT_NE(msg.find("the non-reentrant form"), std::string::npos) << msg;
      }
      EXPECT_FALSE(detail::is_implicitly_checkpointed(blk->parameters()[0])) << "a refused call marks nothing";
      checkpoint_wrapper(blk);
      EXPECT_FALSE(detail::checkpoint_options(*blk)) << "no holder call to wrap";
      for (const auto& p : blk->parameters()) EXPECT_TRUE(detail::is_implicitly_checkpointed(p));
      EXPECT_FALSE(detail::is_implicitly_checkpointed(net->head->weight));
    }
  });
}

}  // namespace
}  // namespace fsdp::testing
