// The packing of an FSDP group's all-gather and reduce-scatter (see fsdp_collectives.h).
#include "fsdp/fsdp_collectives.h"

#include "c10d/placed_collectives.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>

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

// [Note: small copies by memcpy]
// A group's copies (all-gather copy-in and copy-out, reduce-scatter copy-in) are per parameter and per rank;
// as tensor ops each one is a narrow, a view or reshape and a copy_, a dispatch apiece (0.3-1 us on the CPU),
// which is most of a small group's host time (bench/host_overhead.py: about 120 ops per group and step, 47 us).
// Where both sides are CPU memory, contiguous, of the same dtype (no cast), and the group's piece is small,
// the bytes move by memcpy on raw pointers instead: the same bytes, so the same results bit for bit. Larger
// pieces keep copy_, which LibTorch spreads over the intra-op threads; CUDA keeps copy_ on its streams. The
// copy-out bumps the unsharded data's version counter as copy_ does; tensors with a lazy conjugate or negative
// bit take copy_, which applies it.
constexpr int64_t kSmallCopyBytes = 256 * 1024;
// (A conjugate or negative bit is a lazy operation that copy_ applies and raw bytes would not.)
bool plain_cpu(const torch::Tensor& t) {
  return t.defined() && t.is_cpu() && t.layout() == torch::kStrided && t.is_contiguous() && t.has_storage() &&
         !t.is_conj() && !t.is_neg();
}
char* bytes_of(const torch::Tensor& t) { return static_cast<char*>(t.data_ptr()); }
}  // namespace

