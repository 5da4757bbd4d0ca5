// Loss parallelism: cross-entropy over logits sharded on the class (vocabulary) dim across a TP group,
// without gathering them. See [Note: vocab-parallel cross-entropy] in src/tensor/parallel/loss.cpp and
// docs/TENSOR_PARALLEL.md ("loss_parallel and the DTensor RNG").
//
// Mirrors torch.distributed.tensor.parallel.loss_parallel (PyTorch users write
// `with loss_parallel(): loss = F.cross_entropy(dtensor_logits, labels)`).
#pragma once

#include <cstdint>
#include <string>

#include <torch/types.h>

#include "fsdp/tensor/device_mesh.h"
#include "fsdp/tensor/dtensor.h"

namespace fsdp::tp {

/// The options of vocab_parallel_cross_entropy, spelled as torch::nn::functional::CrossEntropyFuncOptions
/// (no class weights: PyTorch's loss_parallel takes a replicated `weight`; libfsdp's does not yet). Validated by
/// vocab_parallel_cross_entropy (c10::Error for a reduction other than mean/sum/none, a smoothing outside [0, 1]).
/// Example: `tp::LossParallelOptions().set_reduction("sum").set_ignore_index(-100).set_label_smoothing(0.1)`
struct LossParallelOptions {
  /// "mean" (over the targets that are not ignore_index; NaN when every target is ignored, as PyTorch),
  /// "sum" or "none" (one loss per row, 0 for an ignored row).
  std::string reduction = "mean";
  /// Targets equal to it contribute neither loss nor gradient.
  int64_t ignore_index = -100;
  /// In [0, 1]: the target distribution is (1 - label_smoothing) on the target class plus
  /// label_smoothing / V on every class (V: the global vocabulary size), as torch's cross_entropy.
  double label_smoothing = 0.0;

  LossParallelOptions& set_reduction(std::string r) { reduction = std::move(r); return *this; }
  LossParallelOptions& set_ignore_index(int64_t i) { ignore_index = i; return *this; }
  LossParallelOptions& set_label_smoothing(double s) { label_smoothing = s; return *this; }
};

/// Cross-entropy of logits sharded on their last (class) dim over the 1-D TP mesh `tp_mesh`: this rank holds
/// `local_logits`, [N, V_r] (or [V_r] with a 0-D target), the columns [o_r, o_r + V_r) of the global [N, V]
/// logits, torch.chunk's chunk r of V over the TP size (c = ceil(V / tp); trailing chunks short or empty):
/// exactly what a ColwiseParallel head (Shard(-1) output, the default) returns for a vocabulary V that does
/// not divide. `target`: [N] int64 class indices in [0, V) or ignore_index, the same on every TP rank.
/// Returns what torch::nn::functional::cross_entropy(gathered_logits, target, options) returns (a scalar for
/// "mean"/"sum", [N] for "none"), the same on every TP rank; its backward gives each rank the gradient of its
/// own columns (softmax minus the smoothed one-hot, local, no communication). Forward: three all-reduces of
/// [N] (max, sum of exponentials, target logit; a fourth, the row sums, with label smoothing) and one
/// all-gather of 2 integers per rank to check the shapes. Never materialises [N, V] on any rank.
/// Computes in local_logits' dtype (pass fp32 logits for fp32 accuracy).
/// Throws c10::Error, on every rank alike (before any collective that could mismatch), naming the shapes and
/// the fix: a mesh that is not 1-D, logits that are not 1-D or 2-D (flatten [B, T, V_r] to [B * T, V_r]),
/// a target whose shape does not match, ranks whose N differ or whose V_r are not torch.chunk's pieces of
/// one V, a target outside [0, V) that is not ignore_index, a reduction other than mean/sum/none, a
/// label_smoothing outside [0, 1].
/// Mirrors `with loss_parallel(): F.cross_entropy(logits_dtensor, target, ...)` on a Shard(-1) DTensor.
/// Example: `auto loss = fsdp::tp::vocab_parallel_cross_entropy(head(x).view({-1, v_local}), y.view(-1), mesh["tp"]);`
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& local_logits, const torch::Tensor& target,
                                           const DeviceMeshPtr& tp_mesh, const LossParallelOptions& options = {});

/// The same on a DTensor: `logits` on a 1-D mesh with placements {Shard(1)} (or {Shard(-1)}; 2-D global
/// shape [N, V]) or {Shard(0)} for a 1-D [V]. Throws c10::Error for any other mesh or placement.
/// Example: `auto loss = fsdp::tp::vocab_parallel_cross_entropy(DTensor(local, tp_mesh, {Shard(1)}, {n, v}), y);`
torch::Tensor vocab_parallel_cross_entropy(const DTensor& logits, const torch::Tensor& target,
                                           const LossParallelOptions& options = {});

/// The region of loss_parallel(): while it lives on this thread, torch::nn::functional::cross_entropy
/// (aten::cross_entropy_loss) on the vocabulary-sharded output of a ColwiseParallel head (output layout
/// Shard(-1): a parallelised Linear or the tied head of [Note: tied TP styles]), or on a view of it that keeps
/// its storage and rows (`.view({-1, V_r})`, `.flatten(0, 1)`, `.reshape`), computes
/// vocab_parallel_cross_entropy(logits, target, tp_mesh, {reduction, ignore_index, label_smoothing as given to
/// cross_entropy}), forward and backward. Every other cross_entropy (and every other op) computes as without it;
/// outside the region nothing changes. See [Note: loss_parallel guard] in src/tensor/parallel/loss_parallel.cpp.
/// Inside the region, cross_entropy on such logits throws c10::Error (on every rank alike) for: class weights
/// (not supported: leave `weight` unset, or gather the logits and call cross_entropy outside the region); a
/// view whose last dim is not the head's local vocabulary V_r or whose rows are not the head's rows (a slice
/// of the class dim, a transpose, a class dim not last: flatten to [N, V_r] with view/reshape); inputs of more
/// than 2 dims (flatten [B, T, V_r] to [B * T, V_r]); and what vocab_parallel_cross_entropy throws.
/// Must end on the thread that began it, innermost first (it restores the thread's dispatch state). Nests.
/// Mirrors torch.distributed.tensor.parallel.loss_parallel (a context manager in PyTorch).
/// Example: `{ auto guard = fsdp::tp::loss_parallel(); loss = F::cross_entropy(head(x).flatten(0, 1), y.view(-1)); loss.backward(); }`
class LossParallelGuard {
 public:
  LossParallelGuard();
  ~LossParallelGuard();
  LossParallelGuard(const LossParallelGuard&) = delete;
  LossParallelGuard& operator=(const LossParallelGuard&) = delete;
  LossParallelGuard(LossParallelGuard&&) = delete;
  LossParallelGuard& operator=(LossParallelGuard&&) = delete;

 private:
  bool key_was_included_;
};

/// Begins a loss_parallel region on this thread (see LossParallelGuard); it ends when the returned guard is
/// destroyed. Throws c10::Error if libfsdp's interception kernels could not be registered (another library
/// owns the dispatch key).
/// Mirrors `with torch.distributed.tensor.parallel.loss_parallel(): ...`.
/// Example: `auto guard = fsdp::tp::loss_parallel(); auto loss = torch::nn::functional::cross_entropy(logits, y);`
[[nodiscard]] LossParallelGuard loss_parallel();

}  // namespace fsdp::tp
