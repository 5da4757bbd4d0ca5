// FSDPState: the registry of FSDP states, lazy init, the forward/backward hooks and the
// end-of-backward callback. Mirrors torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState.
// (The checks for forwards that bypassed FSDP are in fsdp_state_checks.cpp.)
#include "fsdp/fsdp_state.h"

#include "fsdp/fsdp/deferred_init.h"

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include <torch/csrc/autograd/engine.h>

#include "fsdp/consistency.h"
#include "c10d/process_group_access.h"
#include "utils/checkpoint_regions.h"
#include "utils/implicit_checkpoint.h"
#include "utils/selective_checkpoint_internal.h"

namespace fsdp::detail {

// [Note: post-backward and the end-of-backward callback]
// A group's gradients are reduce-scattered once per backward, after every use of its parameters in that
// backward produced its gradient. Two mechanisms find that moment, as in FSDP2:
// - RegisterPostBackward (below): pre_forward passes the call's inputs that require grad through this
//   identity autograd function. Its backward runs once the gradients of those inputs are computed, that
//   is after every node of the call and the AccumulateGrad nodes they complete (those have the engine's
//   highest priority). on_input_grads_ready counts them; when every call of the group in this forward
//   (and every recomputation in this backward) is tracked and has reported (FSDPState::all_calls_done),
//   the group's post_backward runs right there, so its reduce-scatter overlaps the rest of the backward.
// - The end-of-backward callback: the first pre-backward of a backward (an output's tensor hook) queues
//   root_post_backward_final on the autograd engine, which runs it once the whole backward is done. It
//   runs the post-backward of every group whose hooks could not tell (a call whose inputs need no grad,
//   e.g. token ids; a call whose output fed no gradient) or that got gradients after its post-backward,
//   waits for the reduce-scatters (is_last_backward), reshards and returns every state to IDLE.
// A backward that throws never runs the callback: the BackwardGuard the callback holds is destroyed with
// the engine's graph task, before the exception reaches the caller, and runs abort_backward (local
// cleanup, no collective); the next root forward completes the collectives left in flight.
//
// [Note: collective order]
// Gloo and NCCL match collectives by their order on each rank: every rank must issue the same
// collectives, of the same sizes, in the same order, or the process aborts or hangs. FSDP keeps that
// order independent of what each rank's data did:
// - group layout: at the root's lazy init the ranks compare every group's collective sizes
//   (check_group_layout, consistency.cpp) and all throw a c10::Error when they differ.
// - all-gathers follow the forward (pre_forward, and the implicit prefetch in the first iteration's
//   forward order) and the backward (pre_backward, prefetching in reverse post-forward order): the same
//   program, and the same autograd graph, on every rank.
// - reduce-scatters: a group's has a size that depends on the group only (every trainable parameter
//   takes part, with zeros and a presence flag where this rank has no gradient: FSDPParamGroup::
//   post_backward, foreach_reduce), and the end-of-backward callback finishes groups in the fixed
//   pre-order of FSDPContext::states, not in the order in which their hooks happened to fire.
// - checks that throw run before any collective of their step, on what every rank has alike (e.g.
//   check_params_hold_fsdp_data before the all-gather), so every rank refuses at the same point; cleanup
//   after a failure is local (abort_backward) and leaves collectives in flight for the next root
//   forward to complete.

namespace {

using torch::nn::Module;

// Autograd function applied to a module's inputs that require grad: identity in forward; its backward
// runs when the gradients w.r.t. those inputs are ready, i.e. once the module's backward is done
// (AccumulateGrad nodes run first: they have the highest priority in the engine's ready queue).
// See [Note: post-backward and the end-of-backward callback].
struct RegisterPostBackward : public torch::autograd::Function<RegisterPostBackward> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs, int64_t state_id) {
    ctx->saved_data["state_id"] = state_id;
    return torch::autograd::variable_list(inputs.begin(), inputs.end());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (auto state = state_by_id(ctx->saved_data["state_id"].toInt())) state->on_input_grads_ready();
    grads.emplace_back();  // no gradient for state_id
    return grads;
  }
};

}  // namespace

