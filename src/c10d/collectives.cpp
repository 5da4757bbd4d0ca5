#include "fsdp/c10d/collectives.h"

#include <ATen/EmptyTensor.h>
#include <ATen/TensorIterator.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <sstream>

#include "c10d/placed_collectives.h"
#include "c10d/fingerprint.h"
#include "c10d/gloo_ring_order.h"
#include "c10d/process_group_access.h"
#include "c10d/shm_transport.h"

namespace fsdp {
namespace {

using detail::check_fingerprint;
using detail::gloo_reduce_rows;
using detail::GlooRingLayout;
using detail::ring_reduce_round;

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:  // SUM, then our own division (see the header)
      return c10d::ReduceOp::SUM;
    case ReduceOp::MAX:
      return c10d::ReduceOp::MAX;
    case ReduceOp::MIN:
      return c10d::ReduceOp::MIN;
    case ReduceOp::PRODUCT:
      return c10d::ReduceOp::PRODUCT;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ReduceOp");
}

std::string header(const char* op, ProcessGroup& group, uint64_t seq) {
  std::ostringstream os;
  os << op << " #" << seq << " on " << group.str();
  return os.str();
}

// ---- Transport bytes (see CommStats in distributed.h) ---------------------------------------------------
// Each collective adds what this rank sends and receives, derived from the algorithm that carries it.

bool is_gloo(const ProcessGroup& g) { return g.backend()->getBackendName() == "gloo"; }

void add_bytes(CommBytes& c, uint64_t sent, uint64_t received) {
  c.sent += sent;
  c.received += received;
  ++c.count;
}

// Gloo's ring all-reduce on rank `r`: in its reduce-scatter phase the rank sends segments
// (r+1)*per_rank + i and receives (r+2)*per_rank + i, in its all-gather phase it sends r*per_rank + i and
// receives (r+1)*per_rank + i, for i < num_segments - per_rank.
void count_all_reduce(ProcessGroup& g, CommBytes& into, uint64_t total, uint64_t elem) {
  const uint64_t n = g.size(), r = g.rank();
  uint64_t sent = 0, received = 0;
  if (is_gloo(g)) {
    GlooRingLayout l(total, elem, n);
    for (uint64_t i = 0; i < l.num_segments - l.per_rank; ++i) {
      sent += l.length((r + 1) * l.per_rank + i, total) + l.length(r * l.per_rank + i, total);
      received += l.length((r + 2) * l.per_rank + i, total) + l.length((r + 1) * l.per_rank + i, total);
    }
  } else {
    sent = received = 2 * (n - 1) * total / n;  // nominal ring (NCCL, MPI)
  }
  add_bytes(into, sent, received);
}

// FSDP_GLOO_REDUCE_SCATTER=allreduce: Gloo groups reduce-scatter through ProcessGroupGloo's
// _reduce_scatter_base (an all-reduce) as before issue 16, e.g. to compare the two. Read once.
bool gloo_reduce_scatter_via_all_reduce() {
  static const bool via = [] {
    const char* v = std::getenv("FSDP_GLOO_REDUCE_SCATTER");
    if (!v || !*v || std::string(v) == "alltoall") return false;
    TORCH_CHECK(std::string(v) == "allreduce", "reduce_scatter_tensor: FSDP_GLOO_REDUCE_SCATTER=", v,
                " is invalid: expected \"alltoall\" (the default) or \"allreduce\" (Gloo's _reduce_scatter_base)");
    return true;
  }();
  return via;
}

// Gloo's binomial-tree broadcast (gloo/broadcast.cc): with ranks renumbered so that the root is 0, step i
// pairs virtual ranks v < 2^i with v + 2^i; so v receives once (v > 0, at the step of its highest bit) and
// then sends to v + 2^i for every 2^i > v with v + 2^i < n. Other backends: a chain (every rank but the
// last sends it once).
void count_broadcast(ProcessGroup& g, int src, uint64_t bytes) {
  const uint64_t n = g.size();
  const uint64_t v = (static_cast<uint64_t>(g.rank()) + n - static_cast<uint64_t>(src)) % n;
  uint64_t sends = 0;
  if (is_gloo(g)) {
    for (uint64_t bit = 1; bit < n; bit <<= 1) {
      if (bit > v && v + bit < n) ++sends;
    }
  } else {
    sends = v + 1 < n ? 1 : 0;
  }
  add_bytes(detail::ProcessGroupAccess::comm_stats(g).broadcast, sends * bytes, v == 0 ? 0 : bytes);
}

// The group's shared-memory transport when it can carry `t` (a CPU tensor of a one-host Gloo group).
detail::ShmTransport* shm_for(ProcessGroup& g, const torch::Tensor& t) {
  return t.is_cpu() ? detail::ProcessGroupAccess::shm(g) : nullptr;
}

// Records, checks (debug mode), publishes progress, then runs `issue` and wraps it as a Work.
// World size 1 never reaches here: the callers return early.
template <typename Issue>
Work launch(ProcessGroup& group, const char* op, uint64_t seq, uint64_t bytes, std::string description,
            bool async_op, const torch::Tensor* in, const torch::Tensor* out, int64_t arg, Issue&& issue,
            std::function<void()> on_done = {}) {
  detail::ProcessGroupAccess::count_collective(group, op, bytes);
  group.flight_recorder().issued(seq, op, description.substr(description.find(':') == std::string::npos
                                                                 ? description.size()
                                                                 : description.find(':') + 2));
  if (group.debug_backend()) check_fingerprint(group, op, seq, arg, in, out);
  detail::ProcessGroupAccess::note_progress(group, seq);
  c10::intrusive_ptr<c10d::Work> w;
  try {
    w = issue();
  } catch (const c10::Error& e) {
    group.flight_recorder().failed(seq, e.what_without_backtrace());
    TORCH_CHECK(false, description, " failed: ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    group.flight_recorder().failed(seq, e.what());
    TORCH_CHECK(false, description, " failed: ", e.what());
  }
  Work work(std::move(w), std::move(description), std::move(on_done), &group, seq);
  if (!async_op) work.wait();
  return work;
}

}  // namespace

std::string describe(const torch::Tensor& t) {
  std::ostringstream os;
  os << t.sizes() << " " << t.scalar_type();
  return os.str();
}

namespace {

/// "<header>: input <describe>, output <describe>": the context of an all-gather or reduce-scatter.
std::string pair_desc(const char* op, ProcessGroup& group, uint64_t seq, const torch::Tensor& input,
                      const torch::Tensor& output) {
  return header(op, group, seq) + ": input " + describe(input) + ", output " + describe(output);
}

/// The tensors of an all-gather (big = output) or reduce-scatter (big = input): `big` holds `n` times
/// the elements of `small`, in the same dtype, both contiguous.
void check_pair(const std::string& desc, const torch::Tensor& big, const char* big_name, const torch::Tensor& small,
                const char* small_name, int n) {
  TORCH_CHECK(big.numel() == small.numel() * n, desc, ": expected ", big_name, ".numel() == ", n, " * ", small_name,
              ".numel() = ", small.numel() * n, ", got ", big.numel());
  TORCH_CHECK(big.scalar_type() == small.scalar_type(), desc, ": input and output dtypes differ");
  TORCH_CHECK(big.is_contiguous() && small.is_contiguous(), desc, ": tensors must be contiguous");
}

// [Note: Gloo reduce-scatter]
// ProcessGroupGloo's _reduce_scatter_base all-reduces the whole input and keeps one chunk: each rank sends
// and receives 2(N-1)/N of the input, twice what a reduce-scatter needs. Ours moves (N-1)/N: Gloo's
// all-to-all (each rank sends chunk c of its input to rank c, gloo/alltoall.cc) leaves in `gathered` row j
// = rank j's copy of this rank's chunk, and the completion step (run once by Work::wait, before the AVG
// division) reduces the rows into `output` with gloo_ring_reduce ([Note: Gloo ring order]), so that the
// result is the old path's bit for bit (tests/c10d/test_gloo_reduce_scatter.cpp checks it against
// _reduce_scatter_base). The ring's chunks need not line up with the reduce-scatter's (their segments are
// rounded), so one output chunk can span two ring chunks, each with its own order.
// The all-to-all is one Gloo collective: it takes the group's next Gloo tag, honours the group timeout
// and fails like any other Work; fingerprints, the flight recorder and progress marks are unchanged
// (launch() wraps it as before). On the shared-memory transport ([Note: shared-memory transport]) the
// dtypes its all-reduce takes skip `gathered` too: each round of the all-to-all is reduced straight out of
// the slots into `output` by the same gloo_ring_reduce (issue 37 item 1: the input's bytes are no longer
// written to `gathered` and read back); other dtypes keep the all-to-all. An output inside the input (in
// place) takes the same path, whatever the other ranks do: the transport reads this rank's own rows from a
// copy then, so that every rank of a collective runs the same kind of rounds.

// Whether two tensors' bytes overlap (contiguous tensors: their data_ptr() and nbytes() span them).
bool overlap(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  const char* a0 = static_cast<const char*>(a.data_ptr());
  const char* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// What the shared-memory transport compares of a reduction across ranks: the op and the dtype.
uint32_t shm_reduce_arg(ReduceOp op, const torch::Tensor& t) {
  return static_cast<uint32_t>(op) << 8 | static_cast<uint32_t>(t.scalar_type());
}

// all_reduce and broadcast through the shared-memory transport: contiguous dense CPU tensors of the dtypes
// ProcessGroupGloo reduces with gloo's C++ operators, for which at::add/mul/lt/where compute the same bits
// (tests/c10d/test_shm_transport.cpp compares every one with Gloo). Anything else (bool, complex, int16,
// float8, a non-contiguous or sparse tensor) stays on Gloo, so that it fails or succeeds exactly as before.
bool shm_can_carry_dtype(torch::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

bool shm_can_carry(const torch::Tensor& t) {
  return t.layout() == c10::kStrided && t.is_contiguous() && shm_can_carry_dtype(t.scalar_type());
}

}  // namespace

Work::Work(c10::intrusive_ptr<c10d::Work> work, std::string description, std::function<void()> on_done,
           ProcessGroup* group, uint64_t seq)
    : work_(std::move(work)),
      description_(std::move(description)),
      on_done_(std::move(on_done)),
      group_(group),
      seq_(seq),
      done_(false) {}

void Work::wait() {
  if (done_) return;  // already waited (or nothing was issued)
  done_ = true;
  if (work_) {
    std::string cause;
    auto t0 = std::chrono::steady_clock::now();
    try {
      work_->wait();
    } catch (const c10::Error& e) {
      cause = e.what_without_backtrace();
    } catch (const std::exception& e) {
      cause = e.what();
    }
    if (group_) {
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      detail::ProcessGroupAccess::add_wait_seconds(*group_, waited);
    }
    if (!cause.empty()) {
      // Name the ranks that never reached this collective (from the progress each rank publishes in
      // the store) and leave the flight recorder behind for the post-mortem.
      std::string extra;
      if (group_) {
        group_->flight_recorder().failed(seq_, cause);
        auto lagging = group_->lagging_ranks(seq_);
        if (!lagging.empty()) extra += "; ranks that have not reached it: [" + c10::Join(", ", lagging) + "]";
        if (cause.find("imed out") != std::string::npos || cause.find("imeout") != std::string::npos) {
          extra += "; not completed within the group timeout of " + std::to_string(group_->timeout().count()) + " ms";
        }
        auto path = group_->dump_flight_recorder();
        if (!path.empty()) extra += "; flight recorder written to " + path;
      }
      TORCH_CHECK(false, description_, " failed: ", cause, extra);
    }
    if (group_) group_->flight_recorder().completed(seq_);
    // Release the backend's work, and with it the tensors it holds (a Gloo reduce-scatter's input and
    // scratch), at the wait rather than when this handle is destroyed, which FSDP does later.
    work_.reset();
  }
  if (on_done_) on_done_();
}

bool Work::is_completed() const { return done_ || !work_ || work_->isCompleted(); }

Work all_gather_into_tensor(const torch::Tensor& output, const torch::Tensor& input, ProcessGroup& group,
                            bool async_op) {
  uint64_t seq = detail::ProcessGroupAccess::next_seq(group);
  const std::string desc = pair_desc("all_gather_into_tensor", group, seq, input, output);
  check_pair(desc, output, "output", input, "input", group.size());
  if (group.size() == 1) {
    if (!output.is_same(input) && output.data_ptr() != input.data_ptr()) output.view(-1).copy_(input.view(-1));
    return Work();
  }
  // Ring all-gather (Gloo's gloo/allgather.cc, NCCL's ring): N-1 steps, each sending one rank's block to
  // the next rank and receiving one from the previous: (N-1)/N of the output each way.
  const uint64_t ag_bytes = input.nbytes() * static_cast<uint64_t>(group.size() - 1);
  add_bytes(detail::ProcessGroupAccess::comm_stats(group).all_gather_into_tensor, ag_bytes, ag_bytes);
  return launch(group, "all_gather_into_tensor", seq, output.nbytes(), desc, async_op, &input, &output, 0, [&] {
    auto out = output.view({-1});
    auto in = input.view({-1});
    if (auto* shm = shm_for(group, input)) return shm->all_gather(out, in, seq, header("all_gather_into_tensor", group, seq));
    c10d::AllgatherOptions opts;
    return group.backend()->_allgather_base(out, in, opts);
  });
}

namespace detail {

void visit_pieces(const PieceList& list, uint64_t offset, uint64_t length, const ShmTransport::Piece& piece) {
  uint64_t at = 0;  // where the current piece starts
  for (const auto& [src, bytes] : list) {
    if (length == 0) break;
    if (offset < at + bytes) {
      const uint64_t skip = offset - at, take = std::min(length, bytes - skip);
      piece(src ? src + skip : nullptr, take);
      offset += take;
      length -= take;
    }
    at += bytes;
  }
}

bool can_all_gather_placed(ProcessGroup& group) {
  return group.size() > 1 && !group.debug_backend() && ProcessGroupAccess::shm(group) != nullptr;
}

Work all_gather_placed(const torch::Tensor& input, ShmTransport::PlaceRound place, ProcessGroup& group,
                       bool async_op) {
  TORCH_INTERNAL_ASSERT(input.is_cpu() && input.is_contiguous());
  auto source = [input](int, uint64_t off, uint64_t len, const ShmTransport::Piece& piece) {
    piece(static_cast<const char*>(input.data_ptr()) + off, len);
  };
  return all_gather_placed(input.numel(), input.scalar_type(), std::move(source), {}, std::move(place), group,
                           async_op);
}

Work all_gather_placed(int64_t numel, torch::ScalarType dtype, ShmTransport::RowPieces source,
                       std::vector<torch::Tensor> held, ShmTransport::PlaceRound place, ProcessGroup& group,
                       bool async_op) {
  TORCH_INTERNAL_ASSERT(can_all_gather_placed(group));
  uint64_t seq = ProcessGroupAccess::next_seq(group);
  const int n = group.size();
  const uint64_t bytes = static_cast<uint64_t>(numel) * c10::elementSize(dtype);
  const std::string desc = header("all_gather_into_tensor", group, seq) + ": input [" + std::to_string(numel) + "] " +
                           c10::toString(dtype) + ", placed straight into its destinations (no output buffer)";
  const uint64_t ag_bytes = bytes * static_cast<uint64_t>(n - 1);
  add_bytes(ProcessGroupAccess::comm_stats(group).all_gather_into_tensor, ag_bytes, ag_bytes);
  // The sources stay alive while the transport reads them and until the wait, whichever ends last
  // ([Note: borrowed sources]).
  auto keep = std::make_shared<std::vector<torch::Tensor>>(std::move(held));
  auto read = [keep, source = std::move(source)](int j, uint64_t off, uint64_t len, const ShmTransport::Piece& piece) {
    source(j, off, len, piece);
  };
  auto on_done = [keep]() mutable { keep.reset(); };
  return launch(group, "all_gather_into_tensor", seq, bytes * static_cast<uint64_t>(n), desc, async_op, nullptr,
                nullptr, 0,
                [&] {
                  return ProcessGroupAccess::shm(group)->all_gather_placed(
                      bytes, std::move(read), std::move(place), seq, header("all_gather_into_tensor", group, seq));
                },
                std::move(on_done));
}

bool can_reduce_scatter_placed(ProcessGroup& group, torch::ScalarType dtype, int64_t numel) {
  return group.size() > 1 && !group.debug_backend() && ProcessGroupAccess::shm(group) != nullptr && is_gloo(group) &&
         !gloo_reduce_scatter_via_all_reduce() && numel > 0 && shm_can_carry_dtype(dtype);
}

Work reduce_scatter_placed(const torch::Tensor& output, ShmTransport::RowPieces rows, std::vector<torch::Tensor> held,
                           ProcessGroup& group, ReduceOp op, bool async_op) {
  TORCH_INTERNAL_ASSERT(can_reduce_scatter_placed(group, output.scalar_type(), output.numel()) && output.is_cpu() &&
                        output.is_contiguous());
  uint64_t seq = ProcessGroupAccess::next_seq(group);
  const int n = group.size();
  const std::string desc = header("reduce_scatter_tensor", group, seq) + ": input [" +
                           std::to_string(output.numel() * n) + "] " + c10::toString(output.scalar_type()) +
                           " read straight from its sources (no input buffer), output " + describe(output);
  const uint64_t rs_bytes = output.nbytes() * static_cast<uint64_t>(n - 1);
  add_bytes(ProcessGroupAccess::comm_stats(group).reduce_scatter_tensor, rs_bytes, rs_bytes);
  // The sources stay alive while the transport reads them and until the wait, whichever ends last ([Note:
  // borrowed sources]), as reduce_scatter_tensor's input does.
  auto keep = std::make_shared<std::vector<torch::Tensor>>(std::move(held));
  auto read = [keep, rows = std::move(rows)](int j, uint64_t off, uint64_t len, const ShmTransport::Piece& piece) {
    rows(j, off, len, piece);
  };
  auto on_done = [output, keep, n, op]() mutable {
    if (op == ReduceOp::AVG) output.div_(n);
    keep.reset();
  };
  const uint64_t total = output.nbytes() * static_cast<uint64_t>(n);
  return launch(
      group, "reduce_scatter_tensor", seq, total, desc, async_op, nullptr, &output, static_cast<int64_t>(op),
      [&] {
        auto out = output.view({-1});
        auto reduce = ring_reduce_round(out, static_cast<int64_t>(group.rank()) * out.numel(), n, op, total);
        return ProcessGroupAccess::shm(group)->reduce_scatter(out, out.nbytes(), std::move(read),
                                                              shm_reduce_arg(op, output), std::move(reduce), seq,
                                                              header("reduce_scatter_tensor", group, seq));
      },
      std::move(on_done));
}

}  // namespace detail

Work reduce_scatter_tensor(const torch::Tensor& output, const torch::Tensor& input, ProcessGroup& group,
                           ReduceOp op, bool async_op) {
  uint64_t seq = detail::ProcessGroupAccess::next_seq(group);
  const std::string desc = pair_desc("reduce_scatter_tensor", group, seq, input, output);
  check_pair(desc, input, "input", output, "output", group.size());
  if (group.size() == 1) {
    if (output.data_ptr() != input.data_ptr()) output.view(-1).copy_(input.view(-1));
    return Work();
  }
  const int n = group.size();
  // Each rank sends N-1 of its input's N chunks and receives N-1 chunks of output's size: (N-1)/N of the
  // input each way (our Gloo reduce-scatter counts its own sends and receives; NCCL's ring the same).
  // Gloo's _reduce_scatter_base is an all-reduce of the input: counted as one.
  const bool ours = is_gloo(group) && output.numel() > 0 && !gloo_reduce_scatter_via_all_reduce();
  auto& counter = detail::ProcessGroupAccess::comm_stats(group).reduce_scatter_tensor;
  if (ours || !is_gloo(group)) {
    const uint64_t rs_bytes = output.nbytes() * static_cast<uint64_t>(n - 1);
    add_bytes(counter, rs_bytes, rs_bytes);
  } else {
    count_all_reduce(group, counter, input.nbytes(), input.element_size());
  }
  std::function<void()> on_done;
  auto* shm = shm_for(group, input);
  if (ours && shm && shm_can_carry(input) && shm_can_carry(output)) {
    // [Note: Gloo reduce-scatter] through the shared-memory transport: each round of the all-to-all is reduced
    // straight out of the slots into `output`, in Gloo's ring order as the completion step below would, with
    // no `gathered` scratch (N x output's bytes written and read again) and no completion step but AVG's.
    // The input stays alive until the wait, as Gloo's work keeps it (the transport drops its reference when it
    // is done, at a moment that depends on the threads' timing), and no longer: the memory estimator counts it
    // until then. (Work::wait runs this once; the handle itself may live on, e.g. through a copy-out.)
    on_done = [output, held = input, n, op]() mutable {
      if (op == ReduceOp::AVG) output.div_(n);
      held = torch::Tensor();
    };
    return launch(
        group, "reduce_scatter_tensor", seq, input.nbytes(), desc, async_op, &input, &output,
        static_cast<int64_t>(op),
        [&] {
          auto out = output.view({-1});
          auto reduce = ring_reduce_round(out, static_cast<int64_t>(group.rank()) * out.numel(), n, op, input.nbytes());
          // An output inside the input (in place): the rounds read the input while the output is written, so they
          // read a copy (as large as the `gathered` scratch of the all-to-all path), not the input.
          auto src = overlap(output, input) ? input.reshape({-1}).clone() : input.view({-1});
          const uint64_t m = out.nbytes();
          auto rows = [src, m](int j, uint64_t off, uint64_t len, const detail::ShmTransport::Piece& piece) {
            piece(static_cast<const char*>(src.data_ptr()) + j * m + off, len);
          };
          return shm->reduce_scatter(out, m, std::move(rows), shm_reduce_arg(op, input), std::move(reduce), seq,
                                     header("reduce_scatter_tensor", group, seq));
        },
        std::move(on_done));
  }
  if (ours) {
    // See [Note: Gloo reduce-scatter]. `gathered` is kept alive by the completion step (and by Gloo's work).
    // On the CPU from the input's allocator: FSDP's inputs come from its buffer pool (fsdp/fsdp_buffer_pool.h),
    // so the scratch is a reused pool block too instead of freshly faulted pages every step. (Any CPU
    // allocator works; a tensor without one, e.g. from_blob, gets a fresh tensor.)
    auto* alloc = input.is_cpu() ? input.storage().allocator() : nullptr;
    auto gathered = alloc ? at::Tensor(at::detail::empty_generic({input.numel()}, alloc,
                                                                c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                                input.scalar_type(), std::nullopt))
                         : torch::empty_like(input.view({-1}));
    on_done = [output, gathered, n, rank = group.rank(), op, total = input.nbytes()]() mutable {
      gloo_reduce_rows(output, gathered, n, rank, op, total);
      gathered = torch::Tensor();  // drop our reference once reduced (Gloo's work holds one until freed)
      if (op == ReduceOp::AVG) output.div_(n);
    };
    return launch(
        group, "reduce_scatter_tensor", seq, input.nbytes(), desc, async_op, &input, &output,
        static_cast<int64_t>(op),
        [&] {
          auto in = input.view({-1});
          if (shm) return shm->all_to_all(gathered, in, seq, header("reduce_scatter_tensor", group, seq));
          std::vector<int64_t> equal_splits;  // empty: n equal chunks
          return group.backend()->alltoall_base(gathered, in, equal_splits, equal_splits, c10d::AllToAllOptions());
        },
        std::move(on_done));
  }
  if (op == ReduceOp::AVG) {
    on_done = [output, n] { output.div_(n); };
  }
  return launch(
      group, "reduce_scatter_tensor", seq, input.nbytes(), desc, async_op, &input, &output, static_cast<int64_t>(op),
      [&] {
        c10d::ReduceScatterOptions opts;
        opts.reduceOp = to_c10d(op);
        auto out = output.view({-1});
        auto in = input.view({-1});
        return group.backend()->_reduce_scatter_base(out, in, opts);
      },
      std::move(on_done));
}

Work all_reduce(const torch::Tensor& tensor, ProcessGroup& group, ReduceOp op, bool async_op) {
  uint64_t seq = detail::ProcessGroupAccess::next_seq(group);
  std::string desc = header("all_reduce", group, seq) + ": tensor " + describe(tensor);
  if (group.size() == 1) return Work();
  std::function<void()> on_done;
  if (op == ReduceOp::AVG) {
    int n = group.size();
    on_done = [tensor, n] { tensor.div_(n); };
  }
  // Counted as Gloo's ring would move it, on the shared-memory transport too (as its all-gathers are):
  // CommStats stays comparable across transports.
  count_all_reduce(group, detail::ProcessGroupAccess::comm_stats(group).all_reduce, tensor.nbytes(),
                   tensor.element_size());
  return launch(
      group, "all_reduce", seq, tensor.nbytes(), desc, async_op, &tensor, nullptr, static_cast<int64_t>(op),
      [&]() -> c10::intrusive_ptr<c10d::Work> {
        if (auto* shm = shm_can_carry(tensor) ? shm_for(group, tensor) : nullptr) {
          // [Note: shared-memory transport]: every rank's bytes, round by round through the slots, each
          // round reduced straight out of them into this rank's tensor in Gloo's ring order.
          auto reduce = ring_reduce_round(tensor, 0, group.size(), op, tensor.nbytes());
          return shm->all_reduce(tensor, shm_reduce_arg(op, tensor), std::move(reduce), seq,
                                 header("all_reduce", group, seq));
        }
        c10d::AllreduceOptions opts;
        opts.reduceOp = to_c10d(op);
        std::vector<at::Tensor> ts{tensor};
        return group.backend()->allreduce(ts, opts);
      },
      std::move(on_done));
}

Work broadcast(const torch::Tensor& tensor, int src, ProcessGroup& group, bool async_op) {
  uint64_t seq = detail::ProcessGroupAccess::next_seq(group);
  std::string desc = header("broadcast", group, seq) + ": tensor " + describe(tensor) + " from rank " +
                     std::to_string(src);
  TORCH_CHECK(src >= 0 && src < group.size(), desc, ": src out of range");
  if (group.size() == 1) return Work();
  // Counted as Gloo's binomial tree would move it, on the shared-memory transport too.
  count_broadcast(group, src, tensor.nbytes());
  return launch(group, "broadcast", seq, tensor.nbytes(), desc, async_op, &tensor, nullptr, src,
                [&]() -> c10::intrusive_ptr<c10d::Work> {
                  if (auto* shm = shm_can_carry(tensor) ? shm_for(group, tensor) : nullptr) {
                    return shm->broadcast(tensor, src, seq, header("broadcast", group, seq));
                  }
                  c10d::BroadcastOptions opts;
                  opts.rootRank = src;
                  std::vector<at::Tensor> ts{tensor};
                  return group.backend()->broadcast(ts, opts);
                });
}

Work barrier(ProcessGroup& group, bool async_op) {
  uint64_t seq = detail::ProcessGroupAccess::next_seq(group);
  std::string desc = header("barrier", group, seq);
  if (group.size() == 1) return Work();
  return launch(group, "barrier", seq, 0, desc, async_op, nullptr, nullptr, 0, [&] {
    c10d::BarrierOptions opts;
    return group.backend()->barrier(opts);
  });
}

}  // namespace fsdp
