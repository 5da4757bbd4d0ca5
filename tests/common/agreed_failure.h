// Checks of a load that failed on every rank as [Note: validate, agree, apply] says
// (src/checkpoint/validate_agree_apply.h).
#pragma once

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace fsdp::testing {

/// `errors` (one per rank, from run_ranks_collect): every rank threw a message holding each needle and
/// "(nothing was loaded on any rank)"; the ranks other than `bad` name it ("rank <bad> failed: ").
inline void expect_agreed_failure(const std::vector<std::string>& errors, int bad,
                                  const std::vector<std::string>& needles) {
  for (size_t r = 0; r < errors.size(); ++r) {
    const auto& e = errors[r];
    ASSERT_FALSE(e.empty()) << "rank " << r << " loaded although rank " << bad << " rejected the load";
    for (const auto& n : needles) EXPECT_NE(e.find(n), std::string::npos) << "rank " << r << ": " << e;
    EXPECT_NE(e.find("(nothing was loaded on any rank)"), std::string::npos) << "rank " << r << ": " << e;
    if (static_cast<int>(r) != bad) {
      EXPECT_NE(e.find("rank " + std::to_string(bad) + " failed: "), std::string::npos) << "rank " << r << ": " << e;
    }
  }
}

}  // namespace fsdp::testing
