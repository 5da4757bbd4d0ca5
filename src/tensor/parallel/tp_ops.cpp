// The ops of tensor-parallel modules: aten::linear and aten::embedding on a TP weight, run with the
// collectives of the module's style (Megatron-LM's f/g functions, as PyTorch's ColwiseParallel and
// RowwiseParallel place them through DTensor redistributes). Reached from the interception's fallback
// (utils/intercept.h; tp_run_op below is TP's layer); see docs/TENSOR_PARALLEL.md section 2.
#include "tensor/parallel/tp_ops.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include <torch/autograd.h>

#include "fsdp/c10d/collectives.h"
#include "tensor/parallel/loss_parallel.h"
#include "tensor/parallel/prepare_module.h"
#include "utils/intercept.h"

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
  // Held weakly too ([Note: identity by address] in fsdp/fsdp_interception.cpp): a weight's storage can be
  // replaced (fully_shard gives it one of its own) and the old one freed while the weight lives.
  struct StorageEntry {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    const c10::TensorImpl* weight;
  };
  std::unordered_map<const c10::StorageImpl*, StorageEntry> storages;
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

// Sequence parallelism: the activation is split along dim `dim` (the sequence) over the TP group.
// [T/tp] pieces rank-major along `dim`; both need `dim`'s size to divide evenly (checked by the callers).
// `out` with its dim 0 moved back to `dim`, as a contiguous tensor of its own: the autograd functions
// below return it, and an output that is a view (movedim's, which .contiguous() keeps when a size-1
// dim makes it contiguous already, e.g. one position per rank) may not be modified in place by the
// caller (a rowwise Linear's `+= bias`).
torch::Tensor back_from_front(const torch::Tensor& out, int64_t dim) {
  if (dim == 0) return out;
  return out.movedim(0, dim).clone(at::MemoryFormat::Contiguous);
}

torch::Tensor gather_along(const torch::Tensor& x, int64_t dim, ProcessGroup& pg) {
  auto front = x.movedim(dim, 0).contiguous();
  auto shape = front.sizes().vec();
  shape[0] *= pg.size();
  auto out = torch::empty(shape, front.options());
  all_gather_into_tensor(out, front, pg);
  return back_from_front(out, dim);
}
torch::Tensor reduce_scatter_along(const torch::Tensor& x, int64_t dim, ProcessGroup& pg) {
  auto front = x.movedim(dim, 0).contiguous();
  auto shape = front.sizes().vec();
  shape[0] /= pg.size();
  auto out = torch::empty(shape, front.options());
  reduce_scatter_tensor(out, front, pg, ReduceOp::SUM);
  return back_from_front(out, dim);
}

// All-gather along `dim` forward; reduce-scatter of the gradient backward, for a gathered tensor that each
// rank uses differently: the input of a column-parallel module under sequence parallelism (each rank's
// output features contribute a part of every position's input gradient, and each rank keeps its
// positions' sum), or a fused projection's output of which each rank takes its heads (fused_heads).
struct GatherSeq : torch::autograd::Function<GatherSeq> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t group,
                               int64_t dim) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    return gather_along(x, dim, *reinterpret_cast<ProcessGroup*>(group));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {reduce_scatter_along(grads[0], ctx->saved_data["dim"].toInt(), group_of(ctx)), torch::Tensor(),
            torch::Tensor()};
  }
};

// Reduce-scatter along the sequence forward (Partial -> Shard(d), the output of a row-parallel module
// under sequence parallelism); all-gather of the gradient backward.
struct ScatterSeq : torch::autograd::Function<ScatterSeq> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t group,
                               int64_t dim) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    return reduce_scatter_along(x, dim, *reinterpret_cast<ProcessGroup*>(group));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {gather_along(grads[0], ctx->saved_data["dim"].toInt(), group_of(ctx)), torch::Tensor(), torch::Tensor()};
  }
};

// Replicate -> Shard(dim): this rank's chunk forward; all-gather of the gradient backward.
struct ChunkSeq : torch::autograd::Function<ChunkSeq> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t group,
                               int64_t dim) {
    auto& pg = *reinterpret_cast<ProcessGroup*>(group);
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    const int64_t c = x.size(dim) / pg.size();
    return x.narrow(dim, pg.rank() * c, c).contiguous();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {gather_along(grads[0], ctx->saved_data["dim"].toInt(), group_of(ctx)), torch::Tensor(), torch::Tensor()};
  }
};

