// ProcessGroupMPI (internal; MPI builds only): the c10d::Backend of the "mpi" backend, one per group, over
// one MPI communicator. Its collectives (process_group_mpi.cpp) check their arguments on the calling
// thread, then hand the MPI call to the MPI thread (mpi_thread.h) as an Op and return a Work at once;
// process_group_mpi_ops.cpp builds the Ops the collectives share and queues them.
#pragma once

#include <mpi.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "c10d/mpi/mpi_thread.h"

namespace fsdp::detail {

class ProcessGroupMPI : public c10d::Backend {
 public:
  // `comm` returns errors (MPI_ERRORS_RETURN) and belongs to this backend; `name` is the group's, for errors.
  ProcessGroupMPI(MPI_Comm comm, int rank, int size, std::chrono::milliseconds timeout, std::string name)
      : c10d::Backend(rank, size), comm_(comm), timeout_(timeout), name_(std::move(name)) {}

  const std::string getBackendName() const override { return "mpi"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  MPI_Comm comm() const { return comm_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool /*waitAllRanks*/) override { barrier(opts)->wait(); }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  // One non-blocking MPI operation: `start` issues it (on the MPI thread), `after` finishes the outputs
  // once MPI has completed it (AVG's division, copies back into non-contiguous tensors). The buffers MPI
  // uses are captured by value in `start`, which is kept until completion (enqueue_async).
  struct Op {
    const char* call;
    std::function<int(MPI_Request*)> start;
    std::function<void()> after;
    std::string desc;  // for errors: the collective, its shapes and dtypes
  };

  static c10d::ReduceOp::RedOpType red(const c10d::ReduceOp& op) {
    return static_cast<c10d::ReduceOp::RedOpType>(op);
  }
  c10::intrusive_ptr<c10d::Work> recv_from(std::vector<at::Tensor>& tensors, int src, int tag, const char* api);
  c10::intrusive_ptr<c10d::Work> p2p(c10d::OpType type, const std::string& d, std::vector<at::Tensor> outputs,
                                     std::function<int(MPI_Request*)> start,
                                     std::function<void(const MPI_Status&)> after);

  // The Ops of the collectives that FSDP issues, shared by their single and coalesced variants.
  Op allreduce_op(const at::Tensor& t, c10d::ReduceOp::RedOpType op, const std::string& d);
  Op allgather_base_op(const at::Tensor& output, const at::Tensor& input, const std::string& d);
  Op reduce_scatter_op(const at::Tensor& output, const at::Tensor& input, c10d::ReduceOp::RedOpType op,
                       const std::string& d);
  // For the coalesced variants: the op run to completion inside one job.
  std::function<void()> blocking(Op op);

  c10::intrusive_ptr<c10d::Work> enqueue_async(c10d::OpType type, const std::string& d,
                                               std::vector<at::Tensor> outputs, std::chrono::milliseconds op_timeout,
                                               Op op);
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const std::string& d, std::vector<at::Tensor> outputs,
                                         std::chrono::milliseconds op_timeout, std::function<void()> fn);

  // Starts a non-blocking MPI call with `start`, then waits for it with MpiThread::wait_request().
  template <typename F>
  void run_nb(F start, const char* call, const std::string& d) const {
    MPI_Request req = MPI_REQUEST_NULL;
    check(start(&req), call, d);
    check(MpiThread::wait_request(&req), call, d);
  }

  // MPI call failed: c10::Error naming the call, the collective (shapes, dtypes), the rank and MPI's reason.
  void check(int rc, const char* call, const std::string& d) const;
  // Argument checks on the calling thread; each throws c10::Error naming the collective `d` / `api`.
  at::Tensor single(std::vector<at::Tensor>& ts, const char* api) const;
  void cpu(const at::Tensor& t, const std::string& d) const;
  int count(const at::Tensor& t, const std::string& d) const;
  void check_root(int64_t root, const std::string& d) const;
  void check_avg(c10d::ReduceOp::RedOpType op, const at::Tensor& t, const std::string& d) const;

  MPI_Comm comm_;
  std::chrono::milliseconds timeout_;
  std::string name_;
};

}  // namespace fsdp::detail
