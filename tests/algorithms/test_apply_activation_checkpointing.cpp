// apply_activation_checkpointing and checkpoint_wrapper on unchanged LibTorch models (CTest label:
// activation_checkpointing; UnchangedRegions: unchanged_models too): a Sequential's elements, a ModuleList iterated in
// the user's forward and torch::nn::TransformerEncoder's layers are checkpointed without an edit of the forward
// ([Note: implicit checkpoint regions]). Each is compared bit for bit with the same model without checkpointing
// (losses and every parameter's gradient, with dropout: the RNG is restored for the replay), the regions are really
// replayed (the counters), less memory is held after forward, a selective policy applies, a buffer written in the
// region (BatchNorm's running statistics) is written once, regions end where they must (an explicit region, the
// module's next call, an autocast toggle, a saved-tensor hook scope), requires_grad set outside the dispatcher is
// replayed, and bad uses are refused naming the module. On 2 and 3
// ranks, under fully_shard (implicit groups; applied before or after sharding; bf16 mixed precision; a root holder
// whose group holds the unchanged blocks), the traces equal those without checkpointing bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "error_message.h"
#include "expect_tensors_equal.h"
#include "heap_in_use.h"
#include "fsdp/fsdp.h"
#include "multi_rank.h"
#include "unchanged_harness.h"
#include "utils/implicit_checkpoint.h"

