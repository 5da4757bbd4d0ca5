// fsdp::estimate_memory: see include/fsdp/memory_estimate.h for the model it follows.
#include "fsdp/memory_estimate.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>
#include <unordered_set>

namespace fsdp {
namespace {

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// Rows and elements per row as FSDPParam chunks them: dim 0 (a 0-dim parameter is one row).
int64_t dim0(const ParamInfo& p) { return p.shape.empty() ? 1 : p.shape[0]; }
int64_t row_numel(const ParamInfo& p) {
  int64_t n = 1;
  for (size_t d = 1; d < p.shape.size(); ++d) n *= p.shape[d];
  return n;
}

}  // namespace

std::vector<ParamInfo> param_infos(const torch::nn::Module& module) {
  std::vector<ParamInfo> out;
  std::unordered_set<const void*> seen;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    const auto& t = p.value();
    if (!seen.insert(t.unsafeGetTensorImpl()).second) continue;  // tied: once, under its first name
    out.push_back(ParamInfo{p.key(), t.sizes().vec(), t.scalar_type(), t.requires_grad()});
  }
  return out;
}

std::vector<ShardGroupInfo> shard_groups(const torch::nn::Module& module, const std::vector<std::string>& sharded_modules) {
  std::map<std::string, std::shared_ptr<torch::nn::Module>> by_path;
  for (const auto& m : module.named_modules(/*name_prefix=*/"", /*include_self=*/false)) by_path[m.key()] = m.value();
  std::set<std::string> sharded(sharded_modules.begin(), sharded_modules.end());
  // Which sharded module owns a parameter: the deepest sharded path that is a prefix of its FQN.
  auto owner = [&](const std::string& fqn) -> std::string {
    std::string best;
    bool found = sharded.count("") > 0;
    for (const auto& s : sharded) {
      if (s.empty()) continue;
      if (fqn.size() > s.size() && fqn.compare(0, s.size(), s) == 0 && fqn[s.size()] == '.' &&
          (!found || s.size() > best.size())) {
        best = s;
        found = true;
      }
    }
    return found ? best : std::string("\x01");  // not sharded
  };
  for (const auto& s : sharded_modules) {
    TORCH_CHECK(s.empty() || by_path.count(s), "estimate_memory: shard_groups: module path '", s,
                "' is not a submodule of the model (named_modules() has no such path). Fix: pass paths as ",
                "named_modules() spells them (e.g. \"h.0\"), or \"\" for the root");
  }
  std::vector<ShardGroupInfo> groups;
  std::map<std::string, size_t> index;
  for (const auto& s : sharded_modules) {
    if (index.count(s)) continue;
    index[s] = groups.size();
    groups.push_back(ShardGroupInfo{s, {}, std::nullopt});
  }
  for (const auto& p : param_infos(module)) {
    auto o = owner(p.fqn);
    if (o != "\x01") groups[index[o]].fqns.push_back(p.fqn);
  }
  return groups;
}

