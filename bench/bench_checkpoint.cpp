// bench_checkpoint: checkpoint save and load throughput per rank against a plain sequential write and
// read of the same bytes on the same disk, in one run; and the time of a resharded load against a load
// of the same size without resharding.
//
//   build/bin/bench_checkpoint [--dir /tmp] [--mib 256] [--world 2] [--reshard-world 3] [--reps 3]
//                              [--format safetensors|distcp] [--thread-count N] [--strided]
//
// Ranks are threads over Gloo (in one process, as the tests run them); each owns a file, and they write
// and read in parallel. Every write is fsynced (the baseline's too) and every file's pages are dropped
// from the page cache (posix_fadvise DONTNEED) before it is read, so reads come from the disk. Times
// are the slowest rank's, the median of --reps repetitions.
//
// Goals (issue 32): save and load throughput >= 0.9 x the plain write/read; resharded load <= 1.2 x the
// same-size load; async_save blocks for no longer than the staging copy itself (a copy into memory
// already allocated), from its second call on (its buffers are kept: SaveOptions::cache_staging).
// --strided saves views that need a copy before they are written (transposed shards: what a GPU shard
// is to the writer), once copying everything first (per_thread_copy_ahead 0) and once copying ahead of
// the writers (the default 10 MB): their times and the host memory the copies hold at most.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <thread>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "checkpoint/copy_ahead.h"
#include "checkpoint/safetensors.h"
#include "fsdp/fsdp.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kCols = 4096;     // elements per row (16 KiB of float32)
constexpr int kTensors = 8;         // tensors in the state dict

