// distribute_module: lay a module's parameters and buffers out on a mesh (partition_fn), and convert its
// inputs and outputs at its boundary (input_fn, output_fn); local_map: run a function written for local
// tensors on DTensors. Mirrors torch.distributed.tensor.distribute_module and
// torch.distributed.tensor.experimental.local_map.
//
// [Note: distribute_module without hooks]
// PyTorch replaces each parameter by a DTensor parameter and registers input_fn/output_fn as forward
// pre/post hooks. LibTorch has neither tensor subclasses nor forward hooks, so:
// - a distributed parameter stays the same torch::Tensor object, registered under the same name: its
//   data is replaced (set_data) by this rank's local piece, and a registry keyed by the parameter records
//   its mesh, placements and global shape; parameter_dtensor(p) gives the DTensor view of the live
//   parameter (its local tensor is the parameter itself, so gradients of DTensor ops reach p.grad()).
//   Any module works: partition_fn is called for every submodule (named_modules(), the root as ""), and
//   calls distribute_parameter / distribute_buffer for what it wants laid out; every parameter and
//   buffer left untouched is then replicated (broadcast from mesh rank 0), as PyTorch's default.
// - input_fn/output_fn are applied by the returned DistributedModule, a callable holding the module:
//   calling it runs input_fn on the arguments, the module's forward, then output_fn on the result. Code
//   that calls the module's forward directly (a parent's member call) bypasses them: call the wrapper.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "fsdp/tensor/dtensor.h"

namespace fsdp {

/// Called once per submodule (the root as "") with its FQN, the module and the mesh.
using PartitionFn = std::function<void(const std::string& name, torch::nn::Module& module, const DeviceMeshPtr& mesh)>;
/// Gets the module and its tensor arguments, returns the arguments its forward receives (same count).
using InputFn = std::function<std::vector<torch::Tensor>(torch::nn::Module& module, std::vector<torch::Tensor> inputs,
                                                         const DeviceMeshPtr& mesh)>;
/// Gets the module and its forward's output, returns what the caller receives.
using OutputFn = std::function<torch::Tensor(torch::nn::Module& module, torch::Tensor output, const DeviceMeshPtr& mesh)>;

/// Replaces parameter `name` of `module` (a direct parameter of it, e.g. "weight") by this rank's piece of
/// it under `placements` (distribute_tensor with src_data_rank: by default rank 0's values), keeping the
/// parameter object, its registration and requires_grad; records it for parameter_dtensor().
/// Collective over the mesh (the broadcast). Throws c10::Error naming the module's parameters when there
/// is no such parameter, and distribute_tensor's errors. Mirrors `module.register_parameter(name,
/// nn.Parameter(distribute_tensor(param, mesh, placements)))` in a PyTorch partition_fn.
/// Example: distribute_parameter(linear, "weight", mesh, {Shard(0)});
void distribute_parameter(torch::nn::Module& module, const std::string& name, const DeviceMeshPtr& mesh,
                          std::vector<Placement> placements, std::optional<int64_t> src_data_rank = 0);
/// The same for a buffer of `module`.
void distribute_buffer(torch::nn::Module& module, const std::string& name, const DeviceMeshPtr& mesh,
                       std::vector<Placement> placements, std::optional<int64_t> src_data_rank = 0);
/// The DTensor a parameter or buffer stands for after distribute_parameter/distribute_buffer (its local
/// tensor is `param` itself), or nullopt for a tensor that was not distributed.
/// Example: auto w = parameter_dtensor(linear->weight)->full_tensor();
std::optional<DTensor> parameter_dtensor(const torch::Tensor& param);

namespace detail {
/// partition_fn over every submodule of `root`, then Replicate() for every parameter and buffer it left.
void partition_module(torch::nn::Module& root, const DeviceMeshPtr& mesh, const PartitionFn& partition_fn);
}  // namespace detail

/// A module holder with input_fn/output_fn around its forward (see [Note: distribute_module without hooks]).
template <typename ModuleHolder>
class DistributedModule {
 public:
  DistributedModule(ModuleHolder module, DeviceMeshPtr mesh, InputFn input_fn, OutputFn output_fn)
      : module_(std::move(module)), mesh_(std::move(mesh)), input_fn_(std::move(input_fn)), output_fn_(std::move(output_fn)) {}
  /// input_fn(inputs) -> module->forward(...) -> output_fn(output). Tensor arguments only.
  template <typename... Tensors>
  torch::Tensor operator()(Tensors&&... inputs) {
    std::vector<torch::Tensor> in{torch::Tensor(std::forward<Tensors>(inputs))...};
    if (input_fn_) in = input_fn_(*module_.ptr(), std::move(in), mesh_);
    TORCH_CHECK(in.size() == sizeof...(Tensors), "distribute_module: input_fn returned ", in.size(),
                " inputs for a forward of ", sizeof...(Tensors), ": expected as many as it was given");
    torch::Tensor out = call(in, std::index_sequence_for<Tensors...>{});
    if (output_fn_) out = output_fn_(*module_.ptr(), std::move(out), mesh_);
    return out;
  }
  ModuleHolder& module() { return module_; }
  ModuleHolder& operator*() { return module_; }
  auto operator->() { return module_.operator->(); }
  const DeviceMeshPtr& device_mesh() const { return mesh_; }

