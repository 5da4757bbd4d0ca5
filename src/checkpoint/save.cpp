// dcp::save and dcp::async_save: every rank writes its own chunks; rank 0 commits atomically.
//
// Protocol (through the group's store; see coordinator.h), for a save into DIR:
//   1. rank 0 removes stale DIR.tmp-* folders of crashed saves and creates DIR.tmp-<nonce>; every rank
//      learns its name (or rank 0's error, which every rank then throws).
//   2. every rank writes shard-{rank+1:05d}-model-00001-of-00001.safetensors into it and fsyncs it,
//      then reports its keys, chunks and checksums (or its error) to rank 0.
//   3. rank 0 checks the reports (same keys everywhere, every tensor covered exactly once), writes
//      libfsdp_checkpoint.json, fsyncs it and the folder, renames DIR.tmp-<nonce> to DIR, fsyncs the
//      parent, then replaces `latest` by an atomic rename; on any error it removes the temporary
//      folder. It publishes the outcome, which every rank returns or throws.
// A crash before the rename leaves only a DIR.tmp-* folder (removed by the next save into DIR); a crash
// after it leaves a complete DIR that `latest` may not name yet. The previous checkpoint and `latest`
// stay valid throughout.
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "checkpoint/coordinator.h"
#include "checkpoint/key_union.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/save_plan.h"
#include "checkpoint/stateful_entries.h"
#include "checkpoint/torch_dcp.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "util.h"

namespace fsdp::dcp {

namespace fs = std::filesystem;
using detail::Coordinator;
using detail::check_reports;
using detail::decide_replicated_writers;
using detail::resolve_group;
using fsdp::detail::message_of;
using fsdp::detail::numel_of;

namespace {

using detail::Item;
using detail::kChecksumBlockBytes;
using detail::Plan;
using detail::metadata_of;
using detail::write_shard;
using detail::write_torch_metadata;

/// `s` without trailing slashes.
std::string strip_slashes(std::string s) {
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

/// The dtype's name in the format's metadata ("F32" or "float32"); throws for a dtype it cannot store.
std::string dtype_label(StorageFormat f, torch::ScalarType dtype, const char* api, const std::string& key) {
  return f == StorageFormat::Distcp ? detail::torch_dtype_name(dtype, api, key) : detail::dtype_name(dtype, api, key);
}

Plan build_plan(const StateDict& sd, int rank, StorageFormat format, const char* api) {
  Plan plan;
  plan.format = format;
  for (const auto& [key, v] : sd) {
    TORCH_CHECK(!key.empty() && key != "__metadata__", api, ": invalid key '", key, "'");
    if (const auto* val = std::get_if<Value>(&v)) {
      plan.value_keys.push_back(key);
      if (val->per_rank) plan.per_rank[key] = val->json;
      else plan.values[key] = val->json;  // reported; rank 0 keeps the lowest rank's (see merge_reports)
      continue;
    }
    Item it;
    it.key = key;
    if (const auto* d = std::get_if<DTensor>(&v)) {
      const auto& mesh = d->device_mesh();
      it.sharded = true;
      it.dtype = d->scalar_type();
      it.global = d->sizes();
      it.offsets = d->local_offsets();
      it.sizes = d->to_local().sizes().vec();
      // One replica writes: the rank at coordinate 0 of every replicated mesh dim.
      bool primary = true, origin = true;
      for (int64_t md = 0; md < mesh->ndim(); ++md) {
        if (mesh->get_local_rank(md) != 0) {
          origin = false;
          if (d->placements()[md].is_replicate()) primary = false;
        }
      }
      it.write = primary && (numel_of(it.sizes) > 0 || (numel_of(it.global) == 0 && origin));
      if (plan.mesh_shape.empty()) {
        plan.mesh_shape = mesh->shape();
        plan.mesh_dim_names = mesh->dim_names();
      }
      if (it.write) it.data = d->to_local();
    } else {
      const auto& t = std::get<torch::Tensor>(v);
      TORCH_CHECK(t.defined(), api, ": '", key, "' is an undefined tensor (rank ", rank, ")");
      it.dtype = t.scalar_type();
      it.global = t.sizes().vec();
      it.offsets.assign(it.global.size(), 0);
      it.sizes = it.global;
      // Replicated: one copy is saved, the lowest rank's that holds the key (rank 0 unless the ranks hold
      // different keys, as pipeline stages do): decided by decide_replicated_writers before staging.
      it.write = rank == 0;
      it.data = t;
    }
    dtype_label(format, it.dtype, api, key);  // throws for dtypes the format cannot store
    plan.items.push_back(std::move(it));
  }
  return plan;
}

/// Staging buffers of async saves kept for the next one (SaveOptions::cache_staging): periodic saves
/// stage the same shapes every time, and fresh memory (pinned for CUDA, or page-faulted on first touch)
/// costs as much as the copy into it. Keyed by group and the plan's signature; a save takes the set out
/// and gives it back when its background write ends, so two saves in flight never share buffers.
class StagingCache {
 public:
  using Buffers = std::vector<torch::Tensor>;
  static StagingCache& instance() {
    static StagingCache c;
    return c;
  }
  std::shared_ptr<Buffers> take(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sets_.find(key);
    if (it == sets_.end()) return nullptr;
    ++reuses_;
    auto b = std::move(it->second);
    sets_.erase(it);
    return b;
  }
  /// Keeps `b` for `key`, replacing whatever was kept for the same group (one set per group: a
  /// changed state dict should not pin the old one's memory).
  void give(const std::string& group, const std::string& key, std::shared_ptr<Buffers> b) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = sets_.begin(); it != sets_.end();) {
      it = it->first.rfind(group, 0) == 0 && it->first != key ? sets_.erase(it) : std::next(it);
    }
    sets_[key] = std::move(b);
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    sets_.clear();
  }
  int64_t reuses() {
    std::lock_guard<std::mutex> lock(mu_);
    return reuses_;
  }

