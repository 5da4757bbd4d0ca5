// The dispatcher fallback that drives implicit groups: it classifies each op on an intercepted parameter
// and hands it to the parameter's FSDPState (fsdp_implicit.cpp). See [Note: implicit groups] there.
#include "fsdp/fsdp_interception.h"

#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "fsdp/deferred_init_internal.h"
#include "fsdp/fsdp_state.h"
#include "tensor/parallel/tp_ops.h"

namespace fsdp::detail {
namespace {

// [Note: identity by address]
// The registries of the implicit path, of TP and of deferred init find tensors, storages and autograd
// nodes by address, because that is what an op's arguments give. An address identifies an object only
// while it lives: a freed object's address is soon another's (a new autograd node each step, a
// temporary's storage). So each entry holds a weak reference to its object (weak_intrusive_ptr for
// TensorImpl and StorageImpl, weak_ptr for autograd nodes). A weak reference keeps the object's memory
// block, hence its address, from being reused while the entry exists, and says when the object died
// (the entry is then ignored and erased at the next registration). Never a raw pointer as identity of
// something that can be freed while the entry is kept.
struct ParamEntry {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  std::weak_ptr<FSDPState> state;
  size_t index = 0;
};
struct StorageEntry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  const c10::TensorImpl* param = nullptr;
  bool is_shard = false;
};

// Intercepted parameters and the storages of their shards and unsharded tensors. Read on every
// intercepted op (shared lock), written at fully_shard and the first unshard.
struct InterceptRegistry {
  std::shared_mutex mu;
  std::unordered_map<const c10::TensorImpl*, ParamEntry> params;
  std::unordered_map<const c10::StorageImpl*, StorageEntry> storages;
};

InterceptRegistry& intercept_registry() {
  static auto* r = new InterceptRegistry();  // never destroyed: see registry() in fsdp_state.cpp
  return *r;
}

// What the fallback needs to know about an op, computed once per op per thread.
struct OpInfo {
  bool meta = false;           // reads only metadata (sizes, dtype): never unshards
  std::vector<char> written;   // per argument: the op writes it in place
};

const OpInfo& op_info(const c10::OperatorHandle& op) {
  thread_local std::unordered_map<const c10::FunctionSchema*, OpInfo> cache;
  const auto& schema = op.schema();
  auto it = cache.find(&schema);
  if (it != cache.end()) return it->second;
  OpInfo info;
  info.meta = is_metadata_op(op);
  for (const auto& a : schema.arguments()) info.written.push_back(a.alias_info() && a.alias_info()->isWrite() ? 1 : 0);
  return cache.emplace(&schema, std::move(info)).first->second;
}

struct Found {
  std::shared_ptr<FSDPState> state;
  size_t index = 0;          // parameter index in the state's group
  size_t arg = 0;            // argument position
  bool is_param = false;     // the parameter itself (else an alias: a view, .data(), detach())
  bool alias_of_shard = false;
  bool written = false;
};

bool resolve(const torch::Tensor& t, size_t arg, bool written, std::vector<Found>& out) {
  if (!t.defined() || !t.key_set().has(kInterceptKey)) return false;
  auto& r = intercept_registry();
  std::shared_lock<std::shared_mutex> lock(r.mu);
  Found f;
  f.arg = arg;
  f.written = written;
  const c10::TensorImpl* param = t.unsafeGetTensorImpl();
  auto pit = r.params.find(param);
  if (pit != r.params.end()) {
    f.is_param = true;
  } else {
    auto sit = r.storages.find(t.storage().unsafeGetStorageImpl());
    if (sit == r.storages.end() || sit->second.storage.expired()) return false;  // an alias of a parameter that is gone
    f.alias_of_shard = sit->second.is_shard;
    pit = r.params.find(sit->second.param);
    if (pit == r.params.end()) return false;
  }
  if (pit->second.impl.expired()) return false;
  f.state = pit->second.state.lock();
  if (!f.state) return false;
  f.index = pit->second.index;
  out.push_back(std::move(f));
  return true;
}

// Whether an unintercepted tensor argument of the op is the gradient of an intercepted parameter
// (torch::optim's weight decay: `grad.add(p, wd)` reads the shard along with its gradient).
bool reads_with_own_grad(const std::vector<Found>& found, const torch::jit::Stack& stack, size_t base, size_t nargs) {
  for (const auto& f : found) {
    if (!f.state->group) continue;
    const auto& g = f.state->group->params()[f.index].param.grad();
    if (!g.defined()) continue;
    for (size_t a = 0; a < nargs; ++a) {
      const auto& iv = stack[base + a];
      if (!iv.isTensor()) continue;
      const auto& t = iv.toTensor();
      if (t.defined() && !t.key_set().has(kInterceptKey) && t.is_alias_of(g)) return true;
    }
  }
  return false;
}

struct PreBackwardHook : torch::autograd::FunctionPreHook {
  explicit PreBackwardHook(int64_t id) : state_id(id) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (auto s = state_by_id(state_id)) s->implicit_pre_backward();
    return grads;
  }
  int64_t state_id;
};