namespace fsdp::testing::implicit_regions {
namespace {


struct Result {
  torch::Tensor loss;
  std::vector<torch::Tensor> grads;
  int64_t held = 0;  // heap bytes the forward left alive for backward
  detail::ImplicitCheckpointStats forward_stats, backward_stats;  // counters moved by the forward, the backward
};

detail::ImplicitCheckpointStats minus(const detail::ImplicitCheckpointStats& a, const detail::ImplicitCheckpointStats& b) {
  return {a.regions - b.regions, a.replays - b.replays, a.ops - b.ops};
}

// The global generator's lock: rank threads share it, so a model's construction from a seed must not meet another
// thread's reseeding (the multi-rank tests here draw nothing else: dropout 0, inputs from arange/linspace).
std::mutex& generator_mutex() {
  static std::mutex mu;
  return mu;
}

// One forward and backward of `loss_of` with the generator seeded (dropout): the loss and every gradient.
Result step(torch::nn::Module& model, const std::function<torch::Tensor()>& loss_of) {
  for (auto& p : model.parameters()) p.mutable_grad() = torch::Tensor();
  {
    std::lock_guard<std::mutex> lock(generator_mutex());
    torch::manual_seed(7);
  }
  Result r;
  const auto s0 = detail::implicit_checkpoint_stats();
  const int64_t before = heap_in_use();
  auto loss = loss_of();
  r.held = heap_in_use() - before;
  const auto s1 = detail::implicit_checkpoint_stats();
  loss.backward();
  r.backward_stats = minus(detail::implicit_checkpoint_stats(), s1);
  r.forward_stats = minus(s1, s0);
  r.loss = loss.detach();
  for (auto& p : model.parameters()) r.grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return r;
}

void expect_same(const Result& a, const Result& b, const std::string& what) {
  EXPECT_TRUE(torch::equal(a.loss, b.loss)) << what << ": loss " << a.loss.item<double>() << " vs " << b.loss.item<double>();
  expect_tensors_equal(a.grads, b.grads, what + ": gradients");
}

template <typename T>
std::function<bool(torch::nn::Module&)> is_a() {
  return [](torch::nn::Module& m) { return dynamic_cast<T*>(&m) != nullptr; };
}

// ---- A GPT-style block in a ModuleList that the model's forward iterates -------------------------------------------

struct AttnBlockImpl : torch::nn::Module {
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr};
  torch::nn::Dropout drop{nullptr};
  int64_t heads;
  AttnBlockImpl(int64_t d, int64_t h, double p) : heads(h) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
    proj = register_module("proj", torch::nn::Linear(d, d));
    fc = register_module("fc", torch::nn::Linear(d, 2 * d));
    out = register_module("out", torch::nn::Linear(2 * d, d));
    drop = register_module("drop", torch::nn::Dropout(p));
  }
  torch::Tensor forward(torch::Tensor x) {
    const auto B = x.size(0), T = x.size(1), C = x.size(2);
    auto parts = qkv(ln1(x)).view({B, T, 3, heads, C / heads}).permute({2, 0, 3, 1, 4});
    auto att = torch::matmul(parts[0], parts[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(C / heads));
    auto causal = torch::ones({T, T}, torch::kBool).tril();  // made inside the region: replayed too
    att = drop(att.masked_fill(causal.logical_not(), -1e9).softmax(-1));
    auto y = torch::matmul(att, parts[2]).transpose(1, 2).reshape({B, T, C});
    x = x + drop(proj(y));
    x = x + drop(out(torch::gelu(fc(ln2(x)))));
    return x * torch::sigmoid(x);  // ends with ops that save tensors and use no parameter
  }
};
TORCH_MODULE(AttnBlock);

struct StackNetImpl : torch::nn::Module {
  torch::nn::Embedding wte{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm lnf{nullptr};
  torch::nn::Linear head{nullptr};
  StackNetImpl(int64_t vocab, int64_t d, int64_t n, double p) {
    wte = register_module("wte", torch::nn::Embedding(vocab, d));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < n; ++i) blocks->push_back(AttnBlock(d, 4, p));
    lnf = register_module("lnf", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    head = register_module("head", torch::nn::Linear(d, vocab));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = wte(idx);
    for (const auto& m : *blocks) x = m->as<AttnBlock>()->forward(x);
    return head(lnf(x));
  }
};
TORCH_MODULE(StackNet);

StackNet make_stack(int64_t n_blocks = 4, double p = 0.2) {
  std::lock_guard<std::mutex> lock(generator_mutex());
  torch::manual_seed(3);
  return StackNet(97, 64, n_blocks, p);
}

Result stack_step(StackNet& net, int64_t batch = 8, int64_t seq = 64) {
  torch::manual_seed(5);
  auto idx = torch::randint(0, 97, {batch, seq});
  auto tgt = torch::randint(0, 97, {batch, seq});
  return step(*net, [&] { return torch::cross_entropy_loss(net->forward(idx).view({-1, 97}), tgt.view({-1})); });
}

TEST(ApplyActivationCheckpointing, ModuleListIteratedInTheUsersForwardMatchesBitForBitWithDropout) {
  auto plain = make_stack();
  auto ref = stack_step(plain);
  auto net = make_stack();
  EXPECT_EQ(apply_activation_checkpointing(*net, is_a<AttnBlockImpl>()), 4);
  for (int round = 0; round < 2; ++round) {  // (twice: a second step sees the same regions)
    auto got = stack_step(net);
    expect_same(got, ref, "round " + std::to_string(round));
    EXPECT_EQ(got.forward_stats.regions, 4) << "one region per block";
    EXPECT_EQ(got.backward_stats.replays, 4) << "each block's region replayed once";
    EXPECT_LT(got.held * 2, ref.held) << "checkpointed forward held " << got.held << " B, plain " << ref.held << " B";
    std::printf("[implicit regions] held after forward: plain %lld B, checkpointed %lld B, %lld ops recorded\n",
                static_cast<long long>(ref.held), static_cast<long long>(got.held),
                static_cast<long long>(got.forward_stats.ops));
  }
  // Broken on purpose: a replay under another RNG state than the forward's would draw other dropout masks.
  auto unrestored = make_stack();
  apply_activation_checkpointing(*unrestored, is_a<AttnBlockImpl>(), CheckpointOptions().preserve_rng_state(false));
  auto got = stack_step(unrestored);
  EXPECT_TRUE(torch::equal(got.loss, ref.loss));
  bool all_equal = true;
  for (size_t i = 0; i < got.grads.size(); ++i) all_equal = all_equal && torch::equal(got.grads[i], ref.grads[i]);
  EXPECT_FALSE(all_equal) << "without the RNG restored the replayed dropout masks differ, so must the gradients";
}

TEST(ApplyActivationCheckpointing, SelectivePolicyOnAnUnchangedModel) {
  auto plain = make_stack();
  auto ref = stack_step(plain);
  auto full_net = make_stack();
  apply_activation_checkpointing(*full_net, is_a<AttnBlockImpl>());
  auto full = stack_step(full_net);
  auto net = make_stack();
  auto sac = CheckpointOptions().context_fn(
      [] { return create_selective_checkpoint_contexts(default_selective_save_list()); });
  apply_activation_checkpointing(*net, is_a<AttnBlockImpl>(), sac);
  auto got = stack_step(net);
  expect_same(got, ref, "selective");
  EXPECT_EQ(got.backward_stats.replays, 4);
  std::printf("[implicit regions] held after forward: plain %lld B, selective %lld B, full %lld B\n",
              static_cast<long long>(ref.held), static_cast<long long>(got.held), static_cast<long long>(full.held));
  EXPECT_LT(got.held, ref.held);
  EXPECT_LT(full.held, got.held);
}

// ---- Sequential: blocks as Sequential elements --------------------------------------------------------------------

// A block as a Sequential element: a Sequential cannot hold a Sequential (its templated forward), so LibTorch users
// subclass it with a plain forward.
struct MlpBlockImpl : torch::nn::SequentialImpl {
  using torch::nn::SequentialImpl::SequentialImpl;
  torch::Tensor forward(torch::Tensor x) { return torch::nn::SequentialImpl::forward(x); }
};
TORCH_MODULE(MlpBlock);

torch::nn::Sequential make_sequential(double p = 0.3) {
  std::lock_guard<std::mutex> lock(generator_mutex());
  torch::manual_seed(4);
  torch::nn::Sequential model;
  for (int i = 0; i < 3; ++i) {
    model->push_back(MlpBlock(torch::nn::Linear(16, 32), torch::nn::GELU(), torch::nn::Dropout(p),
                              torch::nn::Linear(32, 16)));
  }
  model->push_back(torch::nn::Linear(16, 5));
  return model;
}

TEST(ApplyActivationCheckpointing, SequentialElementsMatchBitForBit) {
  torch::manual_seed(6);
  auto x = torch::randn({32, 16});
  auto plain = make_sequential();
  auto ref = step(*plain, [&] { return plain->forward(x).pow(2).mean(); });
  auto model = make_sequential();
  // The blocks, not the final Linear.
  const int64_t n = apply_activation_checkpointing(*model, is_a<MlpBlockImpl>());
  EXPECT_EQ(n, 3);
  auto got = step(*model, [&] { return model->forward(x).pow(2).mean(); });
  expect_same(got, ref, "Sequential");
  EXPECT_EQ(got.forward_stats.regions, 3);
  EXPECT_EQ(got.backward_stats.replays, 3);
  // checkpoint_wrapper on one unchanged element: the same mechanism.
  auto one = make_sequential();
  checkpoint_wrapper((*one)[1]);
  auto got_one = step(*one, [&] { return one->forward(x).pow(2).mean(); });
  expect_same(got_one, ref, "checkpoint_wrapper on element 1");
  EXPECT_EQ(got_one.backward_stats.replays, 1);
}

// ---- torch::nn::TransformerEncoder: its forward calls its layers ---------------------------------------------------

torch::nn::TransformerEncoder make_encoder(double p = 0.1) {
  std::lock_guard<std::mutex> lock(generator_mutex());
  torch::manual_seed(8);
  auto layer = torch::nn::TransformerEncoderLayer(
      torch::nn::TransformerEncoderLayerOptions(32, 4).dim_feedforward(64).dropout(p));
  return torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(layer, 3));
}

TEST(ApplyActivationCheckpointing, TransformerEncoderLayersMatchBitForBit) {
  torch::manual_seed(9);
  auto src = torch::randn({24, 4, 32});  // [T, B, E]
  auto mask = torch::triu(torch::full({24, 24}, -std::numeric_limits<float>::infinity()), 1);
  auto plain = make_encoder();
  auto ref = step(*plain, [&] { return plain->forward(src, mask).pow(2).mean(); });
  auto enc = make_encoder();
  EXPECT_EQ(apply_activation_checkpointing(*enc, is_a<torch::nn::TransformerEncoderLayerImpl>()), 3);
  auto got = step(*enc, [&] { return enc->forward(src, mask).pow(2).mean(); });
  expect_same(got, ref, "TransformerEncoder");
  EXPECT_EQ(got.forward_stats.regions, 3);
  EXPECT_EQ(got.backward_stats.replays, 3);
  EXPECT_LT(got.held, ref.held);
  // README's three lines: per-layer selective checkpointing.
  auto encoder = make_encoder();
  auto sac = fsdp::CheckpointOptions().context_fn([] { return fsdp::create_selective_checkpoint_contexts(fsdp::default_selective_save_list()); });
  auto is_layer = [](torch::nn::Module& m) { return dynamic_cast<torch::nn::TransformerEncoderLayerImpl*>(&m) != nullptr; };
  fsdp::apply_activation_checkpointing(*encoder, is_layer, sac);
  auto selective = step(*encoder, [&] { return encoder->forward(src, mask).pow(2).mean(); });
  expect_same(selective, ref, "TransformerEncoder, selective");
  EXPECT_EQ(selective.backward_stats.replays, 3);
  EXPECT_LT(selective.held, ref.held);
  EXPECT_GT(selective.held, got.held);
}

// ---- Writes inside a region -----------------------------------------------------------------------------------------

TEST(ApplyActivationCheckpointing, BufferWrittenInTheRegionIsWrittenOnce) {
  // BatchNorm's running statistics are updated by the forward; the replay updates a copy (PyTorch's recomputation
  // updates them a second time).
  auto make = [] {
    torch::manual_seed(10);
    return torch::nn::Sequential(MlpBlock(torch::nn::Linear(8, 8), torch::nn::BatchNorm1d(8), torch::nn::ReLU()),
                                 torch::nn::Linear(8, 2));
  };
  torch::manual_seed(11);
  auto x = torch::randn({16, 8});
  auto plain = make();
  auto ref = step(*plain, [&] { return plain->forward(x).pow(2).mean(); });
  auto model = make();
  checkpoint_wrapper((*model)[0]);
  auto got = step(*model, [&] { return model->forward(x).pow(2).mean(); });
  expect_same(got, ref, "BatchNorm block");
  EXPECT_EQ(got.backward_stats.replays, 1);
  auto bn_ref = (*plain)[0]->as<MlpBlock>()->ptr(1)->as<torch::nn::BatchNorm1d>();
  auto bn = (*model)[0]->as<MlpBlock>()->ptr(1)->as<torch::nn::BatchNorm1d>();
  EXPECT_TRUE(torch::equal(bn->running_mean, bn_ref->running_mean));
  EXPECT_TRUE(torch::equal(bn->running_var, bn_ref->running_var));
  EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 1);
}

