// State dicts of sharded modules and torch::optim optimizers (see include/fsdp/state_dict.h).
//
// Every set_* function works in two phases: prepare() validates the whole dict against the model
// (and optimizer) and stages what it will copy; only when nothing failed on this rank does apply()
// copy (under NoGradGuard) and create optimizer state. So a failed load changes nothing.
#include "fsdp/state_dict.h"

#include <functional>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "fsdp/collectives.h"
#include "fsdp_state.h"
#include "util.h"

namespace fsdp {

// ---------------------------------------------------------------------------------------------
// StateDict

void StateDict::insert_or_assign(const std::string& key, StateDictValue value) {
  auto it = index_.find(key);
  if (it != index_.end()) {
    items_[it->second].second = std::move(value);
    return;
  }
  index_.emplace(key, items_.size());
  items_.emplace_back(key, std::move(value));
}

StateDictValue* StateDict::find(const std::string& key) {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &items_[it->second].second;
}

const StateDictValue* StateDict::find(const std::string& key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &items_[it->second].second;
}

StateDictValue& StateDict::at(const std::string& key) {
  return const_cast<StateDictValue&>(static_cast<const StateDict&>(*this).at(key));
}

const StateDictValue& StateDict::at(const std::string& key) const {
  auto* v = find(key);
  if (!v) {
    std::ostringstream os;
    size_t shown = 0;
    for (const auto& item : items_) {
      if (shown++ == 5) {
        os << ", ...";
        break;
      }
      os << (shown > 1 ? ", " : "") << "'" << item.first << "'";
    }
    TORCH_CHECK(false, "StateDict::at: no key '", key, "' among its ", items_.size(), " keys (", os.str(), ")");
  }
  return *v;
}

bool StateDict::erase(const std::string& key) {
  auto it = index_.find(key);
  if (it == index_.end()) return false;
  items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(it->second));
  index_.clear();
  for (size_t i = 0; i < items_.size(); ++i) index_.emplace(items_[i].first, i);
  return true;
}

std::vector<std::string> StateDict::keys() const {
  std::vector<std::string> out;
  out.reserve(items_.size());
  for (const auto& item : items_) out.push_back(item.first);
  return out;
}

StateDict StateDict::with_prefix(const std::string& prefix, bool strip) const {
  StateDict out;
  for (const auto& [k, v] : items_) {
    if (k.compare(0, prefix.size(), prefix) == 0) out.insert_or_assign(strip ? k.substr(prefix.size()) : k, v);
  }
  return out;
}

void StateDict::update(const StateDict& other, const std::string& prefix) {
  for (const auto& [k, v] : other) insert_or_assign(prefix + k, v);
}

const char* kind_name(const StateDictValue& value) {
  if (std::holds_alternative<DTensor>(value)) return "DTensor";
  if (std::holds_alternative<torch::Tensor>(value)) return "Tensor";
  return "Value";
}

namespace {

using detail::list_keys;
using detail::shape_str;

using detail::FSDPParam;
using detail::FSDPParamGroup;

// ---------------------------------------------------------------------------------------------
// The FSDP layout of a model's parameters.

struct Layout {
  FSDPParamGroup* group = nullptr;
  const FSDPParam* param = nullptr;
  /// The parameter's sharded DTensor (aliases its local shard).
  DTensor dtensor() const { return group->sharded_dtensor(*param); }
};

struct ModelContext {
  std::unordered_map<const c10::TensorImpl*, Layout> layouts;
  ProcessGroupPtr world;  // null: a single process
  int rank = 0;

