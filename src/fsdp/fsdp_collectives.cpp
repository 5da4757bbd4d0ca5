// The packing of an FSDP group's all-gather and reduce-scatter (see fsdp_collectives.h).
#include "fsdp/fsdp_collectives.h"

#include <algorithm>

namespace fsdp::detail {

// [Note: mixed-dtype all-gather]
// A group's parameters gather in one collective. When they gather in several dtypes (a frozen int64 index
// table or a frozen bf16 parameter beside float ones; trainable ones share one dtype, see
// verify_managed_params), the collective moves bytes, as FSDP2's uint8 all-gather: each rank's slice of the
// uint8 output holds every parameter's piece in its own dtype, each piece padded to a multiple of kAlign
// bytes, so that every piece (and every rank's slice) starts aligned for any element size and the copy-out
// can view it in its dtype in place: [world, N bytes] -> narrow -> view(dtype) = [world, piece elements].
// The bytes on the wire are those of the pieces (plus < kAlign per parameter); no value is converted.
namespace {
constexpr int64_t kAlign = 16;  // the largest element size (complex128)
int64_t aligned(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
bool gathers_bytes(const std::vector<FSDPParam>& params) {
  for (const auto& p : params) {
    if (p.param_dtype != params[0].param_dtype) return true;
  }
  return false;
}
}  // namespace

AllGatherResult foreach_all_gather(const std::vector<FSDPParam>& params, bool post_forward, ProcessGroup& pg,
                                   CommContext& comm, torch::Device device, bool non_blocking) {
  const int world = pg.size();
  const bool as_bytes = gathers_bytes(params);
  auto piece = [&](const FSDPParam& p) {  // this rank's piece of p: elements, and its size in the output
    const int64_t numel = post_forward ? p.post_forward_shard.numel() : p.padded_numel();
    return std::pair<int64_t, int64_t>{numel, as_bytes ? aligned(numel * c10::elementSize(p.param_dtype)) : numel};
  };
  int64_t n = 0;
  for (const auto& p : params) n += piece(p).second;
  auto dtype = as_bytes ? torch::kByte : params.empty() ? torch::kFloat32 : params[0].param_dtype;
  torch::Tensor output, input;
  {
    // CUDA: copy-in on its own stream, after the compute queued so far (see fsdp_streams.h).
    StreamScope copy_in(&comm, CommStream::kAllGatherCopyIn);
    output = comm.empty({world * n}, dtype, device);  // CPU: a pool block (see fsdp_buffer_pool.h)
    // All-gather input: this rank's slice of the output (in-place all-gather); copy_ casts to param_dtype.
    input = output.narrow(0, pg.rank() * n, n);
    int64_t off = 0;
    torch::NoGradGuard no_grad;
    for (const auto& p : params) {
      const auto& src = post_forward ? p.post_forward_shard : p.padded_shard;
      const auto [numel, size] = piece(p);
      auto dst = as_bytes ? input.narrow(0, off, numel * c10::elementSize(p.param_dtype)).view(p.param_dtype)
                          : input.narrow(0, off, numel);
      dst.copy_(src.reshape({-1}), non_blocking);
      off += size;
    }
  }
  comm.wait(CommStream::kAllGather, CommStream::kAllGatherCopyIn);
  StreamScope all_gather(&comm, CommStream::kAllGather, /*wait_previous=*/false);
  // One rank (replicate's one-rank shard dimension, or a world of 1): the copy-in is the whole output.
  Work work = world == 1 ? Work() : all_gather_into_tensor(output, input, pg, /*async_op=*/true);
  return AllGatherResult{output, std::move(work), world, as_bytes};
}

void foreach_all_gather_copy_out(const AllGatherResult& ag, std::vector<FSDPParam>& params) {
  torch::NoGradGuard no_grad;
  auto out2d = ag.output.view({ag.world, -1});
  int64_t off = 0;
  for (auto& p : params) {
    int64_t per_rank = p.unsharded_padded.numel() / ag.world;
    if (ag.as_bytes) {  // [world, bytes] viewed in the parameter's dtype, in place (aligned: see the note)
      const int64_t bytes = per_rank * static_cast<int64_t>(c10::elementSize(p.param_dtype));
      p.unsharded_padded.view({ag.world, per_rank}).copy_(out2d.narrow(1, off, bytes).view(p.param_dtype));
      off += aligned(bytes);
    } else {
      p.unsharded_padded.view({ag.world, per_rank}).copy_(out2d.narrow(1, off, per_rank));
      off += per_rank;
    }
    p.post_forward_shard = torch::Tensor();
  }
}

ReduceScatterResult foreach_reduce(const std::vector<FSDPParam>& params, std::vector<torch::Tensor> grads,
                                   std::vector<size_t> param_indices, int64_t data_numel, std::vector<char> missing,
                                   ProcessGroup& pg, CommContext& comm, torch::ScalarType reduce_dtype,
                                   torch::Device device) {
  torch::NoGradGuard no_grad;
  const int ws = pg.size();
  const int64_t m = data_numel;
  // CUDA: copy-in and reduce-scatter on the reduce-scatter stream, after the backward queued so far.
  StreamScope rs_stream(&comm, CommStream::kReduceScatter);
  const int64_t np = static_cast<int64_t>(param_indices.size());
  // Reduce-scatter input [ws, M + P]: row r = every gradient's chunk r (zero-padded), in group order,
  // then the P presence flags.
  // Uninitialised (CPU: a pool block): every element is written below, the gradients' rows by the copy,
  // the padding and absent gradients with zeros, so nothing is written twice.
  auto input = comm.empty({ws, m + np}, reduce_dtype, device);
  input.narrow(1, m, np).zero_();
  int64_t off = 0;
  for (size_t k = 0; k < param_indices.size(); ++k) {
    const auto& p = params[param_indices[k]];
    auto& g = grads[param_indices[k]];
    if (g.defined()) input.narrow(1, m + static_cast<int64_t>(k), 1).fill_(1);
    for (int r = 0; r < ws; ++r) {
      auto range = chunk_range(p.orig_size[0], ws, r);
      const int64_t filled = g.defined() ? range.length * p.row_numel : 0;
      if (filled > 0) {
        input[r].narrow(0, off, filled).copy_(g.narrow(0, range.offset, range.length).reshape({-1}));
      }
      if (filled < p.padded_numel()) input[r].narrow(0, off + filled, p.padded_numel() - filled).zero_();
    }
    off += p.padded_numel();
    if (g.defined()) comm.record_stream(g, CommStream::kReduceScatter);  // read there; freed by the compute stream
    // Copied in: released now, so that the full-size gradients and the reduce-scatter's output and backend
    // buffers are never alive together (the reduce-scatter is the backward's largest moment in
    // parameter-heavy models).
    g = torch::Tensor();
  }
  auto flat_in = input.view({-1});
  if (ws == 1) {
    // One rank (replicate's one-rank shard dimension, or a world of 1): the input is the sum.
    return ReduceScatterResult{torch::Tensor(), flat_in, Work(), std::move(param_indices), m, std::move(missing)};
  }
  auto output = comm.empty({m + np}, reduce_dtype, device);
  Work work = reduce_scatter_tensor(output, flat_in, pg, ReduceOp::SUM, /*async_op=*/true);
  // The input is not kept: the backend's work holds it until the collective completes (Gloo's work owns
  // its tensors, NCCL stashes them with its stream), and at world size 1 the copy is already queued on the
  // reduce-scatter stream, where the memory is allocated and reused in order. Dropping it here frees each
  // group's input during the backward instead of at its end (as FSDP2 does), lowering the peak.
  return ReduceScatterResult{torch::Tensor(), output, std::move(work), std::move(param_indices), m, std::move(missing)};
}

void foreach_reduce_scatter_copy_out(const ReduceScatterResult& rs, const std::vector<FSDPParam>& params,
                                     const std::function<void(size_t, torch::Tensor)>& sink) {
  torch::NoGradGuard no_grad;
  // Presence counts (divided too, still > 0 exactly where some rank had a gradient). Read (a host
  // sync) only when this rank lacked a gradient: otherwise every count is at least 1.
  torch::Tensor present;
  if (std::find(rs.missing.begin(), rs.missing.end(), 1) != rs.missing.end()) {
    present = rs.output.narrow(0, rs.data_numel, static_cast<int64_t>(rs.param_indices.size())).to(torch::kCPU);
  }
  int64_t off = 0;
  for (size_t k = 0; k < rs.param_indices.size(); ++k) {
    size_t i = rs.param_indices[k];
    const auto& p = params[i];
    if (rs.missing[k] && present[static_cast<int64_t>(k)].item<double>() <= 0) {
      off += p.padded_numel();
      continue;  // no rank had a gradient for it: it keeps none
    }
    auto shape = p.orig_size;
    shape[0] = p.padded_rows;
    auto shard = rs.output.narrow(0, off, p.padded_numel()).view(shape).narrow(0, 0, p.local_rows);
    off += p.padded_numel();
    if (shard.scalar_type() == p.orig_dtype && shard.device() == p.sharded_data.device() && shard.is_cpu()) {
      // CPU: the gradient aliases its piece of the output (no copy, no allocation), as a plain tensor on
      // the output's storage rather than a view: optimizers detach_() and zero_() gradients in place,
      // which autograd views do not allow. The pieces are disjoint; the output's pool block returns to
      // the pool once the last gradient of the group is dropped (zero_grad(set_to_none=true)) or, when
      // it is accumulated into an existing .grad, right after.
      shard = torch::empty({0}, shard.options()).set_(shard.storage(), shard.storage_offset(), shard.sizes(),
                                                       shard.strides());
    } else if (shard.scalar_type() == p.orig_dtype && shard.device() == p.sharded_data.device()) {
      // CUDA: an independent tensor (the output is recorded on the reduce-scatter stream).
      shard = shard.clone();
    } else {
      shard = shard.to(p.sharded_data.device(), p.orig_dtype);
    }
    sink(i, std::move(shard));
  }
}

}  // namespace fsdp::detail
