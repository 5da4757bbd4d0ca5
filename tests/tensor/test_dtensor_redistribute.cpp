// DTensor::redistribute on N-D meshes (src/tensor/dtensor.cpp; CTest labels: foundation, tensor_parallel):
// every pair of placement lists over Shard(0), Shard(1), Replicate() and Partial() on a 1-D mesh of 2
// and 4 ranks and a 2x2 mesh, with dims that the mesh does not divide (torch.chunk semantics, empty
// chunks included). Values are small integers so that every reduction is exact: results are compared
// bit for bit against distribute_tensor of the full tensor.
#include <gtest/gtest.h>

#include "fsdp/fsdp.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

std::vector<std::vector<Placement>> all_placements(int64_t ndim) {
  const std::vector<Placement> one{Shard(0), Shard(1), Replicate(), Partial()};
  std::vector<std::vector<Placement>> out{{}};
  for (int64_t d = 0; d < ndim; ++d) {
    std::vector<std::vector<Placement>> next;
    for (const auto& prefix : out) {
      for (const auto& p : one) {
        auto v = prefix;
        v.push_back(p);
        next.push_back(v);
      }
    }
    out = next;
  }
  return out;
}

std::string describe(const std::vector<Placement>& ps) {
  std::string s = "(";
  for (size_t i = 0; i < ps.size(); ++i) s += (i ? ", " : "") + ps[i].str();
  return s + ")";
}

// A DTensor of `full` whose Partial mesh dims hold uneven summands (not just value-and-zeros), so that a
// reduction that drops or double-counts a rank's summand shows.
DTensor make_source(const torch::Tensor& full, const DeviceMeshPtr& mesh, const std::vector<Placement>& ps) {
  auto plain = ps;
  for (auto& p : plain)
    if (p.is_partial()) p = Replicate();
  torch::Tensor local = distribute_tensor(full, mesh, plain).to_local().clone();
  for (int64_t d = 0; d < mesh->ndim(); ++d) {
    if (!ps[d].is_partial()) continue;
    auto r = torch::full_like(local, 7.0 * (d + 1));
    local = mesh->get_local_rank(d) == 0 ? local - (mesh->size(d) - 1) * r : r;
  }
  return DTensor(local, mesh, ps, full.sizes().vec());
}

// Every source -> target pair on `mesh`, for each shape.
void check_all_pairs(const DeviceMeshPtr& mesh, const std::vector<std::vector<int64_t>>& shapes) {
  const auto placements = all_placements(mesh->ndim());
  for (const auto& shape : shapes) {
    int64_t numel = 1;
    for (auto s : shape) numel *= s;
    auto full = torch::arange(numel, torch::kFloat32).view(shape) - 3;
    for (const auto& from : placements) {
      auto src = make_source(full, mesh, from);
      ASSERT_TRUE(torch::equal(src.full_tensor(), full)) << "source " << describe(from);
      for (const auto& to : placements) {
        auto out = src.redistribute(to);
        auto expect = distribute_tensor(full, mesh, to).to_local();
        SCOPED_TRACE("shape " + c10::str(c10::IntArrayRef(shape)) + ": " + describe(from) + " -> " + describe(to) +
                     " on rank " + std::to_string(mesh->get_rank()));
        EXPECT_EQ(out.placements(), to);
        EXPECT_EQ(out.sizes(), shape);
        ASSERT_EQ(out.to_local().sizes(), expect.sizes());
        bool partial = false;
        for (const auto& p : to) partial = partial || p.is_partial();
        if (!partial) {
          EXPECT_TRUE(torch::equal(out.to_local(), expect)) << out.to_local() << "\nexpected\n" << expect;
        }
        EXPECT_TRUE(torch::equal(out.full_tensor(), full));
      }
      // The source is unchanged (all_reduce works on a copy).
      EXPECT_TRUE(torch::equal(src.full_tensor(), full));
    }
  }
}

TEST(DTensorRedistribute, AllPairsOn2Ranks) {
  run_ranks(2, [](ProcessGroupPtr) { check_all_pairs(init_device_mesh(torch::kCPU, {2}), {{3, 5}, {1, 2}, {0, 3}}); });
}

TEST(DTensorRedistribute, AllPairsOn4Ranks) {
  // 3 rows on 4 ranks: chunks of 1, 1, 1, 0 (an empty shard); 5 columns: 2, 2, 1, 0.
  run_ranks(4, [](ProcessGroupPtr) { check_all_pairs(init_device_mesh(torch::kCPU, {4}), {{3, 5}}); });
}

TEST(DTensorRedistribute, AllPairsOn2x2Mesh) {
  // (Shard(0), Shard(0)) nests: 5 rows -> 3 + 2 across "dp", then 2 + 1 / 1 + 1 across "tp".
  run_ranks(4, [](ProcessGroupPtr) {
    check_all_pairs(init_device_mesh(torch::kCPU, {2, 2}, {"dp", "tp"}), {{5, 3}, {2, 1}});
  });
}

TEST(DTensorRedistribute, NestedShardOfOneDimHoldsRowsInMeshOrder) {
  // Left-to-right nesting, as PyTorch's default: rank (i, j) of a 2x2 mesh holds chunk 2i + j.
  run_ranks(4, [](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2, 2}, {"dp", "tp"});
    auto full = torch::arange(8, torch::kFloat32);
    auto dt = distribute_tensor(full, mesh, {Shard(0), Shard(0)});
    EXPECT_TRUE(torch::equal(dt.to_local(), full.narrow(0, 2 * pg->rank(), 2)));
    EXPECT_EQ(dt.local_offsets(), std::vector<int64_t>{2 * pg->rank()});
    // Partial on the outer dim, sharded inner: the reduce-scatter runs on the inner group's pieces.
    auto part = DTensor::from_local(torch::full({2}, 1.0f + pg->rank()), mesh, {Partial(), Shard(0)});
    EXPECT_EQ(part.sizes(), std::vector<int64_t>{4});
    // Ranks 0 and 2 (tp coordinate 0) hold rows 0-1: 1 + 3; ranks 1 and 3 rows 2-3: 2 + 4.
    EXPECT_TRUE(torch::equal(part.full_tensor(), torch::tensor({4.0f, 4.0f, 6.0f, 6.0f})));
  });
}

TEST(DTensorRedistribute, BadPlacementsNameWhatIsWrong) {
  run_ranks(2, [](ProcessGroupPtr) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    auto dt = distribute_tensor(torch::zeros({4, 2}), mesh, {Shard(0)});
    try {
      dt.redistribute({Shard(2)});
      ADD_FAILURE() << "expected a throw";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("Shard(dim=2) is out of range for a 2-D tensor"), std::string::npos)
          << e.what();
    }
    EXPECT_THROW(dt.redistribute({Replicate(), Replicate()}), c10::Error);
  });
}

}  // namespace
}  // namespace fsdp::testing