 private:
  template <size_t... I>
  torch::Tensor call(const std::vector<torch::Tensor>& in, std::index_sequence<I...>) {
    return module_->forward(in[I]...);
  }
  ModuleHolder module_;
  DeviceMeshPtr mesh_;
  InputFn input_fn_;
  OutputFn output_fn_;
};

/// Lays `module`'s parameters and buffers out on `mesh`: partition_fn(name, submodule, mesh) for every
/// submodule (null: everything replicated), then Replicate() (a broadcast from mesh rank 0) for every
/// parameter and buffer not distributed. Returns the module wrapped with input_fn/output_fn (either may be
/// null). Collective over the mesh: every rank calls it with the same module structure.
/// Throws what partition_fn throws. Mirrors torch.distributed.tensor.distribute_module.
/// Example:
///   auto dm = distribute_module(torch::nn::Linear(8, 4), mesh,
///       [](const std::string&, torch::nn::Module& m, const DeviceMeshPtr& mesh) {
///         if (m.named_parameters(false).contains("weight")) distribute_parameter(m, "weight", mesh, {Shard(0)});
///       });
///   auto y = dm(x);
template <typename ModuleHolder>
DistributedModule<ModuleHolder> distribute_module(ModuleHolder module, const DeviceMeshPtr& mesh,
                                                  const PartitionFn& partition_fn = nullptr,
                                                  InputFn input_fn = nullptr, OutputFn output_fn = nullptr) {
  TORCH_CHECK(mesh, "distribute_module: expected a mesh, got null");
  detail::partition_module(*module.ptr(), mesh, partition_fn);
  return DistributedModule<ModuleHolder>(std::move(module), mesh, std::move(input_fn), std::move(output_fn));
}

/// Placements of one local_map input or output; nullopt: not a DTensor (an input is passed as its local
/// tensor unchecked; an output is returned as a Replicate DTensor of the value, which must then be
/// the same on every rank).
using OptionalPlacements = std::optional<std::vector<Placement>>;
/// A function on local tensors.
using LocalFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>& locals)>;

/// Wraps `fn` (written for local tensors) into a function on DTensors: each input's local tensor is
/// passed to fn, and each output becomes DTensor::from_local(out, mesh, out_placements[i], run_check=false)
/// (its global shape from the local ones: an all-reduce per sharded mesh dim). `in_placements` (if given,
/// one per input) are the placements fn expects: an input with other placements throws naming the input
/// and both placement lists, or with redistribute_inputs=true is redistributed (differentiably) first.
/// `mesh` defaults to the first input's. Autograd flows through fn as through any local computation.
/// Throws c10::Error for a count mismatch between outputs and out_placements or inputs and in_placements.
/// Mirrors torch.distributed.tensor.experimental.local_map(func, out_placements, in_placements,
/// device_mesh, redistribute_inputs=...).
/// Example:
///   auto f = local_map([](auto& t) { return std::vector<torch::Tensor>{t[0].relu()}; }, {{Shard(0)}}, {{{Shard(0)}}});
///   DTensor y = f({x})[0];
std::function<std::vector<DTensor>(const std::vector<DTensor>&)> local_map(
    LocalFn fn, std::vector<OptionalPlacements> out_placements,
    std::optional<std::vector<OptionalPlacements>> in_placements = std::nullopt, DeviceMeshPtr mesh = nullptr,
    bool redistribute_inputs = false);

}  // namespace fsdp
