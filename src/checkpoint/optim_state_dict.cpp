// The optimizers' state dict (see include/fsdp/checkpoint/state_dict.h): the state and hyper-parameters of
// one or several optimizers under FQN keys, sharded like the parameters, read and written through each
// optimizer type's adapter (include/fsdp/checkpoint/optimizer_adapter.h). Mirrors
// torch.distributed.checkpoint.state_dict.get_optimizer_state_dict / set_optimizer_state_dict, in its
// flattened layout (flatten_optimizer_state_dict=True, our default) or its nested one as PyTorch's DCP
// stores it. Loads follow [Note: validate, agree, apply] (validate_agree_apply.h).
#include <algorithm>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "fsdp/checkpoint/state_dict.h"
#include "checkpoint/state_dict_impl.h"
#include "util.h"

namespace fsdp {

namespace detail::sd {

namespace {

constexpr const char* kState = "state.";
constexpr const char* kGroups = "param_groups.";

torch::optim::OptimizerParamState* find_state(const torch::optim::Optimizer& opt, const torch::Tensor& p) {
  auto& st = const_cast<torch::optim::Optimizer&>(opt).state();
  auto it = st.find(p.unsafeGetTensorImpl());
  return it == st.end() ? nullptr : it->second.get();
}

/// The local shard of an optimizer parameter (an implicit group's parameter reads as the full tensor
/// outside forward): the shape of its state tensors.
torch::Tensor local_like(const OptParam& op) { return op.layout ? op.layout->to_local() : op.param.detach(); }

/// Every group's hyper-parameters: [optimizer][group].
std::vector<std::vector<nlohmann::json>> all_hparams(const Optims& optims) {
  std::vector<std::vector<nlohmann::json>> out;
  for (size_t i = 0; i < optims.opts.size(); ++i) {
    out.emplace_back();
    for (const auto& g : optims.opts[i]->param_groups()) out.back().push_back(optims.adapters[i]->get_hparams(g.options()));
  }
  return out;
}

/// The state tensor `name` of `state`; throws when the adapter lists the name but has no field for it.
torch::Tensor* state_field(const OptimizerAdapter& ad, torch::optim::OptimizerParamState& state, const std::string& name,
                           const char* api) {
  auto* field = ad.state_tensor(state, name);
  TORCH_CHECK(field, api, ": the optimizer adapter of ", ad.name, " lists state '", name,
              "' but its state_tensor() returns no field for it. Fix the adapter's state_names or state_tensor");
  return field;
}

}  // namespace

Optims::Optims(std::vector<torch::optim::Optimizer*> optimizers, const char* api) : opts(std::move(optimizers)) {
  TORCH_CHECK(!opts.empty(), api, ": no optimizer given");
  std::unordered_set<const torch::optim::Optimizer*> seen;
  size_t base = 0;
  for (size_t i = 0; i < opts.size(); ++i) {
    TORCH_CHECK(opts[i], api, ": optimizer #", i, " is null");
    TORCH_CHECK(seen.insert(opts[i]).second, api, ": optimizer #", i, " is passed twice");
    adapters.push_back(optimizer_adapter(*opts[i], api));
    group_base.push_back(base);
    base += opts[i]->param_groups().size();
  }
}

// ---------------------------------------------------------------------------------------------
// get_optimizer_state_dict

std::vector<OptParam> opt_params(const torch::nn::Module& model, const Optims& optims, const ModelContext& ctx,
                                 const char* api) {
  std::unordered_map<const c10::TensorImpl*, std::string> fqns;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) fqns.emplace(item.value().unsafeGetTensorImpl(), item.key());
  std::vector<OptParam> out;
  std::unordered_map<std::string, std::pair<size_t, size_t>> seen;  // fqn -> (optimizer, group)
  for (size_t o = 0; o < optims.opts.size(); ++o) {
    const auto& groups = optims.opts[o]->param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      const auto& params = groups[g].params();
      for (size_t i = 0; i < params.size(); ++i) {
        const auto& p = params[i];
        auto it = fqns.find(p.unsafeGetTensorImpl());
        TORCH_CHECK(it != fqns.end(), api, ": parameter #", i, " of param group ", g, " of optimizer #", o, " (",
                    optims.adapters[o]->name, ", shape ", shape_str(p.sizes()), ") is not a parameter of the model (rank ",
                    ctx.rank, "). Fix: pass the model whose parameters the optimizer was built from (after fully_shard: "
                    "the same tensors)");
        auto [at, fresh] = seen.emplace(it->second, std::make_pair(o, g));
        TORCH_CHECK(fresh, api, ": parameter '", it->second, "' is in param group ", at->second.second, " of optimizer #",
                    at->second.first, " and in param group ", g, " of optimizer #", o, " (rank ", ctx.rank,
                    "); state dict keys are FQNs, so each parameter must be in exactly one group of one optimizer. Fix: "
                    "remove it from all but one");
        std::optional<DTensor> layout;
        if (const auto* l = ctx.find(p)) layout = l->dtensor();
        out.push_back({o, g, it->second, p, layout});
      }
    }
  }
  return out;
}

