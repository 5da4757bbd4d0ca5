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
//   evaluate.h            the loss, evaluate() and generate() (sampling)
//   memory_estimate.h/.cpp  --estimate-memory: fsdp::estimate_memory for this model and these flags
//   interop.h             --save-init, --dump-batches and --no-shard, for bench/compare_fsdp2.py
//   data.h, model.h       the corpus and sampler, the model: plain LibTorch
//   tokenizer.h           --tokenizer: bytes or SentencePiece (its C++ library); the model's vocab_size
//   token_shards.h        --data-shards: llm.c token files by mmap; `train_gpt tokenize` writes them
//   sft.h                 --sft: prompt/response JSONL, prompt masked; the loss over the global unmasked tokens
//   model_llama.h         the Llama architecture (--model llama-*, --init-from a Hugging Face Llama folder)
//   hf.h/.cpp             Hugging Face folders in and out: --init-from, --export-hf, --dump-logits
//   pipeline.h/.cpp       --pp: pipeline parallelism (stages of the model, a schedule, FSDP inside each stage)
//   model_plain.h         the same model without any libfsdp type (--model-impl plain): what fully_shard
//                         takes unchanged, as PyTorch's does

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include "fsdp/elastic/errors.h"
#include "checkpointing.h"
#include "data.h"
#include "evaluate.h"
#include "fault_tolerance.h"
#include "fsdp/fsdp.h"
#include "hf.h"
#include "interop.h"
#include "memory_estimate.h"
#include "model.h"
#include "model_llama.h"
#include "model_plain.h"
#include "optimizer.h"
#include "options.h"
#include "parallelize.h"
#include "pipeline.h"
#include "reporting.h"
#include "sft.h"
#include "token_shards.h"

