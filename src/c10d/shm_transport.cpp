#include "c10d/shm_transport.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace fsdp::detail {

// The segment: a header line, one control line per rank, then (page-aligned) per rank two slot buffers.
struct alignas(64) RankControl {
  std::atomic<uint64_t> written;  // rounds this rank has written into its slot
  std::atomic<uint64_t> read;     // rounds this rank has read out of every slot
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> failed;   // 0 ok, 1 its transport failed, 2 its group was destroyed
  // What this rank's round in buffer b belongs to: (kind << 56 | the collective's number in the group)
  // and the collective's bytes. Compared by every reader, so ranks that disagree on a collective fail
  // instead of exchanging mismatched bytes.
  std::atomic<uint64_t> op[2];
  std::atomic<uint64_t> op_bytes[2];
  // The collective's argument (an all-reduce's reduce op and dtype, a broadcast's source), compared too.
  std::atomic<uint32_t> op_arg[2];
};
static_assert(sizeof(RankControl) == 64);

struct ShmTransport::Segment {
  std::atomic<uint32_t> bell;  // incremented at every state change; the futex waiters sleep on
  uint32_t size;
  std::atomic<uint32_t> sleepers;  // threads in futex_wait on `bell`: ring_bell skips the syscall when none
  char pad[52];
  RankControl ranks[1];  // `size` of them (the segment is sized for it)
};

namespace {

static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "the control blocks are shared between processes: lock-free atomics only");

uint64_t control_bytes(int size) {
  const uint64_t raw = 64 + 64 * static_cast<uint64_t>(size);
  return (raw + 4095) / 4096 * 4096;
}
uint64_t segment_bytes(int size) { return control_bytes(size) + 2 * static_cast<uint64_t>(size) * ShmTransport::kSlotBytes; }

