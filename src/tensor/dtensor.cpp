#include "fsdp/tensor/dtensor.h"

#include <algorithm>
#include <sstream>

#include <torch/autograd.h>

#include "fsdp/c10d/collectives.h"
#include "tensor/dtensor_autograd.h"
#include "util.h"

namespace fsdp {

std::string Placement::str() const {
  if (is_shard()) return "Shard(dim=" + std::to_string(dim) + ")";
  return is_partial() ? "Partial(" + reduce_op + ")" : "Replicate()";
}

Placement Partial(std::string reduce_op) {
  TORCH_CHECK(reduce_op == "sum" || reduce_op == "avg" || reduce_op == "max" || reduce_op == "min",
              "Partial: reduce_op \"", reduce_op, "\" is not supported: expected \"sum\", \"avg\", \"max\" or \"min\"");
  Placement p{Placement::Kind::PARTIAL, 0};
  p.reduce_op = std::move(reduce_op);
  return p;
}

ChunkRange chunk_range(int64_t size, int64_t chunks, int64_t index) {
  int64_t c = (size + chunks - 1) / chunks;
  int64_t begin = std::min(index * c, size);
  int64_t end = std::min((index + 1) * c, size);
  return {begin, end - begin};
}

namespace {

void check_placements(const DeviceMesh& mesh, const std::vector<Placement>& placements, int64_t ndim,
                      const char* api) {
  TORCH_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(), api, ": ", placements.size(),
              " placements for a ", mesh.ndim(), "-D mesh: expected one per mesh dimension");
  for (const auto& p : placements) {
    TORCH_CHECK(!p.is_shard() || (p.dim >= 0 && p.dim < ndim), api, ": ", p.str(), " is out of range for a ", ndim,
                "-D tensor");
  }
}

}  // namespace

DTensor::DTensor(torch::Tensor local, DeviceMeshPtr mesh, std::vector<Placement> placements,
                 std::vector<int64_t> global_shape)
    : local_(std::move(local)),
      mesh_(std::move(mesh)),
      placements_(std::move(placements)),
      global_shape_(std::move(global_shape)) {
  TORCH_CHECK(mesh_, "DTensor: expected a mesh, got null");
  check_placements(*mesh_, placements_, static_cast<int64_t>(global_shape_.size()), "DTensor");
  TORCH_CHECK(local_.dim() == static_cast<int64_t>(global_shape_.size()), "DTensor: local tensor ",
              local_.sizes(), " and global shape ", c10::IntArrayRef(global_shape_), " differ in rank");
  // The local shape must be what torch.chunk gives this rank.
  std::vector<int64_t> expect = global_shape_;
  for (int64_t d = 0; d < mesh_->ndim(); ++d) {
    const auto& p = placements_[d];
    if (p.is_shard()) expect[p.dim] = chunk_range(expect[p.dim], mesh_->size(d), mesh_->get_local_rank(d)).length;
  }
  TORCH_CHECK(local_.sizes().vec() == expect, "DTensor: local shape ", local_.sizes(), " on rank ",
              mesh_->get_rank(), " does not match global shape ", c10::IntArrayRef(global_shape_),
              " under the placements (expected ", c10::IntArrayRef(expect), ")");
}

int64_t DTensor::numel() const {
  int64_t n = 1;
  for (auto s : global_shape_) n *= s;
  return n;
}

std::vector<int64_t> DTensor::local_offsets() const {
  std::vector<int64_t> offsets(global_shape_.size(), 0);
  std::vector<int64_t> sizes = global_shape_;
  for (int64_t d = 0; d < mesh_->ndim(); ++d) {
    const auto& p = placements_[d];
    if (!p.is_shard()) continue;
    auto r = chunk_range(sizes[p.dim], mesh_->size(d), mesh_->get_local_rank(d));
    offsets[p.dim] += r.offset;
    sizes[p.dim] = r.length;
  }
  return offsets;
}

