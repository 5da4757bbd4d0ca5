#include "fsdp/tensor/dtensor_ops.h"

#include <algorithm>
#include <numeric>
#include <sstream>

#include <ATen/InferSize.h>

#include "tensor/dtensor_autograd.h"

namespace fsdp::dtensor {

// [Note: DTensor ops]
// Design: DTensor stays a value type (local tensor + mesh + placements + global shape) and ops are free
// functions (plus operators) in fsdp::dtensor. Each op is three steps:
//   1. sharding propagation: from the inputs' placements and shapes, the placements each input must have
//      and the output's, per mesh dim (the rules of PyTorch's strategies in torch/distributed/tensor/_ops/,
//      written out per op family below: pointwise, reduction, matmul, view, cat/split, softmax);
//   2. the inputs are redistributed to those placements (differentiably; usually nothing moves), and an
//      input that is Replicate on a mesh dim where the output is Shard or Partial is wrapped in
//      grad_all_reduce, so that its gradient keeps the layout of [Note: DTensor autograd];
//   3. the ATen op runs on the local tensors and the result is wrapped in a DTensor, whose constructor
//      checks the local shape against the global shape and placements (a wrong rule fails loudly).
// Why not the dispatcher (a DTensor key on the local tensor, as the TP interception does): DTensor's
// metadata (placements, global shape) would have to live beside a plain tensor that ATen ops create and
// copy freely, LibTorch has no tensor subclass to carry it, and the implicit FSDP/TP fallback already owns
// the key's meaning for parameters. A value type keeps the metadata exact, makes each rule one readable
// function, and leaves autograd to ordinary local ops.
// What it cannot do: ops other than those listed in dtensor_ops.h (use local_map or to_local); PyTorch's
// cost-based choice among strategies (libfsdp follows the first, most sharded input and redistributes the
// others); lazy Partial gradients (see [Note: DTensor autograd]); view/reshape that split or merge a
// sharded dim (refused with the fix); broadcasting of a dim that is sharded (the broadcast input is
// replicated instead).

namespace {

using detail::grad_all_reduce;

std::string placements_list(const std::vector<Placement>& ps) {
  std::string s = "[";
  for (size_t i = 0; i < ps.size(); ++i) s += (i ? ", " : "") + ps[i].str();
  return s + "]";
}

std::string inputs_desc(const std::vector<const DTensor*>& in) {
  std::string s;
  for (size_t i = 0; i < in.size(); ++i) {
    s += (i ? ", " : "") + std::string("input ") + std::to_string(i) + " " + placements_list(in[i]->placements()) +
         " shape " + c10::str(c10::IntArrayRef(in[i]->sizes()));
  }
  return s;
}

[[noreturn]] void no_rule(const std::string& op, const std::vector<const DTensor*>& in, const std::string& why,
                          const std::string& fix) {
  TORCH_CHECK(false, "fsdp::DTensor: no sharding rule for aten::", op, " with placements ", inputs_desc(in), ": ",
              why, ". Fix: ", fix);
}

void check_same_mesh(const std::string& op, const std::vector<const DTensor*>& in) {
  for (const auto* t : in) TORCH_CHECK(t->device_mesh(), "fsdp::DTensor: aten::", op, " on a DTensor without a mesh");
  for (size_t i = 1; i < in.size(); ++i) {
    TORCH_CHECK(in[i]->device_mesh() == in[0]->device_mesh() ||
                    (in[i]->device_mesh()->ranks() == in[0]->device_mesh()->ranks() &&
                     in[i]->device_mesh()->shape() == in[0]->device_mesh()->shape() &&
                     in[i]->device_mesh()->root_dims() == in[0]->device_mesh()->root_dims()),
                "fsdp::DTensor: aten::", op, " on DTensors of different meshes: ", in[0]->device_mesh()->str(), " and ",
                in[i]->device_mesh()->str(), ". Fix: redistribute both onto one mesh");
  }
}

int64_t wrap_dim(int64_t d, int64_t ndim, const std::string& op) {
  const int64_t n = std::max<int64_t>(ndim, 1);
  TORCH_CHECK(d >= -n && d < n, "fsdp::DTensor: aten::", op, ": dim ", d, " is out of range for a ", ndim,
              "-D tensor (expected ", -n, " .. ", n - 1, ")");
  return d < 0 ? d + n : d;
}

// The DTensor `t` redistributed to `target` and its local tensor, wrapped for the gradient when `t` is
// Replicate on a mesh dim whose output is Shard or Partial (see [Note: DTensor ops], step 2).
torch::Tensor prepare(const DTensor& t, const std::vector<Placement>& target, const std::vector<Placement>& out) {
  DTensor r = t.redistribute(target);
  std::vector<int64_t> dims;
  for (size_t m = 0; m < target.size(); ++m) {
    if (target[m].is_replicate() && !out[m].is_replicate()) dims.push_back(static_cast<int64_t>(m));
  }
  return grad_all_reduce(r.to_local(), r.device_mesh(), dims);
}

DTensor make(torch::Tensor local, const DTensor& like, std::vector<Placement> placements, std::vector<int64_t> shape) {
  return DTensor(std::move(local), like.device_mesh(), std::move(placements), std::move(shape));
}

// ---- Pointwise ---------------------------------------------------------------------------------------

// How an op may keep Partial inputs Partial (it is linear in them).
enum class PartialRule {
  NONE,    // reduce every Partial input first
  JOINT,   // add/sub: every input Partial with the same linear op
  FIRST,   // div: input 0 Partial(sum/avg), the others Replicate
  ANY_ONE  // mul, neg, scalar mul: one input Partial(sum/avg), the others Replicate
};

DTensor pointwise(const std::string& op, const std::vector<DTensor>& inputs, PartialRule rule,
                  const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& fn) {
  std::vector<const DTensor*> in;
  for (const auto& t : inputs) in.push_back(&t);
  check_same_mesh(op, in);
  const auto& mesh = *inputs[0].device_mesh();
  // Broadcast shape.
  int64_t out_ndim = 0;
  for (const auto* t : in) out_ndim = std::max<int64_t>(out_ndim, static_cast<int64_t>(t->sizes().size()));
  std::vector<int64_t> out_shape(out_ndim, 1);
  for (const auto* t : in) {
    const int64_t off = out_ndim - static_cast<int64_t>(t->sizes().size());
    for (size_t i = 0; i < t->sizes().size(); ++i) {
      const int64_t s = t->sizes()[i];
      auto& o = out_shape[off + i];
      TORCH_CHECK(s == o || s == 1 || o == 1, "fsdp::DTensor: aten::", op, ": the shapes do not broadcast (",
                  inputs_desc(in), ")");
      if (o == 1) o = s;
    }
  }
  auto aligned = [&](const DTensor& t, int64_t out_dim) -> int64_t {  // t's dim for out_dim, -1: broadcast
    const int64_t off = out_ndim - static_cast<int64_t>(t.sizes().size());
    const int64_t d = out_dim - off;
    if (d < 0 || t.sizes()[d] != out_shape[out_dim]) return -1;
    return d;
  };
  // Leader order: most dims, then most Shard placements, then first.
  std::vector<size_t> order(in.size());
  std::iota(order.begin(), order.end(), 0);
  auto shards = [&](size_t i) {
    return std::count_if(in[i]->placements().begin(), in[i]->placements().end(), [](const Placement& p) { return p.is_shard(); });
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (in[a]->sizes().size() != in[b]->sizes().size()) return in[a]->sizes().size() > in[b]->sizes().size();
    return shards(a) > shards(b);
  });