// ---- The three containers under fully_shard, on 2 ranks -----------------------------------------------------------

enum class Container { Sequential, ModuleList, TransformerEncoder };

// One container's model (dropout 0: the rank threads share the global generator, so their masks would interleave),
// its blocks and root sharded as implicit groups, the blocks checkpointed (full or selective) or not; two steps of
// SGD on each rank's own batch; the local gradient shards and the loss of the last step.
Result train_container(Container c, int mode, const ProcessGroupPtr& pg) {
  auto mesh = init_device_mesh(torch::kCPU, {pg->size()});
  const auto opts = FullyShardOptions().mesh(mesh);
  const auto sac = CheckpointOptions().context_fn(
      [] { return create_selective_checkpoint_contexts(default_selective_save_list()); });
  std::shared_ptr<torch::nn::Module> root;
  std::function<torch::Tensor()> loss_of;
  const int64_t r = pg->rank();
  auto apply = [&](const std::function<bool(torch::nn::Module&)>& check) {
    if (mode > 0) EXPECT_EQ(apply_activation_checkpointing(*root, check, mode == 1 ? CheckpointOptions() : sac), 3);
  };
  if (c == Container::Sequential) {
    auto seq = make_sequential(0.0);
    for (size_t i = 0; i < 3; ++i) fully_shard(seq[i], opts);
    root = seq.ptr();
    fully_shard(root, opts);
    apply(is_a<MlpBlockImpl>());
    auto x = torch::linspace(-1, 1, 8 * 16).view({8, 16}) + 0.1 * r;
    loss_of = [seq, x]() mutable { return seq->forward(x).pow(2).mean(); };
  } else if (c == Container::ModuleList) {
    auto net = make_stack(3, 0.0);
    for (const auto& b : *net->blocks) fully_shard(b, opts);
    root = net.ptr();
    fully_shard(root, opts);
    apply(is_a<AttnBlockImpl>());
    auto idx = (torch::arange(4 * 16).view({4, 16}) * (3 + r)).remainder(97);
    auto tgt = (idx * 7 + 1).remainder(97);
    loss_of = [net, idx, tgt]() mutable {
      return torch::cross_entropy_loss(net->forward(idx).view({-1, 97}), tgt.view({-1}));
    };
  } else {
    auto enc = make_encoder(0.0);
    for (const auto& layer : *enc->layers) fully_shard(layer, opts);
    root = enc.ptr();
    fully_shard(root, opts);
    apply(is_a<torch::nn::TransformerEncoderLayerImpl>());
    auto src = torch::linspace(-2, 2, 12 * 2 * 32).view({12, 2, 32}) * (1 + 0.1 * r);
    loss_of = [enc, src]() mutable { return enc->forward(src).pow(2).mean(); };
  }
  torch::optim::SGD opt(root->parameters(), 0.1);
  Result last;
  for (int s = 0; s < 2; ++s) {
    opt.zero_grad();
    last = step(*root, loss_of);
    opt.step();
  }
  return last;
}

