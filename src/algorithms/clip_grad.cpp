#include "fsdp/algorithms/clip_grad.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "fsdp/c10d/collectives.h"
#include "fsdp/fsdp_state.h"
#include "tensor/parallel/tp_ops.h"

namespace fsdp {
namespace {

// The gradients by the groups their shards are summed over: FSDP's shard group (`group`), the TP group
// (tensor-parallel parameters, parallelize_module), both (FSDP over TP), or none (replicated: counted
// once, e.g. a norm's weight in a TP-only model, identical on every TP rank).
struct GradGroups {
  std::vector<torch::Tensor> sharded, sharded_tp, tp_only, replicated;
  std::vector<torch::Tensor> all;
  ProcessGroupPtr group;  // FSDP's (the caller's, else the first sharded parameter's shard group)
  ProcessGroupPtr tp_group;
  torch::ScalarType dtype = torch::kFloat32;
};

GradGroups split_grads(const std::vector<torch::Tensor>& parameters, ProcessGroupPtr group) {
  GradGroups out;
  out.group = std::move(group);
  const auto owners = detail::param_owners();
  for (const auto& p : parameters) {
    const auto& g = p.grad();
    if (!g.defined()) continue;
    out.all.push_back(g);
    if (g.scalar_type() == torch::kDouble) out.dtype = torch::kDouble;
    const auto* tp = tp::detail::find_tp_param(p);
    if (tp && !tp->placement.is_shard()) tp = nullptr;  // replicated by TP (a sequence-parallel norm): once
    if (tp) {
      const auto& pg = tp->mesh->get_group(0);
      TORCH_CHECK(!out.tp_group || out.tp_group == pg, "clip_grad_norm_: the parameters are tensor-parallel over ",
                  "more than one TP group; pass the parameters of one TP mesh");
      out.tp_group = pg;
    }
    auto it = owners.find(p.unsafeGetTensorImpl());
    // A group whose shard dimension has one rank (fsdp::replicate's) holds whole gradients: counted once,
    // like a plain parameter's, also beside fully_shard groups in one model.
    auto one_rank = [](const auto& state) { return state->group->mesh()->shape().back() == 1; };
    if (it != owners.end() && !one_rank(it->second)) {
      const auto& state = it->second;
      if (!out.group) out.group = state->group->mesh()->get_group(state->group->mesh()->ndim() - 1);
      (tp ? out.sharded_tp : out.sharded).push_back(g);
    } else {
      (tp ? out.tp_only : out.replicated).push_back(g);
    }
  }
  return out;
}

// A rank's partial norm of some gradients: sum of |g|^p (or max |g| for inf), shape [1].
struct PartialNorm {
  double norm_type;
  bool inf_norm;
  torch::ScalarType dtype;
  torch::TensorOptions opts;
  // On CUDA, one multi-tensor norm kernel for all gradients (as torch.nn.utils.get_total_norm) instead of
  // three kernels per gradient: a few hundred launches fewer per step. The CPU path is unchanged.
  bool foreach;

  torch::Tensor operator()(const std::vector<torch::Tensor>& gs) const {
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
  }
};

// The global norm of the sharded gradients (before the replicated ones are added and the root taken):
// `total` is [sum over FSDP's group only, over FSDP's and TP's, over TP's only]. also_sum is summed
// over FSDP's group alongside.
torch::Tensor reduce_sharded(torch::Tensor total, const GradGroups& gg, bool inf_norm, const torch::Tensor& also_sum) {
  const ReduceOp op = inf_norm ? ReduceOp::MAX : ReduceOp::SUM;
  // Over TP's group first: entries 1 and 2. Then entry 1 is folded into entry 0, which FSDP's group
  // reduces (entry 2 must not take FSDP's sum, entry 0 not TP's). Without TP this is the one all-reduce
  // of [partial norm, also_sum...] as before, to the bit.
  if (gg.tp_group && gg.tp_group->size() > 1) {
    auto tp_part = total.narrow(0, 1, 2).clone();
    all_reduce(tp_part, *gg.tp_group, op);
    total = torch::cat({total.narrow(0, 0, 1), tp_part});
  }
  auto fsdp_part = inf_norm ? torch::maximum(total.narrow(0, 0, 1), total.narrow(0, 1, 1))
                            : total.narrow(0, 0, 1) + total.narrow(0, 1, 1);
  const bool distributed = gg.group && gg.group->size() > 1;
  if (distributed && also_sum.defined() && !inf_norm && also_sum.scalar_type() == total.scalar_type() &&
      also_sum.device() == total.device()) {
    // One collective for both (issue 16, part 3): [partial norm, also_sum...].
    auto packed = torch::cat({fsdp_part, also_sum.reshape({-1})});
    all_reduce(packed, *gg.group, ReduceOp::SUM);
    fsdp_part = packed.narrow(0, 0, 1);
    torch::NoGradGuard no_grad;
    also_sum.view({-1}).copy_(packed.narrow(0, 1, also_sum.numel()));
  } else if (distributed) {
    fsdp_part = fsdp_part.clone();
    all_reduce(fsdp_part, *gg.group, op);
    if (also_sum.defined()) all_reduce(also_sum, *gg.group, ReduceOp::SUM);
  }
  total = torch::cat({fsdp_part, total.narrow(0, 2, 1)});
  return inf_norm ? total.max().reshape({1}) : total.sum().reshape({1});
}

}  // namespace

torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm, double norm_type,
                              bool error_if_nonfinite, ProcessGroupPtr group, const torch::Tensor& also_sum) {
  TORCH_CHECK(norm_type > 0, "clip_grad_norm_: norm_type must be positive, got ", norm_type);
  const bool inf_norm = std::isinf(norm_type);
  GradGroups gg = split_grads(parameters, std::move(group));
  auto& grads = gg.all;
  // On the gradients' device (CUDA: the norms stay on the GPU, and NCCL all-reduces device tensors).
  auto opts = torch::TensorOptions().dtype(gg.dtype).device(grads.empty() ? torch::Device(torch::kCPU) : grads[0].device());
  const bool foreach = opts.device().is_cuda() && std::all_of(grads.begin(), grads.end(), [&](const torch::Tensor& g) {
    return g.device() == opts.device() && g.scalar_type() == gg.dtype;
  });
  const PartialNorm partial{norm_type, inf_norm, gg.dtype, opts, foreach};
  if (also_sum.defined()) {
    TORCH_CHECK(also_sum.is_contiguous(), "clip_grad_norm_: also_sum must be contiguous, got strides ",
                also_sum.strides(), ". Fix: pass also_sum.contiguous() and read the result from that tensor");
  }
  auto total = reduce_sharded(torch::cat({partial(gg.sharded), partial(gg.sharded_tp), partial(gg.tp_only)}), gg,
                              inf_norm, also_sum);
  auto rep = partial(gg.replicated);
  total = inf_norm ? torch::maximum(total, rep) : (total + rep).pow(1.0 / norm_type);
  total = total.reshape({});
  if (error_if_nonfinite) {
    double v = total.item<double>();
    TORCH_CHECK(std::isfinite(v), "clip_grad_norm_: the total norm of order ", norm_type, " for gradients from ",
                "`parameters` is non-finite (", v, ") on rank ", gg.group ? gg.group->rank() : 0,
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
