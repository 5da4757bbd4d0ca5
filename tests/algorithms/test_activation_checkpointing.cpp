// Activation checkpointing (CTest label: mixed_precision; RegressionsCheckpointFn: mixed_precision, regressions;
// Unchanged: unchanged_models): checkpoint_wrapper under fully_shard gives bitwise the same losses and gradients
// and holds less memory after forward; fsdp::checkpoint (the functional form, torch.utils.checkpoint) restores the
// RNG for dropout and calls a mutable lambda's own copy; at the call site of an unchanged model it matches the
// reference and the holder model's checkpoint_wrapper; a group called twice is reduced once per backward however its
// calls are checkpointed, bit-equal to no checkpointing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>

#include "error_message.h"
#include "heap_in_use.h"
#include "fsdp/utils/activation_checkpoint.h"
#include "seed11_net.h"
#include "unchanged_harness.h"

namespace fsdp::testing::seed11_net {
namespace {

TEST(ActivationCheckpointing, ShardedLossesAndGradientsBitIdentical) {
  auto batches = make_batches(3, kBatch, kSeq, 31);
  std::map<bool, std::vector<std::map<std::string, torch::Tensor>>> grads;  // per rank
  std::map<bool, std::vector<float>> losses;
  std::mutex mu;
  for (bool ac : {false, true}) {
    grads[ac].resize(2);
    run_ranks(2, [&](ProcessGroupPtr pg) {
      Net net;
      load_full(*net, initial_weights());
      auto mesh = init_device_mesh(torch::kCPU, {2});
      for (auto& b : net->blocks) {
        if (ac) checkpoint_wrapper(b);
        fully_shard(b, FullyShardOptions().mesh(mesh));
      }
      fully_shard(net, FullyShardOptions().mesh(mesh));
      FSDPModule<Net> model(net);
      torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
      for (const auto& gb : batches) {
        auto b = gb.slice(pg->rank() * 6, 6);
        opt.zero_grad();
        auto loss = loss_fn(model(b.idx), b.targets);
        loss.backward();
        if (pg->rank() == 0) {
          std::lock_guard<std::mutex> lock(mu);
          losses[ac].push_back(loss.item<float>());
        }
        opt.step();
      }
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& p : net->named_parameters()) grads[ac][pg->rank()][p.key()] = p.value().grad().clone();
    });
  }
  EXPECT_EQ(losses[false], losses[true]);
  for (int r = 0; r < 2; ++r) {
    for (const auto& [k, g] : grads[false][r]) EXPECT_TRUE(torch::equal(g, grads[true][r].at(k))) << k << " rank " << r;
  }
}

TEST(ActivationCheckpointing, DropoutMatchesThroughRngRestore) {
  torch::manual_seed(5);
  torch::nn::Sequential seq(torch::nn::Linear(8, 16), torch::nn::Dropout(0.5), torch::nn::Linear(16, 4));
  auto x = torch::randn({6, 8}, torch::requires_grad());
  torch::manual_seed(99);
  seq->forward(x).sum().backward();
  auto g_ref = x.grad().clone();
  std::vector<torch::Tensor> pg_ref;
  for (auto& p : seq->parameters()) pg_ref.push_back(p.grad().clone());
  x.mutable_grad() = torch::Tensor();
  seq->zero_grad();
  torch::manual_seed(99);
  auto y = checkpoint([&](const torch::Tensor& in) { return seq->forward(in); }, x);
  torch::manual_seed(12345);  // the recomputation must not see this state
  y.sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), g_ref));
  auto ps = seq->parameters();
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(torch::equal(ps[i].grad(), pg_ref[i]));
}


