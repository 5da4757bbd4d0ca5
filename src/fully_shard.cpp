// fully_shard: the registry of FSDP states, the forward/backward hooks and the public API.
#include "fsdp/fully_shard.h"

#include <mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/nn/modules/embedding.h>

#include "consistency.h"
#include "fsdp_state.h"
#include "process_group_access.h"

namespace fsdp {
namespace detail {
namespace {

using torch::nn::Module;

// Module -> state, and state id -> state. Modules are held weakly: a state lives while its module does.
struct Registry {
  std::mutex mu;
  struct Entry {
    std::weak_ptr<Module> module;
    std::shared_ptr<FSDPState> state;
  };
  std::unordered_map<const Module*, Entry> by_module;
  std::unordered_map<int64_t, std::weak_ptr<FSDPState>> by_id;
  std::unordered_map<const Module*, std::weak_ptr<Module>> fsdp_forward;  // marked by FSDPModule holders
  int64_t next_id = 1;

  void purge_locked() {
    for (auto it = by_module.begin(); it != by_module.end();) {
      it = it->second.module.expired() ? by_module.erase(it) : std::next(it);
    }
    for (auto it = by_id.begin(); it != by_id.end();) it = it->second.expired() ? by_id.erase(it) : std::next(it);
    for (auto it = fsdp_forward.begin(); it != fsdp_forward.end();) {
      it = it->second.expired() ? fsdp_forward.erase(it) : std::next(it);
    }
  }
};

Registry& registry() {
  // Never destroyed: at exit the states it holds (CUDA shards, NCCL groups through their meshes) would be
  // destroyed during static destruction, after CUDA's own teardown, which crashes the process at exit
  // (train_gpt --device cuda under fsdprun, found on an H200).
  static Registry* r = new Registry();
  return *r;
}

bool is_marked(const Module& m) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.fsdp_forward.find(&m);
  return it != r.fsdp_forward.end() && !it->second.expired();
}

// Autograd function applied to a module's inputs that require grad: identity in forward; its backward
// runs when the gradients w.r.t. those inputs are ready, i.e. once the module's backward is done
// (AccumulateGrad nodes run first: they have the highest priority in the engine's ready queue).
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

std::string describe_shape(const torch::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

}  // namespace

std::shared_ptr<FSDPState> state_of(const Module& module) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_module.find(&module);
  if (it == r.by_module.end() || it->second.module.expired()) return nullptr;
  return it->second.state;
}

void FSDPContext::reset_forward() {
  for (FSDPState* s : states) {
    s->ran_forward = false;
    s->fwd_calls = 0;
    s->fwd_untracked = 0;
    s->post_forward_indices.clear();
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
  }
  in_backward = false;
}

namespace {
// Runs the root's cleanup when a backward ends without its end-of-backward callback (an exception
// inside the backward: the engine drops the graph task, and with it this guard, before the
// exception reaches the caller — so before user code can zero or step the gradients).
struct BackwardGuard {
  explicit BackwardGuard(int64_t id) : root_id(id) {}
  BackwardGuard(const BackwardGuard&) = delete;  // one owner: only its destruction means "dropped"
  BackwardGuard& operator=(const BackwardGuard&) = delete;
  int64_t root_id;
  bool finished = false;
  ~BackwardGuard() {
    if (finished) return;
    if (auto r = state_by_id(root_id)) r->abort_backward();
  }
};
}  // namespace

std::string FSDPState::name() const {
  if (!ctx) return "the module passed to fully_shard (" + module_type + ")";
  if (is_root()) return "the root (" + module_type + ")";
  return "'" + fqn + "' (" + module_type + ")";
}

std::shared_ptr<FSDPState> state_by_id(int64_t id) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_id.find(id);
  return it == r.by_id.end() ? nullptr : it->second.lock();
}

std::unordered_map<const c10::TensorImpl*, std::shared_ptr<FSDPState>> param_owners() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::unordered_map<const c10::TensorImpl*, std::shared_ptr<FSDPState>> owners;
  for (auto& [mod, entry] : r.by_module) {
    if (entry.module.expired() || !entry.state->group) continue;
    for (const auto& p : entry.state->group->params()) owners.emplace(p.param.unsafeGetTensorImpl(), entry.state);
  }
  return owners;
}

std::shared_ptr<FSDPState> state_of_param(const torch::Tensor& param) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const auto* impl = param.unsafeGetTensorImpl();
  for (auto& [mod, entry] : r.by_module) {
    if (entry.module.expired() || !entry.state->group) continue;
    for (const auto& p : entry.state->group->params()) {
      if (p.param.unsafeGetTensorImpl() == impl) return entry.state;
    }
  }
  return nullptr;
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

