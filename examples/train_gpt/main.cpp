// train_gpt: trains a GPT-2-style byte-level language model on English text across ranks with FSDP2
// (libfsdp), evaluates it on a held-out split and prints a sample.
//
//   build/bin/fsdprun --standalone --nproc-per-node 2 -- build/bin/train_gpt --model small --steps 300
//   torchrun --standalone --nproc-per-node 2 --no-python build/bin/train_gpt ...   (the same)
//   build/bin/train_gpt ...                                                      (one process, no launcher)
//
// Reading order, the way torchtitan lays out its trainer:
//   parallelize.h/.cpp    how FSDP2 is applied to the model: the file to read first
//   main.cpp (this file)  run() parses and validates everything (on every rank, before any
//                         communication), loads the data, initialises the process group; train() builds
//                         the model on every rank from one seed, shards it with parallelize() and runs
//                         the loop of train_step()s; evaluate() and generate() do the rest
//   options.h/.cpp        the command line, presets and the checks of the input
//   optimizer.h/.cpp      AdamW (foreach kernels on CUDA) and the learning-rate schedule
//   checkpointing.h/.cpp  --ckpt-dir and --resume: distributed checkpoints (fsdp::dcp)
//   reporting.h/.cpp      banner, log lines, progress bar, --metrics, memory, MFU, summary
//   interop.h             --save-init, --dump-batches and --no-shard, for bench/compare_fsdp2.py
//   data.h, model.h       the corpus and sampler, the model: plain LibTorch
//   model_plain.h         the same model without any libfsdp type (--model-impl plain): what fully_shard
//                         takes unchanged, as PyTorch's does

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include "checkpointing.h"
#include "data.h"
#include "fsdp/fsdp.h"
#include "interop.h"
#include "model.h"
#include "model_plain.h"
#include "optimizer.h"
#include "options.h"
#include "parallelize.h"
#include "reporting.h"

namespace train_gpt {
namespace {

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  // In fp32 whatever the compute dtype: a log-softmax over 256 classes in bf16 loses the small probabilities.
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat32).reshape({-1, logits.size(-1)}),
                                              targets.reshape({-1}));
}

// `Model`, here and below: the model holder of --model-impl, fsdp::FSDPModule<GPT> (holder) or PlainGPT
// (plain). Both are called as `model(x)` and have the same members (cfg, num_params(), unique_parameters()).

/// Mean loss over the fixed evaluation batches of the validation split, averaged over ranks.
/// Every rank runs the same number of forwards (the blocks all-gather their parameters in each).
template <typename Model>
double evaluate(Model& model, const TokenWindows& val, int64_t num_batches, int64_t batch_size, int tp,
                fsdp::ProcessGroup& pg) {
  model->eval();
  torch::NoGradGuard no_grad;
  auto sum = torch::zeros({1}, torch::TensorOptions(torch::kDouble).device(pg.device()));
  for (int64_t b = 0; b < num_batches; ++b) {
    // The ranks of a TP group evaluate the same windows (each computes the same loss: the sum over all
    // ranks is tp x the data-parallel sum, and so is the divisor below).
    auto [x, y] = val.get(eval_indices(b, batch_size, pg.rank() / tp, pg.size() / tp));
    sum += lm_loss(model(x.to(pg.device())), y.to(pg.device())).to(torch::kDouble);
  }
  fsdp::all_reduce(sum, pg, fsdp::ReduceOp::SUM);
  model->train();
  return sum.item<double>() / static_cast<double>(num_batches * pg.size());
}

