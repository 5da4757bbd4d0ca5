// FSDPParamGroup: when a group's parameters are sharded, and the gradients of its backward.
#include "fsdp/fsdp_param_group.h"

#include <map>
#include <utility>

#include "fsdp/fsdp_init.h"
#include "tensor/parallel/tp_ops.h"

namespace fsdp::detail {

FSDPParamGroup::FSDPParamGroup(std::vector<std::pair<std::string, torch::Tensor>> params, GroupOptions options,
                               const std::string& module_name)
    : opts_(std::move(options)), module_name_(module_name) {
  const auto& mesh = opts_.mesh;
  TORCH_CHECK(mesh->ndim() == 1 || mesh->ndim() == 2, "fully_shard: expected a 1-D or 2-D DeviceMesh, got ",
              mesh->str());
  shard_pg_ = mesh->get_group(mesh->ndim() - 1);
  if (mesh->ndim() == 2) replicate_pg_ = mesh->get_group(0);
  const int ws = shard_pg_->size();
  const int rank = shard_pg_->rank();
  const int global_rank = mesh->get_rank();
  torch::NoGradGuard no_grad;

  // Validate every parameter before sharding any: a failed fully_shard leaves the module untouched.
  const auto dtypes = verify_managed_params(params, opts_.mp, module_name, global_rank);
  auto gather_dtype_of = [&](const torch::Tensor& t) {
    return (opts_.mp.param_dtype() && at::isFloatingType(t.scalar_type())) ? *opts_.mp.param_dtype() : t.scalar_type();
  };
  // Each parameter's shard dim ([Note: Shard(d)], fsdp_param.cpp), validated before sharding anything.
  std::vector<int64_t> shard_dims(params.size(), 0);
  if (opts_.placement_fn) {
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& [name, tensor] = params[i];
      auto result = opts_.placement_fn(name, tensor);
      if (result.mesh && result.mesh != mesh) {
        const bool same = result.mesh->ranks() == mesh->ranks() && result.mesh->shape() == mesh->shape() &&
                          result.mesh->device_type() == mesh->device_type();
        TORCH_CHECK(same, "fully_shard: shard_placement_fn returned the mesh ", result.mesh->str(),
                    " for parameter '", name, "' of ", module_name, ", but this fully_shard call shards over ",
                    mesh->str(), "; libfsdp shards one fully_shard call over one mesh (PyTorch's per-parameter ",
                    "ShardPlacementResult meshes are not supported). Fix: call fully_shard on the module that owns ",
                    "these parameters (e.g. the experts) with FullyShardOptions().mesh(that mesh), before this call");
      }
      const auto& placement = result.placement;
      if (!placement) continue;
      TORCH_CHECK(placement->is_shard(), "fully_shard: shard_placement_fn returned ", placement->str(),
                  " for parameter '", name, "' of ", module_name, "; expected fsdp::Shard(dim) or std::nullopt (Shard(0))");
      const int64_t ndim = tensor.dim();
      int64_t d = placement->dim < 0 ? placement->dim + ndim : placement->dim;
      TORCH_CHECK(d >= 0 && d < ndim, "fully_shard: shard_placement_fn returned Shard(", placement->dim,
                  ") for parameter '", name, "' of ", module_name, " of shape ", tensor.sizes(),
                  "; expected a dim in [", -ndim, ", ", ndim, ")");
      if (d != 0) {
        TORCH_CHECK(tensor.size(d) % ws == 0, "fully_shard: parameter '", name, "' of ", module_name, " (shape ",
                    tensor.sizes(), ") cannot be sharded on dim ", d, " over ", ws, " ranks: its size ",
                    tensor.size(d), " does not divide evenly (FSDP shards dims other than 0 only evenly, as ",
                    "PyTorch). Fix: return Shard(0) or std::nullopt for it, or a dim whose size divides by ", ws);
        TORCH_CHECK(!tp::detail::find_tp_param(tensor), "fully_shard: parameter '", name, "' of ", module_name,
                    " is tensor-parallel; shard_placement_fn's Shard(", d, ") is not supported on top of tensor ",
                    "parallelism. Fix: return std::nullopt (Shard(0)) for tensor-parallel parameters");
        TORCH_CHECK(!opts_.extension_fn || !opts_.extension_fn(name, tensor), "fully_shard: parameter '", name,
                    "' of ", module_name, " has an all-gather extension and Shard(", d, "); an extension needs ",
                    "Shard(0). Fix: return std::nullopt from one of the two functions for it");
      }
      shard_dims[i] = d;
    }
  }
  // The extensions and their layouts, probed before sharding anything too ([Note: all-gather extension]).
  std::vector<std::shared_ptr<AllGatherExtension>> extensions(params.size());
  std::vector<std::vector<std::pair<torch::ScalarType, int64_t>>> layouts(params.size());
  if (opts_.extension_fn) {
    for (size_t i = 0; i < params.size(); ++i) {
      extensions[i] = opts_.extension_fn(params[i].first, params[i].second);
      if (extensions[i]) {
        layouts[i] = FSDPParam::probe_extension(*extensions[i], params[i].second, ws,
                                                gather_dtype_of(params[i].second), params[i].first, module_name);
      }
    }
  }
  const auto shard_device = opts_.offload ? torch::Device(torch::kCPU) : mesh->device();
  for (size_t i = 0; i < params.size(); ++i) {
    auto& [name, tensor] = params[i];
    // Each parameter gathers in mp's param_dtype if it is floating, else in its own dtype (as PyTorch's
    // FSDPParam.init_dtype_attrs); a group with several such dtypes gathers bytes (fsdp_collectives.cpp).
    const auto gather_dtype = (opts_.mp.param_dtype() && at::isFloatingType(tensor.scalar_type()))
                                  ? *opts_.mp.param_dtype() : tensor.scalar_type();
    params_.emplace_back(name, tensor, gather_dtype, ws, rank, shard_device, opts_.offload && opts_.pin_memory,
                         shard_dims[i]);
    params_.back().all_gather_extension = std::move(extensions[i]);
    params_.back().extension_layout = std::move(layouts[i]);
  }
  if (replicate_pg_ && replicate_pg_->size() > 1) broadcast_over_replicate();
  auto base = dtypes.trainable.value_or(params_.empty() ? torch::kFloat32 : params_[0].orig_dtype);
  auto compute = (opts_.mp.param_dtype() && at::isFloatingType(base)) ? *opts_.mp.param_dtype() : base;
  reduce_dtype_ = opts_.mp.reduce_dtype().value_or(compute);
  comm_ = comm_context_for(opts_.mesh.get(), mesh->device());
}