void FSDPState::lazy_init() {
  // This state runs forward first: it becomes the root of every state in its modules' trees.
  auto root_module = modules[0].lock();
  TORCH_INTERNAL_ASSERT(root_module, "lazy_init: module is gone");
  ctx = std::make_shared<FSDPContext>();
  ctx->root = this;
  fqn = "";
  std::unordered_set<FSDPState*> seen;
  module_fqns.assign(modules.size(), std::nullopt);
  for (const auto& item : root_module->named_modules("", /*include_self=*/true)) {
    auto s = state_of(*item.value());
    if (!s) continue;
    if (seen.insert(s.get()).second) {
      if (s.get() != this) {
        TORCH_CHECK(!s->ctx, "fully_shard: FSDP requires running forward through the root module first: '",
                    item.key(), "' (", s->module_type, ") ran forward before the root (", module_type, "). Fix: ",
                    "call the root model's forward (the module fully_shard was applied to last) before any submodule's");
        s->ctx = ctx;
        s->fqn = item.key();
        s->module_fqns.assign(s->modules.size(), std::nullopt);
      }
      ctx->states.push_back(s.get());
    }
    // The path of each module of the state (several for fully_shard({a, b})).
    for (size_t i = 0; i < s->modules.size(); ++i) {
      if (!s->module_fqns[i] && s->modules[i].lock().get() == item.value().get()) s->module_fqns[i] = item.key();
    }
  }
  for (FSDPState* s : ctx->states) {
    if (!s->group) continue;
    const auto& ps = s->group->params();
    for (size_t i = 0; i < ps.size(); ++i) ctx->param_index.emplace(ps[i].param.unsafeGetTensorImpl(), std::make_pair(s, i));
  }
  // Resolve reshard_after_forward and name parameters by their path from the root.
  for (FSDPState* s : ctx->states) {
    if (s->group) {
      for (auto& p : s->group->params()) {
        const auto& mfqn = s->module_fqns[p.module_index];
        if (!mfqn) continue;  // a module of the group outside the root's tree: keep the local name
        p.fqn = mfqn->empty() ? p.name_in_module : *mfqn + "." + p.name_in_module;
      }
    }
    bool root = s == this;
    ReshardAfterForward raf = s->options.reshard_after_forward().value_or(ReshardAfterForward(!root));
    int shard_size = s->group ? s->group->shard_size() : 1;
    if (std::holds_alternative<bool>(raf)) {
      s->reshard_after_forward_k = std::get<bool>(raf) ? 1 : 0;
    } else {
      int k = std::get<int>(raf);
      TORCH_CHECK(k >= 1 && shard_size % k == 0, "fully_shard: reshard_after_forward=", k, " of ", s->name(),
                  " must divide the shard group size ", shard_size);
      s->reshard_after_forward_k = k == shard_size ? 1 : (k == 1 ? 0 : k);
      if (s->reshard_after_forward_k > 1) {
        // Groups of k consecutive ranks of the shard group, as FSDP2's post-forward mesh.
        auto& pg = s->group->mesh()->get_group(s->group->mesh()->ndim() - 1);
        int base = pg->rank() / k * k;
        std::vector<int> members;
        for (int i = 0; i < k; ++i) members.push_back(base + i);
        s->post_forward_group =
            new_group(pg, members, "post_forward" + std::to_string(detail::ProcessGroupAccess::next_subgroup_id(*pg)) +
                                       "/" + std::to_string(base));
      }
    }
  }
  // Every rank must have the same groups with the same collective sizes (a c10::Error, not a Gloo abort).
  check_group_layout(*this);
}

void FSDPState::root_pre_forward() {
  // A new iteration. Groups left unsharded by a forward without backward (evaluation) or by an unused
  // prefetch are resharded, so that no stale all-gather survives an optimizer step.
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
      s->group->reshard();
    }
  }
  ctx->reset_forward();
}

void FSDPState::abort_backward() noexcept {
  if (!ctx) return;
  for (FSDPState* s : ctx->states) {
    if (s->group) s->group->abort_backward();
  }
  ctx->reset_backward();
  ctx->backward_aborted = true;
}

void FSDPState::prefetch(FSDPState* other) {
  if (other && other->group) other->group->unshard(/*async_op=*/true);
}