/// Runs fn(rank, group) on `world` threads; returns the slowest rank's seconds.
double run_threads(int world, const std::function<void(int, fsdp::ProcessGroupPtr)>& fn) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::minutes(10));
  std::vector<fsdp::ProcessGroupPtr> groups(world);
  std::vector<double> secs(world, 0);
  std::vector<std::string> errors(world);
  {
    std::vector<std::thread> ts;
    for (int r = 0; r < world; ++r)
      ts.emplace_back([&, r] { groups[r] = fsdp::make_gloo_group(store, r, world, std::chrono::minutes(10)); });
    for (auto& t : ts) t.join();
  }
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) {
    ts.emplace_back([&, r] {
      try {
        fsdp::set_thread_default_process_group(groups[r]);
        fsdp::barrier(*groups[r]);
        auto t0 = Clock::now();
        fn(r, groups[r]);
        secs[r] = std::chrono::duration<double>(Clock::now() - t0).count();
      } catch (const c10::Error& e) {
        errors[r] = e.what_without_backtrace();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < world; ++r) TORCH_CHECK(errors[r].empty(), "bench_checkpoint: rank ", r, ": ", errors[r]);
  return *std::max_element(secs.begin(), secs.end());
}

bool keep_page_cache = false;  // --warm

void drop_cache_of(const fs::path& p) {
  if (keep_page_cache) return;
  if (fs::is_directory(p)) {
    for (const auto& e : fs::directory_iterator(p)) drop_cache_of(e.path());
    return;
  }
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

/// The benchmark state dict on `world` ranks: kTensors tensors of [rows, kCols] float32, sharded on dim 0.
/// `strided`: each local shard is the transpose of a contiguous [kCols, rows] tensor.
fsdp::StateDict make_state(int world, int rank, int64_t rows, fsdp::ProcessGroupPtr pg, bool zeros,
                           bool strided = false) {
  auto mesh = fsdp::init_device_mesh(torch::kCPU, {world}, {"shard"}, pg);
  fsdp::StateDict sd;
  for (int i = 0; i < kTensors; ++i) {
    auto r = fsdp::chunk_range(rows, world, rank);
    auto local = zeros ? torch::zeros({r.length, kCols}) : torch::rand({r.length, kCols});
    if (strided) local = local.t().contiguous().t();
    sd.insert_or_assign("layers." + std::to_string(i) + ".weight",
                        fsdp::DTensor(local, mesh, {fsdp::Shard(0)}, {rows, kCols}));
  }
  return sd;
}

int64_t local_bytes(const fsdp::StateDict& sd) {
  int64_t b = 0;
  for (const auto& [k, v] : sd) {
    const auto& t = std::get<fsdp::DTensor>(v).to_local();
    b += t.numel() * static_cast<int64_t>(t.element_size());
  }
  return b;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// "median (min-max)": the run-to-run spread, so that a reader can judge a ratio.
std::string spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.3f s (%.3f-%.3f)", v[v.size() / 2], v.front(), v.back());
  return buf;
}

/// Bytes this process made the kernel fetch from storage (/proc/self/io read_bytes): shows reads the
/// page cache served twice or readahead that fetched bytes nobody asked for.
int64_t disk_read_bytes() {
  std::FILE* f = std::fopen("/proc/self/io", "r");
  if (!f) return -1;
  char line[128];
  int64_t v = -1;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "read_bytes: %lld", reinterpret_cast<long long*>(&v)) == 1) break;
  std::fclose(f);
  return v;
}

/// Read requests the block device under the benchmark's folder completed (/sys/dev/block/MAJ:MIN/stat,
/// whole-device figures: other processes' reads count too): how the bytes reached the disk, which the
/// access pattern decides and a busy CPU does not. ms: the requests' summed time (queue + service).
struct DiskReads {
  int64_t ios = 0, merged = 0, sectors = 0, ms = 0;
};
std::string disk_stat_path;  // "" when unknown
DiskReads disk_reads() {
  DiskReads d;
  std::FILE* f = disk_stat_path.empty() ? nullptr : std::fopen(disk_stat_path.c_str(), "r");
  if (!f) return d;
  long long a = 0, b = 0, c = 0, e = 0;
  if (std::fscanf(f, "%lld %lld %lld %lld", &a, &b, &c, &e) == 4) d = {a, b, c, e};
  std::fclose(f);
  return d;
}
/// "N reqs of K KiB, M ms" between two readings.
std::string disk_delta(const DiskReads& a, const DiskReads& b) {
  if (disk_stat_path.empty()) return "n/a";
  const int64_t n = b.ios - a.ios;
  char buf[96];
  std::snprintf(buf, sizeof buf, "%lld reqs of %.0f KiB, %lld ms", static_cast<long long>(n),
                n > 0 ? (b.sectors - a.sectors) * 512.0 / 1024.0 / static_cast<double>(n) : 0.0,
                static_cast<long long>(b.ms - a.ms));
  return buf;
}

/// Every rank's loaded shards equal the saved ones.
void expect_same(const std::vector<fsdp::StateDict>& loaded, const std::vector<fsdp::StateDict>& saved,
                 const char* what) {
  for (size_t r = 0; r < loaded.size(); ++r) {
    for (const auto& [k, v] : loaded[r]) {
      TORCH_CHECK(torch::equal(std::get<fsdp::DTensor>(v).to_local(), std::get<fsdp::DTensor>(saved[r].at(k)).to_local()),
                  "bench_checkpoint: ", what, " differs");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Checkpoint save/load throughput vs plain sequential I/O of the same bytes"};
  std::string dir = fs::temp_directory_path().string();
  int64_t mib = 256;
  int world = 2, reshard_world = 3, reps = 3;
  app.add_option("--dir", dir, "Folder on the disk to measure (Default: $TMPDIR or /tmp)");
  app.add_option("--mib", mib, "MiB of state per rank at --world ranks")->capture_default_str();
  app.add_option("--world", world, "Ranks of the save and the same-size load")->capture_default_str();
  app.add_option("--reshard-world", reshard_world, "Ranks of the resharded load")->capture_default_str();
  app.add_option("--reps", reps, "Repetitions; the median is reported")->capture_default_str();
  std::string format = "safetensors";
  int threads = 1;
  app.add_option("--format", format, "Checkpoint layout: safetensors (ours) or distcp (PyTorch's)")
      ->check(CLI::IsMember({"safetensors", "distcp"}))->capture_default_str();
  app.add_option("--thread-count", threads, "Writer threads per rank (SaveOptions::thread_count)")->capture_default_str();
  bool prefetch = false;
  app.add_flag("--cooperative-prefetch", prefetch,
               "Report the resharded load with [Note: one reader per file region] (off by default in dcp::load); "
               "the other way is measured beside it in every invocation");
  bool warm = false;
  bool strided = false, no_verify = false;
  app.add_flag("--no-verify", no_verify, "Load without checking CRC-32C (LoadOptions::verify_checksums(false))");
  app.add_flag("--strided", strided, "Save transposed shards (a copy before each write): copy ahead vs copy first");
  app.add_flag("--warm", warm, "Read from the page cache (no drop before reads): isolates the CPU side of loading");
  CLI11_PARSE(app, argc, argv);
  keep_page_cache = warm;
  fsdp::dcp::detail::set_cooperative_prefetch(prefetch);
  const auto save_opts = [&](fsdp::ProcessGroupPtr pg) {
    return fsdp::dcp::SaveOptions().group(pg).thread_count(threads).storage_format(
        format == "distcp" ? fsdp::dcp::StorageFormat::Distcp : fsdp::dcp::StorageFormat::Safetensors);
  };

  const fs::path base = fs::path(dir) / ("bench_checkpoint_" + std::to_string(::getpid()));
  fs::create_directories(base);
  {
    struct stat st {};
    if (::stat(base.c_str(), &st) == 0) {
      char p[96];
      std::snprintf(p, sizeof p, "/sys/dev/block/%u:%u/stat", major(st.st_dev), minor(st.st_dev));
      if (fs::exists(p)) disk_stat_path = p;
    }
  }
  // Global rows so that each of `world` ranks holds `mib` MiB; divisible by world * reshard_world * 8.
  const int64_t row_bytes = kCols * 4;
  int64_t rows = mib * (1 << 20) * world / (row_bytes * kTensors);
  const int64_t q = static_cast<int64_t>(world) * reshard_world;
  rows = std::max<int64_t>(q, rows / q * q);
  const int64_t per_rank = rows * row_bytes * kTensors / world;
  std::printf("bench_checkpoint: %d tensors of [%lld, %lld] float32 = %.0f MiB; %d ranks hold %.1f MiB each; disk: %s\n",
              kTensors, static_cast<long long>(rows), static_cast<long long>(kCols),
              rows * row_bytes * kTensors / 1048576.0, world, per_rank / 1048576.0, base.c_str());

  std::vector<double> t_save_first, copy_first_mib, copy_ahead_mib;  // --strided
  std::vector<double> t_write, t_read, t_save, t_load, t_same, t_reshard, t_async_fresh, t_async_reused, t_copy;
  std::vector<double> io_read, io_load, io_same, io_reshard;  // MiB fetched from storage
  std::vector<double> t_reshard_other;  // the resharded load with the cooperative prefetch the other way
  for (int rep = 0; rep < reps; ++rep) {
    const fs::path plain = base / "plain", ck = base / ("ck" + std::to_string(rep)),
                   ck2 = base / ("ck_w" + std::to_string(reshard_world) + "_" + std::to_string(rep));
    fs::remove_all(plain);
    fs::create_directories(plain);
    // 1. Plain sequential write of each rank's bytes (write + fsync), in parallel.
    std::vector<torch::Tensor> bufs(world);
    for (int r = 0; r < world; ++r) bufs[r] = torch::rand({per_rank / 4});
    t_write.push_back(run_threads(world, [&](int r, fsdp::ProcessGroupPtr) {
      auto f = fsdp::dcp::detail::File::create((plain / std::to_string(r)).string(), "bench");
      f.write_all(bufs[r].data_ptr(), static_cast<size_t>(per_rank), "plain");
      f.fsync();
    }));
    // 2. dcp::save of the same bytes (fsync on).
    std::vector<fsdp::StateDict> sds(world);
    run_threads(world, [&](int r, fsdp::ProcessGroupPtr pg) { sds[r] = make_state(world, r, rows, pg, false, strided); });
    TORCH_CHECK(local_bytes(sds[0]) == per_rank);
    if (strided) {  // 2a. copying everything first: the rank's whole shard once more in memory
      t_save_first.push_back(run_threads(world, [&](int r, fsdp::ProcessGroupPtr pg) {
        fsdp::dcp::save(sds[r], (base / "first").string(), save_opts(pg).per_thread_copy_ahead(0));
      }));
      copy_first_mib.push_back(per_rank / 1048576.0);
      fs::remove_all(base / "first");
    }
    t_save.push_back(run_threads(world, [&](int r, fsdp::ProcessGroupPtr pg) {
      fsdp::dcp::save(sds[r], ck.string(), save_opts(pg));
    }));
    if (strided) copy_ahead_mib.push_back(fsdp::dcp::detail::last_copy_ahead_peak_bytes() / 1048576.0);
    // 2b. async_save twice (the second stages into the first's kept buffers): how long each blocks, against
    //     the staging copy alone (into memory already allocated and touched).
    {
      std::vector<double> fresh(world), reused(world), copy(world);
      fsdp::dcp::detail::clear_staging_cache();
      run_threads(world, [&](int r, fsdp::ProcessGroupPtr pg) {
        for (int k = 0; k < 2; ++k) {
          const auto t0 = Clock::now();
          auto fut = fsdp::dcp::async_save(sds[r], (base / ("async" + std::to_string(k))).string(), save_opts(pg));
          (k == 0 ? fresh : reused)[r] = std::chrono::duration<double>(Clock::now() - t0).count();
          fut.get();
        }
        std::vector<torch::Tensor> pre;
        for (const auto& [key, v] : sds[r]) pre.push_back(std::get<fsdp::DTensor>(v).to_local().clone());
        const auto t0 = Clock::now();
        size_t i = 0;
        for (const auto& [key, v] : sds[r]) pre[i++].copy_(std::get<fsdp::DTensor>(v).to_local());
        copy[r] = std::chrono::duration<double>(Clock::now() - t0).count();
      });
      fs::remove_all(base / "async0");
      fs::remove_all(base / "async1");
      t_async_fresh.push_back(*std::max_element(fresh.begin(), fresh.end()));
      t_async_reused.push_back(*std::max_element(reused.begin(), reused.end()));
      t_copy.push_back(*std::max_element(copy.begin(), copy.end()));
    }
    drop_cache_of(plain);
    drop_cache_of(ck);
    // 3. Plain sequential read of each rank's file.
    int64_t d_read = disk_read_bytes();
    const DiskReads k_read = disk_reads();
    t_read.push_back(run_threads(world, [&](int r, fsdp::ProcessGroupPtr) {
      auto f = fsdp::dcp::detail::File::open_read((plain / std::to_string(r)).string(), "bench");
      f.pread_exact(bufs[r].data_ptr(), static_cast<size_t>(per_rank), 0, "plain");
    }));
    io_read.push_back((disk_read_bytes() - d_read) / 1048576.0);
    const std::string dk_read = disk_delta(k_read, disk_reads());
    // 4. dcp::load on the same world size (each rank reads its own file).
    std::vector<fsdp::StateDict> dst(world);
    run_threads(world, [&](int r, fsdp::ProcessGroupPtr pg) { dst[r] = make_state(world, r, rows, pg, true); });
    int64_t d_load = disk_read_bytes();
    const DiskReads k_load = disk_reads();
    t_load.push_back(run_threads(world, [&](int r, fsdp::ProcessGroupPtr pg) {
      fsdp::dcp::load(dst[r], ck.string(), fsdp::dcp::LoadOptions().group(pg).verify_checksums(!no_verify));
    }));
    io_load.push_back((disk_read_bytes() - d_load) / 1048576.0);
    const std::string dk_load = disk_delta(k_load, disk_reads());
    expect_same(dst, sds, "loaded data");
    dst.clear();
    bufs.clear();
    // 5. On reshard_world ranks: a load of a checkpoint saved on reshard_world ranks (same size, no
    //    resharding) against a load of the checkpoint saved on `world` ranks (resharded).
    std::vector<fsdp::StateDict> sds2(reshard_world), dst2(reshard_world);
    run_threads(reshard_world, [&](int r, fsdp::ProcessGroupPtr pg) {
      // The same global tensors: gather from the world-rank pieces.
      auto mesh = fsdp::init_device_mesh(torch::kCPU, {reshard_world}, {"shard"}, pg);
      for (const auto& [k, v0] : sds[0]) {
        std::vector<torch::Tensor> parts;
        for (int s = 0; s < world; ++s) parts.push_back(std::get<fsdp::DTensor>(sds[s].at(k)).to_local());
        auto full = torch::cat(parts);
        sds2[r].insert_or_assign(k, fsdp::distribute_tensor(full, mesh, {fsdp::Shard(0)}));
      }
      dst2[r] = make_state(reshard_world, r, rows, pg, true);
    });
    sds.clear();
    run_threads(reshard_world, [&](int r, fsdp::ProcessGroupPtr pg) {
      fsdp::dcp::save(sds2[r], ck2.string(), save_opts(pg));
    });
    drop_cache_of(ck);
    drop_cache_of(ck2);
    int64_t d_same = disk_read_bytes();
    const DiskReads k_same = disk_reads();
    t_same.push_back(run_threads(reshard_world, [&](int r, fsdp::ProcessGroupPtr pg) {
      fsdp::dcp::load(dst2[r], ck2.string(), fsdp::dcp::LoadOptions().group(pg).verify_checksums(!no_verify));
    }));
    io_same.push_back((disk_read_bytes() - d_same) / 1048576.0);
    const std::string dk_same = disk_delta(k_same, disk_reads());
    // The resharded load twice, with and without [Note: one reader per file region], in alternating
    // order (the disk's behaviour drifts between invocations: compare within one).
    std::string dk_reshard;
    for (int pass = 0; pass < 2; ++pass) {
      const bool with_prefetch = (pass + rep) % 2 == 0;
      fsdp::dcp::detail::set_cooperative_prefetch(with_prefetch);
      drop_cache_of(ck);
      int64_t d_reshard = disk_read_bytes();
      const DiskReads k_reshard = disk_reads();
      const double t = run_threads(reshard_world, [&](int r, fsdp::ProcessGroupPtr pg) {
        fsdp::dcp::load(dst2[r], ck.string(), fsdp::dcp::LoadOptions().group(pg).verify_checksums(!no_verify));
      });
      expect_same(dst2, sds2, "resharded data");
      if (with_prefetch == prefetch) {
        t_reshard.push_back(t);
        io_reshard.push_back((disk_read_bytes() - d_reshard) / 1048576.0);
        dk_reshard = disk_delta(k_reshard, disk_reads());
      } else {
        t_reshard_other.push_back(t);
      }
    }
    fsdp::dcp::detail::set_cooperative_prefetch(prefetch);
    fs::remove_all(plain);
    fs::remove_all(ck);
    fs::remove_all(ck2);
    std::printf("  rep %d: write %.3f s, save %.3f s, read %.3f s, load %.3f s, load on %d ranks %.3f s, resharded "
                "%.3f s; MiB from disk: read %.0f, load %.0f, same-size %.0f, resharded %.0f\n", rep, t_write.back(),
                t_save.back(), t_read.back(), t_load.back(), reshard_world, t_same.back(), t_reshard.back(),
                io_read.back(), io_load.back(), io_same.back(), io_reshard.back());
    std::printf("         device reads: read %s; load %s; same-size %s; resharded %s\n", dk_read.c_str(),
                dk_load.c_str(), dk_same.c_str(), dk_reshard.c_str());
  }
  fs::remove_all(base);
  const double mb = per_rank / 1048576.0;
  const double w = median(t_write), s = median(t_save), r = median(t_read), l = median(t_load);
  const double same = median(t_same), resh = median(t_reshard);
  std::printf("per rank (%d ranks, %.1f MiB each), median of %d:\n", world, mb, reps);
  std::printf("  spread, median (min-max): write %s, save %s, read %s, load %s, same-size %s, resharded %s\n",
              spread(t_write).c_str(), spread(t_save).c_str(), spread(t_read).c_str(), spread(t_load).c_str(),
              spread(t_same).c_str(), spread(t_reshard).c_str());
  std::printf("  format %s, %d writer thread(s) per rank, cooperative prefetch %s, checksums %s\n", format.c_str(),
              threads, prefetch ? "on" : "off", no_verify ? "not checked" : "checked");
  std::printf("  plain write+fsync %8.1f MiB/s   dcp::save %8.1f MiB/s   ratio %.2f (goal >= 0.9)\n", mb / w, mb / s, w / s);
  std::printf("  plain read        %8.1f MiB/s   dcp::load %8.1f MiB/s   ratio %.2f (goal >= 0.9)\n", mb / r, mb / l, r / l);
  std::printf("  async_save blocks: first %s, second (kept buffers) %s; the staging copy alone %s: %.2fx (goal <= 1)\n",
              spread(t_async_fresh).c_str(), spread(t_async_reused).c_str(), spread(t_copy).c_str(),
              median(t_async_reused) / median(t_copy));
  if (strided) {
    std::printf("  strided shards: save copying first %s (copies held: %.1f MiB), copying ahead %s (at most %.1f MiB "
                "held by one writer): %.2fx\n", spread(t_save_first).c_str(), median(copy_first_mib),
                spread(t_save).c_str(), median(copy_ahead_mib), s / median(t_save_first));
  }
  std::printf("  load on %d ranks: same-size %.3f s, resharded from %d ranks %.3f s: %.2fx (goal <= 1.2)\n",
              reshard_world, same, world, resh, resh / same);
  std::printf("  resharded with the cooperative prefetch %s: %s: %.2fx same-size\n", prefetch ? "off" : "on",
              spread(t_reshard_other).c_str(), median(t_reshard_other) / same);
  return 0;
}
