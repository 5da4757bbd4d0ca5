// vocab_parallel_cross_entropy: cross-entropy over vocabulary-sharded logits (loss.h).
//
// [Note: vocab-parallel cross-entropy]
// Rank r of the TP group holds the columns [o_r, o_r + V_r) of the logits x [N, V] (torch.chunk's chunk r of V:
// the local output of a ColwiseParallel head). For row i, with target t_i, smoothing e and V classes:
//   m_i   = max_j x_ij                        all-reduce MAX of the local row maxima (an empty shard gives -inf)
//   s_i   = sum_j exp(x_ij - m_i)             all-reduce SUM of the local sums
//   lse_i = m_i + log s_i
//   x_it  = the target's logit                all-reduce SUM: the owner of t_i contributes x_it, the others 0
//   nll_i = lse_i - x_it
//   loss_i = (1 - e) nll_i + e (lse_i - sum_j x_ij / V)   (the smoothed term needs one more all-reduce SUM)
// and loss_i = 0 for an ignored row; "mean" divides the sum by the number of rows that are not ignored.
// Backward needs no communication: d loss_i / d x_ij = softmax_ij - (1 - e) [j == t_i] - e / V, for the rank's own
// columns j, times the incoming gradient (and 1 / count for "mean", 0 for an ignored row). The forward keeps the
// local softmax [N, V_r] for it (the exponentials, divided in place: no second [N, V_r] buffer), as PyTorch's
// loss_parallel keeps its log-softmax. The max is detached, as in every log-sum-exp: it cancels in the gradient.
// Every rank holds the same target and computes the same [N] loss; only the [N] vectors cross the group.
#include "fsdp/tensor/parallel/loss.h"

#include <cmath>
#include <limits>

#include <torch/autograd.h>

#include "fsdp/c10d/collectives.h"
#include "utils/intercept.h"

