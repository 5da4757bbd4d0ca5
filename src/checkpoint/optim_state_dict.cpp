// The optimizer's state dict (see include/fsdp/checkpoint/state_dict.h): torch::optim's Adam, AdamW and SGD state
// and hyper-parameters under FQN keys, sharded like the parameters. Mirrors
// torch.distributed.checkpoint.state_dict.get_optimizer_state_dict / set_optimizer_state_dict.
// Loads follow [Note: validate, agree, apply] (validate_agree_apply.h).
#include <map>
#include <unordered_map>
#include <unordered_set>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "fsdp/checkpoint/state_dict.h"
#include "checkpoint/state_dict_impl.h"
#include "util.h"

namespace fsdp {

namespace detail::sd {

namespace {

// ---------------------------------------------------------------------------------------------
// torch::optim's hyper-parameters and per-parameter state, by name

const std::vector<std::string>& hparam_names(OptKind k) {
  static const std::vector<std::string> adam{"lr", "betas", "eps", "weight_decay", "amsgrad"};
  static const std::vector<std::string> sgd{"lr", "momentum", "dampening", "weight_decay", "nesterov"};
  return k == OptKind::SGD ? sgd : adam;
}

template <typename Options>
nlohmann::json adam_hparams(const Options& a) {
  return {{"lr", a.lr()},
          {"betas", {std::get<0>(a.betas()), std::get<1>(a.betas())}},
          {"eps", a.eps()},
          {"weight_decay", a.weight_decay()},
          {"amsgrad", a.amsgrad()}};
}

nlohmann::json get_hparams(const torch::optim::OptimizerOptions& opts, OptKind k) {
  switch (k) {
    case OptKind::ADAM: return adam_hparams(dynamic_cast<const torch::optim::AdamOptions&>(opts));
    case OptKind::ADAMW: return adam_hparams(dynamic_cast<const torch::optim::AdamWOptions&>(opts));
    case OptKind::SGD: {
      const auto& s = dynamic_cast<const torch::optim::SGDOptions&>(opts);
      return {{"lr", s.lr()}, {"momentum", s.momentum()}, {"dampening", s.dampening()},
              {"weight_decay", s.weight_decay()}, {"nesterov", s.nesterov()}};
    }
  }
  return {};
}

/// "" when `v` is a valid value of hyper-parameter `name`, else what is wrong.
std::string check_hparam(const std::string& name, const nlohmann::json& v) {
  if (name == "amsgrad" || name == "nesterov") return v.is_boolean() ? "" : "expected a boolean";
  if (name == "betas") {
    return v.is_array() && v.size() == 2 && v[0].is_number() && v[1].is_number() ? "" : "expected [beta1, beta2]";
  }
  return v.is_number() ? "" : "expected a number";
}

template <typename Options>
void set_adam_hparams(Options& a, const nlohmann::json& hp) {
  a.lr(hp["lr"].get<double>());
  a.betas(std::make_tuple(hp["betas"][0].get<double>(), hp["betas"][1].get<double>()));
  a.eps(hp["eps"].get<double>());
  a.weight_decay(hp["weight_decay"].get<double>());
  a.amsgrad(hp["amsgrad"].get<bool>());
}

void set_hparams(torch::optim::OptimizerOptions& opts, OptKind k, const nlohmann::json& hp) {
  switch (k) {
    case OptKind::ADAM: set_adam_hparams(dynamic_cast<torch::optim::AdamOptions&>(opts), hp); break;
    case OptKind::ADAMW: set_adam_hparams(dynamic_cast<torch::optim::AdamWOptions&>(opts), hp); break;
    case OptKind::SGD: {
      auto& s = dynamic_cast<torch::optim::SGDOptions&>(opts);
      s.lr(hp["lr"].get<double>());
      s.momentum(hp["momentum"].get<double>());
      s.dampening(hp["dampening"].get<double>());
      s.weight_decay(hp["weight_decay"].get<double>());
      s.nesterov(hp["nesterov"].get<bool>());
      break;
    }
  }
}

/// State tensors an optimizer of kind `k` keeps per parameter, given its hyper-parameters.
std::vector<std::string> state_names(OptKind k, const nlohmann::json& hp) {
  if (k == OptKind::SGD) {
    if (hp["momentum"].get<double>() != 0) return {"momentum_buffer"};
    return {};
  }
  std::vector<std::string> names{"exp_avg", "exp_avg_sq"};
  if (hp["amsgrad"].get<bool>()) names.push_back("max_exp_avg_sq");
  return names;
}

bool has_step(OptKind k) { return k != OptKind::SGD; }

template <typename S>
torch::Tensor* adam_field(S& s, const std::string& name) {
  if (name == "exp_avg") return &s.exp_avg();
  if (name == "exp_avg_sq") return &s.exp_avg_sq();
  if (name == "max_exp_avg_sq") return &s.max_exp_avg_sq();
  return nullptr;
}

/// The state tensor `name` of a parameter's state (null if the state or the tensor is absent).
torch::Tensor* state_field(torch::optim::OptimizerParamState* s, OptKind k, const std::string& name) {
  if (!s) return nullptr;
  switch (k) {
    case OptKind::ADAM: return adam_field(dynamic_cast<torch::optim::AdamParamState&>(*s), name);
    case OptKind::ADAMW: return adam_field(dynamic_cast<torch::optim::AdamWParamState&>(*s), name);
    case OptKind::SGD:
      return name == "momentum_buffer" ? &dynamic_cast<torch::optim::SGDParamState&>(*s).momentum_buffer() : nullptr;
  }
  return nullptr;
}

int64_t get_step(torch::optim::OptimizerParamState* s, OptKind k) {
  if (!s) return 0;
  if (k == OptKind::ADAM) return dynamic_cast<torch::optim::AdamParamState&>(*s).step();
  if (k == OptKind::ADAMW) return dynamic_cast<torch::optim::AdamWParamState&>(*s).step();
  return 0;
}

void set_step(torch::optim::OptimizerParamState& s, OptKind k, int64_t step) {
  if (k == OptKind::ADAM) dynamic_cast<torch::optim::AdamParamState&>(s).step(step);
  if (k == OptKind::ADAMW) dynamic_cast<torch::optim::AdamWParamState&>(s).step(step);
}

std::unique_ptr<torch::optim::OptimizerParamState> new_state(OptKind k) {
  switch (k) {
    case OptKind::ADAM: return std::make_unique<torch::optim::AdamParamState>();
    case OptKind::ADAMW: return std::make_unique<torch::optim::AdamWParamState>();
    case OptKind::SGD: return std::make_unique<torch::optim::SGDParamState>();
  }
  return nullptr;
}

torch::optim::OptimizerParamState* find_state(const torch::optim::Optimizer& opt, const torch::Tensor& p) {
  auto& st = const_cast<torch::optim::Optimizer&>(opt).state();
  auto it = st.find(p.unsafeGetTensorImpl());
  return it == st.end() ? nullptr : it->second.get();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// get_optimizer_state_dict

OptKind opt_kind(const torch::optim::Optimizer& o, const char* api) {
  if (dynamic_cast<const torch::optim::AdamW*>(&o)) return OptKind::ADAMW;
  if (dynamic_cast<const torch::optim::Adam*>(&o)) return OptKind::ADAM;
  if (dynamic_cast<const torch::optim::SGD*>(&o)) return OptKind::SGD;
  TORCH_CHECK(false, api, ": optimizer type ", c10::demangle(typeid(o).name()),
              " is not supported: expected torch::optim::Adam, AdamW or SGD");
}

std::vector<OptParam> opt_params(const torch::nn::Module& model, const torch::optim::Optimizer& opt,
                                 const ModelContext& ctx, const char* api) {
  std::unordered_map<const c10::TensorImpl*, std::string> fqns;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) fqns.emplace(item.value().unsafeGetTensorImpl(), item.key());
  std::vector<OptParam> out;
  std::unordered_map<std::string, size_t> seen;
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    const auto& params = opt.param_groups()[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      auto it = fqns.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(it != fqns.end(), api, ": parameter #", i, " of param group ", g, " (shape ", shape_str(p.sizes()),
                  ") is not a parameter of the model (rank ", ctx.rank,
                  "). Fix: pass the model whose parameters the optimizer was built from (after fully_shard: the same "
                  "tensors)");
      TORCH_CHECK(seen.emplace(it->second, g).second, api, ": parameter '", it->second, "' is in param groups ",
                  seen[it->second], " and ", g, " of the optimizer; each parameter must be in one group");
      std::optional<DTensor> layout;
      if (const auto* l = ctx.find(p)) layout = l->dtensor();
      out.push_back({g, it->second, p, layout});
    }
  }
  return out;
}

StateDict optimizer_state_dict(const torch::nn::Module& model, const torch::optim::Optimizer& opt,
                               const StateDictOptions& o, const ModelContext& ctx) {
  const char* api = "get_optimizer_state_dict";
  const OptKind k = opt_kind(opt, api);
  auto params = opt_params(model, opt, ctx, api);
  const bool full = o.full_state_dict();
  const bool keep = !(full && o.cpu_offload()) || ctx.rank == 0;
  StateDict sd;
  for (const auto& op : params) {
    if (o.ignore_frozen_params() && !op.param.requires_grad()) continue;
    auto hp = get_hparams(opt.param_groups()[op.group].options(), k);
    auto* state = find_state(opt, op.param);
    for (const auto& name : state_names(k, hp)) {
      auto* field = state_field(state, k, name);
      // No state yet (before the first step): zeros, the state the first step would create.
      torch::Tensor local = field && field->defined() ? *field : torch::zeros_like(op.layout ? op.layout->to_local() : op.param.detach());
      const std::string key = "state." + op.fqn + "." + name;
      if (!op.layout) {
        if (keep) sd.insert_or_assign(key, full && o.cpu_offload() ? local.cpu() : local);
        continue;
      }
      DTensor d(local, op.layout->device_mesh(), op.layout->placements(), op.layout->sizes());
      if (!full) {
        sd.insert_or_assign(key, d);
        continue;
      }
      auto t = d.full_tensor();
      if (keep) sd.insert_or_assign(key, o.cpu_offload() ? t.cpu() : t);
    }
    if (has_step(k) && keep) sd.insert_or_assign("state." + op.fqn + ".step", Value(get_step(state, k)));
  }
  if (keep) {
    for (const auto& op : params) {
      if (o.ignore_frozen_params() && !op.param.requires_grad()) continue;
      auto hp = get_hparams(opt.param_groups()[op.group].options(), k);
      for (const auto& name : hparam_names(k)) sd.insert_or_assign("param_groups." + op.fqn + "." + name, Value(hp[name]));
    }
  }
  return sd;
}

// ---------------------------------------------------------------------------------------------
// set_optimizer_state_dict

Layouts optimizer_layouts(const std::vector<OptParam>& params) {
  Layouts l;
  for (const auto& op : params) {
    for (const char* name : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"})
      l.emplace("state." + op.fqn + "." + name, op.layout);
  }
  return l;
}

namespace {

/// The keys an optimizer load expects: each is taken once, as frozen (skipped), missing or present.
struct Keys {
  const StateDict& sd;
  Prepared& prep;
  bool ignore_frozen = false;
  std::unordered_set<std::string> expected, frozen;

  /// The entry of `key` for parameter `op`, or null when it is frozen (skipped) or missing (recorded).
  const StateDictValue* take(const std::string& key, const OptParam& op) {
    if (ignore_frozen && !op.param.requires_grad()) {
      frozen.insert(key);
      return nullptr;
    }
    expected.insert(key);
    const auto* entry = sd.find(key);
    if (!entry) prep.result.missing_keys.push_back(key);
    return entry;
  }
  /// Records every key of the dict that no take() asked for.
  void record_unexpected() {
    for (const auto& [key, v] : sd) {
      if (!expected.count(key) && !frozen.count(key)) prep.result.unexpected_keys.push_back(key);
    }
  }
};

/// Validates the hyper-parameters (one value per param group, which every parameter of the group must
/// agree on) and stages setting those that change. Returns each group's hyper-parameters after the load.
std::vector<nlohmann::json> prepare_hparams(const std::vector<OptParam>& params, torch::optim::Optimizer& opt,
                                            OptKind k, Keys& keys, const char* api, int rank) {
  const size_t n_groups = opt.param_groups().size();
  std::vector<nlohmann::json> group_hp(n_groups);
  std::vector<std::map<std::string, std::string>> hp_source(n_groups);  // name -> fqn it came from
  for (size_t g = 0; g < n_groups; ++g) group_hp[g] = get_hparams(opt.param_groups()[g].options(), k);
  std::vector<bool> group_changed(n_groups, false);
  for (const auto& op : params) {
    for (const auto& name : hparam_names(k)) {
      const std::string key = "param_groups." + op.fqn + "." + name;
      const auto* entry = keys.take(key, op);
      if (!entry) continue;
      const auto* v = std::get_if<Value>(entry);
      TORCH_CHECK(v, api, ": '", key, "' is a ", kind_name(*entry), " in the state dict but a hyper-parameter (a Value) ",
                  "of the optimizer (rank ", rank, ")");
      auto problem = check_hparam(name, v->json);
      TORCH_CHECK(problem.empty(), api, ": '", key, "' = ", v->json.dump(), " in the state dict: ", problem, " (rank ",
                  rank, ")");
      auto& src = hp_source[op.group];
      if (src.count(name)) {
        TORCH_CHECK(group_hp[op.group][name] == v->json, api, ": param group ", op.group, " gets ", name, " = ",
                    group_hp[op.group][name].dump(), " from '", src[name], "' but ", v->json.dump(), " from '", op.fqn,
                    "' (rank ", rank, "): parameters of one group must share their hyper-parameters. Fix: build the ",
                    "optimizer's param groups as they were when the state dict was saved");
      } else {
        src[name] = op.fqn;
        group_hp[op.group][name] = v->json;
        group_changed[op.group] = true;
      }
    }
  }
  for (size_t g = 0; g < n_groups; ++g) {
    if (!group_changed[g]) continue;
    keys.prep.apply.push_back([&opt, g, k, hp = group_hp[g]] { set_hparams(opt.param_groups()[g].options(), k, hp); });
  }
  return group_hp;
}

/// Validates the state of parameter `op` (under the hyper-parameters `hp` the load leaves in place) and
/// stages copying it, creating the state when the optimizer has none yet.
void prepare_param_state(const OptParam& op, torch::optim::Optimizer& opt, OptKind k, const nlohmann::json& hp,
                         Keys& keys, const char* api, int rank) {
  std::vector<std::pair<std::string, torch::Tensor>> sources;  // state name -> local source
  std::optional<int64_t> step;
  auto names = state_names(k, hp);
  auto* state = find_state(opt, op.param);
  for (const auto& name : names) {
    const std::string key = "state." + op.fqn + "." + name;
    const auto* entry = keys.take(key, op);
    if (!entry) continue;
    auto* field = state_field(state, k, name);
    torch::Tensor like = field && field->defined() ? *field : (op.layout ? op.layout->to_local() : op.param.detach());
    sources.emplace_back(name, resolve_tensor(*entry, key, like, op.layout, api, rank));
  }
  if (has_step(k)) {
    const std::string key = "state." + op.fqn + ".step";
    if (const auto* entry = keys.take(key, op)) {
      const auto* v = std::get_if<Value>(entry);
      TORCH_CHECK(v && v->json.is_number_integer() && v->json.get<int64_t>() >= 0, api, ": '", key,
                  "' must be a Value holding a non-negative integer, got ",
                  v ? v->json.dump() : std::string(kind_name(*entry)), " (rank ", rank, ")");
      step = v->json.get<int64_t>();
    }
  }
  if (sources.empty() && !step) return;
  // The local shard's shape (an implicit group's parameter reads as the full tensor outside forward).
  torch::Tensor like = op.layout ? op.layout->to_local() : op.param.detach();
  keys.prep.apply.push_back([&opt, k, p = op.param, like, sources, step, names] {
    auto& st = opt.state();
    auto it = st.find(p.unsafeGetTensorImpl());
    if (it == st.end()) {
      // torch::optim creates state lazily at a parameter's first step: create it now, as that step would.
      auto s = new_state(k);
      for (const auto& name : names) *state_field(s.get(), k, name) = torch::zeros_like(like);
      it = st.emplace(p.unsafeGetTensorImpl(), std::move(s)).first;
    }
    for (const auto& [name, src] : sources) {
      auto* field = state_field(it->second.get(), k, name);
      if (!field->defined()) *field = torch::zeros_like(like);
      copy_into(*field, src);
    }
    if (step) set_step(*it->second, k, *step);
  });
}

}  // namespace

Prepared prepare_optimizer(const std::vector<OptParam>& params, torch::optim::Optimizer& opt, OptKind k,
                           const StateDict& sd, const StateDictOptions& o, const char* api, int rank) {
  Prepared prep;
  Keys keys{sd, prep, o.ignore_frozen_params()};
  auto group_hp = prepare_hparams(params, opt, k, keys, api, rank);
  for (const auto& op : params) prepare_param_state(op, opt, k, group_hp[op.group], keys, api, rank);
  keys.record_unexpected();
  return prep;
}

}  // namespace detail::sd

// ---------------------------------------------------------------------------------------------
// Public API

StateDict get_optimizer_state_dict(const torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
                                   const StateDictOptions& o) {
  detail::sd::ModelContext ctx(model);
  return detail::sd::optimizer_state_dict(model, optimizer, o, ctx);
}

LoadResult set_optimizer_state_dict(const torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                    const StateDict& state_dict, const StateDictOptions& o) {
  using namespace detail::sd;  // NOLINT: this file's own internals
  const char* api = "set_optimizer_state_dict";
  ModelContext ctx(model);
  Prepared prep;
  auto validate = [&] {  // see [Note: validate, agree, apply]
    const OptKind k = opt_kind(optimizer, api);
    auto params = opt_params(model, optimizer, ctx, api);
    StateDict local;
    if (o.broadcast_from_rank0()) local = broadcast_dict(state_dict, ctx.world, optimizer_layouts(params), api);
    prep = prepare_optimizer(params, optimizer, k, o.broadcast_from_rank0() ? local : state_dict, o, api, ctx.rank);
    check_strict(prep.result, o.strict(), api, "optimizer", ctx.rank);
  };
  detail::validate_agree_apply(api, validate, agree_over(ctx.world), [&] { prep.run(); });
  return prep.result;
}

}  // namespace fsdp
