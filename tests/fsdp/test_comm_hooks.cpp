// FSDPModule's communication settings (CTest labels fully_shard, fsdp_api), as FSDP2's
// test_fully_shard_comm.py and test_fully_shard_training.py: custom all-gather and reduce-scatter (Comm),
// the all-reduce hook completing a manual 2-D data-parallel reduction, buffers from the process group's
// allocator, a reduce-scatter group of its own, set_unshard_in_backward, reset_iter_state,
// share_comm_ctx, and the settings libfsdp accepts with a fixed behaviour. Each trains the blocks + root
// model against one process on the global batch (fp32: full gradients every step at 1e-4 relative, final
// parameters at 1e-5), on 2, 3 (uneven rows) or 4 ranks.
#include <gtest/gtest.h>

#include <atomic>

#include "fsdp/fsdp_param_group.h"
#include "fsdp/fsdp_state.h"
#include "error_message.h"
#include "fully_shard_test_util.h"

namespace fsdp::testing {
namespace {

// Every fully_shard module of the blocks + root model: the blocks, then the root.
std::vector<FSDPModuleAPI> apis(Net& net) {
  std::vector<FSDPModuleAPI> out;
  for (auto& b : net->blocks) out.push_back(b.fsdp());
  out.push_back(fsdp_api(net));
  return out;
}

Net sharded_net(const DeviceMeshPtr& mesh) {
  Net net;
  load_full(*net, initial_weights());
  for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
  fully_shard(net, FullyShardOptions().mesh(mesh));
  return net;
}

// ---- Comm: set_custom_all_gather / set_custom_reduce_scatter ------------------------------------------

struct CountingAllGather : AllGather {
  int allocs = 0, calls = 0;
  torch::Tensor allocate(at::IntArrayRef size, torch::ScalarType dtype, torch::Device device) override {
    ++allocs;
    return torch::empty(size, torch::TensorOptions().dtype(dtype).device(device));
  }
  Work operator()(const torch::Tensor& output, const torch::Tensor& input, ProcessGroup& group, bool async_op) override {
    ++calls;
    return all_gather_into_tensor(output, input, group, async_op);
  }
};

// Another algorithm than the backend's reduce-scatter with the same sums: an all-reduce of the whole input,
// then this rank's chunk. `drop_flags` breaks it on purpose (the presence flags are left at zero).
struct AllReduceReduceScatter : ReduceScatter {
  int allocs = 0, calls = 0;
  torch::Tensor allocate(at::IntArrayRef size, torch::ScalarType dtype, torch::Device device) override {
    ++allocs;
    return torch::empty(size, torch::TensorOptions().dtype(dtype).device(device));
  }
  Work operator()(const torch::Tensor& output, const torch::Tensor& input, ProcessGroup& group, ReduceOp op,
                  bool async_op) override {
    ++calls;
    EXPECT_EQ(op, ReduceOp::SUM);
    auto sum = input.clone();
    all_reduce(sum, group, op);
    output.copy_(sum.view({group.size(), -1})[group.rank()]);
    return Work();  // done
  }
};

TEST(CommHooks, CustomAllGatherAndReduceScatterTrainLikeOneProcess) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches);
  for (int ws : {2, 3}) {
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      auto mesh = init_device_mesh(torch::kCPU, {ws});
      Net net = sharded_net(mesh);
      auto ag = std::make_shared<CountingAllGather>();
      auto rs = std::make_shared<AllReduceReduceScatter>();
      for (auto api : apis(net)) {
        api.set_custom_all_gather(ag);
        api.set_custom_reduce_scatter(rs);
      }
      auto& g = *mesh->get_group(0);
      const auto ag0 = g.collective_count("all_gather_into_tensor");
      const auto rs0 = g.collective_count("reduce_scatter_tensor");
      train_vs_reference(pg, net, batches, ref, std::to_string(ws) + " ranks, custom collectives");
      // Per step: forward gathers root + 2 blocks, backward the 2 blocks (the root stays unsharded);
      // 3 reduce-scatters. Every buffer came from the custom allocate (reduce-scatter: input and output).
      EXPECT_EQ(ag->calls, kSteps * 5);
      EXPECT_EQ(ag->allocs, ag->calls);
      EXPECT_EQ(rs->calls, kSteps * 3);
      EXPECT_EQ(rs->allocs, 2 * rs->calls);
      // The gradient checks' full_tensor() all-gathers go through the group; no reduce-scatter does.
      EXPECT_EQ(g.collective_count("reduce_scatter_tensor"), rs0) << "the default reduce-scatter ran";
      EXPECT_GT(g.collective_count("all_gather_into_tensor"), ag0);
      // null restores the default.
      for (auto api : apis(net)) api.set_custom_reduce_scatter(nullptr);
      FSDPModule<Net> model(net);
      auto b = batches[0].slice(pg->rank() * (kBatch / ws), kBatch / ws);
      loss_fn(model(b.idx), b.targets).backward();
      EXPECT_EQ(g.collective_count("reduce_scatter_tensor"), rs0 + 3);
    });
  }
}

