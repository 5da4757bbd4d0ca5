// The checkpoint regions a thread is inside: what FSDP needs to reduce a group once per backward when its
// calls are recomputed by several regions (see [Note: recomputed regions], activation_checkpoint.cpp).
#pragma once

#include <cstdint>
#include <vector>

namespace fsdp::detail {

/// One enclosing (reentrant) checkpoint region: its first run (forward, no grad) or its recomputation (backward).
/// `region` numbers the region's CheckpointFunction node for the process's lifetime (never reused, unlike
/// an address).
struct CheckpointFrame {
  uint64_t region = 0;
  bool recompute = false;
};

/// This thread's enclosing checkpoint regions, outermost first (empty outside checkpoint()). Reentrant
/// regions only: a non-reentrant region's first run is an ordinary forward for FSDP.
const std::vector<CheckpointFrame>& checkpoint_frames();

/// Whether this thread runs the recomputation of a non-reentrant region ([Note: non-reentrant checkpoint]):
/// a forward inside a backward whose graph is never backpropagated.
bool in_non_reentrant_recompute();

}  // namespace fsdp::detail
