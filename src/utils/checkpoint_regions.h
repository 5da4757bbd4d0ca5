// The checkpoint regions a thread is inside: what FSDP needs to reduce a group once per backward when its
// calls are recomputed by several regions (see [Note: recomputed regions], activation_checkpoint.cpp).
#pragma once

#include <cstdint>
#include <vector>

namespace fsdp::detail {

/// One enclosing checkpoint region: its first run (forward, no grad) or its recomputation (backward).
/// `region` numbers the region's CheckpointFunction node for the process's lifetime (never reused, unlike
/// an address).
struct CheckpointFrame {
  uint64_t region = 0;
  bool recompute = false;
};

/// This thread's enclosing checkpoint regions, outermost first (empty outside checkpoint()).
const std::vector<CheckpointFrame>& checkpoint_frames();

}  // namespace fsdp::detail
