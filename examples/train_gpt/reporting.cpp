#include "reporting.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <stdexcept>

#if FSDP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace train_gpt {

namespace {
double status_mb(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(key.size())) / 1024.0;  // "VmHWM:  123456 kB"
  }
  return 0.0;
}
}  // namespace

double peak_rss_mb() { return status_mb("VmHWM"); }
double current_rss_mb() { return status_mb("VmRSS"); }

double peak_gpu_mem_mb(const torch::Device& device) {
#if FSDP_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1024.0 * 1024.0);  // [0]: StatType::AGGREGATE
  }
#endif
  return 0.0;
}

double flops_per_token(const GPTConfig& c, int64_t num_params) {
  if (c.is_llama()) {
    // torchtitan's Llama count (get_num_flop_per_token): 6 x the parameters that multiply (an untied embedding is
    // a lookup, not a matmul: left out; tied, it is the head and counts), plus attention's scores and weighted sum,
    // 12 x layers x heads x head_dim x sequence (query heads: grouped key/value heads save no FLOPs there).
    const int64_t embedding = c.tie_weights ? 0 : c.vocab_size * c.n_embd;
    return 6.0 * static_cast<double>(num_params - embedding) +
           12.0 * static_cast<double>(c.n_layer * c.n_head * c.head_dim() * c.block_size);
  }
  return 6.0 * static_cast<double>(num_params) +
         12.0 * static_cast<double>(c.n_layer * c.n_embd * c.block_size);
}

namespace {

/// Length of the well-formed UTF-8 sequence at bytes[i] (Unicode's table 3-7: no overlong forms, no
/// surrogates, nothing above U+10FFFF), or 0.
size_t utf8_sequence_length(const std::string& bytes, size_t i) {
  auto at = [&](size_t k) { return static_cast<unsigned char>(bytes[k]); };
  const unsigned char c = at(i);
  if (c < 0x80) return 1;
  size_t len = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + len > bytes.size() || at(i + 1) < lo || at(i + 1) > hi) return 0;
  for (size_t k = 2; k < len; ++k) {
    if (at(i + k) < 0x80 || at(i + k) > 0xBF) return 0;
  }
  return len;
}

}  // namespace

std::string printable(const std::string& bytes) {
  static const std::string kReplacement = "\xEF\xBF\xBD";
  std::string out;
  size_t i = 0;
  while (i < bytes.size()) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    size_t len = utf8_sequence_length(bytes, i);
    if (len == 1 && ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7F)) len = 0;
    if (len > 0) {
      out.append(bytes, i, len);
      i += len;
    } else {
      out += kReplacement;
      i += 1;
    }
  }
  return out;
}

// ---- Progress bar and metrics ----------------------------------------------------------------------

void ProgressBar::update(int64_t step, double loss, double seconds_per_step) {
  if (!enabled_) return;
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(kWidth * step / std::max<int64_t>(total_, 1));
  const auto eta = static_cast<int64_t>(seconds_per_step * static_cast<double>(total_ - step));
  std::printf("\r\033[K[%s%s] %lld/%lld loss %.4f ETA %lld:%02lld", std::string(filled, '#').c_str(),
              std::string(kWidth - filled, '.').c_str(), static_cast<long long>(step),
              static_cast<long long>(total_), loss, static_cast<long long>(eta / 60),
              static_cast<long long>(eta % 60));
  std::fflush(stdout);
  shown_ = true;
}

void ProgressBar::clear() {
  if (!shown_) return;
  std::printf("\r\033[K");
  std::fflush(stdout);
  shown_ = false;
}

MetricsWriter::MetricsWriter(const std::string& path, int64_t keep_through_step) {
  if (path.empty()) return;
  std::string kept;
  if (keep_through_step >= 0) {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
          j["step"].get<int64_t>() <= keep_through_step) {
        kept += line + "\n";
      }
    }
  }
  out_.open(path, std::ios::trunc);
  if (!out_) throw UsageError("--metrics " + path + " cannot be written (missing directory?)");
  out_ << kept;
}

void MetricsWriter::probe(const std::string& path) {
  std::ofstream out(path, std::ios::app);
  if (!out) throw UsageError("--metrics " + path + " cannot be written (missing directory?)");
}

