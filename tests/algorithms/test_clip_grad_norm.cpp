// clip_grad_norm_ over sharded gradients (CTest label: mixed_precision): the single-process norm on every rank
// (bitwise the same), 2-norm and inf-norm; also_sum rides in the norm's all-reduce bit for bit; a non-finite norm
// raises when asked.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "seed11_net.h"

namespace fsdp::testing::seed11_net {
namespace {

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

}  // namespace
}  // namespace fsdp::testing::seed11_net
