// FSDPParam: sharding one parameter and moving its data between the shard and the unsharded tensor.
#include "fsdp/fsdp_param.h"

#include "fsdp/fsdp_interception.h"
#include "tensor/parallel/tp_ops.h"

#include <sstream>
#include <utility>

namespace fsdp::detail {
namespace {

// Frees or re-allocates the bytes of `t`'s storage in place: views that autograd saved keep pointing
// at the same StorageImpl and see whatever is copied in later. See [Note: FSDP tensors]. The old
// contents are not kept (every re-allocation is followed by a copy-out), so this works the same for
// any device's allocator (CPU, or CUDA's caching allocator). On the CPU the storage's allocator is the
// tree's buffer pool (alloc_unsharded_param), which outlives the parameter's group.
void resize_storage(const torch::Tensor& t, size_t nbytes) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == nbytes) return;  // already the requested size
  if (nbytes == 0) {
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
  } else {
    TORCH_INTERNAL_ASSERT(impl->allocator(), "resize_storage: storage without an allocator");
    impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  }
  impl->set_nbytes(nbytes);
}

}  // namespace

void accumulate(torch::Tensor& into, torch::Tensor from) {
  if (!from.defined()) return;
  torch::NoGradGuard no_grad;
  if (into.defined()) {
    into.add_(from);
  } else {
    into = std::move(from);
  }
}

// [Note: Shard(d)]
// shard_placement_fn can shard a parameter on a dim d other than 0 (e.g. Shard(1) for a weight whose rows
// are few), with PyTorch's rule that d's size divides by the shard group size (no padding). The shard is
// the contiguous chunk r of dim d (padded_shard, the optimizer's tensor, a DTensor with Shard(d)); the
// all-gather moves the flat chunks as for dim 0, and the copy-out puts rank r's chunk at rows
// [r * n/ws, (r + 1) * n/ws) of dim d of the unsharded tensor (chunk-cat: a strided copy); the
// reduce-scatter's copy-in takes chunk r of dim d of the gradient into rank r's row of its input. The
// post-forward shard of reshard_after_forward=k is a flat slice of the unsharded tensor, re-gathered as is.
FSDPParam::FSDPParam(const std::string& name, const torch::Tensor& tensor, torch::ScalarType param_dtype_,
                     int shard_size, int shard_rank, torch::Device shard_device, bool pin_memory, int64_t shard_dim_)
    : fqn(name), local_fqn(name), name_in_module(name), param(tensor), orig_size(tensor.sizes().vec()),
      orig_dtype(tensor.scalar_type()), param_dtype(param_dtype_), shard_dim(shard_dim_) {
  torch::NoGradGuard no_grad;
  const int64_t d = shard_dim;
  for (size_t i = 0; i < orig_size.size(); ++i) {
    if (static_cast<int64_t>(i) != d) row_numel *= orig_size[i];
  }
  padded_rows = (orig_size[d] + shard_size - 1) / shard_size;
  auto range = chunk_range(orig_size[d], shard_size, shard_rank);
  local_rows = range.length;
  local_offset = range.offset;
  auto padded_shape = orig_size;
  padded_shape[d] = padded_rows;
  padded_shard = torch::zeros(padded_shape, tensor.options().device(shard_device));
  if (pin_memory && torch::cuda::is_available()) padded_shard = padded_shard.pin_memory();
  sharded_data = padded_shard.narrow(d, 0, local_rows);
  if (const auto* tp = tp::detail::find_tp_param(param)) {
    tp_mesh = tp->mesh;
    tp_placement = tp->placement;
    tp_global_shape = tp->global_shape;
  }
  if (tensor.is_meta()) {
    // Built by deferred_init: the shard is filled by materialize_module. set_data refuses to turn a meta
    // tensor into a CPU one, so the parameter takes the shard's metadata directly (what set_data does
    // after its check); it stays the same object for the module, optimizers and state dicts.
    sharded_intercepted = intercepted(sharded_data);
    param.unsafeGetTensorImpl()->shallow_copy_from(sharded_intercepted.getIntrusivePtr());
    return;
  }
  if (local_rows > 0) padded_shard.narrow(d, 0, local_rows).copy_(tensor.narrow(d, range.offset, range.length));
  sharded_intercepted = intercepted(sharded_data);
  param.set_data(sharded_intercepted);
}