// Shard(dim) -> Replicate: all-gather forward; this rank's chunk of the gradient backward, for a gathered
// tensor that every rank uses alike (its gradient is replicated): the sequence after the last
// sequence-parallel block, or a column-parallel output with output_layouts(Replicate()) (dim -1).
struct UnchunkSeq : torch::autograd::Function<UnchunkSeq> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t group,
                               int64_t dim) {
    auto& pg = *reinterpret_cast<ProcessGroup*>(group);
    ctx->saved_data["rank"] = static_cast<int64_t>(pg.rank());
    ctx->saved_data["chunk"] = x.size(dim);
    ctx->saved_data["dim"] = dim;
    return gather_along(x, dim, pg);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const int64_t c = ctx->saved_data["chunk"].toInt(), r = ctx->saved_data["rank"].toInt();
    return {grads[0].narrow(ctx->saved_data["dim"].toInt(), r * c, c).contiguous(), torch::Tensor(), torch::Tensor()};
  }
};


// A sequence-sharded layout's dim (for the input's rank), checked to exist and, for `full`, to divide.
int64_t seq_dim(const TPParam& p, const Placement& layout, const torch::Tensor& x, bool full, int64_t tp) {
  const int64_t d = layout.dim;
  TORCH_CHECK(d < x.dim(), style_name(p.style), " on '", p.fqn, "': its sequence dim ", d, " does not exist in an input of shape ",
              x.sizes());
  TORCH_CHECK(!full || x.size(d) % tp == 0, style_name(p.style), " on '", p.fqn, "': the sequence (dim ", d, ") of ",
              x.size(d), " positions is not divisible by the TP size ", tp,
              "; sequence parallelism splits it evenly: use a sequence length that is a multiple of ", tp);
  return d;
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
    // Sequence-sharded input: all-gathered (its gradient reduce-scattered, which also sums what copy_to_tp
    // would); else replicated: copy_to_tp.
    const auto& in = p.style.input_layout;
    auto xf = in.is_shard() ? GatherSeq::apply(x, g, seq_dim(p, in, x, false, pg.size())) : CopyToTP::apply(x, g);
    if (p.style.output_layout.is_replicate()) {
      // The bias stays replicated for this layout (see apply_work): added after the all-gather.
      auto y = UnchunkSeq::apply(torch::linear(xf, w), g, xf.dim() - 1);
      if (bias && bias->defined()) y = y + *bias;
      return y;
    }
    return torch::linear(xf, w, bias);
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
  const auto& out = p.style.output_layout;
  if (out.is_shard()) {
    // Sequence-sharded output: reduce-scattered along the sequence. Each rank adds the bias to its own
    // positions only, so the bias's gradient is a partial sum: all-reduced.
    // (The bias is a partial_grad parameter: the fallback passed it through copy_to_tp already.)
    auto y = torch::linear(xi, w);
    y = ScatterSeq::apply(y, g, seq_dim(p, out, y, true, pg.size()));
    if (bias && bias->defined()) y = y + *bias;
    return y;
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
    if (p.style.output_layout.is_replicate()) y = UnchunkSeq::apply(y, g, y.dim() - 1);
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
  const auto& out = p.style.output_layout;
  if (out.is_shard()) return ScatterSeq::apply(y, g, seq_dim(p, out, y, true, pg.size()));  // sequence-sharded
  return ReduceFromTP::apply(y, g);
}

int64_t to_int(const c10::IValue& v) { return v.isInt() ? v.toInt() : v.toSymInt().guard_int(__FILE__, __LINE__); }

}  // namespace

// Whether any partial_grad parameter was registered: ops of models without one skip the lookups.
std::atomic<bool> any_partial_grad{false};

const char* style_name(const ParallelStyle& s) {
  switch (s.kind) {
    case ParallelStyle::Kind::COLWISE: return "ColwiseParallel";
    case ParallelStyle::Kind::ROWWISE: return "RowwiseParallel";
    case ParallelStyle::Kind::SEQUENCE: return "SequenceParallel";
    case ParallelStyle::Kind::CUSTOM: return s.custom ? "UserParallelStyle" : "UserParallelStyle(null)";
  }
  return "?";
}

