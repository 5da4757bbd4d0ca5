// fsdp::estimate_memory: per-rank peak memory of FSDP2 training, predicted before running (issue 14).
//
// In the spirit of DeepSpeed's estimate_zero3_model_states_mem_needs, which predicts the model states
// (parameters, gradients, optimizer state), but for the whole peak: what libfsdp's own allocations add
// while a step runs (the unsharded parameters of the groups alive at once, the full-size gradients and
// the reduce-scatter buffer), plus the activations, which the caller supplies (the library cannot know a
// model's activations; examples/train_gpt computes a GPT's from its config).
//
// Every byte count is in bytes. The model follows what the library allocates (src/fsdp/fsdp_param.cpp,
// fsdp_param_group.cpp, fsdp_collectives.cpp):
// - Each parameter is chunked along dim 0 into world_size shards of ceil(dim0 / world_size) rows (the
//   last ones padded or empty); a rank's padded shard is always ceil(dim0 / N) rows in the parameter's
//   own dtype. Gradients and optimizer state have the local rows: the estimate is for rank 0, which holds
//   a full ceil(dim0 / N) rows of every parameter (the most loaded rank). A 0-dim parameter counts as 1 row.
// - Unsharding a group allocates its all-gather buffer (world_size x the group's padded shards, in
//   param_dtype) and then the unsharded parameters (the same size), copies out and frees the buffer: for
//   a moment the group takes twice its unsharded size. The next group's all-gather (prefetch) is issued
//   after the copy-out: its buffer is alive beside the current group's parameters. On one host's CPU
//   ranks (cpu_shared_memory) the all-gather writes straight into the unsharded parameters, allocated at
//   its issue: no buffer, only this rank's input (1 / world_size of them) while it runs, and not even that
//   when the parameters gather in their own dtype (the shards are read where they are).
// - Groups with reshard_after_forward=false (the root by default) stay unsharded from their forward to
//   their post-backward; with reshard_after_forward=true a group is unsharded around its own forward and
//   backward (plus the one prefetched).
// - The backward produces each group's full-size gradients (compute dtype). Its post-backward reshards
//   the group, then allocates the reduce-scatter input [N, M + P] (reduce_dtype), copies the gradients
//   in (releasing them) and issues the reduce-scatter into a [M + P] output. The reduce-scatter is finished (its output
//   copied out to the sharded gradients) at the next group's post-backward: one is in flight at a time.
//   Until then the input and the backend's scratch stay (reduce_scatter_held_inputs). On one host's CPU
//   ranks (cpu_shared_memory) with gradients already in the reduce dtype (fp32 or bf16) there is no input
//   and no copy-in: the reduce-scatter reads the gradients where they are and holds them until then. The
//   root's group is the first to get gradients (the head) and the last to reduce them: its full-size
//   gradients are counted throughout the backward.
// - Optimizer state is `optimizer_bytes_per_element` per shard element of each trainable parameter
//   (AdamW with fp32 state: exp_avg + exp_avg_sq = 8). It exists from the first optimizer step on; the
//   estimate is for a steady-state step (state present). Gradients are set to none by zero_grad and
//   come back group by group as the reduce-scatters finish.
// - The step is walked as a sequence of moments: each group's forward copy-out and prefetch, and in the
//   backward each group's copy-out, the end of its backward computation, its reduce-scatter and the
//   copy-out of the previous one, with the activations still saved (the caller's total spread evenly over
//   the groups in forward order). The largest moment is peak_backward (the breakdown fields are its
//   parts, peak_moment names it); the optimizer step (states + AdamW's temporaries, two fp32 shards of the
//   largest parameter) is the other candidate. Activation-dominated models peak early in the backward,
//   parameter-dominated ones near its end.
//   It predicts the bytes alive, not the allocator's retention: CUDA's caching allocator rounds and caches
//   blocks; glibc's malloc raises its mmap threshold after each large free (up to 32 MiB), so freed
//   blocks then stay in its heap and RSS exceeds the live bytes by 10-70% on train_gpt
//   (MALLOC_MMAP_THRESHOLD_=131072 turns this off; docs/BENCHMARKS.md, "Memory estimator"). On the CPU,
//   predict RSS growth over the process baseline by passing the LibTorch runtime's own first-use memory
//   (thread pools, kernels' scratch) as runtime_overhead_bytes.
// - cpu_offload: the sharded parameters, gradients and optimizer state live in host memory. They are
//   reported as usual, and counted in total_peak only when `device_is_cpu` (on a CPU-only run host and
//   device memory are the same); otherwise offloaded_host_bytes says what the host must hold.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace fsdp {

