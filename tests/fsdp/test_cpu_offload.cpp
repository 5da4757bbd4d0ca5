// CPUOffloadPolicy (CTest label: mixed_precision; UnchangedMore: unchanged_models): parity with the run
// without offload and with the reference, parameters, gradients and optimizer state on the CPU, each
// parameter its group's padded shard; an unchanged model matches the holder model.
#include <gtest/gtest.h>

#include <mutex>

#include "fsdp/fsdp_state.h"
#include "seed11_net.h"
#include "unchanged_harness.h"

namespace fsdp::testing::seed11_net {
namespace {

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
}  // namespace fsdp::testing::seed11_net

namespace fsdp::testing::unchanged_harness {
namespace {

TEST_P(UnchangedMore, CpuOffloadMatchesReferenceAndHolderPath) {
  const int ws = GetParam();
  Config s;
  s.offload = true;
  plain_vs_holder_vs_reference(ws, s, "CPUOffloadPolicy");
  // Each parameter is its group's CPU shard, its gradient a shard of the same shape.
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    PlainNet net{nullptr};
    Model m = plain_sharded(pg, s, &net);
    auto b = make_batches(1, kBatch, kSeq)[0].slice(pg->rank() * (kBatch / ws), kBatch / ws);
    loss_fn(m.forward(b.idx), b.targets).backward();
    for (const auto& p : net->named_parameters()) {
      const auto full = initial_weights().at(p.key());
      EXPECT_EQ(p.value().size(0), chunk_range(full.size(0), ws, pg->rank()).length) << p.key() << ": not a shard";
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_EQ(p.value().grad().sizes(), p.value().sizes()) << p.key();
      EXPECT_TRUE(p.value().device().is_cpu());
    }
  });
}

}  // namespace
}  // namespace fsdp::testing::unchanged_harness