 private:
  int64_t reuses_ = 0;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Buffers>> sets_;
};

/// "key:dtype:shape:device;..." of what this rank stages.
std::string staging_key(const Plan& plan) {
  std::ostringstream os;
  for (const auto& it : plan.items) {
    if (!it.write) continue;
    os << it.key << ':' << it.dtype << ':' << c10::IntArrayRef(it.sizes) << ':' << it.data.device() << ';';
  }
  return os.str();
}

/// Copies what this rank writes to CPU memory: with `copy`, always (async_save: later training steps
/// must not change it); otherwise only what is not already a contiguous CPU tensor. With `buffers`
/// (async_save): into them when they hold one tensor per written item (a previous save's, from the
/// StagingCache), else into fresh ones recorded there.
/// CUDA shards go to pinned host memory by asynchronous copies, with one wait at the end (on an event of
/// the current stream, not a device-wide sync): the copies run back to back and async_save returns as soon
/// as they are done.
/// With `copy_ahead` (save, not copy): what needs a copy stays as it is for the writers' CopyAhead
/// ([Note: copy ahead]); the current stream of its device is synchronized so that their copies see
/// what the caller's kernels wrote.
void stage(Plan& plan, bool copy, int64_t copy_ahead, StagingCache::Buffers* buffers = nullptr) {
  torch::NoGradGuard no_grad;
  std::optional<torch::Device> device_copied;
  if (!copy && copy_ahead > 0) {
    for (auto& it : plan.items) {
      if (!it.write) continue;
      it.data = it.data.detach();
      if (!it.data.device().is_cpu()) device_copied = it.data.device();
    }
    if (device_copied) {
      c10::impl::VirtualGuardImpl impl(device_copied->type());
      c10::Event done(device_copied->type());
      done.record(impl.getStream(*device_copied));
      done.synchronize();
    }
    return;
  }
  size_t n_written = 0;
  for (const auto& it : plan.items) n_written += it.write ? 1 : 0;
  const bool reuse = buffers && buffers->size() == n_written;
  if (buffers && !reuse) buffers->clear();
  size_t k = 0;
  for (auto& it : plan.items) {
    if (!it.write) continue;
    auto src = it.data.detach();
    torch::Tensor dst;
    if (reuse) {
      dst = (*buffers)[k++];
    } else if (src.is_cuda()) {
      dst = torch::empty(src.sizes(), src.options().device(torch::kCPU).pinned_memory(true));
    } else if (copy || !src.is_contiguous()) {
      dst = torch::empty(src.sizes(), src.options().device(torch::kCPU).memory_format(c10::MemoryFormat::Contiguous));
    }
    if (!dst.defined()) {
      it.data = src.cpu();  // already contiguous CPU memory, and no copy asked for
      continue;
    }
    dst.copy_(src, /*non_blocking=*/src.is_cuda());
    if (src.is_cuda()) device_copied = src.device();
    it.data = dst;
    if (buffers && !reuse) buffers->push_back(dst);
  }
  if (device_copied) {
    c10::impl::VirtualGuardImpl impl(device_copied->type());
    c10::Event done(device_copied->type());
    done.record(impl.getStream(*device_copied));
    done.synchronize();
  }
}

/// This rank's report to rank 0: its keys, chunks, file checksums and per-rank Values.
nlohmann::json describe(const Plan& plan) {
  nlohmann::json keys = nlohmann::json::array();
  for (const auto& it : plan.items) {
    keys.push_back({it.key, it.sharded ? "DTensor" : "Tensor", dtype_label(plan.format, it.dtype, "dcp::save", it.key),
                    it.global, static_cast<int>(it.dtype)});
  }
  for (const auto& k : plan.value_keys) keys.push_back({k, "Value"});
  nlohmann::json chunks = nlohmann::json::array();
  for (const auto& it : plan.items)
    if (it.write) chunks.push_back({it.key, it.offsets, it.sizes});
  return {{"keys", keys}, {"chunks", chunks}, {"per_rank", plan.per_rank}, {"values", plan.values}};
}

/// Deletes the oldest libfsdp checkpoints next to `dir` so that `keep` remain (never `dir`).
void prune(const fs::path& parent, const fs::path& dir, int keep) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    if (!e.is_directory()) continue;
    if (!fs::exists(e.path() / kMetadataFileName)) {
      // PyTorch's format, when libfsdp wrote it (its save_id says so); never another program's.
      if (auto t = detail::libfsdp_torch_dcp_time(e.path().string())) found.emplace_back(*t, e.path());
      continue;
    }
    try {
      auto j = nlohmann::json::parse(detail::read_small_file((e.path() / kMetadataFileName).string(), "dcp::save"));
      if (j.value("format", "") != detail::kFormatName) continue;
      found.emplace_back(j.value("created_unix_ns", int64_t(0)), e.path());
    } catch (const std::exception&) {
      continue;  // not ours or unreadable: never delete it
    }
  }
  std::sort(found.begin(), found.end());
  size_t excess = found.size() > static_cast<size_t>(keep) ? found.size() - keep : 0;
  for (size_t i = 0; i < found.size() && excess > 0; ++i) {
    if (fs::equivalent(found[i].second, dir, ec)) continue;
    fs::remove_all(found[i].second, ec);
    --excess;
  }
}

