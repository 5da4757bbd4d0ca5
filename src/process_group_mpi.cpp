// The "mpi" backend: a c10d::Backend over MPI (Open MPI) for CPU tensors. See process_group_mpi.h for the
// design; this file is compiled with FSDP_WITH_MPI=1 and MPI's include directory only when CMake finds
// MPI (CMakeLists.txt), and without MPI it keeps only the functions that say so.
#include "process_group_mpi.h"
#include "process_group_access.h"

#include <cstdlib>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#if FSDP_WITH_MPI
#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <sstream>
#include <thread>

#include <ATen/core/ivalue.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#endif

namespace fsdp::detail {

namespace {
bool mpirun_without_master_addr(const LaunchEnv& env) {
  const char* addr = std::getenv("MASTER_ADDR");
  return env.source == "openmpi" && (addr == nullptr || *addr == '\0');
}
}  // namespace

std::optional<std::string> mpi_default_backend(const LaunchEnv& env, torch::DeviceType device_type) {
  if (mpi_backend_built() && device_type == torch::kCPU && mpirun_without_master_addr(env)) return "mpi";
  return std::nullopt;
}

bool mpi_provides_rendezvous(const std::string& launch_source) {
  return mpi_backend_built() && launch_source == "openmpi";
}

#if !FSDP_WITH_MPI

bool mpi_backend_built() { return false; }
std::string mpi_thread_level() { return ""; }

ProcessGroupPtr init_mpi_process_group(const std::optional<std::string>& backend, torch::DeviceType,
                                       const LaunchEnv&, std::chrono::milliseconds,
                                       const c10::intrusive_ptr<c10d::Store>&) {
  TORCH_CHECK(!backend || *backend != "mpi",
              "init_process_group: backend mpi requested but this libfsdp was built without MPI (CMake did not find "
              "it). Fix: install Open MPI (`apt-get install libopenmpi-dev openmpi-bin`; scripts/setup.sh does) and "
              "rebuild (`rm -rf build && scripts/setup.sh`), or use backend gloo");
  return nullptr;
}

ProcessGroupPtr new_mpi_group(const ProcessGroupPtr&, const std::vector<int>&, const std::string&) { return nullptr; }

#else  // FSDP_WITH_MPI

bool mpi_backend_built() { return true; }

namespace {

// ---------------------------------------------------------------------------------------------------
// The MPI thread: initialises MPI, then runs every MPI call of the process in the order they were
// posted. One thread makes MPI's thread level a non-issue (SERIALIZED is requested, FUNNELED would do)
// and keeps collectives of all groups in the order the program issued them, which is the same on every
// rank (libfsdp's contract). Point-to-point requests are non-blocking and polled between jobs, so a
// send waiting for its receive never blocks the collectives behind it.
class MpiThread {
 public:
  // Started on first use; never destroyed (its thread outlives static destruction; see at_exit()).
  static MpiThread& get() {
    static MpiThread* t = new MpiThread();
    return *t;
  }
  static bool started() { return started_.load(); }

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  int provided() const { return provided_; }
  bool finalized() const { return finalized_.load(); }

  // Runs `job` on the MPI thread later (in posting order).
  void post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

  // Runs `fn` on the MPI thread and returns its result (rethrows its exception).
  template <typename F>
  auto call(F fn) -> decltype(fn()) {
    using R = decltype(fn());
    auto p = std::make_shared<std::promise<R>>();
    auto fut = p->get_future();
    post([p, fn = std::move(fn)]() mutable {
      try {
        if constexpr (std::is_void_v<R>) {
          fn();
          p->set_value();
        } else {
          p->set_value(fn());
        }
      } catch (...) {
        p->set_exception(std::current_exception());
      }
    });
    return fut.get();
  }

  // A pending non-blocking request and what to do when it completes (on the MPI thread).
  struct Pending {
    MPI_Request request;
    std::function<void(int rc, const MPI_Status&)> done;
  };
  // Only from the MPI thread.
  void add_pending(Pending p) { pending_.push_back(std::move(p)); }

