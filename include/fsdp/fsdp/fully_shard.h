// fully_shard: FSDP2 parameter sharding for LibTorch modules.
//
//   GPT model(cfg);                                               // any LibTorch model, unchanged
//   for (auto& b : *model->blocks) fsdp::fully_shard(b, opts);    // bottom-up (blocks: a ModuleList)
//   fsdp::fully_shard(model, opts);                               // root last
//   torch::optim::AdamW opt(model->parameters(), ...);           // sees local shards
//
//   // The alternative without per-op overhead: declare the modules as FSDP holders.
//   struct GPTImpl : torch::nn::Module {
//     std::vector<fsdp::FSDPModule<Block>> blocks;   // was std::vector<Block>
//     ...
//   };
//   fsdp::FSDPModule<GPT> model(GPT(cfg));
//   for (auto& b : model->blocks) fsdp::fully_shard(b, opts);     // then as above
//
// Every parameter of a fully_shard call (minus those of already-sharded submodules) forms one group:
// sharded on dim 0 over the mesh (torch.chunk layout, zero padding, empty shards allowed), all-gathered
// as one flat buffer before the module's forward and again before its backward, gradients
// reduce-scattered (SUM, then divided by the number of data-parallel ranks) into sharded gradients.
// The parameter tensors keep their identity: only their data is swapped between the local shard and
// the unsharded tensor, so `model->parameters()`, an optimizer and the autograd graph all keep
// pointing at the same objects.
//
// Any module can be sharded, as in Python: a torch::nn::Sequential element (`seq->ptr(i)`), a
// ModuleList/ModuleDict entry however the model calls it (`m->as<Block>()->forward(x)`), a plain
// torch::nn::Linear/Conv2d/Embedding/LSTM/MultiheadAttention member, the root. The model's code stays
// as it is. Two ways FSDP follows a group's forward:
// - implicit (no module of the fully_shard call has an fsdp::FSDPModule holder): the parameters are
//   intercepted at tensor level (a dispatch key on their data). The first op that uses a group's
//   parameter in forward all-gathers the group; it is resharded (reshard_after_forward) when an op uses a
//   group outside its module's subtree, so nested groups behave as with module hooks; the first autograd
//   node of an op that used it unshards it in backward; its gradients are reduce-scattered as soon as
//   every parameter it used has its gradient. mp_policy's cast_forward_inputs casts the floating-point
//   inputs of the ops that use the group's parameters (module inputs are not visible); output_dtype
//   needs the call through fsdp_forward (refused otherwise). Outside forward and backward a parameter is its local shard (see "Reads" below). An
//   alias (a view, detach(), .data()) of a parameter taken while it was sharded and used in a forward throws a
//   c10::Error. Activation checkpointing: checkpoint_wrapper() / apply_activation_checkpointing() on the
//   unchanged module (its ops are recorded and replayed in backward, non-reentrant), or fsdp::checkpoint around
//   the call in the model's forward. Cost: ~1 us per op that takes a parameter; other ops pay nothing.
//   torch::optim::LBFGS is not supported (it clones parameters outside forward).
// - holder (no per-op cost in forward): declare the module as fsdp::FSDPModule<Block> instead of Block
//   and call it as `block(x)` (or through fsdp::fsdp_forward() for other entry points). Its shards carry
//   the interception key (its unsharded parameters do not), so ops on the shards between steps (the
//   optimizer's) cost ~1 us each and a use of a sharded parameter is seen. A forward that bypasses the
//   holder (a root called as `model->forward(x)`, a child a container calls directly, a module reached
//   through `as<>()`) would compute on the local shards: it raises a c10::Error naming the parameter, its
//   module and the supported calls, at the first use of a sharded parameter while a forward is open (the
//   root called through its holder, or an unchanged root); else (the root itself called through ->forward)
//   at the end of the root's forward when the use is in the root output's autograd graph, or when the
//   gradient of the use reaches its parameter in backward, before that gradient is reduced or seen by an
//   optimizer. Every rank runs the same forward, so every rank raises at the same place.
// Both give identical numbers (the same collectives on the same data; tested bit for bit in fp32).
//
// Reads of a sharded parameter (both paths): shape and content agree, and no plain read is a hidden
// collective. Between steps (before the first forward, after a backward, after the root's reshard()
// ends an evaluation forward of an unchanged model) `p.sizes()` is the local shard's and a read sees the
// local shard, on this rank alone: `p.detach()`, `p.sum()` / `p.clone()` under torch::NoGradGuard,
// `dst.copy_(p)`, torch::save; p.detach() is the shard as a tensor, also combined with other tensors.
// A rank whose shard is empty may skip a read. Full values come from explicit calls that every rank
// makes: get_model_state_dict(full_state_dict), DTensor::full_tensor(), FSDPModuleAPI::unshard(). In-place
// writes (optimizer updates, torch::nn::init) write the shard. Exceptions, raised at the use:
// - a holder group's parameter used during a forward outside its module's forward (a tied weight read as
//   `matmul(h, head->weight.t())` in the root's forward) throws on every rank, in train and eval mode;
// - an unchanged model's parameter read with grad enabled between steps (`p.sum()`) throws, since it
//   could also be the first op of a forward: read under NoGradGuard or through p.detach().
// What an unchanged model cannot tell apart: between steps its parameter itself (not p.detach()) combined
// with another tensor (`linear(x, w)`, but also `p - ref`) or viewed (`w.t()`) starts a forward and
// all-gathers its group; under NoGradGuard a forward whose very first op takes only parameters and is not
// a view (exp(log_scale)) computes that op on the shard. A root declared as fsdp::FSDPModule<Holder> opens
// its forward explicitly and has neither limit. See [Note: reads of a sharded parameter]
// (src/fsdp/fsdp_interception.cpp).
//
// Backward: a group's gradients are reduce-scattered once per backward, after every use of its
// parameters in that backward produced its gradient: as soon as the gradients of every call's inputs
// are computed when each call of the group had an input that requires grad, else (e.g. token ids, or
// a block called first on an input without grad) at the end of the backward. This holds for a module
// called several times per forward, several modules sharded as one group, activation checkpointing
// (also when each call, or a nested region, is recomputed by a checkpoint of its own: the group waits
// for every region that used it; gradients bit-equal to the run without checkpointing, fp32 and bf16),
// several root forwards before one backward (a loss summed over two batches; holder roots: the calls
// add up while the previous forward's output lives and no backward ran since), and a second backward over the same graph (`backward(retain_graph=true)`: gradients accumulate as
// without FSDP, for every reshard_after_forward). A backward that throws (e.g. from a user hook)
// leaves the model trainable: before the exception reaches the caller, the gradients not yet reduced
// are dropped, the sharded gradients (from before it, plus groups it finished reducing, as plain
// autograd keeps what it accumulated) are back in .grad and the groups are resharded locally; the
// next forward completes its in-flight collectives and starts clean (zero_grad() as usual).
//
// After fully_shard, FSDP owns the parameters' data. `module->to(dtype or device)` between steps converts
// the shards: each group takes the converted copies over at its next unshard (the next forward, or an
// explicit unshard), as PyTorch's FSDPModule._apply; call it on the whole module, on every rank. Other
// replacements (`param.set_data(...)`, module->to() while a group is unsharded, part of a group) are
// refused at that point with an error naming the parameter: FSDP gathers from the shards it holds, so the
// change would otherwise be silently undone. Compute in another dtype with mp_policy; change values in
// place (copy_ under torch::NoGradGuard, or set_model_state_dict).
//
// Buffers (BatchNorm's running_mean/running_var/num_batches_tracked, any register_buffer) are neither
// sharded nor synchronised, as in PyTorch's FSDP2: every rank keeps and updates its own copy, so a
// train-mode BatchNorm keeps per-rank running statistics computed from that rank's batches (use
// SyncBatchNorm-like code of your own, or eval-mode statistics, if they must agree). get_model_state_dict
// returns each rank's own buffers; dcp::save writes rank 0's copy (rank 0 of the save's group; the
// other ranks' buffers are not saved), and dcp::load gives every rank that copy.
//
// Mirrors torch.distributed.fsdp.fully_shard and FSDPModule (FSDP2).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