void register_tp_param(const torch::Tensor& param, TPParam info) {
  if (info.partial_grad) any_partial_grad = true;
  auto& r = registry();
  std::unique_lock<std::shared_mutex> lock(r.mu);
  for (auto it = r.params.begin(); it != r.params.end();) it = it->second.impl.expired() ? r.params.erase(it) : std::next(it);
  for (auto it = r.storages.begin(); it != r.storages.end();) {
    it = r.params.count(it->second.weight) && !it->second.storage.expired() ? std::next(it) : r.storages.erase(it);
  }
  if (info.is_weight) {
    r.storages.insert_or_assign(param.storage().unsafeGetStorageImpl(),
                                Registry::StorageEntry{param.storage().getWeakStorageImpl(), param.unsafeGetTensorImpl()});
  }
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

bool has_tp_params_on(const DeviceMeshPtr& root) {
  auto& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.mu);
  for (const auto& [impl, e] : r.params) {
    if (!e.impl.expired() && e.info.mesh->root_mesh() == root) return true;
  }
  return false;
}

void check_fully_shard_over_tp(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                               const DeviceMeshPtr& mesh, int rank) {
  for (const auto& [name, t] : params) {
    const TPParam* p = find_tp_param(t);
    if (!p) continue;
    const auto fix = std::string(". Fix: build one mesh and slice both from it: mesh = fsdp::init_device_mesh(torch::kCPU, ") +
                     "{dp, tp}, {\"dp\", \"tp\"}); parallelize_module(model, mesh[\"tp\"], plan); then fully_shard(module, " +
                     "FullyShardOptions().mesh(mesh[\"dp\"])) (HSDP: mesh.slice({\"dp_replicate\", \"dp_shard\"}))";
    TORCH_CHECK(p->mesh->root_mesh() == mesh->root_mesh(), "fully_shard: parameter '", name, "' on rank ", rank,
                " is tensor-parallel on ", p->mesh->str(), ", but FSDP's mesh ", mesh->str(),
                " is not a slice of the same mesh, so the rows of its shards cannot be placed", fix);
    const auto& fd = mesh->root_dims();
    TORCH_CHECK(std::find(fd.begin(), fd.end(), p->mesh->root_dims()[0]) == fd.end(), "fully_shard: parameter '", name,
                "' on rank ", rank, " is tensor-parallel on ", p->mesh->str(), ", and FSDP's mesh ", mesh->str(),
                " contains that same dimension: a mesh dimension can shard a parameter only once", fix);
  }
}

