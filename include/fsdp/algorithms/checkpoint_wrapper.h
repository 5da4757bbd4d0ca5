// checkpoint_wrapper: activation checkpointing of a module's whole forward, applied from outside the
// model's code (the call-site form is fsdp::checkpoint, fsdp/utils/activation_checkpoint.h).
//
// Mirrors torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper (reentrant).
#pragma once

#include <memory>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace fsdp {

/// Checkpoints `module`'s forward whenever it runs through fsdp::FSDPModule (declare the module as
/// fsdp::FSDPModule<Holder>). Apply before or after fully_shard. Mirrors checkpoint_wrapper(module).
void checkpoint_wrapper(const std::shared_ptr<torch::nn::Module>& module);
template <typename T>
void checkpoint_wrapper(const torch::nn::ModuleHolder<T>& holder) {
  checkpoint_wrapper(std::static_pointer_cast<torch::nn::Module>(holder.ptr()));
}

}  // namespace fsdp
