// init_process_group from the launcher's environment (fsdprun, torchrun, Slurm, Open MPI): missing or bad
// variables name the variable and the fix, an unreachable or unresolvable master fails in time, one
// process needs no master (CTest label: foundation).
#include <cstdlib>
#include <functional>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/c10d/collectives.h"
#include "fsdp/c10d/distributed.h"

namespace {

class Env : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                          "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "TORCHELASTIC_USE_AGENT_STORE", "FSDP_TIMEOUT_S"})
      unsetenv(v);
  }
  static std::string error_of(const std::function<void()>& fn) {
    try {
      fn();
    } catch (const c10::Error& e) {
      return e.what();
    }
    return "";
  }
};

TEST_F(Env, MissingRankNamesTheVariableAndTheFix) {
  auto msg = error_of([] { fsdp::read_launch_env(); });
  EXPECT_NE(msg.find("RANK is not set"), std::string::npos) << msg;
  EXPECT_NE(msg.find("fsdprun"), std::string::npos) << msg;
}

TEST_F(Env, WorldSizeZero) {
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "0", 1);
  auto msg = error_of([] { fsdp::read_launch_env(); });
  EXPECT_NE(msg.find("WORLD_SIZE=0"), std::string::npos) << msg;
}

TEST_F(Env, RankOutOfRangeAndGarbage) {
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "2", 1);
  EXPECT_NE(error_of([] { fsdp::read_launch_env(); }).find("RANK=3"), std::string::npos);
  setenv("RANK", "one", 1);
  EXPECT_NE(error_of([] { fsdp::read_launch_env(); }).find("RANK=one is not an integer"), std::string::npos);
}

TEST_F(Env, MissingMasterAddr) {
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "2", 1);
  auto msg = error_of([] { fsdp::read_launch_env(); });
  EXPECT_NE(msg.find("MASTER_ADDR is not set"), std::string::npos) << msg;
}

TEST_F(Env, SlurmAndOpenMpi) {
  setenv("SLURM_PROCID", "2", 1);
  setenv("SLURM_NTASKS", "4", 1);
  setenv("SLURM_LOCALID", "0", 1);
  setenv("SLURM_STEP_ID", "0", 1);  // a task of an srun step (test_slurm_env.cpp: the batch script is refused)
  setenv("MASTER_ADDR", "10.0.0.1", 1);
  setenv("MASTER_PORT", "1234", 1);
  auto env = fsdp::read_launch_env();
  EXPECT_EQ(env.source, "slurm");
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.master_port, 1234);
  unsetenv("SLURM_PROCID");
  setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "3", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  env = fsdp::read_launch_env();
  EXPECT_EQ(env.source, "openmpi");
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 3);
}

TEST_F(Env, UnreachableMasterFailsWithinTheTimeout) {
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "1", 1);  // nothing listens on port 1
  fsdp::InitOptions opts;
  opts.timeout(std::chrono::seconds(2));
  auto t0 = std::chrono::steady_clock::now();
  auto msg = error_of([&] { fsdp::init_process_group(opts); });
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(msg.find("MASTER_ADDR:MASTER_PORT = 127.0.0.1:1"), std::string::npos) << msg;
  // Bounded by the 2 s timeout, not by the 30 min default. c10d's TCPStore client makes a second attempt
  // after a jittered backoff when the first one times out (a host that drops the SYN instead of refusing
  // it: CI saw 2 s + 3.4 s + 2 s = 7.1 s), so the bound allows two attempts and the largest backoff.
  EXPECT_LT(s, 3 * 2.0 + 10.0) << "took " << s << " s";
}

TEST_F(Env, UnresolvableMasterAddrFailsAtOnce) {
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_ADDR", "no-such-host.invalid", 1);
  setenv("MASTER_PORT", "29500", 1);
  auto msg = error_of([] { fsdp::init_process_group(); });
  EXPECT_NE(msg.find("MASTER_ADDR=no-such-host.invalid cannot be resolved"), std::string::npos) << msg;
}

TEST_F(Env, SingleProcessNeedsNoMaster) {
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  setenv("MASTER_PORT", "0", 1);  // let the store pick a free port
  auto pg = fsdp::init_process_group();
  EXPECT_EQ(pg->size(), 1);
  EXPECT_EQ(pg->device(), torch::Device(torch::kCPU));
  EXPECT_TRUE(fsdp::is_initialized());
  auto t = torch::ones({3});
  fsdp::all_reduce(t, *pg);
  EXPECT_TRUE(torch::equal(t, torch::ones({3})));
  fsdp::set_default_process_group(nullptr);
}

}  // namespace
