// The shared-memory transport of one-host Gloo groups (src/c10d/shm_transport.h, issues 16 and 37; CTest
// label fully_shard): who gets it, results equal to Gloo's bit for bit over several rounds (all-gather,
// reduce-scatter, all-reduce in every op and dtype, broadcast from every rank), in place and out of order,
// and failures that never hang: a rank that skips, ranks that disagree, a rank whose process is gone.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include "fsdp/c10d/collectives.h"
#include "multi_rank.h"
#include "c10d/placed_collectives.h"
#include "c10d/process_group_access.h"

namespace fsdp::testing {
namespace {

bool has_shm(ProcessGroup& g) { return detail::ProcessGroupAccess::shm(g) != nullptr; }

// Reaps forked rank `pid` by `deadline`; one still running then is killed and reported as hung (-1), so that
// a survivor stuck in its error path fails the test naming it instead of running into ctest's timeout.
int reap_by(pid_t pid, std::chrono::steady_clock::time_point deadline) {
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return status;
}

// Appends to a c10d::FileStore's file what a process killed in the middle of a set() leaves: a record cut
// short (the key's length and bytes, no value). Every later read of that file by c10d's FileStore spins
// forever ([Note: no progress marks on a FileStore] in src/c10d/distributed.cpp).
void cut_a_filestore_record(const std::string& path) {
  const std::string key = "/fsdp_progress/cut/2";
  const uint32_t len = static_cast<uint32_t>(key.size());
  FILE* f = std::fopen(path.c_str(), "ab");
  std::fwrite(&len, sizeof(len), 1, f);
  std::fwrite(key.data(), 1, key.size(), f);
  std::fclose(f);
}

bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

// All-gathers equal Gloo's _allgather_base bit for bit, for sizes of no bytes, under one round and over
// several (2 MiB per round and rank), in fp32 and bf16, in place (input = this rank's part of the output),
// and with several collectives in flight at once, waited in reverse order (the transport runs them in
// issue order on its worker, and its two buffers alternate between rounds).
class ShmTransport : public ::testing::TestWithParam<int> {};

TEST_P(ShmTransport, AllGatherEqualsGlooBitForBit) {
  const int n = GetParam();
  run_ranks(n, [&](ProcessGroupPtr pg) {
    ASSERT_TRUE(has_shm(*pg)) << "ranks of one process are on one host";
    for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      for (int64_t m : {int64_t{0}, int64_t{1}, int64_t{777}, int64_t{1300001}}) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + pg->rank());
        auto input = torch::randn({m}, gen).to(dtype);
        auto ours = torch::full({n * m}, -1.0, input.options());
        all_gather_into_tensor(ours, input, *pg);
        auto gloo = torch::empty({n * m}, input.options());
        auto in = input.clone();
        pg->backend()->_allgather_base(gloo, in, c10d::AllgatherOptions())->wait();
        EXPECT_TRUE(bitwise_equal(ours, gloo)) << "N=" << n << " " << dtype << " m=" << m;
        // In place.
        auto buf = torch::zeros({n * m}, input.options());
        auto mine = buf.narrow(0, pg->rank() * m, m);
        mine.copy_(input);
        all_gather_into_tensor(buf, mine, *pg);
        EXPECT_TRUE(bitwise_equal(buf, gloo)) << "in place, N=" << n << " " << dtype << " m=" << m;
      }
    }
    // Five in flight (sizes from 1 to 3 rounds), waited last first.
    std::vector<torch::Tensor> ins, outs;
    std::vector<Work> works;
    for (int k = 0; k < 5; ++k) {
      const int64_t m = 1 + k * 300000;
      ins.push_back(torch::full({m}, static_cast<float>(100 * pg->rank() + k)));
      outs.push_back(torch::empty({n * m}));
      works.push_back(all_gather_into_tensor(outs.back(), ins.back(), *pg, /*async_op=*/true));
    }
    for (int k = 4; k >= 0; --k) {
      works[k].wait();
      const int64_t m = ins[k].numel();
      for (int r = 0; r < n; ++r) {
        EXPECT_TRUE(outs[k].narrow(0, r * m, m).eq(static_cast<float>(100 * r + k)).all().item<bool>())
            << "collective " << k << ", part of rank " << r;
      }
    }
  });
}

// The reduce-scatter's all-to-all through shared memory gives Gloo's _reduce_scatter_base's bits (the
// reduction order is test_gloo_reduce_scatter.cpp's subject; here: several rounds, AVG, in place).
TEST_P(ShmTransport, ReduceScatterEqualsGlooBitForBit) {
  const int n = GetParam();
  run_ranks(n, [&](ProcessGroupPtr pg) {
    ASSERT_TRUE(has_shm(*pg));
    for (int64_t m : {int64_t{3}, int64_t{700001}}) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(11 + pg->rank());
      auto input = torch::randn({n * m}, gen);
      auto ours = torch::empty({m});
      reduce_scatter_tensor(ours, input, *pg, ReduceOp::AVG);
      auto gloo = torch::empty({m});
      auto in = input.clone();
      c10d::ReduceScatterOptions opts;
      pg->backend()->_reduce_scatter_base(gloo, in, opts)->wait();
      gloo.div_(n);
      EXPECT_TRUE(bitwise_equal(ours, gloo)) << "N=" << n << " m=" << m;
      auto buf = input.clone();
      auto mine = buf.narrow(0, pg->rank() * m, m);
      reduce_scatter_tensor(mine, buf, *pg, ReduceOp::AVG);
      EXPECT_TRUE(bitwise_equal(mine, gloo)) << "in place, N=" << n << " m=" << m;
    }
  });
}