class ContainersOnTwoRanks : public ::testing::TestWithParam<Container> {};

TEST_P(ContainersOnTwoRanks, FullAndSelectiveMatchNoCheckpointBitForBit) {
  std::vector<std::vector<Result>> got(3, std::vector<Result>(2));
  run_ranks(2, [&](ProcessGroupPtr pg) {
    for (int mode = 0; mode < 3; ++mode) got[mode][pg->rank()] = train_container(GetParam(), mode, pg);
  });
  for (int mode = 1; mode < 3; ++mode) {
    for (int r = 0; r < 2; ++r) {
      const std::string what = std::string(mode == 1 ? "full" : "selective") + ", rank " + std::to_string(r);
      expect_same(got[mode][r], got[0][r], what);
      // (The counters are the process's: the other rank's regions may fall in this one's forward.)
      EXPECT_GE(got[mode][r].forward_stats.regions, 3) << what;
    }
  }
}

std::string container_name(const ::testing::TestParamInfo<Container>& info) {
  switch (info.param) {
    case Container::Sequential: return "Sequential";
    case Container::ModuleList: return "ModuleList";
    case Container::TransformerEncoder: return "TransformerEncoder";
  }
  return "unknown";
}

INSTANTIATE_TEST_SUITE_P(Containers, ContainersOnTwoRanks,
                         ::testing::Values(Container::Sequential, Container::ModuleList, Container::TransformerEncoder),
                         container_name);

