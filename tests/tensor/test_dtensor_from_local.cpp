// DTensor::from_local's run_check (issue 28, item 4; [Note: from_local's run_check], src/tensor/dtensor.cpp):
// pieces that do not form one DTensor make every rank throw the same message, naming the ranks and shapes,
// instead of some ranks building a DTensor while others throw (and the next collective hangs); run_check=false
// skips the comparison.
#include <gtest/gtest.h>

#include <string>

#include "fsdp/fsdp.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

void expect_same_error_everywhere(const std::vector<std::string>& errors, const std::vector<std::string>& needles) {
  for (size_t r = 0; r < errors.size(); ++r) {
    ASSERT_FALSE(errors[r].empty()) << "rank " << r << " built a DTensor the other ranks rejected";
    for (const auto& n : needles) EXPECT_NE(errors[r].find(n), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("Every rank raises this error"), std::string::npos) << errors[r];
  }
  // The same message on every rank (up to the backtrace LibTorch appends).
  auto head = [](const std::string& e) { return e.substr(0, e.find('\n')); };
  for (size_t r = 1; r < errors.size(); ++r) EXPECT_EQ(head(errors[r]), head(errors[0]));
}

// Shard(1) widths 2/3/4/5 over 14 columns: the sum is right but only rank 2's width is torch.chunk's.
TEST(DTensorFromLocal, UnevenWidthsFailOnEveryRank) {
  auto errors = run_ranks_collect(4, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {4});
    DTensor::from_local(torch::zeros({3, 2 + pg->rank()}), mesh, {Shard(1)});
  });
  expect_same_error_everywhere(errors, {"global shape [3, 14]", "rank 0 has [3, 2] (expected [3, 4])",
                                        "rank 3 has [3, 5] (expected [3, 2])"});
  EXPECT_EQ(errors[0].find("rank 2 has"), std::string::npos) << errors[0];  // rank 2's piece is right
}

// A 2 x 2 mesh, Replicate on dim 0 and Shard(0) on dim 1: the two replica rows hold different pieces
// and would sum them to different global shapes ([6, 2] and [4, 2]).
TEST(DTensorFromLocal, ReplicasWithDifferentPiecesFailOnEveryRank) {
  auto errors = run_ranks_collect(4, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"rep", "shard"});
    const int64_t rows = pg->rank() < 2 ? 3 : 2;
    DTensor::from_local(torch::zeros({rows, 2}), mesh, {Replicate(), Shard(0)});
  });
  expect_same_error_everywhere(errors, {"different global shapes", "[6, 2]", "[4, 2]"});
}

TEST(DTensorFromLocal, DifferentPlacementsOrGlobalShapesFailOnEveryRank) {
  auto errors = run_ranks_collect(3, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {3});
    DTensor::from_local(torch::zeros({2, 2}), mesh, {pg->rank() == 1 ? Replicate() : Shard(0)});
  });
  expect_same_error_everywhere(errors, {"different placements", "rank 1 (Replicate())"});
  errors = run_ranks_collect(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    DTensor::from_local(torch::zeros({2, 2}), mesh, {Shard(0)}, {pg->rank() == 0 ? 4 : 5, 2});
  });
  expect_same_error_everywhere(errors, {"disagree on the tensor's rank or global shape", "global [5, 2]"});
  errors = run_ranks_collect(2, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    DTensor::from_local(torch::zeros({2, 2}), mesh, {Shard(2)});  // out of range on every rank
  });
  expect_same_error_everywhere(errors, {"Shard(dim=2) is out of range for a 2-D tensor"});
}

// Consistent pieces (uneven and empty shards included) build the same DTensor with or without the check.
TEST(DTensorFromLocal, ConsistentPiecesAgreeWithAndWithoutTheCheck) {
  run_ranks(3, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {3});
    auto full = torch::arange(2 * 5, torch::kFloat32).view({5, 2});  // rows 2 / 2 / 1
    auto piece = distribute_tensor(full, mesh, {Shard(0)}).to_local();
    auto checked = DTensor::from_local(piece, mesh, {Shard(0)});
    auto unchecked = DTensor::from_local(piece, mesh, {Shard(0)}, {}, /*run_check=*/false);
    EXPECT_EQ(checked.sizes(), std::vector<int64_t>({5, 2}));
    EXPECT_EQ(unchecked.sizes(), checked.sizes());
    EXPECT_TRUE(torch::equal(checked.full_tensor(), full));
    auto tiny = torch::arange(2, torch::kFloat32);  // rows 1 / 1 / 0: an empty shard on rank 2
    auto t = DTensor::from_local(distribute_tensor(tiny, mesh, {Shard(0)}).to_local(), mesh, {Shard(0)}, {2});
    EXPECT_TRUE(torch::equal(t.full_tensor(), tiny));
  });
}

}  // namespace
}  // namespace fsdp::testing
