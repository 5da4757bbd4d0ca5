// The optimizer adapter registry (include/fsdp/checkpoint/optimizer_adapter.h) and the adapters of
// torch::optim's optimizers. Names are torch.optim's (torch/optim/{adam,adamw,sgd,adagrad,rmsprop}.py):
// the per-parameter state dicts and param_group keys of Optimizer.state_dict(), so that a libfsdp state
// dict maps key for key onto PyTorch's. Hyper-parameters LibTorch does not have (foreach, maximize,
// capturable, fused, differentiable) are neither written nor expected.
#include "fsdp/checkpoint/optimizer_adapter.h"

#include <mutex>
#include <unordered_map>

#include <c10/util/Exception.h>
#include <c10/util/TypeIndex.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

namespace fsdp {

namespace {

namespace optim = torch::optim;

/// check_hparam of the built-ins: "betas" a pair of numbers, the names in `bools` booleans, the rest numbers.
std::function<std::string(const std::string&, const nlohmann::json&)> typed_check(std::vector<std::string> bools) {
  return [bools = std::move(bools)](const std::string& name, const nlohmann::json& v) -> std::string {
    if (std::find(bools.begin(), bools.end(), name) != bools.end()) return v.is_boolean() ? "" : "expected a boolean";
    if (name == "betas") {
      return v.is_array() && v.size() == 2 && v[0].is_number() && v[1].is_number() ? "" : "expected [beta1, beta2]";
    }
    return v.is_number() ? "" : "expected a number";
  };
}

// Adam and AdamW: the same fields in two unrelated LibTorch types.
template <typename Options, typename State>
OptimizerAdapter adam_like(const char* name) {
  OptimizerAdapter a;
  a.name = name;
  a.hparam_names = {"lr", "betas", "eps", "weight_decay", "amsgrad"};
  a.get_hparams = [](const optim::OptimizerOptions& o) -> nlohmann::json {
    const auto& x = static_cast<const Options&>(o);
    return {{"lr", x.lr()},
            {"betas", {std::get<0>(x.betas()), std::get<1>(x.betas())}},
            {"eps", x.eps()},
            {"weight_decay", x.weight_decay()},
            {"amsgrad", x.amsgrad()}};
  };
  a.set_hparams = [](optim::OptimizerOptions& o, const nlohmann::json& hp) {
    auto& x = static_cast<Options&>(o);
    x.lr(hp["lr"].get<double>());
    x.betas(std::make_tuple(hp["betas"][0].get<double>(), hp["betas"][1].get<double>()));
    x.eps(hp["eps"].get<double>());
    x.weight_decay(hp["weight_decay"].get<double>());
    x.amsgrad(hp["amsgrad"].get<bool>());
  };
  a.check_hparam = typed_check({"amsgrad"});
  a.state_names = [](const nlohmann::json& hp) {
    std::vector<std::string> names{"exp_avg", "exp_avg_sq"};
    if (hp["amsgrad"].get<bool>()) names.push_back("max_exp_avg_sq");
    return names;
  };
  a.state_tensor = [](optim::OptimizerParamState& s, const std::string& n) -> torch::Tensor* {
    auto& x = static_cast<State&>(s);
    if (n == "exp_avg") return &x.exp_avg();
    if (n == "exp_avg_sq") return &x.exp_avg_sq();
    if (n == "max_exp_avg_sq") return &x.max_exp_avg_sq();
    return nullptr;
  };
  a.has_step = true;
  a.get_step = [](const optim::OptimizerParamState& s) { return static_cast<const State&>(s).step(); };
  a.set_step = [](optim::OptimizerParamState& s, int64_t step) { static_cast<State&>(s).step(step); };
  // Adam's first step: zeros (adam.cpp), max_exp_avg_sq only with amsgrad.
  a.init_state = [](const nlohmann::json& hp, const torch::Tensor& like) -> std::unique_ptr<optim::OptimizerParamState> {
    auto s = std::make_unique<State>();
    s->exp_avg(torch::zeros_like(like, torch::MemoryFormat::Preserve));
    s->exp_avg_sq(torch::zeros_like(like, torch::MemoryFormat::Preserve));
    if (hp["amsgrad"].get<bool>()) s->max_exp_avg_sq(torch::zeros_like(like, torch::MemoryFormat::Preserve));
    return s;
  };
  return a;
}

OptimizerAdapter sgd_adapter() {
  OptimizerAdapter a;
  a.name = "torch::optim::SGD";
  a.hparam_names = {"lr", "momentum", "dampening", "weight_decay", "nesterov"};
  a.get_hparams = [](const optim::OptimizerOptions& o) -> nlohmann::json {
    const auto& x = static_cast<const optim::SGDOptions&>(o);
    return {{"lr", x.lr()}, {"momentum", x.momentum()}, {"dampening", x.dampening()},
            {"weight_decay", x.weight_decay()}, {"nesterov", x.nesterov()}};
  };
  a.set_hparams = [](optim::OptimizerOptions& o, const nlohmann::json& hp) {
    auto& x = static_cast<optim::SGDOptions&>(o);
    x.lr(hp["lr"].get<double>());
    x.momentum(hp["momentum"].get<double>());
    x.dampening(hp["dampening"].get<double>());
    x.weight_decay(hp["weight_decay"].get<double>());
    x.nesterov(hp["nesterov"].get<bool>());
  };
  a.check_hparam = typed_check({"nesterov"});
  a.state_names = [](const nlohmann::json& hp) {
    return hp["momentum"].get<double>() != 0 ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
  };
  a.state_tensor = [](optim::OptimizerParamState& s, const std::string& n) -> torch::Tensor* {
    return n == "momentum_buffer" ? &static_cast<optim::SGDParamState&>(s).momentum_buffer() : nullptr;
  };
  // SGD's first step clones the gradient into the buffer (sgd.cpp); before it, zeros are the state
  // PyTorch's get_optimizer_state_dict reports too (its _init_optim_state steps with zero gradients).
  a.init_state = [](const nlohmann::json& hp, const torch::Tensor& like) -> std::unique_ptr<optim::OptimizerParamState> {
    auto s = std::make_unique<optim::SGDParamState>();
    if (hp["momentum"].get<double>() != 0) s->momentum_buffer(torch::zeros_like(like, torch::MemoryFormat::Preserve));
    return s;
  };
  return a;
}

OptimizerAdapter adagrad_adapter() {
  OptimizerAdapter a;
  a.name = "torch::optim::Adagrad";
  a.hparam_names = {"lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"};
  a.get_hparams = [](const optim::OptimizerOptions& o) -> nlohmann::json {
    const auto& x = static_cast<const optim::AdagradOptions&>(o);
    return {{"lr", x.lr()}, {"lr_decay", x.lr_decay()}, {"weight_decay", x.weight_decay()},
            {"initial_accumulator_value", x.initial_accumulator_value()}, {"eps", x.eps()}};
  };
  a.set_hparams = [](optim::OptimizerOptions& o, const nlohmann::json& hp) {
    auto& x = static_cast<optim::AdagradOptions&>(o);
    x.lr(hp["lr"].get<double>());
    x.lr_decay(hp["lr_decay"].get<double>());
    x.weight_decay(hp["weight_decay"].get<double>());
    x.initial_accumulator_value(hp["initial_accumulator_value"].get<double>());
    x.eps(hp["eps"].get<double>());
  };
  a.check_hparam = typed_check({});
  a.state_names = [](const nlohmann::json&) { return std::vector<std::string>{"sum"}; };
  a.state_tensor = [](optim::OptimizerParamState& s, const std::string& n) -> torch::Tensor* {
    return n == "sum" ? &static_cast<optim::AdagradParamState&>(s).sum() : nullptr;
  };
  a.has_step = true;
  a.get_step = [](const optim::OptimizerParamState& s) { return static_cast<const optim::AdagradParamState&>(s).step(); };
  a.set_step = [](optim::OptimizerParamState& s, int64_t step) { static_cast<optim::AdagradParamState&>(s).step(step); };
  // Adagrad's constructor (adagrad.cpp, as torch.optim.Adagrad.__init__): sum = initial_accumulator_value.
  a.init_state = [](const nlohmann::json& hp, const torch::Tensor& like) -> std::unique_ptr<optim::OptimizerParamState> {
    auto s = std::make_unique<optim::AdagradParamState>();
    s->sum(torch::full_like(like, hp["initial_accumulator_value"].get<double>(), torch::MemoryFormat::Preserve));
    return s;
  };
  return a;
}

OptimizerAdapter rmsprop_adapter() {
  OptimizerAdapter a;
  a.name = "torch::optim::RMSprop";
  a.hparam_names = {"lr", "alpha", "eps", "weight_decay", "momentum", "centered"};
  a.get_hparams = [](const optim::OptimizerOptions& o) -> nlohmann::json {
    const auto& x = static_cast<const optim::RMSpropOptions&>(o);
    return {{"lr", x.lr()}, {"alpha", x.alpha()}, {"eps", x.eps()}, {"weight_decay", x.weight_decay()},
            {"momentum", x.momentum()}, {"centered", x.centered()}};
  };
  a.set_hparams = [](optim::OptimizerOptions& o, const nlohmann::json& hp) {
    auto& x = static_cast<optim::RMSpropOptions&>(o);
    x.lr(hp["lr"].get<double>());
    x.alpha(hp["alpha"].get<double>());
    x.eps(hp["eps"].get<double>());
    x.weight_decay(hp["weight_decay"].get<double>());
    x.momentum(hp["momentum"].get<double>());
    x.centered(hp["centered"].get<bool>());
  };
  a.check_hparam = typed_check({"centered"});
  // rmsprop.cpp (as torch.optim.RMSprop): momentum_buffer only when momentum > 0, grad_avg only when centered.
  a.state_names = [](const nlohmann::json& hp) {
    std::vector<std::string> names{"square_avg"};
    if (hp["momentum"].get<double>() > 0) names.push_back("momentum_buffer");
    if (hp["centered"].get<bool>()) names.push_back("grad_avg");
    return names;
  };
  a.state_tensor = [](optim::OptimizerParamState& s, const std::string& n) -> torch::Tensor* {
    auto& x = static_cast<optim::RMSpropParamState&>(s);
    if (n == "square_avg") return &x.square_avg();
    if (n == "momentum_buffer") return &x.momentum_buffer();
    if (n == "grad_avg") return &x.grad_avg();
    return nullptr;
  };
  a.has_step = true;
  a.get_step = [](const optim::OptimizerParamState& s) { return static_cast<const optim::RMSpropParamState&>(s).step(); };
  a.set_step = [](optim::OptimizerParamState& s, int64_t step) { static_cast<optim::RMSpropParamState&>(s).step(step); };
  a.init_state = [](const nlohmann::json& hp, const torch::Tensor& like) -> std::unique_ptr<optim::OptimizerParamState> {
    auto s = std::make_unique<optim::RMSpropParamState>();
    s->square_avg(torch::zeros_like(like, torch::MemoryFormat::Preserve));
    if (hp["momentum"].get<double>() > 0) s->momentum_buffer(torch::zeros_like(like, torch::MemoryFormat::Preserve));
    if (hp["centered"].get<bool>()) s->grad_avg(torch::zeros_like(like, torch::MemoryFormat::Preserve));
    return s;
  };
  return a;
}

// [Note: LBFGS has no sharded state dict]
// LBFGS keeps one state for the whole optimizer (lbfgs.cpp: state_[first parameter]; torch/optim/lbfgs.py:
// self.state[self._params[0]]): d, t, old_dirs, old_stps, ro, H_diag, prev_flat_grad, prev_loss,
// func_evals, n_iter, whose tensors are flat over the concatenation of every parameter and whose lists grow
// with history_size. No entry belongs to a parameter, so there is no FQN to key it by, and no piece of it
// is a rank's shard: it cannot be sharded or resharded like the parameters. PyTorch agrees: its
// get_optimizer_state_dict only passes LBFGS's state through unsharded (under the first parameter's FQN),
// and with flatten_optimizer_state_dict it raises NotImplementedError on the old_dirs list. Over sharded
// parameters LBFGS is moreover not data-parallel: its dot products and line search would run on each
// rank's local shards alone. So it is refused, with this reason.
OptimizerAdapter lbfgs_adapter() {
  OptimizerAdapter a;
  a.name = "torch::optim::LBFGS";
  a.unsupported =
      "its state (d, t, old_dirs, old_stps, ro, H_diag, prev_flat_grad, prev_loss, func_evals, n_iter) is one "
      "set of tensors flat over all the optimizer's parameters, not per parameter, so it has no FQN keys and "
      "cannot be sharded or resharded like the parameters (PyTorch keeps it only unsharded; its "
      "flatten_optimizer_state_dict rejects it). Fix: save it with torch::save(optimizer, path) in a single "
      "process, or train with another optimizer";
  return a;
}

struct Registry {
  std::mutex mu;
  std::unordered_map<std::type_index, std::shared_ptr<const OptimizerAdapter>> adapters;
  Registry() {
    auto add = [this](std::type_index t, OptimizerAdapter a) {
      adapters[t] = std::make_shared<const OptimizerAdapter>(std::move(a));
    };
    add(typeid(optim::Adam), adam_like<optim::AdamOptions, optim::AdamParamState>("torch::optim::Adam"));
    add(typeid(optim::AdamW), adam_like<optim::AdamWOptions, optim::AdamWParamState>("torch::optim::AdamW"));
    add(typeid(optim::SGD), sgd_adapter());
    add(typeid(optim::Adagrad), adagrad_adapter());
    add(typeid(optim::RMSprop), rmsprop_adapter());
    add(typeid(optim::LBFGS), lbfgs_adapter());
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_optimizer_adapter(std::type_index type, OptimizerAdapter a) {
  const std::string type_name = c10::demangle(type.name());
  TORCH_CHECK(!a.name.empty(), "register_optimizer_adapter(", type_name, "): the adapter needs a name");
  if (a.unsupported.empty()) {
    auto need = [&](bool present, const char* field) {
      TORCH_CHECK(present, "register_optimizer_adapter(", type_name, "): the adapter's ", field,
                  " is empty. Fix: set it (see include/fsdp/checkpoint/optimizer_adapter.h)");
    };
    need(static_cast<bool>(a.get_hparams), "get_hparams");
    need(static_cast<bool>(a.set_hparams), "set_hparams");
    need(static_cast<bool>(a.state_names), "state_names");
    need(static_cast<bool>(a.state_tensor), "state_tensor");
    need(static_cast<bool>(a.init_state), "init_state");
    if (a.has_step) {
      need(static_cast<bool>(a.get_step), "get_step (has_step is set)");
      need(static_cast<bool>(a.set_step), "set_step (has_step is set)");
    }
  }
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.adapters[type] = std::make_shared<const OptimizerAdapter>(std::move(a));
}

std::shared_ptr<const OptimizerAdapter> optimizer_adapter(const torch::optim::Optimizer& optimizer, const char* api) {
  const std::type_index type(typeid(optimizer));
  std::shared_ptr<const OptimizerAdapter> a;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.adapters.find(type);
    if (it != r.adapters.end()) a = it->second;
  }
  const std::string type_name = c10::demangle(type.name());
  TORCH_CHECK(a, api, ": optimizer type ", type_name, " is not supported: no optimizer adapter is registered for it ",
              "(built in: torch::optim::Adam, AdamW, SGD, Adagrad, RMSprop). Fix: call fsdp::register_optimizer_adapter<",
              type_name, ">(adapter) once before (include/fsdp/checkpoint/optimizer_adapter.h)");
  TORCH_CHECK(a->unsupported.empty(), api, ": optimizer type ", type_name, " has no state dict: ", a->unsupported);
  return a;
}

}  // namespace fsdp
