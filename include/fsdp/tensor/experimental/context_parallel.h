// Context parallelism: a long sequence split over the ranks of a `cp` mesh dimension, attention computed as
// ring attention over that group. Mirrors torch.distributed.tensor.experimental.context_parallel (PyTorch
// 2.13's _context_parallel/_attention.py) with its all-gather rotation (_RotateMethod.ALL_GATHER) and its
// head-tail load balancer (_HeadTailLoadBalancer). Design: docs/TENSOR_PARALLEL.md, "Context parallelism".
#pragma once

#include <memory>
#include <vector>

#include <torch/types.h>

#include "fsdp/tensor/device_mesh.h"

namespace fsdp::experimental {

/// The load-balanced order of a sequence of `seq_length` positions over `cp_size` ranks, as PyTorch's
/// _HeadTailLoadBalancer._generate_indices: the sequence is cut into 2*cp_size chunks of
/// c = seq_length / (2*cp_size) positions, and CP rank i holds chunks i and 2*cp_size-1-i, in that order.
/// Returns int64 [seq_length]: position p of the reordered sequence holds original position result[p];
/// rank i's shard is result[2*c*i : 2*c*(i+1)]. With `restore`, the inverse permutation (argsort).
/// Throws c10::Error when seq_length is not a multiple of 2*cp_size (naming both) or cp_size < 1.
/// Example: context_parallel_load_balance_indices(8, 2) == [0, 1, 6, 7, 2, 3, 4, 5] (chunks of 2).
torch::Tensor context_parallel_load_balance_indices(int64_t seq_length, int64_t cp_size, bool restore = false);

/// This CP rank's positions of a sequence of `seq_length`: the original positions of the shard that
/// context_parallel leaves on rank `cp_rank` (int64 [seq_length / cp_size]). Example: (8, 2, 1) -> [2, 3, 4, 5].
torch::Tensor context_parallel_positions(int64_t seq_length, int64_t cp_size, int64_t cp_rank);

/// The whole sequences back from shards that context_parallel left (e.g. a model's outputs computed under it):
/// each buffer is all-gathered over `cp_mesh` along its `seq_dims` entry and put back in original order. Returns new
/// tensors (the inputs are unchanged), without autograd. Collective over cp_mesh (every rank calls it with the same
/// shapes). Mirrors torch.distributed.tensor.experimental.context_parallel_unshard.
/// Throws c10::Error (before communicating) for buffers and seq_dims of different lengths, a seq dim out of range, a
/// mesh that is not 1-D, or a local length that is odd (not a load-balanced shard).
/// Example: auto full = context_parallel_unshard((*mesh)["cp"], {logits}, {1})[0];  // [B, T, V] from [B, T/cp, V]
std::vector<torch::Tensor> context_parallel_unshard(const DeviceMeshPtr& cp_mesh, const std::vector<torch::Tensor>& buffers,
                                                    const std::vector<int64_t>& seq_dims);

/// Context parallelism for the lifetime of the object (the C++ counterpart of PyTorch's context manager
/// `with context_parallel(cp_mesh, buffers=..., buffer_seq_dims=..., no_restore_buffers=...)`):
///
/// - On construction each tensor of `buffers` is sharded in place along its `buffer_seq_dims` entry: the
///   sequence is reordered by context_parallel_load_balance_indices and this CP rank keeps its 1/cp
///   (the tensor handles the caller holds now see the shard: resize_ + copy_, as PyTorch).
/// - While it lives, torch::scaled_dot_product_attention (aten::scaled_dot_product_attention) called on
///   this thread with q/k/v of this rank's shard ([..., L/cp, E], seq dim -2) runs as ring attention over
///   the CP group: K and V are all-gathered (backward: reduce-scatter of dK, dV) and the causal mask is the
///   one of the load-balanced positions, so the result equals this rank's rows of one process's
///   attention on the full sequence. Supports is_causal true and false, `scale`, `enable_gqa`; no model
///   edit is needed. The backward may run after the object is gone (the graph holds the group).
/// - On destruction each buffer not in `no_restore_buffers` gets its full original content back.
///
/// `cp_mesh` must be 1-D (e.g. (*mesh)["cp"]). Buffers must not require grad (inputs, labels, positions:
/// not parameters) and must all have the same length along their seq dim; that length must be a multiple of
/// 2 * cp (PyTorch falls back to an unbalanced split otherwise; libfsdp refuses).
/// Throws c10::Error (on every rank alike: only local shapes are checked, before any collective) for: a mesh
/// that is not 1-D; buffers and buffer_seq_dims of different lengths; a seq dim out of range; unequal
/// lengths; a length not divisible by 2*cp; a buffer that requires grad; a no_restore buffer not in
/// `buffers`; a context_parallel already alive on this thread. Under it, scaled_dot_product_attention
/// throws for dropout_p > 0, an attn_mask, is_causal with different q and k lengths, and a local length
/// that is odd (not a load-balanced shard).
///
/// Ops other than SDPA run as before, through one boxed call each: see [Note: context parallel interception]
/// in src/tensor/experimental/context_parallel.cpp. Not thread-safe across threads: it acts on the thread
/// that constructed it and must be destroyed there.
///
/// Example: { fsdp::experimental::context_parallel cp((*mesh)["cp"], {tokens, labels, pos}, {1, 1, 0});
///            auto loss = model->forward(tokens, pos, labels); loss.backward(); }
class context_parallel {
 public:
  context_parallel(const DeviceMeshPtr& cp_mesh, std::vector<torch::Tensor> buffers = {},
                   std::vector<int64_t> buffer_seq_dims = {}, std::vector<torch::Tensor> no_restore_buffers = {});
  ~context_parallel();
  context_parallel(const context_parallel&) = delete;
  context_parallel& operator=(const context_parallel&) = delete;

  /// This CP rank's original positions of the buffers' sequence (context_parallel_positions), int64;
  /// undefined when no buffer was given.
  const torch::Tensor& positions() const { return positions_; }

 private:
  std::vector<torch::Tensor> buffers_;
  std::vector<torch::Tensor> originals_;  // undefined for buffers not restored
  torch::Tensor positions_;
  std::shared_ptr<void> state_;  // the thread's CP state (src/tensor/experimental/context_parallel.cpp)
};

}  // namespace fsdp::experimental
