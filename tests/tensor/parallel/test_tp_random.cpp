// The DTensor RNG (src/tensor/random.cpp; CTest label: tensor_parallel): after fsdp::manual_seed(seed, mesh),
// random tensors and dropout masks are, on every rank, its piece of what one process seeded alike draws:
// replicated ones equal on every TP rank, sharded ones (sequence-parallel dropout, attention heads, uneven
// sequence lengths via torch.chunk) their chunk; on tp 2 and 3 and a dp 2 x tp 2 mesh; the gradient is the
// mask. Different seeds on different ranks throw on every rank; an unseeded mesh throws.
#include <gtest/gtest.h>

#include <mutex>

#include "fsdp/fsdp.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

constexpr uint64_t kSeed = 20261205;

// One step of a TP model's random ops, in order, each returned whole (global) or as this rank's piece:
// dropout of a replicated activation [2, 5, 4]; of a sequence-sharded one (Shard(1), 5 positions: torch.chunk
// pieces on 2 and 3 ranks); of attention probabilities [2, 6, 3, 3] sharded on heads; a sharded rand [7, 3].
struct Draws {
  torch::Tensor replicated, sequence, heads, rand, grad_sequence;
};

Draws draw(const DeviceMeshPtr& mesh, const std::vector<Placement>& rep, const std::vector<Placement>& seq,
           const std::vector<Placement>& heads, const std::vector<Placement>& rows) {
  Draws d;
  auto x = torch::ones({2, 5, 4});
  d.replicated = random::dropout(DTensor(x, mesh, rep, {2, 5, 4}).to_local(), 0.5, true, mesh, rep, {2, 5, 4});
  // The sequence-sharded activation: this rank's positions of arange(40) + 1, needing grad.
  auto full = (torch::arange(40, torch::kFloat32) + 1).view({2, 5, 4});
  auto local = distribute_tensor(full, mesh, seq).to_local().clone().requires_grad_(true);
  d.sequence = random::dropout(DTensor(local, mesh, seq, {2, 5, 4}), 0.3, true);
  d.sequence.sum().backward();
  d.grad_sequence = local.grad();
  auto probs = distribute_tensor(torch::ones({2, 6, 3, 3}), mesh, heads).to_local();
  d.heads = random::dropout(DTensor(probs, mesh, heads, {2, 6, 3, 3}), 0.1, true);
  d.rand = random::rand_local({7, 3}, mesh, rows);
  return d;
}

// The one-process reference: the same draws on a 1-rank mesh.
Draws reference() {
  Draws ref;
  run_ranks(1, [&](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {1}, {"tp"});
    fsdp::manual_seed(kSeed, mesh);
    ref = draw(mesh, {Replicate()}, {Shard(1)}, {Shard(1)}, {Shard(0)});
  });
  return ref;
}

void expect_piece(const torch::Tensor& got, const torch::Tensor& want_full, const DeviceMeshPtr& mesh,
                  const std::vector<Placement>& pl, const std::string& what) {
  auto want = distribute_tensor(want_full, mesh, pl).to_local();
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(torch::equal(got, want)) << what << " on rank " << mesh->get_rank() << ":\n" << got << "\nwant\n" << want;
}

void tp_matches_one_process(int tp) {
  const auto ref = reference();
  // Sanity: the masks are random (some dropped, some kept), so equality is not trivial.
  ASSERT_GT((ref.replicated == 0).sum().item<int64_t>(), 0);
  ASSERT_GT((ref.replicated != 0).sum().item<int64_t>(), 0);
  run_ranks(tp, [&](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {tp}, {"tp"});
    fsdp::manual_seed(kSeed, mesh);
    for (int step = 0; step < 2; ++step) {  // the second step's draws differ from the first's (offsets advance)
      auto d = draw(mesh, {Replicate()}, {Shard(1)}, {Shard(1)}, {Shard(0)});
      if (step == 1) {
        EXPECT_FALSE(torch::equal(d.replicated, ref.replicated)) << "step 1 drew step 0's mask again";
        continue;
      }
      expect_piece(d.replicated, ref.replicated, mesh, {Replicate()}, "replicated dropout");
      expect_piece(d.sequence.detach(), ref.sequence.detach(), mesh, {Shard(1)}, "sequence-parallel dropout");
      expect_piece(d.grad_sequence, ref.grad_sequence, mesh, {Shard(1)}, "sequence-parallel dropout's gradient");
      expect_piece(d.heads, ref.heads, mesh, {Shard(1)}, "attention dropout on sharded heads");
      expect_piece(d.rand, ref.rand, mesh, {Shard(0)}, "sharded rand");
    }
  });
}

TEST(TPRandom, DropoutMatchesOneProcessTp2) { tp_matches_one_process(2); }
TEST(TPRandom, DropoutMatchesOneProcessTp3) { tp_matches_one_process(3); }

// dp 2 x tp 2: the batch sharded over dp, replicated over tp: each rank's mask is its dp rows of the
// one-process mask, the same on both TP ranks of a row.
TEST(TPRandom, TwoDimensionalMesh) {
  torch::Tensor ref;
  run_ranks(1, [&](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {1, 1}, {"dp", "tp"});
    fsdp::manual_seed(kSeed, mesh);
    ref = random::dropout(torch::ones({5, 3, 4}), 0.5, true, mesh, {Shard(0), Replicate()}, {5, 3, 4});
  });
  run_ranks(4, [&](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"dp", "tp"});
    fsdp::manual_seed(kSeed, (*mesh)["tp"]);  // seeds the root: every slice shares it
    const auto r = chunk_range(5, 2, mesh->get_local_rank(0));
    auto got = random::dropout(torch::ones({r.length, 3, 4}), 0.5, true, mesh, {Shard(0), Replicate()}, {5, 3, 4});
    expect_piece(got, ref, mesh, {Shard(0), Replicate()}, "dp x tp dropout");
  });
}

// Eval mode and p = 0 draw nothing (the offset does not move) and return the input.
TEST(TPRandom, EvalDrawsNothing) {
  run_ranks(2, [](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2}, {"tp"});
    fsdp::manual_seed(3, mesh);
    auto x = torch::ones({4});
    EXPECT_TRUE(torch::equal(random::dropout(x, 0.5, false, mesh, {Replicate()}), x));
    EXPECT_TRUE(torch::equal(random::dropout(x, 0.0, true, mesh, {Replicate()}), x));
    EXPECT_EQ(random::get_rng_state(mesh).second, 0u);
    random::dropout(x, 0.5, true, mesh, {Replicate()});
    EXPECT_EQ(random::get_rng_state(mesh).second, 4u);
  });
}

TEST(TPRandom, ErrorsOnEveryRank) {
  auto errors = run_ranks_collect(3, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {3}, {"tp"});
    fsdp::manual_seed(pg->rank() == 1 ? 8 : 7, mesh);
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("passed different seeds (by rank: 7, 8, 7)"), std::string::npos) << errors[r];
  }
  errors = run_ranks_collect(2, [](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2}, {"tp"});
    random::dropout(torch::ones({2}), 0.5, true, mesh, {Replicate()});
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(errors[r].find("is not seeded; call fsdp::manual_seed"), std::string::npos) << errors[r];
  errors = run_ranks_collect(2, [](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2}, {"tp"});
    fsdp::manual_seed(1, mesh);
    random::rand_local({2}, mesh, {Partial()});
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(errors[r].find("cannot be Partial"), std::string::npos) << errors[r];
}

}  // namespace
}  // namespace fsdp::testing
