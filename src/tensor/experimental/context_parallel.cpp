// Context parallelism (fsdp/tensor/experimental/context_parallel.h): sharding of the buffers with PyTorch's
// head-tail load balancing, and ring attention with all-gather rotation in place of
// aten::scaled_dot_product_attention while a context_parallel object lives on the thread.
#include "fsdp/tensor/experimental/context_parallel.h"

#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <tuple>

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "fsdp/c10d/collectives.h"
#include "utils/implicit_checkpoint.h"
#include "utils/intercept.h"
#include "utils/recompute_regions.h"

// [Note: context parallel interception]
// PyTorch swaps F.scaled_dot_product_attention (monkey patch) or installs a dispatcher handler for the SDPA
// backends' ops. LibTorch has neither a patchable Python function nor DTensor inputs, and q/k/v are
// activations that carry no key of ours. What libfsdp has is kInterceptKey (utils/intercept.h), above Autograd:
// - aten::scaled_dot_product_attention is CompositeImplicitAutograd, so it decomposes at Autograd; a kernel
//   of its own on kInterceptKey (registered at load with linear's and matmul's) sees it whole first.
// - For that kernel to be reached with plain activations, context_parallel puts kInterceptKey in the
//   thread's included keys (as selective checkpointing does for its regions) and restores the previous
//   state when it ends. A thread-local CP state says which group and layout to use.
// Cost for the other ops: while the region lives, every op of the thread goes once through the key's boxed
// fallback, which hands it to the installed layers (TP, FSDP, checkpointing) or straight below the key:
// one boxed call per op, no copy, nothing else. The alternatives cost more or touch more: an AutogradCPU /
// AutogradCUDA kernel for SDPA would replace the op for every caller in the process, inside or outside
// a region, and would have to call ATen's composite by its internal name; a second free dispatch key with a
// fallthrough fallback would cost nothing for other ops but the only free keys above Autograd are
// c10's TESTING_ONLY ones. The per-op cost is negligible beside the attention of long sequences, which is
// what CP is for; bench/bench_context_parallel.cpp measures the memory.
//
// [Note: ring attention by all-gather]
// With PyTorch's _RotateMethod.ALL_GATHER every rank gathers the whole K and V of the CP group once per
// attention call (rank-major: rank s holds chunks s and 2cp-1-s of c = L / (2cp) positions each) and computes its
// own queries against them. Query chunk a (original positions [a*c, (a+1)*c)) under is_causal sees every key of
// the chunks before it in full and its own chunk causally (top-left aligned: query i sees keys <= i), and nothing
// after it. So with K/V put back in original order (one index_select, which autograd reverses), each of this
// rank's two query chunks is at most two flash-attention calls: against K[0, a*c) without a mask and against
// K[a*c, (a+1)*c) with is_causal. The two partial results are merged by their log-sum-exps (as PyTorch's
// _SDPAMerger): lse = logaddexp(lse1, lse2), out = out1 * exp(lse1 - lse) + out2 * exp(lse2 - lse). Not causal:
// one call against all of K. No score matrix and no mask is ever materialized (the CPU flash kernel works in
// tiles). Only this rank's q, k, v, output and log-sum-exp are saved for backward; the backward gathers K/V again
// (one more all-gather per layer, as PyTorch's ring backward rotates K/V again), so the memory per rank is 1/cp of
// one process's activations plus the gathered K/V of the one layer being computed.
// Backward (RingAttention below, PyTorch's _templated_ring_attention_backward): each call's flash backward is
// given the merged output and log-sum-exp, which makes its dq, dk, dv the exact contributions of that block to
// the gradient of the merged softmax; dq sums over the calls, dk/dv accumulate into their key ranges, and dK/dV
// are reduce-scattered over the CP group (each rank's queries contribute to every key's gradient; each rank keeps
// the sum for its own keys): the backward of the all-gather. GQA: k/v are gathered with their own heads (fewer
// bytes) and repeated to the query heads after the gather; the backward sums the repeats.
// Other devices than the CPU (whose SDPA backends libfsdp does not drive block by block yet) take one SDPA call
// against the gathered K/V with an additive mask of the load-balanced positions: the same result, with a
// [L/cp, L] mask per region (shared by the layers) as the extra memory.
namespace fsdp::experimental {
namespace {

using fsdp::detail::kInterceptKey;

struct CPState {
  ProcessGroupPtr group;
  int64_t cp = 1;
  int64_t rank = 0;
  // Additive causal masks by (local length, dtype, device).
  std::map<std::tuple<int64_t, int, std::string>, torch::Tensor> masks;
};

thread_local CPState* tls_state = nullptr;
thread_local std::shared_ptr<CPState> tls_keep;  // owns tls_state's region while a checkpoint holds a capture of it

// A checkpoint's recomputation sees this thread's CP region as its forward did ([Note: regions a recomputation
// re-enters] in utils/recompute_regions.h): attention in a checkpointed block is recomputed as ring attention
// over the same group (or as plain attention when its forward ran outside a region), whether backward runs in
// the region, after it or on an autograd thread. Without it, the recomputation's plain attention has the ring's
// shapes and other values: silently wrong gradients.
class CPReentry {
 public:
  explicit CPReentry(std::shared_ptr<CPState> state)
      : keep_before_(std::move(tls_keep)), state_before_(tls_state),
        key_was_included_(c10::impl::tls_is_dispatch_key_included(fsdp::detail::kInterceptKey)) {
    tls_keep = std::move(state);
    tls_state = tls_keep.get();
    if (tls_state) c10::impl::tls_set_dispatch_key_included(fsdp::detail::kInterceptKey, true);
  }
  ~CPReentry() {
    tls_keep = std::move(keep_before_);
    tls_state = state_before_;
    c10::impl::tls_set_dispatch_key_included(fsdp::detail::kInterceptKey, key_was_included_);
  }
  CPReentry(const CPReentry&) = delete;
  CPReentry& operator=(const CPReentry&) = delete;

