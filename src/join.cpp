#include "fsdp/join.h"

#include <exception>

#include "fsdp/collectives.h"
#include "fsdp/fully_shard.h"
#include "fsdp_state.h"

namespace fsdp {
namespace {

// Counts the ranks still training: each rank contributes 1 (training) or 0 (joined).
int count_active(ProcessGroup& group, bool training) {
  auto t = torch::full({1}, training ? 1.0f : 0.0f, torch::TensorOptions().device(group.device()));  // NCCL: CUDA
  all_reduce(t, group, ReduceOp::SUM);
  return static_cast<int>(t.item<float>());
}

class FSDPJoinHook : public JoinHook {
 public:
  explicit FSDPJoinHook(FSDPJoinable& j, torch::optim::Optimizer& opt, std::function<torch::Tensor()> fwd)
      : joinable_(j), opt_(opt), forward_loss_(std::move(fwd)) {}
  void main_hook(int active_ranks) override {
    joinable_.set_divide_factor(active_ranks);
    // The same forward/backward collectives as a training iteration, contributing zero gradients;
    // then the optimizer step with what the training ranks reduced.
    opt_.zero_grad();
    auto loss = forward_loss_();
    (loss * 0).backward();
    opt_.step();
    opt_.zero_grad();
  }

 private:
  FSDPJoinable& joinable_;
  torch::optim::Optimizer& opt_;
  std::function<torch::Tensor()> forward_loss_;
};

}  // namespace

FSDPJoinable::FSDPJoinable(std::shared_ptr<torch::nn::Module> root, torch::optim::Optimizer& optimizer,
                           std::function<torch::Tensor()> forward_loss, ProcessGroupPtr group)
    : root_(std::move(root)), optimizer_(optimizer), forward_loss_(std::move(forward_loss)), group_(std::move(group)) {
  TORCH_CHECK(root_, "FSDPJoinable: got a null module");
  if (!group_) {
    auto state = detail::state_of(*root_);
    group_ = state ? state->mesh->world() : default_process_group();
  }
}

std::shared_ptr<JoinHook> FSDPJoinable::join_hook() {
  return std::make_shared<FSDPJoinHook>(*this, optimizer_, forward_loss_);
}

void FSDPJoinable::on_iteration(int active_ranks) { set_divide_factor(active_ranks); }

void FSDPJoinable::set_divide_factor(int active_ranks) {
  if (divide_by_initial_) return;  // FSDP's default: the initial number of data-parallel ranks
  for (const auto& m : root_->modules(/*include_self=*/true)) {
    if (auto s = detail::state_of(*m)) s->gradient_divide_factor = static_cast<double>(active_ranks);
  }
}

Join::Join(std::vector<Joinable*> joinables, JoinOptions options)
    : joinables_(std::move(joinables)), options_(options) {
  TORCH_CHECK(!joinables_.empty() || !options_.enable(), "Join: expected at least one Joinable");
  if (!options_.enable()) return;
  group_ = joinables_[0]->join_process_group();
  for (auto* j : joinables_) {
    TORCH_CHECK(j->join_process_group().get() == group_.get(),
                "Join: every Joinable must use the same process group");
    if (auto* f = dynamic_cast<FSDPJoinable*>(j)) f->set_divide_by_initial_world_size(options_.divide_by_initial_world_size());
  }
}

Join::~Join() noexcept(false) {
  if (std::uncaught_exceptions() == 0) finish();
}

void Join::notify_join_context(Joinable& joinable) {
  if (!options_.enable()) return;
  int active = count_active(*group_, /*training=*/true);
  TORCH_CHECK(!options_.throw_on_early_termination() || active == group_->size(), "Join: rank ", group_->rank(),
              " detected that ", group_->size() - active, " of ", group_->size(),
              " ranks ran out of inputs (throw_on_early_termination=true). Fix: give every rank the same number of "
              "batches, or set throw_on_early_termination=false to shadow the missing iterations");
  for (auto* j : joinables_) j->on_iteration(active);
}

void Join::finish() {
  if (finished_ || !options_.enable()) return;
  finished_ = true;
  if (options_.throw_on_early_termination()) {
    // Match the training ranks' per-iteration count, then raise everywhere.
    int active = count_active(*group_, /*training=*/false);
    TORCH_CHECK(active == 0, "Join: rank ", group_->rank(), " ran out of inputs while ", active,
                " rank(s) still had some (throw_on_early_termination=true)");
    return;
  }
  std::vector<std::shared_ptr<JoinHook>> hooks;
  for (auto* j : joinables_) hooks.push_back(j->join_hook());
  bool last = true;
  while (true) {
    int active = count_active(*group_, /*training=*/false);
    if (active == 0) break;
    last = false;
    for (auto& h : hooks) h->main_hook(active);
  }
  for (auto& h : hooks) h->post_hook(last);
}

}  // namespace fsdp
