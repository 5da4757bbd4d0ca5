// Pipeline schedules: in which order each rank runs the forward and backward of its stages'
// microbatches, and the step that runs them.
//
// Mirrors torch.distributed.pipelining's schedules (schedules.py): ScheduleGPipe, Schedule1F1B (one
// stage per rank), ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble (several stages per rank,
// stage i on rank i % ranks) and ScheduleZBVZeroBubble (two stages per rank in a "V": rank r holds
// stages r and 2p-1-r). Each schedule's order of actions per rank (pipeline_order()) is PyTorch's own
// (tests/python/test_pipelining_orders.py compares them), so the same microbatches meet the same
// gradients in the same order.
//
// Semantics as PyTorch's: step() splits the batch into n_microbatches along dim 0, runs the actions,
// and on the last stage computes loss_fn(output, target) per microbatch. The backward of each
// microbatch's loss is unscaled; after the last backward each stage's gradients are divided by the
// number of microbatches (scale_grads, default true: right for a mean loss), so a step's gradients are
// those of the mean of the microbatch losses, the one-process gradients of the whole batch.
// Zero-bubble schedules split a backward into I (the input's gradient, sent to the previous stage at
// once) and W (the weights' gradients, later, filling bubbles): see [Note: zero-bubble backward].
// With fully_shard inside a stage, the gradients are reduced once per step, at the stage's last
// backward (earlier ones accumulate unsharded gradients without reduce-scatter: as PyTorch's
// set_requires_gradient_sync(False) / set_reshard_after_backward(False) per microbatch).
// Failures: a rank whose peer died, stalled or sent something else fails within the pipeline group's
// timeout, naming its stage, the action ("1F3": stage 1, forward, microbatch 3) and the message.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "fsdp/pipelining/stage.h"

namespace fsdp::pipelining {

/// What an action computes. Mirrors _ComputationType: FORWARD "F", FULL_BACKWARD "B", BACKWARD_INPUT
/// "I", BACKWARD_WEIGHT "W".
enum class ComputationType { FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT };

/// One action of a schedule: a computation of one stage on one microbatch. Mirrors _Action.
struct Action {
  int stage_index = 0;
  ComputationType computation_type = ComputationType::FORWARD;
  int microbatch_index = 0;
  /// "1F3" as PyTorch prints it (stage, type, microbatch).
  std::string str() const;
  bool operator==(const Action& o) const {
    return stage_index == o.stage_index && computation_type == o.computation_type &&
           microbatch_index == o.microbatch_index;
  }
};

/// The order of one rank's actions; std::nullopt marks an idle slot (as PyTorch's None), kept so that
/// orders print aligned across ranks.
using RankOrder = std::vector<std::optional<Action>>;

/// loss_fn(output of the last stage for one microbatch, target of that microbatch) -> 0-dim loss.
using LossFn = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

/// Splits `batch` along dim 0 into `n_microbatches` equal views. Throws c10::Error naming both numbers
/// when the batch's size does not divide (PyTorch's tensor_split would make uneven microbatches, whose
/// mean-of-means is not the batch's mean). Mirrors pipelining.microbatch.split_args_kwargs_into_chunks
/// for one tensor. Example: `auto mbs = split_into_microbatches(x, 4);`
std::vector<torch::Tensor> split_into_microbatches(const torch::Tensor& batch, int n_microbatches);

/// The base of the schedules. Not copyable; holds references to its stages.
class PipelineSchedule {
 public:
  virtual ~PipelineSchedule();
  PipelineSchedule(const PipelineSchedule&) = delete;
  PipelineSchedule& operator=(const PipelineSchedule&) = delete;

  /// Runs one training step (forward and backward of every microbatch of this rank's stages). Every
  /// rank of the pipeline group calls it. `input`: the whole batch, [B, ...], on the rank holding
  /// stage 0 (ignored elsewhere); `target`: [B, ...] on the rank holding the last stage (required
  /// there when a loss_fn was given). B must divide by n_microbatches. `losses`, when given, receives
  /// on the last stage's rank the n_microbatches losses (detached 0-dim tensors, unscaled), as
  /// PyTorch's `losses` list; it is cleared on other ranks. Returns, on the last stage's rank, the
  /// microbatches' outputs concatenated along dim 0 (detached); an undefined tensor elsewhere.
  /// Gradients accumulate into the stages' parameters' .grad (zero them between steps as usual).
  /// Throws c10::Error naming the stage, the action and the message when a peer fails or stalls
  /// (within the group's timeout), or for a missing input/target or a batch that does not divide.
  /// Mirrors _PipelineSchedule.step(*args, target=..., losses=...).
  /// Example: `std::vector<torch::Tensor> losses; schedule.step(x, y, &losses);`
  torch::Tensor step(const torch::Tensor& input = {}, const torch::Tensor& target = {},
                     std::vector<torch::Tensor>* losses = nullptr);

  /// Every rank's order of actions (the same on every rank). Mirrors `pipeline_order`.
  const std::map<int, RankOrder>& pipeline_order() const { return order_; }
  /// PyTorch's printout of the order: one line per rank, actions separated by spaces, idle slots as "_".
  std::string format_pipeline_order() const;
  int n_microbatches() const { return n_microbatches_; }
  /// The name as train_gpt's --pp-schedule spells it ("gpipe", "1f1b", ...).
  virtual std::string name() const = 0;

  /// Seconds this rank spent waiting for its neighbours' messages in the last step (the bubble, with
  /// the transfer time), and the step's wall time. For the benchmark's bubble fraction.
  double last_step_wait_seconds() const { return wait_s_; }
  double last_step_seconds() const { return step_s_; }

