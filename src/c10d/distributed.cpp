#include "fsdp/c10d/distributed.h"

#include <netdb.h>

#include <cstdlib>
#include <mutex>
#include <sstream>
#include <thread>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include "c10d/mpi/process_group_mpi.h"
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "c10d/gloo_group.h"
#include "c10d/network_check.h"
#include "c10d/process_group_access.h"
#include "c10d/slurm_env.h"
#include "c10d/progress_publisher.h"
#include "c10d/shm_transport.h"
#include "util.h"

namespace fsdp {
namespace {

std::optional<std::string> getenv_str(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

// Parses an integer environment variable; throws naming the variable on garbage.
std::optional<long> getenv_int(const char* name) {
  auto s = getenv_str(name);
  if (!s) return std::nullopt;
  char* end = nullptr;
  long v = std::strtol(s->c_str(), &end, 10);
  TORCH_CHECK(!s->empty() && end != nullptr && *end == '\0', "init_process_group: ", name, "=", *s,
              " is not an integer");
  return v;
}

// [Note: math kernels warmed up once]
// LibTorch's CPU build computes sqrt, exp, tanh, erf... with MKL's vector math (VML, ATen/cpu/vml.h).
// When several threads make the first call of such a function in a process at the same time, one of
// them can get results off by ~2.6e-4 relative (measured with plain LibTorch 2.13, no libfsdp: three
// threads, first sqrt of 18 floats, 2 runs in 400; none after one call on a single thread first). That
// changed AdamW's denominator and clip_grad_norm_'s norm on one rank in ~1 run in 20 of the in-process
// tests, where ranks are threads, and it can hit any process whose intra-op threads split the first
// large sqrt. So every VML-backed op runs once, on one thread, before the first process group exists.
void warm_up_math_kernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    torch::NoGradGuard no_grad;
    for (auto dtype : {torch::kFloat, torch::kDouble}) {
      auto x = torch::full({16}, 0.5, torch::TensorOptions().dtype(dtype));
      const std::vector<torch::Tensor> outs{x.acos(), x.asin(), x.atan(), x.cos(),  x.erf(),   x.erfc(),  x.erfinv(),
                                            x.exp(),  x.log(),  x.log10(), x.log2(), x.sin(),   x.sqrt(),  x.tan(),
                                            x.tanh(), x.trunc(), x.rsqrt(), x.sigmoid(), x.expm1(), x.log1p(), x.lgamma()};
    }
  });
}

// A one-host job: Gloo listens on loopback unless GLOO_SOCKET_IFNAME says otherwise.
bool is_loopback(const std::string& addr) { return addr == "127.0.0.1" || addr == "localhost" || addr == "::1"; }

std::mutex g_default_mutex;
std::optional<bool> g_debug_override;
// Never destroyed unless destroy_process_group() resets it: destroying an NCCL group during static
// destruction, after CUDA's teardown, crashes the process at exit.
ProcessGroupPtr& g_default_group = *new ProcessGroupPtr();
thread_local ProcessGroupPtr t_default_group;

}  // namespace

bool debug_mode() {
  {
    std::lock_guard<std::mutex> lock(g_default_mutex);
    if (g_debug_override) return *g_debug_override;
  }
  auto v = getenv_str("FSDP_DEBUG");
  return v && *v == "DETAIL";
}