/// One parameter as the estimator sees it: only its name, shape and dtype (meta tensors do: a model built
/// with fsdp::deferred_init can be estimated before materialize_module or before any allocation).
struct ParamInfo {
  std::string fqn;             ///< fully qualified name, e.g. "h.0.attn.c_attn.weight"
  std::vector<int64_t> shape;  ///< the full (unsharded) shape
  torch::ScalarType dtype = torch::kFloat32;  ///< the parameter's own dtype (shards, gradients)
  bool requires_grad = true;   ///< frozen parameters have no gradient and no optimizer state
};

/// One fully_shard call: the parameters it manages (by FQN, each in exactly one group).
struct ShardGroupInfo {
  std::string name;                ///< for the breakdown, e.g. the module path ("" = the root)
  std::vector<std::string> fqns;   ///< parameters of the group (FQNs from `params`)
  /// reshard_after_forward of this group; unset: MemoryEstimateOptions::reshard_after_forward.
  std::optional<bool> reshard_after_forward;
};

/// The knobs of FullyShardOptions that change memory, plus what the estimator cannot know.
struct MemoryEstimateOptions {
  int64_t world_size = 1;  ///< the shard group's size (N); must be >= 1
  bool reshard_after_forward = true;  ///< default for groups that do not set theirs
  /// MixedPrecisionPolicy: unset = the parameter's dtype (floating parameters only are cast).
  std::optional<torch::ScalarType> param_dtype, reduce_dtype;
  bool cpu_offload = false;  ///< CPUOffloadPolicy: model states on the host
  bool device_is_cpu = true;  ///< the run's device is the CPU (then host memory is the device memory)
  double optimizer_bytes_per_element = 8.0;  ///< AdamW fp32: exp_avg + exp_avg_sq = 2 x 4 bytes
  int64_t activation_bytes = 0;  ///< caller's peak activations (saved tensors + backward temporaries), bytes
  int64_t runtime_overhead_bytes = 0;  ///< caller's fixed overhead of the runtime (see the file comment), bytes
  bool grads_set_to_none = true;  ///< zero_grad() frees the gradients (LibTorch's default): none at the backward's start
  /// With device_is_cpu: the ranks share one host and its shared-memory transport (make_gloo_group's default
  /// there): each all-gather writes straight into the unsharded parameters (no output buffer beside them at
  /// the copy-out, only this rank's input while it runs) and each reduce-scatter reduces straight out of
  /// shared memory (no receive buffer). false: Gloo's sockets (several hosts, or FSDP_SHM_TRANSPORT=0).
  bool cpu_shared_memory = true;
  /// Input-sized buffers a reduce-scatter keeps until it is finished (the input itself included). Unset: 2
  /// on the CPU without cpu_shared_memory (Gloo's all-to-all: the input and an input-sized receive buffer),
  /// 1 otherwise (NCCL, one host's shared memory: the input); 0 at world size 1 (no backend: the input is
  /// copied to the output and freed).
  std::optional<int> reduce_scatter_held_inputs;
};

/// Per-rank breakdown, in bytes (rank 0, the most loaded one).
struct MemoryEstimate {
  int64_t sharded_params = 0;    ///< padded shards of every parameter, in its own dtype
  int64_t grads = 0;             ///< sharded gradients of the trainable parameters, in their own dtype
  int64_t optimizer_state = 0;   ///< optimizer_bytes_per_element x shard elements of the trainable ones
  int64_t offloaded_host = 0;    ///< with cpu_offload: params + grads + optimizer state held on the host
  // At the forward's and backward's largest moment (peak_moment):
  int64_t grads_at_peak = 0;     ///< sharded gradients alive (those reduced so far when zero_grad frees them)
  int64_t unsharded_params = 0;  ///< unsharded parameters and all-gather buffers alive, param_dtype
  int64_t unsharded_grads = 0;   ///< full-size gradients not yet reduce-scattered, compute dtype
  int64_t reduce_scatter = 0;    ///< reduce-scatter inputs, outputs and backend copies alive, reduce_dtype
  int64_t activations = 0;       ///< activations still saved (share of MemoryEstimateOptions::activation_bytes)
  int64_t peak_backward = 0;     ///< the largest moment of forward + backward, without runtime_overhead
  std::string peak_moment;       ///< which moment, e.g. "reduce-scatter of 'h.3'"
  int64_t runtime_overhead = 0;  ///< as given (MemoryEstimateOptions::runtime_overhead_bytes)
  int64_t peak_optimizer_step = 0;  ///< the optimizer-step moment, without runtime_overhead
  int64_t total_peak = 0;        ///< max(peak_backward, peak_optimizer_step) + runtime_overhead
                                 ///< (on the CPU with FSDP_CPU_BUFFER_POOL=1 in the environment both peaks
                                 ///< include an upper bound of FSDP's buffer pool: src/fsdp/fsdp_buffer_pool.h)
  int64_t padding = 0;           ///< of sharded_params: bytes of padding rows (ceil(dim0/N) x N - dim0)
  int64_t num_params = 0;        ///< elements of the full model (each parameter once)
  std::string largest_group;     ///< name of the group with the largest unsharded size
};