#include <c10/core/Event.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "fsdp/tensor/device_mesh.h"
#include "fsdp/utils/activation_checkpoint.h"
#include "fsdp/utils/saved_tensor_hooks.h"
#include "fsdp/tensor/dtensor.h"
#include "fsdp/fsdp/all_gather_extension.h"
#include "fsdp/fsdp/comm.h"
#include "fsdp/fsdp/detail/hooks.h"
#include "fsdp/fsdp/policies.h"
#include "fsdp/tensor/parallel/detail/module_boundary.h"

namespace fsdp {

/// When to free the unsharded parameters after forward (FSDP2's `reshard_after_forward`).
/// `true`: reshard to the full mesh (all-gather again in backward; least memory). `false`: keep them
/// unsharded until after backward (no backward all-gather; ZeRO-2 memory). An int k (dividing the
/// shard group size): keep a 1/k slice after forward and all-gather over groups of k consecutive ranks
/// in backward. Unset: true for non-root modules, false for the root (current PyTorch).
using ReshardAfterForward = std::variant<bool, int>;

/// What FullyShardOptions::shard_placement_fn returns for one parameter: a placement (fsdp::Shard(d);
/// std::nullopt = Shard(0)) and optionally the mesh to shard it over (null: fully_shard's). Built
/// implicitly from a Placement, a std::optional<Placement> or std::nullopt, so `return fsdp::Shard(1);`
/// works. Mirrors PyTorch's `Shard | ShardPlacementResult | None`. A mesh other than fully_shard's (a
/// per-parameter mesh, e.g. MoE experts on an expert mesh) is refused at fully_shard, naming the
/// parameter: shard the module that owns those parameters by its own fully_shard call with that mesh, as
/// torchtitan does for experts (PyTorch's per-parameter meshes make several groups per call; libfsdp keeps
/// one group per call).
/// Example: `return fsdp::ShardPlacementResult(fsdp::Shard(0), ep_mesh);`
struct ShardPlacementResult {
  ShardPlacementResult() = default;
  ShardPlacementResult(std::nullopt_t) {}  // NOLINT(google-explicit-constructor): Shard(0)
  ShardPlacementResult(Placement p) : placement(std::move(p)) {}  // NOLINT(google-explicit-constructor)
  ShardPlacementResult(std::optional<Placement> p) : placement(std::move(p)) {}  // NOLINT(google-explicit-constructor)
  ShardPlacementResult(std::optional<Placement> p, DeviceMeshPtr m) : placement(std::move(p)), mesh(std::move(m)) {}
  std::optional<Placement> placement;  // std::nullopt: Shard(0)
  DeviceMeshPtr mesh;                  // null: fully_shard's mesh
};

/// FullyShardOptions::shard_placement_fn: (name, parameter) -> ShardPlacementResult (e.g. fsdp::Shard(d),
/// or std::nullopt for Shard(0)).
using ShardPlacementFn = std::function<ShardPlacementResult(const std::string& name, const torch::Tensor& param)>;

/// Options of fully_shard. Mirrors fully_shard's keyword arguments.
/// Example: `fsdp::FullyShardOptions().mesh(mesh).reshard_after_forward(false)
///           .mp_policy(fsdp::MixedPrecisionPolicy().param_dtype(torch::kBFloat16))`
struct FullyShardOptions {
  /// Mesh to shard over: 1-D (FSDP) or 2-D (replicate, shard) for HSDP.
  /// (Default: null = a 1-D mesh over the default process group)
  TORCH_ARG(DeviceMeshPtr, mesh) = nullptr;
  /// See ReshardAfterForward. (Default: unset = true, false for the root)
  TORCH_ARG(std::optional<ReshardAfterForward>, reshard_after_forward) = std::nullopt;
  /// Dtypes of all-gather, compute and reduction. (Default: all original dtypes)
  TORCH_ARG(MixedPrecisionPolicy, mp_policy) = {};
  /// Keep shards, gradients and optimizer state on the CPU. (Default: none)
  TORCH_ARG(std::optional<CPUOffloadPolicy>, offload_policy) = std::nullopt;
  /// Parameters left out of sharding (neither sharded nor reduced; their module must handle them).
  /// (Default: none)
  TORCH_ARG(std::vector<torch::Tensor>, ignored_params) = {};
  /// Broadcast the parameters of this call (before sharding) and the buffers of its modules (outside
  /// already-sharded submodules) from rank 0 of the mesh to every rank, so that ranks that built the
  /// model from differently seeded generators start from rank 0's weights. One broadcast per dtype,
  /// at fully_shard only. Set it on every fully_shard call (children and root). The analogue of FSDP1's
  /// `sync_module_states`. (Default: false; every rank must then start from the same weights, see
  /// fully_shard)
  TORCH_ARG(bool, sync_module_states) = false;
  /// Chooses the dimension each parameter is sharded on: called once per parameter of this call with its
  /// name relative to the fully_shard module and its (unsharded) value; std::nullopt = Shard(0); another
  /// placement than Shard is refused. A negative dim counts from the end. Shard(d != 0) needs the parameter's size on d divisible by the shard group
  /// size (as PyTorch; refused otherwise, naming the parameter), and is refused together with tensor
  /// parallelism or an all-gather extension. The shard is then a contiguous chunk on dim d; gathers,
  /// gradients, state dicts and DCP follow (the DTensor placement is Shard(d)). Mirrors fully_shard's
  /// shard_placement_fn (a per-parameter mesh is refused: see ShardPlacementResult). (Default: none:
  /// every parameter on dim 0)
  /// Example: `opts.shard_placement_fn([](const std::string&, const torch::Tensor& p) -> std::optional<fsdp::Placement> { if (p.dim() == 2) return fsdp::Shard(1); return std::nullopt; })`
  TORCH_ARG(ShardPlacementFn, shard_placement_fn) = nullptr;
  /// Gives parameters their own all-gather (see AllGatherExtension; e.g. low_precision_all_gather(kFloat8_e4m3fn)).
  /// Called once per parameter of this call at fully_shard. The C++ form of a parameter being a tensor
  /// subclass with fsdp_pre_all_gather / fsdp_post_all_gather in PyTorch. (Default: none)
  TORCH_ARG(AllGatherExtensionFn, all_gather_extension_fn) = nullptr;
  /// With a full mesh in `mesh` (e.g. (dp_replicate, dp_shard, tp)): its data-parallel dimensions, from
  /// which fully_shard takes its 1-D (shard) or 2-D (replicate, shard) mesh; one built per distinct set of
  /// names (flattened ones are built once per mesh and names). Throws c10::Error for an unknown name, a
  /// name out of the mesh's order, or `replicate` alone (that is replicate()). Mirrors fully_shard's
  /// dp_mesh_dims. (Default: none: `mesh` is the data-parallel mesh)
  TORCH_ARG(std::optional<DataParallelMeshDims>, dp_mesh_dims) = std::nullopt;
};

/// Handle of an explicit unshard; wait() completes it (copies the all-gather output into the
/// unsharded parameters). Mirrors FSDP2's UnshardHandle.
class UnshardHandle {
 public:
  UnshardHandle() = default;
  explicit UnshardHandle(std::function<void()> wait) : wait_(std::move(wait)) {}
  void wait() {
    if (wait_) std::exchange(wait_, nullptr)();
  }