struct WrongSizeAllGather : CountingAllGather {
  torch::Tensor allocate(at::IntArrayRef size, torch::ScalarType dtype, torch::Device device) override {
    return torch::empty({size[0] + 1}, torch::TensorOptions().dtype(dtype).device(device));
  }
};

TEST(CommHooks, CustomAllocationOfTheWrongSizeIsRefusedOnEveryRank) {
  auto batches = make_batches(1, kBatch, kSeq);
  run_ranks(2, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    Net net = sharded_net(mesh);
    fsdp_api(net).set_custom_all_gather(std::make_shared<WrongSizeAllGather>());
    FSDPModule<Net> model(net);
    auto b = batches[0].slice(pg->rank() * 6, 6);
    auto msg = error_message([&] { model(b.idx); });
    EXPECT_NE(msg.find("custom AllGather's allocate"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected a contiguous tensor of exactly that size"), std::string::npos) << msg;
  });
}

// ---- set_all_reduce_hook ---------------------------------------------------------------------------

// 4 ranks as 2 replicas of 2: FSDP shards over the "shard" dimension only, and the hook all-reduces the
// reduce-scattered gradients over "replicate" and halves them, which is HSDP done by hand: the
// gradients equal one process's on the global batch.
TEST(CommHooks, AllReduceHookCompletesAManualReplicaReduction) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches);
  run_ranks(4, [&](ProcessGroupPtr pg) {
    auto mesh2d = init_device_mesh(torch::kCPU, {2, 2}, {"replicate", "shard"});
    auto mesh = (*mesh2d)["shard"];
    auto replicate_pg = mesh2d->get_group(0);
    Net net = sharded_net(mesh);
    int calls = 0;
    int64_t numel = 0;
    // With PyTorch's stream argument (a stream of the mesh's device; on the CPU there are no side streams).
    const c10::Stream cpu_stream(c10::Stream::DEFAULT, c10::Device(torch::kCPU));
    for (auto api : apis(net)) {
      api.set_all_reduce_hook(
          [&](const torch::Tensor& reduced) {
            ++calls;
            numel += reduced.numel();
            all_reduce(reduced, *replicate_pg, ReduceOp::SUM);
            reduced.div_(2);
          },
          cpu_stream);
    }
    train_vs_reference(pg, net, batches, ref, "FSDP over 2 ranks + hook over 2 replicas");
    EXPECT_EQ(calls, kSteps * 3);
    int64_t padded = 0;  // every trainable parameter's padded shard, per step
    for (const auto& p : net->named_parameters()) {
      const int64_t d0 = p.value().dim() ? ref.final_params.at(p.key()).size(0) : 1;
      padded += (d0 + 1) / 2 * (ref.final_params.at(p.key()).numel() / d0);
    }
    EXPECT_EQ(numel, kSteps * padded) << "the hook sees the gradients without the presence flags";
  });
}

// ---- set_allocate_memory_from_process_group_for_comm, set_symm_mem_for_comm ---------------------------

TEST(CommHooks, ProcessGroupAllocatorTrainsLikeOneProcessAndExcludesCustomComms) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches);
  run_ranks(2, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {2});
    Net net = sharded_net(mesh);
    for (auto api : apis(net)) api.set_allocate_memory_from_process_group_for_comm(true);
    // Gloo has no allocator of its own: the buffers come from the pool as by default.
    train_vs_reference(pg, net, batches, ref, "process-group allocation");
    auto msg = error_message([&] { fsdp_api(net).set_custom_all_gather(std::make_shared<CountingAllGather>()); });
    EXPECT_NE(msg.find("set_allocate_memory_from_process_group_for_comm"), std::string::npos) << msg;
    fsdp_api(net).set_allocate_memory_from_process_group_for_comm(false);
    fsdp_api(net).set_custom_all_gather(std::make_shared<CountingAllGather>());
    msg = error_message([&] { fsdp_api(net).set_allocate_memory_from_process_group_for_comm(true); });
    EXPECT_NE(msg.find("has a custom all-gather"), std::string::npos) << msg;
    msg = error_message([&] { fsdp_api(net).set_symm_mem_for_comm(); });
    EXPECT_NE(msg.find("refused"), std::string::npos) << msg;
    EXPECT_NE(msg.find("set_allocate_memory_from_process_group_for_comm(true)"), std::string::npos) << msg;
  });
}

