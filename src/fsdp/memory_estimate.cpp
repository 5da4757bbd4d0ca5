// fsdp::estimate_memory: see include/fsdp/fsdp/memory_estimate.h for the model it follows.
#include "fsdp/fsdp/memory_estimate.h"

#include <cstdlib>

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
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

namespace {

int64_t elem(torch::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }

// Checks the inputs; returns the parameters by FQN and the FQNs that are in a group.
std::pair<std::map<std::string, const ParamInfo*>, std::set<std::string>> check_inputs(
    const std::vector<ParamInfo>& params, const std::vector<ShardGroupInfo>& groups, const MemoryEstimateOptions& o) {
  TORCH_CHECK(o.world_size >= 1, "estimate_memory: world_size must be >= 1 (the shard group's size), got ",
              o.world_size, ". Fix: pass the number of ranks that shard each parameter (e.g. WORLD_SIZE)");
  TORCH_CHECK(o.activation_bytes >= 0 && o.runtime_overhead_bytes >= 0 && o.optimizer_bytes_per_element >= 0,
              "estimate_memory: activation_bytes (", o.activation_bytes, "), runtime_overhead_bytes (",
              o.runtime_overhead_bytes, ") and optimizer_bytes_per_element (", o.optimizer_bytes_per_element,
              ") must be >= 0");
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
  return {std::move(by_fqn), std::move(grouped)};
}

// Model states: shards of grouped parameters (rank 0 holds ceil(dim0/N) rows of each), full replicas
// of the others. Fills e's parameter, gradient and optimizer fields; returns the largest trainable shard
// (elements, for the optimizer's temporaries).
int64_t add_model_states(const std::vector<ParamInfo>& params, const std::set<std::string>& grouped,
                         const MemoryEstimateOptions& o, MemoryEstimate& e) {
  const int64_t N = o.world_size;
  int64_t largest_trainable_shard = 0;
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
  return largest_trainable_shard;
}

// Per group: unsharded size U (the all-gather buffer is as large: world_size padded shards in
// param_dtype), full-size gradient size (compute dtype, unpadded), reduce-scatter input [N, M + P] and
// output [M + P] (reduce dtype), and the sharded gradients the output becomes (the parameters' dtype).
struct GroupBytes {
  std::string name;
  int64_t unsharded = 0, grad = 0, rs_in = 0, rs_out = 0, shard_grad = 0;
  bool reshard = true, trainable = false;
  // The reduce-scatter reads the gradients where they are (no input, no copy-in; [Note: placed reduce-scatter]
  // in fsdp_collectives.cpp): one host's CPU ranks, gradients already in the reduce dtype, fp32 or bf16.
  bool rs_placed = false;
  // A placed all-gather reads the shards where they are (no input, no copy-in): parameters gathered in their
  // own dtype (no param_dtype cast).
  bool ag_from_shards = true;
};

std::vector<GroupBytes> group_bytes(const std::vector<ShardGroupInfo>& groups,
                                    const std::map<std::string, const ParamInfo*>& by_fqn,
                                    const MemoryEstimateOptions& o, MemoryEstimate& e) {
  const int64_t N = o.world_size;
  auto compute_dtype = [&](const ParamInfo& p) {
    return (o.param_dtype && at::isFloatingType(p.dtype)) ? *o.param_dtype : p.dtype;
  };
  std::vector<GroupBytes> gs;
  int64_t largest = -1;
  for (const auto& g : groups) {
    GroupBytes x;
    x.name = g.name;
    x.reshard = g.reshard_after_forward.value_or(o.reshard_after_forward);
    int64_t m = 0, np = 0;
    torch::ScalarType reduce = torch::kFloat32;
    for (const auto& f : g.fqns) {
      const auto& p = *by_fqn.at(f);
      const int64_t padded_shard = (dim0(p) + N - 1) / N * row_numel(p);
      if (compute_dtype(p) != p.dtype) x.ag_from_shards = false;
      x.unsharded += N * padded_shard * elem(compute_dtype(p));
      if (p.requires_grad) {
        x.grad += numel_of(p.shape) * elem(compute_dtype(p));
        x.shard_grad += padded_shard * elem(p.dtype);
        m += padded_shard;
        ++np;
        if (!x.trainable) reduce = o.reduce_dtype.value_or(compute_dtype(p));
        x.trainable = true;
      }
    }
    if (x.trainable) {
      x.rs_out = (m + np) * elem(reduce);
      x.rs_in = N * x.rs_out;
      x.rs_placed = o.device_is_cpu && o.cpu_shared_memory && N > 1 &&
                    (reduce == torch::kFloat32 || reduce == torch::kBFloat16);
      for (const auto& f : g.fqns) {
        const auto& p = *by_fqn.at(f);
        if (p.requires_grad && compute_dtype(p) != reduce) x.rs_placed = false;
      }
    }
    if (x.unsharded > largest) {
      largest = x.unsharded;
      e.largest_group = g.name;
    }
    gs.push_back(x);
  }
  return gs;
}

// The step as a sequence of moments (see the header): at each, what is alive besides the sharded
// parameters and optimizer state. The largest is the peak; its parts are the breakdown (in `e`).
struct StepWalk {
  const MemoryEstimateOptions& o;
  const std::vector<GroupBytes>& gs;
  MemoryEstimate& e;
  int64_t dev_params, dev_opt, grads_at_start, rs_held;
  bool host_states;
  // FSDP's CPU buffer pool: the most of its buffers alive at once, and the largest moment without them.
  int64_t pool_high_water = 0, others_peak = -1;
  std::string others_moment;

