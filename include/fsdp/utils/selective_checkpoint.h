// Selective activation checkpointing: inside a non-reentrant checkpoint region, a per-op policy chooses which
// ops' outputs are kept from the forward (MUST_SAVE: typically matmuls and attention, costly to recompute) and
// which are recomputed in backward (PREFER_RECOMPUTE: pointwise ops, norms, cheap but activation-heavy). The
// memory sits between no checkpointing and full checkpointing, and the recomputation skips the saved ops.
//
// Mirrors torch.utils.checkpoint's CheckpointPolicy, SelectiveCheckpointContext and
// create_selective_checkpoint_contexts, passed as checkpoint's context_fn (CheckpointOptions::context_fn).
// How it works: [Note: selective checkpoint], src/utils/selective_checkpoint.cpp.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

namespace fsdp {

/// What the policy decides for one op. Mirrors torch.utils.checkpoint.CheckpointPolicy. The PREFER_* values are
/// hints to a compiler in PyTorch; eagerly (PyTorch's and libfsdp's case) PREFER_SAVE acts as MUST_SAVE and
/// PREFER_RECOMPUTE as MUST_RECOMPUTE.
/// Example: `return op.schema().name() == "aten::mm" ? fsdp::CheckpointPolicy::MUST_SAVE : fsdp::CheckpointPolicy::PREFER_RECOMPUTE;`
enum class CheckpointPolicy { MUST_SAVE, PREFER_SAVE, MUST_RECOMPUTE, PREFER_RECOMPUTE };

/// What the policy is told about the call. Mirrors torch.utils.checkpoint.SelectiveCheckpointContext.
/// libfsdp asks the policy in the first run only (the recomputation follows the first run's decisions, so a
/// policy that counts ops, as torchtitan's "save every other matmul", needs no recompute branch):
/// `is_recompute` is always false.
/// Example: `[](const fsdp::SelectiveCheckpointContext& ctx, const c10::OperatorHandle& op, const std::vector<c10::IValue>& args) { ... }`
struct SelectiveCheckpointContext {
  bool is_recompute = false;
};

/// The policy: called for each op the region runs with gradients enabled, as the dispatcher sees it (after
/// the decomposition of composite ops, e.g. aten::layer_norm arrives as aten::native_layer_norm, except
/// aten::linear and aten::matmul, which arrive whole), with the op's arguments (tensors and scalars, as the
/// schema orders them). An op whose output aliases an input (a view, an in-place or out= op) is recomputed
/// whatever the policy returns. Throwing from it fails the forward with that error.
/// Example: `fsdp::SelectiveCheckpointPolicyFn save_mm = [](auto&, const c10::OperatorHandle& op, auto&) { return op.schema().name() == "aten::mm" ? fsdp::CheckpointPolicy::MUST_SAVE : fsdp::CheckpointPolicy::PREFER_RECOMPUTE; };`
using SelectiveCheckpointPolicyFn =
    std::function<CheckpointPolicy(const SelectiveCheckpointContext& ctx, const c10::OperatorHandle& op,
                                   const std::vector<c10::IValue>& args)>;

/// A selective policy for one checkpoint region (what create_selective_checkpoint_contexts returns; PyTorch's
/// pair of context managers).
/// Example: `fsdp::CheckpointOptions().context_fn([] { return fsdp::SelectiveCheckpointContexts{save_mm}; })`
struct SelectiveCheckpointContexts {
  SelectiveCheckpointPolicyFn policy;
  /// false: a saved output modified in place after it was saved (its version counter moved) makes the
  /// recomputation throw c10::Error naming the op, instead of serving the modified value. true: no check
  /// (PyTorch's allow_cache_entry_mutation).
  bool allow_cache_entry_mutation = false;
};

/// A selective policy from a function (see SelectiveCheckpointPolicyFn). Throws c10::Error for an empty function.
/// Mirrors torch.utils.checkpoint.create_selective_checkpoint_contexts(policy_fn, allow_cache_entry_mutation).
/// Example: `fsdp::create_selective_checkpoint_contexts([](auto&, const c10::OperatorHandle& op, auto&) { return op.schema().name() == "aten::mm" ? fsdp::CheckpointPolicy::MUST_SAVE : fsdp::CheckpointPolicy::PREFER_RECOMPUTE; })`
SelectiveCheckpointContexts create_selective_checkpoint_contexts(SelectiveCheckpointPolicyFn policy,
                                                                 bool allow_cache_entry_mutation = false);

/// A selective policy from a list of ops to save (MUST_SAVE); every other op is recomputed (PREFER_RECOMPUTE).
/// An entry names an op with all its overloads ("aten::mm", "aten::add") or one overload ("aten::add.Tensor").
/// Throws c10::Error naming the entry if no registered op has that name (a typo would otherwise save nothing).
/// Mirrors create_selective_checkpoint_contexts(ops_to_save: list).
/// Example: `fsdp::create_selective_checkpoint_contexts({"aten::mm", "aten::linear", "aten::matmul"})`
SelectiveCheckpointContexts create_selective_checkpoint_contexts(const std::vector<std::string>& ops_to_save,
                                                                 bool allow_cache_entry_mutation = false);

/// The ops that torchtitan's selective "op" mode saves, as libfsdp's dispatcher names them: matrix products
/// (aten::mm, aten::addmm, aten::bmm, aten::baddbmm, aten::linear, aten::matmul), the fused attention kernels
/// (aten::_scaled_dot_product_flash_attention, ..._efficient_attention, ..._cudnn_attention,
/// ..._flash_attention_for_cpu), the functional reduce-scatter and aten::max.
/// Example: `auto ops = fsdp::default_selective_save_list();`
std::vector<std::string> default_selective_save_list();

}  // namespace fsdp