torch::Tensor DTensor::full_tensor() const {
  return redistribute(std::vector<Placement>(placements_.size(), Replicate())).to_local();
}

torch::Tensor DTensor::full_tensor(std::vector<Placement> grad_placements) const {
  return redistribute(std::vector<Placement>(placements_.size(), Replicate())).to_local(std::move(grad_placements));
}

namespace {

// Size of tensor dim `k` at nesting level `level`: after mesh dims 0 .. level-1 split it.
int64_t level_size(const DeviceMesh& mesh, const std::vector<Placement>& placements,
                   const std::vector<int64_t>& global_shape, int64_t level, int64_t k) {
  int64_t n = global_shape[k];
  for (int64_t d = 0; d < level; ++d) {
    if (placements[d].is_shard(k)) n = chunk_range(n, mesh.size(d), mesh.get_local_rank(d)).length;
  }
  return n;
}

// `local` holds chunk coord (of mesh dim d) of a dim k of size n: returns the whole n rows on every
// rank of the group. Chunks are padded to ceil(n/size) rows so that the all-gather is even.
torch::Tensor gather_dim(const torch::Tensor& local, int64_t k, int64_t n, const DeviceMesh& mesh, int64_t d) {
  const int64_t size = mesh.size(d);
  const int64_t c = (n + size - 1) / size;
  // Empty on every rank of the group (the ranks of a mesh dim's group differ only in dim k's chunk):
  // nothing to exchange.
  int64_t other = 1;
  for (int64_t i = 0; i < local.dim(); ++i)
    if (i != k) other *= local.size(i);
  if (n == 0 || other == 0) {
    auto shape = local.sizes().vec();
    shape[k] = n;
    return torch::zeros(shape, local.options());
  }
  auto front = local.movedim(k, 0).contiguous();
  auto padded_shape = front.sizes().vec();
  padded_shape[0] = c;
  auto padded = front;
  if (front.size(0) != c) {
    padded = torch::zeros(padded_shape, front.options());
    if (front.size(0) > 0) padded.narrow(0, 0, front.size(0)).copy_(front);
  }
  auto gathered_shape = padded_shape;
  gathered_shape[0] = c * size;
  auto gathered = torch::empty(gathered_shape, front.options());
  all_gather_into_tensor(gathered, padded, *mesh.get_group(d));
  return gathered.narrow(0, 0, n).movedim(0, k).contiguous();
}

// `full` holds a summand of all n rows of dim k: returns this rank's chunk of the sum over mesh dim d.
torch::Tensor reduce_scatter_dim(const torch::Tensor& full, int64_t k, const DeviceMesh& mesh, int64_t d) {
  // Partial(sum) and Partial(avg) (divided by the caller).
  const int64_t size = mesh.size(d);
  const int64_t n = full.size(k);
  const int64_t c = (n + size - 1) / size;
  if (full.numel() == 0) {  // the same shape on every rank of the group: nothing to reduce
    auto shape = full.sizes().vec();
    shape[k] = chunk_range(n, size, mesh.get_local_rank(d)).length;
    return torch::zeros(shape, full.options());
  }
  auto front = full.movedim(k, 0);
  auto padded_shape = front.sizes().vec();
  padded_shape[0] = c * size;
  auto padded = torch::zeros(padded_shape, front.options());
  if (n > 0) padded.narrow(0, 0, n).copy_(front);
  auto out_shape = padded_shape;
  out_shape[0] = c;
  auto out = torch::empty(out_shape, front.options());
  reduce_scatter_tensor(out, padded, *mesh.get_group(d), ReduceOp::SUM);
  auto r = chunk_range(n, size, mesh.get_local_rank(d));
  return out.narrow(0, 0, r.length).movedim(0, k).contiguous();
}

}  // namespace

