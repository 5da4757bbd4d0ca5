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
#include "utils/checkpoint_regions.h"

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

// [Note: reads of a sharded parameter]
// A sharded parameter's metadata are its local shard's (p.sizes() is the shard's shape), and every
// shard carries the interception key, holder or implicit group, so every op that uses it is seen here.
// The rule (issue 28, items 5 and 8): a use sees what the parameter holds, no plain read is a hidden
// collective, and a use that would compute a forward on the shard raises at the use.
// - Between steps (no forward open: before the first forward, after a backward, after the root's
//   reshard()), an op whose operands are only sharded parameters and aliases of them, apart from the
//   tensors it writes (p.sum(), p.clone(), p.detach(), dst.copy_(p), torch::save), is a read: it runs on
//   the local shard, on this rank alone, and changes no state. A rank whose shard is empty may skip it.
//   Ops on an alias taken by such a read are reads too, whatever else they take: p.detach() is the local
//   shard as a tensor (p.detach().narrow(...), p.detach().equal(ref), p.detach() - ref).
//   An implicit group's read with grad enabled (other than detach/alias) raises instead: with grad
//   enabled it may as well be the first op of a forward whose first use of the model takes only
//   parameters, which computed on the shard would be wrong and which the fallback cannot tell from a read.
//   A view of the parameter itself (w.t(), p.narrow(...)) stays a forward use: that is how forwards
//   begin to use a weight (x.matmul(w.t()) runs w.t() first). Under NoGradGuard a forward whose first op
//   takes only parameters and is not a view (exp(log_scale)) computes that op on the shard: its result
//   has the shard's shape, which the next op almost always refuses (documented in fully_shard.h; the fix
//   is an FSDPModule holder for such a root, whose forward opens explicitly).
// - While a forward is open: an implicit group's use all-gathers it (a forward use; [Note: implicit
//   groups]). A holder group unshards only in its module's forward, and its unsharded data carry no key
//   (zero overhead there), so a holder parameter seen here while a forward is open is being used outside
//   its module's forward (e.g. a tied weight read as `matmul(h, head->weight.t())` in the root's forward):
//   raise, in train and eval mode alike. Every rank runs the same forward, so every rank raises there.
// - In-place writes (optimizer updates, init) and reads together with the parameter's own gradient under
//   no_grad (weight decay) use the shard, as before.
// What stays a forward: between steps an implicit group's parameter itself combined with another tensor
// (linear(x, w) starts an evaluation forward; so does `p - ref`, which therefore all-gathers): with no
// module hook, an operand that is not a parameter is what tells a forward's first op. Take the shard
// first (p.detach()) to combine it with other tensors. The residue: a forward whose very first op is
// w.detach() or w.data() (a stop-gradient on a weight, before any op on the input) computes on the shard.
bool is_alias_op(const c10::OperatorHandle& op) {
  const auto& name = op.schema().name();
  return name == "aten::detach" || name == "aten::alias";
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

// Whether the op is a read between steps ([Note: reads of a sharded parameter]); raises for an implicit
// group's read with grad enabled.
bool read_between_steps(const c10::OperatorHandle& op, const std::vector<Found>& found, size_t other_operands,
                        bool grad_mode) {
  bool on_param = false;  // else only aliases of shards, taken by earlier reads between steps
  for (const auto& f : found) {
    if (f.written) return false;
    const auto& ctx = f.state->ctx;
    if (ctx && (ctx->forward_open || ctx->in_backward)) return false;
    on_param = on_param || f.is_param;
  }
  if (!on_param) return true;  // p.detach() is the local shard, whatever it is combined with
  if (other_operands > 0) return false;
  if (is_alias_op(op)) return true;
  // A view of the parameter itself (w.t(), w.narrow(...)) is how most forwards begin to use a weight
  // (x.matmul(w.t())): it stays a forward use, which all-gathers.
  const auto& returns = op.schema().returns();
  if (!returns.empty() && returns[0].alias_info()) return false;
  if (grad_mode) {
    for (const auto& f : found) {
      FSDPState& s = *f.state;
      const auto& p = s.group->params()[f.index];
      if (s.implicit && p.requires_grad() && s.group->sharded_state() != ShardedState::UNSHARDED) {
        s.raise_read_with_grad(p, op.schema().name());
      }
    }
  }
  return true;
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (deferred_init_active()) return deferred_init_fallback(op, ks, stack);
  const OpInfo& info = op_info(op);
  if (info.meta) return redispatch_below_intercept(op, ks, stack);
  const size_t nargs = op.schema().arguments().size();
  const size_t nret = op.schema().returns().size();
  const size_t base = stack->size() - nargs;
  std::vector<Found> found;
  size_t other_operands = 0;  // tensors read that are not sharded parameters (an input, a reference)
  auto scan = [&](const torch::Tensor& t, size_t a, bool w) {
    if (!resolve(t, a, w, found) && t.defined() && !w) ++other_operands;
  };
  for (size_t a = 0; a < nargs; ++a) {
    const auto& iv = (*stack)[base + a];
    const bool w = info.written[a] != 0;
    if (iv.isTensor()) {
      scan(iv.toTensor(), a, w);
    } else if (iv.isList()) {
      for (const auto& e : iv.toListRef()) {
        if (e.isTensor()) scan(e.toTensor(), a, w);
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
  if (read_between_steps(op, found, other_operands, grad_mode)) return run();
  std::vector<FSDPState*> forward_states;
  std::vector<FSDPState*> cast_states;  // forward_states, and the states of a recomputation's op
  const bool optimizer_read = !grad_mode && reads_with_own_grad(found, *stack, base, nargs);
  for (const auto& f : found) {
    FSDPState& s = *f.state;
    if (!s.implicit) {
      if (s.ctx && s.ctx->in_backward) {
        // set_unshard_in_backward(false) keys a holder group's unsharded data too: a backward formula
        // that does read the parameter gathers it here instead of reading freed memory.
        if (!s.group->unshard_in_backward && s.group->sharded_state() != ShardedState::UNSHARDED) {
          s.group->unshard(/*async_op=*/true);  // (or completes one in flight)
          s.group->wait_for_unshard();
        }
        continue;
      }
      // A holder group: see [Note: reads of a sharded parameter].
      // (A TP parameter's unsharded data carry the key too: its own module's forward is fine.)
      const bool in_forward = s.ctx && s.ctx->forward_open && !s.ctx->in_backward;
      if (in_forward && !f.written && !optimizer_read && s.group->sharded_state() == ShardedState::SHARDED) {
        s.raise_use_outside_forward(s.group->params()[f.index], op.schema().name());
      }
      continue;
    }
    if (s.ctx && s.ctx->in_backward) {
      s.implicit_backward_use(f.index, grad_mode);
      // A recomputation (a checkpointed region re-run in backward) casts as its forward did.
      if (grad_mode && !f.written && (in_non_reentrant_recompute() || !checkpoint_frames().empty()) &&
          std::find(forward_states.begin(), forward_states.end(), &s) == forward_states.end()) {
        cast_states.push_back(&s);
      }
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
  cast_states.insert(cast_states.end(), forward_states.begin(), forward_states.end());
  for (FSDPState* s : cast_states) {
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

bool takes_fsdp_param(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const size_t nargs = op.schema().arguments().size();
  std::vector<Found> found;
  for (size_t a = stack.size() - nargs; a < stack.size(); ++a) {
    if (stack[a].isTensor() && resolve(stack[a].toTensor(), a, false, found)) return true;
  }
  return false;
}

void composite_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  // A TP module's op goes through the fallback (FSDP's pre-forward, then the style); any other call
  // decomposes below the key, and its ops reach the fallback one by one.
  if (!deferred_init_active() && fsdp::tp::detail::is_tp_op(op, *stack)) return fallback(op, ks, stack);
  // An FSDP parameter's linear/matmul is classified as one op (x is an operand: a forward, not a read
  // between steps), then decomposes without interception.
  if (!deferred_init_active() && takes_fsdp_param(op, *stack)) return fallback(op, ks, stack);
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
