// fully_shard's initialisation: default mesh, managed parameters and their checks (see fsdp_init.h).
#include "fsdp/fsdp_init.h"

#include <mutex>
#include <sstream>
#include <tuple>

#include <c10/util/StringUtil.h>
#include <unordered_map>
#include <unordered_set>

#include <torch/nn/modules/embedding.h>

#include "fsdp/fsdp_state.h"

namespace fsdp::detail {
namespace {

// Modules whose parameters get sparse gradients, which a reduce-scatter of dense rows cannot take: refused
// at fully_shard, before anything is sharded, instead of failing deep in backward. (A custom module that
// asks for a sparse gradient through the functional form is caught when the gradient arrives.)
void check_dense_gradients(const torch::nn::Module& m, const std::string& path, const std::string& param, int rank) {
  bool sparse = false;
  if (const auto* e = m.as<torch::nn::EmbeddingImpl>()) sparse = e->options.sparse();
  if (const auto* e = m.as<torch::nn::EmbeddingBagImpl>()) sparse = e->options.sparse();
  TORCH_CHECK(!sparse, "fully_shard: module '", path, "' (", m.name(), ") on rank ", rank, " has sparse=true, so its ",
              "parameter '", param, "' would get sparse gradients, which FSDP cannot reduce-scatter (it shards dense ",
              "rows). Fix: construct it with sparse(false) (the default), or pass '", param, "' in ignored_params and ",
              "reduce its gradient yourself");
}

}  // namespace

DeviceMeshPtr data_parallel_mesh(const DeviceMeshPtr& mesh, const DataParallelMeshDims& dims, const char* api) {
  TORCH_CHECK(mesh, api, ": dp_mesh_dims names dimensions of `mesh`, but no mesh was given. Fix: pass the full mesh");
  TORCH_CHECK(!dims.shard().empty() || !dims.replicate().empty(), api,
              ": at least one of shard or replicate must be set in DataParallelMeshDims");
  std::vector<std::string> names = dims.replicate();
  names.insert(names.end(), dims.shard().begin(), dims.shard().end());
  int64_t last = -1;
  for (const auto& n : names) {
    const int64_t d = mesh->dim_index(n);  // throws for an unknown name, listing the mesh's names
    TORCH_CHECK(d > last, api, ": dp_mesh_dims names '", n, "' out of order or twice in ", mesh->str(),
                "; list the replicate dimensions, then the shard ones, each in the mesh's order");
    last = d;
  }
  if (dims.replicate().size() <= 1 && dims.shard().size() <= 1) {
    return names.size() == 1 ? (*mesh)[names[0]] : mesh->slice(names);
  }
  TORCH_CHECK(names.size() == static_cast<size_t>(mesh->ndim()), api, ": dp_mesh_dims flattens several dimensions of ",
              mesh->str(), " into one, which needs every dimension of the mesh to be data-parallel (a flattened mesh ",
              "is a new root: parameters tensor-parallel on the other dimensions would lose them). Fix: name one ",
              "dimension per field, or build the mesh with one data-parallel dimension");
  // Flattened: a mesh over the ranks the named dimensions span (row-major in the mesh's order, so their
  // group's rank order), one dimension per field; built once per (mesh, names).
  static std::mutex mu;
  static std::vector<std::tuple<std::weak_ptr<const DeviceMesh>, std::vector<std::string>, DeviceMeshPtr>> cache;
  const std::vector<std::string> key = [&] {
    auto k = dims.replicate();
    k.push_back("|");
    k.insert(k.end(), dims.shard().begin(), dims.shard().end());
    return k;
  }();
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = cache.begin(); it != cache.end();) {
      auto m = std::get<0>(*it).lock();
      if (!m) {
        it = cache.erase(it);
        continue;
      }
      if (m.get() == mesh.get() && std::get<1>(*it) == key) return std::get<2>(*it);
      ++it;
    }
  }
  auto span = mesh->slice(names);
  std::vector<int64_t> shape;
  std::vector<std::string> flat_names;
  for (const auto* field : {&dims.replicate(), &dims.shard()}) {
    if (field->empty()) continue;
    int64_t size = 1;
    std::string joined;
    for (const auto& n : *field) {
      size *= mesh->size(mesh->dim_index(n));
      joined += (joined.empty() ? "" : "_") + n;
    }
    shape.push_back(size);
    flat_names.push_back(joined);
  }
  // Built outside the lock: the constructor rendezvouses with the other ranks (threads of this process in tests).
  auto flat = std::make_shared<DeviceMesh>(span->world(), shape, flat_names);
  std::lock_guard<std::mutex> lock(mu);
  cache.emplace_back(mesh, key, flat);
  return flat;
}

