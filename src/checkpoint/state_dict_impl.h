// Internals shared by the model state dict (state_dict.cpp) and the optimizer state dict
// (optim_state_dict.cpp), as torch.distributed.checkpoint.state_dict splits get_model_state_dict and
// get_optimizer_state_dict. Every set_* function follows [Note: validate, agree, apply]: prepare_*()
// validates the whole dict and stages closures in a Prepared; Prepared::run() applies them.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "fsdp/checkpoint/optimizer_adapter.h"
#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/tensor/parallel/tensor_parallel.h"
#include "fsdp/fsdp_state.h"
#include "checkpoint/validate_agree_apply.h"

namespace fsdp::detail::sd {

/// The layout of one sharded parameter: FSDP's (possibly over TP), or tensor parallelism's alone.
struct Layout {
  FSDPParamGroup* group = nullptr;  // an FSDP parameter: its group and FSDPParam
  const FSDPParam* param = nullptr;
  torch::Tensor tp_param;           // else a parameter of parallelize_module that no fully_shard manages
  /// The parameter's sharded DTensor (aliases its local shard).
  DTensor dtensor() const { return group ? group->sharded_dtensor(*param) : tp::tp_param_dtensor(tp_param); }
  /// The local shard, to load into.
  torch::Tensor local() const { return group ? param->sharded_data : tp_param.detach(); }
};

/// The FSDP layouts of a model's parameters and the group its state dicts communicate over.
struct ModelContext {
  std::unordered_map<const c10::TensorImpl*, Layout> layouts;
  ProcessGroupPtr world;  // null: a single process
  int rank = 0;

  /// Walks every FSDP state under `model`, reshards its group (state dicts read and write the local
  /// shards, as FSDP2's state_dict does) and records each sharded parameter's layout.
  explicit ModelContext(const torch::nn::Module& model);
  const Layout* find(const torch::Tensor& t) const {
    auto it = layouts.find(t.unsafeGetTensorImpl());
    return it == layouts.end() ? nullptr : &it->second;
  }
};

/// What a set_* function will do once every rank has validated (phase 3 of [Note: validate, agree, apply]).
struct Prepared {
  std::vector<std::function<void()>> apply;
  LoadResult result;
  void run() {
    torch::NoGradGuard no_grad;
    for (auto& f : apply) f();
  }
};

/// Phase 2 of [Note: validate, agree, apply] for the state dicts: collectives over `world` (one
/// all-reduce when every rank validated). Null `world` or one rank: no communication.
Agree agree_over(const ProcessGroupPtr& world);

/// Copies src into dst (skipped when they are the same memory: a dict that aliases its target).
void copy_into(const torch::Tensor& dst, const torch::Tensor& src);

/// Checks the missing/unexpected keys of a strict load; `what` names the destination ("model", ...).
void check_strict(const LoadResult& r, bool strict, const char* api, const char* what, int rank);

/// Validates one tensor entry against its destination and returns the source to copy from (already
/// the local piece). `dst_layout` is set when the destination is a sharded parameter (or state of one).
torch::Tensor resolve_tensor(const StateDictValue& entry, const std::string& key, const torch::Tensor& dst,
                             const std::optional<DTensor>& dst_layout, const char* api, int rank);

/// Tensor key -> the layout of its destination (nullopt: not sharded). A key "<prefix>.*" stands for every
/// "<prefix>.<name>" that has no entry of its own (an optimizer state under any adapter's names).
using Layouts = std::unordered_map<std::string, std::optional<DTensor>>;

/// broadcast_from_rank0: rank 0's dict `sd` becomes every rank's, each tensor cut to the local piece of
/// its destination in `layouts`. Collective over `world`.
StateDict broadcast_dict(const StateDict& sd, const ProcessGroupPtr& world, const Layouts& layouts, const char* api);

/// Appends a sharded entry of a get_* state dict: `d` itself, or gathered with full_state_dict (a
/// collective: every rank calls it, in the same order), moved to the CPU with cpu_offload (sharded: a
/// DTensor whose local is on the CPU, as PyTorch's _offload_state_dict_to_cpu; full: only where `keep`).
void emit_tensor(StateDict& sd, const std::string& key, const DTensor& d, const StateDictOptions& o, bool keep);
/// Appends an unsharded entry (moved to the CPU with cpu_offload), where `keep`.
void emit_tensor(StateDict& sd, const std::string& key, const torch::Tensor& t, const StateDictOptions& o, bool keep);

/// Whether this rank keeps the entries of a get_* dict (full_state_dict with cpu_offload: rank 0 only).
inline bool keeps_entries(const StateDictOptions& o, int rank) { return !(o.full_state_dict() && o.cpu_offload()) || rank == 0; }

// ---------------------------------------------------------------------------------------------
// The optimizer side (optim_state_dict.cpp), which set_state_dict combines with the model's.

/// The optimizers of one state dict call with their adapters (fsdp/checkpoint/optimizer_adapter.h).
struct Optims {
  std::vector<torch::optim::Optimizer*> opts;
  std::vector<std::shared_ptr<const OptimizerAdapter>> adapters;
  /// The nested layout's index of optimizer i's param group 0: groups are numbered over every optimizer in
  /// order, as PyTorch's get_optimizer_state_dict concatenates their param_groups.
  std::vector<size_t> group_base;
  /// Throws naming the problem: no optimizer, a null one, one passed twice, a type without an adapter.
  Optims(std::vector<torch::optim::Optimizer*> optimizers, const char* api);
};

/// One parameter of the optimizers, with its FQN and layout.
struct OptParam {
  size_t opt = 0;    // which optimizer of Optims
  size_t group = 0;  // its param group there
  std::string fqn;
  torch::Tensor param;            // the optimizer's tensor (its data is the local shard)
  std::optional<DTensor> layout;  // set when sharded
};

/// The optimizers' parameters in optimizer, then param-group order; throws when one is not the model's, or
/// is in two groups or two optimizers (naming its FQN).
std::vector<OptParam> opt_params(const torch::nn::Module& model, const Optims& optims, const ModelContext& ctx,
                                 const char* api);

/// get_optimizer_state_dict's dict (keys without the "optim." prefix).
StateDict optimizer_state_dict(const torch::nn::Module& model, const Optims& optims, const StateDictOptions& o,
                               const ModelContext& ctx);

/// The layouts of the optimizers' state tensors (for broadcast_from_rank0): "state.<fqn>.*" entries.
Layouts optimizer_layouts(const std::vector<OptParam>& params);

/// Phase 1 for the optimizers: validates `sd` and stages the hyper-parameters and state it sets.
Prepared prepare_optimizer(const std::vector<OptParam>& params, const Optims& optims, const StateDict& sd,
                           const StateDictOptions& o, const char* api, int rank);

}  // namespace fsdp::detail::sd
