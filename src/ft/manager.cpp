// fsdp::ft::Manager (include/fsdp/ft/manager.h): the replica quorum, the replicate group it forms, the
// heal that copies the state from a live replica group to a joining one, and the commit vote.
#include "fsdp/ft/manager.h"

#include <signal.h>
#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "c10d/gloo_group.h"
#include "ft/decision.h"
#include "ft/heal_state.h"
#include "fsdp/c10d/collectives.h"
#include "util.h"

namespace fsdp::ft {

// [Note: replica quorum]
// Every store key below is under "ft/" in ManagerOptions::store. R replica groups (ids 0..R-1) of S ranks
// each; rank s of every replica group talks to rank s of the others (the replicate group of rank s).
//
// Rounds. Every step attempt is one round n (0, 1, 2, ...: the same numbers on every rank). The ranks of
// round n's participants (members and joiners) arrive at round n + 1 by add("r<n+1>/arr/<r>/<reg>", 1), under
// the registration round n admitted (below), so that a process of an older incarnation with the same id never
// counts; a replica group has arrived when all S of its ranks have. Every replica group has the same S
// ("group_size", checked when a Manager is made).
// Joining. A replica group that starts (or was left out of a round) registers "<inc>.<since>": its
// incarnation id (drawn by its rank 0, so a restarted group is never mistaken for its dead predecessor)
// and the round it was left out of (-1 for a fresh start). Each rank adds to "join/<r>/<reg>/n" and sets
// "joining/<r>" = reg, and "start/<r>/<reg>" = its initial step; the registration is ready when n == S.
// Joiners never decide a round (except round 0): they scan the decisions, from the one decided before they
// registered, until one admits their registration (a decision admits a replica group's registration, not
// its id: the restarted process is never taken for the one that died).
// Deciding round n. Any arrived rank of round n - 1's participants may decide: it waits until every
// participant of round n - 1 arrived, or `join_timeout` passed since it began waiting (the missing ones are
// left out: dead, or too slow, they rejoin and are healed), with at least min_replica_size replica groups
// (arrived, or ready joiners; else it waits up to `timeout` and throws). It writes the decision with
// compareSet("r<n>/decision"): one decision wins, every rank reads that one.
// Which step is the truth. The holders of round n - 1's state are its members, plus its joiners if round
// n - 1 committed (a joiner whose heal or step failed holds nothing). Round n's members are the holders
// that arrived; its joiners are the other arrived participants and the ready registrations. All members
// hold the same state and step (they committed the same steps together); the donor is the lowest member.
// If no holder arrived within `quorum_timeout` (a slow holder must not be taken for a dead one: that would
// end the job), the state is lost: the decision says so and every rank throws the same error (resume from
// a checkpoint). Round 0 is decided by joiners: the lowest ready replica group is its donor, and its initial
// step the step (a resumed checkpoint's), so that replica groups that initialised differently start from
// one state.
// Group. A decision forms a new replicate group (Gloo over sockets: a peer that dies fails it at once,
// src/c10d/gloo_group.h) when the participants changed, when it has joiners (a restarted replica group keeps
// the id of the one that died: the same ids are not the same processes), or when round n - 1 did not commit
// (its group may be broken); rank s's group is prefixed "pg/<n>/<s>/", ranks in replica id order.
// Heal. With joiners, the donor broadcasts its state over the replicate group: a JSON description first
// (step, keys, kinds, dtypes, shapes, non-tensor values), then the local pieces: one flat buffer per dtype,
// sent in 8 MiB chunks. Everyone receives into fresh buffers; a joiner checks the description against its own state dict (a mismatch
// names the key) and calls load_state_dict only once every byte arrived, so a donor that dies mid-copy
// leaves the joiner's state as it was (the step fails; the next round heals again from another holder,
// or, with none left, reports the state lost).
// Commit. should_commit: every rank of every participant adds to "r<n>/ok" or "r<n>/bad"; the decision
// (compareSet "r<n>/commit") is 1 when all R * S voted ok, 0 as soon as one voted bad or when `timeout`
// passed. A step that did not commit changes no state: the caller retries the same batch. A rank that
// records an error closes its replicate group at once, so that the others' collectives fail now, not after
// `timeout`. Keys are never deleted: the store grows by a few hundred bytes per round (one lighthouse per job).

namespace {

using json = nlohmann::json;
using internal::contains;
using internal::Decision;
using internal::list_of;
using internal::describe_state;
using internal::dtype_named;
using internal::received_state;
using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(2);
constexpr int64_t kHealChunkBytes = 8 << 20;  // one broadcast of a heal (bounds the donor's send buffer too)

std::string str_of(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }



}  // namespace

struct Manager::Impl {
  ManagerOptions o;
  int S = 0, s = 0;
  std::string reg;            // this replica group's current registration
  bool joining = true;        // waiting to be admitted (no state held yet)
  std::optional<Decision> d;  // the round this rank last took part in
  bool committed = false;     // whether that round committed
  int64_t scan_from = 0;      // a joiner: the round decided before it registered
  int64_t initial_step = 0;   // ManagerOptions::initial_step
  ProcessGroupPtr group;      // the replicate group (null: none, or broken)
  std::chrono::milliseconds ms(Clock::duration d) const {
    return std::chrono::duration_cast<std::chrono::milliseconds>(d);
  }