MemoryEstimate estimate_memory(const std::vector<ParamInfo>& params, const std::vector<ShardGroupInfo>& groups,
                               const MemoryEstimateOptions& o) {
  TORCH_CHECK(o.world_size >= 1, "estimate_memory: world_size must be >= 1 (the shard group's size), got ",
              o.world_size, ". Fix: pass the number of ranks that shard each parameter (e.g. WORLD_SIZE)");
  TORCH_CHECK(o.activation_bytes >= 0 && o.runtime_overhead_bytes >= 0 && o.optimizer_bytes_per_element >= 0,
              "estimate_memory: activation_bytes (", o.activation_bytes, "), runtime_overhead_bytes (",
              o.runtime_overhead_bytes, ") and optimizer_bytes_per_element (", o.optimizer_bytes_per_element,
              ") must be >= 0");
  const int64_t N = o.world_size;
  std::map<std::string, const ParamInfo*> by_fqn;
  for (const auto& p : params) {
    TORCH_CHECK(by_fqn.emplace(p.fqn, &p).second, "estimate_memory: parameter '", p.fqn,
                "' is listed twice in params. Fix: list each parameter once (a tied weight under one name)");
    for (auto d : p.shape) {
      TORCH_CHECK(d >= 0, "estimate_memory: parameter '", p.fqn, "' has a negative dimension in its shape ",
                  c10::IntArrayRef(p.shape));
    }
  }
  std::set<std::string> grouped;
  for (const auto& g : groups) {
    for (const auto& f : g.fqns) {
      TORCH_CHECK(by_fqn.count(f), "estimate_memory: group '", g.name, "' names parameter '", f,
                  "', which is not in params. Fix: use the FQNs of param_infos(model) (before fully_shard)");
      TORCH_CHECK(grouped.insert(f).second, "estimate_memory: parameter '", f, "' is in more than one group (",
                  "again in '", g.name, "'); fully_shard manages each parameter in exactly one group");
    }
  }
  auto elem = [](torch::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); };
  auto compute_dtype = [&](const ParamInfo& p) {
    return (o.param_dtype && at::isFloatingType(p.dtype)) ? *o.param_dtype : p.dtype;
  };

  MemoryEstimate e;
  int64_t largest_trainable_shard = 0;  // elements, for the optimizer's temporaries
  // Model states: shards of grouped parameters (rank 0 holds ceil(dim0/N) rows of each), full replicas
  // of the others.
  for (const auto& p : params) {
    const bool sharded = grouped.count(p.fqn) > 0;
    const int64_t rows = sharded ? (dim0(p) + N - 1) / N : dim0(p);
    const int64_t shard = rows * row_numel(p);
    e.num_params += numel_of(p.shape);
    e.sharded_params += shard * elem(p.dtype);
    if (sharded) e.padding += (rows * N - dim0(p)) * row_numel(p) * elem(p.dtype);
    if (p.requires_grad) {
      e.grads += shard * elem(p.dtype);
      e.optimizer_state += static_cast<int64_t>(static_cast<double>(shard) * o.optimizer_bytes_per_element);
      largest_trainable_shard = std::max(largest_trainable_shard, shard);
    }
  }

  // Per group: unsharded size (all-gather buffer = unsharded padded params, param_dtype), full-size
  // gradient (compute dtype, unpadded), reduce-scatter input [N, M + P] and output [M + P].
  struct G {
    int64_t unsharded = 0, grad = 0, rs = 0, shard_grad = 0;
    bool reshard = true;
  };
  std::vector<G> gs;
  int64_t largest = -1;
  for (const auto& g : groups) {
    G x;
    x.reshard = g.reshard_after_forward.value_or(o.reshard_after_forward);
    int64_t m = 0, np = 0;
    torch::ScalarType reduce = torch::kFloat32;
    bool any_trainable = false;
    for (const auto& f : g.fqns) {
      const auto& p = *by_fqn.at(f);
      const int64_t padded_shard = (dim0(p) + N - 1) / N * row_numel(p);
      x.unsharded += N * padded_shard * elem(compute_dtype(p));
      if (p.requires_grad) {
        x.grad += numel_of(p.shape) * elem(compute_dtype(p));
        x.shard_grad += padded_shard * elem(p.dtype);
        m += padded_shard;
        ++np;
        if (!any_trainable) reduce = o.reduce_dtype.value_or(compute_dtype(p));
        any_trainable = true;
      }
    }
    if (any_trainable) x.rs = (N + 1) * (m + np) * elem(reduce);
    if (x.unsharded > largest) {
      largest = x.unsharded;
      e.largest_group = g.name;
    }
    gs.push_back(x);
  }

  // Unsharded parameters alive at once: walk the forward (groups in order) and the backward (reverse).
  // A group's copy-out holds its all-gather buffer and its unsharded parameters (2x); the next group's
  // prefetched all-gather buffer sits beside the current group's parameters; groups that do not reshard
  // after forward stay until their backward ends.
  int64_t kept = 0, peak_u = 0;
  const size_t n = gs.size();
  for (size_t i = 0; i < n; ++i) {
    peak_u = std::max(peak_u, kept + 2 * gs[i].unsharded);
    if (i + 1 < n) peak_u = std::max(peak_u, kept + gs[i].unsharded + gs[i + 1].unsharded);
    if (!gs[i].reshard) kept += gs[i].unsharded;
  }
  for (size_t k = n; k-- > 0;) {
    const int64_t others = kept - (gs[k].reshard ? 0 : gs[k].unsharded);
    if (gs[k].reshard) peak_u = std::max(peak_u, others + 2 * gs[k].unsharded);
    if (k > 0 && gs[k - 1].reshard) peak_u = std::max(peak_u, kept + (gs[k].reshard ? gs[k].unsharded : 0) + gs[k - 1].unsharded);
    if (!gs[k].reshard) kept -= gs[k].unsharded;
  }
  e.unsharded_params = peak_u;
  // Full-size gradients: the root's (the first group: first to get gradients, last to reduce) for the
  // whole backward, plus the largest other group's.
  int64_t other_grad = 0, rs = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) other_grad = std::max(other_grad, gs[i].grad);
    rs = std::max(rs, gs[i].rs);
  }
  e.unsharded_grads = (n > 0 ? gs[0].grad : 0) + other_grad;
  e.reduce_scatter = rs;
  e.activations = o.activation_bytes;
  e.runtime_overhead = o.runtime_overhead_bytes;

  const bool host_states = o.cpu_offload && !o.device_is_cpu;
  const int64_t states_on_device_params = host_states ? 0 : e.sharded_params;
  const int64_t states_on_device_grads = host_states ? 0 : e.grads;
  const int64_t states_on_device_opt = host_states ? 0 : e.optimizer_state;
  if (o.cpu_offload) e.offloaded_host = e.sharded_params + e.grads + e.optimizer_state;
  // The backward, group by group (reverse forward order): at group k's backward the activations of the
  // groups before it are still saved (the caller's total, spread evenly over the groups), the sharded
  // gradients of the groups after it are back (zero_grad set them to none), the groups that kept their
  // parameters are unsharded, k is gathered (its copy-out, or k beside the prefetched k - 1), the root's
  // and k's full-size gradients and k's reduce-scatter are alive. At the first group all activations and
  // no gradients; at the last (the root) gradients of everything and few activations: which one peaks
  // depends on the model (activation- or parameter-dominated).
  int64_t grouped_grads = 0;
  for (const auto& g : gs) grouped_grads += g.shard_grad;
  const int64_t ungrouped_grads = e.grads - grouped_grads;  // replicated parameters: present all along
  int64_t kept_all = 0;
  for (const auto& g : gs) kept_all += g.reshard ? 0 : g.unsharded;
  int64_t grads_done = 0, kept_b = kept_all;
  e.peak_backward = 0;
  for (size_t k = n; k-- > 0;) {
    int64_t unsharded = kept_b;
    if (gs[k].reshard) {
      unsharded = std::max(kept_b + 2 * gs[k].unsharded,
                           kept_b + gs[k].unsharded + ((k > 0 && gs[k - 1].reshard) ? gs[k - 1].unsharded : 0));
    }
    const int64_t acts = n > 0 ? e.activations * static_cast<int64_t>(k + 1) / static_cast<int64_t>(n) : e.activations;
    const int64_t grads_now = o.grads_set_to_none ? grads_done + ungrouped_grads : e.grads;
    const int64_t full_grads = gs[0].grad + (k > 0 ? gs[k].grad : 0);
    const int64_t at_k = states_on_device_params + states_on_device_opt + (host_states ? 0 : grads_now) + acts +
                         unsharded + full_grads + gs[k].rs;
    e.peak_backward = std::max(e.peak_backward, at_k);
    grads_done += gs[k].shard_grad;
    if (!gs[k].reshard) kept_b -= gs[k].unsharded;
  }
  if (n == 0) {
    e.peak_backward = states_on_device_params + states_on_device_opt +
                      (o.grads_set_to_none ? 0 : states_on_device_grads) + e.activations;
  }
  // AdamW's step: a few shard-sized fp32 temporaries of the parameter being updated.
  e.peak_optimizer_step = states_on_device_params + states_on_device_grads + states_on_device_opt +
                          (states_on_device_opt > 0 ? 3 * largest_trainable_shard * 4 : 0);
  e.total_peak = std::max(e.peak_backward, e.peak_optimizer_step) + e.runtime_overhead;
  return e;
}