void MetricsWriter::write(const nlohmann::json& line) {
  if (!out_.is_open()) return;
  out_ << line.dump() << '\n';
  out_.flush();  // a crashed or interrupted run keeps its curve
}

// ---- Reporter ----------------------------------------------------------------------------------------

Reporter::Reporter(const RunSetup& s, int64_t num_params, fsdp::ProcessGroupPtr pg)
    : s_(s),
      o_(s.opts),
      pg_(std::move(pg)),
      device_(pg_->device()),
      main_rank_(pg_->rank() == 0),
      num_params_(num_params),
      // A pipeline's pp ranks share one batch: each rank's share is 1 / pp of it (tok/s/rank, MFU).
      tokens_per_step_(s.opts.batch_size * s.cfg.block_size * s.opts.grad_accum_steps / s.parallel.pp),
      flops_per_token_(flops_per_token(s.cfg, num_params)),
      bar_(main_rank_ && !s.opts.no_progress && isatty(STDOUT_FILENO), s.opts.steps) {
  mark_interval();
}

void Reporter::say(const std::string& line) {
  bar_.clear();
  if (main_rank_) std::cout << line << std::endl;
}

std::string pipeline_layout(const ParallelOptions& p) {
  std::string out = "pp " + std::to_string(p.pp) + " x dp " + std::to_string(p.dp_replicate * p.dp_shard);
  if (p.tp > 1) out += " x tp " + std::to_string(p.tp);
  if (p.dp_replicate > 1) {
    out += ", dp = dp_replicate " + std::to_string(p.dp_replicate) + " x dp_shard " + std::to_string(p.dp_shard);
  }
  if (p.sequence_parallel) out += ", sequence parallel";
  return out;
}

void Reporter::banner(int64_t steps_per_epoch, bool foreach_optimizer) {
  const int world = pg_->size();
  std::ostringstream os;
  os << "train_gpt: " << world << " rank" << (world > 1 ? "s" : "") << " x " << torch::get_num_threads()
     << " thread" << (torch::get_num_threads() > 1 ? "s" : "") << " (" << pg_->backend()->getBackendName()
     << " on " << device_.str() << ")\n"
     << "model: " << (o_.init_from.empty() ? o_.model : "--init-from " + o_.init_from) << ": " << describe(s_.cfg) << ", " << fmt("%.2f", num_params_ / 1e6)
     << "M parameters, " << (s_.parallel.replicate ? "replicated (fsdp::replicate)" : "sharded") << " over "
     << world << " rank" << (world > 1 ? "s" : "")
     << (s_.parallel.cp > 1
             ? " (dp_replicate x dp_shard x cp x tp = " + std::to_string(s_.parallel.dp_replicate) + " x " +
                   std::to_string(s_.parallel.dp_shard) + " x " + std::to_string(s_.parallel.cp) + " x " +
                   std::to_string(s_.parallel.tp) + ")"
         : (s_.parallel.tp > 1 || s_.parallel.dp_replicate > 1) && s_.parallel.pp == 1
             ? " (dp_replicate x dp_shard x tp = " + std::to_string(s_.parallel.dp_replicate) + " x " +
                   std::to_string(s_.parallel.dp_shard) + " x " + std::to_string(s_.parallel.tp) +
                   (s_.parallel.sequence_parallel ? ", sequence parallel" : "") +
                   (s_.parallel.loss_parallel ? ", loss parallel" : "") +
                   (s_.parallel.dtensor_rng ? ", DTensor RNG" : "") + ")"
             : std::string())
     << (s_.parallel.pp > 1 ? " (" + pipeline_layout(s_.parallel) + ")" : std::string())
     << (o_.model_impl == "plain" ? " (unchanged model code: --model-impl plain)" : "") << "\n"
     << "data: " << s_.data_name << ", " << s_.data_bytes << " bytes: train " << s_.train.size()
     << " windows, val " << s_.val.size() << " windows of " << s_.cfg.block_size + 1 << " tokens; "
     << steps_per_epoch << " steps per epoch\n"
     << "batch: " << o_.batch_size << " x " << s_.cfg.block_size << " tokens x " << o_.grad_accum_steps
     << " microbatch" << (o_.grad_accum_steps > 1 ? "es" : "") << " x " << s_.parallel.data_ranks(world)
     << (s_.parallel.tp > 1 || s_.parallel.pp > 1 || s_.parallel.cp > 1
             ? " data-parallel ranks (x" +
                   (s_.parallel.cp > 1 ? " " + std::to_string(s_.parallel.cp) + " context-parallel" : std::string()) +
                   (s_.parallel.tp > 1 ? " " + std::to_string(s_.parallel.tp) + " tensor-parallel" : std::string()) +
                   (s_.parallel.pp > 1 ? " " + std::to_string(s_.parallel.pp) + " pipeline-parallel" : std::string()) + ")"
             : std::string(" ranks"))
     << " = " << tokens_per_step_ * (world / (s_.parallel.tp * s_.parallel.cp)) << " tokens per step\n"
     << "optim: AdamW lr " << fmt("%.2e", o_.lr) << " -> " << fmt("%.2e", o_.min_lr) << " (warmup "
     << o_.warmup_steps << ", cosine), weight decay " << o_.weight_decay << ", clip "
     << (o_.clip_grad > 0 ? fmt("%g", o_.clip_grad) : std::string("off"))
     << (foreach_optimizer ? ", foreach kernels" : "") << "; precision " << o_.mixed_precision
     << ", reshard after forward " << o_.reshard_after_forward << (o_.cpu_offload ? ", cpu offload" : "")
     << (o_.activation_checkpointing != "none" ? ", activation checkpointing " + o_.activation_checkpointing : "")
     << (o_.activation_offload ? ", activation offload" : "");
  say(os.str());
}