  void consider(int64_t unsharded, int64_t full_grads, int64_t rs, int64_t shard_grads, int64_t acts,
                const std::string& what) {
    const int64_t total = dev_params + dev_opt + shard_grads + unsharded + full_grads + rs + acts;
    const int64_t pooled = unsharded + rs + (shard_grads - grads_at_start);
    pool_high_water = std::max(pool_high_water, pooled);
    if (total - pooled > others_peak) {
      others_peak = total - pooled;
      others_moment = what;
    }
    if (total > e.peak_backward) {
      e.peak_backward = total;
      e.grads_at_peak = shard_grads;
      e.unsharded_params = unsharded;
      e.unsharded_grads = full_grads;
      e.reduce_scatter = rs;
      e.activations = acts;
      e.peak_moment = what;
    }
  }
  int64_t acts_of(size_t groups_saved) const {
    const size_t n = gs.size();
    return n == 0 ? o.activation_bytes : o.activation_bytes * static_cast<int64_t>(groups_saved) / static_cast<int64_t>(n);
  }
  std::string named(const char* what, size_t k) const {
    return std::string(what) + (gs[k].name.empty() ? std::string(" the root") : " '" + gs[k].name + "'");
  }
  // A reduce-scatter in flight: its output and rs_held input-sized buffers, or placed the gradients it reads
  // (counted with the full-size gradients).
  int64_t pending_bytes(size_t j) const { return gs[j].rs_out + (gs[j].rs_placed ? 0 : rs_held * gs[j].rs_in); }
  int64_t pending_grads(size_t j) const { return gs[j].rs_placed ? gs[j].grad : 0; }
  // Group j's unsharding: at its copy-out, what is alive beside its unsharded parameters: the all-gather
  // output, or placed straight into them ([Note: placed all-gather] in fsdp_collectives.cpp) this rank's
  // input, 1 / world_size of them, kept until the wait (none when the shards are read where they are: no
  // param_dtype cast). While it is in flight: its output, or placed its unsharded parameters and that input.
  // Every group is counted as placed with cpu_shared_memory: groups that take the copy-out path on one host
  // (an all-gather extension, mixed dtypes, Shard(d > 0), a custom AllGather, debug mode) are undercounted by
  // (1 - 1 / world_size) x their unsharded size at their copy-out, and a post-forward gather over k ranks
  // keeps an input of 1 / k, not 1 / world_size. Likewise every group whose gradients are in an fp32 or bf16
  // reduce dtype counts its reduce-scatter as placed (rs_placed): one with Shard(d > 0), a custom
  // ReduceScatter, debug mode or FSDP_GLOO_REDUCE_SCATTER=allreduce keeps the input and copy-in (undercounted by
  // its input at the copy-in), and so does one whose reduction FSDP divides first (fp16).
  bool placed() const { return o.device_is_cpu && o.cpu_shared_memory && o.world_size > 1; }
  int64_t placed_input(size_t j) const { return gs[j].ag_from_shards ? 0 : gs[j].unsharded / o.world_size; }
  int64_t copy_out_extra(size_t j) const { return placed() ? placed_input(j) : gs[j].unsharded; }
  int64_t in_flight(size_t j) const { return gs[j].unsharded + (placed() ? placed_input(j) : 0); }