namespace {

// The environment variables of rank, world size and local rank, by launcher: torchrun/fsdprun, then
// Open MPI's mpirun, then Slurm's srun.
struct LauncherVars {
  const char* source;
  const char* rank;
  const char* size;
  const char* local;
};
LauncherVars detect_launcher() {
  if (getenv_str("RANK") || getenv_str("WORLD_SIZE")) return {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"};
  if (getenv_str("OMPI_COMM_WORLD_RANK")) {
    return {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"};
  }
  if (getenv_str("SLURM_PROCID")) return {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"};
  TORCH_CHECK(false,
              "init_process_group: RANK is not set (nor SLURM_PROCID or OMPI_COMM_WORLD_RANK): expected the "
              "environment of a launcher. Fix: start the program with `fsdprun --nproc-per-node N PROGRAM` "
              "or `torchrun --no-python --nproc-per-node N PROGRAM`, or set RANK, WORLD_SIZE, MASTER_ADDR "
              "and MASTER_PORT yourself");
  return {};  // (not reached)
}

// The store's address of an srun step of several tasks: MASTER_ADDR/MASTER_PORT when set, else derived
// from SLURM_* (fills `addr`, `port` and env.rendezvous_origin).
void slurm_rendezvous(LaunchEnv& env, std::optional<std::string>& addr, std::optional<long>& port) {
  // The batch script of `sbatch --ntasks N` sees SLURM_PROCID=0 and SLURM_NTASKS=N too, but it is one
  // process, not N tasks: its rank 0 would wait for the others until the timeout. Only srun's tasks
  // (a job step) have SLURM_STEP_ID.
  TORCH_CHECK(getenv_str("SLURM_STEP_ID") || getenv_str("SLURM_STEPID"), "init_process_group: SLURM_PROCID=",
              env.rank, " and SLURM_NTASKS=", env.world_size, " are set but SLURM_STEP_ID is not: this process "
              "is the batch script of Slurm job ", getenv_str("SLURM_JOB_ID").value_or("?"), ", not one of ",
              env.world_size, " tasks of an srun step, so the other ranks would never start. Fix: start it with "
              "`srun PROGRAM` (one task per rank), or with `srun --ntasks-per-node 1 fsdprun ...` per node");
  // See [Note: Slurm rendezvous] (src/c10d/slurm_env.h): the first host of the step, a port from the job id.
  std::string origin;
  if (!addr || addr->empty()) {
    auto derived = detail::slurm_master_addr_from_env();
    TORCH_CHECK(derived.has_value(), "init_process_group: MASTER_ADDR is not set, nor SLURM_STEP_NODELIST or "
                "SLURM_JOB_NODELIST to take it from (SLURM_PROCID=", env.rank, ", SLURM_NTASKS=", env.world_size,
                "): expected srun to set the node list. Fix: launch with srun, or export MASTER_ADDR=<host of "
                "rank 0>");
    addr = derived->addr;
    origin = "MASTER_ADDR from " + derived->origin;
  } else {
    origin = "MASTER_ADDR from the environment";
  }
  if (!port) {
    auto job_id = getenv_int("SLURM_JOB_ID");
    if (!job_id) job_id = getenv_int("SLURM_JOBID");
    TORCH_CHECK(job_id.has_value() && *job_id >= 0, "init_process_group: MASTER_PORT is not set, nor SLURM_JOB_ID "
                "to derive it from (SLURM_PROCID=", env.rank, ", SLURM_NTASKS=", env.world_size, "): expected "
                "srun to set SLURM_JOB_ID. Fix: launch with srun, or export MASTER_PORT=<free TCP port on ", *addr,
                ">");
    const long step_id = getenv_int("SLURM_STEP_ID").value_or(getenv_int("SLURM_STEPID").value_or(0));
    port = detail::slurm_master_port(*job_id, step_id < 0 ? 0 : step_id);
    origin += ", MASTER_PORT = 20000 + 10 * (SLURM_JOB_ID=" + std::to_string(*job_id) + " % 1000) + (SLURM_STEP_ID=" +
              std::to_string(step_id) + " % 10); export MASTER_PORT to choose another";
  } else {
    origin += ", MASTER_PORT from the environment";
  }
  env.rendezvous_origin = origin;
}

}  // namespace

LaunchEnv read_launch_env() {
  LaunchEnv env;
  const LauncherVars vars = detect_launcher();
  env.source = vars.source;
  const char* rank_var = vars.rank;
  const char* size_var = vars.size;
  const char* local_var = vars.local;
  auto rank = getenv_int(rank_var);
  auto size = getenv_int(size_var);
  TORCH_CHECK(rank.has_value(), "init_process_group: ", rank_var, " is not set (", size_var,
              " is): expected this process's rank. Fix: launch with fsdprun or torchrun");
  TORCH_CHECK(size.has_value(), "init_process_group: ", size_var, " is not set (", rank_var,
              " is): expected the number of processes. Fix: launch with fsdprun or torchrun");
  TORCH_CHECK(*size > 0, "init_process_group: ", size_var, "=", *size,
              " is invalid: expected a positive number of processes");
  TORCH_CHECK(*rank >= 0 && *rank < *size, "init_process_group: ", rank_var, "=", *rank,
              " is out of range: expected 0 <= ", rank_var, " < ", size_var, "(", *size, ")");
  env.rank = static_cast<int>(*rank);
  env.world_size = static_cast<int>(*size);
  env.local_rank = static_cast<int>(getenv_int(local_var).value_or(env.rank));
  if (env.source == "slurm") {
    env.local_world_size = detail::slurm_local_world_size_from_env().value_or(env.world_size);
  } else {
    env.local_world_size = static_cast<int>(
        getenv_int(env.source == "torchrun" ? "LOCAL_WORLD_SIZE" : "OMPI_COMM_WORLD_LOCAL_SIZE").value_or(env.world_size));
  }
  env.use_agent_store = getenv_str("TORCHELASTIC_USE_AGENT_STORE").value_or("False") == "True";
  env.restart_count = static_cast<int>(getenv_int("TORCHELASTIC_RESTART_COUNT").value_or(0));

  auto addr = getenv_str("MASTER_ADDR");
  auto port = getenv_int("MASTER_PORT");
  if (env.source == "slurm" && env.world_size > 1) slurm_rendezvous(env, addr, port);
  // Under mpirun with the mpi backend built in, the store's address comes over MPI (process_group_mpi.h).
  if (env.world_size > 1 && !detail::mpi_provides_rendezvous(env.source)) {
    TORCH_CHECK(addr.has_value() && !addr->empty(), "init_process_group: MASTER_ADDR is not set: expected the host of "
                "rank 0 (", rank_var, "=", env.rank, ", ", size_var, "=", env.world_size,
                "). Fix: launch with fsdprun/torchrun or export MASTER_ADDR=<host of rank 0>");
    TORCH_CHECK(port.has_value(), "init_process_group: MASTER_PORT is not set: expected the TCP port of the "
                "store on MASTER_ADDR(", *addr, "). Fix: launch with fsdprun/torchrun or export MASTER_PORT=29500");
  }
  env.master_addr = addr.value_or("127.0.0.1");
  if (port) {
    TORCH_CHECK(*port >= 0 && *port <= 65535, "init_process_group: MASTER_PORT=", *port,
                " is invalid: expected 0..65535");
    env.master_port = static_cast<int>(*port);
  }
  return env;
}

ProcessGroup::ProcessGroup(c10::intrusive_ptr<c10d::Backend> backend, torch::Device device,
                           c10::intrusive_ptr<c10d::Store> store, std::vector<int> global_ranks,
                           std::chrono::milliseconds timeout, std::string name)
    : backend_(std::move(backend)),
      device_(device),
      store_(std::move(store)),
      global_ranks_(std::move(global_ranks)),
      timeout_(timeout),
      name_(std::move(name)) {
  TORCH_CHECK(backend_, "ProcessGroup: expected a c10d backend, got null");
  warm_up_math_kernels();
  rank_ = backend_->getRank();
  size_ = backend_->getSize();
  if (global_ranks_.empty()) {
    for (int r = 0; r < size_; ++r) global_ranks_.push_back(r);
  }
  TORCH_CHECK(static_cast<int>(global_ranks_.size()) == size_, "ProcessGroup: ", global_ranks_.size(),
              " global ranks given for a backend of size ", size_);
}

uint64_t ProcessGroup::collective_count(const std::string& op) const {
  auto it = counts_.find(op);
  return it == counts_.end() ? 0 : it->second;
}

uint64_t ProcessGroup::collective_bytes(const std::string& op) const {
  auto it = bytes_.find(op);
  return it == bytes_.end() ? 0 : it->second;
}

std::string ProcessGroup::dump_flight_recorder(const std::string& dir) const {
  return recorder_->dump(name_, rank_, size_, dir);
}

namespace {
// [Note: no progress marks on a FileStore]
// c10d's FileStore appends a set() as several write()s (the key's length and bytes, then the value's), and
// its readers loop until they have a whole record: a process killed between those writes (SIGKILL, the OOM
// killer) leaves a record cut short, and from then on every check/get of every process spins on it forever
// (its File::read retries a read that returns 0 at the end of the file). The progress marks are written in
// the background at every collective, so a killed rank would often cut one, and the survivors' error path
// (lagging_ranks) would hang instead of failing (tests/c10d/test_shm_transport.cpp:
// KilledRankFailsTheOthersFast hung in CI that way). Groups over a FileStore, bare or under a PrefixStore,
// keep no marks: their errors name the collective and the dead or stalled rank but not the lagging ones.
bool file_backed(c10d::Store* s) {
  while (s) {
    if (dynamic_cast<c10d::FileStore*>(s)) return true;
    auto* prefixed = dynamic_cast<c10d::PrefixStore*>(s);
    if (!prefixed) return false;
    s = prefixed->getUnderlyingStore().get();
  }
  return false;
}
}  // namespace

void ProcessGroup::note_progress(uint64_t seq) {
  if (!store_ || size_ == 1) return;
  if (!progress_ && file_backed(store_.get())) return;  // [Note: no progress marks on a FileStore]
  // Written by a background thread at most once per interval: an inline store round trip per collective,
  // and then a wake-up of that thread per collective, were most of the collectives layer's own cost on tiny
  // models ([Note: progress marks] in progress_publisher.h, docs/BENCHMARKS.md).
  if (!progress_) {
    progress_ = std::make_shared<detail::ProgressPublisher>(store_, "fsdp_progress/" + name_ + "/" + std::to_string(rank_));
  }
  progress_->publish(seq + 1);
}

std::vector<int> ProcessGroup::lagging_ranks(uint64_t seq) const {
  std::vector<int> lagging;
  if (!store_ || file_backed(store_.get())) return lagging;  // [Note: no progress marks on a FileStore]
  // This rank's own mark may still be on its way to the store, and a live peer's may be up to an interval
  // behind it ([Note: progress marks]).
  if (progress_) progress_->flush(std::chrono::seconds(5));
  std::this_thread::sleep_for(detail::ProgressPublisher::kSettle);
  try {
    for (int r = 0; r < size_; ++r) {
      std::string key = "fsdp_progress/" + name_ + "/" + std::to_string(r);
      if (!store_->check({key})) {
        lagging.push_back(r);
        continue;
      }
      auto v = store_->get(key);
      if (std::stoull(std::string(v.begin(), v.end())) < seq + 1) lagging.push_back(r);
    }
  } catch (...) {
    return {};  // the store is gone too: nothing reliable to say
  }
  return lagging;
}

std::string ProcessGroup::str() const {
  std::ostringstream os;
  os << "ProcessGroup(name=" << name_ << ", backend=" << backend_->getBackendName() << ", rank=" << rank_
     << ", size=" << size_ << ")";
  return os.str();
}

namespace detail {

ProcessGroupPtr make_gloo_group_on_sockets(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                          std::chrono::milliseconds timeout, std::vector<int> global_ranks,
                                          const std::string& name, int threads, std::optional<bool> loopback) {
  // A name that is no interface here fails naming the variable (Gloo's own message is "Unable to find
  // address for: X"); init_process_group checks reachability too (src/c10d/network_check.cpp).
  detail::check_socket_ifname("GLOO_SOCKET_IFNAME");
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  // GLOO_SOCKET_IFNAME (comma-separated) selects interfaces, as in PyTorch; otherwise loopback for a
  // one-host job and the hostname's address otherwise.
  if (auto ifnames = getenv_str("GLOO_SOCKET_IFNAME"); ifnames && !ifnames->empty()) {
    std::stringstream ss(*ifnames);
    std::string ifname;
    while (std::getline(ss, ifname, ',')) {
      if (!ifname.empty()) opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    }
  } else {
    // MASTER_ADDR, or under srun without it the first host of the step (src/c10d/slurm_env.h).
    bool local = loopback ? *loopback : is_loopback(detail::rendezvous_host_from_env());
    opts->devices.push_back(local ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                  : c10d::ProcessGroupGloo::createDefaultDevice());
  }
  opts->threads = threads;
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "init_process_group: Gloo rendezvous of group '", name, "' failed on rank ", rank, " of ",
                size, " within ", timeout.count(), " ms: ", detail::message_of(e),
                ". Every rank of the group must start; check that all ranks run and that GLOO_SOCKET_IFNAME "
                "names a reachable interface");
  }
  // Every rank past Gloo's rendezvous before any goes on: Gloo's connectFullMesh returns on one rank while a
  // peer may still be completing its handshake, and a rank that failed right after (a bad FSDP_SHM_TRANSPORT
  // below) would close its sockets under that peer, which then reports a Gloo connection error instead of the
  // refusal every rank should report. Found under load (two test suites at once).
  {
    const std::string prefix = "fsdp_gloo_ready/" + name + "/";
    store->set(prefix + std::to_string(rank), std::vector<uint8_t>{1});
    std::vector<std::string> keys;
    for (int r = 0; r < size; ++r) keys.push_back(prefix + std::to_string(r));
    try {
      store->wait(keys, timeout);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "init_process_group: rank ", rank, " of group '", name, "' finished Gloo's rendezvous but ",
                  "not every rank reported doing so within ", timeout.count(), " ms: ", detail::message_of(e));
    }
  }
  auto group = std::make_shared<ProcessGroup>(backend, torch::Device(torch::kCPU), store, std::move(global_ranks),
                                              timeout, name);
  if (debug_mode() && size > 1) {
    // A side group for fingerprints: its collectives never interleave with the checked ones.
    auto side_opts = c10d::ProcessGroupGloo::Options::create(timeout);
    side_opts->devices = opts->devices;
    side_opts->threads = 1;
    detail::ProcessGroupAccess::set_debug_backend(*group, c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("fsdp_debug", store), rank, size, side_opts));
  }
  return group;
}

}  // namespace detail

