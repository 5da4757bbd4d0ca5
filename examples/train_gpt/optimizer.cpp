#include "optimizer.h"

#include <cmath>
#include <memory>

namespace train_gpt {

DecayGroups decay_groups(const torch::nn::Module& model) {
  DecayGroups g;
  for (const auto& p : unique_parameters(model)) (p.dim() >= 2 ? g.decay : g.no_decay).push_back(p);
  return g;
}

torch::optim::AdamW make_adamw(const DecayGroups& g, const Options& o) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(g.decay, std::make_unique<torch::optim::AdamWOptions>(
                                   torch::optim::AdamWOptions(o.lr).betas({0.9, 0.95}).weight_decay(o.weight_decay)));
  groups.emplace_back(g.no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                      torch::optim::AdamWOptions(o.lr).betas({0.9, 0.95}).weight_decay(0.0)));
  return torch::optim::AdamW(std::move(groups), torch::optim::AdamWOptions(o.lr));
}

double lr_at(int64_t step, const Options& o) {
  if (o.warmup_steps > 0 && step <= o.warmup_steps) {
    return o.lr * static_cast<double>(step) / static_cast<double>(o.warmup_steps);
  }
  const double span = static_cast<double>(std::max<int64_t>(o.steps - o.warmup_steps, 1));
  const double progress = std::min(1.0, static_cast<double>(step - o.warmup_steps) / span);
  return o.min_lr + 0.5 * (1.0 + std::cos(M_PI * progress)) * (o.lr - o.min_lr);
}

void foreach_adamw_step(torch::optim::AdamW& opt) {
  torch::NoGradGuard no_grad;
  for (auto& group : opt.param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    TORCH_CHECK(!o.amsgrad(), "foreach_adamw_step: amsgrad is not supported");
    const double lr = o.lr(), wd = o.weight_decay(), eps = o.eps();
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs;
    std::vector<c10::Scalar> step_size, bc2_sqrt;
    for (auto& p : group.params()) {
      if (!p.grad().defined() || p.numel() == 0) continue;
      auto& slot = opt.state()[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto st = std::make_unique<torch::optim::AdamWParamState>();
        st->step(0);
        st->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        st->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        slot = std::move(st);
      }
      auto& st = static_cast<torch::optim::AdamWParamState&>(*slot);
      st.step(st.step() + 1);
      params.push_back(p);
      grads.push_back(p.grad());
      exp_avgs.push_back(st.exp_avg());
      exp_avg_sqs.push_back(st.exp_avg_sq());
      const double t = static_cast<double>(st.step());
      step_size.emplace_back(-(lr / (1.0 - std::pow(beta1, t))));
      bc2_sqrt.emplace_back(std::sqrt(1.0 - std::pow(beta2, t)));
    }
    if (params.empty()) continue;
    if (wd != 0) at::_foreach_mul_(params, 1.0 - lr * wd);
    at::_foreach_lerp_(exp_avgs, grads, 1.0 - beta1);
    at::_foreach_mul_(exp_avg_sqs, beta2);
    at::_foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2);
    auto denom = at::_foreach_sqrt(exp_avg_sqs);
    at::_foreach_div_(denom, bc2_sqrt);
    at::_foreach_add_(denom, eps);
    at::_foreach_addcdiv_(params, exp_avgs, denom, step_size);
  }
}

}  // namespace train_gpt