/// Continues `prompt` by `num_tokens` bytes. Every rank runs every forward in lockstep (each forward
/// all-gathers the blocks' parameters); rank 0 draws each byte and broadcasts it, so all ranks extend
/// the same text even if their logits differed in the last bit. Deterministic given `seed`.
template <typename Model>
std::string generate(Model& model, const std::string& prompt, int64_t num_tokens,
                     double temperature, int64_t top_k, uint64_t seed, fsdp::ProcessGroup& pg) {
  model->eval();
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<int64_t> tokens;
  for (unsigned char c : (prompt.empty() ? std::string("\n") : prompt)) tokens.push_back(c);
  const int64_t context = model->cfg.block_size;
  std::string out;
  for (int64_t i = 0; i < num_tokens; ++i) {
    const auto begin = tokens.size() > static_cast<size_t>(context) ? tokens.end() - context : tokens.begin();
    auto idx = torch::tensor(std::vector<int64_t>(begin, tokens.end()), torch::kLong).unsqueeze(0);  // [1, T]
    const int64_t T = idx.size(1);
    // Sequence parallelism splits the sequence evenly over the TP ranks: pad on the right to a multiple
    // of tp (block_size is one). Exact: attention is causal, so no real position sees the padding.
    if (const auto& sp = model->sequence_parallel_mesh) {
      const int64_t tp = sp->size(0), padded = (T + tp - 1) / tp * tp;
      idx = torch::cat({idx, torch::zeros({1, padded - T}, torch::kLong)}, 1);
    }
    auto logits = model(idx.to(pg.device())).select(1, T - 1).squeeze(0).to(torch::kCPU, torch::kFloat32);  // [vocab]
    auto next = torch::zeros({1}, torch::kLong);
    if (pg.rank() == 0) {
      if (temperature == 0.0) {
        next = logits.argmax().reshape({1});
      } else {
        logits = logits / temperature;
        if (top_k > 0 && top_k < logits.size(0)) {
          auto kth = std::get<0>(logits.topk(top_k)).min();
          logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
        }
        next = torch::multinomial(torch::softmax(logits, 0), 1, /*replacement=*/false, gen);
      }
    }
    next = next.to(pg.device());  // NCCL broadcasts device tensors
    fsdp::broadcast(next, /*src=*/0, pg);
    tokens.push_back(next.item<int64_t>());
    out.push_back(static_cast<char>(tokens.back()));
  }
  model->train();
  return out;
}

/// What train_step() works on: built once by train().
template <typename Model>
struct Training {
  const RunSetup& s;
  fsdp::ProcessGroup& pg;
  Model& model;
  torch::optim::AdamW& optimizer;
  std::optional<fsdp::ShardedGradScaler>& scaler;  // fp16 only
  DistributedSampler& sampler;
  std::optional<BatchRecorder>& recorder;  // --dump-batches
  std::vector<torch::Tensor> params;       // local shards: what clipping sees
  bool foreach_optimizer;
  fsdp::ProcessGroupPtr replicate_group = nullptr;  // HSDP (--dp-replicate > 1): the replicas of this shard group
};

/// This rank's model states, bytes: the parameters' storage (a sharded parameter's is FSDP's padded
/// shard), the gradients and AdamW's state (local rows).
struct ModelStates {
  int64_t params = 0, grads = 0, optimizer = 0;
  int64_t total() const { return params + grads + optimizer; }
};

ModelStates model_states(const std::vector<torch::Tensor>& params, torch::optim::AdamW& optimizer) {
  ModelStates m;
  for (const auto& p : params) {
    m.params += static_cast<int64_t>(p.storage().nbytes());
    if (p.grad().defined()) m.grads += static_cast<int64_t>(p.grad().nbytes());
  }
  for (const auto& [key, state] : optimizer.state()) {
    const auto& a = static_cast<const torch::optim::AdamWParamState&>(*state);
    for (const auto* t : {&a.exp_avg(), &a.exp_avg_sq(), &a.max_exp_avg_sq()}) {
      if (t->defined()) m.optimizer += static_cast<int64_t>(t->nbytes());
    }
  }
  return m;
}

struct StepResult {
  double loss;       ///< mean loss of the global batch (identical on every rank)
  double grad_norm;  ///< norm of the full gradient, before clipping
  ModelStates states;  ///< after the optimizer step, before zero_grad (when asked for; else zeros)
};

