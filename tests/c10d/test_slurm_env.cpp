// Slurm's environment (src/c10d/slurm_env.{h,cpp}): the hostlist parser, the tasks-per-node list, the derived
// MASTER_PORT, and read_launch_env under srun (rank 0's host from the node list, errors naming the variables).
// The real srun launch is tests/python/test_slurm.py (label multinode).
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "fsdp/c10d/distributed.h"
#include "c10d/slurm_env.h"

namespace {

using fsdp::detail::expand_slurm_hostlist;
using fsdp::detail::expand_slurm_tasks_per_node;
using fsdp::detail::slurm_master_port;
using Hosts = std::vector<std::string>;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

Hosts expand(const std::string& list) { return expand_slurm_hostlist(list, "SLURM_STEP_NODELIST"); }

// ---- The hostlist parser -------------------------------------------------------------------------------
TEST(SlurmHostlist, PlainNamesAndCommas) {
  EXPECT_EQ(expand("localhost"), Hosts({"localhost"}));
  EXPECT_EQ(expand("a,b.example.com,c-1"), Hosts({"a", "b.example.com", "c-1"}));
}

TEST(SlurmHostlist, RangesKeepTheZeroPaddingOfTheLowerBound) {
  EXPECT_EQ(expand("node[01-03,07],gpu-a[1-2]"), Hosts({"node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"}));
  EXPECT_EQ(expand("n[8-10]"), Hosts({"n8", "n9", "n10"}));
  EXPECT_EQ(expand("n[08-10]"), Hosts({"n08", "n09", "n10"}));
  EXPECT_EQ(expand("n[098-101]"), Hosts({"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(expand("n[007]"), Hosts({"n007"}));
  EXPECT_EQ(expand("n[0-1]"), Hosts({"n0", "n1"}));
}

// Expected values of the cases above and of r[1-2]n[1-2] checked against `scontrol show hostnames` (Slurm 22.05).
TEST(SlurmHostlist, SeveralBracketsExpandAsAProduct) {
  EXPECT_EQ(expand("r[1-2]n[1-2]"), Hosts({"r1n1", "r1n2", "r2n1", "r2n2"}));
  // A suffix after the last bracket: scontrol 22.05 calls it invalid and Slurm never writes one; accepted here.
  EXPECT_EQ(expand("n[1-2]-ib"), Hosts({"n1-ib", "n2-ib"}));
}

TEST(SlurmHostlist, LargeRangesExpandInOrder) {
  auto hosts = expand("gpu[0001-1000],login");
  ASSERT_EQ(hosts.size(), 1001u);
  EXPECT_EQ(hosts.front(), "gpu0001");
  EXPECT_EQ(hosts[998], "gpu0999");
  EXPECT_EQ(hosts[999], "gpu1000");
  EXPECT_EQ(hosts.back(), "login");
}

TEST(SlurmHostlist, MalformedListsNameTheVariableTheListAndThePosition) {
  struct Case {
    std::string list, why;
  };
  const std::vector<Case> cases{
      {"", "an empty list"},
      {"n[1-3", "'[' without ']'"},
      {"n1-3]", "']' without '['"},
      {"n[]", "empty brackets"},
      {"n[1,,3]", "an empty range"},
      {"n[3-1]", "the range 3-1 is reversed"},
      {"n[1-x]", "'x' is not a number"},
      {"n[a]", "'a' is not a number"},
      {"n[1-]", "an empty range bound"},
      {"a,,b", "an empty host name"},
      {"a,", "an empty host name"},
      {"n[[1]]", "nested '['"},
      {"n[1-2000000]", "more than 1000000 hosts"},
      {"a[1-1000]b[1-1001]", "more than 1000000 hosts"},
  };
  for (const auto& c : cases) {
    auto msg = error_of([&] { expand(c.list); });
    EXPECT_NE(msg.find("SLURM_STEP_NODELIST=" + c.list + " is not a Slurm hostlist"), std::string::npos)
        << c.list << ": " << msg;
    EXPECT_NE(msg.find(c.why), std::string::npos) << c.list << ": " << msg;
    EXPECT_NE(msg.find("at position"), std::string::npos) << msg;
    EXPECT_NE(msg.find("export MASTER_ADDR"), std::string::npos) << msg;
  }
  EXPECT_NE(error_of([] { expand("n[3-1]"); }).find("at position 2"), std::string::npos);
  EXPECT_NE(error_of([] { expand("a,nn[1-3"); }).find("at position 4"), std::string::npos);
}

// ---- Tasks per node and the port -----------------------------------------------------------------------
TEST(SlurmTasksPerNode, Expands) {
  auto tpn = [](const std::string& s) { return expand_slurm_tasks_per_node(s, "SLURM_STEP_TASKS_PER_NODE"); };
  EXPECT_EQ(tpn("2"), std::vector<int>({2}));
  EXPECT_EQ(tpn("2(x3),1"), std::vector<int>({2, 2, 2, 1}));
  EXPECT_EQ(tpn("4,3(x2)"), std::vector<int>({4, 3, 3}));
  for (const std::string bad : {"", "x", "2(x)", "2(y3)", "2(x3", "2,", "2(x0)"}) {
    auto msg = error_of([&] { tpn(bad); });
    EXPECT_NE(msg.find("SLURM_STEP_TASKS_PER_NODE=" + bad + " is not a Slurm tasks-per-node list"), std::string::npos)
        << bad << ": " << msg;
  }
}

TEST(SlurmMasterPort, FromJobAndStepInARangeBelowTheEphemeralPorts) {
  EXPECT_EQ(slurm_master_port(1234, 0), 22340);  // 20000 + 10 * 234
  EXPECT_EQ(slurm_master_port(1234, 3), 22343);
  EXPECT_EQ(slurm_master_port(0, 0), 20000);
  EXPECT_EQ(slurm_master_port(999, 9), 29999);
  EXPECT_NE(slurm_master_port(1234, 0), slurm_master_port(1235, 0));  // consecutive jobs
  EXPECT_NE(slurm_master_port(1234, 0), slurm_master_port(1234, 1));  // concurrent steps of one job
  for (long job : {0L, 1L, 999L, 1000L, 123456789L}) {
    for (long step : {0L, 9L, 10L, 4294967294L}) {
      const int p = slurm_master_port(job, step);
      EXPECT_GE(p, 20000);
      EXPECT_LE(p, 29999);
    }
  }
}

// ---- read_launch_env under srun ------------------------------------------------------------------------
// What srun sets for task 1 of a 2-task step on node[01-02], one task per node.
class SlurmEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                          "OMPI_COMM_WORLD_RANK", "TORCHELASTIC_USE_AGENT_STORE", "SLURM_JOBID", "SLURM_STEPID",
                          "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"}) {
      unsetenv(v);
    }
    setenv("SLURM_PROCID", "1", 1);
    setenv("SLURM_NTASKS", "2", 1);
    setenv("SLURM_LOCALID", "0", 1);
    setenv("SLURM_NODEID", "1", 1);
    setenv("SLURM_JOB_ID", "4321", 1);
    setenv("SLURM_STEP_ID", "2", 1);
    setenv("SLURM_STEP_NODELIST", "node[01-02]", 1);
    setenv("SLURM_JOB_NODELIST", "node[01-04]", 1);
    setenv("SLURM_STEP_TASKS_PER_NODE", "1(x2)", 1);
  }
};

