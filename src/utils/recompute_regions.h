// Thread-local regions that a checkpoint's recomputation re-enters as its forward saw them.
//
// [Note: regions a recomputation re-enters]
// loss_parallel() and context_parallel (tensor/) are thread-local regions that change what an op computes on
// this thread (cross_entropy becomes the vocab-parallel loss, SDPA ring attention). A checkpointed function that
// ran inside such a region is recomputed in backward, which may run after the region ended (backward outside
// it), inside a region its forward was not in, or on another thread (CUDA's autograd threads, which do not see
// the caller's thread_locals). Recomputed without the region, it computes something else: a different number
// of saved tensors (caught by the determinism check) or, for attention under a reentrant checkpoint, a graph of
// plain attention with the ring's shapes (silently wrong gradients: tests/tensor/test_context_parallel.cpp,
// ContextParallelCheckpoint, off by up to 0.17 without this). So each region registers a capture function here, at load; a checkpoint captures
// every registered region when its forward runs (make_non_reentrant_frame, the reentrant FnHolder) and re-enters
// the captures around its recomputation (RecomputeStates), leaving the thread's own state as it was after.
// An implicit checkpoint region (implicit_checkpoint.cpp: a checkpoint_wrapper'd module without a holder) captures
// when it opens and stays open across the module's ops; so a region that begins or ends closes it first
// (close_implicit_region in LossParallelGuard and context_parallel), and nothing is recorded under a state it
// does not run in. utils/ cannot depend on tensor/: hence registration rather than calls.
#pragma once

#include <functional>
#include <memory>
#include <vector>

namespace fsdp::detail {

/// Enters a captured region state on the calling thread; the returned object leaves it (restores what the thread
/// had) when destroyed, on the same thread.
using RegionReentry = std::function<std::shared_ptr<void>()>;

/// Reads this thread's state of one kind of region (none active is a state too: re-entering it suspends a
/// region of that kind for the recomputation).
using RegionCapture = RegionReentry (*)();

/// Registers a kind of region (once per kind, at load time: before any thread dispatches).
void register_region_capture(RegionCapture capture);

/// This thread's state of every registered kind of region.
std::vector<RegionReentry> capture_regions();

/// Enters `regions` for its lifetime (innermost last), then restores the thread's own states in reverse order.
class ReenterRegions {
 public:
  explicit ReenterRegions(const std::vector<RegionReentry>& regions);
  ~ReenterRegions();
  ReenterRegions(const ReenterRegions&) = delete;
  ReenterRegions& operator=(const ReenterRegions&) = delete;

 private:
  std::vector<std::shared_ptr<void>> entered_;
};

}  // namespace fsdp::detail
