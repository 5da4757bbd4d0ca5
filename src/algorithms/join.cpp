#include "fsdp/algorithms/join.h"

#include <exception>

#include "fsdp/c10d/collectives.h"
#include "fsdp/fsdp/fully_shard.h"
#include "fsdp/fsdp_state.h"

namespace fsdp {
namespace {

// Header of every round: [ranks training, ranks in notify_join_context, ranks announcing a forward,
// ranks that joined in this round], then each joinable's values. All summed over the join group.
constexpr int64_t kHeader = 4;

// FSDPJoinable's values: [optimizer stepped, autograd on, then per state: requires_gradient_sync,
// reshard_after_backward, is_last_backward].
constexpr int64_t kFsdpFixed = 2;
constexpr int64_t kPerState = 3;

}  // namespace

class FSDPJoinHook : public JoinHook {
 public:
  explicit FSDPJoinHook(FSDPJoinable& j) : joinable_(j) {}

  void on_round(const JoinRound& round) override {
    const int64_t* v = round.values;
    auto& opt = joinable_.optimizer_;
    if (v[0] > 0) {
      // The training ranks stepped since the previous round (some rank saw its shards change). In the first round after joining this
      // rank trained through that interval itself (and stepped with them): only its stale gradients
      // must go, or the next reduce-scatter would add into them.
      if (!round.first) opt.step();
      opt.zero_grad();
    }
    if (round.active_ranks == 0 || !round.forward) {
      if (round.active_ranks > 0) joinable_.set_divide_factor(round.active_ranks);
      return;
    }
    joinable_.set_divide_factor(round.active_ranks);
    // Mirror this microbatch's settings, so that the shadow issues exactly the training ranks'
    // collectives (no reduce-scatter without sync, no all-gather for a group left unsharded).
    const int a = round.active_ranks;
    for (size_t i = 0; i < joinable_.states_.size(); ++i) {
      auto& s = *joinable_.states_[i];
      const int64_t* f = v + kFsdpFixed + kPerState * static_cast<int64_t>(i);
      s.requires_gradient_sync = f[0] == a;
      s.reshard_after_backward = f[1] == a;
      s.is_last_backward = f[2] == a;
    }
    if (v[1] == a) {
      auto loss = joinable_.forward_loss_();
      (loss * 0).backward();  // the same collectives, a zero contribution
    } else {
      torch::NoGradGuard no_grad;  // the training ranks ran a forward without autograd (evaluation)
      joinable_.forward_loss_();
    }
  }