 protected:
  PipelineSchedule(std::vector<PipelineStage*> stages, int n_microbatches, LossFn loss_fn, bool scale_grads,
                   const char* name);
  /// Rank of the pipeline group holding stage i.
  std::function<int(int)> stage_to_rank_;
  std::map<int, RankOrder> order_;
  std::vector<PipelineStage*> stages_;  // this rank's stages
  int n_microbatches_;
  int num_stages_;
  int pp_size_;
  LossFn loss_fn_;
  bool scale_grads_;
  double wait_s_ = 0, step_s_ = 0;
  /// Validates the stages (same group, same num_stages, each on the rank the mapping gives) and orders.
  void finish_init();
};

/// All forwards, then all backwards (activations of all n microbatches live at once).
/// Mirrors torch.distributed.pipelining.ScheduleGPipe(stage, n_microbatches, loss_fn, scale_grads=True).
/// Example: `fsdp::pipelining::ScheduleGPipe schedule(stage, 4, loss_fn);`
class ScheduleGPipe : public PipelineSchedule {
 public:
  ScheduleGPipe(PipelineStage& stage, int n_microbatches, LossFn loss_fn = {}, bool scale_grads = true);
  std::string name() const override { return "gpipe"; }
};

/// One forward, one backward in the steady state: stage s holds at most p - s microbatches of
/// activations. Throws c10::Error when n_microbatches < the number of stages (as PyTorch).
/// Mirrors torch.distributed.pipelining.Schedule1F1B.
/// Example: `fsdp::pipelining::Schedule1F1B schedule(stage, 8, loss_fn);`
class Schedule1F1B : public PipelineSchedule {
 public:
  Schedule1F1B(PipelineStage& stage, int n_microbatches, LossFn loss_fn = {}, bool scale_grads = true);
  std::string name() const override { return "1f1b"; }
};

/// Interleaved 1F1B (Narayanan et al. 2021) over several stages per rank (stage i on rank i % p),
/// depth first, with PyTorch's relaxed microbatch rule: rounds = max(1, n / p), n divisible by rounds.
/// Mirrors torch.distributed.pipelining.ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn).
/// Example: `fsdp::pipelining::ScheduleInterleaved1F1B schedule({&s0, &s1}, 8, loss_fn);`
class ScheduleInterleaved1F1B : public PipelineSchedule {
 public:
  ScheduleInterleaved1F1B(std::vector<PipelineStage*> stages, int n_microbatches, LossFn loss_fn = {},
                          bool scale_grads = true);
  std::string name() const override { return "interleaved-1f1b"; }
};

/// Interleaved zero bubble (Qi et al. 2023, ZB1P): interleaved 1F1B with backwards split into I and W,
/// W deferred. Mirrors torch.distributed.pipelining.ScheduleInterleavedZeroBubble.
/// Example: `fsdp::pipelining::ScheduleInterleavedZeroBubble schedule({&s0, &s1}, 8, loss_fn);`
class ScheduleInterleavedZeroBubble : public PipelineSchedule {
 public:
  ScheduleInterleavedZeroBubble(std::vector<PipelineStage*> stages, int n_microbatches, LossFn loss_fn = {},
                                bool scale_grads = true);
  std::string name() const override { return "interleaved-zero-bubble"; }
};

/// Zero bubble "V" (ZBV): exactly two stages per rank, rank r holding stages r and 2p-1-r, so the
/// last stage and the first share rank 0. Mirrors torch.distributed.pipelining.ScheduleZBVZeroBubble.
/// Example: `fsdp::pipelining::ScheduleZBVZeroBubble schedule({&s_r, &s_2p_1_r}, 8, loss_fn);`
class ScheduleZBVZeroBubble : public PipelineSchedule {
 public:
  ScheduleZBVZeroBubble(std::vector<PipelineStage*> stages, int n_microbatches, LossFn loss_fn = {},
                        bool scale_grads = true);
  std::string name() const override { return "zbv-zero-bubble"; }
};

/// The stage indices rank `rank` of `pp_size` holds under a schedule: {rank, rank + p, ...} for the
/// looped ones, {rank, 2p-1-rank} for "zbv-zero-bubble". `schedule`: gpipe, 1f1b, interleaved-1f1b,
/// interleaved-zero-bubble, zbv-zero-bubble (PyTorch's names work too: "GPipe", "1F1B", "Interleaved1F1B",
/// "InterleavedZeroBubble", "ZBVZeroBubble"). Throws c10::Error for an unknown name (listing the known
/// ones) or a stage count the schedule cannot use. Mirrors the stage layout of torchtitan's
/// pipeline_llm. Example: `auto mine = stage_ids_this_rank("zbv-zero-bubble", pp_rank, 2, 4);`
std::vector<int> stage_ids_this_rank(const std::string& schedule, int rank, int pp_size, int num_stages);

/// Builds a schedule by name (see stage_ids_this_rank) over this rank's stages. Mirrors
/// torch.distributed.pipelining.schedules.get_schedule_class(name)(stages, n_microbatches, loss_fn).
/// Example: `auto schedule = make_schedule("1f1b", {&stage}, 8, loss_fn);`
std::unique_ptr<PipelineSchedule> make_schedule(const std::string& schedule, std::vector<PipelineStage*> stages,
                                                int n_microbatches, LossFn loss_fn = {}, bool scale_grads = true);

}  // namespace fsdp::pipelining
