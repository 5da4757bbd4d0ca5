// Sharded initialisation: build a model whose full size exceeds one rank's memory, shard it, then
// give each rank only its rows, with exactly the values eager construction gives.
//
//   torch::manual_seed(0);
//   auto model = fsdp::deferred_init([&] { return GPT(cfg); });   // no parameter gets memory
//   for (auto& b : *model->blocks) fsdp::fully_shard(b, opts);      // shards are allocated, not filled
//   fsdp::fully_shard(model, opts);
//   fsdp::materialize_module(model);                                // each rank fills its rows
//
// deferred_init runs the constructor with every tensor it creates on the meta device (shape and dtype,
// no storage) and records the ops it applies (torch::empty, torch::nn::init's uniform_/normal_,
// fill_, a view's in-place write, copy_ from a tensor made outside...). The model's code is unchanged.
// materialize_module replays the record in order, one parameter at a time: each parameter is created in
// full on the CPU, initialised by the recorded ops with the random stream eager construction would have
// used, its rows copied into the rank's shard, and freed. So the shards are bit-identical to the rows
// of an eagerly constructed model with the same seed, whatever the number of ranks, and the per-rank
// peak is the rank's shards plus the largest parameter (plus the few parameters one module's
// initialisation touches together, e.g. a Linear's weight and bias).
//
// What the constructor may not do under deferred_init: read values (`.item()`, `data_ptr()`, printing a
// tensor, torch::tensor({...}) from a list) - meta tensors have none; the ops that do throw a c10::Error
// naming the op. Mirrors torchdistx's deferred_init / materialize_module (PyTorch's own recipe,
// `with torch.device("meta")` + to_empty + reset_parameters, gives other values than eager init).
#pragma once

#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace fsdp {

namespace detail {
/// Starts recording on this thread (throws c10::Error if a recording is already active here).
void begin_deferred_init();
/// Stops recording and attaches the record to `module`'s parameters and buffers (nullptr: discards it).
void end_deferred_init(const std::shared_ptr<torch::nn::Module>& module);
template <typename T>
std::shared_ptr<torch::nn::Module> module_ptr_of(const std::shared_ptr<T>& m) {
  return m;
}
template <typename T>
std::shared_ptr<torch::nn::Module> module_ptr_of(const torch::nn::ModuleHolder<T>& m) {
  return m.ptr();
}
}  // namespace detail

/// Calls `make` (which returns a module: a TORCH_MODULE holder or a std::shared_ptr to a module) with
/// every tensor the constructor creates on the meta device, and records how each is initialised. The
/// returned module has meta parameters and buffers: shard it with fully_shard, then call
/// materialize_module. Not thread-safe with respect to other threads' use of the same module; other
/// threads may record their own models at the same time.
/// Throws c10::Error "deferred_init: ..." when the constructor reads a value (naming the op), or when
/// called inside another deferred_init on the same thread; what `make` throws propagates (the record
/// is discarded).
/// Mirrors torchdistx.deferred_init.deferred_init(module_fn).
template <typename F>
auto deferred_init(F&& make) -> decltype(make()) {
  detail::begin_deferred_init();
  try {
    auto m = make();
    detail::end_deferred_init(detail::module_ptr_of(m));
    return m;
  } catch (...) {
    detail::end_deferred_init(nullptr);
    throw;
  }
}

/// Gives every parameter and buffer of `module` (recursively) recorded by deferred_init its values:
/// a parameter sharded by fully_shard gets the rank's rows in its shard (on the shard's device); any
/// other parameter or buffer becomes a full CPU tensor. The record is replayed in order on the CPU with
/// a private copy of the default generator's state at deferred_init's call, so no other thread's
/// random numbers interfere; afterwards the default CPU generator is left where eager construction
/// would have left it. Collective-free: every rank replays on its own (the random stream is the same).
/// Call once, after the fully_shard calls and before the first forward (a forward with parameters not
/// yet materialised throws, naming them). Peak memory: the shards plus the full tensors alive at once
/// during the replay (one parameter, or the few one module's initialisation touches together).
/// Throws c10::Error "materialize_module: ..." naming the parameter (FQN), the rank-independent
/// reason and the fix: when the module has nothing to materialise, when a recorded op changed a
/// parameter's shape (created as [a, b], left [c, d] by its initialisation), or when an op fails.
/// Mirrors torchdistx.deferred_init.materialize_module(module).
void materialize_module(const std::shared_ptr<torch::nn::Module>& module);
template <typename T>
void materialize_module(const torch::nn::ModuleHolder<T>& module) {
  materialize_module(std::static_pointer_cast<torch::nn::Module>(module.ptr()));
}

/// Gives every parameter and buffer of `module` recorded by deferred_init memory without running the
/// recorded initialisation: sharded parameters keep their zero-filled shards, other parameters and
/// buffers become zero-filled CPU tensors of their shapes. For a model whose values come from a
/// checkpoint next (`fsdp::dcp::load` reads each rank's rows straight into its shards), so that no
/// rank spends the time to draw initial values or ever holds a full parameter. The default generator
/// is not advanced. Throws c10::Error "to_empty: ..." when nothing of `module` waits for
/// materialisation. Mirrors torch.nn.Module.to_empty(device=...) after construction on the meta device.
void to_empty(const std::shared_ptr<torch::nn::Module>& module);
template <typename T>
void to_empty(const torch::nn::ModuleHolder<T>& module) {
  to_empty(std::static_pointer_cast<torch::nn::Module>(module.ptr()));
}

/// Whether `t` is still waiting for materialize_module (a meta tensor recorded by deferred_init, or a
/// sharded parameter whose shard is not filled yet).
bool is_deferred(const torch::Tensor& t);

}  // namespace fsdp
