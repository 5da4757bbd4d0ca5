// One fully_shard group: its parameters (FSDPParam, see [Note: FSDP tensors] in fsdp_param.h), whether
// they are sharded, and the collectives that move them (fsdp_collectives.h).
// Mirrors torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/c10d/collectives.h"
#include "fsdp/tensor/device_mesh.h"
#include "fsdp/tensor/dtensor.h"
#include "fsdp/fsdp/fully_shard.h"  // ShardPlacementFn, AllGatherExtensionFn
#include "fsdp/fsdp/policies.h"
#include "fsdp/fsdp_collectives.h"
#include "fsdp/fsdp_param.h"
#include "fsdp/fsdp_streams.h"

namespace fsdp::detail {

/// Where a group's parameters are.
enum class ShardedState {
  SHARDED,               // data = local shards; the unsharded storage is freed
  SHARDED_POST_FORWARD,  // data = local shards; a 1/k slice kept for the backward all-gather over k ranks
  UNSHARDED,             // data = full parameters in param_dtype
  // set_unshard_in_backward(false), in backward: data = the unsharded tensors without storage (their full shape,
  // so that autograd accumulates full-shape gradients); a read during the backward gathers (UNSHARDED).
  UNSHARDED_WITHOUT_DATA,
};

struct GroupOptions {
  DeviceMeshPtr mesh;            // 1-D (shard) or 2-D (replicate, shard)
  MixedPrecisionPolicy mp;
  bool offload = false;
  bool pin_memory = false;
  AllGatherExtensionFn extension_fn;  // FullyShardOptions::all_gather_extension_fn
  ShardPlacementFn placement_fn;      // FullyShardOptions::shard_placement_fn
};

class FSDPParamGroup {
 public:
  /// Shards `params` (name, tensor) in place: after this, every parameter's data is its local shard.
  FSDPParamGroup(std::vector<std::pair<std::string, torch::Tensor>> params, GroupOptions options,
                 const std::string& module_name);

  std::vector<FSDPParam>& params() { return params_; }
  const std::vector<FSDPParam>& params() const { return params_; }
  ShardedState sharded_state() const { return state_; }
  ProcessGroup& shard_group() const { return *shard_pg_; }
  const ProcessGroupPtr& shard_group_ptr() const { return shard_pg_; }
  const DeviceMeshPtr& mesh() const { return opts_.mesh; }
  int shard_size() const { return shard_pg_->size(); }
  int shard_rank() const { return shard_pg_->rank(); }
  torch::ScalarType reduce_dtype() const { return reduce_dtype_; }

  /// Issues the all-gather (SHARDED: over the shard group; SHARDED_POST_FORWARD: over the post-forward
  /// group). Idempotent: does nothing when unsharded or an all-gather is already in flight.
  void unshard(bool async_op);
  /// Waits for an in-flight all-gather and copies it out into the unsharded parameters.
  void wait_for_unshard();
  bool unshard_in_flight() const { return pending_ag_.has_value(); }
  /// Frees the unsharded data; the parameters' data become their shards again.
  void reshard();
  /// The parameters' data become their shards again but the unsharded data is kept: the next unshard
  /// reuses it without an all-gather when no rank's shards changed since ([Note: kept unsharded data]).
  /// Reshards instead for parameters with an all-gather extension. An all-gather in flight is waited.
  void reshard_keep_unsharded();
  /// Whether reshard_keep_unsharded() kept unsharded data that the next unshard may reuse (for tests).
  bool keeps_unsharded() const { return unsharded_kept_; }
  /// Pre-backward of a group with unshard_in_backward == false: UNSHARDED_WITHOUT_DATA (no collective).
  void expose_unsharded_shape();
  /// Keeps a 1/k slice of the unsharded parameters and frees the rest (reshard_after_forward = k).
  void reshard_post_forward(const ProcessGroupPtr& post_forward_group);

  /// Post-backward: takes the unsharded gradients; with `sync` issues their reduce-scatter
  /// (finished by finish_reduce), else accumulates them (in the reduce dtype) for a later step.
  /// Every trainable parameter is reduced (zeros where this rank has no gradient, with a presence
  /// flag per parameter), so the reduce-scatter's size is the same on every rank whatever data each saw.
  /// Reshards when `reshard` (the data must be sharded before a reduce-scatter result is assigned).
  /// A reduce-scatter still in flight from an earlier backward is finished first (with divide_factor).
  void post_backward(bool sync, bool reshard, double divide_factor);
  /// Waits for the reduce-scatter, divides by `divide_factor`, all-reduces over the replicate
  /// group (HSDP), and accumulates into (or sets) the sharded gradients.
  void finish_reduce(double divide_factor);
  bool reduce_in_flight() const { return pending_rs_.has_value(); }
  /// HSDP: whether the reductions issued from now on all-reduce over the replicate dimension. Without,
  /// the reduce-scattered sums wait in partial_reduce_output_ and the sharded gradients are not updated;
  /// the next reduction that all-reduces adds them first. Mirrors FSDPModule.set_requires_all_reduce.
  void set_requires_all_reduce(bool v) { requires_all_reduce_ = v; }
  /// After a backward that did not finish (an exception): completes and drops an in-flight
  /// reduce-scatter and drops unsharded gradients, so they cannot leak into the next step.
  void discard_gradients_in_flight();