void FSDPContext::reset_forward(bool adds_to_backward) {
  forward_stack.clear();
  if (adds_to_backward) {
    for (FSDPState* s : states) s->ran_forward = false;  // (the forward graph check is per forward)
    return;
  }
  for (FSDPState* s : states) {
    s->ran_forward = false;
    s->fwd_calls = 0;
    s->fwd_untracked = 0;
    s->post_forward_indices.clear();
    s->ckpt_regions.clear();
    std::fill(s->fwd_used.begin(), s->fwd_used.end(), 0);
  }
  post_forward_order.clear();
  reset_backward();
}

void FSDPContext::reset_backward() {
  for (FSDPState* s : states) {
    s->training_state = TrainingState::IDLE;
    s->bwd_calls = 0;
    s->bwd_untracked = 0;
    s->input_grads_ready = 0;
    s->backward_cursor = 0;
    s->post_backward_runs = 0;
    s->ckpt_recomputed.clear();
    std::fill(s->bwd_used.begin(), s->bwd_used.end(), 0);
    std::fill(s->grad_accumulated.begin(), s->grad_accumulated.end(), 0);
  }
  in_backward = false;
  reduce_pending = nullptr;
  open_graph.reset();
}

std::string FSDPState::name() const {
  if (!ctx) return "the module passed to fully_shard (" + module_type + ")";
  if (is_root()) return "the root (" + module_type + ")";
  return "'" + fqn + "' (" + module_type + ")";
}

FSDPState::FSDPState(std::vector<std::shared_ptr<Module>> mods, FullyShardOptions opts)
    : options(std::move(opts)) {
  for (auto& m : mods) modules.push_back(m);
  module_type = mods[0]->name();
  for (size_t i = 1; i < mods.size(); ++i) module_type += "+" + mods[i]->name();
}

double FSDPState::divide_factor() const {
  if (gradient_divide_factor) return *gradient_divide_factor;
  return static_cast<double>(mesh->size());  // shard size x replicate size: the data-parallel ranks
}

void FSDPState::init_params(const std::vector<std::pair<size_t, std::string>>& origin) {
  if (!group) return;
  auto& ps = group->params();
  for (size_t i = 0; i < ps.size(); ++i) {
    ps[i].module_index = origin[i].first;
    ps[i].name_in_module = origin[i].second;
    if (!ps[i].param.requires_grad()) continue;
    // Every gradient that reaches the parameter must come from a use inside the group's FSDP
    // forward: a forward that bypassed FSDP computed on the shard (see check_grad_arrival). The hook
    // runs before AccumulateGrad, in every backward, for as long as the parameter lives.
    const int64_t sid = id;
    ps[i].param.register_hook([sid, i](const torch::Tensor& grad) {
      if (auto s = state_by_id(sid)) {
        if (s->group && i < s->group->params().size()) s->check_grad_arrival(s->group->params()[i], grad);
      }
    });
  }
}