/// One optimizer step at learning rate `lr` over --grad-accum-steps microbatches of this rank;
/// `count_states`: also count the model states (once per run: not on the per-step path).
template <typename Model>
StepResult train_step(Training<Model>& t, double lr, bool count_states) {
  const Options& o = t.s.opts;
  const torch::Device device = t.pg.device();
  for (auto& group : t.optimizer.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  // Gradient accumulation: the gradients of every microbatch but the last stay local and unsharded
  // (no reduce-scatter); the last backward reduce-scatters the accumulated sum once.
  auto loss_sum = torch::zeros({1}, torch::TensorOptions().device(device));
  for (int64_t micro = 0; micro < o.grad_accum_steps; ++micro) {
    auto [x, y] = t.s.train.get(t.sampler.next());
    if (t.recorder) t.recorder->add(x, y);
    x = x.to(device, /*non_blocking=*/false);
    y = y.to(device, /*non_blocking=*/false);
    if (!o.no_shard) fsdp::fsdp_api(t.model).set_requires_gradient_sync(micro == o.grad_accum_steps - 1);
    torch::Tensor logits;
    if (!o.no_shard || t.s.parallel.param_dtype == torch::kFloat32) {
      logits = t.model(x);
    } else {  // --no-shard (the floor): mixed precision the plain-LibTorch way, by autocast around the forward
      CpuAutocast autocast(t.s.parallel.param_dtype, device.type());
      logits = t.model(x);
    }
    auto loss = lm_loss(logits, y) / static_cast<double>(o.grad_accum_steps);
    (t.scaler ? t.scaler->scale(loss) : loss).backward();
    loss_sum += loss.detach();
  }
  // The norm of the full gradient (an all-reduce of the shards' partial norms): identical on every
  // rank, so every rank scales its shard by the same factor.
  // With fp16 the gradients are unscaled first; a step with inf/nan gradients is skipped (the norm
  // logged is then inf) and the scale backs off.
  const double max_norm = o.clip_grad > 0 ? o.clip_grad : std::numeric_limits<double>::infinity();
  if (t.scaler) t.scaler->unscale_(t.optimizer);
  // Sharded: the loss of the global batch (the sum of the ranks' means) is all-reduced in the norm's
  // collective (one all-reduce per step instead of two; bit-identical, see fsdp::clip_grad_norm_).
  const double norm =
      (o.no_shard ? fsdp::clip_grad_norm_(t.params, max_norm)
                  : fsdp::clip_grad_norm_(t.params, max_norm, 2.0, false, nullptr, loss_sum))
          .template item<double>();
  if (t.scaler) {
    t.scaler->step(t.optimizer);
    t.scaler->update();
  } else if (t.foreach_optimizer) {
    foreach_adamw_step(t.optimizer);
  } else {
    t.optimizer.step();
  }
  const ModelStates states = count_states ? model_states(t.params, t.optimizer) : ModelStates{};
  t.optimizer.zero_grad();
  // The loss of the global batch: the mean of the ranks' means (equal batch sizes); sharded runs summed
  // it over the ranks with the gradient norm above.
  if (o.no_shard) fsdp::all_reduce(loss_sum, t.pg, fsdp::ReduceOp::SUM);
  // HSDP: the norm's group is the shard group; the replicas' losses are summed too.
  if (t.replicate_group) fsdp::all_reduce(loss_sum, *t.replicate_group, fsdp::ReduceOp::SUM);
  return {loss_sum.item<double>() / (t.pg.size() / t.s.parallel.tp), norm, states};
}

// [Note: glibc keeps freed memory]
// LibTorch's CPU allocator is glibc's malloc. With glibc's defaults every tensor above the mmap threshold
// (128 KiB, rising with use up to 32 MiB) is a fresh mmap, and memory freed at the top of the heap goes
// back to the kernel; the next step's tensors of the same sizes then fault in and zero their pages again:
// 6,000-18,000 minor faults per step on the `wide` benchmark config, for FSDP and the no-FSDP floor alike
// (issue 16, part 2). A CPU training step allocates the same sizes every step, so train_gpt keeps what it
// frees: allocations up to 32 MiB (glibc's largest threshold) come from the heap and the heap is never
// trimmed. Steady-state steps then fault zero times and the peak RSS stays what it was (measured: wide
// 568 MiB either way). Not done when the user tunes malloc through the environment (GLIBC_TUNABLES,
// MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_), nor on CUDA, whose caching allocator already reuses.
void keep_freed_memory() {
  for (const char* v : {"GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}) {
    if (std::getenv(v)) return;
  }
  mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
}

template <typename Model>
int train(const RunSetup& s, const ResumePlan& plan, const fsdp::ProcessGroupPtr& pg) {
  const Options& o = s.opts;
  const int rank = pg->rank(), world = pg->size();
  if (o.threads > 0) torch::set_num_threads(o.threads);
  const torch::Device device = pg->device();
  if (device.is_cpu()) keep_freed_memory();
  auto mesh = make_mesh(device.type(), world, s.parallel);  // 1-D, or (dp_replicate, dp_shard, tp)
  const int tp = s.parallel.tp, data_rank = rank / tp, data_world = world / tp;  // a TP group shares its data

  // Identical initial weights on every rank (and for every world size): one seed. Sharded runs build the
  // model with fsdp::deferred_init (no rank ever holds the full model: each fills only its rows, with the
  // values eager construction gives); --no-shard and --save-init (which writes the full weights) build it
  // in full, on the CPU, and move it to the device.
  const double rss_before = current_rss_mb();
  torch::manual_seed(o.seed);
  // (Tensor parallelism shards the eagerly built model: deferred_init knows FSDP's rows only.)
  const bool sharded_init = !o.no_shard && o.save_init.empty() && tp == 1;
  Model model = sharded_init ? fsdp::deferred_init([&] { return Model(s.cfg); }) : Model(s.cfg);
  const DecayGroups groups = decay_groups(*model);  // on the full shapes, before sharding
  Reporter report(s, model->num_params(), pg);
  if (!o.save_init.empty() && rank == 0) save_initial_weights(*model, s.cfg, o.save_init);
  // (with --cpu-offload the shards stay on the CPU: fully_shard puts them in pinned host memory).
  if (!sharded_init && device.is_cuda() && !o.cpu_offload) model->to(device);
  if (!o.no_shard) parallelize(model, mesh, s.parallel);
  if (sharded_init) {
    fsdp::materialize_module(model);
    for (auto& b : model->buffers()) {
      if (b.device() != device && !o.cpu_offload) b.set_data(b.to(device));
    }
  }
  report.say("model built" + std::string(sharded_init ? " sharded (deferred_init)" : " in full") + ": peak RSS +" +
             std::to_string(std::lround(peak_rss_mb() - rss_before)) + " MiB over the " +
             std::to_string(std::lround(rss_before)) + " MiB before construction (rank " + std::to_string(rank) + ")");
  std::optional<BatchRecorder> recorder;
  if (!o.dump_batches.empty()) recorder.emplace(o.dump_batches);
  torch::optim::AdamW optimizer = make_adamw(groups, o);
  // fp16 only: dynamic loss scaling, so that small gradients do not flush to zero in fp16. Every rank
  // skips the same steps (the inf/nan check is all-reduced). bf16 has fp32's range and needs none.
  std::optional<fsdp::ShardedGradScaler> scaler;
  if (s.parallel.param_dtype == torch::kHalf) scaler.emplace(fsdp::GradScalerOptions(), pg);
  DistributedSampler sampler(s.train.size(), o.batch_size, data_rank, data_world, o.seed);
  // fp16's scaler steps torch::optim::AdamW itself.
  Training<Model> t{s, *pg, model, optimizer, scaler, sampler, recorder, model->unique_parameters(),
             !scaler && (o.optimizer_impl == "foreach" || (o.optimizer_impl == "auto" && device.is_cuda())),
             s.parallel.dp_replicate > 1 ? mesh->get_group("dp_replicate") : nullptr};
  const auto kill_at = kill_after_checkpoint(plan.restart);
  report.banner(sampler.batches_per_epoch() / o.grad_accum_steps, t.foreach_optimizer);

  // --stop-at: this run's last step (the learning-rate schedule still spans --steps).
  const int64_t last_step = o.stop_at > 0 ? std::min(o.stop_at, o.steps) : o.steps;
  int64_t start_step = 0;
  if (plan.resume) {  // [checkpoints] before the first evaluation; the loop then starts at step N + 1
    const Resumed r = resume(o, plan, s.train.size(), last_step, *model, optimizer, sampler, scaler, pg);
    start_step = r.step;
    report.restore_first_eval(r.first_eval);
    report.say(r.message);
  }
  report.open_metrics(plan.resume ? start_step : -1);
  if (mesh->ndim() > 1) {  // FSDP's and TP's collectives run on the mesh's dims, not on the world group
    report.watch_groups({{"dp_replicate", mesh->get_group("dp_replicate")},
                         {"dp_shard", mesh->get_group("dp_shard")},
                         {"tp", mesh->get_group("tp")}});
  }
  auto run_eval = [&](int64_t step) {
    const double loss = evaluate(model, s.val, s.eval_batches, o.batch_size, tp, *pg);
    report.eval(step, loss);
    return loss;
  };
  // The evaluation before training (the "first" evaluation loss): ~ln(256) = 5.55 for a fresh model.
  if (start_step == 0) report.initial_metrics(run_eval(0));

  const auto t_train = Clock::now();
  const nlohmann::json ckpt_run = checkpoint_run_info(o, s.cfg, s.train.size(), world);
  for (int64_t step = start_step + 1; step <= last_step; ++step) {
    const auto t0 = Clock::now();
    const double lr = lr_at(step, o);
    const StepResult r = train_step(t, lr, /*count_states=*/step == start_step + 1);
    report.step(step, lr, r.loss, r.grad_norm, seconds_since(t0), [&] { return run_eval(step); });
    if (step == start_step + 1) {  // rank 0's (it holds ceil(dim0 / N) rows of every parameter: the most)
      const double mib = 1 << 20, ideal = 16.0 * static_cast<double>(model->num_params()) / world;
      report.say("model states on rank 0: params " + fmt("%.1f", r.states.params / mib) + " + grads " +
                 fmt("%.1f", r.states.grads / mib) + " + optimizer " + fmt("%.1f", r.states.optimizer / mib) +
                 " = " + fmt("%.1f", r.states.total() / mib) + " MiB; 16 x P / N = " + fmt("%.1f", ideal / mib) +
                 " MiB (x" + fmt("%.4f", r.states.total() / ideal) + ", fp32 AdamW with no padding)");
    }
    // [checkpoints] after the step and its evaluation, every rank writing its shards.
    if (checkpoint_due(o, step, last_step)) {
      const auto t_save = Clock::now();
      const std::string path =
          save_checkpoint(o, ckpt_run, step, *model, optimizer, sampler, scaler, report.first_eval_json());
      report.say("checkpoint: " + path + " saved in " + fmt("%.2f", seconds_since(t_save)) + " s");
      kill_if_due(kill_at, step, rank);
    }
  }
  // A resumed run that had nothing left to train still reports where the model stands.
  if (!report.evaluated() && start_step > 0 && start_step >= last_step) run_eval(start_step);
  report.end_of_training(last_step);
  const double wall = seconds_since(t_train);
  if (recorder) recorder->write(rank, o.grad_accum_steps, run_description(s, world, start_step));
  // The sample: every rank runs the forwards, rank 0 prints.
  std::string sample;
  if (o.sample_tokens > 0) sample = generate(model, o.sample_prompt, o.sample_tokens, o.temperature, o.top_k, o.seed, *pg);
  report.summary(start_step, last_step, wall, sample);
  return 0;
}

// ---- --estimate-memory (issue 14) ---------------------------------------------------------------------

/// Peak activation bytes of one microbatch's forward + backward on one rank, from the model shape: what
/// autograd saves (B x T x C elements unless said otherwise, in the compute dtype e), counted from
/// model.cpp's forward:
///   per block 16: its input (saved by ln_1), ln_1's output (by c_attn), qkv 3 (by SDPA, as q/k/v views),
///     SDPA's output 1 (also c_proj's input: LibTorch's CPU flash attention allocates it [B, T, H, D], so
///     transpose(1, 2).contiguous() is free), the residual sum 1 (by ln_2), ln_2's
///     output 1 (by c_fc), c_fc's output 4 (by GELU), GELU's output 4 (by mlp.c_proj); plus fp32 stats:
///     LayerNorm mean + rstd (2 x 2 x B x T) and SDPA's logsumexp (B x H x T);
///   head: the last block's output (by ln_f) 1, ln_f's output 1 (by lm_head), the logits B x T x V in e
///     (train_step keeps them), log_softmax's fp32 output B x T x V (by nll_loss);
///   backward temporaries: the larger of the loss's two fp32 B x T x V gradients and a block's MLP
///     gradients (4 + 4 + 2 residual).
/// With activation checkpointing a block saves only its input; one block at a time is recomputed (its 15
/// inner tensors and stats come back during its backward).
int64_t gpt_activation_bytes(const GPTConfig& c, int64_t batch, int64_t e, bool checkpointing) {
  const int64_t B = batch, T = c.block_size, C = c.n_embd, L = c.n_layer, H = c.n_head, V = c.vocab_size;
  const int64_t btc = B * T * C * e;
  const int64_t stats = 2 * 2 * B * T * 4 + B * H * T * 4;
  const int64_t head = 2 * btc + B * T * V * e + B * T * V * 4;
  const int64_t backward_tmp = std::max<int64_t>(2 * B * T * V * 4, 10 * btc);
  const int64_t blocks = checkpointing ? (L * btc + 15 * btc + stats) : L * (16 * btc + stats);
  return blocks + head + backward_tmp;
}

// LibTorch's own first-use memory on the CPU over the process baseline, independent of the model: the
// OpenMP and autograd threads, oneDNN/MKL scratch and JIT code, glibc's per-thread arenas. Measured with
// the tiny preset (model states and activations < 1 MiB, so its RSS growth is this overhead): 15 MiB in
// fp32, 28 MiB with bf16/fp16 compute (oneDNN's reduced-precision kernels); see docs/BENCHMARKS.md,
// "Memory estimator (issue 14, part 2)".
int64_t cpu_runtime_overhead_bytes(torch::ScalarType compute) {
  return (compute == torch::kFloat32 ? 15 : 28) * (int64_t(1) << 20);
}

/// Prints fsdp::estimate_memory's breakdown for this run (rank 0) without building anything but meta
/// tensors: the same groups parallelize() makes (every block, then the root, which keeps its parameters
/// unsharded from forward to backward).
void print_memory_estimate(const RunSetup& s, int world, int rank, bool cuda) {
  const Options& o = s.opts;
  auto model = fsdp::deferred_init([&] { return GPT(s.cfg); });  // meta tensors: sizes and dtypes only
  std::vector<std::string> sharded = {""};  // forward order: the root (embeddings) first, then the blocks
  for (int64_t i = 0; i < s.cfg.n_layer; ++i) sharded.push_back("h." + std::to_string(i));
  auto groups = fsdp::shard_groups(*model, sharded);
  groups[0].reshard_after_forward = false;  // the root's default
  fsdp::MemoryEstimateOptions eo;
  eo.world_size = world;
  eo.reshard_after_forward = o.reshard_after_forward != "false";  // N (a slice kept) counts as true
  if (s.parallel.param_dtype != torch::kFloat32) {
    eo.param_dtype = s.parallel.param_dtype;
    eo.reduce_dtype = torch::kFloat32;
  }
  eo.cpu_offload = o.cpu_offload;
  eo.device_is_cpu = !cuda;
  eo.optimizer_bytes_per_element = 8.0;  // AdamW: exp_avg + exp_avg_sq in fp32
  const int64_t e = static_cast<int64_t>(c10::elementSize(s.parallel.param_dtype));
  eo.activation_bytes = gpt_activation_bytes(s.cfg, o.batch_size, e, o.activation_checkpointing);
  eo.runtime_overhead_bytes = cuda ? 0 : cpu_runtime_overhead_bytes(s.parallel.param_dtype);
  const auto est = fsdp::estimate_memory(fsdp::param_infos(*model), groups, eo);
  if (rank != 0) return;
  std::cout << "memory estimate per rank: " << describe(s.cfg) << ", " << est.num_params << " parameters, "
            << world << (world == 1 ? " rank" : " ranks") << ", batch " << o.batch_size << ", " << o.mixed_precision
            << ", reshard_after_forward " << o.reshard_after_forward
            << (o.activation_checkpointing ? ", activation checkpointing" : "") << (o.cpu_offload ? ", cpu offload" : "")
            << (cuda ? " (CUDA: the caching allocator's peak)" : " (CPU: RSS growth over the process baseline)") << "\n"
            << fsdp::format_memory_estimate(est);
}

/// The process group: from the launcher's environment, or a group of one when started without one.
fsdp::ProcessGroupPtr make_process_group(bool launched, bool cuda) {
  fsdp::InitOptions init;
  init.device_type(cuda ? torch::kCUDA : torch::kCPU);
  if (launched) return fsdp::init_process_group(init);
  if (cuda) {  // one process on cuda:0 without a launcher: NCCL over an in-memory store
    fsdp::LaunchEnv env;
    env.master_addr = "127.0.0.1";
    init.env(env);
    init.store(c10::make_intrusive<c10d::HashStore>());
    return fsdp::init_process_group(init);
  }
  auto pg = fsdp::make_gloo_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, std::chrono::minutes(30));
  fsdp::set_default_process_group(pg);
  return pg;
}

bool launched_by_a_launcher() {
  for (const char* v : {"RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"}) {
    if (std::getenv(v)) return true;
  }
  return false;
}

int run(int argc, char** argv) {
  Options o;
  if (const auto rc = parse_options(argc, argv, o)) return *rc;  // --help
  // Everything that can be wrong with the input is checked here, identically on every rank and before
  // any communication: a bad flag fails every rank with the same message instead of hanging the others.
  const bool launched = launched_by_a_launcher();
  const fsdp::LaunchEnv env = launched ? fsdp::read_launch_env() : fsdp::LaunchEnv{};
  const RunSetup s = prepare_run(o, env);
  if (!o.metrics.empty() && env.rank == 0) MetricsWriter::probe(o.metrics);  // fails now, not after training
  if (o.no_shard) check_no_shard(o, env.world_size);
  const ResumePlan plan = check_checkpoint_options(o, s.cfg, s.train.size(), env.restart_count);  // [checkpoints]
  const bool cuda = use_cuda(o, env);
  if (o.estimate_memory) {  // no process group: every rank computes the same prediction, rank 0 prints
    print_memory_estimate(s, launched ? env.world_size : 1, env.rank, cuda);
    return 0;
  }
  auto pg = make_process_group(launched, cuda);
  // --model-impl: the same run with either model code (model.h or model_plain.h).
  const int rc = o.model_impl == "plain" ? train<PlainGPT>(s, plan, pg) : train<fsdp::FSDPModule<GPT>>(s, plan, pg);
  // Before exit: a NCCL group left to static destruction can crash the exit (after CUDA's teardown).
  fsdp::destroy_process_group(pg);
  return rc;
}

}  // namespace
}  // namespace train_gpt

int main(int argc, char** argv) {
  try {
    const int rc = train_gpt::run(argc, argv);
    // On CUDA, skip static destruction: on an H200 (PyTorch 2.11, NCCL 2.28) train_gpt finished, wrote its
    // metrics and then died with SIGSEGV at exit under fsdprun, which a launcher reads as a failed run
    // (and restarts). Everything the run wrote is flushed and closed by now. Not yet verified on a GPU:
    // see docs/BENCHMARKS.md, GPU.
    if (torch::cuda::is_available()) {
      std::cout.flush();
      std::cerr.flush();
      std::_Exit(rc);
    }
    return rc;
  } catch (const train_gpt::UsageError& e) {
    std::cerr << "train_gpt: error: " << e.what() << std::endl;
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "train_gpt: error: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "train_gpt: error: " << e.what() << std::endl;
    return 1;
  }
}
