// The parallel styles that act at a module's boundary (its inputs and outputs) rather than on its parameters:
// PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput, and the interface of a user-defined style.
// Mirrors torch.distributed.tensor.parallel.{PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput,
// ParallelStyle}. They are plan entries of fsdp::tp::parallelize_module like ColwiseParallel:
//
//   tp::parallelize_module(model, mesh["tp"], {
//       {"h.0",  tp::PrepareModuleInput().input_layouts({Replicate()}).desired_input_layouts({Shard(1)})},
//       {"h.3",  tp::PrepareModuleOutput().output_layouts({Shard(1)}).desired_output_layouts({Replicate()})},
//       {"h.*.attn.c_attn", tp::ColwiseParallel()}, ...});
//
// LibTorch has no forward hooks, so the redistribution needs a call boundary the library owns:
// see [Note: module boundaries] in src/tensor/parallel/prepare_module.cpp. In short, a module qualifies when it is
// called through an fsdp::FSDPModule<T> holder (declare `fsdp::FSDPModule<Block> block` where the parent declares
// `Block block`; it needs no fully_shard) or as an entry of a torch::nn::Sequential (one tensor in, one tensor out).
// Any other module (e.g. a ModuleList entry called as `h[i]->as<Block>()->forward(x)`) is refused by
// parallelize_module with a c10::Error naming its FQN and this fix: its input also feeds code the library never
// sees (a block's residual add), so redistributing at the first op on its parameters would be silently wrong.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "fsdp/tensor/device_mesh.h"
#include "fsdp/tensor/dtensor.h"
#include "fsdp/tensor/parallel/tensor_parallel.h"