StateDict optimizer_state_dict(const torch::nn::Module& model, const Optims& optims, const StateDictOptions& o,
                               const ModelContext& ctx) {
  const char* api = "get_optimizer_state_dict";
  auto params = opt_params(model, optims, ctx, api);
  const auto hps = all_hparams(optims);
  const bool keep = keeps_entries(o, ctx.rank);
  auto skipped = [&](const OptParam& op) { return o.ignore_frozen_params() && !op.param.requires_grad(); };
  StateDict sd;
  // "state": the same keys in both layouts (PyTorch's DCP flattens {"state": {fqn: {name: v}}} to them).
  for (const auto& op : params) {
    if (skipped(op)) continue;
    const auto& ad = *optims.adapters[op.opt];
    const auto& hp = hps[op.opt][op.group];
    auto* state = find_state(*optims.opts[op.opt], op.param);
    // No state yet (before the first step): the state the optimizer would create, which PyTorch's
    // get_optimizer_state_dict reports too (its _init_optim_state steps once with zero gradients).
    std::unique_ptr<torch::optim::OptimizerParamState> fresh;
    if (!state) {
      fresh = ad.init_state(hp, local_like(op));
      state = fresh.get();
    }
    for (const auto& name : ad.state_names(hp)) {
      auto* field = state_field(ad, *state, name, api);
      torch::Tensor local = field->defined() ? *field : torch::zeros_like(local_like(op));
      const std::string key = kState + op.fqn + "." + name;
      if (op.layout) emit_tensor(sd, key, DTensor(local, op.layout->device_mesh(), op.layout->placements(), op.layout->sizes()), o, keep);
      else emit_tensor(sd, key, local, o, keep);
    }
    if (ad.has_step && keep) sd.insert_or_assign(kState + op.fqn + ".step", Value(ad.get_step(*state)));
  }
  if (!keep) return sd;
  if (o.flatten_optimizer_state_dict()) {
    // "param_groups.<fqn>.<hp>": every parameter carries its group's values (_flatten_optim_state_dict).
    for (const auto& op : params) {
      if (skipped(op)) continue;
      const auto& hp = hps[op.opt][op.group];
      for (const auto& name : optims.adapters[op.opt]->hparam_names)
        sd.insert_or_assign(kGroups + op.fqn + "." + name, Value(hp[name]));
    }
    return sd;
  }
  // Nested: PyTorch's "param_groups" list of {hp..., "params": [fqn...]}, which its DCP flattens (through
  // _traverse.traverse_state_dict: a list of dicts is walked by index) to "param_groups.<i>.<hp>" and
  // "param_groups.<i>.params", i counting the groups of every optimizer in order.
  for (size_t i = 0; i < optims.opts.size(); ++i) {
    for (size_t g = 0; g < optims.opts[i]->param_groups().size(); ++g) {
      const std::string prefix = kGroups + std::to_string(optims.group_base[i] + g) + ".";
      nlohmann::json fqns = nlohmann::json::array();
      for (const auto& op : params) {
        if (op.opt == i && op.group == g && !skipped(op)) fqns.push_back(op.fqn);
      }
      for (const auto& name : optims.adapters[i]->hparam_names) sd.insert_or_assign(prefix + name, Value(hps[i][g][name]));
      sd.insert_or_assign(prefix + "params", Value(std::move(fqns)));
    }
  }
  return sd;
}

