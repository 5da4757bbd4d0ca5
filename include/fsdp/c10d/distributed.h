// Process groups: rank discovery from the launcher's environment, rendezvous on a c10d TCPStore,
// and the c10d backend (Gloo on CPU, NCCL on CUDA) every other libfsdp API communicates through.
//
// Mirrors torch.distributed.init_process_group / new_group / get_rank / get_world_size.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/arg.h>
#include <torch/types.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "fsdp/c10d/flight_recorder.h"

namespace fsdp {

namespace detail {
struct ProcessGroupAccess;  // src/c10d/process_group_access.h
class ProgressPublisher;    // src/c10d/progress_publisher.h
class ShmTransport;         // src/c10d/shm_transport.h
}  // namespace detail

/// Who launched us and where this process sits, as read from the environment.
/// Sources, in order: torchrun/fsdprun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
/// `MASTER_ADDR`, `MASTER_PORT`), Open MPI (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
/// `OMPI_COMM_WORLD_LOCAL_RANK`) and Slurm's srun (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`; the
/// processes on this node from `SLURM_STEP_TASKS_PER_NODE` at `SLURM_NODEID`). Under srun, `MASTER_ADDR`
/// defaults to the first host of `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`) and `MASTER_PORT` to
/// 20000 + 10 * (`SLURM_JOB_ID` % 1000) + (`SLURM_STEP_ID` % 10); an exported `MASTER_ADDR`/`MASTER_PORT`
/// overrides either (docs/SLURM.md).
struct LaunchEnv {
  int rank = 0;               ///< global rank, 0 <= rank < world_size
  int world_size = 1;         ///< number of processes in the job
  int local_rank = 0;         ///< rank within this node (selects the CUDA device)
  int local_world_size = 1;   ///< processes on this node
  std::string master_addr;    ///< host of the TCPStore
  int master_port = 29500;    ///< port of the TCPStore
  bool use_agent_store = false;  ///< `TORCHELASTIC_USE_AGENT_STORE=True`: the launcher hosts the store
  int restart_count = 0;      ///< `TORCHELASTIC_RESTART_COUNT` (selects the store prefix with an agent store)
  std::string source;         ///< "torchrun", "slurm" or "openmpi"
  /// Where master_addr/master_port came from, for messages: "MASTER_ADDR/MASTER_PORT", or under srun e.g.
  /// "MASTER_ADDR from the first host of SLURM_STEP_NODELIST=node[01-02], MASTER_PORT = 20000 + ...".
  std::string rendezvous_origin = "MASTER_ADDR/MASTER_PORT";
};

/// Reads `LaunchEnv` from the environment.
/// Throws c10::Error naming the variable when a required one is missing or invalid, e.g.
/// "init_process_group: WORLD_SIZE=0 is invalid: expected a positive integer".
/// `MASTER_ADDR`/`MASTER_PORT` are required only when world_size > 1 (and, under srun, only when Slurm's
/// node list or job id are missing). Under Slurm it also throws, naming `SLURM_STEP_ID`, in the batch script
/// of `sbatch --ntasks N` (N > 1): a single process there would wait for N - 1 ranks that never start; and
/// on a malformed `SLURM_STEP_NODELIST`/`SLURM_JOB_NODELIST`, naming the variable and the position.
LaunchEnv read_launch_env();

/// Options of init_process_group. Every field is optional.
/// Example: `fsdp::init_process_group(fsdp::InitOptions().device_type(torch::kCUDA).timeout(std::chrono::minutes(5)))`
struct InitOptions {
  /// "gloo", "nccl" or "mpi" (CPU; builds with Open MPI, see docs/MULTINODE.md, MPI). (Default: "nccl" when
  /// `device_type` is CUDA; "mpi" under mpirun without MASTER_ADDR in a build with MPI; else "gloo")
  TORCH_ARG(std::optional<std::string>, backend);
  /// Device type to compute on: kCPU or kCUDA; with kCUDA each rank takes cuda:LOCAL_RANK.
  /// (Default: kCPU)
  TORCH_ARG(torch::DeviceType, device_type) = torch::kCPU;
  /// Timeout of the rendezvous and of every collective.
  /// (Default: `FSDP_TIMEOUT_S` seconds from the environment if set, else 30 min, as PyTorch's)
  TORCH_ARG(std::optional<std::chrono::milliseconds>, timeout);
  /// Overrides the environment (e.g. for tests). (Default: from read_launch_env())
  TORCH_ARG(std::optional<LaunchEnv>, env);
  /// Gloo worker threads per group. (Default: 2)
  TORCH_ARG(int, gloo_threads) = 2;
  /// Debug mode: before every collective the ranks compare a fingerprint (sequence number, op, shapes,
  /// dtypes) over a side Gloo group and all raise on a mismatch. (Default: `FSDP_DEBUG=DETAIL` in the
  /// environment; off otherwise, and then free)
  TORCH_ARG(std::optional<bool>, debug);
  /// Rendezvous on this store instead of the TCPStore at MASTER_ADDR:MASTER_PORT (e.g. a c10d::HashStore
  /// for a one-process job started without a launcher, with `env` = LaunchEnv{}). (Default: null)
  TORCH_ARG(c10::intrusive_ptr<c10d::Store>, store);
};

/// Whether groups created from now on run in debug mode (FSDP_DEBUG=DETAIL or InitOptions::debug).
bool debug_mode();

/// Bytes one rank moved over the transport for one kind of collective on one group: what its sockets
/// (Gloo), NCCL's channels or MPI carried, not the tensors' sizes. See CommStats.
struct CommBytes {
  uint64_t sent = 0;      ///< bytes this rank sent to other ranks
  uint64_t received = 0;  ///< bytes this rank received from other ranks
  uint64_t count = 0;     ///< collectives counted (those that reached the backend; size-1 groups never do)
};

/// Transport bytes of one rank on one group, per collective kind, counted by libfsdp's collectives
/// layer (src/c10d/collectives.cpp) when each collective is issued, from the algorithm that runs it:
/// - all_gather_into_tensor: Gloo's ring all-gather: (N-1)/N of the output sent and received;
/// - reduce_scatter_tensor: on Gloo, libfsdp's own reduce-scatter (an all-to-all of the input's chunks,
///   then a local reduction), counted from the sizes it sends and receives: (N-1)/N of the input each way;
/// - all_reduce: Gloo's ring all-reduce (a reduce-scatter then an all-gather, in segments): about
///   2(N-1)/N of the tensor each way, computed segment by segment as Gloo cuts it;
/// - broadcast: Gloo's binomial tree: a non-root receives the tensor once; a rank sends it once per child.
/// On a one-host Gloo group the all-gathers, the reduce-scatter's all-to-all, and the all-reduces and
/// broadcasts of plain dtypes go through shared memory (see make_gloo_group): counted with the same
/// figures as on Gloo's sockets, so that the ratio to FSDP's minimum does not depend on the transport.
/// NCCL and MPI groups are counted with the nominal figures of the ring algorithms (the same as above for
/// all-gather and reduce-scatter, 2(N-1)/N for all-reduce, a chain for broadcast: every rank but the last
/// sends the tensor once): those libraries choose their algorithm at run time and do not report bytes.
/// Barriers and the debug-mode fingerprint exchange (FSDP_DEBUG) are not counted. FSDP's theoretical
/// minimum per step is (N-1)/N of each all-gather's output and of each reduce-scatter's input; a ratio of
/// the measured bytes to it shows the overhead of the transport. Units: bytes. No PyTorch equivalent
/// (PyTorch's profiler reports collectives' tensor sizes, not the bytes on the wire).
struct CommStats {
  CommBytes all_gather_into_tensor;
  CommBytes reduce_scatter_tensor;
  CommBytes all_reduce;
  CommBytes broadcast;
  /// Sum over the kinds above of the bytes sent.
  uint64_t sent() const {
    return all_gather_into_tensor.sent + reduce_scatter_tensor.sent + all_reduce.sent + broadcast.sent;
  }
  /// Sum over the kinds above of the bytes received.
  uint64_t received() const {
    return all_gather_into_tensor.received + reduce_scatter_tensor.received + all_reduce.received +
           broadcast.received;
  }
};

/// A group of ranks and the c10d backend that runs their collectives.
/// Mirrors torch.distributed.ProcessGroup for one device type. Cheap to share: hold it as
/// `ProcessGroupPtr`. All collectives must be issued in the same order on every rank of the group.
class ProcessGroup {
 public:
  /// Wraps an existing c10d backend (e.g. one the caller built). `global_ranks[i]` is the global rank
  /// of group rank i (Default: 0..size-1). `store` (may be null) lets new_group() build sub-groups.
  ProcessGroup(c10::intrusive_ptr<c10d::Backend> backend, torch::Device device,
               c10::intrusive_ptr<c10d::Store> store = {}, std::vector<int> global_ranks = {},
               std::chrono::milliseconds timeout = std::chrono::minutes(30), std::string name = "default");

