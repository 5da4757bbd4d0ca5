// The transport counters of the collectives layer (ProcessGroup::comm_stats, issue 16): each collective
// counts the bytes of the algorithm that runs it, and what the ranks send they receive (CTest label:
// fully_shard).
#include <gtest/gtest.h>

#include <mutex>
#include <vector>

#include "fsdp/c10d/collectives.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

// The transport counters of each collective, per rank: the figures of the algorithm that runs it, and
// conservation (what the ranks send in total, they receive in total).
TEST(CommStats, EachCollectiveCountsItsAlgorithmsBytes) {
  for (int n : {2, 3, 4}) {
    std::mutex mu;
    std::vector<CommStats> stats(n);
    run_ranks(n, [&](ProcessGroupPtr pg) {
      const int64_t m = 1001;  // fp32 elements per rank
      auto in = torch::ones({m});
      auto out = torch::empty({n * m});
      all_gather_into_tensor(out, in, *pg);
      auto rs_out = torch::empty({m});
      reduce_scatter_tensor(rs_out, out, *pg);
      auto t = torch::ones({3 * m + 5});
      all_reduce(t, *pg);
      broadcast(t, n - 1, *pg);
      barrier(*pg);
      auto s = pg->comm_stats();
      const uint64_t b = m * 4;
      EXPECT_EQ(s.all_gather_into_tensor.sent, (n - 1) * b);
      EXPECT_EQ(s.all_gather_into_tensor.received, (n - 1) * b);
      EXPECT_EQ(s.reduce_scatter_tensor.sent, (n - 1) * b);
      EXPECT_EQ(s.reduce_scatter_tensor.received, (n - 1) * b);
      EXPECT_EQ(s.all_gather_into_tensor.count, 1u);
      EXPECT_EQ(s.broadcast.received, pg->rank() == n - 1 ? 0u : t.nbytes());
      // Ring all-reduce: 2(N-1)/N of the tensor, within one segment of rounding.
      const double ar = 2.0 * (n - 1) / n * t.nbytes();
      EXPECT_NEAR(static_cast<double>(s.all_reduce.sent), ar, 2.0 * t.nbytes() / n / 2 + 8);
      EXPECT_EQ(s.sent(), s.all_gather_into_tensor.sent + s.reduce_scatter_tensor.sent + s.all_reduce.sent +
                              s.broadcast.sent);
      std::lock_guard<std::mutex> lock(mu);
      stats[pg->rank()] = s;
      pg->reset_comm_stats();
      EXPECT_EQ(pg->comm_stats().sent(), 0u);
      EXPECT_EQ(pg->comm_stats().all_reduce.count, 0u);
    });
    uint64_t ar_sent = 0, ar_recv = 0, bc_sent = 0, bc_recv = 0;
    for (const auto& s : stats) {
      ar_sent += s.all_reduce.sent;
      ar_recv += s.all_reduce.received;
      bc_sent += s.broadcast.sent;
      bc_recv += s.broadcast.received;
    }
    EXPECT_EQ(ar_sent, ar_recv) << "N=" << n;
    EXPECT_EQ(bc_sent, bc_recv) << "N=" << n;
    EXPECT_EQ(bc_sent, static_cast<uint64_t>(n - 1) * (3 * 1001 + 5) * 4) << "N=" << n;
  }
}

}  // namespace
}  // namespace fsdp::testing