// [Note: placed all-gather]
// On a one-host CPU group (the shared-memory transport, issue 37 item 1) the all-gather needs no output: the
// unsharded parameters are allocated before it is issued (instead of at its wait) and the transport's worker
// copies each rank's bytes out of its slot straight into them (c10d/placed_collectives.h). That removes the
// copy-out (every gathered byte copied once instead of twice) and the [world x N] output, which the copy-out
// held beside the unsharded parameters; the input is this rank's N elements alone, and when every shard is
// already in the wire dtype (no param_dtype cast) there is no input either: the transport copies this rank's
// bytes straight from the shards into its slot ([Note: borrowed sources] in c10d/placed_collectives.h). The
// wait then only marks the unsharded data as changed (its version counter, as the copy-out's copy_ would).
// Taken when every piece is
// a plain shard of one dtype in parameter order: no extension ([Note: all-gather extension]), no mixed-dtype
// bytes, dim-0 shards (or post-forward flat slices), contiguous CPU unsharded tensors of the piece's dtype and
// world x its size, no custom AllGather, no debug-mode fingerprints; anything else takes the output and the
// copy-out as before. The bytes are the same either way, so the results are identical bit for bit.
AllGatherResult foreach_all_gather(const std::vector<FSDPParam>& params, bool post_forward, ProcessGroup& pg,
                                   CommContext& comm, torch::Device device, bool non_blocking, AllGather* custom,
                                   const std::function<void()>& alloc_unsharded) {
  const int world = pg.size();
  AllGatherResult result;
  result.world = world;
  result.post_forward = post_forward;
  result.pieces.resize(params.size());
  result.extended.assign(params.size(), 0);
  torch::Tensor output, input;
  bool from_shards = false;
  std::vector<torch::Tensor> shards;  // from_shards: each parameter's (post-forward) shard, in order
  std::vector<std::vector<torch::Tensor>> srcs(params.size());
  torch::ScalarType wire = torch::kFloat32;
  int64_t n = 0;
  {
    // CUDA: copy-in on its own stream, after the compute queued so far (see fsdp_streams.h).
    StreamScope copy_in(&comm, CommStream::kAllGatherCopyIn, /*wait_previous=*/comm.copy_in_waits_current());
    torch::NoGradGuard no_grad;
    // Each parameter's pieces: its (post-forward) shard, cast to param_dtype by the copy below, or its
    // extension's inputs ([Note: all-gather extension]; not for the post-forward gather, which moves the
    // already rebuilt values).
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      if (!post_forward && p.all_gather_extension) {
        srcs[i] = p.extension_inputs();
        result.extended[i] = 1;
        for (const auto& t : srcs[i]) result.pieces[i].emplace_back(t.scalar_type(), t.numel());
      } else {
        srcs[i] = {post_forward ? p.post_forward_shard : p.padded_shard};
        result.pieces[i].emplace_back(p.param_dtype, srcs[i][0].numel());
      }
    }
    // One dtype on the wire, or bytes: [Note: mixed-dtype all-gather].
    std::optional<torch::ScalarType> dtype;
    for (const auto& ps : result.pieces) {
      for (const auto& [dt, numel] : ps) {
        if (!dtype) dtype = dt;
        if (dt != *dtype) result.as_bytes = true;
      }
    }
    auto size = [&](torch::ScalarType dt, int64_t numel) {
      return result.as_bytes ? aligned(numel * static_cast<int64_t>(c10::elementSize(dt))) : numel;
    };
    for (const auto& ps : result.pieces) {
      for (const auto& [dt, numel] : ps) n += size(dt, numel);
    }
    wire = result.as_bytes ? torch::kByte : dtype.value_or(torch::kFloat32);
    // [Note: placed all-gather]: the unsharded parameters are the destination, allocated now.
    bool placed = alloc_unsharded && !custom && world > 1 && device.is_cpu() && !result.as_bytes &&
                  detail::can_all_gather_placed(pg);
    for (size_t i = 0; placed && i < params.size(); ++i) {
      placed = !result.extended[i] && (params[i].shard_dim == 0 || post_forward) && result.pieces[i].size() == 1;
    }
    if (placed) {
      alloc_unsharded();
      for (size_t i = 0; placed && i < params.size(); ++i) {
        const auto& dst = params[i].unsharded_padded;
        placed = plain_cpu(dst) && dst.scalar_type() == wire && dst.numel() == result.pieces[i][0].second * world;
      }
    }
    result.placed = placed;
    // Placed, with every shard already in the wire dtype (no cast), the transport reads the shards themselves:
    // no input, no copy-in ([Note: placed all-gather]).
    from_shards = placed;
    for (size_t i = 0; from_shards && i < params.size(); ++i) {
      from_shards = plain_cpu(srcs[i][0]) && srcs[i][0].scalar_type() == wire;
    }
    if (from_shards) {
      shards.reserve(params.size());
      for (auto& v : srcs) shards.push_back(std::move(v[0]));
    } else {
      // CPU: a pool block (see fsdp_buffer_pool.h), unless the user's AllGather allocates.
      if (result.placed) {
        output = comm.empty({n}, wire, device);  // this rank's input alone
      } else {
        output = custom ? custom->allocate({world * n}, wire, device) : comm.empty({world * n}, wire, device);
      }
      TORCH_CHECK(result.placed ||
                      (output.numel() == world * n && output.scalar_type() == wire && output.is_contiguous()),
                  "fully_shard: the custom AllGather's allocate({", world * n, "}, ", wire, ") returned ",
                  output.sizes(), " ", output.scalar_type(), output.is_contiguous() ? "" : " (not contiguous)",
                  "; expected a contiguous tensor of exactly that size and dtype");
      TORCH_CHECK(!result.as_bytes || reinterpret_cast<uintptr_t>(output.data_ptr()) % kAlign == 0,
                  "fully_shard: the custom AllGather's allocate returned a buffer at an address not aligned to ", kAlign,
                  " bytes; the group gathers several dtypes as bytes and views each piece in its dtype in place. Fix: ",
                  "allocate with torch::empty (or align the buffer to ", kAlign, " bytes)");
      // All-gather input: this rank's slice of the output (in-place all-gather); copy_ casts to param_dtype.
      input = result.placed ? output : output.narrow(0, pg.rank() * n, n);
      const int64_t wire_size = static_cast<int64_t>(c10::elementSize(wire));
      const bool cpu_out = plain_cpu(output);
      int64_t off = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        for (size_t j = 0; j < srcs[i].size(); ++j) {
          const auto [dt, numel] = result.pieces[i][j];
          const auto& src = srcs[i][j];
          const int64_t piece_bytes = numel * static_cast<int64_t>(c10::elementSize(dt));
          if (cpu_out && piece_bytes <= kSmallCopyBytes && src.scalar_type() == dt && plain_cpu(src)) {
            // [Note: small copies by memcpy] (an empty piece has nothing to copy, and maybe no pointer)
            if (piece_bytes > 0) {
              std::memcpy(bytes_of(input) + off * wire_size, bytes_of(src), static_cast<size_t>(piece_bytes));
            }
          } else {
            auto dst = result.as_bytes ? input.narrow(0, off, piece_bytes).view(dt) : input.narrow(0, off, numel);
            dst.copy_(src.reshape({-1}), non_blocking);
          }
          off += size(dt, numel);
        }
      }
    }
  }
  comm.wait(CommStream::kAllGather, CommStream::kAllGatherCopyIn);
  StreamScope all_gather(&comm, CommStream::kAllGather, /*wait_previous=*/false);
  // One rank (replicate's one-rank shard dimension, or a world of 1): the copy-in is the whole output.
  if (result.placed) {
    // Each parameter's piece: its byte range in a rank's input, and where rank r's copy of it goes (rows r
    // of the unsharded tensor, a dim-0 shard or a flat slice). Pieces are in parameter order.
    struct Dest {
      uint64_t begin, bytes;
      char* base;
      torch::Tensor keep;  // its storage outlives the work even if the group is destroyed first
    };
    std::vector<Dest> dests;
    dests.reserve(params.size());
    const uint64_t wire_size = c10::elementSize(wire);
    uint64_t begin = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      const uint64_t bytes = static_cast<uint64_t>(result.pieces[i][0].second) * wire_size;
      dests.push_back({begin, bytes, bytes_of(params[i].unsharded_padded), params[i].unsharded_padded});
      begin += bytes;
    }
    PieceList pieces;  // from_shards: this rank's bytes, shard by shard
    for (size_t i = 0; i < shards.size(); ++i) pieces.emplace_back(bytes_of(shards[i]), dests[i].bytes);
    auto place = [dests = std::move(dests)](int r, uint64_t off, uint64_t len, const char* src) {
      const uint64_t end = off + len;
      // First piece that ends after `off` (the pieces are sorted and contiguous).
      auto it = std::upper_bound(dests.begin(), dests.end(), off,
                                 [](uint64_t o, const Dest& d) { return o < d.begin + d.bytes; });
      for (; it != dests.end() && it->begin < end; ++it) {
        const uint64_t lo = std::max(off, it->begin), hi = std::min(end, it->begin + it->bytes);
        if (hi > lo) {
          std::memcpy(it->base + static_cast<uint64_t>(r) * it->bytes + (lo - it->begin), src + (lo - off), hi - lo);
        }
      }
    };
    if (from_shards) {
      // This rank's bytes, piece by piece from its shards, read while the all-gather runs ([Note: borrowed
      // sources]: FSDP changes no shard while its all-gather is in flight, the optimizer steps after the waits).
      auto source = [pieces = std::move(pieces)](int, uint64_t off, uint64_t len, const ShmTransport::Piece& piece) {
        visit_pieces(pieces, off, len, piece);
      };
      result.work = detail::all_gather_placed(n, wire, std::move(source), std::move(shards), std::move(place), pg,
                                              /*async_op=*/true);
      return result;
    }
    result.work = detail::all_gather_placed(input, std::move(place), pg, /*async_op=*/true);
    // Kept until the wait (the transport drops its reference when it is done, at a moment that depends on the
    // threads' timing), so that the memory a step holds does not: the estimator counts it until then.
    result.output = std::move(output);
    return result;
  }
  if (world > 1) {
    result.work = custom ? (*custom)(output, input, pg, /*async_op=*/true)
                         : all_gather_into_tensor(output, input, pg, /*async_op=*/true);
  }
  result.output = std::move(output);
  return result;
}

