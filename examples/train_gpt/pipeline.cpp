// train_gpt --pp N: see pipeline.h for the layout, the step, the loss and the clipping.
#include "pipeline.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "checkpointing.h"
#include "evaluate.h"
#include "fsdp/pipelining/schedules.h"
#include "fsdp/pipelining/stage.h"
#include "model.h"
#include "model_llama.h"
#include "model_plain.h"
#include "optimizer.h"
#include "parallelize.h"
#include "reporting.h"

namespace train_gpt {
namespace {

/// This rank's part of a pipelined model, and the forward through every stage for evaluation and sampling.
/// Shaped like a model holder (`model->eval()`, `model->cfg`, `model(x)`), so generate() (evaluate.h)
/// samples from it unchanged. `Stage`: fsdp::FSDPModule<GPTStage>, PlainGPTStage, fsdp::FSDPModule<LlamaStage>
/// or PlainLlamaStage.
template <typename Stage>
class PipelinedModel {
 public:
  PipelinedModel(const GPTConfig& cfg, std::vector<Stage> stages, std::vector<int> stage_ids,
               std::vector<int> owner, fsdp::ProcessGroupPtr pp_group, torch::Device device)
      : cfg(cfg), stages_(std::move(stages)), stage_ids_(std::move(stage_ids)), owner_(std::move(owner)),
        pp_(std::move(pp_group)), device_(device) {}

  PipelinedModel* operator->() { return this; }
  void eval() {
    for (auto& s : stages_) s->eval();
  }
  void train() {
    for (auto& s : stages_) s->train();
  }

  /// Logits [B, T, vocab] of `idx` on every rank of the pipeline: the stages run in order, each on the rank
  /// holding it; an output crosses to the next stage's rank by a broadcast over the pp group (its dtype
  /// and shape first), so no rank needs to know another's shapes. Collective over the pp group (and each
  /// stage's forward over its dp group). Without gradients: evaluation and sampling only.
  torch::Tensor operator()(const torch::Tensor& idx) {
    torch::NoGradGuard no_grad;
    torch::Tensor x = idx.to(device_);
    const int num_stages = static_cast<int>(owner_.size());
    for (int id = 0; id < num_stages; ++id) {
      if (owner_[id] == pp_->rank()) x = local(id)(x);
      // The next stage on the same rank (the V's turn at the last rank) needs no message.
      if (id + 1 < num_stages && owner_[id + 1] == owner_[id]) continue;
      x = broadcast_from(owner_[id], x);
    }
    return x;
  }

  GPTConfig cfg;
  /// --sequence-parallel: the TP mesh, so that generate() pads the prompt to a multiple of tp (else null).
  fsdp::DeviceMeshPtr sequence_parallel_mesh;

 private:
  Stage& local(int id) {
    for (size_t i = 0; i < stage_ids_.size(); ++i) {
      if (stage_ids_[i] == id) return stages_[i];
    }
    TORCH_CHECK(false, "PipelinedModel: stage ", id, " is not on pp rank ", pp_->rank());
  }

  /// `x` of pp rank `src` on every pp rank: a header {dtype, dims, sizes...} then the data.
  torch::Tensor broadcast_from(int src, const torch::Tensor& x) {
    constexpr int64_t kWords = 8;
    auto header = torch::zeros({kWords}, torch::TensorOptions(torch::kLong).device(device_));
    if (pp_->rank() == src) {
      TORCH_CHECK(x.dim() + 2 <= kWords, "PipelinedModel: a stage output of ", x.dim(), " dims");
      std::vector<int64_t> h = {static_cast<int64_t>(x.scalar_type()), x.dim()};
      for (auto d : x.sizes()) h.push_back(d);
      h.resize(kWords, 0);
      header.copy_(torch::tensor(h, torch::kLong));
    }
    fsdp::broadcast(header, src, *pp_);
    const auto h = header.cpu();
    const auto dtype = static_cast<c10::ScalarType>(h[0].item<int64_t>());
    std::vector<int64_t> sizes;
    for (int64_t d = 0; d < h[1].item<int64_t>(); ++d) sizes.push_back(h[2 + d].item<int64_t>());
    torch::Tensor out = pp_->rank() == src ? x.contiguous() : torch::empty(sizes, torch::TensorOptions(dtype).device(device_));
    fsdp::broadcast(out, src, *pp_);
    return out;
  }