void Reporter::open_metrics(int64_t keep_through_step) {
  metrics_ = MetricsWriter(main_rank_ ? o_.metrics : std::string(), keep_through_step);
}

void Reporter::restore_first_eval(const nlohmann::json& first_eval) {
  if (first_eval.is_object()) first_eval_ = {first_eval.at("step").get<int64_t>(), first_eval.at("loss").get<double>()};
}

nlohmann::json Reporter::first_eval_json() const {
  return first_eval_ ? nlohmann::json{{"step", first_eval_->first}, {"loss", first_eval_->second}} : nlohmann::json();
}

void Reporter::eval(int64_t step, double loss) {
  if (!first_eval_) first_eval_ = {step, loss};
  last_eval_ = {step, loss};
  say("eval step " + std::to_string(step) + ": val loss " + fmt("%.4f", loss));
}

double Reporter::global_peak_mb() {
  auto t = torch::tensor({peak_rss_mb()}, torch::kDouble).to(device_);
  fsdp::all_reduce(t, *pg_, fsdp::ReduceOp::MAX);
  return t.item<double>();
}

double Reporter::global_peak_gpu_mb() {
  auto t = torch::tensor({peak_gpu_mem_mb(device_)}, torch::kDouble).to(device_);
  fsdp::all_reduce(t, *pg_, fsdp::ReduceOp::MAX);
  return t.item<double>();
}

nlohmann::json Reporter::mfu(double tokens_per_s_per_rank) const {
  if (!device_.is_cuda()) return nullptr;
  return flops_per_token_ * tokens_per_s_per_rank / (o_.peak_tflops * 1e12);
}

namespace {
long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}
}  // namespace

void Reporter::mark_interval() {
  marks_ = {static_cast<double>(pg_->comm_stats().sent()),
            static_cast<double>(pg_->collective_bytes("all_gather_into_tensor")),
            static_cast<double>(pg_->collective_bytes("reduce_scatter_tensor")), pg_->wait_seconds(), minor_faults()};
  group_marks_.clear();
  for (const auto& [name, g] : groups_) group_marks_.push_back(g->comm_stats());
}

void Reporter::watch_groups(std::vector<std::pair<std::string, fsdp::ProcessGroupPtr>> groups) {
  groups_ = std::move(groups);
  mark_interval();
}

void Reporter::initial_metrics(double eval_loss) {
  metrics_.write({{"step", 0}, {"loss", nullptr}, {"lr", 0.0}, {"grad_norm", nullptr}, {"tokens_per_s", nullptr},
                  {"step_ms", nullptr}, {"peak_rss_mb", global_peak_mb()},
                  {"peak_gpu_mem_mb", global_peak_gpu_mb()}, {"mfu", nullptr}, {"eval_loss", eval_loss}});
  mark_interval();
}

