// The registry of FSDP states: module -> state, state id -> state, the modules whose forward goes
// through a holder, and the lookups built on it (managed parameters, the state of a parameter).
#include <algorithm>
#include <mutex>
#include <unordered_map>

#include "fsdp/fsdp_state.h"

namespace fsdp::detail {
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
  std::unordered_map<const Module*, std::weak_ptr<Module>> fsdp_forward;  // mark_fsdp_forward (custom holders)
  struct Held {
    std::weak_ptr<Module> module;
    int holders = 0;  // live FSDPModule holders (copies share one)
  };
  std::unordered_map<const Module*, Held> held;
  // Modules checkpoint_wrapper was applied to (held weakly: a new module at a freed one's address is not marked).
  std::unordered_map<const Module*, std::pair<std::weak_ptr<Module>, CheckpointOptions>> checkpointed;
  // Modules offload_wrapper was applied to (weakly, as checkpointed).
  std::unordered_map<const Module*, std::weak_ptr<Module>> offloaded;
  int64_t next_id = 1;

  void purge_locked() {
    for (auto it = by_module.begin(); it != by_module.end();) {
      it = it->second.module.expired() ? by_module.erase(it) : std::next(it);
    }
    for (auto it = by_id.begin(); it != by_id.end();) it = it->second.expired() ? by_id.erase(it) : std::next(it);
    for (auto it = fsdp_forward.begin(); it != fsdp_forward.end();) {
      it = it->second.expired() ? fsdp_forward.erase(it) : std::next(it);
    }
    for (auto it = held.begin(); it != held.end();) it = it->second.module.expired() ? held.erase(it) : std::next(it);
    for (auto it = checkpointed.begin(); it != checkpointed.end();) {
      it = it->second.first.expired() ? checkpointed.erase(it) : std::next(it);
    }
    for (auto it = offloaded.begin(); it != offloaded.end();) {
      it = it->second.expired() ? offloaded.erase(it) : std::next(it);
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

}  // namespace

bool is_marked(const Module& m) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.fsdp_forward.find(&m);
  if (it != r.fsdp_forward.end() && !it->second.expired()) return true;
  auto h = r.held.find(&m);
  return h != r.held.end() && h->second.holders > 0 && !h->second.module.expired();
}

namespace {
// A holder made after fully_shard: the group takes the holder path once every module has one (and
// before its first forward; afterwards both mechanisms run, which gives the same numbers).
void maybe_leave_implicit(const Module& module) {
  auto s = state_of(module);
  if (s && s->implicit && std::all_of(s->modules.begin(), s->modules.end(), [](const auto& w) {
        auto m = w.lock();
        return m && is_marked(*m);
      })) {
    s->disable_interception();
  }
}
}  // namespace

std::shared_ptr<void> hold_fsdp_forward(const Module& module) {
  auto& r = registry();
  std::weak_ptr<Module> weak;
  try {
    weak = const_cast<Module&>(module).shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    return nullptr;  // not owned by a shared_ptr: cannot be tracked
  }
  {
    std::lock_guard<std::mutex> lock(r.mu);
    auto& h = r.held[&module];
    if (h.module.expired() || h.module.lock().get() != &module) h = Registry::Held{weak, 0};
    ++h.holders;
  }
  maybe_leave_implicit(module);
  const Module* key = &module;
  return std::shared_ptr<void>(nullptr, [key, weak](void*) {
    auto& reg = registry();
    std::lock_guard<std::mutex> lock(reg.mu);
    auto it = reg.held.find(key);
    if (it != reg.held.end() && it->second.module.lock() == weak.lock() && it->second.holders > 0) --it->second.holders;
  });
}

void mark_module(const Module& module) {
  auto& r = registry();
  std::weak_ptr<Module> weak;
  try {
    weak = const_cast<Module&>(module).shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    return;  // not owned by a shared_ptr: cannot be tracked
  }
  {
    std::lock_guard<std::mutex> lock(r.mu);
    r.fsdp_forward[&module] = weak;
  }
  maybe_leave_implicit(module);
}

void register_state(const std::shared_ptr<FSDPState>& state, const std::vector<std::shared_ptr<Module>>& modules) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  state->id = r.next_id++;
  r.by_id[state->id] = state;
  for (const auto& m : modules) r.by_module[m.get()] = {m, state};
}

ManagedParamMap managed_params(bool forget_destroyed) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (forget_destroyed) r.purge_locked();
  ManagedParamMap managed;
  for (auto& [mod, entry] : r.by_module) {
    if (entry.module.expired() || !entry.state->group) continue;
    for (const auto& p : entry.state->group->params()) managed.emplace(p.param.unsafeGetTensorImpl(), std::make_pair(entry.state, &p));
  }
  return managed;
}

std::shared_ptr<FSDPState> state_of(const Module& module) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_module.find(&module);
  if (it == r.by_module.end() || it->second.module.expired()) return nullptr;
  return it->second.state;
}

void mark_checkpointed(const std::shared_ptr<torch::nn::Module>& module, const CheckpointOptions& options) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.purge_locked();
  r.checkpointed[module.get()] = {module, options};
}

std::optional<CheckpointOptions> checkpoint_options(const torch::nn::Module& module) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.checkpointed.find(&module);
  if (it == r.checkpointed.end() || it->second.first.expired()) return std::nullopt;
  return it->second.second;
}

void mark_offloaded(const std::shared_ptr<torch::nn::Module>& module) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.purge_locked();
  r.offloaded[module.get()] = module;
}

bool is_offloaded(const torch::nn::Module& module) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.offloaded.find(&module);
  return it != r.offloaded.end() && !it->second.expired();
}

std::shared_ptr<FSDPState> state_by_id(int64_t id) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_id.find(id);
  return it == r.by_id.end() ? nullptr : it->second.lock();
}

std::vector<std::shared_ptr<FSDPState>> live_states() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::shared_ptr<FSDPState>> out;
  for (auto& [id, w] : r.by_id) {
    if (auto s = w.lock()) out.push_back(std::move(s));
  }
  return out;
}

std::unordered_map<const c10::TensorImpl*, std::shared_ptr<FSDPState>> param_owners() {
  std::unordered_map<const c10::TensorImpl*, std::shared_ptr<FSDPState>> owners;
  for (auto& [impl, owner] : managed_params()) owners.emplace(impl, owner.first);
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

}  // namespace fsdp::detail
