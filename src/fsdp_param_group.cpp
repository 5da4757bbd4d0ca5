#include "fsdp_param_group.h"

#include <algorithm>
#include <map>
#include <utility>


namespace fsdp::detail {
namespace {

// Frees or re-allocates the bytes of `t`'s storage in place: views that autograd saved keep pointing
// at the same StorageImpl and see whatever is copied in later. See [Note: FSDP tensors]. The old
// contents are not kept (every re-allocation is followed by a copy-out), so this works the same for
// any device's allocator (CPU, or CUDA's caching allocator).
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

// Gradient accumulation's rule, used wherever gradients move between .grad, the stash and the pending
// slot: `into += from`, or `into` takes `from` when it holds nothing yet. An undefined `from` is a no-op.
void accumulate(torch::Tensor& into, torch::Tensor from) {
  if (!from.defined()) return;
  torch::NoGradGuard no_grad;
  if (into.defined()) {
    into.add_(from);
  } else {
    into = std::move(from);
  }
}

}  // namespace

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
  std::optional<torch::ScalarType> trainable_dtype, gather_dtype;
  std::string trainable_dtype_fqn, gather_dtype_fqn;
  for (auto& [name, tensor] : params) {
    TORCH_CHECK(tensor.dim() > 0, "fully_shard: parameter '", name, "' of ", module_name, " on rank ", global_rank,
                " is a scalar (0-D): FSDP shards dim 0. Fix: give it shape [1] (e.g. `register_parameter(\"", name,
                "\", torch::zeros({1}))`) or pass it in ignored_params");
    TORCH_CHECK(tensor.is_contiguous(), "fully_shard: parameter '", name, "' of ", module_name, " on rank ",
                global_rank, " is not contiguous (shape ", tensor.sizes(), ", strides ", tensor.strides(),
                "): FSDP shards contiguous dim-0 rows. Fix: make it contiguous before fully_shard (p.set_data(p.contiguous()))");
    TORCH_CHECK(!tensor.is_sparse(), "fully_shard: parameter '", name, "' is sparse, which FSDP does not support");
    if (tensor.requires_grad()) {
      TORCH_CHECK(!trainable_dtype || *trainable_dtype == tensor.scalar_type(), "fully_shard: trainable parameters of ",
                  module_name, " have different dtypes: '", trainable_dtype_fqn, "' is ", *trainable_dtype, " and '",
                  name, "' is ", tensor.scalar_type(), ". FSDP reduces one group in one dtype. Fix: shard them in separate "
                  "fully_shard calls or cast them to one dtype");
      trainable_dtype = tensor.scalar_type();
      trainable_dtype_fqn = name;
    }
    // One flat all-gather per group: every parameter must gather in the same dtype.
    auto gdtype = (opts_.mp.param_dtype() && at::isFloatingType(tensor.scalar_type())) ? *opts_.mp.param_dtype()
                                                                                       : tensor.scalar_type();
    TORCH_CHECK(!gather_dtype || *gather_dtype == gdtype, "fully_shard: parameters '", gather_dtype_fqn, "' (",
                *gather_dtype, ") and '", name, "' (", gdtype, ") of ", module_name, " would be all-gathered in different ",
                "dtypes, but a group is gathered as one flat buffer. Fix: shard them in separate fully_shard calls, cast "
                "them to one dtype, or pass one of them in ignored_params");
    gather_dtype = gdtype;
    gather_dtype_fqn = name;
  }
  for (auto& [name, tensor] : params) {
    FSDPParam p;
    p.fqn = name;
    p.local_fqn = name;
    p.name_in_module = name;
    p.param = tensor;
    p.orig_size = tensor.sizes().vec();
    p.orig_dtype = tensor.scalar_type();
    p.param_dtype = *gather_dtype;
    for (size_t d = 1; d < p.orig_size.size(); ++d) p.row_numel *= p.orig_size[d];
    p.padded_rows = (p.orig_size[0] + ws - 1) / ws;
    auto range = chunk_range(p.orig_size[0], ws, rank);
    p.local_rows = range.length;
    p.local_offset = range.offset;
    auto padded_shape = p.orig_size;
    padded_shape[0] = p.padded_rows;
    auto shard_opts = tensor.options().device(opts_.offload ? torch::Device(torch::kCPU) : mesh->device());
    p.padded_shard = torch::zeros(padded_shape, shard_opts);
    if (opts_.offload && opts_.pin_memory && torch::cuda::is_available()) p.padded_shard = p.padded_shard.pin_memory();
    if (p.local_rows > 0) p.padded_shard.narrow(0, 0, p.local_rows).copy_(tensor.narrow(0, range.offset, range.length));
    p.sharded_data = p.padded_shard.narrow(0, 0, p.local_rows);
    tensor.set_data(p.sharded_data);
    params_.push_back(std::move(p));
  }
  if (replicate_pg_ && replicate_pg_->size() > 1) broadcast_over_replicate();
  auto base = trainable_dtype.value_or(params_.empty() ? torch::kFloat32 : params_[0].orig_dtype);
  auto compute = (opts_.mp.param_dtype() && at::isFloatingType(base)) ? *opts_.mp.param_dtype() : base;
  reduce_dtype_ = opts_.mp.reduce_dtype().value_or(compute);
  comm_ = comm_context_for(opts_.mesh.get(), mesh->device());
}