  int rank() const { return rank_; }            ///< this process's rank in the group
  int size() const { return size_; }            ///< number of ranks in the group
  torch::Device device() const { return device_; }  ///< the device this rank computes on
  torch::DeviceType device_type() const { return device_.type(); }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const std::string& name() const { return name_; }  ///< e.g. "default", "mesh/shard/0"
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  const c10::intrusive_ptr<c10d::Backend>& backend() const { return backend_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  /// Number of collectives issued on this group so far (identical on every rank when in sync).
  uint64_t seq() const { return seq_; }
  /// Number of collectives of kind `op` ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
  /// "broadcast", "barrier") that reached the backend (a group of size 1 never does).
  uint64_t collective_count(const std::string& op) const;
  /// Bytes of the collectives of kind `op` that reached the backend: the output size of an
  /// all-gather, the input size of a reduce-scatter, the tensor size otherwise.
  uint64_t collective_bytes(const std::string& op) const;
  /// Bytes this rank sent and received over the transport on this group since it was created or since
  /// reset_comm_stats(), per collective kind (see CommStats for how each figure is derived).
  const CommStats& comm_stats() const { return comm_stats_; }
  /// Zeroes comm_stats() (e.g. before a measured step). Only affects this rank's counters.
  void reset_comm_stats() { comm_stats_ = CommStats(); }
  /// Seconds this rank spent blocked in Work::wait() on this group: communication not hidden behind
  /// compute.
  double wait_seconds() const { return wait_seconds_; }

  /// "ProcessGroup(name=default, backend=gloo, rank=1, size=3)".
  std::string str() const;

  /// The last collectives of this group (see flight_recorder.h).
  FlightRecorder& flight_recorder() const { return *recorder_; }
  /// Writes the flight recorder as JSON into `dir` (Default: FSDP_FLIGHT_RECORDER_DIR); returns the path.
  std::string dump_flight_recorder(const std::string& dir = "") const;
  /// Side Gloo backend that compares collective fingerprints in debug mode (null when off).
  const c10::intrusive_ptr<c10d::Backend>& debug_backend() const { return debug_backend_; }
  /// Ranks of the group that have not reached collective `seq` according to the store, e.g. after a
  /// timeout. Empty when unknown: no store, or a c10d::FileStore, on which no marks are kept because a
  /// killed rank's cut write would hang every reader (src/c10d/distributed.cpp: [Note: no progress marks
  /// on a FileStore]).
  std::vector<int> lagging_ranks(uint64_t seq) const;

 private:
  // The library's bookkeeping (sequence numbers, counters, ...) is written through this accessor only.
  friend struct detail::ProcessGroupAccess;
  /// Publishes in the store that this rank reached collective `seq` (read by lagging_ranks()).
  void note_progress(uint64_t seq);

  c10::intrusive_ptr<c10d::Backend> backend_;
  torch::Device device_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::vector<int> global_ranks_;
  std::chrono::milliseconds timeout_;
  std::string name_;
  int rank_ = 0;
  int size_ = 1;
  uint64_t seq_ = 0;
  uint64_t subgroups_ = 0;
  std::map<std::string, uint64_t> counts_;
  std::map<std::string, uint64_t> bytes_;
  double wait_seconds_ = 0;
  CommStats comm_stats_;
  std::shared_ptr<FlightRecorder> recorder_ = std::make_shared<FlightRecorder>();
  std::shared_ptr<detail::ProgressPublisher> progress_;  // made on the first note_progress
  c10::intrusive_ptr<c10d::Backend> debug_backend_;
  std::shared_ptr<detail::ShmTransport> shm_;  // one-host Gloo groups: see [Note: shared-memory transport]
};
using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

/// Initialises the default process group from the launcher's environment: rendezvous on a c10d
/// TCPStore at MASTER_ADDR:MASTER_PORT (a client of the launcher's store when
/// `TORCHELASTIC_USE_AGENT_STORE=True`, else hosted by rank 0), then a Gloo (CPU) or NCCL (CUDA)
/// backend. Honours `GLOO_SOCKET_IFNAME` (NCCL reads `NCCL_DEBUG`, `NCCL_DEBUG_SUBSYS`,
/// `NCCL_SOCKET_IFNAME` itself). The returned group's device() is the device this rank must use
/// (cuda:LOCAL_RANK on CUDA). With CUDA, that device becomes the current CUDA device of the process
/// before any CUDA work (NCCL's communicator, the caching allocator, libfsdp's streams): as
/// `torch.cuda.set_device(local_rank)`, which users forget, leaving every rank on cuda:0.
/// Also sets the group as the default group (see default_process_group()).
/// Throws c10::Error when the environment is incomplete, the master is unreachable within
/// `timeout`, CUDA is requested but unavailable, or there are fewer CUDA devices than local ranks.
/// Mirrors torch.distributed.init_process_group.
ProcessGroupPtr init_process_group(const InitOptions& options = {});

/// Builds a Gloo group of `size` ranks over `store` (e.g. an in-memory c10d::HashStore shared by
/// threads, as the test harness does). Used by init_process_group and new_group.
/// When all ranks run on one host (same boot id, hostname and ipc/mnt/net/pid namespaces), the group's
/// all_gather_into_tensor, reduce_scatter_tensor, and all_reduce and broadcast of contiguous fp32, fp64,
/// fp16, bf16, int8, uint8, int32 and int64 CPU tensors move their bytes through a shared-memory segment
/// (/dev/shm, 2 x 2 MiB per rank, reserved at creation) on a worker thread instead of Gloo's loopback
/// sockets, reducing in Gloo's ring order ([Note: Gloo ring order]); everything else (barriers,
/// point-to-point, other dtypes) stays on Gloo. Results are identical bit for bit; a rank that skips or
/// disagrees on such a collective, or whose process exits, makes the others fail (after the timeout, at
/// once, or within a fraction of a second). `FSDP_SHM_TRANSPORT=0` keeps the bytes on Gloo; if the
/// segment cannot be made (e.g. /dev/shm full: each group takes 4 MiB x size of it) the group warns and
/// stays on Gloo. Ranks must issue such collectives in the same order as the group's other collectives
/// (each is checked against its number in the group: a reordering fails at once). A process forked
/// after the group's creation cannot use it. Throws c10::Error when the rendezvous fails or
/// FSDP_SHM_TRANSPORT is neither 0 nor 1 on any rank (every rank then throws, naming that rank).
ProcessGroupPtr make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                std::chrono::milliseconds timeout, std::vector<int> global_ranks = {},
                                std::string name = "default", int threads = 2);

/// Wraps a caller's c10d::ProcessGroup: its backend for `device.type()` is used.
ProcessGroupPtr from_c10d(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, torch::Device device);

/// Creates a sub-group of `parent` holding `ranks` (group ranks of `parent`, sorted, distinct).
/// Must be called by exactly the ranks in `ranks` (unlike PyTorch, other ranks need not call it).
/// Returns the group for this rank. Throws if this rank is not in `ranks` or `parent` has no store.
/// Mirrors torch.distributed.new_group.
ProcessGroupPtr new_group(const ProcessGroupPtr& parent, const std::vector<int>& ranks,
                          const std::string& name);

/// The group set by init_process_group (or set_default_process_group). Throws if none is set.
/// The test harness sets a per-thread default, which takes precedence over the process-wide one.
ProcessGroupPtr default_process_group();
/// Sets the process-wide default group (null clears it).
void set_default_process_group(ProcessGroupPtr group);
/// Sets the default group of the calling thread only (used when ranks are threads; null clears it).
void set_thread_default_process_group(ProcessGroupPtr group);
/// True when a default group is set for this thread or process.
bool is_initialized();

/// Shuts down `group`'s backend (NCCL: its communicators and watchdog; Gloo: nothing) and, when it is the
/// process-wide or this thread's default group, clears that. (Default: the default group; a no-op when
/// none is set.) Call before the process exits: a NCCL group destroyed during static destruction, after
/// CUDA's own teardown, can crash the exit. Mirrors torch.distributed.destroy_process_group.
void destroy_process_group(ProcessGroupPtr group = nullptr);

}  // namespace fsdp
