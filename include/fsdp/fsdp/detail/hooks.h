// Internal (installed because the templates of fully_shard.h use it; not part of the API): the plumbing
// that routes a forward through FSDP. FSDPModule<Holder>::forward and fsdp_forward() call
// run_with_hooks(), which runs FSDPState's pre-forward (unshard, cast, register the post-backward) and
// post-forward (reshard, register the pre-backward, cast) around the call. The C++ frontend has no
// module hooks, so these entry points stand in for nn.Module.register_forward_pre_hook /
// register_forward_hook, through which FSDP2's FSDPState runs (_fsdp_state.py).
#pragma once

#include <exception>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "fsdp/utils/activation_checkpoint.h"
#include "fsdp/utils/detail/forward_args.h"

namespace fsdp {
class FSDPModuleAPI;

namespace detail {
/// The state fully_shard attaches to a module (src/fsdp/fsdp_state.h).
class FSDPState;

template <typename T>
struct is_shared_ptr : std::false_type {};
template <typename T>
struct is_shared_ptr<std::shared_ptr<T>> : std::true_type {};

/// The FSDP state attached to `module` by fully_shard, or null.
std::shared_ptr<FSDPState> state_of(const torch::nn::Module& module);
/// The state behind an FSDPModuleAPI (for the library and its tests).
FSDPState& fsdp_state(const FSDPModuleAPI& api);
/// Registers a live FSDPModule holder of `module` until the returned token (shared by the holder's
/// copies) is destroyed: a module sharded while it has one takes the holder path, otherwise (e.g. a
/// holder passed into a torch::nn::Sequential, which keeps only the module) the implicit one.
std::shared_ptr<void> hold_fsdp_forward(const torch::nn::Module& module);
/// The options checkpoint_wrapper was applied to `module` with (then FSDPModule runs its forward under
/// fsdp::checkpoint with them), or std::nullopt.
std::optional<CheckpointOptions> checkpoint_options(const torch::nn::Module& module);
/// Records that checkpoint_wrapper was applied to `module` (fsdp/algorithms/checkpoint_wrapper.h).
void mark_checkpointed(const std::shared_ptr<torch::nn::Module>& module, const CheckpointOptions& options);
/// Whether offload_wrapper was applied to `module` (then FSDPModule runs its forward under save_on_cpu), and the
/// record of it (fsdp/algorithms/checkpoint_wrapper.h).
bool is_offloaded(const torch::nn::Module& module);
void mark_offloaded(const std::shared_ptr<torch::nn::Module>& module);

/// Hook entry points used by FSDPModule and fsdp_forward. `inputs` are the tensor arguments of the
/// call; returns the tensors to call the module with (cast, and wrapped to run post-backward).
std::vector<torch::Tensor> pre_forward(FSDPState& state, std::vector<torch::Tensor> inputs);
/// Returns the outputs to hand back (pre-backward hooks registered, cast to output_dtype).
std::vector<torch::Tensor> post_forward(FSDPState& state, std::vector<torch::Tensor> outputs);
/// Called when the wrapped forward threw: leaves the group consistent and rethrows with context
/// (e.g. naming modules whose forward bypassed FSDP).
[[noreturn]] void forward_failed(FSDPState& state, std::exception_ptr error);

// Runs `call(args...)` between the FSDP pre- and post-forward of `state` (if any).
template <typename Call, typename... Args>
auto run_with_hooks(const std::shared_ptr<FSDPState>& state, Call&& call, Args&&... args) {
  if (!state) return call(std::forward<Args>(args)...);
  std::vector<torch::Tensor> ins;
  (collect(ins, args), ...);
  try {
    auto new_ins = pre_forward(*state, std::move(ins));
    size_t i = 0;
    // Braced init keeps left-to-right evaluation of the replacements.
    auto out = std::apply(call, std::tuple<decltype(replace(std::forward<Args>(args), new_ins, i))...>{
                                    replace(std::forward<Args>(args), new_ins, i)...});
    std::vector<torch::Tensor> outs;
    collect_out(outs, out);
    outs = post_forward(*state, std::move(outs));
    size_t j = 0;
    restore_out(out, outs, j);
    return out;
  } catch (...) {
    forward_failed(*state, std::current_exception());
  }
}
}  // namespace detail
}  // namespace fsdp