/// Rank 0: renames the complete `tmp` to `dir` (swapping it with an existing `dir` atomically where the
/// filesystem can, then deleting the old one).
void rename_into_place(const fs::path& tmp, const fs::path& dir, const char* api) {
  if (!fs::exists(dir)) {
    TORCH_CHECK(::rename(tmp.c_str(), dir.c_str()) == 0, api, ": renaming ", tmp, " to ", dir, " failed: ",
                detail::errno_text(errno));
    return;
  }
  std::error_code ec;
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(tmp, ec);  // now the old checkpoint
    return;
  }
  const fs::path old = dir.string() + ".old-" + detail::random_nonce(8);
  TORCH_CHECK(::rename(dir.c_str(), old.c_str()) == 0, api, ": moving the old ", dir, " aside failed: ",
              detail::errno_text(errno));
  TORCH_CHECK(::rename(tmp.c_str(), dir.c_str()) == 0, api, ": renaming ", tmp, " to ", dir,
              " failed: ", detail::errno_text(errno), " (the old checkpoint is at ", old, ")");
  fs::remove_all(old, ec);
}

/// Rank 0: everything after the shards are on disk. Throws on failure (the caller removes `tmp`).
void commit(const Plan& plan, const std::vector<nlohmann::json>& reports, const fs::path& tmp, const fs::path& dir,
            int world, const SaveOptions& o, const char* api) {
  const fs::path parent = dir.parent_path().empty() ? fs::path(".") : dir.parent_path();
  detail::fault_point({"before_metadata", tmp.string(), 0});
  if (plan.format == StorageFormat::Distcp) {
    write_torch_metadata(plan, reports, tmp, o.fsync(), api);
  } else {
    const std::string text = metadata_of(plan, reports, world).dump(1);
    auto f = detail::File::create((tmp / kMetadataFileName).string(), api);
    f.write_all(text.data(), text.size(), "the checkpoint metadata");
    if (o.fsync()) f.fsync();
  }
  if (o.fsync()) detail::fsync_dir(tmp.string(), api);
  detail::fault_point({"before_rename", dir.string(), 0});
  rename_into_place(tmp, dir, api);
  if (o.fsync()) detail::fsync_dir(parent.string(), api);
  detail::fault_point({"before_latest", dir.string(), 0});
  if (o.update_latest()) {
    detail::write_file_atomic((parent / kLatestFileName).string(), dir.filename().string() + "\n", o.fsync(), api);
  }
  if (o.keep_last() > 0) prune(parent, dir, o.keep_last());
  detail::fault_point({"done", dir.string(), 0});
}