// ---------------------------------------------------------------------------------------------
// set_optimizer_state_dict

Layouts optimizer_layouts(const std::vector<OptParam>& params) {
  Layouts l;
  for (const auto& op : params) l.emplace(kState + op.fqn + ".*", op.layout);
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
    return take(key);
  }
  /// The entry of `key`, or null when missing (recorded).
  const StateDictValue* take(const std::string& key) {
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

/// The hyper-parameters of every group (per optimizer) as a load leaves them, and where each came from.
struct GroupHparams {
  std::vector<std::vector<nlohmann::json>> hp;
  std::vector<std::vector<std::map<std::string, std::string>>> source;  // name -> the key it came from
};

/// Validates one hyper-parameter entry and records it for its group: a second value for the same group
/// (another parameter's, in the flattened layout) must be equal.
void take_hparam(GroupHparams& gh, const OptimizerAdapter& ad, size_t o, size_t g, const std::string& name,
                 const std::string& key, const StateDictValue& entry, const char* api, int rank) {
  const auto* v = std::get_if<Value>(&entry);
  TORCH_CHECK(v, api, ": '", key, "' is a ", kind_name(entry), " in the state dict but a hyper-parameter (a Value) of the ",
              "optimizer (", ad.name, ", rank ", rank, ")");
  if (ad.check_hparam) {
    auto problem = ad.check_hparam(name, v->json);
    TORCH_CHECK(problem.empty(), api, ": '", key, "' = ", v->json.dump(), " in the state dict: ", problem, " (", ad.name,
                ", rank ", rank, ")");
  }
  auto& src = gh.source[o][g];
  auto& hp = gh.hp[o][g];
  if (src.count(name)) {
    TORCH_CHECK(hp[name] == v->json, api, ": param group ", g, " of optimizer #", o, " gets ", name, " = ", hp[name].dump(),
                " from '", src[name], "' but ", v->json.dump(), " from '", key, "' (rank ", rank,
                "): parameters of one group must share their hyper-parameters. Fix: build the optimizer's param groups "
                "as they were when the state dict was saved");
    return;
  }
  src[name] = key;
  hp[name] = v->json;
}

/// Flattened layout: "param_groups.<fqn>.<hp>" for every parameter.
void take_flat_hparams(const std::vector<OptParam>& params, const Optims& optims, GroupHparams& gh, Keys& keys,
                       const char* api, int rank) {
  for (const auto& op : params) {
    const auto& ad = *optims.adapters[op.opt];
    for (const auto& name : ad.hparam_names) {
      const std::string key = kGroups + op.fqn + "." + name;
      if (const auto* entry = keys.take(key, op)) take_hparam(gh, ad, op.opt, op.group, name, key, *entry, api, rank);
    }
  }
}

/// Nested layout: "param_groups.<i>.params" lists the FQNs of saved group i, "param_groups.<i>.<hp>" its
/// values. Each of our groups takes the saved group that holds its parameters (the FQNs, not the index,
/// decide: the optimizers may be passed in another order than at save), which must hold exactly them.
void take_nested_hparams(const std::vector<OptParam>& params, const Optims& optims, GroupHparams& gh, Keys& keys,
                         bool ignore_frozen, const char* api, int rank) {
  // The saved groups, from their "params" lists.
  std::map<std::string, std::set<std::string>> saved;  // group index (as in the key) -> FQNs
  std::unordered_map<std::string, std::string> saved_of;    // fqn -> group index
  const std::string groups = kGroups;
  for (const auto& [key, v] : keys.sd) {
    if (key.compare(0, groups.size(), groups) != 0) continue;
    const auto rest = key.substr(groups.size());
    const auto dot = rest.find('.');
    if (dot == std::string::npos || rest.substr(dot + 1) != "params") continue;
    const auto index = rest.substr(0, dot);
    if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos) continue;
    const auto* list = std::get_if<Value>(&v);
    bool ok = list && list->json.is_array();
    for (const auto& f : ok ? list->json : nlohmann::json::array()) ok = ok && f.is_string();
    TORCH_CHECK(ok, api, ": '", key, "' must be a Value holding the list of the group's parameter FQNs, got ",
                list ? list->json.dump() : std::string(kind_name(v)), " (rank ", rank, ")");
    saved[index];  // a group may list no parameter (all frozen at save)
    for (const auto& f : list->json) {
      const auto fqn = f.get<std::string>();
      auto [it, fresh] = saved_of.emplace(fqn, index);
      TORCH_CHECK(fresh, api, ": '", fqn, "' is listed by both 'param_groups.", it->second, ".params' and '", key,
                  "' in the state dict (rank ", rank, "): a parameter belongs to one param group");
      saved[index].insert(fqn);
    }
  }
  // A saved group whose parameters are all frozen (left out with ignore_frozen_params) matches none of
  // ours: its keys are skipped, not unexpected.
  std::unordered_set<std::string> frozen_fqns;
  for (const auto& op : params) {
    if (ignore_frozen && !op.param.requires_grad()) frozen_fqns.insert(op.fqn);
  }
  for (const auto& [index, fqns] : saved) {
    if (!std::all_of(fqns.begin(), fqns.end(), [&](const std::string& f) { return frozen_fqns.count(f) > 0; })) continue;
    const std::string prefix = kGroups + index + ".";
    for (const auto& [key, v] : keys.sd) {
      if (key.compare(0, prefix.size(), prefix) == 0) keys.frozen.insert(key);
    }
  }
  for (size_t o = 0; o < optims.opts.size(); ++o) {
    const auto& ad = *optims.adapters[o];
    for (size_t g = 0; g < optims.opts[o]->param_groups().size(); ++g) {
      std::set<std::string> ours;
      std::set<std::string> frozen;
      for (const auto& op : params) {
        if (op.opt != o || op.group != g) continue;
        (ignore_frozen && !op.param.requires_grad() ? frozen : ours).insert(op.fqn);
      }
      const std::string own_key = kGroups + std::to_string(optims.group_base[o] + g) + ".params";
      std::string index;
      for (const auto& f : ours) {
        auto it = saved_of.find(f);
        if (it != saved_of.end()) {
          index = it->second;
          break;
        }
      }
      if (index.empty()) {
        // No saved group holds any of its parameters: its keys are missing (under the index get would write).
        if (!ours.empty()) keys.take(own_key);
        continue;
      }
      std::set<std::string> theirs;
      for (const auto& f : saved[index]) {
        if (!frozen.count(f)) theirs.insert(f);
      }
      TORCH_CHECK(theirs == ours, api, ": param group ", g, " of optimizer #", o, " (", ad.name, ") holds ",
                  list_keys({ours.begin(), ours.end()}), " but the state dict's group 'param_groups.", index,
                  ".params' holds ", list_keys({theirs.begin(), theirs.end()}), " (rank ", rank,
                  "). Fix: build the optimizers' param groups as they were when the state dict was saved");
      keys.take(kGroups + index + ".params");
      for (const auto& name : ad.hparam_names) {
        const std::string key = kGroups + index + "." + name;
        if (const auto* entry = keys.take(key)) take_hparam(gh, ad, o, g, name, key, *entry, api, rank);
      }
    }
  }
}