// all_gather_placed (c10d/placed_collectives.h, FSDP's all-gather straight into the unsharded parameters): each
// rank's bytes reach their destinations, pieces of no element and one crossing the 2 MiB round boundary
// included, equal to all_gather_into_tensor's output bit for bit; and a rank on the placed path meets ranks on
// all_gather_into_tensor in the same collective (the transport compares both as an all-gather).
TEST_P(ShmTransport, AllGatherPlacedEqualsAllGatherIntoTensor) {
  const int n = GetParam();
  run_ranks(n, [&](ProcessGroupPtr pg) {
    ASSERT_TRUE(detail::can_all_gather_placed(*pg));
    const std::vector<int64_t> sizes = {0, 5, 524287, 1, 0, 175708};  // 700001 floats: 2 rounds
    auto gen = at::make_generator<at::CPUGeneratorImpl>(31 + pg->rank());
    auto input = torch::randn({700001}, gen);
    auto expect = torch::empty({n * 700001});
    all_gather_into_tensor(expect, input, *pg);
    for (int placed_ranks : {n, 1}) {  // every rank placed; only rank 0
      std::vector<torch::Tensor> dests;
      for (auto m : sizes) dests.push_back(torch::full({n, m}, -1.0f));
      if (pg->rank() < placed_ranks) {
        std::vector<char*> bases;
        for (auto& d : dests) bases.push_back(static_cast<char*>(d.data_ptr()));
        auto place = [&](int r, uint64_t off, uint64_t len, const char* src) {
          uint64_t begin = 0;
          for (size_t i = 0; i < sizes.size(); ++i) {
            const uint64_t bytes = sizes[i] * 4, lo = std::max(off, begin), hi = std::min(off + len, begin + bytes);
            if (hi > lo) std::memcpy(bases[i] + r * bytes + (lo - begin), src + (lo - off), hi - lo);
            begin += bytes;
          }
        };
        detail::all_gather_placed(input, place, *pg, /*async_op=*/false);
      } else {
        auto out = torch::empty({n * 700001});
        all_gather_into_tensor(out, input, *pg);
        auto rows = out.view({n, 700001});
        int64_t off = 0;
        for (size_t i = 0; i < sizes.size(); ++i) {
          dests[i].copy_(rows.narrow(1, off, sizes[i]));
          off += sizes[i];
        }
      }
      auto rows = expect.view({n, 700001});
      int64_t off = 0;
      for (size_t i = 0; i < sizes.size(); ++i) {
        EXPECT_TRUE(bitwise_equal(dests[i], rows.narrow(1, off, sizes[i]).contiguous()))
            << "piece " << i << ", rank " << pg->rank() << ", " << placed_ranks << " rank(s) placed";
        off += sizes[i];
      }
    }
  });
}

// A rank's data given as pieces (issue 37, [Note: placed reduce-scatter]): sources at offsets of one tensor and
// runs of zeros (null sources), laid out as `layout` (element counts; negative = that many zeros).
struct PieceLayout {
  std::vector<int64_t> layout;
  int64_t numel() const {
    int64_t n = 0;
    for (auto k : layout) n += std::abs(k);
    return n;
  }
  // Row j (of `rows` rows) as pieces of `src` (row j's elements at j * numel()) and zeros.
  detail::ShmTransport::RowPieces pieces(const torch::Tensor& src) const {
    const uint64_t es = src.element_size(), row_bytes = numel() * es;
    return [layout = layout, src, es, row_bytes](int j, uint64_t off, uint64_t len,
                                                 const detail::ShmTransport::Piece& piece) {
      const char* base = static_cast<const char*>(src.data_ptr()) + j * row_bytes;
      uint64_t at = 0;
      for (auto k : layout) {
        const uint64_t bytes = std::abs(k) * es;
        if (len > 0 && off < at + bytes) {
          const uint64_t skip = off - at, take = std::min(len, bytes - skip);
          piece(k < 0 ? nullptr : base + off, take);
          off += take;
          len -= take;
        }
        at += bytes;
      }
    };
  }
  // The row the pieces make: src's values with the zero runs zeroed.
  torch::Tensor materialize(const torch::Tensor& src, int rows) const {
    auto out = src.clone().view({rows, numel()});
    int64_t at = 0;
    for (auto k : layout) {
      if (k < 0) out.narrow(1, at, -k).zero_();
      at += std::abs(k);
    }
    return out.view({-1});
  }
};

