#include <unordered_set>
#include "parallelize.h"

#include <memory>
#include <set>

namespace train_gpt {
namespace {

/// The options of every fully_shard call: the mesh, mixed precision, CPU offload.
fsdp::FullyShardOptions shard_options(const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  auto opts = fsdp::FullyShardOptions().mesh(mesh);
  if (p.param_dtype != torch::kFloat32) {
    opts.mp_policy(fsdp::MixedPrecisionPolicy().param_dtype(p.param_dtype).reduce_dtype(torch::kFloat32));
  }
  if (p.cpu_offload) opts.offload_policy(fsdp::CPUOffloadPolicy());
  if (p.all_gather_dtype) opts.all_gather_extension_fn(fsdp::low_precision_all_gather(*p.all_gather_dtype));
  if (p.shard_dim != 0) {
    opts.shard_placement_fn([d = p.shard_dim, n = p.dp_shard](const std::string&, const torch::Tensor& w)
                                -> std::optional<fsdp::Placement> {
      if (w.dim() == 2 && w.size(d) % n == 0) return fsdp::Shard(d);
      return std::nullopt;
    });
  }
  return opts;
}

/// The options of every replicate call (--data-parallel replicate): the same mesh and policies.
fsdp::ReplicateOptions replicate_options(const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  const auto s = shard_options(mesh, p);
  return fsdp::ReplicateOptions().mesh(mesh).mp_policy(s.mp_policy()).offload_policy(s.offload_policy());
}

/// The blocks' tensor-parallel plan: Megatron-LM's layout. Each block starts and ends with a
/// replicated activation (or, with sequence parallelism, one sharded on the sequence, dim 1).
/// `mlp_seq_dim`: the sequence's dim at the MLP (PlainBlock runs its MLP on [B * T, C]: dim 0; a
/// position-wise MLP does not mind that the gathered rows come rank by rank).
fsdp::tp::ParallelizePlan block_plan(bool sp, int64_t mlp_seq_dim) {
  using namespace fsdp::tp;
  const auto seq = sp ? fsdp::Shard(1) : fsdp::Replicate();
  const auto mlp_seq = sp ? fsdp::Shard(mlp_seq_dim) : fsdp::Replicate();
  ParallelizePlan plan = {{"h.*.attn.c_attn", ColwiseParallel().input_layouts(seq)},
                          {"h.*.attn.c_proj", RowwiseParallel().output_layouts(seq)},
                          {"h.*.mlp.c_fc", ColwiseParallel().input_layouts(mlp_seq)},
                          {"h.*.mlp.c_proj", RowwiseParallel().output_layouts(mlp_seq)}};
  if (sp) {
    plan.push_back({"h.*.ln_1", SequenceParallel()});
    plan.push_back({"h.*.ln_2", SequenceParallel()});
  }
  return plan;
}

}  // namespace

int freeze_parameters(torch::nn::Module& model, const ParallelOptions& p) {
  if (!p.freeze) return 0;
  torch::NoGradGuard no_grad;
  int frozen = 0;
  for (auto& item : model.named_parameters()) {
    if (!std::regex_search(item.key(), *p.freeze)) continue;
    auto& w = item.value();
    w.set_requires_grad(false);
    if (w.scalar_type() != p.frozen_dtype) w.set_data(w.to(p.frozen_dtype));
    ++frozen;
  }
  if (frozen == 0) throw std::invalid_argument("--freeze: no parameter name matches the regex");
  return frozen;
}

fsdp::DeviceMeshPtr make_mesh(torch::DeviceType device, int world, const ParallelOptions& p) {
  // Pipeline parallelism leads (torchtitan's order, pp outermost): the ranks of one pipeline position are
  // contiguous, pp rank r holds global ranks [r x dp_shard, (r + 1) x dp_shard).
  // The other dims keep parallelize()'s names and order, so fsdp_mesh and apply_tp find theirs.
  if (p.pp > 1) {
    return fsdp::init_device_mesh(device, {p.pp, p.dp_replicate, p.dp_shard, p.tp}, {"pp", "dp_replicate", "dp_shard", "tp"});
  }
  if (p.cp > 1) {  // torchtitan's order: ["dp_replicate", "dp_shard", "cp", "tp"]
    return fsdp::init_device_mesh(device, {p.dp_replicate, p.dp_shard, p.cp, p.tp}, {"dp_replicate", "dp_shard", "cp", "tp"});
  }
  if (p.tp == 1 && p.dp_replicate == 1) return fsdp::init_device_mesh(device, {world});
  return fsdp::init_device_mesh(device, {p.dp_replicate, p.dp_shard, p.tp}, {"dp_replicate", "dp_shard", "tp"});
}

fsdp::DeviceMeshPtr fsdp_mesh(const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  if (mesh->ndim() == 1) return mesh;
  if (p.cp > 1) return p.dp_shard == 1 ? (*mesh)["cp"] : mesh->slice({"dp_shard", "cp"});
  return p.dp_replicate > 1 ? mesh->slice({"dp_replicate", "dp_shard"}) : (*mesh)["dp_shard"];
}

// [Note: sequence boundaries in train_gpt]
// With sequence parallelism the residual stream is split along the sequence from the first block's input to the
// last block's output. The holder models (GPT, GPTStage, Llama, LlamaStage) get the split and the gather from plan
// entries at call boundaries they already have, fsdp::FSDPModule holders ([Note: module boundaries] in
// src/tensor/parallel/prepare_module.cpp): GPT's PrepareModuleInput on its first block (h.0: Replicate -> Shard(1))
// and PrepareModuleOutput on its last (Shard(1) -> Replicate); Llama's PrepareModuleOutput on model.embed_tokens
// (torchtitan's tok_embeddings RowwiseParallel(output_layouts=Shard(1)), without sharding the replicated, possibly
// tied table), SequenceParallel on model.norm, and PrepareModuleInput on lm_head (torchtitan's output
// ColwiseParallel(input_layouts=Shard(1)), the head replicated). A pipeline stage takes the entries whose module it
// holds (the first stage the split, the last the gather). The plain models (--model-impl plain) call their blocks
// through a ModuleList and their embedding and head as TORCH_MODULE members: no boundary exists there (a block's
// input also feeds its residual add, which no parameter op sees), parallelize_module refuses such an entry, and
// their forwards keep the two calls tp::distribute_sequence / gather_sequence, reading sequence_parallel_mesh.
namespace {
std::string fqn_of(const torch::nn::Module& model, const std::shared_ptr<torch::nn::Module>& m) {
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    if (item.value() == m) return item.key();
  TORCH_CHECK(false, "parallelize: a block is not a submodule of the model");
  return "";
}
}  // namespace

void apply_tp(torch::nn::Module& model, const torch::nn::ModuleList& blocks, const fsdp::DeviceMeshPtr& mesh,
              const ParallelOptions& p, fsdp::DeviceMeshPtr* sequence_parallel_mesh) {
  auto tp_mesh = (*mesh)["tp"];
  const bool plain = blocks->size() > 0 && blocks->ptr(0)->as<PlainBlockImpl>() != nullptr;
  auto plan = block_plan(p.sequence_parallel, plain ? 0 : 1);
  if (p.sequence_parallel && !plain && blocks->size() > 0) {  // [Note: sequence boundaries in train_gpt]
    using namespace fsdp::tp;
    const auto children = model.named_children();
    const bool split = children.contains("wte"), gather = children.contains("lm_head");  // the model's first / last
    const auto first = fqn_of(model, blocks->ptr(0)), last = fqn_of(model, blocks->ptr(blocks->size() - 1));
    const Layouts rep{fsdp::Replicate()}, seq{fsdp::Shard(1)};
    if (split && gather && first == last) {
      plan.push_back({first, PrepareModuleInputOutput().input_layouts(rep).desired_input_layouts(seq)
                                 .output_layouts(seq).desired_output_layouts(rep)});
    } else {
      if (split) plan.push_back({first, PrepareModuleInput().input_layouts(rep).desired_input_layouts(seq)});
      if (gather) plan.push_back({last, PrepareModuleOutput().output_layouts(seq).desired_output_layouts(rep)});
    }
  }
  fsdp::tp::parallelize_module(model.shared_from_this(), tp_mesh, plan);
  for (const auto& b : *blocks) {
    for (const auto& m : b->modules(/*include_self=*/false)) {
      if (auto* attn = m->as<CausalSelfAttentionImpl>()) attn->tp_mesh = tp_mesh;
    }
  }
  if (p.sequence_parallel) *sequence_parallel_mesh = tp_mesh;
}

void apply_loss_parallel(GPTImpl& model, const fsdp::DeviceMeshPtr& mesh) {
  using namespace fsdp::tp;
  auto tp_mesh = (*mesh)["tp"];
  // Both on wte.weight's vocabulary rows ([Note: tied TP styles] in tensor_parallel.cpp).
  parallelize_module(model.shared_from_this(), tp_mesh, {{"wte", RowwiseParallel()}, {"lm_head", ColwiseParallel()}});
  model.loss_parallel_mesh = tp_mesh;
}

void apply_dtensor_rng(GPTImpl& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p, uint64_t seed) {
  fsdp::manual_seed(seed, mesh);
  auto rng = std::make_shared<TPDropout>();
  rng->mesh = mesh;
  // The data dims shard the batch (dim 0); tp replicates, or shards the sequence (SP) or the heads.
  const bool has_tp = mesh->ndim() > 1;
  for (int64_t d = 0; d < mesh->ndim(); ++d) {
    const bool is_tp = has_tp && mesh->dim_names()[d] == "tp";
    rng->replicated.push_back(is_tp ? fsdp::Replicate() : fsdp::Shard(0));
    rng->residual.push_back(is_tp ? (p.sequence_parallel ? fsdp::Shard(1) : fsdp::Replicate()) : fsdp::Shard(0));
    rng->heads.push_back(is_tp ? fsdp::Shard(1) : fsdp::Shard(0));
  }
  model.rng = rng;
  for (auto& b : model.blocks) {
    b->attn->rng = rng;
    b->mlp->rng = rng;
  }
}

void parallelize(fsdp::FSDPModule<GPT>& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  if (p.tp > 1) apply_tp(*model, model->h, mesh, p, &model->sequence_parallel_mesh);
  if (p.loss_parallel) apply_loss_parallel(*model, mesh);
  if (p.activation_checkpointing != "none") apply_activation_checkpointing(model, p);
  apply_fsdp(model, fsdp_mesh(mesh, p), p);
}

void apply_activation_checkpointing(fsdp::FSDPModule<GPT>& model, const ParallelOptions& p) {
  for (size_t i = 0; i < model->blocks.size(); ++i) {
    if (auto options = block_checkpoint_options(p, static_cast<int64_t>(i))) fsdp::checkpoint_wrapper(model->blocks[i], *options);
  }
}

std::optional<fsdp::CheckpointOptions> block_checkpoint_options(const ParallelOptions& p, int64_t index) {
  const std::string& mode = p.activation_checkpointing;
  if (mode == "full") return p.checkpoint_options;
  if (mode == "selective-op") return fsdp::CheckpointOptions(p.checkpoint_options).context_fn(selective_op_policy);
  if (mode.rfind("layer:", 0) == 0) {
    const int64_t k = std::stoll(mode.substr(6));
    if ((index + 1) % k == 0) return p.checkpoint_options;
  }
  return std::nullopt;
}

fsdp::SelectiveCheckpointContexts selective_op_policy() {
  static const auto save = [] {
    const auto ops = fsdp::default_selective_save_list();
    return std::set<std::string>(ops.begin(), ops.end());
  }();
  auto matmuls = std::make_shared<int64_t>(0);  // this region's matrix products so far
  return fsdp::create_selective_checkpoint_contexts(
      [matmuls](const fsdp::SelectiveCheckpointContext&, const c10::OperatorHandle& op, const std::vector<c10::IValue>&) {
        const std::string& name = op.schema().name();
        const bool matmul = name == "aten::mm" || name == "aten::linear" || name == "aten::addmm" || name == "aten::matmul";
        if (matmul && ++*matmuls % 2 == 0) return fsdp::CheckpointPolicy::PREFER_RECOMPUTE;
        return save.count(name) ? fsdp::CheckpointPolicy::MUST_SAVE : fsdp::CheckpointPolicy::PREFER_RECOMPUTE;
      });
}

void apply_fsdp(fsdp::FSDPModule<GPT>& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  if (p.replicate) {
    const auto ropts = replicate_options(mesh, p);
    for (auto& block : model->blocks) fsdp::replicate(block, ropts);  // one all-reduce per block
    fsdp::replicate(model, ropts);
    return;
  }
  const auto opts = shard_options(mesh, p);
  // 1. Blocks, bottom-up.
  auto block_opts = opts;
  block_opts.reshard_after_forward(p.reshard_after_forward);
  for (auto& block : model->blocks) fsdp::fully_shard(block, block_opts);
  // 2. The root last (its default reshard_after_forward: false).
  fsdp::fully_shard(model, opts);
}

void parallelize(fsdp::FSDPModule<GPTStage>& stage, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  if (p.tp > 1) {  // the blocks' plan as for the whole model ("h.*.attn.c_attn" matches the stage's "h.5...")
    torch::nn::ModuleList blocks;  // apply_tp's view of the stage's blocks (a temporary second parent)
    for (const auto& b : stage->h->values()) blocks->push_back(b);
    apply_tp(*stage, blocks, mesh, p, &stage->sequence_parallel_mesh);
  }
  // Activation checkpointing by the block's index in the whole model (layer:K counts as for --pp 1).
  const auto keys = stage->h->keys();
  for (size_t i = 0; i < keys.size(); ++i) {
    if (auto options = block_checkpoint_options(p, std::stoll(keys[i]))) fsdp::checkpoint_wrapper(stage->blocks[i], *options);
  }
  const auto opts = shard_options(fsdp_mesh(mesh, p), p);
  auto block_opts = opts;
  block_opts.reshard_after_forward(p.reshard_after_forward);
  for (auto& block : stage->blocks) fsdp::fully_shard(block, block_opts);
  fsdp::fully_shard(stage, opts);  // the stage's root last: wte/wpe and/or ln_f/lm_head (none on a middle stage)
}

void parallelize(PlainGPTStage& stage, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  if (p.tp > 1) {
    torch::nn::ModuleList blocks;
    for (const auto& b : stage->h->values()) blocks->push_back(b);
    apply_tp(*stage, blocks, mesh, p, &stage->sequence_parallel_mesh);
  }
  for (const auto& item : stage->h->items()) {
    if (auto options = block_checkpoint_options(p, std::stoll(item.first))) fsdp::checkpoint_wrapper(item.second, *options);
  }
  const auto opts = shard_options(fsdp_mesh(mesh, p), p);
  auto block_opts = opts;
  block_opts.reshard_after_forward(p.reshard_after_forward);
  for (const auto& block : stage->h->values()) fsdp::fully_shard(block, block_opts);
  fsdp::fully_shard(stage, opts);
}

namespace {
// Llama's tensor-parallel plan (torchtitan's parallelize_llama apply_tp): q/k/v, gate and up column-parallel, o and
// down row-parallel; with sequence parallelism the RMSNorms run on the rank's positions ([Note: SequenceParallel on a
// user's norm] in src/tensor/parallel/tensor_parallel.cpp) and the projections gather their input along the sequence
// (input_layouts Shard(1), one all-gather per projection: torchtitan gathers once per attention/MLP through
// PrepareModuleInput, which needs the attention and MLP called through holders), and the boundaries of
// [Note: sequence boundaries in train_gpt]. The attention computes n_head / tp heads (LlamaAttentionImpl::forward
// reads the local head count from the projections' outputs).
void apply_tp_llama(torch::nn::Module& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p, bool plain,
                    fsdp::DeviceMeshPtr* sequence_parallel_mesh) {
  using namespace fsdp::tp;
  auto tp_mesh = (*mesh)["tp"];
  const bool sp = p.sequence_parallel;
  const auto seq = sp ? fsdp::Shard(1) : fsdp::Replicate();
  ParallelizePlan plan;
  for (const char* name : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"})
    plan.push_back({std::string("model.layers.*.") + name, ColwiseParallel().input_layouts(seq)});
  for (const char* name : {"self_attn.o_proj", "mlp.down_proj"})
    plan.push_back({std::string("model.layers.*.") + name, RowwiseParallel().output_layouts(seq)});
  if (sp) {
    plan.push_back({"model.layers.*.input_layernorm", SequenceParallel()});
    plan.push_back({"model.layers.*.post_attention_layernorm", SequenceParallel()});
    if (!plain) {  // the plain forwards split and gather themselves (before model.norm, which then sees it whole)
      std::unordered_set<std::string> names;
      for (const auto& item : model.named_modules("", /*include_self=*/false)) names.insert(item.key());
      const Layouts rep{fsdp::Replicate()}, sharded{fsdp::Shard(1)};
      if (names.count("model.embed_tokens")) {
        plan.push_back({"model.embed_tokens", PrepareModuleOutput().output_layouts(rep).desired_output_layouts(sharded)});
      }
      if (names.count("lm_head")) {
        plan.push_back({"model.norm", SequenceParallel()});
        plan.push_back({"lm_head", PrepareModuleInput().input_layouts(sharded).desired_input_layouts(rep)});
      }
    }
    *sequence_parallel_mesh = tp_mesh;
  }
  parallelize_module(model.shared_from_this(), tp_mesh, plan);
}
}  // namespace

void parallelize(fsdp::FSDPModule<LlamaStage>& stage, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  if (p.tp > 1) apply_tp_llama(*stage, mesh, p, /*plain=*/false, &stage->sequence_parallel_mesh);
  const auto keys = stage->layers->keys();
  for (size_t i = 0; i < keys.size(); ++i) {
    if (auto options = block_checkpoint_options(p, std::stoll(keys[i]))) fsdp::checkpoint_wrapper(stage->blocks[i], *options);
  }
  const auto opts = shard_options(fsdp_mesh(mesh, p), p);
  auto block_opts = opts;
  block_opts.reshard_after_forward(p.reshard_after_forward);
  const bool own_groups = !stage->cfg.tie_weights;  // as for Llama
  if (own_groups && !stage->embed.is_empty()) fsdp::fully_shard(stage->embed, block_opts);
  for (auto& block : stage->blocks) fsdp::fully_shard(block, block_opts);
  if (own_groups && !stage->head.is_empty()) {
    fsdp::fully_shard(stage->head, fsdp::FullyShardOptions(opts).reshard_after_forward(false));
  }
  fsdp::fully_shard(stage, opts);
}

void parallelize(PlainLlamaStage& stage, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  if (p.tp > 1) apply_tp_llama(*stage, mesh, p, /*plain=*/true, &stage->sequence_parallel_mesh);
  for (const auto& item : stage->layers->items()) {
    if (auto options = block_checkpoint_options(p, std::stoll(item.first))) fsdp::checkpoint_wrapper(item.second, *options);
  }
  const auto opts = shard_options(fsdp_mesh(mesh, p), p);
  auto block_opts = opts;
  block_opts.reshard_after_forward(p.reshard_after_forward);
  const bool own_groups = !stage->cfg.tie_weights;
  if (own_groups && stage->embed_tokens) fsdp::fully_shard(stage->embed_tokens, block_opts);
  for (const auto& layer : stage->layers->values()) fsdp::fully_shard(layer, block_opts);
  if (own_groups && stage->lm_head) {
    fsdp::fully_shard(stage->lm_head, fsdp::FullyShardOptions(opts).reshard_after_forward(false));
  }
  fsdp::fully_shard(stage, opts);
}

void parallelize(fsdp::FSDPModule<Llama>& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  if (p.tp > 1) apply_tp_llama(*model, mesh, p, /*plain=*/false, &model->sequence_parallel_mesh);
  for (size_t i = 0; i < model->blocks.size(); ++i) {
    if (auto options = block_checkpoint_options(p, static_cast<int64_t>(i))) fsdp::checkpoint_wrapper(model->blocks[i], *options);
  }
  const auto dp_mesh = fsdp_mesh(mesh, p);
  if (p.replicate) {
    const auto ropts = replicate_options(dp_mesh, p);
    for (auto& block : model->blocks) fsdp::replicate(block, ropts);
    fsdp::replicate(model, ropts);
    return;
  }
  const auto opts = shard_options(dp_mesh, p);
  auto block_opts = opts;
  block_opts.reshard_after_forward(p.reshard_after_forward);
  // Untied, the embedding and the head are groups of their own (torchtitan's parallelize_llama): the embedding is
  // freed after its forward; the head, used first in backward, stays gathered (reshard_after_forward false). Tied,
  // they are one parameter, which must live in one group: the root's.
  const bool own_groups = !model->cfg.tie_weights;
  if (own_groups) fsdp::fully_shard(model->embed, block_opts);
  for (auto& block : model->blocks) fsdp::fully_shard(block, block_opts);  // the decoder layers, bottom-up
  if (own_groups) fsdp::fully_shard(model->head, fsdp::FullyShardOptions(opts).reshard_after_forward(false));
  fsdp::fully_shard(model, opts);  // the root last: the final norm (and a tied embedding and head)
}

void parallelize(PlainLlama& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  if (p.tp > 1) apply_tp_llama(*model, mesh, p, /*plain=*/true, &model->sequence_parallel_mesh);
  auto layers = model->model->layers;
  for (int64_t i = 0; i < static_cast<int64_t>(layers->size()); ++i) {
    if (auto options = block_checkpoint_options(p, i)) fsdp::checkpoint_wrapper(layers[i], *options);
  }
  const auto dp_mesh = fsdp_mesh(mesh, p);
  if (p.replicate) {
    const auto ropts = replicate_options(dp_mesh, p);
    for (auto& layer : *layers) fsdp::replicate(layer, ropts);
    fsdp::replicate(model, ropts);
    return;
  }
  const auto opts = shard_options(dp_mesh, p);
  auto block_opts = opts;
  block_opts.reshard_after_forward(p.reshard_after_forward);
  const bool own_groups = !model->cfg.tie_weights;  // as for Llama above
  if (own_groups) fsdp::fully_shard(model->model->embed_tokens, block_opts);
  for (auto& layer : *layers) fsdp::fully_shard(layer, block_opts);  // the ModuleList's shared_ptrs
  if (own_groups) fsdp::fully_shard(model->lm_head, fsdp::FullyShardOptions(opts).reshard_after_forward(false));
  fsdp::fully_shard(model, opts);
}

void parallelize(PlainGPT& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  if (p.tp > 1) apply_tp(*model, model->h, mesh, p, &model->sequence_parallel_mesh);
  // The blocks are called by the model's own forward: checkpoint_wrapper on an unchanged module checkpoints it from
  // the ops on its parameters, no edit of the forward ([Note: implicit checkpoint regions]).
  for (int64_t i = 0; i < static_cast<int64_t>(model->h->size()); ++i) {
    if (auto options = block_checkpoint_options(p, i)) fsdp::checkpoint_wrapper(model->h[i], *options);
  }
  if (p.replicate) {
    const auto ropts = replicate_options(fsdp_mesh(mesh, p), p);
    for (auto& block : *model->h) fsdp::replicate(block, ropts);
    fsdp::replicate(model, ropts);
    return;
  }
  const auto opts = shard_options(fsdp_mesh(mesh, p), p);
  auto block_opts = opts;
  block_opts.reshard_after_forward(p.reshard_after_forward);
  for (auto& block : *model->h) fsdp::fully_shard(block, block_opts);  // the ModuleList's shared_ptrs
  fsdp::fully_shard(model, opts);
}

}  // namespace train_gpt
