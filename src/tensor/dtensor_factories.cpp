#include "fsdp/tensor/dtensor_factories.h"

#include "tensor/dtensor_autograd.h"

namespace fsdp::dtensor {

namespace {

// The placements (Replicate() everywhere when empty), checked before anything is made.
std::vector<Placement> factory_placements(std::vector<Placement> placements, const DeviceMeshPtr& mesh,
                                          const std::vector<int64_t>& size, const char* api) {
  TORCH_CHECK(mesh, "fsdp::dtensor::", api, ": expected a mesh, got null");
  if (placements.empty()) placements.assign(mesh->ndim(), Replicate());
  TORCH_CHECK(static_cast<int64_t>(placements.size()) == mesh->ndim(), "fsdp::dtensor::", api, ": ", placements.size(),
              " placements for a ", mesh->ndim(), "-D mesh: expected one per mesh dimension");
  for (const auto& p : placements) {
    TORCH_CHECK(!p.is_shard() || (p.dim >= 0 && p.dim < static_cast<int64_t>(size.size())), "fsdp::dtensor::", api, ": ",
                p.str(), " is out of range for a ", size.size(), "-D tensor of size ", c10::IntArrayRef(size));
  }
  return placements;
}

torch::TensorOptions on_mesh(torch::TensorOptions options, const DeviceMeshPtr& mesh) {
  if (!options.has_device()) options = options.device(mesh->device());
  return options;
}

// This rank's offsets and sizes under `placements` (torch.chunk, nested left to right).
std::pair<std::vector<int64_t>, std::vector<int64_t>> local_box(const std::vector<int64_t>& size, const DeviceMesh& mesh,
                                                                const std::vector<Placement>& placements) {
  std::vector<int64_t> offsets(size.size(), 0), sizes = size;
  for (int64_t d = 0; d < mesh.ndim(); ++d) {
    const auto& p = placements[d];
    if (!p.is_shard()) continue;
    auto r = chunk_range(sizes[p.dim], mesh.size(d), mesh.get_local_rank(d));
    offsets[p.dim] += r.offset;
    sizes[p.dim] = r.length;
  }
  return {offsets, sizes};
}

// A DTensor whose local tensor is `make(local sizes)`: every placement's piece of a constant.
DTensor constant(const std::vector<int64_t>& size, const DeviceMeshPtr& mesh, std::vector<Placement> placements,
                 const torch::TensorOptions& options, const std::function<torch::Tensor(c10::IntArrayRef, torch::TensorOptions)>& make,
                 bool zero_on_partial_sum) {
  const auto [offsets, sizes] = local_box(size, *mesh, placements);
  const bool requires_grad = options.requires_grad();
  auto local = make(sizes, options.requires_grad(false));
  // Partial(sum): coordinate 0 holds the value, the others zeros (the global value is the constant).
  for (int64_t d = 0; d < mesh->ndim() && zero_on_partial_sum; ++d) {
    if (placements[d].is_partial() && placements[d].reduce_op == "sum" && mesh->get_local_rank(d) != 0) {
      local = torch::zeros(sizes, options.requires_grad(false));
      break;
    }
  }
  if (requires_grad) local.requires_grad_(true);
  return DTensor(std::move(local), mesh, std::move(placements), size);
}

// Draws the whole tensor, keeps this rank's piece (see [Note: DTensor rand/randn]).
DTensor random(const char* api, std::vector<int64_t> size, DeviceMeshPtr mesh, std::vector<Placement> placements,
               torch::TensorOptions options, std::optional<at::Generator> generator, bool normal) {
  placements = factory_placements(std::move(placements), mesh, size, api);
  options = on_mesh(options, mesh);
  const bool requires_grad = options.requires_grad();
  options = options.requires_grad(false);
  torch::Tensor full = normal ? torch::randn(size, generator, options) : torch::rand(size, generator, options);
  const auto [offsets, sizes] = local_box(size, *mesh, placements);
  torch::Tensor local = full;
  for (size_t k = 0; k < size.size(); ++k) local = local.narrow(static_cast<int64_t>(k), offsets[k], sizes[k]);
  local = local.clone();
  for (int64_t d = 0; d < mesh->ndim(); ++d) {
    if (placements[d].is_partial() && placements[d].reduce_op == "sum" && mesh->get_local_rank(d) != 0) local.zero_();
  }
  if (requires_grad) local.requires_grad_(true);
  return DTensor(std::move(local), std::move(mesh), std::move(placements), std::move(size));
}

}  // namespace

DTensor zeros(std::vector<int64_t> size, DeviceMeshPtr mesh, std::vector<Placement> placements, torch::TensorOptions options) {
  placements = factory_placements(std::move(placements), mesh, size, "zeros");
  return constant(size, mesh, std::move(placements), on_mesh(options, mesh),
                  [](c10::IntArrayRef s, torch::TensorOptions o) { return torch::zeros(s, o); }, false);
}

DTensor ones(std::vector<int64_t> size, DeviceMeshPtr mesh, std::vector<Placement> placements, torch::TensorOptions options) {
  placements = factory_placements(std::move(placements), mesh, size, "ones");
  return constant(size, mesh, std::move(placements), on_mesh(options, mesh),
                  [](c10::IntArrayRef s, torch::TensorOptions o) { return torch::ones(s, o); }, true);
}

DTensor empty(std::vector<int64_t> size, DeviceMeshPtr mesh, std::vector<Placement> placements, torch::TensorOptions options) {
  placements = factory_placements(std::move(placements), mesh, size, "empty");
  return constant(size, mesh, std::move(placements), on_mesh(options, mesh),
                  [](c10::IntArrayRef s, torch::TensorOptions o) { return torch::empty(s, o); }, false);
}

DTensor full(std::vector<int64_t> size, const c10::Scalar& fill_value, DeviceMeshPtr mesh, std::vector<Placement> placements,
             torch::TensorOptions options) {
  placements = factory_placements(std::move(placements), mesh, size, "full");
  return constant(size, mesh, std::move(placements), on_mesh(options, mesh),
                  [&](c10::IntArrayRef s, torch::TensorOptions o) { return torch::full(s, fill_value, o); }, true);
}

DTensor rand(std::vector<int64_t> size, DeviceMeshPtr mesh, std::vector<Placement> placements, torch::TensorOptions options,
             std::optional<at::Generator> generator) {
  return random("rand", std::move(size), std::move(mesh), std::move(placements), options, std::move(generator), false);
}

DTensor randn(std::vector<int64_t> size, DeviceMeshPtr mesh, std::vector<Placement> placements, torch::TensorOptions options,
              std::optional<at::Generator> generator) {
  return random("randn", std::move(size), std::move(mesh), std::move(placements), options, std::move(generator), true);
}

}  // namespace fsdp::dtensor
