// Dynamic loss scaling for fp16 training of sharded models.
//
// Mirrors torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler (torch.amp.GradScaler whose
// inf/nan check is all-reduced, so that every rank skips the same steps).
#pragma once

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include "fsdp/c10d/distributed.h"

namespace fsdp {

/// Options of ShardedGradScaler; defaults as torch.amp.GradScaler.
/// Example: `fsdp::ShardedGradScaler scaler(fsdp::GradScalerOptions().init_scale(1024).growth_interval(100));`
struct GradScalerOptions {
  /// Initial scale factor. (Default: 65536.0)
  TORCH_ARG(double, init_scale) = 65536.0;
  /// Factor the scale grows by after `growth_interval` consecutive finite steps. (Default: 2.0)
  TORCH_ARG(double, growth_factor) = 2.0;
  /// Factor the scale shrinks by after a step with inf/nan gradients. (Default: 0.5)
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Consecutive finite steps before the scale grows. (Default: 2000)
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// When false, scale() returns its input and step() just steps. (Default: true)
  TORCH_ARG(bool, enabled) = true;
};

/// Usage, once per step:
///   scaler.scale(loss).backward();
///   scaler.unscale_(opt);                 // optional, e.g. before fsdp::clip_grad_norm_
///   scaler.step(opt);                     // skipped on every rank if any rank saw inf/nan
///   scaler.update();
class ShardedGradScaler {
 public:
  /// `group`: ranks that must agree on skipping (Default: the default process group; none if unset).
  explicit ShardedGradScaler(GradScalerOptions options = {}, ProcessGroupPtr group = nullptr);

  /// loss * scale (a new tensor). Mirrors GradScaler.scale().
  torch::Tensor scale(const torch::Tensor& loss) const;
  /// Divides the optimizer's gradients by the scale in place and records whether any rank found an
  /// inf/nan (one all-reduce MAX). Throws c10::Error if called twice before update().
  void unscale_(torch::optim::Optimizer& optimizer);
  /// Unscales if needed, then runs optimizer.step() unless inf/nan was found. Returns true if it
  /// stepped. Mirrors GradScaler.step().
  bool step(torch::optim::Optimizer& optimizer);
  /// Adjusts the scale (backoff after inf/nan, growth after growth_interval good steps).
  void update();

  double get_scale() const { return options_.enabled() ? scale_ : 1.0; }
  /// Restores the scale and growth tracker saved from get_scale() / growth_tracker() (e.g. on resume).
  /// Throws c10::Error if scale <= 0 or the tracker is outside [0, growth_interval).
  /// Mirrors GradScaler.load_state_dict().
  void load_state(double scale, int64_t growth_tracker);
  /// Whether the last unscale_ found inf/nan on any rank.
  bool found_inf() const { return found_inf_; }
  int64_t growth_tracker() const { return growth_tracker_; }

 private:
  GradScalerOptions options_;
  ProcessGroupPtr group_;
  double scale_;
  int64_t growth_tracker_ = 0;
  bool unscaled_ = false;
  bool found_inf_ = false;
};

}  // namespace fsdp