namespace detail {

// The value of a Partial(op) local tensor reduced over mesh dim d (all ranks of the group get it).
static torch::Tensor reduce_partial(torch::Tensor local, const Placement& p, const DeviceMesh& mesh, int64_t d) {
  local = local.clone();  // all_reduce is in place; the source DTensor stays unchanged
  if (local.numel() == 0) return local;
  const auto op = p.reduce_op == "max" ? ReduceOp::MAX : p.reduce_op == "min" ? ReduceOp::MIN : ReduceOp::SUM;
  all_reduce(local, *mesh.get_group(d), op);
  if (p.reduce_op == "avg") local.div_(mesh.size(d));
  return local;
}

torch::Tensor redistribute_local(const torch::Tensor& local_in, const DeviceMesh& mesh,
                                 const std::vector<Placement>& from, const std::vector<Placement>& target,
                                 const std::vector<int64_t>& global_shape) {
  const int64_t ndim = mesh.ndim();
  std::vector<Placement> cur = from;
  if (cur == target) return local_in;

  // Mesh dims to all-gather first: those that stop sharding, and (closure) every inner mesh dim that
  // shards the same tensor dim as an outer one whose split changes (its chunk boundaries move).
  std::vector<char> gather(ndim, 0);
  for (int64_t d = 0; d < ndim; ++d) gather[d] = cur[d].is_shard() && cur[d] != target[d];
  for (bool changed = true; changed;) {
    changed = false;
    for (int64_t d = 0; d < ndim; ++d) {
      int64_t k = -1;
      if (gather[d]) k = cur[d].dim;
      else if (target[d].is_shard() && target[d] != cur[d]) k = target[d].dim;
      if (k < 0) continue;
      // A mesh dim that is gathered and re-sharded on another tensor dim changes that one's split too.
      for (int64_t kk : {k, target[d].is_shard() ? target[d].dim : k}) {
        for (int64_t d2 = d + 1; d2 < ndim; ++d2) {
          if (!gather[d2] && cur[d2].is_shard(kk)) gather[d2] = changed = true;
        }
      }
    }
  }

  torch::Tensor local = local_in;
  // Gathers, innermost first: a mesh dim's chunk is taken from the piece the outer dims left.
  for (int64_t d = ndim - 1; d >= 0; --d) {
    if (!gather[d]) continue;
    const int64_t k = cur[d].dim;
    local = gather_dim(local, k, level_size(mesh, cur, global_shape, d, k), mesh, d);
    cur[d] = Replicate();
  }
  // Targets, outermost first.
  for (int64_t d = 0; d < ndim; ++d) {
    const Placement& t = target[d];
    if (cur[d] == t) continue;
    TORCH_INTERNAL_ASSERT(!cur[d].is_shard(), "redistribute: mesh dim ", d, " still sharded");
    const int64_t coord = mesh.get_local_rank(d);
    if (cur[d].is_partial() && (t.is_replicate() || t.is_partial() || !cur[d].is_linear_partial())) {
      // To Replicate; Partial(a) -> Partial(b) and Partial(max/min) -> Shard go through Replicate.
      local = reduce_partial(local, cur[d], mesh, d);
      cur[d] = Replicate();
      if (cur[d] == t) continue;
    }
    if (cur[d].is_replicate() && t.is_shard()) {
      auto r = chunk_range(local.size(t.dim), mesh.size(d), coord);
      local = local.narrow(t.dim, r.offset, r.length).contiguous();
    } else if (cur[d].is_replicate() && t.is_partial()) {
      // Partial(sum): the sum over the mesh dim must be the value: coordinate 0 keeps it. avg/max/min of
      // equal values is the value: every rank keeps it.
      if (t.reduce_op == "sum" && coord != 0) local = torch::zeros_like(local);
    } else if (cur[d].is_partial() && t.is_shard()) {  // Partial(sum) or Partial(avg)
      local = reduce_scatter_dim(local, t.dim, mesh, d);
      if (cur[d].reduce_op == "avg") local.div_(mesh.size(d));
    }
    cur[d] = t;
  }
  return local;
}

std::vector<Placement> grad_placements_of(const std::vector<Placement>& placements) {
  auto out = placements;
  for (auto& p : out)
    if (p.is_partial()) p = Replicate();
  return out;
}

// [Note: DTensor autograd]
// A DTensor's local tensor is an ordinary autograd tensor, and the gradient autograd computes for it on
// a rank is read as that rank's piece of the global gradient, laid out with the DTensor's placements
// with Partial read as Replicate (the gradient of a summand of a sum is the whole gradient: PyTorch keeps
// gradients of Partial inputs Replicate too, see is_backward in torch's _redistribute.py). Every DTensor
// function keeps this invariant, so that a chain DTensor ops -> full_tensor -> loss.backward() gives
// one process's gradients:
// - redistribute(from -> to): backward redistributes the gradient from grad(to) to grad(from), where
//   grad() reads Partial as Replicate (Shard -> Replicate: the local chunk; Replicate -> Shard: an
//   all-gather; Partial -> Replicate: identity).
// - to_local(grad_placements) / full_tensor(grad_placements): the caller says how its gradient is laid
//   out (e.g. Partial when each rank's loss covered a part); backward redistributes it to grad(placements)
//   (Partial -> Replicate: all-reduce; Partial -> Shard: reduce-scatter, PyTorch's reduce-scatter backward
//   of Shard -> Replicate).
// - from_local: the local tensor is the caller's, its gradient already has that layout.
// - ops (src/tensor/dtensor_ops.cpp): an input that is Replicate on a mesh dim whose output is Shard or
//   Partial gets only this rank's share of its gradient from the local op; grad_all_reduce sums it over
//   that mesh dim (Megatron's `f`). PyTorch leaves that gradient Partial and reduces it lazily (often a
//   reduce-scatter at the next redistribute); libfsdp reduces at once, which may move more bytes but
//   never leaves a gradient whose layout autograd cannot see.
// Partial(avg/max/min) -> Replicate backward is the identity too (PyTorch's rule, not the derivative of
// the mean or the maximum over ranks).

namespace {

// Holds the forward and backward of one differentiable local step.
struct LocalStep : torch::CustomClassHolder {
  std::function<torch::Tensor(const torch::Tensor&)> forward, backward;
};

struct LocalStepFunction : public torch::autograd::Function<LocalStepFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               c10::intrusive_ptr<LocalStep> step) {
    auto out = step->forward(x);
    ctx->saved_data["step"] = c10::IValue::make_capsule(std::move(step));
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto step = c10::static_intrusive_pointer_cast<LocalStep>(ctx->saved_data["step"].toCapsule());
    return {step->backward(grads[0].contiguous()), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor local_step(const torch::Tensor& x, std::function<torch::Tensor(const torch::Tensor&)> forward,
                         std::function<torch::Tensor(const torch::Tensor&)> backward) {
  if (!x.requires_grad() || !torch::GradMode::is_enabled()) {
    torch::NoGradGuard no_grad;
    return forward(x);
  }
  auto step = c10::make_intrusive<LocalStep>();
  step->forward = std::move(forward);
  step->backward = std::move(backward);
  return LocalStepFunction::apply(x, std::move(step));
}

torch::Tensor grad_all_reduce(const torch::Tensor& x, const DeviceMeshPtr& mesh, const std::vector<int64_t>& mesh_dims) {
  if (mesh_dims.empty()) return x;
  return local_step(
      x, [](const torch::Tensor& t) { return t; },
      [mesh, mesh_dims](const torch::Tensor& g) {
        auto out = g.clone();
        if (out.numel() > 0)
          for (int64_t d : mesh_dims) all_reduce(out, *mesh->get_group(d), ReduceOp::SUM);
        return out;
      });
}

torch::Tensor redistribute_grad(const torch::Tensor& local, const DeviceMeshPtr& mesh, const std::vector<Placement>& from,
                                const std::vector<Placement>& to, const std::vector<int64_t>& global_shape) {
  auto gfrom = grad_placements_of(from), gto = grad_placements_of(to);
  return local_step(
      local, [&](const torch::Tensor& t) { return redistribute_local(t, *mesh, from, to, global_shape); },
      [mesh, gfrom, gto, global_shape](const torch::Tensor& g) {
        return redistribute_local(g, *mesh, gto, gfrom, global_shape);
      });
}

}  // namespace detail

DTensor DTensor::redistribute(std::vector<Placement> target) const {
  TORCH_CHECK(mesh_, "DTensor::redistribute: the DTensor has no mesh (default-constructed)");
  check_placements(*mesh_, target, static_cast<int64_t>(global_shape_.size()), "DTensor::redistribute");
  if (placements_ == target) return *this;
  auto local = detail::redistribute_grad(local_, mesh_, placements_, target, global_shape_);
  return DTensor(std::move(local), mesh_, std::move(target), global_shape_);
}

torch::Tensor DTensor::to_local(std::vector<Placement> grad_placements) const {
  TORCH_CHECK(mesh_, "DTensor::to_local: the DTensor has no mesh (default-constructed)");
  check_placements(*mesh_, grad_placements, static_cast<int64_t>(global_shape_.size()), "DTensor::to_local(grad_placements)");
  auto mine = detail::grad_placements_of(placements_);
  if (grad_placements == mine) return local_;
  return detail::local_step(
      local_, [](const torch::Tensor& t) { return t; },
      [mesh = mesh_, grad_placements, mine, shape = global_shape_](const torch::Tensor& g) {
        return detail::redistribute_local(g, *mesh, grad_placements, mine, shape);
      });
}

namespace {

using detail::shape_str;

// [Note: from_local's run_check]
// DTensor::from_local is called by every rank with its own piece. Checked rank by rank, ranks can
// diverge: with Shard(1) widths 2/3/4/5 over 14 columns one rank's width matches torch.chunk and it
// builds a DTensor while the others throw (the next collective hangs), and two replica rows of a 2-D
// mesh can each sum their row to a different global shape without any error. So by default every rank
// publishes what it was given (placements, local shape, global shape) with one all-gather over the
// mesh's ranks, and every rank runs the same checks on the same table: all build the same DTensor, or
// all throw the same message naming the ranks and shapes. run_check=false skips it (no communication
// beyond the global shape's all-reduces) when the caller guarantees consistent pieces.

// One rank's row of the table: [placements (kind * 1024 + dim, one per mesh dim), local ndim, given
// global ndim (-1: none), local sizes (k), given sizes (k)].
struct FromLocalRow {
  std::vector<int64_t> placements, local, given;
  bool has_given = false;
};

std::string placements_str(const std::vector<int64_t>& codes) {
  std::string out = "(";
  for (size_t i = 0; i < codes.size(); ++i) {
    const int64_t kind = codes[i] / 1024, dim = codes[i] % 1024;
    out += (i ? ", " : "") + (kind == 0 ? "Shard(dim=" + std::to_string(dim) + ")" : kind == 1 ? "Replicate()"
                                                                                   : std::string("Partial(") + (dim == 1 ? "avg" : dim == 2 ? "max" : dim == 3 ? "min" : "sum") + ")");
  }
  return out + ")";
}

std::vector<FromLocalRow> gather_rows(const DeviceMesh& mesh, const std::vector<Placement>& placements,
                                      const torch::Tensor& local, const std::vector<int64_t>& given) {
  auto& world = *mesh.world();
  const auto opts = torch::TensorOptions(torch::kInt64).device(world.device());
  auto k = torch::full({1}, std::max<int64_t>(local.dim(), static_cast<int64_t>(given.size())), opts);
  all_reduce(k, world, ReduceOp::MAX);
  const int64_t K = k.item<int64_t>(), M = mesh.ndim(), W = M + 2 + 2 * K;
  std::vector<int64_t> row(W, 0);
  for (int64_t d = 0; d < M; ++d) {
    const auto& p = placements[d];
    const int64_t op = p.reduce_op == "avg" ? 1 : p.reduce_op == "max" ? 2 : p.reduce_op == "min" ? 3 : 0;
    row[d] = (p.is_shard() ? 0 : p.is_replicate() ? 1 : 2) * 1024 + (p.is_shard() ? p.dim : p.is_partial() ? op : 0);
  }
  row[M] = local.dim();
  row[M + 1] = given.empty() ? -1 : static_cast<int64_t>(given.size());
  for (int64_t i = 0; i < local.dim(); ++i) row[M + 2 + i] = local.size(i);
  for (size_t i = 0; i < given.size(); ++i) row[M + 2 + K + i] = given[i];
  auto mine = torch::tensor(row, torch::kInt64).to(world.device());
  auto all = torch::empty({world.size() * W}, opts);
  all_gather_into_tensor(all, mine, world);
  auto cpu = all.cpu();
  const int64_t* v = cpu.data_ptr<int64_t>();
  std::vector<FromLocalRow> rows(world.size());
  for (int r = 0; r < world.size(); ++r) {
    const int64_t* x = v + r * W;
    rows[r].placements.assign(x, x + M);
    rows[r].local.assign(x + M + 2, x + M + 2 + x[M]);
    rows[r].has_given = x[M + 1] >= 0;
    if (rows[r].has_given) rows[r].given.assign(x + M + 2 + K, x + M + 2 + K + x[M + 1]);
  }
  return rows;
}

// The mesh coordinate of each row (rows are in the order of the mesh's world group).
std::vector<std::vector<int64_t>> coordinates_of_rows(const DeviceMesh& mesh) {
  const auto& ranks = mesh.ranks();
  const auto& members = mesh.world()->global_ranks();
  std::vector<std::vector<int64_t>> coords;
  for (int r = 0; r < mesh.world()->size(); ++r) {
    const int g = members.empty() ? r : members[r];
    int64_t pos = std::find(ranks.begin(), ranks.end(), g) - ranks.begin();
    std::vector<int64_t> c(mesh.ndim());
    for (int64_t d = mesh.ndim() - 1; d >= 0; --d) {
      c[d] = pos % mesh.size(d);
      pos /= mesh.size(d);
    }
    coords.push_back(std::move(c));
  }
  return coords;
}

std::string rank_name(const DeviceMesh& mesh, int row) {
  const auto& members = mesh.world()->global_ranks();
  return "rank " + std::to_string(members.empty() ? row : members[row]);
}

// What every rank would compute as the global shape without a given one: the innermost mesh dim's sums
// first, as the all-reduces of run_check=false.
std::vector<std::vector<int64_t>> summed_shapes(const DeviceMesh& mesh, const std::vector<Placement>& placements,
                                                const std::vector<FromLocalRow>& rows,
                                                const std::vector<std::vector<int64_t>>& coords) {
  std::vector<std::vector<int64_t>> cur;
  for (const auto& r : rows) cur.push_back(r.local);
  for (int64_t d = mesh.ndim() - 1; d >= 0; --d) {
    if (!placements[d].is_shard() || cur[0].empty()) continue;
    const int64_t t = placements[d].dim;
    auto next = cur;
    for (size_t r = 0; r < rows.size(); ++r) {
      int64_t sum = 0;
      for (size_t q = 0; q < rows.size(); ++q) {
        bool same_line = true;
        for (int64_t e = 0; e < mesh.ndim(); ++e) same_line = same_line && (e == d || coords[q][e] == coords[r][e]);
        if (same_line) sum += cur[q][t];
      }
      next[r][t] = sum;
    }
    cur = std::move(next);
  }
  return cur;
}

// The checks of run_check on the gathered table: the same verdict on every rank. Returns the problem, or "".
std::string check_rows(const DeviceMesh& mesh, const std::vector<Placement>& placements,
                       const std::vector<FromLocalRow>& rows, std::vector<int64_t>& global) {
  std::ostringstream os;
  for (size_t r = 1; r < rows.size(); ++r) {
    if (rows[r].placements != rows[0].placements) {
      return "the ranks pass different placements: " + rank_name(mesh, 0) + " " + placements_str(rows[0].placements) +
             ", " + rank_name(mesh, static_cast<int>(r)) + " " + placements_str(rows[r].placements);
    }
    if (rows[r].local.size() != rows[0].local.size() || rows[r].has_given != rows[0].has_given ||
        rows[r].given != rows[0].given) {
      return "the ranks disagree on the tensor's rank or global shape: " + rank_name(mesh, 0) + " local " +
             shape_str(rows[0].local) + (rows[0].has_given ? " global " + shape_str(rows[0].given) : "") + ", " +
             rank_name(mesh, static_cast<int>(r)) + " local " + shape_str(rows[r].local) +
             (rows[r].has_given ? " global " + shape_str(rows[r].given) : "");
    }
  }
  const auto coords = coordinates_of_rows(mesh);
  if (rows[0].has_given) {
    global = rows[0].given;
  } else {
    const auto shapes = summed_shapes(mesh, placements, rows, coords);
    for (size_t r = 1; r < rows.size(); ++r) {
      if (shapes[r] != shapes[0]) {
        return "the local pieces add up to different global shapes on different ranks: " + shape_str(shapes[0]) +
               " on " + rank_name(mesh, 0) + ", " + shape_str(shapes[r]) + " on " + rank_name(mesh, static_cast<int>(r)) +
               " (replicas of a mesh dim must hold the same pieces)";
      }
    }
    global = shapes[0];
  }
  if (global.size() != rows[0].local.size()) return "the global shape " + shape_str(global) + " and the local shapes differ in rank";
  std::string bad;
  for (size_t r = 0; r < rows.size(); ++r) {
    std::vector<int64_t> expect = global;
    for (int64_t d = 0; d < mesh.ndim(); ++d) {
      if (placements[d].is_shard()) expect[placements[d].dim] = chunk_range(expect[placements[d].dim], mesh.size(d), coords[r][d]).length;
    }
    if (expect != rows[r].local) {
      bad += (bad.empty() ? "" : ", ") + rank_name(mesh, static_cast<int>(r)) + " has " + shape_str(rows[r].local) +
             " (expected " + shape_str(expect) + ")";
    }
  }
  if (!bad.empty()) return "the local shapes do not match global shape " + shape_str(global) + " under torch.chunk sharding: " + bad;
  return "";
}

}  // namespace

DTensor DTensor::from_local(torch::Tensor local, DeviceMeshPtr mesh, std::vector<Placement> placements,
                            std::vector<int64_t> global_shape, bool run_check) {
  TORCH_CHECK(mesh, "DTensor::from_local: expected a mesh, got null");
  TORCH_CHECK(static_cast<int64_t>(placements.size()) == mesh->ndim(), "DTensor::from_local: ", placements.size(),
              " placements for a ", mesh->ndim(), "-D mesh: expected one per mesh dimension");
  if (run_check) {
    // See [Note: from_local's run_check]. Range errors of a Shard dim are found on the table too, so that
    // every rank throws (a rank that threw alone here would leave the others in the all-gather).
    const auto rows = gather_rows(*mesh, placements, local, global_shape);
    std::vector<int64_t> global;
    std::string problem;
    for (const auto& p : placements) {
      if (p.is_shard() && (p.dim < 0 || p.dim >= static_cast<int64_t>(rows[0].local.size())) && problem.empty()) {
        problem = p.str() + " is out of range for a " + std::to_string(rows[0].local.size()) + "-D tensor";
      }
    }
    if (problem.empty()) problem = check_rows(*mesh, placements, rows, global);
    TORCH_CHECK(problem.empty(), "DTensor::from_local on ", mesh->str(), ": ", problem,
                ". Every rank raises this error. Fix: pass pieces that torch.chunk of one global tensor gives each ",
                "rank (and the same placements and shape on every rank)");
    return DTensor(std::move(local), std::move(mesh), std::move(placements), std::move(global));
  }
  check_placements(*mesh, placements, local.dim(), "DTensor::from_local");
  if (global_shape.empty() && local.dim() > 0) {
    // Sum the local sizes along each sharded dim over its mesh dim (innermost first).
    global_shape = local.sizes().vec();
    for (int64_t d = mesh->ndim() - 1; d >= 0; --d) {
      const auto& p = placements[d];
      if (!p.is_shard()) continue;
      // On the group's device: NCCL reduces CUDA tensors only.
      auto n = torch::full({1}, global_shape[p.dim], torch::TensorOptions(torch::kInt64).device(mesh->get_group(d)->device()));
      all_reduce(n, *mesh->get_group(d), ReduceOp::SUM);
      global_shape[p.dim] = n.item<int64_t>();
    }
  }
  return DTensor(std::move(local), std::move(mesh), std::move(placements), std::move(global_shape));
}

std::string DTensor::str() const {
  std::ostringstream os;
  os << "DTensor(local=" << local_.sizes() << " " << local_.scalar_type()
     << ", global=" << c10::IntArrayRef(global_shape_) << ", placements=(";
  for (size_t i = 0; i < placements_.size(); ++i) os << (i ? ", " : "") << placements_[i].str();
  os << "), mesh=" << mesh_->str() << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const DTensor& t) { return os << t.str(); }

DTensor distribute_tensor(const torch::Tensor& full, DeviceMeshPtr mesh, std::vector<Placement> placements,
                          std::optional<int64_t> src_data_rank) {
  TORCH_CHECK(mesh, "distribute_tensor: expected a mesh, got null");
  check_placements(*mesh, placements, full.dim(), "distribute_tensor");
  TORCH_CHECK(!src_data_rank || (*src_data_rank >= 0 && *src_data_rank < mesh->size()), "distribute_tensor: src_data_rank ",
              src_data_rank.value_or(0), " is not a position of ", mesh->str(), ": expected 0 .. ", mesh->size() - 1,
              " (or std::nullopt for no broadcast)");
  torch::Tensor cur = full;
  if (src_data_rank) {
    // One broadcast of the whole tensor over the mesh's ranks, from the rank at that mesh position, on a
    // copy (the caller's tensor stays as it was) on the group's device.
    auto& world = *mesh->world();
    const int src_global = mesh->ranks()[*src_data_rank];
    const auto& members = world.global_ranks();
    int src = src_global;
    if (!members.empty()) src = static_cast<int>(std::find(members.begin(), members.end(), src_global) - members.begin());
    auto buf = full.detach().to(world.device(), /*non_blocking=*/false, /*copy=*/true).contiguous();
    if (buf.numel() > 0) broadcast(buf, src, world);
    cur = buf.to(full.device());
  }
  bool zero = false;  // a Partial(sum) mesh dim on which this rank is not coordinate 0
  for (int64_t d = 0; d < mesh->ndim(); ++d) {
    const auto& p = placements[d];
    if (p.is_partial() && p.reduce_op == "sum" && mesh->get_local_rank(d) != 0) zero = true;
    if (!p.is_shard()) continue;
    auto r = chunk_range(cur.size(p.dim), mesh->size(d), mesh->get_local_rank(d));
    cur = cur.narrow(p.dim, r.offset, r.length);
  }
  if (zero) cur = torch::zeros_like(cur);
  cur = cur.contiguous();
  if (src_data_rank) cur = cur.detach().requires_grad_(full.requires_grad());
  return DTensor(std::move(cur), std::move(mesh), std::move(placements), full.sizes().vec());
}

}  // namespace fsdp