TEST_F(SlurmEnv, RankWorldAndAddressFromSlurm) {
  auto env = fsdp::read_launch_env();
  EXPECT_EQ(env.source, "slurm");
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.local_world_size, 1);
  EXPECT_EQ(env.master_addr, "node01");
  EXPECT_EQ(env.master_port, 20000 + 10 * 321 + 2);
  EXPECT_NE(env.rendezvous_origin.find("SLURM_STEP_NODELIST=node[01-02]"), std::string::npos) << env.rendezvous_origin;
  EXPECT_NE(env.rendezvous_origin.find("SLURM_JOB_ID=4321"), std::string::npos) << env.rendezvous_origin;
}

TEST_F(SlurmEnv, JobNodeListWhenNoStepNodeList) {
  unsetenv("SLURM_STEP_NODELIST");
  setenv("SLURM_JOB_NODELIST", "gpu-a[7-8],gpu-b1", 1);
  EXPECT_EQ(fsdp::read_launch_env().master_addr, "gpu-a7");
}

TEST_F(SlurmEnv, LocalWorldSizeFromThisNodesEntry) {
  setenv("SLURM_NTASKS", "5", 1);
  setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2),1", 1);
  setenv("SLURM_NODEID", "2", 1);
  EXPECT_EQ(fsdp::read_launch_env().local_world_size, 1);
  setenv("SLURM_NODEID", "0", 1);
  EXPECT_EQ(fsdp::read_launch_env().local_world_size, 2);
  // Past the end of the list: the next source (here none: the world size); the count only informs.
  setenv("SLURM_NODEID", "3", 1);
  EXPECT_EQ(fsdp::read_launch_env().local_world_size, 5);
  setenv("SLURM_NTASKS_PER_NODE", "3", 1);
  EXPECT_EQ(fsdp::read_launch_env().local_world_size, 3);
  setenv("SLURM_STEP_TASKS_PER_NODE", "2(y2)", 1);
  auto msg = error_of([] { fsdp::read_launch_env(); });
  EXPECT_NE(msg.find("SLURM_STEP_TASKS_PER_NODE=2(y2) is not a Slurm tasks-per-node list"), std::string::npos) << msg;
}