// reduce_scatter_placed over pieces equals reduce_scatter_tensor of the input they make, bit for bit: large pieces
// (reduced where they are), many small ones (gathered into the round's scratch first), zero runs, pieces across
// rounds, fp32 and bf16, SUM and MAX. all_gather_placed over pieces equals all_gather_into_tensor likewise.
TEST_P(ShmTransport, PiecesEqualTheTensorPaths) {
  const int n = GetParam();
  std::vector<int64_t> small;
  for (int i = 0; i < 300; ++i) small.push_back(i % 3 == 0 ? -7 : 11);
  std::vector<PieceLayout> layouts = {
      {{100000, -70000, 30, -3, 300001}},  // few large pieces: reduced where they are
      {small},                             // 300 small ones: through the scratch
  };
  layouts[1].layout.push_back(400000);     // and one large piece after them, in the next round
  run_ranks(n, [&](ProcessGroupPtr pg) {
    ASSERT_TRUE(detail::can_all_gather_placed(*pg));
    for (const auto& l : layouts) {
      for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(41 + pg->rank());
        auto src = torch::randn({n * l.numel()}, gen).to(dtype);
        for (auto op : {ReduceOp::SUM, ReduceOp::MAX}) {
          auto out = torch::full({l.numel()}, -1.0, src.options());
          ASSERT_TRUE(detail::can_reduce_scatter_placed(*pg, dtype, out.numel()));
          detail::reduce_scatter_placed(out, l.pieces(src), {src}, *pg, op, /*async_op=*/false);
          auto expect = torch::empty({l.numel()}, src.options());
          reduce_scatter_tensor(expect, l.materialize(src, n), *pg, op);
          EXPECT_TRUE(bitwise_equal(out, expect)) << "N=" << n << " " << dtype << " " << l.layout.size() << " pieces";
        }
        // All-gather: this rank's one row of pieces (the transport asks for row j = this rank: that row of `src`).
        auto gathered = torch::full({n, l.numel()}, -1.0, src.options());
        char* base = static_cast<char*>(gathered.data_ptr());
        const uint64_t row_bytes = l.numel() * src.element_size();
        auto place = [&](int r, uint64_t off, uint64_t len, const char* from) {
          std::memcpy(base + r * row_bytes + off, from, len);
        };
        detail::all_gather_placed(l.numel(), dtype, l.pieces(src), {src}, place, *pg, /*async_op=*/false);
        auto expect = torch::empty({n * l.numel()}, src.options());
        all_gather_into_tensor(expect, l.materialize(src, n).narrow(0, pg->rank() * l.numel(), l.numel()).contiguous(),
                               *pg);
        EXPECT_TRUE(bitwise_equal(gathered.view({-1}), expect)) << "all-gather, N=" << n << " " << dtype;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShmTransport, ::testing::Values(2, 3, 4));

// FSDP_SHM_TRANSPORT=0 keeps every group on Gloo's sockets (the results are the same); a bad value is
// refused naming the variable and the values it takes.
TEST(ShmTransportEnv, ZeroTurnsItOffAndBadValuesAreRefused) {
  setenv("FSDP_SHM_TRANSPORT", "0", 1);
  run_ranks(2, [&](ProcessGroupPtr pg) {
    EXPECT_FALSE(has_shm(*pg));
    auto out = torch::empty({4});
    all_gather_into_tensor(out, torch::full({2}, static_cast<float>(pg->rank())), *pg);
    EXPECT_TRUE(out.equal(torch::tensor({0.f, 0.f, 1.f, 1.f})));
  });
  setenv("FSDP_SHM_TRANSPORT", "yes", 1);
  auto errors = run_ranks_collect(2, [](ProcessGroupPtr) {});
  unsetenv("FSDP_SHM_TRANSPORT");
  for (const auto& e : errors) {
    EXPECT_NE(e.find("FSDP_SHM_TRANSPORT=yes is invalid: expected 1"), std::string::npos) << e;
  }
}

// A rank that never reaches an all-gather: the others fail after the group timeout, naming the
// collective and the missing rank; the skipping rank is unharmed.
TEST(ShmTransportErrors, SkippedAllGatherTimesOutNamingTheMissingRank) {
  const auto timeout = std::chrono::seconds(2);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<double> failed_after(3, 0);
  auto errors = run_ranks_collect(
      3,
      [&](ProcessGroupPtr pg) {
        ASSERT_TRUE(has_shm(*pg));
        if (pg->rank() == 2) {
          std::this_thread::sleep_for(timeout + std::chrono::seconds(3));
          return;
        }
        auto out = torch::empty({3 * 5});
        try {
          all_gather_into_tensor(out, torch::ones({5}), *pg);
        } catch (...) {
          failed_after[pg->rank()] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          throw;
        }
      },
      std::chrono::seconds(60), timeout);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("all_gather_into_tensor #0"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("input [5] Float, output [15] Float"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("timed out after 2000 ms in the shared-memory transport waiting for ranks [2]"),
              std::string::npos)
        << errors[r];
    EXPECT_NE(errors[r].find("ranks that have not reached it: [2]"), std::string::npos) << errors[r];
    EXPECT_GT(failed_after[r], 1.9);
    EXPECT_LT(failed_after[r], 2.0 + 5.0);
  }
  EXPECT_EQ(errors[2], "");
}

// Ranks that disagree on a collective's size fail at once on every rank, each naming both sides, instead
// of exchanging mismatched bytes (Gloo fails too, on a size check); the group refuses later collectives.
TEST(ShmTransportErrors, RanksThatDisagreeOnTheSizeFailAtOnce) {
  auto t0 = std::chrono::steady_clock::now();
  auto errors = run_ranks_collect(
      2,
      [&](ProcessGroupPtr pg) {
        const int64_t m = pg->rank() == 0 ? 10 : 20;
        auto out = torch::empty({2 * m});
        std::string first;
        try {
          all_gather_into_tensor(out, torch::ones({m}), *pg);
        } catch (const c10::Error& e) {
          first = e.what_without_backtrace();
        }
        EXPECT_NE(first.find("ranks disagree on all_gather_into_tensor #0"), std::string::npos) << first;
        EXPECT_NE(first.find("an all-gather of 40 bytes"), std::string::npos) << first;
        EXPECT_NE(first.find("an all-gather of 80 bytes"), std::string::npos) << first;
        auto again = torch::empty({4});
        all_gather_into_tensor(again, torch::ones({2}), *pg);  // throws: the transport is broken
      },
      std::chrono::seconds(60), std::chrono::seconds(30));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 15.0);
  for (const auto& e : errors) {
    EXPECT_NE(e.find("an earlier collective of this group failed in the shared-memory transport"), std::string::npos)
        << e;
  }
}

// A rank whose process is gone (exited, still a zombie of its parent) makes the other fail within
// seconds, naming the rank and its pid, not after the group timeout (60 s here). Two forked processes
// over a FileStore: each test runs in its own process under ctest, before any thread exists.
TEST(ShmTransportErrors, ExitedPeerProcessFailsTheOthersFast) {
  auto dir = std::filesystem::temp_directory_path() / ("fsdp_shm_dead_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string store_path = (dir / "store").string(), result = (dir / "result").string();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 2; ++rank) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int code = 0;
      try {
        auto store = c10::make_intrusive<c10d::FileStore>(store_path, 2);
        auto pg = make_gloo_group(store, rank, 2, std::chrono::seconds(60));
        if (!has_shm(*pg)) std::_Exit(10);
        barrier(*pg);
        if (rank == 1) std::_Exit(0);  // gone before the all-gather
        auto out = torch::empty({8});
        auto t0 = std::chrono::steady_clock::now();
        try {
          all_gather_into_tensor(out, torch::ones({4}), *pg);
          code = 11;
        } catch (const c10::Error& e) {
          const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          FILE* f = std::fopen(result.c_str(), "w");
          std::fprintf(f, "%.3f\n%s", s, e.what_without_backtrace());
          std::fclose(f);
        }
      } catch (...) {
        code = 12;
      }
      std::_Exit(code);
    }
    pids.push_back(pid);
  }
  // Rank 1 stays a zombie until rank 0 is done: reap rank 0 first.
  int status = reap_by(pids[0], std::chrono::steady_clock::now() + std::chrono::seconds(60));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank 0's status " << status << " (-1: hung)";
  ::waitpid(pids[1], &status, 0);
  std::ifstream in(result);
  double seconds = 1e9;
  in >> seconds;
  std::string message((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_LT(seconds, 10.0) << message;
  EXPECT_NE(message.find("rank 1 (pid " + std::to_string(pids[1]) + ") exited before"), std::string::npos) << message;
  EXPECT_NE(message.find("all_gather_into_tensor #1"), std::string::npos) << message;
  std::filesystem::remove_all(dir);
}

// An all-gather whose input lies inside another rank's part of the output (not in place): this rank's
// part comes out right even though the copy of rank 0's part overwrites the input, over several rounds.
TEST(ShmTransport, AllGatherWithInputInsideAnotherRanksPart) {
  run_ranks(2, [&](ProcessGroupPtr pg) {
    const int64_t m = 700001;  // 2.8 MB per rank: two rounds of 2 MiB
    auto mine = torch::arange(m, torch::kFloat32).add_(1e6 * pg->rank());
    auto out = torch::empty({2 * m});
    auto input = out.narrow(0, 0, m);  // rank 0: in place; rank 1: inside rank 0's part
    input.copy_(mine);
    all_gather_into_tensor(out, input, *pg);
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(out.narrow(0, r * m, m).equal(torch::arange(m, torch::kFloat32).add_(1e6 * r)))
          << "rank " << pg->rank() << ", part of rank " << r;
    }
  });
}

// Ranks that issue the same collectives in different orders across the two transports (a barrier on
// Gloo, an all-gather on shared memory) fail at once naming both numbers, instead of pairing the
// all-gathers regardless (the group's collective numbers are compared, not the transport's own count).
TEST(ShmTransportErrors, CollectivesInDifferentOrdersFailNamingBothNumbers) {
  auto t0 = std::chrono::steady_clock::now();
  auto errors = run_ranks_collect(
      2,
      [&](ProcessGroupPtr pg) {
        auto out = torch::empty({8});
        if (pg->rank() == 0) {
          auto w = barrier(*pg, /*async_op=*/true);            // #0
          all_gather_into_tensor(out, torch::ones({4}), *pg);  // #1
          w.wait();
        } else {
          all_gather_into_tensor(out, torch::ones({4}), *pg);  // #0
          barrier(*pg);                                         // #1
        }
      },
      std::chrono::seconds(60), std::chrono::seconds(8));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("ranks disagree on all_gather_into_tensor #" + std::to_string(1 - r)), std::string::npos)
        << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("as its #" + std::to_string(r)), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

// A process forked while a group exists (a data-loader worker, a subprocess launcher) that drops the
// group's transport and exits must not disturb the parent's group: the transport belongs to the parent.
// (Only async-signal-safe work is certain in such a child; the transport's destructor does no more.)
TEST(ShmTransport, ForkedChildLeavesTheParentsGroupAlone) {
  run_ranks(2, [&](ProcessGroupPtr pg) {
    ASSERT_TRUE(has_shm(*pg));
    auto out = torch::empty({4});
    all_gather_into_tensor(out, torch::full({2}, 1.0f), *pg);
    if (pg->rank() == 0) {
      pid_t pid = ::fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        detail::ProcessGroupAccess::set_shm(*pg, nullptr);  // the transport's destructor, in the child
        std::_Exit(0);
      }
      int status = 0;
      ASSERT_EQ(::waitpid(pid, &status, 0), pid);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
    }
    barrier(*pg);
    for (int k = 0; k < 3; ++k) {
      all_gather_into_tensor(out, torch::full({2}, static_cast<float>(pg->rank() + k)), *pg);
      EXPECT_TRUE(out.equal(torch::tensor({0.f + k, 0.f + k, 1.f + k, 1.f + k}))) << "after the child, round " << k;
    }
    EXPECT_TRUE(has_shm(*pg));
  });
}

// FSDP_SHM_TRANSPORT set to a bad value on one rank only: every rank fails at group creation, naming the
// variable and the rank, instead of the others waiting for that rank until the store times out. Two forked
// processes over a FileStore (the variable is per process).
TEST(ShmTransportEnv, BadValueOnOneRankFailsEveryRankAtOnce) {
  for (int bad_rank : {0, 1}) {
    auto dir = std::filesystem::temp_directory_path() /
               ("fsdp_shm_env_" + std::to_string(::getpid()) + "_" + std::to_string(bad_rank));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    const std::string store_path = (dir / "store").string();
    std::vector<pid_t> pids;
    for (int rank = 0; rank < 2; ++rank) {
      pid_t pid = ::fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        if (rank == bad_rank) setenv("FSDP_SHM_TRANSPORT", "on", 1);
        else unsetenv("FSDP_SHM_TRANSPORT");
        int code = 10;
        try {
          auto store = c10::make_intrusive<c10d::FileStore>(store_path, 2);
          auto pg = make_gloo_group(store, rank, 2, std::chrono::seconds(60));
        } catch (const c10::Error& e) {
          const std::string m = e.what_without_backtrace();
          code = m.find("FSDP_SHM_TRANSPORT=on is invalid") != std::string::npos &&
                         m.find("(rank " + std::to_string(bad_rank) + ")") != std::string::npos
                     ? 0
                     : 11;
          if (code) std::fprintf(stderr, "rank %d: %s\n", rank, m.c_str());
        }
        std::_Exit(code);
      }
      pids.push_back(pid);
    }
    auto t0 = std::chrono::steady_clock::now();
    for (int rank = 0; rank < 2; ++rank) {
      int status = 0;
      ASSERT_EQ(::waitpid(pids[rank], &status, 0), pids[rank]);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
          << "bad rank " << bad_rank << ", rank " << rank << ": status " << status
          << " (10: no error, 11: another error)";
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
    std::filesystem::remove_all(dir);
  }
}

// A segment left in /dev/shm by a rank 0 killed during setup (its pid gone, older than a minute) is
// removed when the next group on this host is created; a young one, and one whose creator runs, stay.
TEST(ShmTransport, StaleSegmentOfADeadCreatorIsRemovedAtTheNextSetup) {
  pid_t dead = ::fork();
  ASSERT_GE(dead, 0);
  if (dead == 0) std::_Exit(0);
  ASSERT_EQ(::waitpid(dead, nullptr, 0), dead);
  auto make = [](const std::string& name, int age_s) {
    int fd = ::shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
    ASSERT_GE(fd, 0) << name;
    ASSERT_EQ(::ftruncate(fd, 4096), 0);
    timespec times[2];
    ::clock_gettime(CLOCK_REALTIME, &times[0]);
    times[0].tv_sec -= age_s;
    times[1] = times[0];
    ASSERT_EQ(::futimens(fd, times), 0);
    ::close(fd);
  };
  auto exists = [](const std::string& name) { return std::filesystem::exists("/dev/shm" + name); };
  const std::string stale = "/fsdp-" + std::to_string(dead) + "-0123456789abcdef";
  const std::string young = "/fsdp-" + std::to_string(dead) + "-fedcba9876543210";
  const std::string live = "/fsdp-" + std::to_string(::getpid()) + "-00000000000000aa";
  make(stale, 120);
  make(young, 0);
  make(live, 120);
  run_ranks(2, [&](ProcessGroupPtr pg) { EXPECT_TRUE(has_shm(*pg)); });
  EXPECT_FALSE(exists(stale)) << "a dead creator's segment older than a minute is removed";
  EXPECT_TRUE(exists(young)) << "a young segment may belong to a setup in progress";
  EXPECT_TRUE(exists(live)) << "its creator still runs";
  for (const auto& n : {stale, young, live}) ::shm_unlink(n.c_str());
}

// /dev/shm too small for the segment (containers often get 64 MiB, shared by everything): group creation
// warns, naming the group and the error, and every rank stays on Gloo's sockets with the same results;
// nothing is left behind in /dev/shm. Run in a forked child with a private mount namespace whose /dev/shm
// is a 1 MiB tmpfs (needs root, as CI and the development machines have); its stderr goes to a file.
TEST(ShmTransportErrors, FullDevShmFallsBackToGlooWithAWarning) {
  auto dir = std::filesystem::temp_directory_path() / ("fsdp_shm_full_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string log = (dir / "stderr").string();
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || ::dup2(fd, 2) < 0) std::_Exit(20);
    if (::unshare(CLONE_NEWNS) != 0 || ::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=1m") != 0) {
      std::fprintf(stderr, "cannot mount a private /dev/shm: %s\n", std::strerror(errno));
      std::_Exit(21);
    }
    std::atomic<int> bad{0};
    try {
      run_ranks(2, [&](ProcessGroupPtr pg) {
        if (has_shm(*pg)) bad |= 1;
        auto out = torch::empty({4});
        all_gather_into_tensor(out, torch::full({2}, static_cast<float>(pg->rank())), *pg);
        if (!out.equal(torch::tensor({0.f, 0.f, 1.f, 1.f}))) bad |= 2;
        auto rs = torch::empty({3});
        reduce_scatter_tensor(rs, torch::arange(6, torch::kFloat32), *pg);
        if (!rs.equal(torch::arange(6, torch::kFloat32).narrow(0, 3 * pg->rank(), 3) * 2)) bad |= 4;
        auto ar = torch::full({3}, static_cast<float>(pg->rank() + 1));
        all_reduce(ar, *pg);
        broadcast(ar, 1, *pg);
        if (!ar.equal(torch::full({3}, 3.f))) bad |= 4;
      });
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      bad |= 8;
    }
    int left = 0;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
      left += e.path().filename().string().rfind("fsdp-", 0) == 0;
    std::fflush(stderr);
    std::_Exit(bad.load() | (left ? 16 : 0));
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  std::ifstream in(log);
  std::string err((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_TRUE(WIFEXITED(status)) << err;
  const int code = WEXITSTATUS(status);
  ASSERT_NE(code, 21) << "this test needs root (a private mount namespace with a small /dev/shm): " << err;
  EXPECT_EQ(code, 0) << "1: the group has the transport, 2: wrong all-gather, 4: wrong reduce-scatter, all-reduce or broadcast, "
                     << "8: an exception, 16: a segment left in /dev/shm; stderr:\n" << err;
  EXPECT_NE(err.find("the shared-memory transport is off, all-gathers, reduce-scatters, all-reduces and broadcasts "
                     "go through Gloo's sockets"),
            std::string::npos) << err;
  EXPECT_NE(err.find("in /dev/shm: No space left on device"), std::string::npos) << err;
  std::filesystem::remove_all(dir);
}

// ---- all_reduce and broadcast through shared memory (issue 37, item 2) -------------------------------------

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      return c10d::ReduceOp::SUM;
    case ReduceOp::MAX:
      return c10d::ReduceOp::MAX;
    case ReduceOp::MIN:
      return c10d::ReduceOp::MIN;
    case ReduceOp::PRODUCT:
      return c10d::ReduceOp::PRODUCT;
  }
  return c10d::ReduceOp::SUM;
}

const char* op_name(ReduceOp op) {
  static const char* names[] = {"SUM", "AVG", "MAX", "MIN", "PRODUCT"};
  return names[static_cast<int>(op)];
}

// Rank `rank`'s input: for floating dtypes magnitudes over ~8 decades and both signs (sums then depend on the
// order of the additions), with NaN, -0.0 and +0.0 sprinkled in when `specials` (MAX and MIN: where Gloo's
// std::max/std::min differ from at::maximum/at::minimum); small integers otherwise (PRODUCT wraps alike).
torch::Tensor input_for(int64_t numel, int rank, torch::ScalarType dtype, bool specials) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2000 + rank);
  if (!c10::isFloatingType(dtype)) return torch::randint(-50, 50, {numel}, gen, torch::kLong).to(dtype);
  auto x = torch::randn({numel}, gen, torch::kFloat64) * torch::exp(torch::randn({numel}, gen, torch::kFloat64) * 3);
  if (specials) {
    auto pick = torch::randint(0, 8, {numel}, gen, torch::kLong);
    x.masked_fill_(pick.eq(0), std::nan(""));
    x.masked_fill_(pick.eq(1), -0.0);
    x.masked_fill_(pick.eq(2), 0.0);
  }
  return x.to(dtype);
}