  // Whether the replica groups all run on this host: the replicate group spans jobs, so MASTER_ADDR (this
  // replica group's own, often 127.0.0.1 under --standalone) cannot say; the lighthouse's address can. A
  // HashStore is shared by threads of this process; another kind of store says nothing: every interface.
  bool loopback() const {
    c10d::Store* st = o.store.get();
    while (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(st)) st = prefixed->getUnderlyingStore().get();
    if (dynamic_cast<c10d::HashStore*>(st)) return true;
    const auto* tcp = dynamic_cast<const c10d::TCPStore*>(st);
    if (!tcp) return false;
    const auto& h = tcp->getHost();
    return h == "127.0.0.1" || h == "localhost" || h == "::1";
  }

  std::string key(const std::string& k) const { return "ft/" + k; }
  int64_t counter(const std::string& k) { return o.store->add(key(k), 0); }
  bool has(const std::string& k) { return o.store->check({key(k)}); }
  std::string get(const std::string& k) { return str_of(o.store->get(key(k))); }
  std::string decide(const std::string& k, const std::string& v) {
    return str_of(o.store->compareSet(key(k), {}, bytes_of(v)));
  }
  std::string where() const {
    return "replica group " + std::to_string(o.replica_id) + ", rank " + std::to_string(s);
  }

  void register_join(int64_t since) {
    // Rank 0 draws the incarnation once per registration; the replica group agrees on it.
    auto t = torch::zeros({1}, torch::kLong);
    if (s == 0) {
      std::random_device rd;
      t.fill_((static_cast<int64_t>(rd() >> 1) << 20) ^ static_cast<int64_t>(rd()));
    }
    t = t.to(o.replica_group->device());  // (NCCL takes device tensors only)
    broadcast(t, 0, *o.replica_group);
    reg = std::to_string(t.item<int64_t>()) + "." + std::to_string(since);
    // Decisions from here on may admit it: a joiner scans from the round decided before it registered.
    scan_from = has("latest") ? std::stoll(get("latest")) : 0;
    o.store->set(key("start/" + std::to_string(o.replica_id) + "/" + reg), bytes_of(std::to_string(initial_step)));
    o.store->add(key("join/" + std::to_string(o.replica_id) + "/" + reg + "/n"), 1);
    o.store->set(key("joining/" + std::to_string(o.replica_id)), bytes_of(reg));
    joining = true;
  }

  // Whether decision `nd` admits this replica group's current registration (a process of an older
  // incarnation with the same id is not admitted by it).
  bool admits(const Decision& nd) const {
    auto it = nd.reg.find(o.replica_id);
    return contains(nd.participants(), o.replica_id) && it != nd.reg.end() && it->second == reg;
  }

  // The ready registration of replica group r that round `prev` has not admitted, if any.
  std::optional<std::string> ready_registration(int r, const std::map<int, std::string>& admitted) {
    const std::string jk = "joining/" + std::to_string(r);
    if (!has(jk)) return std::nullopt;
    std::string rg = get(jk);
    auto it = admitted.find(r);
    if (it != admitted.end() && it->second == rg) return std::nullopt;
    if (counter("join/" + std::to_string(r) + "/" + rg + "/n") < S) return std::nullopt;
    return rg;
  }