std::string format_memory_estimate(const MemoryEstimate& e) {
  std::ostringstream os;
  auto row = [&](const char* name, int64_t bytes, const char* what) {
    char buf[160];
    std::snprintf(buf, sizeof(buf), "  %-20s %10.1f MiB  %s\n", name, static_cast<double>(bytes) / (1 << 20), what);
    os << buf;
  };
  row("sharded params", e.sharded_params, "padded shards, own dtype");
  row("grads", e.grads, "sharded gradients, own dtype");
  row("optimizer state", e.optimizer_state, "per shard element");
  row("unsharded params", e.unsharded_params, ("groups alive at once, param dtype (largest: '" + e.largest_group + "')").c_str());
  row("unsharded grads", e.unsharded_grads, "full-size gradients before reduce-scatter");
  row("reduce-scatter", e.reduce_scatter, "largest group's input + output, reduce dtype");
  row("activations", e.activations, "caller's estimate");
  row("runtime overhead", e.runtime_overhead, "caller's estimate");
  if (e.offloaded_host > 0) row("offloaded (host)", e.offloaded_host, "params + grads + optimizer on the host");
  row("peak (backward)", e.peak_backward, "its largest moment, group by group (see memory_estimate.h)");
  row("peak (optim step)", e.peak_optimizer_step, "params + grads + optimizer + temporaries");
  row("total peak", e.total_peak, "max of the two + runtime overhead");
  row("(padding)", e.padding, "of sharded params");
  return os.str();
}

}  // namespace fsdp
