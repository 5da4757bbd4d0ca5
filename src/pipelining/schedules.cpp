// The schedules (fsdp/pipelining/schedules.h): their orders (schedule_orders.cpp) and the runtime that
// runs one rank's actions.
//
// [Note: pipeline runtime]
// Each rank runs its compute actions in the order of pipeline_order()[rank]. A forward of stage s > 0
// first receives its input from stage s-1 (blocking: that is the bubble), a backward of stage s < last
// its output's gradient from stage s+1; what a stage produces is sent at once without waiting (isend),
// and every send is waited at the end of the step. When both stages of a message live on this rank
// (ZBV's turn at the bottom of the V, or a single-rank pipeline) the tensor is handed over in memory.
// Every message has its own tag (kind, receiving stage, microbatch), so on Gloo a receive matches
// exactly its message whatever order the two ranks post them in; a message of the wrong size fails the
// receive instead of corrupting a tensor. Orders are deadlock-free as PyTorch's are: each action waits
// only for actions that come earlier in their rank's order.
//
// [Note: zero-bubble backward]
// A zero-bubble schedule splits a backward into I (the input's gradient, needed by the previous stage
// now) and W (the weights' gradients, needed only at the optimizer step). I is
// torch::autograd::grad(output, input, grad_output, retain_graph=true): autograd runs only the nodes on
// the path to the input, and those nodes compute only the gradients that lead there (an addmm's weight
// product is skipped). Before it, a pre-hook is put on each "intermediate": a node on the input's path
// with a branch that leads to weights (addmm, whose edge to the transposed weight leaves the path), to
// keep the gradient that enters it. W then feeds each kept gradient back into its node with the
// weights as the only outputs (Engine::execute with accumulate_grad, as backward(inputs=weights)), so
// autograd runs the weight branches and nothing of the input's path again: the same work as one full
// backward, split in two (src/pipelining/backward_split.cpp; the idea is PyTorch's stage_backward_input
// and stage_backward_weight). Where the split does not apply, W is a full backward of the retained graph
// (the input's part of the backward then runs twice): a fully_shard'ed stage (its graph holds FSDP's
// unsharded parameters and its gradients must pass FSDP's hooks), a weight under two intermediates (tied
// inside a stage), a weight reached only off the input's path, and the first stage (no input gradient:
// I does nothing and W is the whole backward).
#include "fsdp/pipelining/schedules.h"

#include <chrono>
#include <set>
#include <sstream>

#include <torch/autograd.h>

#include "fsdp/c10d/p2p.h"
#include "fsdp/fsdp/fully_shard.h"
#include "pipelining/backward_split.h"
#include "pipelining/schedule_orders.h"
#include "pipelining/stage_access.h"
#include "utils/implicit_checkpoint.h"

