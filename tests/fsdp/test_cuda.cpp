// FSDP on CUDA (issue 12; CTest label: cuda). Every test needs an NVIDIA GPU and a CUDA LibTorch: elsewhere
// each one skips (GTEST_SKIP, reported by ctest as "Not Run (Skipped)", never as passed) with the reason.
//
//   CudaParity.*       world size 1 on NCCL against single-device training, fp32 and bf16 (tolerances of
//                      the CPU parity tests: 1e-5 fp32, 1e-3 bf16)
//   CudaGloo.*         2 ranks (processes) on one GPU over Gloo with CUDA tensors (NCCL refuses two ranks on
//                      one device): parity with the all-gathers prefetched on the side streams
//   CudaStreams.*      a reduce-scatter stream delayed behind a long kernel: the gradients it reads must not be
//                      reused by the compute stream before it read them (record_stream); streams are in use
//   CudaOffload.*      CPUOffloadPolicy on a GPU: shards, gradients and optimizer state in pinned host memory
//   CudaCheckpoint.*   a DCP checkpoint saved from GPU shards loads on 2 CPU ranks, is saved again there and
//                      loads back onto the GPU bit-identical
#include <gtest/gtest.h>

#include <cstdio>
#include <unistd.h>

#include <filesystem>

#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <fstream>
#include <optional>
#include <thread>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include "fsdp/fsdp.h"
#include "fsdp/fsdp_streams.h"
#include "utils/saved_tensor_hooks_internal.h"
#include "fsdp_test_model.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

constexpr int64_t kBatch = 12;
constexpr int64_t kSeq = 5;
constexpr int kSteps = 4;

// Skips the test, naming what is missing.
#define REQUIRE_CUDA()                                                                                      \
  do {                                                                                                      \
    if (!torch::cuda::is_available()) {                                                                     \
      GTEST_SKIP() << "needs a CUDA device (an NVIDIA GPU): none is usable here (torch::cuda::is_available() " \
                   << "is false" << (FSDP_WITH_CUDA ? "" : "; this build's LibTorch has no CUDA") << ")";   \
    }                                                                                                       \
  } while (0)

const torch::Device kGpu(torch::kCUDA, 0);

std::map<std::string, torch::Tensor> initial_weights() {
  static std::map<std::string, torch::Tensor> w = [] {
    torch::manual_seed(7);
    Net net(3);
    return snapshot(*net);
  }();
  return w;
}

/// A one-rank NCCL group on cuda:0, rendezvous on an in-memory store (no launcher).
ProcessGroupPtr nccl_world_of_one() {
  InitOptions o;
  LaunchEnv env;
  env.master_addr = "127.0.0.1";
  o.env(env);
  o.device_type(torch::kCUDA);
  o.store(c10::make_intrusive<c10d::HashStore>());
  return init_process_group(o);
}

/// One rank on `dev`: NCCL on CUDA, Gloo on the CPU (rendezvous on an in-memory store).
ProcessGroupPtr world_of_one(torch::Device dev) {
  if (dev.is_cuda()) return nccl_world_of_one();
  InitOptions o;
  LaunchEnv env;
  env.master_addr = "127.0.0.1";
  o.env(env);
  o.store(c10::make_intrusive<c10d::HashStore>());
  return init_process_group(o);
}

struct History {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> first_grads;   // full gradients after step 0 (reference) or shards (FSDP)
  std::map<std::string, torch::Tensor> final_params;  // full (reference) or shards (FSDP)
};