  /// Walks every FSDP state under `model`, reshards its group (state dicts read and write the local
  /// shards, as FSDP2's state_dict does) and records each sharded parameter's layout.
  explicit ModelContext(const torch::nn::Module& model) {
    std::unordered_set<detail::FSDPState*> seen;
    auto visit = [&](const torch::nn::Module& m) {
      auto s = detail::state_of(m);
      if (!s || !seen.insert(s.get()).second || !s->group) return;
      s->group->reshard();
      for (const auto& p : s->group->params()) layouts[p.param.unsafeGetTensorImpl()] = Layout{s->group.get(), &p};
      if (!world) world = s->group->mesh()->world();
    };
    visit(model);
    for (const auto& item : model.named_modules("", /*include_self=*/false)) visit(*item.value());
    if (!world && is_initialized()) world = default_process_group();
    rank = world ? world->rank() : 0;
  }
  const Layout* find(const torch::Tensor& t) const {
    auto it = layouts.find(t.unsafeGetTensorImpl());
    return it == layouts.end() ? nullptr : &it->second;
  }
};

/// The piece of `full` that `like` holds locally (a view).
torch::Tensor local_piece(const torch::Tensor& full, const DTensor& like) {
  auto offsets = like.local_offsets();
  auto sizes = like.to_local().sizes();
  torch::Tensor t = full;
  for (int64_t d = 0; d < full.dim(); ++d) {
    if (sizes[d] != full.size(d)) t = t.narrow(d, offsets[d], sizes[d]);
  }
  return t;
}

bool same_layout(const DTensor& a, const DTensor& b) {
  return a.sizes() == b.sizes() && a.local_offsets() == b.local_offsets() &&
         a.to_local().sizes() == b.to_local().sizes();
}

/// Copies src into dst (skipped when they are the same memory: a dict that aliases its target).
void copy_into(const torch::Tensor& dst, const torch::Tensor& src) {
  if (dst.numel() == 0) return;
  if (dst.data_ptr() == src.data_ptr() && dst.sizes() == src.sizes() && dst.strides() == src.strides() &&
      dst.scalar_type() == src.scalar_type() && dst.device() == src.device())
    return;
  dst.copy_(src);
}

/// What set_* will do once everything has been validated.
struct Prepared {
  std::vector<std::function<void()>> apply;
  LoadResult result;
  void run() {
    torch::NoGradGuard no_grad;
    for (auto& f : apply) f();
  }
};

/// Checks the missing/unexpected keys of a strict load.
void check_strict(const LoadResult& r, bool strict, const char* api, const char* what, int rank) {
  if (!strict) return;
  TORCH_CHECK(r.missing_keys.empty(), api, ": the state dict lacks ", r.missing_keys.size(), " key(s) the ", what,
              " has, on rank ", rank, ": ", list_keys(r.missing_keys),
              ". Fix: pass a complete state dict, or strict(false) to load the rest and leave these unchanged");
  TORCH_CHECK(r.unexpected_keys.empty(), api, ": the state dict holds ", r.unexpected_keys.size(),
              " key(s) the ", what, " does not have, on rank ", rank, ": ", list_keys(r.unexpected_keys),
              ". Fix: remove them (e.g. a prefix such as 'model.' left on the keys?), or strict(false) to ignore them");
}

/// Validates one tensor entry against its destination and returns the source to copy from (already
/// the local piece). `dst_layout` is set when the destination is a sharded parameter (or state of one).
torch::Tensor resolve_tensor(const StateDictValue& entry, const std::string& key, const torch::Tensor& dst,
                             const std::optional<DTensor>& dst_layout, const char* api, int rank) {
  TORCH_CHECK(!std::holds_alternative<Value>(entry), api, ": '", key, "' is a Value in the state dict but a tensor in the ",
              "destination (rank ", rank, ")");
  const auto global = dst_layout ? dst_layout->sizes() : dst.sizes().vec();
  if (const auto* d = std::get_if<DTensor>(&entry)) {
    TORCH_CHECK(d->sizes() == global, api, ": '", key, "' has shape ", shape_str(d->sizes()), " in the state dict but ",
                shape_str(global), " in the destination (rank ", rank, "). Fix: load state saved from a model of this ",
                "configuration");
    TORCH_CHECK(d->scalar_type() == dst.scalar_type(), api, ": '", key, "' has dtype ", d->scalar_type(),
                " in the state dict but ", dst.scalar_type(), " in the destination (rank ", rank,
                "). Fix: convert the state dict's tensor, or load into a model of that dtype");
    if (!dst_layout) {
      TORCH_CHECK(d->to_local().sizes() == dst.sizes(), api, ": '", key,
                  "' is a sharded DTensor in the state dict but the destination is not sharded (rank ", rank,
                  "). Fix: pass its full tensor (DTensor::full_tensor()), or load through dcp::load, which reshards");
      return d->to_local();
    }
    TORCH_CHECK(same_layout(*d, *dst_layout), api, ": '", key, "' is sharded as ", d->str(), " in the state dict but as ",
                dst_layout->str(), " in the destination (rank ", rank, "). Fix: pass its full tensor, or load through ",
                "dcp::load, which reshards");
    return d->to_local();
  }
  const auto& t = std::get<torch::Tensor>(entry);
  TORCH_CHECK(t.defined(), api, ": '", key, "' is an undefined tensor in the state dict (rank ", rank, ")");
  TORCH_CHECK(t.sizes().vec() == global, api, ": '", key, "' has shape ", shape_str(t.sizes()), " in the state dict but ",
              shape_str(global), " in the destination (rank ", rank, "). Fix: load state saved from a model of this ",
              "configuration");
  TORCH_CHECK(t.scalar_type() == dst.scalar_type(), api, ": '", key, "' has dtype ", t.scalar_type(),
              " in the state dict but ", dst.scalar_type(), " in the destination (rank ", rank,
              "). Fix: convert the state dict's tensor, or load into a model of that dtype");
  return dst_layout ? local_piece(t, *dst_layout) : t;
}

// ---------------------------------------------------------------------------------------------
// broadcast_from_rank0: rank 0's dict becomes every rank's, tensors cut to the local pieces.

void broadcast_string(std::string& s, ProcessGroup& pg) {
  auto len = torch::tensor({static_cast<int64_t>(s.size())}, torch::kInt64).to(pg.device());
  broadcast(len, 0, pg);
  int64_t n = len.cpu().item<int64_t>();
  auto bytes = torch::empty({n}, torch::kUInt8);
  if (pg.rank() == 0 && n) std::memcpy(bytes.data_ptr(), s.data(), static_cast<size_t>(n));
  bytes = bytes.to(pg.device());
  broadcast(bytes, 0, pg);
  bytes = bytes.cpu();
  s.assign(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(n));
}

using LocalOf = std::function<StateDictValue(const std::string& key, const torch::Tensor& full)>;

StateDict broadcast_dict(const StateDict& sd, const ProcessGroupPtr& world, const LocalOf& local_of, const char* api) {
  if (!world || world->size() == 1) {
    StateDict out;
    for (const auto& [k, v] : sd) {
      if (const auto* t = std::get_if<torch::Tensor>(&v)) out.insert_or_assign(k, local_of(k, *t));
      else out.insert_or_assign(k, v);
    }
    return out;
  }
  ProcessGroup& pg = *world;
  // Manifest: keys, kinds, dtypes, shapes and Values of rank 0's dict (or the error that stops everyone).
  std::string manifest;
  if (pg.rank() == 0) {
    nlohmann::json m = nlohmann::json::array();
    std::string error;
    for (const auto& [k, v] : sd) {
      if (const auto* t = std::get_if<torch::Tensor>(&v)) {
        m.push_back({{"k", k}, {"dtype", static_cast<int>(t->scalar_type())}, {"shape", t->sizes().vec()}});
      } else if (const auto* val = std::get_if<Value>(&v)) {
        m.push_back({{"k", k}, {"value", val->json}, {"per_rank", val->per_rank}});
      } else if (error.empty()) {
        error = std::string(api) + ": broadcast_from_rank0 needs full tensors on rank 0, but '" + k +
                "' is a DTensor. Fix: pass get_*_state_dict(..., full_state_dict(true)) on rank 0, or load without "
                "broadcast_from_rank0";
      }
    }
    manifest = error.empty() ? nlohmann::json{{"entries", m}}.dump() : nlohmann::json{{"error", error}}.dump();
  }
  broadcast_string(manifest, pg);
  auto m = nlohmann::json::parse(manifest);
  TORCH_CHECK(!m.contains("error"), m.value("error", std::string()), " (seen on rank ", pg.rank(), ")");
  StateDict out;
  for (const auto& e : m["entries"]) {
    auto key = e["k"].get<std::string>();
    if (e.contains("value")) {
      out.insert_or_assign(key, Value(e["value"], e["per_rank"].get<bool>()));
      continue;
    }
    auto dtype = static_cast<torch::ScalarType>(e["dtype"].get<int>());
    auto shape = e["shape"].get<std::vector<int64_t>>();
    torch::Tensor buf;
    if (pg.rank() == 0) {
      buf = std::get<torch::Tensor>(sd.at(key)).to(pg.device()).contiguous();
      if (buf.is_same(std::get<torch::Tensor>(sd.at(key)))) buf = buf.clone();  // never broadcast into the source
    } else {
      buf = torch::empty(shape, torch::TensorOptions().dtype(dtype).device(pg.device()));
    }
    if (buf.numel() > 0) broadcast(buf, 0, pg);
    out.insert_or_assign(key, local_of(key, buf));
  }
  return out;
}

/// For a destination sharded like `layout`: the local piece (as a DTensor, copied so the full tensor
/// can be freed) when `full` has the global shape; else `full` unchanged (validation reports it).
StateDictValue cut(const torch::Tensor& full, const std::optional<DTensor>& layout) {
  if (!layout || full.sizes().vec() != layout->sizes()) return full;
  return DTensor(local_piece(full, *layout).clone(), layout->device_mesh(), layout->placements(), layout->sizes());
}

using Layouts = std::unordered_map<std::string, std::optional<DTensor>>;  // tensor key -> destination layout

LocalOf local_of_for(const Layouts& layouts) {
  return [&layouts](const std::string& key, const torch::Tensor& full) -> StateDictValue {
    auto it = layouts.find(key);
    return cut(full, it == layouts.end() ? std::nullopt : it->second);
  };
}

/// Every rank learns whether every rank validated its dict; throws on all ranks if one did not (so
/// that no rank applies a load another rank rejected). Collective over `world`.
void agree(const ProcessGroupPtr& world, const std::exception_ptr& error, const char* api, int rank) {
  if (world && world->size() > 1) {
    auto flag = torch::tensor({error ? 1 : 0}, torch::kInt32).to(world->device());
    all_reduce(flag, *world, ReduceOp::MAX);
    if (!error) {
      TORCH_CHECK(flag.cpu().item<int>() == 0, api, ": another rank rejected its state dict (see its error); nothing ",
                  "was loaded on rank ", rank);
    }
  }
  if (error) std::rethrow_exception(error);
}

// ---------------------------------------------------------------------------------------------
// Model

struct ModelTarget {
  std::string key;
  torch::Tensor dst;              // where the value goes (the local shard for a sharded parameter)
  std::optional<DTensor> layout;  // set for sharded parameters
};

struct ModelTargets {
  std::vector<ModelTarget> targets;
  std::unordered_set<std::string> frozen;  // left out by ignore_frozen_params
};

ModelTargets model_targets(const torch::nn::Module& model, const ModelContext& ctx, const StateDictOptions& o) {
  ModelTargets out;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto& p = item.value();
    if (o.ignore_frozen_params() && !p.requires_grad()) {
      out.frozen.insert(item.key());
      continue;
    }
    if (const auto* l = ctx.find(p)) {
      out.targets.push_back({item.key(), l->param->sharded_data, l->dtensor()});
    } else {
      out.targets.push_back({item.key(), p.detach(), std::nullopt});
    }
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    out.targets.push_back({item.key(), item.value().detach(), std::nullopt});
  }
  return out;
}

