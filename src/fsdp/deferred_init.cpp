// deferred_init / materialize_module: record a constructor on the meta device, replay it one
// parameter at a time into the shards. See [Note: deferred init].
#include "fsdp/fsdp/deferred_init.h"

#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "fsdp/deferred_init_internal.h"
#include "fsdp/fsdp_interception.h"
#include "fsdp/fsdp_param.h"
#include "fsdp/fsdp_state.h"
#include "fsdp/unmapping_allocator.h"
#include "tensor/parallel/tp_ops.h"
#include "util.h"

// [Note: deferred init]
// Recording: deferred_init puts kInterceptKey (the key of implicit groups, fsdp_interception.h) in the
// thread's included key set, so every op - factories too, which have no tensor argument - reaches the
// fallback first. The fallback records the op and its arguments, turns every device argument into
// "meta" (so factories allocate nothing) and runs the op below the key with the key excluded: the ops a
// composite op calls are not recorded twice. The record keeps the meta tensors alive (no storage), so
// their addresses identify them until the replay, even after fully_shard turned a parameter into its
// shard in place.
// Replay: the ops run again in order on the CPU with the original arguments, each recorded tensor
// replaced by the real tensor its op produced. The key stays included, so every random op, nested ones
// too (torch::randn calls normal_), gets a private generator started from the default generator's state
// at deferred_init: the same stream as eager construction, untouched by other threads. A tensor whose
// root (views share their base's root) is used for the last time is dropped after that op; a parameter
// or buffer is first copied to where it lives: its rows into its shard, or the whole tensor into the
// meta tensor itself, which becomes a CPU tensor in place (shallow_copy_from, as set_data does; set_data
// refuses a meta-to-CPU change).
namespace fsdp {
namespace detail {
namespace {

// A meta tensor as an op saw it: its storage identifies it (torch::empty wraps the op's result in a new
// TensorImpl, views share their base's storage, and fully_shard later turns a parameter's TensorImpl
// into its shard in place), its view metadata says which part of the storage.
struct TRef {
  c10::Storage storage;  // keeps the address unique until the replay
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
};
TRef ref_of(const torch::Tensor& t) {
  return {t.storage(), t.sizes().vec(), t.strides().vec(), t.storage_offset(), t.scalar_type()};
}
const c10::StorageImpl* sid(const torch::Tensor& t) {
  return t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

struct Recorded {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;                       // as the caller passed them (devices not rewritten)
  std::vector<std::vector<std::optional<TRef>>> targs;  // per argument, per tensor: recorded ones
  std::vector<std::vector<std::optional<TRef>>> touts;  // per result, per tensor: recorded ones
};

// A parameter or buffer of the module. Held weakly ([Note: identity by address]): the weak reference
// keeps `key` from being reused by another tensor while the record exists, and a member that died before
// materialisation is skipped instead of written through a dangling pointer.
struct Member {
  std::string fqn;
  const c10::TensorImpl* key;
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  TRef ref;
};

struct Log {
  std::vector<Recorded> ops;
  std::unordered_set<const c10::StorageImpl*> made;  // storages the recorded ops created
  std::vector<Member> members;
  torch::Tensor rng_state;  // default CPU generator at deferred_init
};

thread_local std::shared_ptr<Log> t_recording;
thread_local std::optional<at::Generator> t_replay_generator;

// Parameters and buffers recorded and not yet materialised -> their record.
std::mutex g_mu;
std::unordered_map<const c10::TensorImpl*, std::shared_ptr<Log>>& pending() {
  static auto* m = new std::unordered_map<const c10::TensorImpl*, std::shared_ptr<Log>>();
  return *m;
}

const auto kAfter = c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kInterceptKey);

bool is_device_arg(const c10::Argument& a) {
  const auto& t = a.type();
  if (t->kind() == c10::TypeKind::DeviceObjType) return true;
  auto opt = t->cast<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == c10::TypeKind::DeviceObjType;
}

bool is_generator_arg(const c10::Argument& a) {
  auto opt = a.type()->cast<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == c10::TypeKind::GeneratorType;
}

template <typename F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const auto& t : v.toTensorList()) f(static_cast<torch::Tensor>(t));
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) {
      if (e.isTensor()) f(e.toTensor());
    }
  }
}

