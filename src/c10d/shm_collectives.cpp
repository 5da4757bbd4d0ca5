// The collectives of the shared-memory transport, each a sequence of rounds ([Note: shared-memory transport] in
// shm_transport.h; the rounds, the worker and the setup are in shm_transport.cpp).
#include "c10d/shm_transport.h"

#include <algorithm>
#include <cstring>

#include <c10/util/Exception.h>

namespace fsdp::detail {
namespace {
// Copies bytes [off, off + len) of row `j` (its pieces: a source, or zeros) into `dst`; `what` names the
// collective if the pieces do not add up to `len`.
void copy_row(const ShmTransport::RowPieces& rows, int j, uint64_t off, uint64_t len, char* dst, const char* what) {
  char* at = dst;
  rows(j, off, len, [&](const char* src, uint64_t l) {
    if (src) {
      std::memcpy(at, src, l);
    } else {
      std::memset(at, 0, l);
    }
    at += l;
  });
  TORCH_INTERNAL_ASSERT(static_cast<uint64_t>(at - dst) == len, what, ": row ", j, " gave ", at - dst, " of ", len,
                        " bytes");
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ShmTransport::all_gather(at::Tensor output, at::Tensor input, uint64_t seq,
                                                        std::string what) {
  const uint64_t n = input.nbytes();
  const char* src = static_cast<const char*>(input.data_ptr());
  char* dst = static_cast<char*>(output.data_ptr());
  auto place = [output = std::move(output), n, src, dst, me = rank_](int r, uint64_t off, uint64_t len,
                                                                     const char* from) {
    char* to = dst + static_cast<uint64_t>(r) * n + off;
    // In place (`input` is this rank's part of `output`) the bytes are already there.
    if (!(r == me && to == src + off)) std::memcpy(to, from, len);
  };
  return all_gather_placed(input, std::move(place), seq, std::move(what));
}

c10::intrusive_ptr<c10d::Work> ShmTransport::all_gather_placed(at::Tensor input, PlaceRound place, uint64_t seq,
                                                               std::string what) {
  const uint64_t n = input.nbytes();
  auto source = [input = std::move(input)](int, uint64_t off, uint64_t len, const Piece& piece) {
    piece(static_cast<const char*>(input.data_ptr()) + off, len);
  };
  return all_gather_placed(n, std::move(source), std::move(place), seq, std::move(what));
}

c10::intrusive_ptr<c10d::Work> ShmTransport::all_gather_placed(uint64_t bytes, RowPieces source, PlaceRound place,
                                                               uint64_t seq, std::string what) {
  return enqueue([this, n = bytes, source = std::move(source), place = std::move(place), seq, what = std::move(what)] {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    uint64_t off = 0;
    do {  // at least one round, so that ranks compare even an empty collective
      const uint64_t len = std::min(kSlotBytes, n - off);
      round(kAllGather, seq, n, 0,
            [&](char* mine) { copy_row(source, rank_, off, len, mine, "all-gather"); },
            [&](const char* const* slots) {
              if (len == 0) return;
              // This rank's own part from its slot too, not from its source: an all-gather's `input` inside
              // another rank's part of the output has been overwritten by then.
              for (int r = 0; r < size_; ++r) place(r, off, len, slots[r]);
            },
            deadline, what);
      off += len;
    } while (off < n);
  });
}

c10::intrusive_ptr<c10d::Work> ShmTransport::all_to_all(at::Tensor output, at::Tensor input, uint64_t seq,
                                                        std::string what) {
  return enqueue([this, output = std::move(output), input = std::move(input), seq, what = std::move(what)] {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    const uint64_t m = input.nbytes() / static_cast<uint64_t>(size_);  // bytes per destination
    const uint64_t region = kSlotBytes / static_cast<uint64_t>(size_) / 64 * 64;  // per destination per round
    const char* src = static_cast<const char*>(input.data_ptr());
    char* dst = static_cast<char*>(output.data_ptr());
    uint64_t off = 0;
    do {
      const uint64_t len = std::min(region, m - off);
      round(
          kAllToAll, seq, m, 0,
          [&](char* mine) {
            for (int j = 0; j < size_; ++j) {
              if (j != rank_) std::memcpy(mine + j * region, src + j * m + off, len);
            }
          },
          [&](const char* const* slots) {
            for (int r = 0; r < size_; ++r) {
              char* to = dst + r * m + off;
              const char* from = r == rank_ ? src + rank_ * m + off : slots[r] + rank_ * region;
              if (to != from) std::memcpy(to, from, len);
            }
          },
          deadline, what);
      off += len;
    } while (off < m);
  });
}

c10::intrusive_ptr<c10d::Work> ShmTransport::reduce_scatter(at::Tensor output, uint64_t row_bytes, RowPieces rows,
                                                            uint32_t arg, ReduceRound reduce, uint64_t seq,
                                                            std::string what) {
  TORCH_INTERNAL_ASSERT(output.nbytes() == row_bytes);
  return enqueue([this, output = std::move(output), rows = std::move(rows), arg, reduce = std::move(reduce), seq,
                  what = std::move(what)] {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    const uint64_t m = output.nbytes();  // bytes per destination
    // Per destination per round: whole cache lines, so a whole number of elements of any dtype.
    const uint64_t region = kSlotBytes / static_cast<uint64_t>(size_) / 64 * 64;
    const char* own[kMaxRanks];
    uint64_t off = 0;
    do {  // at least one round, so that ranks compare even an empty collective
      const uint64_t len = std::min(region, m - off);
      round(
          kReduceScatter, seq, m, arg,
          [&](char* mine) {
            for (int j = 0; j < size_; ++j) {
              if (j != rank_) copy_row(rows, j, off, len, mine + j * region, "reduce-scatter");
            }
          },
          [&](const char* const* slots) {
            if (len == 0) return;
            // This rank's own row: large pieces are reduced where they are; many small ones (a block of small
            // parameters, their padding) are gathered first, so that the reduction runs once per round rather
            // than once per piece. The same bits either way: each element is reduced alone.
            uint64_t pieces = 0;
            rows(rank_, off, len, [&](const char*, uint64_t l) { pieces += l > 0; });
            const bool direct = pieces <= 1 || len / pieces >= (64u << 10);
            if (!direct && !scratch_) scratch_.reset(new char[region]);
            if (!zeros_) {
              zeros_.reset(new char[region]);
              std::memset(zeros_.get(), 0, region);
            }
            uint64_t pos = 0;
            rows(rank_, off, len, [&](const char* src, uint64_t l) {
              if (l == 0) return;
              if (direct) {
                for (int r = 0; r < size_; ++r) own[r] = r == rank_ ? (src ? src : zeros_.get()) : slots[r] + rank_ * region + pos;
                reduce(off + pos, l, own);
              } else {
                std::memcpy(scratch_.get() + pos, src ? src : zeros_.get(), l);
              }
              pos += l;
            });
            TORCH_INTERNAL_ASSERT(pos == len, "reduce-scatter: row ", rank_, " gave ", pos, " of ", len, " bytes");
            if (!direct) {
              for (int r = 0; r < size_; ++r) own[r] = r == rank_ ? scratch_.get() : slots[r] + rank_ * region;
              reduce(off, len, own);
            }
          },
          deadline, what);
      off += len;
    } while (off < m);
  });
}

c10::intrusive_ptr<c10d::Work> ShmTransport::all_reduce(at::Tensor tensor, uint32_t arg, ReduceRound reduce,
                                                        uint64_t seq, std::string what) {
  return enqueue([this, tensor = std::move(tensor), arg, reduce = std::move(reduce), seq, what = std::move(what)] {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    const uint64_t n = tensor.nbytes();
    const char* src = static_cast<const char*>(tensor.data_ptr());
    uint64_t off = 0;
    do {  // at least one round, so that ranks compare even an empty collective
      // kSlotBytes is a multiple of every element size: a round holds whole elements.
      const uint64_t len = std::min(kSlotBytes, n - off);
      round(kAllReduce, seq, n, arg, [&](char* mine) { std::memcpy(mine, src + off, len); },
            [&](const char* const* slots) {
              if (len > 0) reduce(off, len, slots);
            },
            deadline, what);
      off += len;
    } while (off < n);
  });
}

c10::intrusive_ptr<c10d::Work> ShmTransport::broadcast(at::Tensor tensor, int src_rank, uint64_t seq,
                                                       std::string what) {
  TORCH_INTERNAL_ASSERT(src_rank >= 0 && src_rank < size_);
  return enqueue([this, tensor = std::move(tensor), src_rank, seq, what = std::move(what)] {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    const uint64_t n = tensor.nbytes();
    char* data = static_cast<char*>(tensor.data_ptr());
    uint64_t off = 0;
    do {
      const uint64_t len = std::min(kSlotBytes, n - off);
      // Every rank takes part in every round (the ranks compare the collective, and the source may reuse its
      // buffer only once every rank has read it); only the source writes, only the others read.
      round(kBroadcast, seq, n, static_cast<uint32_t>(src_rank),
            [&](char* mine) {
              if (rank_ == src_rank) std::memcpy(mine, data + off, len);
            },
            [&](const char* const* slots) {
              if (rank_ != src_rank) std::memcpy(data + off, slots[src_rank], len);
            },
            deadline, what);
      off += len;
    } while (off < n);
  });
}

}  // namespace fsdp::detail
