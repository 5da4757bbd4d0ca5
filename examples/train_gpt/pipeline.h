// train_gpt --pp N: pipeline parallelism (torch.distributed.pipelining through fsdp::pipelining), composed
// with FSDP over the data-parallel ranks, as torchtitan's pipeline_llm + parallelize.
//
// Layout. The mesh is (pp, dp_replicate, dp_shard, tp), pp outermost: WORLD_SIZE = --pp x --dp-replicate x
// FSDP ranks x --tp (sizes of 1 allowed). The model's blocks split into
// num_stages = --pp x --stages-per-rank stages (stage_layers: even, the first stages one block more when
// they do not divide); stage 0 also holds wte and wpe, the last stage ln_f and lm_head. Pipeline rank r
// holds the stages fsdp::pipelining::stage_ids_this_rank gives for --pp-schedule (r, r + pp, ... for the
// looped schedules; r and 2 pp - 1 - r for zbv-zero-bubble). Each stage is a GPTStage (model.h; --model-impl
// plain: a PlainGPTStage, model_plain.h; Llama: LlamaStage, PlainLlamaStage, model_llama.h) sharing the whole
// model's modules, so its parameter names are the unpipelined model's, fully_shard'ed over the
// dp_shard dim (HSDP: the (dp_replicate, dp_shard) slice) exactly as parallelize() shards the whole model (per
// block, then the stage's root), after --tp's plan on the stage's blocks (apply_tp).
//
// A step. Every rank of one pipeline (one dp coordinate) draws the same --batch-size sequences; the
// schedule splits them into --pp-microbatches microbatches, runs its order of forwards and backwards, and
// scales the gradients by 1 / microbatches, so the gradients are those of the batch's mean loss: the
// --pp 1 run's with the same global batch (tests/python/test_train_gpt_pp.py compares the losses).
// The loss lives on the last stage's rank: the step's loss (the mean of its microbatches' means) is
// summed over the data-parallel ranks with the gradient norm's collective and then over the pipeline
// ranks (the others contribute 0), so every rank logs and records the same loss.
// Gradient clipping: each rank's norm of its stages' gradients over its dp group (fsdp::clip_grad_norm_
// with max_norm inf: no clipping yet), squared and summed over the pp group, is the whole model's norm;
// every rank then scales its gradients by the same min(1, max_norm / (norm + 1e-6)), PyTorch's coefficient.
// Tied weights (the GPT presets' default): the last stage's head holds a copy of wte.weight whose gradient is
// summed with the first stage's after each backward, so both copies take the same updates ([Note: tied
// weights across stages] in pipeline.cpp).
// Checkpoints (--ckpt-dir, --resume): each rank saves and loads its own stages' parameters and optimizer state
// under the unpipelined model's keys (checkpoint_view); dcp::save writes the union of the ranks' keys, so a
// pipelined run's checkpoint is a --pp 1 run's and resumes with or without a pipeline, on any layout (tied
// weights: only between pipelined runs, since the head's copy has optimizer state of its own).
// Evaluation and sampling run the stages in order without a schedule (no gradients, rare): each stage's
// output is broadcast over the pp group from the rank holding it (evaluate_pipelined, PipelinedModel).
//
// Not supported with --pp > 1 (refused while parsing, options.cpp: check_pipeline_options):
// --data-parallel replicate, --grad-accum-steps, fp16, --sft, --init-from/--export-hf and the other
// whole-model flags, --freeze, --activation-offload. Every rank builds the whole model once (eagerly)
// before keeping its stages.
#pragma once

#include "checkpointing.h"
#include "fsdp/fsdp.h"
#include "options.h"

namespace train_gpt {

/// Trains with pipeline parallelism (s.parallel.pp > 1) on the world `pg`: the banner, the loop of
/// schedule steps, evaluations, checkpoints (`plan`: resume first), the summary and the sample, as train()
/// in main.cpp. Returns the exit code.
int train_pipelined(const RunSetup& s, const ResumePlan& plan, const fsdp::ProcessGroupPtr& pg);

}  // namespace train_gpt
