// The DTensor RNG (random.h): manual_seed per root mesh and an offset-based tracker.
//
// [Note: DTensor RNG]
// Goal: a random op on a distributed tensor gives each rank its piece of what one process would draw for the
// global tensor with the same seed: the same values on every rank of a Replicate() mesh dim (dropout on a
// replicated activation under TP: every TP rank must drop the same elements, or the replicas diverge), and
// torch.chunk's chunk of the one-process tensor on a Shard(d) mesh dim (sequence-parallel dropout, a sharded
// random tensor).
// State: per root mesh (PyTorch keeps one tracker per process; ranks that are threads of one process, as the
// tests run them, each have their own root), a seed and an offset. Every random op takes the state's current
// offset, then advances it by its global numel rounded up to a multiple of 4 (PyTorch's
// OffsetBasedRNGTracker rule), so the ranks that run the same ops in the same order stay in step without
// communicating. Ops that only some ranks run (e.g. another pipeline stage's) must not share a root's state
// with ranks that need the same values.
// The draw: the op draws the whole global tensor from a generator determined by (seed, offset) only, and
// each rank keeps its piece.
// - CPU: LibTorch's CPU generator is mt19937, which cannot jump ahead to an offset: the generator is a fresh
//   mt19937 seeded with splitmix64(seed ^ splitmix64(offset)), so a draw depends only on (seed, offset).
// - CUDA: Philox (seed, offset) is the generator's whole state, set with set_current_seed and set_offset.
//   PyTorch instead sets each shard's Philox offset to where its first element would be, which saves the draw
//   of the other shards but depends on how the kernel maps elements to Philox counters; drawing the whole
//   tensor is exact on any device whatever the kernel.
// Cost: a sharded op draws tp (the shard count) times its own numel and holds the global tensor transiently
// (for SP dropout, one [B, T, C] mask per rank at the moment of the draw instead of [B, T / tp, C]; the kept
// mask is the local piece). A replicated op draws what it needs. No communication at all after manual_seed.
// One process (a 1-rank mesh, or the same code with tp = 1) applies the same rule and so draws the same
// tensors: that is the reference the tests compare against (not torch::rand with torch::manual_seed, whose
// stream differs).
#include "fsdp/tensor/random.h"

#include <map>
#include <mutex>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/autograd.h>

#include "fsdp/c10d/collectives.h"
#include "utils/intercept.h"