/// Single-device training on `device` over the global batch, optionally computing in `compute` (bf16: a
/// low-precision copy of the fp32 master weights computes the loss and gradients, which update the master
/// in fp32 -- what FSDP's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) does at world size 1).
History reference(const std::vector<Batch>& batches, torch::Device device, torch::ScalarType compute) {
  Net master(3);
  load_full(*master, initial_weights());
  master->to(device);
  torch::optim::AdamW opt(master->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  History h;
  for (size_t step = 0; step < batches.size(); ++step) {
    const auto& b = batches[step];
    opt.zero_grad();
    if (compute == torch::kFloat32) {
      auto loss = loss_fn(master(b.idx.to(device)), b.targets.to(device));
      loss.backward();
      h.losses.push_back(loss.item<double>());
    } else {
      Net low(3);
      load_full(*low, snapshot(*master));
      low->to(device, compute);
      auto loss = loss_fn(low(b.idx.to(device)), b.targets.to(device));
      loss.backward();
      h.losses.push_back(loss.item<double>());
      auto lp = low->named_parameters();
      for (auto& p : master->named_parameters()) p.value().mutable_grad() = lp[p.key()].grad().to(torch::kFloat32);
    }
    if (step == 0) {
      for (const auto& p : master->named_parameters()) h.first_grads[p.key()] = p.value().grad().detach().clone();
    }
    opt.step();
  }
  for (const auto& p : master->named_parameters()) h.final_params[p.key()] = p.value().detach().clone();
  return h;
}

/// FSDP training on `pg` (rank r takes rows [r * B / ws, ...) of each global batch). Losses are the global
/// mean (all-reduced); gradients and parameters are this rank's shards.
History train_fsdp(ProcessGroupPtr pg, const std::vector<Batch>& batches, const FullyShardOptions& base,
                   bool to_device_first = true) {
  const torch::Device dev = pg->device();
  Net net(3);
  load_full(*net, initial_weights());
  if (to_device_first) net->to(dev);
  auto opts = base;
  opts.mesh(init_device_mesh(dev.type(), {pg->size()}, {}, pg));
  for (auto& b : net->blocks) fully_shard(b, opts);
  fully_shard(net, opts);
  FSDPModule<Net> model(net);  // the root's forward must go through FSDP
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  const int64_t local = kBatch / pg->size();
  History h;
  for (size_t step = 0; step < batches.size(); ++step) {
    auto b = batches[step].slice(pg->rank() * local, local);
    opt.zero_grad();
    auto loss = loss_fn(model(b.idx.to(dev)), b.targets.to(dev));
    loss.backward();
    auto l = loss.detach().to(torch::kFloat32).reshape({1}).clone();
    all_reduce(l, *pg, ReduceOp::AVG);
    h.losses.push_back(l.item<double>());
    if (step == 0) {
      for (const auto& p : net->named_parameters()) {
        if (p.value().grad().defined()) h.first_grads[p.key()] = p.value().grad().detach().cpu().clone();
      }
    }
    opt.step();
  }
  for (const auto& p : net->named_parameters()) h.final_params[p.key()] = p.value().detach().cpu().clone();
  return h;
}

/// Compares FSDP's shards (rank `rank` of `ws`) with the reference's full tensors.
void expect_parity(const History& fsdp, const History& ref, int ws, int rank, double tol, const char* what) {
  ASSERT_EQ(fsdp.losses.size(), ref.losses.size());
  double max_loss = 0, max_grad = 0, max_param = 0;
  for (size_t i = 0; i < ref.losses.size(); ++i) max_loss = std::max(max_loss, std::abs(fsdp.losses[i] - ref.losses[i]));
  auto shard = [&](const torch::Tensor& full) {
    auto r = chunk_range(full.size(0), ws, rank);
    return full.cpu().narrow(0, r.offset, r.length);
  };
  for (const auto& [name, g] : ref.first_grads) {
    ASSERT_TRUE(fsdp.first_grads.count(name)) << what << ": no gradient for " << name;
    max_grad = std::max(max_grad, max_abs_diff(fsdp.first_grads.at(name), shard(g)));
  }
  for (const auto& [name, p] : ref.final_params) {
    ASSERT_TRUE(fsdp.final_params.count(name)) << what << ": no parameter " << name;
    max_param = std::max(max_param, max_abs_diff(fsdp.final_params.at(name), shard(p)));
  }
  std::printf("[%s] rank %d/%d: max |loss diff| %.3g, max |grad diff| %.3g, max |param diff| %.3g (tol %.0e)\n", what,
              rank, ws, max_loss, max_grad, max_param, tol);
  EXPECT_LE(max_loss, tol) << what;
  EXPECT_LE(max_grad, tol) << what;
  EXPECT_LE(max_param, tol) << what;
}

struct DefaultGroupReset {
  ~DefaultGroupReset() { destroy_process_group(); }
};

// Runs everywhere: a one-process job rendezvous on a caller's store (what train_gpt and these tests use
// without a launcher) instead of a TCPStore.
TEST(CudaInit, StoreOptionReplacesTheTcpRendezvous) {
  DefaultGroupReset reset;
  InitOptions o;
  LaunchEnv env;
  env.master_addr = "127.0.0.1";
  env.master_port = 1;  // nothing listens there: a TCPStore would fail
  o.env(env);
  o.store(c10::make_intrusive<c10d::HashStore>());
  o.timeout(std::chrono::seconds(5));
  auto pg = init_process_group(o);
  EXPECT_EQ(pg->size(), 1);
  EXPECT_EQ(pg->device(), torch::Device(torch::kCPU));
  EXPECT_EQ(default_process_group(), pg);
}

// Runs where no GPU is usable: asking for CUDA fails at once, naming the device and the fix.
TEST(CudaInit, CudaWithoutAGpuIsAClearError) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a CUDA device is usable here";
  InitOptions o;
  LaunchEnv env;
  env.master_addr = "127.0.0.1";
  o.env(env);
  o.device_type(torch::kCUDA);
  o.store(c10::make_intrusive<c10d::HashStore>());
  try {
    init_process_group(o);
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("init_process_group: device type CUDA requested"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Fix:"), std::string::npos) << msg;
  }
}

TEST(CudaParity, Fp32WorldSize1OnNccl) {
  REQUIRE_CUDA();
  DefaultGroupReset reset;
  auto pg = nccl_world_of_one();
  EXPECT_EQ(pg->backend()->getBackendName(), "nccl");
  EXPECT_EQ(pg->device(), kGpu);
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = reference(batches, kGpu, torch::kFloat32);
  auto got = train_fsdp(pg, batches, FullyShardOptions());
  expect_parity(got, ref, 1, 0, 1e-5, "cuda fp32 nccl ws1");
}

TEST(CudaParity, Bf16WorldSize1OnNccl) {
  REQUIRE_CUDA();
  DefaultGroupReset reset;
  auto pg = nccl_world_of_one();
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = reference(batches, kGpu, torch::kBFloat16);
  auto got = train_fsdp(
      pg, batches,
      FullyShardOptions().mp_policy(MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat32)));
  expect_parity(got, ref, 1, 0, 1e-3, "cuda bf16 nccl ws1");
}