// all_reduce through shared memory equals ProcessGroupGloo's allreduce bit for bit: every op our all_reduce
// takes (AVG as SUM plus our division, on both sides), fp32, bf16, fp16, fp64 and every integer dtype the
// transport carries (int64, int32, int8, uint8: sums and products wrap alike); sizes of no element,
// fewer elements than ranks, uneven, and over several 2 MiB rounds and several of Gloo's 1 MiB ring segments
// (1300001 fp32 = 5.2 MB: 3 rounds, 6-8 segments). For N >= 3, rank 0 checks that summing in rank order
// would differ somewhere: the equality is not a coincidence of the data.
class ShmCollectives : public ::testing::TestWithParam<int> {};

TEST_P(ShmCollectives, AllReduceEqualsGlooBitForBit) {
  const int n = GetParam();
  run_ranks(n, [&](ProcessGroupPtr pg) {
    ASSERT_TRUE(has_shm(*pg));
    for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16, torch::kFloat64, torch::kInt64,
                       torch::kInt32, torch::kInt8, torch::kUInt8}) {
      for (int64_t m : {int64_t{0}, int64_t{1}, int64_t{n - 1}, int64_t{7}, int64_t{1001}, int64_t{1300001}}) {
        for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::PRODUCT, ReduceOp::MAX, ReduceOp::MIN}) {
          if (op == ReduceOp::AVG && !c10::isFloatingType(dtype)) continue;  // div_ refuses integers on both
          const bool specials = op == ReduceOp::MAX || op == ReduceOp::MIN;
          auto input = input_for(m, pg->rank(), dtype, specials);
          auto ours = input.clone();
          all_reduce(ours, *pg, op);
          auto gloo = input.clone();
          {
            c10d::AllreduceOptions opts;
            opts.reduceOp = to_c10d(op);
            std::vector<at::Tensor> ts{gloo};
            pg->backend()->allreduce(ts, opts)->wait();
            if (op == ReduceOp::AVG) gloo.div_(n);
          }
          EXPECT_TRUE(bitwise_equal(ours, gloo))
              << "N=" << n << " " << dtype << " m=" << m << " " << op_name(op) << " rank " << pg->rank();
          if (op == ReduceOp::SUM && dtype == torch::kFloat32 && n >= 3 && m > 1000) {
            auto all = torch::empty({n * m}, input.options());
            all_gather_into_tensor(all, input, *pg);
            auto naive = all.view({n, m})[0].clone();
            for (int r = 1; r < n; ++r) naive.add_(all.view({n, m})[r]);
            EXPECT_FALSE(bitwise_equal(naive, gloo)) << "N=" << n << ": the data does not exercise the order";
          }
        }
      }
    }
    // Five in flight, waited last first (issue order on the worker, both buffers reused).
    std::vector<torch::Tensor> ts;
    std::vector<Work> works;
    for (int k = 0; k < 5; ++k) {
      ts.push_back(torch::full({1 + k * 300000}, static_cast<float>(pg->rank() + k)));
      works.push_back(all_reduce(ts.back(), *pg, ReduceOp::SUM, /*async_op=*/true));
    }
    for (int k = 4; k >= 0; --k) {
      works[k].wait();
      EXPECT_TRUE(ts[k].eq(static_cast<float>(n * (n - 1) / 2 + n * k)).all().item<bool>()) << "collective " << k;
    }
  });
}