  // Forward: a group's copy-out holds its all-gather buffer and its unsharded parameters; then the next
  // group's all-gather (prefetch) runs beside them. Groups that do not reshard after forward stay.
  // Returns the bytes of the groups kept unsharded.
  int64_t forward() {
    const size_t n = gs.size();
    consider(0, 0, 0, grads_at_start, n == 0 ? o.activation_bytes : 0, n == 0 ? "backward (no group)" : "start of the step");
    int64_t kept = 0;
    for (size_t k = 0; k < n; ++k) {
      consider(kept + gs[k].unsharded + copy_out_extra(k), 0, 0, grads_at_start, acts_of(k),
               named("forward all-gather copy-out of", k));
      if (k + 1 < n) {
        consider(kept + gs[k].unsharded + in_flight(k + 1), 0, 0, grads_at_start, acts_of(k + 1),
                 named("forward with the next all-gather in flight,", k));
      }
      if (!gs[k].reshard) kept += gs[k].unsharded;
    }
    return kept;
  }

  // Backward, groups in reverse. The root's (first) group gets gradients from the first op of the
  // backward to the last: its full-size gradients are counted throughout. A group's reduce-scatter is
  // issued by its post-backward and finished at the next group's ([Note: one reduce-scatter in flight]):
  // until then its output and rs_held input-sized buffers stay. While it is issued the input exists in
  // any case.
  void backward(int64_t kept) {
    std::optional<size_t> pending;
    int64_t done = grads_at_start;  // sharded gradients copied out so far
    for (size_t k = gs.size(); k-- > 0;) {
      const int64_t prev = pending ? pending_bytes(*pending) : 0;
      const int64_t prev_grads = pending ? pending_grads(*pending) : 0;
      const int64_t next_ag = (k > 0 && gs[k - 1].reshard) ? in_flight(k - 1) : 0;  // backward prefetch
      const int64_t root_grads = (k > 0 ? gs[0].grad : 0) + prev_grads;
      int64_t cur = 0;
      if (gs[k].reshard) {
        consider(kept + gs[k].unsharded + copy_out_extra(k), root_grads, prev, done, acts_of(k + 1),
                 named("backward all-gather copy-out of", k));
        cur = gs[k].unsharded;
      }
      consider(kept + cur + next_ag, root_grads + gs[k].grad, prev, done, acts_of(k + 1), named("end of the backward of", k));
      if (!gs[k].reshard) kept -= gs[k].unsharded;  // the post-backward reshards before it reduces
      if (!gs[k].trainable) continue;
      if (gs[k].rs_placed) {
        // No input: the output beside the gradients, which the reduce-scatter holds until its wait.
        consider(kept + next_ag, root_grads + gs[k].grad, gs[k].rs_out + prev, done, acts_of(k),
                 named("reduce-scatter of", k));
      } else {
        // Copy-in: the zero-filled input beside the full-size gradients, which are released once copied; then
        // the output and the backend's buffers.
        consider(kept + next_ag, root_grads + gs[k].grad, gs[k].rs_in + prev, done, acts_of(k),
                 named("reduce-scatter copy-in of", k));
        consider(kept + next_ag, root_grads, gs[k].rs_out + std::max<int64_t>(rs_held, 1) * gs[k].rs_in + prev, done,
                 acts_of(k), named("reduce-scatter of", k));
      }
      if (pending) {  // its wait released the backend's buffers; its output is copied out to the shards
        consider(kept + next_ag, root_grads - prev_grads + pending_grads(k), pending_bytes(k) + gs[*pending].rs_out,
                 done + gs[*pending].shard_grad, acts_of(k), named("copy-out of the reduce-scatter before", k));
        if (o.grads_set_to_none && !host_states) done += gs[*pending].shard_grad;
      }
      pending = k;
    }
    if (pending) {
      consider(kept, pending_grads(*pending), pending_bytes(*pending), done + gs[*pending].shard_grad, 0,
               "end of the backward");
    }
  }
};

}  // namespace

