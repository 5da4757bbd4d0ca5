// DeviceMesh: ranks laid out as an n-D array (1-D for FSDP, 2-D (replicate, shard) for HSDP), with
// one process group per mesh dimension and coordinate.
//
// Mirrors torch.distributed.device_mesh.{DeviceMesh, init_device_mesh}.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include "fsdp/c10d/distributed.h"

namespace fsdp {

class DeviceMesh;
using DeviceMeshPtr = std::shared_ptr<DeviceMesh>;

/// A row-major array of global ranks. For shape {R, S}, rank g sits at (g / S, g % S); the group of
/// dimension 1 ("shard") holds the ranks of this rank's row, the group of dimension 0 ("replicate")
/// those of its column.
class DeviceMesh : public std::enable_shared_from_this<DeviceMesh> {
 public:
  /// Builds the groups of every dimension for this rank, over `world` (its store). Collective over
  /// the world: every rank must call it with the same arguments.
  /// Throws c10::Error when prod(shape) != world size, e.g. "mesh shape 2 x 3 = 6 != WORLD_SIZE(4)",
  /// when a dimension is < 1, or when dim_names has the wrong length or duplicates.
  DeviceMesh(ProcessGroupPtr world, std::vector<int64_t> shape, std::vector<std::string> dim_names = {});

  /// Number of dimensions (1 or 2, or more).
  int64_t ndim() const { return static_cast<int64_t>(shape_.size()); }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<std::string>& dim_names() const { return dim_names_; }
  /// Total number of ranks (product of the shape), or the size of dimension `dim`.
  int64_t size() const;
  int64_t size(int64_t dim) const;
  /// This rank's coordinate along `dim` (its rank in get_group(dim)).
  int64_t get_local_rank(int64_t dim = 0) const;
  /// This rank's coordinate, one entry per dimension.
  std::vector<int64_t> get_coordinate() const;
  /// Global rank of this process (also on a sub-mesh, whose world() is a sub-group).
  /// Mirrors DeviceMesh.get_rank().
  int get_rank() const { return world_->global_ranks()[world_->rank()]; }
  /// The process group of dimension `dim` that contains this rank. Throws if dim is out of range.
  const ProcessGroupPtr& get_group(int64_t dim = 0) const;
  const ProcessGroupPtr& get_group(const std::string& dim_name) const;
  /// Index of a named dimension; throws naming the known names when absent.
  int64_t dim_index(const std::string& dim_name) const;
  /// The 1-D sub-mesh of a named dimension, e.g. mesh["shard"]. Its world() is that dimension's group;
  /// root_mesh() is this mesh's root. Mirrors DeviceMesh.__getitem__.
  DeviceMeshPtr operator[](const std::string& dim_name) const;
  /// The sub-mesh of several named dimensions of this mesh's root, in the order given, e.g.
  /// mesh.slice({"dp_replicate", "dp_shard"}) for HSDP inside a 3-D (dp_replicate, dp_shard, tp) mesh.
  /// Its world() is the group of the ranks it spans (one group per distinct sub-mesh, built on first
  /// use: collective over the root's world unless every dimension is named); with every root dimension
  /// named it is the root's world. An order other than the root's gives a transposed view: fully_shard
  /// uses one, (tp, dp), to describe a parameter sharded first by TP, then by FSDP (see
  /// docs/TENSOR_PARALLEL.md section 3). Throws c10::Error for an unknown or repeated name (listing the
  /// known ones). Mirrors DeviceMesh.__getitem__ with a tuple of names (which requires the root's order).
  DeviceMeshPtr slice(const std::vector<std::string>& dim_names) const;
  /// The mesh this one was sliced from (itself for a mesh built by init_device_mesh).
  /// Mirrors torch's _mesh_resources.get_root_mesh(mesh).
  DeviceMeshPtr root_mesh() const;
  /// For each dimension of this mesh, its index in root_mesh() (0, 1, ... for a root).
  const std::vector<int64_t>& root_dims() const { return root_dims_; }
  /// The world group the mesh was built over.
  const ProcessGroupPtr& world() const { return world_; }
  torch::Device device() const { return world_->device(); }
  torch::DeviceType device_type() const { return world_->device_type(); }
  /// Global ranks, row-major: the mesh as a tensor would hold it.
  const std::vector<int>& ranks() const { return ranks_; }
  /// "DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('replicate', 'shard'))".
  std::string str() const;

 private:
  DeviceMesh() = default;  // for sub-meshes
  ProcessGroupPtr world_;
  std::vector<int64_t> shape_;
  std::vector<std::string> dim_names_;
  std::vector<int> ranks_;
  std::vector<int64_t> coord_;
  std::vector<ProcessGroupPtr> groups_;  // one per dimension: the group containing this rank
  DeviceMeshPtr root_;              // null for a root
  std::vector<int64_t> root_dims_;  // per dimension: its index in the root
  uint64_t mesh_id_ = 0;            // names the root's groups in the store
  // Root only: the world groups of slices over some (not all) of its dims, by root dims (built once).
  mutable std::mutex slice_mu_;
  mutable std::map<std::vector<int64_t>, ProcessGroupPtr> slice_worlds_;
};

std::ostream& operator<<(std::ostream& os, const DeviceMesh& mesh);

/// Creates a mesh over the default process group (init_process_group must have run) or `world`.
/// `device_type` must match the group's device. Mirrors torch.distributed.device_mesh.init_device_mesh.
DeviceMeshPtr init_device_mesh(torch::DeviceType device_type, std::vector<int64_t> shape,
                               std::vector<std::string> dim_names = {}, ProcessGroupPtr world = nullptr);

}  // namespace fsdp