TEST(ActivationCheckpointing, ActivationMemoryIsLower) {
  // A deeper, wider stack of blocks on one rank: activations dominate. Full checkpointing keeps the blocks' inputs;
  // selective (the matmuls' outputs saved) sits between it and no checkpointing.
  enum class Mode { kNone, kFull, kSelective };
  std::map<Mode, int64_t> held;
  for (Mode mode : {Mode::kNone, Mode::kFull, Mode::kSelective}) {
    run_ranks(1, [&](ProcessGroupPtr pg) {
      Net net(/*n_blocks=*/8);
      auto mesh = init_device_mesh(torch::kCPU, {1});
      auto selective = CheckpointOptions().context_fn(
          [] { return create_selective_checkpoint_contexts(default_selective_save_list()); });
      for (auto& b : net->blocks) {
        if (mode == Mode::kFull) checkpoint_wrapper(b);
        if (mode == Mode::kSelective) checkpoint_wrapper(b, selective);
        fully_shard(b, FullyShardOptions().mesh(mesh));
      }
      fully_shard(net, FullyShardOptions().mesh(mesh));
      FSDPModule<Net> model(net);
      auto idx = torch::randint(0, kVocab, {256, 64});
      auto tgt = torch::randint(0, kClasses, {256, 64});
      loss_fn(model(idx), tgt).backward();  // warm-up: lazy init, allocator caches
      int64_t before = heap_in_use();
      auto loss = loss_fn(model(idx), tgt);
      held[mode] = heap_in_use() - before;
      loss.backward();
    });
  }
  std::printf("[activation checkpointing] memory held after forward, 8 blocks, batch 256x64: none %lld B, full %lld B, "
              "selective %lld B\n", static_cast<long long>(held[Mode::kNone]), static_cast<long long>(held[Mode::kFull]),
              static_cast<long long>(held[Mode::kSelective]));
  EXPECT_LT(held[Mode::kFull] * 2, held[Mode::kNone]);
  EXPECT_LT(held[Mode::kFull], held[Mode::kSelective]);
  EXPECT_LT(held[Mode::kSelective], held[Mode::kNone]);
}

// offload_wrapper: the tensors saved inside each block go through save_on_cpu (the innermost hooks: an outer
// counting hook sees only the ones saved outside the blocks), and the gradients are those without it, bit for bit;
// a module without a holder is refused.
TEST(ActivationCheckpointing, OffloadWrapperSendsTheBlocksSavedTensorsThroughSaveOnCpu) {
  auto batches = make_batches(1, kBatch, kSeq, 31);
  std::map<bool, std::map<std::string, torch::Tensor>> grads;
  std::map<bool, int64_t> outer_packs;
  for (bool offload : {false, true}) {
    run_ranks(1, [&](ProcessGroupPtr pg) {
      Net net;
      load_full(*net, initial_weights());
      auto mesh = init_device_mesh(torch::kCPU, {1});
      for (auto& b : net->blocks) {
        if (offload) offload_wrapper(b);
        fully_shard(b, FullyShardOptions().mesh(mesh));
      }
      fully_shard(net, FullyShardOptions().mesh(mesh));
      FSDPModule<Net> model(net);
      int64_t packs = 0;
      torch::Tensor loss;
      {
        saved_tensors_hooks count([&packs](const torch::Tensor& t) -> c10::IValue { ++packs; return t; },
                                  [](const c10::IValue& v) { return v.toTensor(); });
        loss = loss_fn(model(batches[0].idx), batches[0].targets);
      }
      loss.backward();
      outer_packs[offload] = packs;
      for (const auto& p : net->named_parameters()) grads[offload][p.key()] = p.value().grad().clone();
    });
  }
  EXPECT_LT(outer_packs[true], outer_packs[false]) << "the blocks' saved tensors went to save_on_cpu";
  EXPECT_GT(outer_packs[true], 0) << "the rest of the model's still reach the outer hooks";
  for (const auto& [k, g] : grads[false]) EXPECT_TRUE(torch::equal(g, grads[true].at(k))) << k;
  // A module without a holder is offloaded through regions (test_apply_activation_checkpointing.cpp), and is either
  // offloaded or checkpointed.
  Block plain;
  offload_wrapper(plain);
  auto msg = error_message([&] { checkpoint_wrapper(plain); });
  EXPECT_NE(msg.find("is offloaded (offload_wrapper) already"), std::string::npos) << msg;
}

}  // namespace
}  // namespace fsdp::testing::seed11_net