namespace fsdp::pipelining {

using detail::StageAccess;
using Clock = std::chrono::steady_clock;

std::string Action::str() const {
  const char* t = computation_type == ComputationType::FORWARD         ? "F"
                  : computation_type == ComputationType::FULL_BACKWARD ? "B"
                  : computation_type == ComputationType::BACKWARD_INPUT ? "I"
                                                                        : "W";
  return std::to_string(stage_index) + t + std::to_string(microbatch_index);
}

std::vector<torch::Tensor> split_into_microbatches(const torch::Tensor& batch, int n_microbatches) {
  TORCH_CHECK(n_microbatches >= 1, "split_into_microbatches: n_microbatches must be >= 1, got ", n_microbatches);
  TORCH_CHECK(batch.defined() && batch.dim() >= 1, "split_into_microbatches: the batch must have a dim 0 to split");
  TORCH_CHECK(batch.size(0) % n_microbatches == 0, "pipeline: the batch's size ", batch.size(0),
              " (dim 0 of ", batch.sizes(), ") does not divide into ", n_microbatches,
              " microbatches; fix: make the batch size a multiple of n_microbatches");
  return batch.chunk(n_microbatches, 0);
}

namespace {

constexpr int kMetaWords = 16;
constexpr int64_t kMetaMarker = 0x5050'4D45;  // "PPME"

enum MsgKind { kActivation = 0, kGradient = 1, kMeta = 2 };

std::string action_name(const Action& a) {
  switch (a.computation_type) {
    case ComputationType::FORWARD: return "forward";
    case ComputationType::FULL_BACKWARD: return "backward";
    case ComputationType::BACKWARD_INPUT: return "input-gradient backward";
    default: return "weight-gradient backward";
  }
}

/// Whether a stage's module is sharded by fully_shard / replicate (its gradient sync is then driven here).
/// A registry lookup, every step: a stage may be sharded after its schedule was built.
bool is_fsdp_module(const torch::nn::Module& m) { return fsdp::detail::state_of(m) != nullptr; }

}  // namespace

PipelineSchedule::PipelineSchedule(std::vector<PipelineStage*> stages, int n_microbatches, LossFn loss_fn,
                                   bool scale_grads, const char* name)
    : stages_(std::move(stages)), n_microbatches_(n_microbatches), loss_fn_(std::move(loss_fn)), scale_grads_(scale_grads) {
  TORCH_CHECK(!stages_.empty(), name, ": no stages given");
  for (auto* s : stages_) TORCH_CHECK(s, name, ": a stage is null");
  TORCH_CHECK(n_microbatches >= 1, name, ": n_microbatches must be >= 1, got ", n_microbatches);
  num_stages_ = stages_[0]->num_stages();
  pp_size_ = stages_[0]->group_size();
}

PipelineSchedule::~PipelineSchedule() = default;

void PipelineSchedule::finish_init() {
  const auto& g = stages_[0]->group();
  const std::string who = name() + " on pipeline rank " + std::to_string(g->rank());
  std::set<int> seen;
  for (auto* s : stages_) {
    TORCH_CHECK(s->group() == g, who, ": stage ", s->stage_index(), " has another pipeline group than stage ",
                stages_[0]->stage_index());
    TORCH_CHECK(s->num_stages() == num_stages_, who, ": stage ", s->stage_index(), " says num_stages ",
                s->num_stages(), ", stage ", stages_[0]->stage_index(), " says ", num_stages_);
    TORCH_CHECK(seen.insert(s->stage_index()).second, who, ": stage ", s->stage_index(), " given twice");
    TORCH_CHECK(stage_to_rank_(s->stage_index()) == g->rank(), who, ": stage ", s->stage_index(),
                " belongs to pipeline rank ", stage_to_rank_(s->stage_index()), " under this schedule (",
                "stage_ids_this_rank() gives each rank's stages)");
    StageAccess::stage_to_rank(*s) = stage_to_rank_;
  }
  const int expected = num_stages_ / pp_size_;
  TORCH_CHECK(num_stages_ % pp_size_ == 0 && static_cast<int>(stages_.size()) == expected, who, ": ",
              stages_.size(), " stage(s) on this rank, expected ", num_stages_, " stages / ", pp_size_,
              " ranks = ", num_stages_ / std::max(1, pp_size_), " per rank (num_stages must be a multiple of the "
              "pipeline group's size)");
}

std::string PipelineSchedule::format_pipeline_order() const {
  std::ostringstream os;
  for (const auto& [rank, ops] : order_) {
    os << "Rank " << rank << ":";
    for (const auto& a : ops) os << " " << (a ? a->str() : "_");
    os << "\n";
  }
  return os.str();
}

torch::Tensor PipelineSchedule::step(const torch::Tensor& input, const torch::Tensor& target,
                                     std::vector<torch::Tensor>* losses) {
  const auto t_step = Clock::now();
  wait_s_ = 0;
  ProcessGroup& group = *stages_[0]->group();
  const int me = group.rank();
  const int m = n_microbatches_;
  std::map<int, PipelineStage*> mine;
  for (auto* s : stages_) mine[s->stage_index()] = s;
  const std::string where = name() + " on pipeline rank " + std::to_string(me);

  std::vector<torch::Tensor> in_mbs, tgt_mbs;
  if (mine.count(0)) {
    TORCH_CHECK(input.defined(), where, ": step() needs the batch's input on the rank holding stage 0");
    in_mbs = split_into_microbatches(input, m);
  }
  const bool has_last = mine.count(num_stages_ - 1) > 0;
  if (has_last) {
    TORCH_CHECK(loss_fn_, where, ": no loss_fn: a training step needs one on the last stage");
    TORCH_CHECK(target.defined(), where, ": step() needs the batch's target on the rank holding the last stage ",
                num_stages_ - 1);
    tgt_mbs = split_into_microbatches(target, m);
  }
  for (auto* s : stages_) {
    StageAccess::microbatches(*s).clear();
    StageAccess::received_grads(*s).clear();
    StageAccess::outputs(*s).clear();
    StageAccess::losses(*s).clear();
    StageAccess::in_meta_known(*s) = false;
    StageAccess::sends(*s).clear();
  }
  std::map<std::pair<int, int>, torch::Tensor> local_act, local_grad;  // (receiving stage, mb)
  std::set<int> meta_sent;                                            // stages that sent this step's header
  std::map<int, int> backwards_done;                                  // per stage: B or W count
  std::map<int, bool> fsdp;
  for (auto* s : stages_) fsdp[s->stage_index()] = is_fsdp_module(*s->submod());
  std::map<std::pair<int, int>, std::shared_ptr<detail::WeightGradWork>> weight_work;  // (stage, mb): I -> W

  auto tag = [&](MsgKind kind, int stage, int mb) { return (kind * num_stages_ + stage) * (m + 1) + mb; };
  auto describe_action = [&](const Action& a) {
    return where + ", stage " + std::to_string(a.stage_index) + ", action " + a.str() + " (" + action_name(a) +
           " of microbatch " + std::to_string(a.microbatch_index) + ")";
  };
  auto timed_wait = [&](Work& w, const Action& a, const std::string& what) {
    const auto t0 = Clock::now();
    try {
      w.wait();
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, describe_action(a), ": ", what, " failed: ", e.what_without_backtrace());
    }
    wait_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
  };