std::vector<torch::Tensor> FSDPState::pre_forward(std::vector<torch::Tensor> inputs) {
  // A forward recomputed during this module's backward (activation checkpointing around it): the
  // pre-backward already unsharded the parameters, and nothing must be resharded or re-registered.
  if (training_state == TrainingState::PRE_BACKWARD) return inputs;
  // An fsdp::Join in progress announces the root's forward to the ranks that ran out of data, before
  // any collective of this forward (lazy init's included).
  if (on_root_forward && (!ctx || (is_root() && training_state != TrainingState::FORWARD))) on_root_forward();
  if (!ctx) {
    lazy_init();
    root_pre_forward();
  } else if (is_root() && training_state != TrainingState::FORWARD) {
    root_pre_forward();
  }
  training_state = TrainingState::FORWARD;
  ran_forward = true;
  input_node = nullptr;
  // An exception from the module's forward leaves this state FORWARD; forward_failed resets it.
  const auto& mp = options.mp_policy();
  if (mp.cast_forward_inputs() && mp.param_dtype()) {
    for (auto& t : inputs) {
      if (t.defined() && t.is_floating_point() && t.scalar_type() != *mp.param_dtype()) t = t.to(*mp.param_dtype());
    }
  }
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
      if (is_root()) input_node = outs[0].grad_fn().get();
    }
  }
  return inputs;
}

std::vector<torch::Tensor> FSDPState::post_forward(std::vector<torch::Tensor> outputs) {
  if (training_state == TrainingState::PRE_BACKWARD) return outputs;  // recomputation: see pre_forward
  if (group) {
    if (reshard_after_forward_k == 1) {
      group->reshard();
    } else if (reshard_after_forward_k > 1) {
      group->reshard_post_forward(post_forward_group);
    }
  }
  if (is_root() && !ctx->forward_order_recorded) ctx->forward_order_recorded = true;
  if (!ctx->in_backward) {
    post_forward_indices.push_back(ctx->post_forward_order.size());
    ctx->post_forward_order.push_back(this);
  }
  if (torch::GradMode::is_enabled() && is_root()) check_forward_graph(outputs);
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
  const auto& mp = options.mp_policy();
  if (mp.output_dtype()) {
    for (auto& t : outputs) {
      if (t.defined() && t.is_floating_point() && t.scalar_type() != *mp.output_dtype()) t = t.to(*mp.output_dtype());
    }
  }
  training_state = TrainingState::IDLE;
  return outputs;
}

void FSDPState::pre_backward() {
  if (!ctx->in_backward) {
    // First FSDP hook of this backward: queue the end-of-backward callback (with a guard that cleans
    // up if the backward throws) and move every group's sharded gradients out of autograd's way.
    ctx->in_backward = true;
    auto guard = std::make_shared<BackwardGuard>(ctx->root->id);
    torch::autograd::Engine::get_default_engine().queue_callback([guard] {
      if (auto r = state_by_id(guard->root_id)) r->root_post_backward_final();
      guard->finished = true;
    });
    for (FSDPState* s : ctx->states) {
      if (s->group) s->group->begin_backward();
    }
  }
  // Already ran for this backward of the module, and no post-backward since: still unsharded.
  if (training_state == TrainingState::PRE_BACKWARD) return;
  training_state = TrainingState::PRE_BACKWARD;
  if (group) {
    group->unshard(/*async_op=*/true);
    group->wait_for_unshard();
  }
  // Prefetch: the explicit list, or the state whose forward ran just before this one (calls are
  // visited in reverse order of their post-forwards; a second backward over the graph reads again).
  size_t index = 0;
  bool have_index = false;
  if (backward_cursor < post_forward_indices.size()) {
    index = post_forward_indices[post_forward_indices.size() - 1 - backward_cursor];
    ++backward_cursor;
    have_index = true;
  }
  if (backward_prefetch) {
    for (auto& w : *backward_prefetch) prefetch(w.lock().get());
  } else if (have_index && index > 0) {
    prefetch(ctx->post_forward_order[index - 1]);
  }
}

void FSDPState::on_input_grads_ready() {
  ++input_grads_ready;
  // Only when every use of the group's parameters is known to be done; otherwise (a call whose
  // inputs need no gradient, a call whose output got no gradient) the end-of-backward callback runs
  // the post-backward once the whole backward is done.
  if (training_state == TrainingState::PRE_BACKWARD && all_calls_done()) post_backward();
}

void FSDPState::post_backward() {
  training_state = TrainingState::POST_BACKWARD;
  ++post_backward_runs;
  if (group) group->post_backward(requires_gradient_sync, reshard_after_backward, divide_factor());
}