Prepared prepare_model(const ModelTargets& mt, const StateDict& sd, const char* api, int rank) {
  Prepared prep;
  std::unordered_set<std::string> expected;
  for (const auto& t : mt.targets) {
    expected.insert(t.key);
    const auto* entry = sd.find(t.key);
    if (!entry) {
      prep.result.missing_keys.push_back(t.key);
      continue;
    }
    auto src = resolve_tensor(*entry, t.key, t.dst, t.layout, api, rank);
    prep.apply.push_back([dst = t.dst, src] { copy_into(dst, src); });
  }
  for (const auto& [k, v] : sd) {
    if (!expected.count(k) && !mt.frozen.count(k)) prep.result.unexpected_keys.push_back(k);
  }
  return prep;
}

Layouts model_layouts(const ModelTargets& mt) {
  Layouts l;
  for (const auto& t : mt.targets) l.emplace(t.key, t.layout);
  return l;
}

// ---------------------------------------------------------------------------------------------
// Optimizer

enum class OptKind { ADAM, ADAMW, SGD };

OptKind opt_kind(const torch::optim::Optimizer& o, const char* api) {
  if (dynamic_cast<const torch::optim::AdamW*>(&o)) return OptKind::ADAMW;
  if (dynamic_cast<const torch::optim::Adam*>(&o)) return OptKind::ADAM;
  if (dynamic_cast<const torch::optim::SGD*>(&o)) return OptKind::SGD;
  TORCH_CHECK(false, api, ": optimizer type ", c10::demangle(typeid(o).name()),
              " is not supported: expected torch::optim::Adam, AdamW or SGD");
}

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