 private:
  std::shared_ptr<CPState> keep_before_;
  CPState* state_before_;
  bool key_was_included_;
};

fsdp::detail::RegionReentry capture_cp() {
  std::shared_ptr<CPState> state = tls_keep;
  return [state]() -> std::shared_ptr<void> { return std::make_shared<CPReentry>(state); };
}

const bool capture_registered = (fsdp::detail::register_region_capture(&capture_cp), true);

std::string shape_str(const torch::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

// The gathered tensor's sequence dim at the front, contiguous (all_gather_into_tensor concatenates along dim 0).
torch::Tensor gather_seq(const torch::Tensor& x, int64_t dim, ProcessGroup& pg) {
  auto front = x.movedim(dim, 0).contiguous();
  auto shape = front.sizes().vec();
  shape[0] *= pg.size();
  auto out = torch::empty(shape, front.options());
  all_gather_into_tensor(out, front, pg).wait();
  return out.movedim(0, dim);
}

torch::Tensor reduce_scatter_seq(const torch::Tensor& g, int64_t dim, ProcessGroup& pg) {
  auto front = g.movedim(dim, 0).contiguous();
  auto shape = front.sizes().vec();
  shape[0] /= pg.size();
  auto out = torch::empty(shape, front.options());
  reduce_scatter_tensor(out, front, pg, ReduceOp::SUM).wait();
  return out.movedim(0, dim).contiguous();
}

// Backward of the K/V all-gather: reduce-scatter of the gradient. A Node of its own (not an
// autograd::Function) so that it holds the group itself: the backward may run after the region ended.
struct AllGatherSeqBackward : torch::autograd::Node {
  AllGatherSeqBackward(ProcessGroupPtr g, int64_t d) : group(std::move(g)), dim(d) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return {torch::Tensor()};
    return {reduce_scatter_seq(grads[0], dim, *group)};
  }
  std::string name() const override { return "fsdp::experimental::AllGatherSeqBackward"; }
  ProcessGroupPtr group;
  int64_t dim;
};

torch::Tensor all_gather_seq(const torch::Tensor& x, int64_t dim, const ProcessGroupPtr& group) {
  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = gather_seq(x, dim, *group);
  }
  if (x.requires_grad() && torch::GradMode::is_enabled()) {
    auto node = c10::make_intrusive<AllGatherSeqBackward>(group, dim);
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    torch::autograd::set_history(out, node);
  }
  return out;
}

// One flash-attention call of a query chunk: keys [k_begin, k_begin + k_len) of K in original order.
struct Part {
  int64_t k_begin, k_len;
  bool causal;
};
// This rank's query chunks (rows of the local q) and the key parts each attends to (Note above).
struct QueryChunk {
  int64_t row_begin, rows;
  std::vector<Part> parts;
};
std::vector<QueryChunk> query_chunks(int64_t local_len, int64_t full_len, bool causal, int64_t cp, int64_t rank) {
  if (!causal) return {{0, local_len, {{0, full_len, false}}}};
  const int64_t c = local_len / 2;
  std::vector<QueryChunk> out;
  for (int64_t slot = 0; slot < 2; ++slot) {
    const int64_t a = slot == 0 ? rank : 2 * cp - 1 - rank;  // the chunk's index in the original sequence
    QueryChunk q{slot * c, c, {}};
    if (a > 0) q.parts.push_back({0, a * c, false});
    q.parts.push_back({a * c, c, true});
    out.push_back(std::move(q));
  }
  return out;
}

// K and V of the whole sequence for this rank's attention: gathered over the CP group (rank-major), their heads
// repeated to the query heads (GQA), and, for is_causal, put back in original order. No autograd: RingAttention
// differentiates it by hand.
std::pair<torch::Tensor, torch::Tensor> gather_kv(const torch::Tensor& k, const torch::Tensor& v, ProcessGroup& pg,
                                                   bool causal, int64_t rep) {
  auto kf = gather_seq(k, 2, pg), vf = gather_seq(v, 2, pg);
  if (rep > 1) kf = kf.repeat_interleave(rep, 1), vf = vf.repeat_interleave(rep, 1);
  if (causal) {
    auto restore = context_parallel_load_balance_indices(kf.size(2), pg.size(), /*restore=*/true).to(kf.device());
    kf = kf.index_select(2, restore), vf = vf.index_select(2, restore);
  }
  return {kf.contiguous(), vf.contiguous()};
}

// The gradient of gather_kv's output (dK or dV of the whole sequence, query heads, original order) as the gradient
// of this rank's K or V: back to the gathered order, the repeated heads summed, reduce-scattered over the group.
torch::Tensor scatter_grad_kv(torch::Tensor g, ProcessGroup& pg, bool causal, int64_t rep) {
  if (causal) g = g.index_select(2, context_parallel_load_balance_indices(g.size(2), pg.size()).to(g.device()));
  if (rep > 1) g = g.view({g.size(0), g.size(1) / rep, rep, g.size(2), g.size(3)}).sum(2);
  return reduce_scatter_seq(g, 2, pg);
}

// Ring attention of this rank's queries [B, H, L/cp, E] against the whole sequence's K/V, from this rank's k and v
// [B, Hkv, L/cp, E]. Saves only this rank's q, k, v, the output and its log-sum-exp: the backward gathers K/V
// again (PyTorch's ring backward rotates K/V again too), so nothing of full length outlives one attention call.
// The group travels as a raw pointer (an IValue cannot hold it), as TP's autograd functions do: the CP mesh must
// outlive the backward.
struct RingAttention : torch::autograd::Function<RingAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, bool causal, bool has_scale, double scale, int64_t group,
                               int64_t rank, int64_t rep) {
    auto& pg = *reinterpret_cast<ProcessGroup*>(group);
    const int64_t cp = pg.size();
    const std::optional<double> sc = has_scale ? std::optional<double>(scale) : std::nullopt;
    auto [kf, vf] = gather_kv(k, v, pg, causal, rep);
    // The output in the CPU flash kernel's layout, [B, L, H, E] in memory seen as [B, H, L, E] (what SDPA returns
    // there): the model's transpose(1, 2).reshape back to [B, L, H * E] is then a view, not a copy that the next
    // Linear would save for backward besides this output.
    auto out = torch::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2);
    auto lse = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(torch::kFloat32));
    for (const auto& chunk : query_chunks(q.size(2), kf.size(2), causal, cp, rank)) {
      auto qc = q.narrow(2, chunk.row_begin, chunk.rows).contiguous();
      torch::Tensor acc, acc_lse;
      for (const auto& part : chunk.parts) {
        auto [o, l] = at::_scaled_dot_product_flash_attention_for_cpu(
            qc, kf.narrow(2, part.k_begin, part.k_len), vf.narrow(2, part.k_begin, part.k_len), 0.0, part.causal,
            std::nullopt, sc);
        if (!acc.defined()) {
          acc = o.to(torch::kFloat32), acc_lse = l;
          continue;
        }
        auto merged = torch::logaddexp(acc_lse, l);
        acc = acc * torch::exp(acc_lse - merged).unsqueeze(-1) + o.to(torch::kFloat32) * torch::exp(l - merged).unsqueeze(-1);
        acc_lse = merged;
      }
      out.narrow(2, chunk.row_begin, chunk.rows).copy_(acc);
      lse.narrow(2, chunk.row_begin, chunk.rows).copy_(acc_lse);
    }
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["has_scale"] = has_scale;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["group"] = group;
    ctx->saved_data["rank"] = rank;
    ctx->saved_data["rep"] = rep;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const bool causal = ctx->saved_data["causal"].toBool();
    const std::optional<double> sc =
        ctx->saved_data["has_scale"].toBool() ? std::optional<double>(ctx->saved_data["scale"].toDouble()) : std::nullopt;
    auto& pg = *reinterpret_cast<ProcessGroup*>(ctx->saved_data["group"].toInt());
    const int64_t rep = ctx->saved_data["rep"].toInt();
    auto [kf, vf] = gather_kv(k, v, pg, causal, rep);
    auto dq = torch::zeros_like(q, at::MemoryFormat::Contiguous), dk = torch::zeros_like(kf), dv = torch::zeros_like(vf);
    const auto& dout = grads[0];
    for (const auto& chunk : query_chunks(q.size(2), kf.size(2), causal, pg.size(), ctx->saved_data["rank"].toInt())) {
      auto qc = q.narrow(2, chunk.row_begin, chunk.rows).contiguous();
      auto oc = out.narrow(2, chunk.row_begin, chunk.rows).contiguous();
      auto lc = lse.narrow(2, chunk.row_begin, chunk.rows).contiguous();
      auto gc = dout.narrow(2, chunk.row_begin, chunk.rows).contiguous();
      for (const auto& part : chunk.parts) {
        auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
            gc, qc, kf.narrow(2, part.k_begin, part.k_len), vf.narrow(2, part.k_begin, part.k_len), oc, lc, 0.0,
            part.causal, std::nullopt, sc);
        dq.narrow(2, chunk.row_begin, chunk.rows).add_(gq);
        dk.narrow(2, part.k_begin, part.k_len).add_(gk);
        dv.narrow(2, part.k_begin, part.k_len).add_(gv);
      }
    }
    kf = torch::Tensor(), vf = torch::Tensor();
    return {dq, scatter_grad_kv(dk, pg, causal, rep), scatter_grad_kv(dv, pg, causal, rep), torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

const torch::Tensor& causal_mask(CPState& st, int64_t local_len, const torch::Tensor& like) {
  auto key = std::make_tuple(local_len, static_cast<int>(like.scalar_type()), like.device().str());
  auto it = st.masks.find(key);
  if (it != st.masks.end()) return it->second;
  const int64_t seq = local_len * st.cp;
  auto kpos = context_parallel_load_balance_indices(seq, st.cp).to(like.device());
  auto qpos = kpos.narrow(0, st.rank * local_len, local_len);
  auto visible = kpos.unsqueeze(0) <= qpos.unsqueeze(1);  // [L/cp, L]
  auto mask = torch::zeros({local_len, seq}, like.options().requires_grad(false));
  mask.masked_fill_(visible.logical_not(), -std::numeric_limits<double>::infinity());
  return st.masks.emplace(key, mask).first->second;
}

// aten::scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None,
// float dropout_p=0.0, bool is_causal=False, *, float? scale=None, bool enable_gqa=False) -> Tensor
bool cp_sdpa(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  CPState* st = tls_state;
  if (!st) return false;
  auto args = torch::jit::last(*stack, 8);
  const torch::Tensor q = args[0].toTensor(), k = args[1].toTensor(), v = args[2].toTensor();
  const std::optional<torch::Tensor> attn_mask = args[3].toOptional<torch::Tensor>();
  const double dropout_p = args[4].toDouble();
  const bool is_causal = args[5].toBool();
  const std::optional<double> scale = args[6].toOptional<double>();
  const bool enable_gqa = args[7].toBool();
  const std::string where = "context_parallel (cp=" + std::to_string(st->cp) + "): scaled_dot_product_attention(query " +
                            shape_str(q) + ", key " + shape_str(k) + ", value " + shape_str(v) + ")";
  TORCH_CHECK(dropout_p == 0.0, where, ": dropout_p must be 0 under context parallelism, found ", dropout_p,
              " (ring attention would need the same dropout mask as one process); train without attention dropout");
  TORCH_CHECK(!attn_mask.has_value() || !attn_mask->defined(), where,
              ": an attn_mask is not supported under context parallelism, found one of shape ",
              shape_str(*attn_mask), " (its columns would have to follow the load-balanced key order); use is_causal=True");
  TORCH_CHECK(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim(), where,
              ": expected query, key and value of equal rank >= 2 ([..., L, E])");
  const int64_t seq_dim = q.dim() - 2;
  const int64_t lq = q.size(seq_dim), lk = k.size(seq_dim);
  if (is_causal) {
    TORCH_CHECK(lq == lk, where, ": is_causal needs equal local query and key lengths, found ", lq, " and ", lk);
    TORCH_CHECK(lq % 2 == 0, where, ": the local sequence length ", lq,
                " is odd, so it is not a load-balanced shard (two chunks of equal length); pass the tensors "
                "the sequence is computed from as buffers of context_parallel");
  }
  if (q.device().is_cpu() && q.dim() == 4) {
    // [Note: ring attention by all-gather]: flash attention block by block, K/V in original order.
    int64_t rep = 1;
    if (enable_gqa && k.size(1) != q.size(1)) {
      TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0 && v.size(1) == k.size(1), where,
                  ": enable_gqa needs the query heads (", q.size(1), ") to be a multiple of the key/value heads (",
                  k.size(1), ")");
      rep = q.size(1) / k.size(1);
    }
    TORCH_CHECK(k.size(1) * rep == q.size(1) && v.size(1) == k.size(1), where,
                ": expected as many key/value heads as query heads (or enable_gqa)");
    torch::Tensor out;
    {
      fsdp::detail::NoInterception below;  // its ops are plain ones on activations
      out = RingAttention::apply(q, k, v, is_causal, scale.has_value(), scale.value_or(0.0),
                                 reinterpret_cast<int64_t>(st->group.get()), st->rank, rep);
    }
    torch::jit::drop(*stack, 8);
    torch::jit::push(*stack, std::move(out));
    return true;
  }
  auto k_full = all_gather_seq(k, seq_dim, st->group);
  auto v_full = all_gather_seq(v, seq_dim, st->group);
  torch::Tensor mask;
  if (is_causal) mask = causal_mask(*st, lq, q);
  torch::Tensor out;
  {
    fsdp::detail::NoInterception below;  // the inner SDPA must not come back here
    out = at::scaled_dot_product_attention(q, k_full, v_full, mask.defined() ? std::optional<torch::Tensor>(mask)
                                                                           : std::nullopt,
                                           0.0, false, scale, enable_gqa);
  }
  torch::jit::drop(*stack, 8);
  torch::jit::push(*stack, std::move(out));
  (void)op;
  return true;
}

}  // namespace

