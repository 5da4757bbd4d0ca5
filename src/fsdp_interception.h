// Tensor-level interception of the parameters of "implicit" groups: fully_shard on a module whose
// forward does not go through an fsdp::FSDPModule holder (a torch::nn::Sequential element, a
// ModuleList entry, a plain torch::nn::Linear member, ...). See [Note: implicit groups] in
// fsdp_implicit.cpp for what is intercepted and why this mechanism.
#pragma once

#include <memory>

#include <c10/core/DispatchKey.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/types.h>

namespace fsdp::detail {

class FSDPState;

/// The dispatch key an intercepted parameter carries. DeferredInit is defined by c10 for torchdistx's
/// deferred initialisation and has no kernel and no fallback in libtorch: a C++ process that does not
/// load torchdistx leaves it free. It sits above Autograd, so the fallback sees each op before autograd
/// records it (and can unshard, cast inputs, and hook the nodes the op creates).
constexpr c10::DispatchKey kInterceptKey = c10::DispatchKey::DeferredInit;

/// Registers the fallback of kInterceptKey (once per process). Throws c10::Error if another library
/// already registered one (e.g. torchdistx loaded in the same process).
void ensure_interception_registered();

/// A tensor aliasing `t` (same storage, sizes, strides and offset) whose key set also holds
/// kInterceptKey. param.set_data(intercepted(x)) gives the parameter the key (set_data copies the key set).
torch::Tensor intercepted(const torch::Tensor& t);

/// Records that `param` (parameter `index` of `state`'s group) is intercepted.
void register_intercepted_param(const torch::Tensor& param, const std::shared_ptr<FSDPState>& state, size_t index);
/// Records that tensors on the storage of `alias` are aliases of `param` (`is_shard`: of its padded shard,
/// else of its unsharded tensor): a view or .data() of the parameter is intercepted as the parameter.
void register_param_storage(const torch::Tensor& param, const torch::Tensor& alias, bool is_shard);

/// Runs library code on intercepted parameters without interception (state dicts, collectives): ops
/// on this thread skip the fallback while it lives.
struct NoInterception : c10::impl::ExcludeDispatchKeyGuard {
  NoInterception() : c10::impl::ExcludeDispatchKeyGuard(kInterceptKey) {}
};

}  // namespace fsdp::detail
