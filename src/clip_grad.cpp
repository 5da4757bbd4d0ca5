#include "fsdp/clip_grad.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "fsdp/collectives.h"
#include "fsdp_state.h"

namespace fsdp {

torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm, double norm_type,
                              bool error_if_nonfinite, ProcessGroupPtr group, const torch::Tensor& also_sum) {
  TORCH_CHECK(norm_type > 0, "clip_grad_norm_: norm_type must be positive, got ", norm_type);
  const bool inf_norm = std::isinf(norm_type);
  // Split the gradients into sharded ones (summed over the shard group) and replicated ones.
  std::vector<torch::Tensor> sharded, replicated;
  std::vector<torch::Tensor> grads;
  torch::ScalarType dtype = torch::kFloat32;
  const auto owners = detail::param_owners();
  for (const auto& p : parameters) {
    const auto& g = p.grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    if (g.scalar_type() == torch::kDouble) dtype = torch::kDouble;
    auto it = owners.find(p.unsafeGetTensorImpl());
    if (it != owners.end()) {
      const auto& state = it->second;
      if (!group) group = state->group->mesh()->get_group(state->group->mesh()->ndim() - 1);
      sharded.push_back(g);
    } else {
      replicated.push_back(g);
    }
  }
  // On the gradients' device (CUDA: the norms stay on the GPU, and NCCL all-reduces device tensors).
  auto opts = torch::TensorOptions().dtype(dtype).device(grads.empty() ? torch::Device(torch::kCPU) : grads[0].device());
  // Local partial: sum of |g|^p (or max |g| for inf), one accumulation per gradient.
  // On CUDA, one multi-tensor norm kernel for all gradients (as torch.nn.utils.get_total_norm) instead of
  // three kernels per gradient: a few hundred launches fewer per step. The CPU path is unchanged.
  const bool foreach = opts.device().is_cuda() && std::all_of(grads.begin(), grads.end(), [&](const torch::Tensor& g) {
    return g.device() == opts.device() && g.scalar_type() == dtype;
  });
  auto partial = [&](const std::vector<torch::Tensor>& gs) {
    auto acc = torch::zeros({1}, opts);
    if (foreach) {
      std::vector<torch::Tensor> nonempty;
      for (const auto& g : gs) {
        if (g.numel() > 0) nonempty.push_back(g.detach());
      }
      if (nonempty.empty()) return acc;
      auto norms = at::stack(at::_foreach_norm(nonempty, norm_type));
      return inf_norm ? torch::maximum(acc, norms.max().reshape({1})) : acc + norms.pow(norm_type).sum().reshape({1});
    }
    for (const auto& g : gs) {
      if (g.numel() == 0) continue;  // an empty shard
      auto n = torch::linalg_vector_norm(g.detach().to(dtype), norm_type);
      if (inf_norm) {
        acc = torch::maximum(acc, n.reshape({1}));
      } else {
        acc += n.pow(norm_type);
      }
    }
    return acc;
  };
  auto total = partial(sharded);
  if (also_sum.defined()) {
    TORCH_CHECK(also_sum.is_contiguous(), "clip_grad_norm_: also_sum must be contiguous, got strides ",
                also_sum.strides(), ". Fix: pass also_sum.contiguous() and read the result from that tensor");
  }
  const bool distributed = group && group->size() > 1;
  if (distributed && also_sum.defined() && !inf_norm && also_sum.scalar_type() == total.scalar_type() &&
      also_sum.device() == total.device()) {
    // One collective for both (issue 16, part 3): [partial norm, also_sum...].
    auto packed = torch::cat({total, also_sum.reshape({-1})});
    all_reduce(packed, *group, ReduceOp::SUM);
    total = packed.narrow(0, 0, 1);
    torch::NoGradGuard no_grad;
    also_sum.view({-1}).copy_(packed.narrow(0, 1, also_sum.numel()));
  } else if (distributed) {
    all_reduce(total, *group, inf_norm ? ReduceOp::MAX : ReduceOp::SUM);
    if (also_sum.defined()) all_reduce(also_sum, *group, ReduceOp::SUM);
  }
  auto rep = partial(replicated);
  total = inf_norm ? torch::maximum(total, rep) : (total + rep).pow(1.0 / norm_type);
  total = total.reshape({});
  if (error_if_nonfinite) {
    double v = total.item<double>();
    TORCH_CHECK(std::isfinite(v), "clip_grad_norm_: the total norm of order ", norm_type, " for gradients from ",
                "`parameters` is non-finite (", v, ") on rank ", group ? group->rank() : 0,
                ", so it cannot be clipped. Fix: find the nan/inf gradient, or pass error_if_nonfinite=false");
  }
  // Same coefficient on every rank: min(1, max_norm / (norm + 1e-6)), as PyTorch.
  auto coef = torch::clamp_max(max_norm / (total + 1e-6), 1.0);
  torch::NoGradGuard no_grad;
  if (foreach && !grads.empty()) {
    at::_foreach_mul_(grads, coef);
  } else {
    for (auto& g : grads) g.mul_(coef.to(g.scalar_type()));
  }
  return total;
}

}  // namespace fsdp
