// MixedPrecisionPolicy, ShardedGradScaler, CPUOffloadPolicy, clip_grad_norm_ and activation
// checkpointing (CTest label: mixed_precision).
#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdio>

#include "fsdp/fsdp_state.h"
#include "fsdp_test_model.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

constexpr int64_t kBatch = 12;
constexpr int64_t kSeq = 3;

std::map<std::string, torch::Tensor> initial_weights() {
  static std::map<std::string, torch::Tensor> w = [] {
    torch::manual_seed(11);
    Net net;
    return snapshot(*net);
  }();
  return w;
}

Net sharded_net(ProcessGroupPtr pg, const FullyShardOptions& base) {
  Net net;
  load_full(*net, initial_weights());
  auto opts = base;
  opts.mesh(init_device_mesh(torch::kCPU, {pg->size()}));
  for (auto& b : net->blocks) fully_shard(b, opts);
  fully_shard(net, opts);
  return net;
}

FullyShardOptions bf16(torch::ScalarType reduce) {
  return FullyShardOptions().mp_policy(MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(reduce));
}

// The single-process reference doing the same casts as bf16 FSDP on `ws` ranks: for each rank's slice,
// a bf16 copy of the fp32 master weights computes a bf16 loss and bf16 gradients; the gradients are
// summed in fp64 over slices and divided by ws (the reduce-scatter in reduce_dtype=fp32 plus FSDP's
// division), and AdamW updates the fp32 master weights.
struct MpReference {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> first_grads;  // after step 0's backward, fp64
  std::map<std::string, torch::Tensor> final_params;
};
MpReference bf16_reference(int ws, const std::vector<Batch>& batches) {
  Net master;
  load_full(*master, initial_weights());
  torch::optim::AdamW opt(master->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  MpReference ref;
  const int64_t local = kBatch / ws;
  for (size_t step = 0; step < batches.size(); ++step) {
    std::map<std::string, torch::Tensor> acc;
    double loss_sum = 0;
    for (int r = 0; r < ws; ++r) {
      Net low;
      {
        torch::NoGradGuard g;
        for (auto& p : low->named_parameters()) {
          p.value().set_data(master->named_parameters()[p.key()].detach().to(torch::kBFloat16));
        }
      }
      auto b = batches[step].slice(r * local, local);
      auto loss = loss_fn(low->forward(b.idx), b.targets);
      loss.backward();
      loss_sum += loss.item<double>();
      for (const auto& p : low->named_parameters()) {
        auto g = p.value().grad().to(torch::kDouble);
        acc[p.key()] = acc.count(p.key()) ? acc[p.key()] + g : g;
      }
    }
    for (auto& [k, v] : acc) v /= ws;
    if (step == 0) ref.first_grads = acc;
    for (auto& p : master->named_parameters()) p.value().mutable_grad() = acc[p.key()].to(torch::kFloat32);
    opt.step();
    ref.losses.push_back(loss_sum / ws);
  }
  ref.final_params = snapshot(*master);
  return ref;
}

// bf16 parity, 10 AdamW steps. Tolerances: losses 1e-3 relative, parameters 1e-3 absolute. Both
// sides compute the same bf16 operations on the same rows; they differ only in the fp32 summation
// order of the reduce-scatter, which can flip a bf16 rounding of a parameter in later steps.
TEST(MixedPrecision, Bf16ParityWithFp32Reduction) {
  for (int ws : {2, 3}) {
    auto batches = make_batches(10, kBatch, kSeq, 5);
    auto ref = bf16_reference(ws, batches);
    std::mutex mu;
    double worst_loss = 0, worst_param = 0;
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      Net net = sharded_net(pg, bf16(torch::kFloat32));
      FSDPModule<Net> model(net);
      torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
      const int64_t local = kBatch / ws;
      for (size_t step = 0; step < batches.size(); ++step) {
        auto b = batches[step].slice(pg->rank() * local, local);
        opt.zero_grad();
        auto loss = loss_fn(model(b.idx), b.targets);
        EXPECT_EQ(loss.scalar_type(), torch::kBFloat16);
        loss.backward();
        for (const auto& p : net->parameters()) {
          EXPECT_EQ(p.scalar_type(), torch::kFloat32) << "sharded parameters stay fp32 (master weights)";
          if (p.grad().defined()) EXPECT_EQ(p.grad().scalar_type(), torch::kFloat32);
        }
        opt.step();
        auto global = loss.detach().to(torch::kFloat32);
        all_reduce(global, *pg, ReduceOp::AVG);
        double d = std::abs(global.item<double>() - ref.losses[step]) / std::abs(ref.losses[step]);
        std::lock_guard<std::mutex> lock(mu);
        worst_loss = std::max(worst_loss, d);
        EXPECT_LE(d, 1e-3) << "step " << step << " ws " << ws;
      }
      auto mesh = init_device_mesh(torch::kCPU, {ws});
      for (const auto& p : net->named_parameters()) {
        auto expect = distribute_tensor(ref.final_params.at(p.key()), mesh, {Shard(0)}).to_local();
        double d = max_abs_diff(p.value(), expect);
        std::lock_guard<std::mutex> lock(mu);
        worst_param = std::max(worst_param, d);
        EXPECT_LE(d, 1e-3) << p.key();
      }
    });
    std::printf("[bf16 parity] %d ranks: max relative loss diff %.3g (tol 1e-3), max |param diff| %.3g (tol 1e-3)\n",
                ws, worst_loss, worst_param);
  }
}

