// fully_shard: the public API (fully_shard, fully_shard_tree, FSDPModuleAPI). The machinery behind it:
// fsdp_init (managed parameters and their checks), fsdp_state (registry and hooks), fsdp_param_group and
// fsdp_param (sharding), fsdp_collectives (the collectives' packing).
// Mirrors torch.distributed.fsdp._fully_shard._fully_shard (fully_shard, FSDPModule).
#include "fsdp/fsdp/fully_shard.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "c10d/process_group_access.h"
#include "fsdp/consistency.h"
#include "fsdp/fsdp_init.h"
#include "fsdp/fsdp_interception.h"
#include "fsdp/fsdp_state.h"
#include "tensor/parallel/tp_ops.h"

namespace fsdp {
// ---------------------------------------------------------------------------------------------------
void mark_fsdp_forward(const torch::nn::Module& module) { detail::mark_module(module); }

detail::FSDPState& detail::fsdp_state(const FSDPModuleAPI& api) { return *api.state_; }

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
  // An unchanged model's evaluation forward has no end that FSDP sees (no backward follows): the root's
  // reshard() ends it, so that reads after it are reads between steps again ([Note: reads of a sharded
  // parameter], fsdp_interception.cpp).
  auto& ctx = state_->ctx;
  if (state_->implicit && state_->is_root() && ctx->forward_open && !ctx->in_backward) ctx->close_forward(nullptr);
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
  // As in PyTorch, also whether HSDP all-reduces (set_requires_all_reduce): a sync after a no-sync
  // microbatch must reduce fully, whatever an earlier set_requires_all_reduce(false) said.
  for (auto& s : states_under(state_, recurse)) {
    s->requires_gradient_sync = v;
    if (s->group) s->group->set_requires_all_reduce(v);
  }
}

void FSDPModuleAPI::set_reshard_after_backward(bool v, bool recurse) {
  for (auto& s : states_under(state_, recurse)) s->reshard_after_backward = v;
}

void FSDPModuleAPI::set_requires_all_reduce(bool v, bool recurse) {
  for (auto& s : states_under(state_, recurse)) {
    if (s->group) s->group->set_requires_all_reduce(v);
  }
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

// ---- Communication settings (FSDPModule.set_custom_all_gather ... set_symm_mem_for_comm) ----

void FSDPModuleAPI::set_custom_all_gather(std::shared_ptr<AllGather> comm) {
  if (!state_->group) return;  // no parameter, no all-gather
  TORCH_CHECK(!comm || !state_->group->allocate_from_process_group, "set_custom_all_gather: ", state_->name(),
              " allocates its buffers from the process group (set_allocate_memory_from_process_group_for_comm); ",
              "turn that off first: a custom AllGather allocates its own");
  state_->group->custom_all_gather = std::move(comm);
}

void FSDPModuleAPI::set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> comm) {
  if (!state_->group) return;
  TORCH_CHECK(!comm || !state_->group->allocate_from_process_group, "set_custom_reduce_scatter: ", state_->name(),
              " allocates its buffers from the process group (set_allocate_memory_from_process_group_for_comm); ",
              "turn that off first: a custom ReduceScatter allocates its own");
  state_->group->custom_reduce_scatter = std::move(comm);
}

void FSDPModuleAPI::set_all_reduce_hook(std::function<void(const torch::Tensor&)> hook,
                                        std::optional<c10::Stream> stream) {
  TORCH_CHECK(!stream || stream->device_type() == state_->mesh->device_type(), "set_all_reduce_hook: ",
              state_->name(), " runs on ", state_->mesh->device(), " but the hook's stream is on ", stream->device(),
              "; pass a stream of the module's device (or none: the reduce-scatter stream)");
  if (!state_->group) return;
  state_->group->all_reduce_hook_stream = hook ? stream : std::nullopt;
  state_->group->all_reduce_hook = std::move(hook);
}

void FSDPModuleAPI::set_post_optim_event(std::shared_ptr<c10::Event> event) {
  TORCH_CHECK(!state_->ctx || state_->is_root(), "set_post_optim_event: ", state_->name(),
              " is not the root; set it on the root (the module whose forward begins the step)");
  state_->post_optim_event = std::move(event);
}

void FSDPModuleAPI::set_force_sum_reduction_for_comms(bool) {
  // Always SUM then divide (see fully_shard.h): nothing to change.
}

void FSDPModuleAPI::set_reduce_scatter_unused_params(bool, bool) {
  // Unused parameters always take part (see fully_shard.h): nothing to change.
}

void FSDPModuleAPI::set_reduce_scatter_max_input_buffers(int max_input_buffers, bool) {
  TORCH_CHECK(max_input_buffers >= 1, "set_reduce_scatter_max_input_buffers: expected a positive count, got ",
              max_input_buffers);
}

