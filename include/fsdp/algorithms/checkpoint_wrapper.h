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

/// Checkpoints `module`'s forward whenever it runs through fsdp::FSDPModule (declare the module as
/// fsdp::FSDPModule<Holder>), with `options` (CheckpointOptions: non-reentrant by default; use_reentrant(true)
/// is PyTorch's CheckpointImpl.REENTRANT; a context_fn makes it selective). Apply before or after fully_shard;
/// applying it again replaces the options. Throws c10::Error for a null module, or one without a live
/// FSDPModule holder (nothing in libfsdp calls its forward, so it could not be checkpointed: the message names
/// fsdp::checkpoint at the call site as the fix).
/// Mirrors checkpoint_wrapper(module, checkpoint_impl, **checkpoint_fn_kwargs).
/// Example: `fsdp::checkpoint_wrapper(block, fsdp::CheckpointOptions().preserve_rng_state(false));`
void checkpoint_wrapper(const std::shared_ptr<torch::nn::Module>& module, const CheckpointOptions& options = {});
template <typename T>
void checkpoint_wrapper(const torch::nn::ModuleHolder<T>& holder, const CheckpointOptions& options = {}) {
  checkpoint_wrapper(std::static_pointer_cast<torch::nn::Module>(holder.ptr()), options);
}

/// Activation offload of `module`'s forward: whenever it runs through fsdp::FSDPModule, the tensors autograd saves
/// during the call go to pinned host memory (fsdp::save_on_cpu(pin_memory=true); on the CPU, another allocation)
/// and come back in backward. With checkpoint_wrapper as well, a non-reentrant region keeps its inputs itself and
/// saves nothing else through the hooks, so little is offloaded (as PyTorch's offload_wrapper around checkpoint_wrapper).
/// Throws c10::Error for a null module or one without a live FSDPModule holder (as checkpoint_wrapper).
/// Mirrors torch.distributed.algorithms._checkpoint.checkpoint_wrapper.offload_wrapper(module).
/// Example: `for (auto& block : model->blocks) fsdp::offload_wrapper(block);`
void offload_wrapper(const std::shared_ptr<torch::nn::Module>& module);
template <typename T>
void offload_wrapper(const torch::nn::ModuleHolder<T>& holder) {
  offload_wrapper(std::static_pointer_cast<torch::nn::Module>(holder.ptr()));
}

/// checkpoint_wrapper(module, options) on every descendant of `model` (not `model` itself) for which
/// `check_fn(module)` is true, e.g. each transformer block. All or nothing: every match must have a live
/// FSDPModule holder, else c10::Error names each one without (its path and type) and nothing is applied.
/// Returns the number of modules wrapped. Mirrors
/// torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing(model,
/// checkpoint_wrapper_fn, check_fn). Not yet: modules without a holder (an unchanged model's blocks called by
/// the model's own forward); checkpoint them at the call site (fsdp::checkpoint).
/// Example: `fsdp::apply_activation_checkpointing(*model, [](torch::nn::Module& m) { return dynamic_cast<BlockImpl*>(&m) != nullptr; }, sac);`
int64_t apply_activation_checkpointing(torch::nn::Module& model, const std::function<bool(torch::nn::Module&)>& check_fn,
                                       const CheckpointOptions& options = {});

}  // namespace fsdp