 private:
  std::function<void()> wait_;
};

/// The FSDP2 API of a sharded module (FSDPModule's methods, usable on any sharded module).
/// Throws c10::Error if `module` was not passed to fully_shard.
class FSDPModuleAPI {
 public:
  explicit FSDPModuleAPI(std::shared_ptr<detail::FSDPState> state) : state_(std::move(state)) {}
  /// All-gathers this module's parameters (not its children's). With async_op the returned handle
  /// must be waited before the parameters are used. Before the root's forward (e.g. to overlap a block's
  /// all-gather with the loading of the batch) the gathered data is kept for the block's forward, unless
  /// a shard changed in between (then gathered again: see set_reshard_after_backward). Mirrors
  /// FSDPModule.unshard().
  UnshardHandle unshard(bool async_op = false);
  /// Frees the unsharded parameters (not recursive). Mirrors FSDPModule.reshard().
  void reshard();
  /// Enables/disables the gradient reduce-scatter in backward (disable for all but the last
  /// microbatch of gradient accumulation). Also sets set_requires_all_reduce to the same value, as
  /// PyTorch does. Mirrors FSDPModule.set_requires_gradient_sync().
  void set_requires_gradient_sync(bool requires_gradient_sync, bool recurse = true);
  /// Reshard after backward (default true). With false, the unsharded parameters are kept after the
  /// backward (memory for communication), which saves the next forward's all-gather: between
  /// microbatches, with or without gradient sync. After a synchronised backward the parameters hold their
  /// shards and sharded gradients again (the optimizer steps them) while the unsharded data is kept; the
  /// next forward reuses it only if no rank's shard changed since (compared locally, agreed by one
  /// all-reduce of a flag), else all-gathers again. PyTorch reuses it even after an optimizer step
  /// (stale parameters); libfsdp never does. Mirrors FSDPModule.set_reshard_after_backward().
  void set_reshard_after_backward(bool reshard_after_backward, bool recurse = true);
  /// HSDP (2-D mesh): whether the gradient reductions all-reduce over the replicate dimension (default
  /// true). With false the gradients are still reduce-scattered within each replica group, but their sums
  /// wait (not in .grad) until the next backward whose reduction all-reduces, which adds them first: the
  /// microbatches of gradient accumulation then cost one all-reduce instead of one each. Keep it true
  /// for the backward before an optimizer step. No effect on a 1-D mesh. Mirrors
  /// FSDPModule.set_requires_all_reduce().
  /// Example: `model.set_requires_all_reduce(micro == n_micro - 1);`
  void set_requires_all_reduce(bool requires_all_reduce, bool recurse = true);
  /// Changes reshard_after_forward of this module (and, with recurse, its sharded submodules).
  void set_reshard_after_forward(ReshardAfterForward value, bool recurse = true);
  /// Whether the next backward is the last of the step (false skips waiting for the reduce-scatters
  /// at the end of backward). Mirrors FSDPModule.set_is_last_backward().
  void set_is_last_backward(bool is_last_backward);
  /// Modules whose all-gather this module's pre-forward issues (explicit forward prefetch; replaces
  /// the implicit one). Mirrors FSDPModule.set_modules_to_forward_prefetch().
  void set_modules_to_forward_prefetch(const std::vector<std::shared_ptr<torch::nn::Module>>& modules);
  /// Modules whose all-gather this module's pre-backward issues (replaces the implicit prefetch of
  /// the module that ran before it in forward). Mirrors FSDPModule.set_modules_to_backward_prefetch().
  void set_modules_to_backward_prefetch(const std::vector<std::shared_ptr<torch::nn::Module>>& modules);
  /// Reduced gradients are divided by `factor` instead of the number of data-parallel ranks.
  /// Mirrors FSDPModule.set_gradient_divide_factor().
  void set_gradient_divide_factor(double factor);
  /// Deprecated alias of set_gradient_divide_factor. Mirrors FSDPModule.set_reduce_scatter_divide_factor().
  [[deprecated("use set_gradient_divide_factor")]] void set_reduce_scatter_divide_factor(double factor) {
    set_gradient_divide_factor(factor);
  }
  /// Replaces this module's all-gather (allocation and collective), for the all-gathers from the shards
  /// and the backward all-gathers of reshard_after_forward=k alike; null restores the default. Throws
  /// c10::Error when set_allocate_memory_from_process_group_for_comm is on. Not recursive. Mirrors
  /// FSDPModule.set_custom_all_gather().
  /// Example: `fsdp::fsdp_api(block).set_custom_all_gather(std::make_shared<MyAllGather>());`
  void set_custom_all_gather(std::shared_ptr<AllGather> comm);
  /// Replaces this module's gradient reduce-scatter (its input and output allocation and the
  /// collective); null restores the default. Throws as set_custom_all_gather. Mirrors
  /// FSDPModule.set_custom_reduce_scatter().
  void set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> comm);
  /// Calls `hook(reduce_output)` on every gradient reduction of this module that completes (after the
  /// reduce-scatter, and after the all-reduce under HSDP; not for an HSDP microbatch whose all-reduce
  /// set_requires_all_reduce(false) defers), before the gradients are copied out: `reduce_output` is
  /// this rank's flat reduced gradients ([sum of padded shard numels], reduce dtype, group order),
  /// already divided (as PyTorch's fp32/bf16 default, which averages in the collective); the hook may
  /// change it in place (e.g. all-reduce it over another mesh dimension). On CUDA it runs on `stream`
  /// when given (after the reduction; the copy-out of the gradients waits for the hook's work), else on
  /// the reduce-scatter stream; on the CPU (no streams) the stream is ignored. Null removes it. Not
  /// recursive. Throws c10::Error for a stream of another device type than the module's mesh. Mirrors
  /// FSDPModule.set_all_reduce_hook(hook, stream=None).
  /// Example: `fsdp::fsdp_api(block).set_all_reduce_hook([&](const torch::Tensor& g) { fsdp::all_reduce(g, *dp_pg); g.div_(2); });`
  void set_all_reduce_hook(std::function<void(const torch::Tensor&)> hook,
                           std::optional<c10::Stream> stream = std::nullopt);
  /// CUDA: the all-gather streams of the root's next forward wait on `event` (recorded after the
  /// optimizer step) instead of on the compute stream: that iteration's all-gather copy-ins (forward and
  /// backward) do not wait for the compute queued before them, as PyTorch. Consumed by that forward, so
  /// record and set a new one each step; without one the copy-ins wait for the compute stream again.
  /// No effect on the CPU (no streams). Throws c10::Error on a non-root after lazy init. Mirrors
  /// FSDPModule.set_post_optim_event().
  void set_post_optim_event(std::shared_ptr<c10::Event> event);
  /// Whether the reduction may use a reduce op other than SUM (AVG, PREMUL_SUM). libfsdp always
  /// reduce-scatters with SUM and divides afterwards (both values give that, which is the behaviour
  /// `enable = true` asks for in PyTorch; the averages equal PyTorch's up to rounding). Mirrors
  /// FSDPModule.set_force_sum_reduction_for_comms().
  void set_force_sum_reduction_for_comms(bool enable);
  /// Whether parameters that received no gradient on this rank take part in the reduce-scatter with
  /// zeros. libfsdp always includes them (with a presence flag, so a parameter no rank produced a
  /// gradient for keeps none): `false`, PyTorch's default, would make ranks whose data used different
  /// parameters (mixture of experts) issue reduce-scatters of different sizes. Both values are accepted
  /// and behave as `true`. Mirrors FSDPModule.set_reduce_scatter_unused_params().
  void set_reduce_scatter_unused_params(bool reduce_scatter_unused_params, bool recurse = true);
  /// How many reduce-scatter input buffers may be in flight (>= 1; throws c10::Error otherwise). libfsdp
  /// never waits to recycle an input: each reduce-scatter writes a fresh buffer that returns to the pool
  /// (or caching allocator) when its collective completes, and at most one reduce-scatter is in flight
  /// per backward ([Note: one reduce-scatter in flight]), so no copy-in stalls whatever the value.
  /// Mirrors FSDPModule.set_reduce_scatter_max_input_buffers().
  void set_reduce_scatter_max_input_buffers(int max_input_buffers, bool recurse = true);
  /// Runs this module's gradient reduce-scatters on a process group of their own over the same ranks
  /// (one per distinct shard group, shared by the modules set in one call), so that a backward's
  /// all-gathers and reduce-scatters do not queue behind each other in one communicator (Gloo: its own
  /// connections; NCCL: its own communicator). Collective over each shard group: call it on every rank
  /// with the same modules. `false` goes back to the shared group. Mirrors
  /// FSDPModule.set_separate_reduce_scatter_group().
  void set_separate_reduce_scatter_group(bool enable = true, bool recurse = true);
  /// Whether this module's parameters are all-gathered in backward (default true). Set false when no
  /// parameter of the group is needed to compute gradients (an embedding table: its backward reads only
  /// the indices), saving one all-gather per step. If a backward formula does read one, the group is
  /// gathered at that read (no saving, same numbers; PyTorch would read freed memory). Call it between
  /// steps (throws c10::Error while the group is unsharded). Not recursive. Mirrors
  /// FSDPModule.set_unshard_in_backward().
  void set_unshard_in_backward(bool unshard_in_backward);
  /// Allocates the all-gather and reduce-scatter buffers from the process group's own allocator
  /// (c10d Backend::allocateTensor, e.g. NCCL's registered memory for zero-copy transfers) when the
  /// backend supports it on the device, else as by default (Gloo: the CPU buffer pool). Throws c10::Error
  /// with a custom all-gather or reduce-scatter set. Not recursive. Mirrors
  /// FSDPModule.set_allocate_memory_from_process_group_for_comm().
  void set_allocate_memory_from_process_group_for_comm(bool enable);
  /// Refused: always throws c10::Error. Symmetric-memory all-gathers need torch's SymmetricMemory
  /// rendezvous, which LibTorch does not expose to C++ callers; use
  /// set_allocate_memory_from_process_group_for_comm(true) for NCCL's registered buffers. Mirrors
  /// FSDPModule.set_symm_mem_for_comm().
  void set_symm_mem_for_comm(const std::string& backend = "NCCL");
  /// Recovery after an exception aborted a forward or backward: completes and drops in-flight
  /// collectives, reshards every group of the tree, drops the failed iteration's gradients in flight
  /// (reduce-scatters, HSDP sums held back by set_requires_all_reduce(false), unsharded gradients
  /// accumulated without sync) and clears per-iteration state; the sharded .grad of earlier completed
  /// backwards stay. libfsdp also recovers on its own at the next root forward; this makes the point
  /// explicit (restart the microbatch sequence after it). Call it on every rank. Throws c10::Error on a
  /// module that is not the root (after the first forward). Mirrors FSDPModule.reset_iter_state().
  void reset_iter_state();
  /// The mesh the parameters are sharded over.
  DeviceMeshPtr mesh() const;
  /// The sharded parameters of this module's group, keyed by fully qualified name relative to the
  /// module fully_shard was called on, before and after the first forward alike (for a group of
  /// several modules, prefixed by the module's position in the fully_shard call: "0.weight",
  /// "1.bias"). DTensors aliasing the parameter storage; no communication.
  std::vector<std::pair<std::string, DTensor>> sharded_parameters() const;
  /// The sharded gradients of this module's group, keyed as sharded_parameters(): DTensors with the
  /// parameters' placements and global shapes, aliasing each gradient's local shard (the analogue of
  /// `p.grad` being a DTensor in FSDP2). Parameters without a gradient are left out. Between
  /// microbatches that keep the parameters unsharded (set_reshard_after_backward(false)), the
  /// gradients reduced so far are returned. No communication.
  std::vector<std::pair<std::string, DTensor>> sharded_gradients() const;

