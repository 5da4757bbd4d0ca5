#include "checkpointing.h"

#include "model_llama.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <thread>
#include <unordered_set>
#include <vector>

namespace train_gpt {
namespace {

namespace fs = std::filesystem;

constexpr const char* kStepKey = "train.step";
constexpr const char* kSamplerKey = "train.sampler";
constexpr const char* kRngKey = "train.rng_state";
constexpr const char* kScalerKey = "train.grad_scaler";
constexpr const char* kRunKey = "train.run";
constexpr const char* kFirstEvalKey = "train.first_eval";  // {step, loss} of the run's first evaluation

nlohmann::json model_json(const GPTConfig& c) {
  nlohmann::json j = {{"vocab_size", c.vocab_size}, {"block_size", c.block_size}, {"n_layer", c.n_layer},
                      {"n_head", c.n_head},         {"n_embd", c.n_embd},         {"dropout", c.dropout},
                      {"tie_weights", c.tie_weights}};
  if (c.is_llama()) {  // GPT-2 checkpoints keep exactly their former fields (no "arch": gpt2 when absent)
    j["arch"] = c.arch;
    j["n_kv_head"] = c.kv_heads();
    j["intermediate_size"] = c.mlp_width();
    j["norm_eps"] = c.norm_eps;
    j["rope_theta"] = c.rope_theta;
    j["rope_type"] = c.rope_type;
    j["rope_factor"] = c.rope_factor;
    j["rope_low_freq_factor"] = c.rope_low_freq_factor;
    j["rope_high_freq_factor"] = c.rope_high_freq_factor;
    j["rope_original_max_positions"] = c.rope_original_max_positions;
    j["max_positions"] = c.max_positions;
  }
  return j;
}

GPTConfig model_from_json(const nlohmann::json& j) {
  GPTConfig c;
  c.vocab_size = j.at("vocab_size").get<int64_t>();
  c.block_size = j.at("block_size").get<int64_t>();
  c.n_layer = j.at("n_layer").get<int64_t>();
  c.n_head = j.at("n_head").get<int64_t>();
  c.n_embd = j.at("n_embd").get<int64_t>();
  c.dropout = j.at("dropout").get<double>();
  c.tie_weights = j.at("tie_weights").get<bool>();
  c.arch = j.value("arch", std::string("gpt2"));
  if (c.is_llama()) {
    c.n_kv_head = j.at("n_kv_head").get<int64_t>();
    c.intermediate_size = j.at("intermediate_size").get<int64_t>();
    c.norm_eps = j.at("norm_eps").get<double>();
    c.rope_theta = j.at("rope_theta").get<double>();
    c.rope_type = j.at("rope_type").get<std::string>();
    c.rope_factor = j.at("rope_factor").get<double>();
    c.rope_low_freq_factor = j.at("rope_low_freq_factor").get<double>();
    c.rope_high_freq_factor = j.at("rope_high_freq_factor").get<double>();
    c.rope_original_max_positions = j.at("rope_original_max_positions").get<int64_t>();
    c.max_positions = j.at("max_positions").get<int64_t>();
  }
  return c;
}

/// The --ckpt-dir flags without --ckpt-dir: refused (a restart without it starts afresh).
void check_no_ckpt_dir(const Options& o) {
  for (const auto& [flag, given] : {std::pair<const char*, bool>{"--ckpt-every", o.ckpt_every > 0},
                                    {"--keep-last", o.keep_last > 0}, {"--resume", !o.resume.empty()}}) {
    if (given) {
      throw UsageError(std::string(flag) + " needs --ckpt-dir DIR, the directory that holds the step-N " +
                       "checkpoints. Fix: add --ckpt-dir DIR");
    }
  }
}

/// A new run: --ckpt-dir must hold no checkpoint (`newest`) and is created now, so that a bad path
/// fails before training.
void check_new_run(const std::string& dir, const std::optional<std::string>& newest) {
  if (newest) {
    throw UsageError("--ckpt-dir " + dir + " already holds checkpoints (the newest: " + *newest +
                     "); a new run would mix its checkpoints with theirs. Fix: --resume to continue that run "
                     "(--resume auto: continue if there is a checkpoint, else start a new run), or another "
                     "(empty) --ckpt-dir");
  }
  std::error_code ec;
  fs::create_directories(dir, ec);  // every rank: idempotent
  if (!fs::is_directory(dir) || access(dir.c_str(), W_OK) != 0) {
    throw UsageError("--ckpt-dir " + dir + " cannot be created or written" + (ec ? ": " + ec.message() : "") +
                     ". Fix: a writable directory");
  }
}

/// The model this run builds (`cfg`), parameter by parameter, against the checkpoint's (`saved`).
void check_model(const fsdp::dcp::CheckpointInfo& info, const GPTConfig& cfg, const GPTConfig& saved,
                 const std::string& who, const std::string& path) {
  std::vector<std::string> differ, absent, extra;
  std::unordered_set<std::string> mine;
  {
    // Only its names and shapes are used (train() reseeds the generator before its own). Llama: on the meta device
    // (deferred_init), as an 8B model would not fit.
    std::shared_ptr<torch::nn::Module> model;
    if (cfg.is_llama()) {
      model = fsdp::deferred_init([&] { return Llama(cfg); }).ptr();
    } else {
      model = GPT(cfg).ptr();
    }
    auto check = [&](const std::string& name, const torch::Tensor& t) {
      const std::string key = fsdp::kModelPrefix + name;
      mine.insert(key);
      const auto it = info.tensors.find(key);
      if (it == info.tensors.end()) {
        absent.push_back("parameter '" + name + "' has shape " + c10::str(t.sizes()) +
                         " in this model but is not in the checkpoint");
      } else if (it->second.sizes != t.sizes().vec()) {
        differ.push_back("parameter '" + name + "' has shape " + c10::str(c10::IntArrayRef(it->second.sizes)) +
                         " in the checkpoint but " + c10::str(t.sizes()) + " in this model");
      }
    };
    for (const auto& p : model->named_parameters()) check(p.key(), p.value());
    for (const auto& b : model->named_buffers()) check(b.key(), b.value());
  }
  const std::string prefix = fsdp::kModelPrefix;
  for (const auto& [key, t] : info.tensors) {
    if (key.rfind(prefix, 0) == 0 && !mine.count(key)) {
      extra.push_back("the checkpoint has parameter '" + key.substr(prefix.size()) + "' of shape " +
                      c10::str(c10::IntArrayRef(t.sizes)) + ", which this model lacks");
    }
  }
  const std::string models = "saved: " + describe(saved) + "; this run: " + describe(cfg);
  for (auto* problems : {&differ, &absent, &extra}) {
    if (problems->empty()) continue;
    const size_t more = differ.size() + absent.size() + extra.size() - 1;
    throw UsageError(who + ": the checkpoint " + path + " holds a model of another shape: " + problems->front() +
                     (more ? ", and " + std::to_string(more) + " more difference" + (more > 1 ? "s" : "") : "") +
                     " (" + models + "). Fix: resume with the model options of the checkpoint (--model, --n-layer, "
                     "--n-head, --n-embd, --block-size, --tie-weights), or start a new run in another --ckpt-dir");
  }
  // Same shapes can still be another model: another architecture, or Llama's key/value heads, norm epsilon or RoPE.
  // (Dropout and the training window change no parameter and are the run's to choose.)
  auto arithmetic = [](const GPTConfig& c) {
    auto j = model_json(c);
    j.erase("dropout");
    j.erase("block_size");
    return j;
  };
  if (saved.arch != cfg.arch || (cfg.is_llama() && arithmetic(saved) != arithmetic(cfg))) {
    throw UsageError(who + ": the checkpoint " + path + " holds another model (" + models + "; saved " +
                     arithmetic(saved).dump() + ", this run " + arithmetic(cfg).dump() + "). Fix: resume with the "
                     "model options of the checkpoint, or start a new run in another --ckpt-dir");
  }
  if (saved.n_head != cfg.n_head || saved.tie_weights != cfg.tie_weights || saved.vocab_size != cfg.vocab_size) {
    throw UsageError(who + ": the checkpoint " + path + " holds another model (" + models +
                     "). Fix: resume with the model options of the checkpoint (--n-head " +
                     std::to_string(saved.n_head) + " --tie-weights " + (saved.tie_weights ? "true" : "false") +
                     "), or start a new run in another --ckpt-dir");
  }
}

/// A resume from `path` (the newest checkpoint of --ckpt-dir): a train_gpt checkpoint of this model,
/// data and seed, before this run's last step. Fills plan.complete (--resume auto, a restart: the
/// checkpoint is at or past this run's last step, so there is nothing left to train).
void check_resume(const Options& o, const GPTConfig& cfg, int64_t train_windows, const std::string& path,
                  bool automatic, ResumePlan& plan) {
  const std::string& who = plan.why;
  const std::string& dir = o.ckpt_dir;
  fsdp::dcp::CheckpointInfo info;
  try {
    info = fsdp::dcp::inspect(path);
  } catch (const c10::Error& e) {
    throw UsageError(who + ": the checkpoint " + path + " cannot be read: " + one_line(e.what_without_backtrace()) +
                     ". Fix: restore it, or write the name of an older step-N folder into " + dir + "/latest");
  }
  const auto step_it = info.values.find(kStepKey);
  const auto run_it = info.values.find(kRunKey);
  if (step_it == info.values.end() || run_it == info.values.end()) {
    throw UsageError(who + ": " + path + " is not a train_gpt checkpoint (it has no '" + kStepKey + "' and '" +
                     kRunKey + "'). Fix: the --ckpt-dir of a train_gpt run");
  }
  const nlohmann::json& run = run_it->second;
  check_model(info, cfg, model_from_json(run.at("model")), who, path);
  // The data position is an index into this run's training windows: the same data, split and seed.
  const auto saved_windows = run.at("train_windows").get<int64_t>();
  if (saved_windows != train_windows) {
    throw UsageError(who + ": the checkpoint " + path + " was trained on " + std::to_string(saved_windows) +
                     " training windows, this run's data has " + std::to_string(train_windows) +
                     ": its data position would point elsewhere. Fix: resume with the checkpoint's --data and "
                     "--val-fraction");
  }
  const auto saved_seed = run.at("seed").get<uint64_t>();
  if (saved_seed != o.seed) {
    throw UsageError(who + ": the checkpoint " + path + " was trained with --seed " + std::to_string(saved_seed) +
                     ", this run has --seed " + std::to_string(o.seed) + " (the data order depends on it). Fix: --seed " +
                     std::to_string(saved_seed));
  }
  const auto step = step_it->second.get<int64_t>();
  // --resume auto, a restart: a checkpoint at or past this run's last step means the run is done (e.g.
  // a rank failed after the last checkpoint): load it and train nothing, instead of failing again.
  const int64_t last_step = o.stop_at > 0 ? std::min(o.stop_at, o.steps) : o.steps;
  if (automatic && o.resume != "always" && step >= last_step) {
    plan.complete = true;
    return;
  }
  if (step >= o.steps) {
    throw UsageError(who + ": the checkpoint " + path + " is at step " + std::to_string(step) + " and --steps is " +
                     std::to_string(o.steps) + ": nothing left to train. Fix: a larger --steps (the learning-rate " +
                     "schedule spans --steps)");
  }
  if (o.stop_at > 0 && o.stop_at <= step) {
    throw UsageError("--stop-at " + std::to_string(o.stop_at) + " is not after the checkpoint's step " +
                     std::to_string(step) + " (" + path + "). Fix: --stop-at > " + std::to_string(step));
  }
}

/// The sampler as the Stateful under train.sampler, not owned (it lives in train() for the whole run; the
/// state dict holding this pointer is gone when save or load returns).
std::shared_ptr<fsdp::Stateful> sampler_stateful(DistributedSampler& sampler) {
  return std::shared_ptr<fsdp::Stateful>(std::shared_ptr<void>(), &sampler);
}

torch::Tensor get_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(const torch::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

/// Loads the checkpoint `path` into the model and the optimizer (resharded to this run's ranks), the
/// sampler, the global generator and the loss scaler. Collective. Returns the step it was saved after;
/// `run_info` gets its train.run, `first_eval` its train.first_eval (null when the checkpoint predates
/// that key, or the run had not evaluated yet).
int64_t load_checkpoint(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                        DistributedSampler& sampler, std::optional<fsdp::ShardedGradScaler>& scaler,
                        const fsdp::ProcessGroupPtr& pg, nlohmann::json& run_info, nlohmann::json& first_eval) {
  auto sd = fsdp::get_state_dict(model, optimizer);  // the destinations, in this run's layout
  auto rng = get_rng_state();
  std::vector<const char*> values{kStepKey, kScalerKey, kRunKey};
  const auto info = fsdp::dcp::inspect(path);
  if (info.values.count(kFirstEvalKey)) values.push_back(kFirstEvalKey);
  // The sampler is a Stateful (dcp::load calls its load_state_dict); checkpoints written before it was one
  // hold one Value {epoch, cursor} under the same key, still read.
  const bool sampler_value = info.values.count(kSamplerKey) > 0;
  if (sampler_value) {
    values.push_back(kSamplerKey);
  } else {
    sd.insert_or_assign(kSamplerKey, sampler_stateful(sampler));
  }
  for (const char* key : values) sd.insert_or_assign(key, fsdp::Value());
  sd.insert_or_assign(kRngKey, rng);
  fsdp::dcp::load(sd, path);  // verified on every rank before anything is written
  auto value = [&](const char* key) { return std::get<fsdp::Value>(sd.at(key)).json; };
  const auto step = value(kStepKey).get<int64_t>();
  const auto pos = sampler_value ? value(kSamplerKey) : nlohmann::json(nullptr);
  const auto scale = value(kScalerKey);
  run_info = value(kRunKey);
  first_eval = sd.contains(kFirstEvalKey) ? value(kFirstEvalKey) : nlohmann::json(nullptr);
  for (const char* key : values) sd.erase(key);
  sd.erase(kRngKey);
  fsdp::set_state_dict(model, optimizer, sd);  // step counts, hyper-parameters, the optimizer state it creates
  if (sampler_value) sampler.set_state({pos.at("epoch").get<int64_t>(), pos.at("cursor").get<int64_t>()});
  set_rng_state(rng);
  if (scaler && !scale.is_null()) {
    scaler.emplace(fsdp::GradScalerOptions().init_scale(scale.at("scale").get<double>()), pg);
    // ShardedGradScaler has no setter for its growth tracker; update() after no inf counts one finite
    // step, and the tracker is below growth_interval (it resets when it reaches it).
    for (int64_t i = 0; i < scale.at("growth_tracker").get<int64_t>(); ++i) scaler->update();
  }
  return step;
}

}  // namespace

ResumePlan check_checkpoint_options(const Options& o, const GPTConfig& cfg, int64_t train_windows, int restart) {
  ResumePlan plan;
  plan.restart = restart;
  const bool always = o.resume == "always";
  const bool automatic = o.resume == "auto" || (o.resume.empty() && restart > 0);
  plan.why = always ? "--resume" : o.resume == "auto" ? "--resume auto"
                                 : "restart " + std::to_string(restart) + " (TORCHELASTIC_RESTART_COUNT=" +
                                       std::to_string(restart) + ")";
  if (o.ckpt_dir.empty()) {
    check_no_ckpt_dir(o);
    return plan;  // a restart without --ckpt-dir has nothing to resume from: it starts afresh
  }
  const std::string& dir = o.ckpt_dir;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) {
    throw UsageError("--ckpt-dir " + dir + " is a file, not a directory. Fix: another --ckpt-dir");
  }
  std::optional<std::string> newest;
  try {
    if (fs::is_directory(dir, ec)) newest = newest_checkpoint(dir);
  } catch (const c10::Error& e) {
    throw UsageError("--ckpt-dir " + dir + ": " + one_line(e.what_without_backtrace()) +
                     ". Fix: write the name of a step-N folder of " + dir + " into " + dir + "/latest");
  }
  if (!always && !(automatic && newest)) {
    check_new_run(dir, newest);
    return plan;
  }
  // Resume: --resume, or --resume auto / a restart with a checkpoint in --ckpt-dir.
  plan.resume = true;
  if (!fs::is_directory(dir, ec)) {
    throw UsageError("--resume: --ckpt-dir " + dir + " does not exist, so there is no checkpoint to resume from. "
                     "Fix: the --ckpt-dir of the run to continue, --resume auto to start a new run when there is no "
                     "checkpoint, or no --resume to start a new run");
  }
  if (!newest) {
    throw UsageError("--resume: no checkpoint in --ckpt-dir " + dir + " (no 'latest' file and no step-N folder). "
                     "Fix: the --ckpt-dir of the run to continue (runs save there with --ckpt-dir and --ckpt-every), "
                     "--resume auto to start a new run when there is no checkpoint, or no --resume to start a new run");
  }
  check_resume(o, cfg, train_windows, *newest, automatic, plan);
  return plan;
}

std::optional<std::string> newest_checkpoint(const std::string& dir) {
  if (auto l = fsdp::dcp::latest(dir)) return l;
  std::optional<std::pair<int64_t, std::string>> best;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) != 0 || name.size() == 5 || name.size() > 23 ||
        name.find_first_not_of("0123456789", 5) != std::string::npos) {
      continue;  // not step-N (a step-N.tmp-* folder is a save that did not complete)
    }
    // Complete: our metadata file, or PyTorch's (--ckpt-format distcp) .metadata, is written last.
    if (!fs::is_regular_file(e.path() / fsdp::dcp::kMetadataFileName, ec) &&
        !fs::is_regular_file(e.path() / ".metadata", ec)) {
      continue;
    }
    const int64_t n = std::stoll(name.substr(5));
    if (!best || n > best->first) best = {n, e.path().string()};
  }
  if (!best) return std::nullopt;
  return best->second;
}