// The reduce-scatter in fp32 is measurably closer to the exact (fp64) sum of the ranks' bf16
// gradients than the reduce-scatter in bf16.
TEST(MixedPrecision, Fp32ReductionCloserThanBf16Reduction) {
  const int ws = 3;
  auto batches = make_batches(1, kBatch, kSeq, 5);
  auto ref = bf16_reference(ws, batches);
  std::map<std::string, double> err;  // reduce dtype name -> mean |grad - exact|
  std::mutex mu;
  for (auto reduce : {torch::kFloat32, torch::kBFloat16}) {
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      Net net = sharded_net(pg, bf16(reduce));
      FSDPModule<Net> model(net);
      auto b = batches[0].slice(pg->rank() * (kBatch / ws), kBatch / ws);
      loss_fn(model(b.idx), b.targets).backward();
      auto mesh = init_device_mesh(torch::kCPU, {ws});
      double sum = 0;
      int64_t n = 0;
      for (const auto& p : net->named_parameters()) {
        auto exact = distribute_tensor(ref.first_grads.at(p.key()), mesh, {Shard(0)}).to_local();
        sum += (p.value().grad().to(torch::kDouble) - exact).abs().sum().item<double>();
        n += exact.numel();
      }
      auto t = torch::tensor({sum, static_cast<double>(n)}, torch::kDouble);
      all_reduce(t, *pg);
      std::lock_guard<std::mutex> lock(mu);
      err[c10::toString(reduce)] = t[0].item<double>() / t[1].item<double>();
    });
  }
  std::printf("[reduce dtype] mean |grad error| vs exact sum: fp32 reduction %.3g, bf16 reduction %.3g\n",
              err["Float"], err["BFloat16"]);
  EXPECT_LT(err["Float"] * 10, err["BFloat16"]);
}