ProcessGroupPtr make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                std::chrono::milliseconds timeout, std::vector<int> global_ranks,
                                std::string name, int threads) {
  auto group = detail::make_gloo_group_on_sockets(store, rank, size, timeout, std::move(global_ranks), name, threads,
                                                 std::nullopt);
  // One host: the bytes of the plain collectives through shared memory (src/c10d/shm_transport.h).
  detail::ProcessGroupAccess::set_shm(*group, detail::ShmTransport::create(store, rank, size, timeout, name));
  return group;
}

namespace {

// The steps of init_process_group, in order.

/// InitOptions::timeout, else FSDP_TIMEOUT_S, else 30 min (PyTorch's default).
std::chrono::milliseconds resolve_timeout(const InitOptions& options) {
  if (options.timeout()) return *options.timeout();
  if (auto s = getenv_int("FSDP_TIMEOUT_S")) {
    TORCH_CHECK(*s > 0, "init_process_group: FSDP_TIMEOUT_S=", *s, " is invalid: expected a positive number of seconds");
    return std::chrono::seconds(*s);
  }
  return std::chrono::minutes(30);
}

/// "gloo" or "nccl": InitOptions::backend, else the device type's.
std::string resolve_backend(const InitOptions& options) {
  std::string name = options.backend().value_or(options.device_type() == torch::kCUDA ? "nccl" : "gloo");
  TORCH_CHECK(name == "gloo" || name == "nccl", "init_process_group: unknown backend '", name,
              "': expected \"gloo\" (CPU), \"nccl\" (CUDA) or \"mpi\" (CPU)");
  return name;
}

/// The device this rank computes on (cuda:LOCAL_RANK on CUDA, made the current CUDA device).
torch::Device select_device(const InitOptions& options, const LaunchEnv& env, const std::string& backend_name) {
  if (options.device_type() != torch::kCUDA) {
    TORCH_CHECK(backend_name == "gloo", "init_process_group: backend nccl needs device type CUDA; got CPU");
    return torch::Device(torch::kCPU);
  }
  TORCH_CHECK(torch::cuda::is_available(), "init_process_group: device type CUDA requested but this LibTorch "
              "has no usable CUDA device. Fix: use device_type kCPU (backend gloo) or a CUDA build of LibTorch");
  int n = static_cast<int>(torch::cuda::device_count());
  TORCH_CHECK(env.local_rank < n, "init_process_group: LOCAL_RANK=", env.local_rank, " but this node has only ",
              n, " CUDA device(s): expected --nproc-per-node <= ", n,
              // Each rank takes cuda:SLURM_LOCALID, so every task must see all of its node's GPUs.
              env.source == "slurm" ? " (under srun: SLURM_LOCALID is the local rank; request GPUs with "
                                      "--gpus-per-node=G and --ntasks-per-node=G, not --gpus-per-task or --gpu-bind, "
                                      "which leave each task only its own GPU)" : "");
  torch::Device device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  // Rank-aware device init, before any CUDA work (the rendezvous creates none; NCCL's communicator,
  // the first allocation and FSDP's streams come later and all land on this device).
  c10::impl::getDeviceGuardImpl(torch::kCUDA)->setDevice(device);
  return device;
}

/// The store the default group rendezvous on. With an agent store the launcher hosts the TCPStore and
/// we are clients under the attempt's prefix (torchrun's contract); otherwise rank 0 hosts it.
c10::intrusive_ptr<c10d::Store> connect_store(const InitOptions& options, const LaunchEnv& env,
                                              std::chrono::milliseconds timeout) {
  // An unresolvable host would make the TCPStore retry until the timeout: fail now, naming it.
  {
    addrinfo* res = nullptr;
    int rc = getaddrinfo(env.master_addr.c_str(), nullptr, nullptr, &res);
    if (res) freeaddrinfo(res);
    TORCH_CHECK(rc == 0, "init_process_group: MASTER_ADDR=", env.master_addr, " cannot be resolved (",
                gai_strerror(rc), "; ", env.rendezvous_origin,
                "). Fix: set MASTER_ADDR to the host name or IP address of rank 0");
  }
  c10::intrusive_ptr<c10d::Store> store = options.store();
  c10d::TCPStoreOptions sopts;
  sopts.port = static_cast<std::uint16_t>(env.master_port);
  sopts.timeout = timeout;
  sopts.isServer = !env.use_agent_store && env.rank == 0;
  sopts.numWorkers = env.use_agent_store ? std::nullopt : std::optional<std::size_t>(env.world_size);
  sopts.waitWorkers = !env.use_agent_store;
  sopts.multiTenant = true;
  try {
    if (!store) store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, sopts);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "init_process_group: rank ", env.rank, " of ", env.world_size,
                " could not rendezvous with the TCPStore at MASTER_ADDR:MASTER_PORT = ", env.master_addr, ":",
                env.master_port, (sopts.isServer ? " (hosted by this rank)" : ""), " (", env.rendezvous_origin,
                ") within ", timeout.count(), " ms: ", detail::message_of(e),
                ". Fix: check that rank 0 is running and that MASTER_ADDR/MASTER_PORT are reachable from this host");
  }
  if (env.use_agent_store) {
    store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(env.restart_count), store);
  }
  return c10::make_intrusive<c10d::PrefixStore>("default_pg", store);
}

}  // namespace