void Reporter::step(int64_t step, double lr, double loss, double grad_norm, double seconds,
                    const std::function<double()>& evaluate) {
  if (!std::isfinite(loss)) {
    bar_.clear();
    throw std::runtime_error("the loss is " + std::to_string(loss) + " at step " + std::to_string(step) +
                             ": training diverged. Fix: a lower --lr, --clip-grad 1, or fp32");
  }
  train_seconds_ += seconds;
  interval_seconds_ += seconds;
  interval_loss_ += loss;
  ++interval_steps_;
  ++steps_timed_;
  bar_.update(step, loss, train_seconds_ / static_cast<double>(steps_timed_));

  // --log-every / --eval-every 0: only after the last step (and, for evaluations, before the first).
  const bool log_now = (o_.log_every > 0 && step % o_.log_every == 0) || step == o_.steps;
  const bool eval_now = (o_.eval_every > 0 && step % o_.eval_every == 0) || step == o_.steps;
  if (!log_now && !eval_now) return;
  const double mean_loss = interval_loss_ / static_cast<double>(interval_steps_);
  const double step_ms = 1e3 * interval_seconds_ / static_cast<double>(interval_steps_);
  const double tps = static_cast<double>(tokens_per_step_ * interval_steps_) / interval_seconds_;  // per rank
  // Per step over the interval, this rank, read before the reporting's own collectives below (issue 16):
  // bytes this rank sent at the transport level (fsdp::CommStats: every collective of the step, the loss and
  // gradient-norm all-reduces included) and the ratio to FSDP's minimum, (N-1)/N of the all-gathers' outputs
  // plus the reduce-scatters' inputs (as bench_fully_shard); minor page faults (getrusage ru_minflt).
  const double steps_d = static_cast<double>(interval_steps_);
  const double sent = (static_cast<double>(pg_->comm_stats().sent()) - marks_.sent) / steps_d;
  const double payload = (static_cast<double>(pg_->collective_bytes("all_gather_into_tensor")) - marks_.all_gather +
                          static_cast<double>(pg_->collective_bytes("reduce_scatter_tensor")) - marks_.reduce_scatter) /
                         steps_d;
  const double all_gather_payload =
      (static_cast<double>(pg_->collective_bytes("all_gather_into_tensor")) - marks_.all_gather) / steps_d;
  const double n = static_cast<double>(pg_->size());
  const nlohmann::json ratio_to_min =
      n > 1 && payload > 0 ? nlohmann::json(sent / ((n - 1) / n * payload)) : nlohmann::json(nullptr);
  const double faults = static_cast<double>(minor_faults() - marks_.minor_faults) / steps_d;
  // Exposed communication: how long this rank blocked in collectives' waits (the part not overlapped).
  const double comm_wait_ms = 1e3 * (pg_->wait_seconds() - marks_.wait_seconds) / steps_d;
  const double peak = global_peak_mb();
  const double peak_gpu = global_peak_gpu_mb();
  nlohmann::json line = {{"step", step},          {"loss", mean_loss},    {"lr", lr},
                         {"grad_norm", grad_norm}, {"tokens_per_s", tps},  {"step_ms", step_ms},
                         {"peak_rss_mb", peak},   {"peak_gpu_mem_mb", peak_gpu}, {"mfu", mfu(tps)},
                         {"bytes_per_step", sent}, {"bytes_ratio_to_min", ratio_to_min},
                         {"all_gather_bytes_per_step", all_gather_payload},
                         {"minor_faults_per_step", faults}, {"comm_wait_ms", comm_wait_ms}};
  std::ostringstream os;
  os << "step " << std::setw(std::to_string(o_.steps).size()) << step << "/" << o_.steps << " | loss "
     << fmt("%.4f", mean_loss) << " | lr " << fmt("%.2e", lr) << " | grad norm " << fmt("%.3f", grad_norm)
     << " | " << fmt("%.0f", tps) << " tok/s/rank | " << fmt("%.0f", step_ms) << " ms/step | peak "
     << fmt("%.0f", peak) << " MiB";
  if (device_.is_cuda()) {
    os << " | GPU peak " << fmt("%.0f", peak_gpu) << " MiB | MFU " << fmt("%.1f", 100.0 * mfu(tps).get<double>())
       << "%";
  }
  say(os.str());
  if (!groups_.empty()) {
    nlohmann::json per_group = nlohmann::json::object();
    for (size_t i = 0; i < groups_.size(); ++i) {
      const auto& now = groups_[i].second->comm_stats();
      const auto& then = group_marks_[i];
      nlohmann::json kinds = nlohmann::json::object();
      auto add = [&](const char* kind, const fsdp::CommBytes& a, const fsdp::CommBytes& b) {
        if (a.count == b.count) return;
        kinds[kind] = {{"count", static_cast<double>(a.count - b.count) / steps_d},
                       {"sent", static_cast<double>(a.sent - b.sent) / steps_d}};
      };
      add("all_gather_into_tensor", now.all_gather_into_tensor, then.all_gather_into_tensor);
      add("reduce_scatter_tensor", now.reduce_scatter_tensor, then.reduce_scatter_tensor);
      add("all_reduce", now.all_reduce, then.all_reduce);
      add("broadcast", now.broadcast, then.broadcast);
      per_group[groups_[i].first] = kinds;
    }
    line["comm_per_step"] = per_group;
  }
  if (eval_now) line["eval_loss"] = evaluate();
  metrics_.write(line);
  mark_interval();
  interval_seconds_ = interval_loss_ = 0;
  interval_steps_ = 0;
}