  auto receive_input = [&](PipelineStage& s, const Action& a) -> torch::Tensor {
    const int st = s.stage_index(), mb = a.microbatch_index;
    if (s.is_first()) return in_mbs[mb].to(s.device());
    torch::Tensor x;
    if (auto it = local_act.find({st, mb}); it != local_act.end()) {
      x = it->second;
      local_act.erase(it);
    } else {
      const int src = stage_to_rank_(st - 1);
      if (!StageAccess::in_meta_known(s)) {
        auto meta = torch::empty({kMetaWords}, torch::kLong);
        Work w = irecv(meta, src, group, tag(kMeta, st, 0), "shape header for stage " + std::to_string(st));
        timed_wait(w, a, "receiving the shape header from stage " + std::to_string(st - 1) + " (pipeline rank " +
                             std::to_string(src) + ")");
        auto* p = meta.data_ptr<int64_t>();
        TORCH_CHECK(p[0] == kMetaMarker && p[2] >= 0 && p[2] <= kMetaWords - 3, describe_action(a),
                    ": the shape header from stage ", st - 1, " is malformed (a message of another kind?)");
        StageAccess::in_dtype(s) = static_cast<c10::ScalarType>(p[1]);
        StageAccess::in_shape(s).assign(p + 3, p + 3 + p[2]);
        StageAccess::in_meta_known(s) = true;
      }
      x = torch::empty(StageAccess::in_shape(s), torch::TensorOptions().dtype(StageAccess::in_dtype(s)).device(s.device()));
      Work w = irecv(x, src, group, tag(kActivation, st, mb),
                     "activations of microbatch " + std::to_string(mb) + " for stage " + std::to_string(st));
      timed_wait(w, a, "receiving the activations from stage " + std::to_string(st - 1) + " (pipeline rank " +
                           std::to_string(src) + ")");
    }
    if (x.is_floating_point()) x.requires_grad_(true);
    return x;
  };

