// The ops of tensor-parallel modules: aten::linear and aten::embedding on a TP weight, run with the
// collectives of the module's style (Megatron-LM's f/g functions, as PyTorch's ColwiseParallel and
// RowwiseParallel place them through DTensor redistributes). Reached from the dispatcher fallback in
// fsdp_interception.cpp; see docs/TENSOR_PARALLEL.md section 2.
#include "tp_ops.h"

#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include <torch/autograd.h>

#include "fsdp/collectives.h"
#include "fsdp_interception.h"

namespace fsdp::tp::detail {
namespace {

// Keyed by TensorImpl; each entry holds a weak reference to it, which keeps the address from being
// reused while the entry exists, and tells a dead parameter's entry (erased at the next registration).
struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  TPParam info;
};
struct Registry {
  std::shared_mutex mu;
  std::unordered_map<const c10::TensorImpl*, Entry> params;
  // Storage of each TP weight -> the weight: F::linear transposes the weight (a view on its storage)
  // before addmm/matmul, so those ops see an alias, not the parameter.
  std::unordered_map<const c10::StorageImpl*, const c10::TensorImpl*> storages;
};
Registry& registry() {
  static auto* r = new Registry();  // never destroyed: read by the fallback until the process ends
  return *r;
}

// The autograd functions get the group as a raw pointer in saved_data (an IValue cannot hold our
// ProcessGroup). Safe: the TP registry's mesh keeps the group alive as long as the parameter exists,
// and a graph that reaches these nodes holds the parameter.
int64_t group_id(const DeviceMeshPtr& mesh) { return reinterpret_cast<int64_t>(mesh->get_group(0).get()); }
ProcessGroup& group_of(torch::autograd::AutogradContext* ctx) {
  return *reinterpret_cast<ProcessGroup*>(ctx->saved_data["group"].toInt());
}

// Identity forward; all-reduce (sum) of the gradient backward: the input of a column-parallel module is
// replicated, and each rank's part of its gradient comes from that rank's output features only.
struct CopyToTP : torch::autograd::Function<CopyToTP> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor()};
    auto g = grads[0].contiguous().clone();
    all_reduce(g, group_of(ctx), ReduceOp::SUM);
    return {g, torch::Tensor()};
  }
};

// All-reduce (sum) forward; identity backward: the Partial output of a row-parallel module becomes
// Replicate, and d(sum)/d(summand) is the identity.
struct ReduceFromTP : torch::autograd::Function<ReduceFromTP> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x, int64_t group) {
    auto y = x.contiguous().clone();
    all_reduce(y, *reinterpret_cast<ProcessGroup*>(group), ReduceOp::SUM);
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], torch::Tensor()};
  }
};

// All-gather along the last dim forward (Shard(-1) -> Replicate, equal chunks); backward keeps this
// rank's chunk of the gradient.
struct GatherLastDim : torch::autograd::Function<GatherLastDim> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t group) {
    auto& pg = *reinterpret_cast<ProcessGroup*>(group);
    const int64_t k = pg.size();
    ctx->saved_data["rank"] = static_cast<int64_t>(pg.rank());
    ctx->saved_data["chunk"] = x.size(-1);
    auto front = x.movedim(-1, 0).contiguous();  // [c, ...]
    auto shape = front.sizes().vec();
    shape[0] *= k;
    auto gathered = torch::empty(shape, front.options());  // [k * c, ...], rank-major
    all_gather_into_tensor(gathered, front, pg);
    return gathered.movedim(0, -1).contiguous();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const int64_t c = ctx->saved_data["chunk"].toInt();
    const int64_t r = ctx->saved_data["rank"].toInt();
    return {grads[0].narrow(-1, r * c, c).contiguous(), torch::Tensor()};
  }
};

const char* style_name(const ParallelStyle& s) {
  return s.kind == ParallelStyle::Kind::COLWISE ? "ColwiseParallel" : "RowwiseParallel";
}