std::vector<std::optional<TRef>> refs(const Log& log, const c10::IValue& v) {
  std::vector<std::optional<TRef>> out;
  for_each_tensor(v, [&](const torch::Tensor& t) {
    out.push_back(t.defined() && log.made.count(sid(t)) ? std::optional<TRef>(ref_of(t)) : std::nullopt);
  });
  return out;
}

void record(Log& log, const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const std::string& name = schema.name();
  TORCH_CHECK(name != "aten::_local_scalar_dense" && name != "aten::item",
              "deferred_init: the constructor reads a tensor's value (", name, ", e.g. .item()), which a meta ",
              "tensor does not have. Fix: compute the value without tensors, or construct that part after ",
              "materialize_module");
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  Recorded r{op, std::vector<c10::IValue>(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end()), {}, {}};
  for (const auto& v : r.args) r.targs.push_back(refs(log, v));
  for (size_t a = 0; a < nargs; ++a) {
    const auto& arg = schema.arguments()[a];
    if (is_device_arg(arg)) {
      (*stack)[base + a] = c10::IValue(c10::Device(c10::kMeta));
    } else if (arg.name() == "pin_memory" && !(*stack)[base + a].isNone()) {
      (*stack)[base + a] = c10::IValue(false);
    }
  }
  {
    NoInterception no_recording;  // the ops this one calls are not recorded again
    try {
      op.redispatchBoxed(ks & kAfter, stack);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "deferred_init: ", name, " failed on meta tensors: ", e.what_without_backtrace(),
                  ". The constructor must not read tensor values (they are created on the meta device); ",
                  "construct that part after materialize_module");
    }
  }
  const size_t nret = schema.returns().size();
  for (size_t k = stack->size() - nret; k < stack->size(); ++k) {
    for_each_tensor((*stack)[k], [&](const torch::Tensor& out) {
      if (out.defined() && out.is_meta() && sid(out)) log.made.insert(sid(out));
    });
    r.touts.push_back(refs(log, (*stack)[k]));
  }
  log.ops.push_back(std::move(r));
}

// During the replay: every random op, nested ones included, draws from the private generator.
void replay_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  for (size_t a = 0; a < nargs; ++a) {
    if (is_generator_arg(schema.arguments()[a]) && (*stack)[base + a].isNone()) {
      (*stack)[base + a] = c10::IValue(*t_replay_generator);
    }
  }
  op.redispatchBoxed(ks & kAfter, stack);
}

// A meta member takes `data`'s storage in place (set_data refuses a meta-to-CPU change), keeping the
// interception key parallelize_module gave it (a TP weight's data carries it) and its TP record, whose
// storage entry must name the new storage.
void become(const c10::intrusive_ptr<c10::TensorImpl>& impl, torch::Tensor data) {
  if (impl->key_set().has(kInterceptKey)) data = intercepted(data);
  impl->shallow_copy_from(data.getIntrusivePtr());
  const torch::Tensor self(impl);
  if (const auto* tp = tp::detail::find_tp_param(self)) {
    auto info = *tp;
    tp::detail::register_tp_param(self, std::move(info));
  }
}

// Copies the full tensor `real` of parameter/buffer `m` where it lives.
void place(const Member& m, const torch::Tensor& real, const ManagedParamMap& managed) {
  TORCH_CHECK(real.sizes().vec() == m.ref.sizes, "materialize_module: '", m.fqn, "' was created with shape ",
              shape_str(m.ref.sizes), " but its recorded initialisation gives ", shape_str(real.sizes()));
  torch::NoGradGuard no_grad;
  NoInterception no_interception;
  auto impl = m.impl.lock();
  if (!impl) return;  // the tensor is gone (its module was dropped or the member replaced)
  // parallelize_module made it this rank's TP part (a chunk, or a replica): that part is what lives here.
  const torch::Tensor self(impl);
  const auto* tp = tp::detail::find_tp_param(self);
  const torch::Tensor local = tp ? tp::detail::local_part(*tp, real) : real;
  auto it = managed.find(m.key);
  if (it != managed.end()) {
    const FSDPParam& p = *it->second.second;
    if (p.local_rows > 0) {
      p.padded_shard.narrow(p.shard_dim, 0, p.local_rows)
          .copy_(local.narrow(p.shard_dim, p.local_offset, p.local_rows));
    }
    return;
  }
  become(impl, local.clone());  // its own storage, in place of the meta one
}