void FSDPModuleAPI::set_separate_reduce_scatter_group(bool enable, bool recurse) {
  // One new group per distinct shard group, shared by the modules of this call (every rank of a shard
  // group visits the same states in the same order, so they create the groups alike).
  std::unordered_map<ProcessGroup*, ProcessGroupPtr> made;
  for (auto& s : states_under(state_, recurse)) {
    if (!s->group) continue;
    if (!enable) {
      s->group->set_reduce_scatter_group(nullptr);
      continue;
    }
    auto& shard = s->group->shard_group();
    auto& pg = made[&shard];
    if (!pg && shard.size() > 1) {
      std::vector<int> ranks(shard.size());
      for (int r = 0; r < shard.size(); ++r) ranks[r] = r;
      // A fresh name per group built (the same on every rank: they build in one order), so that groups
      // built again after set_separate_reduce_scatter_group(false) never share store keys.
      pg = new_group(s->group->shard_group_ptr(), ranks,
                     "reduce_scatter" + std::to_string(detail::ProcessGroupAccess::next_subgroup_id(shard)));
    }
    s->group->set_reduce_scatter_group(pg);
  }
}

void FSDPModuleAPI::set_unshard_in_backward(bool v) {
  auto& group = state_->group;
  if (!group) return;
  if (!state_->implicit && group->unshard_in_backward != v) {
    // A holder group's backward uses are not seen unless its unsharded data carry the interception key:
    // with it, a backward formula that reads a parameter gathers it on demand (fsdp_interception.cpp)
    // instead of reading the freed unsharded storage.
    TORCH_CHECK(group->sharded_state() == detail::ShardedState::SHARDED, "set_unshard_in_backward: ",
                state_->name(), " is unsharded now; call it between steps (after the backward, or before the ",
                "first forward)");
    // (A parameter keyed now gets its keyed unsharded tensor at its next unshard: FSDPParam::to_unsharded.)
    for (auto& p : group->params()) v ? p.disable_interception() : p.enable_interception();
  }
  group->unshard_in_backward = v;
}

void FSDPModuleAPI::set_allocate_memory_from_process_group_for_comm(bool enable) {
  if (!state_->group) return;
  TORCH_CHECK(!enable || (!state_->group->custom_all_gather && !state_->group->custom_reduce_scatter),
              "set_allocate_memory_from_process_group_for_comm: ", state_->name(), " has a custom all-gather or ",
              "reduce-scatter, which allocates its own buffers; remove it first (set_custom_all_gather(nullptr))");
  state_->group->allocate_from_process_group = enable;
}

void FSDPModuleAPI::set_symm_mem_for_comm(const std::string& backend) {
  TORCH_CHECK(false, "set_symm_mem_for_comm(\"", backend, "\"): refused for ", state_->name(),
              ": symmetric-memory all-gathers need torch's SymmetricMemory rendezvous (torch.distributed."
              "_symmetric_memory), which LibTorch does not offer to C++ callers. Use "
              "set_allocate_memory_from_process_group_for_comm(true) for NCCL's registered buffers instead");
}

void FSDPModuleAPI::reset_iter_state() { state_->reset_iter_state(); }

void share_comm_ctx(const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  std::vector<std::shared_ptr<detail::FSDPState>> states;
  for (const auto& m : modules) {
    TORCH_CHECK(m, "share_comm_ctx: got a null module");
    auto s = detail::state_of(*m);
    TORCH_CHECK(s, "share_comm_ctx: expected modules passed to fully_shard, but ", m->name(), " is not sharded");
    states.push_back(std::move(s));
  }
  // Every group checked before any changes (a refusal leaves every module as it was).
  std::vector<detail::FSDPParamGroup*> groups;
  for (auto& s : states) {
    for (auto& t : states_under(s, /*recurse=*/true)) {
      if (!t->group) continue;
      TORCH_CHECK(t->group->can_change_comm_context(), "share_comm_ctx: ", t->name(), " already ran a forward (its ",
                  "unsharded parameters live in its own context's buffers); call share_comm_ctx before the modules' ",
                  "first forward");
      TORCH_CHECK(groups.empty() || t->group->comm_context()->device() == groups.front()->comm_context()->device(),
                  "share_comm_ctx: ", t->name(), " runs on ", t->group->comm_context()->device(), " but the first ",
                  "module on ", groups.front()->comm_context()->device(), "; share contexts only within one device");
      if (std::find(groups.begin(), groups.end(), t->group.get()) == groups.end()) groups.push_back(t->group.get());
    }
  }
  if (groups.empty()) return;
  auto shared = groups.front()->comm_context();
  for (auto* g : groups) {
    if (g != groups.front()) g->set_comm_context(shared);
  }
}

DeviceMeshPtr FSDPModuleAPI::mesh() const { return state_->mesh; }

std::vector<std::pair<std::string, DTensor>> FSDPModuleAPI::sharded_parameters() const {
  std::vector<std::pair<std::string, DTensor>> out;
  if (!state_->group) return out;
  for (const auto& p : state_->group->params()) out.emplace_back(p.local_fqn, state_->group->sharded_dtensor(p));
  return out;
}

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