std::string read_file(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

std::string ns_inode(const char* ns) {
  struct stat st {};
  std::string path = std::string("/proc/self/ns/") + ns;
  if (::stat(path.c_str(), &st) != 0) return "?";
  return std::to_string(st.st_ino);
}

// Identifies "one host" for this purpose: processes that can map the same /dev/shm object and see each
// other's pids. Network namespaces count as separate hosts (the multi-node tests build hosts from them).
std::string host_key() {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  return read_file("/proc/sys/kernel/random/boot_id") + "/" + host + "/" + ns_inode("ipc") + "/" + ns_inode("mnt") +
         "/" + ns_inode("net") + "/" + ns_inode("pid");
}

// FSDP_SHM_TRANSPORT: unset or 1 = on (where possible), 0 = off. Returns "on", "off", or the error for a
// bad value (published to the other ranks before it is thrown, so that they fail too instead of waiting).
std::string mode_from_env() {
  const char* v = std::getenv("FSDP_SHM_TRANSPORT");
  if (!v || !*v) return "on";
  const std::string s(v);
  if (s == "0" || s == "1") return s == "1" ? "on" : "off";
  return "FSDP_SHM_TRANSPORT=" + s +
         " is invalid: expected 1 (the default: one-host Gloo groups move all-gathers, reduce-scatters, "
         "all-reduces and broadcasts through shared memory) or 0 (through Gloo's sockets)";
}

bool pid_alive(int32_t pid) {
  if (pid <= 0 || pid == ::getpid()) return true;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  // A zombie (exited, not yet reaped by its launcher) still answers kill().
  std::string stat = read_file(("/proc/" + std::to_string(pid) + "/stat").c_str());
  auto paren = stat.rfind(')');
  if (paren != std::string::npos && paren + 2 < stat.size()) {
    const char state = stat[paren + 2];
    if (state == 'Z' || state == 'X') return false;
  }
  return true;
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, std::chrono::milliseconds slice) {
  timespec ts{static_cast<time_t>(slice.count() / 1000), static_cast<long>(slice.count() % 1000) * 1000000L};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Maps `name`; creates (and sizes, with the pages reserved so that a full /dev/shm fails here rather than
// with SIGBUS at the first copy) when `create`. Returns null with `error` set on failure.
void* map_segment(const std::string& name, uint64_t bytes, bool create, std::string& error) {
  int fd = ::shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) {
    error = std::string("shm_open(") + name + "): " + std::strerror(errno);
    return nullptr;
  }
  if (create) {
    int rc = ::ftruncate(fd, static_cast<off_t>(bytes));
    if (rc == 0) rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    else rc = errno;
    if (rc != 0) {
      error = "reserving " + std::to_string(bytes) + " bytes of " + name + " in /dev/shm: " + std::strerror(rc);
      ::close(fd);
      ::shm_unlink(name.c_str());
      return nullptr;
    }
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    error = std::string("mmap of ") + name + ": " + std::strerror(errno);
    if (create) ::shm_unlink(name.c_str());
    return nullptr;
  }
  return p;
}

// Removes segments that a killed rank 0 left behind: a signal between creating a segment and unlinking
// its name (after every rank has mapped it, a few store round trips later) leaves the name, and its
// reserved 4 MiB x size, in /dev/shm until reboot. A name is stale when its creator's pid no longer runs
// and it is older than a minute (no setup takes that long; the age also spares a live group's setup in
// another pid namespace sharing this /dev/shm, whose pid means nothing here). Unlinking a name leaves
// any mapping of it intact.
void remove_stale_segments() {
  std::error_code ec;
  const auto now = std::filesystem::file_time_type::clock::now();
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("fsdp-", 0) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(n.c_str() + 5, &end, 10);
    const bool named_by_pid = end != n.c_str() + 5 && *end == '-' && pid > 0 && pid <= INT32_MAX;
    if (!named_by_pid || pid_alive(static_cast<int32_t>(pid))) continue;
    std::error_code tec;
    const auto t = std::filesystem::last_write_time(e.path(), tec);
    if (!tec && now - t > std::chrono::minutes(1)) ::shm_unlink(("/" + n).c_str());
  }
}

class ShmWork : public c10d::Work {
 public:
  void done(std::exception_ptr e) { finish(std::move(e)); }
};

// Rank 0's part of the setup: compares every rank's host key with its own and, when all ranks share its
// host (and the group is small enough), creates and maps the segment (the caller constructs it) (its name in `seg_name`, the mapping
// in `base`, both set as soon as they exist so that the caller's cleanup releases them). A rank that
// refused (a bad FSDP_SHM_TRANSPORT) fails every rank: its refusal is published as the segment.
void create_segment_on_rank0(const std::function<std::string(const std::string&)>& get,
                             const std::function<void(const std::string&, const std::string&)>& put, int size,
                             uint64_t bytes, const std::string& name, std::string& seg_name, void*& base,
                             std::string& error) {
  const std::string mine = get("host/0");
  bool one_host = mine != "off" && size <= ShmTransport::kMaxRanks;
  std::string refused;
  for (int r = 1; r < size; ++r) {
    const std::string theirs = get("host/" + std::to_string(r));
    if (refused.empty() && !theirs.empty() && theirs[0] == '!') {
      refused = theirs + " (rank " + std::to_string(r) + ")";
    }
    one_host = one_host && theirs == mine;
  }
  if (!refused.empty()) {
    put("segment", refused);
    TORCH_CHECK(false, "init_process_group: ", refused.substr(1));
  }
  if (one_host) {
    remove_stale_segments();
    std::random_device rd;
    std::ostringstream os;
    os << "/fsdp-" << ::getpid() << "-" << std::hex << (static_cast<uint64_t>(rd()) << 32 | rd());
    seg_name = os.str();
    base = map_segment(seg_name, bytes, /*create=*/true, error);
    if (!base) {
      TORCH_WARN("group '", name, "': the shared-memory transport is off, all-gathers, reduce-scatters, ",
                 "all-reduces and broadcasts go through Gloo's sockets: ", error);
      seg_name.clear();
    }
  }
}

}  // namespace