/// One parameter of the optimizer, with its FQN and layout.
struct OptParam {
  size_t group = 0;
  std::string fqn;
  torch::Tensor param;            // the optimizer's tensor (its data is the local shard)
  std::optional<DTensor> layout;  // set when sharded
};

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
      torch::Tensor local = field && field->defined() ? *field : torch::zeros_like(op.param.detach());
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

Layouts optimizer_layouts(const std::vector<OptParam>& params) {
  Layouts l;
  for (const auto& op : params) {
    for (const char* name : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"})
      l.emplace("state." + op.fqn + "." + name, op.layout);
  }
  return l;
}

Prepared prepare_optimizer(const std::vector<OptParam>& params, torch::optim::Optimizer& opt, OptKind k,
                           const StateDict& sd, const StateDictOptions& o, const char* api, int rank) {
  Prepared prep;
  std::unordered_set<std::string> expected;
  std::unordered_set<std::string> frozen_keys;
  auto missing = [&](const std::string& key) { prep.result.missing_keys.push_back(key); };

  // Hyper-parameters: one value per param group, which every parameter of the group must agree on.
  const size_t n_groups = opt.param_groups().size();
  std::vector<nlohmann::json> group_hp(n_groups);
  std::vector<std::map<std::string, std::string>> hp_source(n_groups);  // name -> fqn it came from
  for (size_t g = 0; g < n_groups; ++g) group_hp[g] = get_hparams(opt.param_groups()[g].options(), k);
  std::vector<bool> group_changed(n_groups, false);
  for (const auto& op : params) {
    const bool frozen = o.ignore_frozen_params() && !op.param.requires_grad();
    for (const auto& name : hparam_names(k)) {
      const std::string key = "param_groups." + op.fqn + "." + name;
      if (frozen) {
        frozen_keys.insert(key);
        continue;
      }
      expected.insert(key);
      const auto* entry = sd.find(key);
      if (!entry) {
        missing(key);
        continue;
      }
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
    prep.apply.push_back([&opt, g, k, hp = group_hp[g]] { set_hparams(opt.param_groups()[g].options(), k, hp); });
  }

  // Per-parameter state, under the hyper-parameters the load leaves in place.
  for (const auto& op : params) {
    const bool frozen = o.ignore_frozen_params() && !op.param.requires_grad();
    std::vector<std::pair<std::string, torch::Tensor>> sources;  // state name -> local source
    std::optional<int64_t> step;
    auto names = state_names(k, group_hp[op.group]);
    auto* state = find_state(opt, op.param);
    for (const auto& name : names) {
      const std::string key = "state." + op.fqn + "." + name;
      if (frozen) {
        frozen_keys.insert(key);
        continue;
      }
      expected.insert(key);
      const auto* entry = sd.find(key);
      if (!entry) {
        missing(key);
        continue;
      }
      auto* field = state_field(state, k, name);
      torch::Tensor like = field && field->defined() ? *field : op.param.detach();
      sources.emplace_back(name, resolve_tensor(*entry, key, like, op.layout, api, rank));
    }
    if (has_step(k)) {
      const std::string key = "state." + op.fqn + ".step";
      if (frozen) {
        frozen_keys.insert(key);
      } else {
        expected.insert(key);
        const auto* entry = sd.find(key);
        if (!entry) {
          missing(key);
        } else {
          const auto* v = std::get_if<Value>(entry);
          TORCH_CHECK(v && v->json.is_number_integer() && v->json.get<int64_t>() >= 0, api, ": '", key,
                      "' must be a Value holding a non-negative integer, got ",
                      v ? v->json.dump() : std::string(kind_name(*entry)), " (rank ", rank, ")");
          step = v->json.get<int64_t>();
        }
      }
    }
    if (sources.empty() && !step) continue;
    prep.apply.push_back([&opt, k, p = op.param, sources, step, names] {
      auto& st = opt.state();
      auto it = st.find(p.unsafeGetTensorImpl());
      if (it == st.end()) {
        // torch::optim creates state lazily at a parameter's first step: create it now, as that step would.
        auto s = new_state(k);
        for (const auto& name : names) *state_field(s.get(), k, name) = torch::zeros_like(p.detach());
        it = st.emplace(p.unsafeGetTensorImpl(), std::move(s)).first;
      }
      for (const auto& [name, src] : sources) {
        auto* field = state_field(it->second.get(), k, name);
        if (!field->defined()) *field = torch::zeros_like(p.detach());
        copy_into(*field, src);
      }
      if (step) set_step(*it->second, k, *step);
    });
  }
  for (const auto& [key, v] : sd) {
    if (!expected.count(key) && !frozen_keys.count(key)) prep.result.unexpected_keys.push_back(key);
  }
  return prep;
}

void prefix_keys(LoadResult& out, const LoadResult& in, const std::string& prefix) {
  for (const auto& k : in.missing_keys) out.missing_keys.push_back(prefix + k);
  for (const auto& k : in.unexpected_keys) out.unexpected_keys.push_back(prefix + k);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public API

StateDict get_model_state_dict(const torch::nn::Module& model, const StateDictOptions& o) {
  ModelContext ctx(model);
  auto mt = model_targets(model, ctx, o);
  const bool full = o.full_state_dict();
  const bool keep = !(full && o.cpu_offload()) || ctx.rank == 0;
  StateDict sd;
  for (const auto& t : mt.targets) {
    if (t.layout && !full) {
      sd.insert_or_assign(t.key, *t.layout);
      continue;
    }
    torch::Tensor v = t.layout ? t.layout->full_tensor() : t.dst;  // full_tensor: collective, same order on every rank
    if (!keep) continue;
    sd.insert_or_assign(t.key, full && o.cpu_offload() ? v.cpu() : v);
  }
  return sd;
}

LoadResult set_model_state_dict(torch::nn::Module& model, const StateDict& state_dict, const StateDictOptions& o) {
  const char* api = "set_model_state_dict";
  ModelContext ctx(model);
  auto mt = model_targets(model, ctx, o);
  Prepared prep;
  std::exception_ptr error;
  try {
    if (o.broadcast_from_rank0()) {
      auto layouts = model_layouts(mt);
      auto local = broadcast_dict(state_dict, ctx.world, local_of_for(layouts), api);
      prep = prepare_model(mt, local, api, ctx.rank);
    } else {
      prep = prepare_model(mt, state_dict, api, ctx.rank);
    }
    check_strict(prep.result, o.strict(), api, "model", ctx.rank);
  } catch (...) {
    error = std::current_exception();
  }
  agree(ctx.world, error, api, ctx.rank);
  prep.run();
  return prep.result;
}

StateDict get_optimizer_state_dict(const torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
                                   const StateDictOptions& o) {
  ModelContext ctx(model);
  return optimizer_state_dict(model, optimizer, o, ctx);
}

LoadResult set_optimizer_state_dict(const torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                    const StateDict& state_dict, const StateDictOptions& o) {
  const char* api = "set_optimizer_state_dict";
  ModelContext ctx(model);
  Prepared prep;
  std::exception_ptr error;
  try {
    const OptKind k = opt_kind(optimizer, api);
    auto params = opt_params(model, optimizer, ctx, api);
    if (o.broadcast_from_rank0()) {
      auto layouts = optimizer_layouts(params);
      auto local = broadcast_dict(state_dict, ctx.world, local_of_for(layouts), api);
      prep = prepare_optimizer(params, optimizer, k, local, o, api, ctx.rank);
    } else {
      prep = prepare_optimizer(params, optimizer, k, state_dict, o, api, ctx.rank);
    }
    check_strict(prep.result, o.strict(), api, "optimizer", ctx.rank);
  } catch (...) {
    error = std::current_exception();
  }
  agree(ctx.world, error, api, ctx.rank);
  prep.run();
  return prep.result;
}

StateDict get_state_dict(const torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
                         const StateDictOptions& o) {
  ModelContext ctx(model);
  StateDict sd;
  sd.update(get_model_state_dict(model, o), kModelPrefix);
  sd.update(optimizer_state_dict(model, optimizer, o, ctx), kOptimPrefix);
  return sd;
}

LoadResult set_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const StateDict& state_dict,
                          const StateDictOptions& o) {
  const char* api = "set_state_dict";
  ModelContext ctx(model);
  auto mt = model_targets(model, ctx, o);
  Prepared model_prep, optim_prep;
  LoadResult result;
  std::exception_ptr error;
  try {
    const OptKind k = opt_kind(optimizer, api);
    auto params = opt_params(model, optimizer, ctx, api);
    StateDict local;
    const StateDict* src = &state_dict;
    if (o.broadcast_from_rank0()) {
      Layouts layouts;
      for (auto& [key, l] : model_layouts(mt)) layouts.emplace(kModelPrefix + key, l);
      for (auto& [key, l] : optimizer_layouts(params)) layouts.emplace(kOptimPrefix + key, l);
      local = broadcast_dict(state_dict, ctx.world, local_of_for(layouts), api);
      src = &local;
    }
    model_prep = prepare_model(mt, src->with_prefix(kModelPrefix), api, ctx.rank);
    optim_prep = prepare_optimizer(params, optimizer, k, src->with_prefix(kOptimPrefix), o, api, ctx.rank);
    prefix_keys(result, model_prep.result, kModelPrefix);
    prefix_keys(result, optim_prep.result, kOptimPrefix);
    const std::string mp = kModelPrefix, op = kOptimPrefix;
    for (const auto& [key, v] : *src) {
      if (key.compare(0, mp.size(), mp) != 0 && key.compare(0, op.size(), op) != 0) result.unexpected_keys.push_back(key);
    }
    check_strict(result, o.strict(), api, "model and optimizer", ctx.rank);
  } catch (...) {
    error = std::current_exception();
  }
  agree(ctx.world, error, api, ctx.rank);
  model_prep.run();
  optim_prep.run();
  return result;
}

}  // namespace fsdp