 private:
  friend detail::FSDPState& detail::fsdp_state(const FSDPModuleAPI& api);
  std::shared_ptr<detail::FSDPState> state_;
};

/// The FSDP API of a sharded module. Throws c10::Error naming the module type if it is not sharded.
FSDPModuleAPI fsdp_api(const torch::nn::Module& module);
/// The sharded gradient of a parameter managed by fully_shard as a DTensor (placements and global
/// shape of the parameter; aliases the local gradient shard), or std::nullopt when it has no gradient.
/// Throws c10::Error if `param` is not managed by fully_shard. See FSDPModuleAPI::sharded_gradients().
std::optional<DTensor> sharded_grad(const torch::Tensor& param);
/// A parameter managed by fully_shard or replicate as its sharded DTensor (placements and global shape;
/// aliases the local shard; no communication): PyTorch's parameter after fully_shard, which is a DTensor.
/// Its full value is `sharded_param(p).full_tensor()`, a collective over the group's mesh that every rank
/// makes. Throws c10::Error if `param` is not managed by fully_shard or replicate.
/// Example: `auto w = fsdp::sharded_param(model->head->weight).full_tensor();`
DTensor sharded_param(const torch::Tensor& param);
/// Makes the sharded modules `modules` (separate roots, e.g. the stages of pipeline parallelism on one
/// rank) share the first one's communication context: its CUDA streams, all-gather limiter and CPU buffer
/// pool, so that their transient buffers come from one pool instead of fragmenting several. Call it
/// before their first forward, with the same modules on every rank; no communication. Throws c10::Error if
/// a module is not sharded or the modules' devices differ. Mirrors torch.distributed.fsdp.share_comm_ctx.
/// Example: `fsdp::share_comm_ctx({stage0, stage1});`
void share_comm_ctx(const std::vector<std::shared_ptr<torch::nn::Module>>& modules);
inline FSDPModuleAPI fsdp_api(const std::shared_ptr<torch::nn::Module>& module) { return fsdp_api(*module); }
template <typename T>
FSDPModuleAPI fsdp_api(const torch::nn::ModuleHolder<T>& holder) {
  return fsdp_api(*holder.ptr());
}