DeviceMeshPtr fully_shard_mesh(const FullyShardOptions& options) {
  if (options.dp_mesh_dims()) {
    const auto& dims = *options.dp_mesh_dims();
    TORCH_CHECK(!dims.shard().empty() || dims.replicate().empty(), "fully_shard: dp_mesh_dims sets only replicate (",
                c10::Join(", ", options.dp_mesh_dims()->replicate()), "): that is data parallelism without ",
                "sharding. Fix: fsdp::replicate(module, fsdp::ReplicateOptions().mesh(mesh).dp_mesh_dims(...)), or ",
                "name the shard dimension");
    return data_parallel_mesh(options.mesh(), *options.dp_mesh_dims(), "fully_shard");
  }
  auto mesh = options.mesh();
  if (!mesh) {
    auto world = default_process_group();
    mesh = init_device_mesh(world->device_type(), {world->size()}, {}, world);
  }
  TORCH_CHECK(mesh->ndim() == 1 || mesh->ndim() == 2, "fully_shard: expected a 1-D or 2-D DeviceMesh, got ",
              mesh->str());
  return mesh;
}

void for_each_managed_module(
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
    const std::function<void(size_t, const std::string&, const std::string&, torch::nn::Module&)>& fn) {
  for (size_t mi = 0; mi < modules.size(); ++mi) {
    const std::string prefix = modules.size() > 1 ? std::to_string(mi) + "." : "";
    std::vector<std::string> sharded_subtrees;
    for (const auto& item : modules[mi]->named_modules("", /*include_self=*/true)) {
      const std::string& path = item.key();
      bool under = false;
      for (const auto& t : sharded_subtrees) under = under || path == t || path.rfind(t + ".", 0) == 0;
      if (under) continue;
      if (!path.empty() && state_of(*item.value())) {
        sharded_subtrees.push_back(path);  // a sharded submodule manages its own subtree
        continue;
      }
      fn(mi, prefix, path, *item.value());
    }
  }
}

ManagedParams get_managed_params(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                                 const FullyShardOptions& options, int rank) {
  // Parameters owned by other states (param -> (state, its FSDPParam)).
  const auto managed = managed_params(/*forget_destroyed=*/true);
  // Paths of the modules under the ones being sharded: errors name modules by path and type.
  std::unordered_map<const torch::nn::Module*, std::string> paths;
  for (size_t mi = 0; mi < modules.size(); ++mi) {
    const std::string prefix = modules.size() > 1 ? std::to_string(mi) + "." : "";
    for (const auto& item : modules[mi]->named_modules("", /*include_self=*/true)) {
      paths.emplace(item.value().get(), item.key().empty() && modules.size() == 1 ? "" : prefix + item.key());
    }
  }
  // "'emb.weight' of 'emb' (torch::nn::EmbeddingImpl)": the tied parameter in the other group.
  auto describe_managed = [&](const std::shared_ptr<FSDPState>& other, const FSDPParam& op) {
    std::ostringstream os;
    auto m = other->modules[op.module_index].lock();
    auto it = m ? paths.find(m.get()) : paths.end();
    if (it != paths.end()) {
      os << "'" << (it->second.empty() ? op.name_in_module : it->second + "." + op.name_in_module) << "' of '"
         << it->second << "' (" << (m ? m->name() : other->module_type) << "), sharded by an earlier fully_shard call";
    } else {
      os << "'" << op.name_in_module << "' of " << (m ? m->name() : other->module_type)
         << " (outside this module), sharded by an earlier fully_shard call";
    }
    return os.str();
  };
  auto describe_self = [&](size_t mi) {
    std::string what = modules.size() > 1 ? "module " + std::to_string(mi) + " of the fully_shard call (" : "the module passed to fully_shard (";
    return what + modules[mi]->name() + ")";
  };
  std::unordered_set<const c10::TensorImpl*> ignored;
  for (const auto& t : options.ignored_params()) ignored.insert(t.unsafeGetTensorImpl());

  ManagedParams out;
  std::unordered_set<const c10::TensorImpl*> taken;
  for_each_managed_module(modules, [&](size_t mi, const std::string& prefix, const std::string& path,
                                       torch::nn::Module& module) {
    for (const auto& pp : module.named_parameters(/*recurse=*/false)) {
      const auto* impl = pp.value().unsafeGetTensorImpl();
      std::string name = prefix + (path.empty() ? pp.key() : path + "." + pp.key());
      if (ignored.count(impl) || !taken.insert(impl).second) continue;  // ignored, or tied within the group
      auto it = managed.find(impl);
      TORCH_CHECK(it == managed.end(), "fully_shard: parameter '", (path.empty() ? pp.key() : path + "." + pp.key()),
                  "' of ", describe_self(mi), " on rank ", rank, " is the same tensor as ",
                  describe_managed(it->second.first, *it->second.second),
                  ": tied parameters must be sharded in one group. Fix: fully_shard({module_a, module_b}) together, "
                  "or leave both modules to their common parent's fully_shard");
      check_dense_gradients(module, prefix + path, name, rank);
      out.params.emplace_back(name, pp.value());
      out.origin.emplace_back(mi, path.empty() ? pp.key() : path + "." + pp.key());
    }
  });
  return out;
}

