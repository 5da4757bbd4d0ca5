// Slurm's environment, as srun leaves it for each task: the rendezvous address and port of a job that
// was started by `srun PROGRAM` without MASTER_ADDR/MASTER_PORT, and the tasks on this node.
//
// [Note: Slurm rendezvous]
// srun gives every task SLURM_PROCID (rank), SLURM_NTASKS (world size) and SLURM_LOCALID (local rank), but
// no address to meet at. PyTorch leaves that to the user (torch.distributed's env:// needs MASTER_ADDR);
// libfsdp derives it as most Slurm integrations do (Lightning's SLURMEnvironment, submitit):
//  - MASTER_ADDR: the first host of SLURM_STEP_NODELIST (the nodes of this srun step), else of
//    SLURM_JOB_NODELIST. srun places task 0 on the first node of the step with its default (block) and
//    cyclic distributions, so rank 0, which hosts the TCPStore, runs there. With --distribution=arbitrary
//    (SLURM_HOSTFILE) that need not hold: export MASTER_ADDR then.
//  - MASTER_PORT: 20000 + 10 * (SLURM_JOB_ID % 1000) + (SLURM_STEP_ID % 10), in 20000..29999. Distinct for
//    1000 consecutive jobs sharing a node and for 10 concurrent steps of one job; below Linux's ephemeral
//    range (32768..60999), so no outgoing connection of this host holds it by chance. Export MASTER_PORT
//    (srun passes the environment on) to choose another.
// Each is taken only when its variable is unset: an exported MASTER_ADDR or MASTER_PORT always wins.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

/// Expands a Slurm hostlist expression into host names, in order, as `scontrol show hostnames` does:
/// "node[01-03,07],gpu-a[1-2]" -> node01 node02 node03 node07 gpu-a1 gpu-a2. A range keeps the zero padding
/// of its lower bound ("n[08-10]" -> n08 n09 n10; "n[8-10]" -> n8 n9 n10); several bracket groups in one
/// name expand as their product ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2). `what` names the variable the
/// list came from, for messages. Throws c10::Error naming `what`, the list and the position on a malformed
/// list (unbalanced brackets, an empty or reversed range, a non-number) and when it names over 1,000,000 hosts.
std::vector<std::string> expand_slurm_hostlist(const std::string& hostlist, const std::string& what);

/// Expands a Slurm tasks-per-node list ("2(x3),1" -> {2, 2, 2, 1}), as in SLURM_STEP_TASKS_PER_NODE and
/// SLURM_TASKS_PER_NODE. Throws c10::Error naming `what` on a malformed list.
std::vector<int> expand_slurm_tasks_per_node(const std::string& list, const std::string& what);

/// MASTER_PORT of a job started by srun: see [Note: Slurm rendezvous].
int slurm_master_port(long job_id, long step_id);

/// The rendezvous address of a Slurm step, from the environment.
struct SlurmRendezvous {
  std::string addr;    ///< first host of the node list
  std::string origin;  ///< e.g. "the first host of SLURM_STEP_NODELIST=node[01-02]", for messages
};

/// MASTER_ADDR as Slurm implies it: the first host of SLURM_STEP_NODELIST, else of SLURM_JOB_NODELIST;
/// nullopt when neither is set. Throws c10::Error naming the variable when the list is malformed.
std::optional<SlurmRendezvous> slurm_master_addr_from_env();

/// Processes on this node (the entry of SLURM_STEP_TASKS_PER_NODE, else SLURM_TASKS_PER_NODE, at
/// SLURM_NODEID; else SLURM_NTASKS_PER_NODE); nullopt when none of them is set or SLURM_NODEID is past
/// their end. Throws c10::Error naming the variable on a malformed list.
std::optional<int> slurm_local_world_size_from_env();

/// MASTER_ADDR for transport decisions (Gloo's interface): MASTER_ADDR if set, else the Slurm-derived one
/// under srun, else "127.0.0.1". Never throws (a malformed list is reported by read_launch_env).
std::string rendezvous_host_from_env();

}  // namespace fsdp::detail
