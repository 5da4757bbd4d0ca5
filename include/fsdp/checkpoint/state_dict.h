// State dicts of sharded modules and their optimizers: what a checkpoint saves, and where it loads.
//
//   // Save: every rank writes its own shards (see fsdp/checkpoint/checkpoint.h).
//   fsdp::dcp::save(fsdp::get_state_dict(model, opt), "ckpt/step-1000");
//
//   // Load, on any number of ranks: the dict's DTensors alias the local shards, so dcp::load writes
//   // the parameters and the optimizer state in place; set_state_dict then applies what cannot be
//   // aliased (step counts, hyper-parameters, optimizer state that did not exist yet).
//   auto sd = fsdp::get_state_dict(model, opt);
//   fsdp::dcp::load(sd, "ckpt/step-1000");
//   fsdp::set_state_dict(model, opt, sd);
//
// Keys are fully qualified names (FQNs) from the module passed in, as model->named_parameters() gives
// them; never optimizer indices. The layout is what PyTorch's DCP writes for the dicts of
// torch.distributed.checkpoint.state_dict:
//   model:      "<fqn>"                                  parameters (DTensor when sharded) and buffers
//   optimizer:  "state.<fqn>.<name>"                     per-parameter state tensors (exp_avg, sum, square_avg,
//                                                        momentum_buffer, ...: see optimizer_adapter.h),
//                                                        sharded like the parameter; "step": a Value
//     flattened (flatten_optimizer_state_dict, our default):
//               "param_groups.<fqn>.<hyper-parameter>"   lr, betas, eps, weight_decay, ...: Values
//     nested (PyTorch's default, as its DCP flattens {"state": ..., "param_groups": [...]}):
//               "param_groups.<i>.<hyper-parameter>"     group i over every optimizer in order: Values
//               "param_groups.<i>.params"                a Value: the list of the group's FQNs
//   both:       "model.<model key>", "optim.<optimizer key>"   (get_state_dict / set_state_dict)
// Several optimizers over one model share the optimizer keys (each parameter in exactly one of them).
//
// Mirrors torch.distributed.checkpoint.state_dict.{get,set}_{model,optimizer,}_state_dict.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include "fsdp/checkpoint/optimizer_adapter.h"
#include "fsdp/tensor/dtensor.h"

namespace fsdp {

/// A non-tensor entry of a state dict (a step count, a hyper-parameter, a data-loader position):
/// any JSON value. Checkpoints keep it in their JSON metadata file.
struct Value {
  /// The value.
  nlohmann::json json;
  /// True when every rank holds its own value (e.g. the position of a rank's data loader): each rank
  /// saves its own and gets it back on load, which therefore needs the same world size (loading on
  /// another world size fails: such state cannot be resharded). False: the value is the same on every
  /// rank and rank 0's is saved. (Default: false)
  bool per_rank = false;

  Value() = default;
  Value(nlohmann::json json, bool per_rank = false) : json(std::move(json)), per_rank(per_rank) {}  // NOLINT
};

/// A value that differs between ranks (see Value::per_rank).
inline Value per_rank_value(nlohmann::json json) { return Value(std::move(json), /*per_rank=*/true); }

/// One entry: a sharded tensor (DTensor), a tensor every rank holds in full (replicated), or a Value.
using StateDictValue = std::variant<DTensor, torch::Tensor, Value>;

class Stateful;  // fsdp/checkpoint/stateful.h

/// An ordered map from key (FQN) to StateDictValue. Iteration follows insertion order, which is the
/// module's parameter order for dicts built by get_*_state_dict (and the order of collectives they
/// issue, identical on every rank).
class StateDict {
 public:
  using Item = std::pair<std::string, StateDictValue>;
  using iterator = std::vector<Item>::iterator;
  using const_iterator = std::vector<Item>::const_iterator;