// Issue 30's CUDA paths on a one-rank NCCL group: the float8 all-gather's kernels on the GPU (per-shard scale,
// cast, upcast in the copy-out), the root's post-optimizer event waited by the all-gather streams, and buffers
// from NCCL's own allocator where it offers one (Backend::allocateTensor). The settings move no number: the run
// with them equals the float8 run without them bit for bit; float8 weights keep the loss within 0.05 of fp32's.
TEST(CudaCommHooks, Float8AllGatherPostOptimEventAndProcessGroupAllocatorOnOneRank) {
  REQUIRE_CUDA();
  DefaultGroupReset reset;
  auto pg = nccl_world_of_one();
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto run = [&](bool float8, bool settings) {
    Net net(3);
    load_full(*net, initial_weights());
    net->to(kGpu);
    auto opts = FullyShardOptions().mesh(init_device_mesh(torch::kCUDA, {1}, {}, pg));
    if (float8) opts.all_gather_extension_fn(low_precision_all_gather(torch::kFloat8_e4m3fn));
    for (auto& b : net->blocks) fully_shard(b, opts);
    fully_shard(net, opts);
    FSDPModule<Net> model(net);
    if (settings) {
      for (auto& b : net->blocks) b.set_allocate_memory_from_process_group_for_comm(true);
      model.set_allocate_memory_from_process_group_for_comm(true);
    }
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
    std::vector<double> losses;
    for (const auto& b : batches) {
      opt.zero_grad();
      auto loss = loss_fn(model(b.idx.to(kGpu)), b.targets.to(kGpu));
      loss.backward();
      losses.push_back(loss.item<double>());
      opt.step();
      if (settings) {
        auto event = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
        event->record(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(kGpu));
        model.set_post_optim_event(event);
      }
    }
    return losses;
  };
  const auto fp32 = run(false, false), f8 = run(true, false), f8_settings = run(true, true);
  double worst = 0;
  for (size_t i = 0; i < fp32.size(); ++i) worst = std::max(worst, std::abs(f8[i] - fp32[i]));
  std::printf("[cuda float8 all-gather] max |loss - fp32 loss| over %zu steps: %.3g; final %.4f vs %.4f\n", fp32.size(),
              worst, f8.back(), fp32.back());
  EXPECT_LE(worst, 0.05);
  EXPECT_EQ(f8, f8_settings) << "the post-optimizer event and the process-group allocator changed the numbers";
}

