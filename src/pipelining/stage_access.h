// The schedules' access to a PipelineStage's state (src/pipelining/schedules.cpp). Internal.
#pragma once

#include "fsdp/pipelining/stage.h"

namespace fsdp::pipelining::detail {

struct StageAccess {
  using Microbatch = PipelineStage::Microbatch;
  static const PipelineStage::ForwardFn& forward(PipelineStage& s) { return s.forward_; }
  static std::function<int(int)>& stage_to_rank(PipelineStage& s) { return s.stage_to_rank_; }
  static std::map<int, Microbatch>& microbatches(PipelineStage& s) { return s.microbatches_; }
  static std::map<int, torch::Tensor>& received_grads(PipelineStage& s) { return s.received_grads_; }
  static std::vector<torch::Tensor>& outputs(PipelineStage& s) { return s.outputs_; }
  static std::vector<torch::Tensor>& losses(PipelineStage& s) { return s.losses_; }
  static c10::ScalarType& in_dtype(PipelineStage& s) { return s.in_dtype_; }
  static std::vector<int64_t>& in_shape(PipelineStage& s) { return s.in_shape_; }
  static bool& in_meta_known(PipelineStage& s) { return s.in_meta_known_; }
  static std::vector<Work>& sends(PipelineStage& s) { return s.sends_; }
};

}  // namespace fsdp::pipelining::detail
