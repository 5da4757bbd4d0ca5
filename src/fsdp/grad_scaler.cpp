#include "fsdp/fsdp/grad_scaler.h"

#include "fsdp/c10d/collectives.h"

namespace fsdp {

ShardedGradScaler::ShardedGradScaler(GradScalerOptions options, ProcessGroupPtr group)
    : options_(options), group_(std::move(group)), scale_(options.init_scale()) {
  TORCH_CHECK(options_.init_scale() > 0 && options_.growth_factor() > 1.0 && options_.backoff_factor() < 1.0 &&
                  options_.backoff_factor() > 0 && options_.growth_interval() > 0,
              "ShardedGradScaler: expected init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
              "growth_interval > 0");
  if (!group_ && is_initialized()) group_ = default_process_group();
}

torch::Tensor ShardedGradScaler::scale(const torch::Tensor& loss) const {
  if (!options_.enabled()) return loss;
  return loss * scale_;
}

void ShardedGradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) return;
  TORCH_CHECK(!unscaled_, "ShardedGradScaler: unscale_() was already called since the last update(). Fix: call "
              "unscale_ at most once per step, before step()");
  torch::NoGradGuard no_grad;
  const double inv = 1.0 / scale_;
  bool local_inf = false;
  for (auto& pg : optimizer.param_groups()) {
    for (auto& p : pg.params()) {
      auto& g = p.mutable_grad();
      if (!g.defined() || g.numel() == 0) continue;
      g.mul_(inv);
      if (!local_inf) local_inf = !torch::isfinite(g).all().item<bool>();
    }
  }
  // Every rank must agree: one rank's inf skips the step everywhere.
  // On the group's device: NCCL reduces CUDA tensors only.
  auto flag = torch::full({1}, local_inf ? 1.0f : 0.0f,
                          torch::TensorOptions().device(group_ ? group_->device() : torch::Device(torch::kCPU)));
  if (group_) all_reduce(flag, *group_, ReduceOp::MAX);
  found_inf_ = flag.item<float>() > 0;
  unscaled_ = true;
}

bool ShardedGradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  if (!unscaled_) unscale_(optimizer);
  if (found_inf_) return false;  // skipped on every rank
  optimizer.step();
  return true;
}

void ShardedGradScaler::load_state(double scale, int64_t growth_tracker) {
  TORCH_CHECK(scale > 0, "ShardedGradScaler::load_state: expected a positive scale, got ", scale);
  TORCH_CHECK(growth_tracker >= 0 && growth_tracker < options_.growth_interval(),
              "ShardedGradScaler::load_state: growth_tracker ", growth_tracker, " is outside [0, growth_interval(",
              options_.growth_interval(), "))");
  scale_ = scale;
  growth_tracker_ = growth_tracker;
  unscaled_ = false;
  found_inf_ = false;
}

void ShardedGradScaler::update() {
  if (!options_.enabled()) return;
  if (found_inf_) {
    scale_ *= options_.backoff_factor();
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval()) {
    scale_ *= options_.growth_factor();
    growth_tracker_ = 0;
  }
  unscaled_ = false;  // found_inf_ keeps describing the last unscale_ until the next one
}

}  // namespace fsdp