/// The parameters of `module` (a tied parameter once, under its first name), from sizes and dtypes only:
/// meta tensors (fsdp::deferred_init) work. Call it before fully_shard: afterwards a parameter's size is
/// its shard's.
std::vector<ParamInfo> param_infos(const torch::nn::Module& module);

/// The groups fully_shard would make when called on each module path in `sharded_modules` (each a
/// submodule path of `module` as named_modules() spells it; "" = the root): a module's group holds its
/// parameters not managed by a sharded descendant, as fully_shard does. Listed in the given order
/// (fully_shard's: children first, root last); for the estimate's prefetch order pass them in forward
/// order. Throws c10::Error naming an unknown module path.
std::vector<ShardGroupInfo> shard_groups(const torch::nn::Module& module, const std::vector<std::string>& sharded_modules);

/// Predicts per-rank memory. `groups` are in forward order (the order in which the groups unshard in the
/// forward; the root first); every FQN of a group must be in `params`, and a parameter in no group is
/// counted as replicated (not sharded: full size, never gathered). Throws c10::Error (prefixed
/// "estimate_memory:") for world_size < 1, an unknown or repeated FQN, or a negative byte count.
MemoryEstimate estimate_memory(const std::vector<ParamInfo>& params, const std::vector<ShardGroupInfo>& groups,
                               const MemoryEstimateOptions& options);

/// The activations of a model made of repeated blocks (transformer layers), as the caller counts them from its
/// forward: bytes of one microbatch on one rank, in the compute dtype. For activation_peak_bytes.
/// Example: `fsdp::ActivationProfile p; p.blocks = 12; p.block_saved = 16 * btc; p.block_input = btc;` (btc: bytes of one B x T x C activation)
struct ActivationProfile {
  int64_t blocks = 0;           ///< repeated blocks, each one checkpoint region when checkpointed
  int64_t block_saved = 0;      ///< what one block's ops save for backward without checkpointing (its input included)
  int64_t block_input = 0;      ///< one block's input: all that a fully checkpointed block keeps
  int64_t block_selective = 0;  ///< what a selectively checkpointed block keeps: its input and the saved ops' outputs
  int64_t other_saved = 0;      ///< saved outside the blocks (embeddings, final norm, head, loss)
  int64_t head_backward_temporary = 0;   ///< the backward's temporaries before the blocks' (the loss's gradients)
  int64_t block_backward_temporary = 0;  ///< one block's backward temporaries (gradients of its largest ops)
};

/// Activation checkpointing of the blocks, as torchtitan's modes: none; full (each block one region, `every`-th
/// block only when every > 1: torchtitan's "layer every K"); selective (each block one region whose policy keeps
/// some ops' outputs: ActivationProfile::block_selective).
/// Example: `fsdp::ActivationCheckpointing{fsdp::ActivationCheckpointing::Mode::full, /*every=*/2}` (train_gpt's layer:2)
struct ActivationCheckpointing {
  enum class Mode { none, full, selective };
  Mode mode = Mode::none;
  int64_t every = 1;  ///< with full: blocks every, 2 x every, ... (counted from 1) are checkpointed
};

/// Peak activation bytes of one forward + backward under `ac`: the larger of two moments. The backward's start:
/// every block's kept tensors, the rest of the model's, the loss's gradients. The backward of the last
/// checkpointed block (none: of the last block): the blocks' kept tensors, the block's recomputed ones (what it
/// saves without checkpointing less what it kept) and its backward temporaries; the head's saved tensors are
/// freed by then (counting them at both moments over-predicted checkpointed runs by 5-12%). Pass the result as
/// MemoryEstimateOptions::activation_bytes. Throws c10::Error for a negative byte count, every < 1, or a kept
/// size above block_saved.
/// Example: `eo.activation_bytes = fsdp::activation_peak_bytes(profile, {fsdp::ActivationCheckpointing::Mode::selective});`
int64_t activation_peak_bytes(const ActivationProfile& profile, const ActivationCheckpointing& ac = {});

/// A table of `e`, one row per component in MiB (2^20 bytes), for printing.
std::string format_memory_estimate(const MemoryEstimate& e);

}  // namespace fsdp