// In-place ops that overwrite all of their first argument without reading it: the values it had before
// are dead, so the storage can be freed after its previous use and made afresh here. Without this, a
// constructor that initialises every parameter twice (LibTorch's modules in their constructors, then a
// GPT-2 style init loop over the whole model) would keep the whole model alive between the two.
bool overwrites_self(const c10::OperatorHandle& op) {
  static const std::unordered_set<std::string> names = {
      "aten::uniform_", "aten::normal_",  "aten::fill_",   "aten::zero_",       "aten::random_",
      "aten::exponential_", "aten::geometric_", "aten::log_normal_", "aten::cauchy_", "aten::bernoulli_",
      "aten::copy_"};
  return names.count(op.schema().name()) > 0;
}

// Each storage's uses in order, cut into segments at the ops that overwrite it whole: a segment's
// values live from its first op to its last; the last segment's end is where the parameter is placed.
struct Liveness {
  std::unordered_map<const c10::StorageImpl*, TRef> whole;  // the tensor that created each storage
  // (op, storage) pairs after which the storage's current values are dead.
  std::unordered_map<size_t, std::vector<const c10::StorageImpl*>> free_after;
  std::unordered_map<const c10::StorageImpl*, size_t> final_use;  // its last op (where it is placed)
};

// The log's storages are kept alive by its TRefs, so their addresses identify them for the whole replay.
Liveness liveness_of(const Log& log) {
  Liveness lv;
  std::unordered_map<const c10::StorageImpl*, std::vector<std::pair<size_t, bool>>> uses;  // (op, overwrites)
  for (size_t i = 0; i < log.ops.size(); ++i) {
    const auto& r = log.ops[i];
    std::unordered_map<const c10::StorageImpl*, bool> here;  // storage -> overwritten whole (and not read) here
    for (size_t a = 0; a < r.targs.size(); ++a) {
      for (const auto& t : r.targs[a]) {
        if (!t) continue;
        const auto* st = t->storage.unsafeGetStorageImpl();
        const auto w = lv.whole.find(st);
        const bool all = a == 0 && overwrites_self(r.op) && w != lv.whole.end() && t->offset == w->second.offset &&
                         t->sizes == w->second.sizes && t->strides == w->second.strides;
        auto [it, fresh] = here.emplace(st, all);
        if (!fresh) it->second = false;  // also read by another argument
      }
    }
    for (const auto& v : r.touts) {
      for (const auto& t : v) {
        if (!t) continue;
        lv.whole.emplace(t->storage.unsafeGetStorageImpl(), *t);
        here.emplace(t->storage.unsafeGetStorageImpl(), false);
      }
    }
    for (const auto& [st, all] : here) uses[st].emplace_back(i, all);
  }
  for (const auto& [st, us] : uses) {
    for (size_t k = 0; k < us.size(); ++k) {
      if (k + 1 == us.size() || us[k + 1].second) lv.free_after[us[k].first].push_back(st);
    }
    lv.final_use[st] = us.back().first;
  }
  return lv;
}

// The real tensors of the replay: recorded storage -> a real tensor on it, made when first needed.
struct RealValues {
  const Liveness& lv;
  std::unordered_map<const c10::StorageImpl*, torch::Tensor> real;