namespace fsdp::tp {

/// One entry of input_layouts / output_layouts: a placement on the 1-D TP mesh, or std::nullopt for an argument
/// (or result) left as it is (PyTorch's None, e.g. for a non-tensor argument).
using Layouts = std::vector<std::optional<Placement>>;

/// The interface of a user-defined parallel style (PyTorch's abstract ParallelStyle): implement `_apply`, which
/// parallelises `module` on `device_mesh` (e.g. by calling parallelize_module on its submodules with built-in
/// styles, or by registering boundary hooks with register_forward_pre_hook / register_forward_hook below), and
/// optionally `validate`, which parallelize_module calls for every plan entry before it changes anything (throw a
/// c10::Error there so that a bad plan leaves the model untouched on every rank). Put it in a plan with
/// tp::user_style. Mirrors torch.distributed.tensor.parallel.ParallelStyle._apply(module, device_mesh).
/// Example: `struct Mine : tp::UserParallelStyle { void _apply(const std::shared_ptr<torch::nn::Module>& m,
///           const DeviceMeshPtr& mesh) const override { ... } };  plan = {{"blocks.*", tp::user_style(std::make_shared<Mine>())}};`
class UserParallelStyle {
 public:
  virtual ~UserParallelStyle() = default;
  /// Parallelises `module` (the plan entry's module) on the 1-D `device_mesh`. May throw c10::Error.
  virtual void _apply(const std::shared_ptr<torch::nn::Module>& module, const DeviceMeshPtr& device_mesh) const = 0;
  /// Checks that `_apply` can succeed on `module` (its FQN `fqn` in the model, "" for the model itself), before
  /// parallelize_module changes anything. Default: accepts everything.
  virtual void validate(const std::string& fqn, const std::shared_ptr<torch::nn::Module>& module,
                        const DeviceMeshPtr& device_mesh) const {}
  /// A name for messages, e.g. "PrepareModuleInput(input_layouts=(Replicate(),), ...)".
  virtual std::string str() const { return "UserParallelStyle"; }
};

/// A plan entry that runs `style` (kind CUSTOM). Throws c10::Error if `style` is null.
/// Example: `{"blocks.*", tp::user_style(std::make_shared<MyStyle>())}`.
ParallelStyle user_style(std::shared_ptr<const UserParallelStyle> style);

/// Redistributes a module's tensor arguments before its forward: argument i arrives with layout input_layouts[i] on
/// the TP mesh and the module receives it with desired_input_layouts[i] (both std::nullopt: left as is). Entries
/// count the forward's positional arguments (a non-tensor argument needs std::nullopt, as PyTorch's None); LibTorch
/// forwards have no keyword arguments, so PyTorch's input_kwarg_layouts has no counterpart. Supported moves on the
/// 1-D mesh (with autograd, the gradients as PyTorch's DTensor redistribute gives them):
///   Replicate -> Shard(d): this rank's torch.chunk of dim d (uneven and empty chunks allowed); backward all-gathers;
///   Shard(d) -> Replicate: all-gather along d (the chunks may be uneven: their sizes are all-gathered first);
///     backward keeps this rank's chunk; Shard(d) -> Shard(e): both; Partial -> Replicate: all-reduce (sum), backward
///   identity; Partial -> Shard(d): all-reduce then chunk; equal layouts: nothing. A move to Partial is refused.
/// use_local_output: a LibTorch forward takes torch::Tensor, so the module always receives the local tensor (with
/// PyTorch's default false it would receive a DTensor); kept for PyTorch's spelling, both values behave alike.
/// Thrown c10::Error: at parallelize_module for layouts of different lengths, a move to Partial, or a module without a
/// boundary (see the top of this file); at the call for a number of arguments other than the layouts' or a layout
/// on a non-tensor argument (the same on every rank: the calls are the same), a Shard dim out of range.
/// Mirrors torch.distributed.tensor.parallel.PrepareModuleInput.
/// Example: `tp::PrepareModuleInput().input_layouts({Shard(1)}).desired_input_layouts({Replicate()})`.
struct PrepareModuleInput {
  Layouts input_layouts_, desired_input_layouts_;
  bool use_local_output_ = false;
  PrepareModuleInput& input_layouts(Layouts l) { input_layouts_ = std::move(l); return *this; }
  PrepareModuleInput& desired_input_layouts(Layouts l) { desired_input_layouts_ = std::move(l); return *this; }
  PrepareModuleInput& use_local_output(bool v) { use_local_output_ = v; return *this; }
  /// The plan entry (kind CUSTOM); implicit so that `{"h.0", tp::PrepareModuleInput()...}` is a plan entry.
  operator ParallelStyle() const;  // NOLINT
};

/// Redistributes a module's outputs after its forward: output i (a torch::Tensor result is output 0; a
/// std::vector<Tensor>, tuple or pair of them counts its tensors in order) has layout output_layouts[i] and
/// the caller receives it with desired_output_layouts[i]. Moves and errors as PrepareModuleInput. use_local_output
/// (PyTorch's default true): the caller always gets the local tensor (a LibTorch forward returns torch::Tensor),
/// both values behave alike. Mirrors torch.distributed.tensor.parallel.PrepareModuleOutput.
/// Example: `tp::PrepareModuleOutput().output_layouts({Shard(1)}).desired_output_layouts({Replicate()})`.
struct PrepareModuleOutput {
  Layouts output_layouts_, desired_output_layouts_;
  bool use_local_output_ = true;
  PrepareModuleOutput& output_layouts(Layouts l) { output_layouts_ = std::move(l); return *this; }
  PrepareModuleOutput& desired_output_layouts(Layouts l) { desired_output_layouts_ = std::move(l); return *this; }
  PrepareModuleOutput& use_local_output(bool v) { use_local_output_ = v; return *this; }
  operator ParallelStyle() const;  // NOLINT
};

/// Both of the above on one module (one plan entry cannot name a module twice).
/// Mirrors torch.distributed.tensor.parallel.PrepareModuleInputOutput.
/// Example: `tp::PrepareModuleInputOutput().input_layouts({Replicate()}).desired_input_layouts({Shard(1)})
///           .output_layouts({Shard(1)}).desired_output_layouts({Replicate()})`.
struct PrepareModuleInputOutput {
  PrepareModuleInput in;
  PrepareModuleOutput out;
  PrepareModuleInputOutput& input_layouts(Layouts l) { in.input_layouts(std::move(l)); return *this; }
  PrepareModuleInputOutput& desired_input_layouts(Layouts l) { in.desired_input_layouts(std::move(l)); return *this; }
  PrepareModuleInputOutput& use_local_input(bool v) { in.use_local_output(v); return *this; }
  PrepareModuleInputOutput& output_layouts(Layouts l) { out.output_layouts(std::move(l)); return *this; }
  PrepareModuleInputOutput& desired_output_layouts(Layouts l) { out.desired_output_layouts(std::move(l)); return *this; }
  PrepareModuleInputOutput& use_local_output(bool v) { out.use_local_output(v); return *this; }
  operator ParallelStyle() const;  // NOLINT
};

/// A boundary hook: receives the module's tensor arguments (or results) in order, an undefined tensor for each
/// non-tensor one, and returns the tensors to use instead (same count; an undefined entry keeps the original).
using BoundaryHook = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// Runs `hook` on `module`'s arguments before each forward that goes through a boundary (an fsdp::FSDPModule holder
/// or a torch::nn::Sequential entry; see the top of this file), for user-defined styles. Only inside
/// parallelize_module (a UserParallelStyle's _apply): the boundary is checked against the model being parallelised
/// and a c10::Error names the module and the fix when there is none. Mirrors nn.Module.register_forward_pre_hook.
/// Example: `tp::register_forward_pre_hook(module, [](const auto& in) { return std::vector{in[0] * 2}; });`
void register_forward_pre_hook(const std::shared_ptr<torch::nn::Module>& module, BoundaryHook hook);
/// The same after the forward, on its outputs. Mirrors nn.Module.register_forward_hook.
void register_forward_hook(const std::shared_ptr<torch::nn::Module>& module, BoundaryHook hook);

/// The move of PrepareModuleInput/Output as a function: the local tensor `x` of a DTensor with placement `from` on the
/// 1-D `mesh` -> its local tensor with placement `to`, differentiable (see PrepareModuleInput for the moves).
/// Throws c10::Error for a move to Partial or a Shard dim out of range.
/// Example: `auto full = tp::redistribute_local(x, mesh["tp"], Shard(1), Replicate());`
torch::Tensor redistribute_local(const torch::Tensor& x, const DeviceMeshPtr& mesh, const Placement& from,
                                 const Placement& to);

}  // namespace fsdp::tp