void foreach_all_gather_copy_out(const AllGatherResult& ag, std::vector<FSDPParam>& params) {
  torch::NoGradGuard no_grad;
  if (ag.placed) {
    // [Note: placed all-gather]: the bytes are in place already; mark them changed as copy_ would (the
    // version counter is what autograd and the checkpoint's mutation check read).
    for (auto& p : params) {
      p.unsharded_padded.unsafeGetTensorImpl()->bump_version();
      p.post_forward_shard = torch::Tensor();
    }
    return;
  }
  auto out2d = ag.output.view({ag.world, -1});
  const int64_t row_bytes = out2d.size(1) * static_cast<int64_t>(ag.output.element_size());
  const bool cpu_out = plain_cpu(ag.output);
  int64_t off = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    if (cpu_out && !ag.extended[i] && (p.shard_dim == 0 || ag.post_forward) && ag.pieces[i].size() == 1) {
      // [Note: small copies by memcpy]: rank r's piece to rows r of the unsharded tensor, as the copy_ below.
      const auto [dt, numel] = ag.pieces[i][0];
      const int64_t piece_bytes = numel * static_cast<int64_t>(c10::elementSize(dt));
      const auto& dst = p.unsharded_padded;
      if (piece_bytes * ag.world <= kSmallCopyBytes && dst.scalar_type() == dt && plain_cpu(dst) &&
          dst.numel() == numel * ag.world) {
        const int64_t off_bytes = ag.as_bytes ? off : off * static_cast<int64_t>(ag.output.element_size());
        if (piece_bytes > 0) {
          for (int r = 0; r < ag.world; ++r) {
            std::memcpy(bytes_of(dst) + r * piece_bytes, bytes_of(ag.output) + r * row_bytes + off_bytes,
                        static_cast<size_t>(piece_bytes));
          }
        }
        // As copy_ would: the unsharded data changed in place (its version counter is what autograd and the
        // checkpoint's mutation check read).
        dst.unsafeGetTensorImpl()->bump_version();
        off += ag.as_bytes ? aligned(piece_bytes) : numel;
        p.post_forward_shard = torch::Tensor();
        continue;
      }
    }
    // Each piece as [world, numel] in its dtype: in place, aligned when bytes (see the note).
    std::vector<torch::Tensor> views;
    for (const auto& [dt, numel] : ag.pieces[i]) {
      if (ag.as_bytes) {
        const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dt));
        views.push_back(out2d.narrow(1, off, bytes).view(dt));
        off += aligned(bytes);
      } else {
        views.push_back(out2d.narrow(1, off, numel));
        off += numel;
      }
    }
    if (ag.extended[i]) {
      p.all_gather_extension->post_all_gather(views, p.unsharded_padded);
    } else if (p.shard_dim != 0 && !ag.post_forward) {
      // Chunk-cat ([Note: Shard(d)]): rank r's chunk [*shard shape] goes to rows r of dim d split as
      // [world, n / world]: [world, *shard] -> movedim(0, d) -> the unsharded tensor viewed split.
      std::vector<int64_t> gathered{ag.world};
      for (auto s : p.padded_shard.sizes()) gathered.push_back(s);
      auto split = p.padded_shard.sizes().vec();
      split.insert(split.begin() + p.shard_dim, ag.world);
      p.unsharded_padded.view(split).copy_(views[0].view(gathered).movedim(0, p.shard_dim));
    } else {
      p.unsharded_padded.view({ag.world, -1}).copy_(views[0]);
    }
    p.post_forward_shard = torch::Tensor();
  }
}