MemoryEstimate estimate_memory(const std::vector<ParamInfo>& params, const std::vector<ShardGroupInfo>& groups,
                               const MemoryEstimateOptions& o) {
  const auto [by_fqn, grouped] = check_inputs(params, groups, o);
  const int64_t N = o.world_size;
  MemoryEstimate e;
  const int64_t largest_trainable_shard = add_model_states(params, grouped, o, e);
  const std::vector<GroupBytes> gs = group_bytes(groups, by_fqn, o, e);
  e.activations = o.activation_bytes;
  e.runtime_overhead = o.runtime_overhead_bytes;

  const bool host_states = o.cpu_offload && !o.device_is_cpu;
  const int64_t dev_params = host_states ? 0 : e.sharded_params;
  const int64_t dev_grads = host_states ? 0 : e.grads;
  const int64_t dev_opt = host_states ? 0 : e.optimizer_state;
  if (o.cpu_offload) e.offloaded_host = e.sharded_params + e.grads + e.optimizer_state;
  int64_t grouped_grads = 0;
  for (const auto& g : gs) grouped_grads += g.shard_grad;
  // Sharded gradients present from the start of the step: all of them unless zero_grad set them to none
  // (then only those of parameters in no group, which FSDP does not touch).
  const int64_t grads_at_start = host_states ? 0 : (o.grads_set_to_none ? e.grads - grouped_grads : e.grads);
  // Input-sized buffers held by a reduce-scatter in flight; at world size 1 no backend is called (the
  // input is copied to the output and freed at once).
  const int64_t rs_held = N == 1 ? 0 : o.reduce_scatter_held_inputs.value_or(o.device_is_cpu && !o.cpu_shared_memory ? 2 : 1);
  TORCH_CHECK(rs_held >= 0, "estimate_memory: reduce_scatter_held_inputs must be >= 0, got ", rs_held);

  e.peak_backward = -1;
  StepWalk walk{o, gs, e, dev_params, dev_opt, grads_at_start, rs_held, host_states};
  walk.backward(walk.forward());
  // AdamW's step: LibTorch's computes two shard-sized fp32 temporaries for the parameter being updated
  // (exp_avg_sq.sqrt() and its quotient by the bias correction).
  e.peak_optimizer_step = dev_params + dev_grads + dev_opt + (dev_opt > 0 ? 2 * largest_trainable_shard * 4 : 0);
  // FSDP's CPU buffer pool (src/fsdp/fsdp_buffer_pool.h; off unless FSDP_CPU_BUFFER_POOL=1): the all-gather and
  // reduce-scatter buffers, the unsharded parameters and the reduce-scatter outputs (which the reduced
  // gradients alias) stay allocated between uses, so after the first step the pool holds up to twice the
  // most of them ever in use at once (its high-water mark; twice: exact-size blocks) at every moment. With
  // it the peak is bounded by the largest moment of everything else plus twice that mark.
  const char* pool_env = std::getenv("FSDP_CPU_BUFFER_POOL");
  const bool pool = o.device_is_cpu && pool_env && std::string(pool_env) == "1";
  if (pool) {
    if (walk.others_peak + 2 * walk.pool_high_water > e.peak_backward) {
      e.peak_backward = walk.others_peak + 2 * walk.pool_high_water;
      e.peak_moment = walk.others_moment + ", with FSDP's CPU buffer pool holding up to twice its high-water mark (" +
                      std::to_string(2 * walk.pool_high_water / 1048576) + " MiB)";
    }
    // The reduced gradients are pool blocks too: the pool's bound covers them.
    e.peak_optimizer_step += std::max<int64_t>(0, 2 * walk.pool_high_water - grouped_grads);
  }
  e.total_peak = std::max(e.peak_backward, e.peak_optimizer_step) + e.runtime_overhead;
  return e;
}

