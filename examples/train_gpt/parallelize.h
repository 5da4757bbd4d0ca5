// How train_gpt applies FSDP2 to its model: start reading here. parallelize() is a short list of
// apply_* steps (as torchtitan's parallelize_llama), each a few lines of the libfsdp API; everything
// else in train_gpt is the ordinary training loop around it (main.cpp).
#pragma once

#include <regex>

#include "fsdp/fsdp.h"
#include "model.h"
#include "model_llama.h"
#include "model_plain.h"

namespace train_gpt {

/// What parallelize() applies, decided from the command line (options.cpp: parallel_options).
struct ParallelOptions {
  torch::ScalarType param_dtype = torch::kFloat32;  ///< compute dtype of forward and backward
  fsdp::ReshardAfterForward reshard_after_forward = true;  ///< for the blocks
  std::string activation_checkpointing = "none";  ///< none | full | selective-op | layer:K
  fsdp::CheckpointOptions checkpoint_options;  ///< for each checkpointed block's region (--checkpoint-impl)
  bool cpu_offload = false;
  int tp = 1;             ///< tensor-parallel ranks (the mesh's "tp" dim)
  int cp = 1;             ///< context-parallel ranks (the mesh's "cp" dim, between dp_shard and tp)
  int dp_replicate = 1;   ///< HSDP replicas (the mesh's "dp_replicate" dim)
  int dp_shard = 1;       ///< FSDP ranks (the mesh's "dp_shard" dim)
  int pp = 1;             ///< pipeline ranks (the mesh's leading "pp" dim; pipeline.h)
  std::string pp_schedule = "1f1b";  ///< --pp-schedule
  int pp_microbatches = 1;   ///< microbatches per step and data-parallel rank (resolved: never 0)
  int stages_per_rank = 1;   ///< pipeline stages per pp rank (resolved: never 0)
  int num_stages() const { return pp * stages_per_rank; }
  /// The ranks that draw different batches: the FSDP (and HSDP) ranks, not the TP or PP ranks of one batch.
  int data_ranks(int world) const { return world / (tp * pp * cp); }
  bool sequence_parallel = false;
  /// wte RowwiseParallel and the tied lm_head ColwiseParallel: the model returns vocabulary-sharded logits,
  /// which lm_loss reduces with fsdp::tp::vocab_parallel_cross_entropy (issue 35).
  bool loss_parallel = false;
  /// Dropout from the DTensor RNG (fsdp::random, seeded with --seed on the mesh): forced by --tp with dropout.
  bool dtensor_rng = false;
  bool replicate = false;  ///< fsdp::replicate instead of fully_shard (--data-parallel replicate)
  std::optional<torch::ScalarType> all_gather_dtype;  ///< LowPrecisionAllGather of the weight matrices
  int shard_dim = 0;  ///< shard_placement_fn: 2-D weights on this dim where it divides by dp_shard
  std::optional<std::regex> freeze;                ///< parameters frozen before sharding (--freeze)
  torch::ScalarType frozen_dtype = torch::kFloat32;  ///< their dtype (--frozen-dtype)
};

/// --freeze: the parameters whose name matches p.freeze stop requiring grad and take p.frozen_dtype, before
/// any sharding (a frozen bf16 parameter beside fp32 weights makes its group gather bytes, as FSDP2's uint8
/// all-gather). Returns the number of parameters frozen; throws UsageError-like std::invalid_argument when
/// none matches (a typo would silently train everything).
int freeze_parameters(torch::nn::Module& model, const ParallelOptions& p);

/// The device mesh of a run: 1-D over every rank for FSDP alone, (pp, dp_shard) with --pp > 1, else
/// (dp_replicate, dp_shard, tp) with those names (sizes of 1 allowed). Collective over the world.
fsdp::DeviceMeshPtr make_mesh(torch::DeviceType device, int world, const ParallelOptions& p);
/// FSDP's mesh: the whole 1-D mesh, mesh["dp_shard"], or the (dp_replicate, dp_shard) slice for HSDP. With
/// --cp the gradients must be averaged over cp too (torchtitan flattens dp_shard and cp into "dp_shard_cp"):
/// mesh["cp"] when dp_shard is 1 (FSDP over the cp ranks), else the (dp_shard, cp) slice as an HSDP mesh
/// (replicated over dp_shard, sharded over cp: the same gradients, more parameter memory than one flat group).
fsdp::DeviceMeshPtr fsdp_mesh(const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p);

/// Applies FSDP2 (with --tp, tensor parallelism first) to the full model, built identically on every
/// rank, in this order:
///   -1. with tp > 1, apply_tp: in each block, c_attn and mlp.c_fc column-parallel, attn.c_proj and
///      mlp.c_proj row-parallel over mesh["tp"] (each TP rank computes H / tp heads and 4C / tp MLP
///      features; one all-reduce after each projection, in forward and backward); with
///      sequence_parallel, ln_1 and ln_2 on sequence-sharded activations (the all-reduces become
///      all-gathers and reduce-scatters). The root's modules (wpe, ln_f; wte and lm_head without
///      loss_parallel) are not tensor-parallel: every TP rank computes them, FSDP shards them over dp;
///      with loss_parallel (the default with --tp where it applies) apply_loss_parallel makes wte and the
///      tied lm_head vocabulary-parallel; with dropout, apply_dtensor_rng (called by main) seeds the masks;
///   0. activation checkpointing of each block (apply_activation_checkpointing);
///   1. each block becomes a fully_shard group of its own: in forward and backward only one block's
///      parameters (plus the prefetched next one) are gathered at a time;
///   2. the root last: what is left (wte, wpe, ln_f, lm_head) forms one group. lm_head.weight is
///      wte.weight when tied, and tied parameters must live in one group: so neither wte nor lm_head
///      is sharded on its own. The root keeps its parameters gathered between forward and backward
///      (reshard_after_forward false, FSDP2's default for the root): backward needs them first.
/// Mixed precision: parameters are gathered and used in `param_dtype`, gradients reduced in fp32, the
/// sharded parameters and the optimizer state stay fp32.
void parallelize(fsdp::FSDPModule<GPT>& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p);

/// Step -1 (tp > 1): parallelize_module over mesh["tp"] with the plan above, then each block's attention
/// is told its TP mesh (it computes its local heads: CausalSelfAttentionImpl::tp_mesh) and, with
/// sequence parallelism, the model its TP mesh (the residual stream is split along the sequence before
/// the first block and gathered after the last: sequence_parallel_mesh). Works on either model.
/// loss_parallel (issue 35; after apply_tp): wte RowwiseParallel (vocabulary rows) and the tied lm_head
/// ColwiseParallel on the same rows over mesh["tp"], so the model returns vocabulary-sharded logits in training
/// (GPTImpl::loss_parallel_mesh) and lm_loss reduces them with fsdp::tp::vocab_parallel_cross_entropy: the
/// [B, T, vocab] logits and their gradient are never whole on a rank.
void apply_loss_parallel(GPTImpl& model, const fsdp::DeviceMeshPtr& mesh);

/// The DTensor RNG for dropout (--tp with --dropout, or --dtensor-rng): fsdp::manual_seed(seed, mesh) and each
/// dropping module told how its activation lies on `mesh` (TPDropout): batch Shard(0) on the data dims;
/// replicated, sequence-sharded (SP) or head-sharded on tp. Collective over the mesh (the seed check).
void apply_dtensor_rng(GPTImpl& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p, uint64_t seed);

void apply_tp(torch::nn::Module& model, const torch::nn::ModuleList& blocks, const fsdp::DeviceMeshPtr& mesh,
              const ParallelOptions& p, fsdp::DeviceMeshPtr* sequence_parallel_mesh);

/// Step 0: each block keeps only its input in forward and is recomputed in backward, after FSDP's
/// pre-backward all-gather of that block (nothing extra is gathered).
void apply_activation_checkpointing(fsdp::FSDPModule<GPT>& model, const ParallelOptions& p);

/// The checkpoint options of block `index` for p.activation_checkpointing (torchtitan's modes), or none:
/// full: every block; layer:K: blocks K, 2K, ... (counted from 1, as torchtitan); selective-op: every block,
/// with selective_op_policy().
std::optional<fsdp::CheckpointOptions> block_checkpoint_options(const ParallelOptions& p, int64_t index);

/// torchtitan's selective "op" policy: the outputs of fsdp::default_selective_save_list()'s ops are saved,
/// except every second matrix product of a region (counted per region), which is recomputed with the rest.
fsdp::SelectiveCheckpointContexts selective_op_policy();

/// Steps 1 and 2: fully_shard on each block, bottom-up, then on the root.
void apply_fsdp(fsdp::FSDPModule<GPT>& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p);

/// The same for Llama (model_llama.h), with the same options, in torchtitan's layout: untied, model.embed_tokens a
/// group, each decoder layer (model.layers.N) a group (activation checkpointing per layer first), lm_head a group
/// kept gathered from forward to backward, then the root (model.norm; tied, also the embedding and the head, one
/// parameter, which must stay in one group). No tensor parallelism (refused in options.cpp).
/// Example: `parallelize(model, mesh, s.parallel)` for a fsdp::FSDPModule<Llama> built on every rank alike.
void parallelize(fsdp::FSDPModule<Llama>& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p);

/// The same for the unchanged Llama (--model-impl plain): fully_shard on each element of model.layers, then the
/// root, exactly as PyTorch users write it; activation checkpointing by checkpoint_wrapper on the unchanged layers.
void parallelize(PlainLlama& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p);

/// The same for one pipeline stage (--pp, pipeline.h) over the mesh's dp_shard dim: fully_shard on each of
/// the stage's blocks, then on the stage (its embeddings and/or final norm and head), as apply_fsdp does for
/// the whole model, after activation checkpointing of its blocks (block_checkpoint_options by each block's index
/// in the whole model). Each stage is an FSDP root of its own; the schedule drives its gradient sync.
void parallelize(fsdp::FSDPModule<GPTStage>& stage, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p);
/// The same for a stage of the unchanged model (--model-impl plain): fully_shard on each block of the stage's
/// "h", then on the stage.
void parallelize(PlainGPTStage& stage, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p);
/// The same for a Llama stage, in Llama's layout (parallelize(FSDPModule<Llama>&) above): untied, the embedding
/// (first stage) and the head (last stage, kept gathered from forward to backward) are groups of their own; each
/// decoder layer a group; then the stage's root (model.norm; tied, also the embedding or the head's copy).
void parallelize(fsdp::FSDPModule<LlamaStage>& stage, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p);
/// The same for a stage of the unchanged Llama (--model-impl plain).
void parallelize(PlainLlamaStage& stage, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p);

/// The same for the unchanged model (--model-impl plain, model_plain.h), exactly as PyTorch users write it:
/// fully_shard on each block of the ModuleList, then on the root; same groups, same options, same
/// collectives as for GPT. Activation checkpointing: the model's own flag (its forward wraps each block
/// call in fsdp::checkpoint), since checkpoint_wrapper needs a module called through fsdp::FSDPModule.
void parallelize(PlainGPT& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p);

}  // namespace train_gpt