std::pair<double, double> gradient_divide_factors(torch::ScalarType reduce_dtype, double factor) {
  if (reduce_dtype == torch::kFloat32 || reduce_dtype == torch::kBFloat16) return {1.0, factor};
  // N ranks each hold g_i and reduce (g_1 + ... + g_N) / N: dividing by ~sqrt(N) before and after keeps the
  // sum inside fp16's range (PyTorch's loop, kept bit for bit: the same factors, so the same roundings).
  double pre = 1.0;
  while (std::fmod(factor, pre) == 0.0 && factor / pre > pre) pre *= 2.0;
  return {pre, factor / pre};
}

namespace {
// [Note: placed reduce-scatter]
// On one host's CPU ranks the reduce-scatter needs no input ([ws, M + P], as large as the unsharded group) and
// no copy-in: detail::reduce_scatter_placed (c10d/placed_collectives.h) takes row r as its pieces, which the
// transport copies straight from the gradients into its slot (the other ranks' rows) or reduces where they are
// (this rank's own row): each gradient's chunk r, its zero padding, then the presence flags. The same bytes as
// the input would hold, reduced in the same order, so the same bits (tests/fsdp/test_comm.cpp compares it with
// the copy-in path over Gloo's sockets). The gradients stay alive until the wait instead of the input (the memory
// estimator counts them there). Gradients that need a cast (bf16 into an fp32 reduction), a division before the
// sum (fp16), Shard(d > 0) or a custom ReduceScatter take the copy-in.
std::optional<ReduceScatterResult> reduce_scatter_placed(const std::vector<FSDPParam>& params,
                                                         std::vector<torch::Tensor>& grads,
                                                         std::vector<size_t>& param_indices, int64_t m,
                                                         std::vector<char>& missing, ProcessGroup& pg,
                                                         CommContext& comm, torch::ScalarType reduce_dtype,
                                                         torch::Device device, ReduceScatter* custom,
                                                         double predivide_factor) {
  const int ws = pg.size();
  if (custom || ws == 1 || predivide_factor != 1.0 || !device.is_cpu()) return std::nullopt;
  for (size_t i : param_indices) {
    const auto& p = params[i];
    const auto& g = grads[i];
    if (p.shard_dim != 0) return std::nullopt;
    if (g.defined() && !(plain_cpu(g) && g.scalar_type() == reduce_dtype)) return std::nullopt;
  }
  const int64_t np = static_cast<int64_t>(param_indices.size());
  if (!can_reduce_scatter_placed(pg, reduce_dtype, m + np)) return std::nullopt;
  auto output = comm.empty({m + np}, reduce_dtype, device);
  TORCH_INTERNAL_ASSERT(ws <= 256);
  // Row r's pieces, in order: (source or null for zeros, bytes). The presence flags are one tensor that every
  // row ends with.
  const int64_t es = output.element_size();
  std::vector<float> present(static_cast<size_t>(np), 0.0f);
  std::vector<torch::Tensor> held;
  auto rows = std::make_shared<std::vector<PieceList>>(ws);
  for (size_t k = 0; k < param_indices.size(); ++k) {
    const auto& p = params[param_indices[k]];
    auto& g = grads[param_indices[k]];
    if (g.defined()) {
      TORCH_INTERNAL_ASSERT(g.numel() == p.orig_size[0] * p.row_numel, "fully_shard: the gradient of ", p.fqn, " has ",
                            g.numel(), " elements, its parameter ", p.orig_size[0] * p.row_numel);
      present[k] = 1.0f;
    }
    for (int r = 0; r < ws; ++r) {
      auto range = chunk_range(p.orig_size[0], ws, r);
      const int64_t filled = g.defined() ? range.length * p.row_numel : 0;
      auto& row = (*rows)[r];
      if (filled > 0) row.push_back({bytes_of(g) + range.offset * p.row_numel * es, static_cast<uint64_t>(filled * es)});
      if (filled < p.padded_numel()) row.push_back({nullptr, static_cast<uint64_t>((p.padded_numel() - filled) * es)});
    }
    if (g.defined()) held.push_back(std::move(g));
    g = torch::Tensor();
  }
  auto flags = torch::from_blob(present.data(), {np}).to(reduce_dtype, /*non_blocking=*/false, /*copy=*/true);
  for (auto& row : *rows) row.push_back({bytes_of(flags), static_cast<uint64_t>(np * es)});
  held.push_back(flags);
  auto pieces = [rows](int j, uint64_t off, uint64_t len, const ShmTransport::Piece& piece) {
    visit_pieces((*rows)[j], off, len, piece);
  };
  Work work = detail::reduce_scatter_placed(output, std::move(pieces), std::move(held), pg, ReduceOp::SUM,
                                            /*async_op=*/true);
  return ReduceScatterResult{torch::Tensor(), output, std::move(work), std::move(param_indices), m, std::move(missing),
                             predivide_factor};
}
}  // namespace

