// Tensor-level interception of the parameters of "implicit" groups: fully_shard on a module whose
// forward does not go through an fsdp::FSDPModule holder (a torch::nn::Sequential element, a
// ModuleList entry, a plain torch::nn::Linear member, ...). See [Note: implicit groups] in
// fsdp_implicit.cpp for what is intercepted and why this mechanism.
#pragma once

#include <memory>

#include <torch/types.h>

#include "utils/intercept.h"

namespace fsdp::detail {

class FSDPState;

/// Installs fsdp's layer of the interception (utils/intercept.h: implicit groups' parameters, deferred
/// init, then TP's layer for the rest). Throws c10::Error if another library already registered a fallback
/// for the key (e.g. torchdistx loaded in the same process).
void ensure_interception_registered();

/// Records that `param` (parameter `index` of `state`'s group) is intercepted.
void register_intercepted_param(const torch::Tensor& param, const std::shared_ptr<FSDPState>& state, size_t index);
/// Records that tensors on the storage of `alias` are aliases of `param` (`is_shard`: of its padded shard,
/// else of its unsharded tensor): a view or .data() of the parameter is intercepted as the parameter.
void register_param_storage(const torch::Tensor& param, const torch::Tensor& alias, bool is_shard);

}  // namespace fsdp::detail