  /// Start of a backward: moves the sharded gradients out of .grad (into the stash), so that .grad
  /// holds only what autograd accumulates in this backward (unsharded gradients), whatever the data.
  void begin_backward();
  /// End of a backward: the sharded gradients go back to .grad when the data is sharded.
  void end_backward();
  /// A backward that threw: drops this backward's unsharded gradients, puts the sharded gradients
  /// back and reshards locally (no collective; an in-flight all-gather or reduce-scatter is left for
  /// reshard() / discard_gradients_in_flight()). Never throws.
  void abort_backward() noexcept;
  bool in_backward() const { return in_backward_; }
  /// Whether unsharded gradients of this backward wait for a post-backward.
  bool has_unsharded_grads() const;
  /// The sharded gradient of `p` (in .grad, or in the stash while a backward runs), or undefined.
  torch::Tensor sharded_grad(const FSDPParam& p) const;

  /// The sharded parameter as a DTensor (aliases the local shard), or `local` (a tensor of the local
  /// shard's shape, e.g. its gradient) with the parameter's placements and global shape.
  DTensor sharded_dtensor(const FSDPParam& p, const torch::Tensor& local = {}) const {
    return p.to_sharded_dtensor(opts_.mesh, local);
  }
  /// Sum of padded shard bytes (what this rank holds persistently for the group).
  int64_t sharded_bytes() const;
  /// reset_iter_state: drops the gradients held back across backwards (unsharded gradients accumulated
  /// without sync, HSDP sums held back by set_requires_all_reduce(false)).
  void discard_accumulated_gradients();
  /// share_comm_ctx: this group's streams, limiter and buffer pool become `comm`'s. Throws c10::Error
  /// unless can_change_comm_context().
  void set_comm_context(CommContextPtr comm);
  /// Before the first unshard only: the unsharded tensors' storage comes from the context's pool.
  bool can_change_comm_context() const;
  const CommContextPtr& comm_context() const { return comm_; }
  /// set_separate_reduce_scatter_group: the group the reduce-scatters run on (null: the shard group).
  void set_reduce_scatter_group(ProcessGroupPtr pg) { reduce_scatter_pg_ = std::move(pg); }

  // FSDPModuleAPI's communication settings (see fully_shard.h).
  std::shared_ptr<AllGather> custom_all_gather;          // set_custom_all_gather
  std::shared_ptr<ReduceScatter> custom_reduce_scatter;  // set_custom_reduce_scatter
  bool allocate_from_process_group = false;              // set_allocate_memory_from_process_group_for_comm
  std::function<void(const torch::Tensor&)> all_reduce_hook;  // set_all_reduce_hook
  std::optional<c10::Stream> all_reduce_hook_stream;          // its stream (CUDA; null: the reduce-scatter's)
  bool unshard_in_backward = true;                       // set_unshard_in_backward

 private:
  /// HSDP: every replica takes the shards of replicate rank 0 (one broadcast per dtype).
  void broadcast_over_replicate();
  void to_unsharded_data();
  void to_sharded_data();
  /// Throws if a parameter's data is no longer this group's shard, or its unsharded tensor when unsharded
  /// (replaced after fully_shard, e.g. by module->to(dtype)): FSDP gathers from its own shards, so the
  /// change would be silently undone.
  void check_params_hold_fsdp_data() const;
  /// Takes over shards converted by module->to(dtype / device) since the last unshard ([Note: module->to()
  /// after fully_shard], fsdp_param_group.cpp). Throws c10::Error for a partial or impossible conversion.
  void adopt_converted_shards();
  void alloc_unsharded();
  void free_unsharded();
  /// [Note: kept unsharded data]: whether every rank of the shard group still finds its shard in the kept
  /// unsharded data (one all-reduce of a flag over the shard group).
  bool kept_unsharded_data_is_current();
  /// Runs all_reduce_hook on `reduced` (on its stream when one was given).
  void run_all_reduce_hook(const torch::Tensor& reduced);

  std::vector<FSDPParam> params_;
  GroupOptions opts_;
  std::string module_name_;  // type of the fully_shard module(s), for messages
  ProcessGroupPtr shard_pg_;
  ProcessGroupPtr replicate_pg_;  // HSDP only
  ProcessGroupPtr reduce_scatter_pg_;  // set_separate_reduce_scatter_group (null: shard_pg_)
  /// The all-gather / reduce-scatter to use: the custom one, the process-group allocating one, or null
  /// (the default).
  AllGather* all_gather_comm();
  ReduceScatter* reduce_scatter_comm();
  std::shared_ptr<AllGather> pg_alloc_all_gather_;
  std::shared_ptr<ReduceScatter> pg_alloc_reduce_scatter_;
  torch::ScalarType reduce_dtype_;
  ShardedState state_ = ShardedState::SHARDED;
  ProcessGroupPtr post_forward_pg_;  // set while SHARDED_POST_FORWARD
  bool in_backward_ = false;         // between begin_backward() and end_backward()/abort_backward()
  bool unsharded_kept_ = false;      // SHARDED, with the unsharded data kept (reshard_keep_unsharded)
  CommContextPtr comm_;              // CUDA streams shared by the groups of the mesh (no-op on CPU)

  std::optional<AllGatherResult> pending_ag_;      // issued by unshard(), waited by wait_for_unshard()
  std::optional<ReduceScatterResult> pending_rs_;  // issued by post_backward(), waited by finish_reduce()
  bool requires_all_reduce_ = true;
  bool pending_all_reduce_ = true;     // requires_all_reduce_ when pending_rs_ was issued
  torch::Tensor partial_reduce_output_;  // HSDP: reduce-scattered sums not yet all-reduced (flat, as rs.output)
};

}  // namespace fsdp::detail
