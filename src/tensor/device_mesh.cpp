#include "fsdp/tensor/device_mesh.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <sstream>

#include "c10d/process_group_access.h"

namespace fsdp {

DeviceMesh::DeviceMesh(ProcessGroupPtr world, std::vector<int64_t> shape, std::vector<std::string> dim_names)
    : world_(std::move(world)), shape_(std::move(shape)), dim_names_(std::move(dim_names)) {
  TORCH_CHECK(world_, "DeviceMesh: expected a process group, got null");
  TORCH_CHECK(!shape_.empty(), "DeviceMesh: expected a non-empty mesh shape");
  std::ostringstream arith;
  int64_t total = 1;
  for (size_t d = 0; d < shape_.size(); ++d) {
    TORCH_CHECK(shape_[d] >= 1, "DeviceMesh: mesh dimension ", d, " has size ", shape_[d], ": expected >= 1");
    arith << (d ? " x " : "") << shape_[d];
    total *= shape_[d];
  }
  TORCH_CHECK(total == world_->size(), "DeviceMesh: mesh shape ", arith.str(), " = ", total, " != WORLD_SIZE(",
              world_->size(), "). Fix: choose a shape whose product is the number of ranks");
  if (!dim_names_.empty()) {
    TORCH_CHECK(dim_names_.size() == shape_.size(), "DeviceMesh: ", dim_names_.size(), " dim names for a ",
                shape_.size(), "-D mesh");
    std::set<std::string> seen(dim_names_.begin(), dim_names_.end());
    TORCH_CHECK(seen.size() == dim_names_.size(), "DeviceMesh: mesh_dim_names must be distinct");
  }
  ranks_.resize(total);
  std::iota(ranks_.begin(), ranks_.end(), 0);
  for (auto& r : ranks_) r = world_->global_ranks()[r];

  // Coordinate of this rank (row-major), then, per dimension, the ranks that share every other coordinate.
  int64_t rem = world_->rank();
  coord_.assign(shape_.size(), 0);
  for (int64_t d = ndim() - 1; d >= 0; --d) {
    coord_[d] = rem % shape_[d];
    rem /= shape_[d];
  }
  std::vector<int64_t> strides(shape_.size(), 1);
  for (int64_t d = ndim() - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape_[d + 1];
  root_dims_.resize(shape_.size());
  std::iota(root_dims_.begin(), root_dims_.end(), 0);
  const uint64_t mesh_id = mesh_id_ = detail::ProcessGroupAccess::next_subgroup_id(*world_);
  for (int64_t d = 0; d < ndim(); ++d) {
    if (shape_.size() == 1) {
      groups_.push_back(world_);  // a 1-D mesh is the world itself: no new group
      continue;
    }
    int64_t base = world_->rank() - coord_[d] * strides[d];
    std::vector<int> members;
    for (int64_t i = 0; i < shape_[d]; ++i) members.push_back(static_cast<int>(base + i * strides[d]));
    std::string name = "mesh" + std::to_string(mesh_id) + "/" +
                       (dim_names_.empty() ? "dim" + std::to_string(d) : dim_names_[d]) + "/" + std::to_string(base);
    groups_.push_back(new_group(world_, members, name));
  }
}

int64_t DeviceMesh::size() const { return static_cast<int64_t>(ranks_.size()); }

int64_t DeviceMesh::size(int64_t dim) const {
  TORCH_CHECK(dim >= 0 && dim < ndim(), "DeviceMesh: dim ", dim, " out of range for a ", ndim(), "-D mesh");
  return shape_[dim];
}

int64_t DeviceMesh::get_local_rank(int64_t dim) const {
  TORCH_CHECK(dim >= 0 && dim < ndim(), "DeviceMesh: dim ", dim, " out of range for a ", ndim(), "-D mesh");
  return coord_[dim];
}

std::vector<int64_t> DeviceMesh::get_coordinate() const { return coord_; }

const ProcessGroupPtr& DeviceMesh::get_group(int64_t dim) const {
  TORCH_CHECK(dim >= 0 && dim < ndim(), "DeviceMesh: dim ", dim, " out of range for a ", ndim(), "-D mesh");
  return groups_[dim];
}

const ProcessGroupPtr& DeviceMesh::get_group(const std::string& dim_name) const {
  return groups_[dim_index(dim_name)];
}

int64_t DeviceMesh::dim_index(const std::string& dim_name) const {
  for (size_t d = 0; d < dim_names_.size(); ++d) {
    if (dim_names_[d] == dim_name) return static_cast<int64_t>(d);
  }
  std::ostringstream names;
  for (size_t d = 0; d < dim_names_.size(); ++d) names << (d ? ", " : "") << "'" << dim_names_[d] << "'";
  TORCH_CHECK(false, "DeviceMesh: no dimension named '", dim_name, "'; the mesh has [", names.str(), "]");
}

DeviceMeshPtr DeviceMesh::operator[](const std::string& dim_name) const {
  int64_t d = dim_index(dim_name);
  std::shared_ptr<DeviceMesh> sub(new DeviceMesh());
  sub->world_ = groups_[d];
  sub->shape_ = {shape_[d]};
  sub->dim_names_ = {dim_name};
  sub->ranks_ = groups_[d]->global_ranks();
  sub->coord_ = {coord_[d]};
  sub->groups_ = {groups_[d]};
  sub->root_ = root_mesh();
  sub->root_dims_ = {root_dims_[d]};
  return sub;
}

DeviceMeshPtr DeviceMesh::root_mesh() const {
  if (root_) return root_;
  try {
    return std::const_pointer_cast<DeviceMesh>(shared_from_this());
  } catch (const std::bad_weak_ptr&) {
    TORCH_CHECK(false, "DeviceMesh: root_mesh()/slice()/operator[] need the mesh to be owned by a std::shared_ptr "
                "(build it with init_device_mesh or std::make_shared<DeviceMesh>)");
  }
}

DeviceMeshPtr DeviceMesh::slice(const std::vector<std::string>& names) const {
  auto root = root_mesh();
  TORCH_CHECK(!names.empty(), "DeviceMesh::slice: expected at least one dimension name");
  std::vector<int64_t> dims;
  for (const auto& n : names) {
    const int64_t d = root->dim_index(n);  // throws naming the known names
    TORCH_CHECK(std::find(dims.begin(), dims.end(), d) == dims.end(), "DeviceMesh::slice: dimension '", n,
                "' is named twice");
    dims.push_back(d);
  }
  std::shared_ptr<DeviceMesh> sub(new DeviceMesh());
  sub->root_ = root;
  sub->root_dims_ = dims;
  sub->dim_names_ = names;
  for (int64_t d : dims) {
    sub->shape_.push_back(root->shape_[d]);
    sub->coord_.push_back(root->coord_[d]);
    sub->groups_.push_back(root->groups_[d]);
  }
  // Ranks, row-major in the slice's order; the root's other dims fixed at this rank's coordinates.
  std::vector<int64_t> root_strides(root->shape_.size(), 1);
  for (int64_t d = root->ndim() - 2; d >= 0; --d) root_strides[d] = root_strides[d + 1] * root->shape_[d + 1];
  int64_t base = 0;
  for (int64_t d = 0; d < root->ndim(); ++d) {
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) base += root->coord_[d] * root_strides[d];
  }
  std::vector<int> members;  // group ranks in the root's world
  std::vector<int64_t> idx(dims.size(), 0);
  int64_t total = 1;
  for (int64_t n : sub->shape_) total *= n;
  for (int64_t n = 0; n < total; ++n) {
    int64_t flat = base;
    for (size_t k = 0; k < dims.size(); ++k) flat += idx[k] * root_strides[dims[k]];
    members.push_back(static_cast<int>(flat));
    sub->ranks_.push_back(root->ranks_[flat]);
    for (int64_t k = static_cast<int64_t>(dims.size()) - 1; k >= 0; --k) {
      if (++idx[k] < sub->shape_[k]) break;
      idx[k] = 0;
    }
  }
  if (dims.size() == root->shape_.size()) {
    sub->world_ = root->world_;
  } else if (dims.size() == 1) {
    sub->world_ = root->groups_[dims[0]];
  } else {
    auto key = dims;
    std::sort(key.begin(), key.end());
    std::lock_guard<std::mutex> lock(root->slice_mu_);
    auto& world = root->slice_worlds_[key];
    if (!world) {
      std::sort(members.begin(), members.end());
      std::ostringstream name;
      name << "mesh" << root->mesh_id_ << "/slice";
      for (int64_t d : key) name << "/" << (root->dim_names_.empty() ? "dim" + std::to_string(d) : root->dim_names_[d]);
      name << "/" << base;
      world = new_group(root->world_, members, name.str());
    }
    sub->world_ = world;
  }
  return sub;
}

std::string DeviceMesh::str() const {
  std::ostringstream os;
  os << "DeviceMesh('" << (device_type() == torch::kCUDA ? "cuda" : "cpu") << "', ";
  // Nested brackets, row-major.
  std::function<void(size_t, size_t)> emit = [&](size_t d, size_t offset) {
    os << "[";
    size_t stride = 1;
    for (size_t k = d + 1; k < shape_.size(); ++k) stride *= shape_[k];
    for (int64_t i = 0; i < shape_[d]; ++i) {
      if (i) os << ", ";
      if (d + 1 == shape_.size()) {
        os << ranks_[offset + i];
      } else {
        emit(d + 1, offset + i * stride);
      }
    }
    os << "]";
  };
  emit(0, 0);
  if (!dim_names_.empty()) {
    os << ", mesh_dim_names=(";
    for (size_t d = 0; d < dim_names_.size(); ++d) os << (d ? ", " : "") << "'" << dim_names_[d] << "'";
    os << (dim_names_.size() == 1 ? ",)" : ")");
  }
  os << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const DeviceMesh& mesh) { return os << mesh.str(); }

DeviceMeshPtr init_device_mesh(torch::DeviceType device_type, std::vector<int64_t> shape,
                               std::vector<std::string> dim_names, ProcessGroupPtr world) {
  if (!world) world = default_process_group();
  TORCH_CHECK(world->device_type() == device_type, "init_device_mesh: device type ", device_type,
              " does not match the process group's device ", world->device(),
              ". Fix: pass the device type init_process_group returned (group->device_type())");
  return std::make_shared<DeviceMesh>(world, std::move(shape), std::move(dim_names));
}

}  // namespace fsdp
