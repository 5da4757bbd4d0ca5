// DeviceMesh: ranks laid out as an n-D array (1-D for FSDP, 2-D (replicate, shard) for HSDP), with
// one process group per mesh dimension and coordinate.
//
// Mirrors torch.distributed.device_mesh.{DeviceMesh, init_device_mesh}.
#pragma once

#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "fsdp/distributed.h"

namespace fsdp {

class DeviceMesh;
using DeviceMeshPtr = std::shared_ptr<DeviceMesh>;

/// A row-major array of global ranks. For shape {R, S}, rank g sits at (g / S, g % S); the group of
/// dimension 1 ("shard") holds the ranks of this rank's row, the group of dimension 0 ("replicate")
/// those of its column.
class DeviceMesh {
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
  /// Global rank of this process.
  int get_rank() const { return world_->rank(); }
  /// The process group of dimension `dim` that contains this rank. Throws if dim is out of range.
  const ProcessGroupPtr& get_group(int64_t dim = 0) const;
  const ProcessGroupPtr& get_group(const std::string& dim_name) const;
  /// Index of a named dimension; throws naming the known names when absent.
  int64_t dim_index(const std::string& dim_name) const;
  /// The 1-D sub-mesh of a named dimension, e.g. mesh["shard"]. Mirrors DeviceMesh.__getitem__.
  DeviceMeshPtr operator[](const std::string& dim_name) const;
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
};

std::ostream& operator<<(std::ostream& os, const DeviceMesh& mesh);

/// Creates a mesh over the default process group (init_process_group must have run) or `world`.
/// `device_type` must match the group's device. Mirrors torch.distributed.device_mesh.init_device_mesh.
DeviceMeshPtr init_device_mesh(torch::DeviceType device_type, std::vector<int64_t> shape,
                               std::vector<std::string> dim_names = {}, ProcessGroupPtr world = nullptr);

}  // namespace fsdp