// ---- offload_wrapper on unchanged modules ----------------------------------------------------------------------------

TEST(ApplyActivationCheckpointing, OffloadWrapperOnUnchangedBlocksSendsTheirSavedTensorsThroughSaveOnCpu) {
  // An outer counting hook sees only the tensors saved outside the blocks' regions; the gradients are those without.
  auto run = [](StackNet& net, int64_t& outer) {
    torch::manual_seed(5);
    auto idx = torch::randint(0, 97, {4, 32});
    auto tgt = torch::randint(0, 97, {4, 32});
    return step(*net, [&] {
      saved_tensors_hooks count([&outer](const torch::Tensor& t) -> c10::IValue { ++outer; return t; },
                                [](const c10::IValue& v) { return v.toTensor(); });
      return torch::cross_entropy_loss(net->forward(idx).view({-1, 97}), tgt.view({-1}));
    });
  };
  int64_t outer_plain = 0, outer_offload = 0;
  auto plain = make_stack(3, 0.1);
  auto ref = run(plain, outer_plain);
  auto net = make_stack(3, 0.1);
  for (const auto& b : *net->blocks) offload_wrapper(b);
  auto got = run(net, outer_offload);
  expect_same(got, ref, "offload_wrapper");
  EXPECT_EQ(got.forward_stats.regions, 3);
  EXPECT_EQ(got.backward_stats.replays, 0) << "nothing recomputed";
  EXPECT_GT(outer_offload, 0) << "the embedding's and the head's tensors still reach the outer hooks";
  EXPECT_LT(outer_offload * 4, outer_plain) << outer_offload << " of " << outer_plain;
}

// ---- Refusals ---------------------------------------------------------------------------------------------------------

TEST(ApplyActivationCheckpointing, BadUsesAreRefusedNamingTheModule) {
  {  // A module without parameters (nothing marks its ops); nothing is applied.
    auto model = make_sequential();
    auto msg = error_message([&] {
      apply_activation_checkpointing(*model, [](torch::nn::Module& m) {
        return dynamic_cast<torch::nn::DropoutImpl*>(&m) != nullptr || dynamic_cast<torch::nn::LinearImpl*>(&m) != nullptr;
      });
    });
    EXPECT_NE(msg.find("'0.2' (torch::nn::DropoutImpl) has no parameters"), std::string::npos) << msg;
    EXPECT_FALSE(detail::is_implicitly_checkpointed((*model)[0]->as<MlpBlock>()->ptr(0)->parameters()[0]))
        << "all or nothing";
  }
  {  // Nested matches.
    auto model = make_sequential();
    auto msg = error_message([&] {
      apply_activation_checkpointing(*model, [](torch::nn::Module& m) {
        return dynamic_cast<MlpBlockImpl*>(&m) != nullptr || dynamic_cast<torch::nn::LinearImpl*>(&m) != nullptr;
      });
    });
    EXPECT_NE(msg.find("'0.0' (torch::nn::LinearImpl) is inside '0'"), std::string::npos) << msg;
  }
  {  // Reentrant: no call to re-enter.
    auto model = make_sequential();
    auto msg = error_message([&] {
      apply_activation_checkpointing(*model, is_a<MlpBlockImpl>(), CheckpointOptions().use_reentrant(true));
    });
    EXPECT_NE(msg.find("reentrant form re-runs a call"), std::string::npos) << msg;
  }
  {  // An input of a region modified in place after the region read it: refused in backward, naming the region.
    torch::manual_seed(12);
    torch::nn::Linear a(4, 4), b(4, 4);
    checkpoint_wrapper(a);
    checkpoint_wrapper(b);
    auto x = torch::randn({3, 4});
    auto y = b(a(x));  // b's first op closes a's region (x and a's output are a's)
    x.mul_(2);         // (recorded by b's region: its own copy is kept)
    auto msg = error_message([&] { y.sum().backward(); });
    EXPECT_NE(msg.find("region of torch::nn::LinearImpl read was modified in place afterwards"), std::string::npos) << msg;
  }
  {  // A parameter written inside a region.
    torch::nn::Linear a(4, 4);
    checkpoint_wrapper(a);
    auto msg = error_message([&] {
      auto y = a(torch::randn({3, 4}));
      torch::NoGradGuard no_grad;
      a->bias.mul_(1.0);
    });
    EXPECT_NE(msg.find("writes in place into a parameter"), std::string::npos) << msg;
    // The failed forward left no region open: the next forward and backward are ordinary.
    auto y = a(torch::randn({3, 4}));
    y.sum().backward();
    EXPECT_TRUE(a->weight.grad().defined());
  }
}