void FSDPState::root_post_backward_final() {
  // Finish every group whose post-backward did not run (its hooks could not tell when its gradients
  // were complete: inputs without grad such as token ids, a call whose output fed no gradient), or
  // that received gradients after it ran. Fixed pre-order: the same collectives on every rank.
  for (FSDPState* s : ctx->states) {
    if (!s->group) continue;
    if (s->training_state == TrainingState::PRE_BACKWARD || s->group->has_unsharded_grads()) s->post_backward();
  }
  for (FSDPState* s : ctx->states) {
    if (!s->group) continue;
    if (s->is_last_backward) s->group->finish_reduce(s->divide_factor());
    // After a synchronised backward the optimizer steps next: it must see the shards and their
    // gradients, so the group reshards even with reshard_after_backward=false (which keeps the
    // parameters unsharded only between microbatches that skip the gradient sync).
    if (s->reshard_after_backward || (s->requires_gradient_sync && s->is_last_backward)) s->group->reshard();
    s->group->end_backward();
  }
  ctx->reset_backward();
}

void FSDPState::check_grad_arrival(const FSDPParam& p, const torch::Tensor& grad) const {
  // A use inside one of the group's FSDP calls gets its gradient after that call's pre-backward
  // unsharded the group (the output's hook runs before any node of the call), and before its
  // post-backward (which waits for every call). Anything else used the parameter on its shard.
  if (ctx && ctx->in_backward && training_state == TrainingState::PRE_BACKWARD &&
      group->sharded_state() == ShardedState::UNSHARDED) {
    return;
  }
  raise_bypass(p, "got a gradient (shape " + describe_shape(grad) + ") in backward from a use");
}

void FSDPState::check_forward_graph(const std::vector<torch::Tensor>& outputs) const {
  if (ctx->param_index.empty()) return;
  // Every node once; AccumulateGrad nodes are the parameters' uses. Checkpointed regions appear as
  // one node (their parameters are used in the recomputation).
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  for (const auto& t : outputs) {
    if (t.defined() && t.requires_grad() && t.grad_fn() && seen.insert(t.grad_fn().get()).second) {
      stack.push_back(t.grad_fn().get());
    }
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      auto* fn = edge.function.get();
      if (!fn || !seen.insert(fn).second) continue;
      auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(fn);
      if (!acc) {
        if (fn != input_node) stack.push_back(fn);
        continue;
      }
      auto it = ctx->param_index.find(acc->variable.unsafeGetTensorImpl());
      if (it == ctx->param_index.end()) continue;
      const FSDPState* s = it->second.first;
      const FSDPParam& p = s->group->params()[it->second.second];
      if (!s->ran_forward) {
        s->raise_bypass(p, "is used in this forward, but its module's forward did not go through FSDP: a use");
      }
      // Used while sharded (the accumulator records the shape of the first use in the graph).
      auto shape = C10_AS_INTARRAYREF_SLOW(acc->input_metadata(0).shape_as_dim_vector());
      if (shape != p.sharded_data.sizes() || shape == c10::IntArrayRef(p.orig_size)) continue;
      s->raise_bypass(p, "is used in this forward on its shard (shape " + describe_shape(p.sharded_data) + "): a use");
    }
  }
}

void FSDPState::raise_bypass(const FSDPParam& p, const std::string& what) const {
  std::string module_desc = name();
  if (modules.size() > 1) {
    auto m = modules[p.module_index].lock();
    const auto& mf = module_fqns.size() > p.module_index ? module_fqns[p.module_index] : std::nullopt;
    module_desc = (mf ? (mf->empty() ? std::string("the root") : "'" + *mf + "'") : std::string("a module")) + " (" +
                  (m ? m->name() : module_type) + ", sharded with " + name() + ")";
  }
  TORCH_CHECK(false, "fully_shard: parameter '", p.fqn, "' of ", module_desc, " on rank ", mesh->get_rank(), " ",
              what, " outside the module's FSDP forward: the forward ",
              "did not go through FSDP, so it computed on this rank's shard (local shape ", describe_shape(p.sharded_data),
              " of ", c10::IntArrayRef(p.orig_size), ") and its result and gradient are wrong. Supported ways to call a ",
              "sharded module: through its fsdp::FSDPModule<Holder> holder as `module(x)` (not `module->forward(x)`, ",
              "which calls the module directly), from a parent's forward through an fsdp::FSDPModule<Holder> member (a ",
              "container such as torch::nn::Sequential calls its children directly: call the children through ",
              "FSDPModule holders in your own forward, or shard the container and its children as one group), not ",
              "through `as<>()`; other entry points through fsdp::fsdp_forward(module, fn)");
}

std::vector<torch::Tensor> pre_forward(FSDPState& state, std::vector<torch::Tensor> inputs) {
  return state.pre_forward(std::move(inputs));
}

std::vector<torch::Tensor> post_forward(FSDPState& state, std::vector<torch::Tensor> outputs) {
  return state.post_forward(std::move(outputs));
}