// [Note: module->to() after fully_shard]
// PyTorch's FSDPModule._apply re-takes each parameter's converted local tensor as its shard after
// module.to(dtype / device). LibTorch's Module::to swaps each parameter's data for a converted copy (the
// parameter stays the same object), with no hook for FSDP, so the group takes the copies over at its next
// unshard (a forward or an explicit unshard), before its all-gather: the shards, their gradients and, unless
// mp_policy fixes it, param_dtype follow; the unsharded tensors are made again in the new dtype; the reduce
// dtype is recomputed. Every parameter of the group must have been converted alike (module->to converts all);
// a group that is unsharded at the conversion, or CPU-offloaded shards moved off the CPU, stay refused
// (check_holds_fsdp_data names the fix). Every rank must convert, as in PyTorch.
void FSDPParamGroup::adopt_converted_shards() {
  if (state_ != ShardedState::SHARDED && state_ != ShardedState::SHARDED_POST_FORWARD) return;
  bool any = false;
  for (const auto& p : params_) any = any || p.holds_converted_shard();
  if (!any) return;
  std::optional<torch::ScalarType> trainable;
  for (const auto& p : params_) {
    TORCH_CHECK(p.holds_converted_shard(), "fully_shard: ", module_name_, " on rank ", opts_.mesh->get_rank(),
                ": some parameters were converted after fully_shard (module->to(dtype or device)) but '", p.fqn,
                "' was not; convert the whole module (or none), so that the group's shards move together");
    TORCH_CHECK(!opts_.offload || p.param.device().is_cpu(), "fully_shard: parameter '", p.fqn, "' of ", module_name_,
                " has CPU-offloaded shards but was moved to ", p.param.device(), "; with CPUOffloadPolicy the shards "
                "stay on the CPU (FSDP copies them to the mesh's device at each all-gather)");
    if (p.requires_grad()) {
      TORCH_CHECK(!trainable || *trainable == p.param.scalar_type(), "fully_shard: ", module_name_,
                  ": after module->to() the trainable parameters have the dtypes ", *trainable, " and ",
                  p.param.scalar_type(), " ('", p.fqn, "'); a group's trainable parameters share one dtype");
      trainable = p.param.scalar_type();
    }
  }
  if (post_forward_pg_) post_forward_pg_.reset();
  unsharded_kept_ = false;  // (adopt_converted_shard drops the unsharded tensors)
  for (auto& p : params_) {
    const auto dt = p.param.scalar_type();
    p.adopt_converted_shard((opts_.mp.param_dtype() && at::isFloatingType(dt)) ? *opts_.mp.param_dtype() : dt);
  }
  state_ = ShardedState::SHARDED;
  comm_->wait_current(CommStream::kAllGatherCopyIn);  // the new shards were copied on the compute stream
  auto base = trainable.value_or(params_.empty() ? torch::kFloat32 : params_[0].orig_dtype);
  auto compute = (opts_.mp.param_dtype() && at::isFloatingType(base)) ? *opts_.mp.param_dtype() : base;
  reduce_dtype_ = opts_.mp.reduce_dtype().value_or(compute);
  partial_reduce_output_ = torch::Tensor();
}

