// How the optimizer state dicts (fsdp/checkpoint/state_dict.h) read and write one optimizer type: its
// hyper-parameters, its per-parameter state tensors, its step count and the state a parameter gets before
// its first step. torch::optim's optimizers are registered already; register your own with one call:
//
//   fsdp::register_optimizer_adapter<MyOpt>(my_adapter);   // then get/set_optimizer_state_dict take MyOpt
//
// PyTorch needs no such thing (Optimizer.state_dict() is a generic dict of per-parameter dicts); LibTorch's
// optimizers keep typed state (AdamParamState, ...) and typed options, so something must name the fields.
// The names are PyTorch's: a state dict key is "state.<fqn>.<state name>" or "param_groups.<fqn>.<hp name>"
// (or "param_groups.<group>.<hp name>" in the nested layout), exactly as torch.optim spells them, so that
// checkpoints interchange with PyTorch's.
//
// Built-in adapters (state names per parameter; "step" is a Value):
//   torch::optim::Adam, AdamW  exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad), step
//   torch::optim::SGD          momentum_buffer (momentum != 0)
//   torch::optim::Adagrad      sum, step
//   torch::optim::RMSprop      square_avg, momentum_buffer (momentum > 0), grad_avg (centered), step
//   torch::optim::LBFGS        refused: its state is one set of tensors flat over all parameters, not per
//                              parameter, so it can be neither keyed by FQN nor sharded (see `unsupported`).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <typeindex>
#include <typeinfo>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

namespace fsdp {

/// What the optimizer state dicts need to know about one optimizer type. Every function is called with
/// the optimizer's own OptimizerOptions / OptimizerParamState subclasses (cast them with static_cast or
/// dynamic_cast). The functions must not communicate: the state dicts call them in their validation phase.
/// Example: see register_optimizer_adapter, or make_builtin adapters in src/checkpoint/optimizer_adapters.cpp.
struct OptimizerAdapter {
  /// The type's name in messages, e.g. "torch::optim::Adagrad".
  std::string name;
  /// Non-empty: the type is known but has no state dict; get/set_optimizer_state_dict throw this reason
  /// (with the type's name). The other fields are then unused.
  std::string unsupported;
  /// The hyper-parameters of a param group, PyTorch's names in PyTorch's order (e.g. {"lr", "betas", "eps",
  /// "weight_decay", "amsgrad"}): keys "param_groups.<fqn>.<name>".
  std::vector<std::string> hparam_names;
  /// A param group's hyper-parameters as a JSON object holding every name of hparam_names (numbers, bools,
  /// [beta1, beta2] arrays, null for an unset optional).
  std::function<nlohmann::json(const torch::optim::OptimizerOptions&)> get_hparams;
  /// Sets a param group's options from a JSON object holding every name of hparam_names, each accepted by
  /// check_hparam. It may throw on a value it cannot take: a load runs it on a copy of the options
  /// (OptimizerOptions::clone) while validating, so the error changes nothing.
  std::function<void(torch::optim::OptimizerOptions&, const nlohmann::json&)> set_hparams;
  /// "" when `value` is a valid value of hyper-parameter `name`, else what is wrong (e.g. "expected a
  /// number"), which the load's error message quotes. Empty function: any JSON value is accepted.
  std::function<std::string(const std::string& name, const nlohmann::json& value)> check_hparam;
  /// The per-parameter state tensors under a group's hyper-parameters (PyTorch's names: e.g. {"exp_avg",
  /// "exp_avg_sq"}, plus "max_exp_avg_sq" when hparams["amsgrad"]). Each has the parameter's shape and
  /// dtype and is sharded like it: keys "state.<fqn>.<name>".
  std::function<std::vector<std::string>(const nlohmann::json& hparams)> state_names;
  /// The state tensor `name` (one of state_names) inside `state`, to read and to write in place; null
  /// when the state type has no such field. The tensor may be undefined (the load then creates it).
  std::function<torch::Tensor*(torch::optim::OptimizerParamState& state, const std::string& name)> state_tensor;
  /// Whether the state counts steps: key "state.<fqn>.step", a Value holding a non-negative integer.
  bool has_step = false;
  /// The step count of `state` (has_step only).
  std::function<int64_t(const torch::optim::OptimizerParamState& state)> get_step;
  /// Sets the step count of `state` (has_step only). Must not throw (it runs in the apply phase).
  std::function<void(torch::optim::OptimizerParamState& state, int64_t step)> set_step;
  /// New state for a parameter that has none yet, with step 0 and every tensor of state_names(hparams)
  /// like `like` (the parameter's local shard): what the optimizer's constructor or first step creates
  /// (zeros for Adam; initial_accumulator_value for Adagrad). get_optimizer_state_dict reports it for a
  /// parameter before its first step; set_optimizer_state_dict attaches it before copying into it.
  std::function<std::unique_ptr<torch::optim::OptimizerParamState>(const nlohmann::json& hparams,
                                                                   const torch::Tensor& like)>
      init_state;
};

/// Registers (or replaces) the adapter of optimizer type `type`, matched exactly against the optimizer's
/// dynamic type (a subclass of a registered type needs its own registration). Thread-safe. Throws
/// c10::Error when a field that the adapter needs is empty (a function, or the name).
/// Example: `fsdp::register_optimizer_adapter(typeid(MyOpt), adapter)`
void register_optimizer_adapter(std::type_index type, OptimizerAdapter adapter);

/// register_optimizer_adapter for the type Opt (a torch::optim::Optimizer subclass).
/// Example: `fsdp::register_optimizer_adapter<MyOpt>({.name = "MyOpt", .hparam_names = {"lr"}, ...})`
template <typename Opt>
void register_optimizer_adapter(OptimizerAdapter adapter) {
  static_assert(std::is_base_of_v<torch::optim::Optimizer, Opt>, "Opt must be a torch::optim::Optimizer");
  register_optimizer_adapter(std::type_index(typeid(Opt)), std::move(adapter));
}

/// The adapter of `optimizer`'s dynamic type. Throws c10::Error when the type is not registered (naming
/// the type and register_optimizer_adapter) or registered as unsupported (giving the reason); `api`
/// prefixes the message. The returned adapter stays valid when the type is registered again.
/// Example: `fsdp::optimizer_adapter(opt)->state_names(hp)`
std::shared_ptr<const OptimizerAdapter> optimizer_adapter(const torch::optim::Optimizer& optimizer,
                                                          const char* api = "optimizer_adapter");

}  // namespace fsdp
