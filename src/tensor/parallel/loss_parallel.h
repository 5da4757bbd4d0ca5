// The vocabulary-sharded outputs that a loss_parallel region recognises (loss_parallel.cpp): registered by the TP
// ops (tp_ops.cpp) when a ColwiseParallel head produces them. See [Note: loss_parallel guard].
#pragma once

#include <cstdint>

#include <torch/types.h>

#include "fsdp/tensor/device_mesh.h"

namespace fsdp::tp::detail {

/// Records `out` ([..., V_r], the local output of a ColwiseParallel Linear whose output layout is Shard(-1)) as
/// vocabulary-sharded over the 1-D `tp_mesh` with `local_vocab` = V_r columns on this rank: held by a weak
/// reference to its StorageImpl, so its views are recognised too and a freed storage's entry is dropped.
void register_vocab_sharded_output(const torch::Tensor& out, const DeviceMeshPtr& tp_mesh, int64_t local_vocab);

}  // namespace fsdp::tp::detail