ProcessGroupPtr init_process_group(const InitOptions& options) {
  LaunchEnv env = options.env() ? *options.env() : read_launch_env();
  if (options.debug()) {
    std::lock_guard<std::mutex> lock(g_default_mutex);
    g_debug_override = *options.debug();
  }
  const auto timeout = resolve_timeout(options);
  // Backend "mpi", also the default under mpirun without MASTER_ADDR: src/c10d/mpi/process_group_mpi.cpp.
  if (auto g = detail::init_mpi_process_group(options.backend(), options.device_type(), env, timeout, options.store())) {
    set_default_process_group(g);
    return g;
  }
  const std::string backend_name = resolve_backend(options);
  const torch::Device device = select_device(options, env, backend_name);
  // A named interface that does not exist here fails before anything touches the network: at once, on
  // every rank of every host (src/c10d/network_check.h), before another host's failure can stop this one.
  if (backend_name == "gloo") detail::check_socket_ifname("GLOO_SOCKET_IFNAME");
  auto store = connect_store(options, env, timeout);
  ProcessGroupPtr group;
  if (backend_name == "gloo") {
    // Across hosts, check the network first: a wrong or missing interface fails on every rank within
    // seconds, naming it, instead of Gloo's full-mesh connect timing out after `timeout`.
    detail::check_gloo_network(store, env.rank, env.world_size, timeout, is_loopback(env.master_addr));
    group = make_gloo_group(store, env.rank, env.world_size, timeout, {}, "default", options.gloo_threads());
  } else {
#ifdef USE_C10D_NCCL
    detail::check_socket_ifname("NCCL_SOCKET_IFNAME");
    auto nopts = c10d::ProcessGroupNCCL::Options::create();
    nopts->timeout = timeout;
    auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, env.rank, env.world_size, nopts);
    group = std::make_shared<ProcessGroup>(backend, device, store, std::vector<int>{}, timeout, "default");
#else
    (void)device;
    TORCH_CHECK(false, "init_process_group: backend nccl requested but this LibTorch was built without NCCL");
#endif
  }
  set_default_process_group(group);
  return group;
}