/// Rank 0: validates DIR and creates the temporary folder. Returns its path.
fs::path make_tmp(const fs::path& dir, const SaveOptions& o, const char* api) {
  const fs::path parent = dir.parent_path().empty() ? fs::path(".") : dir.parent_path();
  std::error_code ec;
  fs::create_directories(parent, ec);
  TORCH_CHECK(!ec, api, ": cannot create the parent folder ", parent, " of ", dir, ": ", ec.message());
  if (fs::exists(dir)) {
    TORCH_CHECK(fs::is_directory(dir), api, ": ", dir, " exists and is not a folder");
    TORCH_CHECK(o.overwrite(), api, ": ", dir, " already exists. Fix: save each checkpoint into a new folder (e.g. ",
                "one per step), or pass SaveOptions().overwrite(true) to replace it");
  }
  // Folders of saves into DIR that crashed before their rename.
  const std::string stale_prefix = dir.filename().string() + ".tmp-";
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    if (e.path().filename().string().rfind(stale_prefix, 0) == 0) fs::remove_all(e.path(), ec);
  }
  fs::path tmp = dir.string() + ".tmp-" + detail::random_nonce();
  fs::create_directory(tmp, ec);
  TORCH_CHECK(!ec, api, ": cannot create the temporary folder ", tmp, ": ", ec.message());
  return tmp;
}

/// Step 1 of a save: rank 0 creates the temporary folder and publishes it (or its error) to every rank.
fs::path agree_on_tmp(Coordinator& coord, const fs::path& dir, const SaveOptions& o, const char* api) {
  std::string msg;
  if (coord.rank() == 0) {
    try {
      msg = nlohmann::json{{"tmp", make_tmp(dir, o, api).string()}}.dump();
    } catch (const std::exception& e) {
      msg = nlohmann::json{{"error", message_of(e)}}.dump();
    }
  }
  auto prep = nlohmann::json::parse(coord.broadcast("tmp", msg, "to create the temporary folder"));
  if (prep.contains("error")) {
    TORCH_CHECK(false, coord.rank() == 0 ? prep["error"].get<std::string>()
                                         : api + std::string(": rank 0 could not prepare ") + dir.string() + ": " +
                                               prep["error"].get<std::string>());
  }
  return prep["tmp"].get<std::string>();
}

