// One fully_shard group: its parameters, their shards, and the collectives that move between them.
//
// [Note: FSDP tensors]
// - original parameter: the tensor the module registered. We never replace it (identity, grad, hooks
//   and version counter stay); only its data is swapped with set_data():
//     SHARDED   -> data = sharded data
//     UNSHARDED -> data = unsharded data
// - padded shard: this rank's torch.chunk of dim 0, zero-padded to ceil(d0 / ws) rows; shape
//   [padded_rows, *rest], original dtype; lives as long as the group (the optimizer updates it through
//   the sharded data view).
// - sharded data: padded_shard.narrow(0, 0, local_rows) — what the optimizer and state dicts see
//   (possibly 0 rows: an empty shard).
// - all-gather input: the padded shards of the group, cast to param_dtype, copied into one flat
//   buffer of N elements (N = sum of padded shard numels) that is this rank's slice of the output.
// - all-gather output: [ws * N], rank-major; freed once copied out.
// - unsharded padded: [ws * padded_rows, *rest] in param_dtype, one per parameter, allocated once; its
//   storage is resized to 0 bytes when resharded and back before the next copy-out, so the views
//   autograd saved in forward see the re-gathered data in backward and no memory is held in between.
// - unsharded data: unsharded_padded.narrow(0, 0, d0) — the full parameter the module computes with.
// - post-forward shard (reshard_after_forward = k): rows [j * ws/k * padded_rows, ...) of the
//   unsharded padded tensor kept after forward by position j of a group of k consecutive ranks.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/collectives.h"
#include "fsdp/device_mesh.h"
#include "fsdp/dtensor.h"
#include "fsdp/policies.h"
#include "fsdp_streams.h"

namespace fsdp::detail {

/// Where a group's parameters are.
enum class ShardedState {
  SHARDED,               // data = local shards; the unsharded storage is freed
  SHARDED_POST_FORWARD,  // data = local shards; a 1/k slice kept for the backward all-gather over k ranks
  UNSHARDED,             // data = full parameters in param_dtype
};

struct FSDPParam {
  std::string fqn;                  // for messages: path from the root after lazy init, else local_fqn
  std::string local_fqn;            // relative to the fully_shard module ("i." + name for several modules)
  size_t module_index = 0;          // which module of the fully_shard call holds it
  std::string name_in_module;       // relative to that module
  torch::Tensor param;              // the original parameter (see [Note: FSDP tensors])
  std::vector<int64_t> orig_size;   // global shape
  torch::ScalarType orig_dtype;
  torch::ScalarType param_dtype;    // dtype of the all-gather and the unsharded data
  int64_t row_numel = 1;            // elements per dim-0 row
  int64_t padded_rows = 0;          // ceil(d0 / ws)
  int64_t local_rows = 0;           // rows this rank holds (0 for an empty shard)
  int64_t local_offset = 0;         // first global row this rank holds
  torch::Tensor padded_shard;       // [padded_rows, *rest], orig dtype
  torch::Tensor sharded_data;       // padded_shard.narrow(0, 0, local_rows)
  torch::Tensor unsharded_padded;   // [ws * padded_rows, *rest], param dtype; storage freed when sharded
  torch::Tensor unsharded_data;     // unsharded_padded.narrow(0, 0, d0)
  torch::Tensor post_forward_shard; // [(ws/k) * padded_rows, *rest] (SHARDED_POST_FORWARD only)
  torch::Tensor stashed_grad;       // the sharded grad, moved aside while the data is unsharded or a
                                    // backward runs (autograd accumulates unsharded grads into .grad)
  torch::Tensor pending_grad;       // unsharded grad taken out of .grad when the data was resharded
                                    // during a backward before the group's post-backward ran
  torch::Tensor unsharded_accum_grad;  // accumulated unsharded grad (reduce dtype) while sync is off

  int64_t padded_numel() const { return padded_rows * row_numel; }
  bool requires_grad() const { return param.requires_grad(); }
};

struct GroupOptions {
  DeviceMeshPtr mesh;            // 1-D (shard) or 2-D (replicate, shard)
  MixedPrecisionPolicy mp;
  bool offload = false;
  bool pin_memory = false;
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
  /// The sharded gradient of `p` (in .grad, or in the stash while the data is unsharded), or undefined.
  torch::Tensor sharded_grad(const FSDPParam& p) const;

  /// The sharded parameter as a DTensor (aliases the local shard), or `local` (a tensor of the local
  /// shard's shape, e.g. its gradient) with the parameter's placements and global shape.
  DTensor sharded_dtensor(const FSDPParam& p, const torch::Tensor& local = {}) const;
  /// Sum of padded shard bytes (what this rank holds persistently for the group).
  int64_t sharded_bytes() const;

 private:
  /// HSDP: every replica takes the shards of replicate rank 0 (one broadcast per dtype).
  void broadcast_over_replicate();
  void to_unsharded_data();
  void to_sharded_data();
  /// Throws if a parameter's data is no longer this group's shard, or its unsharded tensor when unsharded
  /// (replaced after fully_shard, e.g. by module->to(dtype)): FSDP gathers from its own shards, so the
  /// change would be silently undone.
  void check_params_hold_fsdp_data() const;
  void alloc_unsharded();
  void free_unsharded();

  std::vector<FSDPParam> params_;
  GroupOptions opts_;
  std::string module_name_;  // type of the fully_shard module(s), for messages
  ProcessGroupPtr shard_pg_;
  ProcessGroupPtr replicate_pg_;  // HSDP only
  torch::ScalarType reduce_dtype_;
  ShardedState state_ = ShardedState::SHARDED;
  ProcessGroupPtr post_forward_pg_;  // set while SHARDED_POST_FORWARD
  bool in_backward_ = false;         // between begin_backward() and end_backward()/abort_backward()
  CommContextPtr comm_;              // CUDA streams shared by the groups of the mesh (no-op on CPU)

  struct PendingAllGather {
    torch::Tensor output;  // [world * N] in param_dtype; freed after the copy-out
    Work work;
    int world;             // ranks gathered over (shard size, or k after a post-forward reshard)
  };
  std::optional<PendingAllGather> pending_ag_;  // issued by unshard(), waited by wait_for_unshard()

  struct PendingReduceScatter {
    torch::Tensor input;   // unused (undefined): the backend's work keeps the input alive (see post_backward)
    torch::Tensor output;  // [M + P] in reduce dtype: P = presence counts of the reduced parameters
    Work work;
    std::vector<size_t> param_indices;  // params reduced, in order
    int64_t data_numel = 0;             // M: the gradients; then one presence count per parameter
    std::vector<char> missing;          // per reduced parameter: this rank had no gradient
  };
  std::optional<PendingReduceScatter> pending_rs_;  // issued by post_backward(), waited by finish_reduce()
};

}  // namespace fsdp::detail
