// PipelineStage (fsdp/pipelining/stage.h): the stage's own state; the schedules run it
// (src/pipelining/schedules.cpp).
//
// [Note: pipeline shape exchange]
// PyTorch's PipelineStage infers the shapes of the messages between stages before the first step (a
// forward on meta tensors, or `input_args`/`output_args` given by the user) and assumes them for every
// later step. C++ modules cannot in general run on meta tensors, so a stage learns its input's shape from
// the stage before it instead: before the first activation of each step, the sender sends a small header
// (kMetaWords int64: a marker, the dtype, the number of dims, the dims) with its own tag, and the receiver
// allocates the activation's buffer from it. One header per stage boundary per step (a few microseconds
// beside the activations), in exchange for steps whose batch or sequence length changes (an eval batch, the
// last partial batch of an epoch) working without re-declaring anything. The gradient a stage receives has
// the shape and dtype of its own output, which it knows.
#include "fsdp/pipelining/stage.h"

#include "pipelining/stage_access.h"

namespace fsdp::pipelining {

PipelineStage::PipelineStage(std::shared_ptr<torch::nn::Module> submodule, ForwardFn forward, int stage_index,
                             int num_stages, torch::Device device, ProcessGroupPtr group)
    : submod_(std::move(submodule)),
      forward_(std::move(forward)),
      stage_index_(stage_index),
      num_stages_(num_stages),
      device_(device),
      group_(group ? std::move(group) : default_process_group()) {
  TORCH_CHECK(submod_ && forward_, "PipelineStage(stage_index=", stage_index, "): the submodule or its forward is null");
  TORCH_CHECK(group_, "PipelineStage(stage_index=", stage_index,
              "): no pipeline group: pass one (e.g. mesh->get_group(\"pp\")) or call init_process_group first");
  TORCH_CHECK(num_stages >= 1 && stage_index >= 0 && stage_index < num_stages, "PipelineStage: stage_index ",
              stage_index, " is out of range for num_stages ", num_stages, " (rank ", group_->rank(), ")");
  TORCH_CHECK(num_stages >= group_->size(), "PipelineStage(stage_index=", stage_index, "): num_stages ", num_stages,
              " is smaller than the pipeline group's size ", group_->size(),
              ": every rank of the group must hold at least one stage (rank ", group_->rank(), ")");
}

PipelineStage::~PipelineStage() {
  // Sends still in flight hold their tensors: wait for them, but never throw from a destructor.
  for (auto& w : sends_) {
    try {
      w.wait();
    } catch (...) {
    }
  }
}

void PipelineStage::scale_grads(int64_t grad_scale_factor) {
  if (grad_scale_factor == 1) return;
  torch::NoGradGuard no_grad;
  for (auto& p : submod_->parameters()) {
    if (p.grad().defined()) p.grad().div_(grad_scale_factor);
  }
}

}  // namespace fsdp::pipelining