void FSDPParamGroup::check_params_hold_fsdp_data() const {
  const bool unsharded = state_ == ShardedState::UNSHARDED || state_ == ShardedState::UNSHARDED_WITHOUT_DATA;
  for (const auto& p : params_) p.check_holds_fsdp_data(unsharded, module_name_, opts_.mesh->get_rank());
}

void FSDPParamGroup::broadcast_over_replicate() {
  // HSDP keeps replicas equal only by all-reducing identical updates: replicas that start from
  // different weights (ranks seeded differently) would stay different for good. So every replica
  // takes the shards of replicate rank 0: one broadcast of the group's padded shards per dtype.
  std::map<torch::ScalarType, std::vector<FSDPParam*>> by_dtype;
  for (auto& p : params_) {
    if (p.padded_shard.numel() > 0) by_dtype[p.padded_shard.scalar_type()].push_back(&p);
  }
  torch::NoGradGuard no_grad;
  for (auto& [dtype, ps] : by_dtype) {
    std::vector<torch::Tensor> flat;
    for (auto* p : ps) flat.push_back(p->padded_shard.reshape({-1}).to(opts_.mesh->device()));
    auto buf = torch::cat(flat);
    broadcast(buf, 0, *replicate_pg_);
    int64_t off = 0;
    for (auto* p : ps) {
      p->padded_shard.copy_(buf.narrow(0, off, p->padded_shard.numel()).view(p->padded_shard.sizes()));
      off += p->padded_shard.numel();
    }
  }
}

void FSDPParamGroup::unshard(bool async_op) {
  // Before any collective, so that every rank refuses alike: see [Note: collective order].
  if (!pending_ag_) {
    adopt_converted_shards();  // [Note: module->to() after fully_shard]
    check_params_hold_fsdp_data();
  }
  if (state_ == ShardedState::UNSHARDED || pending_ag_) return;  // already unsharded or in flight
  if (std::exchange(unsharded_kept_, false)) {
    if (kept_unsharded_data_is_current()) {  // [Note: kept unsharded data]
      to_unsharded_data();
      state_ = ShardedState::UNSHARDED;
      return;
    }
    free_unsharded();
  }
  // SHARDED_POST_FORWARD gathers over the post-forward group: see [Note: reshard_after_forward=k].
  const bool post_forward = state_ == ShardedState::SHARDED_POST_FORWARD;
  ProcessGroup& pg = post_forward ? *post_forward_pg_ : *shard_pg_;
  try {
    pending_ag_ = foreach_all_gather(params_, post_forward, pg, *comm_, opts_.mesh->device(),
                                     /*non_blocking=*/opts_.offload, all_gather_comm(), [this] { alloc_unsharded(); });
  } catch (...) {
    // [Note: placed all-gather] allocates the unsharded parameters before issuing: a failed issue (a copy-in
    // error, a refused collective) must not leave them allocated on a group that stays sharded.
    free_unsharded();
    throw;
  }
  if (!async_op) wait_for_unshard();
}