// 4 microbatches in bf16, sync disabled for the first 3: the unsharded gradients accumulate in fp32
// (reduce_dtype), equal to the fp32 sum of the bf16 microbatch gradients. Microbatch 1 skips block 1.
TEST(MixedPrecision, Bf16AccumulationInFp32WithDifferentModuleSubsets) {
  const int ws = 2, k = 4;
  auto batches = make_batches(k, kBatch, kSeq, 8);
  // Reference: per microbatch and per slice, bf16 grads; summed in fp64, divided by ws and k.
  std::map<std::string, torch::Tensor> exact;
  for (int m = 0; m < k; ++m) {
    for (int r = 0; r < ws; ++r) {
      Net low;
      load_full(*low, initial_weights());
      low->to(torch::kBFloat16);
      low->active_blocks = m == 1 ? 1 : -1;
      auto b = batches[m].slice(r * (kBatch / ws), kBatch / ws);
      (loss_fn(low->forward(b.idx), b.targets)).backward();
      for (const auto& p : low->named_parameters()) {
        if (!p.value().grad().defined()) continue;
        auto g = p.value().grad().to(torch::kDouble) / (ws * k);
        exact[p.key()] = exact.count(p.key()) ? exact[p.key()] + g : g;
      }
    }
  }
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    Net net = sharded_net(pg, bf16(torch::kFloat32));
    FSDPModule<Net> model(net);
    for (int m = 0; m < k; ++m) {
      net->active_blocks = m == 1 ? 1 : -1;
      model.set_requires_gradient_sync(m == k - 1);
      auto b = batches[m].slice(pg->rank() * (kBatch / ws), kBatch / ws);
      (loss_fn(model(b.idx), b.targets) / k).backward();
      if (m < k - 1) {
        // Sync off: the unsharded accumulator is fp32, not bf16.
        for (auto& b2 : net->blocks) {
          for (const auto& p : detail::fsdp_state(b2.fsdp()).group->params()) {
            if (p.unsharded_accum_grad.defined()) EXPECT_EQ(p.unsharded_accum_grad.scalar_type(), torch::kFloat32);
          }
        }
      }
    }
    auto mesh = init_device_mesh(torch::kCPU, {ws});
    for (const auto& p : net->named_parameters()) {
      auto expect = distribute_tensor(exact.at(p.key()), mesh, {Shard(0)}).to_local();
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      // bf16 tolerance: the division by k happens on the bf16 loss on our side, in fp64 on the reference.
      EXPECT_TRUE(torch::allclose(p.value().grad().to(torch::kDouble), expect, 1e-2, 1e-4)) << p.key();
    }
  });
}

TEST(MixedPrecision, AllGatherBytesHalveInBf16) {
  std::map<std::string, uint64_t> bytes;
  std::mutex mu;
  for (bool low : {false, true}) {
    run_ranks(2, [&](ProcessGroupPtr pg) {
      Net net = sharded_net(pg, low ? bf16(torch::kFloat32) : FullyShardOptions());
      FSDPModule<Net> model(net);
      auto b = make_batches(1, 8, kSeq)[0].slice(pg->rank() * 4, 4);
      auto before = pg->collective_bytes("all_gather_into_tensor");
      loss_fn(model(b.idx), b.targets).backward();
      std::lock_guard<std::mutex> lock(mu);
      bytes[low ? "bf16" : "fp32"] = pg->collective_bytes("all_gather_into_tensor") - before;
    });
  }
  std::printf("[all-gather bytes per step, 2 ranks, tiny model] fp32 %llu, bf16 %llu\n",
              static_cast<unsigned long long>(bytes["fp32"]), static_cast<unsigned long long>(bytes["bf16"]));
  EXPECT_EQ(bytes["bf16"] * 2, bytes["fp32"]);
}

TEST(MixedPrecision, OutputDtypeAndInputCast) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    FSDPModule<Block> block;
    auto mp = MixedPrecisionPolicy().param_dtype(torch::kBFloat16).output_dtype(torch::kFloat32);
    fully_shard(block, FullyShardOptions().mesh(mesh).mp_policy(mp));
    auto y = block(torch::randn({2, kDim}));  // fp32 input cast to bf16, output cast back to fp32
    EXPECT_EQ(y.scalar_type(), torch::kFloat32);
    // A root stays unsharded after forward, in param_dtype; resharded, it is the fp32 shard again.
    EXPECT_EQ(block->fc1->weight.scalar_type(), torch::kBFloat16);
    EXPECT_EQ(block->norm->weight.size(0), kDim);
    block.reshard();
    EXPECT_EQ(block->fc1->weight.scalar_type(), torch::kFloat32);
    EXPECT_EQ(block->norm->weight.size(0), kDim / 2);
  });
}