namespace {

// lazy_init's steps, in order.

// Parameters and buffers built by deferred_init must be materialised before the first forward.
void check_materialized(const torch::nn::Module& root_module, const FSDPState& root) {
  for (const auto& p : root_module.named_parameters(/*recurse=*/true)) {
    TORCH_CHECK(!is_deferred(p.value()), "fully_shard: parameter '", p.key(), "' of ", root.module_type, " on rank ",
                root.mesh->get_rank(), " was built by fsdp::deferred_init and has no values yet. Fix: call ",
                "fsdp::materialize_module(model) after the fully_shard calls, before the first forward");
  }
  for (const auto& b : root_module.named_buffers(/*recurse=*/true)) {
    TORCH_CHECK(!is_deferred(b.value()), "fully_shard: buffer '", b.key(), "' of ", root.module_type, " on rank ",
                root.mesh->get_rank(), " was built by fsdp::deferred_init and has no values yet. Fix: call ",
                "fsdp::materialize_module(model) after the fully_shard calls, before the first forward");
  }
}

// Gathers every state in `root`'s module tree into root.ctx (root first) and records each state's
// module paths from the root (several for fully_shard({a, b})).
void collect_states(FSDPState& root, torch::nn::Module& root_module) {
  auto& ctx = root.ctx;
  std::unordered_set<FSDPState*> seen;
  root.module_fqns.assign(root.modules.size(), std::nullopt);
  for (const auto& item : root_module.named_modules("", /*include_self=*/true)) {
    auto s = state_of(*item.value());
    if (!s) continue;
    if (seen.insert(s.get()).second) {
      if (s.get() != &root) {
        TORCH_CHECK(!s->ctx, "fully_shard: FSDP requires running forward through the root module first: '",
                    item.key(), "' (", s->module_type, ") ran forward before the root (", root.module_type, "). Fix: ",
                    "call the root model's forward (the module fully_shard was applied to last) before any submodule's");
        s->ctx = ctx;
        s->fqn = item.key();
        s->module_fqns.assign(s->modules.size(), std::nullopt);
      }
      ctx->states.push_back(s.get());
    }
    for (size_t i = 0; i < s->modules.size(); ++i) {
      if (!s->module_fqns[i] && s->modules[i].lock().get() == item.value().get()) s->module_fqns[i] = item.key();
    }
  }
}

// Each state's nearest sharded ancestor (the forward stack nests states by it).
void link_parents(FSDPState& root) {
  std::unordered_map<std::string, FSDPState*> by_path;
  for (FSDPState* s : root.ctx->states) {
    for (const auto& f : s->module_fqns) {
      if (f) by_path.emplace(*f, s);
    }
  }
  for (FSDPState* s : root.ctx->states) {
    s->parent = nullptr;
    if (s == &root || s->module_fqns.empty() || !s->module_fqns[0]) continue;
    std::string path = *s->module_fqns[0];
    while (!s->parent) {
      auto dot = path.rfind('.');
      path = dot == std::string::npos ? "" : path.substr(0, dot);
      auto it = by_path.find(path);
      if (it != by_path.end() && it->second != s) s->parent = it->second;
      if (path.empty() && !s->parent) s->parent = &root;
    }
  }
}

// Resolves `s`'s reshard_after_forward (default: true except for the root). See [Note:
// reshard_after_forward=k] (fsdp_param_group.cpp).
void resolve_reshard_after_forward(FSDPState& s, bool root) {
  ReshardAfterForward raf = s.options.reshard_after_forward().value_or(ReshardAfterForward(!root));
  int shard_size = s.group ? s.group->shard_size() : 1;
  if (std::holds_alternative<bool>(raf)) {
    s.reshard_after_forward_k = std::get<bool>(raf) ? 1 : 0;
    return;
  }
  int k = std::get<int>(raf);
  TORCH_CHECK(k >= 1 && shard_size % k == 0, "fully_shard: reshard_after_forward=", k, " of ", s.name(),
              " must divide the shard group size ", shard_size);
  s.reshard_after_forward_k = k == shard_size ? 1 : (k == 1 ? 0 : k);
  if (s.reshard_after_forward_k > 1) {
    // Groups of k consecutive ranks of the shard group, as FSDP2's post-forward mesh.
    auto& pg = s.group->mesh()->get_group(s.group->mesh()->ndim() - 1);
    int base = pg->rank() / k * k;
    std::vector<int> members;
    for (int i = 0; i < k; ++i) members.push_back(base + i);
    s.post_forward_group = new_group(
        pg, members, "post_forward" + std::to_string(ProcessGroupAccess::next_subgroup_id(*pg)) + "/" + std::to_string(base));
  }
}

}  // namespace