  std::vector<std::vector<Placement>> target(in.size(), std::vector<Placement>(mesh.ndim(), Replicate()));
  std::vector<Placement> out(mesh.ndim(), Replicate());
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    // Partial kept?
    bool keep = false;
    if (rule == PartialRule::JOINT) {
      keep = in[0]->placements()[m].is_linear_partial();
      for (const auto* t : in) keep = keep && t->placements()[m] == in[0]->placements()[m];
      if (keep) {
        out[m] = in[0]->placements()[m];
        for (size_t i = 0; i < in.size(); ++i) target[i][m] = out[m];
      }
    } else if (rule == PartialRule::FIRST || rule == PartialRule::ANY_ONE) {
      int partial = -1, others_ok = 1;
      for (size_t i = 0; i < in.size(); ++i) {
        const auto& p = in[i]->placements()[m];
        if (p.is_linear_partial() && partial < 0 && (rule == PartialRule::ANY_ONE || i == 0)) partial = static_cast<int>(i);
        else if (!p.is_replicate()) others_ok = 0;
      }
      keep = partial >= 0 && others_ok;
      if (keep) {
        out[m] = in[partial]->placements()[m];
        target[partial][m] = out[m];
      }
    }
    if (keep) continue;
    // Shard from the leader (the first in order whose Shard dim is not broadcast).
    for (size_t i : order) {
      const auto& p = in[i]->placements()[m];
      if (!p.is_shard()) continue;
      const int64_t od = p.dim + out_ndim - static_cast<int64_t>(in[i]->sizes().size());
      if (aligned(*in[i], od) < 0) continue;  // a sharded size-1 dim that broadcasts: replicate it
      out[m] = Shard(od);
      break;
    }
    if (out[m].is_shard()) {
      for (size_t i = 0; i < in.size(); ++i) {
        const int64_t d = aligned(*in[i], out[m].dim);
        target[i][m] = d < 0 ? Replicate() : Shard(d);
      }
    }
  }
  std::vector<torch::Tensor> locals;
  for (size_t i = 0; i < in.size(); ++i) locals.push_back(prepare(*in[i], target[i], out));
  return make(fn(locals), inputs[0], out, out_shape);
}

