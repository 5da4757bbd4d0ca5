// DTensor: a tensor distributed over a DeviceMesh, described by its local tensor, the mesh, one
// placement per mesh dimension (Shard(d) or Replicate()) and the global shape.
//
// Sharding follows torch.chunk: along a sharded dim of size n on k ranks, rank r holds rows
// [min(r*c, n), min((r+1)*c, n)) with c = ceil(n/k); trailing ranks may hold empty shards.
// Mirrors torch.distributed.tensor.{DTensor, Shard, Replicate, distribute_tensor}.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include <torch/types.h>

#include "fsdp/device_mesh.h"

namespace fsdp {

/// How a tensor is laid out along one mesh dimension.
struct Placement {
  enum class Kind { SHARD, REPLICATE };
  Kind kind = Kind::REPLICATE;
  int64_t dim = 0;  ///< tensor dim that is split (SHARD only)
  bool is_shard() const { return kind == Kind::SHARD; }
  bool is_replicate() const { return kind == Kind::REPLICATE; }
  bool operator==(const Placement& o) const { return kind == o.kind && (kind == Kind::REPLICATE || dim == o.dim); }
  std::string str() const;  ///< "Shard(dim=0)" or "Replicate()"
};
/// Placement that splits tensor dim `dim` across a mesh dimension. Mirrors torch's Shard(dim).
inline Placement Shard(int64_t dim = 0) { return Placement{Placement::Kind::SHARD, dim}; }
/// Placement that keeps a full copy on every rank of a mesh dimension. Mirrors torch's Replicate().
inline Placement Replicate() { return Placement{Placement::Kind::REPLICATE, 0}; }

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

  /// Gathers the full tensor on every rank (one all-gather per sharded mesh dim). Collective over
  /// the mesh. Mirrors DTensor.full_tensor().
  torch::Tensor full_tensor() const;

  /// Builds a DTensor from each rank's local piece. When `global_shape` is empty it is computed with
  /// one all-gather of the local sizes (so uneven and empty shards are described exactly).
  /// Mirrors DTensor.from_local(..., shape=...).
  static DTensor from_local(torch::Tensor local, DeviceMeshPtr mesh, std::vector<Placement> placements,
                            std::vector<int64_t> global_shape = {});

  std::string str() const;

 private:
  torch::Tensor local_;
  DeviceMeshPtr mesh_;
  std::vector<Placement> placements_;
  std::vector<int64_t> global_shape_;
};

std::ostream& operator<<(std::ostream& os, const DTensor& t);

/// Slices `full` (identical on every rank, no communication) into this rank's piece.
/// Throws c10::Error if a placement's dim is out of range or the mesh and placements disagree.
/// Mirrors torch.distributed.tensor.distribute_tensor (which broadcasts from rank 0 first; pass the
/// same tensor on every rank, or broadcast it yourself).
DTensor distribute_tensor(const torch::Tensor& full, DeviceMeshPtr mesh, std::vector<Placement> placements);

}  // namespace fsdp
