// Internal: the local-tensor steps behind DTensor's autograd ([Note: DTensor autograd] in
// src/tensor/dtensor.cpp), shared by dtensor.cpp, dtensor_ops.cpp and distribute_module.cpp.
#pragma once

#include <functional>
#include <vector>

#include <torch/types.h>

#include "fsdp/tensor/dtensor.h"

namespace fsdp::detail {

/// `local` (laid out with `from`) laid out with `to`: DTensor::redistribute's collectives, no autograd.
torch::Tensor redistribute_local(const torch::Tensor& local, const DeviceMesh& mesh, const std::vector<Placement>& from,
                                 const std::vector<Placement>& to, const std::vector<int64_t>& global_shape);
/// The placements of a DTensor's gradient: Partial read as Replicate.
std::vector<Placement> grad_placements_of(const std::vector<Placement>& placements);
/// forward(x) whose backward is backward(grad) (an autograd node when x requires grad).
torch::Tensor local_step(const torch::Tensor& x, std::function<torch::Tensor(const torch::Tensor&)> forward,
                         std::function<torch::Tensor(const torch::Tensor&)> backward);
/// Identity forward; backward sums the gradient over each of `mesh_dims` (Megatron's f).
torch::Tensor grad_all_reduce(const torch::Tensor& x, const DeviceMeshPtr& mesh, const std::vector<int64_t>& mesh_dims);
/// redistribute_local with the backward of [Note: DTensor autograd].
torch::Tensor redistribute_grad(const torch::Tensor& local, const DeviceMeshPtr& mesh, const std::vector<Placement>& from,
                                const std::vector<Placement>& to, const std::vector<int64_t>& global_shape);

}  // namespace fsdp::detail
