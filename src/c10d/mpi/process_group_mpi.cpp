// ProcessGroupMPI's collectives and point-to-point calls (the class: process_group_mpi_backend.h). Each one
// checks its arguments on the calling thread, so that a wrong call throws there, naming the collective,
// then queues the MPI call on the MPI thread and returns its Work. The Ops that FSDP's collectives share,
// the queueing and the checks are in process_group_mpi_ops.cpp. Compiled only in a build with MPI.
#include "c10d/mpi/process_group_mpi_backend.h"

#include <algorithm>

#include "c10d/mpi/mpi_types.h"

namespace fsdp::detail {

c10::intrusive_ptr<ProcessGroupMPI::Options> ProcessGroupMPI::getBackendOptions() {
  auto o = c10::make_intrusive<Options>("mpi", timeout_);
  o->group_name = name_;
  return o;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  auto t = single(tensors, "broadcast");
  std::string d = "broadcast(tensor " + describe_tensor(t) + ", root " + std::to_string(opts.rootRank) + ")";
  check_root(opts.rootRank, d);
  auto type = mpi_type(t.scalar_type(), d);
  int n = count(t, d);
  auto buf = t.is_contiguous() ? t : t.contiguous();
  const int root = static_cast<int>(opts.rootRank);
  Op op{"MPI_Ibcast", [=, this](MPI_Request* r) { return MPI_Ibcast(buf.data_ptr(), n, type, root, comm_, r); },
        [buf, t] {
          if (!buf.is_same(t)) t.copy_(buf);
        },
        d};
  return enqueue_async(c10d::OpType::BROADCAST, d, {t}, opts.timeout, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  auto t = single(tensors, "allreduce");
  std::string d = "allreduce(tensor " + describe_tensor(t) + ", op " + op_name(red(opts.reduceOp)) + ")";
  return enqueue_async(c10d::OpType::ALLREDUCE, d, {t}, opts.timeout, allreduce_op(t, red(opts.reduceOp), d));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                    const c10d::AllreduceCoalescedOptions& opts) {
  std::vector<std::function<void()>> jobs;
  std::string d = "allreduce_coalesced(" + std::to_string(tensors.size()) + " tensors, op " +
                  op_name(red(opts.reduceOp)) + ")";
  for (auto& t : tensors) {
    cpu(t, d);
    jobs.push_back(blocking(allreduce_op(t, red(opts.reduceOp), d + ": tensor " + describe_tensor(t))));
  }
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, d, tensors, opts.timeout, [jobs] {
    for (auto& j : jobs) j();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  auto t = single(tensors, "reduce");
  auto op = red(opts.reduceOp);
  std::string d = "reduce(tensor " + describe_tensor(t) + ", op " + op_name(op) + ", root " +
                  std::to_string(opts.rootRank) + ")";
  check_root(opts.rootRank, d);
  auto type = mpi_type(t.scalar_type(), d);
  int n = count(t, d);
  int root = static_cast<int>(opts.rootRank);
  check_avg(op, t, d);
  return enqueue(c10d::OpType::REDUCE, d, {t}, opts.timeout, [=, this] {
    auto buf = t.contiguous();
    MPI_Op mop = mpi_op(op, t.scalar_type(), d);
    if (getRank() == root) {
      run_nb([&](MPI_Request* r_) { return MPI_Ireduce(MPI_IN_PLACE, buf.data_ptr(), n, type, mop, root, comm_, r_); }, "MPI_Ireduce", d);
      if (op == c10d::ReduceOp::AVG) buf.div_(getSize());
      if (!buf.is_same(t)) t.copy_(buf);
    } else {
      run_nb([&](MPI_Request* r_) { return MPI_Ireduce(buf.data_ptr(), nullptr, n, type, mop, root, comm_, r_); }, "MPI_Ireduce", d);
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  auto in = single(inputs, "allgather");
  std::string d = "allgather(input " + describe_tensor(in) + ")";
  TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(), "ProcessGroupMPI: ", d,
              ": expected one list of ", getSize(), " output tensors on rank ", getRank());
  auto outs = outputs[0];
  for (auto& o : outs) {
    TORCH_CHECK(o.sizes() == in.sizes() && o.scalar_type() == in.scalar_type(), "ProcessGroupMPI: ", d,
                ": every output must have the input's shape and dtype, got ", describe_tensor(o), " on rank ",
                getRank());
  }
  auto type = mpi_type(in.scalar_type(), d);
  int n = count(in, d);
  return enqueue(c10d::OpType::ALLGATHER, d, outs, opts.timeout, [=, this] {
    auto src = in.contiguous();
    auto flat = at::empty({static_cast<int64_t>(getSize()) * in.numel()}, in.options());
    run_nb([&](MPI_Request* r_) { return MPI_Iallgather(src.data_ptr(), n, type, flat.data_ptr(), n, type, comm_, r_); }, "MPI_Iallgather", d);
    for (int r = 0; r < getSize(); ++r) outs[r].copy_(flat.narrow(0, r * in.numel(), in.numel()).view(in.sizes()));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::AllgatherOptions& opts) {
  std::string d = "_allgather_base(input " + describe_tensor(input) + ", output " + describe_tensor(output) + ")";
  return enqueue_async(c10d::OpType::_ALLGATHER_BASE, d, {output}, opts.timeout, allgather_base_op(output, input, d));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                std::vector<at::Tensor>& inputs,
                                                                                const c10d::AllgatherOptions& opts) {
  std::string d = "allgather_into_tensor_coalesced(" + std::to_string(inputs.size()) + " tensors)";
  TORCH_CHECK(outputs.size() == inputs.size(), "ProcessGroupMPI: ", d, ": ", outputs.size(), " outputs for ",
              inputs.size(), " inputs");
  std::vector<std::function<void()>> jobs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    jobs.push_back(blocking(allgather_base_op(outputs[i], inputs[i],
                                      d + ": input " + describe_tensor(inputs[i]) + ", output " +
                                          describe_tensor(outputs[i]))));
  }
  return enqueue(c10d::OpType::COALESCED, d, outputs, opts.timeout, [jobs] {
    for (auto& j : jobs) j();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                    std::vector<at::Tensor>& inputs,
                                                                    const c10d::AllgatherOptions& opts) {
  // Each input gathered in turn into its list of outputs (outputs[r][i]: input i of rank r).
  std::string d = "allgather_coalesced(" + std::to_string(inputs.size()) + " tensors)";
  TORCH_CHECK(static_cast<int>(outputs.size()) == getSize(), "ProcessGroupMPI: ", d, ": expected ", getSize(),
              " output lists, got ", outputs.size());
  std::vector<at::Tensor> flat_outs;
  std::vector<std::function<void()>> jobs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto in = inputs[i].contiguous();
    auto gathered = at::empty({static_cast<int64_t>(getSize()) * in.numel()}, in.options());
    jobs.push_back(blocking(allgather_base_op(gathered, in, d + ": input " + describe_tensor(in))));
    std::vector<at::Tensor> dst;
    for (int r = 0; r < getSize(); ++r) dst.push_back(outputs[r].at(i));
    jobs.push_back([gathered, dst, in] {
      for (size_t r = 0; r < dst.size(); ++r)
        dst[r].copy_(gathered.narrow(0, static_cast<int64_t>(r) * in.numel(), in.numel()).view(in.sizes()));
    });
    for (auto& t : dst) flat_outs.push_back(t);
  }
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, d, flat_outs, opts.timeout, [jobs] {
    for (auto& j : jobs) j();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::GatherOptions& opts) {
  auto in = single(inputs, "gather");
  std::string d = "gather(input " + describe_tensor(in) + ", root " + std::to_string(opts.rootRank) + ")";
  check_root(opts.rootRank, d);
  int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> outs;
  if (getRank() == root) {
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(), "ProcessGroupMPI: ", d,
                ": the root expects one list of ", getSize(), " outputs");
    outs = outputs[0];
  }
  auto type = mpi_type(in.scalar_type(), d);
  int n = count(in, d);
  return enqueue(c10d::OpType::GATHER, d, outs, opts.timeout, [=, this] {
    auto src = in.contiguous();
    at::Tensor flat;
    if (getRank() == root) flat = at::empty({static_cast<int64_t>(getSize()) * in.numel()}, in.options());
    run_nb([&](MPI_Request* r_) { return MPI_Igather(src.data_ptr(), n, type, flat.defined() ? flat.data_ptr() : nullptr, n, type, root, comm_, r_); }, "MPI_Igather", d);
    for (size_t r = 0; r < outs.size(); ++r)
      outs[r].copy_(flat.narrow(0, static_cast<int64_t>(r) * in.numel(), in.numel()).view(in.sizes()));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::scatter(std::vector<at::Tensor>& outputs,
                                                        std::vector<std::vector<at::Tensor>>& inputs,
                                                        const c10d::ScatterOptions& opts) {
  auto out = single(outputs, "scatter");
  std::string d = "scatter(output " + describe_tensor(out) + ", root " + std::to_string(opts.rootRank) + ")";
  check_root(opts.rootRank, d);
  int root = static_cast<int>(opts.rootRank);
  at::Tensor flat;
  if (getRank() == root) {
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(), "ProcessGroupMPI: ", d,
                ": the root expects one list of ", getSize(), " inputs");
    std::vector<at::Tensor> parts;
    for (auto& t : inputs[0]) parts.push_back(t.reshape({-1}));
    flat = at::cat(parts);
  }
  auto type = mpi_type(out.scalar_type(), d);
  int n = count(out, d);
  return enqueue(c10d::OpType::SCATTER, d, {out}, opts.timeout, [=, this] {
    auto dst = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
    run_nb([&](MPI_Request* r_) { return MPI_Iscatter(flat.defined() ? flat.data_ptr() : nullptr, n, type, dst.data_ptr(), n, type, root, comm_, r_); }, "MPI_Iscatter", d);
    if (!dst.is_same(out)) out.copy_(dst);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                               std::vector<std::vector<at::Tensor>>& inputs,
                                                               const c10d::ReduceScatterOptions& opts) {
  auto out = single(outputs, "reduce_scatter");
  std::string d = "reduce_scatter(output " + describe_tensor(out) + ", op " + op_name(red(opts.reduceOp)) + ")";
  TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(), "ProcessGroupMPI: ", d,
              ": expected one list of ", getSize(), " inputs on rank ", getRank());
  std::vector<at::Tensor> parts;
  for (auto& t : inputs[0]) {
    TORCH_CHECK(t.numel() == out.numel() && t.scalar_type() == out.scalar_type(), "ProcessGroupMPI: ", d,
                ": every input must have the output's size and dtype, got ", describe_tensor(t));
    parts.push_back(t.reshape({-1}));
  }
  auto flat = at::cat(parts);
  return enqueue_async(c10d::OpType::REDUCE_SCATTER, d, {out}, opts.timeout,
                       reduce_scatter_op(out, flat, red(opts.reduceOp), d));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::ReduceScatterOptions& opts) {
  std::string d = "_reduce_scatter_base(input " + describe_tensor(input) + ", output " + describe_tensor(output) +
                  ", op " + op_name(red(opts.reduceOp)) + ")";
  return enqueue_async(c10d::OpType::_REDUCE_SCATTER_BASE, d, {output}, opts.timeout,
                       reduce_scatter_op(output, input, red(opts.reduceOp), d));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  std::string d = "reduce_scatter_tensor_coalesced(" + std::to_string(inputs.size()) + " tensors, op " +
                  op_name(red(opts.reduceOp)) + ")";
  TORCH_CHECK(outputs.size() == inputs.size(), "ProcessGroupMPI: ", d, ": ", outputs.size(), " outputs for ",
              inputs.size(), " inputs");
  std::vector<std::function<void()>> jobs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    jobs.push_back(blocking(reduce_scatter_op(outputs[i], inputs[i], red(opts.reduceOp),
                                              d + ": input " + describe_tensor(inputs[i]) + ", output " +
                                                  describe_tensor(outputs[i]))));
  }
  return enqueue(c10d::OpType::COALESCED, d, outputs, opts.timeout, [jobs] {
    for (auto& j : jobs) j();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t>& output_split_sizes,
                                                              std::vector<int64_t>& input_split_sizes,
                                                              const c10d::AllToAllOptions& opts) {
  std::string d = "alltoall_base(input " + describe_tensor(input) + ", output " + describe_tensor(output) + ")";
  cpu(input, d);
  cpu(output, d);
  TORCH_CHECK(input.scalar_type() == output.scalar_type(), "ProcessGroupMPI: ", d, ": dtypes differ");
  auto type = mpi_type(input.scalar_type(), d);
  // Row counts per peer (dim 0), equal when no splits are given; MPI_Alltoallv takes element counts.
  const int64_t in_row = input.dim() ? input.numel() / std::max<int64_t>(1, input.size(0)) : 1;
  const int64_t out_row = output.dim() ? output.numel() / std::max<int64_t>(1, output.size(0)) : 1;
  auto counts = [&](const std::vector<int64_t>& splits, const at::Tensor& t, int64_t row, const char* which) {
    std::vector<int> c(getSize());
    if (splits.empty()) {
      TORCH_CHECK(t.numel() % getSize() == 0, "ProcessGroupMPI: ", d, ": ", which, " of ", t.numel(),
                  " elements does not split evenly over ", getSize(), " ranks");
      for (auto& x : c) x = static_cast<int>(t.numel() / getSize());
    } else {
      TORCH_CHECK(static_cast<int>(splits.size()) == getSize(), "ProcessGroupMPI: ", d, ": expected ", getSize(),
                  " ", which, " split sizes, got ", splits.size());
      for (int r = 0; r < getSize(); ++r) c[r] = static_cast<int>(splits[r] * row);
    }
    return c;
  };
  auto scounts = counts(input_split_sizes, input, in_row, "input");
  auto rcounts = counts(output_split_sizes, output, out_row, "output");
  std::vector<int> sdispl(getSize(), 0), rdispl(getSize(), 0);
  for (int r = 1; r < getSize(); ++r) {
    sdispl[r] = sdispl[r - 1] + scounts[r - 1];
    rdispl[r] = rdispl[r - 1] + rcounts[r - 1];
  }
  auto in = input, out = output;
  return enqueue(c10d::OpType::ALLTOALL_BASE, d, {output}, opts.timeout, [=, this] {
    auto src = in.contiguous();
    auto dst = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
    run_nb([&](MPI_Request* r_) { return MPI_Ialltoallv(src.data_ptr(), scounts.data(), sdispl.data(), type, dst.data_ptr(), rcounts.data(),
                        rdispl.data(), type, comm_, r_); }, "MPI_Ialltoallv", d);
    if (!dst.is_same(out)) out.copy_(dst);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::barrier(const c10d::BarrierOptions& opts) {
  Op op{"MPI_Ibarrier", [this](MPI_Request* r) { return MPI_Ibarrier(comm_, r); }, [] {}, "barrier()"};
  return enqueue_async(c10d::OpType::BARRIER, "barrier()", {}, opts.timeout, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  auto t = single(tensors, "send");
  std::string d = "send(tensor " + describe_tensor(t) + ", to rank " + std::to_string(dst) + ", tag " +
                  std::to_string(tag) + ")";
  check_root(dst, d);
  auto type = mpi_type(t.scalar_type(), d);
  int n = count(t, d);
  auto buf = t.contiguous().clone();  // the caller may overwrite t before the send completes
  return p2p(c10d::OpType::SEND, d, {t}, [=, this](MPI_Request* req) {
    return MPI_Isend(buf.data_ptr(), n, type, dst, tag, comm_, req);
  }, [buf](const MPI_Status&) {});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  return recv_from(tensors, src, tag, "recv");
}
c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return recv_from(tensors, MPI_ANY_SOURCE, tag, "recvAnysource");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::recv_from(std::vector<at::Tensor>& tensors, int src, int tag,
                                                          const char* api) {
  auto t = single(tensors, api);
  std::string d = std::string(api) + "(tensor " + describe_tensor(t) + ", from " +
                  (src == MPI_ANY_SOURCE ? std::string("any rank") : "rank " + std::to_string(src)) + ", tag " +
                  std::to_string(tag) + ")";
  if (src != MPI_ANY_SOURCE) check_root(src, d);
  auto type = mpi_type(t.scalar_type(), d);
  int n = count(t, d);
  auto buf = t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous);
  return p2p(c10d::OpType::RECV, d, {t}, [=, this](MPI_Request* req) {
    return MPI_Irecv(buf.data_ptr(), n, type, src, tag, comm_, req);
  }, [buf, t](const MPI_Status&) {
    if (!buf.is_same(t)) t.copy_(buf);
  });
}

}  // namespace fsdp::detail