torch::Tensor tp_linear(const TPParam& p, const torch::Tensor& x, const torch::Tensor& w,
                        const c10::optional<torch::Tensor>& bias) {
  const int64_t g = group_id(p.mesh);
  const auto& pg = *p.mesh->get_group(0);
  const int64_t in_local = w.size(1);
  if (p.style.kind == ParallelStyle::Kind::COLWISE) {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_local, style_name(p.style), " on '", p.fqn,
                "': expected a replicated input with in_features = ", in_local, " in its last dim, got ",
                x.sizes());
    if (p.style.output_layout.is_replicate()) {
      // The bias stays replicated for this layout (see apply_work): added after the all-gather.
      auto y = GatherLastDim::apply(torch::linear(CopyToTP::apply(x, g), w), g);
      if (bias && bias->defined()) y = y + *bias;
      return y;
    }
    return torch::linear(CopyToTP::apply(x, g), w, bias);
  }
  torch::Tensor xi = x;
  if (p.style.input_layout.is_replicate()) {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_local * pg.size(), style_name(p.style), " on '", p.fqn,
                "' with input_layouts(Replicate()): expected the full input, in_features = ", in_local * pg.size(),
                " in its last dim, got ", x.sizes());
    xi = CopyToTP::apply(x, g).narrow(-1, pg.rank() * in_local, in_local);
  } else {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_local, style_name(p.style), " on '", p.fqn,
                "': expected this rank's shard of the input (input_layouts Shard(-1)): in_features / tp = ", in_local,
                " in its last dim, got ", x.sizes(), (x.dim() >= 1 && x.size(-1) == in_local * pg.size()
                ? "; this is the full input: use RowwiseParallel().input_layouts(Replicate())" : ""));
  }
  auto y = ReduceFromTP::apply(torch::linear(xi, w), g);
  if (bias && bias->defined()) y = y + *bias;  // once, after the reduction
  return y;
}

torch::Tensor tp_embedding(const TPParam& p, const torch::Tensor& w, const torch::Tensor& ids, int64_t padding_idx,
                           bool scale_grad_by_freq, bool sparse) {
  const int64_t g = group_id(p.mesh);
  const auto& pg = *p.mesh->get_group(0);
  if (p.style.kind == ParallelStyle::Kind::COLWISE) {
    auto y = torch::embedding(w, ids, padding_idx, scale_grad_by_freq, sparse);
    if (p.style.output_layout.is_replicate()) y = GatherLastDim::apply(y, g);
    return y;
  }
  // Rowwise: this rank owns ids [lo, lo + n); the others look up row 0 and are zeroed before the sum.
  const int64_t n = w.size(0);
  const int64_t lo = pg.rank() * n;
  auto outside = (ids < lo).logical_or(ids >= lo + n);
  auto local_ids = (ids - lo).masked_fill(outside, 0);
  const int64_t local_pad = padding_idx >= lo && padding_idx < lo + n ? padding_idx - lo : -1;
  auto y = torch::embedding(w, local_ids, local_pad, scale_grad_by_freq, sparse);
  y = y.masked_fill(outside.unsqueeze(-1), 0);
  return ReduceFromTP::apply(y, g);
}

int64_t to_int(const c10::IValue& v) { return v.isInt() ? v.toInt() : v.toSymInt().guard_int(__FILE__, __LINE__); }

}  // namespace

void register_tp_param(const torch::Tensor& param, TPParam info) {
  auto& r = registry();
  std::unique_lock<std::shared_mutex> lock(r.mu);
  for (auto it = r.params.begin(); it != r.params.end();) it = it->second.impl.expired() ? r.params.erase(it) : std::next(it);
  for (auto it = r.storages.begin(); it != r.storages.end();) it = r.params.count(it->second) ? std::next(it) : r.storages.erase(it);
  if (info.is_weight) r.storages[param.storage().unsafeGetStorageImpl()] = param.unsafeGetTensorImpl();
  r.params.insert_or_assign(param.unsafeGetTensorImpl(),
                            Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), std::move(info)});
}

const TPParam* find_tp_param(const torch::Tensor& param) {
  if (!param.defined()) return nullptr;
  auto& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.mu);
  auto it = r.params.find(param.unsafeGetTensorImpl());
  // `param` is alive, so its entry is not erased while the caller holds it.
  return it == r.params.end() || it->second.impl.expired() ? nullptr : &it->second.info;
}