torch::Tensor context_parallel_load_balance_indices(int64_t seq_length, int64_t cp_size, bool restore) {
  TORCH_CHECK(cp_size >= 1, "context_parallel: the CP size must be >= 1, found ", cp_size);
  TORCH_CHECK(seq_length % (2 * cp_size) == 0, "context_parallel: the sequence length ", seq_length,
              " is not a multiple of 2 * cp = ", 2 * cp_size,
              " (causal load balancing cuts it into 2 * cp chunks of equal length); pad or crop the sequence to a "
              "multiple of ",
              2 * cp_size);
  const int64_t c = seq_length / (2 * cp_size);
  auto chunks = torch::arange(seq_length, torch::kLong).view({2 * cp_size, c});
  auto head = torch::arange(cp_size, torch::kLong);
  auto tail = 2 * cp_size - 1 - head;
  auto idx = torch::stack({chunks.index_select(0, head), chunks.index_select(0, tail)}, 1).reshape({-1});
  return restore ? torch::argsort(idx) : idx;
}

torch::Tensor context_parallel_positions(int64_t seq_length, int64_t cp_size, int64_t cp_rank) {
  TORCH_CHECK(cp_rank >= 0 && cp_rank < cp_size, "context_parallel_positions: rank ", cp_rank,
              " is outside [0, ", cp_size, ")");
  const int64_t local = seq_length / cp_size;
  return context_parallel_load_balance_indices(seq_length, cp_size).narrow(0, cp_rank * local, local).clone();
}