std::shared_ptr<ShmTransport> ShmTransport::create(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                   std::chrono::milliseconds timeout, const std::string& name) {
  if (size < 2 || !store) return nullptr;
  // Keys of this setup: one generation per group built on this store (every rank of a group adds once,
  // and a rank reaches the next group's setup only after the next Gloo rendezvous, i.e. after all ranks
  // added for this one).
  const int64_t arrival = store->add("fsdp_shm/arrivals", 1) - 1;
  const std::string prefix = "fsdp_shm/" + std::to_string(arrival / size) + "/";
  auto put = [&](const std::string& key, const std::string& v) {
    store->set(prefix + key, std::vector<uint8_t>(v.begin(), v.end()));
  };
  auto get = [&](const std::string& key) {
    auto v = store->get(prefix + key);
    return std::string(v.begin(), v.end());
  };
  const std::string mode = mode_from_env();
  const bool bad_env = mode != "on" && mode != "off";
  put("host/" + std::to_string(rank), mode == "on" ? host_key() : mode == "off" ? "off" : "!" + mode);
  if (bad_env) {
    if (rank == 0) put("segment", "!" + mode + " (rank 0)");  // the others wait for rank 0's decision
    TORCH_CHECK(false, "init_process_group: ", mode, " (rank ", rank, ")");
  }
  std::string seg_name;
  void* base = nullptr;
  std::string error;
  const uint64_t bytes = segment_bytes(size);
  // Whatever happens from here (a store timeout because a rank died, a failed thread creation), the
  // segment's name and this rank's mapping are released: /dev/shm keeps nothing of a group.
  auto release = [&] {
    if (base) ::munmap(base, bytes);
    base = nullptr;
    if (rank == 0 && !seg_name.empty()) ::shm_unlink(seg_name.c_str());
  };
  try {
    if (rank == 0) {
      create_segment_on_rank0(get, put, size, bytes, name, seg_name, base, error);
      if (base) {
        auto* seg = new (base) Segment();
        seg->size = static_cast<uint32_t>(size);
      }
      put("segment", seg_name.empty() ? "-" : seg_name);
    } else {
      const std::string published = get("segment");
      TORCH_CHECK(published.empty() || published[0] != '!', "init_process_group: ", published.substr(1));
      if (published == "-") return nullptr;
      base = map_segment(published, bytes, /*create=*/false, error);
      if (!base) TORCH_WARN("group '", name, "' rank ", rank, ": cannot map the shared-memory transport: ", error);
    }
    if (rank == 0 && !base) return nullptr;  // "-" published: nobody maps
    put("ok/" + std::to_string(rank), base ? "1" : "0");
    bool all_ok = true;
    for (int r = 0; r < size; ++r) all_ok = get("ok/" + std::to_string(r)) == "1" && all_ok;
    // Every rank has opened it (or failed to): the name can go, the memory stays until the last unmap.
    if (rank == 0) ::shm_unlink(seg_name.c_str());
    seg_name.clear();
    if (!all_ok) {
      release();
      return nullptr;
    }
    std::shared_ptr<ShmTransport> t(new ShmTransport(base, bytes, rank, size, timeout));
    base = nullptr;  // the transport owns the mapping
    return t;
  } catch (...) {
    release();
    throw;
  }
}

ShmTransport::ShmTransport(void* base, uint64_t bytes, int rank, int size, std::chrono::milliseconds timeout)
    : base_(base), bytes_(bytes), seg_(static_cast<Segment*>(base)), rank_(rank), size_(size), timeout_(timeout),
      owner_pid_(::getpid()) {
  seg_->ranks[rank_].pid.store(::getpid());
  q_->worker = std::thread([this] { worker_loop(); });
}