void hook_outputs(const std::vector<FSDPState*>& states, torch::jit::Stack& stack, size_t nret) {
  auto hook = [&](const torch::Tensor& t) {
    if (!t.defined() || !t.requires_grad()) return;
    const auto& fn = t.grad_fn();
    if (!fn) return;
    for (FSDPState* s : states) {
      if (s->last_hooked_node.lock() == fn) continue;
      s->last_hooked_node = fn;
      fn->add_pre_hook(std::make_unique<PreBackwardHook>(s->id));
    }
  };
  for (size_t i = stack.size() - nret; i < stack.size(); ++i) {
    const auto& iv = stack[i];
    if (iv.isTensor()) {
      hook(iv.toTensor());
    } else if (iv.isTensorList()) {
      for (const auto& t : iv.toTensorVector()) hook(t);
    }
  }
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (deferred_init_active()) return deferred_init_fallback(op, ks, stack);
  const OpInfo& info = op_info(op);
  if (info.meta) return redispatch_below_intercept(op, ks, stack);
  const size_t nargs = op.schema().arguments().size();
  const size_t nret = op.schema().returns().size();
  const size_t base = stack->size() - nargs;
  std::vector<Found> found;
  for (size_t a = 0; a < nargs; ++a) {
    const auto& iv = (*stack)[base + a];
    const bool w = info.written[a] != 0;
    if (iv.isTensor()) {
      resolve(iv.toTensor(), a, w, found);
    } else if (iv.isList()) {
      for (const auto& e : iv.toListRef()) {
        if (e.isTensor()) resolve(e.toTensor(), a, w, found);
      }
    }
  }
  // The library's own ops (unshard, casts) and the op's decomposition run without interception.
  NoInterception no_interception;
  // A tensor-parallel module's op (linear / embedding on a TP weight) runs its style instead of the op,
  // after FSDP's part below when the weight is also FSDP's (unshard first: see [Note: FSDP over TP]).
  auto run = [&] { fsdp::tp::detail::tp_run_op(op, ks, stack); };
  if (found.empty()) return run();

  const bool grad_mode = torch::GradMode::is_enabled();
  std::vector<FSDPState*> forward_states;
  const bool optimizer_read = !grad_mode && reads_with_own_grad(found, *stack, base, nargs);
  for (const auto& f : found) {
    FSDPState& s = *f.state;
    if (s.ctx && s.ctx->in_backward) {
      s.implicit_backward_use(f.index, grad_mode);
    } else if (f.written) {
      // In place: the optimizer's update or an initialisation writes the shard.
      if (f.is_param || f.alias_of_shard) s.implicit_write();
    } else if (!optimizer_read) {
      s.implicit_forward_use(f.index, grad_mode);
      if (f.alias_of_shard) s.raise_stale_alias(s.group->params()[f.index], op.schema().name());
      if (std::find(forward_states.begin(), forward_states.end(), &s) == forward_states.end()) {
        forward_states.push_back(&s);
      }
    }
  }
  // cast_forward_inputs: floating-point tensors entering an op with the group's parameters.
  for (FSDPState* s : forward_states) {
    const auto& mp = s->options.mp_policy();
    if (!mp.cast_forward_inputs() || !mp.param_dtype()) continue;
    for (size_t a = 0; a < nargs; ++a) {
      auto& iv = (*stack)[base + a];
      if (!iv.isTensor()) continue;
      const auto& t = iv.toTensor();
      if (t.defined() && !t.key_set().has(kInterceptKey) && t.is_floating_point() &&
          t.scalar_type() != *mp.param_dtype()) {
        iv = t.to(*mp.param_dtype());
      }
    }
    break;  // one policy per op
  }
  run();
  if (grad_mode && !forward_states.empty()) hook_outputs(forward_states, *stack, nret);
}

void composite_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  // A TP module's op goes through the fallback (FSDP's pre-forward, then the style); any other call
  // decomposes below the key, and its ops reach the fallback one by one.
  if (!deferred_init_active() && fsdp::tp::detail::is_tp_op(op, *stack)) return fallback(op, ks, stack);
  redispatch_below_intercept(op, ks, stack);
}

}  // namespace

void ensure_interception_registered() {
  install_intercept_layer(InterceptLayer::FSDP, &fallback, &composite_kernel);
}

void register_intercepted_param(const torch::Tensor& param, const std::shared_ptr<FSDPState>& state, size_t index) {
  auto& r = intercept_registry();
  std::unique_lock<std::shared_mutex> lock(r.mu);
  // Forget the entries of destroyed states (their addresses may be reused).
  for (auto it = r.params.begin(); it != r.params.end();) {
    it = it->second.state.expired() || it->second.impl.expired() ? r.params.erase(it) : std::next(it);
  }
  for (auto it = r.storages.begin(); it != r.storages.end();) {
    it = r.params.count(it->second.param) && !it->second.storage.expired() ? std::next(it) : r.storages.erase(it);
  }
  r.params.insert_or_assign(param.unsafeGetTensorImpl(),
                            ParamEntry{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), state, index});
}

void register_param_storage(const torch::Tensor& param, const torch::Tensor& alias, bool is_shard) {
  auto& r = intercept_registry();
  std::unique_lock<std::shared_mutex> lock(r.mu);
  r.storages.insert_or_assign(alias.storage().unsafeGetStorageImpl(),
                              StorageEntry{alias.storage().getWeakStorageImpl(), param.unsafeGetTensorImpl(), is_shard});
}

}  // namespace fsdp::detail