void forward_failed(FSDPState& state, std::exception_ptr error) {
  // Leave the module consistent: sharded, idle (the next forward gathers again).
  state.training_state = TrainingState::IDLE;
  try {
    if (state.group) state.group->reshard();
  } catch (...) {
    // keep the original error
  }
  if (!state.is_root()) std::rethrow_exception(error);
  std::string what;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    throw;
  }
  if (what.rfind("fully_shard: ", 0) == 0) std::rethrow_exception(error);  // already explained
  // A sharded module whose forward cannot go through FSDP and that did not run: it was most likely
  // called directly on its sharded parameters.
  std::ostringstream hint;
  int found = 0;
  for (FSDPState* s : state.ctx->states) {
    if (s == &state || !s->group || s->ran_forward || s->group->params().empty()) continue;
    auto m = s->modules[0].lock();
    if (!m || is_marked(*m)) continue;
    const auto& p = s->group->params()[0];
    hint << (found++ ? "; " : "") << s->name() << " (e.g. '" << p.fqn << "' holds local shape "
         << describe_shape(p.sharded_data) << " of " << c10::IntArrayRef(p.orig_size) << " on rank "
         << s->mesh->get_rank() << ")";
  }
  if (found == 0) std::rethrow_exception(error);
  TORCH_CHECK(false, "fully_shard: the forward of ", hint.str(), " did not go through FSDP, so it ran on sharded ",
              "parameters. Fix: declare the module as fsdp::FSDPModule<Holder> instead of Holder (the one-line change), ",
              "or call other entry points through fsdp::fsdp_forward(module, fn). Original error: ", what);
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------------
void mark_fsdp_forward(const torch::nn::Module& module) {
  auto& r = detail::registry();
  std::weak_ptr<torch::nn::Module> weak;
  try {
    weak = const_cast<torch::nn::Module&>(module).shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    return;  // not owned by a shared_ptr: cannot be tracked
  }
  std::lock_guard<std::mutex> lock(r.mu);
  r.fsdp_forward[&module] = weak;
}

FSDPModuleAPI fsdp_api(const torch::nn::Module& module) {
  auto s = detail::state_of(module);
  TORCH_CHECK(s, "fsdp: module ", module.name(), " is not sharded: call fsdp::fully_shard on it first");
  return FSDPModuleAPI(s);
}

UnshardHandle FSDPModuleAPI::unshard(bool async_op) {
  if (!state_->group) return UnshardHandle();
  state_->group->unshard(/*async_op=*/true);
  auto s = state_;
  UnshardHandle handle([s] { s->group->wait_for_unshard(); });
  if (!async_op) handle.wait();
  return handle;
}

void FSDPModuleAPI::reshard() {
  if (state_->group) state_->group->reshard();
}

namespace {
// This state, and with `recurse` every state in its modules' trees.
std::vector<std::shared_ptr<detail::FSDPState>> states_under(const std::shared_ptr<detail::FSDPState>& s,
                                                             bool recurse) {
  std::vector<std::shared_ptr<detail::FSDPState>> out{s};
  if (!recurse) return out;
  std::unordered_set<detail::FSDPState*> seen{s.get()};
  for (auto& w : s->modules) {
    auto m = w.lock();
    if (!m) continue;
    for (const auto& sub : m->modules(/*include_self=*/false)) {
      auto t = detail::state_of(*sub);
      if (t && seen.insert(t.get()).second) out.push_back(t);
    }
  }
  return out;
}

std::vector<std::weak_ptr<detail::FSDPState>> to_states(const std::vector<std::shared_ptr<torch::nn::Module>>& ms,
                                                        const char* api) {
  std::vector<std::weak_ptr<detail::FSDPState>> out;
  for (const auto& m : ms) {
    TORCH_CHECK(m, api, ": got a null module");
    auto s = detail::state_of(*m);
    TORCH_CHECK(s, api, ": module ", m->name(), " is not sharded: call fsdp::fully_shard on it first");
    out.push_back(s);
  }
  return out;
}
}  // namespace

void FSDPModuleAPI::set_requires_gradient_sync(bool v, bool recurse) {
  for (auto& s : states_under(state_, recurse)) s->requires_gradient_sync = v;
}

void FSDPModuleAPI::set_reshard_after_backward(bool v, bool recurse) {
  for (auto& s : states_under(state_, recurse)) s->reshard_after_backward = v;
}