namespace {

// If `t` is the transpose of a TP Linear weight (the view F::linear passes to addmm/mm/matmul), the
// weight's record and the weight; else nullptr. The layout check keeps backward's uses of the same
// storage (wT.t(), the weight's own layout) out: those are ordinary ops.
const TPParam* find_transposed_weight(const torch::Tensor& t, torch::Tensor* weight) {
  if (!t.defined() || t.dim() != 2 || !t.has_storage()) return nullptr;
  auto& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.mu);
  auto sit = r.storages.find(t.storage().unsafeGetStorageImpl());
  if (sit == r.storages.end()) return nullptr;
  auto pit = r.params.find(sit->second);
  if (pit == r.params.end() || pit->second.info.is_embedding) return nullptr;
  auto impl = pit->second.impl.lock();
  if (!impl) return nullptr;
  torch::Tensor w(std::move(impl));
  if (t.size(0) != w.size(1) || t.size(1) != w.size(0) || t.stride(0) != w.stride(1) || t.stride(1) != w.stride(0) ||
      t.storage_offset() != w.storage_offset()) {
    return nullptr;
  }
  *weight = w;
  return &pit->second.info;
}

}  // namespace

bool tp_handle_op(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  static const auto linear = c10::Dispatcher::singleton().findSchemaOrThrow("aten::linear", "");
  static const auto embedding = c10::Dispatcher::singleton().findSchemaOrThrow("aten::embedding", "");
  static const auto addmm = c10::Dispatcher::singleton().findSchemaOrThrow("aten::addmm", "");
  static const auto mm = c10::Dispatcher::singleton().findSchemaOrThrow("aten::mm", "");
  static const auto matmul = c10::Dispatcher::singleton().findSchemaOrThrow("aten::matmul", "");
  const size_t nargs = op.schema().arguments().size();
  const size_t base = stack->size() - nargs;
  auto arg = [&](size_t i) -> const c10::IValue& { return (*stack)[base + i]; };
  torch::Tensor out;
  if (op == linear || op == embedding) {
    const bool is_linear = op == linear;
    const auto& wv = arg(is_linear ? 1 : 0);
    if (!wv.isTensor()) return false;
    const TPParam* p = find_tp_param(wv.toTensor());
    if (!p || !p->is_weight || p->is_embedding == is_linear) return false;
    // The collectives and the local op run without interception (they see the weight itself).
    fsdp::detail::NoInterception no_interception;
    if (is_linear) {
      out = tp_linear(*p, arg(0).toTensor(), arg(1).toTensor(), arg(2).toOptional<torch::Tensor>());
    } else {
      out = tp_embedding(*p, arg(0).toTensor(), arg(1).toTensor(), to_int(arg(2)), arg(3).toBool(), arg(4).toBool());
    }
  } else if (op == mm || op == addmm || op == matmul) {
    // LibTorch's F::linear: addmm(bias, x, weight.t()) for a 2-D input with a bias, else
    // matmul(x, weight.t()) followed by `+= bias` (matmul has a kernel of its own on the key, see
    // ensure_interception_registered; mm is what it decomposes to for 2-D inputs elsewhere).
    const bool is_addmm = op == addmm;
    const auto& wv = arg(is_addmm ? 2 : 1);
    if (!wv.isTensor()) return false;
    torch::Tensor w;
    const TPParam* p = find_transposed_weight(wv.toTensor(), &w);
    if (!p) return false;
    if (is_addmm && (arg(3).toScalar().toDouble() != 1.0 || arg(4).toScalar().toDouble() != 1.0)) return false;
    fsdp::detail::NoInterception no_interception;
    c10::optional<torch::Tensor> bias;
    if (is_addmm) bias = arg(0).toTensor();
    out = tp_linear(*p, arg(is_addmm ? 1 : 0).toTensor(), w, bias);
  } else {
    return false;
  }
  torch::jit::drop(*stack, nargs);
  torch::jit::push(*stack, std::move(out));
  return true;
}

}  // namespace fsdp::tp::detail
