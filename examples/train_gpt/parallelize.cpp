#include "parallelize.h"

namespace train_gpt {
namespace {

/// The options of every fully_shard call: the mesh, mixed precision, CPU offload.
fsdp::FullyShardOptions shard_options(const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  auto opts = fsdp::FullyShardOptions().mesh(mesh);
  if (p.param_dtype != torch::kFloat32) {
    opts.mp_policy(fsdp::MixedPrecisionPolicy().param_dtype(p.param_dtype).reduce_dtype(torch::kFloat32));
  }
  if (p.cpu_offload) opts.offload_policy(fsdp::CPUOffloadPolicy());
  return opts;
}

}  // namespace

void parallelize(fsdp::FSDPModule<GPT>& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  if (p.activation_checkpointing) apply_activation_checkpointing(model);
  apply_fsdp(model, mesh, p);
}

void apply_activation_checkpointing(fsdp::FSDPModule<GPT>& model) {
  for (auto& block : model->blocks) fsdp::checkpoint_wrapper(block);
}

void apply_fsdp(fsdp::FSDPModule<GPT>& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  const auto opts = shard_options(mesh, p);
  // 1. Blocks, bottom-up.
  auto block_opts = opts;
  block_opts.reshard_after_forward(p.reshard_after_forward);
  for (auto& block : model->blocks) fsdp::fully_shard(block, block_opts);
  // 2. The root last (its default reshard_after_forward: false).
  fsdp::fully_shard(model, opts);
}

void parallelize(PlainGPT& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  model->activation_checkpointing = p.activation_checkpointing;
  const auto opts = shard_options(mesh, p);
  auto block_opts = opts;
  block_opts.reshard_after_forward(p.reshard_after_forward);
  for (auto& block : *model->h) fsdp::fully_shard(block, block_opts);  // the ModuleList's shared_ptrs
  fsdp::fully_shard(model, opts);
}

}  // namespace train_gpt