namespace fsdp::random {
namespace {

struct State {
  uint64_t seed = 0;
  uint64_t offset = 0;
};

struct Trackers {
  std::mutex mu;
  // Keyed by the root mesh, held weakly: a dead root's entry is dropped at the next manual_seed.
  std::map<const DeviceMesh*, std::pair<std::weak_ptr<DeviceMesh>, State>> states;
};
Trackers& trackers() {
  static auto* t = new Trackers();
  return *t;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Takes the current offset of `mesh`'s root and advances it by `numel` rounded up to 4.
State take(const DeviceMeshPtr& mesh, int64_t numel, const char* api) {
  TORCH_CHECK(mesh, api, ": expected a DeviceMesh, got null");
  auto root = mesh->root_mesh();
  auto& t = trackers();
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.states.find(root.get());
  TORCH_CHECK(it != t.states.end() && !it->second.first.expired(), api, ": the DTensor RNG of ", root->str(),
              " is not seeded; call fsdp::manual_seed(seed, mesh) with the same seed on every rank first");
  State s = it->second.second;
  it->second.second.offset += static_cast<uint64_t>((numel + 3) / 4 * 4);
  return s;
}

// A generator whose draws depend only on (seed, offset): see [Note: DTensor RNG].
at::Generator generator_for(const State& s, const torch::Device& device) {
  if (device.is_cpu()) return at::make_generator<at::CPUGeneratorImpl>(splitmix64(s.seed ^ splitmix64(s.offset)));
  auto g = at::globalContext().defaultGenerator(device).clone();
  g.set_current_seed(s.seed);
  g.set_offset(s.offset);
  return g;
}

// This rank's piece of `full` (global shape) under `placements` on `mesh`: mesh dims nest left to right
// (docs/TENSOR_PARALLEL.md section 1), torch.chunk along each Shard dim.
torch::Tensor piece(const torch::Tensor& full, const DeviceMeshPtr& mesh, const std::vector<Placement>& placements) {
  auto out = full;
  for (size_t i = 0; i < placements.size(); ++i) {
    const auto& p = placements[i];
    if (!p.is_shard()) continue;
    const int64_t d = p.dim < 0 ? p.dim + full.dim() : p.dim;
    const auto c = chunk_range(out.size(d), mesh->size(static_cast<int64_t>(i)), mesh->get_local_rank(static_cast<int64_t>(i)));
    out = out.narrow(d, c.offset, c.length);
  }
  return out;
}

void check_placements(const DeviceMeshPtr& mesh, const std::vector<Placement>& placements, int64_t ndim, const char* api) {
  TORCH_CHECK(mesh, api, ": expected a DeviceMesh, got null");
  TORCH_CHECK(static_cast<int64_t>(placements.size()) == mesh->ndim(), api, ": expected one placement per mesh dim (",
              mesh->ndim(), " for ", mesh->str(), "), got ", placements.size());
  for (const auto& p : placements) {
    TORCH_CHECK(!p.is_partial(), api, ": a random tensor cannot be ", p.str(),
                "; use Replicate() or Shard(d) (a Partial value has no one-process counterpart to draw)");
    if (p.is_shard()) {
      TORCH_CHECK(p.dim >= -ndim && p.dim < ndim, api, ": ", p.str(), " is out of range for a ", ndim, "-D tensor");
    }
  }
}

}  // namespace

void manual_seed(uint64_t seed, const DeviceMeshPtr& device_mesh) {
  TORCH_CHECK(device_mesh, "fsdp::manual_seed: expected a DeviceMesh, got null");
  auto root = device_mesh->root_mesh();
  auto& world = *root->world();
  {
    fsdp::detail::NoInterception no_interception;
    auto mine = torch::tensor({static_cast<int64_t>(seed)}, torch::kLong).to(root->device());
    auto all = torch::empty({world.size()}, mine.options());
    all_gather_into_tensor(all, mine, world);
    all = all.cpu();
    auto a = all.accessor<int64_t, 1>();
    std::string seeds;
    bool same = true;
    for (int64_t k = 0; k < world.size(); ++k) {
      seeds += (k ? ", " : "") + std::to_string(static_cast<uint64_t>(a[k]));
      same = same && a[k] == a[0];
    }
    TORCH_CHECK(same, "fsdp::manual_seed: the ranks of ", root->str(), " passed different seeds (by rank: ", seeds,
                "); pass the same seed on every rank (vary it by a data-parallel coordinate only through a mesh of "
                "its own)");
  }
  auto& t = trackers();
  std::lock_guard<std::mutex> lock(t.mu);
  for (auto it = t.states.begin(); it != t.states.end();) it = it->second.first.expired() ? t.states.erase(it) : std::next(it);
  t.states[root.get()] = {root, State{seed, 0}};
}

bool is_seeded(const DeviceMeshPtr& device_mesh) {
  if (!device_mesh) return false;
  auto root = device_mesh->root_mesh();
  auto& t = trackers();
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.states.find(root.get());
  return it != t.states.end() && !it->second.first.expired();
}

std::pair<uint64_t, uint64_t> get_rng_state(const DeviceMeshPtr& device_mesh) {
  auto s = take(device_mesh, 0, "fsdp::random::get_rng_state");
  return {s.seed, s.offset};
}

void set_offset(const DeviceMeshPtr& device_mesh, uint64_t offset) {
  take(device_mesh, 0, "fsdp::random::set_offset");  // checks that it is seeded
  auto& t = trackers();
  std::lock_guard<std::mutex> lock(t.mu);
  t.states[device_mesh->root_mesh().get()].second.offset = offset;
}

torch::Tensor rand_local(const std::vector<int64_t>& global_shape, const DeviceMeshPtr& mesh,
                         const std::vector<Placement>& placements, const torch::TensorOptions& options) {
  check_placements(mesh, placements, static_cast<int64_t>(global_shape.size()), "fsdp::random::rand_local");
  int64_t numel = 1;
  for (auto s : global_shape) numel *= s;
  const State s = take(mesh, numel, "fsdp::random::rand_local");
  fsdp::detail::NoInterception no_interception;
  auto opts = options.device(options.has_device() ? options.device() : mesh->device());
  auto gen = generator_for(s, opts.device());
  auto full = torch::empty(global_shape, opts.requires_grad(false)).uniform_(0.0, 1.0, gen);
  return piece(full, mesh, placements).contiguous();
}

torch::Tensor dropout(const torch::Tensor& x, double p, bool train, const DeviceMeshPtr& mesh,
                      const std::vector<Placement>& placements, std::vector<int64_t> global_shape) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "fsdp::random::dropout: p must be in [0, 1), got ", p);
  check_placements(mesh, placements, x.dim(), "fsdp::random::dropout");
  if (!train || p == 0.0) return x;
  if (global_shape.empty()) {
    global_shape = x.sizes().vec();
    for (size_t i = 0; i < placements.size(); ++i) {
      if (!placements[i].is_shard()) continue;
      const int64_t d = placements[i].dim < 0 ? placements[i].dim + x.dim() : placements[i].dim;
      global_shape[d] *= mesh->size(static_cast<int64_t>(i));
    }
  }
  TORCH_CHECK(static_cast<int64_t>(global_shape.size()) == x.dim(), "fsdp::random::dropout: a global shape ",
              c10::IntArrayRef(global_shape), " for a local tensor of shape ", x.sizes());
  int64_t numel = 1;
  for (auto s : global_shape) numel *= s;
  const State s = take(mesh, numel, "fsdp::random::dropout");
  torch::Tensor mask;
  {
    fsdp::detail::NoInterception no_interception;
    at::NoGradGuard no_grad;
    auto gen = generator_for(s, x.device());
    // keep = 1 with probability 1 - p: the scaled mask of F.dropout.
    auto full = torch::empty(global_shape, x.options().requires_grad(false)).bernoulli_(1.0 - p, gen);
    mask = piece(full, mesh, placements);
    TORCH_CHECK(mask.sizes() == x.sizes(), "fsdp::random::dropout: the local tensor of shape ", x.sizes(),
                " is not this rank's piece ", mask.sizes(), " of the global shape ", c10::IntArrayRef(global_shape),
                " under the placements on ", mesh->str(), "; pass the global shape");
    mask = mask.mul(1.0 / (1.0 - p));
  }
  return x * mask;
}

torch::Tensor dropout(const DTensor& x, double p, bool train) {
  return dropout(x.to_local(), p, train, x.device_mesh(), x.placements(), x.sizes());
}

}  // namespace fsdp::random