/// Validates the hyper-parameters and stages setting them. Returns each group's hyper-parameters after
/// the load (what decides the state names expected).
std::vector<std::vector<nlohmann::json>> prepare_hparams(const std::vector<OptParam>& params, const Optims& optims,
                                                         Keys& keys, const StateDictOptions& o, const char* api, int rank) {
  GroupHparams gh;
  gh.hp = all_hparams(optims);
  for (const auto& groups : gh.hp) gh.source.emplace_back(groups.size());
  if (o.flatten_optimizer_state_dict()) take_flat_hparams(params, optims, gh, keys, api, rank);
  else take_nested_hparams(params, optims, gh, keys, o.ignore_frozen_params(), api, rank);
  for (size_t i = 0; i < optims.opts.size(); ++i) {
    const auto& ad = *optims.adapters[i];
    for (size_t g = 0; g < gh.hp[i].size(); ++g) {
      if (gh.source[i][g].empty()) continue;
      // Set them on a copy of the group's options first: an adapter's set_hparams that throws (a user's,
      // on a value its check_hparam let through) then fails the validation, not the apply phase.
      try {
        auto probe = optims.opts[i]->param_groups()[g].options().clone();
        ad.set_hparams(*probe, gh.hp[i][g]);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, api, ": the hyper-parameters ", gh.hp[i][g].dump(), " of param group ", g, " of optimizer #", i,
                    " (", ad.name, ") cannot be set: ", message_of(e), " (rank ", rank, "). Fix: load values of the ",
                    "types the optimizer takes");
      }
      keys.prep.apply.push_back([opt = optims.opts[i], ad = optims.adapters[i], g, hp = gh.hp[i][g]] {
        ad->set_hparams(opt->param_groups()[g].options(), hp);
      });
    }
  }
  return gh.hp;
}

