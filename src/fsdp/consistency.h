// Checks and synchronisation that keep the ranks of an FSDP job consistent with each other:
// - at fully_shard: every rank starts from the same weights (sync_module_states, and in debug mode a
//   checksum comparison naming the first parameter that differs); HSDP replicas are broadcast from
//   replicate rank 0 by the group itself (FSDPParamGroup's constructor);
// - at the root's first forward: every rank has the same FSDP groups with the same collective sizes,
//   so that a mismatch is a c10::Error on every rank instead of a Gloo abort (check_group_layout).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/fsdp/fully_shard.h"

namespace fsdp::detail {

class FSDPState;

/// Called by fully_shard before it shards `params` (module-relative names) of `modules`.
/// With options.sync_module_states(): broadcasts `params` and the buffers of `modules` (outside
/// already-sharded submodules) from rank 0 of the mesh to every rank (one broadcast per dtype).
/// Otherwise, in debug mode (FSDP_DEBUG=DETAIL): compares a checksum of every parameter over the
/// shard group and throws c10::Error on every rank naming the first parameter that differs.
void sync_before_sharding(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                          const std::vector<std::shared_ptr<torch::nn::Module>>& modules, const DeviceMeshPtr& mesh,
                          const FullyShardOptions& options, const std::string& module_name);

/// Called once by the root's lazy init (first forward): exchanges a digest of every group's
/// collective sizes (all-gather and reduce-scatter elements per rank and dtypes, group sizes,
/// reshard_after_forward, parameter shapes) with one small all-reduce over the root mesh's world
/// group, and throws c10::Error on every rank naming the first group and collective that differ.
/// Costs one all-reduce of 2 x world int64 at the first iteration and nothing afterwards.
void check_group_layout(FSDPState& root);

}  // namespace fsdp::detail