 private:
  FSDPJoinable& joinable_;
};

FSDPJoinable::FSDPJoinable(std::shared_ptr<torch::nn::Module> root, torch::optim::Optimizer& optimizer,
                           std::function<torch::Tensor()> forward_loss, ProcessGroupPtr group)
    : root_(std::move(root)), optimizer_(optimizer), forward_loss_(std::move(forward_loss)), group_(std::move(group)) {
  TORCH_CHECK(root_, "FSDPJoinable: got a null module");
  auto state = detail::state_of(*root_);
  TORCH_CHECK(state, "FSDPJoinable: module ", root_->name(), " is not sharded: pass the module fully_shard was applied ",
              "to last (the root), after fully_shard");
  if (!group_) group_ = state->mesh ? state->mesh->world() : default_process_group();
  collect_states();
  last_checksum_ = param_checksum();
}

FSDPJoinable::~FSDPJoinable() {
  if (!states_.empty()) states_[0]->on_root_forward = nullptr;
}

void FSDPJoinable::collect_states() {
  states_.clear();
  for (const auto& m : root_->modules(/*include_self=*/true)) {
    auto s = detail::state_of(*m);
    if (!s) continue;
    bool seen = false;
    for (const auto& t : states_) seen = seen || t == s;
    if (!seen) states_.push_back(s);
  }
}

int64_t FSDPJoinable::param_checksum() const {
  // Whether the optimizer stepped is read from the data itself: LibTorch's SGD updates through
  // .data(), which bumps no version counter. The sum of the shards' bit patterns as integers changes
  // with any update (FSDP's own all-gathers and reshards never write the shards). A read of this
  // rank's shards per round: no communication.
  torch::NoGradGuard no_grad;
  int64_t sum = 0;
  for (const auto& s : states_) {
    if (!s->group) continue;
    for (const auto& p : s->group->params()) {
      const auto& t = p.padded_shard;
      if (t.numel() == 0) continue;
      auto bits = t.element_size() == 8   ? t.view(torch::kLong)
                  : t.element_size() == 4 ? t.view(torch::kInt)
                  : t.element_size() == 2 ? t.view(torch::kShort)
                                          : t.view(torch::kByte);
      sum += bits.sum(torch::kLong).item<int64_t>() * 1000003 + 1;
    }
  }
  return sum;
}

std::shared_ptr<JoinHook> FSDPJoinable::join_hook() { return std::make_shared<FSDPJoinHook>(*this); }

void FSDPJoinable::on_iteration(int active_ranks) { set_divide_factor(active_ranks); }

void FSDPJoinable::set_divide_factor(int active_ranks) {
  if (divide_by_initial_) return;  // FSDP's default: the initial number of data-parallel ranks
  for (const auto& m : root_->modules(/*include_self=*/true)) {
    if (auto s = detail::state_of(*m)) s->gradient_divide_factor = static_cast<double>(active_ranks);
  }
}

int64_t FSDPJoinable::message_size() { return kFsdpFixed + kPerState * static_cast<int64_t>(states_.size()); }

void FSDPJoinable::write_message(int64_t* v, bool training) {
  int64_t checksum = param_checksum();
  v[0] = checksum != last_checksum_ ? 1 : 0;
  last_checksum_ = checksum;
  if (!training) return;  // a rank that just joined reports only whether it stepped
  v[1] = torch::GradMode::is_enabled() ? 1 : 0;
  for (size_t i = 0; i < states_.size(); ++i) {
    int64_t* f = v + kFsdpFixed + kPerState * static_cast<int64_t>(i);
    f[0] = states_[i]->requires_gradient_sync;
    f[1] = states_[i]->reshard_after_backward;
    f[2] = states_[i]->is_last_backward;
  }
}

void FSDPJoinable::check_round(const JoinRound& round) {
  const int64_t* v = round.values;
  // v[0]: how many ranks saw their shards change since the previous round. Any is a step: a rank
  // whose shards are empty, or whose rows got no update, sees none.
  if (!round.forward || round.active_ranks == 0) return;
  const int64_t a = round.active_ranks;
  auto same = [&](int64_t sum) { return sum == 0 || sum == a; };
  TORCH_CHECK(same(v[1]), "Join: rank ", group_->rank(), ": the ranks still training disagree about autograd in this ",
              "forward (", v[1], " of ", a, " have it enabled)");
  for (size_t i = 0; i < states_.size(); ++i) {
    const int64_t* f = v + kFsdpFixed + kPerState * static_cast<int64_t>(i);
    static const char* names[] = {"requires_gradient_sync", "reshard_after_backward", "is_last_backward"};
    for (int k = 0; k < kPerState; ++k) {
      TORCH_CHECK(same(f[k]), "Join: rank ", group_->rank(), ": the ranks still training disagree about ", names[k],
                  " of ", states_[i]->name(), " in this forward (", f[k], " of ", a,
                  " have it true). Set the FSDP settings of a microbatch identically on every rank, before its forward");
    }
  }
}

void FSDPJoinable::attach(Join* join) {
  join_ = join;
  if (states_.empty()) return;
  auto& root_state = *states_[0];
  if (join) {
    collect_states();
    last_checksum_ = param_checksum();
    root_state.on_root_forward = [join] { join->announce_forward(); };
  } else {
    root_state.on_root_forward = nullptr;
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
  for (auto* j : joinables_) j->attach(this);
}

Join::~Join() noexcept(false) {
  if (!options_.enable()) return;
  // Detach first: the joinables may outlive this context.
  struct Detach {
    std::vector<Joinable*>& js;
    ~Detach() {
      for (auto* j : js) j->attach(nullptr);
    }
  } detach{joinables_};
  if (std::uncaught_exceptions() == 0) finish();
}

std::vector<int64_t> Join::exchange(bool training, bool forward, bool newly_joined) {
  int64_t n = kHeader;
  for (auto* j : joinables_) n += j->message_size();
  std::vector<int64_t> mine(n, 0);
  mine[0] = training;
  mine[1] = training && !forward;
  mine[2] = training && forward;
  mine[3] = newly_joined;
  int64_t off = kHeader;
  for (auto* j : joinables_) {
    if (training || newly_joined) j->write_message(mine.data() + off, training);
    off += j->message_size();
  }
  auto t = torch::tensor(mine, torch::kInt64).to(group_->device());
  all_reduce(t, *group_, ReduceOp::SUM);
  t = t.to(torch::kCPU);
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
}

void Join::check_header(const std::vector<int64_t>& sums, bool training, JoinRound& round) {
  const int64_t active = sums[0], notify = sums[1], fwd = sums[2];
  TORCH_CHECK(active == 0 || (notify == active && fwd == 0) || (fwd == active && notify == 0), "Join: rank ",
              group_->rank(), ": the ranks still training are at different points: ", notify,
              " in notify_join_context and ", fwd, " in a forward of the FSDP root. Every rank must run the same "
              "loop: notify_join_context at the same places (once per microbatch, or once per optimizer step "
              "before its first forward), and a rank that runs out of data must leave its loop where the others "
              "call notify_join_context or start a forward");
  round.active_ranks = static_cast<int>(active);
  round.new_joiners = static_cast<int>(sums[3]);
  round.forward = fwd > 0;
  int64_t off = kHeader;
  for (auto* j : joinables_) {
    round.values = sums.data() + off;
    j->check_round(round);
    off += j->message_size();
  }
  if (training) others_joined_ = active < group_->size();
}

void Join::notify_join_context(Joinable& joinable) {
  if (!options_.enable()) return;
  TORCH_CHECK(!finished_, "Join: notify_join_context after finish() on rank ", group_->rank());
  auto sums = exchange(/*training=*/true, /*forward=*/false, /*newly_joined=*/false);
  JoinRound round;
  check_header(sums, true, round);
  int active = round.active_ranks;
  forwards_since_notify_ = 0;
  TORCH_CHECK(!options_.throw_on_early_termination() || active == group_->size(), "Join: rank ", group_->rank(),
              " detected that ", group_->size() - active, " of ", group_->size(),
              " ranks ran out of inputs (throw_on_early_termination=true). Fix: give every rank the same number of "
              "batches, or set throw_on_early_termination=false to shadow the missing iterations");
  for (auto* j : joinables_) j->on_iteration(active);
}

void Join::announce_forward() {
  if (!options_.enable() || finished_) return;  // a joined rank's own shadow forward
  const bool announce = others_joined_ || forwards_since_notify_ > 0;
  ++forwards_since_notify_;
  if (!announce) return;
  auto sums = exchange(/*training=*/true, /*forward=*/true, /*newly_joined=*/false);
  JoinRound round;
  check_header(sums, true, round);
  TORCH_CHECK(!options_.throw_on_early_termination() || round.active_ranks == group_->size(), "Join: rank ",
              group_->rank(), " detected that ", group_->size() - round.active_ranks, " of ", group_->size(),
              " ranks ran out of inputs (throw_on_early_termination=true)");
  for (auto* j : joinables_) j->on_iteration(round.active_ranks);
}

void Join::finish() {
  if (finished_ || !options_.enable()) return;
  finished_ = true;
  if (options_.throw_on_early_termination()) {
    // Match the training ranks' per-iteration count, then raise everywhere.
    auto sums = exchange(/*training=*/false, false, /*newly_joined=*/true);
    int64_t active = sums[0];
    TORCH_CHECK(active == 0, "Join: rank ", group_->rank(), " ran out of inputs while ", active,
                " rank(s) still had some (throw_on_early_termination=true)");
    return;
  }
  std::vector<std::shared_ptr<JoinHook>> hooks;
  for (auto* j : joinables_) hooks.push_back(j->join_hook());
  bool last = true;
  bool first = true;
  while (true) {
    auto sums = exchange(/*training=*/false, false, /*newly_joined=*/first);
    JoinRound round;
    check_header(sums, false, round);
    round.first = first;
    first = false;
    int64_t off = kHeader;
    for (size_t i = 0; i < hooks.size(); ++i) {
      round.values = sums.data() + off;
      hooks[i]->on_round(round);
      off += joinables_[i]->message_size();
    }
    if (round.active_ranks == 0) break;
    last = false;
  }
  for (auto& h : hooks) h->post_hook(last);
}

}  // namespace fsdp