/// The step of `entry`: a Value holding a non-negative integer (ours), or as PyTorch keeps it (a float
/// with an integral value, or a one-element tensor).
int64_t step_of(const StateDictValue& entry, const std::string& key, const char* api, int rank) {
  std::optional<double> x;
  if (const auto* v = std::get_if<Value>(&entry)) {
    if (v->json.is_number()) x = v->json.get<double>();
  } else if (const auto* t = std::get_if<torch::Tensor>(&entry)) {
    if (t->defined() && t->numel() == 1) x = t->item<double>();
  }
  TORCH_CHECK(x && *x >= 0 && *x == static_cast<double>(static_cast<int64_t>(*x)), api, ": '", key,
              "' must be a Value holding a non-negative integer (or a one-element tensor holding one), got ",
              std::holds_alternative<Value>(entry) ? std::get<Value>(entry).json.dump() : std::string(kind_name(entry)),
              " (rank ", rank, ")");
  return static_cast<int64_t>(*x);
}

/// Validates the state of parameter `op` (under the hyper-parameters `hp` the load leaves in place) and
/// stages copying it, creating the state when the optimizer has none yet.
void prepare_param_state(const OptParam& op, const Optims& optims, const nlohmann::json& hp, Keys& keys,
                         const char* api, int rank) {
  const auto& ad = *optims.adapters[op.opt];
  auto& opt = *optims.opts[op.opt];
  const torch::Tensor like = local_like(op);
  auto* state = find_state(opt, op.param);
  // torch::optim creates state lazily at a parameter's first step (Adagrad in its constructor): create it
  // now, as that would, but attach it only in the apply phase.
  std::shared_ptr<std::unique_ptr<torch::optim::OptimizerParamState>> fresh;
  if (!state) {
    fresh = std::make_shared<std::unique_ptr<torch::optim::OptimizerParamState>>(ad.init_state(hp, like));
    state = fresh->get();
  }
  std::vector<std::pair<std::string, torch::Tensor>> sources;  // state name -> local source
  for (const auto& name : ad.state_names(hp)) {
    const std::string key = kState + op.fqn + "." + name;
    auto* field = state_field(ad, *state, name, api);
    const auto* entry = keys.take(key, op);
    if (!entry) continue;
    sources.emplace_back(name, resolve_tensor(*entry, key, field->defined() ? *field : like, op.layout, api, rank));
  }
  std::optional<int64_t> step;
  if (ad.has_step) {
    const std::string key = kState + op.fqn + ".step";
    if (const auto* entry = keys.take(key, op)) step = step_of(*entry, key, api, rank);
  }
  if (sources.empty() && !step) return;
  keys.prep.apply.push_back([&opt, ad = optims.adapters[op.opt], p = op.param, like, sources, step, fresh] {
    auto& st = opt.state();
    auto it = st.find(p.unsafeGetTensorImpl());
    if (it == st.end()) it = st.emplace(p.unsafeGetTensorImpl(), std::move(*fresh)).first;
    for (const auto& [name, src] : sources) {
      auto* field = ad->state_tensor(*it->second, name);  // checked in validation
      if (!field->defined()) *field = torch::zeros_like(like);
      copy_into(*field, src);
    }
    if (step) ad->set_step(*it->second, *step);
  });
}

}  // namespace