std::vector<std::pair<torch::ScalarType, int64_t>> FSDPParam::probe_extension(
    AllGatherExtension& extension, const torch::Tensor& tensor, int shard_size, torch::ScalarType param_dtype,
    const std::string& name, const std::string& module_name) {
  torch::NoGradGuard no_grad;
  auto shape = tensor.sizes().vec();
  TORCH_CHECK(!shape.empty(), "fully_shard: parameter '", name, "' of ", module_name,
              " is 0-dimensional and cannot have an all-gather extension");
  shape[0] = (shape[0] + shard_size - 1) / shard_size;
  auto inputs = extension.pre_all_gather(torch::zeros(shape, tensor.options().device(torch::kCPU)), param_dtype);
  TORCH_CHECK(!inputs.empty(), "fully_shard: the all-gather extension of parameter '", name, "' of ", module_name,
              " returned no tensor from pre_all_gather; expected at least one (e.g. the shard cast to a lower "
              "precision)");
  std::vector<std::pair<torch::ScalarType, int64_t>> layout;
  for (const auto& t : inputs) {
    TORCH_CHECK(t.defined(), "fully_shard: the all-gather extension of parameter '", name, "' of ", module_name,
                " returned an undefined tensor from pre_all_gather");
    layout.emplace_back(t.scalar_type(), t.numel());
  }
  return layout;
}

std::vector<torch::Tensor> FSDPParam::extension_inputs() const {
  auto inputs = all_gather_extension->pre_all_gather(padded_shard, param_dtype);
  bool same = inputs.size() == extension_layout.size();
  for (size_t i = 0; same && i < inputs.size(); ++i) {
    same = inputs[i].defined() && inputs[i].scalar_type() == extension_layout[i].first &&
           inputs[i].numel() == extension_layout[i].second;
  }
  if (!same) {
    std::ostringstream found, expected;
    for (const auto& t : inputs) found << (t.defined() ? c10::toString(t.scalar_type()) : "undefined") << "[" << (t.defined() ? t.numel() : 0) << "] ";
    for (const auto& [dt, n] : extension_layout) expected << c10::toString(dt) << "[" << n << "] ";
    TORCH_CHECK(false, "fully_shard: the all-gather extension of parameter '", fqn, "' returned ", found.str(),
                "from pre_all_gather, but ", expected.str(), "at fully_shard: its inputs must keep their number, ",
                "dtypes and numels (every rank's all-gather has the same layout)");
  }
  return inputs;
}

void FSDPParam::enable_interception() { intercept = true; }

void FSDPParam::disable_interception() {
  intercept = false;
  if (!keyed()) unsharded_intercepted = torch::Tensor();
}

void FSDPParam::alloc_unsharded_param(int shard_size, torch::Device device, CommContext& comm) {
  if (!unsharded_padded.defined()) {
    auto shape = orig_size;
    shape[shard_dim] = shard_size * padded_rows;
    unsharded_padded = comm.empty(shape, param_dtype, device);
    unsharded_data = unsharded_padded.narrow(shard_dim, 0, orig_size[shard_dim]);
    if (keyed()) unsharded_intercepted = intercepted(unsharded_data);
    if (intercept) register_param_storage(param, unsharded_padded, /*is_shard=*/false);
  } else {
    resize_storage(unsharded_padded, unsharded_padded.numel() * unsharded_padded.element_size());
  }
}

void FSDPParam::free_unsharded_param() {
  if (unsharded_padded.defined()) resize_storage(unsharded_padded, 0);
}

void FSDPParam::to_unsharded(bool /*in_backward*/) {
  // .grad stays: outside a backward it is the sharded gradient, which the user's zero_grad() must reach
  // even while the data is unsharded (an evaluation forward, a read); the first pre-backward moves it
  // to the stash before autograd accumulates an unsharded gradient (FSDPParamGroup::begin_backward).
  // During a backward .grad holds only this backward's unsharded gradient: it stays too.
  if (keyed() && !unsharded_intercepted.defined()) {
    // Keyed after its unsharded tensor was made (set_unshard_in_backward(false) between steps).
    unsharded_intercepted = intercepted(unsharded_data);
    if (intercept) register_param_storage(param, unsharded_padded, /*is_shard=*/false);
  }
  param.set_data(keyed() ? unsharded_intercepted : unsharded_data);
}