DTensor sharded_param(const torch::Tensor& param) {
  auto s = detail::state_of_param(param);
  TORCH_CHECK(s && s->group, "sharded_param: the tensor (shape ", param.sizes(),
              ") is not a parameter managed by fully_shard or replicate");
  for (const auto& p : s->group->params()) {
    if (p.param.is_same(param)) return s->group->sharded_dtensor(p);
  }
  TORCH_CHECK(false, "sharded_param: the tensor (shape ", param.sizes(), ") is not a parameter of its group");
}

// ---------------------------------------------------------------------------------------------------
FSDPModuleAPI fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                          const FullyShardOptions& options) {
  TORCH_CHECK(!modules.empty(), "fully_shard: expected at least one module");
  for (const auto& m : modules) {
    TORCH_CHECK(m, "fully_shard: got a null module");
    auto s = detail::state_of(*m);
    TORCH_CHECK(!s, "fully_shard: module ", m->name(), " is already ",
                s && s->replicated ? "managed by replicate; a module is either replicated or sharded (as in "
                                     "PyTorch). Fix: fully_shard its submodules, or replicate it alone"
                                   : "sharded");
  }
  // Implicit: no module of the call has an FSDPModule holder (see [Note: implicit groups]).
  const bool implicit = std::none_of(modules.begin(), modules.end(), [](const auto& m) { return detail::is_marked(*m); });
  for (const auto& m : modules) {
    TORCH_CHECK(!implicit || !detail::checkpoint_options(*m), "fully_shard: ", m->name(), " has checkpoint_wrapper applied, ",
                "but its forward does not go through an fsdp::FSDPModule holder, so nothing can re-run it in backward. ",
                "Fix: wrap its call in the model's forward, `x = fsdp::checkpoint([m](torch::Tensor t) { return ",
                "m->forward(t); }, x);`, or declare the module as fsdp::FSDPModule<Holder>");
  }
  auto mesh = detail::fully_shard_mesh(options);
  auto managed = detail::get_managed_params(modules, options, mesh->get_rank());
  tp::detail::check_fully_shard_over_tp(managed.params, mesh, mesh->get_rank());

  // Every shard carries the interception key ([Note: reads of a sharded parameter]).
  detail::ensure_interception_registered();
  // parallelize_module after fully_shard is refused (tensor_parallel.cpp, check_not_fully_sharded).
  tp::detail::set_fully_sharded_query([](const torch::Tensor& p) { return detail::state_of_param(p) != nullptr; });
  auto state = std::make_shared<detail::FSDPState>(modules, options);
  state->mesh = mesh;
  detail::GroupOptions gopts;
  gopts.mesh = mesh;
  gopts.mp = options.mp_policy();
  gopts.offload = options.offload_policy().has_value();
  gopts.pin_memory = gopts.offload && options.offload_policy()->pin_memory();
  gopts.extension_fn = options.all_gather_extension_fn();
  gopts.placement_fn = options.shard_placement_fn();
  // Same initial weights on every rank (sync_module_states, or the FSDP_DEBUG check).
  detail::sync_before_sharding(managed.params, modules, mesh, options, state->module_type);
  if (!managed.params.empty()) {
    state->group = std::make_unique<detail::FSDPParamGroup>(std::move(managed.params), gopts, state->module_type);
  }
  detail::move_buffers_to_device(modules, mesh->device());  // (after the last check: a refusal changes nothing)
  detail::register_state(state, modules);
  state->implicit = implicit;
  state->init_params(managed.origin);
  state->register_params();
  if (state->implicit) state->enable_interception();
  return FSDPModuleAPI(state);
}

FSDPModuleAPI fully_shard(const std::shared_ptr<torch::nn::Module>& module, const FullyShardOptions& options) {
  return fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{module}, options);
}

std::vector<std::string> fully_shard_tree(const std::shared_ptr<torch::nn::Module>& root,
                                          const AutoWrapPolicy& policy, const FullyShardOptions& options) {
  TORCH_CHECK(root, "fully_shard_tree: got a null root");
  std::vector<std::string> wrapped;
  auto type_selected = [&](const torch::nn::Module& m) {
    // A type matches by its full name ("my::BlockImpl") or its unqualified name ("BlockImpl").
    const std::string type = m.name();
    const std::string short_type = type.substr(type.rfind(':') == std::string::npos ? 0 : type.rfind(':') + 1);
    return policy.module_types().count(type) > 0 || policy.module_types().count(short_type) > 0;
  };
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
    fully_shard(m, options);  // a holder's module, or an implicit group (see [Note: implicit groups])
    wrapped.push_back(path);
    return 0;
  };
  visit(root, "");
  if (!detail::state_of(*root)) fully_shard(root, options);
  wrapped.push_back("");
  return wrapped;
}

}  // namespace fsdp