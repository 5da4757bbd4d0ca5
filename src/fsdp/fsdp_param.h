// FSDPParam: one parameter managed by fully_shard, and the tensors FSDP keeps for it.
// Mirrors torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam.
//
// [Note: FSDP tensors]
// - original parameter: the tensor the module registered. We never replace it (identity, grad, hooks
//   and version counter stay); only its data is swapped with set_data():
//     SHARDED   -> data = sharded data
//     UNSHARDED -> data = unsharded data
// (Below, dim 0; a parameter sharded on another dim by shard_placement_fn: [Note: Shard(d)], fsdp_param.cpp.)
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
//   autograd saved in forward see the re-gathered data in backward and no memory is held in between
//   (on the CPU the freed bytes go back to the tree's buffer pool: see fsdp_buffer_pool.h).
// - unsharded data: unsharded_padded.narrow(0, 0, d0) — the full parameter the module computes with.
// - post-forward shard (reshard_after_forward = k): the flat slice j of k of the unsharded padded tensor
//   (rows [j * ws/k * padded_rows, ...) for dim 0) kept after forward by position j of a group of k
//   consecutive ranks.
//   See [Note: reshard_after_forward=k].
#pragma once

#include "utils/implicit_checkpoint.h"

#include <string>
#include <vector>

#include "fsdp/fsdp/all_gather_extension.h"
#include "fsdp/tensor/device_mesh.h"
#include "fsdp/tensor/dtensor.h"
#include "fsdp/fsdp_streams.h"

namespace fsdp::detail {

/// Gradient accumulation's rule, used wherever gradients move between .grad, the stash and the pending
/// slot: `into += from`, or `into` takes `from` when it holds nothing yet. An undefined `from` is a no-op.
void accumulate(torch::Tensor& into, torch::Tensor from);

/// One sharded parameter (see [Note: FSDP tensors]). Its group (FSDPParamGroup) decides when it moves
/// between sharded and unsharded; this class does the per-parameter part of each move.
class FSDPParam {
 public:
  /// Shards `tensor` in place (FSDP2's _init_sharded_param): copies this rank's torch.chunk of dim 0
  /// (rank `shard_rank` of `shard_size`) into a zero-padded shard on `shard_device` (pinned when
  /// `pin_memory` and CUDA is available) and sets the parameter's data to it. `name` is the local FQN.
  /// `shard_dim` (shard_placement_fn): the dim chunked over the ranks; a dim other than 0 needs its size
  /// divisible by `shard_size` (checked by the group, as PyTorch's even-sharding rule).
  FSDPParam(const std::string& name, const torch::Tensor& tensor, torch::ScalarType param_dtype, int shard_size,
            int shard_rank, torch::Device shard_device, bool pin_memory, int64_t shard_dim = 0);

  std::string fqn;                  // for messages: path from the root after lazy init, else local_fqn
  std::string local_fqn;            // relative to the fully_shard module ("i." + name for several modules)
  size_t module_index = 0;          // which module of the fully_shard call holds it
  std::string name_in_module;       // relative to that module
  torch::Tensor param;              // the original parameter (see [Note: FSDP tensors])
  std::vector<int64_t> orig_size;   // global shape
  torch::ScalarType orig_dtype;
  torch::ScalarType param_dtype;    // dtype of the all-gather and the unsharded data
  // The sharded dim: 0, or d from shard_placement_fn ([Note: Shard(d)], fsdp_param.cpp). "Rows" below are
  // indices along it.
  int64_t shard_dim = 0;
  int64_t row_numel = 1;            // elements per row (per index of shard_dim)
  int64_t padded_rows = 0;          // ceil(size(shard_dim) / ws)
  int64_t local_rows = 0;           // rows this rank holds (0 for an empty shard)
  int64_t local_offset = 0;         // first global row this rank holds
  torch::Tensor padded_shard;       // the global shape with padded_rows on shard_dim, orig dtype, contiguous
  torch::Tensor sharded_data;       // padded_shard.narrow(shard_dim, 0, local_rows)
  torch::Tensor unsharded_padded;   // ws * padded_rows on shard_dim, param dtype; storage freed when sharded
  torch::Tensor unsharded_data;     // unsharded_padded.narrow(shard_dim, 0, size(shard_dim))
  torch::Tensor post_forward_shard; // 1/k of unsharded_padded, flat (SHARDED_POST_FORWARD only)
  torch::Tensor stashed_grad;       // the sharded grad, moved aside while a backward runs (autograd
                                    // accumulates unsharded grads into .grad)
  torch::Tensor pending_grad;       // unsharded grad taken out of .grad when the data was resharded
                                    // during a backward before the group's post-backward ran
  torch::Tensor unsharded_accum_grad;  // accumulated unsharded grad (reduce dtype) while sync is off
  // The parameter's data are these aliases of sharded_data / unsharded_data, which carry the
  // interception key: the shard always (every use of a sharded parameter is seen: [Note: reads of a
  // sharded parameter], fsdp_interception.cpp), the unsharded data only for implicit groups (see
  // [Note: implicit groups], fsdp_implicit.cpp) and TP parameters, so that a holder's forward pays nothing.
  // [Note: all-gather extension] (fsdp/fsdp/all_gather_extension.h): what this parameter sends in the
  // all-gather from the shards instead of its shard in param_dtype (null: the shard).
  std::shared_ptr<AllGatherExtension> all_gather_extension;
  std::vector<std::pair<torch::ScalarType, int64_t>> extension_layout;  // its inputs' dtypes and numels
  /// The layout of `extension`'s inputs for a padded shard of `tensor` over `shard_size` ranks (one call of
  /// pre_all_gather on a zero shard, before anything is sharded). Throws c10::Error naming the parameter
  /// if it returns no tensor or an undefined one.
  static std::vector<std::pair<torch::ScalarType, int64_t>> probe_extension(
      AllGatherExtension& extension, const torch::Tensor& tensor, int shard_size, torch::ScalarType param_dtype,
      const std::string& name, const std::string& module_name);
  /// The extension's inputs for this all-gather. Throws c10::Error naming the parameter if their number,
  /// numels or dtypes differ from the layout recorded at fully_shard (every rank's must agree).
  std::vector<torch::Tensor> extension_inputs() const;
  bool intercept = false;
  torch::Tensor sharded_intercepted;
  torch::Tensor unsharded_intercepted;
  // A tensor-parallel parameter (parallelize_module ran before fully_shard): orig_size is its TP-local
  // shape. Its data always carries the interception key, sharded or not, holder or implicit, so that
  // tensor parallelism's op side sees the module's linear/embedding (tp_ops.cpp). See [Note: FSDP over TP].
  DeviceMeshPtr tp_mesh;             // null unless TP
  Placement tp_placement;            // on tp_mesh
  std::vector<int64_t> tp_global_shape;
  /// Whether the unsharded data carries the interception key too (also for a parameter of a checkpointed unchanged
  /// module: its ops open the module's checkpoint regions, [Note: implicit checkpoint regions]).
  bool keyed() const { return intercept || tp_mesh != nullptr || is_implicitly_checkpointed(param); }