ReduceScatterResult foreach_reduce(const std::vector<FSDPParam>& params, std::vector<torch::Tensor> grads,
                                   std::vector<size_t> param_indices, int64_t data_numel, std::vector<char> missing,
                                   ProcessGroup& pg, CommContext& comm, torch::ScalarType reduce_dtype,
                                   torch::Device device, ReduceScatter* custom, double predivide_factor) {
  torch::NoGradGuard no_grad;
  const int ws = pg.size();
  const int64_t m = data_numel;
  // CUDA: copy-in and reduce-scatter on the reduce-scatter stream, after the backward queued so far.
  StreamScope rs_stream(&comm, CommStream::kReduceScatter);
  const int64_t np = static_cast<int64_t>(param_indices.size());
  if (auto placed = reduce_scatter_placed(params, grads, param_indices, m, missing, pg, comm, reduce_dtype, device,
                                          custom, predivide_factor)) {
    return std::move(*placed);
  }
  // Reduce-scatter input [ws, M + P]: row r = every gradient's chunk r (zero-padded), in group order,
  // then the P presence flags.
  // Uninitialised (CPU: a pool block): every element is written below, the gradients' rows by the copy,
  // the padding and absent gradients with zeros, so nothing is written twice.
  torch::Tensor input;
  if (custom) {
    input = custom->allocate({ws * (m + np)}, reduce_dtype, device);
    TORCH_CHECK(input.numel() == ws * (m + np) && input.scalar_type() == reduce_dtype && input.is_contiguous(),
                "fully_shard: the custom ReduceScatter's allocate returned ", input.sizes(), " ", input.scalar_type(),
                "; expected a contiguous tensor of ", ws * (m + np), " elements of ", reduce_dtype);
    input = input.view({ws, m + np});
  } else {
    input = comm.empty({ws, m + np}, reduce_dtype, device);
  }
  input.narrow(1, m, np).zero_();
  int64_t off = 0;
  for (size_t k = 0; k < param_indices.size(); ++k) {
    const auto& p = params[param_indices[k]];
    auto& g = grads[param_indices[k]];
    if (g.defined()) input.narrow(1, m + static_cast<int64_t>(k), 1).fill_(1);
    if (p.shard_dim != 0) {
      // [Note: Shard(d)]: rank r's row takes chunk r of dim d (even: no padding).
      torch::Tensor chunks;
      if (g.defined()) {
        auto split = p.padded_shard.sizes().vec();
        split.insert(split.begin() + p.shard_dim, ws);
        chunks = g.reshape(split).movedim(p.shard_dim, 0);  // [ws, *shard shape]
      }
      for (int r = 0; r < ws; ++r) {
        auto dst = input[r].narrow(0, off, p.padded_numel());
        if (g.defined()) {
          dst.view(p.padded_shard.sizes()).copy_(chunks[r]);
        } else {
          dst.zero_();
        }
      }
    } else if (plain_cpu(input) && p.padded_numel() * ws * input.element_size() <= kSmallCopyBytes &&
               (!g.defined() || (g.scalar_type() == reduce_dtype && plain_cpu(g)))) {
      // [Note: small copies by memcpy]: the rows and zero padding below, by pointers.
      TORCH_INTERNAL_ASSERT(!g.defined() || g.numel() == p.orig_size[0] * p.row_numel, "fully_shard: the gradient of ",
                            p.fqn, " has ", g.numel(), " elements, its parameter ", p.orig_size[0] * p.row_numel);
      const int64_t es = input.element_size();
      for (int r = 0; r < ws; ++r) {
        auto range = chunk_range(p.orig_size[0], ws, r);
        const int64_t filled = g.defined() ? range.length * p.row_numel : 0;
        char* dst = bytes_of(input) + (r * (m + np) + off) * es;
        if (filled > 0) std::memcpy(dst, bytes_of(g) + range.offset * p.row_numel * es, static_cast<size_t>(filled * es));
        if (filled < p.padded_numel()) std::memset(dst + filled * es, 0, static_cast<size_t>((p.padded_numel() - filled) * es));
      }
    } else {
      for (int r = 0; r < ws; ++r) {
        auto range = chunk_range(p.orig_size[0], ws, r);
        const int64_t filled = g.defined() ? range.length * p.row_numel : 0;
        if (filled > 0) {
          input[r].narrow(0, off, filled).copy_(g.narrow(0, range.offset, range.length).reshape({-1}));
        }
        if (filled < p.padded_numel()) input[r].narrow(0, off + filled, p.padded_numel() - filled).zero_();
      }
    }
    off += p.padded_numel();
    if (g.defined()) comm.record_stream(g, CommStream::kReduceScatter);  // read there; freed by the compute stream
    // Copied in: released now, so that the full-size gradients and the reduce-scatter's output and backend
    // buffers are never alive together (the reduce-scatter is the backward's largest moment in
    // parameter-heavy models).
    g = torch::Tensor();
  }
  if (predivide_factor != 1.0) input.narrow(1, 0, m).div_(predivide_factor);  // not the presence flags
  auto flat_in = input.view({-1});
  if (ws == 1) {
    // One rank (replicate's one-rank shard dimension, or a world of 1): the input is the sum.
    return ReduceScatterResult{torch::Tensor(), flat_in, Work(), std::move(param_indices), m, std::move(missing),
                               predivide_factor};
  }
  auto output = custom ? custom->allocate({m + np}, reduce_dtype, device) : comm.empty({m + np}, reduce_dtype, device);
  TORCH_CHECK(output.numel() == m + np && output.scalar_type() == reduce_dtype && output.is_contiguous(),
              "fully_shard: the custom ReduceScatter's allocate({", m + np, "}, ", reduce_dtype, ") returned ",
              output.sizes(), " ", output.scalar_type(), "; expected a contiguous tensor of exactly that size and dtype");
  Work work = custom ? (*custom)(output, flat_in, pg, ReduceOp::SUM, /*async_op=*/true)
                     : reduce_scatter_tensor(output, flat_in, pg, ReduceOp::SUM, /*async_op=*/true);
  // The input is not kept here: the backend's work holds it until the collective completes (Gloo's work owns
  // its tensors until the wait, the shared-memory reduce-scatter's completion step too, NCCL stashes them
  // with its stream), and at world size 1 the copy is already queued on the
  // reduce-scatter stream, where the memory is allocated and reused in order. Dropping it here frees each
  // group's input during the backward instead of at its end (as FSDP2 does), lowering the peak.
  return ReduceScatterResult{torch::Tensor(), output, std::move(work), std::move(param_indices), m, std::move(missing),
                             predivide_factor};
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
    auto shard = rs.output.narrow(0, off, p.padded_numel()).view(p.padded_shard.sizes()).narrow(p.shard_dim, 0, p.local_rows);
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