TEST(ApplyActivationCheckpointing, ShardedBlocksEndingWithoutAParameterMatchBitForBit) {
  // Each block's region ends with ops that use no parameter (residual add, dropout), so the first tensor its backward
  // unpacks comes before any node of its parameters: the replay's own use of the parameters must unshard the group
  // (resharded after forward), as FSDP does for a use in backward.
  for (int ws : {2, 3}) {
    std::vector<std::vector<Result>> got(2, std::vector<Result>(ws));
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      for (int checkpointed = 0; checkpointed < 2; ++checkpointed) {
        auto net = make_stack(/*n_blocks=*/3, /*p=*/0.0);
        auto mesh = init_device_mesh(torch::kCPU, {pg->size()});
        for (const auto& b : *net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh).reshard_after_forward(true));
        fully_shard(net.ptr(), FullyShardOptions().mesh(mesh));
        if (checkpointed) EXPECT_EQ(apply_activation_checkpointing(*net, is_a<AttnBlockImpl>()), 3);
        auto idx = torch::arange(4 * 16).remainder(97).view({4, 16}) + pg->rank();
        auto tgt = (idx * 7).remainder(97);
        Result r;
        for (int s = 0; s < 2; ++s) {
          for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
          auto loss = torch::cross_entropy_loss(net->forward(idx).view({-1, 97}), tgt.view({-1}));
          loss.backward();
          r.loss = loss.detach();
          r.grads.clear();
          for (auto& p : net->parameters()) r.grads.push_back(p.grad().clone());
        }
        got[checkpointed][pg->rank()] = r;
      }
    });
    for (int r = 0; r < ws; ++r) expect_same(got[1][r], got[0][r], "ws " + std::to_string(ws) + ", rank " + std::to_string(r));
  }
}

// ---- Where regions end: explicit regions, new calls, autocast, saved-tensor hook scopes ------------------------------

TEST(ApplyActivationCheckpointing, ExplicitCheckpointAroundAnImplicitlyCheckpointedModule) {
  // fsdp::checkpoint around a block that apply_activation_checkpointing marked: the explicit region takes it (no
  // implicit region opens inside it, in forward or in its recomputation), and none is left open for the optimizer.
  auto plain = make_stack(2, 0.0);
  auto ref = stack_step(plain);
  auto net = make_stack(2, 0.0);
  apply_activation_checkpointing(*net, is_a<AttnBlockImpl>());
  torch::manual_seed(5);
  auto idx = torch::randint(0, 97, {8, 64});
  auto tgt = torch::randint(0, 97, {8, 64});
  auto got = step(*net, [&] {
    auto x = net->wte(idx);
    for (const auto& m : *net->blocks) {
      auto* blk = m->as<AttnBlock>();
      x = fsdp::checkpoint([blk](torch::Tensor t) { return blk->forward(t); }, x);
    }
    return torch::cross_entropy_loss(net->head(net->lnf(x)).view({-1, 97}), tgt.view({-1}));
  });
  expect_same(got, ref, "explicit around implicit");
  EXPECT_EQ(got.forward_stats.regions, 0);
  EXPECT_EQ(got.backward_stats.regions, 0) << "none opens in a recomputation";
  torch::optim::SGD opt(net->parameters(), 0.1);
  EXPECT_NO_THROW(opt.step());
}