  auto send_output = [&](PipelineStage& s, const Action& a, const torch::Tensor& out) {
    const int st = s.stage_index(), mb = a.microbatch_index;
    auto y = out.detach();
    if (mine.count(st + 1)) {
      local_act[{st + 1, mb}] = y;
      return;
    }
    const int dst = stage_to_rank_(st + 1);
    y = y.contiguous();
    if (!meta_sent.count(st)) {
      auto meta = torch::zeros({kMetaWords}, torch::kLong);
      auto* p = meta.data_ptr<int64_t>();
      TORCH_CHECK(y.dim() <= kMetaWords - 3, describe_action(a), ": the output has ", y.dim(), " dims, at most ",
                  kMetaWords - 3, " are supported");
      p[0] = kMetaMarker;
      p[1] = static_cast<int64_t>(y.scalar_type());
      p[2] = y.dim();
      for (int64_t d = 0; d < y.dim(); ++d) p[3 + d] = y.size(d);
      StageAccess::sends(s).push_back(isend(meta, dst, group, tag(kMeta, st + 1, 0), "shape header for stage " +
                                                                                      std::to_string(st + 1)));
      meta_sent.insert(st);
    }
    StageAccess::sends(s).push_back(isend(y, dst, group, tag(kActivation, st + 1, mb),
                                          "activations of microbatch " + std::to_string(mb) + " for stage " +
                                              std::to_string(st + 1)));
  };

  auto receive_grad = [&](PipelineStage& s, const Action& a, const torch::Tensor& out) -> torch::Tensor {
    const int st = s.stage_index(), mb = a.microbatch_index;
    if (s.is_last()) return {};
    if (auto it = local_grad.find({st, mb}); it != local_grad.end()) {
      auto g = it->second;
      local_grad.erase(it);
      return g;
    }
    const int src = stage_to_rank_(st + 1);
    auto g = torch::empty(out.sizes(), out.options().requires_grad(false));
    Work w = irecv(g, src, group, tag(kGradient, st, mb),
                   "gradient of microbatch " + std::to_string(mb) + " for stage " + std::to_string(st));
    timed_wait(w, a, "receiving the output's gradient from stage " + std::to_string(st + 1) + " (pipeline rank " +
                         std::to_string(src) + ")");
    return g;
  };

  auto send_input_grad = [&](PipelineStage& s, const Action& a, torch::Tensor g, const torch::Tensor& x) {
    const int st = s.stage_index(), mb = a.microbatch_index;
    if (s.is_first()) return;
    if (!g.defined()) g = torch::zeros_like(x);  // the stage's output does not depend on its input
    if (mine.count(st - 1)) {
      local_grad[{st - 1, mb}] = g;
      return;
    }
    StageAccess::sends(s).push_back(isend(g.contiguous(), stage_to_rank_(st - 1), group, tag(kGradient, st - 1, mb),
                                          "gradient of microbatch " + std::to_string(mb) + " for stage " +
                                              std::to_string(st - 1)));
  };

  // fully_shard inside a stage: reduce the gradients only at the stage's last backward of the step.
  auto before_backward = [&](PipelineStage& s) {
    const int st = s.stage_index();
    const bool last = ++backwards_done[st] == m;
    if (!fsdp[st]) return;
    auto api = fsdp_api(*s.submod());
    api.set_requires_gradient_sync(last);
    api.set_reshard_after_backward(last);
    api.set_is_last_backward(last);
  };