// The reduce-scatter's reduction is the all-reduce's (one gloo_ring_reduce): MAX and MIN with NaN and signed
// zeros equal Gloo's _reduce_scatter_base too.
TEST_P(ShmCollectives, ReduceScatterMaxMinWithNaNEqualsGloo) {
  const int n = GetParam();
  run_ranks(n, [&](ProcessGroupPtr pg) {
    for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      for (int64_t m : {int64_t{5}, int64_t{700001}}) {
        auto input = input_for(n * m, pg->rank(), dtype, /*specials=*/true);
        for (auto op : {ReduceOp::MAX, ReduceOp::MIN}) {
          auto ours = torch::empty({m}, input.options());
          reduce_scatter_tensor(ours, input, *pg, op);
          auto gloo = torch::empty({m}, input.options());
          auto in = input.clone();
          c10d::ReduceScatterOptions opts;
          opts.reduceOp = to_c10d(op);
          pg->backend()->_reduce_scatter_base(gloo, in, opts)->wait();
          EXPECT_TRUE(bitwise_equal(ours, gloo)) << "N=" << n << " " << dtype << " m=" << m << " " << op_name(op);
        }
      }
    }
  });
}

// reduce_scatter_tensor reduced straight out of the slots (issue 37 item 1) equals Gloo's _reduce_scatter_base
// bit for bit in every op and dtype the transport reduces, for chunks of one element, uneven sizes, and more
// than one round (300001 fp32 per chunk: 2-5 rounds at 2-4 ranks), with the output in a larger buffer.
TEST_P(ShmCollectives, ReduceScatterEveryOpAndDtypeEqualsGloo) {
  const int n = GetParam();
  run_ranks(n, [&](ProcessGroupPtr pg) {
    ASSERT_TRUE(has_shm(*pg));
    for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16, torch::kFloat64, torch::kInt64,
                       torch::kInt32, torch::kInt8, torch::kUInt8}) {
      for (int64_t m : {int64_t{1}, int64_t{1001}, int64_t{300001}}) {
        for (auto op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::PRODUCT, ReduceOp::MAX, ReduceOp::MIN}) {
          if (op == ReduceOp::AVG && !c10::isFloatingType(dtype)) continue;  // div_ refuses integers on both
          auto input = input_for(n * m, pg->rank(), dtype, op == ReduceOp::MAX || op == ReduceOp::MIN);
          auto holder = torch::full({m + 2}, 7, input.options());
          auto ours = holder.narrow(0, 1, m);
          reduce_scatter_tensor(ours, input, *pg, op);
          auto gloo = torch::empty({m}, input.options());
          auto in = input.clone();
          c10d::ReduceScatterOptions opts;
          opts.reduceOp = to_c10d(op == ReduceOp::AVG ? ReduceOp::SUM : op);
          pg->backend()->_reduce_scatter_base(gloo, in, opts)->wait();
          if (op == ReduceOp::AVG) gloo.div_(n);
          EXPECT_TRUE(bitwise_equal(ours, gloo)) << "N=" << n << " " << dtype << " m=" << m << " " << op_name(op);
          EXPECT_TRUE(holder[0].eq(7).item<bool>() && holder[m + 1].eq(7).item<bool>()) << "wrote outside the output";
        }
      }
    }
  });
}