/// Marks a module's forward as going through FSDP for good (the holder path: see the top of this
/// file). FSDPModule<T> holders register themselves while they live; custom holders that run
/// fsdp::fsdp_forward may call this.
void mark_fsdp_forward(const torch::nn::Module& module);

/// A module holder that routes the forward through FSDP. Declare `fsdp::FSDPModule<Block>` where you
/// declared `Block` (a TORCH_MODULE holder); construct and call it exactly as before. Behaves as the
/// holder it wraps (->, *, ptr(), register_module) and adds FSDPModule's methods. Until fully_shard is
/// applied to it, calls go straight to the module.
template <typename Holder>
class FSDPModule : public Holder {
 public:
  /// Default-constructs the module, as `Holder()` does.
  FSDPModule() : Holder() { mark(); }
  /// An empty holder, as `Holder(nullptr)`.
  FSDPModule(std::nullptr_t) : Holder(nullptr) {}  // NOLINT: implicit, as the holder's
  /// Wraps an existing holder (shares its module). Implicit, so `blocks.push_back(Block(...))` works.
  FSDPModule(Holder holder) : Holder(std::move(holder)) { mark(); }  // NOLINT
  /// Wraps an existing module. Implicit, so the LibTorch idiom
  /// `block = register_module("block", Block(...));` works (register_module returns the Impl's
  /// shared_ptr).
  template <typename Impl, typename = std::enable_if_t<std::is_convertible_v<
                               std::shared_ptr<Impl>, std::shared_ptr<typename Holder::ContainedType>>>>
  FSDPModule(std::shared_ptr<Impl> module)  // NOLINT: implicit, as the holder's
      : Holder(std::shared_ptr<typename Holder::ContainedType>(std::move(module))) {
    mark();
  }
  /// Constructs the module from the holder's arguments, e.g. FSDPModule<Block>(cfg).
  template <typename Arg, typename... Args,
            typename = std::enable_if_t<!std::is_same_v<std::decay_t<Arg>, FSDPModule> &&
                                        !std::is_same_v<std::decay_t<Arg>, Holder> &&
                                        !std::is_same_v<std::decay_t<Arg>, std::nullptr_t> &&
                                        !detail::is_shared_ptr<std::decay_t<Arg>>::value>>
  explicit FSDPModule(Arg&& arg, Args&&... args) : Holder(std::forward<Arg>(arg), std::forward<Args>(args)...) {
    mark();
  }

