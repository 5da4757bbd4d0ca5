// Activation checkpointing: keep only a region's inputs in forward and recompute the region in
// backward, trading compute for activation memory. Composes with fully_shard: checkpoint a module
// and shard it (checkpoint_wrapper(block); fully_shard(block)); FSDP unshards its parameters before
// the recomputation (the pre-backward all-gather), so nothing extra is gathered.
//
// Mirrors torch.utils.checkpoint.checkpoint (use_reentrant=True semantics, with the RNG state restored
// for the recomputation so that dropout masks match). The module form, checkpoint_wrapper, is in
// fsdp/algorithms/checkpoint_wrapper.h.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include <torch/types.h>

#include "fsdp/utils/detail/forward_args.h"

namespace fsdp {

/// The recomputable region: maps the tensor inputs to the tensor outputs.
using CheckpointFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// Runs `fn(inputs)` without recording activations; in backward, restores the RNG state of the
/// forward (CPU, and the CUDA devices of the inputs), recomputes `fn` with gradients enabled and
/// backpropagates through it. Parameters used by `fn` get their gradients accumulated as usual, even
/// when no input requires grad. Outputs are the same tensors (values) `fn` returns.
/// Throws c10::Error if `fn` returns no tensor.
std::vector<torch::Tensor> checkpoint_tensors(CheckpointFn fn, const std::vector<torch::Tensor>& inputs);

/// Functional form for any callable: checkpoint(fn, args...) returns what fn(args...) returns (a
/// Tensor, a std::vector<Tensor>, or a tuple/pair of them and other values). Tensor arguments are
/// the saved inputs; other arguments are copied and reused for the recomputation. `fn` is copied once
/// and called as a non-const object, so a `mutable` lambda works (e.g. one that calls a module holder
/// captured by value: ModuleHolder::operator() is not const); the forward and the recomputation call
/// the same copy, so state it changes in the forward is seen by the recomputation.
template <typename Fn, typename... Args>
auto checkpoint(Fn fn, Args... args) {
  using Out = decltype(fn(args...));
  std::vector<torch::Tensor> ins;
  (detail::collect(ins, args), ...);
  auto stored = std::make_shared<std::tuple<Args...>>(std::move(args)...);
  // The first (no-grad) run keeps its output object so that non-tensor parts can be returned; the
  // recomputation does not (it would keep activations alive).
  auto first = std::make_shared<std::optional<Out>>();
  auto first_run = std::make_shared<bool>(true);
  // mutable: `fn` is called as a non-const object (std::function calls its target as one).
  CheckpointFn run = [fn = std::move(fn), stored, first, first_run](const std::vector<torch::Tensor>& new_ins) mutable {
    size_t i = 0;
    auto call_args = std::apply(
        [&](auto&... a) { return std::tuple<decltype(detail::replace(a, new_ins, i))...>{detail::replace(a, new_ins, i)...}; },
        *stored);
    Out out = std::apply(fn, std::move(call_args));
    std::vector<torch::Tensor> outs;
    detail::collect_out(outs, out);
    if (*first_run) {
      *first = std::move(out);
      *first_run = false;
    }
    return outs;
  };
  auto outs = checkpoint_tensors(std::move(run), ins);
  Out out = std::move(**first);
  first->reset();
  size_t j = 0;
  detail::restore_out(out, outs, j);
  return out;
}

}  // namespace fsdp
