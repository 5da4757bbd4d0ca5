// Policies of fully_shard: mixed precision and CPU offload.
//
// Mirrors torch.distributed.fsdp.{MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy}.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>
#include <torch/arg.h>

namespace fsdp {

/// Dtypes of the all-gather, compute and reduction of a fully_shard group.
/// Shards are cast to `param_dtype` before the all-gather (half the bytes on the wire for bf16),
/// forward and backward compute in it, the sharded parameters and the optimizer state stay in their
/// original dtype (fp32 master weights); gradients are reduced in `reduce_dtype` and stored in the
/// parameter's dtype. Buffers are never cast. Mirrors torch.distributed.fsdp.MixedPrecisionPolicy.
/// Example: `fsdp::MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat32)`
struct MixedPrecisionPolicy {
  /// Dtype of the unsharded parameters (all-gather and compute). (Default: none = the original dtype)
  TORCH_ARG(std::optional<torch::ScalarType>, param_dtype) = std::nullopt;
  /// Dtype of the gradient reduce-scatter. (Default: none = param_dtype, or the original dtype)
  TORCH_ARG(std::optional<torch::ScalarType>, reduce_dtype) = std::nullopt;
  /// Dtype the module's floating outputs are cast to. (Default: none = not cast)
  TORCH_ARG(std::optional<torch::ScalarType>, output_dtype) = std::nullopt;
  /// Cast floating-point forward inputs to `param_dtype`. (Default: true)
  TORCH_ARG(bool, cast_forward_inputs) = true;
};

/// Keeps padded shards, their gradients and the optimizer state on the CPU; shards are copied to the
/// compute device at unshard and gradients copied back after the reduce-scatter, so
/// `optimizer.step()` runs on the CPU. Mirrors torch.distributed.fsdp.CPUOffloadPolicy.
/// Example: `fsdp::FullyShardOptions().offload_policy(fsdp::CPUOffloadPolicy().pin_memory(false))`
struct CPUOffloadPolicy {
  /// Pin the CPU shards and gradients so that host-device copies can be asynchronous. (Default: true)
  TORCH_ARG(bool, pin_memory) = true;
};

/// Which dimensions of a full mesh (e.g. (dp_replicate, dp_shard, tp), the mesh tensor parallelism also uses)
/// are data parallel, so that fully_shard / replicate can take that mesh as is: FSDP shards over the `shard`
/// dimensions and, with `replicate`, replicates over those (HSDP); replicate() uses `replicate` only. Several
/// names in one field are flattened into one dimension; all names must follow the mesh's order. At least one
/// field must be set. Mirrors torch.distributed.fsdp.DataParallelMeshDims (a str or a tuple of str per field).
/// Example: `fsdp::DataParallelMeshDims().shard({"dp_shard"}).replicate({"dp_replicate"})`
struct DataParallelMeshDims {
  /// Dimensions the parameters are sharded over (flattened when several). (Default: none)
  TORCH_ARG(std::vector<std::string>, shard) = {};
  /// Dimensions the parameters are replicated over (flattened when several). (Default: none)
  TORCH_ARG(std::vector<std::string>, replicate) = {};
};

}  // namespace fsdp