  /// Runs the module's forward between FSDP's pre- and post-forward (unshard, reshard, hooks), and inside them
  /// between the module's tensor-parallel boundary styles if any (tp::PrepareModuleInput/Output).
  /// If checkpoint_wrapper was applied, the module's own forward is checkpointed inside FSDP's hooks; if
  /// offload_wrapper was, the call runs under save_on_cpu(pin_memory=true).
  template <typename... Args>
  auto forward(Args&&... args) {
    auto* impl = this->get();
    std::optional<save_on_cpu> offload;
    if (detail::is_offloaded(*impl)) offload.emplace(/*pin_memory=*/true);
    // Inside FSDP's hooks: tensor parallelism's boundary styles (PrepareModuleInput/Output, user hooks), which
    // need this call boundary as FSDP does ([Note: module boundaries] in src/tensor/parallel/prepare_module.cpp).
    auto call = [impl](auto&&... a) {
      return tp::detail::call_with_boundary(
          *impl, [impl](auto&&... b) { return impl->forward(std::forward<decltype(b)>(b)...); },
          std::forward<decltype(a)>(a)...);
    };
    if (auto options = detail::checkpoint_options(*impl)) {
      return detail::run_with_hooks(
          detail::state_of(*impl),
          [call, o = *options](auto&&... a) { return checkpoint(o, call, std::forward<decltype(a)>(a)...); },
          std::forward<Args>(args)...);
    }
    return detail::run_with_hooks(detail::state_of(*impl), call, std::forward<Args>(args)...);
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  FSDPModuleAPI fsdp() const { return fsdp_api(*this->get()); }
  UnshardHandle unshard(bool async_op = false) { return fsdp().unshard(async_op); }
  void reshard() { fsdp().reshard(); }
  void set_requires_gradient_sync(bool v, bool recurse = true) { fsdp().set_requires_gradient_sync(v, recurse); }
  void set_reshard_after_backward(bool v, bool recurse = true) { fsdp().set_reshard_after_backward(v, recurse); }
  void set_requires_all_reduce(bool v, bool recurse = true) { fsdp().set_requires_all_reduce(v, recurse); }
  void set_reshard_after_forward(ReshardAfterForward v, bool recurse = true) {
    fsdp().set_reshard_after_forward(v, recurse);
  }
  void set_is_last_backward(bool v) { fsdp().set_is_last_backward(v); }
  void set_modules_to_forward_prefetch(const std::vector<std::shared_ptr<torch::nn::Module>>& m) {
    fsdp().set_modules_to_forward_prefetch(m);
  }
  void set_modules_to_backward_prefetch(const std::vector<std::shared_ptr<torch::nn::Module>>& m) {
    fsdp().set_modules_to_backward_prefetch(m);
  }
  void set_gradient_divide_factor(double f) { fsdp().set_gradient_divide_factor(f); }
  void set_custom_all_gather(std::shared_ptr<AllGather> c) { fsdp().set_custom_all_gather(std::move(c)); }
  void set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> c) { fsdp().set_custom_reduce_scatter(std::move(c)); }
  void set_all_reduce_hook(std::function<void(const torch::Tensor&)> h, std::optional<c10::Stream> stream = std::nullopt) {
    fsdp().set_all_reduce_hook(std::move(h), stream);
  }
  void set_post_optim_event(std::shared_ptr<c10::Event> e) { fsdp().set_post_optim_event(std::move(e)); }
  void set_force_sum_reduction_for_comms(bool v) { fsdp().set_force_sum_reduction_for_comms(v); }
  void set_reduce_scatter_unused_params(bool v, bool recurse = true) {
    fsdp().set_reduce_scatter_unused_params(v, recurse);
  }
  void set_reduce_scatter_max_input_buffers(int n, bool recurse = true) {
    fsdp().set_reduce_scatter_max_input_buffers(n, recurse);
  }
  void set_separate_reduce_scatter_group(bool v = true, bool recurse = true) {
    fsdp().set_separate_reduce_scatter_group(v, recurse);
  }
  void set_unshard_in_backward(bool v) { fsdp().set_unshard_in_backward(v); }
  void set_allocate_memory_from_process_group_for_comm(bool v) {
    fsdp().set_allocate_memory_from_process_group_for_comm(v);
  }
  void reset_iter_state() { fsdp().reset_iter_state(); }