  /// Inserts `key`, or replaces its value in place (keeping its position).
  void insert_or_assign(const std::string& key, StateDictValue value);
  /// True when `key` is present.
  bool contains(const std::string& key) const { return index_.count(key) > 0; }
  /// The value of `key`, or null.
  StateDictValue* find(const std::string& key);
  const StateDictValue* find(const std::string& key) const;
  /// The value of `key`. Throws c10::Error naming the key (and a few present keys) when absent.
  StateDictValue& at(const std::string& key);
  const StateDictValue& at(const std::string& key) const;
  /// Removes `key`; returns whether it was present. O(size).
  bool erase(const std::string& key);
  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  iterator begin() { return items_.begin(); }
  iterator end() { return items_.end(); }
  const_iterator begin() const { return items_.begin(); }
  const_iterator end() const { return items_.end(); }
  /// Keys in order.
  std::vector<std::string> keys() const;
  /// The entries whose key starts with `prefix`, with the prefix removed when `strip` (values are
  /// shared: tensors alias, as in the source dict).
  StateDict with_prefix(const std::string& prefix, bool strip = true) const;
  /// Appends every entry of `other` with `prefix` prepended to its key.
  void update(const StateDict& other, const std::string& prefix = "");

  /// Adds (or replaces) a Stateful object under `key` (fsdp/checkpoint/stateful.h): dcp::save stores
  /// what its state_dict() returns under "<key>.", dcp::load hands the loaded entries to its
  /// load_state_dict(). It is not an entry of the map: iteration, size() and find() do not see it, and
  /// only dcp::save, async_save and load use it. Mirrors a Stateful value in PyTorch's DCP state dicts.
  /// Example: `sd.insert_or_assign("loader", std::make_shared<MyLoader>())`
  void insert_or_assign(const std::string& key, std::shared_ptr<Stateful> object) {
    for (auto& [k, o] : stateful_) {
      if (k == key) {
        o = std::move(object);
        return;
      }
    }
    stateful_.emplace_back(key, std::move(object));
  }
  /// The Stateful objects, in insertion order.
  const std::vector<std::pair<std::string, std::shared_ptr<Stateful>>>& stateful() const { return stateful_; }