ShmTransport::~ShmTransport() {
  if (::getpid() != owner_pid_) {
    // A forked child (e.g. a data-loader worker exiting): the worker thread and the peers are the
    // parent's. Mark nothing in the segment (that would fail the parent's peers) and lock nothing (the
    // parent's worker may have held the mutex at the fork).
    (void)q_.release();  // leaked: destroying a condition variable the parent's worker waited on blocks
    ::munmap(base_, bytes_);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(q_->mutex);
    q_->stop = true;
  }
  q_->cv.notify_all();
  if (q_->worker.joinable()) q_->worker.join();
  seg_->ranks[rank_].failed.store(2);
  ring_bell();
  ::munmap(base_, bytes_);
}

char* ShmTransport::slot(int r, uint64_t round) const {
  return static_cast<char*>(base_) + control_bytes(size_) + (2 * static_cast<uint64_t>(r) + round % 2) * kSlotBytes;
}

void ShmTransport::ring_bell() {
  seg_->bell.fetch_add(1);
  if (seg_->sleepers.load() != 0) futex_wake_all(&seg_->bell);
}

void ShmTransport::wait_all(const std::function<bool(int r)>& ready, std::chrono::steady_clock::time_point deadline,
                            const std::string& what, const char* stage) {
  auto check_peers = [&] {
    for (int r = 0; r < size_; ++r) {
      if (r == rank_ || ready(r)) continue;
      const uint32_t f = seg_->ranks[r].failed.load();
      TORCH_CHECK(f == 0, "rank ", r, (f == 1 ? "'s shared-memory transport failed (see that rank's error)"
                                              : " destroyed its process group"),
                  " before ", stage, " ", what);
      const int32_t pid = seg_->ranks[r].pid.load();
      TORCH_CHECK(pid_alive(pid), "rank ", r, " (pid ", pid, ") exited before ", stage, " ", what,
                  " (shared-memory transport)");
    }
  };
  for (int spin = 0;; ++spin) {
    const uint32_t seen = seg_->bell.load();
    bool all = true;
    for (int r = 0; r < size_ && all; ++r) all = ready(r);
    if (all) return;
    if (spin < 64) {
      std::this_thread::yield();
      continue;
    }
    check_peers();
    if (std::chrono::steady_clock::now() >= deadline) {
      std::vector<int> missing;
      for (int r = 0; r < size_; ++r) {
        if (!ready(r)) missing.push_back(r);
      }
      TORCH_CHECK(false, "timed out after ", timeout_.count(), " ms in the shared-memory transport waiting for ranks [",
                  c10::Join(", ", missing), "], not done ", stage, " ", what);
    }
    seg_->sleepers.fetch_add(1);
    if (seg_->bell.load() == seen) futex_wait(&seg_->bell, seen, std::chrono::milliseconds(50));
    seg_->sleepers.fetch_sub(1);
  }
}

namespace {
// The names of the kinds of rounds in errors.
std::string kind_name(uint64_t kind, uint32_t arg) {
  switch (kind) {
    case ShmTransport::kAllGather: return "an all-gather";
    case ShmTransport::kAllToAll: return "an all-to-all";
    case ShmTransport::kAllReduce:
    case ShmTransport::kReduceScatter: {
      static const char* ops[] = {"SUM", "AVG", "MAX", "MIN", "PRODUCT"};  // fsdp::ReduceOp's order
      const uint32_t op = arg >> 8;
      return std::string(kind == ShmTransport::kAllReduce ? "an all-reduce (" : "a reduce-scatter (") +
             (op < 5 ? ops[op] : "?") + ", " + c10::toString(static_cast<c10::ScalarType>(arg & 0xff)) + ")";
    }
    case ShmTransport::kBroadcast: return "a broadcast from rank " + std::to_string(arg);
  }
  return "?";
}
}  // namespace