namespace fsdp::testing {
namespace {

// Before the fix this file did not compile: checkpoint() stored `fn` in a non-mutable lambda, so it
// called a const copy, and a mutable lambda's operator() is non-const.
TEST(RegressionsCheckpointFn, MutableLambdaCapturingAModuleHolderByValue) {
  torch::manual_seed(3);
  torch::nn::Linear lin(8, 8);
  auto x = torch::randn({4, 8}, torch::requires_grad());
  // Reference: the same function, no checkpointing.
  torch::tanh(lin(torch::tanh(lin(x)))).pow(2).sum().backward();
  const auto gx = x.grad().clone(), gw = lin->weight.grad().clone(), gb = lin->bias.grad().clone();
  x.mutable_grad() = torch::Tensor();
  lin->zero_grad();

  auto calls = std::make_shared<int>(0);
  int local_calls = 0;  // state of the lambda itself: mutable
  auto y = checkpoint(
      [lin, calls, local_calls](const torch::Tensor& in) mutable {
        ++local_calls;
        *calls = local_calls;  // the forward and the recomputation call one copy: 1, then 2
        return torch::tanh(lin(torch::tanh(lin(in))));
      },
      x);
  EXPECT_EQ(*calls, 1);
  y.pow(2).sum().backward();
  EXPECT_EQ(*calls, 2) << "the recomputation should call the same copy of the lambda as the forward";
  EXPECT_TRUE(torch::allclose(x.grad(), gx, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(lin->weight.grad(), gw, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(lin->bias.grad(), gb, 1e-6, 1e-7));
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing::unchanged_harness {
namespace {

// ---- Activation checkpointing at the call site ------------------------------------------------------

TEST_P(Unchanged, CallSiteCheckpointMatchesReferenceAndHolderCheckpointWrapper) {
  const int ws = GetParam();
  Knobs k;
  k.checkpoint = true;
  auto [plain, holder] = plain_vs_holder(ws, k, "activation checkpointing");
  auto ref = reference_run([] { return make_plain({}); }, make_batches(kSteps3, kBatch, kSeq));
  expect_parity(plain, ref, "activation checkpointing");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Unchanged, ::testing::Values(2, 3));

}  // namespace
}  // namespace fsdp::testing::unchanged_harness

namespace fsdp::testing {
namespace {

// ---- A group called twice in one forward, with activation checkpointing -----------------------------
// A block called twice per forward whose calls are checkpointed in every way (each call by
// checkpoint_wrapper; both in one fsdp::checkpoint region; the parent by checkpoint_wrapper; each call in a
// region of its own, so recomputed by two nested backwards; a region nested in a region), the block as a
// holder or left implicit: its gradient is reduced once per backward (one reduce-scatter per group), and
// the gradients are bit-equal to the same run without checkpointing, in fp32, with bf16 mixed precision
// (bf16 reduction: a second reduce-scatter would round a partial sum; issue 28 item 6) and with a bf16
// model, on inputs with and without grad, for both reshard_after_forward values; in the three forms
// (non-reentrant, reentrant, selective with the linears saved).

struct TwiceBlockImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  torch::Tensor bias;
  TwiceBlockImpl() {
    fc = register_module("fc", torch::nn::Linear(6, 6));
    bias = register_parameter("bias", torch::randn({6}) * 0.1);
  }
  torch::Tensor forward(torch::Tensor x) { return x + torch::tanh(fc(x) + bias); }
};
TORCH_MODULE(TwiceBlock);

enum class Ckpt { kNone, kWrapper, kRegion, kParentWrapper, kEachCall, kNested };
CheckpointOptions ckpt_options;  // every region's: non-reentrant (the default) or reentrant; set before run_ranks

// The two calls: b(b(x)), in a parent module (checkpoint_wrapper of the parent: one region by module).
// `implicit`: b is left implicit (an unchanged model's module, called as b->forward).
struct TwicePairImpl : torch::nn::Module {
  FSDPModule<TwiceBlock> b{nullptr};
  TwiceBlock plain{nullptr};
  Ckpt ckpt;
  TwicePairImpl(Ckpt c, bool implicit) : ckpt(c) {
    if (implicit) {
      plain = register_module("b", TwiceBlock());
    } else {
      b = register_module("b", TwiceBlock());
    }
  }
  std::shared_ptr<torch::nn::Module> block() const { return plain ? plain.ptr() : b.ptr(); }
  torch::Tensor forward(torch::Tensor x) {
    auto* self = this;
    auto call = [self](torch::Tensor t) { return self->plain ? self->plain->forward(t) : self->b(t); };
    const auto& o = ckpt_options;
    if (ckpt == Ckpt::kRegion) return fsdp::checkpoint(o, [call](torch::Tensor t) { return call(call(t)); }, x);
    if (ckpt == Ckpt::kNested) {  // a region inside a region around both calls
      return fsdp::checkpoint(o, [call, o](torch::Tensor t) { return call(fsdp::checkpoint(o, call, t)); }, x);
    }
    if (ckpt == Ckpt::kEachCall) return fsdp::checkpoint(o, call, fsdp::checkpoint(o, call, x));  // two recomputations
    return call(call(x));
  }
};
TORCH_MODULE(TwicePair);

struct TwiceNetImpl : torch::nn::Module {
  FSDPModule<TwicePair> pair{nullptr};
  torch::nn::Linear head{nullptr};
  TwiceNetImpl(Ckpt c, bool implicit) {
    pair = register_module("pair", TwicePair(c, implicit));
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return head(pair(x)); }
};
TORCH_MODULE(TwiceNet);

TEST(ActivationCheckpointing, GroupCalledTwiceReducesOnceAndMatchesNoCheckpointBitForBit) {
  enum class Prec { kFp32, kBf16Mp, kBf16Model };
  torch::manual_seed(7);
  TwiceNet init(Ckpt::kNone, false);
  const auto w = snapshot(*init);
  const auto x = torch::randn({6, 6}) * 3;
  for (int ws : {2, 3}) {
    for (Prec prec : {Prec::kFp32, Prec::kBf16Mp, Prec::kBf16Model}) {
      if (ws == 3 && prec != Prec::kBf16Mp) continue;  // (3 ranks: uneven and empty shards, bf16 reduction)
      for (bool input_grad : {true, false}) {
        for (bool reshard : {true, false}) {
         for (bool implicit : {false, true}) {
          const std::string where = "ws " + std::to_string(ws) + " prec " + std::to_string(static_cast<int>(prec)) +
                                    " input_grad " + std::to_string(input_grad) + " reshard " + std::to_string(reshard) +
                                    (implicit ? " implicit b" : " holder b");
          std::map<Ckpt, std::vector<std::map<std::string, torch::Tensor>>> grads;
          std::mutex mu;
          std::vector<Ckpt> modes{Ckpt::kNone, Ckpt::kRegion, Ckpt::kEachCall, Ckpt::kNested};
          if (!implicit) modes.insert(modes.end(), {Ckpt::kWrapper, Ckpt::kParentWrapper});  // holders only
          // Non-reentrant, reentrant, and selective (the linears saved: their recomputation skipped).
          for (int form : {0, 1, 2}) {
          const bool reentrant = form == 1;
          ckpt_options = CheckpointOptions().use_reentrant(reentrant);
          if (form == 2) {
            ckpt_options.context_fn([] { return create_selective_checkpoint_contexts(
                {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::add.Tensor"}); });
          }
          for (Ckpt c : modes) {
            if (form > 0 && c == Ckpt::kNone) continue;
            grads[c].resize(ws);
            run_ranks(ws, [&](ProcessGroupPtr pg) {
              FSDPModule<TwiceNet> m(c, implicit);
              load_full(*m.ptr(), w);
              if (prec == Prec::kBf16Model) m->to(torch::kBFloat16);
              auto mesh = init_device_mesh(torch::kCPU, {ws});
              auto opts = FullyShardOptions().mesh(mesh).reshard_after_forward(reshard);
              if (prec == Prec::kBf16Mp) opts.mp_policy(MixedPrecisionPolicy().param_dtype(torch::kBFloat16));
              if (c == Ckpt::kWrapper) checkpoint_wrapper(m->pair->b, ckpt_options);
              if (c == Ckpt::kParentWrapper) checkpoint_wrapper(m->pair, ckpt_options);
              fully_shard(m->pair->block(), opts);
              fully_shard(m, opts);
              const int64_t rows = (6 + ws - 1) / ws;
              const int64_t begin = std::min<int64_t>(pg->rank() * rows, 6), len = std::min<int64_t>(rows, 6 - begin);
              auto in = x.narrow(0, begin, len).clone();
              if (prec == Prec::kBf16Model) in = in.to(torch::kBFloat16);
              in.requires_grad_(input_grad);
              for (int it = 0; it < 2; ++it) {
                for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
                const auto rs0 = pg->collective_count("reduce_scatter_tensor");
                m(in).to(torch::kFloat32).pow(2).sum().backward();
                EXPECT_EQ(pg->collective_count("reduce_scatter_tensor") - rs0, 2u)
                    << "one reduce-scatter per group and backward; " << where << " ckpt " << static_cast<int>(c)
                    << " iteration " << it;
              }
              std::lock_guard<std::mutex> lock(mu);
              for (const auto& p : m->named_parameters()) grads[c][pg->rank()][p.key()] = p.value().grad().clone();
            });
          }
          for (Ckpt c : modes) {
            for (int r = 0; r < ws; ++r) {
              for (const auto& [k, g] : grads[Ckpt::kNone][r]) {
                const auto& gc = grads[c][r].at(k);
                EXPECT_TRUE(torch::equal(g, gc))
                    << k << " rank " << r << " " << where << " ckpt " << static_cast<int>(c) << " form "
                    << form << ": max diff "
                    << (g.numel() ? (g.to(torch::kFloat32) - gc.to(torch::kFloat32)).abs().max().item<float>() : 0.f);
              }
            }
          }
          }
         }
        }
      }
    }
  }
}

// A region whose input is fp32 around a group computing in bf16 (mp_policy on the block only; the model
// around it is not sharded): the recomputation casts as the forward did (the holder's cast_forward_inputs and
// output_dtype, an implicit group's per-op casts), in both forms; gradients bit for bit with no checkpointing.
struct MixedRegionImpl : torch::nn::Module {
  FSDPModule<TwiceBlock> blk{nullptr};
  TwiceBlock plain{nullptr};
  torch::nn::Linear head{nullptr};
  std::optional<CheckpointOptions> ckpt;
  MixedRegionImpl(bool implicit, std::optional<CheckpointOptions> c) : ckpt(std::move(c)) {
    if (implicit) {
      plain = register_module("b", TwiceBlock());
    } else {
      blk = register_module("b", TwiceBlock());
    }
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto* self = this;
    auto call = [self](torch::Tensor t) { return (self->plain ? self->plain->forward(t) : self->blk(t)).to(torch::kFloat32); };
    auto h = torch::tanh(x);  // fp32 into the region
    return head(ckpt ? fsdp::checkpoint(*ckpt, call, h) : call(h));
  }
};
TORCH_MODULE(MixedRegion);

TEST(ActivationCheckpointing, RecomputationCastsAsTheForwardWithAPolicyOnTheBlockOnly) {
  torch::manual_seed(9);
  MixedRegion init(false, std::nullopt);
  const auto w = snapshot(*init);
  const auto x = torch::randn({5, 6}, torch::requires_grad());
  for (bool implicit : {false, true}) {
    std::vector<std::optional<CheckpointOptions>> modes{std::nullopt, CheckpointOptions(),
                                                       CheckpointOptions().use_reentrant(true)};
    std::vector<std::map<std::string, torch::Tensor>> grads;
    for (const auto& mode : modes) {
      run_ranks(1, [&](ProcessGroupPtr pg) {
        MixedRegion m(implicit, mode);
        load_full(*m, w);
        auto mp = MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat32);
        if (!implicit) mp.output_dtype(torch::kFloat32);
        fully_shard(implicit ? m->plain.ptr() : m->blk.ptr(),
                    FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {1})).mp_policy(mp));
        m->forward(x).pow(2).sum().backward();
        std::map<std::string, torch::Tensor> g;
        for (const auto& p : m->named_parameters()) g[p.key()] = p.value().grad().clone();
        grads.push_back(std::move(g));
      });
    }
    for (size_t i = 1; i < grads.size(); ++i) {
      for (const auto& [k, g] : grads[0]) {
        EXPECT_TRUE(torch::equal(g, grads[i].at(k))) << k << (implicit ? " implicit" : " holder") << " mode " << i;
      }
    }
  }
}

}  // namespace
}  // namespace fsdp::testing