void FSDPParamGroup::wait_for_unshard() {
  if (!pending_ag_) return;  // nothing in flight
  {
    StreamScope all_gather(comm_.get(), CommStream::kAllGather, /*wait_previous=*/false);
    pending_ag_->work.wait();  // NCCL: the all-gather stream waits; the host does not
  }
  comm_->current_wait(comm_->record(CommStream::kAllGather));
  auto ag = std::move(*pending_ag_);
  pending_ag_.reset();
  if (!ag.placed) alloc_unsharded();  // [Note: placed all-gather]: allocated before the all-gather
  foreach_all_gather_copy_out(ag, params_);
  post_forward_pg_.reset();
  comm_->retire_all_gather_output(std::move(ag.output));  // freed after its copy-out (limiter)
  to_unsharded_data();
  state_ = ShardedState::UNSHARDED;
}

void FSDPParamGroup::reshard() {
  if (pending_ag_) wait_for_unshard();  // a prefetch nobody used: complete the collective first
  if (state_ == ShardedState::SHARDED) {  // already sharded
    if (std::exchange(unsharded_kept_, false)) free_unsharded();
    return;
  }
  if (state_ == ShardedState::UNSHARDED || state_ == ShardedState::UNSHARDED_WITHOUT_DATA) to_sharded_data();
  free_unsharded();
  for (auto& p : params_) p.post_forward_shard = torch::Tensor();
  post_forward_pg_.reset();
  state_ = ShardedState::SHARDED;
}

void FSDPParamGroup::expose_unsharded_shape() {
  // [Note: set_unshard_in_backward(false)] The group is not gathered in backward, but autograd accumulates
  // full-shape gradients into the parameters (AccumulateGrad copies into the variable's shape and strides
  // when it cannot steal the gradient, and a Shard(d) shard has other strides), so the parameters take
  // their unsharded tensors, whose storage is freed: shape without data. A backward formula that does read
  // a parameter reaches the interception (the data carry the key) and gathers (UNSHARDED); the
  // post-backward reshards either way.
  if (pending_ag_ || (state_ != ShardedState::SHARDED && state_ != ShardedState::SHARDED_POST_FORWARD)) return;
  for (const auto& p : params_) {
    if (!p.unsharded_padded.defined()) return;  // never unsharded (no forward ran): nothing to expose
  }
  for (auto& p : params_) p.post_forward_shard = torch::Tensor();
  post_forward_pg_.reset();
  free_unsharded();
  unsharded_kept_ = false;
  to_unsharded_data();
  state_ = ShardedState::UNSHARDED_WITHOUT_DATA;
}

// [Note: reshard_after_forward=k]
// FSDP2's reshard_after_forward=int: after forward each rank keeps 1/k of the unsharded parameters
// instead of its 1/ws shard, so that the backward all-gather runs over k ranks (e.g. the GPUs of one
// node) instead of the whole shard group. FSDPState::lazy_init resolves the option: true, or k == ws,
// reshards fully (1); false, or k == 1, keeps the parameters unsharded (0); otherwise k, which must
// divide ws, with a post-forward group of k consecutive shard ranks (base .. base + k - 1, base =
// rank / k * k), as FSDP2's post-forward mesh. reshard_post_forward keeps, on position j of that group,
// the flat slice j of k of the unsharded padded tensor (for dim-0 shards rows [j * R, (j + 1) * R),
// R = ws / k * padded_rows; a Shard(d) parameter's slice is flat too), a copy: the
// post-forward shard. The data goes back to the sharded data (the optimizer's view never changes), and
// the group is SHARDED_POST_FORWARD: the next unshard gathers the post-forward shards over the k ranks
// (in rank order they are the unsharded padded tensor again), and reshard() drops them. The root's next
// pre-forward reshards every such group fully, so no slice survives an optimizer step.
void FSDPParamGroup::reshard_post_forward(const ProcessGroupPtr& post_forward_group) {
  if (pending_ag_) wait_for_unshard();
  if (state_ != ShardedState::UNSHARDED) return;  // nothing unsharded to keep a slice of
  const int k = post_forward_group->size();
  const int j = post_forward_group->rank();
  for (auto& p : params_) p.to_sharded_post_forward(k, j);
  to_sharded_data();
  free_unsharded();
  post_forward_pg_ = post_forward_group;
  state_ = ShardedState::SHARDED_POST_FORWARD;
}