void FSDPModuleAPI::set_reshard_after_forward(ReshardAfterForward v, bool recurse) {
  for (auto& s : states_under(state_, recurse)) {
    TORCH_CHECK(!s->ctx || std::holds_alternative<bool>(v), "set_reshard_after_forward: an int value must be ",
                "set before the first forward");
    s->options.reshard_after_forward(v);
    if (s->ctx) s->reshard_after_forward_k = std::get<bool>(v) ? 1 : 0;
  }
}

void FSDPModuleAPI::set_is_last_backward(bool v) {
  for (auto& s : states_under(state_, true)) s->is_last_backward = v;
}

void FSDPModuleAPI::set_modules_to_forward_prefetch(const std::vector<std::shared_ptr<torch::nn::Module>>& m) {
  state_->forward_prefetch = to_states(m, "set_modules_to_forward_prefetch");
}

void FSDPModuleAPI::set_modules_to_backward_prefetch(const std::vector<std::shared_ptr<torch::nn::Module>>& m) {
  state_->backward_prefetch = to_states(m, "set_modules_to_backward_prefetch");
}

void FSDPModuleAPI::set_gradient_divide_factor(double factor) {
  TORCH_CHECK(factor > 0, "set_gradient_divide_factor: expected a positive factor, got ", factor);
  state_->gradient_divide_factor = factor;
}

DeviceMeshPtr FSDPModuleAPI::mesh() const { return state_->mesh; }

std::vector<std::pair<std::string, DTensor>> FSDPModuleAPI::sharded_parameters() const {
  std::vector<std::pair<std::string, DTensor>> out;
  if (!state_->group) return out;
  for (const auto& p : state_->group->params()) out.emplace_back(p.local_fqn, state_->group->sharded_dtensor(p));
  return out;
}

namespace {
// Modules whose parameters get sparse gradients, which a reduce-scatter of dense rows cannot take: refused
// at fully_shard, before anything is sharded, instead of failing deep in backward. (A custom module that
// asks for a sparse gradient through the functional form is caught when the gradient arrives.)
void check_dense_gradients(const torch::nn::Module& m, const std::string& path, const std::string& param, int rank) {
  bool sparse = false;
  if (const auto* e = m.as<torch::nn::EmbeddingImpl>()) sparse = e->options.sparse();
  if (const auto* e = m.as<torch::nn::EmbeddingBagImpl>()) sparse = e->options.sparse();
  TORCH_CHECK(!sparse, "fully_shard: module '", path, "' (", m.name(), ") on rank ", rank, " has sparse=true, so its ",
              "parameter '", param, "' would get sparse gradients, which FSDP cannot reduce-scatter (it shards dense ",
              "rows). Fix: construct it with sparse(false) (the default), or pass '", param, "' in ignored_params and ",
              "reduce its gradient yourself");
}
}  // namespace

std::vector<std::pair<std::string, DTensor>> FSDPModuleAPI::sharded_gradients() const {
  std::vector<std::pair<std::string, DTensor>> out;
  if (!state_->group) return out;
  for (const auto& p : state_->group->params()) {
    auto g = state_->group->sharded_grad(p);
    if (g.defined()) out.emplace_back(p.local_fqn, state_->group->sharded_dtensor(p, g));
  }
  return out;
}

