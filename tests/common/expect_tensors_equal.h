// Bitwise equality of two lists of tensors (gradients, parameters), for the parity tests of one process.
#pragma once

#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/types.h>

namespace fsdp::testing {

/// Expects `a` and `b` to hold the same number of tensors, each defined in both or in neither, and equal bit for
/// bit; a failure names `what` and the index.
inline void expect_tensors_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                                 const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << what << ": tensor " << i;
    if (a[i].defined()) EXPECT_TRUE(torch::equal(a[i], b[i])) << what << ": tensor " << i << " differs";
  }
}

}  // namespace fsdp::testing