  for (const auto& slot : order_.at(me)) {
    if (!slot) continue;
    const Action& a = *slot;
    PipelineStage& s = *mine.at(a.stage_index);
    auto& mbs = StageAccess::microbatches(s);
    const int mb = a.microbatch_index;
    try {
      switch (a.computation_type) {
        case ComputationType::FORWARD: {
          // The runtime's own tensors (receive buffers, which the transport fills behind autograd's back;
          // the copies it sends) must never be recorded by the implicit checkpoint region of a stage's last
          // checkpointed module (checkpoint_wrapper on an unchanged module): a replay would recreate a
          // receive buffer empty. So the region of a stage ends with the stage (with its loss, on the last),
          // and the runtime's work runs with regions suspended.
          torch::Tensor x;
          {
            fsdp::detail::SuspendImplicitRegions runtime_code;
            x = receive_input(s, a);
          }
          auto out = StageAccess::forward(s)(x);
          auto& rec = mbs[mb];
          rec.input = x;
          if (s.is_last()) {
            auto loss = loss_fn_(out, tgt_mbs[mb].to(out.device()));
            fsdp::detail::SuspendImplicitRegions runtime_code;
            StageAccess::outputs(s).push_back(out.detach());
            TORCH_CHECK(loss.numel() == 1, "the loss_fn returned a tensor of shape ", loss.sizes(),
                        "; it must return one value (a 0-dim tensor)");
            StageAccess::losses(s).push_back(loss.detach());
            rec.output = loss;
          } else {
            fsdp::detail::SuspendImplicitRegions runtime_code;
            rec.output = out;
            send_output(s, a, out);
          }
          break;
        }
        case ComputationType::FULL_BACKWARD: {
          auto& rec = mbs.at(mb);
          auto g = receive_grad(s, a, rec.output);
          before_backward(s);
          if (g.defined()) {
            torch::autograd::backward({rec.output}, {g});
          } else {
            torch::autograd::backward({rec.output});
          }
          if (!s.is_first()) send_input_grad(s, a, rec.input.grad(), rec.input);
          mbs.erase(mb);
          break;
        }
        case ComputationType::BACKWARD_INPUT: {
          auto& rec = mbs.at(mb);
          auto g = receive_grad(s, a, rec.output);
          StageAccess::received_grads(s)[mb] = g;
          if (!s.is_first() && rec.input.requires_grad()) {
            // A fully_shard'ed stage's graph holds FSDP's unsharded parameters, not the registered ones,
            // and its gradients must go through FSDP's hooks: W is then a full backward.
            torch::Tensor gin;
            weight_work[{a.stage_index, mb}] =
                detail::backward_input(rec.output, g, rec.input, s.submod()->parameters(), !fsdp[a.stage_index], &gin);
            send_input_grad(s, a, gin, rec.input);
          } else if (!s.is_first()) {
            send_input_grad(s, a, {}, rec.input);
          }
          rec.input_grad_done = true;
          break;
        }
        case ComputationType::BACKWARD_WEIGHT: {
          auto& rec = mbs.at(mb);
          TORCH_CHECK(rec.input_grad_done, "the weight-gradient pass came before the input-gradient pass");
          auto g = StageAccess::received_grads(s).at(mb);
          StageAccess::received_grads(s).erase(mb);
          before_backward(s);
          // Only the weights: the input's gradient was sent by I.
          rec.input = torch::Tensor();
          std::shared_ptr<detail::WeightGradWork> work;
          if (auto it = weight_work.find({a.stage_index, mb}); it != weight_work.end()) {
            work = std::move(it->second);
            weight_work.erase(it);
          }
          detail::backward_weight(work, rec.output, g);
          mbs.erase(mb);
          break;
        }
      }
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      if (msg.rfind(where, 0) == 0) throw;  // already names the action
      TORCH_CHECK(false, describe_action(a), ": ", msg);
    } catch (const std::exception& e) {  // e.g. thrown by the user's loss_fn or module
      TORCH_CHECK(false, describe_action(a), ": ", e.what());
    }
  }