namespace {
/// Sequences per microbatch over all data-parallel ranks of a `world`-rank run.
int64_t global_batch_of(const Options& o, int world) { return o.batch_size * data_parallel_ranks(o, world); }
}  // namespace

nlohmann::json checkpoint_run_info(const Options& o, const GPTConfig& cfg, int64_t train_windows, int world) {
  return {{"model", model_json(cfg)},   {"train_windows", train_windows}, {"seed", o.seed},
          {"world_size", world},        {"batch_size", o.batch_size},     {"grad_accum_steps", o.grad_accum_steps},
          {"steps", o.steps},           {"mixed_precision", o.mixed_precision},
          {"global_batch", global_batch_of(o, world)}};
}

bool checkpoint_due(const Options& o, int64_t step, int64_t last_step) {
  return !o.ckpt_dir.empty() && (step == last_step || (o.ckpt_every > 0 && step % o.ckpt_every == 0));
}

std::string save_checkpoint(const Options& o, const nlohmann::json& run_info, int64_t step, const torch::nn::Module& model,
                            const torch::optim::Optimizer& optimizer, DistributedSampler& sampler,
                            const std::optional<fsdp::ShardedGradScaler>& scaler, const nlohmann::json& first_eval) {
  auto sd = fsdp::get_state_dict(model, optimizer);  // DTensors aliasing this rank's shards: no copy
  sd.insert_or_assign(kStepKey, fsdp::Value(step));
  sd.insert_or_assign(kSamplerKey, sampler_stateful(sampler));  // saved as train.sampler.{epoch,cursor}
  sd.insert_or_assign(kRngKey, get_rng_state());
  sd.insert_or_assign(kScalerKey, fsdp::Value(scaler ? nlohmann::json{{"scale", scaler->get_scale()},
                                                                       {"growth_tracker", scaler->growth_tracker()}}
                                                     : nlohmann::json(nullptr)));
  sd.insert_or_assign(kRunKey, fsdp::Value(run_info));
  sd.insert_or_assign(kFirstEvalKey, fsdp::Value(first_eval));
  const std::string path = (std::filesystem::path(o.ckpt_dir) / ("step-" + std::to_string(step))).string();
  // overwrite: a resumed run may repeat a step of a checkpoint newer than the one `latest` named.
  fsdp::dcp::save(sd, path, fsdp::dcp::SaveOptions().keep_last(o.keep_last).overwrite(true).update_latest(true).storage_format(
                              o.ckpt_format == "distcp" ? fsdp::dcp::StorageFormat::Distcp
                                                        : fsdp::dcp::StorageFormat::Safetensors));
  return path;
}