DTensor replicated_like(const torch::Tensor& t, const DTensor& like) {
  return DTensor(t, like.device_mesh(), std::vector<Placement>(like.device_mesh()->ndim(), Replicate()), t.sizes().vec());
}

DTensor unary(const std::string& op, const DTensor& a, PartialRule rule, std::function<torch::Tensor(const torch::Tensor&)> fn) {
  return pointwise(op, {a}, rule, [&](const std::vector<torch::Tensor>& l) { return fn(l[0]); });
}

// ---- Reductions --------------------------------------------------------------------------------------

enum class Reduction { SUM, MEAN, MAX, MIN };

// Placements of a reduction over `dims` (sorted, wrapped): the input's targets and the output's.
void reduction_placements(const DTensor& a, const std::vector<int64_t>& dims, bool keepdim, Reduction kind,
                          std::vector<Placement>& target, std::vector<Placement>& out) {
  const auto& ps = a.placements();
  target = ps;
  out.assign(ps.size(), Replicate());
  const bool linear = kind == Reduction::SUM || kind == Reduction::MEAN;
  for (size_t m = 0; m < ps.size(); ++m) {
    const auto& p = ps[m];
    if (p.is_shard()) {
      if (std::find(dims.begin(), dims.end(), p.dim) != dims.end()) {
        if (linear) {
          out[m] = Partial("sum");
        } else {
          target[m] = Replicate();
        }
      } else {
        int64_t d = p.dim;
        if (!keepdim) d -= std::count_if(dims.begin(), dims.end(), [&](int64_t r) { return r < p.dim; });
        out[m] = Shard(d);
      }
    } else if (p.is_partial()) {
      if (linear && p.is_linear_partial()) out[m] = p;
      else target[m] = Replicate();
    }
  }
  // Shard -> Replicate of an outer mesh dim changes an inner one's chunks of the same dim: targets are
  // whatever redistribute makes of them (it re-chunks), outputs follow the targets.
}