  torch::Tensor view(const TRef& t) {
    auto it = real.find(t.storage.unsafeGetStorageImpl());
    if (it == real.end()) {  // overwritten whole by this op: a fresh tensor, as its creator made it
      const auto& w = lv.whole.at(t.storage.unsafeGetStorageImpl());
      it = real.emplace(t.storage.unsafeGetStorageImpl(), at::empty_strided(w.sizes, w.strides, at::TensorOptions().dtype(w.dtype)))
               .first;
    }
    return it->second.as_strided(t.sizes, t.strides, t.offset);
  }

  // A recorded argument with its tensors replaced by the real ones.
  c10::IValue map_value(const c10::IValue& v, const std::vector<std::optional<TRef>>& trefs) {
    size_t j = 0;
    auto map_tensor = [&](const torch::Tensor& t) -> torch::Tensor {
      const auto& r = trefs.at(j++);
      return r ? view(*r) : t;
    };
    if (v.isTensor()) return map_tensor(v.toTensor());
    if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const auto& t : v.toTensorList()) out.push_back(map_tensor(t));
      return out;
    }
    if (v.isList() && !trefs.empty()) {
      c10::impl::GenericList out(v.toList().elementType());
      for (const auto& e : v.toListRef()) out.push_back(e.isTensor() ? c10::IValue(map_tensor(e.toTensor())) : e);
      return out;
    }
    return v;
  }
};

void replay(Log& log) {
  const Liveness lv = liveness_of(log);
  std::unordered_map<const c10::StorageImpl*, std::vector<const Member*>> members_of;
  for (const auto& m : log.members) members_of[m.ref.storage.unsafeGetStorageImpl()].push_back(&m);
  const auto managed = managed_params();
  auto gen = at::make_generator<at::CPUGeneratorImpl>();
  gen.set_state(log.rng_state);
  t_replay_generator = gen;
  struct Reset {
    ~Reset() { t_replay_generator.reset(); }
  } reset;
  c10::impl::IncludeDispatchKeyGuard include(kInterceptKey);
  torch::NoGradGuard no_grad;
  RealValues values{lv, {}};
  for (size_t i = 0; i < log.ops.size(); ++i) {
    auto& r = log.ops[i];
    torch::jit::Stack stack;
    stack.reserve(r.args.size());
    for (size_t a = 0; a < r.args.size(); ++a) stack.push_back(values.map_value(r.args[a], r.targs[a]));
    try {
      r.op.callBoxed(&stack);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "materialize_module: replaying ", r.op.schema().name(), " failed: ",
                  e.what_without_backtrace());
    }
    for (size_t k = 0; k < r.touts.size() && k < stack.size(); ++k) {
      size_t j = 0;
      for_each_tensor(stack[k], [&](const torch::Tensor& out) {
        const auto& ref = r.touts[k].at(j++);
        if (ref && !values.real.count(ref->storage.unsafeGetStorageImpl())) {
          values.real[ref->storage.unsafeGetStorageImpl()] = out;
        }
      });
    }
    // Storages whose values die here: placed first if this is their final use.
    auto f = lv.free_after.find(i);
    if (f == lv.free_after.end()) continue;
    for (const auto* st : f->second) {
      if (lv.final_use.at(st) == i) {
        auto ms = members_of.find(st);
        if (ms != members_of.end()) {
          for (const Member* m : ms->second) place(*m, values.view(m->ref), managed);
        }
      }
      values.real.erase(st);
    }
  }
  // The default generator continues where eager construction would have left it.
  auto def = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(def.mutex());
  def.set_state(gen.get_state());
}

}  // namespace

bool deferred_init_active() { return t_recording != nullptr || t_replay_generator.has_value(); }

void deferred_init_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (t_replay_generator) return replay_op(op, ks, stack);
  record(*t_recording, op, ks, stack);
}

void begin_deferred_init() {
  TORCH_CHECK(!t_recording, "deferred_init: called inside another deferred_init on the same thread");
  ensure_interception_registered();
  auto log = std::make_shared<Log>();
  auto def = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(def.mutex());
    log->rng_state = def.get_state();
  }
  t_recording = std::move(log);
  // Included until end_deferred_init: a guard object cannot outlive this call, so set the TLS directly.
  c10::impl::tls_set_dispatch_key_included(kInterceptKey, true);
}