std::vector<torch::Tensor> context_parallel_unshard(const DeviceMeshPtr& cp_mesh, const std::vector<torch::Tensor>& buffers,
                                                    const std::vector<int64_t>& seq_dims) {
  TORCH_CHECK(cp_mesh && cp_mesh->ndim() == 1, "context_parallel_unshard: expected a 1-D cp_mesh, found ",
              cp_mesh ? cp_mesh->str() : std::string("null"), "; pass one dimension of it, e.g. (*mesh)[\"cp\"]");
  TORCH_CHECK(buffers.size() == seq_dims.size(), "context_parallel_unshard: buffers and seq_dims must have the same ",
              "length, found ", buffers.size(), " buffers and ", seq_dims.size(), " seq dims");
  std::vector<int64_t> dims;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const auto& b = buffers[i];
    int64_t d = seq_dims[i];
    TORCH_CHECK(b.defined() && d >= -b.dim() && d < b.dim(), "context_parallel_unshard: seq_dims[", i, "] = ", d,
                " is out of range for buffer ", i, b.defined() ? " of shape " + shape_str(b) : std::string(" (undefined)"));
    d = d < 0 ? d + b.dim() : d;
    TORCH_CHECK(b.size(d) % 2 == 0, "context_parallel_unshard: buffer ", i, " (shape ", shape_str(b), ") has ", b.size(d),
                " positions along dim ", d, ", an odd number: not a shard that context_parallel left (two chunks)");
    dims.push_back(d);
  }
  torch::NoGradGuard no_grad;
  fsdp::detail::NoInterception plain;
  auto& pg = *cp_mesh->get_group(0);
  std::vector<torch::Tensor> out;
  for (size_t i = 0; i < buffers.size(); ++i) {
    auto full = gather_seq(buffers[i].detach(), dims[i], pg);
    auto restore = context_parallel_load_balance_indices(full.size(dims[i]), pg.size(), /*restore=*/true);
    out.push_back(full.index_select(dims[i], restore.to(full.device())));
  }
  return out;
}