Resumed resume(const Options& o, const ResumePlan& plan, int64_t train_windows, int64_t last_step, torch::nn::Module& model,
               torch::optim::Optimizer& optimizer, DistributedSampler& sampler,
               std::optional<fsdp::ShardedGradScaler>& scaler, const fsdp::ProcessGroupPtr& pg) {
  const auto t_load = Clock::now();
  const std::string path = *newest_checkpoint(o.ckpt_dir);  // checked by check_checkpoint_options
  Resumed r;
  nlohmann::json saved;
  r.step = load_checkpoint(path, model, optimizer, sampler, scaler, pg, saved, r.first_eval);
  const auto pos = sampler.state();
  const int saved_world = saved.at("world_size").get<int>();
  r.message = "resume: " + path + " (after step " + std::to_string(r.step) + ", saved on " +
              std::to_string(saved_world) + " rank" + (saved_world > 1 ? "s" : "") + ", loaded on " +
              std::to_string(pg->size()) + " in " + fmt("%.2f", seconds_since(t_load)) + " s); data: epoch " +
              std::to_string(pos.epoch) + ", window " + std::to_string(pos.cursor) + " of " +
              std::to_string(train_windows) + "; " +
              (plan.complete ? "nothing left to train (step " + std::to_string(r.step) + " of " +
                                   std::to_string(last_step) + " done)"
                             : "continuing at step " + std::to_string(r.step + 1) + "/" + std::to_string(o.steps)) +
              (plan.why == "--resume" ? std::string() : " [" + plan.why + "]");
  // A resume on another world size with a per-rank --batch-size trains another global batch from here on
  // (an elastic restart, a resume by hand): allowed, but said, never silent.
  const int64_t global = global_batch_of(o, pg->size());
  if (saved.contains("global_batch") && saved.at("global_batch").get<int64_t>() != global) {
    r.message += "; NOTE: the global batch changes from " + std::to_string(saved.at("global_batch").get<int64_t>()) +
                 " to " + std::to_string(global) + " sequences (--batch-size " + std::to_string(o.batch_size) +
                 " per rank on " + std::to_string(pg->size()) + " ranks): pass --global-batch-size " +
                 std::to_string(saved.at("global_batch").get<int64_t>()) + " to keep it";
  }
  return r;
}

