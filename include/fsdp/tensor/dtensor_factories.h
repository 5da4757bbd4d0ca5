// DTensor factories: zeros/ones/empty/full/rand/randn of a global shape, laid out on a mesh with
// placements, without communication. Mirrors torch.distributed.tensor.{zeros, ones, empty, full, rand,
// randn}.
//
// [Note: DTensor rand/randn]
// rand and randn give the same global tensor as one process that seeds its generator the same way and
// calls torch::rand(size): every rank draws the whole global tensor from the generator (the one passed,
// or the default generator of the device, which must then be in the same state on every rank, e.g.
// after torch::manual_seed(s) on each) and keeps its piece. Cost: each rank draws and holds the global
// tensor for a moment (O(global numel) time and memory per rank), and every rank's generator advances by
// the whole draw, so later draws stay in step across ranks. No communication. PyTorch's DTensor RNG
// (offset-based, each rank draws only its piece) is the DTensor random tracker's business, not this one.
#pragma once

#include <optional>
#include <vector>

#include <ATen/core/Generator.h>
#include <torch/types.h>

#include "fsdp/tensor/dtensor.h"

namespace fsdp::dtensor {

// Common arguments: `size` is the global shape; `placements` one per mesh dim (empty: Replicate() on
// every mesh dim, PyTorch's default); `options` dtype/requires_grad (the device defaults to the mesh's).
// A Partial("sum") mesh dim holds the value on coordinate 0 and zeros elsewhere (so the global value is
// the one asked for), Partial(avg/max/min) holds it everywhere. Throws c10::Error (on every rank alike)
// for a wrong number of placements or a Shard dim out of range.

/// Example: auto z = dtensor::zeros({8, 3}, mesh, {Shard(0)});  // local [ceil(8/N) or less, 3]
DTensor zeros(std::vector<int64_t> size, DeviceMeshPtr mesh, std::vector<Placement> placements = {},
              torch::TensorOptions options = {});
/// Example: auto o = dtensor::ones({8, 3}, mesh, {Replicate()});
DTensor ones(std::vector<int64_t> size, DeviceMeshPtr mesh, std::vector<Placement> placements = {},
             torch::TensorOptions options = {});
/// Uninitialized values. Example: auto e = dtensor::empty({8, 3}, mesh, {Shard(1)});
DTensor empty(std::vector<int64_t> size, DeviceMeshPtr mesh, std::vector<Placement> placements = {},
              torch::TensorOptions options = {});
/// Every element `fill_value`. Example: auto f = dtensor::full({8, 3}, 2.5, mesh, {Shard(0)});
DTensor full(std::vector<int64_t> size, const c10::Scalar& fill_value, DeviceMeshPtr mesh,
             std::vector<Placement> placements = {}, torch::TensorOptions options = {});
/// Uniform [0, 1): the piece of the tensor one process would draw (see [Note: DTensor rand/randn]).
/// Example: torch::manual_seed(0); auto r = dtensor::rand({7, 5}, mesh, {Shard(0)});
DTensor rand(std::vector<int64_t> size, DeviceMeshPtr mesh, std::vector<Placement> placements = {},
             torch::TensorOptions options = {}, std::optional<at::Generator> generator = std::nullopt);
/// Standard normal: the piece of the tensor one process would draw (see [Note: DTensor rand/randn]).
DTensor randn(std::vector<int64_t> size, DeviceMeshPtr mesh, std::vector<Placement> placements = {},
              torch::TensorOptions options = {}, std::optional<at::Generator> generator = std::nullopt);

}  // namespace fsdp::dtensor