void Reporter::end_of_training(int64_t last_step) {
  bar_.clear();
  if (last_step < o_.steps) {
    say("stopped after step " + std::to_string(last_step) + " of " + std::to_string(o_.steps) + " (--stop-at)" +
        (o_.ckpt_dir.empty() ? std::string() : ": continue with --resume --ckpt-dir " + o_.ckpt_dir));
  }
}

void Reporter::summary(int64_t start_step, int64_t last_step, double wall_seconds, const std::string& sample) {
  if (!main_rank_) return;
  const int64_t steps_run = last_step - start_step;
  const double tokens = static_cast<double>(tokens_per_step_ * steps_run);
  const double seconds = std::max(train_seconds_, 1e-9);
  std::ostringstream os;
  os << "done: " << steps_run << " steps in " << fmt("%.1f", wall_seconds) << " s ("
     << fmt("%.0f", 1e3 * train_seconds_ / std::max<int64_t>(steps_run, 1)) << " ms/step, "
     << fmt("%.0f", tokens / seconds) << " tok/s/rank, " << fmt("%.0f", tokens * (pg_->size() / (s_.parallel.tp * s_.parallel.cp)) / seconds)
     << " tok/s in all)\n";
  if (device_.is_cuda()) {
    os << "gpu: peak " << fmt("%.0f", peak_gpu_mem_mb(device_)) << " MiB allocated (rank 0), MFU "
       << fmt("%.1f", 100.0 * mfu(tokens / seconds).get<double>()) << "% of " << fmt("%.0f", o_.peak_tflops)
       << " TFLOP/s (" << fmt("%.3g", flops_per_token_) << " FLOPs per token)\n";
  }
  // The run's first evaluation (restored from the checkpoint after a resume) and its last. A run
  // resumed from a checkpoint without train.first_eval that evaluated once shows that one only.
  if (first_eval_ && last_eval_ && first_eval_->first != last_eval_->first) {
    os << "eval loss: " << fmt("%.4f", first_eval_->second) << " (step " << first_eval_->first << ") -> "
       << fmt("%.4f", last_eval_->second) << " (step " << last_eval_->first << ")\n";
  } else if (last_eval_) {
    os << "eval loss: " << fmt("%.4f", last_eval_->second) << " (step " << last_eval_->first << ")\n";
  }
  if (o_.sample_tokens > 0) {
    os << "sample (seed " << o_.seed << ", temperature " << o_.temperature << ", top-k " << o_.top_k << "):\n"
       << "----\n" << printable(o_.sample_prompt + sample) << "\n----";
  }
  std::cout << os.str() << std::endl;
}

}  // namespace train_gpt