ProcessGroupPtr from_c10d(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, torch::Device device) {
  TORCH_CHECK(pg, "from_c10d: expected a c10d::ProcessGroup, got null");
  auto backend = pg->getBackend(device.type());
  return std::make_shared<ProcessGroup>(backend, device, pg->getStore(), std::vector<int>{},
                                        backend->getBackendOptions()->timeout, pg->getGroupName());
}

ProcessGroupPtr new_group(const ProcessGroupPtr& parent, const std::vector<int>& ranks, const std::string& name) {
  TORCH_CHECK(parent, "new_group: parent group is null");
  TORCH_CHECK(parent->store(), "new_group: ", parent->str(), " has no store to build sub-groups with");
  int me = -1;
  std::vector<int> global;
  for (size_t i = 0; i < ranks.size(); ++i) {
    TORCH_CHECK(ranks[i] >= 0 && ranks[i] < parent->size(), "new_group: rank ", ranks[i], " is not in ",
                parent->str());
    TORCH_CHECK(i == 0 || ranks[i] > ranks[i - 1], "new_group: ranks must be sorted and distinct");
    if (ranks[i] == parent->rank()) me = static_cast<int>(i);
    global.push_back(parent->global_ranks()[ranks[i]]);
  }
  TORCH_CHECK(me >= 0, "new_group: rank ", parent->rank(), " of ", parent->str(), " is not in the new group '", name,
              "'");
  if (auto g = detail::new_mpi_group(parent, ranks, name)) return g;  // an "mpi" parent: an MPI sub-communicator
  auto store = c10::make_intrusive<c10d::PrefixStore>(name, parent->store());
  if (parent->device_type() == torch::kCPU) {
    return make_gloo_group(store, me, static_cast<int>(ranks.size()), parent->timeout(), global, name);
  }
#ifdef USE_C10D_NCCL
  auto nopts = c10d::ProcessGroupNCCL::Options::create();
  nopts->timeout = parent->timeout();
  auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, me, static_cast<int>(ranks.size()), nopts);
  return std::make_shared<ProcessGroup>(backend, parent->device(), store, global, parent->timeout(), name);