 private:
  std::vector<Item> items_;
  std::unordered_map<std::string, size_t> index_;
  std::vector<std::pair<std::string, std::shared_ptr<Stateful>>> stateful_;
};

/// "DTensor", "Tensor" or "Value" (for messages).
const char* kind_name(const StateDictValue& value);

/// Options of the get/set state dict functions. Mirrors torch's StateDictOptions.
/// Example: `fsdp::get_model_state_dict(model, fsdp::StateDictOptions().full_state_dict(true).cpu_offload(true))`
struct StateDictOptions {
  /// get: gather full tensors (a collective over each parameter's mesh) instead of DTensors aliasing the
  /// local shards. (set accepts either: a full tensor is sliced locally into each rank's shard; a DTensor
  /// must be sharded like its destination.) (Default: false)
  TORCH_ARG(bool, full_state_dict) = false;
  /// With full_state_dict: the full tensors are copied to the CPU and only rank 0 keeps them (other
  /// ranks get an empty dict). Without: every rank gets its dict with each tensor on the CPU (sharded
  /// entries: DTensors of the same placements whose local tensors are CPU copies), as PyTorch's
  /// _offload_state_dict_to_cpu; a tensor already on the CPU is not copied (Tensor.to). (Default: false)
  TORCH_ARG(bool, cpu_offload) = false;
  /// Leave out parameters that do not require grad (and, on set, do not report them missing).
  /// (Default: false)
  TORCH_ARG(bool, ignore_frozen_params) = false;
  /// set: a key the module (or optimizer) expects but the dict lacks, or a key the dict holds but
  /// nothing expects, is an error. Otherwise they are reported in LoadResult. (Default: true)
  TORCH_ARG(bool, strict) = true;
  /// set: only rank 0's dict is read (full tensors; other ranks may pass an empty dict); every tensor
  /// is broadcast from rank 0 and sliced locally. Collective over the model's world group. (Default: false)
  TORCH_ARG(bool, broadcast_from_rank0) = false;
  /// The optimizer layout (see the top of this file). true: "param_groups.<fqn>.<hp>" for every parameter,
  /// as PyTorch's flatten_optimizer_state_dict=True. false: PyTorch's nested layout as its DCP stores it,
  /// "param_groups.<i>.<hp>" and "param_groups.<i>.params" (the list of FQNs). The "state.*" keys are the
  /// same in both. Our default is true, unlike PyTorch's (false): the checkpoints written before the
  /// option existed are flattened, and a flattened dict reshards across any change of param groups.
  /// set_* must be given the layout the dict has. (Default: true)
  TORCH_ARG(bool, flatten_optimizer_state_dict) = true;
};

/// Keys a non-strict load skipped. Mirrors torch.nn.modules.module._IncompatibleKeys.
struct LoadResult {
  /// Expected but absent from the source: left unchanged.
  std::vector<std::string> missing_keys;
  /// Present in the source but not expected: ignored.
  std::vector<std::string> unexpected_keys;
  /// dcp::load only: bytes of checkpoint files this rank read (safetensors headers, our metadata file,
  /// and the tensor data it needed); 0 for the in-memory loads.
  int64_t bytes_read = 0;
};

/// Prefixes of the combined dict of get_state_dict.
constexpr const char* kModelPrefix = "model.";
constexpr const char* kOptimPrefix = "optim.";

/// The model's parameters and buffers by FQN. Sharded parameters are DTensors aliasing the local shard
/// (no communication, no copy); other parameters and buffers are tensors aliasing the module's. Every
/// FSDP group under `model` is resharded first (as FSDP2 does). With full_state_dict, sharded
/// parameters are gathered (collective; call on every rank).
StateDict get_model_state_dict(const torch::nn::Module& model, const StateDictOptions& options = {});

/// Copies `state_dict` into the model's parameters and buffers in place (under NoGradGuard), so the
/// module, an optimizer and the autograd graph keep their tensors. Everything is validated first
/// (keys with strict, shapes, dtypes, layouts), and the ranks agree (one all-reduce over the model's
/// world group: call it on every rank) before any copies: on error nothing is changed on any rank.
/// Throws c10::Error naming the FQN and the rank, e.g. "set_model_state_dict: 'fc1.weight' has shape
/// [4, 6] in the state dict but [5, 6] in the destination (rank 0) ... (nothing was loaded on any
/// rank)"; the other ranks throw "set_model_state_dict: rank 0 failed: <that message>".
LoadResult set_model_state_dict(torch::nn::Module& model, const StateDict& state_dict,
                                const StateDictOptions& options = {});

/// The optimizer's state keyed by parameter FQN (see the key layout at the top of this file), for every
/// optimizer type with an adapter (torch::optim Adam, AdamW, SGD, Adagrad, RMSprop, and those registered
/// with register_optimizer_adapter: fsdp/checkpoint/optimizer_adapter.h). State tensors of sharded
/// parameters are DTensors with the parameter's placements, aliasing the optimizer's tensors. A parameter
/// without state yet (before its first step) is reported with the state the optimizer would create and
/// step 0, as PyTorch's get_optimizer_state_dict initialises it (it is not attached to the optimizer:
/// set_optimizer_state_dict does that). Throws c10::Error for a type without an adapter (naming it and the
/// registration call), torch::optim::LBFGS (its state is not per parameter) or a parameter that is not
/// in `model`. Mirrors torch.distributed.checkpoint.state_dict.get_optimizer_state_dict.
/// Example: `auto osd = fsdp::get_optimizer_state_dict(model, opt)`
StateDict get_optimizer_state_dict(const torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
                                   const StateDictOptions& options = {});

/// get_optimizer_state_dict of several optimizers over one model (PyTorch: `optimizers` an iterable): one
/// dict keyed by FQN. Throws naming the FQN when a parameter is in two optimizers (or two groups).
/// Example: `fsdp::get_optimizer_state_dict(model, {adam.get(), sgd.get()})`
StateDict get_optimizer_state_dict(const torch::nn::Module& model,
                                   const std::vector<const torch::optim::Optimizer*>& optimizers,
                                   const StateDictOptions& options = {});

/// Loads optimizer state keyed by FQN into `optimizer`: state tensors are copied in place, state is
/// created for parameters that have none (torch::optim creates it lazily at the first step), step
/// counts and the hyper-parameters of each param group are set (every parameter of a group must bring
/// the same values; in the nested layout a group takes the saved group that lists its FQNs, which must
/// list exactly them). Validated first, and agreed by all ranks like set_model_state_dict (collective):
/// on error nothing is changed on any rank. Mirrors set_optimizer_state_dict.
/// Example: `fsdp::set_optimizer_state_dict(model, opt, osd)`
LoadResult set_optimizer_state_dict(const torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                    const StateDict& state_dict, const StateDictOptions& options = {});

/// set_optimizer_state_dict into several optimizers over one model (each takes the keys of its parameters).
/// Example: `fsdp::set_optimizer_state_dict(model, {adam.get(), sgd.get()}, osd)`
LoadResult set_optimizer_state_dict(const torch::nn::Module& model, const std::vector<torch::optim::Optimizer*>& optimizers,
                                    const StateDict& state_dict, const StateDictOptions& options = {});

/// get_model_state_dict under "model." and get_optimizer_state_dict under "optim.": the one dict that
/// dcp::save takes.
/// Example: `fsdp::dcp::save(fsdp::get_state_dict(model, opt), dir)`
StateDict get_state_dict(const torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
                         const StateDictOptions& options = {});
/// get_state_dict with several optimizers. Example: `fsdp::get_state_dict(model, {opt1.get(), opt2.get()})`
StateDict get_state_dict(const torch::nn::Module& model, const std::vector<const torch::optim::Optimizer*>& optimizers,
                         const StateDictOptions& options = {});

/// Loads a dict of get_state_dict's layout into the model and the optimizer. With strict, a key under
/// neither prefix is unexpected. Both parts are validated (on every rank: collective) before either is
/// changed.
/// Example: `fsdp::set_state_dict(model, opt, sd)`
LoadResult set_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const StateDict& state_dict,
                          const StateDictOptions& options = {});