// ---- fp16 with ShardedGradScaler ---------------------------------------------------------------------
// Relative distance of the update a run made from `init` to the reference's: |(p - init) - (ref - init)|
// / |ref - init|. A gradient off by a constant factor (a scale never removed, x2, x0.5) or a step that
// did not happen gives >= 0.5; 0 for an empty shard or a parameter the reference did not move.
double update_error(const torch::Tensor& p, const torch::Tensor& init, const torch::Tensor& ref) {
  auto want = (ref.to(torch::kDouble) - init.to(torch::kDouble));
  auto got = (p.to(torch::kDouble) - init.to(torch::kDouble));
  const double scale = want.norm().item<double>();
  if (p.numel() == 0 || scale == 0) return 0.0;
  return (got - want).norm().item<double>() / scale;
}

TEST(GradScaler, InfOnOneRankSkipsTheStepEverywhere) {
  auto batches = make_batches(4, 8, kSeq, 3);
  // Reference: fp32, one process, the global batch, SGD 0.1 on the unscaled gradients, step 1 skipped
  // (the step whose gradients hold an inf). Parameters after each step.
  std::vector<std::map<std::string, torch::Tensor>> ref_after;
  {
    Net ref;
    load_full(*ref, initial_weights());
    torch::optim::SGD ref_opt(ref->parameters(), 0.1);
    for (int step = 0; step < 4; ++step) {
      ref_opt.zero_grad();
      loss_fn(ref->forward(batches[step].idx), batches[step].targets).backward();
      if (step != 1) ref_opt.step();
      ref_after.push_back(snapshot(*ref));
    }
  }
  run_ranks(2, [&](ProcessGroupPtr pg) {
    // fp16 compute everywhere; the root's output (the logits) in fp32 for the loss.
    auto mp = MixedPrecisionPolicy().param_dtype(torch::kHalf).reduce_dtype(torch::kFloat32);
    Net net;
    load_full(*net, initial_weights());
    auto mesh = init_device_mesh(torch::kCPU, {2});
    for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh).mp_policy(mp));
    fully_shard(net, FullyShardOptions().mesh(mesh).mp_policy(MixedPrecisionPolicy(mp).output_dtype(torch::kFloat32)));
    FSDPModule<Net> model(net);
    torch::optim::SGD opt(net->parameters(), 0.1);
    ShardedGradScaler scaler(GradScalerOptions().init_scale(1024.0).growth_interval(2), pg);
    for (int step = 0; step < 4; ++step) {
      auto b = batches[step].slice(pg->rank() * 4, 4);
      opt.zero_grad();
      scaler.scale(loss_fn(model(b.idx), b.targets)).backward();
      if (step == 1 && pg->rank() == 1) {
        torch::NoGradGuard g;
        net->blocks[0]->fc2->weight.grad().view(-1)[0] = std::numeric_limits<float>::infinity();
      }
      auto before = snapshot(*net);
      bool stepped = scaler.step(opt);
      EXPECT_EQ(stepped, step != 1) << "step " << step << " rank " << pg->rank();
      if (!stepped) {
        for (const auto& p : net->named_parameters()) EXPECT_TRUE(torch::equal(p.value(), before.at(p.key()))) << p.key();
      } else {
        // A taken step applied the unscaled gradient: the shards moved as the fp32 reference did, up to
        // fp16 compute (measured: <= 0.11 of the update, on the small biases; a gradient still scaled by
        // 512-1024 is ~500 off, x2 or no step at all 1, x0.5 0.5).
        auto mesh = init_device_mesh(torch::kCPU, {2});
        for (const auto& p : net->named_parameters()) {
          auto shard = [&](const torch::Tensor& full) { return distribute_tensor(full, mesh, {Shard(0)}).to_local(); };
          const double err = update_error(p.value(), shard(initial_weights().at(p.key())),
                                          shard(ref_after[step].at(p.key())));
          EXPECT_LT(err, 0.25) << p.key() << " after step " << step << " on rank " << pg->rank();
        }
      }
      scaler.update();
      // 1024 -> (finite) tracker 1 -> (inf) 512 -> (finite) tracker 1 -> (finite) 1024.
      std::vector<double> expect_scale{1024.0, 512.0, 512.0, 1024.0};
      EXPECT_EQ(scaler.get_scale(), expect_scale[step]) << "step " << step;
    }
  });
}