std::vector<int64_t> reduce_dims(const DTensor& a, std::vector<int64_t> dims, const std::string& op) {
  const int64_t nd = static_cast<int64_t>(a.sizes().size());
  if (dims.empty()) {
    dims.resize(nd);
    std::iota(dims.begin(), dims.end(), 0);
  }
  for (auto& d : dims) d = wrap_dim(d, nd, op);
  std::sort(dims.begin(), dims.end());
  TORCH_CHECK(std::adjacent_find(dims.begin(), dims.end()) == dims.end(), "fsdp::DTensor: aten::", op,
              ": a dim appears twice in the reduced dims");
  return dims;
}

std::vector<int64_t> reduced_shape(const std::vector<int64_t>& shape, const std::vector<int64_t>& dims, bool keepdim) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < static_cast<int64_t>(shape.size()); ++i) {
    if (std::find(dims.begin(), dims.end(), i) == dims.end()) out.push_back(shape[i]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

DTensor sum_or_mean(const DTensor& a, std::vector<int64_t> dims_in, bool keepdim, bool all, Reduction kind) {
  const std::string op = kind == Reduction::SUM ? "sum" : "mean";
  auto dims = reduce_dims(a, all ? std::vector<int64_t>{} : std::move(dims_in), op);
  std::vector<Placement> target, out;
  reduction_placements(a, dims, keepdim, kind, target, out);
  auto local = prepare(a, target, out);
  int64_t count = 1;
  for (int64_t d : dims) count *= a.sizes()[d];
  torch::Tensor r = dims.empty() ? local.clone() : local.sum(dims, keepdim);
  if (kind == Reduction::MEAN) r = r / static_cast<double>(count);  // the global count: exact for uneven shards
  return make(r, a, out, reduced_shape(a.sizes(), dims, keepdim));
}

std::tuple<DTensor, DTensor> max_min_dim(const DTensor& a, int64_t dim, bool keepdim, Reduction kind) {
  const std::string op = kind == Reduction::MAX ? "max.dim" : "min.dim";
  const int64_t d = wrap_dim(dim, static_cast<int64_t>(a.sizes().size()), op);
  std::vector<Placement> target, out;
  reduction_placements(a, {d}, keepdim, kind, target, out);
  auto local = prepare(a, target, out);
  auto [values, indices] = kind == Reduction::MAX ? local.max(d, keepdim) : local.min(d, keepdim);
  auto shape = reduced_shape(a.sizes(), {d}, keepdim);
  return {make(values, a, out, shape), make(indices, a, out, shape)};
}

DTensor max_min_all(const DTensor& a, Reduction kind) {
  auto dims = reduce_dims(a, {}, kind == Reduction::MAX ? "max" : "min");
  std::vector<Placement> target, out;
  reduction_placements(a, dims, false, kind, target, out);
  auto local = prepare(a, target, out);
  return make(kind == Reduction::MAX ? local.max() : local.min(), a, out, {});
}

// ---- View ----------------------------------------------------------------------------------------------

DTensor view_or_reshape(const DTensor& a, std::vector<int64_t> shape_in, bool is_view) {
  const std::string op = is_view ? "view" : "reshape";
  const auto& in_shape = a.sizes();
  int64_t numel = 1;
  for (auto s : in_shape) numel *= s;
  const auto shape = at::infer_size(shape_in, numel);  // throws for a shape of another numel
  auto out = a.placements();
  auto local_shape = shape;
  for (size_t m = 0; m < out.size(); ++m) {
    const auto& p = out[m];
    if (!p.is_shard()) continue;
    int64_t prefix = 1;
    for (int64_t i = 0; i < p.dim; ++i) prefix *= in_shape[i];
    int64_t e = -1, acc = 1;
    for (int64_t j = 0; j < static_cast<int64_t>(shape.size()); ++j) {
      if (acc == prefix && shape[j] == in_shape[p.dim]) {
        e = j;
        break;
      }
      acc *= shape[j];
      if (acc > prefix && prefix > 0) break;
    }
    if (e < 0) {
      no_rule(op, {&a},
              "the new shape " + c10::str(c10::IntArrayRef(shape)) + " splits or merges sharded dim " + std::to_string(p.dim) +
                  " (size " + std::to_string(in_shape[p.dim]) + ")",
              "redistribute mesh dim " + std::to_string(m) + " to Replicate() (or shard another dim) before aten::" + op);
    }
    out[m] = Shard(e);
  }
  // Local shape: the output shape with each sharded output dim at its local size (the input's local
  // size of the matching dim).
  const auto& local = a.to_local();
  for (size_t m = 0; m < out.size(); ++m) {
    if (out[m].is_shard()) local_shape[out[m].dim] = local.size(a.placements()[m].dim);
  }
  return make(is_view ? local.view(local_shape) : local.reshape(local_shape), a, out, shape);
}

// ---- Softmax ---------------------------------------------------------------------------------------------

DTensor softmax_like(const DTensor& a, int64_t dim, bool log) {
  const std::string op = log ? "_log_softmax" : "_softmax";
  const int64_t d = wrap_dim(dim, static_cast<int64_t>(a.sizes().size()), op);
  auto target = a.placements();
  for (auto& p : target)
    if (p.is_partial() || p.is_shard(d)) p = Replicate();
  auto local = prepare(a, target, target);
  return make(log ? torch::log_softmax(local, d) : torch::softmax(local, d), a, target, a.sizes());
}

}  // namespace

// ---- Pointwise API ---------------------------------------------------------------------------------------

DTensor add(const DTensor& a, const DTensor& b, const c10::Scalar& alpha) {
  return pointwise("add.Tensor", {a, b}, PartialRule::JOINT, [&](const auto& l) { return torch::add(l[0], l[1], alpha); });
}
DTensor add(const DTensor& a, const torch::Tensor& b, const c10::Scalar& alpha) { return add(a, replicated_like(b, a), alpha); }
DTensor add(const DTensor& a, const c10::Scalar& s) {
  return unary("add.Scalar", a, PartialRule::NONE, [&](const torch::Tensor& x) { return torch::add(x, s); });
}
DTensor sub(const DTensor& a, const DTensor& b, const c10::Scalar& alpha) {
  return pointwise("sub.Tensor", {a, b}, PartialRule::JOINT, [&](const auto& l) { return torch::sub(l[0], l[1], alpha); });
}
DTensor sub(const DTensor& a, const torch::Tensor& b, const c10::Scalar& alpha) { return sub(a, replicated_like(b, a), alpha); }
DTensor sub(const DTensor& a, const c10::Scalar& s) {
  return unary("sub.Scalar", a, PartialRule::NONE, [&](const torch::Tensor& x) { return torch::sub(x, s); });
}
DTensor mul(const DTensor& a, const DTensor& b) {
  return pointwise("mul.Tensor", {a, b}, PartialRule::ANY_ONE, [](const auto& l) { return torch::mul(l[0], l[1]); });
}
DTensor mul(const DTensor& a, const torch::Tensor& b) { return mul(a, replicated_like(b, a)); }
DTensor mul(const DTensor& a, const c10::Scalar& s) {
  return unary("mul.Scalar", a, PartialRule::ANY_ONE, [&](const torch::Tensor& x) { return torch::mul(x, s); });
}
DTensor div(const DTensor& a, const DTensor& b) {
  return pointwise("div.Tensor", {a, b}, PartialRule::FIRST, [](const auto& l) { return torch::div(l[0], l[1]); });
}
DTensor div(const DTensor& a, const torch::Tensor& b) { return div(a, replicated_like(b, a)); }
DTensor div(const DTensor& a, const c10::Scalar& s) {
  return unary("div.Scalar", a, PartialRule::ANY_ONE, [&](const torch::Tensor& x) { return torch::div(x, s); });
}
DTensor neg(const DTensor& a) { return unary("neg", a, PartialRule::ANY_ONE, [](const torch::Tensor& x) { return -x; }); }
DTensor exp(const DTensor& a) { return unary("exp", a, PartialRule::NONE, [](const torch::Tensor& x) { return x.exp(); }); }
DTensor log(const DTensor& a) { return unary("log", a, PartialRule::NONE, [](const torch::Tensor& x) { return x.log(); }); }
DTensor sqrt(const DTensor& a) { return unary("sqrt", a, PartialRule::NONE, [](const torch::Tensor& x) { return x.sqrt(); }); }
DTensor abs(const DTensor& a) { return unary("abs", a, PartialRule::NONE, [](const torch::Tensor& x) { return x.abs(); }); }
DTensor relu(const DTensor& a) { return unary("relu", a, PartialRule::NONE, [](const torch::Tensor& x) { return x.relu(); }); }
DTensor gelu(const DTensor& a, const std::string& approximate) {
  return unary("gelu", a, PartialRule::NONE, [&](const torch::Tensor& x) { return torch::gelu(x, approximate); });
}
DTensor silu(const DTensor& a) { return unary("silu", a, PartialRule::NONE, [](const torch::Tensor& x) { return torch::silu(x); }); }
DTensor tanh(const DTensor& a) { return unary("tanh", a, PartialRule::NONE, [](const torch::Tensor& x) { return x.tanh(); }); }
DTensor sigmoid(const DTensor& a) { return unary("sigmoid", a, PartialRule::NONE, [](const torch::Tensor& x) { return x.sigmoid(); }); }
DTensor sin(const DTensor& a) { return unary("sin", a, PartialRule::NONE, [](const torch::Tensor& x) { return x.sin(); }); }
DTensor cos(const DTensor& a) { return unary("cos", a, PartialRule::NONE, [](const torch::Tensor& x) { return x.cos(); }); }
DTensor pow(const DTensor& a, const c10::Scalar& e) {
  return unary("pow.Tensor_Scalar", a, PartialRule::NONE, [&](const torch::Tensor& x) { return x.pow(e); });
}

// ---- Reductions API --------------------------------------------------------------------------------------

DTensor sum(const DTensor& a) { return sum_or_mean(a, {}, false, true, Reduction::SUM); }
DTensor sum(const DTensor& a, std::vector<int64_t> dims, bool keepdim) {
  return sum_or_mean(a, std::move(dims), keepdim, false, Reduction::SUM);
}
DTensor mean(const DTensor& a) { return sum_or_mean(a, {}, false, true, Reduction::MEAN); }
DTensor mean(const DTensor& a, std::vector<int64_t> dims, bool keepdim) {
  return sum_or_mean(a, std::move(dims), keepdim, false, Reduction::MEAN);
}
DTensor max(const DTensor& a) { return max_min_all(a, Reduction::MAX); }
DTensor min(const DTensor& a) { return max_min_all(a, Reduction::MIN); }
std::tuple<DTensor, DTensor> max(const DTensor& a, int64_t dim, bool keepdim) { return max_min_dim(a, dim, keepdim, Reduction::MAX); }
std::tuple<DTensor, DTensor> min(const DTensor& a, int64_t dim, bool keepdim) { return max_min_dim(a, dim, keepdim, Reduction::MIN); }

// ---- Matmul ------------------------------------------------------------------------------------------------

DTensor matmul(const DTensor& a, const DTensor& b) {
  const std::string op = "matmul";
  check_same_mesh(op, {&a, &b});
  const int64_t an = static_cast<int64_t>(a.sizes().size()), bn = static_cast<int64_t>(b.sizes().size());
  const bool batched = bn > 2;
  if (an < 2 || bn < 2 || (batched && an != bn)) {
    no_rule(op, {&a, &b}, "libfsdp supports a [..., m, k] @ b [k, n] and a [B..., m, k] @ b [B..., k, n]",
            "reshape the operands to those forms, or use local_map on the local tensors");
  }
  const int64_t ak = an - 1, am = an - 2, bk = bn - 2, bnn = bn - 1;
  TORCH_CHECK(a.sizes()[ak] == b.sizes()[bk], "fsdp::DTensor: aten::matmul: inner sizes differ (", inputs_desc({&a, &b}), ")");
  if (batched) {
    for (int64_t i = 0; i < an - 2; ++i) {
      TORCH_CHECK(a.sizes()[i] == b.sizes()[i], "fsdp::DTensor: aten::matmul: batch sizes differ (", inputs_desc({&a, &b}),
                  "); broadcasting batch dims is not supported");
    }
  }
  const int64_t mesh_ndim = a.device_mesh()->ndim();
  std::vector<Placement> ta(mesh_ndim, Replicate()), tb(mesh_ndim, Replicate()), out(mesh_ndim, Replicate());
  for (int64_t m = 0; m < mesh_ndim; ++m) {
    Placement pa = a.placements()[m], pb = b.placements()[m];
    if (pa.is_partial() && !(pa.is_linear_partial() && pb.is_replicate())) pa = Replicate();
    if (pa.is_shard()) {
      if (pa.dim < am) {  // a batch dim
        ta[m] = pa;
        tb[m] = batched ? pa : Replicate();
        out[m] = pa;
      } else if (pa.dim == am) {
        ta[m] = pa;
        out[m] = Shard(an - 2);
      } else {  // k
        ta[m] = pa;
        tb[m] = Shard(bk);
        out[m] = Partial("sum");
      }
    } else if (pa.is_partial()) {  // linear Partial x Replicate
      ta[m] = pa;
      out[m] = pa;
    } else {  // a Replicate
      if (pb.is_shard(bnn)) {
        tb[m] = pb;
        out[m] = Shard(an - 1);
      } else if (pb.is_shard(bk)) {
        ta[m] = Shard(ak);
        tb[m] = pb;
        out[m] = Partial("sum");
      } else if (pb.is_shard() && batched) {  // a batch dim of b
        ta[m] = pb;
        tb[m] = pb;
        out[m] = pb;
      } else if (pb.is_linear_partial()) {
        tb[m] = pb;
        out[m] = pb;
      }
    }
  }
  auto la = prepare(a, ta, out), lb = prepare(b, tb, out);
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end() - 1);
  shape.push_back(b.sizes()[bnn]);
  return make(torch::matmul(la, lb), a, out, shape);
}

