// Gradient clipping over a pipelined model: the norm of all stages' gradients.
#pragma once

#include <vector>

#include <torch/types.h>

#include "fsdp/c10d/distributed.h"

namespace fsdp::pipelining {

/// Clips the gradients of this rank's stages' `parameters` so that the norm of the whole model's
/// gradients (every stage, and within a stage every FSDP shard and TP piece) is at most `max_norm`.
/// Each stage's norm is fsdp::clip_grad_norm_'s (over the stage's dp and tp groups; see
/// fsdp/algorithms/clip_grad.h); the stages' p-th powers are then summed (MAX for the inf-norm) with one
/// all-reduce over `pp_group`, so every rank gets the one-process norm and the same clip coefficient,
/// max_norm / (norm + 1e-6) capped at 1, as torch.nn.utils.clip_grad_norm_. Collective over every group
/// involved: every rank of the mesh calls it. Returns the total norm (0-dim float32, float64 for
/// float64 gradients). Throws c10::Error when `error_if_nonfinite` and the norm is not finite.
/// Mirrors torchtitan's dist_utils.clip_grad_norm_(parameters, max_norm, norm_type, pp_mesh=...).
/// Example: `auto norm = fsdp::pipelining::clip_grad_norm_(params, 1.0, 2.0, mesh->get_group("pp"));`
torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm, ProcessGroupPtr pp_group,
                              double norm_type = 2.0, bool error_if_nonfinite = false);

}  // namespace fsdp::pipelining