// broadcast through shared memory: every source rank's bytes on every rank, as Gloo's broadcast.
TEST_P(ShmCollectives, BroadcastFromEveryRankEqualsGloo) {
  const int n = GetParam();
  run_ranks(n, [&](ProcessGroupPtr pg) {
    ASSERT_TRUE(has_shm(*pg));
    for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kInt64}) {
      for (int64_t m : {int64_t{0}, int64_t{1}, int64_t{777}, int64_t{1300001}}) {
        for (int src = 0; src < n; ++src) {
          auto input = input_for(m, pg->rank(), dtype, /*specials=*/false);
          auto ours = input.clone();
          broadcast(ours, src, *pg);
          auto gloo = input.clone();
          {
            c10d::BroadcastOptions opts;
            opts.rootRank = src;
            std::vector<at::Tensor> ts{gloo};
            pg->backend()->broadcast(ts, opts)->wait();
          }
          EXPECT_TRUE(bitwise_equal(ours, gloo)) << "N=" << n << " " << dtype << " m=" << m << " src " << src;
          EXPECT_TRUE(bitwise_equal(ours, input_for(m, src, dtype, false))) << "src " << src;
        }
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShmCollectives, ::testing::Values(2, 3, 4));

// A rank that skips an all_reduce (the loss's, say) and goes on to the next collective, a broadcast: every
// rank fails at once (no timeout: 60 s here), naming both collectives and numbers, instead of pairing unlike
// collectives. (A rank that skips one of two identical all_reduces is indistinguishable from one that does
// not, in PyTorch too: the others then fail when it leaves, "destroyed its process group".)
TEST(ShmCollectivesErrors, SkippedAllReduceFailsEveryRankAtOnce) {
  auto t0 = std::chrono::steady_clock::now();
  auto errors = run_ranks_collect(
      3,
      [&](ProcessGroupPtr pg) {
        auto t = torch::ones({5});
        if (pg->rank() != 2) all_reduce(t, *pg);  // #0: rank 2 skips it
        broadcast(t, 0, *pg);                      // rank 2's #0, the others' #1
      },
      std::chrono::seconds(90), std::chrono::seconds(60));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("all_reduce #0 on"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("tensor [5] Float failed: ranks disagree on all_reduce #0"), std::string::npos)
        << errors[r];
    EXPECT_NE(errors[r].find("rank 2 a broadcast from rank 0 of 20 bytes as its #0"), std::string::npos) << errors[r];
  }
  EXPECT_NE(errors[2].find("ranks disagree on broadcast #0"), std::string::npos) << errors[2];
  EXPECT_NE(errors[2].find("an all-reduce (SUM, Float) of 20 bytes as its #0"), std::string::npos) << errors[2];
}

// A rank that skips an all_reduce and stays alive: the others fail after the group timeout, naming the
// collective and the missing rank; the skipping rank is unharmed.
TEST(ShmCollectivesErrors, StalledRankTimesOutNamingIt) {
  const auto timeout = std::chrono::seconds(2);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<double> failed_after(3, 0);
  auto errors = run_ranks_collect(
      3,
      [&](ProcessGroupPtr pg) {
        if (pg->rank() == 2) {
          std::this_thread::sleep_for(timeout + std::chrono::seconds(3));
          return;
        }
        auto t = torch::ones({5});
        try {
          broadcast(t, 0, *pg);
        } catch (...) {
          failed_after[pg->rank()] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          throw;
        }
      },
      std::chrono::seconds(60), timeout);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("broadcast #0"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("timed out after 2000 ms in the shared-memory transport waiting for ranks [2]"),
              std::string::npos)
        << errors[r];
    EXPECT_NE(errors[r].find("ranks that have not reached it: [2]"), std::string::npos) << errors[r];
    EXPECT_GT(failed_after[r], 1.9);
    EXPECT_LT(failed_after[r], 2.0 + 20.0);
  }
  EXPECT_EQ(errors[2], "");
}

