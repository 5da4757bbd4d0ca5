// replicate: data parallelism without sharding (DDP semantics) on FSDP2's machinery.
//
//   auto mesh = fsdp::init_device_mesh(torch::kCPU, {world}, {"replicate"});
//   for (auto& b : *model->blocks) fsdp::replicate(b, fsdp::ReplicateOptions().mesh(mesh));  // buckets
//   fsdp::replicate(model, fsdp::ReplicateOptions().mesh(mesh));                               // root last
//   torch::optim::AdamW opt(model->parameters(), ...);   // sees full parameters, as without libfsdp
//
// Every rank keeps the whole parameters. Each replicate call forms one group (its parameters minus those
// of already replicated or sharded submodules), the unit in which gradients are all-reduced: as soon as the
// group's backward is done, one all-reduce of its gradients (SUM, then divided by the number of ranks:
// averaged, as DDP does), overlapping the rest of the backward. So the groups play the role of DDP's
// buckets (DDP's bucket_cap_mb): call replicate on the blocks for several buckets, on the root alone for one.
// At replicate, rank 0's parameters are broadcast to every rank (as DDP's constructor does), so ranks that
// built their models from differently seeded generators start equal.
//
// Everything of fully_shard applies (the two ways FSDP follows a forward, holders and unchanged models;
// mp_policy, e.g. reduce_dtype(torch::kBFloat16) for the bf16 gradient compression of DDP's comm hook;
// CPU offload; FSDPModuleAPI: set_requires_gradient_sync(false) is DDP's no_sync(), set_gradient_divide_factor,
// unshard/reshard are no-ops in effect). Parameters that a rank's data does not reach are reduced as zeros
// from that rank (DDP's find_unused_parameters=True behaviour, at no extra cost). Buffers are not broadcast
// each forward (as PyTorch's composable replicate; DDP's broadcast_buffers=True is not offered: keep buffers
// in sync yourself, or use eval-mode statistics).
//
// Mixing: replicate the root and fully_shard the blocks (or the reverse) in one model, as FSDP2's
// replicate_with_fsdp allows: each group keeps its own mesh. A module already managed by fully_shard cannot
// be replicated, and the reverse.
//
// Internally a replicate group is an HSDP group on a (world, 1) mesh ("replicate", "shard") derived once per
// 1-D mesh: the "shard" dimension has one rank, so its all-gather and reduce-scatter move no bytes (and are
// skipped), and the gradients are all-reduced over "replicate". Its DTensors (sharded_parameters(),
// sharded_grad()) are on that 2-D mesh with placements (Replicate(), Shard(0)): the full tensor is the local
// one; PyTorch's are (Replicate(),) on the 1-D mesh.
//
// Mirrors torch.distributed._composable.replicate_with_fsdp.replicate (PyTorch 2.13).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp/fsdp/fully_shard.h"

namespace fsdp {

/// Options of replicate. Mirrors replicate_with_fsdp.replicate's keyword arguments.
/// Example: `fsdp::ReplicateOptions().mesh(mesh).mp_policy(fsdp::MixedPrecisionPolicy().param_dtype(torch::kBFloat16))`
struct ReplicateOptions {
  /// A 1-D mesh of the data-parallel ranks. (Default: null = a 1-D mesh over the default process group)
  TORCH_ARG(DeviceMeshPtr, mesh) = nullptr;
  /// Compute and reduction dtypes, as for fully_shard. (Default: the parameters' dtype)
  TORCH_ARG(MixedPrecisionPolicy, mp_policy) = {};
  /// Parameters and gradients kept on the CPU between steps. (Default: none)
  TORCH_ARG(std::optional<CPUOffloadPolicy>, offload_policy) = std::nullopt;
  /// Parameters left alone (not broadcast, not reduced), as for fully_shard. (Default: none)
  TORCH_ARG(std::vector<torch::Tensor>, ignored_params) = {};
  /// With a full mesh in `mesh`: the dimensions to replicate over (`replicate`, flattened when several;
  /// `shard` must be empty). Mirrors replicate's dp_mesh_dims. (Default: none: `mesh` is 1-D)
  TORCH_ARG(std::optional<DataParallelMeshDims>, dp_mesh_dims) = std::nullopt;
};

/// Replicates `module` over `options.mesh()`: broadcasts rank 0's parameters to every rank, then averages
/// the gradients of its group over the ranks once per backward (see the top of this file). Returns the
/// group's FSDPModuleAPI (set_requires_gradient_sync is DDP's no_sync). A module with an fsdp::FSDPModule
/// holder is followed through the holder, any other module by interception, exactly as for fully_shard.
/// Throws c10::Error, before anything changes, for a mesh that is not 1-D ("replicate expects a 1-D
/// DeviceMesh", naming it), a module already managed by fully_shard or replicate (naming the module), and for
/// every refusal fully_shard makes about the parameters (sparse gradients, mixed trainable dtypes, ...).
/// Collective: every rank of the mesh calls it, in the same order.
/// Example: `fsdp::replicate(model, fsdp::ReplicateOptions().mesh(mesh));`
FSDPModuleAPI replicate(const std::shared_ptr<torch::nn::Module>& module, const ReplicateOptions& options = {});

/// Replicates several modules as one group (one all-reduce per backward for all of them), e.g. the
/// embedding and the output head of a model whose blocks are sharded. Refusals as above, for each
/// module. Mirrors replicate([m1, m2]).
/// Example: `fsdp::replicate({model->wte.ptr(), model->head.ptr()}, fsdp::ReplicateOptions().mesh(mesh));`
FSDPModuleAPI replicate(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                        const ReplicateOptions& options = {});

/// Replicates a module held by a ModuleHolder (e.g. fsdp::FSDPModule<Net> or torch::nn::Linear).
/// Example: `fsdp::replicate(model, fsdp::ReplicateOptions().mesh(mesh));`
template <typename T>
FSDPModuleAPI replicate(const torch::nn::ModuleHolder<T>& holder, const ReplicateOptions& options = {}) {
  return replicate(std::static_pointer_cast<torch::nn::Module>(holder.ptr()), options);
}

/// Whether `module` was passed to fsdp::replicate (false for fully_shard'ed and plain modules).
/// Example: `if (fsdp::is_replicated(*model)) ...`
bool is_replicated(const torch::nn::Module& module);

}  // namespace fsdp
