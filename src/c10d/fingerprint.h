// Debug mode (FSDP_DEBUG): before each collective every rank gathers every rank's fingerprint of it (its
// number in the group, the op, the reduce op or root, and the dtypes and shapes of its tensors) over the
// group's side group, and raises on a mismatch, naming both calls and the field that differs. All ranks see
// the same table, so all raise together instead of exchanging mismatched bytes or hanging.
//
// PyTorch counterpart: TORCH_DISTRIBUTED_DEBUG=DETAIL's collective fingerprints (ProcessGroupWrapper).
#pragma once

#include <cstdint>
#include <string>

#include <torch/torch.h>

#include "fsdp/c10d/distributed.h"

namespace fsdp::detail {

/// Compares this collective across the ranks of `group` (which must have a debug backend): `op` is the
/// collective's name ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast", "barrier"),
/// `seq` its number in the group, `arg` its reduce op (fsdp::ReduceOp) or root, `in`/`out` its tensors (null:
/// none). Throws c10::Error on every rank when the ranks disagree, or when the exchange itself fails (a rank
/// that never reached the collective, after the group timeout).
void check_fingerprint(ProcessGroup& group, const std::string& op, uint64_t seq, int64_t arg,
                       const torch::Tensor* in, const torch::Tensor* out);

}  // namespace fsdp::detail