void FSDPParam::to_sharded(bool in_backward, int rank) {
  auto& g = param.mutable_grad();
  if (in_backward) {
    // During a backward .grad holds only this backward's unsharded gradient (begin_backward stashed
    // the sharded one). The group is resharded before every use produced its gradient (e.g. a
    // recomputation inside a checkpoint): keep it for the post-backward, which reduces it.
    accumulate(pending_grad, std::exchange(g, torch::Tensor()));
    param.set_data(sharded_intercepted);
    return;
  }
  // Outside a backward .grad is the sharded gradient; an unsharded one came from a use of the
  // parameter that FSDP did not see.
  TORCH_CHECK(!g.defined() || g.sizes() == sharded_data.sizes(), "fully_shard: parameter '", fqn,
              "' on rank ", rank, " has a gradient of the unsharded shape ", g.sizes(), " outside a backward (its local ",
              "shard is ", sharded_data.sizes(), "): a backward ran through a use of the parameter that ",
              "FSDP did not see (a forward that bypassed FSDP) or .grad was set by hand. Fix: call the module ",
              "through its fsdp::FSDPModule holder (module(x)) or fsdp::fsdp_forward, and leave .grad to FSDP");
  param.set_data(sharded_intercepted);
  accumulate(g, std::exchange(stashed_grad, torch::Tensor()));
}

void FSDPParam::to_sharded_post_forward(int k, int j) {
  torch::NoGradGuard no_grad;
  // A flat slice (rows of dim 0 for a dim-0 shard; [Note: Shard(d)] otherwise).
  const int64_t n = unsharded_padded.numel() / k;
  post_forward_shard = unsharded_padded.view({-1}).narrow(0, j * n, n).clone();
}

void FSDPParam::check_holds_fsdp_data(bool unsharded, const std::string& module_name, int rank) const {
  const auto& d = param;
  // set_data() swaps the TensorImpl's storage: the data is ours while it views our shard (or, when
  // unsharded, our unsharded tensor).
  const auto& want = unsharded ? unsharded_data : sharded_data;
  const auto& base = unsharded ? unsharded_padded : padded_shard;
  const bool ours = d.scalar_type() == want.scalar_type() && d.device() == want.device() &&
                    d.sizes() == want.sizes() && d.is_alias_of(base);
  TORCH_CHECK(ours, "fully_shard: parameter '", fqn, "' of ", module_name, " on rank ", rank,
              " no longer holds FSDP's data: it is now ", d.scalar_type(), " ", d.sizes(), " on ", d.device(),
              " but FSDP holds it as ", want.scalar_type(), " ", want.sizes(), " on ", want.device(),
              (unsharded ? " (unsharded)" : " (this rank's shard)"), " and gathers from its shard, so the change would "
              "be silently undone. It was replaced after fully_shard (module->to(dtype or device) while the group was "
              "unsharded, or param.set_data()). Fix: call module->to() between steps, when the groups are sharded "
              "(FSDP then takes the converted shards over), or before fully_shard; to compute in another dtype use "
              "FullyShardOptions().mp_policy(param_dtype); to change the values, copy_ into the parameter under "
              "torch::NoGradGuard");
}

bool FSDPParam::holds_converted_shard() const {
  const auto& d = param;
  if (d.is_alias_of(padded_shard) || (unsharded_padded.defined() && d.is_alias_of(unsharded_padded))) return false;
  return d.sizes() == sharded_data.sizes() && (d.scalar_type() != sharded_data.scalar_type() ||
                                                d.device() != sharded_data.device());
}

void FSDPParam::adopt_converted_shard(torch::ScalarType param_dtype_) {
  torch::NoGradGuard no_grad;
  auto data = param.detach();
  // Read without the interception key (a keyed converted tensor would be resolved as a parameter use).
  auto fresh = torch::zeros(padded_shard.sizes(), data.options());
  if (local_rows > 0) fresh.narrow(shard_dim, 0, local_rows).copy_(data);
  auto& g = param.mutable_grad();
  if (g.defined()) g = g.to(fresh.options());
  if (stashed_grad.defined()) stashed_grad = stashed_grad.to(fresh.options());
  padded_shard = fresh;
  sharded_data = padded_shard.narrow(shard_dim, 0, local_rows);
  sharded_intercepted = intercepted(sharded_data);
  param.set_data(sharded_intercepted);
  register_param_storage(param, padded_shard, /*is_shard=*/true);
  orig_dtype = padded_shard.scalar_type();
  param_dtype = param_dtype_;
  unsharded_padded = unsharded_data = unsharded_intercepted = post_forward_shard = torch::Tensor();
  unsharded_accum_grad = pending_grad = torch::Tensor();
}