#else
  TORCH_CHECK(false, "new_group: device ", parent->device(), " needs NCCL, which this LibTorch lacks");
#endif
}

ProcessGroupPtr default_process_group() {
  if (t_default_group) return t_default_group;
  std::lock_guard<std::mutex> lock(g_default_mutex);
  TORCH_CHECK(g_default_group, "default_process_group: no process group is initialised. Fix: call "
              "fsdp::init_process_group() first (or pass a mesh/group explicitly)");
  return g_default_group;
}

void set_default_process_group(ProcessGroupPtr group) {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  g_default_group = std::move(group);
}

void set_thread_default_process_group(ProcessGroupPtr group) { t_default_group = std::move(group); }

void destroy_process_group(ProcessGroupPtr group) {
  if (!group) {
    if (t_default_group) {
      group = t_default_group;
    } else {
      std::lock_guard<std::mutex> lock(g_default_mutex);
      group = g_default_group;
    }
  }
  if (!group) return;
  if (t_default_group == group) t_default_group.reset();
  {
    std::lock_guard<std::mutex> lock(g_default_mutex);
    if (g_default_group == group) g_default_group.reset();
  }
  if (group->backend() && group->backend()->getBackendName() == "nccl") group->backend()->shutdown();
}

bool is_initialized() {
  if (t_default_group) return true;
  std::lock_guard<std::mutex> lock(g_default_mutex);
  return g_default_group != nullptr;
}

}  // namespace fsdp
