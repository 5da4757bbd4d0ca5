// checkpoint_wrapper: activation checkpointing of a module's whole forward, applied from outside the
// model's code (the call-site form is fsdp::checkpoint, fsdp/utils/activation_checkpoint.h).
//
// Mirrors torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper (non-reentrant by
// default, as PyTorch's CheckpointImpl.NO_REENTRANT).
#pragma once

#include <memory>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp/utils/activation_checkpoint.h"

namespace fsdp {

/// Checkpoints `module`'s forward whenever it runs through fsdp::FSDPModule (declare the module as
/// fsdp::FSDPModule<Holder>), with `options` (CheckpointOptions: non-reentrant by default; use_reentrant(true)
/// is PyTorch's CheckpointImpl.REENTRANT). Apply before or after fully_shard; applying it again replaces the
/// options. Throws c10::Error for a null module, or one sharded without a holder (implicit: nothing can
/// re-run its forward; the message names fsdp::checkpoint at the call site as the fix).
/// Mirrors checkpoint_wrapper(module, checkpoint_impl, **checkpoint_fn_kwargs).
/// Example: `fsdp::checkpoint_wrapper(block, fsdp::CheckpointOptions().preserve_rng_state(false));`
void checkpoint_wrapper(const std::shared_ptr<torch::nn::Module>& module, const CheckpointOptions& options = {});
template <typename T>
void checkpoint_wrapper(const torch::nn::ModuleHolder<T>& holder, const CheckpointOptions& options = {}) {
  checkpoint_wrapper(std::static_pointer_cast<torch::nn::Module>(holder.ptr()), options);
}

}  // namespace fsdp