// ---- clip_grad_norm_ ----------------------------------------------------------------------------------
TEST(ClipGradNorm, SameNormOnEveryRankAsSingleProcess) {
  auto batches = make_batches(2, kBatch, kSeq, 21);
  for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
    // Reference: unsharded, global batch, SGD after clipping to 0.1.
    Net ref;
    load_full(*ref, initial_weights());
    torch::optim::SGD ref_opt(ref->parameters(), 0.5);
    std::vector<double> ref_norms;
    for (const auto& b : batches) {
      ref_opt.zero_grad();
      loss_fn(ref->forward(b.idx), b.targets).backward();
      ref_norms.push_back(torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.1, norm_type));
      ref_opt.step();
    }
    for (int ws : {2, 3}) {
      run_ranks(ws, [&](ProcessGroupPtr pg) {
        Net net = sharded_net(pg, FullyShardOptions());
        FSDPModule<Net> model(net);
        torch::optim::SGD opt(net->parameters(), 0.5);
        for (size_t s = 0; s < batches.size(); ++s) {
          auto b = batches[s].slice(pg->rank() * (kBatch / ws), kBatch / ws);
          opt.zero_grad();
          loss_fn(model(b.idx), b.targets).backward();
          auto norm = clip_grad_norm_(net->parameters(), 0.1, norm_type);
          EXPECT_NEAR(norm.item<double>(), ref_norms[s], 1e-5 * ref_norms[s]) << "norm " << norm_type << " ws " << ws;
          // Identical on every rank (bitwise).
          auto all = torch::empty({ws}, norm.options());
          all_gather_into_tensor(all, norm.reshape({1}), *pg);
          EXPECT_TRUE(torch::all(all == all[0]).item<bool>());
          opt.step();
        }
        auto mesh = init_device_mesh(torch::kCPU, {ws});
        for (const auto& p : net->named_parameters()) {
          auto expect = distribute_tensor(ref->named_parameters()[p.key()].detach(), mesh, {Shard(0)}).to_local();
          EXPECT_TRUE(torch::allclose(p.value(), expect, 1e-5, 1e-6)) << p.key();
        }
      });
    }
  }
}

