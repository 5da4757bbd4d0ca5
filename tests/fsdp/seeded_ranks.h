// Ranks whose generators were seeded differently before building the model (issue 17 item 2): a Linear(8, 8)
// built as rank r would build it, the single-process reference and the training that checks every rank
// against it. test_hsdp.cpp and test_sync_module_states.cpp, in namespace fsdp::testing::seeded_ranks.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "fsdp_test_model.h"
#include "multi_rank.h"

namespace fsdp::testing::seeded_ranks {

inline constexpr int64_t kIn = 8, kOut = 8, kRows = 12;  // Linear(8, 8), global batch of 12 rows (2, 3, 4 ranks)
inline constexpr double kLr = 0.1;
inline constexpr int kSgdSteps = 3;

// What rank `rank` would build if it seeded its generator with 1000 + rank: weight [8, 8], bias [8].
inline std::map<std::string, torch::Tensor> seeded_init(int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + rank);
  return {{"weight", torch::randn({kOut, kIn}, gen)}, {"bias", torch::randn({kOut}, gen)}};
}

inline FSDPModule<torch::nn::Linear> build_seeded(int rank) {
  FSDPModule<torch::nn::Linear> m(torch::nn::LinearOptions(kIn, kOut));
  load_full(*m.ptr(), seeded_init(rank));
  return m;
}

inline torch::Tensor global_x(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77 + step);
  return torch::randn({kRows, kIn}, gen);
}

// Single-process reference: `steps` SGD steps from `init` on the global batch; the loss of rank r is
// out_r.pow(2).sum() over its rows, and FSDP divides the summed gradient by the data-parallel size,
// so the reference loss is the sum over all rows divided by `dp`. Returns the parameters after each step
// and the gradients of each step.
struct RefRun {
  std::vector<std::map<std::string, torch::Tensor>> params, grads;
};
inline RefRun reference(const std::map<std::string, torch::Tensor>& init, int dp, int steps) {
  torch::nn::Linear ref(torch::nn::LinearOptions(kIn, kOut));
  load_full(*ref, init);
  torch::optim::SGD opt(ref->parameters(), kLr);
  RefRun out;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    (ref(global_x(s)).pow(2).sum() / dp).backward();
    std::map<std::string, torch::Tensor> g;
    for (const auto& p : ref->named_parameters()) g[p.key()] = p.value().grad().clone();
    out.grads.push_back(g);
    opt.step();
    out.params.push_back(snapshot(*ref));
  }
  return out;
}

// Trains `model` (already sharded over `mesh`, `dp` data-parallel ranks, this rank's data index
// `dp_rank`) for kSgdSteps and checks gradients and parameters against `ref` after every step, and
// that every rank's copy of a shard is identical (all-reduce MAX - MIN over the world is 0).
inline void train_and_compare(FSDPModule<torch::nn::Linear>& model, const DeviceMeshPtr& mesh, int dp,
                              int dp_rank, const RefRun& ref, const std::vector<Placement>& placements,
                              ProcessGroup& world) {
  torch::optim::SGD opt(model->parameters(), kLr);
  const int64_t local = kRows / dp;
  for (int s = 0; s < kSgdSteps; ++s) {
    opt.zero_grad();
    model(global_x(s).narrow(0, dp_rank * local, local)).pow(2).sum().backward();
    for (const auto& p : model->named_parameters()) {
      auto expect = distribute_tensor(ref.grads[s].at(p.key()), mesh, placements).to_local();
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      // fp32 sums in another order than the reference: relative 1e-5, absolute 2e-6 of the largest entry.
      const double atol = 2e-6 * (1 + expect.abs().max().item<double>());
      EXPECT_TRUE(torch::allclose(p.value().grad(), expect, 1e-5, atol))
          << "gradient of " << p.key() << " at step " << s << " on rank " << world.rank() << " of " << world.size()
          << ": max diff " << max_abs_diff(p.value().grad(), expect) << ", max " << expect.abs().max().item<double>();
    }
    opt.step();
    for (const auto& p : model->named_parameters()) {
      auto expect = distribute_tensor(ref.params[s].at(p.key()), mesh, placements).to_local();
      EXPECT_TRUE(torch::allclose(p.value(), expect, 1e-5, 1e-6))
          << p.key() << " after step " << s + 1 << " on rank " << world.rank();
    }
  }
}

}  // namespace fsdp::testing::seeded_ranks
