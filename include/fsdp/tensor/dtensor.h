// DTensor: a tensor distributed over an N-D DeviceMesh, described by its local tensor, the mesh, one
// placement per mesh dimension (Shard(d), Replicate() or Partial()) and the global shape.
//
// Sharding follows torch.chunk: along a sharded dim of size n on k ranks, rank r holds rows
// [min(r*c, n), min((r+1)*c, n)) with c = ceil(n/k); trailing ranks may hold empty shards.
// Mesh dims nest left to right: mesh dim 0 splits the global tensor, mesh dim 1 splits the piece mesh
// dim 0 left, ... (two mesh dims may shard the same tensor dim). See docs/TENSOR_PARALLEL.md.
// Mirrors torch.distributed.tensor.{DTensor, Shard, Replicate, Partial, distribute_tensor}.
#pragma once

#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <torch/types.h>

#include "fsdp/tensor/device_mesh.h"

namespace fsdp {

/// How a tensor is laid out along one mesh dimension.
struct Placement {
  enum class Kind { SHARD, REPLICATE, PARTIAL };
  Kind kind = Kind::REPLICATE;
  int64_t dim = 0;  ///< tensor dim that is split (SHARD only)
  /// PARTIAL only: how the local values combine into the global one: "sum", "avg", "max" or "min".
  std::string reduce_op = "sum";
  bool is_shard() const { return kind == Kind::SHARD; }
  bool is_shard(int64_t d) const { return kind == Kind::SHARD && dim == d; }
  bool is_replicate() const { return kind == Kind::REPLICATE; }
  bool is_partial() const { return kind == Kind::PARTIAL; }
  /// Partial("sum") or Partial("avg"): the global value is linear in the local ones.
  bool is_linear_partial() const { return is_partial() && (reduce_op == "sum" || reduce_op == "avg"); }
  bool operator==(const Placement& o) const {
    return kind == o.kind && (kind != Kind::SHARD || dim == o.dim) && (kind != Kind::PARTIAL || reduce_op == o.reduce_op);
  }
  bool operator!=(const Placement& o) const { return !(*this == o); }
  std::string str() const;  ///< "Shard(dim=0)", "Replicate()" or "Partial(sum)" ("Partial(avg)", ...)
};
/// Placement that splits tensor dim `dim` across a mesh dimension. Mirrors torch's Shard(dim).
inline Placement Shard(int64_t dim = 0) { return Placement{Placement::Kind::SHARD, dim}; }
/// Placement that keeps a full copy on every rank of a mesh dimension. Mirrors torch's Replicate().
inline Placement Replicate() { return Placement{Placement::Kind::REPLICATE, 0}; }
/// Placement whose local tensors are not yet reduced: the global value is their reduction over the mesh
/// dimension with `reduce_op`: "sum" (the default: the output of a row-parallel matmul before its
/// all-reduce), "avg", "max" or "min". Partial -> Replicate all-reduces with SUM, SUM then / group size,
/// MAX or MIN; Replicate -> Partial keeps the value on every rank for avg/max/min and, for sum, on
/// coordinate 0 with zeros elsewhere (PyTorch divides by the group size instead: the same global value,
/// but ours is exact). Throws c10::Error for another reduce op. Mirrors torch's Partial(reduce_op).
/// Example: auto p = Partial("avg");  // p.str() == "Partial(avg)"
Placement Partial(std::string reduce_op = "sum");

/// Rows [offset, offset + length) of a dim of size `size` that chunk `index` of `chunks` holds
/// (torch.chunk semantics, empty chunks at the end).
struct ChunkRange {
  int64_t offset;
  int64_t length;
};
ChunkRange chunk_range(int64_t size, int64_t chunks, int64_t index);

class DTensor {
 public:
  DTensor() = default;
  /// Wraps `local` without communication. `global_shape` is the full tensor's shape; it must be
  /// consistent with the local shape under torch.chunk sharding (checked; throws c10::Error).
  DTensor(torch::Tensor local, DeviceMeshPtr mesh, std::vector<Placement> placements,
          std::vector<int64_t> global_shape);

  /// This rank's piece (aliases the storage it was built from, and is that tensor for autograd: the
  /// gradient of the local tensor is this rank's piece of the global gradient, laid out with this
  /// DTensor's placements, Partial read as Replicate; see [Note: DTensor autograd]).
  /// Mirrors DTensor.to_local().
  const torch::Tensor& to_local() const { return local_; }
  /// This rank's piece, with the placements that its gradient will have when it flows back:
  /// `grad_placements` (one per mesh dim) describes the gradient the caller's code produces for the
  /// returned tensor (e.g. {Partial()} when each rank's loss covers only its own part of a replicated
  /// value), and the backward redistributes it to this DTensor's placements (Partial -> Replicate
  /// all-reduces, Partial -> Shard reduce-scatters, Replicate -> Shard takes the chunk). Identity forward;
  /// collective in backward when the placements differ. Throws c10::Error for a wrong number of
  /// placements or a Shard dim out of range. Mirrors DTensor.to_local(grad_placements=...).
  /// Example: auto y = dt.to_local({Partial()});  // y's gradient is summed over the mesh in backward
  torch::Tensor to_local(std::vector<Placement> grad_placements) const;
  const DeviceMeshPtr& device_mesh() const { return mesh_; }
  const std::vector<Placement>& placements() const { return placements_; }
  /// Global shape.
  const std::vector<int64_t>& sizes() const { return global_shape_; }
  int64_t numel() const;
  torch::ScalarType scalar_type() const { return local_.scalar_type(); }
  /// Offset of this rank's piece in the global tensor, one entry per tensor dim.
  std::vector<int64_t> local_offsets() const;

