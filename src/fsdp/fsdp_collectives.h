// The collectives of an FSDP group and their packing: all-gather copy-in / copy-out, reduce-scatter
// copy-in and the unpacking of its output into sharded gradients.
// Mirrors torch.distributed.fsdp._fully_shard._fsdp_collectives (foreach_all_gather,
// foreach_all_gather_copy_out, foreach_reduce, foreach_reduce_scatter_copy_in). Not to be confused with
// src/c10d/collectives.cpp, the c10d wrappers these call.
//
// Every rank issues these in the same order: see [Note: collective order] (fsdp_state.cpp).
#pragma once

#include <functional>
#include <vector>

#include "fsdp/c10d/collectives.h"
#include "fsdp/fsdp/comm.h"
#include "fsdp/fsdp_param.h"
#include "fsdp/fsdp_streams.h"

namespace fsdp::detail {

/// An all-gather in flight (issued by FSDPParamGroup::unshard, waited by wait_for_unshard).
struct AllGatherResult {
  torch::Tensor output;  // [world * N] in param_dtype; freed after the copy-out (`placed`: the input, [N], or
                         // undefined when the transport reads the shards themselves)
  bool placed = false;   // gathered straight into the unsharded parameters: no copy-out ([Note: placed all-gather])
  Work work;
  int world;             // ranks gathered over (shard size, or k after a post-forward reshard)
  bool as_bytes = false; // the pieces have several dtypes: output is uint8 ([Note: mixed-dtype all-gather])
  /// Per parameter: the dtype and numel of each piece it sent (one: its shard in param_dtype, or its
  /// extension's inputs: see [Note: all-gather extension] in fsdp/fsdp/all_gather_extension.h).
  std::vector<std::vector<std::pair<torch::ScalarType, int64_t>>> pieces;
  std::vector<char> extended;  // per parameter: its pieces are its extension's (post_all_gather rebuilds it)
  bool post_forward = false;   // gathered from post-forward shards (flat slices: copied out as they are)
};

/// Copy-in and all-gather of a group's parameters over `pg`: each rank's padded shards (or, with
/// `post_forward`, its post-forward shards) cast to param_dtype and concatenated into its slice of one
/// flat output, gathered in place (as bytes when the parameters gather in several dtypes: see
/// [Note: mixed-dtype all-gather] in fsdp_collectives.cpp). CUDA: copy-in on the copy-in stream, the collective on the all-gather
/// stream (see fsdp_streams.h). Asynchronous: the result's work must be waited before the copy-out.
/// `custom` (may be null): the user's AllGather (allocation and collective), see FSDPModuleAPI::set_custom_all_gather.
/// `alloc_unsharded` (may be empty) allocates the parameters' unsharded tensors: given, and where the group
/// qualifies ([Note: placed all-gather]), it is called first and the all-gather writes straight into them.
AllGatherResult foreach_all_gather(const std::vector<FSDPParam>& params, bool post_forward, ProcessGroup& pg,
                                   CommContext& comm, torch::Device device, bool non_blocking, AllGather* custom,
                                   const std::function<void()>& alloc_unsharded = {});

/// Copy-out: the (completed) all-gather output viewed as [world, N] holds, per rank, every parameter's
/// piece in group order; each piece goes to its parameter's (allocated) unsharded padded tensor.
void foreach_all_gather_copy_out(const AllGatherResult& ag, std::vector<FSDPParam>& params);

/// A reduce-scatter in flight (issued by FSDPParamGroup::post_backward, waited by finish_reduce).
struct ReduceScatterResult {
  torch::Tensor input;   // unused (undefined): the Work keeps the input (or the gradients read in place) alive
  torch::Tensor output;  // [M + P] in reduce dtype: P = presence counts of the reduced parameters
  Work work;
  std::vector<size_t> param_indices;  // params reduced, in order
  int64_t data_numel = 0;             // M: the gradients; then one presence count per parameter
  std::vector<char> missing;          // per reduced parameter: this rank had no gradient
  double predivide_factor = 1.0;      // the gradients were divided by it before the sum (fp16: see foreach_reduce)
};

/// The division of a reduction by `factor` (the data-parallel size, or set_gradient_divide_factor's) split
/// into a division before the sum and one after, as PyTorch's _get_gradient_divide_factors: for reduce
/// dtypes other than fp32 and bf16 (fp16's range overflows on a sum over many ranks) the pre-factor is the
/// power of two near sqrt(factor) that PyTorch picks; otherwise all of it after. Returns {pre, post}.
std::pair<double, double> gradient_divide_factors(torch::ScalarType reduce_dtype, double factor);

/// Copy-in and reduce-scatter (SUM) over `pg` of the unsharded gradients `grads` (indexed like
/// `params`) of the parameters `param_indices` (M = the sum of their padded numels; `missing[k]`: this
/// rank has no gradient for the k-th, which then contributes zeros). Input [ws, M + P]: row r = every
/// gradient's chunk r, zero-padded, in group order, then the P presence flags. Each gradient is released
/// once copied in (before the output and the backend's buffers are allocated). CUDA: on the
/// reduce-scatter stream. Asynchronous. `custom` (may be null): the user's ReduceScatter, which allocates
/// the input and output and runs the collective (FSDPModuleAPI::set_custom_reduce_scatter).
/// `predivide_factor` != 1: the gradients are divided by it after the copy-in (the flags are not).
ReduceScatterResult foreach_reduce(const std::vector<FSDPParam>& params, std::vector<torch::Tensor> grads,
                                   std::vector<size_t> param_indices, int64_t data_numel, std::vector<char> missing,
                                   ProcessGroup& pg, CommContext& comm, torch::ScalarType reduce_dtype,
                                   torch::Device device, ReduceScatter* custom, double predivide_factor = 1.0);

/// Unpacks a completed (and divided) reduce-scatter output: hands each reduced parameter's sharded
/// gradient to `sink(param index, gradient)`, in `rs.param_indices` order, in the parameter's dtype and
/// on its shard's device. On the CPU, when the dtypes agree, each gradient aliases its (disjoint) piece of
/// the output as a plain tensor, not an autograd view (no copy; the output's pool block is reused once
/// every gradient is dropped); otherwise it is an independent copy. Parameters no rank had a gradient for are
/// skipped (the presence counts are read, a host sync, only when this rank lacked a gradient).
void foreach_reduce_scatter_copy_out(const ReduceScatterResult& rs, const std::vector<FSDPParam>& params,
                                     const std::function<void(size_t, torch::Tensor)>& sink);

}  // namespace fsdp::detail