int64_t activation_peak_bytes(const ActivationProfile& p, const ActivationCheckpointing& ac) {
  TORCH_CHECK(p.blocks >= 0 && p.block_saved >= 0 && p.block_input >= 0 && p.block_selective >= 0 && p.other_saved >= 0 &&
                  p.head_backward_temporary >= 0 && p.block_backward_temporary >= 0,
              "activation_peak_bytes: every count must be >= 0");
  TORCH_CHECK(ac.every >= 1, "activation_peak_bytes: every must be >= 1, got ", ac.every);
  using Mode = ActivationCheckpointing::Mode;
  const int64_t kept_by_region = ac.mode == Mode::selective ? p.block_selective : p.block_input;
  TORCH_CHECK(ac.mode == Mode::none || kept_by_region <= p.block_saved, "activation_peak_bytes: a checkpointed block ",
              "keeps ", kept_by_region, " bytes, more than the ", p.block_saved, " it saves without checkpointing");
  const int64_t regions = ac.mode == Mode::none ? 0 : ac.mode == Mode::selective ? p.blocks : p.blocks / ac.every;
  const int64_t kept = (p.blocks - regions) * p.block_saved + regions * kept_by_region;
  const int64_t recomputed = regions > 0 ? p.block_saved - kept_by_region : 0;
  return std::max(kept + p.other_saved + p.head_backward_temporary, kept + recomputed + p.block_backward_temporary);
}

std::string format_memory_estimate(const MemoryEstimate& e) {
  std::ostringstream os;
  auto row = [&](const char* name, int64_t bytes, const std::string& what) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "  %-22s %10.1f MiB  ", name, static_cast<double>(bytes) / (1 << 20));
    os << buf << what << "\n";
  };
  os << "model states (" << e.num_params << " parameters):\n";
  row("sharded params", e.sharded_params, "padded shards, own dtype (padding " + std::to_string(e.padding) + " bytes)");
  row("grads", e.grads, "sharded gradients, own dtype");
  row("optimizer state", e.optimizer_state, "per shard element");
  if (e.offloaded_host > 0) row("offloaded (host)", e.offloaded_host, "params + grads + optimizer on the host");
  os << "the forward's and backward's peak, at the " << e.peak_moment << ":\n";
  row("sharded grads", e.grads_at_peak, "reduced so far (zero_grad set them to none)");
  row("unsharded params", e.unsharded_params, "kept and gathered groups, all-gather buffers (largest group: '" + e.largest_group + "')");
  row("unsharded grads", e.unsharded_grads, "full-size gradients not yet reduce-scattered");
  row("reduce-scatter", e.reduce_scatter, "inputs and outputs alive");
  row("activations", e.activations, "saved for the backward (caller's total, spread over the groups)");
  row("peak (fwd + bwd)", e.peak_backward, "the above + sharded params + optimizer state");
  row("peak (optim step)", e.peak_optimizer_step, "params + grads + optimizer state + AdamW's temporaries");
  row("runtime overhead", e.runtime_overhead, "caller's estimate");
  row("total peak", e.total_peak, "the larger peak + runtime overhead");
  return os.str();
}

}  // namespace fsdp
