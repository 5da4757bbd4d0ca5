#include "fsdp/collectives.h"

#include <sstream>

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

// Runs `issue` and wraps it as a Work; world size 1 never reaches the backend.
template <typename Issue>
Work launch(ProcessGroup& group, const char* op, uint64_t bytes, std::string description, bool async_op,
            Issue&& issue, std::function<void()> on_done = {}) {
  group.count_collective(op, bytes);
  c10::intrusive_ptr<c10d::Work> w;
  try {
    w = issue();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, description, " failed: ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, description, " failed: ", e.what());
  }
  Work work(std::move(w), std::move(description), std::move(on_done));
  if (!async_op) work.wait();
  return work;
}

}  // namespace

std::string describe(const torch::Tensor& t) {
  std::ostringstream os;
  os << t.sizes() << " " << t.scalar_type();
  return os.str();
}

Work::Work(c10::intrusive_ptr<c10d::Work> work, std::string description, std::function<void()> on_done)
    : work_(std::move(work)), description_(std::move(description)), on_done_(std::move(on_done)), done_(false) {}

void Work::wait() {
  if (done_) return;  // already waited (or nothing was issued)
  done_ = true;
  if (work_) {
    try {
      work_->wait();
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, description_, " failed: ", e.what_without_backtrace());
    } catch (const std::exception& e) {
      TORCH_CHECK(false, description_, " failed: ", e.what());
    }
  }
  if (on_done_) on_done_();
}

bool Work::is_completed() const { return done_ || !work_ || work_->isCompleted(); }

Work all_gather_into_tensor(const torch::Tensor& output, const torch::Tensor& input, ProcessGroup& group,
                            bool async_op) {
  uint64_t seq = group.next_seq();
  std::string desc = header("all_gather_into_tensor", group, seq) + ": input " + describe(input) + ", output " +
                     describe(output);
  TORCH_CHECK(output.numel() == input.numel() * group.size(), desc, ": expected output.numel() == ", group.size(),
              " * input.numel() = ", input.numel() * group.size(), ", got ", output.numel());
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), desc, ": input and output dtypes differ");
  TORCH_CHECK(output.is_contiguous() && input.is_contiguous(), desc, ": tensors must be contiguous");
  if (group.size() == 1) {
    if (!output.is_same(input) && output.data_ptr() != input.data_ptr()) output.view(-1).copy_(input.view(-1));
    return Work();
  }
  return launch(group, "all_gather_into_tensor", output.nbytes(), desc, async_op, [&] {
    c10d::AllgatherOptions opts;
    auto out = output.view({-1});
    auto in = input.view({-1});
    return group.backend()->_allgather_base(out, in, opts);
  });
}

Work reduce_scatter_tensor(const torch::Tensor& output, const torch::Tensor& input, ProcessGroup& group,
                           ReduceOp op, bool async_op) {
  uint64_t seq = group.next_seq();
  std::string desc = header("reduce_scatter_tensor", group, seq) + ": input " + describe(input) + ", output " +
                     describe(output);
  TORCH_CHECK(input.numel() == output.numel() * group.size(), desc, ": expected input.numel() == ", group.size(),
              " * output.numel() = ", output.numel() * group.size(), ", got ", input.numel());
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), desc, ": input and output dtypes differ");
  TORCH_CHECK(output.is_contiguous() && input.is_contiguous(), desc, ": tensors must be contiguous");
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
      group, "reduce_scatter_tensor", input.nbytes(), desc, async_op,
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
  uint64_t seq = group.next_seq();
  std::string desc = header("all_reduce", group, seq) + ": tensor " + describe(tensor);
  if (group.size() == 1) return Work();
  std::function<void()> on_done;
  if (op == ReduceOp::AVG) {
    int n = group.size();
    on_done = [tensor, n] { tensor.div_(n); };
  }
  return launch(
      group, "all_reduce", tensor.nbytes(), desc, async_op,
      [&] {
        c10d::AllreduceOptions opts;
        opts.reduceOp = to_c10d(op);
        std::vector<at::Tensor> ts{tensor};
        return group.backend()->allreduce(ts, opts);
      },
      std::move(on_done));
}

Work broadcast(const torch::Tensor& tensor, int src, ProcessGroup& group, bool async_op) {
  uint64_t seq = group.next_seq();
  std::string desc = header("broadcast", group, seq) + ": tensor " + describe(tensor) + " from rank " +
                     std::to_string(src);
  TORCH_CHECK(src >= 0 && src < group.size(), desc, ": src out of range");
  if (group.size() == 1) return Work();
  return launch(group, "broadcast", tensor.nbytes(), desc, async_op, [&] {
    c10d::BroadcastOptions opts;
    opts.rootRank = src;
    std::vector<at::Tensor> ts{tensor};
    return group.backend()->broadcast(ts, opts);
  });
}

Work barrier(ProcessGroup& group, bool async_op) {
  uint64_t seq = group.next_seq();
  std::string desc = header("barrier", group, seq);
  if (group.size() == 1) return Work();
  return launch(group, "barrier", 0, desc, async_op, [&] {
    c10d::BarrierOptions opts;
    return group.backend()->barrier(opts);
  });
}

}  // namespace fsdp