 private:
  void mark() {
    if (!this->is_empty()) holder_token_ = detail::hold_fsdp_forward(*this->get());
  }
  std::shared_ptr<void> holder_token_;  // shared by copies; see detail::hold_fsdp_forward
};

/// Runs another entry point of a sharded module (e.g. `generate`) through FSDP's forward hooks, as a
/// module forward: unshard before, reshard after, outputs cast to mp_policy's output_dtype, gradients
/// reduce-scattered when the call's backward is done. The entry point's tensor arguments go after `fn`,
/// which receives them: they are cast by cast_forward_inputs and, when they require grad, mark where the
/// call's backward ends (captured tensors are neither: the reduce-scatter then waits for the end of
/// the backward).
///   auto y = fsdp::fsdp_forward(*model, [&](const torch::Tensor& x) { return model->generate(x); }, x);
/// `fn` returns a Tensor, a std::vector<Tensor> or a tuple of them; arguments may be tensors, vectors or
/// other values (passed through). The analogue of register_fsdp_forward_method(module, "generate").
template <typename Fn, typename... Args>
auto fsdp_forward(const torch::nn::Module& module, Fn&& fn, Args&&... args) {
  return detail::run_with_hooks(detail::state_of(module), std::forward<Fn>(fn), std::forward<Args>(args)...);
}

