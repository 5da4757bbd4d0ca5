// The DTensor RNG: random tensors and dropout masks on a DeviceMesh that are, piece by piece, what one
// process would draw for the whole (global) tensor with the same seed. Replicated tensors get the same
// values on every rank of the mesh dim; sharded ones get their chunk of the one-process tensor.
// See [Note: DTensor RNG] in src/tensor/random.cpp.
//
// Mirrors torch.distributed.tensor._random (manual_seed, OffsetBasedRNGTracker).
#pragma once

#include <cstdint>
#include <vector>

#include <torch/types.h>

#include "fsdp/tensor/device_mesh.h"
#include "fsdp/tensor/dtensor.h"

namespace fsdp {

namespace random {

/// Seeds the DTensor RNG of `device_mesh`'s root mesh (every mesh sliced from it shares the state, as PyTorch's
/// one tracker per process) and resets its offset to 0. Collective over the root mesh's world: one all-gather of
/// one integer per rank, to check that every rank passed the same seed (PyTorch does not check; a rank with
/// another seed would silently draw other masks): throws c10::Error on every rank alike, listing the seeds,
/// when they differ. Independent of torch::manual_seed (the default generator is not touched).
/// Mirrors torch.distributed.tensor._random.manual_seed(seed, device_mesh).
/// Example: `fsdp::random::manual_seed(1234, mesh);  // then fsdp::random::dropout(...)`
void manual_seed(uint64_t seed, const DeviceMeshPtr& device_mesh);

/// Whether manual_seed was called for `device_mesh`'s root mesh (no communication, never throws).
/// Example: `if (!fsdp::random::is_seeded(mesh)) fsdp::manual_seed(0, mesh);`
bool is_seeded(const DeviceMeshPtr& device_mesh);

/// The state of `device_mesh`'s root: {seed, offset}. The offset counts the random numbers drawn so far
/// (each draw of n elements advances it by n rounded up to a multiple of 4, PyTorch's rule). Throws c10::Error
/// when the mesh was never seeded. Mirrors OffsetBasedRNGTracker.get_offset / get_seed.
/// Example: `auto [seed, offset] = fsdp::random::get_rng_state(mesh);`
std::pair<uint64_t, uint64_t> get_rng_state(const DeviceMeshPtr& device_mesh);
/// Sets the offset of `device_mesh`'s root (every rank alike: no communication), e.g. to start each training step
/// at a fixed offset so that a resumed run draws what it would have, or to replay a region. Throws c10::Error when
/// the mesh was never seeded. Mirrors OffsetBasedRNGTracker.set_offset.
/// Example: `fsdp::random::set_offset(mesh, step << 40);`
void set_offset(const DeviceMeshPtr& device_mesh, uint64_t offset);

/// This rank's piece of `torch::rand(global_shape)` laid out as `placements` (one per mesh dim: Shard(d) takes
/// torch.chunk's chunk of dim d, Replicate() the whole tensor; Partial() is refused) on `mesh`: the piece of the
/// tensor that one process seeded alike would draw. Advances the offset. `options`: dtype and device
/// (floating point). Throws c10::Error when the mesh is not seeded, for a Partial placement or a Shard dim out
/// of range. Example: `auto local = fsdp::random::rand_local({8, 5}, mesh, {Shard(0)});`
torch::Tensor rand_local(const std::vector<int64_t>& global_shape, const DeviceMeshPtr& mesh,
                         const std::vector<Placement>& placements, const torch::TensorOptions& options = {});

/// Dropout of a DTensor: zeroes each element with probability `p` and scales the rest by 1 / (1 - p), with
/// the mask of the global tensor that one process seeded alike would draw (this rank applies its piece).
/// Returns the local result (differentiable with respect to x.to_local(); the mask is a constant). With
/// `train` false or p == 0 it returns the local tensor unchanged and draws nothing. Throws c10::Error for p
/// outside [0, 1), an unseeded mesh, or a Partial placement. Mirrors F.dropout on a DTensor under
/// torch.distributed.tensor's RNG tracker.
/// Example: `auto y = fsdp::random::dropout(DTensor(x, tp_mesh, {Shard(1)}, {b, t, c}), 0.1, is_training());`
torch::Tensor dropout(const DTensor& x, double p, bool train);

/// The same for a plain tensor laid out as `placements` on `mesh`, with `global_shape` its global shape (empty:
/// the local shape, with each Shard(d) dim multiplied by its mesh dim's size, i.e. an even split, e.g. a
/// sequence-parallel activation). Example: `x = fsdp::random::dropout(x, 0.1, true, tp_mesh, {Replicate()});`
torch::Tensor dropout(const torch::Tensor& x, double p, bool train, const DeviceMeshPtr& mesh,
                      const std::vector<Placement>& placements, std::vector<int64_t> global_shape = {});

}  // namespace random

/// fsdp::random::manual_seed under the name the issue and PyTorch's docs use
/// (torch.distributed.tensor._random.manual_seed). Example: `fsdp::manual_seed(0, mesh);`
inline void manual_seed(uint64_t seed, const DeviceMeshPtr& device_mesh) { random::manual_seed(seed, device_mesh); }

}  // namespace fsdp
