// The thread's stack of saved-tensor hook factories that libfsdp's autograd engine consults for every tensor
// autograd saves (see [Note: saved-tensor hooks], saved_tensor_hooks.cpp). Used by saved_tensors_hooks and by
// non-reentrant checkpointing (activation_checkpoint.cpp).
#pragma once

#include <functional>
#include <memory>

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <torch/csrc/autograd/saved_variable_hooks.h>

namespace fsdp::detail {

/// Makes the hooks of one saved tensor (called by autograd when it saves a tensor on this thread).
using SavedHooksFactory = std::function<std::unique_ptr<torch::autograd::SavedVariableHooks>()>;

/// While on top of this thread's stack, `factory` gives the hooks of every tensor autograd saves here.
/// Throws c10::Error (naming `api`) when libfsdp's engine is not LibTorch's default engine.
void push_saved_hooks(SavedHooksFactory factory, const char* api);
void pop_saved_hooks();

/// The side stream on which save_on_cpu copies saved tensors of `device` (a GPU) to host memory ([Note: save_on_cpu on
/// a side stream], saved_tensor_hooks.cpp); one per device, from the device's stream pool.
c10::Stream offload_stream(c10::Device device);

/// save_on_cpu's hooks as a factory (each saved tensor copied to host memory, pinned when `pin_memory` and CUDA is
/// available; back to its device when unpacked).
SavedHooksFactory save_on_cpu_hooks(bool pin_memory);

/// The hooks of the implicit checkpoint region open on this thread (implicit_checkpoint.cpp; empty: none). They
/// sit where the stack stood when they were set: a saved_tensors_hooks scope entered later is innermost, as in
/// PyTorch. Throws c10::Error as push_saved_hooks.
void set_region_saved_hooks(SavedHooksFactory factory);

/// RAII form of push/pop.
struct SavedHooksScope {
  SavedHooksScope(SavedHooksFactory factory, const char* api) { push_saved_hooks(std::move(factory), api); }
  ~SavedHooksScope() { pop_saved_hooks(); }
  SavedHooksScope(const SavedHooksScope&) = delete;
  SavedHooksScope& operator=(const SavedHooksScope&) = delete;
};

}  // namespace fsdp::detail
