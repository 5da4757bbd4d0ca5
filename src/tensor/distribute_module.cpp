#include "fsdp/tensor/distribute_module.h"

#include <map>
#include <mutex>

#include "tensor/dtensor_autograd.h"

namespace fsdp {

namespace {

// Parameters and buffers laid out by distribute_parameter/distribute_buffer, by TensorImpl (weak
// references: a dead entry cannot be confused with a new tensor at the same address; dead entries go at
// the next registration). See [Note: distribute_module without hooks].
struct DistributedSpec {
  DeviceMeshPtr mesh;
  std::vector<Placement> placements;
  std::vector<int64_t> global_shape;
};

std::mutex& dm_registry_mutex() {
  static std::mutex mu;
  return mu;
}
struct DistributedEntry {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  DistributedSpec spec;
};
std::map<const c10::TensorImpl*, DistributedEntry>& dm_registry() {
  static std::map<const c10::TensorImpl*, DistributedEntry> r;
  return r;
}

void dm_register(const torch::Tensor& t, DistributedSpec spec) {
  std::lock_guard<std::mutex> lock(dm_registry_mutex());
  auto& r = dm_registry();
  for (auto it = r.begin(); it != r.end();) it = it->second.impl.expired() ? r.erase(it) : std::next(it);
  r.erase(t.unsafeGetTensorImpl());
  r.emplace(t.unsafeGetTensorImpl(),
            DistributedEntry{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), std::move(spec)});
}

bool dm_registered(const torch::Tensor& t) {
  std::lock_guard<std::mutex> lock(dm_registry_mutex());
  auto it = dm_registry().find(t.unsafeGetTensorImpl());
  return it != dm_registry().end() && !it->second.impl.expired();
}

std::string names_of(const torch::OrderedDict<std::string, torch::Tensor>& d) {
  std::string s;
  for (const auto& k : d.keys()) s += (s.empty() ? "" : ", ") + k;
  return s.empty() ? "none" : s;
}

void distribute_tensor_in_place(torch::Tensor& t, const DeviceMeshPtr& mesh, std::vector<Placement> placements,
                                std::optional<int64_t> src_data_rank) {
  const auto global = t.sizes().vec();
  auto dt = distribute_tensor(t.detach(), mesh, placements, src_data_rank);
  {
    torch::NoGradGuard no_grad;
    t.set_data(dt.to_local().detach());
  }
  dm_register(t, DistributedSpec{mesh, std::move(placements), global});
}

}  // namespace

void distribute_parameter(torch::nn::Module& module, const std::string& name, const DeviceMeshPtr& mesh,
                          std::vector<Placement> placements, std::optional<int64_t> src_data_rank) {
  auto params = module.named_parameters(/*recurse=*/false);
  auto* p = params.find(name);
  TORCH_CHECK(p, "distribute_parameter: ", module.name(), " has no parameter \"", name, "\" of its own (it has: ",
              names_of(params), "). Fix: call it on the submodule that owns the parameter (partition_fn gets each one)");
  distribute_tensor_in_place(*p, mesh, std::move(placements), src_data_rank);
}

void distribute_buffer(torch::nn::Module& module, const std::string& name, const DeviceMeshPtr& mesh,
                       std::vector<Placement> placements, std::optional<int64_t> src_data_rank) {
  auto buffers = module.named_buffers(/*recurse=*/false);
  auto* b = buffers.find(name);
  TORCH_CHECK(b, "distribute_buffer: ", module.name(), " has no buffer \"", name, "\" of its own (it has: ", names_of(buffers),
              ")");
  distribute_tensor_in_place(*b, mesh, std::move(placements), src_data_rank);
}

std::optional<DTensor> parameter_dtensor(const torch::Tensor& param) {
  DistributedSpec spec;
  {
    std::lock_guard<std::mutex> lock(dm_registry_mutex());
    auto it = dm_registry().find(param.unsafeGetTensorImpl());
    if (it == dm_registry().end() || it->second.impl.expired()) return std::nullopt;
    spec = it->second.spec;
  }
  return DTensor(param, spec.mesh, spec.placements, spec.global_shape);
}

namespace detail {

void partition_module(torch::nn::Module& root, const DeviceMeshPtr& mesh, const PartitionFn& partition_fn) {
  if (partition_fn) {
    for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
      partition_fn(item.key(), *item.value(), mesh);
    }
  }
  // Everything left is replicated: broadcast from mesh rank 0 (PyTorch's replicate_module_params_buffers),
  // in named_modules() order, the same on every rank. A tied tensor is distributed once.
  const std::vector<Placement> replicate(mesh->ndim(), Replicate());
  for (const auto& item : root.named_modules("", true)) {
    for (auto& p : item.value()->named_parameters(false)) {
      if (!dm_registered(p.value())) distribute_tensor_in_place(p.value(), mesh, replicate, 0);
    }
    for (auto& b : item.value()->named_buffers(false)) {
      if (!dm_registered(b.value())) distribute_tensor_in_place(b.value(), mesh, replicate, 0);
    }
  }
}

}  // namespace detail

std::function<std::vector<DTensor>(const std::vector<DTensor>&)> local_map(
    LocalFn fn, std::vector<OptionalPlacements> out_placements, std::optional<std::vector<OptionalPlacements>> in_placements,
    DeviceMeshPtr mesh, bool redistribute_inputs) {
  return [fn = std::move(fn), out_placements = std::move(out_placements), in_placements = std::move(in_placements), mesh,
          redistribute_inputs](const std::vector<DTensor>& inputs) {
    DeviceMeshPtr m = mesh ? mesh : (inputs.empty() ? nullptr : inputs[0].device_mesh());
    TORCH_CHECK(m, "local_map: no mesh: pass device_mesh or at least one DTensor input");
    if (in_placements) {
      TORCH_CHECK(in_placements->size() == inputs.size(), "local_map: ", inputs.size(), " inputs but ", in_placements->size(),
                  " in_placements: expected one per input (std::nullopt for an input taken as it is)");
    }
    std::vector<torch::Tensor> locals;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto& x = inputs[i];
      TORCH_CHECK(x.device_mesh() == m || x.device_mesh()->ranks() == m->ranks(), "local_map: input ", i, " is on ",
                  x.device_mesh()->str(), ", expected ", m->str());
      if (in_placements && (*in_placements)[i] && x.placements() != *(*in_placements)[i]) {
        const auto& want = *(*in_placements)[i];
        std::string have, need;
        for (const auto& p : x.placements()) have += (have.empty() ? "" : ", ") + p.str();
        for (const auto& p : want) need += (need.empty() ? "" : ", ") + p.str();
        TORCH_CHECK(redistribute_inputs, "local_map: input ", i, " has placements [", have, "] but in_placements expects [",
                    need, "]. Fix: redistribute it first or pass redistribute_inputs=true");
        locals.push_back(x.redistribute(want).to_local());
      } else {
        locals.push_back(x.to_local());
      }
    }
    auto outs = fn(locals);
    TORCH_CHECK(outs.size() == out_placements.size(), "local_map: the function returned ", outs.size(), " outputs but ",
                out_placements.size(), " out_placements were given: expected one per output");
    std::vector<DTensor> result;
    for (size_t i = 0; i < outs.size(); ++i) {
      auto ps = out_placements[i] ? *out_placements[i] : std::vector<Placement>(m->ndim(), Replicate());
      result.push_back(DTensor::from_local(outs[i], m, ps, {}, /*run_check=*/false));
    }
    return result;
  };
}

}  // namespace fsdp