void end_deferred_init(const std::shared_ptr<torch::nn::Module>& module) {
  c10::impl::tls_set_dispatch_key_included(kInterceptKey, false);
  auto log = std::move(t_recording);
  t_recording.reset();
  if (!module || !log) return;
  std::unordered_set<const c10::TensorImpl*> seen;
  auto add = [&](const std::string& fqn, const torch::Tensor& t) {
    if (!t.defined() || !log->made.count(sid(t)) || !seen.insert(t.unsafeGetTensorImpl()).second) return;
    // (made outside: not ours; tied: under its first name)
    log->members.push_back({fqn, t.unsafeGetTensorImpl(), c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()),
                            ref_of(t)});
  };
  for (const auto& p : module->named_parameters(/*recurse=*/true)) add(p.key(), p.value());
  for (const auto& b : module->named_buffers(/*recurse=*/true)) add(b.key(), b.value());
  std::lock_guard<std::mutex> lock(g_mu);
  for (const auto& m : log->members) pending()[m.key] = log;
}

}  // namespace detail

namespace detail {
namespace {
// The records that `module`'s parameters and buffers wait on.
std::vector<std::shared_ptr<Log>> logs_of(const torch::nn::Module& module) {
  std::vector<std::shared_ptr<Log>> logs;
  std::lock_guard<std::mutex> lock(g_mu);
  auto visit = [&](const torch::Tensor& t) {
    auto it = pending().find(t.unsafeGetTensorImpl());
    if (it == pending().end()) return;
    if (std::find(logs.begin(), logs.end(), it->second) == logs.end()) logs.push_back(it->second);
  };
  for (const auto& p : module.parameters(/*recurse=*/true)) visit(p);
  for (const auto& b : module.buffers(/*recurse=*/true)) visit(b);
  return logs;
}

void forget(const Log& log) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (const auto& m : log.members) pending().erase(m.key);
}
}  // namespace
}  // namespace detail

void to_empty(const std::shared_ptr<torch::nn::Module>& module) {
  TORCH_CHECK(module, "to_empty: module is null");
  const auto logs = detail::logs_of(*module);
  TORCH_CHECK(!logs.empty(), "to_empty: ", module->name(), " has no parameter or buffer waiting for ",
              "materialisation. Fix: construct it with fsdp::deferred_init([&] { return Model(...); })");
  const auto managed = detail::managed_params();
  for (const auto& log : logs) {
    for (const auto& m : log->members) {
      auto impl = m.impl.lock();
      // A managed parameter already is its zero-filled shard (FSDPParam's constructor).
      // Its current shape: parallelize_module may have made it this rank's TP part.
      if (impl && !managed.count(m.key)) detail::become(impl, at::zeros(impl->sizes(), at::TensorOptions().dtype(m.ref.dtype)));
    }
    detail::forget(*log);
  }
}

void materialize_module(const std::shared_ptr<torch::nn::Module>& module) {
  TORCH_CHECK(module, "materialize_module: module is null");
  const auto logs = detail::logs_of(*module);
  TORCH_CHECK(!logs.empty(), "materialize_module: ", module->name(), " has no parameter or buffer waiting for ",
              "materialisation. Fix: construct it with fsdp::deferred_init([&] { return Model(...); }), and ",
              "call materialize_module once");
  // The full-size temporaries go back to the kernel as soon as they are freed: [Note: materialisation
  // memory] (unmapping_allocator.cpp).
  detail::ScopedUnmappingAllocator unmapping;
  for (const auto& log : logs) {
    detail::replay(*log);
    detail::forget(*log);
  }
}

bool is_deferred(const torch::Tensor& t) {
  if (!t.defined()) return false;
  std::lock_guard<std::mutex> lock(detail::g_mu);
  return detail::pending().count(t.unsafeGetTensorImpl()) > 0;
}

}  // namespace fsdp