/// set_state_dict with several optimizers. Example: `fsdp::set_state_dict(model, {opt1.get(), opt2.get()}, sd)`
LoadResult set_state_dict(torch::nn::Module& model, const std::vector<torch::optim::Optimizer*>& optimizers,
                          const StateDict& state_dict, const StateDictOptions& options = {});

// Overloads for module holders (Net, fsdp::FSDPModule<Net>, ...): pass the holder as you would the module.
template <typename T>
StateDict get_model_state_dict(const torch::nn::ModuleHolder<T>& model, const StateDictOptions& options = {}) {
  return get_model_state_dict(*model, options);
}
template <typename T>
StateDict get_optimizer_state_dict(const torch::nn::ModuleHolder<T>& model, const torch::optim::Optimizer& optimizer,
                                   const StateDictOptions& options = {}) {
  return get_optimizer_state_dict(*model, optimizer, options);
}
template <typename T>
StateDict get_state_dict(const torch::nn::ModuleHolder<T>& model, const torch::optim::Optimizer& optimizer,
                         const StateDictOptions& options = {}) {
  return get_state_dict(*model, optimizer, options);
}
template <typename T>
LoadResult set_model_state_dict(const torch::nn::ModuleHolder<T>& model, const StateDict& state_dict,
                                const StateDictOptions& options = {}) {
  return set_model_state_dict(*model.ptr(), state_dict, options);
}
template <typename T>
LoadResult set_optimizer_state_dict(const torch::nn::ModuleHolder<T>& model, torch::optim::Optimizer& optimizer,
                                    const StateDict& state_dict, const StateDictOptions& options = {}) {
  return set_optimizer_state_dict(*model, optimizer, state_dict, options);
}
template <typename T>
LoadResult set_state_dict(const torch::nn::ModuleHolder<T>& model, torch::optim::Optimizer& optimizer,
                          const StateDict& state_dict, const StateDictOptions& options = {}) {
  return set_state_dict(*model.ptr(), optimizer, state_dict, options);
}
template <typename T>
StateDict get_optimizer_state_dict(const torch::nn::ModuleHolder<T>& model,
                                   const std::vector<const torch::optim::Optimizer*>& optimizers,
                                   const StateDictOptions& options = {}) {
  return get_optimizer_state_dict(*model, optimizers, options);
}
template <typename T>
StateDict get_state_dict(const torch::nn::ModuleHolder<T>& model,
                         const std::vector<const torch::optim::Optimizer*>& optimizers,
                         const StateDictOptions& options = {}) {
  return get_state_dict(*model, optimizers, options);
}
template <typename T>
LoadResult set_optimizer_state_dict(const torch::nn::ModuleHolder<T>& model,
                                    const std::vector<torch::optim::Optimizer*>& optimizers,
                                    const StateDict& state_dict, const StateDictOptions& options = {}) {
  return set_optimizer_state_dict(*model, optimizers, state_dict, options);
}
template <typename T>
LoadResult set_state_dict(const torch::nn::ModuleHolder<T>& model, const std::vector<torch::optim::Optimizer*>& optimizers,
                          const StateDict& state_dict, const StateDictOptions& options = {}) {
  return set_state_dict(*model.ptr(), optimizers, state_dict, options);
}

}  // namespace fsdp
