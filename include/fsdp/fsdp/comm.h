// Custom collectives of a fully_shard group: who allocates the all-gather and reduce-scatter buffers
// and what runs the two collectives. Mirrors torch.distributed.fsdp's Comm, AllGather and ReduceScatter
// (_fully_shard/_fsdp_api.py), installed with FSDPModuleAPI::set_custom_all_gather /
// set_custom_reduce_scatter.
#pragma once

#include <memory>

#include <torch/types.h>

#include "fsdp/c10d/collectives.h"

namespace fsdp {

/// Where a collective's buffers come from. Mirrors torch.distributed.fsdp.Comm.
class Comm {
 public:
  virtual ~Comm() = default;
  /// A buffer of `size` elements of `dtype` on `device` for one collective (contents need not be
  /// initialised: FSDP writes every element it sends). Called once per buffer per collective: the
  /// all-gather's output (its input is this rank's slice of it), and the reduce-scatter's input and
  /// output. The default allocates from the tree's CPU buffer pool or the CUDA caching allocator.
  /// Mirrors Comm.allocate(size, dtype=, device=).
  virtual torch::Tensor allocate(at::IntArrayRef size, torch::ScalarType dtype, torch::Device device) = 0;
};

/// The all-gather of a group's shards. Mirrors torch.distributed.fsdp.AllGather.
/// Example: `struct Counting : fsdp::AllGather { ... }; fsdp::fsdp_api(block).set_custom_all_gather(std::make_shared<Counting>());`
class AllGather : public Comm {
 public:
  /// Gathers every rank's `input` (1-D, `output.numel() / group.size()` elements, this rank's slice of
  /// `output`: the all-gather is in place) into `output` (1-D, rank-major), as all_gather_into_tensor.
  /// With `async_op` the returned Work may still be running; FSDP waits it before the copy-out. An empty
  /// Work means done. Mirrors AllGather.__call__(output_tensor, input_tensor, group, async_op).
  virtual Work operator()(const torch::Tensor& output, const torch::Tensor& input, ProcessGroup& group,
                          bool async_op) = 0;
};

/// The reduce-scatter of a group's gradients. Mirrors torch.distributed.fsdp.ReduceScatter.
class ReduceScatter : public Comm {
 public:
  /// Reduces `input` (1-D, group.size() * output.numel() elements, rank-major chunks) over the group with
  /// `op` and leaves chunk `group.rank()` of the result in `output` (1-D), as reduce_scatter_tensor. FSDP
  /// passes ReduceOp::SUM and divides afterwards. The last elements of each chunk are FSDP's presence
  /// flags (one per parameter; see foreach_reduce): reduce them like the rest. Mirrors
  /// ReduceScatter.__call__(output_tensor, input_tensor, group, op, async_op).
  virtual Work operator()(const torch::Tensor& output, const torch::Tensor& input, ProcessGroup& group, ReduceOp op,
                          bool async_op) = 0;
};

}  // namespace fsdp