void ShmTransport::round(uint64_t kind, uint64_t seq, uint64_t bytes, uint32_t arg,
                         const std::function<void(char*)>& write, const std::function<void(const char* const*)>& read,
                         std::chrono::steady_clock::time_point deadline, const std::string& what) {
  const uint64_t c = rounds_;
  const uint64_t op = kind << 56 | (seq & ((1ull << 56) - 1));
  const std::string piece = what + " (round " + std::to_string(c) + ")";
  // Buffer c % 2 last held round c - 2: free once every rank has read that round.
  if (c >= 2) {
    wait_all([&](int r) { return seg_->ranks[r].read.load(std::memory_order_acquire) >= c - 1; }, deadline, piece,
             "reading the previous use of the buffer of");
  }
  write(slot(rank_, c));
  seg_->ranks[rank_].op[c % 2].store(op, std::memory_order_relaxed);
  seg_->ranks[rank_].op_bytes[c % 2].store(bytes, std::memory_order_relaxed);
  seg_->ranks[rank_].op_arg[c % 2].store(arg, std::memory_order_relaxed);
  seg_->ranks[rank_].written.store(c + 1, std::memory_order_release);
  ring_bell();
  wait_all([&](int r) { return seg_->ranks[r].written.load(std::memory_order_acquire) >= c + 1; }, deadline, piece,
           "writing its part of");
  for (int r = 0; r < size_; ++r) {
    const uint64_t their = seg_->ranks[r].op[c % 2].load(std::memory_order_relaxed);
    const uint64_t their_bytes = seg_->ranks[r].op_bytes[c % 2].load(std::memory_order_relaxed);
    const uint32_t their_arg = seg_->ranks[r].op_arg[c % 2].load(std::memory_order_relaxed);
    TORCH_CHECK(their == op && their_bytes == bytes && their_arg == arg, "ranks disagree on ", what,
                ": this rank (", rank_, ") runs ", kind_name(kind, arg), " of ", bytes,
                " bytes per rank as the group's collective #", seq, ", rank ", r, " ",
                kind_name(their >> 56, their_arg), " of ", their_bytes, " bytes as its #",
                (their & ((1ull << 56) - 1)), " (shared-memory transport). Every rank must issue the same collectives "
                "in the same order with the same shapes and dtypes (FSDP_DEBUG=DETAIL names the calls)");
  }
  const char* slots[kMaxRanks];
  for (int r = 0; r < size_; ++r) slots[r] = slot(r, c);
  read(slots);
  seg_->ranks[rank_].read.store(c + 1, std::memory_order_release);
  ring_bell();
  rounds_ = c + 1;
}

c10::intrusive_ptr<c10d::Work> ShmTransport::enqueue(std::function<void()> run) {
  TORCH_CHECK(::getpid() == owner_pid_, "a process group cannot be used in a process forked after its creation ",
              "(pid ", ::getpid(), ", created in ", owner_pid_, "): create the group in the child");
  auto work = c10::make_intrusive<ShmWork>();
  {
    std::lock_guard<std::mutex> lock(q_->mutex);
    TORCH_CHECK(!q_->stop, "the process group's shared-memory transport is shut down");
    q_->tasks.push_back([this, work, run = std::move(run)]() mutable {
      std::exception_ptr error;
      try {
        TORCH_CHECK(broken_.empty(), "an earlier collective of this group failed in the shared-memory transport (",
                    broken_, "); the group cannot be used any more");
        run();
      } catch (const c10::Error& e) {
        if (broken_.empty()) broken_ = e.what_without_backtrace();
        error = std::current_exception();
      } catch (const std::exception& e) {
        if (broken_.empty()) broken_ = e.what();
        error = std::current_exception();
      }
      run = nullptr;  // release the tensors before completing: the caller may reuse them at once
      if (error) {
        seg_->ranks[rank_].failed.store(1);
        ring_bell();
      }
      work->done(error);
    });
  }
  q_->cv.notify_one();
  return work;
}

void ShmTransport::worker_loop() {
  ::pthread_setname_np(::pthread_self(), "fsdp_shm");
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(q_->mutex);
      q_->cv.wait(lock, [&] { return q_->stop || !q_->tasks.empty(); });
      if (q_->tasks.empty()) return;  // stopping, nothing left
      task = std::move(q_->tasks.front());
      q_->tasks.pop_front();
    }
    task();  // still run when stopping (draining, as Gloo's worker): each within its own deadline
  }
}

}  // namespace fsdp::detail