void FSDPParamGroup::check_params_hold_fsdp_data() const {
  const bool unsharded = state_ == ShardedState::UNSHARDED;
  for (const auto& p : params_) {
    const auto& d = p.param;
    // set_data() swaps the TensorImpl's storage: the data is ours while it views our shard (or, when
    // unsharded, our unsharded tensor).
    const auto& want = unsharded ? p.unsharded_data : p.sharded_data;
    const auto& base = unsharded ? p.unsharded_padded : p.padded_shard;
    const bool ours = d.scalar_type() == want.scalar_type() && d.device() == want.device() &&
                      d.sizes() == want.sizes() && d.is_alias_of(base);
    TORCH_CHECK(ours, "fully_shard: parameter '", p.fqn, "' of ", module_name_, " on rank ", opts_.mesh->get_rank(),
                " no longer holds FSDP's data: it is now ", d.scalar_type(), " ", d.sizes(), " on ", d.device(),
                " but FSDP holds it as ", want.scalar_type(), " ", want.sizes(), " on ", want.device(),
                (unsharded ? " (unsharded)" : " (this rank's shard)"), " and gathers from its shard, so the change would "
                "be silently undone. It was replaced after fully_shard (e.g. by module->to(dtype or device), or "
                "param.set_data()). Fix: convert the module before fully_shard; to compute in another dtype use "
                "FullyShardOptions().mp_policy(param_dtype); to change the values, copy_ into the parameter under "
                "torch::NoGradGuard");
  }
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
  if (!pending_ag_) check_params_hold_fsdp_data();  // before any collective: every rank refuses alike
  if (state_ == ShardedState::UNSHARDED || pending_ag_) return;  // already unsharded or in flight
  const bool post_forward = state_ == ShardedState::SHARDED_POST_FORWARD;
  ProcessGroup& pg = post_forward ? *post_forward_pg_ : *shard_pg_;
  const int world = pg.size();
  int64_t n = 0;
  for (const auto& p : params_) n += post_forward ? p.post_forward_shard.numel() : p.padded_numel();
  auto dtype = params_.empty() ? torch::kFloat32 : params_[0].param_dtype;
  torch::Tensor output, input;
  {
    // CUDA: copy-in on its own stream, after the compute queued so far (see fsdp_streams.h).
    StreamScope copy_in(comm_.get(), CommStream::kAllGatherCopyIn);
    output = torch::empty({world * n}, torch::TensorOptions().dtype(dtype).device(opts_.mesh->device()));
    // All-gather input: this rank's slice of the output (in-place all-gather); copy_ casts to param_dtype.
    input = output.narrow(0, pg.rank() * n, n);
    int64_t off = 0;
    torch::NoGradGuard no_grad;
    for (const auto& p : params_) {
      const auto& src = post_forward ? p.post_forward_shard : p.padded_shard;
      input.narrow(0, off, src.numel()).copy_(src.reshape({-1}), /*non_blocking=*/opts_.offload);
      off += src.numel();
    }
  }
  comm_->wait(CommStream::kAllGather, CommStream::kAllGatherCopyIn);
  {
    StreamScope all_gather(comm_.get(), CommStream::kAllGather, /*wait_previous=*/false);
    Work work = all_gather_into_tensor(output, input, pg, /*async_op=*/true);
    pending_ag_ = PendingAllGather{output, std::move(work), world};
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
  alloc_unsharded();
  torch::NoGradGuard no_grad;
  // Copy-out: the output viewed as [world, N] holds, per rank, every parameter's piece in group order.
  auto out2d = ag.output.view({ag.world, -1});
  int64_t off = 0;
  for (auto& p : params_) {
    int64_t per_rank = p.unsharded_padded.numel() / ag.world;
    p.unsharded_padded.view({ag.world, per_rank}).copy_(out2d.narrow(1, off, per_rank));
    off += per_rank;
    p.post_forward_shard = torch::Tensor();
  }
  post_forward_pg_.reset();
  comm_->retire_all_gather_output(std::move(ag.output));  // freed after its copy-out (limiter)
  to_unsharded_data();
  state_ = ShardedState::UNSHARDED;
}

void FSDPParamGroup::reshard() {
  if (pending_ag_) wait_for_unshard();  // a prefetch nobody used: complete the collective first
  if (state_ == ShardedState::SHARDED) return;  // already sharded
  if (state_ == ShardedState::UNSHARDED) to_sharded_data();
  free_unsharded();
  for (auto& p : params_) p.post_forward_shard = torch::Tensor();
  post_forward_pg_.reset();
  state_ = ShardedState::SHARDED;
}

void FSDPParamGroup::reshard_post_forward(const ProcessGroupPtr& post_forward_group) {
  if (pending_ag_) wait_for_unshard();
  if (state_ != ShardedState::UNSHARDED) return;  // nothing unsharded to keep a slice of
  const int k = post_forward_group->size();
  const int j = post_forward_group->rank();
  torch::NoGradGuard no_grad;
  for (auto& p : params_) {
    int64_t rows = p.unsharded_padded.size(0) / k;
    p.post_forward_shard = p.unsharded_padded.narrow(0, j * rows, rows).clone();
  }
  to_sharded_data();
  free_unsharded();
  post_forward_pg_ = post_forward_group;
  state_ = ShardedState::SHARDED_POST_FORWARD;
}

void FSDPParamGroup::alloc_unsharded() {
  const int ws = shard_pg_->size();
  for (auto& p : params_) {
    if (!p.unsharded_padded.defined()) {
      auto shape = p.orig_size;
      shape[0] = ws * p.padded_rows;
      p.unsharded_padded =
          torch::empty(shape, torch::TensorOptions().dtype(p.param_dtype).device(opts_.mesh->device()));
      p.unsharded_data = p.unsharded_padded.narrow(0, 0, p.orig_size[0]);
    } else {
      resize_storage(p.unsharded_padded, p.unsharded_padded.numel() * p.unsharded_padded.element_size());
    }
  }
}

void FSDPParamGroup::free_unsharded() {
  for (auto& p : params_) {
    if (p.unsharded_padded.defined()) resize_storage(p.unsharded_padded, 0);
  }
}

void FSDPParamGroup::to_unsharded_data() {
  for (auto& p : params_) {
    // Move a sharded gradient aside: autograd must accumulate an unsharded gradient of the unsharded
    // shape; the stash is restored (and added to) when the data is sharded again.
    // (During a backward .grad holds only this backward's unsharded gradient: it stays.)
    auto& g = p.param.mutable_grad();
    if (!in_backward_) accumulate(p.stashed_grad, std::exchange(g, torch::Tensor()));
    p.param.set_data(p.unsharded_data);
  }
}

void FSDPParamGroup::to_sharded_data() {
  const int rank = opts_.mesh->get_rank();
  for (auto& p : params_) {
    auto& g = p.param.mutable_grad();
    if (in_backward_) {
      // During a backward .grad holds only this backward's unsharded gradient (begin_backward stashed
      // the sharded one). The group is resharded before every use produced its gradient (e.g. a
      // recomputation inside a checkpoint): keep it for the post-backward, which reduces it.
      accumulate(p.pending_grad, std::exchange(g, torch::Tensor()));
      p.param.set_data(p.sharded_data);
      continue;
    }
    // Outside a backward .grad is the sharded gradient; an unsharded one came from a use of the
    // parameter that FSDP did not see.
    TORCH_CHECK(!g.defined() || g.sizes() == p.sharded_data.sizes(), "fully_shard: parameter '", p.fqn,
                "' on rank ", rank, " has a gradient of the unsharded shape ", g.sizes(), " outside a backward (its local ",
                "shard is ", p.sharded_data.sizes(), "): a backward ran through a use of the parameter that ",
                "FSDP did not see (a forward that bypassed FSDP) or .grad was set by hand. Fix: call the module ",
                "through its fsdp::FSDPModule holder (module(x)) or fsdp::fsdp_forward, and leave .grad to FSDP");
    p.param.set_data(p.sharded_data);
    accumulate(g, std::exchange(p.stashed_grad, torch::Tensor()));
  }
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
  if (state_ == ShardedState::UNSHARDED) return;  // the stash goes back at the next reshard
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
    in_backward_ = false;
    // Local reshard (no collective: other ranks may be elsewhere). An all-gather in flight keeps the
    // data as it is; the next root forward waits for it and reshards.
    if (!pending_ag_ && state_ == ShardedState::UNSHARDED) {
      to_sharded_data();  // also puts the stashed sharded gradients back
      free_unsharded();
      state_ = ShardedState::SHARDED;
    } else if (state_ != ShardedState::UNSHARDED) {
      end_backward();
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
  if (in_backward_ || state_ == ShardedState::UNSHARDED) return p.stashed_grad;
  return p.param.grad();
}

void FSDPParamGroup::post_backward(bool sync, bool reshard_after, double divide_factor) {
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
    if (reshard_after) reshard();
    return;
  }
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
  if (reshard_after) reshard();
  if (idx.empty()) return;  // no trainable parameter in this group
  const int ws = shard_pg_->size();
  // CUDA: copy-in and reduce-scatter on the reduce-scatter stream, after the backward queued so far.
  StreamScope rs_stream(comm_.get(), CommStream::kReduceScatter);
  const int64_t np = static_cast<int64_t>(idx.size());
  // Reduce-scatter input [ws, M + P]: row r = every gradient's chunk r (zero-padded), in group order,
  // then the P presence flags.
  auto input = torch::zeros({ws, m + np},
                            torch::TensorOptions().dtype(reduce_dtype_).device(opts_.mesh->device()));
  int64_t off = 0;
  for (size_t k = 0; k < idx.size(); ++k) {
    const auto& p = params_[idx[k]];
    const auto& g = grads[idx[k]];
    if (g.defined()) {
      input.narrow(1, m + static_cast<int64_t>(k), 1).fill_(1);
      for (int r = 0; r < ws; ++r) {
        auto range = chunk_range(p.orig_size[0], ws, r);
        if (range.length == 0) continue;
        input[r].narrow(0, off, range.length * p.row_numel).copy_(g.narrow(0, range.offset, range.length).reshape({-1}));
      }
    }
    off += p.padded_numel();
    if (g.defined()) comm_->record_stream(g, CommStream::kReduceScatter);  // read there; freed by the compute stream
  }
  auto flat_in = input.view({-1});
  auto output = torch::empty({m + np}, input.options());
  Work work = reduce_scatter_tensor(output, flat_in, *shard_pg_, ReduceOp::SUM, /*async_op=*/true);
  // The input is not kept: the backend's work holds it until the collective completes (Gloo's work owns
  // its tensors, NCCL stashes them with its stream), and at world size 1 the copy is already queued on the
  // reduce-scatter stream, where the memory is allocated and reused in order. Dropping it here frees each
  // group's input during the backward instead of at its end (as FSDP2 does), lowering the peak.
  pending_rs_ = PendingReduceScatter{torch::Tensor(), output, std::move(work), std::move(idx), m, std::move(missing)};
}

void FSDPParamGroup::finish_reduce(double divide_factor) {
  if (!pending_rs_) return;  // nothing in flight
  auto rs = std::move(*pending_rs_);
  pending_rs_.reset();
  torch::NoGradGuard no_grad;
  {
    StreamScope rs_stream(comm_.get(), CommStream::kReduceScatter, /*wait_previous=*/false);
    rs.work.wait();
    if (replicate_pg_) all_reduce(rs.output, *replicate_pg_, ReduceOp::SUM);
    if (divide_factor != 1.0) rs.output.div_(divide_factor);
  }
  // CUDA: the gradients are taken on the compute stream, after the reduction; the output was allocated
  // on the reduce-scatter stream and is read here.
  comm_->current_wait(comm_->record(CommStream::kReduceScatter));
  comm_->record_stream_current(rs.output);
  comm_->release_all_gather_output();
  // Presence counts (divided too, still > 0 exactly where some rank had a gradient). Read (a host
  // sync) only when this rank lacked a gradient: otherwise every count is at least 1.
  torch::Tensor present;
  if (std::find(rs.missing.begin(), rs.missing.end(), 1) != rs.missing.end()) {
    present = rs.output.narrow(0, rs.data_numel, static_cast<int64_t>(rs.param_indices.size())).to(torch::kCPU);
  }
  int64_t off = 0;
  for (size_t k = 0; k < rs.param_indices.size(); ++k) {
    size_t i = rs.param_indices[k];
    auto& p = params_[i];
    if (rs.missing[k] && present[static_cast<int64_t>(k)].item<double>() <= 0) {
      off += p.padded_numel();
      continue;  // no rank had a gradient for it: it keeps none
    }
    auto shape = p.orig_size;
    shape[0] = p.padded_rows;
    auto shard = rs.output.narrow(0, off, p.padded_numel()).view(shape).narrow(0, 0, p.local_rows);
    off += p.padded_numel();
    // An independent tensor, not a view of the reduce-scatter buffer: optimizers detach_() and zero_()
    // gradients in place, which views do not allow.
    shard = shard.is_view() && shard.scalar_type() == p.orig_dtype && shard.device() == p.sharded_data.device()
                ? shard.clone()
                : shard.to(p.sharded_data.device(), p.orig_dtype);
    // While the data is unsharded (reshard_after_backward=false) or a backward runs (autograd owns
    // .grad) the sharded grad waits in the stash.
    accumulate((in_backward_ || state_ == ShardedState::UNSHARDED) ? p.stashed_grad : p.param.mutable_grad(), shard);
  }
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

DTensor FSDPParamGroup::sharded_dtensor(const FSDPParam& p, const torch::Tensor& local) const {
  std::vector<Placement> placements;
  if (opts_.mesh->ndim() == 2) placements.push_back(Replicate());
  placements.push_back(Shard(0));
  return DTensor(local.defined() ? local : p.sharded_data, opts_.mesh, placements, p.orig_size);
}

int64_t FSDPParamGroup::sharded_bytes() const {
  int64_t b = 0;
  for (const auto& p : params_) b += p.padded_shard.numel() * p.padded_shard.element_size();
  return b;
}

}  // namespace fsdp::detail
