// FSDPState for implicit groups: fully_shard on a module of an unchanged LibTorch model, driven by the
// ops that use its parameters (fsdp_interception.cpp) instead of by a holder's forward.
#include <algorithm>
#include <sstream>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "fsdp/utils/activation_checkpoint.h"
#include "fsdp/fsdp_interception.h"
#include "fsdp/fsdp_state.h"
#include "util.h"

namespace fsdp::detail {

// [Note: implicit groups]
// Python's FSDP2 runs its pre-/post-forward as nn.Module forward hooks, so fully_shard(model.layers[i])
// works on any model. LibTorch modules have no hooks, and its containers call their children's Impl
// directly (Sequential through AnyModule, ModuleList through `as<Block>()`), so a module-level wrapper
// can only see modules that the model calls through one (fsdp::FSDPModule<Holder>, the holder path).
// A group none of whose modules has such a holder is "implicit": FSDP follows its parameters instead
// of its module.
//
// Mechanism. At fully_shard the parameters' data become tensors whose key set also holds
// kInterceptKey (DispatchKey::DeferredInit, free in libtorch; fsdp_interception.h). Every op that
// takes such a parameter, or a view of it, reaches our boxed fallback before Autograd records it. The
// fallback classifies the use and calls this state:
// - forward use (any op outside a backward that does not write the parameter in place): the root's
//   pre-forward if no forward is open (lazy init, Join's announcement, root_pre_forward), then the
//   forward stack: states pop (post-forward: reshard per reshard_after_forward) until the top is an
//   ancestor of this state, which is pushed (pre-forward: unshard, wait, implicit or explicit forward
//   prefetch). Nested use (a parent group around its children) thus keeps the parent unsharded as a
//   module hook would. Floating-point non-parameter inputs of the op are cast to param_dtype
//   (cast_forward_inputs: module inputs are not visible, op inputs are). With grad enabled, each
//   autograd node the op created gets a pre-hook: the first of them to run in backward is this group's
//   pre-backward (unshard, backward prefetch), before any of its nodes or AccumulateGrads.
// - backward use (a backward formula using the saved parameter, or a recomputation inside
//   fsdp::checkpoint): unshards if needed (pre-backward).
// - in-place write (optimizer updates, torch::nn::init): the shard is written. A group left unsharded
//   (by an evaluation forward, or a read) reshards first, so that no update is lost.
// - a read together with the parameter's own gradient under no_grad (torch::optim's weight decay,
//   `grad.add(p, wd)`) and *_like factories (optimizer state) use the shard: the optimizer steps shards.
// Post-backward: a post-accumulate-grad hook on each parameter; once every trainable parameter the
// group used in this forward (or recomputation) has its gradient, the reduce-scatter is issued, during
// the backward. Anything else (a use whose output fed no gradient) is finished by the end-of-backward
// callback, exactly as for holders ([Note: post-backward and the end-of-backward callback]).
// The forward ends at the holder root's post-forward or, for an implicit root, at the first
// pre-backward (the stack is popped; the group that starts the backward stays unsharded). A forward
// without backward (evaluation) leaves the stack to the next forward's first op, which pops it.
//
// Why not the alternatives: an Impl subclass swapped into the containers cannot be built for a type
// unknown to us (Sequential's AnyModule and ModuleList hold the user's concrete Impl), and would not
// cover members called as `fc(x)`; Module::replace_module does not reach a Sequential's AnyModule list.
// Tensor subclasses in the Python sense do not exist in C++. Measured cost: the bare key (a boxed
// fallback that only redispatches) ~0.2-0.3 us per op; with the lookup and the forward stack, a no-grad
// Linear(64, 64) forward on one rank takes 5.5 us against 4.8 us through a holder (4.5 us unsharded),
// while forward + backward is cheaper than the holder's hooks (110 us vs 120 us: no RegisterPostBackward
// node, no output hooks). Other ops pay nothing. End to end, train_gpt's plain model against the holder
// model: docs/BENCHMARKS.md (within noise on tiny and small).
// Limits: uses that do not dispatch (data_ptr(), raw memory in a custom kernel) see what the parameter
// holds at the time; an alias (view, detach(), .data()) taken while the parameter was sharded and
// used in forward raises a c10::Error (raise_stale_alias); torch::optim::LBFGS (clones of parameters
// outside forward) is not supported. Activation checkpointing of an unchanged module cannot re-run its
// forward (no hook can); it records the module's ops and replays them ([Note: implicit checkpoint regions],
// utils/implicit_checkpoint.cpp), non-reentrant only.

namespace {

struct PostAccumulateGrad : torch::autograd::PostAccumulateGradHook {
  PostAccumulateGrad(int64_t id, size_t i) : state_id(id), index(i) {}
  void operator()(const torch::autograd::Variable& /*param*/) override {
    if (auto s = state_by_id(state_id)) s->on_grad_accumulated(index);
  }
  int64_t state_id;
  size_t index;
};

// The topmost sharded module whose tree holds `s`'s first module: the root of `s`'s forwards.
std::shared_ptr<FSDPState> root_for(FSDPState& s) {
  auto mine = s.modules[0].lock();
  TORCH_INTERNAL_ASSERT(mine, "fully_shard: module is gone");
  std::shared_ptr<FSDPState> best;
  size_t best_size = 0;
  for (auto& other : live_states()) {
    auto m = other->modules[0].lock();
    if (!m) continue;
    auto tree = m->modules(/*include_self=*/true);
    if (std::none_of(tree.begin(), tree.end(), [&](const auto& x) { return x.get() == mine.get(); })) continue;
    if (!best || tree.size() > best_size) {
      best = other;
      best_size = tree.size();
    }
  }
  return best;
}

}  // namespace

void FSDPState::register_params() {
  if (!group) return;
  ensure_interception_registered();
  auto self = shared_from_this();
  auto& ps = group->params();
  for (size_t i = 0; i < ps.size(); ++i) {
    register_intercepted_param(ps[i].param, self, i);
    register_param_storage(ps[i].param, ps[i].padded_shard, /*is_shard=*/true);
  }
}

void FSDPState::enable_interception() {
  implicit = true;
  if (!group) return;
  auto& ps = group->params();
  fwd_used.assign(ps.size(), 0);
  bwd_used.assign(ps.size(), 0);
  grad_accumulated.assign(ps.size(), 0);
  for (size_t i = 0; i < ps.size(); ++i) {
    auto& p = ps[i];
    p.enable_interception();
    if (p.param.requires_grad()) {
      torch::autograd::impl::set_post_acc_grad_hooks(p.param, std::make_unique<PostAccumulateGrad>(id, i));
    }
  }
}

void FSDPState::disable_interception() {
  if (ctx || (group && group->sharded_state() != ShardedState::SHARDED)) return;  // keep both: same numbers
  implicit = false;
  if (!group) return;
  for (auto& p : group->params()) p.disable_interception();
}

void FSDPState::begin_root_forward() {
  if (on_root_forward) on_root_forward();
  if (!ctx) lazy_init();
  root_pre_forward();
}

void FSDPState::implicit_forward_use(size_t index, bool grad_mode) {
  if (!ctx || !ctx->forward_open) {
    auto root = ctx ? nullptr : root_for(*this);
    FSDPState* r = ctx ? ctx->root : root.get();
    r->begin_root_forward();
    TORCH_INTERNAL_ASSERT(ctx, "fully_shard: ", name(), " is not under the root ", r->name());
  }
  if (ctx->forward_stack.empty() || ctx->forward_stack.back() != this) {
    // A new call (pushed), or back in an enclosing call after a nested one's (no new pre-forward).
    const auto& st = ctx->forward_stack;
    TORCH_CHECK(std::find(st.begin(), st.end(), this) != st.end() || !options.mp_policy().output_dtype(),
                "fully_shard: mp_policy's output_dtype (", *options.mp_policy().output_dtype(), ") is set on ", name(),
                " on rank ", mesh->get_rank(), ", which has no fsdp::FSDPModule holder and was not called through ",
                "fsdp::fsdp_forward: FSDP sees the ops that use its parameters, not its output, so it cannot cast ",
                "the output (PyTorch casts it in a forward hook; LibTorch modules have none). Fix: call it as ",
                "fsdp::fsdp_forward(*module, [&](const torch::Tensor& x) { return module->forward(x); }, x), declare ",
                "it as an fsdp::FSDPModule<Holder>, or drop output_dtype and cast the output yourself");
    if (enter_forward_stack()) begin_call();
  } else if (group && group->sharded_state() != ShardedState::UNSHARDED) {
    group->unshard(/*async_op=*/false);  // resharded by hand (reshard()) inside its forward
  }
  note_checkpoint_use();
  if (grad_mode && index < fwd_used.size()) fwd_used[index] = 1;
}

bool FSDPState::enter_forward_stack() {
  auto& st = ctx->forward_stack;
  auto on_stack = std::find(st.begin(), st.end(), this);
  if (on_stack != st.end()) {
    ctx->pop_forward_stack(this, /*inclusive=*/false);  // back in its forward after a nested state's
    if (group && group->sharded_state() != ShardedState::UNSHARDED) group->unshard(/*async_op=*/false);
    return false;
  }
  auto is_ancestor = [this](const FSDPState* a) {
    for (const FSDPState* p = parent; p; p = p->parent) {
      if (p == a) return true;
    }
    return false;
  };
  while (!st.empty() && !is_ancestor(st.back())) ctx->pop_forward_stack(st.back(), /*inclusive=*/true);
  st.push_back(this);
  return true;
}

void FSDPContext::pop_forward_stack(FSDPState* s, bool inclusive) {
  while (!forward_stack.empty()) {
    FSDPState* top = forward_stack.back();
    if (top == s && !inclusive) return;
    forward_stack.pop_back();
    if (top->implicit) top->implicit_post_forward();
    if (top == s) return;
  }
}

void FSDPContext::close_forward(FSDPState* keep) {
  while (!forward_stack.empty()) {
    FSDPState* top = forward_stack.back();
    forward_stack.pop_back();
    if (!top->implicit) continue;
    if (top == keep) {
      // Its backward starts now and needs it unsharded: only the bookkeeping of a post-forward.
      top->post_forward_indices.push_back(post_forward_order.size());
      post_forward_order.push_back(top);
      top->training_state = TrainingState::IDLE;
    } else {
      top->implicit_post_forward();
    }
  }
  forward_open = false;
  forward_order_recorded = true;
}

void FSDPState::implicit_post_forward() {
  if (group) {
    if (reshard_after_forward_k == 1) {
      group->reshard();
    } else if (reshard_after_forward_k > 1) {
      group->reshard_post_forward(post_forward_group);  // see [Note: reshard_after_forward=k]
    }
  }
  if (!ctx->in_backward) {
    post_forward_indices.push_back(ctx->post_forward_order.size());
    ctx->post_forward_order.push_back(this);
  }
  training_state = TrainingState::IDLE;
}

void FSDPState::implicit_backward_use(size_t index, bool grad_mode) {
  if (training_state != TrainingState::PRE_BACKWARD) {
    pre_backward();
  } else if (group && group->sharded_state() != ShardedState::UNSHARDED) {
    group->unshard(/*async_op=*/false);
  }
  // A recomputation, or a region first run inside one ([Note: recomputed regions]). A parameter that a
  // recomputation uses gets its gradient again, after the earlier regions' gradients accumulated.
  const bool recomputed = note_checkpoint_use();
  if (recomputed && grad_mode && index < grad_accumulated.size()) grad_accumulated[index] = 0;
  if (grad_mode && index < bwd_used.size()) bwd_used[index] = 1;
}

void FSDPState::implicit_pre_backward() {
  if (ctx) pre_backward();
}

void FSDPState::implicit_write() {
  if (!group || group->sharded_state() == ShardedState::SHARDED) return;
  if (ctx) {
    auto& st = ctx->forward_stack;
    if (std::find(st.begin(), st.end(), this) != st.end()) ctx->pop_forward_stack(this, /*inclusive=*/true);
  }
  group->reshard();
  training_state = TrainingState::IDLE;
}

void FSDPState::on_grad_accumulated(size_t index) {
  if (!implicit || !ctx || !ctx->in_backward || index >= grad_accumulated.size()) return;
  grad_accumulated[index] = 1;
  if (training_state != TrainingState::PRE_BACKWARD) return;
  const auto& ps = group->params();
  for (size_t i = 0; i < ps.size(); ++i) {
    if ((fwd_used[i] || bwd_used[i]) && ps[i].requires_grad() && !grad_accumulated[i]) return;
  }
  if (!all_regions_recomputed()) return;  // a later recomputation will use the group again
  NoInterception no_interception;
  post_backward();
}

void FSDPState::raise_use_outside_forward(const FSDPParam& p, const std::string& op) const {
  raise_bypass(p, "is used by " + op + " during a forward, while it holds only its shard,");
}

void FSDPState::raise_read_with_grad(const FSDPParam& p, const std::string& op) const {
  TORCH_CHECK(false, "fully_shard: parameter '", p.fqn, "' of ", name(), " on rank ", mesh->get_rank(), " is read by ",
              op, " with grad enabled while no forward is open. Between steps a parameter is this rank's shard ",
              "(shape ", shape_str(p.sharded_data.sizes()), " of ", c10::IntArrayRef(p.orig_size), ") and reads never ",
              "communicate; with grad enabled the op might also be the first op of a forward that begins with ",
              "parameters only, which would compute on the shard. Fix: read under torch::NoGradGuard or through ",
              "p.detach() (the local shard; full values: fsdp::get_model_state_dict with full_state_dict, or ",
              "FSDPModuleAPI::unshard()); if this op begins your model's forward, begin the forward with an op on ",
              "its input, or call the root through an fsdp::FSDPModule holder");
}

void FSDPState::raise_stale_alias(const FSDPParam& p, const std::string& op) const {
  TORCH_CHECK(false, "fully_shard: parameter '", p.fqn, "' of ", name(), " on rank ", mesh->get_rank(), " is used by ",
              op, " through an alias of its local shard (shape ", shape_str(p.sharded_data.sizes()), " of ",
              c10::IntArrayRef(p.orig_size), "): a view, detach() or .data() taken while the parameter was sharded ",
              "(outside the forward). FSDP all-gathers the parameter itself, so the alias would compute on the shard. ",
              "Fix: take views of the parameter inside the forward, from the parameter");
}

}  // namespace fsdp::detail