// fully_shard moves the managed modules' buffers to the mesh's device (meta buffers stay: deferred init), and
// the root's holder moves its CPU inputs there, as PyTorch; an all-reduce hook on a stream of its own runs
// after the reduction and before the copy-out (the gradients equal those of the run without the stream).
TEST(CudaInit, BuffersAndRootInputsMoveToTheMeshDeviceAndTheAllReduceHookRunsOnItsStream) {
  REQUIRE_CUDA();
  DefaultGroupReset reset;
  auto pg = nccl_world_of_one();
  auto batches = make_batches(2, kBatch, kSeq);
  auto run = [&](bool hook_stream) {
    Net net(3);
    load_full(*net, initial_weights());  // parameters on the CPU: fully_shard puts the shards on the GPU
    auto counts = net->register_buffer("counts", torch::zeros({3}));
    auto lazy = net->register_buffer("lazy", torch::empty({3}, torch::Device(torch::kMeta)));
    auto opts = FullyShardOptions().mesh(init_device_mesh(torch::kCUDA, {1}, {}, pg));
    for (auto& b : net->blocks) fully_shard(b, opts);
    fully_shard(net, opts);
    EXPECT_EQ(net->named_buffers()["counts"].device(), kGpu);
    EXPECT_TRUE(counts.device() == kGpu) << "the same tensor object, moved";
    EXPECT_TRUE(net->named_buffers()["lazy"].is_meta());
    FSDPModule<Net> model(net);
    int calls = 0;
    if (hook_stream) {
      auto stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStreamFromGlobalPool(kGpu);
      model.set_all_reduce_hook([&](const torch::Tensor& g) {
        ++calls;
        g.mul_(1.0);
      }, stream);
    }
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    std::vector<torch::Tensor> grads;
    for (const auto& b : batches) {
      opt.zero_grad();
      loss_fn(model(b.idx), b.targets.to(kGpu)).backward();  // CPU token ids: moved by the root
      for (const auto& p : net->parameters()) grads.push_back(p.grad().cpu());
      opt.step();
    }
    if (hook_stream) EXPECT_EQ(calls, static_cast<int>(batches.size()));
    return grads;
  };
  auto plain = run(false), hooked = run(true);
  ASSERT_EQ(plain.size(), hooked.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], hooked[i])) << "gradient " << i;
}