// ---- set_separate_reduce_scatter_group ---------------------------------------------------------------

TEST(CommHooks, SeparateReduceScatterGroupTrainsLikeOneProcess) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches);
  for (int ws : {2, 3}) {
    run_ranks(ws, [&](ProcessGroupPtr pg) {
      auto mesh = init_device_mesh(torch::kCPU, {ws});
      Net net = sharded_net(mesh);
      fsdp_api(net).set_separate_reduce_scatter_group();  // recursive: the blocks too
      auto& g = *mesh->get_group(0);
      const auto rs0 = g.collective_count("reduce_scatter_tensor");
      train_vs_reference(pg, net, batches, ref, std::to_string(ws) + " ranks, separate reduce-scatter group");
      EXPECT_EQ(g.collective_count("reduce_scatter_tensor"), rs0) << "a reduce-scatter ran on the shared group";
      fsdp_api(net).set_separate_reduce_scatter_group(false);
      FSDPModule<Net> model(net);
      auto b = batches[0].slice(pg->rank() * (kBatch / ws), kBatch / ws);
      loss_fn(model(b.idx), b.targets).backward();
      EXPECT_EQ(g.collective_count("reduce_scatter_tensor"), rs0 + 3) << "false goes back to the shared group";
      fsdp_api(net).set_separate_reduce_scatter_group(true);  // a new group again (its own store keys)
      loss_fn(model(b.idx), b.targets).backward();
      EXPECT_EQ(g.collective_count("reduce_scatter_tensor"), rs0 + 3) << "enabled again";
    });
  }
}

// ---- set_unshard_in_backward ------------------------------------------------------------------------

// The embedding in a group of its own (an unchanged torch::nn::Embedding: implicit group): its backward
// reads only the indices, so set_unshard_in_backward(false) saves its backward all-gather. On a block,
// whose backward does read its weights, the parameters are gathered when the backward reads them: same
// gradients, no saving.
TEST(CommHooks, UnshardInBackwardFalseSavesTheEmbeddingsAllGather) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches);
  for (int ws : {2, 3}) {
    for (bool on_block : {false, true}) {
      run_ranks(ws, [&](ProcessGroupPtr pg) {
        auto mesh = init_device_mesh(torch::kCPU, {ws});
        Net net;
        load_full(*net, initial_weights());
        fully_shard(net->wte.ptr(), FullyShardOptions().mesh(mesh));
        for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
        fully_shard(net, FullyShardOptions().mesh(mesh));
        auto& g = *mesh->get_group(0);
        if (on_block) {
          net->blocks[1].set_unshard_in_backward(false);
        } else {
          fsdp_api(*net->wte).set_unshard_in_backward(false);
        }
        uint64_t before = 0;
        const auto what = std::to_string(ws) + " ranks, unshard_in_backward(false) on " + (on_block ? "block 1" : "wte");
        train_vs_reference(pg, net, batches, ref, what, [&](size_t step, bool after) {
          // Forward: wte, 2 blocks, root; backward: the blocks (and wte unless it is skipped).
          const auto now = g.collective_count("all_gather_into_tensor");
          if (after) {
            EXPECT_EQ(now - before, on_block ? 7u : 6u) << what << ", step " << step;
          }
          before = now;
        });
      });
    }
  }
}

