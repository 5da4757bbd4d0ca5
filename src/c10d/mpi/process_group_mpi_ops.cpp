// How ProcessGroupMPI issues MPI calls (the class: process_group_mpi_backend.h): the Ops of the collectives
// FSDP issues (shared by their single and coalesced variants), queueing them on the MPI thread as Works,
// and the checks that turn wrong arguments and MPI's error codes into c10::Error. Compiled only in a build
// with MPI.
#include "c10d/mpi/process_group_mpi_backend.h"

#include <climits>

#include "c10d/mpi/mpi_types.h"

namespace fsdp::detail {

// A point-to-point operation: started on the MPI thread, completed when MPI_Test says so.
c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::p2p(c10d::OpType type, const std::string& d,
                                                    std::vector<at::Tensor> outputs,
                                                    std::function<int(MPI_Request*)> start,
                                                    std::function<void(const MPI_Status&)> after) {
  auto work = c10::make_intrusive<MpiWork>(getRank(), type, d, std::move(outputs), timeout_);
  auto& mt = MpiThread::get();
  const std::string call = type == c10d::OpType::SEND ? "MPI_Isend" : "MPI_Irecv";
  mt.post([work, start, after, call, this, &mt] {
    MpiThread::Pending p;
    int rc = start(&p.request);
    if (rc != MPI_SUCCESS) {
      work->run([&] { check(rc, call.c_str(), work->desc()); });
      return;
    }
    p.done = [work, after, call, this](int rc, const MPI_Status& status) {
      work->source_rank = status.MPI_SOURCE;
      work->run([&] {
        check(rc, call.c_str(), work->desc());
        after(status);
      });
    };
    mt.add_pending(std::move(p));
  });
  return work;
}

ProcessGroupMPI::Op ProcessGroupMPI::allreduce_op(const at::Tensor& t, c10d::ReduceOp::RedOpType op,
                                                  const std::string& d) {
  cpu(t, d);
  auto type = mpi_type(t.scalar_type(), d);
  int n = count(t, d);
  check_avg(op, t, d);
  auto buf = t.is_contiguous() ? t : t.contiguous();
  const int size = getSize();
  return Op{"MPI_Iallreduce",
            [=, this](MPI_Request* r) {
              return MPI_Iallreduce(MPI_IN_PLACE, buf.data_ptr(), n, type, mpi_op(op, t.scalar_type(), d), comm_, r);
            },
            [=] {
              if (op == c10d::ReduceOp::AVG) buf.div_(size);  // MPI has no AVG: SUM, then divide
              if (!buf.is_same(t)) t.copy_(buf);
            },
            d};
}

ProcessGroupMPI::Op ProcessGroupMPI::allgather_base_op(const at::Tensor& output, const at::Tensor& input,
                                                       const std::string& d) {
  cpu(input, d);
  cpu(output, d);
  TORCH_CHECK(output.numel() == input.numel() * getSize(), "ProcessGroupMPI: ", d, ": expected output.numel() == ",
              getSize(), " * input.numel() = ", input.numel() * getSize(), ", got ", output.numel(), " on rank ",
              getRank());
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "ProcessGroupMPI: ", d, ": input and output dtypes differ");
  TORCH_CHECK(output.is_contiguous(), "ProcessGroupMPI: ", d, ": the output must be contiguous");
  auto type = mpi_type(input.scalar_type(), d);
  int n = count(input, d);
  auto out = output;
  const auto bytes = static_cast<int64_t>(input.numel()) * input.element_size();
  char* mine = static_cast<char*>(out.data_ptr()) + getRank() * bytes;
  if (input.is_contiguous() && input.data_ptr() == mine) {
    // FSDP's copy-in: the input already sits in this rank's slot of the output.
    return Op{"MPI_Iallgather",
              [=, this](MPI_Request* r) {
                return MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out.data_ptr(), n, type, comm_, r);
              },
              [out] {}, d};
  }
  // MPI forbids aliased send and receive buffers: copy an input that overlaps the output.
  const char* ib = static_cast<const char*>(input.data_ptr());
  const char* ob = static_cast<const char*>(out.data_ptr());
  bool overlaps = ib < ob + out.nbytes() && ob < ib + bytes;
  auto src = (overlaps || !input.is_contiguous()) ? input.contiguous().clone() : input;
  return Op{"MPI_Iallgather",
            [=, this](MPI_Request* r) {
              return MPI_Iallgather(src.data_ptr(), n, type, out.data_ptr(), n, type, comm_, r);
            },
            [src, out] {}, d};
}

ProcessGroupMPI::Op ProcessGroupMPI::reduce_scatter_op(const at::Tensor& output, const at::Tensor& input,
                                                       c10d::ReduceOp::RedOpType op, const std::string& d) {
  cpu(input, d);
  cpu(output, d);
  TORCH_CHECK(input.numel() == output.numel() * getSize(), "ProcessGroupMPI: ", d, ": expected input.numel() == ",
              getSize(), " * output.numel() = ", output.numel() * getSize(), ", got ", input.numel(), " on rank ",
              getRank());
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "ProcessGroupMPI: ", d, ": input and output dtypes differ");
  auto type = mpi_type(input.scalar_type(), d);
  int n = count(output, d);
  check_avg(op, output, d);
  auto out = output;
  const char* ib = static_cast<const char*>(input.data_ptr());
  const char* ob = static_cast<const char*>(out.data_ptr());
  bool overlaps = ib < ob + out.nbytes() && ob < ib + input.nbytes();
  auto src = (overlaps || !input.is_contiguous()) ? input.contiguous().clone() : input;
  auto dst = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
  const int size = getSize();
  const auto dtype = input.scalar_type();
  return Op{"MPI_Ireduce_scatter_block",
            [=, this](MPI_Request* r) {
              return MPI_Ireduce_scatter_block(src.data_ptr(), dst.data_ptr(), n, type, mpi_op(op, dtype, d), comm_, r);
            },
            [=] {
              if (op == c10d::ReduceOp::AVG) dst.div_(size);
              if (!dst.is_same(out)) out.copy_(dst);
            },
            d};
}

