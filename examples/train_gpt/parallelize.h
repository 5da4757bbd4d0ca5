// How train_gpt applies FSDP2 to its model: start reading here. parallelize() is a short list of
// apply_* steps (as torchtitan's parallelize_llama), each a few lines of the libfsdp API; everything
// else in train_gpt is the ordinary training loop around it (main.cpp).
#pragma once

#include "fsdp/fsdp.h"
#include "model.h"
#include "model_plain.h"

namespace train_gpt {

/// What parallelize() applies, decided from the command line (options.cpp: parallel_options).
struct ParallelOptions {
  torch::ScalarType param_dtype = torch::kFloat32;  ///< compute dtype of forward and backward
  fsdp::ReshardAfterForward reshard_after_forward = true;  ///< for the blocks
  bool activation_checkpointing = false;
  bool cpu_offload = false;
};

/// Applies FSDP2 to the full model, built identically on every rank, in this order:
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

/// Step 0: each block keeps only its input in forward and is recomputed in backward, after FSDP's
/// pre-backward all-gather of that block (nothing extra is gathered).
void apply_activation_checkpointing(fsdp::FSDPModule<GPT>& model);

/// Steps 1 and 2: fully_shard on each block, bottom-up, then on the root.
void apply_fsdp(fsdp::FSDPModule<GPT>& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p);

/// The same for the unchanged model (--model-impl plain, model_plain.h), exactly as PyTorch users write it:
/// fully_shard on each block of the ModuleList, then on the root; same groups, same options, same
/// collectives as for GPT. Activation checkpointing: the model's own flag (its forward wraps each block
/// call in fsdp::checkpoint), since checkpoint_wrapper needs a module called through fsdp::FSDPModule.
void parallelize(PlainGPT& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p);

}  // namespace train_gpt