DTensor linear(const DTensor& x, const DTensor& weight, const std::optional<DTensor>& bias) {
  auto y = matmul(x, transpose(weight, 0, 1));
  return bias ? add(y, *bias) : y;
}

// ---- Shape ops -------------------------------------------------------------------------------------------------

DTensor transpose(const DTensor& a, int64_t dim0, int64_t dim1) {
  const int64_t n = static_cast<int64_t>(a.sizes().size());
  std::vector<int64_t> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  if (n > 0) std::swap(perm[wrap_dim(dim0, n, "transpose.int")], perm[wrap_dim(dim1, n, "transpose.int")]);
  return permute(a, perm);
}

DTensor permute(const DTensor& a, std::vector<int64_t> dims) {
  const int64_t n = static_cast<int64_t>(a.sizes().size());
  TORCH_CHECK(static_cast<int64_t>(dims.size()) == n, "fsdp::DTensor: aten::permute: ", dims.size(), " dims for a ", n,
              "-D tensor");
  for (auto& d : dims) d = wrap_dim(d, n, "permute");
  std::vector<int64_t> inverse(n, -1), shape(n);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(inverse[dims[i]] < 0, "fsdp::DTensor: aten::permute: dim ", dims[i], " repeated");
    inverse[dims[i]] = i;
    shape[i] = a.sizes()[dims[i]];
  }
  auto out = a.placements();
  for (auto& p : out)
    if (p.is_shard()) p = Shard(inverse[p.dim]);
  return make(a.to_local().permute(dims), a, out, shape);
}