/// Shards the parameters of `module` (those not already managed by a sharded submodule) as one group.
/// Apply bottom-up: blocks first, the root last. Returns the FSDP API of the module. Any module works
/// (see the top of this file: implicit groups, or the holder path when the module has an
/// fsdp::FSDPModule holder).
/// Initial weights: every rank keeps its own rows of its own copy, so on a 1-D mesh every rank must
/// start from the same weights (seed every rank identically, load the same checkpoint, or set
/// FullyShardOptions::sync_module_states to broadcast rank 0's parameters and buffers). On a 2-D
/// (HSDP) mesh every replica takes the shards of replicate rank 0 (one broadcast per group, here), so
/// replicas start and stay identical; the ranks of a shard group must still agree. With FSDP_DEBUG=DETAIL
/// a checksum comparison over the shard group throws c10::Error on every rank naming the first
/// parameter that differs (skipped with sync_module_states). Collective: every rank of the mesh must call
/// it with the same modules and options; at the root's first forward the ranks compare their groups'
/// collective sizes and throw c10::Error on every rank naming the first group that differs.
/// Afterwards, between forward/backward passes, the registered parameters hold their local shard:
/// their sizes() are [rows of this rank (possibly 0), *rest] and the optimizer steps those shards.
/// Everything is validated before anything is sharded: when it throws, the module is unchanged.
/// Throws c10::Error (messages name the parameter's fully qualified name and the rank) for: a scalar
/// or non-contiguous parameter, a parameter tied to one managed by another fully_shard call (shard
/// tied modules together: fully_shard({a, b})), mixed original dtypes among trainable parameters (as
/// PyTorch: one reduction dtype per group; frozen parameters of other dtypes, e.g. an int64 index table
/// or a bf16 constant beside fp32 weights, are fine: the group is then all-gathered as bytes, in one
/// collective, as FSDP2's uint8 all-gather), a parameter of a module that makes
/// sparse gradients (torch::nn::Embedding or EmbeddingBag with sparse=true: the message names the module
/// FQN and type; pass its weight in ignored_params or use sparse=false), a mesh of more than 2 dims, a
/// module already sharded. reshard_after_forward = k not dividing the shard group size throws at the
/// first forward; a sparse gradient made by custom code (e.g. torch::embedding(..., sparse=true)) throws
/// at the end of that backward, naming the parameter, on every rank, before any gradient is reduced.
FSDPModuleAPI fully_shard(const std::shared_ptr<torch::nn::Module>& module, const FullyShardOptions& options = {});
/// Shards several modules as one group (e.g. modules that share a tied parameter). The first module
/// holds the group's state. The group is implicit unless one of the modules has an FSDPModule holder
/// (then the forward of each must go through a holder). The group's gradients are
/// reduced once per backward, after the last use of any of its modules (see the note at the top).
/// Error messages name each parameter by its path from the root once a forward ran ("emb.weight"),
/// before that by its name in its module and the module's type.
FSDPModuleAPI fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                          const FullyShardOptions& options = {});
template <typename T>
FSDPModuleAPI fully_shard(const torch::nn::ModuleHolder<T>& holder, const FullyShardOptions& options = {}) {
  return fully_shard(std::static_pointer_cast<torch::nn::Module>(holder.ptr()), options);
}

/// Which modules fully_shard_tree wraps (besides the root, which is always wrapped last). Mirrors FSDP1's
/// auto-wrap policies (torch.distributed.fsdp.wrap's ModuleWrapPolicy and size_based_auto_wrap_policy):
/// FSDP2 has none (its users call fully_shard on each module themselves), so this is a convenience.
/// Example: `fsdp::AutoWrapPolicy().module_types({"BlockImpl"})`, or `.min_num_params(1'000'000)`
struct AutoWrapPolicy {
  /// Wrap modules whose type name is in this set: Module::name() ("my::BlockImpl") or its unqualified
  /// form ("BlockImpl"). (Default: none)
  TORCH_ARG(std::unordered_set<std::string>, module_types) = {};
  /// Wrap modules whose not-yet-wrapped subtree holds at least this many parameter elements; 0 = off.
  /// (Default: 0)
  TORCH_ARG(int64_t, min_num_params) = 0;
};

/// Applies fully_shard bottom-up to every module of `root`'s tree that `policy` selects, then to
/// `root` — the same result as the manual calls, for any modules (implicit groups or holders).
/// Returns the FQNs wrapped, bottom-up ("" is the root).
std::vector<std::string> fully_shard_tree(const std::shared_ptr<torch::nn::Module>& root,
                                          const AutoWrapPolicy& policy, const FullyShardOptions& options = {});
template <typename T>
std::vector<std::string> fully_shard_tree(const torch::nn::ModuleHolder<T>& root, const AutoWrapPolicy& policy,
                                          const FullyShardOptions& options = {}) {
  return fully_shard_tree(std::static_pointer_cast<torch::nn::Module>(root.ptr()), policy, options);
}

}  // namespace fsdp