  int64_t padded_numel() const { return padded_rows * row_numel; }
  bool requires_grad() const { return param.requires_grad(); }

  /// Implicit group: the unsharded data will carry the interception key too (it must be sharded).
  void enable_interception();
  /// Back to the holder path: the unsharded data will not carry the key (it must be sharded).
  void disable_interception();
  /// Allocates the unsharded padded tensor ([shard_size * padded_rows, *rest], param dtype, on `device`)
  /// the first time, afterwards re-allocates its freed storage in place (see [Note: FSDP tensors]). On
  /// the CPU the storage comes from `comm`'s buffer pool (its allocator is the pool, so every
  /// re-allocation reuses a pool block: no page faults per step).
  void alloc_unsharded_param(int shard_size, torch::Device device, CommContext& comm);
  /// Frees the unsharded padded tensor's storage (0 bytes); the tensor object and its views stay.
  void free_unsharded_param();
  /// The parameter's data becomes the unsharded data. .grad stays (outside a backward: the sharded
  /// gradient, so that zero_grad() reaches it; FSDPParamGroup::begin_backward stashes it).
  void to_unsharded(bool in_backward);
  /// The parameter's data becomes the sharded data. In a backward the unsharded gradient of this
  /// backward moves to the pending slot; outside one a leftover stash goes back to .grad. Throws c10::Error
  /// (naming the parameter and `rank`) for an unsharded gradient outside a backward.
  void to_sharded(bool in_backward, int rank);
  /// Keeps position `j` of `k` of the unsharded padded rows as the post-forward shard (a copy).
  void to_sharded_post_forward(int k, int j);
  /// Throws c10::Error unless the parameter's data is still FSDP's (its shard, or with `unsharded` its
  /// unsharded tensor): a replacement after fully_shard would be silently undone by the next all-gather.
  void check_holds_fsdp_data(bool unsharded, const std::string& module_name, int rank) const;
  /// [Note: module->to() after fully_shard] (fsdp_param_group.cpp): whether the parameter's data is its
  /// shard converted to another dtype or device (same shape, not our storage), which adopt_converted_shard
  /// takes as the new shard.
  bool holds_converted_shard() const;
  /// Makes the converted data the new padded shard (copied into a padded tensor of its dtype and device;
  /// the sharded gradient converted alike), drops the unsharded tensor (re-made at the next unshard in the
  /// new param_dtype) and sets orig_dtype, and param_dtype to `param_dtype`.
  void adopt_converted_shard(torch::ScalarType param_dtype);
  /// The sharded parameter as a DTensor over `mesh` (aliases the local shard), or `local` (a tensor of
  /// the local shard's shape, e.g. its gradient) with the parameter's placements and global shape. When
  /// the model has TP parameters on `mesh`'s root, over the root's dims instead (see [Note: FSDP over TP]).
  DTensor to_sharded_dtensor(const DeviceMeshPtr& mesh, const torch::Tensor& local = {}) const;

 private:
  mutable DeviceMeshPtr dtensor_mesh_;  // computed on first use
  mutable std::vector<Placement> dtensor_placements_;
  mutable std::vector<int64_t> dtensor_shape_;
};

}  // namespace fsdp::detail
