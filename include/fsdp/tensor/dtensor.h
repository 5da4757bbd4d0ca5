// DTensor: a tensor distributed over an N-D DeviceMesh, described by its local tensor, the mesh, one
// placement per mesh dimension (Shard(d), Replicate() or Partial()) and the global shape.
//
// Sharding follows torch.chunk: along a sharded dim of size n on k ranks, rank r holds rows
// [min(r*c, n), min((r+1)*c, n)) with c = ceil(n/k); trailing ranks may hold empty shards.
// Mesh dims nest left to right: mesh dim 0 splits the global tensor, mesh dim 1 splits the piece mesh
// dim 0 left, ... (two mesh dims may shard the same tensor dim). See docs/TENSOR_PARALLEL.md.
// Mirrors torch.distributed.tensor.{DTensor, Shard, Replicate, Partial, distribute_tensor}.
#pragma once

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
  bool is_shard() const { return kind == Kind::SHARD; }
  bool is_shard(int64_t d) const { return kind == Kind::SHARD && dim == d; }
  bool is_replicate() const { return kind == Kind::REPLICATE; }
  bool is_partial() const { return kind == Kind::PARTIAL; }
  bool operator==(const Placement& o) const { return kind == o.kind && (kind != Kind::SHARD || dim == o.dim); }
  bool operator!=(const Placement& o) const { return !(*this == o); }
  std::string str() const;  ///< "Shard(dim=0)", "Replicate()" or "Partial(sum)"
};
/// Placement that splits tensor dim `dim` across a mesh dimension. Mirrors torch's Shard(dim).
inline Placement Shard(int64_t dim = 0) { return Placement{Placement::Kind::SHARD, dim}; }
/// Placement that keeps a full copy on every rank of a mesh dimension. Mirrors torch's Replicate().
inline Placement Replicate() { return Placement{Placement::Kind::REPLICATE, 0}; }
/// Placement whose local tensors are summands: the global value is their sum over the mesh dimension
/// (the output of a row-parallel matmul before its all-reduce). Mirrors torch's Partial("sum"); other
/// reduce ops are not supported.
inline Placement Partial() { return Placement{Placement::Kind::PARTIAL, 0}; }

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

  /// This rank's piece (aliases the storage it was built from). Mirrors DTensor.to_local().
  const torch::Tensor& to_local() const { return local_; }
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
  /// Collective over the mesh. Mirrors DTensor.full_tensor().
  torch::Tensor full_tensor() const;

  /// The same global tensor under `placements` (one per mesh dim) on the same mesh. Per mesh dim:
  /// Shard -> Replicate all-gathers, Replicate -> Shard takes the local chunk (no communication),
  /// Partial -> Replicate all-reduces, Partial -> Shard reduce-scatters, Replicate -> Partial keeps the
  /// value on coordinate 0 and zeros elsewhere, Shard(d) -> Shard(k) gathers then chunks. Uneven dims
  /// are padded for the collectives and trimmed. Collective over every mesh dim whose placement
  /// changes (and over inner mesh dims sharding the same tensor dim, whose chunks depend on the outer
  /// split): every rank must call it with the same placements. Not differentiable (unlike PyTorch's).
  /// Throws c10::Error for a wrong number of placements or a Shard dim out of range.
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

/// Slices `full` (identical on every rank, no communication) into this rank's piece. A Partial()
/// mesh dim keeps `full` on coordinate 0 and zeros on the others (so the sum is `full`).
/// Throws c10::Error if a placement's dim is out of range or the mesh and placements disagree.
/// Mirrors torch.distributed.tensor.distribute_tensor (which broadcasts from rank 0 first; pass the
/// same tensor on every rank, or broadcast it yourself).
DTensor distribute_tensor(const torch::Tensor& full, DeviceMeshPtr mesh, std::vector<Placement> placements);

}  // namespace fsdp