void FSDPState::lazy_init() {
  // This state runs forward first: it becomes the root of every state in its modules' trees.
  auto root_module = modules[0].lock();
  TORCH_INTERNAL_ASSERT(root_module, "lazy_init: module is gone");
  check_materialized(*root_module, *this);
  ctx = std::make_shared<FSDPContext>();
  ctx->root = this;
  fqn = "";
  collect_states(*this, *root_module);
  link_parents(*this);
  for (FSDPState* s : ctx->states) {
    if (!s->group) continue;
    const auto& ps = s->group->params();
    for (size_t i = 0; i < ps.size(); ++i) ctx->param_index.emplace(ps[i].param.unsafeGetTensorImpl(), std::make_pair(s, i));
  }
  // Name parameters by their path from the root, and resolve reshard_after_forward.
  for (FSDPState* s : ctx->states) {
    if (s->group) {
      for (auto& p : s->group->params()) {
        const auto& mfqn = s->module_fqns[p.module_index];
        if (!mfqn) continue;  // a module of the group outside the root's tree: keep the local name
        p.fqn = mfqn->empty() ? p.name_in_module : *mfqn + "." + p.name_in_module;
      }
    }
    resolve_reshard_after_forward(*s, s == this);
  }
  // Every rank must have the same groups with the same collective sizes (a c10::Error, not a Gloo abort).
  // See [Note: collective order].
  check_group_layout(*this);
}

void FSDPState::root_pre_forward() {
  // A new iteration. Groups left unsharded (by an explicit unshard(), a forward without backward, an
  // unused prefetch, reshard_after_backward=false) hold their shards again, so that an optimizer step or
  // a load before their next unshard is not lost; their unsharded data is kept and reused by that unshard
  // unless a shard changed ([Note: kept unsharded data], fsdp_param_group_kept.cpp).
  if (ctx->in_backward) abort_backward();  // a backward that neither finished nor reported its failure
  const bool backward_unfinished = ctx->backward_aborted;  // the last backward threw before its end
  ctx->backward_aborted = false;
  for (FSDPState* s : ctx->states) {
    if (!s->group) continue;
    if (backward_unfinished) {
      // Its in-flight reduce-scatters and unsharded gradients must not leak into this step.
      s->group->discard_gradients_in_flight();
      s->group->reshard();
    } else if (s != this && s->reshard_after_forward_k != 0) {
      s->group->reshard_keep_unsharded();
    }
  }
  // [Note: several forwards, one backward]
  // Two root forwards before one backward (a loss summed over two batches): the group's uses in both
  // feed that backward, so their calls add up (else the group would be reduced when the second
  // forward's calls are done, and again when the first forward's gradients arrive). The previous
  // forward belongs to the coming backward while its output's autograd node lives and no backward ran
  // since; a forward whose output was dropped (an evaluation with grad enabled) starts afresh.
  ctx->reset_forward(/*adds_to_backward=*/!backward_unfinished && ctx->open_graph.lock() != nullptr);
  ctx->forward_open = true;
  // set_post_optim_event: the all-gather streams wait on the user's event, and this iteration's copy-ins
  // not on the compute stream (CUDA; no-op on the CPU).
  auto event = std::exchange(post_optim_event, nullptr);
  std::unordered_set<const CommContext*> done;
  for (FSDPState* s : ctx->states) {
    if (!s->group || !done.insert(s->group->comm_context().get()).second) continue;
    auto& comm = *s->group->comm_context();
    comm.set_copy_in_waits_current(event == nullptr);
    if (!event) continue;
    comm.stream_wait(CommStream::kAllGatherCopyIn, event);
    comm.stream_wait(CommStream::kAllGather, event);
  }
}

void FSDPState::prefetch(FSDPState* other) {
  if (!other || !other->group) return;
  if (ctx && ctx->in_backward && !other->group->unshard_in_backward) return;  // set_unshard_in_backward(false)
  other->group->unshard(/*async_op=*/true);
}

bool FSDPState::note_checkpoint_use() {
  const auto& frames = checkpoint_frames();
  if (frames.empty()) return false;
  auto has = [](const std::vector<uint64_t>& v, uint64_t r) { return std::find(v.begin(), v.end(), r) != v.end(); };
  bool ours = false;
  for (const auto& f : frames) {
    if (!f.recompute || !has(ckpt_regions, f.region)) continue;
    ours = true;
    if (!has(ckpt_recomputed, f.region)) ckpt_recomputed.push_back(f.region);
  }
  // The innermost region's first run (no grad): it will be recomputed in a backward.
  const auto& inner = frames.back();
  if (!inner.recompute && !has(ckpt_regions, inner.region)) ckpt_regions.push_back(inner.region);
  return ours;
}

