// The network check of init_process_group (issue 18): the interface Gloo and NCCL are told to use
// (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) exists here, and every rank can reach the address Gloo will
// listen on, before Gloo's own full-mesh connect (which, on the wrong network, waits for the whole
// process-group timeout, 30 min by default, and then names neither the interface nor the variable).
#pragma once

#include <chrono>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

struct sockaddr;

namespace fsdp::detail {

/// The numeric address of an AF_INET or AF_INET6 socket address ("10.0.0.1", "::1"); "?" otherwise.
std::string ip_of(const sockaddr* sa);

/// Throws c10::Error if `var` (GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME, comma-separated) names an interface
/// that this host lacks, that is down, or that has no IP address; the message names the variable, the
/// interface, this host's interfaces and the fix. Unset or empty: nothing to check. NCCL's syntax is
/// understood: a name is a prefix unless it starts with '=', and a list starting with '^' excludes
/// (not checked).
void check_socket_ifname(const char* var);

/// Before the default group's Gloo connects: each rank listens on the address Gloo will use (the first
/// interface of GLOO_SOCKET_IFNAME, else the hostname's address or loopback, as Gloo picks it), publishes it in
/// `store`, and connects to the next rank's (a ring, so every host's listening address is tried from
/// another host); every rank then reads every rank's result and all throw together when one failed,
/// naming the ranks, the addresses, the interface and the variable. A connect gets FSDP_NIC_CHECK_TIMEOUT_S
/// (default 5) seconds. Waiting for the other ranks to arrive takes at most `timeout`.
/// Skipped when size == 1 (only the name is checked), FSDP_NIC_CHECK=0, or on one host on loopback
/// (`local_master` and GLOO_SOCKET_IFNAME unset).
/// `local_master`: MASTER_ADDR is loopback, so without GLOO_SOCKET_IFNAME Gloo listens on 127.0.0.1.
void check_gloo_network(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                        std::chrono::milliseconds timeout, bool local_master);

}  // namespace fsdp::detail
