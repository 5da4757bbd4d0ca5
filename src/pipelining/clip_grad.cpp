// clip_grad_norm_ over the stages of a pipeline (fsdp/pipelining/clip_grad.h).
#include "fsdp/pipelining/clip_grad.h"

#include <cmath>
#include <limits>

#include "fsdp/algorithms/clip_grad.h"
#include "fsdp/c10d/collectives.h"

namespace fsdp::pipelining {

torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm, ProcessGroupPtr pp_group,
                              double norm_type, bool error_if_nonfinite) {
  TORCH_CHECK(pp_group, "pipelining::clip_grad_norm_: the pipeline group is null");
  const bool inf_norm = std::isinf(norm_type);
  // This stage's norm over its dp/tp groups, without clipping (an infinite max_norm scales by exactly 1;
  // PyTorch's clip_grad_norm_ multiplies by the clamped coefficient too).
  auto stage_norm = fsdp::clip_grad_norm_(parameters, std::numeric_limits<double>::infinity(), norm_type, false);
  auto part = (inf_norm ? stage_norm : stage_norm.pow(norm_type)).reshape({1}).contiguous();
  all_reduce(part, *pp_group, inf_norm ? ReduceOp::MAX : ReduceOp::SUM);
  auto total = (inf_norm ? part : part.pow(1.0 / norm_type)).reshape({});
  if (error_if_nonfinite) {
    TORCH_CHECK(std::isfinite(total.item<double>()), "pipelining::clip_grad_norm_: the total norm of order ", norm_type,
                " is non-finite (", total.item<double>(), ") on pipeline rank ", pp_group->rank(),
                ". Fix: find the stage with inf/nan gradients, or pass error_if_nonfinite=false");
  }
  auto coef = torch::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0);
  torch::NoGradGuard no_grad;
  for (const auto& p : parameters) {
    if (p.grad().defined()) p.grad().mul_(coef.to(p.grad().dtype()));
  }
  return total;
}

}  // namespace fsdp::pipelining