  /// Gathers the full tensor on every rank: redistribute to Replicate() on every mesh dim (one
  /// all-gather per sharded mesh dim, one all-reduce per Partial mesh dim), then to_local().
  /// Collective over the mesh. Differentiable: the gradient of the full tensor is taken as Replicate
  /// (every rank holds the same whole gradient; pass grad_placements otherwise) and flows back through
  /// the redistribute (Shard: the local chunk; Partial: as is). Mirrors DTensor.full_tensor().
  torch::Tensor full_tensor() const;
  /// full_tensor() whose gradient has `grad_placements` (e.g. {Partial()} when each rank computed a
  /// loss from a part of the full tensor: the gradients are summed in backward).
  /// Mirrors DTensor.full_tensor(grad_placements=...).
  torch::Tensor full_tensor(std::vector<Placement> grad_placements) const;

  /// The same global tensor under `placements` (one per mesh dim) on the same mesh. Per mesh dim:
  /// Shard -> Replicate all-gathers, Replicate -> Shard takes the local chunk (no communication),
  /// Partial -> Replicate all-reduces, Partial -> Shard reduce-scatters, Replicate -> Partial keeps the
  /// value on coordinate 0 and zeros elsewhere, Shard(d) -> Shard(k) gathers then chunks. Uneven dims
  /// are padded for the collectives and trimmed. Collective over every mesh dim whose placement
  /// changes (and over inner mesh dims sharding the same tensor dim, whose chunks depend on the outer
  /// split): every rank must call it with the same placements. Partial(op) -> Replicate all-reduces with
  /// op (avg: SUM, then / group size), Partial(avg) -> Shard reduce-scatters then divides, Partial(max/min)
  /// -> Shard all-reduces then chunks, Partial(a) -> Partial(b) goes through Replicate.
  /// Differentiable (the result's local tensor is an autograd function of this one's): the backward
  /// redistributes the gradient from the target placements to the source ones, with Partial read as
  /// Replicate on both sides (PyTorch's _redistribute.py rule: Shard -> Replicate backward is the local
  /// chunk, Partial -> Replicate backward the identity, Replicate -> Shard backward an all-gather); see
  /// [Note: DTensor autograd]. Throws c10::Error for a wrong number of placements or a Shard dim out of range.
  /// Mirrors DTensor.redistribute(device_mesh, placements).
  DTensor redistribute(std::vector<Placement> placements) const;

  /// Builds a DTensor from each rank's local piece. Collective over the mesh's ranks: every rank calls it.
  /// When `global_shape` is empty it is the sum of the local sizes along each Shard mesh dim (so uneven
  /// and empty shards are described exactly). The local pieces of a Replicate or Partial mesh dim must
  /// have equal shapes.
  /// `run_check` (default true; PyTorch's default is false): the ranks compare what they were given (one
  /// all-reduce and one all-gather of a few integers per rank over the mesh) and either all build the
  /// same DTensor or all throw the same c10::Error naming the ranks and shapes: different placements or
  /// global shapes, local shapes that are not torch.chunk's pieces of one global shape, replicas whose
  /// pieces sum to different global shapes. With run_check=false only this rank's piece is checked (an
  /// inconsistent set can then make some ranks throw and others hang in the next collective).
  /// Throws c10::Error for a wrong number of placements or a Shard dim out of range.
  /// Mirrors DTensor.from_local(local_tensor, device_mesh, placements, run_check=..., shape=...).
  /// Autograd: the DTensor's local tensor is `local` itself, so gradients reach it directly (PyTorch's
  /// from_local backward, which keeps a Replicate gradient of a Partial input as is).
  /// Example: auto dt = DTensor::from_local(torch::ones({2, 3}), mesh, {Shard(0)});  // global [2 * N, 3]
  static DTensor from_local(torch::Tensor local, DeviceMeshPtr mesh, std::vector<Placement> placements,
                            std::vector<int64_t> global_shape = {}, bool run_check = true);

  std::string str() const;

 private:
  torch::Tensor local_;
  DeviceMeshPtr mesh_;
  std::vector<Placement> placements_;
  std::vector<int64_t> global_shape_;
};

std::ostream& operator<<(std::ostream& os, const DTensor& t);

/// This rank's piece of `full` under `placements`. With `src_data_rank` (default 0, as PyTorch), the
/// tensor of the rank at that position of the mesh (mesh.ranks()[src_data_rank]) is broadcast over the
/// mesh's ranks first (one broadcast of the whole tensor over mesh->world(), collective: every rank of the
/// mesh calls it, with tensors of the same shape and dtype; the caller's tensor is not modified), so ranks
/// passing different tensors end with the source rank's; the result is then a leaf (detached, with
/// full.requires_grad()), on full's device. With std::nullopt there is no communication: `full` must be
/// the same on every rank, and the piece is a differentiable slice of it. A Partial("sum") mesh dim keeps
/// the value on coordinate 0 and zeros on the others, Partial(avg/max/min) keeps it everywhere.
/// Throws c10::Error (on every rank, before any communication) if a placement's dim is out of range, the
/// mesh and placements disagree, or src_data_rank is not a position of the mesh.
/// Mirrors torch.distributed.tensor.distribute_tensor(tensor, device_mesh, placements, src_data_rank=0).
/// Example: auto dt = distribute_tensor(torch::randn({7, 3}), mesh, {Shard(0)});  // rank 0's rows, chunked
DTensor distribute_tensor(const torch::Tensor& full, DeviceMeshPtr mesh, std::vector<Placement> placements,
                          std::optional<int64_t> src_data_rank = 0);

}  // namespace fsdp