void FSDPParamGroup::alloc_unsharded() {
  for (auto& p : params_) p.alloc_unsharded_param(shard_pg_->size(), opts_.mesh->device(), *comm_);
}

void FSDPParamGroup::free_unsharded() {
  for (auto& p : params_) p.free_unsharded_param();
}

void FSDPParamGroup::to_unsharded_data() {
  for (auto& p : params_) p.to_unsharded(in_backward_);
}

void FSDPParamGroup::to_sharded_data() {
  const int rank = opts_.mesh->get_rank();
  for (auto& p : params_) p.to_sharded(in_backward_, rank);
}

void FSDPParamGroup::begin_backward() {
  if (in_backward_) return;
  in_backward_ = true;
  for (auto& p : params_) {
    // The data is sharded (an unsharded group stashed its grad when it was unsharded): .grad is the
    // sharded gradient of earlier backwards. Outside the autograd's reach until end_backward.
    accumulate(p.stashed_grad, std::exchange(p.param.mutable_grad(), torch::Tensor()));
  }
}

void FSDPParamGroup::end_backward() {
  in_backward_ = false;
  // Outside a backward .grad is the sharded gradient, whatever the data (see FSDPParam::to_unsharded).
  for (auto& p : params_) accumulate(p.param.mutable_grad(), std::exchange(p.stashed_grad, torch::Tensor()));
}

void FSDPParamGroup::abort_backward() noexcept {
  try {
    if (in_backward_) {
      for (auto& p : params_) {
        p.param.mutable_grad() = torch::Tensor();  // this backward's unsharded gradient
        p.pending_grad = torch::Tensor();
      }
    }
    end_backward();  // the sharded gradients back in .grad
    // Local reshard (no collective: other ranks may be elsewhere). An all-gather in flight keeps the
    // data as it is; the next root forward waits for it and reshards.
    if (!pending_ag_ && (state_ == ShardedState::UNSHARDED || state_ == ShardedState::UNSHARDED_WITHOUT_DATA)) {
      to_sharded_data();
      free_unsharded();
      state_ = ShardedState::SHARDED;
    }
  } catch (...) {
    // cleanup after a failure must not throw; the next forward reshards again
  }
}

bool FSDPParamGroup::has_unsharded_grads() const {
  if (!in_backward_) return false;
  for (const auto& p : params_) {
    if (p.pending_grad.defined() || p.param.grad().defined()) return true;
  }
  return false;
}

torch::Tensor FSDPParamGroup::sharded_grad(const FSDPParam& p) const {
  if (in_backward_) return p.stashed_grad;
  return p.param.grad();
}

