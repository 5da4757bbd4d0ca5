// expect_trains_like_unsharded: a sharded model trains like its unsharded copy (shared by the test binaries
// that check that a model shape works with fully_shard).
#pragma once

#include <functional>

#include "fsdp_test_model.h"
#include "multi_rank.h"

namespace fsdp::testing {

// Trains a model sharded by `shard` on `ws` ranks and an unsharded copy (same initial weights) with SGD
// on the same batch on every rank, so that the averaged gradient is the unsharded one: after `steps`
// steps every parameter (gathered from its shards, through the state dict) must match the copy's.
inline constexpr double kLearningRate = 0.02;

template <typename Model>
void expect_trains_like_unsharded(int ws, const std::function<Model()>& make,
                                  const std::function<void(Model&, const DeviceMeshPtr&)>& shard,
                                  const std::function<torch::Tensor(Model&, const torch::Tensor&)>& loss_of,
                                  const torch::Tensor& input, int steps = 3) {
  // A fixed initialisation and a step small enough that rounding is not amplified. With SGD(0.1) on a sum of squares
  // a few random initialisations (about 2%) start with gradients of norm ~100, and the trajectory amplified the last
  // bit that FSDP's average over 3 ranks (g/3 + g/3 + g/3; exact over 2 or 4) changes to 1e-6-1e-1 after 3 steps,
  // with identical gradients on every rank (BadInput.PlainMemberChildTrainsLikeOneProcess failed that way, always
  // at 3 ranks; per-rank sums of the gathered parameters and gradients were equal at every step). At 0.02, 40 seeds
  // of the three tests pass, and seed 20, which failed at 0.1 every time, passes.
  torch::manual_seed(1);
  Model ref = make();
  const auto init = snapshot(*ref);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(kLearningRate));
  for (int s = 0; s < steps; ++s) {
    ref_opt.zero_grad();
    loss_of(ref, input).backward();
    ref_opt.step();
  }
  const auto expect = snapshot(*ref);
  run_ranks(ws, [&](ProcessGroupPtr pg) {
    Model m = make();
    load_full(*m, init);
    auto mesh = init_device_mesh(torch::kCPU, {ws}, {}, pg);
    shard(m, mesh);
    torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(kLearningRate));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      loss_of(m, input).backward();
      opt.step();
    }
    int compared = 0;
    for (const auto& [k, v] : get_model_state_dict(*m)) {
      const auto* d = std::get_if<DTensor>(&v);
      if (!d) continue;
      ++compared;
      auto full = d->full_tensor();
      EXPECT_TRUE(torch::allclose(full, expect.at(k), 1e-5, 1e-6))
          << k << " on rank " << pg->rank() << " of " << ws << ": max |diff| " << max_abs_diff(full, expect.at(k));
    }
    EXPECT_GT(compared, 0) << "no sharded parameter";
  });
}

}  // namespace fsdp::testing