  // The sends: every one must have been received before the step ends (and their tensors can go).
  for (auto* s : stages_) {
    for (auto& w : StageAccess::sends(*s)) {
      const auto t0 = Clock::now();
      try {
        w.wait();
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, where, ", stage ", s->stage_index(), ": a message was not received at the end of the step: ",
                    e.what_without_backtrace());
      }
      wait_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
    }
    StageAccess::sends(*s).clear();
    TORCH_CHECK(StageAccess::microbatches(*s).empty(), where, ", stage ", s->stage_index(), ": ",
                StageAccess::microbatches(*s).size(), " microbatch(es) without a backward at the end of the step");
    if (fsdp[s->stage_index()]) {
      // Leave the stage as fully_shard's defaults for whatever runs next (an eval forward, a checkpoint).
      auto api = fsdp_api(*s->submod());
      api.set_requires_gradient_sync(true);
      api.set_reshard_after_backward(true);
    }
    if (scale_grads_) s->scale_grads(m);
  }

  torch::Tensor merged;
  if (losses) losses->clear();
  if (has_last) {
    auto& last = *mine.at(num_stages_ - 1);
    merged = torch::cat(StageAccess::outputs(last), 0);
    if (losses) *losses = StageAccess::losses(last);
    StageAccess::outputs(last).clear();
  }
  step_s_ = std::chrono::duration<double>(Clock::now() - t_step).count();
  return merged;
}

// ---------------------------------------------------------------------------------------------------------
// The schedules.

namespace {
std::function<int(int)> looped(int p) {
  return [p](int s) { return s % p; };
}
std::function<int(int)> v_shape(int p) {
  return [p](int s) { return s < p ? s : 2 * p - 1 - s; };
}
}  // namespace

ScheduleGPipe::ScheduleGPipe(PipelineStage& stage, int n_microbatches, LossFn loss_fn, bool scale_grads)
    : PipelineSchedule({&stage}, n_microbatches, std::move(loss_fn), scale_grads, "ScheduleGPipe") {
  stage_to_rank_ = looped(pp_size_);
  order_ = detail::gpipe_order(pp_size_, n_microbatches_);
  finish_init();
}

Schedule1F1B::Schedule1F1B(PipelineStage& stage, int n_microbatches, LossFn loss_fn, bool scale_grads)
    : PipelineSchedule({&stage}, n_microbatches, std::move(loss_fn), scale_grads, "Schedule1F1B") {
  TORCH_CHECK(n_microbatches >= num_stages_, "Schedule1F1B: the number of microbatches (", n_microbatches,
              ") must be >= the number of stages (", num_stages_, "), as in PyTorch");
  stage_to_rank_ = looped(pp_size_);
  order_ = detail::one_f_one_b_order(pp_size_, n_microbatches_);
  finish_init();
}

namespace {
void check_rounds(const char* who, int m, int p) {
  const int rounds = std::max(1, m / p);
  TORCH_CHECK(m % rounds == 0, who, ": the number of microbatches (", m, ") must be a multiple of the number of "
              "rounds max(1, n_microbatches / pipeline ranks) = ", rounds, ", as in PyTorch");
}
}  // namespace

ScheduleInterleaved1F1B::ScheduleInterleaved1F1B(std::vector<PipelineStage*> stages, int n_microbatches,
                                                 LossFn loss_fn, bool scale_grads)
    : PipelineSchedule(std::move(stages), n_microbatches, std::move(loss_fn), scale_grads, "ScheduleInterleaved1F1B") {
  check_rounds("ScheduleInterleaved1F1B", n_microbatches_, pp_size_);
  stage_to_rank_ = looped(pp_size_);
  order_ = detail::interleaved_order(pp_size_, static_cast<int>(stages_.size()), n_microbatches_, false);
  finish_init();
}

ScheduleInterleavedZeroBubble::ScheduleInterleavedZeroBubble(std::vector<PipelineStage*> stages, int n_microbatches,
                                                             LossFn loss_fn, bool scale_grads)
    : PipelineSchedule(std::move(stages), n_microbatches, std::move(loss_fn), scale_grads,
                       "ScheduleInterleavedZeroBubble") {
  check_rounds("ScheduleInterleavedZeroBubble", n_microbatches_, pp_size_);
  stage_to_rank_ = looped(pp_size_);
  order_ = detail::interleaved_order(pp_size_, static_cast<int>(stages_.size()), n_microbatches_, true);
  finish_init();
}

