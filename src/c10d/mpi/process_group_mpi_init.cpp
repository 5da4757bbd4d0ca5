// The "mpi" backend's hand-offs from init_process_group, read_launch_env and new_group (process_group_mpi.h):
// when the backend is chosen, building the default group over MPI_COMM_WORLD with its store, and sub-groups
// as MPI communicators. This file is compiled in every build; with MPI (FSDP_WITH_MPI=1 and MPI's include
// directory, CMakeLists.txt) it builds the groups, without MPI it keeps only the functions that say so.
#include "c10d/mpi/process_group_mpi.h"
#include "c10d/process_group_access.h"

#include <cstdlib>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#if FSDP_WITH_MPI
#include <unistd.h>

#include <cstdio>
#include <functional>

#include "c10d/mpi/mpi_thread.h"
#include "c10d/mpi/process_group_mpi_backend.h"
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

// The default group's store (see process_group_mpi.h): at MASTER_ADDR:MASTER_PORT when they are set,
// else hosted by rank 0 on a free port whose address the other ranks learn over MPI.
c10::intrusive_ptr<c10d::Store> world_store(const LaunchEnv& env, std::chrono::milliseconds timeout, int rank,
                                            int size) {
  const char* addr_env = std::getenv("MASTER_ADDR");
  const char* port_env = std::getenv("MASTER_PORT");
  const bool have_master = addr_env && *addr_env && port_env && *port_env;
  c10::intrusive_ptr<c10d::Store> store;
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
    MpiThread::get().call([&] { MPI_Bcast(&a, static_cast<int>(sizeof(a)), MPI_BYTE, 0, MPI_COMM_WORLD); });
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
  return c10::make_intrusive<c10d::PrefixStore>("default_pg", store);
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
  // A process that no MPI launcher started (fsdprun's or torchrun's workers) would initialise MPI as a
  // singleton, which forks a daemon of Open MPI's: several at once on one host can fail inside MPI_Init
  // ("Unable to start a daemon on the local node") and abort the process with Open MPI's message instead of
  // this one. With more than one rank and no launcher's variable (Open MPI's mpirun, a PMIx or PMI launcher:
  // prterun, srun --mpi=pmix/pmi2, MPICH's and Intel MPI's hydra) the job is refused before MPI_Init.
  const bool mpi_launched = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMIX_RANK") ||
                            std::getenv("PMI_SIZE") || std::getenv("PMI_RANK") || std::getenv("MV2_COMM_WORLD_SIZE");
  TORCH_CHECK(mpi_launched || env.world_size <= 1, "init_process_group: backend mpi: no MPI launcher started this ",
              "process (none of OMPI_COMM_WORLD_SIZE, PMIX_RANK, PMI_SIZE, PMI_RANK, MV2_COMM_WORLD_SIZE is set), but the ",
              "launcher's environment (",
              env.source, ") says rank ", env.rank, " of ", env.world_size,
              ": the processes were not started by one mpirun. Fix: launch with `mpirun -np ", env.world_size,
              " PROGRAM` (as root add --allow-run-as-root; with more ranks than cores add --oversubscribe), or use "
              "backend gloo under fsdprun/torchrun");
  auto& mt = MpiThread::get();
  const int rank = mt.world_rank(), size = mt.world_size();
  TORCH_CHECK(size == env.world_size && rank == env.rank, "init_process_group: backend mpi: MPI_COMM_WORLD has ", size,
              " process(es) and this is rank ", rank, ", but the launcher's environment (", env.source,
              ") says rank ", env.rank, " of ", env.world_size,
              ": the processes were not started by one mpirun. Fix: launch with `mpirun -np ", env.world_size,
              " PROGRAM` (as root add --allow-run-as-root; with more ranks than cores add --oversubscribe), or use "
              "backend gloo under fsdprun/torchrun");

  c10::intrusive_ptr<c10d::Store> store = given_store;
  if (!store && size > 1) store = world_store(env, timeout, rank, size);
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