// [Note: FSDP over TP]
// torchtitan's recipe: parallelize_module(model, mesh["tp"], plan), then fully_shard(..., mesh["dp"]).
// A TP parameter's data is then its TP-local shard, and FSDP shards that again on dim 0: rank (dp d,
// tp t) holds chunk d (over dp) of chunk t (over tp) of the global tensor. FSDP itself only sees the
// TP-local tensor (orig_size): it all-gathers over dp to the TP-local tensor, and the TP op runs on
// that. For state dicts, DCP and full_tensor the parameter is described over the root mesh with its
// dims in split order: (FSDP's replicate dim if HSDP, the other root dims (tp), FSDP's shard dim),
// placements (Replicate(), the TP placement or Replicate(), Shard(0)). DTensor nests mesh dims left to
// right, so tp splits the global tensor first and dp splits the tp chunk: exactly FSDP's layout, and
// local_offsets()/full_tensor() put the rows in the right order. PyTorch keeps the (dp, tp) order and
// marks the dp placement _StridedShard(0, split_factor=tp) instead; the two describe the same layout.
// Every parameter of a model with TP parameters on the same root gets the root-spanning description
// (replicated on tp when not TP-sharded), so a state dict has one world: the root's.
DTensor FSDPParam::to_sharded_dtensor(const DeviceMeshPtr& mesh, const torch::Tensor& local) const {
  if (!dtensor_mesh_) {
    auto root = mesh->root_mesh();
    const bool spans_root = tp_mesh || (root->ndim() > mesh->ndim() && tp::detail::has_tp_params_on(root));
    if (!spans_root) {
      dtensor_mesh_ = mesh;
      if (mesh->ndim() == 2) dtensor_placements_.push_back(Replicate());
      dtensor_placements_.push_back(Shard(shard_dim));
      dtensor_shape_ = orig_size;
    } else {
      TORCH_CHECK(!tp_mesh || tp_mesh->root_mesh() == root, "fully_shard: parameter '", fqn, "' is tensor-parallel on ",
                  tp_mesh->str(), ", which is not a dimension of FSDP's mesh's root ", root->str(),
                  ". Fix: slice both from one mesh, e.g. mesh = init_device_mesh(kCPU, {dp, tp}, {\"dp\", \"tp\"}); ",
                  "parallelize_module(model, mesh[\"tp\"], plan); fully_shard(..., mesh[\"dp\"])");
      const auto& fd = mesh->root_dims();
      std::vector<std::string> names;
      auto name_of = [&](int64_t d) { return root->dim_names()[d]; };
      TORCH_CHECK(!root->dim_names().empty(), "fully_shard: the root mesh ", root->str(), " needs dim names");
      for (size_t i = 0; i + 1 < fd.size(); ++i) {
        names.push_back(name_of(fd[i]));
        dtensor_placements_.push_back(Replicate());
      }
      for (int64_t d = 0; d < root->ndim(); ++d) {
        if (std::find(fd.begin(), fd.end(), d) != fd.end()) continue;
        names.push_back(name_of(d));
        const bool is_tp_dim = tp_mesh && tp_mesh->root_dims().size() == 1 && tp_mesh->root_dims()[0] == d;
        dtensor_placements_.push_back(is_tp_dim ? tp_placement : Replicate());
      }
      names.push_back(name_of(fd.back()));
      dtensor_placements_.push_back(Shard(shard_dim));  // (0 for a TP parameter: refused otherwise)
      dtensor_mesh_ = root->slice(names);
      dtensor_shape_ = tp_mesh ? tp_global_shape : orig_size;
    }
  }
  return DTensor(local.defined() ? local : sharded_data, dtensor_mesh_, dtensor_placements_, dtensor_shape_);
}

}  // namespace fsdp::detail