// 2 ranks on one GPU over Gloo with CUDA tensors. The ranks are processes, not threads: autograd runs every
// CUDA backward node of the process on one device thread, so two rank threads would share it, and one
// rank's backward hook waiting in a collective would block the other's from ever reaching it.
// The parent test starts this binary twice with --gtest_filter=CudaGlooRank.Run (rank in
// FSDP_CUDA_GLOO_RANK, rendezvous on a FileStore); each rank checks parity against its own single-device
// reference. A rank whose Gloo cannot run the collectives on CUDA tensors prints GLOO_CUDA_UNSUPPORTED.
TEST(CudaGlooRank, Run) {
  const char* r = std::getenv("FSDP_CUDA_GLOO_RANK");
  if (r == nullptr) GTEST_SKIP() << "a rank of CudaGloo.TwoRanksOnOneGpuParityWithPrefetchOnSideStreams (started by it)";
  REQUIRE_CUDA();
  const int rank = std::atoi(r);
  auto store = c10::make_intrusive<c10d::FileStore>(std::getenv("FSDP_CUDA_GLOO_STORE"), 2);
  auto cpu_pg = make_gloo_group(store, rank, 2, std::chrono::seconds(60));
  auto pg = std::make_shared<ProcessGroup>(cpu_pg->backend(), kGpu, cpu_pg->store(), cpu_pg->global_ranks(),
                                           cpu_pg->timeout(), cpu_pg->name());
  try {  // can this Gloo run FSDP's two collectives on CUDA tensors?
    auto out = torch::empty({4}, torch::TensorOptions().device(kGpu));
    auto in = torch::full({2}, static_cast<double>(rank + 1), torch::TensorOptions().device(kGpu));
    cpu_pg->backend()->_allgather_base(out, in, c10d::AllgatherOptions())->wait();
    auto rs_out = torch::empty({2}, torch::TensorOptions().device(kGpu));
    auto rs_in = torch::ones({4}, torch::TensorOptions().device(kGpu));
    cpu_pg->backend()->_reduce_scatter_base(rs_out, rs_in, c10d::ReduceScatterOptions())->wait();
    TORCH_CHECK(out.cpu().equal(torch::tensor({1.f, 1.f, 2.f, 2.f})) && rs_out.cpu().equal(torch::full({2}, 2.f)),
                "wrong results");
  } catch (const std::exception& e) {
    std::string what = e.what();
    std::printf("GLOO_CUDA_UNSUPPORTED: %s\n", what.substr(0, 300).c_str());
    std::fflush(stdout);
    GTEST_SKIP() << what;
  }
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = reference(batches, kGpu, torch::kFloat32);
  auto got = train_fsdp(pg, batches, FullyShardOptions());
  expect_parity(got, ref, 2, rank, 1e-5, "cuda gloo 2 ranks on 1 gpu");
  // Counted on the group the collectives went through (the GPU view of the rank's Gloo backend); found
  // on the H200: counting on cpu_pg, which FSDP never calls, failed although parity held.
  EXPECT_GT(pg->collective_count("all_gather_into_tensor"), 0u);
  EXPECT_GT(pg->collective_count("reduce_scatter_tensor"), 0u);
}

