// Internal (installed because fsdp::FSDPModule's template uses it; not part of the API): the call boundary at which
// the styles of fsdp/tensor/parallel/style.h (PrepareModuleInput/Output, user hooks) run, since LibTorch has no
// forward hooks. FSDPModule<T>::forward runs the module through call_with_boundary; a torch::nn::Sequential entry is
// wrapped by parallelize_module instead. See [Note: module boundaries] in src/tensor/parallel/prepare_module.cpp.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "fsdp/utils/detail/forward_args.h"

namespace fsdp::tp::detail {

/// The hooks of one module (held by the registry in prepare_module.cpp).
struct BoundaryHooks;
/// Whether any module has boundary hooks: calls of other modules skip the registry lookup.
extern std::atomic<bool> any_boundary_hooks;
/// `module`'s hooks, or null.
std::shared_ptr<const BoundaryHooks> boundary_hooks(const torch::nn::Module& module);
/// Runs the pre-forward hooks on the positional arguments (undefined tensors for non-tensor arguments).
std::vector<torch::Tensor> run_pre_hooks(const BoundaryHooks& hooks, std::vector<torch::Tensor> inputs);
/// Runs the post-forward hooks on the output's tensors (collect_out's order).
std::vector<torch::Tensor> run_post_hooks(const BoundaryHooks& hooks, std::vector<torch::Tensor> outputs);

template <typename T>
void collect_arg(std::vector<torch::Tensor>& v, const T& a) {
  if constexpr (std::is_same_v<std::decay_t<T>, torch::Tensor>) {
    v.push_back(a);
  } else {
    v.emplace_back();
  }
}
template <typename T>
decltype(auto) replace_arg(T&& a, const std::vector<torch::Tensor>& v, size_t& i) {
  if constexpr (std::is_same_v<std::decay_t<T>, torch::Tensor>) {
    return torch::Tensor(v[i++]);
  } else {
    ++i;
    return std::forward<T>(a);
  }
}

/// Runs `call(args...)` (the module's own forward) between `module`'s boundary hooks, if it has any.
template <typename Call, typename... Args>
auto call_with_boundary(const torch::nn::Module& module, Call&& call, Args&&... args) {
  std::shared_ptr<const BoundaryHooks> hooks;
  if (any_boundary_hooks.load(std::memory_order_relaxed)) hooks = boundary_hooks(module);
  if (!hooks) return call(std::forward<Args>(args)...);
  std::vector<torch::Tensor> ins;
  (collect_arg(ins, args), ...);
  ins = run_pre_hooks(*hooks, std::move(ins));
  size_t i = 0;
  // Braced init keeps left-to-right evaluation of the replacements.
  auto out = std::apply(call, std::tuple<decltype(replace_arg(std::forward<Args>(args), ins, i))...>{
                                  replace_arg(std::forward<Args>(args), ins, i)...});
  std::vector<torch::Tensor> outs;
  fsdp::detail::collect_out(outs, out);
  outs = run_post_hooks(*hooks, std::move(outs));
  size_t j = 0;
  fsdp::detail::restore_out(out, outs, j);
  return out;
}

}  // namespace fsdp::tp::detail
