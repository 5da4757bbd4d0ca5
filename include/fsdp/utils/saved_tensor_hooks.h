// Saved-tensor hooks for LibTorch: what autograd keeps for backward goes through a pack function in forward
// and comes back through an unpack function in backward. PyTorch offers them to Python only
// (torch.autograd.graph.saved_tensors_hooks); libfsdp installs them for C++ (see [Note: saved-tensor hooks],
// src/utils/saved_tensor_hooks.cpp). They carry non-reentrant activation checkpointing
// (fsdp/utils/activation_checkpoint.h) and activation offload (save_on_cpu).
#pragma once

#include <functional>

#include <ATen/core/ivalue.h>
#include <torch/types.h>

namespace fsdp {

/// While an object lives, every tensor that autograd saves for backward on this thread (the inputs and
/// outputs an op's derivative formula needs) is passed to `pack` in forward, and what `pack` returned is
/// passed to `unpack` when the backward needs the tensor: `unpack` must return a tensor of the same
/// shape, dtype and values. Objects nest: the innermost applies. Scope-bound (create and destroy on one
/// thread, in reverse order). Tensors saved while none is alive, or with grad disabled, are kept as
/// usual. Mirrors torch.autograd.graph.saved_tensors_hooks(pack_hook, unpack_hook).
/// Throws c10::Error (at construction) if LibTorch's autograd engine was started before libfsdp was
/// loaded (the hooks need libfsdp's engine; see the note), naming the cause.
/// Example: `fsdp::saved_tensors_hooks h([](const torch::Tensor& t) -> c10::IValue { return t.to(torch::kHalf); }, [](const c10::IValue& v) { return v.toTensor().to(torch::kFloat); });`
class saved_tensors_hooks {
 public:
  using Pack = std::function<c10::IValue(const torch::Tensor&)>;
  using Unpack = std::function<torch::Tensor(const c10::IValue&)>;
  saved_tensors_hooks(Pack pack, Unpack unpack);
  ~saved_tensors_hooks();
  saved_tensors_hooks(const saved_tensors_hooks&) = delete;
  saved_tensors_hooks& operator=(const saved_tensors_hooks&) = delete;
};

/// Activation offload: while alive, the tensors autograd saves are copied to host memory in forward
/// (pinned when `pin_memory` and CUDA is available) and back to their device in backward, so that
/// accelerator memory holds no activations between forward and backward. Tensors already on the CPU are
/// copied to another CPU allocation (nothing is saved; the hooks run as on a GPU). On a GPU with pin_memory the copy
/// out runs on a side stream, ordered by events (the forward does not wait for it; the copy back waits for it), else
/// the copies are synchronous on the current stream ([Note: save_on_cpu on a side stream]). Mirrors
/// torch.autograd.graph.save_on_cpu(pin_memory) (whose copies are on the current stream).
/// Example: `{ fsdp::save_on_cpu offload(/*pin_memory=*/true); loss = model(x).sum(); } loss.backward();`
class save_on_cpu : public saved_tensors_hooks {
 public:
  explicit save_on_cpu(bool pin_memory = false);
};

}  // namespace fsdp