  // Round 0, decided by joiners (see the note).
  Decision decide_first() {
    const auto t0 = Clock::now();
    for (;;) {
      if (has("r0/decision")) return Decision::parse(get("r0/decision"));
      std::vector<int> ready;
      std::map<int, std::string> regs;
      for (int r = 0; r < o.num_replica_groups; ++r) {
        if (auto rg = ready_registration(r, {})) {
          ready.push_back(r);
          regs[r] = *rg;
        }
      }
      const auto waited = Clock::now() - t0;
      if (static_cast<int>(ready.size()) >= o.min_replica_size &&
          (static_cast<int>(ready.size()) == o.num_replica_groups || waited >= o.join_timeout)) {
        Decision nd;
        nd.round = 0;
        // The donor's state is the truth, and its step with it (a replica group resumed from a checkpoint).
        nd.step = std::stoll(get("start/" + std::to_string(ready.front()) + "/" + regs.at(ready.front())));
        nd.members = {ready.front()};
        nd.joiners.assign(ready.begin() + 1, ready.end());
        nd.donor = ready.front();
        nd.new_group = true;
        nd.reg = regs;
        return Decision::parse(decide("r0/decision", nd.dump()));
      }
      TORCH_CHECK(waited < o.quorum_timeout, "fsdp::ft::Manager (", where(), "): the first quorum found ", ready.size(),
                  " ready replica group(s) ", list_of(ready), " within ", o.quorum_timeout.count(),
                  " ms; min_replica_size is ", o.min_replica_size, ". Start every replica group, or lower min_replica_size");
      std::this_thread::sleep_for(kPoll);
    }
  }

  // Round n, decided by an arrived participant of round n - 1 (`prev`).
  Decision decide_next(const Decision& prev, bool prev_committed) {
    const int64_t n = prev.round + 1;
    const int64_t step = prev.step + (prev_committed ? 1 : 0);
    const std::string dk = "r" + std::to_string(n) + "/decision";
    const auto t0 = Clock::now();
    const std::vector<int> expected = prev.participants();
    std::vector<int> holders = prev.members;
    if (prev_committed) holders.insert(holders.end(), prev.joiners.begin(), prev.joiners.end());
    for (;;) {
      if (has(dk)) return Decision::parse(get(dk));
      std::vector<int> arrived, missing, ready;
      std::map<int, std::string> regs = prev.reg;
      for (int r : expected) {
        const std::string ak = "r" + std::to_string(n) + "/arr/" + std::to_string(r) + "/" + prev.reg.at(r);
        (counter(ak) == S ? arrived : missing).push_back(r);
      }
      for (int r = 0; r < o.num_replica_groups; ++r) {
        if (contains(arrived, r)) continue;
        if (auto rg = ready_registration(r, prev.reg)) {
          ready.push_back(r);
          regs[r] = *rg;
        }
      }
      const auto waited = Clock::now() - t0;
      const int count = static_cast<int>(arrived.size() + ready.size());
      bool holder_arrived = false;
      for (int r : arrived) holder_arrived = holder_arrived || contains(holders, r);
      // Without a holder of the state the round would have to say it is lost, which ends the job: a holder
      // that is only slow (a long checkpoint save, a peer's timeout) gets up to quorum_timeout to arrive.
      const bool may_decide = holder_arrived || waited >= o.quorum_timeout;
      if (count >= o.min_replica_size && (missing.empty() || waited >= o.join_timeout) && may_decide) {
        Decision nd;
        nd.round = n;
        nd.step = step;
        nd.reg = regs;
        for (int r : arrived) (contains(holders, r) ? nd.members : nd.joiners).push_back(r);
        nd.joiners.insert(nd.joiners.end(), ready.begin(), ready.end());
        std::sort(nd.joiners.begin(), nd.joiners.end());
        if (nd.members.empty()) {
          nd.lost = "no replica group that holds the state of step " + std::to_string(step) +
                    " reached round " + std::to_string(n) + " (holders " + list_of(holders) + ", missing " +
                    list_of(missing) + " after " + std::to_string(o.quorum_timeout.count()) + " ms)";
        } else if (!nd.joiners.empty()) {
          nd.donor = nd.members.front();
        }
        // A joiner is a process new to the group (or one left out): even when the ids are the previous
        // round's, the group must be new (a restarted replica group has the id of the one that died).
        nd.new_group = !prev_committed || nd.participants() != expected || !nd.joiners.empty();
        return Decision::parse(decide(dk, nd.dump()));
      }
      TORCH_CHECK(waited < o.quorum_timeout, "fsdp::ft::Manager (", where(), "): round ", n, " (step ", step, ") has ",
                  count, " replica group(s) after ", o.quorum_timeout.count(), " ms (arrived ", list_of(arrived),
                  ", joining ", list_of(ready), ", missing ", list_of(missing), "); min_replica_size is ",
                  o.min_replica_size, ". Restart the missing replica groups, or lower min_replica_size");
      std::this_thread::sleep_for(kPoll);
    }
  }