TEST(CudaGloo, TwoRanksOnOneGpuParityWithPrefetchOnSideStreams) {
  REQUIRE_CUDA();
  namespace fs = std::filesystem;
  const std::string base = (fs::temp_directory_path() / ("fsdp_cuda_gloo_" + std::to_string(::getpid()))).string();
  fs::remove(base + ".store");
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 2; ++rank) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0) << "fork failed";
    if (pid == 0) {  // the child execs at once: nothing of the parent's CUDA state is used
      ::setenv("FSDP_CUDA_GLOO_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("FSDP_CUDA_GLOO_STORE", (base + ".store").c_str(), 1);
      std::string log = base + ".rank" + std::to_string(rank) + ".log";
      FILE* f = std::freopen(log.c_str(), "w", stdout);
      if (f) ::dup2(::fileno(stdout), 2);
      ::execl("/proc/self/exe", "test_cuda", "--gtest_filter=CudaGlooRank.Run", static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<int> status(2, -1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(150);
  for (int rank = 0; rank < 2; ++rank) {
    while (true) {
      int st = 0;
      pid_t done = ::waitpid(pids[rank], &st, WNOHANG);
      if (done == pids[rank]) {
        status[rank] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        break;
      }
      if (std::chrono::steady_clock::now() > deadline) {  // no hang: kill both and fail
        for (pid_t p : pids) ::kill(p, SIGKILL);
        ::waitpid(pids[rank], &st, 0);
        status[rank] = -2;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  std::string unsupported;
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream in(base + ".rank" + std::to_string(rank) + ".log");
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("GLOO_CUDA_UNSUPPORTED: ", 0) == 0) unsupported = line.substr(23);
      if (line.rfind("[cuda gloo", 0) == 0 || line.find("Failure") != std::string::npos ||
          line.find("rror") != std::string::npos) {
        std::printf("  rank %d: %s\n", rank, line.c_str());
      }
    }
    fs::remove(base + ".rank" + std::to_string(rank) + ".log");
  }
  fs::remove(base + ".store");
  if (!unsupported.empty()) {
    GTEST_SKIP() << "Gloo in this LibTorch does not run all_gather_into_tensor / reduce_scatter_tensor on CUDA "
                    "tensors, so 2 ranks cannot share one GPU (NCCL refuses two ranks on one device): "
                 << unsupported;
  }
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(status[rank], 0) << "rank " << rank << (status[rank] == -2 ? " did not finish within 150 s" : " failed");
  }
}

// A long kernel on `stream` (about `ms` milliseconds of fp32 matrix products on an H100-class GPU).
void busy(const c10::Stream& stream, int iters) {
  c10::StreamGuard guard(stream);
  auto a = torch::randn({4096, 4096}, torch::TensorOptions().device(kGpu));
  auto b = a;
  for (int i = 0; i < iters; ++i) b = torch::mm(a, b).div_(64.0);
}

TEST(CudaStreams, DelayedReduceScatterStreamReadsIntactGradients) {
  REQUIRE_CUDA();
  if (std::getenv("FSDP_CUDA_STREAMS") && std::string(std::getenv("FSDP_CUDA_STREAMS")) == "0") {
    GTEST_SKIP() << "FSDP_CUDA_STREAMS=0: the side streams are off";
  }
  DefaultGroupReset reset;
  auto pg = nccl_world_of_one();
  auto batches = make_batches(2, kBatch, kSeq);
  auto ref = reference(batches, kGpu, torch::kFloat32);

  Net net(3);
  load_full(*net, initial_weights());
  net->to(kGpu);
  auto mesh = init_device_mesh(torch::kCUDA, {1}, {}, pg);
  auto opts = FullyShardOptions().mesh(mesh);
  for (auto& b : net->blocks) fully_shard(b, opts);
  fully_shard(net, opts);
  auto ctx = detail::comm_context_for(mesh.get(), kGpu);
  ASSERT_TRUE(ctx->enabled()) << "the CUDA streams are not in use";
  FSDPModule<Net> model(net);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  for (size_t step = 0; step < batches.size(); ++step) {
    opt.zero_grad();
    auto loss = loss_fn(model(batches[step].idx.to(kGpu)), batches[step].targets.to(kGpu));
    // The reduce-scatter stream starts every copy-in late: the backward's later kernels on the compute
    // stream run first and allocate; without record_stream they would reuse the freed gradients' memory.
    busy(ctx->stream(detail::CommStream::kReduceScatter), 40);
    loss.backward();
    if (step == 0) {
      double max_grad = 0;
      for (const auto& p : net->named_parameters()) {
        max_grad = std::max(max_grad, max_abs_diff(p.value().grad().cpu(), ref.first_grads.at(p.key()).cpu()));
      }
      std::printf("[cuda streams] delayed reduce-scatter stream: max |grad diff| %.3g\n", max_grad);
      EXPECT_LE(max_grad, 1e-5);
    }
    opt.step();
  }
  torch::cuda::synchronize();
  for (const auto& p : net->named_parameters()) {
    EXPECT_LE(max_abs_diff(p.value().detach().cpu(), ref.final_params.at(p.key()).cpu()), 1e-5) << p.key();
  }
}

// save_on_cpu (pin_memory) on a GPU copies each saved tensor to host memory on a side stream ([Note: save_on_cpu on
// a side stream]). The side stream is made to start late (busy) and the forward allocates after it: without the
// event wait and the allocator's record of the side stream's use, the copies would read memory already reused. The
// gradients equal those without the hooks, bit for bit.
TEST(CudaSaveOnCpu, SideStreamCopiesGiveTheGradientsWithoutHooks) {
  REQUIRE_CUDA();
  torch::manual_seed(3);
  torch::nn::Sequential mlp(torch::nn::Linear(256, 1024), torch::nn::GELU(), torch::nn::Linear(1024, 256));
  mlp->to(kGpu);
  auto x = torch::randn({64, 256}, torch::TensorOptions().device(kGpu));
  auto run = [&](bool offload) {
    for (auto& p : mlp->parameters()) p.mutable_grad() = torch::Tensor();
    torch::Tensor loss;
    {
      std::optional<save_on_cpu> hooks;
      if (offload) {
        hooks.emplace(/*pin_memory=*/true);
        busy(detail::offload_stream(kGpu), 40);
      }
      loss = mlp->forward(x).pow(2).sum();
      for (int i = 0; i < 8; ++i) torch::full({64, 1024}, 7.0, torch::TensorOptions().device(kGpu));
    }
    loss.backward();
    std::vector<torch::Tensor> grads;
    for (auto& p : mlp->parameters()) grads.push_back(p.grad().cpu());
    return grads;
  };
  auto ref = run(false);
  auto got = run(true);
  ASSERT_EQ(ref.size(), got.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(torch::equal(ref[i], got[i])) << "gradient " << i;
}

TEST(CudaOffload, PinnedHostShardsGradientsAndOptimizerStateParity) {
  REQUIRE_CUDA();
  DefaultGroupReset reset;
  auto pg = nccl_world_of_one();
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = reference(batches, kGpu, torch::kFloat32);

  Net net(3);
  load_full(*net, initial_weights());  // on the CPU: offloaded shards stay there
  auto opts = FullyShardOptions().mesh(init_device_mesh(torch::kCUDA, {1}, {}, pg)).offload_policy(CPUOffloadPolicy());
  for (auto& b : net->blocks) fully_shard(b, opts);
  fully_shard(net, opts);
  for (const auto& p : net->named_parameters()) {
    EXPECT_TRUE(p.value().device().is_cpu()) << p.key();
    EXPECT_TRUE(p.value().is_pinned()) << p.key() << ": offloaded shards live in pinned host memory";
  }
  FSDPModule<Net> model(net);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  History got;
  for (size_t step = 0; step < batches.size(); ++step) {
    opt.zero_grad();
    auto out = model(batches[step].idx.to(kGpu));
    EXPECT_TRUE(out.is_cuda()) << "the compute runs on the GPU";
    auto loss = loss_fn(out, batches[step].targets.to(kGpu));
    loss.backward();
    got.losses.push_back(loss.item<double>());
    for (const auto& p : net->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_TRUE(p.value().grad().device().is_cpu()) << p.key() << ": offloaded gradients live on the CPU";
      if (step == 0) got.first_grads[p.key()] = p.value().grad().clone();
    }
    opt.step();
  }
  for (const auto& p : net->named_parameters()) got.final_params[p.key()] = p.value().detach().clone();
  expect_parity(got, ref, 1, 0, 1e-5, "cuda cpu offload");
}

// A progress line, flushed at once: on the H200 this test's process died without output (stdout is a
// file there), and these lines say how far it got.
void progress(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// Saves from `dev` shards (one rank), loads on 2 CPU ranks and saves again there, loads back on `dev`.
void checkpoint_round_trip(torch::Device dev) {
  namespace fs = std::filesystem;
  auto dir = fs::temp_directory_path() / ("fsdp_cuda_ckpt_" + dev.str() + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::map<std::string, torch::Tensor> original;
  {
    DefaultGroupReset reset;
    auto pg = world_of_one(dev);
    auto batches = make_batches(2, kBatch, kSeq);
    Net net(3);
    load_full(*net, initial_weights());
    net->to(dev);
    auto opts = FullyShardOptions().mesh(init_device_mesh(dev.type(), {1}, {}, pg));
    for (auto& b : net->blocks) fully_shard(b, opts);
    fully_shard(net, opts);
    FSDPModule<Net> model(net);
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    for (const auto& b : batches) {  // trained weights: not the initial ones
      opt.zero_grad();
      loss_fn(model(b.idx.to(dev)), b.targets.to(dev)).backward();
      opt.step();
    }
    for (const auto& p : net->named_parameters()) original[p.key()] = p.value().detach().cpu().clone();
    dcp::save(get_model_state_dict(*net), (dir / "gpu").string());
    progress("[checkpoint round trip] saved from " + dev.str());
  }
  progress("[checkpoint round trip] the " + dev.str() + " group is destroyed");
  // Two CPU ranks load it (resharded), then save it again.
  run_ranks(2, [&](ProcessGroupPtr pg) {
    Net net(3);
    FSDPModule<Net> holder(net);  // the holder path: the parameters read as this rank's shards
    auto opts = FullyShardOptions().mesh(init_device_mesh(torch::kCPU, {2}, {}, pg));
    for (auto& b : net->blocks) fully_shard(b, opts);
    fully_shard(net, opts);
    auto sd = get_model_state_dict(*net);
    dcp::load(sd, (dir / "gpu").string());
    for (const auto& p : net->named_parameters()) {
      auto r = chunk_range(original.at(p.key()).size(0), 2, pg->rank());
      EXPECT_TRUE(p.value().equal(original.at(p.key()).narrow(0, r.offset, r.length))) << p.key();
    }
    dcp::save(get_model_state_dict(*net), (dir / "cpu").string());
  });
  progress("[checkpoint round trip] loaded and saved again on 2 CPU ranks");
  // Back onto the GPU.
  {
    DefaultGroupReset reset;
    auto pg = world_of_one(dev);
    Net net(3);
    net->to(dev);
    auto opts = FullyShardOptions().mesh(init_device_mesh(dev.type(), {1}, {}, pg));
    for (auto& b : net->blocks) fully_shard(b, opts);
    fully_shard(net, opts);
    auto sd = get_model_state_dict(*net);
    dcp::load(sd, (dir / "cpu").string());
    for (const auto& p : net->named_parameters()) {
      EXPECT_EQ(p.value().device().type(), dev.type()) << p.key();
      EXPECT_TRUE(p.value().detach().cpu().equal(original.at(p.key()))) << p.key() << " differs after the round trip through the CPU ranks";
    }
    progress("[checkpoint round trip] loaded back on " + dev.str());
  }
  fs::remove_all(dir);
}


TEST(CudaCheckpoint, GpuShardsToCpuRanksAndBackBitIdentical) {
  REQUIRE_CUDA();
  checkpoint_round_trip(kGpu);
}

// The same round trip from a CPU rank (runs everywhere): the CPU half of the GPU test, so that a failure of
// the GPU test that this one does not share is CUDA-specific.
TEST(CudaCheckpoint, CpuAnalogOfTheRoundTrip) { checkpoint_round_trip(torch::Device(torch::kCPU)); }

}  // namespace
}  // namespace fsdp::testing
