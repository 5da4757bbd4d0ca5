// Op interception (libfsdp's counterpart of Python's dispatch modes): the dispatch key that tensor-parallel
// parameters and the parameters of fsdp's implicit groups carry (and that a selective checkpoint region puts
// in the thread's included keys), and the one fallback that sees the ops on them. The fallback is installed
// in layers so that dependencies run one way: tensor/parallel installs the handler of TP parameters
// (tp_ops.cpp); fsdp, above it, installs one that handles its own parameters and calls TP's for the rest
// (fsdp/fsdp_interception.cpp); selective checkpointing (utils/selective_checkpoint.cpp), above all, decides
// per op and calls the layer below. The highest layer installed receives every op.
// See [Note: implicit groups] in fsdp/fsdp_implicit.cpp and [Note: selective checkpoint].
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/types.h>

namespace fsdp::detail {

/// The dispatch key an intercepted parameter carries. DeferredInit is defined by c10 for torchdistx's
/// deferred initialisation and has no kernel and no fallback in libtorch: a C++ process that does not
/// load torchdistx leaves it free. It sits above Autograd, so the fallback sees each op before autograd
/// records it (and can unshard, cast inputs, and hook the nodes the op creates).
constexpr c10::DispatchKey kInterceptKey = c10::DispatchKey::DeferredInit;

/// Runs library code on intercepted parameters without interception (state dicts, collectives): ops
/// on this thread skip the fallback while it lives.
struct NoInterception : c10::impl::ExcludeDispatchKeyGuard {
  NoInterception() : c10::impl::ExcludeDispatchKeyGuard(kInterceptKey) {}
};

/// A boxed handler of the ops on intercepted tensors.
using InterceptFn = void (*)(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

/// The layers of the fallback, lowest first.
enum class InterceptLayer { TensorParallel = 0, FSDP = 1, Checkpoint = 2 };

/// Installs `layer`'s handlers (once per process and layer; later calls are no-ops). `fallback` sees every op on
/// an intercepted tensor; `composite` sees aten::linear and aten::matmul, which are composite (without it they
/// decompose before reaching the fallback). The highest installed layer receives both, whatever the order of
/// installation. The key's kernels themselves are registered when libfsdp is loaded (see intercept.cpp). Throws
/// c10::Error if that registration failed: another library registered a fallback for the key (e.g. torchdistx
/// loaded in the same process).
void install_intercept_layer(InterceptLayer layer, InterceptFn fallback, InterceptFn composite);

/// The handler of aten::scaled_dot_product_attention on the key ahead of the layers: returns true when it ran
/// the op (context parallelism's ring attention, while a context_parallel region lives on this thread), false to
/// hand it to the layers as any other op. See [Note: context parallel interception] in
/// tensor/experimental/context_parallel.cpp.
using SdpaHandler = bool (*)(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

/// Installs the SDPA handler (once per process; later calls are no-ops). aten::scaled_dot_product_attention is
/// CompositeImplicitAutograd: its kernel on the key is registered at load like linear's and matmul's.
void install_sdpa_handler(SdpaHandler handler);

/// The handler of aten::cross_entropy_loss on the key ahead of the layers: returns true when it ran the op
/// (the vocab-parallel loss, while a loss_parallel region lives on this thread), false to hand it to the layers
/// as any other op. See [Note: loss_parallel guard] in tensor/parallel/loss_parallel.cpp.
using CrossEntropyHandler = bool (*)(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

/// Installs the cross-entropy handler (once per process; later calls are no-ops). aten::cross_entropy_loss is
/// CompositeImplicitAutograd: its kernel on the key is registered at load like SDPA's.
void install_cross_entropy_handler(CrossEntropyHandler handler);

/// Hands `op` to the highest installed layer below `layer` (its composite handler when `composite`), or
/// runs it below the key when there is none.
void call_layer_below(InterceptLayer layer, bool composite, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                      torch::jit::Stack* stack);

/// Whether `op` only reads its tensors' metadata (sizes, dtype, *_like factories): it never needs a
/// parameter's values, so no layer unshards or communicates for it.
bool is_metadata_op(const c10::OperatorHandle& op);

/// Runs `op` below the interception key (what a handler does once it is done with the op).
void redispatch_below_intercept(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

/// A tensor aliasing `t` (same storage, sizes, strides and offset) whose key set also holds
/// kInterceptKey. param.set_data(intercepted(x)) gives the parameter the key (set_data copies the key set).
torch::Tensor intercepted(const torch::Tensor& t);

}  // namespace fsdp::detail