namespace fsdp::tp {
namespace {

struct Shapes {
  int64_t vocab = 0;   // global V
  int64_t offset = 0;  // o_r
};

// Validates from rank-identical information: the all-gathered (N, V_r) of every rank. Every rank runs this
// all-gather (its inputs are two integers), so a rank whose shapes are wrong cannot leave the others
// waiting in a later collective: all of them see the same table and throw the same error.
Shapes check_shapes(const torch::Tensor& x, const torch::Tensor& target, ProcessGroup& pg,
                    const LossParallelOptions& o) {
  const int64_t tp = pg.size(), r = pg.rank();
  const bool rows = x.dim() == 2;
  auto mine = torch::tensor({rows ? x.size(0) : int64_t{-1}, x.size(-1)}, torch::kLong);
  auto all = torch::empty({tp * 2}, torch::kLong);
  all_gather_into_tensor(all, mine, pg);
  auto a = all.accessor<int64_t, 1>();
  Shapes s;
  for (int64_t k = 0; k < tp; ++k) s.vocab += a[2 * k + 1];
  std::string table;
  for (int64_t k = 0; k < tp; ++k) {
    table += (k ? ", " : "") + std::string("rank ") + std::to_string(k) + ": [" +
             (a[2 * k] < 0 ? std::string() : std::to_string(a[2 * k]) + ", ") + std::to_string(a[2 * k + 1]) + "]";
  }
  for (int64_t k = 0; k < tp; ++k) {
    TORCH_CHECK(a[2 * k] == a[0], "vocab_parallel_cross_entropy: the TP ranks' local logits have different rows (",
                table, "); every rank of the TP group must pass its columns of the same [N, V] logits");
    const auto c = chunk_range(s.vocab, tp, k);
    TORCH_CHECK(a[2 * k + 1] == c.length, "vocab_parallel_cross_entropy: the TP ranks' local logits (", table,
                ") are not torch.chunk's pieces of a vocabulary of ", s.vocab, " over ", tp,
                " ranks (rank ", k, " should hold ", c.length, " columns); pass the local output of a ColwiseParallel "
                "head (Shard(-1)), or shard the logits with DTensor/distribute_tensor(..., {Shard(1)})");
  }
  s.offset = chunk_range(s.vocab, tp, r).offset;
  const bool ok_target = rows ? (target.dim() == 1 && target.size(0) == x.size(0)) : target.dim() == 0;
  TORCH_CHECK(ok_target, "vocab_parallel_cross_entropy: expected a target of shape ",
              rows ? "[" + std::to_string(x.size(0)) + "]" : std::string("[] (0-D)"), " for local logits of shape ",
              x.sizes(), ", got ", target.sizes());
  TORCH_CHECK(target.scalar_type() == torch::kLong, "vocab_parallel_cross_entropy: expected int64 class indices as ",
              "the target, got ", target.scalar_type(), " (class probabilities are not supported, as in PyTorch's ",
              "loss_parallel)");
  if (target.numel() > 0) {
    auto valid = target != o.ignore_index;
    auto bad = valid & ((target < 0) | (target >= s.vocab));
    if (bad.any().item<bool>()) {
      const int64_t t = target.masked_select(bad).index({0}).item<int64_t>();
      TORCH_CHECK(false, "vocab_parallel_cross_entropy: target ", t, " is out of bounds: expected class indices in [0, ",
                  s.vocab, ") or ignore_index ", o.ignore_index);
    }
  }
  return s;
}

// The forward of [Note: vocab-parallel cross-entropy] on local logits [N, V_r]; backward local.
struct VocabParallelCE : torch::autograd::Function<VocabParallelCE> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& target,
                               int64_t group, int64_t vocab, int64_t offset, int64_t ignore_index, double smoothing,
                               int64_t reduction) {
    auto& pg = *reinterpret_cast<ProcessGroup*>(group);
    const int64_t n = x.size(0), vl = x.size(1);
    auto xd = x.detach();
    // m: the row maxima over every rank's columns (an empty shard contributes -inf).
    auto m = vl > 0 ? std::get<0>(xd.max(1)).contiguous()
                    : torch::full({n}, -std::numeric_limits<double>::infinity(), x.options());
    all_reduce(m, pg, ReduceOp::MAX);
    // Rows whose every logit is -inf would give NaN through (-inf) - (-inf); PyTorch gives NaN too.
    auto e = (xd - m.unsqueeze(1)).exp_();  // [N, V_r]: becomes the softmax
    auto s = e.sum(1);
    all_reduce(s, pg, ReduceOp::SUM);
    auto lse = m + s.log();
    const auto valid = target != ignore_index;
    const auto local = valid & (target >= offset) & (target < offset + vl);
    auto picked = torch::zeros({n}, x.options());
    if (vl > 0) {
      auto idx = torch::where(local, target - offset, torch::zeros_like(target)).unsqueeze(1);
      picked = xd.gather(1, idx).squeeze(1) * local.to(x.scalar_type());
    }
    all_reduce(picked, pg, ReduceOp::SUM);
    auto loss = lse - picked;
    if (smoothing > 0) {
      auto row_sum = xd.sum(1);
      all_reduce(row_sum, pg, ReduceOp::SUM);
      loss = (1 - smoothing) * loss + smoothing * (lse - row_sum / static_cast<double>(vocab));
    }
    const auto validf = valid.to(x.scalar_type());
    loss = loss * validf;  // an ignored row: 0 (its terms may be anything, e.g. a target on no rank)
    e.div_(s.unsqueeze(1));
    ctx->save_for_backward({e, target});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["vocab"] = vocab;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["smoothing"] = smoothing;
    ctx->saved_data["reduction"] = reduction;
    const double count = validf.sum().item<double>();
    ctx->saved_data["count"] = count;
    if (reduction == 0) return loss;                // none
    if (reduction == 1) return loss.sum();          // sum
    return loss.sum() / count;                      // mean: NaN when every row is ignored, as PyTorch
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto& p = saved[0];
    const auto& target = saved[1];
    const int64_t offset = ctx->saved_data["offset"].toInt(), vocab = ctx->saved_data["vocab"].toInt();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt(), reduction = ctx->saved_data["reduction"].toInt();
    const double smoothing = ctx->saved_data["smoothing"].toDouble();
    const int64_t n = p.size(0), vl = p.size(1);
    const auto valid = (target != ignore_index).to(p.scalar_type());
    torch::Tensor g;  // [N]: the incoming gradient of each row's loss
    if (reduction == 0) {
      g = grads[0] * valid;
    } else {
      auto scale = reduction == 2 ? grads[0] / ctx->saved_data["count"].toDouble() : grads[0];
      g = scale.expand({n}) * valid;
    }
    auto grad = p.clone();
    if (smoothing > 0) grad.sub_(smoothing / static_cast<double>(vocab));
    if (vl > 0) {
      const auto local = (target != ignore_index) & (target >= offset) & (target < offset + vl);
      auto idx = torch::where(local, target - offset, torch::zeros_like(target)).unsqueeze(1);
      grad.scatter_add_(1, idx, (-(1 - smoothing) * local.to(p.scalar_type())).unsqueeze(1));
    }
    grad.mul_(g.unsqueeze(1));
    return {grad, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

int64_t reduction_code(const std::string& r) {
  if (r == "none") return 0;
  if (r == "sum") return 1;
  if (r == "mean") return 2;
  TORCH_CHECK(false, "vocab_parallel_cross_entropy: reduction '", r, "' is not supported; use \"mean\", \"sum\" or \"none\"");
}

}  // namespace

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& local_logits, const torch::Tensor& target,
                                           const DeviceMeshPtr& tp_mesh, const LossParallelOptions& options) {
  TORCH_CHECK(tp_mesh && tp_mesh->ndim() == 1, "vocab_parallel_cross_entropy: expected a 1-D TP mesh (e.g. mesh[\"tp\"]), got ",
              tp_mesh ? tp_mesh->str() : std::string("null"));
  TORCH_CHECK(local_logits.dim() == 1 || local_logits.dim() == 2, "vocab_parallel_cross_entropy: expected local logits ",
              "[N, V_r] or [V_r] (class dim last), got shape ", local_logits.sizes(),
              "; flatten a [B, T, V_r] head output with logits.view({-1, logits.size(-1)}) and the target with view(-1)");
  const int64_t red = reduction_code(options.reduction);
  TORCH_CHECK(options.label_smoothing >= 0.0 && options.label_smoothing <= 1.0,
              "vocab_parallel_cross_entropy: label_smoothing must be in [0, 1], got ", options.label_smoothing);
  TORCH_CHECK(local_logits.is_floating_point(), "vocab_parallel_cross_entropy: expected floating-point logits, got ",
              local_logits.scalar_type());
  // The logits may be a TP head's output; nothing below is a TP module's op.
  fsdp::detail::NoInterception no_interception;
  auto& pg = *tp_mesh->get_group(0);
  const Shapes s = check_shapes(local_logits, target, pg, options);
  const bool rows = local_logits.dim() == 2;
  auto x = rows ? local_logits : local_logits.unsqueeze(0);
  auto t = rows ? target : target.unsqueeze(0);
  auto loss = VocabParallelCE::apply(x, t, reinterpret_cast<int64_t>(&pg), s.vocab, s.offset, options.ignore_index,
                                     options.label_smoothing, red);
  return !rows && red == 0 ? loss.squeeze(0) : loss;
}

torch::Tensor vocab_parallel_cross_entropy(const DTensor& logits, const torch::Tensor& target,
                                           const LossParallelOptions& options) {
  const auto& mesh = logits.device_mesh();
  const auto& pl = logits.placements();
  const int64_t nd = static_cast<int64_t>(logits.sizes().size());
  const bool class_sharded = pl.size() == 1 && pl[0].is_shard() && (pl[0].dim == nd - 1 || pl[0].dim == -1);
  TORCH_CHECK(mesh && mesh->ndim() == 1 && class_sharded && (nd == 1 || nd == 2),
              "vocab_parallel_cross_entropy: expected logits [N, V] sharded on the class dim over a 1-D mesh ",
              "(placements {Shard(1)}), got global shape ", c10::IntArrayRef(logits.sizes()), " with placements ",
              pl.empty() ? std::string("{}") : pl[0].str(), pl.size() > 1 ? " ..." : "", " on ",
              mesh ? mesh->str() : std::string("no mesh"),
              "; redistribute to {Shard(1)} on the TP mesh first");
  return vocab_parallel_cross_entropy(logits.to_local(), target, mesh, options);
}

}  // namespace fsdp::tp
