// checkpoint_wrapper: activation checkpointing of a module's whole forward, applied from outside the
// model's code (the call-site form is fsdp::checkpoint, fsdp/utils/activation_checkpoint.h).
//
// Mirrors torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper (non-reentrant by
// default, as PyTorch's CheckpointImpl.NO_REENTRANT).
#pragma once

#include <functional>
#include <memory>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp/utils/activation_checkpoint.h"

namespace fsdp {

/// Checkpoints `module`'s forward with `options` (CheckpointOptions: non-reentrant by default; use_reentrant(true)
/// is PyTorch's CheckpointImpl.REENTRANT; a context_fn makes it selective). Apply before or after fully_shard;
/// applying it again replaces the options. Two forms, chosen by how the model calls the module:
/// - through an fsdp::FSDPModule holder: FSDPModule runs the call under fsdp::checkpoint;
/// - an unchanged module (called by the model's own code: a Sequential element, a ModuleList entry iterated in the
///   user's forward, torch::nn::TransformerEncoder's layers, a member called as `fc(x)`), sharded or not: the ops on
///   its parameters open a checkpoint region that lasts until another module's parameter is used (or a backward
///   begins), recorded as an op tape and replayed in backward. The values and gradients are those without
///   checkpointing; the region also takes the ops between the module's last parameter use and the next module's
///   (residual adds, dropout), and the user's ops after the model (the loss) when no other module's parameter comes
///   first. Non-reentrant only. See [Note: implicit checkpoint regions], src/utils/implicit_checkpoint.cpp.
/// Throws c10::Error for a null module; for an unchanged one without parameters of its own (outside holder
/// modules), with use_reentrant(true), or whose parameter is already another checkpointed module's.
/// Mirrors checkpoint_wrapper(module, checkpoint_impl, **checkpoint_fn_kwargs).
/// Example: `fsdp::checkpoint_wrapper(block, fsdp::CheckpointOptions().preserve_rng_state(false));`
void checkpoint_wrapper(const std::shared_ptr<torch::nn::Module>& module, const CheckpointOptions& options = {});
template <typename T>
void checkpoint_wrapper(const torch::nn::ModuleHolder<T>& holder, const CheckpointOptions& options = {}) {
  checkpoint_wrapper(std::static_pointer_cast<torch::nn::Module>(holder.ptr()), options);
}

/// Activation offload of `module`'s forward: the tensors autograd saves during its calls go to pinned host memory
/// (fsdp::save_on_cpu(pin_memory=true); on the CPU, another allocation) and come back in backward. Through an
/// fsdp::FSDPModule holder, the holder's call runs under save_on_cpu; on an unchanged module, the regions of
/// checkpoint_wrapper (from its first parameter use to the next module's) run under it, nothing recorded. With
/// checkpoint_wrapper as well (holders only), a non-reentrant region keeps its inputs itself and saves nothing else
/// through the hooks, so little is offloaded (as PyTorch's offload_wrapper around checkpoint_wrapper).
/// Throws c10::Error for a null module, an unchanged one without parameters of its own, one whose parameter is another
/// wrapped module's, or an unchanged one that checkpoint_wrapper was applied to (either, not both).
/// Mirrors torch.distributed.algorithms._checkpoint.checkpoint_wrapper.offload_wrapper(module).
/// Example: `for (auto& block : model->blocks) fsdp::offload_wrapper(block);`
void offload_wrapper(const std::shared_ptr<torch::nn::Module>& module);
template <typename T>
void offload_wrapper(const torch::nn::ModuleHolder<T>& holder) {
  offload_wrapper(std::static_pointer_cast<torch::nn::Module>(holder.ptr()));
}

/// checkpoint_wrapper(module, options) on every descendant of `model` (not `model` itself) for which
/// `check_fn(module)` is true, e.g. each transformer block, with or without holders: an unchanged model needs no
/// edit of its forward (LibTorch's TransformerEncoder: check_fn selects its TransformerEncoderLayerImpl layers).
/// All or nothing: c10::Error names every match that cannot be checkpointed (its path, its type and why: an unchanged
/// module without parameters, one inside another unchanged match, one sharing a parameter with another, any
/// unchanged one with use_reentrant(true)) and nothing is applied. Returns the number of modules checkpointed.
/// Mirrors torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing(model,
/// checkpoint_wrapper_fn, check_fn).
/// Example: `fsdp::apply_activation_checkpointing(*model, [](torch::nn::Module& m) { return dynamic_cast<torch::nn::TransformerEncoderLayerImpl*>(&m) != nullptr; });`
int64_t apply_activation_checkpointing(torch::nn::Module& model, const std::function<bool(torch::nn::Module&)>& check_fn,
                                       const CheckpointOptions& options = {});

}  // namespace fsdp