/// Step 3 of a save, rank 0: checks every rank's report and commits. Returns the failure ("" on success).
std::string check_and_commit(const Plan& plan, const std::vector<std::string>& reports_text, const fs::path& tmp,
                             const fs::path& dir, int world, const SaveOptions& o, const char* api) {
  std::vector<nlohmann::json> reports;
  std::string error;
  for (size_t r = 0; r < reports_text.size(); ++r) {
    reports.push_back(nlohmann::json::parse(reports_text[r]));
    if (error.empty() && reports.back().contains("error")) {
      error = "rank " + std::to_string(r) + ": " + reports.back()["error"].get<std::string>();
    }
  }
  nlohmann::json union_keys;
  if (error.empty()) {
    auto problem = check_reports(reports, &union_keys);
    if (!problem.empty()) error = std::string(api) + ": the ranks' state dicts disagree: " + problem;
  }
  if (error.empty()) {
    try {
      // The metadata describes the union of the ranks' keys: rank 0's plan and report, completed with
      // the keys only other ranks hold (dtype, Values: the lowest rank's), and per-rank Values of any rank.
      Plan merged = plan;
      merged.values = nlohmann::json::object();
      for (const auto& rep : reports)
        for (const auto& [k, v] : rep["values"].items())
          if (!merged.values.contains(k)) merged.values[k] = v;
      std::set<std::string> have;
      for (const auto& it : merged.items) have.insert(it.key);
      for (const auto& k : union_keys) {
        if (k[1] == "Value" || have.count(k[0].get<std::string>())) continue;
        Item it;
        it.key = k[0].get<std::string>();
        it.dtype = static_cast<torch::ScalarType>(k[4].get<int>());
        it.global = k[3].get<std::vector<int64_t>>();
        it.sharded = k[1] == "DTensor";
        it.write = false;
        merged.items.push_back(std::move(it));
      }
      reports[0]["keys"] = union_keys;
      for (const auto& rep : reports)
        for (const auto& [k, v] : rep["per_rank"].items())
          if (!reports[0]["per_rank"].contains(k)) reports[0]["per_rank"][k] = nullptr;
      commit(merged, reports, tmp, dir, world, o, api);
    } catch (const std::exception& e) {
      error = std::string("rank 0: ") + message_of(e);
    }
  }
  if (error.empty()) return "";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  return std::string(api) + " of " + dir.string() + " failed; the previous checkpoint and `latest` are " +
         "untouched. " + error;
}

/// The save itself, on the calling thread (save) or a background thread (async_save).
void run_save(const Plan& plan, Coordinator& coord, const std::string& dir_arg, const SaveOptions& o, const char* api) {
  const fs::path dir = strip_slashes(dir_arg);
  const int rank = coord.rank();
  // 1. The temporary folder.
  const fs::path tmp = agree_on_tmp(coord, dir, o, api);
  // 2. This rank's shard.
  nlohmann::json report;
  try {
    report = describe(plan);
    report["files"] = write_shard(plan, tmp.string(), rank, o.thread_count(), o.per_thread_copy_ahead(), o.fsync(), api);
  } catch (const std::exception& e) {
    report = {{"error", std::string(message_of(e))}};
  }
  auto reports_text = coord.gather("report", report.dump(), "to finish writing its shard");
  // 3. Rank 0 commits; every rank learns the outcome.
  std::string outcome = rank == 0 ? check_and_commit(plan, reports_text, tmp, dir, coord.world(), o, api) : "";
  outcome = coord.broadcast("outcome", outcome, "to commit the checkpoint");
  TORCH_CHECK(outcome.empty(), outcome);
}