std::optional<DTensor> sharded_grad(const torch::Tensor& param) {
  auto s = detail::state_of_param(param);
  TORCH_CHECK(s, "sharded_grad: the tensor (shape ", param.sizes(), ") is not a parameter managed by fully_shard");
  for (const auto& p : s->group->params()) {
    if (!p.param.is_same(param)) continue;
    auto g = s->group->sharded_grad(p);
    if (!g.defined()) return std::nullopt;
    return s->group->sharded_dtensor(p, g);
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------------
FSDPModuleAPI fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                          const FullyShardOptions& options) {
  TORCH_CHECK(!modules.empty(), "fully_shard: expected at least one module");
  for (const auto& m : modules) {
    TORCH_CHECK(m, "fully_shard: got a null module");
    TORCH_CHECK(!detail::state_of(*m), "fully_shard: module ", m->name(), " is already sharded");
  }
  auto mesh = options.mesh();
  if (!mesh) {
    auto world = default_process_group();
    mesh = init_device_mesh(world->device_type(), {world->size()}, {}, world);
  }
  TORCH_CHECK(mesh->ndim() == 1 || mesh->ndim() == 2, "fully_shard: expected a 1-D or 2-D DeviceMesh, got ",
              mesh->str());

  // Parameters owned by other states (param -> (state, its FSDPParam)).
  std::unordered_map<const c10::TensorImpl*, std::pair<std::shared_ptr<detail::FSDPState>, const detail::FSDPParam*>>
      managed;
  {
    auto& r = detail::registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.purge_locked();
    for (auto& [mod, entry] : r.by_module) {
      if (entry.module.expired() || !entry.state->group) continue;
      for (const auto& p : entry.state->group->params()) managed.emplace(p.param.unsafeGetTensorImpl(), std::make_pair(entry.state, &p));
    }
  }
  // Paths of the modules under the ones being sharded: errors name modules by path and type.
  std::unordered_map<const torch::nn::Module*, std::string> paths;
  for (size_t mi = 0; mi < modules.size(); ++mi) {
    const std::string prefix = modules.size() > 1 ? std::to_string(mi) + "." : "";
    for (const auto& item : modules[mi]->named_modules("", /*include_self=*/true)) {
      paths.emplace(item.value().get(), item.key().empty() && modules.size() == 1 ? "" : prefix + item.key());
    }
  }
  // "'emb.weight' of 'emb' (torch::nn::EmbeddingImpl)": the tied parameter in the other group.
  auto describe_managed = [&](const std::shared_ptr<detail::FSDPState>& other, const detail::FSDPParam& op) {
    std::ostringstream os;
    auto m = other->modules[op.module_index].lock();
    auto it = m ? paths.find(m.get()) : paths.end();
    if (it != paths.end()) {
      os << "'" << (it->second.empty() ? op.name_in_module : it->second + "." + op.name_in_module) << "' of '"
         << it->second << "' (" << (m ? m->name() : other->module_type) << "), sharded by an earlier fully_shard call";
    } else {
      os << "'" << op.name_in_module << "' of " << (m ? m->name() : other->module_type)
         << " (outside this module), sharded by an earlier fully_shard call";
    }
    return os.str();
  };
  auto describe_self = [&](size_t mi) {
    std::string what = modules.size() > 1 ? "module " + std::to_string(mi) + " of the fully_shard call (" : "the module passed to fully_shard (";
    return what + modules[mi]->name() + ")";
  };
  std::unordered_set<const c10::TensorImpl*> ignored;
  for (const auto& t : options.ignored_params()) ignored.insert(t.unsafeGetTensorImpl());

  std::vector<std::pair<std::string, torch::Tensor>> params;
  std::vector<std::pair<size_t, std::string>> origin;  // module index and name in that module, per param
  std::unordered_set<const c10::TensorImpl*> taken;
  const int rank = mesh->get_rank();
  for (size_t mi = 0; mi < modules.size(); ++mi) {
    std::string prefix = modules.size() > 1 ? std::to_string(mi) + "." : "";
    std::vector<std::string> sharded_subtrees;
    for (const auto& item : modules[mi]->named_modules("", /*include_self=*/true)) {
      const std::string& path = item.key();
      bool under = false;
      for (const auto& t : sharded_subtrees) under = under || path == t || path.rfind(t + ".", 0) == 0;
      if (under) continue;
      if (!path.empty() && detail::state_of(*item.value())) {
        sharded_subtrees.push_back(path);  // a sharded submodule manages its own subtree
        continue;
      }
      for (const auto& pp : item.value()->named_parameters(/*recurse=*/false)) {
        const auto* impl = pp.value().unsafeGetTensorImpl();
        std::string name = prefix + (path.empty() ? pp.key() : path + "." + pp.key());
        if (ignored.count(impl) || !taken.insert(impl).second) continue;  // ignored, or tied within the group
        auto it = managed.find(impl);
        TORCH_CHECK(it == managed.end(), "fully_shard: parameter '", (path.empty() ? pp.key() : path + "." + pp.key()),
                    "' of ", describe_self(mi), " on rank ", rank, " is the same tensor as ",
                    describe_managed(it->second.first, *it->second.second),
                    ": tied parameters must be sharded in one group. Fix: fully_shard({module_a, module_b}) together, "
                    "or leave both modules to their common parent's fully_shard");
        check_dense_gradients(*item.value(), prefix + path, name, rank);
        params.emplace_back(name, pp.value());
        origin.emplace_back(mi, path.empty() ? pp.key() : path + "." + pp.key());
      }
    }
  }

  auto state = std::make_shared<detail::FSDPState>(modules, options);
  state->mesh = mesh;
  detail::GroupOptions gopts;
  gopts.mesh = mesh;
  gopts.mp = options.mp_policy();
  gopts.offload = options.offload_policy().has_value();
  gopts.pin_memory = gopts.offload && options.offload_policy()->pin_memory();
  // Same initial weights on every rank (sync_module_states, or the FSDP_DEBUG check).
  detail::sync_before_sharding(params, modules, mesh, options, state->module_type);
  if (!params.empty()) state->group = std::make_unique<detail::FSDPParamGroup>(std::move(params), gopts, state->module_type);
  {
    auto& r = detail::registry();
    std::lock_guard<std::mutex> lock(r.mu);
    state->id = r.next_id++;
    r.by_id[state->id] = state;
    for (const auto& m : modules) r.by_module[m.get()] = {m, state};
  }
  if (state->group) {
    auto& ps = state->group->params();
    for (size_t i = 0; i < ps.size(); ++i) {
      ps[i].module_index = origin[i].first;
      ps[i].name_in_module = origin[i].second;
      if (!ps[i].param.requires_grad()) continue;
      // Every gradient that reaches the parameter must come from a use inside the group's FSDP
      // forward: a forward that bypassed FSDP computed on the shard (see check_grad_arrival). The hook
      // runs before AccumulateGrad, in every backward, for as long as the parameter lives.
      const int64_t sid = state->id;
      ps[i].param.register_hook([sid, i](const torch::Tensor& grad) {
        if (auto s = detail::state_by_id(sid)) {
          if (s->group && i < s->group->params().size()) s->check_grad_arrival(s->group->params()[i], grad);
        }
      });
    }
  }
  return FSDPModuleAPI(state);
}

FSDPModuleAPI fully_shard(const std::shared_ptr<torch::nn::Module>& module, const FullyShardOptions& options) {
  return fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{module}, options);
}

