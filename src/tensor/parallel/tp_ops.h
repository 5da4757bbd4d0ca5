// Tensor parallelism's op side (tp_ops.cpp): the registry of TP parameters and the handling of the ops
// that run a parallelised module (aten::linear, aten::embedding) inside the dispatcher fallback of
// the interception (utils/intercept.h: TP's layer, or fsdp's above it). The plan side (matching,
// validation, sharding) is tensor_parallel.cpp.
#pragma once

#include <atomic>
#include <optional>

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/types.h>

#include "fsdp/tensor/parallel/tensor_parallel.h"

namespace fsdp::tp::detail {

/// What a parallelised parameter is.
struct TPParam {
  std::string fqn;            ///< module FQN in the model parallelize_module was given ("" = that module)
  bool is_embedding = false;  ///< else Linear
  bool is_weight = true;      ///< else the (colwise) bias, or a LayerNorm's bias
  bool is_norm = false;       ///< a LayerNorm's weight or bias under SequenceParallel (Replicate())
  /// Replicated, but used on sequence-sharded activations (a SequenceParallel norm's weight and bias, the
  /// bias of a RowwiseParallel with a Shard(d) output): each rank's gradient is a partial sum over its
  /// positions, all-reduced over the TP group (see wrap_partial_grad_params).
  bool partial_grad = false;
  ParallelStyle style;
  DeviceMeshPtr mesh;                 ///< 1-D TP mesh (keeps the group alive for the autograd functions)
  Placement placement;                ///< of this parameter on the mesh
  std::vector<int64_t> global_shape;  ///< before sharding
  /// A RowwiseParallel Embedding's weight (Shard(0): vocabulary rows) that a tied head also uses through
  /// F::linear as a ColwiseParallel weight (Shard(0): the same rows), e.g. GPT-2's wte and lm_head: the style of
  /// that second use and its module's FQN. See [Note: tied TP styles] in tensor_parallel.cpp.
  std::optional<ParallelStyle> tied_linear_style;
  std::string tied_linear_fqn;
};

/// "ColwiseParallel", "RowwiseParallel" or "SequenceParallel" (for messages).
const char* style_name(const ParallelStyle& s);

/// Records a parallelised parameter (by its TensorImpl, which set_data keeps).
void register_tp_param(const torch::Tensor& param, TPParam info);
/// The record of `param`, or nullptr.
const TPParam* find_tp_param(const torch::Tensor& param);
/// Whether a parameter is managed by fully_shard. The fsdp layer installs it (fully_shard), so that
/// parallelize_module refuses fully_shard-then-parallelize_module without depending on fsdp/.
using FullyShardedQuery = bool (*)(const torch::Tensor& param);
void set_fully_sharded_query(FullyShardedQuery q);
extern std::atomic<FullyShardedQuery> fully_sharded_query;
/// This rank's part of the full (global-shape) tensor of a parameter recorded as `p`: its chunk along
/// the sharded dim, or `full` itself when replicated. materialize_module uses it to fill a deferred
/// parameter that parallelize_module sharded (tensor_parallel.cpp).
torch::Tensor local_part(const TPParam& p, const torch::Tensor& full);

/// Whether any live TP parameter's mesh is a slice of `root` (fully_shard then describes its parameters
/// over the root: see [Note: FSDP over TP] in fsdp_param.cpp).
bool has_tp_params_on(const DeviceMeshPtr& root);

/// fully_shard of TP parameters over `mesh`: throws c10::Error (naming the parameter, both meshes and the
/// fix) unless the TP mesh and FSDP's mesh are slices of one root mesh and the TP dim is not one of FSDP's.
void check_fully_shard_over_tp(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                               const DeviceMeshPtr& mesh, int rank);

/// In a forward with grad mode on: replaces each argument of the op on the stack that is a partial_grad
/// TP parameter by copy_to_tp(parameter) (identity forward, all-reduce of its gradient over the TP group),
/// so that the sum of the ranks' partial gradients reaches the parameter. PyTorch gets the same from
/// DTensor (a Replicate parameter meeting a Shard(1) activation gives a Partial gradient).
void wrap_partial_grad_params(const c10::OperatorHandle& op, torch::jit::Stack* stack);

/// The autograd functions behind tp::distribute_sequence, tp::gather_sequence, tp::local_heads_of_fused.
torch::Tensor chunk_sequence(const torch::Tensor& x, const DeviceMeshPtr& mesh, int64_t dim);
torch::Tensor unchunk_sequence(const torch::Tensor& x, const DeviceMeshPtr& mesh, int64_t dim);
std::vector<torch::Tensor> fused_heads(const torch::Tensor& local, const DeviceMeshPtr& mesh, int64_t n_fused);

/// Whether tp_handle_op would run this op (on the stack) the TP way.
bool is_tp_op(const c10::OperatorHandle& op, const torch::jit::Stack& stack);

/// Called by the interception fallback on every intercepted op. Runs the op the TP way and
/// returns true when it is aten::linear or aten::embedding on a TP weight; else returns false and leaves
/// the stack untouched.
bool tp_handle_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

/// What the TP layer of the interception does with an op (wrap_partial_grad_params, then tp_handle_op or
/// the op itself below the key), without interception; fsdp's layer calls it once done with its own
/// parameters.
void tp_run_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

/// Installs the TP layer of the interception (utils/intercept.h); called by parallelize_module.
void ensure_tp_interception();

}  // namespace fsdp::tp::detail
