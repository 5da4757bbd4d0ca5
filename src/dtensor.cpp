#include "fsdp/dtensor.h"

#include <sstream>

#include "fsdp/collectives.h"

namespace fsdp {

std::string Placement::str() const {
  return is_shard() ? "Shard(dim=" + std::to_string(dim) + ")" : "Replicate()";
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
  // Undo the sharding one mesh dim at a time, innermost first (the order distribute_tensor applied).
  torch::Tensor cur = local_;
  // Sizes of the tensor at each stage of sharding, outermost first.
  std::vector<std::vector<int64_t>> stage_sizes{global_shape_};
  for (int64_t d = 0; d < mesh_->ndim(); ++d) {
    auto s = stage_sizes.back();
    const auto& p = placements_[d];
    if (p.is_shard()) s[p.dim] = chunk_range(s[p.dim], mesh_->size(d), mesh_->get_local_rank(d)).length;
    stage_sizes.push_back(s);
  }
  for (int64_t d = mesh_->ndim() - 1; d >= 0; --d) {
    const auto& p = placements_[d];
    if (!p.is_shard()) continue;
    int64_t k = mesh_->size(d);
    int64_t n = stage_sizes[d][p.dim];  // size of the sharded dim before this mesh dim split it
    int64_t c = (n + k - 1) / k;
    // Move the sharded dim to the front, pad to c rows, gather, then trim and move it back.
    auto front = cur.movedim(p.dim, 0).contiguous();
    auto padded_shape = front.sizes().vec();
    padded_shape[0] = c;
    auto padded = torch::zeros(padded_shape, front.options());
    if (front.size(0) > 0) padded.narrow(0, 0, front.size(0)).copy_(front);
    auto gathered_shape = padded_shape;
    gathered_shape[0] = c * k;
    auto gathered = torch::empty(gathered_shape, front.options());
    all_gather_into_tensor(gathered, padded, *mesh_->get_group(d));
    cur = gathered.narrow(0, 0, n).movedim(0, p.dim).contiguous();
  }
  return cur;
}

DTensor DTensor::from_local(torch::Tensor local, DeviceMeshPtr mesh, std::vector<Placement> placements,
                            std::vector<int64_t> global_shape) {
  TORCH_CHECK(mesh, "DTensor::from_local: expected a mesh, got null");
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

DTensor distribute_tensor(const torch::Tensor& full, DeviceMeshPtr mesh, std::vector<Placement> placements) {
  TORCH_CHECK(mesh, "distribute_tensor: expected a mesh, got null");
  check_placements(*mesh, placements, full.dim(), "distribute_tensor");
  torch::Tensor cur = full;
  for (int64_t d = 0; d < mesh->ndim(); ++d) {
    const auto& p = placements[d];
    if (!p.is_shard()) continue;
    auto r = chunk_range(cur.size(p.dim), mesh->size(d), mesh->get_local_rank(d));
    cur = cur.narrow(p.dim, r.offset, r.length);
  }
  return DTensor(cur.contiguous(), std::move(mesh), std::move(placements), full.sizes().vec());
}

}  // namespace fsdp