 private:
  MpiThread() {
    std::promise<void> ready;
    auto fut = ready.get_future();
    thread_ = std::thread([this, &ready] {
      try {
        init();
        ready.set_value();
      } catch (...) {
        ready.set_exception(std::current_exception());
        return;
      }
      loop();
    });
    try {
      fut.get();
    } catch (...) {
      thread_.join();
      throw;
    }
    started_ = true;
    std::atexit(&MpiThread::at_exit);
  }

  void init() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided_);
      TORCH_CHECK(rc == MPI_SUCCESS, "init_process_group: backend mpi: MPI_Init_thread failed with code ", rc);
    } else {
      MPI_Query_thread(&provided_);  // the program initialised MPI itself: use it as it is
      owns_mpi_ = false;
    }
    // Only this thread calls MPI, and it is the thread that initialised it: FUNNELED is enough.
    TORCH_CHECK(provided_ >= MPI_THREAD_FUNNELED || owns_mpi_,
                "init_process_group: backend mpi: MPI grants only MPI_THREAD_SINGLE, expected at least "
                "MPI_THREAD_FUNNELED");
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
    MPI_Comm_dup(MPI_COMM_WORLD, &exit_comm_);
  }

  // Runs the posted jobs; while requests are pending, tests them: spinning for spin_us() after the last
  // event (a peer that is already there), then sleeping between tests with a pause doubling from 20 us to
  // 500 us, instead of MPI's own spinning, which took a core from the compute threads (docs/BENCHMARKS.md).
  void loop() {
    auto last_event = std::chrono::steady_clock::now();
    auto pause = std::chrono::microseconds(20);
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (pending_.empty()) {
          cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        } else if (queue_.empty() && std::chrono::steady_clock::now() - last_event >= spin_us()) {
          cv_.wait_for(lock, pause, [&] { return stop_ || !queue_.empty(); });
          pause = std::min(pause * 2, std::chrono::microseconds(500));
        }
        if (!queue_.empty()) {
          job = std::move(queue_.front());
          queue_.pop_front();
        } else if (stop_) {
          return;
        }
      }
      if (job) job();
      if (job || poll() > 0) {
        last_event = std::chrono::steady_clock::now();
        pause = std::chrono::microseconds(20);
      }
    }
  }

 public:
  // FSDP_MPI_SPIN_US (default 50): how long the MPI thread spins on pending requests before it sleeps.
  static std::chrono::microseconds spin_us() {
    static const auto spin = std::chrono::microseconds([] {
      const char* v = std::getenv("FSDP_MPI_SPIN_US");
      return v ? std::max(0L, std::atol(v)) : 50L;
    }());
    return spin;
  }

 private:
  // Tests the pending requests; runs the completion of those done. Returns how many completed.
  int poll() {
    int completed = 0;
    for (size_t i = 0; i < pending_.size();) {
      int flag = 0;
      MPI_Status status;
      int rc = MPI_Test(&pending_[i].request, &flag, &status);
      if (rc != MPI_SUCCESS || flag) {
        auto p = std::move(pending_[i]);
        pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
        p.done(rc, status);
        ++completed;
      } else {
        ++i;
      }
    }
    return completed;
  }

  // At exit every rank meets in a non-blocking barrier, then calls MPI_Finalize. A rank that exits while
  // others are still running (an error on this rank only), or whose MPI thread is stuck in a collective
  // that will never complete, gives up after FSDP_MPI_EXIT_TIMEOUT_S (default 60) seconds and exits
  // without MPI_Finalize: mpirun then stops the whole job instead of leaving the other ranks hanging.
  static void at_exit() {
    if (!started_) return;
    auto& t = get();
    long limit_s = 60;
    if (const char* v = std::getenv("FSDP_MPI_EXIT_TIMEOUT_S")) limit_s = std::max(1L, std::atol(v));
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(limit_s);
    auto done = std::make_shared<std::promise<bool>>();
    auto fut = done->get_future();
    t.post([&t, done, deadline] {
      if (!t.owns_mpi_) {
        done->set_value(true);
        return;
      }
      MPI_Request req;
      bool met = false;
      if (MPI_Ibarrier(t.exit_comm_, &req) == MPI_SUCCESS) {
        while (std::chrono::steady_clock::now() < deadline) {
          int flag = 0;
          if (MPI_Test(&req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
          if (flag) {
            met = true;
            break;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      }
      if (met) {
        MPI_Finalize();
        t.finalized_ = true;
      }
      done->set_value(met);
    });
    bool ok = fut.wait_until(deadline + std::chrono::seconds(5)) == std::future_status::ready && fut.get();
    if (ok) {
      {
        std::lock_guard<std::mutex> lock(t.mu_);
        t.stop_ = true;
      }
      t.cv_.notify_one();
      t.thread_.join();
    } else {
      std::fprintf(stderr,
                   "libfsdp: rank %d: the other MPI ranks did not reach exit within %ld s (FSDP_MPI_EXIT_TIMEOUT_S): "
                   "exiting without MPI_Finalize, so that mpirun stops the job\n",
                   t.world_rank_, limit_s);
      std::fflush(stderr);
      t.thread_.detach();
    }
  }

  static inline std::atomic<bool> started_{false};
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::vector<Pending> pending_;  // MPI thread only
  int provided_ = MPI_THREAD_SINGLE;
  bool owns_mpi_ = true;
  int world_rank_ = 0;
  int world_size_ = 1;
  MPI_Comm exit_comm_ = MPI_COMM_NULL;
  std::atomic<bool> finalized_{false};
};

// ---------------------------------------------------------------------------------------------------
// Datatypes and reductions.

MPI_Datatype mpi_type(at::ScalarType t, const std::string& what) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kHalf:
    case at::kBFloat16: return MPI_UINT16_T;  // moved as bits; reduced by the user ops below
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kShort: return MPI_INT16_T;
    case at::kChar: return MPI_INT8_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kBool: return MPI_C_BOOL;
    default: break;
  }
  TORCH_CHECK(false, "ProcessGroupMPI: ", what, ": dtype ", t, " is not supported: expected one of Float, Double, "
              "Half, BFloat16, Int, Long, Short, Char, Byte, Bool");
}

// 16-bit floats reduce as Gloo does: each pairwise step in float, rounded back to the 16-bit type.
template <typename T, typename F>
void reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  F f;
  for (int i = 0; i < *len; ++i) b[i] = static_cast<T>(f(static_cast<float>(a[i]), static_cast<float>(b[i])));
}
struct Add { float operator()(float a, float b) const { return a + b; } };
struct Mul { float operator()(float a, float b) const { return a * b; } };
struct Min { float operator()(float a, float b) const { return std::isnan(a) ? a : (b < a ? b : a); } };
struct Max { float operator()(float a, float b) const { return std::isnan(a) ? a : (b > a ? b : a); } };

