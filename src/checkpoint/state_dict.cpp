// State dicts of sharded modules (see include/fsdp/checkpoint/state_dict.h): the StateDict container, what model
// and optimizer loads share (validation of a tensor entry, broadcast_from_rank0), the model's state dict
// and set_state_dict, which loads both. The optimizer's is in optim_state_dict.cpp, as PyTorch splits
// get_model_state_dict and get_optimizer_state_dict.
//
// Every set_* function follows [Note: validate, agree, apply] (validate_agree_apply.h): prepare_*()
// validates the whole dict against the model (and optimizer) and stages what it will copy; only when
// every rank validated does Prepared::run() copy (under NoGradGuard) and create optimizer state. So a
// failed load changes nothing on any rank.
#include "fsdp/checkpoint/state_dict.h"

#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "fsdp/c10d/collectives.h"
#include "checkpoint/state_dict_impl.h"
#include "tensor/parallel/tp_ops.h"
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

// ---------------------------------------------------------------------------------------------
// Shared by the model and optimizer state dicts (state_dict_impl.h)

namespace detail::sd {

ModelContext::ModelContext(const torch::nn::Module& model) {
  std::unordered_set<FSDPState*> seen;
  auto visit = [&](const torch::nn::Module& m) {
    auto s = state_of(m);
    if (!s || !seen.insert(s.get()).second || !s->group) return;
    s->group->reshard();
    for (const auto& p : s->group->params()) layouts[p.param.unsafeGetTensorImpl()] = Layout{s->group.get(), &p};
    // The world of the parameters' DTensors: FSDP's mesh, or its root with TP ([Note: FSDP over TP]).
    if (!world && !s->group->params().empty()) world = s->group->sharded_dtensor(s->group->params()[0]).device_mesh()->world();
  };
  visit(model);
  for (const auto& item : model.named_modules("", /*include_self=*/false)) visit(*item.value());
  // Tensor-parallel parameters that no fully_shard manages (a TP-only model) are DTensors too.
  for (const auto& p : model.parameters()) {
    if (layouts.count(p.unsafeGetTensorImpl()) || !tp::detail::find_tp_param(p)) continue;
    Layout l;
    l.tp_param = p;
    if (!world) world = l.dtensor().device_mesh()->world();
    layouts.emplace(p.unsafeGetTensorImpl(), std::move(l));
  }
  if (!world && is_initialized()) world = default_process_group();
  rank = world ? world->rank() : 0;
}

namespace {

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

/// The piece of `full` for a destination sharded like `layout` (as a DTensor, copied so the full
/// tensor can be freed) when `full` has the global shape; else `full` unchanged (validation reports it).
StateDictValue cut(const torch::Tensor& full, const std::optional<DTensor>& layout) {
  if (!layout || full.sizes().vec() != layout->sizes()) return full;
  return DTensor(local_piece(full, *layout).clone(), layout->device_mesh(), layout->placements(), layout->sizes());
}

/// Broadcasts rank `root`'s `s` to every rank of `pg` (two broadcasts: its length, then its bytes).
void broadcast_string(std::string& s, int root, ProcessGroup& pg) {
  auto len = torch::tensor({static_cast<int64_t>(s.size())}, torch::kInt64).to(pg.device());
  broadcast(len, root, pg);
  int64_t n = len.cpu().item<int64_t>();
  auto bytes = torch::empty({n}, torch::kUInt8);
  if (pg.rank() == root && n) std::memcpy(bytes.data_ptr(), s.data(), static_cast<size_t>(n));
  bytes = bytes.to(pg.device());
  broadcast(bytes, root, pg);
  bytes = bytes.cpu();
  s.assign(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(n));
}

/// Rank 0's manifest of `sd`: keys, kinds, dtypes, shapes and Values (or the error that stops everyone).
std::string manifest_of(const StateDict& sd, const char* api) {
  nlohmann::json m = nlohmann::json::array();
  for (const auto& [k, v] : sd) {
    if (const auto* t = std::get_if<torch::Tensor>(&v)) {
      m.push_back({{"k", k}, {"dtype", static_cast<int>(t->scalar_type())}, {"shape", t->sizes().vec()}});
    } else if (const auto* val = std::get_if<Value>(&v)) {
      m.push_back({{"k", k}, {"value", val->json}, {"per_rank", val->per_rank}});
    } else {
      const std::string error = std::string(api) + ": broadcast_from_rank0 needs full tensors on rank 0, but '" + k +
                                "' is a DTensor. Fix: pass get_*_state_dict(..., full_state_dict(true)) on rank 0, or "
                                "load without broadcast_from_rank0";
      return nlohmann::json{{"error", error}}.dump();
    }
  }
  return nlohmann::json{{"entries", m}}.dump();
}

}  // namespace

/// Copies src into dst (skipped when they are the same memory: a dict that aliases its target).
void copy_into(const torch::Tensor& dst, const torch::Tensor& src) {
  if (dst.numel() == 0) return;
  if (dst.data_ptr() == src.data_ptr() && dst.sizes() == src.sizes() && dst.strides() == src.strides() &&
      dst.scalar_type() == src.scalar_type() && dst.device() == src.device())
    return;
  dst.copy_(src);
}

Agree agree_over(const ProcessGroupPtr& world) {
  return [world](const std::string& problem) -> std::optional<Failure> {
    if (!world || world->size() == 1) return std::nullopt;
    // The lowest failing rank (size when none failed): one all-reduce when every rank validated.
    auto first = torch::tensor({problem.empty() ? world->size() : world->rank()}, torch::kInt32).to(world->device());
    all_reduce(first, *world, ReduceOp::MIN);
    const int r = first.cpu().item<int>();
    if (r == world->size()) return std::nullopt;
    std::string message = problem;
    broadcast_string(message, r, *world);
    return Failure{r, message};
  };
}

void check_strict(const LoadResult& r, bool strict, const char* api, const char* what, int rank) {
  if (!strict) return;
  TORCH_CHECK(r.missing_keys.empty(), api, ": the state dict lacks ", r.missing_keys.size(), " key(s) the ", what,
              " has, on rank ", rank, ": ", list_keys(r.missing_keys),
              ". Fix: pass a complete state dict, or strict(false) to load the rest and leave these unchanged");
  TORCH_CHECK(r.unexpected_keys.empty(), api, ": the state dict holds ", r.unexpected_keys.size(),
              " key(s) the ", what, " does not have, on rank ", rank, ": ", list_keys(r.unexpected_keys),
              ". Fix: remove them (e.g. a prefix such as 'model.' left on the keys?), or strict(false) to ignore them");
}

torch::Tensor resolve_tensor(const StateDictValue& entry, const std::string& key, const torch::Tensor& dst,
                             const std::optional<DTensor>& dst_layout, const char* api, int rank) {
  TORCH_CHECK(!std::holds_alternative<Value>(entry), api, ": '", key, "' is a Value in the state dict but a tensor in the ",
              "destination (rank ", rank, ")");
  const auto* d = std::get_if<DTensor>(&entry);
  const auto* t = std::get_if<torch::Tensor>(&entry);
  TORCH_CHECK(d || t->defined(), api, ": '", key, "' is an undefined tensor in the state dict (rank ", rank, ")");
  const auto global = dst_layout ? dst_layout->sizes() : dst.sizes().vec();
  const auto sizes = d ? d->sizes() : t->sizes().vec();
  const auto dtype = d ? d->scalar_type() : t->scalar_type();
  TORCH_CHECK(sizes == global, api, ": '", key, "' has shape ", shape_str(sizes), " in the state dict but ",
              shape_str(global), " in the destination (rank ", rank, "). Fix: load state saved from a model of this ",
              "configuration");
  TORCH_CHECK(dtype == dst.scalar_type(), api, ": '", key, "' has dtype ", dtype, " in the state dict but ",
              dst.scalar_type(), " in the destination (rank ", rank,
              "). Fix: convert the state dict's tensor, or load into a model of that dtype");
  if (!d) return dst_layout ? local_piece(*t, *dst_layout) : *t;
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

StateDict broadcast_dict(const StateDict& sd, const ProcessGroupPtr& world, const Layouts& layouts, const char* api) {
  auto local_of = [&layouts](const std::string& key, const torch::Tensor& full) -> StateDictValue {
    auto it = layouts.find(key);
    if (it == layouts.end()) {
      const auto dot = key.rfind('.');
      if (dot != std::string::npos) it = layouts.find(key.substr(0, dot) + ".*");
    }
    return cut(full, it == layouts.end() ? std::nullopt : it->second);
  };
  if (!world || world->size() == 1) {
    StateDict out;
    for (const auto& [k, v] : sd) {
      if (const auto* t = std::get_if<torch::Tensor>(&v)) out.insert_or_assign(k, local_of(k, *t));
      else out.insert_or_assign(k, v);
    }
    return out;
  }
  ProcessGroup& pg = *world;
  std::string manifest = pg.rank() == 0 ? manifest_of(sd, api) : std::string();
  broadcast_string(manifest, 0, pg);
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

void emit_tensor(StateDict& sd, const std::string& key, const DTensor& d, const StateDictOptions& o, bool keep) {
  if (!o.full_state_dict()) {
    // Sharded: the DTensor itself; with cpu_offload one whose local is on the CPU (Tensor.to: a copy from an
    // accelerator, the same tensor when it is on the CPU already, as PyTorch's _offload_state_dict_to_cpu).
    if (!o.cpu_offload()) sd.insert_or_assign(key, d);
    else sd.insert_or_assign(key, DTensor(d.to_local().to(torch::kCPU), d.device_mesh(), d.placements(), d.sizes()));
    return;
  }
  // A collective: issued in the same order on every rank, kept or not. Without autograd (full_tensor is
  // differentiable: the state dict holds values, as PyTorch's, which builds it under no_grad).
  torch::Tensor full;
  {
    torch::NoGradGuard no_grad;
    full = d.full_tensor();
  }
  if (keep) sd.insert_or_assign(key, o.cpu_offload() ? full.to(torch::kCPU) : full);
}

void emit_tensor(StateDict& sd, const std::string& key, const torch::Tensor& t, const StateDictOptions& o, bool keep) {
  if (keep) sd.insert_or_assign(key, o.cpu_offload() ? t.to(torch::kCPU) : t);
}

// ---------------------------------------------------------------------------------------------
// Model

namespace {

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
      out.targets.push_back({item.key(), l->local(), l->dtensor()});
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

}  // namespace

}  // namespace detail::sd

// ---------------------------------------------------------------------------------------------
// Public API

using namespace detail::sd;  // NOLINT: this file's own internals

StateDict get_model_state_dict(const torch::nn::Module& model, const StateDictOptions& o) {
  ModelContext ctx(model);
  auto mt = model_targets(model, ctx, o);
  const bool keep = keeps_entries(o, ctx.rank);
  StateDict sd;
  for (const auto& t : mt.targets) {
    if (t.layout) emit_tensor(sd, t.key, *t.layout, o, keep);  // the parameter's own DTensor
    else emit_tensor(sd, t.key, t.dst, o, keep);
  }
  return sd;
}

LoadResult set_model_state_dict(torch::nn::Module& model, const StateDict& state_dict, const StateDictOptions& o) {
  const char* api = "set_model_state_dict";
  ModelContext ctx(model);
  auto mt = model_targets(model, ctx, o);
  Prepared prep;
  auto validate = [&] {  // see [Note: validate, agree, apply]
    StateDict local;
    if (o.broadcast_from_rank0()) local = broadcast_dict(state_dict, ctx.world, model_layouts(mt), api);
    prep = prepare_model(mt, o.broadcast_from_rank0() ? local : state_dict, api, ctx.rank);
    check_strict(prep.result, o.strict(), api, "model", ctx.rank);
  };
  validate_agree_apply(api, validate, agree_over(ctx.world), [&] { prep.run(); });
  return prep.result;
}

StateDict get_state_dict(const torch::nn::Module& model, const std::vector<const torch::optim::Optimizer*>& optimizers,
                         const StateDictOptions& o) {
  std::vector<torch::optim::Optimizer*> opts;
  for (const auto* p : optimizers) opts.push_back(const_cast<torch::optim::Optimizer*>(p));  // only read
  Optims optims(std::move(opts), "get_state_dict");
  ModelContext ctx(model);
  StateDict sd;
  sd.update(get_model_state_dict(model, o), kModelPrefix);
  sd.update(optimizer_state_dict(model, optims, o, ctx), kOptimPrefix);
  return sd;
}

StateDict get_state_dict(const torch::nn::Module& model, const torch::optim::Optimizer& optimizer,
                         const StateDictOptions& o) {
  return get_state_dict(model, std::vector<const torch::optim::Optimizer*>{&optimizer}, o);
}

namespace {

void prefix_keys(LoadResult& out, const LoadResult& in, const std::string& prefix) {
  for (const auto& k : in.missing_keys) out.missing_keys.push_back(prefix + k);
  for (const auto& k : in.unexpected_keys) out.unexpected_keys.push_back(prefix + k);
}

}  // namespace

LoadResult set_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const StateDict& state_dict,
                          const StateDictOptions& o) {
  return set_state_dict(model, std::vector<torch::optim::Optimizer*>{&optimizer}, state_dict, o);
}

LoadResult set_state_dict(torch::nn::Module& model, const std::vector<torch::optim::Optimizer*>& optimizers,
                          const StateDict& state_dict, const StateDictOptions& o) {
  const char* api = "set_state_dict";
  ModelContext ctx(model);
  auto mt = model_targets(model, ctx, o);
  Prepared model_prep, optim_prep;
  LoadResult result;
  auto validate = [&] {  // see [Note: validate, agree, apply]
    Optims optims(optimizers, api);
    auto params = opt_params(model, optims, ctx, api);
    StateDict local;
    if (o.broadcast_from_rank0()) {
      Layouts layouts;
      for (auto& [key, l] : model_layouts(mt)) layouts.emplace(kModelPrefix + key, l);
      for (auto& [key, l] : optimizer_layouts(params)) layouts.emplace(kOptimPrefix + key, l);
      local = broadcast_dict(state_dict, ctx.world, layouts, api);
    }
    const StateDict& src = o.broadcast_from_rank0() ? local : state_dict;
    model_prep = prepare_model(mt, src.with_prefix(kModelPrefix), api, ctx.rank);
    optim_prep = prepare_optimizer(params, optims, src.with_prefix(kOptimPrefix), o, api, ctx.rank);
    prefix_keys(result, model_prep.result, kModelPrefix);
    prefix_keys(result, optim_prep.result, kOptimPrefix);
    const std::string mp = kModelPrefix, op = kOptimPrefix;
    for (const auto& [key, v] : src) {
      if (key.compare(0, mp.size(), mp) != 0 && key.compare(0, op.size(), op) != 0) result.unexpected_keys.push_back(key);
    }
    check_strict(result, o.strict(), api, "model and optimizer", ctx.rank);
  };
  validate_agree_apply(api, validate, agree_over(ctx.world), [&] {
    model_prep.run();
    optim_prep.run();
  });
  return result;
}

}  // namespace fsdp
