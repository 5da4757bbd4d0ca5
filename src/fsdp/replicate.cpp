// replicate: DDP semantics on FSDP2's machinery (see include/fsdp/fsdp/replicate.h).
// Mirrors torch.distributed._composable.replicate_with_fsdp.
#include "fsdp/fsdp/replicate.h"

#include <mutex>
#include <utility>

#include "fsdp/fsdp_init.h"
#include "fsdp/fsdp_state.h"

#include <c10/util/StringUtil.h>

namespace fsdp {
namespace {

// [Note: replicate as HSDP with one-rank shards]
// PyTorch's replicate_with_fsdp runs FSDP2's parameter groups with a DDPMeshInfo: no shard dimension, the
// gradients all-reduced over the replicate dimension. Here a replicate group is an HSDP group on a
// (world, 1) mesh: the FSDP machinery (hooks, holders and interception, mixed precision, offload, the
// cross-rank checks, gradient accumulation, state dicts) is shared as is, the broadcast over "replicate"
// at init is DDP's initial broadcast, and the one-rank "shard" dimension makes the all-gather and the
// reduce-scatter local copies that move no bytes (fsdp_collectives.cpp skips their collectives). The
// 2-D mesh is derived once per 1-D mesh (its process groups are built once), so the replicate groups of
// one model share it.
DeviceMeshPtr replicate_mesh(const DeviceMeshPtr& mesh) {
  static std::mutex mu;
  static std::vector<std::pair<std::weak_ptr<DeviceMesh>, DeviceMeshPtr>> cache;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = cache.begin(); it != cache.end();) {
      auto m = it->first.lock();
      if (!m) {
        it = cache.erase(it);  // the user's mesh is gone: so are its derived groups
        continue;
      }
      if (m == mesh) return it->second;
      ++it;
    }
  }
  // Built outside the lock: the constructor rendezvouses with the other ranks, which may be threads of
  // this process (one rank per thread) that need the lock for their own meshes meanwhile.
  std::string name = mesh->dim_names().empty() ? "replicate" : mesh->dim_names()[0];
  auto derived = std::make_shared<DeviceMesh>(mesh->get_group(0), std::vector<int64_t>{mesh->size(), 1},
                                              std::vector<std::string>{name, "shard"});
  std::lock_guard<std::mutex> lock(mu);
  cache.emplace_back(mesh, derived);
  return derived;
}

}  // namespace

FSDPModuleAPI replicate(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                        const ReplicateOptions& options) {
  TORCH_CHECK(!modules.empty(), "replicate: got no module");
  for (const auto& module : modules) {
    TORCH_CHECK(module, "replicate: got a null module");
    if (auto s = detail::state_of(*module)) {
      TORCH_CHECK(false, "replicate: module ", module->name(), " is already managed by ",
                  s->replicated ? "replicate" : "fully_shard", ". Cannot apply replicate() on a module already ",
                  "managed by fully_shard or replicate (as in PyTorch). Fix: call it once per module; to shard some ",
                  "modules and replicate others, call each on a different module (e.g. fully_shard on the blocks, ",
                  "replicate on the root)");
    }
  }
  auto mesh = options.mesh();
  if (options.dp_mesh_dims()) {
    TORCH_CHECK(options.dp_mesh_dims()->shard().empty(), "replicate: dp_mesh_dims sets shard (",
                c10::Join(", ", options.dp_mesh_dims()->shard()), "), but replicate does not shard. Fix: ",
                "fsdp::fully_shard with dp_mesh_dims for HSDP, or name only the replicate dimensions");
    mesh = detail::data_parallel_mesh(mesh, *options.dp_mesh_dims(), "replicate");
  }
  if (!mesh) {
    auto world = default_process_group();
    mesh = init_device_mesh(world->device_type(), {world->size()}, {"replicate"}, world);
  }
  TORCH_CHECK(mesh->ndim() == 1, "replicate expects a 1-D DeviceMesh but got ", mesh->str(),
              ". Fix: pass the data-parallel dimension, e.g. mesh[\"dp\"] (HSDP on a 2-D mesh is fully_shard's)");
  auto api = fully_shard(modules, FullyShardOptions()
                                      .mesh(replicate_mesh(mesh))
                                      .reshard_after_forward(false)  // nothing to free: the shards are whole
                                      .mp_policy(options.mp_policy())
                                      .offload_policy(options.offload_policy())
                                      .ignored_params(options.ignored_params()));
  detail::fsdp_state(api).replicated = true;
  return api;
}

FSDPModuleAPI replicate(const std::shared_ptr<torch::nn::Module>& module, const ReplicateOptions& options) {
  return replicate(std::vector<std::shared_ptr<torch::nn::Module>>{module}, options);
}

bool is_replicated(const torch::nn::Module& module) {
  auto s = detail::state_of(module);
  return s && s->replicated;
}

}  // namespace fsdp