const char* op_name(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

// The MPI operation for `op` on `t`. AVG is SUM here (MPI has no AVG); the caller divides afterwards.
// Called on the MPI thread (MPI_Op_create needs MPI initialised).
MPI_Op mpi_op(c10d::ReduceOp::RedOpType op, at::ScalarType t, const std::string& what) {
  const bool floating = t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
  if (t == at::kBool) {  // as Gloo: a sum or max of booleans is "any", a product or min is "all"
    switch (op) {
      case c10d::ReduceOp::SUM:
      case c10d::ReduceOp::MAX:
      case c10d::ReduceOp::BOR: return MPI_LOR;
      case c10d::ReduceOp::PRODUCT:
      case c10d::ReduceOp::MIN:
      case c10d::ReduceOp::BAND: return MPI_LAND;
      case c10d::ReduceOp::BXOR: return MPI_LXOR;
      default: break;
    }
  } else if (t == at::kHalf || t == at::kBFloat16) {
    static MPI_Op ops[2][4] = {};
    static bool made = false;
    if (!made) {
      MPI_Op_create(&reduce16<c10::Half, Add>, 1, &ops[0][0]);
      MPI_Op_create(&reduce16<c10::Half, Mul>, 1, &ops[0][1]);
      MPI_Op_create(&reduce16<c10::Half, Min>, 1, &ops[0][2]);
      MPI_Op_create(&reduce16<c10::Half, Max>, 1, &ops[0][3]);
      MPI_Op_create(&reduce16<c10::BFloat16, Add>, 1, &ops[1][0]);
      MPI_Op_create(&reduce16<c10::BFloat16, Mul>, 1, &ops[1][1]);
      MPI_Op_create(&reduce16<c10::BFloat16, Min>, 1, &ops[1][2]);
      MPI_Op_create(&reduce16<c10::BFloat16, Max>, 1, &ops[1][3]);
      made = true;
    }
    int k = t == at::kHalf ? 0 : 1;
    switch (op) {
      case c10d::ReduceOp::SUM:
      case c10d::ReduceOp::AVG: return ops[k][0];
      case c10d::ReduceOp::PRODUCT: return ops[k][1];
      case c10d::ReduceOp::MIN: return ops[k][2];
      case c10d::ReduceOp::MAX: return ops[k][3];
      default: break;
    }
  } else {
    switch (op) {
      case c10d::ReduceOp::SUM: return MPI_SUM;
      case c10d::ReduceOp::AVG:
        if (floating) return MPI_SUM;
        break;
      case c10d::ReduceOp::PRODUCT: return MPI_PROD;
      case c10d::ReduceOp::MIN: return MPI_MIN;
      case c10d::ReduceOp::MAX: return MPI_MAX;
      case c10d::ReduceOp::BAND:
        if (!floating) return MPI_BAND;
        break;
      case c10d::ReduceOp::BOR:
        if (!floating) return MPI_BOR;
        break;
      case c10d::ReduceOp::BXOR:
        if (!floating) return MPI_BXOR;
        break;
      default: break;
    }
  }
  TORCH_CHECK(false, "ProcessGroupMPI: ", what, ": reduce op ", op_name(op), " is not supported for dtype ", t,
              ": expected SUM, AVG (floating point), PRODUCT, MIN, MAX, or BAND/BOR/BXOR (integers, bool)");
}

std::string describe_tensor(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes() << " " << t.scalar_type();
  return os.str();
}

// ---------------------------------------------------------------------------------------------------
// Work: completes on the MPI thread; wait() applies the group's timeout (PyTorch's Gloo does the same
// per collective), so a rank missing from a collective is an error, not a hang.
class MpiWork : public c10d::Work {
 public:
  MpiWork(int rank, c10d::OpType type, std::string desc, std::vector<at::Tensor> outputs,
          std::chrono::milliseconds timeout)
      : c10d::Work(rank, type),
        desc_(std::move(desc)),
        outputs_(std::move(outputs)),
        timeout_(timeout),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    auto limit = timeout == kNoTimeout ? timeout_ : timeout;
    std::unique_lock<std::mutex> lock(mutex_);
    if (!cv_.wait_for(lock, limit, [&] { return completed_; })) {
      TORCH_CHECK(false, "ProcessGroupMPI: ", desc_, " timed out: not completed within ", limit.count(),
                  " ms on rank ", rank_, " (a rank of the group has not called it?). The MPI thread stays blocked: "
                  "end the process (mpirun then stops the job)");
    }
    if (exception_) std::rethrow_exception(exception_);
    return true;
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  // On the MPI thread: runs `fn`, then completes (with its error, if any).
  void run(const std::function<void()>& fn) {
    std::exception_ptr error;
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    complete(error);
  }
  void complete(std::exception_ptr error) {
    finish(error);
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }
  const std::string& desc() const { return desc_; }
  int source_rank = -1;
  int sourceRank() const override { return source_rank; }

 private:
  std::string desc_;
  std::vector<at::Tensor> outputs_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// ---------------------------------------------------------------------------------------------------
class ProcessGroupMPI : public c10d::Backend {
 public:
  ProcessGroupMPI(MPI_Comm comm, int rank, int size, std::chrono::milliseconds timeout, std::string name)
      : c10d::Backend(rank, size), comm_(comm), timeout_(timeout), name_(std::move(name)) {}

  const std::string getBackendName() const override { return "mpi"; }
  c10::intrusive_ptr<Options> getBackendOptions() override {
    auto o = c10::make_intrusive<Options>("mpi", timeout_);
    o->group_name = name_;
    return o;
  }
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  MPI_Comm comm() const { return comm_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
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

  c10d::ReduceOp::RedOpType red(const c10d::ReduceOp& op) { return static_cast<c10d::ReduceOp::RedOpType>(op); }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    auto t = single(tensors, "allreduce");
    std::string d = "allreduce(tensor " + describe_tensor(t) + ", op " + op_name(red(opts.reduceOp)) + ")";
    return enqueue_async(c10d::OpType::ALLREDUCE, d, {t}, opts.timeout, allreduce_op(t, red(opts.reduceOp), d));
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
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

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
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

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
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

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    std::string d = "_allgather_base(input " + describe_tensor(input) + ", output " + describe_tensor(output) + ")";
    return enqueue_async(c10d::OpType::_ALLGATHER_BASE, d, {output}, opts.timeout, allgather_base_op(output, input, d));
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
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

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
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

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
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

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
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

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
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

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    std::string d = "_reduce_scatter_base(input " + describe_tensor(input) + ", output " + describe_tensor(output) +
                    ", op " + op_name(red(opts.reduceOp)) + ")";
    return enqueue_async(c10d::OpType::_REDUCE_SCATTER_BASE, d, {output}, opts.timeout,
                         reduce_scatter_op(output, input, red(opts.reduceOp), d));
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
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

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override {
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

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    Op op{"MPI_Ibarrier", [this](MPI_Request* r) { return MPI_Ibarrier(comm_, r); }, [] {}, "barrier()"};
    return enqueue_async(c10d::OpType::BARRIER, "barrier()", {}, opts.timeout, std::move(op));
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool /*waitAllRanks*/) override {
    barrier(opts)->wait();
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
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

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return recv_from(tensors, src, tag, "recv");
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return recv_from(tensors, MPI_ANY_SOURCE, tag, "recvAnysource");
  }

 private:
  c10::intrusive_ptr<c10d::Work> recv_from(std::vector<at::Tensor>& tensors, int src, int tag, const char* api) {
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

  // A point-to-point operation: started on the MPI thread, completed when MPI_Test says so.
  c10::intrusive_ptr<c10d::Work> p2p(c10d::OpType type, const std::string& d, std::vector<at::Tensor> outputs,
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

  // One non-blocking MPI operation: `start` issues it (on the MPI thread), `after` finishes the outputs
  // once MPI has completed it (AVG's division, copies back into non-contiguous tensors). The buffers MPI
  // uses are captured by value in `start`, which is kept until completion (enqueue_async).
  struct Op {
    const char* call;
    std::function<int(MPI_Request*)> start;
    std::function<void()> after;
    std::string desc;  // for errors: the collective, its shapes and dtypes
  };

  Op allreduce_op(const at::Tensor& t, c10d::ReduceOp::RedOpType op, const std::string& d) {
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

  Op allgather_base_op(const at::Tensor& output, const at::Tensor& input, const std::string& d) {
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

  Op reduce_scatter_op(const at::Tensor& output, const at::Tensor& input, c10d::ReduceOp::RedOpType op,
                       const std::string& d) {
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
  std::function<void()> blocking(Op op) {
    return [op = std::move(op), this] {
      run_nb(op.start, op.call, op.desc);
      op.after();
    };
  }

  // A single collective, asynchronous on the MPI thread: started when its turn comes, then completed by the
  // MPI thread's polling while it starts the next ones, so that (as with Gloo's worker threads) FSDP's
  // reduce-scatter and the next all-gather progress together. Every rank starts them in issue order, which
  // MPI requires of non-blocking collectives on one communicator.
  c10::intrusive_ptr<c10d::Work> enqueue_async(c10d::OpType type, const std::string& d, std::vector<at::Tensor> outputs,
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

  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const std::string& d, std::vector<at::Tensor> outputs,
                                         std::chrono::milliseconds op_timeout, std::function<void()> fn) {
    auto timeout = op_timeout == c10d::kUnsetTimeout ? timeout_ : op_timeout;
    auto work = c10::make_intrusive<MpiWork>(getRank(), type, "group '" + name_ + "': " + d, std::move(outputs),
                                             timeout);
    MpiThread::get().post([work, fn = std::move(fn)] { work->run(fn); });
    return work;
  }

  // Starts a non-blocking MPI call with `start`, then waits for it with wait_request().
  template <typename F>
  void run_nb(F start, const char* call, const std::string& d) const {
    MPI_Request req = MPI_REQUEST_NULL;
    check(start(&req), call, d);
    check(wait_request(&req), call, d);
  }

  // Waits for `req` without taking a core from the compute threads. MPI's blocking collectives spin until
  // every peer has arrived; with FSDP's prefetching the MPI thread often waits while this rank (or the
  // peer) computes, and spinning there took a core from the compute threads (GPT "small" on 2 cores: 1.7x
  // Gloo's step time; docs/BENCHMARKS.md). So: spin FSDP_MPI_SPIN_US (default 50) microseconds, which
  // covers a peer that is already there, then test with sleeps doubling from 20 us up to 500 us (MPI_Test
  // also drives the collective's progress).
  static int wait_request(MPI_Request* req) {
    const auto spin = MpiThread::spin_us();
    const auto t0 = std::chrono::steady_clock::now();
    auto pause = std::chrono::microseconds(20);
    for (;;) {
      int flag = 0;
      int rc = MPI_Test(req, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS || flag) return rc;
      if (std::chrono::steady_clock::now() - t0 < spin) continue;
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(500));
    }
  }

  // MPI call failed: c10::Error naming the call, the collective (shapes, dtypes), the rank and MPI's reason.
  void check(int rc, const char* call, const std::string& d) const {
    if (rc == MPI_SUCCESS) return;
    char msg[MPI_MAX_ERROR_STRING] = {0};
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    TORCH_CHECK(false, "ProcessGroupMPI: ", call, " failed in ", d, " of group '", name_, "' on rank ", getRank(),
                " of ", getSize(), ": ", std::string(msg, static_cast<size_t>(len)), " (MPI error code ", rc, ")");
  }

  at::Tensor single(std::vector<at::Tensor>& ts, const char* api) const {
    TORCH_CHECK(ts.size() == 1, "ProcessGroupMPI: ", api, ": expected exactly one tensor (one device per rank), got ",
                ts.size(), " on rank ", getRank());
    cpu(ts[0], api);
    return ts[0];
  }
  void cpu(const at::Tensor& t, const std::string& d) const {
    TORCH_CHECK(t.device().is_cpu(), "ProcessGroupMPI: ", d, ": tensor on ", t.device(),
                ", expected a CPU tensor (the mpi backend runs CPU tensors; use nccl for CUDA)");
  }
  int count(const at::Tensor& t, const std::string& d) const {
    TORCH_CHECK(t.numel() <= INT_MAX, "ProcessGroupMPI: ", d, ": ", t.numel(),
                " elements exceed MPI's int count (", INT_MAX, ") on rank ", getRank(),
                ". Fix: split the tensor");
    return static_cast<int>(t.numel());
  }
  void check_root(int64_t root, const std::string& d) const {
    TORCH_CHECK(root >= 0 && root < getSize(), "ProcessGroupMPI: ", d, ": rank ", root, " is out of range for a group ",
                "of size ", getSize());
  }
  void check_avg(c10d::ReduceOp::RedOpType op, const at::Tensor& t, const std::string& d) const {
    TORCH_CHECK(op != c10d::ReduceOp::AVG || at::isFloatingType(t.scalar_type()), "ProcessGroupMPI: ", d,
                ": AVG of ", t.scalar_type(), " tensors is not an integer. Fix: SUM, then divide yourself");
    TORCH_CHECK(op != c10d::ReduceOp::PREMUL_SUM && op != c10d::ReduceOp::UNUSED, "ProcessGroupMPI: ", d,
                ": reduce op ", op_name(op), " is not supported");
  }

  MPI_Comm comm_;
  std::chrono::milliseconds timeout_;
  std::string name_;
};

// A communicator with errors returned as codes (then mapped to c10::Error) instead of MPI aborting.
MPI_Comm returning_errors(MPI_Comm c) {
  if (c != MPI_COMM_NULL) MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
  return c;
}

c10::intrusive_ptr<ProcessGroupMPI> dup_backend(const ProcessGroupMPI& b, const std::string& name) {
  MPI_Comm c = MpiThread::get().call([&] {
    MPI_Comm out = MPI_COMM_NULL;
    MPI_Comm_dup(b.comm(), &out);
    return returning_errors(out);
  });
  return c10::make_intrusive<ProcessGroupMPI>(c, b.getRank(), b.getSize(), b.timeout(), name);
}

// Debug mode (FSDP_DEBUG=DETAIL): the fingerprints go over a duplicate communicator, so they never
// interleave with the checked collectives.
void add_debug_backend(const ProcessGroupPtr& group, const ProcessGroupMPI& b, const std::string& name) {
  if (debug_mode() && group->size() > 1) ProcessGroupAccess::set_debug_backend(*group, dup_backend(b, name + "/fsdp_debug"));
}

}  // namespace

std::string mpi_thread_level() {
  if (!MpiThread::started()) return "";
  switch (MpiThread::get().provided()) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "?";
}

ProcessGroupPtr init_mpi_process_group(const std::optional<std::string>& backend, torch::DeviceType device_type,
                                       const LaunchEnv& env, std::chrono::milliseconds timeout,
                                       const c10::intrusive_ptr<c10d::Store>& given_store) {
  std::optional<std::string> chosen = backend ? backend : mpi_default_backend(env, device_type);
  if (!chosen || *chosen != "mpi") return nullptr;
  TORCH_CHECK(device_type == torch::kCPU, "init_process_group: backend mpi runs CPU tensors only, got device type ",
              device_type, ". Fix: backend nccl for CUDA, or device_type kCPU");
  auto& mt = MpiThread::get();
  const int rank = mt.world_rank(), size = mt.world_size();
  TORCH_CHECK(size == env.world_size && rank == env.rank, "init_process_group: backend mpi: MPI_COMM_WORLD has ", size,
              " process(es) and this is rank ", rank, ", but the launcher's environment (", env.source,
              ") says rank ", env.rank, " of ", env.world_size,
              ": the processes were not started by one mpirun. Fix: launch with `mpirun -np ", env.world_size,
              " PROGRAM` (as root add --allow-run-as-root; with more ranks than cores add --oversubscribe), or use "
              "backend gloo under fsdprun/torchrun");

  // The store (see process_group_mpi.h): given, at MASTER_ADDR:MASTER_PORT, or hosted by rank 0 on a free
  // port whose address the other ranks learn over MPI.
  c10::intrusive_ptr<c10d::Store> store = given_store;
  const char* addr_env = std::getenv("MASTER_ADDR");
  const char* port_env = std::getenv("MASTER_PORT");
  const bool have_master = addr_env && *addr_env && port_env && *port_env;
  if (!store && size > 1) {
    c10d::TCPStoreOptions sopts;
    sopts.timeout = timeout;
    sopts.isServer = rank == 0;
    sopts.numWorkers = size;
    sopts.waitWorkers = false;  // the clients learn the port only after the server exists
    std::string host;
    if (have_master) {
      host = env.master_addr;
      sopts.port = static_cast<std::uint16_t>(env.master_port);
    } else {
      sopts.port = 0;  // rank 0: any free port
    }
    // Rank 0 advertises loopback when all ranks share its node, else its host name.
    struct Address {
      char host[256];
      int port;
    } a{};
    try {
      if (rank == 0) {
        auto server = c10::make_intrusive<c10d::TCPStore>(have_master ? host : "127.0.0.1", sopts);
        store = server;
        const char* local_size = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
        std::string advertised = have_master ? host : "127.0.0.1";
        if (!have_master && !(local_size && std::atoi(local_size) == size)) {
          char name[256] = {0};
          gethostname(name, sizeof(name) - 1);
          advertised = name;
        }
        std::snprintf(a.host, sizeof(a.host), "%s", advertised.c_str());
        a.port = server->getPort();
      }
      mt.call([&] { MPI_Bcast(&a, static_cast<int>(sizeof(a)), MPI_BYTE, 0, MPI_COMM_WORLD); });
      if (rank != 0) {
        sopts.port = static_cast<std::uint16_t>(a.port);
        store = c10::make_intrusive<c10d::TCPStore>(std::string(a.host), sopts);
      }
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "init_process_group: backend mpi: rank ", rank, " of ", size, " could not reach the TCPStore ",
                  "(libfsdp's side channel for checkpoints and debug mode) at ", (rank == 0 ? host : a.host), ":",
                  (rank == 0 ? sopts.port : a.port), " within ", timeout.count(), " ms: ", e.what(),
                  ". Fix: export MASTER_ADDR/MASTER_PORT (mpirun -x) to an address every rank can reach");
    }
    store = c10::make_intrusive<c10d::PrefixStore>("default_pg", store);
  }
  if (!store) store = c10::make_intrusive<c10d::HashStore>();  // one process: a store of its own

  MPI_Comm world = mt.call([] {
    MPI_Comm c = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &c);
    return returning_errors(c);
  });
  auto b = c10::make_intrusive<ProcessGroupMPI>(world, rank, size, timeout, "default");
  auto group = std::make_shared<ProcessGroup>(b, torch::Device(torch::kCPU), store, std::vector<int>{}, timeout,
                                              "default");
  add_debug_backend(group, *b, "default");
  return group;
}

ProcessGroupPtr new_mpi_group(const ProcessGroupPtr& parent, const std::vector<int>& ranks, const std::string& name) {
  auto* pb = dynamic_cast<ProcessGroupMPI*>(parent->backend().get());
  if (!pb) return nullptr;
  int me = -1;
  std::vector<int> global;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == parent->rank()) me = static_cast<int>(i);
    global.push_back(parent->global_ranks()[ranks[i]]);
  }
  TORCH_CHECK(me >= 0, "new_group: rank ", parent->rank(), " of ", parent->str(), " is not in the new group '", name,
              "'");
  // MPI_Comm_create_group is collective over the new group's members only (libfsdp's new_group contract);
  // the tag keeps concurrent creations on one parent apart.
  const int tag = static_cast<int>(std::hash<std::string>{}(name) % 32768);
  MPI_Comm c = MpiThread::get().call([&] {
    MPI_Group pg = MPI_GROUP_NULL, g = MPI_GROUP_NULL;
    MPI_Comm_group(pb->comm(), &pg);
    MPI_Group_incl(pg, static_cast<int>(ranks.size()), ranks.data(), &g);
    MPI_Comm out = MPI_COMM_NULL;
    int rc = MPI_Comm_create_group(pb->comm(), g, tag, &out);
    MPI_Group_free(&g);
    MPI_Group_free(&pg);
    TORCH_CHECK(rc == MPI_SUCCESS && out != MPI_COMM_NULL, "new_group: MPI_Comm_create_group failed for group '",
                name, "' on rank ", parent->rank(), " of ", parent->str(), " (MPI error code ", rc, ")");
    return returning_errors(out);
  });
  auto b = c10::make_intrusive<ProcessGroupMPI>(c, me, static_cast<int>(ranks.size()), parent->timeout(), name);
  auto store = c10::make_intrusive<c10d::PrefixStore>(name, parent->store());
  auto group = std::make_shared<ProcessGroup>(b, parent->device(), store, global, parent->timeout(), name);
  add_debug_backend(group, *b, name);
  return group;
}

#endif  // FSDP_WITH_MPI

}  // namespace fsdp::detail
