// Gloo's ring all-reduce, reproduced: its segmentation (to count its bytes) and its order of reduction (to get
// its bits without its sockets): the shared-memory all-reduce and reduce-scatter, and our Gloo reduce-scatter's
// completion step, reduce through it (src/c10d/collectives.cpp, [Note: Gloo reduce-scatter]).
//
// [Note: Gloo ring order]
// Gloo's ring all-reduce (gloo/allreduce.cc) reduces ring chunk g (GlooRingLayout: segments
// [g*per_rank, (g+1)*per_rank)) along the ring: it starts at rank g-1 and each rank g-2, g-3, ..., g (mod N)
// combines its own value `a` with the partial result `b` it received, c = f(a, b). For SUM and PRODUCT
// that is ((x[g-1] + x[g-2]) + x[g-3]) + ... + x[g]: floating-point addition is commutative but not
// associative, so this order, not only the set of terms, gives Gloo's bits (fp32, bf16, fp16, fp64; any N).
// MAX and MIN are std::max(a, b) and std::min(a, b) (gloo/math.h): (a < b ? b : a) and (b < a ? b : a),
// which do not propagate NaN as at::maximum does (the result is NaN exactly where the last rank of the
// chunk's path, rank g, holds NaN) and keep the rank's own zero on a -0.0/+0.0 tie; at::where with the same
// comparison selects the same operand, bit for bit. gloo_ring_reduce reproduces it for any range of the
// buffer: reduce-scatter reduces its own chunk, the shared-memory all-reduce every round of the whole buffer
// ([Note: shared-memory transport]), so both reduce in exactly Gloo's order through this one function.
//
// No PyTorch counterpart: ProcessGroupGloo calls gloo's ring itself.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "c10d/shm_transport.h"
#include "fsdp/c10d/collectives.h"

namespace fsdp::detail {

/// Gloo's segmentation of a ring all-reduce of `total` bytes of `elem`-byte elements over `n` ranks
/// (gloo/allreduce.cc, ring(); ProcessGroupGloo leaves maxSegmentSize at gloo's default of 1 MiB): the
/// buffer is cut into num_segments segments of segment_bytes (the last ones short or empty), and rank k
/// reduces segments [k * per_rank, (k + 1) * per_rank). Used to count the all-reduce's bytes exactly and to
/// reproduce its summation order in gloo_reduce_rows.
struct GlooRingLayout {
  uint64_t num_segments = 0, per_rank = 0, segment_bytes = 0;
  GlooRingLayout(uint64_t total, uint64_t elem, uint64_t n) {
    constexpr uint64_t kGlooMaxSegmentBytes = 1024 * 1024;
    const uint64_t max_segment = elem * std::max<uint64_t>(1, kGlooMaxSegmentBytes / elem);
    const uint64_t want = std::max<uint64_t>((total + max_segment - 1) / max_segment, 2 * n);
    num_segments = (want + n - 1) / n * n;
    per_rank = num_segments / n;
    const uint64_t seg = (total + num_segments - 1) / num_segments;
    segment_bytes = (seg + elem - 1) / elem * elem;
  }
  // Bytes of segment `s` (taken modulo num_segments, as gloo does) inside a buffer of `total` bytes.
  uint64_t length(uint64_t s, uint64_t total) const {
    const uint64_t off = (s % num_segments) * segment_bytes;
    return off >= total ? 0 : std::min(segment_bytes, total - off);
  }
};

/// Reduces rows[r] (rank r's values) into `out` in Gloo's ring order, for any range of the buffer: `out` and
/// the rows hold elements [begin, begin + out.numel()) of a ring all-reduce of
/// `total_bytes` over `n` ranks; no rows[r] may overlap `out`.
void gloo_ring_reduce(const torch::Tensor& out, const std::vector<torch::Tensor>& rows, int64_t begin, int n,
                      ReduceOp op, uint64_t total_bytes);

/// Our Gloo reduce-scatter's completion: `gathered` row j is rank j's copy of this rank's chunk of an input of
/// `total_bytes`; reduces the rows into `output` in Gloo's ring order.
void gloo_reduce_rows(const torch::Tensor& output, const torch::Tensor& gathered, int n, int rank, ReduceOp op,
                      uint64_t total_bytes);

/// One round of a reduction through the shared-memory transport (ShmTransport::ReduceRound): slots[r] holds
/// rank r's bytes [off, off + len) of the piece of a ring all-reduce of `total` bytes over `n` ranks that
/// starts at element `begin` (an all-reduce's whole tensor: 0; a reduce-scatter's chunk: rank x its numel),
/// reduced in Gloo's ring order into `out` at the same bytes.
ShmTransport::ReduceRound ring_reduce_round(const torch::Tensor& out, int64_t begin, int n, ReduceOp op,
                                            uint64_t total);

}  // namespace fsdp::detail