// A holder embedding (fsdp::FSDPModule<torch::nn::Embedding>) with set_unshard_in_backward(false): its
// gradient arrives while the group is not gathered (the parameter then has its unsharded shape without
// data), sharded on dim 0 and on dim 1 (Shard(1): the gradient's strides differ from the shard's). 2
// all-gathers per step instead of 3; gradients as one process's.
struct EmbHeadImpl : torch::nn::Module {
  FSDPModule<torch::nn::Embedding> emb{nullptr};
  torch::nn::Linear head{nullptr};
  EmbHeadImpl() {
    emb = register_module("emb", torch::nn::Embedding(11, 6));
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  torch::Tensor forward(torch::Tensor idx) { return head(emb(idx)).mean(1); }
};
TORCH_MODULE(EmbHead);

TEST(CommHooks, UnshardInBackwardFalseOnAHolderEmbedding) {
  torch::manual_seed(5);
  EmbHead init;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(13);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> data;
  for (int i = 0; i < 4; ++i) data.emplace_back(torch::randint(0, 11, {12, 3}, gen), torch::randn({12, 3}, gen));
  auto copy_init = [&](EmbHead& m) {
    torch::NoGradGuard g;
    for (auto& p : m->named_parameters()) p.value().copy_(init->named_parameters()[p.key()]);
  };
  EmbHead ref;
  copy_init(ref);
  torch::optim::SGD ref_opt(ref->parameters(), 0.1);
  std::vector<std::map<std::string, torch::Tensor>> ref_grads;
  for (auto& [idx, y] : data) {
    ref_opt.zero_grad();
    torch::mse_loss(ref(idx), y).backward();
    std::map<std::string, torch::Tensor> g;
    for (auto& p : ref->named_parameters()) g[p.key()] = p.value().grad().clone();
    ref_grads.push_back(g);
    ref_opt.step();
  }
  for (int ws : {2, 3}) {
    for (bool dim1 : {false, true}) {
      run_ranks(ws, [&](ProcessGroupPtr pg) {
        const std::string what = std::to_string(ws) + " ranks, embedding on dim " + (dim1 ? "1" : "0");
        auto mesh = init_device_mesh(torch::kCPU, {ws});
        EmbHead m;
        copy_init(m);
        auto emb_opts = FullyShardOptions().mesh(mesh);
        if (dim1) {
          emb_opts.shard_placement_fn([](const std::string&, const torch::Tensor&) -> std::optional<Placement> {
            return Shard(1);
          });
        }
        fully_shard(m->emb, emb_opts);
        fully_shard(m, FullyShardOptions().mesh(mesh));
        m->emb.set_unshard_in_backward(false);
        FSDPModule<EmbHead> model(m);
        torch::optim::SGD opt(m->parameters(), 0.1);
        auto& g = *mesh->get_group(0);
        const int64_t local = 12 / ws;
        for (size_t s = 0; s < data.size(); ++s) {
          opt.zero_grad();
          const auto before = g.collective_count("all_gather_into_tensor");
          torch::mse_loss(model(data[s].first.slice(0, pg->rank() * local, (pg->rank() + 1) * local)),
                          data[s].second.slice(0, pg->rank() * local, (pg->rank() + 1) * local))
              .backward();
          EXPECT_EQ(g.collective_count("all_gather_into_tensor") - before, 2u) << what << ", step " << s;
          for (auto& p : m->named_parameters()) {
            auto full = sharded_grad(p.value())->full_tensor();
            EXPECT_TRUE(torch::allclose(full, ref_grads[s].at(p.key()), kGradRtol, kGradAtol))
                << p.key() << " at step " << s << " (" << what << "): max |diff| "
                << max_abs_diff(full, ref_grads[s].at(p.key()));
          }
          opt.step();
        }
      });
    }
  }
}

// ---- reset_iter_state ----------------------------------------------------------------------------

// Two failures, each followed by reset_iter_state on the root: a microbatch accumulated without sync whose
// step is then abandoned, and a forward that throws inside the root's module (an index out of range).
// The steps after each continue exactly as one process that never saw the failed work.
TEST(CommHooks, ResetIterStateDropsTheFailedIterationsWork) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches);
  for (bool hsdp : {false, true}) {
    run_ranks(4, [&](ProcessGroupPtr pg) {
      auto mesh = hsdp ? init_device_mesh(torch::kCPU, {2, 2}, {"replicate", "shard"})
                       : init_device_mesh(torch::kCPU, {4});
      Net net;
      load_full(*net, initial_weights());
      for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh));
      fully_shard(net, FullyShardOptions().mesh(mesh));
      FSDPModule<Net> model(net);
      auto opt = make_optimizer(net->parameters(), Opt::ADAMW);
      const std::string what = hsdp ? "HSDP 2 x 2" : "FSDP over 4";
      const int64_t local = kBatch / 4;
      for (size_t step = 0; step < batches.size(); ++step) {
        auto b = batches[step].slice(pg->rank() * local, local);
        opt->zero_grad();
        if (step == 2) {
          // Work held back across backwards, then the step is abandoned: FSDP, a microbatch without sync
          // (unsharded gradients kept); HSDP, that and a microbatch whose all-reduce is deferred (the
          // reduce-scattered sum kept). Without reset_iter_state the next backward would add them in.
          model.set_requires_gradient_sync(false);
          loss_fn(model(b.idx), b.targets).backward();
          model.set_requires_gradient_sync(true);
          if (hsdp) {
            model.set_requires_all_reduce(false);
            loss_fn(model(b.idx), b.targets).backward();
            model.set_requires_all_reduce(true);
          }
          model.reset_iter_state();
          opt->zero_grad();
        }
        if (step == 4) {
          auto bad = b.idx.clone();
          bad[0][0] = kVocab + 5;  // out of range for the embedding: the root's forward throws
          EXPECT_THROW(model(bad), c10::Error);
          model.reset_iter_state();
        }
        loss_fn(model(b.idx), b.targets).backward();
        expect_gradients_match(*net, ref, step, what);
        opt->step();
      }
      auto msg = error_message([&] { net->blocks[0].reset_iter_state(); });
      EXPECT_NE(msg.find("is not the root"), std::string::npos) << msg;
    });
  }
}