bool FSDPState::all_regions_recomputed() const {
  for (uint64_t r : ckpt_regions) {
    if (std::find(ckpt_recomputed.begin(), ckpt_recomputed.end(), r) == ckpt_recomputed.end()) return false;
  }
  return true;
}

std::vector<torch::Tensor> FSDPState::pre_forward(std::vector<torch::Tensor> inputs) {
  // FSDP's own ops (unshard, casts, hooks) are not those of an enclosing selective checkpoint region, and differ
  // between its first run and its recomputation ([Note: selective checkpoint]).
  // A holder's forward ends the thread's implicit checkpoint region ([Note: implicit checkpoint regions]); first, so
  // that the selective run it frees is not the one SuspendSelective puts back.
  detail::SuspendImplicitRegions suspend_implicit;
  detail::SuspendSelective suspend_selective;
  // A forward recomputed during this module's backward (activation checkpointing around it, inside its
  // hooks): the pre-backward already unsharded the parameters, and nothing must be resharded or
  // re-registered. A call recomputed by a region of its own (each call checkpointed separately) is a
  // call like the first recomputed one, though the group is already in its backward: it is tracked, so
  // that the post-backward waits for its gradients ([Note: recomputed regions]).
  // A recomputation casts as the forward did (cast_forward_inputs), so that it computes the same tensors.
  bool recomputed_region = false;
  if (ctx && ctx->in_backward && in_non_reentrant_recompute()) {
    // A non-reentrant region recomputed for the saved tensors of the forward's graph ([Note: non-reentrant
    // checkpoint], activation_checkpoint.cpp): its graph is never backpropagated, so the call is not
    // counted; the group's backward is due (its forward ran in the region): unshard as its pre-backward.
    pre_backward();
    return cast_forward_inputs(std::move(inputs));
  }
  if (training_state == TrainingState::PRE_BACKWARD) {
    recomputed_region = note_checkpoint_use();
    if (!recomputed_region) return cast_forward_inputs(std::move(inputs));
  }
  // An fsdp::Join in progress announces the root's forward to the ranks that ran out of data, before
  // any collective of this forward (lazy init's included).
  if (on_root_forward && (!ctx || (is_root() && training_state != TrainingState::FORWARD))) on_root_forward();
  if (!ctx) {
    lazy_init();
    root_pre_forward();
  } else if (is_root() && training_state != TrainingState::FORWARD && !recomputed_region) {
    root_pre_forward();
  }
  if (!recomputed_region) note_checkpoint_use();  // (after the root's pre-forward: it resets the regions)
  // As FSDP2's root pre-forward: the root's tensor inputs go to the mesh's device (accelerators only).
  if (is_root() && !recomputed_region && mesh && !mesh->device().is_cpu()) {
    for (auto& t : inputs) {
      if (t.defined() && t.device() != mesh->device()) t = t.to(mesh->device());
    }
  }
  enter_forward_stack();
  input_node.reset();
  // An exception from the module's forward leaves this state FORWARD; forward_failed resets it.
  inputs = cast_forward_inputs(std::move(inputs));
  begin_call();
  // Post-backward runs when the gradients of these inputs are computed (and every call of the group
  // is done: see all_calls_done).
  if (torch::GradMode::is_enabled()) {
    std::vector<size_t> pos;
    torch::autograd::variable_list need;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].defined() && inputs[i].requires_grad()) {
        pos.push_back(i);
        need.push_back(inputs[i]);
      }
    }
    // A call during a backward is a recomputation (a checkpointed parent): it belongs to that backward.
    (ctx->in_backward ? bwd_calls : fwd_calls) += 1;
    if (need.empty()) (ctx->in_backward ? bwd_untracked : fwd_untracked) += 1;
    if (!need.empty()) {
      // Passed as a TensorList: a std::vector argument would not be seen as tensors by autograd.
      auto outs = RegisterPostBackward::apply(at::TensorList(need), id);
      for (size_t j = 0; j < pos.size(); ++j) inputs[pos[j]] = outs[j];
      if (is_root()) input_node = outs[0].grad_fn();
    }
  }
  return inputs;
}