namespace {

// If `t` is the transpose of a TP Linear weight (the view F::linear passes to addmm/mm/matmul), the
// weight's record and the weight; else nullptr. The layout check keeps backward's uses of the same
// storage (wT.t(), the weight's own layout) out: those are ordinary ops.
const TPParam* find_transposed_weight(const torch::Tensor& t, torch::Tensor* weight) {
  if (!t.defined() || t.dim() != 2 || !t.has_storage()) return nullptr;
  auto& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.mu);
  // The view's base is the weight itself (a view of a view has the root as base); the storage is the
  // weight's only until fully_shard gives it storages of its own.
  auto pit = r.params.end();
  if (t.is_view()) pit = r.params.find(t._base().unsafeGetTensorImpl());
  if (pit == r.params.end()) {
    auto sit = r.storages.find(t.storage().unsafeGetStorageImpl());
    if (sit == r.storages.end() || sit->second.storage.expired()) return nullptr;
    pit = r.params.find(sit->second.weight);
  }
  if (pit == r.params.end() || (pit->second.info.is_embedding && !pit->second.info.tied_linear_style)) return nullptr;
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

namespace {

// What tp_handle_op would run: the TP record and weight of a TP module's op on the stack, or nullptr.
struct TPOp {
  const TPParam* p = nullptr;
  torch::Tensor w;
  enum class Kind { LINEAR, EMBEDDING, ADDMM, MATMUL } kind = Kind::LINEAR;
};

TPOp match_tp_op(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  static const auto linear = c10::Dispatcher::singleton().findSchemaOrThrow("aten::linear", "");
  static const auto embedding = c10::Dispatcher::singleton().findSchemaOrThrow("aten::embedding", "");
  static const auto addmm = c10::Dispatcher::singleton().findSchemaOrThrow("aten::addmm", "");
  static const auto mm = c10::Dispatcher::singleton().findSchemaOrThrow("aten::mm", "");
  static const auto matmul = c10::Dispatcher::singleton().findSchemaOrThrow("aten::matmul", "");
  const size_t nargs = op.schema().arguments().size();
  const size_t base = stack.size() - nargs;
  auto arg = [&](size_t i) -> const c10::IValue& { return stack[base + i]; };
  TPOp m;
  if (op == linear || op == embedding) {
    const bool is_linear = op == linear;
    const auto& wv = arg(is_linear ? 1 : 0);
    if (!wv.isTensor()) return m;
    const TPParam* p = find_tp_param(wv.toTensor());
    if (!p || !p->is_weight) return m;
    if (p->is_embedding == is_linear && !(is_linear && p->tied_linear_style)) return m;
    m.p = p;
    m.w = wv.toTensor();
    m.kind = is_linear ? TPOp::Kind::LINEAR : TPOp::Kind::EMBEDDING;
  } else if (op == mm || op == addmm || op == matmul) {
    // LibTorch's F::linear: addmm(bias, x, weight.t()) for a 2-D input with a bias, else
    // matmul(x, weight.t()) followed by `+= bias` (matmul has a kernel of its own on the key, see
    // ensure_interception_registered; mm is what it decomposes to for 2-D inputs elsewhere).
    const bool is_addmm = op == addmm;
    const auto& wv = arg(is_addmm ? 2 : 1);
    if (!wv.isTensor()) return m;
    if (is_addmm && (arg(3).toScalar().toDouble() != 1.0 || arg(4).toScalar().toDouble() != 1.0)) return m;
    m.p = find_transposed_weight(wv.toTensor(), &m.w);
    m.kind = is_addmm ? TPOp::Kind::ADDMM : TPOp::Kind::MATMUL;
  }
  return m;
}

}  // namespace

bool is_tp_op(const c10::OperatorHandle& op, const torch::jit::Stack& stack) { return match_tp_op(op, stack).p; }

int64_t tp_group_id(const DeviceMeshPtr& mesh, const char* api) {
  TORCH_CHECK(mesh && mesh->ndim() == 1, api, ": expected a 1-D TP mesh (e.g. mesh[\"tp\"]), got ",
              mesh ? mesh->str() : std::string("null"));
  return group_id(mesh);
}

torch::Tensor chunk_sequence(const torch::Tensor& x, const DeviceMeshPtr& mesh, int64_t dim) {
  const int64_t g = tp_group_id(mesh, "distribute_sequence");
  const int64_t tp = mesh->size(0);
  if (dim < 0) dim += x.dim();
  TORCH_CHECK(dim >= 0 && dim < x.dim() && x.size(dim) % tp == 0, "distribute_sequence: dim ", dim, " of an input of shape ",
              x.sizes(), " must exist and divide by the TP size ", tp,
              "; sequence parallelism splits the sequence evenly: use a length that is a multiple of ", tp);
  fsdp::detail::NoInterception no_interception;
  return ChunkSeq::apply(x, g, dim);
}

torch::Tensor unchunk_sequence(const torch::Tensor& x, const DeviceMeshPtr& mesh, int64_t dim) {
  const int64_t g = tp_group_id(mesh, "gather_sequence");
  if (dim < 0) dim += x.dim();
  TORCH_CHECK(dim >= 0 && dim < x.dim(), "gather_sequence: dim ", dim, " out of range for shape ", x.sizes());
  fsdp::detail::NoInterception no_interception;
  return UnchunkSeq::apply(x, g, dim);
}

std::vector<torch::Tensor> fused_heads(const torch::Tensor& local, const DeviceMeshPtr& mesh, int64_t n_fused) {
  const int64_t g = tp_group_id(mesh, "local_heads_of_fused");
  const int64_t tp = mesh->size(0), t = mesh->get_local_rank(0);
  const int64_t full = local.size(-1) * tp;
  TORCH_CHECK(n_fused >= 1 && full % n_fused == 0 && (full / n_fused) % tp == 0, "local_heads_of_fused: a local output of ",
              local.size(-1), " features on ", tp, " TP ranks is ", full, " features, which does not split into ", n_fused,
              " parts of a size divisible by ", tp);
  fsdp::detail::NoInterception no_interception;
  auto gathered = GatherSeq::apply(local, g, local.dim() - 1);
  const int64_t c = full / n_fused, mine = c / tp;
  std::vector<torch::Tensor> out;
  for (int64_t j = 0; j < n_fused; ++j) out.push_back(gathered.narrow(-1, j * c + t * mine, mine));
  return out;
}

void wrap_partial_grad_params(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!any_partial_grad || !torch::GradMode::is_enabled()) return;
  const auto& args = op.schema().arguments();
  const size_t base = stack->size() - args.size();
  for (size_t a = 0; a < args.size(); ++a) {
    auto& iv = (*stack)[base + a];
    if (!iv.isTensor() || (args[a].alias_info() && args[a].alias_info()->isWrite())) continue;
    const auto& t = iv.toTensor();
    if (!t.defined() || !t.requires_grad()) continue;
    const TPParam* p = find_tp_param(t);
    if (!p || !p->partial_grad) continue;
    fsdp::detail::NoInterception no_interception;
    iv = CopyToTP::apply(t, group_id(p->mesh));
  }
}

