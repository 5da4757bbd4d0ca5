// The selective part of a non-reentrant checkpoint region (see [Note: selective checkpoint],
// selective_checkpoint.cpp), as the region's frame (activation_checkpoint.cpp) uses it.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Generator.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/types.h>

#include "fsdp/utils/selective_checkpoint.h"

namespace fsdp::detail {

struct CachedOp;
struct SelectiveRun;

/// The ops a region's first run saved, and what the recomputation needs to skip them.
class SelectiveRegion {
 public:
  /// `gens`: the generators whose states the region restores (random ops that are saved leave them where the
  /// first run did); `restore_rng`: whether the region restores them at all (preserve_rng_state).
  SelectiveRegion(SelectiveCheckpointContexts contexts, std::vector<at::Generator> gens, bool restore_rng, bool check);
  ~SelectiveRegion();

  /// The first run's pack hook, for the tensor saved under `index`: noted when a saved op is running.
  void on_pack(size_t index, const torch::Tensor& t);
  /// Whether the tensor saved under `index` was kept from the first run (an op's own temporary), and which.
  const torch::Tensor* kept(size_t index) const;

  /// Receives, in the recomputation, each saved tensor of a skipped op: its index and the tensor (null when
  /// the tensor is kept: the index only advances).
  using Fill = std::function<void(size_t index, const torch::Tensor* t)>;

  /// While alive, this thread's ops go through the region's policy: the first run (`fill` empty) or the
  /// recomputation. A nested region's scope (or a null region: a region without policy) suspends the
  /// enclosing one.
  class Scope {
   public:
    Scope(SelectiveRegion* region, Fill fill);
    ~Scope();
    /// After a recomputation: throws c10::Error (when the region checks determinism) if it did not reach every
    /// op the first run saved.
    void finish() const;
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    SelectiveRun* previous_;
    std::unique_ptr<SelectiveRun> run_;
    std::optional<c10::impl::IncludeDispatchKeyGuard> include_;
  };

 private:
  friend struct SelectiveRun;
  SelectiveCheckpointContexts contexts_;
  std::vector<at::Generator> gens_;
  bool restore_rng_;
  bool check_;
  std::vector<CachedOp> cached_;                        // in the first run's order
  std::unordered_map<size_t, torch::Tensor> kept_;      // saved tensors kept as they were
  // The storages of the saved outputs not yet copied: (op, tensor) in cached_, for copy on write.
  std::unordered_map<const c10::StorageImpl*, std::pair<size_t, size_t>> saved_storages_;
};

/// Suspends this thread's selective region (library code run inside a region, e.g. FSDP's pre-forward: its
/// ops are not the region's, and differ between the first run and the recomputation).
class SuspendSelective {
 public:
  SuspendSelective();
  ~SuspendSelective();
  SuspendSelective(const SuspendSelective&) = delete;
  SuspendSelective& operator=(const SuspendSelective&) = delete;

 private:
  SelectiveRun* previous_;
};

}  // namespace fsdp::detail