// also_sum (issue 16, part 3): a loss all-reduced in the norm's collective gives, bit for bit, the norm
// and the sum of two separate all-reduces, with one collective fewer; with the inf-norm (MAX) it is
// reduced on its own. 2, 3 and 4 ranks (Gloo's ring order matters from 3).
TEST(ClipGradNorm, AlsoSumRidesInTheNormsAllReduceBitForBit) {
  auto batches = make_batches(1, kBatch, kSeq, 23);
  for (int ws : {2, 3, 4}) {
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
        Net net = sharded_net(pg, FullyShardOptions());
        FSDPModule<Net> model(net);
        auto b = batches[0].slice(pg->rank() * (kBatch / ws), kBatch / ws);
        auto loss = loss_fn(model(b.idx), b.targets);
        loss.backward();
        std::vector<torch::Tensor> saved;
        for (const auto& p : net->parameters()) saved.push_back(p.grad().clone());
        // Separate: the norm, then the loss.
        auto sep_sum = (loss.detach() * (1.0 + pg->rank() * 1e-3)).reshape({1});
        auto sep_norm = clip_grad_norm_(net->parameters(), 1e9, norm_type);
        all_reduce(sep_sum, *pg, ReduceOp::SUM);
        // Together.
        size_t i = 0;
        for (auto& p : net->parameters()) p.mutable_grad().copy_(saved[i++]);
        auto both_sum = (loss.detach() * (1.0 + pg->rank() * 1e-3)).reshape({1});
        const uint64_t before = pg->collective_count("all_reduce");
        auto both_norm = clip_grad_norm_(net->parameters(), 1e9, norm_type, false, nullptr, both_sum);
        EXPECT_EQ(pg->collective_count("all_reduce") - before, std::isinf(norm_type) ? 2u : 1u) << "ws " << ws;
        EXPECT_EQ(both_norm.item<float>(), sep_norm.item<float>()) << "ws " << ws << " norm " << norm_type;
        EXPECT_EQ(both_sum.item<float>(), sep_sum.item<float>()) << "ws " << ws << " norm " << norm_type;
      }
    });
  }
}

TEST(ClipGradNorm, NonFiniteNormRaisesWhenAsked) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    Net net = sharded_net(pg, FullyShardOptions());
    FSDPModule<Net> model(net);
    auto b = make_batches(1, 4, kSeq)[0].slice(pg->rank() * 2, 2);
    loss_fn(model(b.idx), b.targets).backward();
    if (pg->rank() == 0) {
      torch::NoGradGuard g;
      net->head->bias.grad().fill_(std::numeric_limits<float>::quiet_NaN());
    }
    try {
      clip_grad_norm_(net->parameters(), 1.0, 2.0, /*error_if_nonfinite=*/true);
      FAIL() << "expected an error on rank " << pg->rank();
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("non-finite"), std::string::npos) << e.what();
    }
  });
}

// ---- Activation checkpointing -------------------------------------------------------------------------
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

// Bytes the allocator holds (malloc'd + mmapped): what a forward keeps alive for backward.
int64_t heap_in_use() {
  auto mi = mallinfo2();
  return static_cast<int64_t>(mi.uordblks + mi.hblkhd);
}

TEST(ActivationCheckpointing, ActivationMemoryIsLower) {
  // A deeper, wider stack of blocks on one rank: activations dominate.
  std::map<bool, int64_t> held;
  for (bool ac : {false, true}) {
    run_ranks(1, [&](ProcessGroupPtr pg) {
      Net net(/*n_blocks=*/8);
      auto mesh = init_device_mesh(torch::kCPU, {1});
      for (auto& b : net->blocks) {
        if (ac) checkpoint_wrapper(b);
        fully_shard(b, FullyShardOptions().mesh(mesh));
      }
      fully_shard(net, FullyShardOptions().mesh(mesh));
      FSDPModule<Net> model(net);
      auto idx = torch::randint(0, kVocab, {256, 64});
      auto tgt = torch::randint(0, kClasses, {256, 64});
      loss_fn(model(idx), tgt).backward();  // warm-up: lazy init, allocator caches
      int64_t before = heap_in_use();
      auto loss = loss_fn(model(idx), tgt);
      held[ac] = heap_in_use() - before;
      loss.backward();
    });
  }
  std::printf("[activation checkpointing] memory held after forward, 8 blocks, batch 256x64: without %lld B, with %lld B\n",
              static_cast<long long>(held[false]), static_cast<long long>(held[true]));
  EXPECT_LT(held[true] * 2, held[false]);
}

