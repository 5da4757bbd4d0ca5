// Activation checkpointing: keep only a region's inputs in forward and recompute the region in
// backward, trading compute for activation memory. Composes with fully_shard: checkpoint a module
// and shard it (checkpoint_wrapper(block); fully_shard(block)); FSDP unshards its parameters before
// the recomputation (the pre-backward all-gather), so nothing extra is gathered.
//
// Mirrors torch.utils.checkpoint.checkpoint: non-reentrant by default (use_reentrant=False, saved-tensor
// hooks), reentrant on request, the RNG and autocast states of the forward restored for the recomputation
// so that dropout masks and casts match. The module form, checkpoint_wrapper, is in
// fsdp/algorithms/checkpoint_wrapper.h.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include "fsdp/utils/detail/forward_args.h"
#include "fsdp/utils/selective_checkpoint.h"

namespace fsdp {

/// The recomputable region: maps the tensor inputs to the tensor outputs.
using CheckpointFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// torch.utils.checkpoint.checkpoint's keyword arguments.
/// Example: `fsdp::CheckpointOptions().use_reentrant(true)`
struct CheckpointOptions {
  /// false: the region runs with gradients, but the tensors its ops save for backward are not kept (saved-
  /// tensor hooks, fsdp/utils/saved_tensor_hooks.h): the first time the backward needs one, the region is
  /// re-run and the recomputed tensors serve the forward's graph ([Note: non-reentrant checkpoint],
  /// src/utils/activation_checkpoint.cpp). Any inputs and outputs, inputs without grad, nested regions,
  /// parameters used inside, a backward through part of the outputs, retain_graph. true: the autograd
  /// Function form: the region runs without gradients and its backward re-runs it and backpropagates
  /// through it in a nested backward (needs an output that requires grad to be used). (Default: false, as
  /// PyTorch recommends)
  TORCH_ARG(bool, use_reentrant) = false;
  /// Restore the forward's RNG states (CPU, and the CUDA devices of the inputs) for the recomputation, so
  /// that dropout draws the same masks; the caller's states are put back after it. (Default: true)
  TORCH_ARG(bool, preserve_rng_state) = true;
  /// "default": the recomputation must save the same number of tensors, with the same shapes, dtypes and
  /// devices, in the same order, as the first run; a difference throws c10::Error in backward naming the
  /// tensor's index and both descriptions (a region that depends on state changed between forward and
  /// backward would otherwise silently give wrong gradients). "none": no check. Non-reentrant only, as in
  /// PyTorch. (Default: "default")
  TORCH_ARG(std::string, determinism_check) = "default";
  /// Selective activation checkpointing (non-reentrant only): called once per region run, it returns the
  /// region's per-op policy (fsdp/utils/selective_checkpoint.h): the outputs of the ops it saves are kept from
  /// the forward and those ops are not run again in backward; the rest is recomputed. Empty: every op is
  /// recomputed (full checkpointing). Mirrors checkpoint's context_fn=partial(create_selective_checkpoint_contexts,
  /// policy). (Default: empty)
  /// Example: `fsdp::CheckpointOptions().context_fn([] { return fsdp::create_selective_checkpoint_contexts({"aten::mm", "aten::linear"}); })`
  TORCH_ARG(std::function<SelectiveCheckpointContexts()>, context_fn);
};

/// Runs `fn(inputs)` as a checkpointed region (see CheckpointOptions). Parameters used by `fn` get their
/// gradients accumulated as usual, even when no input requires grad. Outputs are the same tensors (values)
/// `fn` returns. The autocast state of the forward (CPU and CUDA) is restored for the recomputation.
/// Throws c10::Error if `fn` returns no tensor (reentrant), for a bad determinism_check value, or for a
/// context_fn with use_reentrant(true); a failed determinism check throws from the backward.
std::vector<torch::Tensor> checkpoint_tensors(CheckpointFn fn, const std::vector<torch::Tensor>& inputs,
                                              const CheckpointOptions& options = {});

/// Functional form for any callable: checkpoint(fn, args...) returns what fn(args...) returns (a
/// Tensor, a std::vector<Tensor>, or a tuple/pair of them and other values). Tensor arguments are
/// the saved inputs; other arguments are copied and reused for the recomputation. `fn` is copied once
/// and called as a non-const object, so a `mutable` lambda works (e.g. one that calls a module holder
/// captured by value: ModuleHolder::operator() is not const); the forward and the recomputation call
/// the same copy, so state it changes in the forward is seen by the recomputation.
/// The same with options first: `fsdp::checkpoint(fsdp::CheckpointOptions().use_reentrant(true), fn, x)`.
template <typename Fn, typename... Args>
auto checkpoint(const CheckpointOptions& options, Fn fn, Args... args) {
  using Out = decltype(fn(args...));
  std::vector<torch::Tensor> ins;
  (detail::collect(ins, args), ...);
  auto stored = std::make_shared<std::tuple<Args...>>(std::move(args)...);
  // The first run keeps its output object so that non-tensor parts can be returned; the recomputation
  // does not (it would keep activations alive).
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
  auto outs = checkpoint_tensors(std::move(run), ins, options);
  Out out = std::move(**first);
  first->reset();
  size_t j = 0;
  detail::restore_out(out, outs, j);
  return out;
}

/// checkpoint(fn, args...) with the default options (non-reentrant).
/// Example: `auto y = fsdp::checkpoint([&](const torch::Tensor& x) { return block->forward(x); }, x);`
template <typename Fn, typename... Args,
          std::enable_if_t<!std::is_same_v<std::decay_t<Fn>, CheckpointOptions>, int> = 0>
auto checkpoint(Fn fn, Args... args) {
  return checkpoint(CheckpointOptions(), std::move(fn), std::move(args)...);
}

/// Runs `sequential` on `input` in `segments` pieces of size(sequential) / segments modules (the last one
/// takes the rest): every piece but the last is a checkpointed region (with `options`), the last runs
/// normally, as its activations are needed at once. Mirrors torch.utils.checkpoint.checkpoint_sequential
/// (functions, segments, input, use_reentrant=...). Throws c10::Error unless 1 <= segments <= size.
/// Example: `auto y = fsdp::checkpoint_sequential(layers, 4, x);`
torch::Tensor checkpoint_sequential(const torch::nn::Sequential& sequential, int64_t segments, torch::Tensor input,
                                    const CheckpointOptions& options = {});

}  // namespace fsdp
