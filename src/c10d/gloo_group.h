// A Gloo group whose bytes always go over Gloo's sockets, never through the one-host shared-memory
// transport that make_gloo_group adds (src/c10d/shm_transport.h). For groups whose peers may vanish at any
// moment and must be seen to vanish at once, whatever the host: the replicate group of fsdp::ft::Manager
// (a peer's closed sockets fail the collective; the shared-memory transport, built for ranks that live
// and die together, would wait for a thread-rank that left without dying).
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/c10d/distributed.h"

namespace fsdp::detail {

/// make_gloo_group without the shared-memory transport (same arguments, same errors). `loopback`: whether
/// every rank runs on this host (Gloo then listens on 127.0.0.1); unset, as make_gloo_group decides it (from
/// MASTER_ADDR, which for groups that span jobs says nothing). GLOO_SOCKET_IFNAME overrides both.
ProcessGroupPtr make_gloo_group_on_sockets(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                          std::chrono::milliseconds timeout, std::vector<int> global_ranks,
                                          const std::string& name, int threads, std::optional<bool> loopback);

}  // namespace fsdp::detail