// Ranks that disagree on the collective (a broadcast where the others all-reduce), on the reduce op (of an
// all-reduce or a reduce-scatter), or on the broadcast's source fail at once on every rank, each naming both
// sides, instead of combining unlike bytes (Gloo, with no such check, would pair them or hang until its
// timeout; the reduce-scatter's all-to-all, which does not know the op, summed on some ranks and maxed on others).
TEST(ShmCollectivesErrors, MismatchedCollectivesFailAtOnce) {
  struct Case {
    const char* name;
    std::function<void(ProcessGroupPtr, torch::Tensor&)> call;
    std::vector<std::string> expected;  // in every rank's error
  };
  std::vector<Case> cases = {
      {"broadcast vs all_reduce",
       [](ProcessGroupPtr pg, torch::Tensor& t) {
         if (pg->rank() == 1) broadcast(t, 0, *pg);
         else all_reduce(t, *pg);
       },
       {"ranks disagree on ", " #0", "a broadcast from rank 0 of 16 bytes", "an all-reduce (SUM, Float) of 16 bytes"}},
      {"SUM vs MAX",
       [](ProcessGroupPtr pg, torch::Tensor& t) { all_reduce(t, *pg, pg->rank() == 0 ? ReduceOp::MAX : ReduceOp::SUM); },
       {"ranks disagree on all_reduce #0", "an all-reduce (MAX, Float)", "an all-reduce (SUM, Float)"}},
      {"reduce-scatter SUM vs MAX",
       [](ProcessGroupPtr pg, torch::Tensor& t) {
         auto out = torch::empty({4});
         reduce_scatter_tensor(out, t.repeat({3}), *pg, pg->rank() == 0 ? ReduceOp::MAX : ReduceOp::SUM);
       },
       {"ranks disagree on reduce_scatter_tensor #0", "a reduce-scatter (MAX, Float)",
        "a reduce-scatter (SUM, Float)"}},
      {"different sources",
       [](ProcessGroupPtr pg, torch::Tensor& t) { broadcast(t, pg->rank() == 0 ? 0 : 1, *pg); },
       {"ranks disagree on broadcast #0", "a broadcast from rank 0", "a broadcast from rank 1"}},
  };
  for (auto& c : cases) {
    auto t0 = std::chrono::steady_clock::now();
    auto errors = run_ranks_collect(
        3,
        [&](ProcessGroupPtr pg) {
          auto t = torch::ones({4});
          c.call(pg, t);
        },
        std::chrono::seconds(90), std::chrono::seconds(60));
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0) << c.name;
    for (int r = 0; r < 3; ++r) {
      for (const auto& want : c.expected) {
        EXPECT_NE(errors[r].find(want), std::string::npos) << c.name << ", rank " << r << ": " << errors[r];
      }
    }
  }
}