Prepared prepare_optimizer(const std::vector<OptParam>& params, const Optims& optims, const StateDict& sd,
                           const StateDictOptions& o, const char* api, int rank) {
  Prepared prep;
  Keys keys{sd, prep, o.ignore_frozen_params()};
  auto hps = prepare_hparams(params, optims, keys, o, api, rank);
  for (const auto& op : params) prepare_param_state(op, optims, hps[op.opt][op.group], keys, api, rank);
  keys.record_unexpected();
  return prep;
}

}  // namespace detail::sd

// ---------------------------------------------------------------------------------------------
// Public API

namespace {

std::vector<torch::optim::Optimizer*> mutable_list(const std::vector<const torch::optim::Optimizer*>& optimizers) {
  std::vector<torch::optim::Optimizer*> out;
  // get_* only reads the optimizers (Optims holds them mutable for set_*).
  for (const auto* o : optimizers) out.push_back(const_cast<torch::optim::Optimizer*>(o));
  return out;
}

}  // namespace

StateDict get_optimizer_state_dict(const torch::nn::Module& model,
                                   const std::vector<const torch::optim::Optimizer*>& optimizers,
                                   const StateDictOptions& o) {
  detail::sd::Optims optims(mutable_list(optimizers), "get_optimizer_state_dict");
  detail::sd::ModelContext ctx(model);
  return detail::sd::optimizer_state_dict(model, optims, o, ctx);
}

StateDict get_optimizer_state_dict(const torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
                                   const StateDictOptions& o) {
  return get_optimizer_state_dict(model, std::vector<const torch::optim::Optimizer*>{&optimizer}, o);
}

LoadResult set_optimizer_state_dict(const torch::nn::Module& model,
                                    const std::vector<torch::optim::Optimizer*>& optimizers,
                                    const StateDict& state_dict, const StateDictOptions& o) {
  using namespace detail::sd;  // NOLINT: this file's own internals
  const char* api = "set_optimizer_state_dict";
  ModelContext ctx(model);
  Prepared prep;
  auto validate = [&] {  // see [Note: validate, agree, apply]
    Optims optims(optimizers, api);
    auto params = opt_params(model, optims, ctx, api);
    StateDict local;
    if (o.broadcast_from_rank0()) local = broadcast_dict(state_dict, ctx.world, optimizer_layouts(params), api);
    prep = prepare_optimizer(params, optims, o.broadcast_from_rank0() ? local : state_dict, o, api, ctx.rank);
    check_strict(prep.result, o.strict(), api, "optimizer", ctx.rank);
  };
  detail::validate_agree_apply(api, validate, agree_over(ctx.world), [&] { prep.run(); });
  return prep.result;
}

LoadResult set_optimizer_state_dict(const torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                    const StateDict& state_dict, const StateDictOptions& o) {
  return set_optimizer_state_dict(model, std::vector<torch::optim::Optimizer*>{&optimizer}, state_dict, o);
}

}  // namespace fsdp
