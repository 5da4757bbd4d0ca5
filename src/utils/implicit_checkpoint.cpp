// Checkpoint regions of unchanged modules: recorded op tapes replayed in backward.
#include "utils/implicit_checkpoint.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <sstream>
#include <unordered_map>
#include <utility>

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>

#include "utils/intercept.h"
#include "utils/op_tape.h"
#include "utils/non_reentrant_frame.h"
#include "utils/saved_tensor_hooks_internal.h"
#include "utils/selective_checkpoint_internal.h"

// [Note: implicit checkpoint regions]
// PyTorch's apply_activation_checkpointing swaps a module for a wrapper whose forward runs the module under
// torch.utils.checkpoint. A LibTorch model's containers call their children's Impl directly (Sequential through
// AnyModule, ModuleList and TransformerEncoder through as<Layer>()), so nothing can wrap the call of an unchanged
// module (see [Note: implicit groups], fsdp_implicit.cpp); what can be seen is its parameters, at op level.
//   Regions. The checkpointed module's parameters carry libfsdp's interception key (utils/intercept.h), and this
// layer of the fallback sees every op on them. With grad enabled, an op on a parameter of checkpointed module M
// (not a metadata query, not detach) opens a region for M: from then on the key is in the thread's included keys,
// so every op of the thread reaches this layer; the region records each top-level op (not nested in another op)
// and runs it as it would run anyway: its first run is the ordinary forward, with the saved-tensor hooks of a
// non-reentrant checkpoint ([Note: non-reentrant checkpoint]) around it. The region ends at the first op that uses
// another module's parameter (a parameter of another checkpointed module, which opens that one's region; or
// another leaf that requires grad and carries the key: a parameter of an FSDP or TP module), at the next use of the
// parameter that opened it (the module's next call opens a region of its own: a module called twice, forwards
// without backward), when a backward begins (libfsdp's autograd engine, saved_tensor_hooks.cpp), where an explicit
// checkpoint region begins (none opens inside one, nor inside a backward), at a holder's pre- or post-forward, when
// the autocast state changes (the replay runs under one) and when a saved-tensor hook scope is entered or left (the
// forward's tensors would go to other hooks than the replay's). So a region spans from the module's first parameter use to the next module's: the block's
// ops before its first weight (none in a pre-norm block) are the previous region's, and the ops between its last
// weight and the next module's (residual adds, dropout) are its own. The boundaries move work between regions; the
// values are those of the forward either way, since a region replays exactly what it recorded.
//   The tape. Each op is kept as its OperatorHandle, its non-tensor arguments and, per tensor argument, where the
// replay finds it: the output of an earlier op of the region (by slot), or a tensor from outside the region (an
// input: the block's input, the attention mask, a parameter), held by the tape as checkpoint holds its inputs. The
// region's own values are not held (that is the memory saved). In backward, the first tensor the graph unpacks
// replays the tape under the first run's RNG and autocast states and each op's grad mode: the outside tensors
// detached, with their requires_grad (parameters and keyed tensors as they are: FSDP and TP find their parameters
// by identity, unshard and cast them for the replay as for the forward), and the k-th tensor the replay saves serves
// the k-th the forward saved, as for fsdp::checkpoint; slots are freed after their last use. What the dispatcher
// does not see: requires_grad set on a value (requires_grad_()) is noted and set again on the replayed value; a
// tensor saved outside the region's ops (a custom autograd::Function's node) is refused in forward, naming the module. A context_fn makes the
// region selective ([Note: selective checkpoint]): the ops it saves are skipped in the replay.
//   Writes. An op of the region that writes in place into an outside tensor (an input; a buffer: batch_norm's
// running statistics, which its schema does not annotate, so they are recognised by name) writes it in the forward
// only (PyTorch's recomputation updates running statistics a second time): the tape keeps a copy of the value it had (copied just before the write),
// and the replay writes a fresh copy of that. An outside tensor modified after the region used it (its version
// moved) is refused in backward, naming the op; a write into a parameter inside a region is refused in forward.
//   What is recorded too: every op of the thread while the region is open, including those of the user's code after
// the model (the loss) when no other module's parameter comes first; they are replayed with it (a little compute).
// Library code runs without interception (NoInterception) or suspended (SuspendImplicitRegions), so FSDP's
// collectives are not on the tape. Limits: only non-reentrant regions (the reentrant form needs a call to re-run);
// a module without parameters cannot be seen; nested matches are refused (each parameter opens one region).
//   offload_wrapper on an unchanged module uses the same regions without a tape: while one is open, the tensors
// autograd saves go through save_on_cpu's hooks (pinned host memory on CUDA).
namespace fsdp::detail {
namespace {

struct Owner {
  std::string name;
  ImplicitRegionKind kind = ImplicitRegionKind::Checkpoint;
  CheckpointOptions options;
};

struct ParamEntry {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;  // see [Note: identity by address], fsdp_interception.cpp
  std::shared_ptr<const Owner> owner;
};

struct Registry {
  std::shared_mutex mu;
  std::unordered_map<const c10::TensorImpl*, ParamEntry> params;
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: read by rank threads until the process exits
  return *r;
}

std::atomic<bool> any_registered{false};
std::atomic<int64_t> n_regions{0}, n_replays{0}, n_ops{0};

std::shared_ptr<const Owner> owner_of(const torch::Tensor& t) {
  auto& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.mu);
  auto it = r.params.find(t.unsafeGetTensorImpl());
  if (it == r.params.end() || it->second.impl.expired()) return nullptr;
  return it->second.owner;
}

// The region open on a thread: the tape being recorded and the maps from the thread's tensors to its refs.
struct OpenRegion {
  std::shared_ptr<const Owner> owner;
  std::shared_ptr<Tape> tape;  // (null in an offload region: nothing is recorded)
  std::shared_ptr<NonReentrantFrame> frame;
  std::unordered_map<const c10::TensorImpl*, std::pair<c10::weak_intrusive_ptr<c10::TensorImpl>, size_t>> slots;
  std::unordered_map<const c10::TensorImpl*, size_t> outside;  // (the tape holds them: addresses stay theirs)
  std::vector<std::pair<size_t, size_t>> slot_owner;            // per slot: (op, output) that made it
  const c10::TensorImpl* opened_by = nullptr;                   // the parameter whose use opened the region
  AutocastState autocast;                                       // the autocast state the region runs under
  std::unique_ptr<SelectiveRegion::Scope> selective;
  bool included_before = false;
};

thread_local OpenRegion* t_open = nullptr;  // (a raw pointer: nothing to destroy at thread exit)
thread_local int t_depth = 0;               // > 0: inside a recorded op
thread_local int t_suspended = 0;
thread_local bool t_close_pending = false;  // the region refused a saved tensor: closed at the thread's next op

struct Counter {
  explicit Counter(int& c) : c_(c) { ++c_; }
  ~Counter() { --c_; }
  int& c_;
};

// Library ops run inside a region (copies, detaches): neither this region's nor a selective region's ops.
struct LibraryOps {
  LibraryOps() : depth(t_depth) {}
  Counter depth;
  SuspendSelective suspend;
};

void record(bool composite, const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);


void open_region(std::shared_ptr<const Owner> owner, const c10::TensorImpl* opened_by, const c10::OperatorHandle& op,
                 const torch::jit::Stack& stack) {
  const size_t nargs = op.schema().arguments().size();
  std::vector<torch::Tensor> devices_of;
  for (size_t a = stack.size() - nargs; a < stack.size(); ++a) {
    each_tensor(stack[a], [&](const torch::Tensor& t, int64_t) {
      if (t.defined()) devices_of.push_back(t);
    });
  }
  auto region = std::make_unique<OpenRegion>();
  region->owner = owner;
  region->opened_by = opened_by;
  if (owner->kind == ImplicitRegionKind::Offload) {
    // offload_wrapper: the region's saved tensors go to host memory; its ops run as they are, unrecorded (the thread's
    // included keys stay as they are).
    region->included_before = c10::impl::tls_is_dispatch_key_included(kInterceptKey);
    set_region_saved_hooks(save_on_cpu_hooks(/*pin_memory=*/true));
    t_open = region.release();
    n_regions.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  region->tape = std::make_shared<Tape>();
  region->tape->name = owner->name;
  region->frame = make_non_reentrant_frame(devices_of, owner->options);
  region->frame->fn = [tape = region->tape](const std::vector<torch::Tensor>&) {
    n_replays.fetch_add(1, std::memory_order_relaxed);
    replay(*tape);
    return std::vector<torch::Tensor>();
  };
  region->autocast = region->frame->autocast;
  std::weak_ptr<NonReentrantFrame> weak = region->frame;  // the hooks own the frame; the factory must not
  set_region_saved_hooks([weak, name = owner->name]() -> std::unique_ptr<torch::autograd::SavedVariableHooks> {
    // Every tensor the region saves is saved by one of its recorded ops, which the replay runs again. One saved
    // outside them (a custom torch::autograd::Function's save_for_backward: its forward runs ops, its node is
    // made outside the dispatcher) would not be saved by the replay.
    // (Refused: the region ends at the thread's next op; not here, inside the hooks' own factory.)
    if (t_depth == 0) t_close_pending = true;
    TORCH_CHECK(t_depth > 0, "apply_activation_checkpointing: a tensor is saved for backward outside the ops of the ",
                "checkpointed region of ", name, " (a custom torch::autograd::Function's save_for_backward?); the ",
                "region's recomputation replays ops, not the Function's node. Fix: checkpoint the call with ",
                "fsdp::checkpoint in the forward, or do not checkpoint this module");
    return std::make_unique<FirstRunHooks>(weak.lock());
  });
  region->included_before = c10::impl::tls_is_dispatch_key_included(kInterceptKey);
  c10::impl::tls_set_dispatch_key_included(kInterceptKey, true);
  // (The key is included already: the selective scope's guard changes nothing, and the close puts it back.)
  if (region->frame->selective) {
    region->selective = std::make_unique<SelectiveRegion::Scope>(region->frame->selective.get(), SelectiveRegion::Fill{});
  }
  t_open = region.release();
  n_regions.fetch_add(1, std::memory_order_relaxed);
}

// Why the op closes the open region or opens one: the checkpointed module whose parameter it takes (null: none),
// and whether it takes another module's parameter.
struct OpOwner {
  std::shared_ptr<const Owner> owner;
  bool foreign = false;
  const c10::TensorImpl* first_param = nullptr;  // the first of the owner's parameters the op takes
  bool reuses_opener = false;                    // it takes the parameter that opened the open region
};

OpOwner classify(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  OpOwner out;
  const c10::TensorImpl* opener = t_open ? t_open->opened_by : nullptr;
  const size_t nargs = op.schema().arguments().size();
  for (size_t a = stack.size() - nargs; a < stack.size(); ++a) {
    each_tensor(stack[a], [&](const torch::Tensor& t, int64_t) {
      if (!t.defined() || !t.key_set().has(kInterceptKey)) return;
      if (auto o = owner_of(t)) {
        if (out.owner && out.owner != o) out.foreign = true;  // two checkpointed modules' parameters in one op
        out.owner = std::move(o);
        if (!out.first_param) out.first_param = t.unsafeGetTensorImpl();
        if (t.unsafeGetTensorImpl() == opener) out.reuses_opener = true;
      } else if (t.is_leaf() && t.requires_grad()) {
        out.foreign = true;  // a parameter of a module that is not checkpointed (FSDP's, TP's)
      }
    });
  }
  return out;
}

bool opens_regions(const c10::OperatorHandle& op) {
  if (is_metadata_op(op)) return false;
  const auto& name = op.schema().name();
  return name != "aten::detach" && name != "aten::alias";
}

void handle(bool composite, const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (t_depth > 0 || in_tape_replay() || !any_registered.load(std::memory_order_relaxed)) {
    return selective_handle(composite, op, ks, stack);
  }
  if (t_close_pending) close_implicit_region();
  if (t_open && t_open->tape) {
    bool sealed;
    {
      std::lock_guard<std::mutex> lock(t_open->tape->mu);
      sealed = t_open->tape->sealed;  // a backward on another thread replayed it already
    }
    // A region runs under one autocast state (the replay's); a change ends it.
    if (sealed || !(AutocastState::current() == t_open->autocast)) close_implicit_region();
  }
  if (t_suspended == 0) {
    const OpOwner o = classify(op, *stack);
    const bool opens = o.owner && !o.foreign && torch::GradMode::is_enabled() && opens_regions(op) &&
                       torch::autograd::get_current_graph_task_id() == -1;  // (none inside a backward)
    // Another module's parameter ends the region; so does a new use of the parameter that opened it (the module's
    // next call: a forward without backward, or a module called twice, starts a region of its own).
    if (t_open && (o.foreign || (o.owner && o.owner != t_open->owner) || (o.reuses_opener && opens))) {
      close_implicit_region();
    }
    if (!t_open && opens) open_region(o.owner, o.first_param, op, *stack);
  }
  if (!t_open || !t_open->tape) {
    // (The op's own decomposition is nested in it, whether a layer below runs it unintercepted or not: only
    // top-level ops open and close regions.)
    Counter depth(t_depth);
    return selective_handle(composite, op, ks, stack);
  }
  try {
    record(composite, op, ks, stack);
  } catch (...) {
    close_implicit_region();  // the forward is abandoned; the thread's ops go their usual way again
    throw;
  }
}

void checkpoint_layer_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  handle(false, op, ks, stack);
}
void checkpoint_layer_composite(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  handle(true, op, ks, stack);
}

// Whether argument `a` of the op is written by it: annotated (Tensor(a!)), or a normalisation's running statistics in
// training mode, which batch_norm, native_batch_norm, instance_norm, ... update without the annotation (their
// versions do not move either).
bool writes_arg(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args, size_t a) {
  const auto& arg = schema.arguments()[a];
  if (arg.alias_info() && arg.alias_info()->isWrite()) return true;
  if (arg.name() != "running_mean" && arg.name() != "running_var") return false;
  for (size_t i = 0; i < schema.arguments().size() && i < args.size(); ++i) {
    const auto& name = schema.arguments()[i].name();
    if ((name == "training" || name == "use_input_stats") && args[i].isBool()) return args[i].toBool();
  }
  return false;
}

void record(bool composite, const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  OpenRegion& r = *t_open;
  Tape& tape = *r.tape;
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  TapeOp rec{op};
  rec.grad_mode = torch::GradMode::is_enabled();
  rec.args.assign(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  {
    std::lock_guard<std::mutex> lock(tape.mu);
    const size_t op_index = tape.ops.size();
    for (size_t a = 0; a < nargs; ++a) {
      c10::IValue& arg = rec.args[a];
      if (arg.isList()) arg = c10::IValue(arg.toList().copy());  // (the blanks must not reach the caller's list)
      const bool written = writes_arg(schema, rec.args, a);
      std::vector<std::pair<torch::Tensor, int64_t>> tensors;
      each_tensor(arg, [&](const torch::Tensor& t, int64_t element) { tensors.emplace_back(t, element); });
      for (auto& [t, element] : tensors) {
        if (!t.defined()) continue;
        TapeRef ref{a, element, false, 0};
        auto sit = r.slots.find(t.unsafeGetTensorImpl());
        if (sit != r.slots.end() && !sit->second.first.expired()) {
          ref.index = sit->second.second;
          // (requires_grad_() since its op: the replay sets the same on the slot)
          auto [op_k, out_k] = r.slot_owner[ref.index];
          if (t.requires_grad() && !tape.ops[op_k].requires_grad[out_k]) tape.ops[op_k].requires_grad[out_k] = true;
        } else {
          ref.outside = true;
          auto oit = r.outside.find(t.unsafeGetTensorImpl());
          if (oit == r.outside.end()) {
            TapeOutside o;
            o.as_is = t.key_set().has(kInterceptKey);
            o.requires_grad = t.requires_grad();
            {
              LibraryOps library;
              o.value = o.as_is ? t : t.detach();  // (shares the version counter)
            }
            o.first_use = op_index;
            o.version = static_cast<int64_t>(t._version());
            oit = r.outside.emplace(t.unsafeGetTensorImpl(), tape.outside.size()).first;
            tape.outside.push_back(std::move(o));
          }
          ref.index = oit->second;
          TapeOutside& o = tape.outside[ref.index];
          if (written) {
            TORCH_CHECK(!o.as_is, "apply_activation_checkpointing: op ", op_name(op), " writes in place into a ",
                        "parameter (shape ", t.sizes(), ") inside the checkpointed region of ", tape.name,
                        "; the recomputation would write it again. Fix: write parameters outside the forward, or do ",
                        "not checkpoint this module");
            if (!o.before.defined()) {
              // The value the region's earlier reads saw (the copy's ops are not the region's, nor a selective
              // region's).
              LibraryOps library;
              o.before = copy_of(t);
            }
          }
        }
        set_arg(rec.args, a, element, element < 0 ? c10::IValue() : c10::IValue(torch::Tensor()));
        rec.refs.push_back(ref);
      }
    }
  }
  {
    Counter depth(t_depth);
    selective_handle(composite, op, ks, stack);
  }
  std::lock_guard<std::mutex> lock(tape.mu);
  if (tape.sealed) return;  // replayed meanwhile by another thread: this op is not the region's (the next one closes it)
  rec.first_slot = tape.n_slots;
  const size_t nret = schema.returns().size();
  for (size_t i = stack->size() - nret; i < stack->size(); ++i) {
    each_tensor((*stack)[i], [&](const torch::Tensor& t, int64_t) {
      const size_t slot = tape.n_slots++;
      ++rec.n_outputs;
      rec.requires_grad.push_back(t.defined() && t.requires_grad());
      r.slot_owner.emplace_back(tape.ops.size(), rec.n_outputs - 1);
      if (t.defined()) {
        r.slots.insert_or_assign(t.unsafeGetTensorImpl(),
                                 std::make_pair(c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), slot));
      }
    });
  }
  tape.ops.push_back(std::move(rec));
  n_ops.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

void install_checkpoint_layer() {
  install_intercept_layer(InterceptLayer::Checkpoint, &checkpoint_layer_fallback, &checkpoint_layer_composite);
}

void checkpoint_implicitly(const std::string& name, const std::vector<torch::Tensor>& params,
                           const CheckpointOptions& options, ImplicitRegionKind kind) {
  const char* api = kind == ImplicitRegionKind::Offload ? "offload_wrapper" : "apply_activation_checkpointing";
  TORCH_CHECK(!params.empty(), api, ": ", name, " has no parameters of its own (outside ",
              "modules with an fsdp::FSDPModule holder), so its ops cannot be told from the model's: an unchanged ",
              "module is checkpointed from the ops on its parameters. Fix: select a module with parameters (its ",
              "parent), or checkpoint its call in the forward with fsdp::checkpoint");
  TORCH_CHECK(kind == ImplicitRegionKind::Offload || !options.use_reentrant(), api, ": use_reentrant(true) for ", name, ", which has ",
              "no fsdp::FSDPModule holder: the reentrant form re-runs a call, and the model's own code makes this ",
              "module's calls. Fix: the non-reentrant form (the default, and what PyTorch recommends), or declare the ",
              "module as fsdp::FSDPModule<Holder>");
  TORCH_CHECK(options.determinism_check() == "default" || options.determinism_check() == "none",
              "apply_activation_checkpointing: determinism_check must be \"default\" or \"none\", got \"",
              options.determinism_check(), "\"");
  install_checkpoint_layer();
  auto owner = std::make_shared<Owner>();
  owner->name = name;
  owner->kind = kind;
  owner->options = options;
  auto& r = registry();
  std::unique_lock<std::shared_mutex> lock(r.mu);
  for (auto it = r.params.begin(); it != r.params.end();) {
    it = it->second.impl.expired() ? r.params.erase(it) : std::next(it);
  }
  // The same module again (same name): its new options replace the old.
  for (const auto& p : params) {
    auto it = r.params.find(p.unsafeGetTensorImpl());
    if (it == r.params.end()) continue;
    const auto& other = it->second.owner;
    const char* what = other->kind == ImplicitRegionKind::Offload ? "offloaded (offload_wrapper)" : "checkpointed";
    TORCH_CHECK(other->name != name || other->kind == kind, api, ": ", name, " is ", what, " already; an unchanged ",
                "module's regions are either checkpointed or offloaded (a checkpointed region saves little but its ",
                "inputs, so offloading it too gains little). Fix: apply one of the two");
    if (other->name == name) continue;
    TORCH_CHECK(false, api, ": a parameter of ", name, " (shape ", p.sizes(), ") is also a parameter of ", other->name,
                ", which is ", what, " already; an op on it could not tell which module's region it begins (nested ",
                "or tied modules). Fix: apply it to only one of them (the outer one)");
  }
  for (const auto& p : params) {
    if (!p.key_set().has(kInterceptKey)) {
      NoInterception no_interception;
      torch::NoGradGuard no_grad;
      if (p.is_meta()) {
        // A deferred parameter (fsdp::deferred_init): set_data refuses a meta tensor; materialize_module keeps the
        // key of the metadata (as tensor_parallel.cpp's replace_data).
        p.unsafeGetTensorImpl()->shallow_copy_from(intercepted(p.detach()).getIntrusivePtr());
      } else {
        const_cast<torch::Tensor&>(p).set_data(intercepted(p.data()));  // the same storage, with the key
      }
    }
    r.params.insert_or_assign(p.unsafeGetTensorImpl(),
                              ParamEntry{c10::weak_intrusive_ptr<c10::TensorImpl>(p.getIntrusivePtr()), owner});
  }
  any_registered.store(true, std::memory_order_release);
}

bool is_implicitly_checkpointed(const torch::Tensor& param) {
  return any_registered.load(std::memory_order_acquire) && param.defined() && owner_of(param) != nullptr;
}

void close_implicit_region() {
  t_close_pending = false;
  OpenRegion* r = t_open;
  if (!r) return;
  t_open = nullptr;
  r->selective.reset();
  set_region_saved_hooks(nullptr);
  c10::impl::tls_set_dispatch_key_included(kInterceptKey, r->included_before);
  delete r;
}

SuspendImplicitRegions::SuspendImplicitRegions() {
  close_implicit_region();
  ++t_suspended;
}
SuspendImplicitRegions::~SuspendImplicitRegions() { --t_suspended; }

ImplicitCheckpointStats implicit_checkpoint_stats() {
  return {n_regions.load(), n_replays.load(), n_ops.load()};
}

}  // namespace fsdp::detail