// A rank killed (SIGKILL) before an all_reduce, and before a broadcast: the others fail within seconds,
// naming the rank, its pid and the collective, not after the group timeout (60 s here). Three forked
// processes over a FileStore, as ExitedPeerProcessFailsTheOthersFast. The killed rank leaves a FileStore
// record cut short, as a kill in the middle of a set() does: this hung the survivors' error path in CI
// once, when they read their progress marks from the store ([Note: no progress marks on a FileStore]).
TEST(ShmCollectivesErrors, KilledRankFailsTheOthersFast) {
  for (const std::string collective : {"all_reduce", "broadcast"}) {
    auto dir = std::filesystem::temp_directory_path() /
               ("fsdp_shm_killed_" + std::to_string(::getpid()) + "_" + collective);
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    const std::string store_path = (dir / "store").string();
    std::vector<pid_t> pids;
    for (int rank = 0; rank < 3; ++rank) {
      pid_t pid = ::fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        int code = 0;
        try {
          auto store = c10::make_intrusive<c10d::FileStore>(store_path, 3);
          auto pg = make_gloo_group(store, rank, 3, std::chrono::seconds(60));
          if (!has_shm(*pg)) std::_Exit(10);
          auto t = torch::ones({1000});
          all_reduce(t, *pg);  // #0: all alive
          if (rank == 2) {
            cut_a_filestore_record(store_path);
            ::raise(SIGKILL);
          }
          auto t0 = std::chrono::steady_clock::now();
          try {
            if (collective == "all_reduce") all_reduce(t, *pg);
            else broadcast(t, 2, *pg);
            code = 11;
          } catch (const c10::Error& e) {
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            FILE* f = std::fopen((dir / ("result" + std::to_string(rank))).c_str(), "w");
            std::fprintf(f, "%.3f\n%s", s, e.what_without_backtrace());
            std::fclose(f);
          }
          // Out before the store's destructor: c10d's FileStore counts its users out through the file, and
          // that read spins on the cut record too (a hazard of FileStore itself, not of libfsdp's).
          std::_Exit(code);
        } catch (...) {
          code = 12;
        }
        std::_Exit(code);
      }
      pids.push_back(pid);
    }
    // Rank 2 stays a zombie until the others are done: reap them first.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);  // ctest: 120 s for both
    for (int rank = 0; rank < 2; ++rank) {
      const int status = reap_by(pids[rank], deadline);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
          << collective << ": rank " << rank << "'s status " << status << " (-1: hung)";
    }
    int status = 0;
    ::waitpid(pids[2], &status, 0);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "rank 2's status " << status;
    for (int rank = 0; rank < 2; ++rank) {
      std::ifstream in(dir / ("result" + std::to_string(rank)));
      double seconds = 1e9;
      in >> seconds;
      std::string message((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      EXPECT_LT(seconds, 10.0) << message;
      EXPECT_NE(message.find("rank 2 (pid " + std::to_string(pids[2]) + ") exited before"), std::string::npos)
          << message;
      EXPECT_NE(message.find(collective + " #1"), std::string::npos) << message;
    }
    std::filesystem::remove_all(dir);
  }
}

}  // namespace
}  // namespace fsdp::testing
