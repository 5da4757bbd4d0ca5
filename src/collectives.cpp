#include "fsdp/collectives.h"

#include <chrono>
#include <sstream>

#include "process_group_access.h"

namespace fsdp {
namespace {

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

// What the ranks compare in debug mode: one fixed-size int64 row per collective.
// [seq, op, arg (reduce op or root), in dtype, in ndim, in dims x8, out dtype, out ndim, out dims x8]
constexpr int64_t kMaxDims = 8;
constexpr int64_t kFingerprint = 3 + 2 * (2 + kMaxDims);
const std::vector<std::string> kOps = {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast",
                                       "barrier"};

void encode_tensor(std::vector<int64_t>& row, const torch::Tensor* t) {
  row.push_back(t ? static_cast<int64_t>(t->scalar_type()) : -1);
  row.push_back(t ? t->dim() : -1);
  for (int64_t d = 0; d < kMaxDims; ++d) row.push_back(t && d < t->dim() ? t->size(d) : -1);
}

std::string decode_tensor(const int64_t* f) {
  if (f[0] < 0) return "";
  std::ostringstream os;
  os << "[";
  for (int64_t d = 0; d < f[1] && d < kMaxDims; ++d) os << (d ? ", " : "") << f[2 + d];
  os << "] " << static_cast<c10::ScalarType>(f[0]);
  return os.str();
}

// The name of a ReduceOp as the user wrote it (the fingerprint stores its enum value).
const char* reduce_op_name(int64_t op) {
  switch (static_cast<ReduceOp>(op)) {
    case ReduceOp::SUM: return "SUM";
    case ReduceOp::AVG: return "AVG";
    case ReduceOp::MAX: return "MAX";
    case ReduceOp::MIN: return "MIN";
    case ReduceOp::PRODUCT: return "PRODUCT";
  }
  return "?";
}

std::string decode(const int64_t* f) {
  std::ostringstream os;
  int64_t op = f[1];
  os << (op >= 0 && op < static_cast<int64_t>(kOps.size()) ? kOps[op] : "?") << " #" << f[0] << "(";
  std::string in = decode_tensor(f + 3), out = decode_tensor(f + 3 + 2 + kMaxDims);
  os << (in.empty() ? "" : "input " + in) << (out.empty() ? "" : ", output " + out);
  if (op == 1 || op == 2) os << ", reduce op " << reduce_op_name(f[2]);
  if (op == 3) os << ", src " << f[2];
  os << ")";
  return os.str();
}

// Debug mode: every rank gathers every rank's fingerprint over the side group and raises on a
// mismatch, naming both calls and the field that differs. All ranks see the same table, so all raise.
void check_fingerprint(ProcessGroup& group, const std::string& op, uint64_t seq, int64_t arg,
                       const torch::Tensor* in, const torch::Tensor* out) {
  std::vector<int64_t> row{static_cast<int64_t>(seq),
                           std::find(kOps.begin(), kOps.end(), op) - kOps.begin(), arg};
  encode_tensor(row, in);
  encode_tensor(row, out);
  auto mine = torch::tensor(row, torch::kInt64);
  auto all = torch::empty({group.size() * kFingerprint}, torch::kInt64);
  try {
    group.debug_backend()->_allgather_base(all, mine, c10d::AllgatherOptions())->wait();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "FSDP_DEBUG: the fingerprint exchange before ", op, " #", seq, " on ", group.str(),
                " failed (a rank did not reach this collective within the timeout?): ", e.what_without_backtrace());
  }
  const int64_t* t = all.data_ptr<int64_t>();
  static const char* fields[] = {"sequence number", "op", "reduce op / root", "input dtype", "input shape",
                                 "output dtype", "output shape"};
  for (int r = 1; r < group.size(); ++r) {
    const int64_t* a = t;
    const int64_t* b = t + r * kFingerprint;
    for (int64_t i = 0; i < kFingerprint; ++i) {
      if (a[i] == b[i]) continue;
      int field = i < 3 ? static_cast<int>(i)
                  : i == 3 ? 3
                  : i < 3 + 2 + kMaxDims ? 4
                  : i == 3 + 2 + kMaxDims ? 5
                                          : 6;
      group.flight_recorder().failed(seq, "fingerprint mismatch");
      TORCH_CHECK(false, "FSDP_DEBUG: collective mismatch on ", group.str(), ": rank 0 calls ", decode(a), " but rank ",
                  r, " calls ", decode(b), " (", fields[field], " differs). Every rank must issue the same ",
                  "collectives in the same order with the same shapes and dtypes");
    }
  }
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
  return launch(group, "all_gather_into_tensor", seq, output.nbytes(), desc, async_op, &input, &output, 0, [&] {
    c10d::AllgatherOptions opts;
    auto out = output.view({-1});
    auto in = input.view({-1});
    return group.backend()->_allgather_base(out, in, opts);
  });
}

Work reduce_scatter_tensor(const torch::Tensor& output, const torch::Tensor& input, ProcessGroup& group,
                           ReduceOp op, bool async_op) {
  uint64_t seq = detail::ProcessGroupAccess::next_seq(group);
  const std::string desc = pair_desc("reduce_scatter_tensor", group, seq, input, output);
  check_pair(desc, input, "input", output, "output", group.size());
  if (group.size() == 1) {
    if (output.data_ptr() != input.data_ptr()) output.view(-1).copy_(input.view(-1));
    return Work();
  }
  std::function<void()> on_done;
  if (op == ReduceOp::AVG) {
    int n = group.size();
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
  return launch(
      group, "all_reduce", seq, tensor.nbytes(), desc, async_op, &tensor, nullptr, static_cast<int64_t>(op),
      [&] {
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
  return launch(group, "broadcast", seq, tensor.nbytes(), desc, async_op, &tensor, nullptr, src, [&] {
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
