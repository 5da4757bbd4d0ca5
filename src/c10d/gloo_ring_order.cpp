// Gloo's ring order of reduction ([Note: Gloo ring order] in gloo_ring_order.h).
#include "c10d/gloo_ring_order.h"

#include <ATen/TensorIterator.h>

#include <algorithm>

namespace fsdp::detail {

void gloo_ring_reduce(const torch::Tensor& out, const std::vector<torch::Tensor>& rows, int64_t begin, int n,
                      ReduceOp op, uint64_t total_bytes) {
  torch::NoGradGuard no_grad;
  const int64_t m = out.numel();
  const uint64_t elem = out.element_size();
  GlooRingLayout l(total_bytes, elem, n);
  const int64_t ring_chunk = static_cast<int64_t>(l.segment_bytes / elem * l.per_rank);
  const int64_t end = begin + m;
  for (int64_t a = begin; a < end;) {
    const int64_t g = a / ring_chunk;
    const int64_t b = std::min(end, (g + 1) * ring_chunk);
    auto dst = out.narrow(0, a - begin, b - a);
    // The k-th rank of chunk g's path: rank g - k (k = 1 starts it, k = n ends it).
    auto row = [&](int64_t k) { return rows[((g - k) % n + n) % n].narrow(0, a - begin, b - a); };
    switch (op) {
      case ReduceOp::SUM:
      case ReduceOp::AVG:
        at::add_out(dst, row(1), row(2));
        for (int k = 3; k <= n; ++k) dst.add_(row(k));
        break;
      case ReduceOp::PRODUCT:
        at::mul_out(dst, row(1), row(2));
        for (int k = 3; k <= n; ++k) dst.mul_(row(k));
        break;
      case ReduceOp::MAX:
      case ReduceOp::MIN: {
        // Rank g - k combines a = its value, b = the partial: max keeps b where a < b, min where b < a.
        const bool max = op == ReduceOp::MAX;
        auto first = row(2), second = row(1);
        at::where_out(dst, max ? at::lt(first, second) : at::lt(second, first), second, first);
        for (int k = 3; k <= n; ++k) {
          auto x = row(k);
          at::where_out(dst, max ? at::lt(x, dst) : at::lt(dst, x), dst, x);
        }
        break;
      }
    }
    a = b;
  }
}

void gloo_reduce_rows(const torch::Tensor& output, const torch::Tensor& gathered, int n, int rank, ReduceOp op,
                      uint64_t total_bytes) {
  const int64_t m = output.numel();
  auto rows = gathered.view({n, m}).unbind(0);
  gloo_ring_reduce(output.view({-1}), rows, static_cast<int64_t>(rank) * m, n, op, total_bytes);
}

ShmTransport::ReduceRound ring_reduce_round(const torch::Tensor& out, int64_t begin, int n, ReduceOp op,
                                            uint64_t total) {
  const int64_t elem = out.element_size();
  const auto dtype = out.scalar_type();
  char* data = static_cast<char*>(out.data_ptr());
  return [n, op, total, elem, dtype, data, begin](uint64_t off, uint64_t len, const char* const* slots) {
    // Plain tensors over the raw bytes: no autograd or inference-mode state of the caller's tensor reaches
    // the worker thread.
    const auto opts = torch::TensorOptions().dtype(dtype);
    const int64_t first = begin + static_cast<int64_t>(off) / elem, numel = static_cast<int64_t>(len) / elem;
    // In pieces of at most ATen's grain size (TensorIterator runs smaller ops serially), so that each op runs
    // on this thread alone: one core per group, as Gloo's reduction on its worker, rather than a second
    // OpenMP team of the worker's competing with the training threads' (OpenMP gives each calling thread a
    // team of its own).
    for (int64_t a = 0; a < numel; a += at::internal::GRAIN_SIZE) {
      const int64_t len_a = std::min<int64_t>(at::internal::GRAIN_SIZE, numel - a);
      std::vector<torch::Tensor> rows;
      rows.reserve(n);
      for (int r = 0; r < n; ++r) {
        rows.push_back(torch::from_blob(const_cast<char*>(slots[r]) + a * elem, {len_a}, opts));
      }
      gloo_ring_reduce(torch::from_blob(data + off + a * elem, {len_a}, opts), rows, first + a, n, op, total);
    }
  };
}

}  // namespace fsdp::detail