void FSDPParamGroup::post_backward(bool sync, bool reshard_after, double divide_factor) {
  // Run by FSDPState: see [Note: post-backward and the end-of-backward callback] (fsdp_state.cpp).
  // A reduce-scatter left in flight (set_is_last_backward(false)) completes before the next one.
  finish_reduce(divide_factor);
  // Take the unsharded gradients of this backward out of the parameters (begin_backward moved the
  // sharded ones aside, so whatever .grad holds now was accumulated by autograd in this backward).
  torch::NoGradGuard no_grad;
  const int rank = opts_.mesh->get_rank();
  std::vector<torch::Tensor> grads(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    auto& g = p.param.mutable_grad();
    torch::Tensor taken;
    if (in_backward_ && g.defined()) {
      taken = std::move(g);
      g = torch::Tensor();
    }
    accumulate(taken, std::exchange(p.pending_grad, torch::Tensor()));
    if (!taken.defined()) continue;
    TORCH_CHECK(!taken.is_sparse(), "fully_shard: parameter '", p.fqn, "' of ", module_name_, " on rank ", rank,
                " got a sparse gradient, which FSDP cannot reduce-scatter (it shards dense rows). Fix: compute it "
                "with a dense gradient (e.g. embedding(..., sparse=false)), or pass the parameter in ignored_params "
                "and reduce its gradient yourself");
    TORCH_CHECK(taken.sizes() == p.unsharded_data.sizes(), "fully_shard: parameter '", p.fqn, "' on rank ", rank,
                " received a gradient of shape ", taken.sizes(), " but its unsharded shape is ",
                c10::IntArrayRef(p.orig_size), ": a use of the parameter that FSDP did not see (a forward that ",
                "bypassed FSDP) computed on its local shard. Fix: call the module through its fsdp::FSDPModule ",
                "holder (module(x)) or fsdp::fsdp_forward");
    grads[i] = std::move(taken);
  }
  if (!sync) {
    // Gradient accumulation without communication: keep the unsharded grads in the reduce dtype.
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!grads[i].defined()) continue;
      auto& acc = params_[i].unsharded_accum_grad;
      if (acc.defined()) {
        acc.add_(grads[i]);
      } else {
        acc = grads[i].to(reduce_dtype_, /*non_blocking=*/false, /*copy=*/grads[i].scalar_type() == reduce_dtype_);
      }
    }
    if (reshard_after || state_ == ShardedState::UNSHARDED_WITHOUT_DATA) reshard();
    return;
  }
  // See [Note: collective order] (fsdp_state.cpp).
  // Every trainable parameter takes part in the reduce-scatter, with or without a gradient on this
  // rank: its size then depends only on the group (checked across ranks at the first forward), never
  // on which parameters a rank's data happened to use (a parameter unused on one rank, e.g. an expert
  // no token was routed to, would otherwise make the ranks' reduce-scatters differ in size, which
  // aborts the process inside Gloo). A missing gradient contributes zeros; one presence flag per
  // parameter travels with each chunk, so that a parameter no rank produced a gradient for keeps an
  // undefined gradient, as without FSDP.
  std::vector<size_t> idx;
  int64_t m = 0;
  std::vector<char> missing;  // per reduced parameter: no gradient on this rank
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    if (p.unsharded_accum_grad.defined()) {
      if (grads[i].defined()) p.unsharded_accum_grad.add_(grads[i]);
      grads[i] = std::move(p.unsharded_accum_grad);
      p.unsharded_accum_grad = torch::Tensor();
    }
    if (!p.requires_grad() && !grads[i].defined()) continue;  // frozen (the same on every rank)
    missing.push_back(grads[i].defined() ? 0 : 1);
    idx.push_back(i);
    m += p.padded_numel();
  }
  if (reshard_after || state_ == ShardedState::UNSHARDED_WITHOUT_DATA) reshard();
  if (idx.empty()) return;  // no trainable parameter in this group
  pending_rs_ = foreach_reduce(params_, std::move(grads), std::move(idx), m, std::move(missing),
                               reduce_scatter_pg_ ? *reduce_scatter_pg_ : *shard_pg_, *comm_, reduce_dtype_,
                               opts_.mesh->device(), reduce_scatter_comm(),
                               gradient_divide_factors(reduce_dtype_, divide_factor).first);
  pending_all_reduce_ = requires_all_reduce_;
}