/// What this rank saves, staged (`copy`: always copied, for async_save). On an error, lets the other
/// ranks fail too instead of waiting for this one, then throws.
Plan plan_or_fail(const StateDict& state_dict, Coordinator& coord, bool copy, const SaveOptions& o, const char* api,
                  const std::function<StagingCache::Buffers*(const Plan&)>& buffers = nullptr) {
  Plan plan;
  std::string error;
  try {
    TORCH_CHECK(o.thread_count() >= 1, api, ": thread_count must be at least 1, got ", o.thread_count());
    TORCH_CHECK(o.per_thread_copy_ahead() >= 0, api, ": per_thread_copy_ahead must be at least 0 bytes, got ",
                o.per_thread_copy_ahead(), " (0 copies everything before writing)");
    plan = build_plan(detail::with_stateful_entries(state_dict, api), coord.rank(), o.storage_format(), api);
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  decide_replicated_writers(plan, coord, error, api);  // every rank takes part, even one that failed
  try {
    if (error.empty()) stage(plan, copy, o.per_thread_copy_ahead(), buffers ? buffers(plan) : nullptr);
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  if (error.empty()) return plan;
  if (!coord.single()) {
    if (coord.rank() == 0) coord.set("tmp", nlohmann::json{{"error", error}}.dump());
    else coord.gather("report", nlohmann::json{{"error", error}}.dump(), "");
  }
  TORCH_CHECK(false, error);
}

// async saves of one group run one after another (so `latest` moves in call order).
std::mutex& chain_mu() {
  static std::mutex mu;
  return mu;
}
std::map<const ProcessGroup*, std::shared_future<void>>& chains() {
  static std::map<const ProcessGroup*, std::shared_future<void>> m;
  return m;
}

}  // namespace

void save(const StateDict& state_dict, const std::string& dir, const SaveOptions& options) {
  const char* api = "dcp::save";
  TORCH_CHECK(!dir.empty(), api, ": expected a folder, got an empty path");
  auto group = resolve_group(state_dict, options.group());
  Coordinator coord(group, api);
  Plan plan = plan_or_fail(state_dict, coord, /*copy=*/false, options, api);
  run_save(plan, coord, dir, options, api);
}

std::future<void> async_save(const StateDict& state_dict, const std::string& dir, const SaveOptions& options) {
  const char* api = "dcp::async_save";
  TORCH_CHECK(!dir.empty(), api, ": expected a folder, got an empty path");
  auto group = resolve_group(state_dict, options.group());
  auto coord = std::make_shared<Coordinator>(group, api, /*clone_store=*/true);
  // Staged (copied): training may change the model from now on. Into the previous save's buffers when
  // it left them (cache_staging) and they fit.
  std::string cache_key;
  const std::string group_key = std::to_string(reinterpret_cast<uintptr_t>(group.get())) + "|";
  std::shared_ptr<StagingCache::Buffers> buffers;
  auto take = [&](const Plan& p) -> StagingCache::Buffers* {
    if (!options.cache_staging()) return nullptr;
    cache_key = group_key + staging_key(p);
    buffers = StagingCache::instance().take(cache_key);
    if (!buffers) buffers = std::make_shared<StagingCache::Buffers>();
    return buffers.get();
  };
  auto plan = std::make_shared<Plan>(
      plan_or_fail(state_dict, *coord, /*copy=*/true, options, api, take));
  auto result = std::make_shared<std::promise<void>>();
  auto finished = std::make_shared<std::promise<void>>();
  std::shared_future<void> previous;
  {
    std::lock_guard<std::mutex> lock(chain_mu());
    auto& slot = chains()[group.get()];
    previous = slot;
    slot = finished->get_future().share();
  }
  std::future<void> fut = result->get_future();
  std::thread([plan, coord, dir, options, result, finished, previous, api, buffers, cache_key, group_key] {
    if (previous.valid()) previous.wait();
    std::exception_ptr error;
    try {
      run_save(*plan, *coord, dir, options, api);
    } catch (...) {
      error = std::current_exception();
    }
    // The buffers go back before the future completes: the next async_save, called right after
    // fut.get(), finds them, and nothing of this thread touches the cache once the caller may exit.
    plan->items.clear();  // the buffers' last users besides the cache
    if (buffers && !buffers->empty()) StagingCache::instance().give(group_key, cache_key, buffers);
    if (error) result->set_exception(error);
    else result->set_value();
    finished->set_value();
  }).detach();
  return fut;
}

void detail::clear_staging_cache() { StagingCache::instance().clear(); }
int64_t detail::staging_cache_reuses() { return StagingCache::instance().reuses(); }

std::optional<std::string> latest(const std::string& parent) {
  const fs::path p = fs::path(parent) / kLatestFileName;
  if (!fs::exists(p)) return std::nullopt;
  std::string name = detail::read_small_file(p.string(), "dcp::latest");
  while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
  TORCH_CHECK(!name.empty() && name.find('/') == std::string::npos, "dcp::latest: ", p,
              " is malformed: expected the name of a checkpoint folder next to it, found '", name, "'");
  return (fs::path(parent) / name).string();
}

}  // namespace fsdp::dcp
