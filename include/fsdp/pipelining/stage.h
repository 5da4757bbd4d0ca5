// One stage of a pipeline-parallel model: a submodule, its place in the pipeline, and the messages it
// exchanges with its neighbours.
//
// Mirrors torch.distributed.pipelining.PipelineStage. A stage is any LibTorch module whose forward takes
// one tensor and returns one tensor (unchanged models included; fully_shard'ed or tensor-parallel
// submodules too): the first stage takes the microbatch's input, the others the previous stage's output;
// the last stage's output goes to the loss. Shapes are not declared: before the first microbatch of each
// step, a stage tells the next one the dtype and shape of its output (see [Note: pipeline shape
// exchange] in src/pipelining/stage.cpp), so a batch of another size in a later step works.
// The schedule (schedules.h) drives the stage; users only build it and pass it to a schedule.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "fsdp/c10d/collectives.h"
#include "fsdp/c10d/distributed.h"

namespace fsdp::pipelining {

class PipelineStage;
namespace detail {
struct StageAccess;  // the schedules' entry points (src/pipelining/stage_access.h)
}

/// A pipeline stage. Not copyable; keep it alive while a schedule uses it.
class PipelineStage {
 public:
  /// The stage's forward: one tensor in, one tensor out.
  using ForwardFn = std::function<torch::Tensor(const torch::Tensor&)>;

  /// `submodule`: this stage's part of the model; `forward` runs it (Default for the templated
  /// constructors: `submodule->forward(x)`, which works for torch::nn::Sequential and any module whose
  /// forward takes and returns one tensor). `stage_index` in [0, num_stages): its position in the
  /// pipeline. `device`: where it computes (inputs received from other stages are placed there).
  /// `group`: the pipeline group (one rank per pipeline position, e.g. `mesh->get_group("pp")`;
  /// Default: the default process group). Which rank holds which stage is chosen by the schedule:
  /// stage i on group rank i % group size for the looped schedules, the "V" for ScheduleZBVZeroBubble
  /// (stage_ids_this_rank() in schedules.h). Throws c10::Error for a stage index out of range,
  /// num_stages < group size, a null submodule or forward.
  /// Mirrors torch.distributed.pipelining.PipelineStage(submodule, stage_index, num_stages, device, group=group).
  /// Example: `fsdp::pipelining::PipelineStage stage(part, pp_rank, 4, torch::kCPU, mesh->get_group("pp"));`
  PipelineStage(std::shared_ptr<torch::nn::Module> submodule, ForwardFn forward, int stage_index, int num_stages,
                torch::Device device, ProcessGroupPtr group = nullptr);
  template <typename M>
  PipelineStage(std::shared_ptr<M> submodule, int stage_index, int num_stages, torch::Device device,
                ProcessGroupPtr group = nullptr)
      : PipelineStage(submodule, [m = submodule.get()](const torch::Tensor& x) -> torch::Tensor { return m->forward(x); },
                      stage_index, num_stages, device, std::move(group)) {}
  template <typename M>
  PipelineStage(const torch::nn::ModuleHolder<M>& submodule, int stage_index, int num_stages, torch::Device device,
                ProcessGroupPtr group = nullptr)
      : PipelineStage(submodule.ptr(), stage_index, num_stages, device, std::move(group)) {}
  ~PipelineStage();
  PipelineStage(const PipelineStage&) = delete;
  PipelineStage& operator=(const PipelineStage&) = delete;

  int stage_index() const { return stage_index_; }
  int num_stages() const { return num_stages_; }
  bool is_first() const { return stage_index_ == 0; }
  bool is_last() const { return stage_index_ == num_stages_ - 1; }
  /// This rank's rank in the pipeline group, and the group's size.
  int group_rank() const { return group_->rank(); }
  int group_size() const { return group_->size(); }
  const ProcessGroupPtr& group() const { return group_; }
  torch::Device device() const { return device_; }
  /// The stage's module (e.g. for its parameters, an optimizer, a state dict).
  const std::shared_ptr<torch::nn::Module>& submod() const { return submod_; }

  /// Divides the gradients of the stage's parameters by `grad_scale_factor` (the schedules call it once
  /// per step with the number of microbatches, when the loss is a mean: see PipelineSchedule).
  /// Mirrors PipelineStage.scale_grads.
  void scale_grads(int64_t grad_scale_factor);

 private:
  friend struct detail::StageAccess;
  struct Microbatch {
    torch::Tensor input;   // this stage's input (a leaf that requires grad, on non-first stages)
    torch::Tensor output;  // its output (the loss on the last stage)
    bool input_grad_done = false;  // zero bubble: the input-gradient pass ran
  };
  std::shared_ptr<torch::nn::Module> submod_;
  ForwardFn forward_;
  int stage_index_;
  int num_stages_;
  torch::Device device_;
  ProcessGroupPtr group_;
  std::function<int(int)> stage_to_rank_;  // set by the schedule
  // Per step.
  std::map<int, Microbatch> microbatches_;
  std::map<int, torch::Tensor> received_grads_;   // kept between a zero-bubble I and W
  std::vector<torch::Tensor> outputs_;             // last stage: the microbatches' outputs (detached)
  std::vector<torch::Tensor> losses_;              // last stage: the microbatches' losses (detached)
  c10::ScalarType in_dtype_ = torch::kFloat;       // this step's input, from the previous stage
  std::vector<int64_t> in_shape_;
  bool in_meta_known_ = false;
  std::vector<Work> sends_;
};

}  // namespace fsdp::pipelining
