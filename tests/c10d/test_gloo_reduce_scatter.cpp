// Gloo's reduce-scatter (issue 16): it moves (N-1)/N of its input instead of all-reducing it
// (src/c10d/collectives.cpp, [Note: Gloo reduce-scatter]) and equals Gloo's own _reduce_scatter_base bit for
// bit, for 2, 3 and 4 ranks; a rank that skips it makes the others fail in time, naming it (CTest label:
// fully_shard).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>
#include <vector>

#include <unistd.h>

#include "fsdp/c10d/collectives.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

// Inputs whose sums depend on the order of the additions: magnitudes over ~8 decades, both signs.
torch::Tensor spread_values(int64_t numel, int rank, torch::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + rank);
  auto x = torch::randn({numel}, gen, torch::kFloat32) * torch::exp(torch::randn({numel}, gen, torch::kFloat32) * 3);
  return x.to(dtype);
}

bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

// The reduce-scatter of the library equals, bit for bit, Gloo's own _reduce_scatter_base (the all-reduce
// path the library used before), for fp32 and bf16, SUM, AVG and MAX, on sizes where Gloo's ring segments
// do not line up with the reduce-scatter's chunks (odd chunk sizes; over 2N MiB, where Gloo cuts more than
// two segments per rank). For N >= 3 the order matters: rank 0 checks that summing in rank order would
// differ somewhere, so bitwise equality is not a coincidence of the data.
class GlooReduceScatter : public ::testing::TestWithParam<int> {};

TEST_P(GlooReduceScatter, EqualsTheAllReducePathBitForBit) {
  const int n = GetParam();
  {
    for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      for (int64_t m : {int64_t{1}, int64_t{7}, int64_t{1001}, int64_t{600001}}) {
        run_ranks(n, [&](ProcessGroupPtr pg) {
          auto input = spread_values(n * m, pg->rank(), dtype);
          for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX}) {
            auto ours = torch::empty({m}, input.options());
            auto work = reduce_scatter_tensor(ours, input, *pg, op, /*async_op=*/true);
            work.wait();
            auto old = torch::empty({m}, input.options());
            c10d::ReduceScatterOptions opts;
            opts.reduceOp = op == ReduceOp::MAX ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
            auto in = input.clone();
            pg->backend()->_reduce_scatter_base(old, in, opts)->wait();
            if (op == ReduceOp::AVG) old.div_(n);
            EXPECT_TRUE(bitwise_equal(ours, old))
                << "N=" << n << " " << dtype << " m=" << m << " op=" << static_cast<int>(op) << " rank "
                << pg->rank() << ": max |diff| "
                << (ours.to(torch::kDouble) - old.to(torch::kDouble)).abs().max().item<double>();
            if (op == ReduceOp::SUM) {
              // In place: the output is this rank's chunk of the input.
              auto buf = input.clone();
              auto mine = buf.narrow(0, pg->rank() * m, m);
              reduce_scatter_tensor(mine, buf, *pg, op);
              EXPECT_TRUE(bitwise_equal(mine, old)) << "in place, N=" << n << " " << dtype << " m=" << m;
            }
            if (op == ReduceOp::SUM && n >= 3 && m > 1000) {
              // Rank 0's chunk summed in rank order, x0 + x1 + ...: Gloo's ring order differs for N >= 3.
              auto all = torch::empty({n * m}, input.options());
              all_gather_into_tensor(all, input.view({n, m})[0].contiguous(), *pg);
              if (pg->rank() == 0) {
                auto naive = all.view({n, m})[0].clone();
                for (int r = 1; r < n; ++r) naive.add_(all.view({n, m})[r]);
                EXPECT_FALSE(bitwise_equal(naive, old)) << "N=" << n << ": the data does not exercise the order";
              }
            }
            // And against a single-process sum in double precision (the reference independent of Gloo).
            if (op == ReduceOp::SUM && dtype == torch::kFloat32 && m < 10000) {
              auto all = torch::empty({n * n * m}, input.options());
              all_gather_into_tensor(all, input, *pg);
              auto ref = all.to(torch::kDouble).view({n, n, m}).select(1, pg->rank()).sum(0);
              auto scale = all.to(torch::kDouble).view({n, n, m}).select(1, pg->rank()).abs().sum(0);
              // fp32 sum of n terms: |error| <= (n-1) * eps * sum |x| (eps = 2^-24, round to nearest).
              auto bound = scale * ((n - 1) * std::ldexp(1.0, -24)) + 1e-30;
              EXPECT_TRUE(((ours.to(torch::kDouble) - ref).abs() <= bound).all().item<bool>())
                  << "N=" << n << " m=" << m << " rank " << pg->rank();
            }
          }
        });
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, GlooReduceScatter, ::testing::Values(2, 3, 4));

// The same error behaviour as every collective: a rank that never reaches an async reduce-scatter makes
// the others' wait() fail within the group timeout, naming the collective, its shapes and the missing
// rank, with the flight recorder written.
TEST(GlooReduceScatterErrors, SkippedReduceScatterTimesOutNamingTheMissingRank) {
  auto dir = std::filesystem::temp_directory_path() / ("fsdp_rs_fr_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  setenv("FSDP_FLIGHT_RECORDER_DIR", dir.c_str(), 1);
  const auto timeout = std::chrono::seconds(2);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<double> failed_after(3, 0);
  auto errors = run_ranks_collect(
      3,
      [&](ProcessGroupPtr pg) {
        barrier(*pg);
        if (pg->rank() == 2) {
          std::this_thread::sleep_for(timeout + std::chrono::seconds(3));  // skips it, stays alive
          return;
        }
        auto out = torch::empty({5});
        auto work = reduce_scatter_tensor(out, torch::ones({15}), *pg, ReduceOp::AVG, /*async_op=*/true);
        try {
          work.wait();
        } catch (...) {
          failed_after[pg->rank()] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          throw;
        }
      },
      std::chrono::seconds(60), timeout);
  unsetenv("FSDP_FLIGHT_RECORDER_DIR");
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("reduce_scatter_tensor #1"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("input [15] Float, output [5] Float"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("ranks that have not reached it: [2]"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("not completed within the group timeout of 2000 ms"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("flight recorder written to"), std::string::npos) << errors[r];
    EXPECT_LT(failed_after[r], 2.0 + 5.0);
    auto file = dir / ("fsdp_flight_recorder_default_rank" + std::to_string(r) + ".json");
    ASSERT_TRUE(std::filesystem::exists(file));
    std::ifstream in(file);
    std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_NE(json.find("reduce_scatter_tensor"), std::string::npos) << json;
  }
  EXPECT_EQ(errors[2], "");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fsdp::testing