// ---- share_comm_ctx ------------------------------------------------------------------------------

TEST(CommHooks, ShareCommCtxTwoRootsTrainLikeOneProcess) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches);
  run_ranks(2, [&](ProcessGroupPtr pg) {
    // Two models on two meshes over the same ranks (two contexts until shared).
    auto mesh_a = init_device_mesh(torch::kCPU, {2});
    auto mesh_b = init_device_mesh(torch::kCPU, {2});
    Net a = sharded_net(mesh_a), b = sharded_net(mesh_b);
    auto context = [](const std::shared_ptr<torch::nn::Module>& m) {
      return detail::fsdp_state(fsdp_api(*m)).group->comm_context().get();
    };
    EXPECT_NE(context(a.ptr()), context(b.ptr())) << "two meshes, two contexts";
    share_comm_ctx({a.ptr(), b.ptr()});
    EXPECT_EQ(context(a.ptr()), context(b.ptr()));
    EXPECT_EQ(context(a->blocks[1].ptr()), context(b->blocks[0].ptr()));
    train_vs_reference(pg, a, batches, ref, "first of two roots sharing a context");
    train_vs_reference(pg, b, batches, ref, "second of two roots sharing a context");
    auto msg = error_message([&] { share_comm_ctx({a.ptr(), std::make_shared<torch::nn::LinearImpl>(2, 2)}); });
    EXPECT_NE(msg.find("is not sharded"), std::string::npos) << msg;
    msg = error_message([&] { share_comm_ctx({a.ptr(), b.ptr()}); });
    EXPECT_NE(msg.find("already ran a forward"), std::string::npos) << msg;
  });
}

// ---- Settings with a fixed behaviour in libfsdp --------------------------------------------------------

TEST(CommHooks, FixedBehaviourSettingsAreAcceptedAndTrainLikeOneProcess) {
  auto batches = make_batches(kSteps, kBatch, kSeq);
  auto ref = run_reference(batches);
  run_ranks(3, [&](ProcessGroupPtr pg) {
    auto mesh = init_device_mesh(torch::kCPU, {3});
    Net net = sharded_net(mesh);
    auto root = fsdp_api(net);
    root.set_force_sum_reduction_for_comms(true);
    root.set_force_sum_reduction_for_comms(false);
    root.set_reduce_scatter_unused_params(false);
    root.set_reduce_scatter_max_input_buffers(2);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    for (auto api : apis(net)) api.set_reduce_scatter_divide_factor(3.0);  // the default factor: same numbers
#pragma GCC diagnostic pop
    root.set_post_optim_event(std::make_shared<c10::Event>(c10::DeviceType::CPU));  // no streams on the CPU
    train_vs_reference(pg, net, batches, ref, "fixed-behaviour settings");
    auto msg = error_message([&] { root.set_reduce_scatter_max_input_buffers(0); });
    EXPECT_NE(msg.find("expected a positive count, got 0"), std::string::npos) << msg;
    msg = error_message([&] { net->blocks[0].set_post_optim_event(nullptr); });
    EXPECT_NE(msg.find("is not the root"), std::string::npos) << msg;
    const c10::Stream cuda_stream(c10::Stream::UNSAFE, c10::Device(torch::kCUDA, 0), 0);  // (never used)
    msg = error_message([&] { root.set_all_reduce_hook([](const torch::Tensor&) {}, cuda_stream); });
    EXPECT_NE(msg.find("but the hook's stream is on cuda:0"), std::string::npos) << msg;
  });
}

}  // namespace
}  // namespace fsdp::testing