void FSDPState::begin_call() {
  training_state = TrainingState::FORWARD;
  ran_forward = true;
  if (group) {
    group->unshard(/*async_op=*/true);  // no-op when a prefetch is in flight or already unsharded
    group->wait_for_unshard();
  }
  // Prefetch: the explicit list, or the state that ran after this one in the first iteration.
  if (forward_prefetch) {
    for (auto& w : *forward_prefetch) prefetch(w.lock().get());
  } else if (ctx->forward_order_recorded) {
    auto& order = ctx->forward_order;
    for (size_t i = 0; i + 1 < order.size(); ++i) {
      if (order[i] == this) {
        prefetch(order[i + 1]);
        break;
      }
    }
  }
  if (!ctx->forward_order_recorded &&
      std::find(ctx->forward_order.begin(), ctx->forward_order.end(), this) == ctx->forward_order.end()) {
    ctx->forward_order.push_back(this);
  }
}

std::vector<torch::Tensor> FSDPState::cast_forward_inputs(std::vector<torch::Tensor> inputs) const {
  const auto& mp = options.mp_policy();
  if (mp.cast_forward_inputs() && mp.param_dtype()) {
    for (auto& t : inputs) {
      if (t.defined() && t.is_floating_point() && t.scalar_type() != *mp.param_dtype()) t = t.to(*mp.param_dtype());
    }
  }
  return inputs;
}

std::vector<torch::Tensor> FSDPState::cast_outputs(std::vector<torch::Tensor> outputs) const {
  const auto& mp = options.mp_policy();
  if (mp.output_dtype()) {
    for (auto& t : outputs) {
      if (t.defined() && t.is_floating_point() && t.scalar_type() != *mp.output_dtype()) t = t.to(*mp.output_dtype());
    }
  }
  return outputs;
}

std::vector<torch::Tensor> FSDPState::post_forward(std::vector<torch::Tensor> outputs) {
  detail::SuspendImplicitRegions suspend_implicit;  // (as pre_forward)
  detail::SuspendSelective suspend_selective;
  // A recomputation (see pre_forward): only the casts of the forward.
  if (training_state == TrainingState::PRE_BACKWARD) return cast_outputs(std::move(outputs));
  // Implicit states still running inside this module's forward end with it.
  ctx->pop_forward_stack(this, /*inclusive=*/true);
  if (group) {
    if (reshard_after_forward_k == 1) {
      group->reshard();
    } else if (reshard_after_forward_k > 1) {
      group->reshard_post_forward(post_forward_group);  // see [Note: reshard_after_forward=k]
    }
  }
  if (is_root()) {
    ctx->forward_order_recorded = true;
    ctx->close_forward(nullptr);
  }
  if (!ctx->in_backward) {
    post_forward_indices.push_back(ctx->post_forward_order.size());
    ctx->post_forward_order.push_back(this);
  }
  if (torch::GradMode::is_enabled() && is_root()) {
    check_forward_graph(outputs);
    for (const auto& t : outputs) {
      if (t.defined() && t.grad_fn()) {
        ctx->open_graph = t.grad_fn();  // [Note: several forwards, one backward]
        break;
      }
    }
  }
  if (torch::GradMode::is_enabled()) {
    int64_t sid = id;
    for (auto& t : outputs) {
      if (t.defined() && t.requires_grad()) {
        t.register_hook([sid](const torch::Tensor&) {
          if (auto s = state_by_id(sid)) s->pre_backward();
        });
      }
    }
  }
  outputs = cast_outputs(std::move(outputs));
  training_state = TrainingState::IDLE;
  return outputs;
}

std::vector<torch::Tensor> pre_forward(FSDPState& state, std::vector<torch::Tensor> inputs) {
  return state.pre_forward(std::move(inputs));
}

std::vector<torch::Tensor> post_forward(FSDPState& state, std::vector<torch::Tensor> outputs) {
  return state.post_forward(std::move(outputs));
}

}  // namespace fsdp::detail