DTensor view(const DTensor& a, std::vector<int64_t> shape) { return view_or_reshape(a, std::move(shape), true); }
DTensor reshape(const DTensor& a, std::vector<int64_t> shape) { return view_or_reshape(a, std::move(shape), false); }

DTensor cat(const std::vector<DTensor>& tensors, int64_t dim) {
  TORCH_CHECK(!tensors.empty(), "fsdp::DTensor: aten::cat: expected at least one DTensor");
  std::vector<const DTensor*> in;
  for (const auto& t : tensors) in.push_back(&t);
  check_same_mesh("cat", in);
  const int64_t n = static_cast<int64_t>(tensors[0].sizes().size());
  const int64_t d = wrap_dim(dim, n, "cat");
  auto shape = tensors[0].sizes();
  shape[d] = 0;
  for (const auto* t : in) {
    bool ok = static_cast<int64_t>(t->sizes().size()) == n;
    for (int64_t i = 0; ok && i < n; ++i) ok = i == d || t->sizes()[i] == tensors[0].sizes()[i];
    TORCH_CHECK(ok, "fsdp::DTensor: aten::cat: shapes differ outside dim ", d, " (", inputs_desc(in), ")");
    shape[d] += t->sizes()[d];
  }
  auto target = tensors[0].placements();
  for (auto& p : target)
    if (p.is_shard(d) || (p.is_partial() && !p.is_linear_partial())) p = Replicate();
  std::vector<torch::Tensor> locals;
  for (const auto* t : in) locals.push_back(prepare(*t, target, target));
  return make(torch::cat(locals, d), tensors[0], target, shape);
}

