// Collective timeouts and the flight recorder: a rank that skips a collective makes the others fail within
// the group timeout, naming it and dumping the flight recorder, which keeps the last collectives in order
// (CTest label: join_debug).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include <unistd.h>

#include "fsdp/c10d/collectives.h"
#include "fsdp/c10d/flight_recorder.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

// ---- Timeouts and the flight recorder -------------------------------------------------------------
TEST(Timeout, SkippedCollectiveNamesTheMissingRankAndDumpsTheFlightRecorder) {
  auto dir = std::filesystem::temp_directory_path() / ("fsdp_fr_" + std::to_string(::getpid()));
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
          // Skips the all-reduce; stays alive past the others' timeout.
          std::this_thread::sleep_for(timeout + std::chrono::seconds(3));
          return;
        }
        auto t = torch::ones({4, 2});
        try {
          all_reduce(t, *pg);
        } catch (...) {
          failed_after[pg->rank()] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          throw;
        }
      },
      std::chrono::seconds(60), timeout);
  unsetenv("FSDP_FLIGHT_RECORDER_DIR");
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("all_reduce #1"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("[4, 2] Float"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("ranks that have not reached it: [2]"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("flight recorder written to"), std::string::npos) << errors[r];
    EXPECT_LT(failed_after[r], 2.0 + 5.0);
    EXPECT_TRUE(std::filesystem::exists(dir / ("fsdp_flight_recorder_default_rank" + std::to_string(r) + ".json")));
  }
  EXPECT_EQ(errors[2], "");
  std::filesystem::remove_all(dir);
}

TEST(FlightRecorder, KeepsTheLastCollectivesInOrder) {
  FlightRecorder fr(4);
  for (uint64_t s = 0; s < 6; ++s) fr.issued(s, "all_reduce", "tensor [1] Float");
  fr.completed(5);
  auto recs = fr.records();
  ASSERT_EQ(recs.size(), 4u);
  EXPECT_EQ(recs.front().seq, 2u);
  EXPECT_EQ(recs.back().seq, 5u);
  EXPECT_EQ(recs.back().state, "completed");
  EXPECT_EQ(recs[2].state, "issued");
}

}  // namespace
}  // namespace fsdp::testing
