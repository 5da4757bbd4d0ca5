// Tensor parallelism: shard the matrices of Linear and Embedding modules across a TP group, with the
// model's code unchanged; sequence parallelism for the norms between them. Mirrors
// torch.distributed.tensor.parallel.{parallelize_module, ColwiseParallel, RowwiseParallel, SequenceParallel}. Design and what is left: docs/TENSOR_PARALLEL.md.
//
//   auto tp_mesh = fsdp::init_device_mesh(torch::kCPU, {world});          // or mesh["tp"] of a 2-D mesh
//   fsdp::tp::parallelize_module(model, tp_mesh, {{"blocks.*.fc1", fsdp::tp::ColwiseParallel()},
//                                                 {"blocks.*.fc2", fsdp::tp::RowwiseParallel()}});
//   torch::optim::AdamW opt(model->parameters(), ...);                    // sees the local shards
//
// How (no forward hooks in LibTorch): a planned module's weight keeps its identity but its data becomes
// this rank's shard, tagged for libfsdp's dispatcher interception (src/fsdp/fsdp_interception.h). When
// Linear::forward multiplies by that weight (LibTorch's F::linear: addmm or matmul with weight.t()) or
// Embedding::forward looks it up (aten::embedding), the style's version of the op runs instead: the
// input and output collectives of PyTorch's style, as autograd functions (all-reduce of the input
// gradient, all-reduce or all-gather of the output). Every other op on the parameter (optimizer step,
// zeros_like, clipping) runs on the local shard as is.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp/tensor/device_mesh.h"
#include "fsdp/tensor/dtensor.h"

namespace fsdp::tp {

class UserParallelStyle;  // fsdp/tensor/parallel/style.h

/// How one module is parallelised. Build it with ColwiseParallel(), RowwiseParallel() or
/// SequenceParallel() and adjust the layouts with the setters, as PyTorch's keyword arguments.
struct ParallelStyle {
  /// CUSTOM: a boundary style (PrepareModuleInput/Output/InputOutput) or a user-defined one: `custom` does it
  /// (fsdp/tensor/parallel/style.h).
  enum class Kind { COLWISE, ROWWISE, SEQUENCE, CUSTOM };
  Kind kind = Kind::COLWISE;
  /// Layout the module's input has on the TP mesh. Colwise: Replicate() (default) or Shard(d) with
  /// d >= 0, a sequence-sharded activation (sequence parallelism: all-gathered along d first, its
  /// gradient reduce-scattered). Rowwise: Shard(-1) (the local output of a colwise module, the default)
  /// or Replicate() (each rank takes its columns). Sequence: Shard(sequence_dim).
  Placement input_layout = Replicate();
  /// Layout the module's output must have. Colwise: Shard(-1) (default: each rank keeps its
  /// features) or Replicate() (all-gathered along the last dim). Rowwise: Replicate() (all-reduced,
  /// default) or Shard(d) with d >= 0 (reduce-scattered along d: the sequence-sharded activation of
  /// sequence parallelism; its gradient is all-gathered). Sequence: Shard(sequence_dim).
  Placement output_layout = Shard(-1);
  /// Must stay true: a LibTorch module returns a torch::Tensor, not a DTensor. Kept for PyTorch's
  /// spelling; false throws at parallelize_module.
  bool use_local_output = true;

  /// Kind CUSTOM only: the style (tp::user_style, or the conversion of PrepareModuleInput and the like).
  std::shared_ptr<const UserParallelStyle> custom;