TEST(ApplyActivationCheckpointing, EachCallOpensItsOwnRegionAlsoWithoutBackward) {
  // A module's next call (the parameter that opened its region used again) starts a new region: forwards without a
  // backward do not pile up in one, and a module called twice per forward is two regions.
  torch::manual_seed(13);
  torch::nn::Linear lin(6, 6), ref_lin(6, 6);
  {
    torch::NoGradGuard no_grad;
    ref_lin->weight.copy_(lin->weight);
    ref_lin->bias.copy_(lin->bias);
  }
  checkpoint_wrapper(lin);
  auto x = torch::randn({4, 6});
  const auto s0 = detail::implicit_checkpoint_stats();
  for (int i = 0; i < 3; ++i) lin(x).sum();  // (evaluation with grad enabled: no backward)
  EXPECT_EQ(detail::implicit_checkpoint_stats().regions - s0.regions, 3);
  auto got = step(*lin, [&] { return lin(torch::tanh(lin(x))).pow(2).sum(); });
  auto ref = step(*ref_lin, [&] { return ref_lin(torch::tanh(ref_lin(x))).pow(2).sum(); });
  expect_same(got, ref, "a module called twice");
  EXPECT_EQ(got.forward_stats.regions, 2);
  EXPECT_EQ(got.backward_stats.replays, 2);
}

TEST(ApplyActivationCheckpointing, AutocastToggleAndSavedTensorHookScopesEndRegions) {
  // The blocks under CPU autocast (bf16), the head and loss outside it; the second block inside a save_on_cpu scope.
  // A region runs under one autocast state and one set of hooks: each change ends it, so the replay computes what
  // the forward computed.
  auto run = [](StackNet& net) {
    torch::manual_seed(5);
    auto idx = torch::randint(0, 97, {4, 32});
    auto tgt = torch::randint(0, 97, {4, 32});
    return step(*net, [&] {
      auto x = net->wte(idx);
      at::autocast::set_autocast_enabled(at::kCPU, true);
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      x = net->blocks[0]->as<AttnBlock>()->forward(x);
      {
        fsdp::save_on_cpu offload(/*pin_memory=*/false);
        x = net->blocks[1]->as<AttnBlock>()->forward(x);
      }
      x = net->blocks[2]->as<AttnBlock>()->forward(x);
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
      return torch::cross_entropy_loss(net->head(net->lnf(x.to(torch::kFloat))).view({-1, 97}), tgt.view({-1}));
    });
  };
  auto plain = make_stack(3, 0.1);
  auto ref = run(plain);
  auto net = make_stack(3, 0.1);
  apply_activation_checkpointing(*net, is_a<AttnBlockImpl>());
  auto got = run(net);
  expect_same(got, ref, "autocast and save_on_cpu");
  EXPECT_GE(got.backward_stats.replays, 3);
}

// A block whose forward sets requires_grad outside the dispatcher (requires_grad_() on a fresh tensor): the replay
// gives the slot the forward's requires_grad, so that the ops after it save the same tensors.
struct GatedImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  GatedImpl() { lin = register_module("lin", torch::nn::Linear(6, 6)); }
  torch::Tensor forward(const torch::Tensor& x) {
    auto gate = torch::full({6}, 0.5);
    gate.requires_grad_(true);
    return torch::sigmoid(lin(x)) * gate;
  }
};
TORCH_MODULE(Gated);

// A custom autograd::Function inside a region: its node saves tensors outside the dispatcher, which a replay of ops
// cannot give back; refused in forward, naming the module.
struct SquareFn : torch::autograd::Function<SquareFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x) {
    ctx->save_for_backward({x});
    return x * x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    return {2 * ctx->get_saved_variables()[0] * g[0]};
  }
};

TEST(ApplyActivationCheckpointing, RequiresGradSetInTheRegionAndCustomFunctions) {
  torch::manual_seed(14);
  auto x = torch::randn({5, 6});
  Gated ref_m, m;
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < m->parameters().size(); ++i) m->parameters()[i].copy_(ref_m->parameters()[i]);
  }
  auto ref = step(*ref_m, [&] { return ref_m(x).sum(); });
  checkpoint_wrapper(m);
  auto got = step(*m, [&] { return m(x).sum(); });
  expect_same(got, ref, "requires_grad_ in the region");
  EXPECT_EQ(got.backward_stats.replays, 1);

  torch::nn::Linear lin(6, 6);
  checkpoint_wrapper(lin);
  auto msg = error_message([&] { SquareFn::apply(lin(x)); });
  EXPECT_NE(msg.find("saved for backward outside the ops of the checkpointed region of torch::nn::LinearImpl"),
            std::string::npos) << msg;
  // The refused region ended: the thread's next ops are ordinary (not recorded, not saved through its hooks).
  const auto s0 = detail::implicit_checkpoint_stats();
  auto z = torch::randn({3, 3}, torch::requires_grad());
  (z * z).sum().backward();
  EXPECT_EQ(detail::implicit_checkpoint_stats().ops - s0.ops, 0);
  EXPECT_TRUE(torch::equal(z.grad(), 2 * z));
}

}  // namespace
}  // namespace fsdp::testing::implicit_regions