std::vector<DTensor> split(const DTensor& a, int64_t split_size, int64_t dim) {
  const int64_t d = wrap_dim(dim, static_cast<int64_t>(a.sizes().size()), "split.Tensor");
  TORCH_CHECK(split_size > 0 || a.sizes()[d] == 0, "fsdp::DTensor: aten::split.Tensor: split_size must be positive, got ",
              split_size);
  auto target = a.placements();
  for (auto& p : target)
    if (p.is_shard(d)) p = Replicate();
  auto local = prepare(a, target, target);
  std::vector<DTensor> out;
  for (auto& piece : local.split(split_size, d)) {
    auto shape = a.sizes();
    shape[d] = piece.size(d);
    out.push_back(make(piece, a, target, shape));
  }
  return out;
}

DTensor softmax(const DTensor& a, int64_t dim) { return softmax_like(a, dim, false); }
DTensor log_softmax(const DTensor& a, int64_t dim) { return softmax_like(a, dim, true); }

}  // namespace fsdp::dtensor

namespace fsdp {

DTensor operator+(const DTensor& a, const DTensor& b) { return dtensor::add(a, b); }
DTensor operator-(const DTensor& a, const DTensor& b) { return dtensor::sub(a, b); }
DTensor operator*(const DTensor& a, const DTensor& b) { return dtensor::mul(a, b); }
DTensor operator/(const DTensor& a, const DTensor& b) { return dtensor::div(a, b); }
DTensor operator+(const DTensor& a, const torch::Tensor& b) { return dtensor::add(a, b); }
DTensor operator-(const DTensor& a, const torch::Tensor& b) { return dtensor::sub(a, b); }
DTensor operator*(const DTensor& a, const torch::Tensor& b) { return dtensor::mul(a, b); }
DTensor operator/(const DTensor& a, const torch::Tensor& b) { return dtensor::div(a, b); }
DTensor operator+(const DTensor& a, double s) { return dtensor::add(a, c10::Scalar(s)); }
DTensor operator-(const DTensor& a, double s) { return dtensor::sub(a, c10::Scalar(s)); }
DTensor operator*(const DTensor& a, double s) { return dtensor::mul(a, c10::Scalar(s)); }
DTensor operator/(const DTensor& a, double s) { return dtensor::div(a, c10::Scalar(s)); }
DTensor operator+(double s, const DTensor& a) { return dtensor::add(a, c10::Scalar(s)); }
DTensor operator*(double s, const DTensor& a) { return dtensor::mul(a, c10::Scalar(s)); }
DTensor operator-(const DTensor& a) { return dtensor::neg(a); }

}  // namespace fsdp