  // A joiner: the first decision from "latest" on that admits this registration.
  Decision await_admission() {
    const auto t0 = Clock::now();
    int64_t n = scan_from;
    std::optional<Decision> last;
    for (;;) {
      const std::string dk = "r" + std::to_string(n) + "/decision";
      if (has(dk)) {
        Decision nd = Decision::parse(get(dk));
        if (admits(nd)) return nd;
        last = nd;
        ++n;
        continue;
      }
      if (has("done")) {
        throw JobFinished("fsdp::ft::Manager (" + where() + "): the job finished at step " + get("done") +
                          " before this replica group was admitted: nothing is left to train");
      }
      if (n == 0) {  // the first round, decided by joiners: it may have left this one out (too late)
        Decision nd = decide_first();
        if (admits(nd)) return nd;
        last = nd;
        n = 1;
        continue;
      }
      TORCH_CHECK(Clock::now() - t0 < o.quorum_timeout, "fsdp::ft::Manager (", where(), "): not admitted to a quorum within ",
                  o.quorum_timeout.count(), " ms; the last round decided was ", n - 1,
                  last ? " (members " + list_of(last->members) + ", joiners " + list_of(last->joiners) + ")" : "",
                  ". If every replica group that held the state died, it is lost: resume from a checkpoint");
      std::this_thread::sleep_for(kPoll);
    }
  }
};

Manager::Manager(ManagerOptions options) : impl_(std::make_unique<Impl>()) {
  auto& o = impl_->o;
  o = std::move(options);
  TORCH_CHECK(o.store, "fsdp::ft::Manager: ManagerOptions::store is required (the store every replica group shares)");
  TORCH_CHECK(o.replica_group, "fsdp::ft::Manager: ManagerOptions::replica_group is required (this replica group's own group)");
  TORCH_CHECK(o.num_replica_groups > 0, "fsdp::ft::Manager: num_replica_groups must be positive, got ",
              o.num_replica_groups);
  TORCH_CHECK(o.replica_id >= 0 && o.replica_id < o.num_replica_groups, "fsdp::ft::Manager: replica_id ",
              o.replica_id, " is outside [0, ", o.num_replica_groups, ")");
  TORCH_CHECK(o.min_replica_size >= 1 && o.min_replica_size <= o.num_replica_groups,
              "fsdp::ft::Manager: min_replica_size ", o.min_replica_size, " is outside [1, num_replica_groups = ",
              o.num_replica_groups, "]");
  TORCH_CHECK(o.max_retries >= 1, "fsdp::ft::Manager: max_retries must be positive, got ", o.max_retries);
  TORCH_CHECK(o.state_dict && o.load_state_dict,
              "fsdp::ft::Manager: ManagerOptions::state_dict and load_state_dict are required (the state a joiner receives)");
  TORCH_CHECK(o.initial_step >= 0, "fsdp::ft::Manager: initial_step must be >= 0, got ", o.initial_step);
  // Gloo's write to a dead peer's socket raises SIGPIPE, whose default action kills the survivor (status 141,
  // found under load); Python ignores SIGPIPE from the start. Ignored here unless the program handles it.
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
  impl_->S = o.replica_group->size();
  impl_->s = o.replica_group->rank();
  impl_->initial_step = o.initial_step;
  step_ = o.initial_step;
  // Every replica group must have as many ranks (rank s talks to rank s; the votes count R x S).
  const std::string size = str_of(o.store->compareSet("ft/group_size", {}, bytes_of(std::to_string(impl_->S))));
  TORCH_CHECK(size == std::to_string(impl_->S), "fsdp::ft::Manager (replica group ", o.replica_id, "): its group has ",
              impl_->S, " ranks, the job's replica groups have ", size, ". Fix: the same number of ranks in every "
              "replica group");
  impl_->register_join(-1);
}

Manager::~Manager() = default;

int64_t Manager::num_participants() const {
  return quorum_.round < 0 ? 0 : static_cast<int64_t>(quorum_.members.size() + quorum_.joiners.size());
}

int64_t Manager::participant_index() const {
  std::vector<int> p = quorum_.members;
  p.insert(p.end(), quorum_.joiners.begin(), quorum_.joiners.end());
  std::sort(p.begin(), p.end());
  auto it = std::find(p.begin(), p.end(), impl_->o.replica_id);
  return it == p.end() ? -1 : it - p.begin();
}

void Manager::shutdown() {
  auto& m = *impl_;
  m.o.store->compareSet(m.key("done"), {}, bytes_of(std::to_string(step_)));
  m.group.reset();
}

void Manager::report_error(const std::string& what) {
  if (!error_) error_ = what;
  // The step fails: the replicate group is closed at once, so that the peers' pending collectives fail now
  // instead of after `timeout` (the next round forms a new group).
  impl_->group.reset();
}

void Manager::start_quorum() {
  auto& m = *impl_;
  TORCH_CHECK(!participating_, "fsdp::ft::Manager (", m.where(), "): start_quorum called twice without should_commit");
  TORCH_CHECK(failed_in_a_row_ < m.o.max_retries, "fsdp::ft::Manager (", m.where(), "): ", failed_in_a_row_,
              " steps in a row did not commit (max_retries); the last failure: ", quorum_.failure);
  error_.reset();
  Decision d;
  if (!m.joining) {
    const int64_t n = m.d->round + 1;
    m.o.store->add(m.key("r" + std::to_string(n) + "/arr/" + std::to_string(m.o.replica_id) + "/" + m.reg), 1);
    d = m.decide_next(*m.d, m.committed);
    if (!m.admits(d)) {
      // Left out (arrived too late): this replica group's state is no longer trusted; it joins again.
      m.group.reset();
      m.register_join(n);
      d = m.await_admission();
    }
  } else {
    d = m.await_admission();
  }
  m.joining = false;  // a participant of this round: it arrives at the next one
  m.o.store->set(m.key("latest"), bytes_of(std::to_string(d.round)));
  TORCH_CHECK(d.lost.empty(), "fsdp::ft::Manager (", m.where(), "): the state is lost: ", d.lost,
              ". Resume every replica group from a checkpoint");
  const bool joiner = contains(d.joiners, m.o.replica_id);
  quorum_ = QuorumInfo();
  quorum_.round = d.round;
  quorum_.step = d.step;
  quorum_.members = d.members;
  quorum_.joiners = d.joiners;
  quorum_.donor = d.donor;
  quorum_.new_group = d.new_group;
  m.d = d;
  m.committed = false;
  participating_ = true;
  const auto parts = d.participants();
  const int index = static_cast<int>(std::find(parts.begin(), parts.end(), m.o.replica_id) - parts.begin());
  if (d.new_group || !m.group) {
    m.group.reset();
    try {
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
          "ft/pg/" + std::to_string(d.round) + "/" + std::to_string(m.s), m.o.store);
      m.group = detail::make_gloo_group_on_sockets(prefixed, index, static_cast<int>(parts.size()), m.o.timeout, {},
                                                  "ft/replicate/" + std::to_string(m.s), 1, m.loopback());
    } catch (const std::exception& e) {
      report_error("forming the replicate group of round " + std::to_string(d.round) + ": " + detail::message_of(e));
    }
  }
  if (d.joiners.empty()) {
    step_ = d.step;
    return;
  }
  // The heal (see the note): every participant takes part in the broadcasts.
  const auto t0 = Clock::now();
  const int src = static_cast<int>(std::find(parts.begin(), parts.end(), d.donor) - parts.begin());
  const bool donor = m.o.replica_id == d.donor;
  std::string why;  // this rank's failure of the heal, if any
  json meta;
  std::vector<torch::Tensor> received;
  if (!m.group) why = *error_;
  if (why.empty()) {
    bool died = false;  // the injected death of a donor (ManagerOptions::after_heal_send)
    try {
      std::vector<torch::Tensor> locals;
      if (donor) meta = describe_state(m.o.state_dict(), d.step, locals);
      // The description: its length, then its bytes.
      std::string text = donor ? meta.dump() : std::string();
      auto len = torch::tensor({static_cast<int64_t>(text.size())}, torch::kLong);
      broadcast(len, src, *m.group);
      auto buf = torch::empty({len.item<int64_t>()}, torch::kUInt8);
      if (donor) std::memcpy(buf.data_ptr(), text.data(), text.size());
      broadcast(buf, src, *m.group);
      if (!donor) meta = json::parse(std::string(static_cast<const char*>(buf.data_ptr()), static_cast<size_t>(buf.numel())));
      // The tensors: per dtype (in the order of first appearance), one flat buffer of the entries in the
      // description's order, sent in chunks of kHealChunkBytes (one broadcast each instead of one per tensor:
      // 157 tensors of the small preset took 0.06-0.36 s one by one on loopback, per-call latency).
      std::vector<std::string> dtypes;
      std::map<std::string, int64_t> numel;
      for (const auto& e : meta.at("entries")) {
        if (e.at("kind") == "Value") continue;
        const std::string dt = e.at("dtype");
        if (!numel.count(dt)) dtypes.push_back(dt);
        int64_t n = 1;
        for (int64_t x : e.at("shape").get<std::vector<int64_t>>()) n *= x;
        numel[dt] += n;
      }
      int64_t chunk = 0;
      std::map<std::string, torch::Tensor> flats;
      for (const auto& dt : dtypes) {
        torch::Tensor flat;
        if (donor) {
          std::vector<torch::Tensor> parts;
          for (const auto& t : locals)
            if (dt == c10::toString(t.scalar_type())) parts.push_back(t.reshape({-1}));
          flat = torch::cat(parts);
        } else {
          flat = torch::empty({numel[dt]}, torch::TensorOptions().dtype(dtype_named(dt, "a heal buffer")));
        }
        const int64_t per = std::max<int64_t>(1, kHealChunkBytes / static_cast<int64_t>(flat.element_size()));
        for (int64_t off = 0; off < flat.numel(); off += per) {
          broadcast(flat.narrow(0, off, std::min(per, flat.numel() - off)), src, *m.group);
          if (donor && m.o.after_heal_send) {
            try {
              m.o.after_heal_send(chunk);
            } catch (...) {
              died = true;
              m.group.reset();  // a donor that dies: its sockets close under the receivers
              throw;
            }
          }
          ++chunk;
        }
        quorum_.heal_bytes += flat.numel() * static_cast<int64_t>(flat.element_size());
        flats[dt] = flat;
      }
      if (!donor) {  // each entry a view of its dtype's buffer
        std::map<std::string, int64_t> off;
        for (const auto& e : meta.at("entries")) {
          if (e.at("kind") == "Value") continue;
          const std::string dt = e.at("dtype");
          const auto shape = e.at("shape").get<std::vector<int64_t>>();
          int64_t n = 1;
          for (int64_t x : shape) n *= x;
          received.push_back(flats[dt].narrow(0, off[dt], n).view(shape));
          off[dt] += n;
        }
      }
    } catch (const std::exception& e) {
      if (died) throw;
      m.group.reset();
      why = detail::message_of(e);
    }
  }
  if (joiner) {
    // Checked against this rank's own state dict; loaded only when every rank of this replica group has
    // all of it (load_state_dict may run collectives over the replica group: all its ranks call it or none).
    StateDict in;
    if (why.empty()) {
      try {
        in = received_state(m.o.state_dict(), meta, received, d.donor);
      } catch (const std::exception& e) {
        why = detail::message_of(e);
      }
    }
    auto ok = torch::tensor({why.empty() ? 1 : 0}, torch::kInt).to(m.o.replica_group->device());
    all_reduce(ok, *m.o.replica_group, ReduceOp::MIN);
    if (ok.item<int>() == 1) {
      try {
        m.o.load_state_dict(in);
      } catch (const std::exception& e) {
        why = "load_state_dict: " + detail::message_of(e);
      }
    } else if (why.empty()) {
      why = "another rank of this replica group could not receive the state";
    }
  }
  if (!why.empty()) {
    report_error("healing in round " + std::to_string(d.round) + " (donor replica group " + std::to_string(d.donor) +
                 "): " + why);
  }
  quorum_.heal_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  step_ = d.step;
}