  ParallelStyle& input_layouts(Placement p) { input_layout = p; return *this; }
  ParallelStyle& output_layouts(Placement p) { output_layout = p; return *this; }
  ParallelStyle& set_use_local_output(bool v) { use_local_output = v; return *this; }
  /// "ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(dim=-1))".
  std::string str() const;
};

/// Linear: weight [out, in] sharded on dim 0 (Shard(0)), bias on dim 0; input replicated; output
/// this rank's out/tp features (Shard(-1)). With output_layouts(Replicate()) the output is all-gathered
/// and the bias stays whole (unlike PyTorch, which shards it: F::linear adds the bias outside the op
/// libfsdp intercepts). Embedding: weight [num, dim] sharded on dim 1; output
/// this rank's dim/tp features. The input's gradient is all-reduced over the TP group in backward.
/// Tied head: a module whose only parameter is the weight of an Embedding planned RowwiseParallel (GPT-2's
/// lm_head sharing wte.weight, used through F::linear) may be planned ColwiseParallel (input Replicate()): the
/// shard of vocabulary rows serves both, and its Shard(-1) output is the local logits that
/// vocab_parallel_cross_entropy (loss.h) takes. Example: `{{"wte", RowwiseParallel()}, {"lm_head", ColwiseParallel()}}`.
/// Mirrors torch.distributed.tensor.parallel.ColwiseParallel().
inline ParallelStyle ColwiseParallel() {
  return ParallelStyle{ParallelStyle::Kind::COLWISE, Replicate(), Shard(-1), true};
}
/// Linear: weight [out, in] sharded on dim 1 (Shard(1)), bias replicated and added once after the
/// all-reduce; input Shard(-1) (this rank's in/tp features); output Replicate() (all-reduced).
/// Embedding: weight [num, dim] sharded on dim 0 (each rank owns num/tp ids; others give zero rows
/// before the all-reduce); input replicated ids. Mirrors torch.distributed.tensor.parallel.RowwiseParallel().
inline ParallelStyle RowwiseParallel() {
  return ParallelStyle{ParallelStyle::Kind::ROWWISE, Shard(-1), Replicate(), true};
}

/// LayerNorm (or Dropout) on a sequence-sharded activation: each rank normalises its own positions
/// (dim `sequence_dim` of the input, e.g. 1 for [batch, seq, features]) with the whole, replicated
/// weight and bias, whose gradients, partial sums over each rank's positions, are all-reduced over the
/// TP group in backward. Put it between a RowwiseParallel().output_layouts(Shard(1)) and a
/// ColwiseParallel().input_layouts(Shard(1)); the sequence length must be divisible by the TP size.
/// Accepted: torch::nn::LayerNorm, torch::nn::Dropout (nothing to do: each rank drops its own positions), and a
/// user's own norm module (LibTorch 2.13 has no torch::nn::RMSNorm), e.g. an RMSNorm computing
/// x * rsqrt(mean(x^2, -1) + eps) * weight: a module with no submodules whose parameters are a 1-D `weight` and
/// optionally a 1-D `bias` (anything else throws naming the module). Such a module must act on each position
/// on its own (a norm over the last dim), as PyTorch's SequenceParallel also assumes; its parameters are
/// replicated and each op that uses them in a forward all-reduces their gradient over the TP group
/// ([Note: SequenceParallel on a user's norm] in tensor_parallel.cpp).
/// Mirrors torch.distributed.tensor.parallel.SequenceParallel(sequence_dim).
inline ParallelStyle SequenceParallel(int64_t sequence_dim = 1) {
  return ParallelStyle{ParallelStyle::Kind::SEQUENCE, Shard(sequence_dim), Shard(sequence_dim), true};
}

/// Module FQN pattern -> style, applied in order. A pattern is split on '.', each segment matched
/// against one path segment with '*' (any characters) and '?' (one character), e.g. "blocks.*.fc1".
/// Mirrors the dict parallelize_plan of parallelize_module.
using ParallelizePlan = std::vector<std::pair<std::string, ParallelStyle>>;

/// Parallelises the modules that `plan` names over `tp_mesh` (a 1-D mesh: pass mesh["tp"] of a 2-D
/// mesh). Changes `module` in place: each planned Linear/Embedding's weight (and colwise bias) keeps its
/// identity and holds this rank's shard (sizes() are the local shard's); call it before building the
/// optimizer. Every rank must start from the same weights (seed identically or load the same
/// checkpoint): each keeps its own chunk of its own copy, no data moves. No communication here; the
/// forward and backward of the planned modules then run collectives over tp_mesh's group, so every
/// rank of the group must run the same forward passes.
/// Validates the whole plan first and throws c10::Error before changing anything (so, with the same
/// model and plan everywhere, the same error on every rank) for: a mesh that is not 1-D, a pattern
/// that matches no module (the message lists the model's module names), a module matched by two
/// patterns or already parallelised, a module that is neither torch::nn::Linear nor
/// torch::nn::Embedding (LayerNorm or Dropout for SequenceParallel; the message names its type), a sharded dimension not divisible by the TP
/// size (naming the module, the dimension and a fix), an unsupported layout, use_local_output(false),
/// a parameter already sharded by fully_shard (apply parallelize_module first).
/// A deferred model (fsdp::deferred_init, meta parameters) is parallelised as a plan: each rank's TP part
/// (and its FSDP rows, after fully_shard) is filled by materialize_module, bit-identical to eager init.
/// Mirrors torch.distributed.tensor.parallel.parallelize_module (which returns the module).
/// Example: `auto m = fsdp::deferred_init([] { return Net(); }); parallelize_module(m, mesh["tp"], plan);
///           fsdp::fully_shard(m, fsdp::FullyShardOptions().mesh(mesh["dp"])); fsdp::materialize_module(m);`
void parallelize_module(const std::shared_ptr<torch::nn::Module>& module, const DeviceMeshPtr& tp_mesh,
                        const ParallelizePlan& plan);
/// Applies one style to `module` itself (PyTorch's parallelize_module(module, mesh, style)).
void parallelize_module(const std::shared_ptr<torch::nn::Module>& module, const DeviceMeshPtr& tp_mesh,
                        const ParallelStyle& style);
template <typename T>
void parallelize_module(const torch::nn::ModuleHolder<T>& holder, const DeviceMeshPtr& tp_mesh,
                        const ParallelStyle& style) {
  parallelize_module(std::static_pointer_cast<torch::nn::Module>(holder.ptr()), tp_mesh, style);
}
template <typename T>
void parallelize_module(const torch::nn::ModuleHolder<T>& holder, const DeviceMeshPtr& tp_mesh,
                        const ParallelizePlan& plan) {
  parallelize_module(std::static_pointer_cast<torch::nn::Module>(holder.ptr()), tp_mesh, plan);
}

/// Sequence parallelism at a model's boundaries, where LibTorch has no module hooks to do it (PyTorch's
/// PrepareModuleInput / PrepareModuleOutput on the first and last sequence-parallel modules):
/// distribute_sequence keeps this rank's chunk of a replicated activation along `dim` (Replicate() ->
/// Shard(dim); backward all-gathers the gradient); gather_sequence all-gathers a sequence-sharded one
/// (Shard(dim) -> Replicate(); backward keeps this rank's chunk of the gradient, which every rank holds
/// in full). Both are collectives over `tp_mesh` (1-D) in backward or forward; `dim`'s size must divide
/// by the TP size (distribute_sequence throws c10::Error naming the sizes otherwise).
torch::Tensor distribute_sequence(const torch::Tensor& x, const DeviceMeshPtr& tp_mesh, int64_t dim = 1);
torch::Tensor gather_sequence(const torch::Tensor& x, const DeviceMeshPtr& tp_mesh, int64_t dim = 1);

/// This rank's heads of a fused projection such as GPT-2's c_attn (a Linear(C, n_fused * C) whose
/// output is [q; k; v] along the last dim) under ColwiseParallel: `local` is the module's local output,
/// [..., n_fused * C / tp] (contiguous output features, which mix q, k and v of different heads); the
/// result is n_fused tensors [..., C / tp]: q, k and v of heads [t * H / tp, (t + 1) * H / tp) for TP
/// rank t, ready for attention with H / tp heads and a RowwiseParallel output projection. It all-gathers
/// the local output along the last dim (backward: reduce-scatter), one activation collective per call
/// that separate q, k and v projections (torchtitan's layout) would not need; it keeps the fused
/// parameter, and so GPT-2's checkpoints, unchanged. Throws c10::Error when C is not divisible by the TP
/// size. No PyTorch counterpart (PyTorch users split the projection).
std::vector<torch::Tensor> local_heads_of_fused(const torch::Tensor& local, const DeviceMeshPtr& tp_mesh,
                                                int64_t n_fused = 3);

/// The DTensor view of a parameter parallelised by parallelize_module (its local shard, the TP mesh,
/// its placement and its global shape), e.g. to call full_tensor(). Throws c10::Error when `param` is
/// not one. Mirrors reading a TP parameter in PyTorch (which is a DTensor).
DTensor tp_param_dtensor(const torch::Tensor& param);

}  // namespace fsdp::tp