ScheduleZBVZeroBubble::ScheduleZBVZeroBubble(std::vector<PipelineStage*> stages, int n_microbatches, LossFn loss_fn,
                                             bool scale_grads)
    : PipelineSchedule(std::move(stages), n_microbatches, std::move(loss_fn), scale_grads, "ScheduleZBVZeroBubble") {
  TORCH_CHECK(stages_.size() == 2, "ScheduleZBVZeroBubble requires exactly 2 stages per rank, got ", stages_.size());
  stage_to_rank_ = v_shape(pp_size_);
  order_ = detail::zbv_order(pp_size_, n_microbatches_);
  finish_init();
}

namespace {
std::string canonical(const std::string& name) {
  std::string n;
  for (char c : name) n += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (n == "gpipe") return "gpipe";
  if (n == "1f1b") return "1f1b";
  if (n == "interleaved-1f1b" || n == "interleaved1f1b") return "interleaved-1f1b";
  if (n == "interleaved-zero-bubble" || n == "interleavedzerobubble" || n == "zero-bubble") return "interleaved-zero-bubble";
  if (n == "zbv-zero-bubble" || n == "zbvzerobubble" || n == "zbv") return "zbv-zero-bubble";
  TORCH_CHECK(false, "unknown pipeline schedule '", name,
              "'; known: gpipe, 1f1b, interleaved-1f1b, interleaved-zero-bubble (zero-bubble), zbv-zero-bubble "
              "(or PyTorch's GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble)");
}
}  // namespace

std::vector<int> stage_ids_this_rank(const std::string& schedule, int rank, int pp_size, int num_stages) {
  const std::string s = canonical(schedule);
  TORCH_CHECK(pp_size >= 1 && rank >= 0 && rank < pp_size, "stage_ids_this_rank: rank ", rank, " is out of range for ",
              pp_size, " pipeline ranks");
  TORCH_CHECK(num_stages % pp_size == 0 && num_stages >= pp_size, "schedule ", s, ": num_stages ", num_stages,
              " must be a positive multiple of the pipeline ranks ", pp_size);
  const int v = num_stages / pp_size;
  if (s == "gpipe" || s == "1f1b") {
    TORCH_CHECK(v == 1, "schedule ", s, " runs one stage per rank, got ", v, " (", num_stages, " stages on ", pp_size,
                " ranks); use interleaved-1f1b or a zero-bubble schedule for several");
    return {rank};
  }
  if (s == "zbv-zero-bubble") {
    TORCH_CHECK(v == 2, "schedule zbv-zero-bubble runs exactly 2 stages per rank, got ", v, " (", num_stages,
                " stages on ", pp_size, " ranks)");
    return {rank, 2 * pp_size - 1 - rank};
  }
  std::vector<int> ids;
  for (int i = 0; i < v; ++i) ids.push_back(rank + i * pp_size);
  return ids;
}

std::unique_ptr<PipelineSchedule> make_schedule(const std::string& schedule, std::vector<PipelineStage*> stages,
                                                int n_microbatches, LossFn loss_fn, bool scale_grads) {
  const std::string s = canonical(schedule);
  if (s == "gpipe" || s == "1f1b") {
    TORCH_CHECK(stages.size() == 1, "schedule ", s, " runs one stage per rank, got ", stages.size());
    if (s == "gpipe") return std::make_unique<ScheduleGPipe>(*stages[0], n_microbatches, std::move(loss_fn), scale_grads);
    return std::make_unique<Schedule1F1B>(*stages[0], n_microbatches, std::move(loss_fn), scale_grads);
  }
  if (s == "interleaved-1f1b")
    return std::make_unique<ScheduleInterleaved1F1B>(std::move(stages), n_microbatches, std::move(loss_fn), scale_grads);
  if (s == "interleaved-zero-bubble")
    return std::make_unique<ScheduleInterleavedZeroBubble>(std::move(stages), n_microbatches, std::move(loss_fn),
                                                           scale_grads);
  return std::make_unique<ScheduleZBVZeroBubble>(std::move(stages), n_microbatches, std::move(loss_fn), scale_grads);
}

}  // namespace fsdp::pipelining
