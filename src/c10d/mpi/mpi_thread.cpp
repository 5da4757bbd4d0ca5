// The MPI thread and MpiWork (see mpi_thread.h). Compiled only in a build with MPI (CMakeLists.txt).
#include "c10d/mpi/mpi_thread.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include <c10/util/Exception.h>

namespace fsdp::detail {

MpiThread& MpiThread::get() {
  static MpiThread* t = new MpiThread();
  return *t;
}

void MpiThread::post(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
}

MpiThread::MpiThread() {
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

void MpiThread::init() {
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
void MpiThread::loop() {
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

std::chrono::microseconds MpiThread::spin_us() {
  static const auto spin = std::chrono::microseconds([] {
    const char* v = std::getenv("FSDP_MPI_SPIN_US");
    return v ? std::max(0L, std::atol(v)) : 50L;
  }());
  return spin;
}

int MpiThread::wait_request(MPI_Request* req) {
  const auto spin = spin_us();
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

// Tests the pending requests; runs the completion of those done. Returns how many completed.
int MpiThread::poll() {
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

// On the MPI thread at exit: meets the other ranks in a non-blocking barrier until `deadline`, then (met)
// calls MPI_Finalize. Returns whether the ranks met; true without either when the program owns MPI.
bool MpiThread::exit_barrier(std::chrono::steady_clock::time_point deadline) {
  if (!owns_mpi_) return true;
  MPI_Request req;
  bool met = false;
  if (MPI_Ibarrier(exit_comm_, &req) == MPI_SUCCESS) {
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
    finalized_ = true;
  }
  return met;
}

// At exit every rank meets in a non-blocking barrier, then calls MPI_Finalize. A rank that exits while
// others are still running (an error on this rank only), or whose MPI thread is stuck in a collective
// that will never complete, gives up after FSDP_MPI_EXIT_TIMEOUT_S (default 60) seconds and exits
// without MPI_Finalize: mpirun then stops the whole job instead of leaving the other ranks hanging.
void MpiThread::at_exit() {
  if (!started_) return;
  auto& t = get();
  long limit_s = 60;
  if (const char* v = std::getenv("FSDP_MPI_EXIT_TIMEOUT_S")) limit_s = std::max(1L, std::atol(v));
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(limit_s);
  auto done = std::make_shared<std::promise<bool>>();
  auto fut = done->get_future();
  t.post([&t, done, deadline] { done->set_value(t.exit_barrier(deadline)); });
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

MpiWork::MpiWork(int rank, c10d::OpType type, std::string desc, std::vector<at::Tensor> outputs,
                 std::chrono::milliseconds timeout)
    : c10d::Work(rank, type),
      desc_(std::move(desc)),
      outputs_(std::move(outputs)),
      timeout_(timeout),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

bool MpiWork::wait(std::chrono::milliseconds timeout) {
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

void MpiWork::run(const std::function<void()>& fn) {
  std::exception_ptr error;
  try {
    fn();
  } catch (...) {
    error = std::current_exception();
  }
  complete(error);
}

void MpiWork::complete(std::exception_ptr error) {
  finish(error);
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

}  // namespace fsdp::detail