  std::vector<Stage> stages_;
  std::vector<int> stage_ids_;  // this rank's stages, in the order of stages_
  std::vector<int> owner_;      // per stage: the pp rank holding it
  fsdp::ProcessGroupPtr pp_;
  torch::Device device_;
};

/// Mean loss over the evaluation batches of the validation split, as evaluate() (evaluate.h) with the
/// data split over the data-parallel ranks (the ranks of a pipeline and of a TP group evaluate the same
/// windows). Collective.
template <typename Stage>
double evaluate_pipelined(PipelinedModel<Stage>& model, const TokenWindows& val, int64_t num_batches, int64_t batch_size,
                          int dp_rank, int dp, fsdp::ProcessGroup& world) {
  model.eval();
  auto sum = torch::zeros({1}, torch::TensorOptions(torch::kDouble).device(world.device()));
  for (int64_t b = 0; b < num_batches; ++b) {
    auto [x, y] = val.get(eval_indices(b, batch_size, dp_rank, dp));
    sum += lm_loss(model(x), y.to(world.device())).to(torch::kDouble);
  }
  // Every rank holds its pipeline's loss: the mean over the world is the mean over the dp ranks.
  fsdp::all_reduce(sum, world, fsdp::ReduceOp::SUM);
  model.train();
  return sum.item<double>() / static_cast<double>(num_batches * world.size());
}

/// [Note: tied weights across stages]
/// With tied weights (wte.weight is lm_head.weight in the whole model) the first stage holds wte and the last
/// stage a copy of the same weight as its head (stage_head, model.h). Both copies start equal; after each step's
/// backward their (sharded) gradients are summed over the pp group, which is the whole model's gradient of the
/// one tied weight, and each copy takes that sum: the same gradient, the same AdamW state and update, so the
/// copies stay bitwise equal. Each rank of a pipeline holds the same rows of both (the same dp_shard
/// coordinate), so their local shards have one shape, which the ranks holding neither learn once (a broadcast
/// from the first stage's rank). The gradient norm counts the weight once (the head's copy is left out).
struct TiedWeights {
  torch::Tensor first, last;  // this rank's wte.weight / tied lm_head.weight (undefined where not held)
  torch::Tensor buffer;       // the local shard's shape and dtype, on every pp rank

  TiedWeights(const torch::Tensor& wte, const torch::Tensor& head, int src, fsdp::ProcessGroup& pp,
              torch::Device device)
      : first(wte), last(head) {
    constexpr int64_t kWords = 4;  // dtype, rows, columns, dims
    auto header = torch::zeros({kWords}, torch::TensorOptions(torch::kLong).device(device));
    if (pp.rank() == src) {
      TORCH_CHECK(first.defined() && first.dim() == 2, "tied weights: pp rank ", src, " lacks wte.weight");
      header.copy_(torch::tensor({static_cast<int64_t>(first.scalar_type()), first.size(0), first.size(1), int64_t{2}}));
    }
    fsdp::broadcast(header, src, pp);
    const auto h = header.cpu();
    buffer = torch::zeros({h[1].item<int64_t>(), h[2].item<int64_t>()},
                          torch::TensorOptions(static_cast<c10::ScalarType>(h[0].item<int64_t>())).device(device));
  }

