// fully_shard's initialisation: the default mesh, which parameters a fully_shard call manages, and the
// checks each must pass before anything is sharded (a failed fully_shard leaves the module untouched).
// Mirrors torch.distributed.fsdp._fully_shard._fsdp_init (_init_default_fully_shard_mesh,
// _get_managed_modules / _get_managed_states, _verify_managed_param).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/fsdp/fully_shard.h"

namespace fsdp::detail {

/// `options.mesh()`, or a 1-D mesh over the default process group. Throws c10::Error for a mesh that is
/// neither 1-D nor 2-D.
DeviceMeshPtr fully_shard_mesh(const FullyShardOptions& options);
/// The data-parallel mesh of `dims` in the full mesh `mesh` (dp_mesh_dims of fully_shard and replicate):
/// 1-D or 2-D (replicate, shard), several names of one field flattened into one dimension. `api` names the
/// caller in errors. Collective over the ranks spanned the first time a flattened mesh is built.
DeviceMeshPtr data_parallel_mesh(const DeviceMeshPtr& mesh, const DataParallelMeshDims& dims, const char* api);

/// Visits, pre-order, every module of `modules`' trees outside the subtrees of already-sharded submodules
/// (those are managed by their own fully_shard call): `fn(index of the tree in modules, prefix ("i." with
/// several modules, else ""), path from that tree's root ("" for the root), module)`. Mirrors
/// _get_managed_modules.
void for_each_managed_module(
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
    const std::function<void(size_t, const std::string&, const std::string&, torch::nn::Module&)>& fn);

/// The parameters a fully_shard call of `modules` manages, in module order.
struct ManagedParams {
  /// (local FQN, parameter): the FQN relative to the module, prefixed by "i." for several modules.
  std::vector<std::pair<std::string, torch::Tensor>> params;
  /// Per parameter: index of its module in the call and its name in that module.
  std::vector<std::pair<size_t, std::string>> origin;
};

/// Every parameter of `modules` outside already-sharded submodules, minus `options.ignored_params()`,
/// each once (tied parameters within the call are one). Throws c10::Error (naming the parameter, both
/// modules and `rank`) for a parameter already managed by another fully_shard call, and for a module
/// that makes sparse gradients (torch::nn::Embedding / EmbeddingBag with sparse=true).
ManagedParams get_managed_params(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                                 const FullyShardOptions& options, int rank);

/// Moves the buffers of `modules` (outside already-sharded submodules; each once) to `device`, as
/// PyTorch's _move_states_to_device at fully_shard: buffers on the meta device (deferred init) stay.
/// The parameters move with their shards (FSDPParam).
void move_buffers_to_device(const std::vector<std::shared_ptr<torch::nn::Module>>& modules, torch::Device device);

/// The dtypes of a group, found while checking its parameters.
struct GroupDtypes {
  std::optional<torch::ScalarType> trainable;  // of the trainable parameters (unset: none trainable)
};

/// Checks the parameters of one group before any is sharded: each is at least 1-D, contiguous and dense;
/// trainable parameters share one dtype (as in PyTorch: one reduction dtype per group). Frozen parameters
/// may have other dtypes (gathered as bytes).
/// Throws c10::Error naming the parameter, `module_name` and `rank`.
GroupDtypes verify_managed_params(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                                  const MixedPrecisionPolicy& mp, const std::string& module_name, int rank);

}  // namespace fsdp::detail