std::vector<std::string> fully_shard_tree(const std::shared_ptr<torch::nn::Module>& root,
                                          const AutoWrapPolicy& policy, const FullyShardOptions& options) {
  TORCH_CHECK(root, "fully_shard_tree: got a null root");
  std::vector<std::string> wrapped;
  std::vector<std::string> unreachable;
  std::vector<std::string> skipped;  // selected by min_num_params, but their forward cannot go through FSDP
  auto type_selected = [&](const torch::nn::Module& m) {
    // A type matches by its full name ("my::BlockImpl") or its unqualified name ("BlockImpl").
    const std::string type = m.name();
    const std::string short_type = type.substr(type.rfind(':') == std::string::npos ? 0 : type.rfind(':') + 1);
    return policy.module_types().count(type) > 0 || policy.module_types().count(short_type) > 0;
  };
  // Refuse before sharding anything: a failed call leaves the model untouched.
  for (const auto& item : root->named_modules("", /*include_self=*/false)) {
    if (type_selected(*item.value()) && !detail::state_of(*item.value()) && !detail::is_marked(*item.value())) {
      unreachable.push_back("'" + item.key() + "' (" + item.value()->name() + ")");
    }
  }
  TORCH_CHECK(unreachable.empty(), "fully_shard_tree: the policy selects ", c10::Join(", ", unreachable),
              ", whose forward cannot go through FSDP. Fix: declare each as fsdp::FSDPModule<Holder> instead of Holder");
  // Post-order: children before parents, the root last. Returns the parameter elements of the
  // subtree not yet wrapped.
  std::function<int64_t(const std::shared_ptr<torch::nn::Module>&, const std::string&)> visit =
      [&](const std::shared_ptr<torch::nn::Module>& m, const std::string& path) -> int64_t {
    int64_t unwrapped = 0;
    for (const auto& c : m->named_children()) {
      unwrapped += visit(c.value(), path.empty() ? c.key() : path + "." + c.key());
    }
    for (const auto& p : m->named_parameters(/*recurse=*/false)) unwrapped += p.value().numel();
    if (path.empty() || detail::state_of(*m)) return unwrapped;  // the root comes last; already sharded
    bool by_type = type_selected(*m);
    bool by_size = policy.min_num_params() > 0 && unwrapped >= policy.min_num_params();
    if (!by_type && !by_size) return unwrapped;
    if (!detail::is_marked(*m)) {
      // Selected by size only (a type-selected one was refused above): it stays in its parent's group.
      skipped.push_back("'" + path + "' (" + m->name() + ", " + std::to_string(unwrapped) + " parameter elements)");
      return unwrapped;
    }
    fully_shard(m, options);
    wrapped.push_back(path);
    return 0;
  };
  visit(root, "");
  if (!skipped.empty()) {
    TORCH_WARN("fully_shard_tree: min_num_params=", policy.min_num_params(), " selects ", c10::Join(", ", skipped),
               ", whose forward cannot go through FSDP; their parameters stay in the group of the nearest wrapped ",
               "ancestor (gathered with it, for its whole forward). Fix: declare each module to wrap as ",
               "fsdp::FSDPModule<Holder> instead of Holder, or raise min_num_params");
  }
  if (!detail::state_of(*root)) fully_shard(root, options);
  wrapped.push_back("");
  return wrapped;
}

}  // namespace fsdp