  /// Sums the copies' gradients over the pipeline group and gives each copy the sum. Collective over pp.
  void sum_gradients(fsdp::ProcessGroup& pp) {
    buffer.zero_();
    for (const auto* t : {&first, &last}) {
      if (t->defined() && t->grad().defined()) buffer.add_(t->grad());
    }
    fsdp::all_reduce(buffer, pp, fsdp::ReduceOp::SUM);
    for (auto* t : {&first, &last}) {
      if (!t->defined()) continue;
      if (t->grad().defined()) {
        t->mutable_grad().copy_(buffer);
      } else {
        t->mutable_grad() = buffer.clone();
      }
    }
  }
};

/// Checks that the stages' parameter names are the whole model's: every stage of the pipeline (built here on
/// every rank, sharing the model's modules) names each of its parameters as `model` does, with the same tensor
/// (or, for a tied head's copy, equal values), and together they hold every name of the model exactly once.
/// A state dict of a stage then uses the unpipelined keys. Returns the number of names; throws c10::Error
/// naming the first name that differs.
template <typename Model, typename Stage>
size_t check_stage_names(const Model& model, int num_stages) {
  const auto whole = model->named_parameters();
  std::map<std::string, int> seen;  // name -> stage
  for (int id = 0; id < num_stages; ++id) {
    const auto [begin, end] = stage_layers(model->cfg.n_layer, id, num_stages);
    Stage stage(*model, begin, end, id == 0, id == num_stages - 1);
    for (const auto& item : stage->named_parameters()) {
      const torch::Tensor* w = whole.find(item.key());
      TORCH_CHECK(w, "pipeline stage ", id, ": parameter '", item.key(), "' is not a name of the whole model");
      TORCH_CHECK(w->is_same(item.value()) || torch::equal(*w, item.value()), "pipeline stage ", id, ": '", item.key(),
                  "' is not the whole model's parameter of that name");
      const auto [it, fresh] = seen.emplace(item.key(), id);
      TORCH_CHECK(fresh, "pipeline stages ", it->second, " and ", id, " both hold '", item.key(), "'");
    }
  }
  for (const auto& item : whole) {
    TORCH_CHECK(seen.count(item.key()), "no pipeline stage holds the whole model's parameter '", item.key(), "'");
  }
  return seen.size();
}

/// The module a checkpoint of this rank sees: its stages' modules under the whole model's names (GPT: wte, wpe,
/// drop, h.N, ln_f, lm_head; Llama: model.embed_tokens, model.layers.N, model.norm, lm_head; the blocks of several
/// stages merged into one container), so that fsdp::get_state_dict keys the parameters and the optimizer state as
/// the unpipelined model does. Each rank saves its own keys; the checkpoint holds their union, a --pp 1 run's keys.
std::shared_ptr<torch::nn::Module> checkpoint_view(const std::vector<std::shared_ptr<torch::nn::Module>>& stages) {
  // Merges the children of `from` into `into`, recursing into the containers two stages share by name (h,
  // model, model.layers) and registering the rest (modules of one stage) as they are.
  std::function<void(torch::nn::Module&, const torch::nn::Module&)> merge = [&](torch::nn::Module& into,
                                                                                 const torch::nn::Module& from) {
    for (const auto& child : from.named_children()) {
      const bool container = child.key() == "h" || child.key() == "model" || child.key() == "layers";
      if (!container) {
        into.register_module(child.key(), child.value());
        continue;
      }
      const auto present = into.named_children();  // a copy: find() points into it
      const auto* existing = present.find(child.key());
      std::shared_ptr<torch::nn::Module> target =
          existing ? *existing : into.register_module(child.key(), std::make_shared<torch::nn::Module>(child.key()));
      merge(*target, *child.value());
    }
  };
  auto root = std::make_shared<torch::nn::Module>("PipelineRankModel");
  for (const auto& st : stages) merge(*root, *st);
  return root;
}

std::string stage_list(const std::vector<int>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out;
}

/// The tied weight's two copies of a stage (undefined where the stage has none): GPT's wte/lm_head, Llama's
/// model.embed_tokens/lm_head.
torch::Tensor embedding_weight(fsdp::FSDPModule<GPTStage>& s) { return s->wte ? s->wte->weight : torch::Tensor(); }
torch::Tensor embedding_weight(PlainGPTStage& s) { return s->wte ? s->wte->weight : torch::Tensor(); }
torch::Tensor embedding_weight(fsdp::FSDPModule<LlamaStage>& s) {
  return s->embed.is_empty() ? torch::Tensor() : s->embed->weight;
}
torch::Tensor embedding_weight(PlainLlamaStage& s) { return s->embed_tokens ? s->embed_tokens->weight : torch::Tensor(); }
template <typename Stage>
torch::Tensor head_weight(Stage& s) {
  return s->lm_head ? s->lm_head->weight : torch::Tensor();
}

/// train_pipelined for one model code: `Model` GPT with `Stage` fsdp::FSDPModule<GPTStage>, or PlainGPT with
/// PlainGPTStage.
template <typename Model, typename Stage>
int train_pipelined_as(const RunSetup& s, const ResumePlan& plan, const fsdp::ProcessGroupPtr& pg) {
  const Options& o = s.opts;
  const ParallelOptions& p = s.parallel;
  const int world = pg->size();
  if (o.threads > 0) torch::set_num_threads(o.threads);
  const torch::Device device = pg->device();
  auto mesh = make_mesh(device.type(), world, p);  // (pp, dp_replicate, dp_shard, tp)
  const auto pp_group = mesh->get_group("pp");
  const int pp_rank = static_cast<int>(mesh->get_local_rank(0));
  // The data-parallel ranks (HSDP's replicas x FSDP's shards): the ranks of a pipeline and of a TP group share
  // their batch, as check_data_size counts them.
  const int dp = p.dp_replicate * p.dp_shard;
  const int dp_rank = static_cast<int>(mesh->get_local_rank(1) * p.dp_shard + mesh->get_local_rank(2));
  const int num_stages = p.num_stages();

  // Every rank builds the whole model from one seed (the weights of --pp 1, whose deferred_init gives the
  // eager values) and keeps its stages' modules; the rest is freed with `model` below.
  torch::manual_seed(o.seed);
  Model model(s.cfg);
  const int64_t num_params = model->num_params();
  const size_t num_names = check_stage_names<Model, Stage>(model, num_stages);
  const std::vector<int> my_ids = fsdp::pipelining::stage_ids_this_rank(p.pp_schedule, pp_rank, p.pp, num_stages);
  std::vector<int> owner(num_stages, -1);
  for (int r = 0; r < p.pp; ++r) {
    for (int id : fsdp::pipelining::stage_ids_this_rank(p.pp_schedule, r, p.pp, num_stages)) owner[id] = r;
  }
  std::vector<Stage> stages;
  for (int id : my_ids) {
    const auto [begin, end] = stage_layers(s.cfg.n_layer, id, num_stages);
    stages.emplace_back(Stage(*model, begin, end, id == 0, id == num_stages - 1));
  }
  model = nullptr;
  DecayGroups groups;  // on the full shapes, before sharding (as decay_groups(*model) for --pp 1)
  std::vector<torch::Tensor> params;
  for (auto& st : stages) {
    const DecayGroups g = decay_groups(*st);
    groups.decay.insert(groups.decay.end(), g.decay.begin(), g.decay.end());
    groups.no_decay.insert(groups.no_decay.end(), g.no_decay.begin(), g.no_decay.end());
    if (device.is_cuda() && !o.cpu_offload) st->to(device);
    parallelize(st, mesh, p);
    for (const auto& t : unique_parameters(*st)) params.push_back(t);
  }

  // Tied weights: the copies on the first and the last stage ([Note: tied weights across stages]); the norm
  // counts the weight once (the head's copy left out).
  std::optional<TiedWeights> tied;
  std::vector<torch::Tensor> norm_params = params;
  if (s.cfg.tie_weights) {
    torch::Tensor wte, head;
    for (size_t i = 0; i < stages.size(); ++i) {
      if (my_ids[i] == 0) wte = embedding_weight(stages[i]);
      if (my_ids[i] == num_stages - 1) head = head_weight(stages[i]);
    }
    tied.emplace(wte, head, owner[0], *pp_group, device);
    if (head.defined()) {
      norm_params.clear();
      for (const auto& t : params) {
        if (!t.is_same(head)) norm_params.push_back(t);
      }
    }
  }

  // The schedule over this rank's stages; each stage is called as `st(x)`: through its FSDPModule holder's hooks
  // (holder), or directly (plain: fully_shard follows the unchanged modules at tensor level).
  std::vector<std::unique_ptr<fsdp::pipelining::PipelineStage>> pipeline_stages;
  std::vector<fsdp::pipelining::PipelineStage*> stage_ptrs;
  for (size_t i = 0; i < stages.size(); ++i) {
    pipeline_stages.push_back(std::make_unique<fsdp::pipelining::PipelineStage>(
        stages[i].ptr(), [st = stages[i]](const torch::Tensor& x) mutable { return st(x); }, my_ids[i], num_stages,
        device, pp_group));
    stage_ptrs.push_back(pipeline_stages.back().get());
  }
  // The loss of --pp 1 (the mean over the microbatch's tokens); the schedule averages the microbatches.
  auto schedule = fsdp::pipelining::make_schedule(p.pp_schedule, stage_ptrs, p.pp_microbatches,
                                                  [](const torch::Tensor& logits, const torch::Tensor& y) {
                                                    return lm_loss(logits, y);
                                                  });
  const bool has_last = owner[num_stages - 1] == pp_rank;
  PipelinedModel<Stage> pipelined(s.cfg, stages, my_ids, owner, pp_group, device);
  if (p.sequence_parallel) pipelined.sequence_parallel_mesh = (*mesh)["tp"];  // generate() pads to a multiple of tp

  torch::optim::AdamW optimizer = make_adamw(groups, o);
  const bool foreach_optimizer = o.optimizer_impl == "foreach" || (o.optimizer_impl == "auto" && device.is_cuda());
  DistributedSampler sampler(s.train.size(), o.batch_size, dp_rank, dp, o.seed);
  Reporter report(s, num_params, pg);
  report.banner(sampler.batches_per_epoch() / o.grad_accum_steps, foreach_optimizer);
  {
    std::ostringstream os;
    os << "pipeline: " << pipeline_layout(p) << ", schedule " << p.pp_schedule << ", " << p.pp_microbatches
       << " microbatches of " << o.batch_size / p.pp_microbatches << " sequences, " << num_stages << " stages (";
    for (int id = 0; id < num_stages; ++id) {
      const auto [begin, end] = stage_layers(s.cfg.n_layer, id, num_stages);
      os << (id ? "; " : "") << "stage " << id << ": " << (s.cfg.is_llama() ? "model.layers." : "h.") << begin
         << (end - begin > 1 ? "-" + std::to_string(end - 1) : "")
         << (id == 0 ? " + embeddings" : "") << (id == num_stages - 1 ? (s.cfg.is_llama() ? " + norm, lm_head" : " + ln_f, lm_head") : "") << " on pp rank "
         << owner[id];
    }
    os << "); rank 0 holds stage" << (my_ids.size() > 1 ? "s " : " ") << stage_list(my_ids) << "; the stages' "
       << num_names << " parameter names are the whole model's";
    report.say(os.str());
  }
  // --stop-at: this run's last step (the learning-rate schedule still spans --steps).
  const int64_t last_step = o.stop_at > 0 ? std::min(o.stop_at, o.steps) : o.steps;
  std::vector<std::shared_ptr<torch::nn::Module>> stage_modules;
  for (auto& st : stages) stage_modules.push_back(st.ptr());
  const auto ckpt_view = checkpoint_view(stage_modules);
  std::optional<fsdp::ShardedGradScaler> no_scaler;  // fp16 is refused with --pp
  int64_t start_step = 0;
  if (plan.resume) {  // [checkpoints] every rank loads its stages' keys, resharded to this run's ranks
    const Resumed r = resume(o, plan, s.train.size(), last_step, *ckpt_view, optimizer, sampler, no_scaler, pg);
    start_step = r.step;
    report.restore_first_eval(r.first_eval);
    report.say(r.message);
  }
  report.open_metrics(plan.resume ? start_step : -1);
  report.watch_groups({{"pp", pp_group},
                       {"dp_replicate", mesh->get_group("dp_replicate")},
                       {"dp_shard", mesh->get_group("dp_shard")},
                       {"tp", mesh->get_group("tp")}});
  auto run_eval = [&](int64_t step) {
    const double loss = evaluate_pipelined(pipelined, s.val, s.eval_batches, o.batch_size, dp_rank, dp, *pg);
    report.eval(step, loss);
    return loss;
  };
  if (start_step == 0) report.initial_metrics(run_eval(0));

  const auto t_train = Clock::now();
  const nlohmann::json ckpt_run = checkpoint_run_info(o, s.cfg, s.train.size(), world);
  const auto kill_at = kill_after_checkpoint(plan.restart);
  const double max_norm = o.clip_grad > 0 ? o.clip_grad : std::numeric_limits<double>::infinity();
  for (int64_t step = start_step + 1; step <= last_step; ++step) {
    const auto t0 = Clock::now();
    const double lr = lr_at(step, o);
    for (auto& group : optimizer.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    auto [x, y] = s.train.get(sampler.next());
    x = x.to(device);
    y = y.to(device);
    std::vector<torch::Tensor> losses;
    schedule->step(x, y, &losses);  // x is read on stage 0's rank, y on the last stage's
    if (tied) tied->sum_gradients(*pp_group);
    auto loss_sum = torch::zeros({1}, torch::TensorOptions().device(device));
    if (has_last) loss_sum += torch::stack(losses).mean();  // the batch's mean: the mean of equal microbatches' means
    // This rank's stages' norm over its dp group (max_norm inf: nothing clipped yet), with the loss summed over
    // the dp group in the same collective; then [norm^2, loss] summed over the pipeline: the whole model's norm
    // and the global batch's loss (the ranks without the last stage add 0). The norm is
    // fsdp::pipelining::clip_grad_norm_'s; done here to share its pp all-reduce with the loss and to leave the
    // tied head's copy out of the norm while still clipping it.
    const auto stage_norm = fsdp::clip_grad_norm_(norm_params, std::numeric_limits<double>::infinity(), 2.0, false,
                                                  nullptr, loss_sum);
    // HSDP: the norm's group is the shard group; the replicas' losses are summed too (as train_step).
    if (p.dp_replicate > 1) fsdp::all_reduce(loss_sum, *mesh->get_group("dp_replicate"), fsdp::ReduceOp::SUM);
    auto packed = torch::cat({stage_norm.to(torch::kFloat32).pow(2).reshape({1}), loss_sum});
    fsdp::all_reduce(packed, *pp_group, fsdp::ReduceOp::SUM);
    const auto total_norm = packed[0].sqrt();
    // PyTorch's clip coefficient, the same on every rank.
    const auto coef = torch::clamp_max(max_norm / (total_norm + 1e-6), 1.0);
    if (o.clip_grad > 0) {
      for (auto& t : params) {
        if (t.grad().defined()) t.grad().mul_(coef);
      }
    }
    if (foreach_optimizer) {
      foreach_adamw_step(optimizer);
    } else {
      optimizer.step();
    }
    optimizer.zero_grad();
    const double loss = packed[1].item<double>() / dp;
    report.step(step, lr, loss, total_norm.item<double>(), seconds_since(t0), [&] { return run_eval(step); });
    // [checkpoints] after the step and its evaluation, every rank writing its stages' shards (dcp::save over
    // the whole mesh: the checkpoint holds the union of the ranks' keys).
    if (checkpoint_due(o, step, last_step)) {
      const auto t_save = Clock::now();
      const std::string path =
          save_checkpoint(o, ckpt_run, step, *ckpt_view, optimizer, sampler, no_scaler, report.first_eval_json());
      report.say("checkpoint: " + path + " saved in " + fmt("%.2f", seconds_since(t_save)) + " s");
      kill_if_due(kill_at, step, pg->rank());
    }
  }
  // A resumed run that had nothing left to train still reports where the model stands.
  if (!report.evaluated() && start_step > 0 && start_step >= last_step) run_eval(start_step);
  report.end_of_training(last_step);
  const double wall = seconds_since(t_train);
  std::string sample;
  if (o.sample_tokens > 0) {
    sample = generate(pipelined, o.sample_prompt, o.sample_tokens, o.temperature, o.top_k, o.seed, *pg, *s.tokenizer);
  }
  report.summary(start_step, last_step, wall, sample);
  return 0;
}

}  // namespace

int train_pipelined(const RunSetup& s, const ResumePlan& plan, const fsdp::ProcessGroupPtr& pg) {
  // The architecture picks the model, --model-impl its code (model.h, model_plain.h, model_llama.h).
  const bool plain = s.opts.model_impl == "plain";
  if (s.cfg.is_llama()) {
    return plain ? train_pipelined_as<PlainLlama, PlainLlamaStage>(s, plan, pg)
                 : train_pipelined_as<Llama, fsdp::FSDPModule<LlamaStage>>(s, plan, pg);
  }
  return plain ? train_pipelined_as<PlainGPT, PlainGPTStage>(s, plan, pg)
               : train_pipelined_as<GPT, fsdp::FSDPModule<GPTStage>>(s, plan, pg);
}

}  // namespace train_gpt