namespace train_gpt {
namespace {

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
  fsdp::DeviceMeshPtr cp_mesh = nullptr;  // --cp > 1: the mesh's "cp" dim
  fsdp::ft::Manager* ft = nullptr;        // --ft-replica-id: the replica groups' quorum (fault_tolerance.h)
};

/// --cp: the positions of GPT's wpe become a buffer that context_parallel shards (GPT::positions); the other
/// models refuse --cp (options.cpp), so they never get here with a cp mesh.
template <typename Model>
void set_positions(Model& model, const torch::Tensor& pos) {
  if constexpr (std::is_same_v<Model, fsdp::FSDPModule<GPT>>) {
    model->positions = pos;
  } else {
    TORCH_CHECK(!pos.defined(), "train_gpt: --cp needs the GPT-2 holder model");
  }
}

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
  bool committed = true;  ///< --ft-*: false when the replica groups did not commit the step (nothing changed)
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
  // The step's microbatches first: --sft's loss is normalised by the unmasked targets of all of them on all
  // ranks (sft.h, masked_loss_scale: one all-reduce of a count), known before the first backward.
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int64_t micro = 0; micro < o.grad_accum_steps; ++micro) batches.push_back(t.s.train.get(t.sampler.next()));
  std::optional<double> token_scale;
  if (t.s.masked_targets) {
    std::vector<torch::Tensor> targets;
    for (const auto& b : batches) targets.push_back(b.second);
    token_scale = masked_loss_scale(targets, t.pg, t.s.parallel.tp);
  }
  for (int64_t micro = 0; micro < o.grad_accum_steps; ++micro) {
    auto [x, y] = batches[micro];
    if (t.recorder) t.recorder->add(x, y);
    x = x.to(device, /*non_blocking=*/false);
    y = y.to(device, /*non_blocking=*/false);
    if (!o.no_shard) {
      const bool last = micro == o.grad_accum_steps - 1;
      // --reduce-scatter-each-microbatch: sharded sums every microbatch, the replicas' all-reduce once.
      // (set_requires_gradient_sync also sets requires_all_reduce, so it comes first.)
      fsdp::fsdp_api(t.model).set_requires_gradient_sync(last || o.reduce_scatter_each_microbatch);
      if (o.reduce_scatter_each_microbatch) fsdp::fsdp_api(t.model).set_requires_all_reduce(last);
      if (o.keep_unsharded) fsdp::fsdp_api(t.model).set_reshard_after_backward(last);
    }
    // --cp: x, y and the positions sharded along the sequence (load-balanced), and SDPA as ring attention,
    // for this microbatch's forward and backward; the loss is this rank's mean, averaged over cp like dp.
    std::optional<fsdp::experimental::context_parallel> cp_region;
    if (t.cp_mesh) {
      auto pos = torch::arange(x.size(1), torch::TensorOptions(torch::kLong).device(device));
      set_positions(t.model, pos);
      cp_region.emplace(t.cp_mesh, std::vector<torch::Tensor>{x, y, pos}, std::vector<int64_t>{1, 1, 0});
    }
    torch::Tensor logits, loss;
    {
      // --activation-offload: what the forward (and the loss) saves for backward goes to host memory.
      std::optional<fsdp::save_on_cpu> offload;
      if (o.activation_offload) offload.emplace(/*pin_memory=*/device.is_cuda());
      if (!o.no_shard || t.s.parallel.param_dtype == torch::kFloat32) {
        logits = t.model(x);
      } else {  // --no-shard (the floor): mixed precision the plain-LibTorch way, by autocast around the forward
        CpuAutocast autocast(t.s.parallel.param_dtype, device.type());
        logits = t.model(x);
      }
      fsdp::DeviceMeshPtr vocab_mesh;  // loss_parallel: the logits are this TP rank's vocabulary columns
      if constexpr (std::is_same_v<Model, fsdp::FSDPModule<GPT>>) vocab_mesh = t.model->loss_parallel_mesh;
      loss = token_scale ? lm_loss_sum(logits, y, vocab_mesh) * *token_scale
                         : lm_loss(logits, y, vocab_mesh) / static_cast<double>(o.grad_accum_steps);
    }
    (t.scaler ? t.scaler->scale(loss) : loss).backward();
    loss_sum += loss.detach();
    if (t.cp_mesh) {
      cp_region.reset();
      set_positions(t.model, torch::Tensor());
    }
  }
  // The norm of the full gradient (an all-reduce of the shards' partial norms): identical on every
  // rank, so every rank scales its shard by the same factor.
  // With fp16 the gradients are unscaled first; a step with inf/nan gradients is skipped (the norm
  // logged is then inf) and the scale backs off.
  const double max_norm = o.clip_grad > 0 ? o.clip_grad : std::numeric_limits<double>::infinity();
  // --ft-*: this replica group's gradient shards (and its ranks' losses) averaged over the replica groups of the
  // step; from here on every replica group holds the same gradients (fault_tolerance.h).
  if (t.ft) average_over_replica_groups(*t.ft, t.params, loss_sum);
  if (t.scaler) t.scaler->unscale_(t.optimizer);
  // Sharded: the loss of the global batch (the sum of the ranks' means) is all-reduced in the norm's
  // collective (one all-reduce per step instead of two; bit-identical, see fsdp::clip_grad_norm_).
  // (--data-parallel replicate: every gradient is whole, the norm needs no collective; the loss has its own.)
  const bool own_loss_all_reduce = o.no_shard || t.s.parallel.replicate;
  const double norm =
      (own_loss_all_reduce ? fsdp::clip_grad_norm_(t.params, max_norm)
                  : fsdp::clip_grad_norm_(t.params, max_norm, 2.0, false, nullptr, loss_sum))
          .template item<double>();
  if (t.ft && !t.ft->should_commit()) {  // another replica group failed: the step changes nothing, it is retried
    t.optimizer.zero_grad();
    return {std::numeric_limits<double>::quiet_NaN(), norm, ModelStates{}, /*committed=*/false};
  }
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
  if (own_loss_all_reduce) fsdp::all_reduce(loss_sum, t.pg, fsdp::ReduceOp::SUM);
  // HSDP: the norm's group is the shard group; the replicas' losses are summed too.
  if (t.replicate_group) fsdp::all_reduce(loss_sum, *t.replicate_group, fsdp::ReduceOp::SUM);
  return {loss_sum.item<double>() / (t.pg.size() / t.s.parallel.tp), norm, states};  // (the dp x cp ranks' means)
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
  // A TP group and a CP group share their data (CP splits each sequence, not the batch).
  const int tp = s.parallel.tp * s.parallel.cp, data_rank = rank / tp, data_world = world / tp;

  // Identical initial weights on every rank (and for every world size): one seed. Sharded runs build the
  // model with fsdp::deferred_init (no rank ever holds the full model: each fills only its rows, with the
  // values eager construction gives); --no-shard and --save-init (which writes the full weights) build it
  // in full, on the CPU, and move it to the device.
  const double rss_before = current_rss_mb();
  torch::manual_seed(o.seed);
  // (Tensor parallelism shards the eagerly built model: deferred_init knows FSDP's rows only.)
  // (--data-parallel replicate: every rank holds the whole model anyway.)
  // (--freeze changes dtypes before sharding: eager too.)
  const bool sharded_init =
      !o.no_shard && o.save_init.empty() && tp == 1 && !s.parallel.replicate && !s.parallel.freeze;
  Model model = sharded_init ? fsdp::deferred_init([&] { return Model(s.cfg); }) : Model(s.cfg);
  const DecayGroups groups = decay_groups(*model);  // on the full shapes, before sharding
  Reporter report(s, model->num_params(), pg);
  if (!o.save_init.empty() && rank == 0) save_initial_weights(*model, s.cfg, o.save_init);
  if (s.parallel.freeze) report.say("frozen: " + std::to_string(freeze_parameters(*model, s.parallel)) + " parameters");
  // (with --cpu-offload the shards stay on the CPU: fully_shard puts them in pinned host memory).
  if (!sharded_init && device.is_cuda() && !o.cpu_offload) model->to(device);
  if (!o.no_shard) parallelize(model, mesh, s.parallel);
  if constexpr (std::is_same_v<Model, fsdp::FSDPModule<GPT>>) {
    if (s.parallel.dtensor_rng) {
      apply_dtensor_rng(*model, mesh, s.parallel, o.seed);
      report.say("dropout: DTensor RNG (fsdp::manual_seed(" + std::to_string(o.seed) + ", mesh)): each rank applies "
                 "its piece of the masks one process would draw");
    }
  }
  if (sharded_init) {
    fsdp::materialize_module(model);
    for (auto& b : model->buffers()) {
      if (b.device() != device && !o.cpu_offload) b.set_data(b.to(device));
    }
  }
  report.say("model built" + std::string(sharded_init ? " sharded (deferred_init)" : " in full") + ": peak RSS +" +
             std::to_string(std::lround(peak_rss_mb() - rss_before)) + " MiB over the " +
             std::to_string(std::lround(rss_before)) + " MiB before construction (rank " + std::to_string(rank) + ")");
  // --init-from: the Hugging Face weights, read straight into the shards (a resume loads its checkpoint instead).
  if (!o.init_from.empty() && !plan.resume) {
    const auto t_load = Clock::now();
    const int64_t bytes = load_hf_weights(*model, s.cfg, o.init_from);
    report.say("init-from: " + o.init_from + " loaded in " + fmt("%.2f", seconds_since(t_load)) + " s (" +
               fmt("%.1f", static_cast<double>(bytes) / (1 << 20)) + " MiB read by rank " + std::to_string(rank) + ")");
  }
  std::optional<BatchRecorder> recorder;
  if (!o.dump_batches.empty()) recorder.emplace(o.dump_batches);
  torch::optim::AdamW optimizer = make_adamw(groups, o);
  // fp16 only: dynamic loss scaling, so that small gradients do not flush to zero in fp16. Every rank
  // skips the same steps (the inf/nan check is all-reduced). bf16 has fp32's range and needs none.
  std::optional<fsdp::ShardedGradScaler> scaler;
  if (s.parallel.param_dtype == torch::kHalf) scaler.emplace(fsdp::GradScalerOptions(), pg);
  // --ft-*: the data ranks of every replica group together (fault_tolerance.h).
  const bool ft_on = o.ft_replica_id >= 0;
  DistributedSampler sampler(s.train.size(), o.batch_size, ft_on ? o.ft_replica_id * data_world + data_rank : data_rank,
                             ft_on ? o.ft_group_size * data_world : data_world, o.seed);
  // fp16's scaler steps torch::optim::AdamW itself.
  Training<Model> t{s, *pg, model, optimizer, scaler, sampler, recorder, model->unique_parameters(),
             !scaler && (o.optimizer_impl == "foreach" || (o.optimizer_impl == "auto" && device.is_cuda())),
             s.parallel.dp_replicate > 1                           ? mesh->get_group("dp_replicate")
             : s.parallel.cp > 1 && s.parallel.dp_shard > 1 ? mesh->get_group("dp_shard")  // (dp_shard, cp) HSDP mesh
                                                            : nullptr,
             s.parallel.cp > 1 ? (*mesh)["cp"] : nullptr};
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
  // --ft-*: what a joining replica group receives: the model, the optimizer and the data position (after the
  // resume: the state of a resumed replica group is that of its checkpoint's step).
  std::unique_ptr<fsdp::ft::Manager> ft;
  if (ft_on) {
    ft = make_ft_manager(
        o, pg, start_step,
        [&] {
          fsdp::StateDict sd = fsdp::get_state_dict(*model, optimizer);
          const auto st = sampler.state();
          sd.insert_or_assign("train.sampler.epoch", fsdp::Value(st.epoch));
          sd.insert_or_assign("train.sampler.cursor", fsdp::Value(st.cursor));
          return sd;
        },
        [&](const fsdp::StateDict& sd) {
          fsdp::StateDict states;
          for (const auto& [k, v] : sd) {
            if (k.rfind("train.sampler.", 0) != 0) states.insert_or_assign(k, v);
          }
          fsdp::set_state_dict(*model, optimizer, states);
          auto value = [&](const char* k) { return std::get<fsdp::Value>(sd.at(k)).json.get<int64_t>(); };
          sampler.set_state({value("train.sampler.epoch"), value("train.sampler.cursor")});
        });
    t.ft = ft.get();
  }
  // --logits-tokens: the logits before the first step of this run (after --init-from or the resume).
  torch::Tensor logit_tokens, logits_init;
  if (!o.logits_tokens.empty()) {
    logit_tokens = read_logits_tokens(o.logits_tokens, s.cfg);
    logits_init = logits_of(model, logit_tokens, device);
  }
  report.open_metrics(plan.resume ? start_step : -1);
  if (mesh->ndim() > 1) {  // FSDP's and TP's collectives run on the mesh's dims, not on the world group
    std::vector<std::pair<std::string, fsdp::ProcessGroupPtr>> groups = {
        {"dp_replicate", mesh->get_group("dp_replicate")}, {"dp_shard", mesh->get_group("dp_shard")}};
    if (s.parallel.cp > 1) groups.push_back({"cp", mesh->get_group("cp")});
    groups.push_back({"tp", mesh->get_group("tp")});
    report.watch_groups(std::move(groups));
  }
  auto run_eval = [&](int64_t step) {
    const double loss = evaluate(model, s.val, s.eval_batches, o.batch_size, tp, *pg, s.masked_targets);
    report.eval(step, loss);
    return loss;
  };
  // The evaluation before training (the "first" evaluation loss): ~ln(256) = 5.55 for a fresh model.
  // (--ft-*: not before the replica groups agree on the state.)
  if (start_step == 0 && !ft) report.initial_metrics(run_eval(0));

  const auto t_train = Clock::now();
  const nlohmann::json ckpt_run = checkpoint_run_info(o, s.cfg, s.train.size(), world);
  bool first = true;
  for (int64_t step = start_step + 1; step <= last_step; ++step) {
    const auto t0 = Clock::now();
    if (ft) {  // the replica groups agree on who takes part and on the step (a joiner is healed here)
      ft->start_quorum();
      step = ft->current_step() + 1;
      if (!ft->last_quorum().joiners.empty()) report.say(describe_heal(ft->last_quorum()));
      if (step > last_step) break;
    }
    const double lr = lr_at(step, o);
    // The DTensor RNG's stream of each step starts at a fixed offset: a resumed run draws what it would have.
    if (s.parallel.dtensor_rng) fsdp::random::set_offset(mesh, static_cast<uint64_t>(step) << 40);
    const auto data_position = sampler.state();
    const StepResult r = train_step(t, lr, /*count_states=*/first);
    if (!r.committed) {  // --ft-*: nothing changed; the same batch again at the next quorum
      sampler.set_state(data_position);
      report.say("ft: step " + std::to_string(step) + " not committed by every replica group (" +
                 ft->last_quorum().failure + "); retrying it");
      --step;
      continue;
    }
    report.step(step, lr, r.loss, r.grad_norm, seconds_since(t0), [&] { return run_eval(step); });
    if (first) {
      first = false;  // rank 0's (it holds ceil(dim0 / N) rows of every parameter: the most)
      const double mib = 1 << 20, ideal = 16.0 * static_cast<double>(model->num_params()) / world;
      report.say("model states on rank 0: params " + fmt("%.1f", r.states.params / mib) + " + grads " +
                 fmt("%.1f", r.states.grads / mib) + " + optimizer " + fmt("%.1f", r.states.optimizer / mib) +
                 " = " + fmt("%.1f", r.states.total() / mib) + " MiB; 16 x P / N = " + fmt("%.1f", ideal / mib) +
                 " MiB (x" + fmt("%.4f", r.states.total() / ideal) + ", fp32 AdamW with no padding)");
    }
    test_step_delay();
    // [checkpoints] after the step and its evaluation, every rank writing its shards.
    if (checkpoint_due(o, step, last_step)) {
      const auto t_save = Clock::now();
      const std::string path =
          save_checkpoint(o, ckpt_run, step, *model, optimizer, sampler, scaler, report.first_eval_json());
      report.say("checkpoint: " + path + " saved in " + fmt("%.2f", seconds_since(t_save)) + " s");
      kill_if_due(kill_at, step, rank);
    }
  }
  if (ft) ft->shutdown();  // a replica group that joins from now on is told the job finished
  // A resumed run that had nothing left to train still reports where the model stands.
  if (!report.evaluated() && start_step > 0 && start_step >= last_step) run_eval(start_step);
  report.end_of_training(last_step);
  const double wall = seconds_since(t_train);
  if (recorder) recorder->write(rank, o.grad_accum_steps, run_description(s, world, start_step));
  if (logit_tokens.defined()) {
    auto logits = logits_of(model, logit_tokens, device);
    if (rank == 0) fsdp::dcp::save_file({{"logits_init", logits_init}, {"logits", logits}}, o.dump_logits);
  }
  if (!o.export_hf.empty()) {  // a Hugging Face folder of the trained model (the source's config.json fields kept)
    const auto t_export = Clock::now();
    nlohmann::json base = nullptr;
    if (!o.init_from.empty()) {
      std::ifstream in(o.init_from + "/config.json");
      if (in) base = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
      if (base.is_discarded()) base = nullptr;
    }
    export_hf(*model, s.cfg, o.export_hf, base, static_cast<int64_t>(o.export_max_file_mb * (1 << 20)), *pg);
    std::string copied;
    if (rank == 0) {
      for (const auto& name : copy_tokenizer_files(o.init_from, o.tokenizer, o.export_hf)) copied += " " + name;
    }
    report.say("export-hf: " + o.export_hf + " written in " + fmt("%.2f", seconds_since(t_export)) + " s" +
               (copied.empty() ? "" : "; tokenizer files:" + copied));
  }
  // The sample: every rank runs the forwards, rank 0 prints.
  std::string sample;
  if (o.sample_tokens > 0) sample = generate(model, o.sample_prompt, o.sample_tokens, o.temperature, o.top_k, o.seed, *pg, *s.tokenizer);
  report.summary(start_step, last_step, wall, sample);
  return 0;
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
  // `train_gpt tokenize ...`: text files -> token shards (token_shards.h), no training.
  if (argc > 1 && std::string(argv[1]) == "tokenize") return tokenize_main(argc - 1, argv + 1);
  Options o;
  if (const auto rc = parse_options(argc, argv, o)) return *rc;  // --help
  // Everything that can be wrong with the input is checked here, identically on every rank and before
  // any communication: a bad flag fails every rank with the same message instead of hanging the others.
  const bool launched = launched_by_a_launcher();
  const fsdp::LaunchEnv env = launched ? fsdp::read_launch_env() : fsdp::LaunchEnv{};
  resolve_global_batch(o, launched ? env.world_size : 1);
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
  if (s.parallel.pp > 1) {  // --pp: the pipelined trainer (pipeline.h), GPT-2 holder model only (options.cpp)
    if (!cuda) keep_freed_memory();
    const int rc = train_pipelined(s, plan, pg);
    fsdp::destroy_process_group(pg);
    return rc;
  }
  // --model-impl: the same run with either model code (model.h or model_plain.h).
  // The architecture (--model llama-*, or --init-from's config.json) picks the model; the trainer is the same.
  const bool plain = o.model_impl == "plain";
  const int rc = s.cfg.is_llama() ? (plain ? train<PlainLlama>(s, plan, pg) : train<fsdp::FSDPModule<Llama>>(s, plan, pg))
                                  : (plain ? train<PlainGPT>(s, plan, pg) : train<fsdp::FSDPModule<GPT>>(s, plan, pg));
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
  } catch (const fsdp::ft::JobFinished& e) {  // --ft-*: a replica group restarted after the others finished
    std::cout << "train_gpt: " << e.what() << std::endl;
    return 0;
  } catch (const train_gpt::UsageError& e) {
    fsdp::elastic::record_exception(e);  // the launcher's summary shows it (TORCHELASTIC_ERROR_FILE)
    std::cerr << "train_gpt: error: " << e.what() << std::endl;
    return 2;
  } catch (const c10::Error& e) {
    fsdp::elastic::record_exception(e);
    std::cerr << "train_gpt: error: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    fsdp::elastic::record_exception(e);
    std::cerr << "train_gpt: error: " << e.what() << std::endl;
    return 1;
  }
}