std::optional<KillAt> kill_after_checkpoint(int restart) {
  const char* v = std::getenv("TRAIN_GPT_TEST_KILL_AFTER_CHECKPOINT");
  if (!v || !*v || restart > 0) return std::nullopt;
  long long step = 0;
  int rank = 0;
  char who[16] = {0};
  const int n = std::sscanf(v, "%lld:%d:%15s", &step, &rank, who);
  if (n < 2 || (n == 3 && std::string(who) != "agent") || (n == 2 && std::strchr(v, ':') != std::strrchr(v, ':'))) {
    throw UsageError(std::string("TRAIN_GPT_TEST_KILL_AFTER_CHECKPOINT=") + v +
                     ": expected STEP:RANK or STEP:RANK:agent. Fix: unset it");
  }
  return KillAt{static_cast<int64_t>(step), rank, n == 3};
}

void kill_if_due(const std::optional<KillAt>& kill_at, int64_t step, int rank) {
  if (kill_at && kill_at->step == step && kill_at->rank == rank) {
    std::cout.flush();
    ::kill(kill_at->agent ? ::getppid() : ::getpid(), SIGKILL);
    if (kill_at->agent) std::this_thread::sleep_for(std::chrono::seconds(60));  // until PDEATHSIG ends us
  }
}

void test_step_delay() {
  static const long ms = [] {
    const char* v = std::getenv("TRAIN_GPT_TEST_STEP_DELAY_MS");
    return v && *v ? std::max(0L, std::atol(v)) : 0L;
  }();
  if (ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

}  // namespace train_gpt