namespace {
struct RegionState {
  CPState cp;
  bool included_before = false;
};
}  // namespace

context_parallel::context_parallel(const DeviceMeshPtr& cp_mesh, std::vector<torch::Tensor> buffers,
                                   std::vector<int64_t> buffer_seq_dims, std::vector<torch::Tensor> no_restore_buffers) {
  // Every check reads local, rank-identical shapes; nothing here communicates.
  TORCH_CHECK(cp_mesh, "context_parallel: cp_mesh is null; pass the CP dimension's mesh, e.g. (*mesh)[\"cp\"]");
  TORCH_CHECK(cp_mesh->ndim() == 1, "context_parallel: expected a 1-D cp_mesh, found ", cp_mesh->str(),
              "; pass one dimension of it, e.g. (*mesh)[\"cp\"]");
  TORCH_CHECK(tls_state == nullptr, "context_parallel: a context_parallel region is already alive on this thread; "
              "nested regions are not supported (end the outer one first)");
  TORCH_CHECK(buffers.size() == buffer_seq_dims.size(), "context_parallel: buffers and buffer_seq_dims must have the "
              "same length, found ", buffers.size(), " buffers and ", buffer_seq_dims.size(), " seq dims");
  const int64_t cp = cp_mesh->size();
  int64_t seq = -1;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const auto& b = buffers[i];
    TORCH_CHECK(b.defined(), "context_parallel: buffer ", i, " is undefined");
    TORCH_CHECK(!b.requires_grad(), "context_parallel: buffer ", i, " (shape ", shape_str(b),
                ") requires grad; buffers are inputs, labels and positions, never parameters");
    int64_t d = buffer_seq_dims[i];
    TORCH_CHECK(d >= -b.dim() && d < b.dim(), "context_parallel: buffer_seq_dims[", i, "] = ", d,
                " is out of range for buffer ", i, " of shape ", shape_str(b));
    d = d < 0 ? d + b.dim() : d;
    buffer_seq_dims[i] = d;
    if (seq < 0) seq = b.size(d);
    TORCH_CHECK(b.size(d) == seq, "context_parallel: every buffer must have the same sequence length; buffer 0 has ",
                seq, " and buffer ", i, " (shape ", shape_str(b), ", seq dim ", d, ") has ", b.size(d));
  }
  if (seq >= 0) {
    TORCH_CHECK(seq % (2 * cp) == 0, "context_parallel: the buffers' sequence length ", seq,
                " is not a multiple of 2 * cp = 2 * ", cp, " = ", 2 * cp,
                " (the causal load balancing cuts it into 2 * cp equal chunks); pad or crop the sequence to a multiple of ",
                2 * cp);
  }
  for (size_t j = 0; j < no_restore_buffers.size(); ++j) {
    bool found = false;
    for (const auto& b : buffers) found = found || b.unsafeGetTensorImpl() == no_restore_buffers[j].unsafeGetTensorImpl();
    TORCH_CHECK(found, "context_parallel: no_restore_buffers[", j, "] is not one of buffers (no_restore_buffers must be "
                "a subset of buffers, compared by identity)");
  }
  auto region = std::make_shared<RegionState>();
  region->cp.group = cp_mesh->get_group(0);
  region->cp.cp = cp;
  region->cp.rank = cp_mesh->get_local_rank(0);

  // Shard in place: this rank's slice of the load-balanced order.
  if (seq >= 0) {
    torch::NoGradGuard no_grad;
    fsdp::detail::NoInterception plain;
    positions_ = context_parallel_positions(seq, cp, region->cp.rank);
    for (size_t i = 0; i < buffers.size(); ++i) {
      auto& b = buffers[i];
      bool restore = true;
      for (const auto& n : no_restore_buffers) restore = restore && n.unsafeGetTensorImpl() != b.unsafeGetTensorImpl();
      originals_.push_back(restore ? b.clone() : torch::Tensor());
      auto shard = b.index_select(buffer_seq_dims[i], positions_.to(b.device()));
      b.resize_(shard.sizes());
      b.copy_(shard);
    }
    buffers_ = std::move(buffers);
  }

  fsdp::detail::install_sdpa_handler(&cp_sdpa);
  // An implicit checkpoint region open on this thread captured the thread's regions when it opened: it ends here
  // (and at this region's end), so that what follows is recorded under the state it runs in.
  fsdp::detail::close_implicit_region();
  region->included_before = c10::impl::tls_is_dispatch_key_included(kInterceptKey);
  c10::impl::tls_set_dispatch_key_included(kInterceptKey, true);
  tls_keep = std::shared_ptr<CPState>(region, &region->cp);
  tls_state = tls_keep.get();
  state_ = region;
}

context_parallel::~context_parallel() {
  fsdp::detail::close_implicit_region();
  auto region = std::static_pointer_cast<RegionState>(state_);
  tls_state = nullptr;
  tls_keep.reset();
  c10::impl::tls_set_dispatch_key_included(kInterceptKey, region->included_before);
  torch::NoGradGuard no_grad;
  fsdp::detail::NoInterception plain;
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (!originals_[i].defined()) continue;
    buffers_[i].resize_(originals_[i].sizes());
    buffers_[i].copy_(originals_[i]);
  }
}

}  // namespace fsdp::experimental