TEST_F(SlurmEnv, ExportedMasterAddrAndPortOverride) {
  setenv("MASTER_ADDR", "10.1.2.3", 1);
  auto env = fsdp::read_launch_env();
  EXPECT_EQ(env.master_addr, "10.1.2.3");
  EXPECT_EQ(env.master_port, 23212);  // still derived
  setenv("MASTER_PORT", "31000", 1);
  env = fsdp::read_launch_env();
  EXPECT_EQ(env.master_addr, "10.1.2.3");
  EXPECT_EQ(env.master_port, 31000);
  unsetenv("MASTER_ADDR");
  env = fsdp::read_launch_env();
  EXPECT_EQ(env.master_addr, "node01");
  EXPECT_EQ(env.master_port, 31000);
}

TEST_F(SlurmEnv, TorchrunVariablesWinOverSlurm) {
  // fsdprun started by srun (one agent per node) gives its workers RANK etc.: those are the ranks.
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "4", 1);
  setenv("MASTER_ADDR", "node02", 1);
  setenv("MASTER_PORT", "29500", 1);
  auto env = fsdp::read_launch_env();
  EXPECT_EQ(env.source, "torchrun");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.master_addr, "node02");
}

TEST_F(SlurmEnv, BatchScriptIsRefusedNamingSrun) {
  // `sbatch --ntasks 2 script` where the script runs the program itself: one process, not two tasks.
  unsetenv("SLURM_STEP_ID");
  setenv("SLURM_PROCID", "0", 1);
  auto msg = error_of([] { fsdp::read_launch_env(); });
  EXPECT_NE(msg.find("SLURM_STEP_ID is not"), std::string::npos) << msg;
  EXPECT_NE(msg.find("batch script of Slurm job 4321"), std::string::npos) << msg;
  EXPECT_NE(msg.find("srun PROGRAM"), std::string::npos) << msg;
  // One task is a valid one-process job, batch script or not.
  setenv("SLURM_NTASKS", "1", 1);
  EXPECT_EQ(fsdp::read_launch_env().world_size, 1);
}

TEST_F(SlurmEnv, NoNodeListNamesBothVariables) {
  unsetenv("SLURM_STEP_NODELIST");
  unsetenv("SLURM_JOB_NODELIST");
  auto msg = error_of([] { fsdp::read_launch_env(); });
  EXPECT_NE(msg.find("MASTER_ADDR is not set, nor SLURM_STEP_NODELIST or SLURM_JOB_NODELIST"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("export MASTER_ADDR"), std::string::npos) << msg;
}

TEST_F(SlurmEnv, NoJobIdNamesIt) {
  unsetenv("SLURM_JOB_ID");
  auto msg = error_of([] { fsdp::read_launch_env(); });
  EXPECT_NE(msg.find("MASTER_PORT is not set, nor SLURM_JOB_ID"), std::string::npos) << msg;
  EXPECT_NE(msg.find("export MASTER_PORT"), std::string::npos) << msg;
  setenv("SLURM_JOBID", "17", 1);  // the older spelling, still set by srun
  EXPECT_EQ(fsdp::read_launch_env().master_port, 20000 + 170 + 2);
}

TEST_F(SlurmEnv, MalformedNodeListNamesTheVariable) {
  setenv("SLURM_STEP_NODELIST", "node[01-", 1);
  auto msg = error_of([] { fsdp::read_launch_env(); });
  EXPECT_NE(msg.find("SLURM_STEP_NODELIST=node[01- is not a Slurm hostlist"), std::string::npos) << msg;
}

TEST_F(SlurmEnv, UnresolvableFirstHostFailsNamingWhereItCameFrom) {
  setenv("SLURM_STEP_NODELIST", "no-such-host-fsdp.invalid", 1);
  setenv("SLURM_PROCID", "0", 1);
  fsdp::InitOptions opts;
  opts.timeout(std::chrono::seconds(5));
  auto msg = error_of([&] { fsdp::init_process_group(opts); });
  EXPECT_NE(msg.find("MASTER_ADDR=no-such-host-fsdp.invalid cannot be resolved"), std::string::npos) << msg;
  EXPECT_NE(msg.find("first host of SLURM_STEP_NODELIST"), std::string::npos) << msg;
}

}  // namespace
