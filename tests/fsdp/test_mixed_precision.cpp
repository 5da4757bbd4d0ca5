// MixedPrecisionPolicy (CTest label: mixed_precision; Unchanged: unchanged_models): bf16 parity with an fp32
// reduction, the fp32 reduction closer than a bf16 one, accumulation in fp32, all-gather bytes halved, output
// dtype and input cast; an unchanged model in bf16 gives the holder model's numbers.
#include <gtest/gtest.h>

#include <cstdio>
#include <mutex>

#include "error_message.h"
#include "fsdp/fsdp_collectives.h"
#include "seed11_net.h"
#include "unchanged_harness.h"

namespace fsdp::testing::seed11_net {
namespace {

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

// reduce_dtype fp16: the division by the data-parallel size is split around the sum as PyTorch's
// _get_gradient_divide_factors (pre = the power of two near sqrt(N)), so that a sum the fp16 range cannot
// hold stays finite. Every rank's gradient is 24000 per element: the plain sum over 3 or 4 ranks
// (72000, 96000) overflows fp16 (max 65504); pre-divided by 2 it does not, and the average is exact (every
// partial sum is a multiple of fp16's spacing there).
TEST(Fp16Reduction, DividesBeforeAndAfterTheSumAsPyTorch) {
  // PyTorch's factors for these sizes (its loop on `factor`, fp16; fp32 and bf16 divide only after).
  const std::vector<std::pair<double, double>> expected_pre = {{1, 1}, {2, 2}, {3, 2}, {4, 2}, {6, 4},
                                                               {8, 4}, {16, 4}, {32, 8}, {2.5, 1}};
  for (const auto& [factor, pre] : expected_pre) {
    auto [got_pre, got_post] = fsdp::detail::gradient_divide_factors(torch::kHalf, factor);
    EXPECT_EQ(got_pre, pre) << "factor " << factor;
    EXPECT_EQ(got_post, factor / pre) << "factor " << factor;
    EXPECT_EQ(fsdp::detail::gradient_divide_factors(torch::kFloat32, factor).first, 1.0);
    EXPECT_EQ(fsdp::detail::gradient_divide_factors(torch::kBFloat16, factor).first, 1.0);
  }
  for (int ws : {3, 4}) {
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      auto mesh = init_device_mesh(torch::kCPU, {ws});
      torch::nn::Linear lin(torch::nn::LinearOptions(4, 5).bias(false));  // 5 rows: uneven (and empty) shards
      fully_shard(lin.ptr(), FullyShardOptions().mesh(mesh).mp_policy(MixedPrecisionPolicy().reduce_dtype(torch::kHalf)));
      (lin(torch::ones({1, 4})).sum() * 24000.0).backward();
      auto full = sharded_grad(lin->weight)->full_tensor();
      EXPECT_TRUE(torch::equal(full, torch::full({5, 4}, 24000.0f)))
          << "world size " << ws << ": the fp16 reduction overflowed or lost precision, got " << full;
    });
  }
}

// output_dtype needs the module's output: through an FSDPModule holder or fsdp::fsdp_forward (whose
// arguments are also cast by cast_forward_inputs). A group without either is refused at its first op.
TEST(MixedPrecision, OutputDtypeOnAGroupWithoutHolderNeedsFsdpForward) {
  run_ranks(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto mp = MixedPrecisionPolicy().param_dtype(torch::kBFloat16).output_dtype(torch::kFloat64);
    torch::nn::Linear lin(kDim, kDim);
    fully_shard(lin.ptr(), FullyShardOptions().mesh(mesh).mp_policy(mp));
    auto x = torch::randn({2, kDim});
    auto msg = error_message([&] { lin(x); });
    EXPECT_NE(msg.find("output_dtype"), std::string::npos) << msg;
    EXPECT_NE(msg.find("fsdp::fsdp_forward"), std::string::npos) << msg;
    EXPECT_NE(msg.find("on rank " + std::to_string(pg->rank())), std::string::npos) << msg;
    torch::ScalarType seen = torch::kFloat32;
    auto y = fsdp_forward(*lin, [&](const torch::Tensor& in) {
      seen = in.scalar_type();
      return lin(in);
    }, x.requires_grad_());
    EXPECT_EQ(seen, torch::kBFloat16) << "cast_forward_inputs on the argument";
    EXPECT_EQ(y.scalar_type(), torch::kFloat64) << "output_dtype";
    y.sum().backward();
    ASSERT_TRUE(lin->weight.grad().defined());
    EXPECT_EQ(lin->weight.grad().sizes(), lin->weight.sizes()) << "the sharded gradient after the backward";
  });
}

}  // namespace
}  // namespace fsdp::testing::seed11_net

namespace fsdp::testing::unchanged_harness {
namespace {

// bf16 compute, fp32 reduction: a GPT-like model starting with an embedding sees the same casts on both
// paths (the token ids are not floating point; the embedding's output is already bf16), so the numbers
// must be identical. The activations are bf16 inside the unchanged model.
TEST_P(Unchanged, Bf16MixedPrecisionIdenticalToHolderPath) {
  Knobs k;
  k.mp = MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat32);
  auto [plain, holder] = plain_vs_holder(GetParam(), k, "bf16");
  // Sanity: bf16 training stays near the fp32 reference (loose: bf16 has 8 mantissa bits).
  auto ref = reference_run([] { return make_plain({}); }, make_batches(kSteps3, kBatch, kSeq));
  for (size_t s = 0; s < plain.losses.size(); ++s) EXPECT_NEAR(plain.losses[s], ref.losses[s], 0.05 * ref.losses[s]);
  run_ranks(GetParam(), [&](ProcessGroupPtr pg) {
    PlainNet net{nullptr};
    Model m = sharded_plain(pg, k, &net);
    std::vector<torch::ScalarType> seen;
    net->tap = [&](int, torch::Tensor x) {
      seen.push_back(x.scalar_type());
      return x;
    };
    auto b = make_batches(1, kBatch, kSeq)[0].slice(0, 2);
    auto out = m.forward(b.idx);
    EXPECT_EQ(seen, std::vector<torch::ScalarType>(3, torch::kBFloat16)) << "activations after wte and each block";
    loss_fn(out.to(torch::kFloat), b.targets).backward();
    for (const auto& p : net->parameters()) {
      ASSERT_TRUE(sharded_grad(p).has_value());
      EXPECT_EQ(sharded_grad(p)->to_local().scalar_type(), torch::kFloat32) << "sharded gradients stay fp32";
    }
  });
}

}  // namespace
}  // namespace fsdp::testing::unchanged_harness