namespace fsdp::testing::unchanged_harness {
namespace {

// ---- Under fully_shard, on 2 and 3 ranks --------------------------------------------------------------------------

enum class When { Before, After };

struct RegionSetup {
  When when = When::After;
  MixedPrecisionPolicy mp;
  bool root_holder = false;  // FSDPModule<PlainNet> with one group (its blocks unchanged inside it)
  CheckpointOptions options;
  int calls_per_block = 1;
};

// PlainNet (blocks in a ModuleList iterated by its forward), sharded as sharded_plain does (or with a root holder),
// its blocks checkpointed by apply_activation_checkpointing (or not).
Trace run_plain(ProcessGroupPtr pg, const RegionSetup& s, bool checkpointed, const std::vector<Batch>& batches) {
  PlainNet net;
  load_full(*net, initial_weights());
  net->calls_per_block = s.calls_per_block;
  auto ac = [&] {
    if (!checkpointed) return;
    EXPECT_EQ(apply_activation_checkpointing(
                  *net, [](torch::nn::Module& m) { return dynamic_cast<BlockImpl*>(&m) != nullptr; }, s.options),
              static_cast<int64_t>(net->blocks->size()));
  };
  auto opts = FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {pg->size()})).mp_policy(s.mp);
  if (s.when == When::Before) ac();
  Model m;
  if (s.root_holder) {
    FSDPModule<PlainNet> holder(net);
    fully_shard(net, opts);
    m = {net.ptr(), [holder](const torch::Tensor& x) mutable { return holder(x); }};
  } else {
    for (size_t i = 0; i < net->blocks->size(); ++i) fully_shard(net->blocks[i], opts);
    fully_shard(net, opts);
    m = as_model(net);
  }
  if (s.when == When::After) ac();
  return train_sharded(m, pg, batches);
}

class UnchangedRegions : public ::testing::TestWithParam<int> {};  // world size

void expect_checkpointed_equals_plain(int ws, const RegionSetup& s, const std::string& what) {
  auto batches = make_batches(kSteps3, kBatch, kSeq);
  std::vector<Trace> plain(ws), ckpt(ws);
  const auto before = detail::implicit_checkpoint_stats();
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    plain[pg->rank()] = run_plain(pg, s, false, batches);
    ckpt[pg->rank()] = run_plain(pg, s, true, batches);
  });
  const auto after = detail::implicit_checkpoint_stats();
  // Every rank's every step replays each block's region once.
  EXPECT_GE(after.replays - before.replays, int64_t{ws} * kSteps3 * 2) << what;
  for (int r = 0; r < ws; ++r) {
    EXPECT_EQ(ckpt[r].losses.size(), static_cast<size_t>(kSteps3)) << what << ", rank " << r;
    EXPECT_EQ(diff_traces(ckpt[r], plain[r]), "") << what << ": checkpointed vs not, rank " << r;
  }
}

TEST_P(UnchangedRegions, AppliedAfterFullyShardMatchesNoCheckpointBitForBit) {
  expect_checkpointed_equals_plain(GetParam(), RegionSetup{}, "applied after fully_shard");
}

TEST_P(UnchangedRegions, AppliedBeforeFullyShardMatchesNoCheckpointBitForBit) {
  RegionSetup s;
  s.when = When::Before;
  expect_checkpointed_equals_plain(GetParam(), s, "applied before fully_shard");
}

TEST_P(UnchangedRegions, Bf16MixedPrecisionMatchesNoCheckpointBitForBit) {
  RegionSetup s;
  s.mp = MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat32);
  expect_checkpointed_equals_plain(GetParam(), s, "bf16 mixed precision");
}

TEST_P(UnchangedRegions, UnchangedBlocksInsideARootHolderGroupMatchBitForBit) {
  RegionSetup s;
  s.root_holder = true;
  expect_checkpointed_equals_plain(GetParam(), s, "root holder");
}

TEST_P(UnchangedRegions, SelectiveInsideARootHolderGroupMatchesBitForBit) {
  RegionSetup s;
  s.root_holder = true;
  s.options.context_fn([] { return create_selective_checkpoint_contexts(default_selective_save_list()); });
  expect_checkpointed_equals_plain(GetParam(), s, "selective, root holder");
}

TEST_P(UnchangedRegions, BlocksCalledTwicePerForwardMatchBitForBit) {
  RegionSetup s;
  s.calls_per_block = 2;
  s.mp = MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat32);
  expect_checkpointed_equals_plain(GetParam(), s, "blocks called twice, bf16");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, UnchangedRegions, ::testing::Values(2, 3));

}  // namespace
}  // namespace fsdp::testing::unchanged_harness