// For the coalesced variants: the op run to completion inside one job.
std::function<void()> ProcessGroupMPI::blocking(Op op) {
  return [op = std::move(op), this] {
    run_nb(op.start, op.call, op.desc);
    op.after();
  };
}

// A single collective, asynchronous on the MPI thread: started when its turn comes, then completed by the
// MPI thread's polling while it starts the next ones, so that (as with Gloo's worker threads) FSDP's
// reduce-scatter and the next all-gather progress together. Every rank starts them in issue order, which
// MPI requires of non-blocking collectives on one communicator.
c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::enqueue_async(c10d::OpType type, const std::string& d,
                                                              std::vector<at::Tensor> outputs,
                                                              std::chrono::milliseconds op_timeout, Op op) {
  auto timeout = op_timeout == c10d::kUnsetTimeout ? timeout_ : op_timeout;
  auto work = c10::make_intrusive<MpiWork>(getRank(), type, "group '" + name_ + "': " + d, std::move(outputs),
                                           timeout);
  auto& mt = MpiThread::get();
  mt.post([work, op = std::move(op), this, &mt] {
    MpiThread::Pending p;
    int rc = op.start(&p.request);
    if (rc != MPI_SUCCESS) {
      work->run([&] { check(rc, op.call, work->desc()); });
      return;
    }
    // The whole op rides along until completion: its lambdas hold the buffers MPI reads and writes.
    p.done = [work, op, this](int rc, const MPI_Status&) {
      work->run([&] {
        check(rc, op.call, work->desc());
        op.after();
      });
    };
    mt.add_pending(std::move(p));
  });
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMPI::enqueue(c10d::OpType type, const std::string& d,
                                                        std::vector<at::Tensor> outputs,
                                                        std::chrono::milliseconds op_timeout,
                                                        std::function<void()> fn) {
  auto timeout = op_timeout == c10d::kUnsetTimeout ? timeout_ : op_timeout;
  auto work = c10::make_intrusive<MpiWork>(getRank(), type, "group '" + name_ + "': " + d, std::move(outputs),
                                           timeout);
  MpiThread::get().post([work, fn = std::move(fn)] { work->run(fn); });
  return work;
}

// MPI call failed: c10::Error naming the call, the collective (shapes, dtypes), the rank and MPI's reason.
void ProcessGroupMPI::check(int rc, const char* call, const std::string& d) const {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  TORCH_CHECK(false, "ProcessGroupMPI: ", call, " failed in ", d, " of group '", name_, "' on rank ", getRank(),
              " of ", getSize(), ": ", std::string(msg, static_cast<size_t>(len)), " (MPI error code ", rc, ")");
}

at::Tensor ProcessGroupMPI::single(std::vector<at::Tensor>& ts, const char* api) const {
  TORCH_CHECK(ts.size() == 1, "ProcessGroupMPI: ", api, ": expected exactly one tensor (one device per rank), got ",
              ts.size(), " on rank ", getRank());
  cpu(ts[0], api);
  return ts[0];
}
void ProcessGroupMPI::cpu(const at::Tensor& t, const std::string& d) const {
  TORCH_CHECK(t.device().is_cpu(), "ProcessGroupMPI: ", d, ": tensor on ", t.device(),
              ", expected a CPU tensor (the mpi backend runs CPU tensors; use nccl for CUDA)");
}
int ProcessGroupMPI::count(const at::Tensor& t, const std::string& d) const {
  TORCH_CHECK(t.numel() <= INT_MAX, "ProcessGroupMPI: ", d, ": ", t.numel(),
              " elements exceed MPI's int count (", INT_MAX, ") on rank ", getRank(),
              ". Fix: split the tensor");
  return static_cast<int>(t.numel());
}
void ProcessGroupMPI::check_root(int64_t root, const std::string& d) const {
  TORCH_CHECK(root >= 0 && root < getSize(), "ProcessGroupMPI: ", d, ": rank ", root, " is out of range for a group ",
              "of size ", getSize());
}
void ProcessGroupMPI::check_avg(c10d::ReduceOp::RedOpType op, const at::Tensor& t, const std::string& d) const {
  TORCH_CHECK(op != c10d::ReduceOp::AVG || at::isFloatingType(t.scalar_type()), "ProcessGroupMPI: ", d,
              ": AVG of ", t.scalar_type(), " tensors is not an integer. Fix: SUM, then divide yourself");
  TORCH_CHECK(op != c10d::ReduceOp::PREMUL_SUM && op != c10d::ReduceOp::UNUSED, "ProcessGroupMPI: ", d,
              ": reduce op ", op_name(op), " is not supported");
}
}  // namespace fsdp::detail