void FSDPParamGroup::finish_reduce(double divide_factor) {
  if (!pending_rs_) return;  // nothing in flight
  auto rs = std::move(*pending_rs_);
  pending_rs_.reset();
  torch::NoGradGuard no_grad;
  {
    StreamScope rs_stream(comm_.get(), CommStream::kReduceScatter, /*wait_previous=*/false);
    rs.work.wait();
    if (replicate_pg_ && !pending_all_reduce_) {
      // HSDP microbatch without the replicate all-reduce: the sum waits for the next reduction that
      // all-reduces (divided then, once, like the gradients it is summed with).
      accumulate(partial_reduce_output_, rs.output.clone());  // (the output is a pool block, reused)
      comm_->current_wait(comm_->record(CommStream::kReduceScatter));
      comm_->release_all_gather_output();
      return;
    }
    if (partial_reduce_output_.defined()) {
      TORCH_CHECK(partial_reduce_output_.sizes() == rs.output.sizes(), "fully_shard: ", module_name_, " on rank ",
                  opts_.mesh->get_rank(), ": the reduction held back by set_requires_all_reduce(false) has ",
                  partial_reduce_output_.numel(), " elements but this one ", rs.output.numel(),
                  " (a frozen parameter got a gradient in between?); keep the trainable parameters fixed between ",
                  "microbatches");
      rs.output.add_(partial_reduce_output_);
      partial_reduce_output_ = torch::Tensor();
    }
    if (replicate_pg_) all_reduce(rs.output, *replicate_pg_, ReduceOp::SUM);
    // The rest of the division (fp16: part of it came before the sum; see gradient_divide_factors).
    const double post_factor = divide_factor / rs.predivide_factor;
    if (post_factor != 1.0) rs.output.narrow(0, 0, rs.data_numel).div_(post_factor);
    // set_all_reduce_hook: the reduced gradients, divided (PyTorch averages in the collective for fp32
    // and bf16), without the presence flags; changes made in place are what the parameters receive.
    if (all_reduce_hook) run_all_reduce_hook(rs.output.narrow(0, 0, rs.data_numel));
  }
  // CUDA: the gradients are taken on the compute stream, after the reduction; the output was allocated
  // on the reduce-scatter stream and is read here.
  comm_->current_wait(comm_->record(CommStream::kReduceScatter));
  comm_->record_stream_current(rs.output);
  comm_->release_all_gather_output();
  foreach_reduce_scatter_copy_out(rs, params_, [this](size_t i, torch::Tensor shard) {
    auto& p = params_[i];
    // While a backward runs (autograd owns .grad) the sharded grad waits in the stash.
    accumulate(in_backward_ ? p.stashed_grad : p.param.mutable_grad(), std::move(shard));
  });
}

void FSDPParamGroup::run_all_reduce_hook(const torch::Tensor& reduced) {
  // Called on the reduce-scatter stream. PyTorch's `stream` argument: the hook runs on the user's stream,
  // after the reduction, and the reduce-scatter stream (whose completion the copy-out waits for) waits for
  // the hook's work. The output stays alive past that copy-out, so the hook stream needs no record_stream.
  if (!all_reduce_hook_stream || !comm_->enabled()) {
    all_reduce_hook(reduced);
    return;
  }
  const auto device_type = reduced.device().type();
  c10::Event reduced_ready(device_type);
  reduced_ready.record(comm_->stream(CommStream::kReduceScatter));
  c10::Event hook_done(device_type);
  {
    c10::StreamGuard on_hook_stream(*all_reduce_hook_stream);
    reduced_ready.block(*all_reduce_hook_stream);
    all_reduce_hook(reduced);
    hook_done.record(*all_reduce_hook_stream);
  }
  hook_done.block(comm_->stream(CommStream::kReduceScatter));
}

void FSDPParamGroup::discard_gradients_in_flight() {
  if (pending_rs_) {
    try {
      pending_rs_->work.wait();  // the collective must complete on every rank; its result is dropped
    } catch (...) {
      // the failure that interrupted the backward is already being reported
    }
    pending_rs_.reset();
  }
  for (auto& p : params_) {
    p.pending_grad = torch::Tensor();
    auto& g = p.param.mutable_grad();
    if (g.defined() && g.sizes() != p.sharded_data.sizes()) g = torch::Tensor();  // an unsharded leftover
  }
}

void FSDPParamGroup::discard_accumulated_gradients() {
  for (auto& p : params_) p.unsharded_accum_grad = torch::Tensor();
  partial_reduce_output_ = torch::Tensor();
}

bool FSDPParamGroup::can_change_comm_context() const {
  if (state_ != ShardedState::SHARDED || pending_ag_ || pending_rs_) return false;
  for (const auto& p : params_) {
    if (p.unsharded_padded.defined()) return false;
  }
  return true;
}