void Manager::allreduce(const std::vector<torch::Tensor>& tensors) {
  auto& m = *impl_;
  TORCH_CHECK(participating_, "fsdp::ft::Manager (", m.where(), "): allreduce outside a step: call start_quorum first");
  if (error_) return;
  if (!m.group) {
    report_error("no replicate group in round " + std::to_string(quorum_.round));
    return;
  }
  const double n = static_cast<double>(num_participants());
  // One flat buffer per dtype, in the order of first appearance (the same on every rank).
  std::vector<c10::ScalarType> order;
  for (const auto& t : tensors) {
    TORCH_CHECK(t.is_floating_point(), "fsdp::ft::Manager (", m.where(), "): allreduce averages floating tensors, got ",
                c10::toString(t.scalar_type()), " ", t.sizes());
    if (std::find(order.begin(), order.end(), t.scalar_type()) == order.end()) order.push_back(t.scalar_type());
  }
  try {
    for (auto st : order) {
      std::vector<torch::Tensor> part;
      for (const auto& t : tensors)
        if (t.scalar_type() == st) part.push_back(t.reshape({-1}));
      auto flat = torch::cat(part).to(torch::kCPU);  // (the replicate group is Gloo: device tensors via the host)
      if (m.group->size() > 1) all_reduce(flat, *m.group);
      flat.div_(n);
      int64_t off = 0;
      for (const auto& t : tensors) {
        if (t.scalar_type() != st) continue;
        t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
        off += t.numel();
      }
    }
  } catch (const std::exception& e) {
    m.group.reset();
    report_error("allreduce over the replicate group of round " + std::to_string(quorum_.round) + ": " +
                 detail::message_of(e));
  }
}