bool tp_handle_op(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const TPOp m = match_tp_op(op, *stack);
  if (!m.p) return false;
  check_boundary_use(m.w);  // [Note: module boundaries]: a module with boundary styles called around its holder
  const size_t nargs = op.schema().arguments().size();
  const size_t base = stack->size() - nargs;
  auto arg = [&](size_t i) -> const c10::IValue& { return (*stack)[base + i]; };
  // The collectives and the local op run without interception (they see the weight itself).
  fsdp::detail::NoInterception no_interception;
  torch::Tensor out;
  // A tied Embedding weight used as a Linear weight: run the Linear's style ([Note: tied TP styles]).
  std::optional<TPParam> as_linear;
  if (m.p->is_embedding && m.kind != TPOp::Kind::EMBEDDING) {
    as_linear = *m.p;
    as_linear->is_embedding = false;
    as_linear->style = *m.p->tied_linear_style;
    as_linear->fqn = m.p->tied_linear_fqn;
  }
  const TPParam& lp = as_linear ? *as_linear : *m.p;
  switch (m.kind) {
    case TPOp::Kind::LINEAR:
      out = tp_linear(lp, arg(0).toTensor(), m.w, arg(2).toOptional<torch::Tensor>());
      break;
    case TPOp::Kind::EMBEDDING:
      out = tp_embedding(*m.p, m.w, arg(1).toTensor(), to_int(arg(2)), arg(3).toBool(), arg(4).toBool());
      break;
    case TPOp::Kind::ADDMM:
      out = tp_linear(lp, arg(1).toTensor(), m.w, arg(0).toTensor());
      break;
    case TPOp::Kind::MATMUL:
      out = tp_linear(lp, arg(0).toTensor(), m.w, c10::nullopt);
      break;
  }
  // A colwise Linear's vocabulary-sharded output: what a loss_parallel region recognises ([Note: loss_parallel
  // guard] in loss_parallel.cpp).
  if (m.kind != TPOp::Kind::EMBEDDING && lp.style.kind == ParallelStyle::Kind::COLWISE && lp.style.output_layout.is_shard()) {
    register_vocab_sharded_output(out, lp.mesh, m.w.size(0));
  }
  torch::jit::drop(*stack, nargs);
  torch::jit::push(*stack, std::move(out));
  return true;
}

void tp_run_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (fsdp::detail::is_metadata_op(op)) return fsdp::detail::redispatch_below_intercept(op, ks, stack);
  fsdp::detail::NoInterception no_interception;
  wrap_partial_grad_params(op, stack);
  if (!tp_handle_op(op, ks, stack)) fsdp::detail::redispatch_below_intercept(op, ks, stack);
}

namespace {
void tp_composite(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (is_tp_op(op, *stack)) return tp_run_op(op, ks, stack);
  fsdp::detail::redispatch_below_intercept(op, ks, stack);
}
}  // namespace

void ensure_tp_interception() {
  fsdp::detail::install_intercept_layer(fsdp::detail::InterceptLayer::TensorParallel, &tp_run_op, &tp_composite);
}

}  // namespace fsdp::tp::detail
