// Gradient clipping over sharded parameters.
//
// Mirrors torch.nn.utils.clip_grad_norm_ applied to FSDP2's DTensor parameters.
#pragma once

#include <vector>

#include <torch/types.h>

#include "fsdp/c10d/distributed.h"

namespace fsdp {

/// Clips the gradients of `parameters` (local shards of fully_shard parameters, and/or ordinary
/// replicated parameters) so that their total norm over all ranks is at most `max_norm`, in place.
/// The total norm is the single-process norm of the full gradients: the p-th powers of the local
/// shards' norms are summed with one all-reduce over the shard group of the parameters' mesh (MAX for
/// the inf-norm); those of tensor-parallel parameters (fsdp::tp::parallelize_module) also over their TP
/// group, one more all-reduce (so on a dp x tp mesh every element counts once, and parameters that TP
/// replicates, such as norms, are not counted tp times); parameters managed by neither count once
/// (their gradients are assumed identical on every rank). Every rank gets the same norm and the same clip coefficient.
/// Parameters without a gradient are skipped.
/// Returns the total norm: a 0-dim float32 tensor (float64 if gradients are float64).
/// Throws c10::Error when `error_if_nonfinite` and the norm is nan or inf ("clip_grad_norm_: the
/// total norm of order 2 is non-finite ..."); otherwise a non-finite norm makes the gradients
/// non-finite too, as in PyTorch. `group` overrides the process group of the reduction (Default: the
/// shard group of the first sharded parameter; no communication if none is sharded).
/// `also_sum` (optional, no PyTorch counterpart): a tensor SUM-all-reduced in place over the same group,
/// in the same collective as the norm's partial sums when it has the norm's dtype and the norm is finite
/// (e.g. a training loop's loss: one collective per step instead of two; issue 16), else by an
/// all-reduce of its own over that group; left as is when there is no group (nothing sharded) or the
/// group has one rank. Packing does not change any result's bits: Gloo's ring reduces both elements of
/// so small a buffer in the same order as each alone. Throws c10::Error for a non-contiguous `also_sum`.
/// Mirrors torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite).
torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm, double norm_type = 2.0,
                              bool error_if_nonfinite = false, ProcessGroupPtr group = nullptr,
                              const torch::Tensor& also_sum = {});

}  // namespace fsdp