void move_buffers_to_device(const std::vector<std::shared_ptr<torch::nn::Module>>& modules, torch::Device device) {
  torch::NoGradGuard no_grad;
  std::unordered_set<const c10::TensorImpl*> seen;
  for_each_managed_module(modules, [&](size_t, const std::string&, const std::string&, torch::nn::Module& m) {
    for (auto& b : m.named_buffers(/*recurse=*/false)) {
      auto& t = b.value();
      if (!t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
      if (t.device() == device || t.is_meta()) continue;
      t.set_data(t.to(device));  // the same tensor object: references the model kept stay valid
    }
  });
}

GroupDtypes verify_managed_params(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                                  const MixedPrecisionPolicy& mp, const std::string& module_name, int rank) {
  GroupDtypes dtypes;
  std::string trainable_dtype_fqn;
  for (const auto& [name, tensor] : params) {
    TORCH_CHECK(tensor.dim() > 0, "fully_shard: parameter '", name, "' of ", module_name, " on rank ", rank,
                " is a scalar (0-D): FSDP shards dim 0. Fix: give it shape [1] (e.g. `register_parameter(\"", name,
                "\", torch::zeros({1}))`) or pass it in ignored_params");
    TORCH_CHECK(tensor.is_contiguous(), "fully_shard: parameter '", name, "' of ", module_name, " on rank ",
                rank, " is not contiguous (shape ", tensor.sizes(), ", strides ", tensor.strides(),
                "): FSDP shards contiguous dim-0 rows. Fix: make it contiguous before fully_shard (p.set_data(p.contiguous()))");
    TORCH_CHECK(!tensor.is_sparse(), "fully_shard: parameter '", name, "' is sparse, which FSDP does not support");
    if (tensor.requires_grad()) {
      TORCH_CHECK(!dtypes.trainable || *dtypes.trainable == tensor.scalar_type(), "fully_shard: trainable parameters of ",
                  module_name, " have different dtypes: '", trainable_dtype_fqn, "' is ", *dtypes.trainable, " and '",
                  name, "' is ", tensor.scalar_type(), ". FSDP reduces one group in one dtype. Fix: shard them in separate "
                  "fully_shard calls or cast them to one dtype");
      dtypes.trainable = tensor.scalar_type();
      trainable_dtype_fqn = name;
    }
    // Parameters that gather in different dtypes (a frozen int64 or bf16 one beside float ones) are gathered
    // as bytes in the same one collective: see [Note: mixed-dtype all-gather] (fsdp_collectives.cpp).
  }
  return dtypes;
}

}  // namespace fsdp::detail
