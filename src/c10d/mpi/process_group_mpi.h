// The "mpi" backend (internal): a c10d::Backend over Open MPI for CPU tensors, and the hand-offs that
// init_process_group, read_launch_env and new_group make to it (src/c10d/distributed.cpp).
//
// The CPU wheel of PyTorch ships no ProcessGroupMPI, so libfsdp brings its own, compiled only when CMake
// finds MPI (Debian: libopenmpi-dev). This header is the same in both builds: without MPI the functions
// below (process_group_mpi_init.cpp) say so (mpi_backend_built() is false and asking for "mpi" throws with
// the fix), so that the rest of the library needs no #ifdef. The files, all MPI-only but the first:
//  - process_group_mpi_init.cpp: these functions (the default group, its store, sub-groups);
//  - process_group_mpi_backend.h: ProcessGroupMPI, the c10d::Backend; process_group_mpi.cpp its
//    collectives, process_group_mpi_ops.cpp how it issues them on the MPI thread and its checks;
//  - mpi_thread.{h,cpp}: the MPI thread (init, queue, polling, finalize) and MpiWork;
//  - mpi_types.{h,cpp}: datatypes and reduce ops.
//
// Design, in short (details in those files and docs/MULTINODE.md, MPI):
//  - MPI is initialised once per process (MPI_Init_thread, MPI_THREAD_SERIALIZED requested) on one
//    process-wide MPI thread, which then runs every MPI call of every "mpi" group in issue order; a
//    collective returns a c10d::Work at once and completes on that thread, so communication overlaps
//    compute as with Gloo. MPI_Finalize runs at exit on the same thread.
//  - Rank and world size come from MPI_COMM_WORLD (mpirun's OMPI_COMM_WORLD_* variables agree with it).
//  - libfsdp's ProcessGroup also wants a c10d::Store (checkpoint coordination, debug progress keys): with
//    MASTER_ADDR/MASTER_PORT set, the usual TCPStore there; without them (plain `mpirun -np N`), rank 0
//    hosts a TCPStore on a free port and broadcasts its address over MPI, so everything that needs a
//    store works unchanged. Sub-groups (new_group, 2-D meshes) are MPI communicators
//    (MPI_Comm_create_group: only the members call it, as libfsdp's new_group requires).
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/c10d/distributed.h"

namespace fsdp::detail {

/// True when this libfsdp was built with the MPI backend (CMake found MPI).
bool mpi_backend_built();

/// Whether the "mpi" backend can bring its own rendezvous for a job started by `launch_source`
/// (LaunchEnv::source): true for "openmpi" in a build with MPI. read_launch_env then accepts a job
/// without MASTER_ADDR/MASTER_PORT.
bool mpi_provides_rendezvous(const std::string& launch_source);

/// The backend init_process_group uses when the caller names none and the device is CPU: "mpi" when the
/// process was started by mpirun (env.source == "openmpi"), MASTER_ADDR is unset and the build has MPI;
/// otherwise nullopt (the caller's own default: gloo / nccl).
std::optional<std::string> mpi_default_backend(const LaunchEnv& env, torch::DeviceType device_type);

/// init_process_group's hand-off: when `backend` (or, unset, mpi_default_backend()) is "mpi", builds the
/// default group over MPI_COMM_WORLD and returns it; otherwise returns null and the caller goes on with
/// Gloo/NCCL. `store`: use it instead of building one (see the header comment). Throws c10::Error
/// (prefixed "init_process_group: backend mpi") when the build has no MPI (naming the fix), the device is
/// not CPU, or MPI's world disagrees with `env` (processes not started by one mpirun).
ProcessGroupPtr init_mpi_process_group(const std::optional<std::string>& backend, torch::DeviceType device_type,
                                       const LaunchEnv& env, std::chrono::milliseconds timeout,
                                       const c10::intrusive_ptr<c10d::Store>& store);

/// new_group's hand-off: when `parent` runs on the "mpi" backend, returns the sub-group of `ranks` (group
/// ranks of parent, sorted, distinct, containing this rank; checked by the caller) as an MPI communicator
/// with the store PrefixStore(name, parent->store()); otherwise returns null.
ProcessGroupPtr new_mpi_group(const ProcessGroupPtr& parent, const std::vector<int>& ranks, const std::string& name);

/// The thread support MPI granted ("MPI_THREAD_SERIALIZED", ...), or "" before MPI is initialised or
/// without MPI. For logs and tests.
std::string mpi_thread_level();

}  // namespace fsdp::detail