bool Manager::should_commit() {
  auto& m = *impl_;
  TORCH_CHECK(participating_, "fsdp::ft::Manager (", m.where(), "): should_commit without start_quorum");
  const std::string r = "r" + std::to_string(quorum_.round) + "/";
  const int64_t total = num_participants() * m.S;
  if (error_) {
    m.o.store->compareSet(m.key(r + "why"), {}, bytes_of(m.where() + ": " + *error_));
    m.o.store->add(m.key(r + "bad"), 1);
  } else {
    m.o.store->add(m.key(r + "ok"), 1);
  }
  const auto t0 = Clock::now();
  std::string verdict;
  for (;;) {
    if (m.has(r + "commit")) {
      verdict = m.get(r + "commit");
      break;
    }
    const int64_t bad = m.counter(r + "bad"), ok = m.counter(r + "ok");
    std::string v;
    if (bad > 0) v = "0";
    else if (ok == total) v = "1";
    else if (Clock::now() - t0 >= m.o.timeout) v = "0";
    if (!v.empty()) {
      verdict = m.decide(r + "commit", v);
      break;
    }
    std::this_thread::sleep_for(kPoll);
  }
  participating_ = false;
  m.committed = verdict == "1";
  failed_in_a_row_ = m.committed ? 0 : failed_in_a_row_ + 1;
  if (!m.committed) {
    quorum_.failure = m.has(r + "why") ? m.get(r + "why")
                                       : "a rank did not vote within " + std::to_string(m.o.timeout.count()) + " ms";
  }
  // Committed: a healed joiner now holds the state. Not committed: a joiner stays one in the next round
  // (it arrives as a participant; the deciders do not count it as a holder).
  if (m.committed) ++step_;
  error_.reset();
  return m.committed;
}

}  // namespace fsdp::ft