// ---- CPU offload --------------------------------------------------------------------------------------
// On a CPU mesh the compute device is the CPU, so "shards on the CPU" holds with or without the policy
// and the host-device copies the policy adds (shard -> compute device at unshard, reduced gradient ->
// CPU shard) are CPU-to-CPU copies. What is checked is what can differ here: the trained values are
// bitwise those of the same run without offload (the copies change no value; a reduced gradient
// dropped, doubled or left unsharded would change them) and match the single-process reference; each
// parameter is its group's CPU shard (the local rows of the padded shard, not a full or gathered
// tensor), its gradient a shard of the same shape; the optimizer state is on the CPU. (This LibTorch
// is CPU-only: a CUDA mesh, where the copies cross devices, cannot be built here.)
TEST(CPUOffload, ParityAndTensorsLiveOnCpu) {
  auto batches = make_batches(5, kBatch, kSeq, 41);
  Net ref;
  load_full(*ref, initial_weights());
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  for (const auto& b : batches) {
    ref_opt.zero_grad();
    loss_fn(ref->forward(b.idx), b.targets).backward();
    ref_opt.step();
  }
  // Parameters and gradients of rank r after the last step, without (false) and with (true) offload.
  std::map<bool, std::vector<std::map<std::string, torch::Tensor>>> params, grads;
  std::mutex mu;
  for (bool offload : {false, true}) {
    params[offload].resize(2);
    grads[offload].resize(2);
    run_ranks(2, [&](ProcessGroupPtr pg) {
      auto opts = FullyShardOptions();
      if (offload) opts.offload_policy(CPUOffloadPolicy().pin_memory(false));
      Net net = sharded_net(pg, opts);
      FSDPModule<Net> model(net);
      torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
      for (const auto& gb : batches) {
        auto b = gb.slice(pg->rank() * 6, 6);
        opt.zero_grad();
        loss_fn(model(b.idx), b.targets).backward();
        opt.step();
      }
      auto mesh = init_device_mesh(torch::kCPU, {2});
      for (const auto& p : net->named_parameters()) {
        const auto& full = ref->named_parameters()[p.key()];
        auto expect = distribute_tensor(full.detach(), mesh, {Shard(0)}).to_local();
        EXPECT_TRUE(torch::allclose(p.value(), expect, 1e-5, 1e-6)) << p.key();
        EXPECT_EQ(p.value().sizes(), expect.sizes()) << p.key() << ": not this rank's shard";
        ASSERT_TRUE(p.value().grad().defined()) << p.key();
        EXPECT_EQ(p.value().grad().sizes(), p.value().sizes()) << p.key() << ": the gradient is not a shard";
        EXPECT_TRUE(p.value().device().is_cpu());
        EXPECT_TRUE(p.value().grad().device().is_cpu());
        auto state = detail::state_of_param(p.value());
        ASSERT_TRUE(state);
        bool in_padded_shard = false;
        for (const auto& fp : state->group->params()) {
          EXPECT_TRUE(fp.padded_shard.device().is_cpu());
          in_padded_shard |= fp.padded_shard.numel() > 0 && p.value().numel() > 0 &&
                             p.value().data_ptr() == fp.padded_shard.data_ptr();
        }
        if (p.value().numel() > 0) EXPECT_TRUE(in_padded_shard) << p.key() << ": not stored in its padded shard";
      }
      for (const auto& kv : opt.state()) {
        auto& s = static_cast<torch::optim::AdamWParamState&>(*kv.second);
        EXPECT_TRUE(s.exp_avg().device().is_cpu());
        EXPECT_TRUE(s.exp_avg_sq().device().is_cpu());
      }
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& p : net->named_parameters()) {
        params[offload][pg->rank()][p.key()] = p.value().detach().clone();
        grads[offload][pg->rank()][p.key()] = p.value().grad().clone();
      }
    });
  }
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(params[true][r].size(), params[false][r].size());
    for (const auto& [k, v] : params[false][r]) {
      EXPECT_TRUE(torch::equal(params[true][r].at(k), v)) << k << " rank " << r << ": offload changed a value";
      EXPECT_TRUE(torch::equal(grads[true][r].at(k), grads[false][r].at(k))) << k << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace fsdp::testing