void FSDPParamGroup::set_comm_context(CommContextPtr comm) {
  TORCH_CHECK(can_change_comm_context(), "share_comm_ctx: ", module_name_, " on rank ", opts_.mesh->get_rank(),
              " already ran a forward (its unsharded parameters live in its context's buffers); call share_comm_ctx ",
              "before the modules' first forward");
  TORCH_CHECK(comm->device() == comm_->device(), "share_comm_ctx: ", module_name_, " runs on ", comm_->device(),
              " but the first module on ", comm->device(), "; share contexts only between modules of one device");
  comm_ = std::move(comm);
  pg_alloc_all_gather_.reset();  // they allocate from the context they were made with
  pg_alloc_reduce_scatter_.reset();
}

namespace {
// set_allocate_memory_from_process_group_for_comm: buffers from the backend's allocator where it has one
// (c10d Backend::allocateTensor, e.g. NCCL's registered memory), else the default (pool or caching
// allocator); the collectives themselves are the default ones. PyTorch's ProcessGroupAllocAllGather /
// ProcessGroupAllocReduceScatter.
torch::Tensor pg_allocate(ProcessGroup& pg, CommContext& comm, at::IntArrayRef size, torch::ScalarType dtype,
                          torch::Device device) {
  const auto& backend = pg.backend();
  if (backend && backend->supportsTensorAlloc(device.index())) {
    return backend->allocateTensor(c10::multiply_integers(size), at::TensorOptions().dtype(dtype).device(device))
        .view(size);
  }
  return comm.empty(size, dtype, device);
}
struct ProcessGroupAllocAllGather : AllGather {
  ProcessGroupAllocAllGather(ProcessGroupPtr pg, CommContextPtr comm) : pg(std::move(pg)), comm(std::move(comm)) {}
  torch::Tensor allocate(at::IntArrayRef size, torch::ScalarType dtype, torch::Device device) override {
    return pg_allocate(*pg, *comm, size, dtype, device);
  }
  Work operator()(const torch::Tensor& output, const torch::Tensor& input, ProcessGroup& group, bool async_op) override {
    return all_gather_into_tensor(output, input, group, async_op);
  }
  ProcessGroupPtr pg;
  CommContextPtr comm;
};
struct ProcessGroupAllocReduceScatter : ReduceScatter {
  ProcessGroupAllocReduceScatter(ProcessGroupPtr pg, CommContextPtr comm) : pg(std::move(pg)), comm(std::move(comm)) {}
  torch::Tensor allocate(at::IntArrayRef size, torch::ScalarType dtype, torch::Device device) override {
    return pg_allocate(*pg, *comm, size, dtype, device);
  }
  Work operator()(const torch::Tensor& output, const torch::Tensor& input, ProcessGroup& group, ReduceOp op,
                  bool async_op) override {
    return reduce_scatter_tensor(output, input, group, op, async_op);
  }
  ProcessGroupPtr pg;
  CommContextPtr comm;
};
}  // namespace

AllGather* FSDPParamGroup::all_gather_comm() {
  if (custom_all_gather) return custom_all_gather.get();
  if (!allocate_from_process_group) return nullptr;
  if (!pg_alloc_all_gather_) pg_alloc_all_gather_ = std::make_shared<ProcessGroupAllocAllGather>(shard_pg_, comm_);
  return pg_alloc_all_gather_.get();
}

ReduceScatter* FSDPParamGroup::reduce_scatter_comm() {
  if (custom_reduce_scatter) return custom_reduce_scatter.get();
  if (!allocate_from_process_group) return nullptr;
  if (!pg_alloc_reduce_scatter_) {
    pg_alloc_reduce_scatter_ = std::make_shared<ProcessGroupAllocReduceScatter>(shard_pg_, comm_);
  }
  return pg_alloc_reduce_scatter_.get();
}

int64_t FSDPParamGroup::sharded_bytes() const {
  int64_t b = 0;
  for (const auto& p : params_) b += p.padded_shard.numel() * p.padded_shard.element_size();
  return b;
}

}  // namespace fsdp::detail
