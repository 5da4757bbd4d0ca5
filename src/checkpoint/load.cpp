// dcp::load: reading a checkpoint into a state dict with resharding. The checkpoint's description
// (inspect) is read by metadata.cpp; read_tensor, verify and consolidate are in verify.cpp; the chunk
// reader they share is chunk_reader.cpp.
//
// Two ways to read, by the checkpoint's kind:
// - Ours (a metadata file with CRC-32Cs): every byte read is verified before anything is written, so
//   the data is read in phase 1 (validate) and staged in the page cache, as below.
// - Folders of plain safetensors files (a consolidated checkpoint: model.safetensors, or an index and
//   its shards, as consolidate() and Hugging Face write them; or PyTorch's HuggingFaceStorageWriter
//   shards): there is nothing to verify, so phase 1 checks only the headers (shapes, dtypes, sizes,
//   coverage) and phase 3 streams the data: one destination box at a time, pread straight into the
//   local tensor when it is contiguous CPU memory of the file's dtype, else through a staging buffer of
//   at most kStageBytes (64 MiB, or one row of the box). A consolidated checkpoint can be larger than a rank's
//   memory: each rank touches only its rows and holds no more than one staging buffer.
//
// Resharding: a destination is a box of the global tensor (a DTensor's local piece, or a whole tensor).
// For each chunk of the checkpoint that overlaps it, the overlap is one run of the chunk's C-order
// elements from its first to its last element (exactly the overlap when it spans the trailing dims, as
// with Shard(0)); only that byte range of the file is read (widened to whole checksum blocks when
// checksums are verified). Files are memory-mapped: what a load reads stays in the page cache, verified,
// until every rank has read and verified everything; only then is it copied into the destinations
// (see [Note: validate, agree, apply] in validate_agree_apply.h).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <map>
#include <set>

#include "checkpoint/chunk_reader.h"
#include "checkpoint/cooperative_prefetch.h"
#include "checkpoint/coordinator.h"
#include "checkpoint/key_union.h"
#include "checkpoint/metadata.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/stateful_entries.h"
#include "checkpoint/torch_dcp.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "util.h"
#include "checkpoint/validate_agree_apply.h"


namespace fsdp::dcp {

namespace fs = std::filesystem;

namespace {

using fsdp::detail::list_keys;
using fsdp::detail::numel_of;
using fsdp::detail::shape_str;
using detail::read_info;
using detail::chunk_view;
using detail::coverage_problem;
using detail::FileCache;
using detail::narrow_to;
using detail::Overlap;
using detail::overlap_of;
using detail::read_box;

/// Largest staging buffer of a streamed read (a box is staged in slabs of rows of at most this size,
/// or one row when a row is larger): bounds the extra memory of a load whatever the tensor's size.
constexpr int64_t kStageBytes = int64_t(64) << 20;
std::atomic<int64_t> stage_bytes{kStageBytes};  // tests lower it (detail::set_load_stage_bytes)
// Off: [Note: one reader per file region] halves the disk's requests of a resharded load but was 4-25%
// slower than every rank reading its own pieces on this project's VM disk, measured side by side in one
// invocation (docs/BENCHMARKS.md "Resharded load: one reader per file region, following behind").
std::atomic<bool> prefetch_on{false};  // benchmarks compare (detail::set_cooperative_prefetch)
bool cooperative_prefetch_enabled() { return prefetch_on.load(); }


/// Phase 1 of dcp::load on one rank: validates the state dict against the checkpoint and stages every
/// copy (views of verified file bytes) and Value, changing nothing.
class LoadPlan {
 public:
  LoadPlan(const std::string& dir, const LoadOptions& options, int rank, int world, const char* api,
           const std::map<std::string, std::pair<std::string, bool>>* stateful_keys = nullptr)
      : stateful_keys_(stateful_keys), info_(read_info_of_rank(dir, api, rank)), files_(info_.dir, api), options_(options), rank_(rank),
        world_(world), api_(api), stream_(!info_.metadata.is_object()) {
    for (const auto& f : info_.files) result_.bytes_read += f.header_bytes;
    std::error_code ec;
    auto n = fs::file_size(fs::path(info_.dir) / (info_.format == detail::kTorchFormatName ? detail::kTorchMetadataFileName
                                                                                           : kMetadataFileName), ec);
    if (!ec) result_.bytes_read += static_cast<int64_t>(n);
  }

  /// Stages every entry of `sd`, then checks the keys (strict). Throws on the first problem.
  void stage(const StateDict& sd) {
    std::set<std::string> seen;
    for (const auto& [key, v] : sd) {
      seen.insert(key);
      if (std::holds_alternative<Value>(v)) {
        sd_value_ = &v;
        stage_value(key);
      } else {
        stage_tensor(key, v);
      }
    }
    for (const auto& [k, _] : info_.tensors)
      if (!seen.count(k)) result_.unexpected_keys.push_back(k);
    for (const auto& [k, _] : info_.values)
      if (!seen.count(k)) result_.unexpected_keys.push_back(k);
    for (const auto& [k, _] : info_.per_rank_values)
      if (!seen.count(k)) result_.unexpected_keys.push_back(k);
    for (const auto& [k, _] : info_.unreadable)
      if (!seen.count(k)) result_.unexpected_keys.push_back(k);
    if (options_.strict()) check_strict_missing();
  }

  /// Strict: `unasked` (the checkpoint's keys no rank's state dict holds) must be empty.
  void check_strict_unexpected(const std::vector<std::string>& unasked) const {
    if (!options_.strict()) return;
    TORCH_CHECK(unasked.empty(), api_, ": ", info_.dir, " holds ", unasked.size(),
                " key(s) no rank's state dict does (rank ", rank_, "): ", list_keys(unasked),
                ". Fix: add them to the state dict (e.g. get_state_dict(model, optimizer) for a checkpoint with ",
                "optimizer state), or pass LoadOptions().strict(false) to ignore them");
  }

  /// The byte ranges [begin, end) of each file this rank will read (merged, sorted), for
  /// CooperativePrefetch.
  detail::FileRanges needed() const {
    detail::FileRanges out;
    // Only the pieces read in phase 1: a streamed load (plain safetensors) reads in phase 3, after the
    // agreement, where nobody waits for a reader.
    for (const Read& p : pending_) {
      const auto r = chunk_range(info_, *p.chunk, p.fqn, p.dtype, p.ov, options_.verify_checksums(), api_);
      out[p.chunk->file].emplace_back(p.chunk->file_offset + r.begin, p.chunk->file_offset + r.end);
    }
    for (auto& [_, v] : out) v = detail::merged_ranges(std::move(v));
    return out;
  }

  const std::string& dir() const { return info_.dir; }

  /// Phase 3: copies what was staged into `sd`'s destinations, and streams the reads of a checkpoint
  /// without checksums.
  void apply(StateDict& sd) {
    {
      torch::NoGradGuard no_grad;
      for (auto& c : copies_) c.dst.copy_(c.src);
      for (size_t i = 0; i < reads_.size(); ++i) {
        try {
          stream(reads_[i]);
        } catch (const c10::Error& e) {
          // Only an I/O error gets here (the headers, sizes and shapes were checked in phase 1).
          TORCH_CHECK(false, fsdp::detail::message_of(e), " (rank ", rank_, "; ", i, " of the ", reads_.size(),
                      " tensor pieces of this rank were loaded before it: the state dict is partly loaded. Fix: ",
                      "restore the file and load again)");
        }
      }
    }
    for (auto& [k, v] : values_) std::get<Value>(sd.at(k)).json = std::move(v);
  }

  const LoadResult& result() const { return result_; }
  /// Reads and verifies the staged pieces, each once `prefetch` (if any) has it in the page cache; part
  /// of phase 1.
  void read(detail::CooperativePrefetch* prefetch) { read_pending(prefetch); }
  /// Stateful objects whose per-rank Values came as every saving rank's (another world size).
  const std::set<std::string>& resharded() const { return resharded_; }
  int saved_world_size() const { return info_.world_size; }

 private:
  struct Copy {
    torch::Tensor dst;  // a box of a destination (aliases the model's shard, an optimizer tensor, ...)
    torch::Tensor src;  // its verified bytes, a view of a mapped file
  };
  /// A piece to read: box `ov` of chunk `chunk`, into `dst` (streamed in phase 3 for checkpoints without
  /// checksums, staged by read_pending() in phase 1 otherwise).
  struct Read {
    torch::Tensor dst;  // the box of the destination
    std::string fqn;
    const ChunkInfo* chunk;
    Overlap ov;
    torch::ScalarType dtype;  // the file's
  };

  static CheckpointInfo read_info_of_rank(const std::string& dir, const char* api, int rank) {
    try {
      return read_info(dir, api, nullptr);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, fsdp::detail::message_of(e), " (rank ", rank, ")");
    }
  }

  /// Reads `r` into its destination (see the top of this file).
  void stream(const Read& r) {
    const ChunkInfo& c = *r.chunk;
    auto it = open_.find(c.file);
    if (it == open_.end()) {
      it = open_.emplace(c.file, detail::File::open_read((fs::path(info_.dir) / c.file).string(), api_)).first;
    }
    const detail::File& file = it->second;
    const std::string what = "'" + r.fqn + "' (rank " + std::to_string(rank_) + ")";
    const int64_t es = static_cast<int64_t>(c10::elementSize(r.dtype));
    if (r.dst.device().is_cpu() && r.dst.scalar_type() == r.dtype && r.dst.is_contiguous()) {
      // Straight into the destination: no extra memory.
      result_.bytes_read += read_box(file, c, r.ov.lo, r.ov.len, es, static_cast<char*>(r.dst.data_ptr()), what);
      r.dst.unsafeGetTensorImpl()->bump_version();  // as copy_ would: autograd sees the change
      return;
    }
    if (r.ov.lo.empty()) {  // a scalar
      auto buf = torch::empty({}, torch::TensorOptions().dtype(r.dtype));
      result_.bytes_read += read_box(file, c, r.ov.lo, r.ov.len, es, static_cast<char*>(buf.data_ptr()), what);
      r.dst.copy_(buf);
      return;
    }
    // Through a staging buffer (another dtype, device or a non-contiguous destination), in slabs of rows.
    const int64_t row_bytes = es * numel_of(std::vector<int64_t>(r.ov.len.begin() + 1, r.ov.len.end()));
    const int64_t rows = std::max<int64_t>(1, stage_bytes.load() / std::max<int64_t>(row_bytes, 1));
    for (int64_t r0 = 0; r0 < r.ov.len[0]; r0 += rows) {
      const int64_t n = std::min(rows, r.ov.len[0] - r0);
      auto lo = r.ov.lo, len = r.ov.len;
      lo[0] += r0;
      len[0] = n;
      auto buf = torch::empty(len, torch::TensorOptions().dtype(r.dtype));
      result_.bytes_read += read_box(file, c, lo, len, es, static_cast<char*>(buf.data_ptr()), what);
      r.dst.narrow(0, r0, n).copy_(buf);  // converts the dtype (as PyTorch's Tensor.copy_) and the device
    }
  }

  /// The first file holding `t` (for messages), or "(no file)" when all of its files are missing.
  static std::string first_file(const TensorInfo& t) { return t.chunks.empty() ? "(no file)" : t.chunks[0].file; }

  [[noreturn]] void refuse_unreadable(const std::string& key) const {
    TORCH_CHECK(false, api_, ": '", key, "' in ", info_.dir, " cannot be loaded: ", info_.unreadable.at(key), " (rank ",
                rank_, "). Fix: remove '", key, "' from the state dict (with LoadOptions().strict(false) to skip it) ",
                "and restore it another way");
  }

  void stage_value(const std::string& key) {
    const char* api = api_;
    if (auto it = info_.values.find(key); it != info_.values.end()) {
      values_.emplace_back(key, it->second);
    } else if (auto pr = info_.per_rank_values.find(key); pr != info_.per_rank_values.end()) {
      if (info_.world_size != world_ && stateful_keys_ && stateful_keys_->count(key)) {
        // Per-rank state of a Stateful that reshards itself: every saving rank's value, for the object.
        const auto& [object, reshards] = stateful_keys_->at(key);
        TORCH_CHECK(reshards, api, ": '", key, "' is per-rank state of the Stateful '", object, "', saved by ", info_.world_size, " ranks in ", info_.dir,
                    ", but this job has ", world_, " (rank ", rank_, ") and the object does not reshard ",
                    "(reshardable() is false). Fix: load on ", info_.world_size, " ranks, or implement ",
                    "Stateful::reshardable and load_state_dict_resharded");
        values_.emplace_back(key, nlohmann::json(pr->second));
        resharded_.insert(object);
        return;
      }
      TORCH_CHECK(info_.world_size == world_ && static_cast<int>(pr->second.size()) == world_, api, ": '", key,
                  "' is per-rank state saved by ", info_.world_size, " ranks in ", info_.dir, ", but this job has ",
                  world_, " (rank ", rank_, "): per-rank state cannot be resharded to another world size. Fix: load on ",
                  info_.world_size, " ranks, or remove '", key, "' from the state dict (and restore it another way)");
      values_.emplace_back(key, pr->second[static_cast<size_t>(rank_)]);
    } else if (info_.unreadable.count(key)) {
      refuse_unreadable(key);
    } else if (auto t = info_.tensors.find(key); t != info_.tensors.end()) {
      // PyTorch keeps some counters as one-element tensors (Adam's `step` is a float32 scalar) where
      // libfsdp's state dict holds a number: such a tensor loads into the Value as that number.
      TORCH_CHECK(fsdp::detail::numel_of(t->second.sizes) == 1, api, ": '", key,
                  "' is a Value in the state dict but a tensor of shape ", shape_str(t->second.sizes), " in ", info_.dir,
                  " (rank ", rank_, ")");
      values_.emplace_back(key, number_of(read_tensor(info_, key), std::get<Value>(*sd_value_).json));
    } else {
      result_.missing_keys.push_back(key);
    }
  }

  void stage_tensor(const std::string& key, const StateDictValue& v) {
    const char* api = api_;
    torch::Tensor dst;
    std::vector<int64_t> global, offsets;
    if (const auto* d = std::get_if<DTensor>(&v)) {
      dst = d->to_local();
      global = d->sizes();
      offsets = d->local_offsets();
    } else {
      dst = std::get<torch::Tensor>(v);
      TORCH_CHECK(dst.defined(), api, ": '", key, "' is an undefined tensor in the state dict (rank ", rank_, ")");
      global = dst.sizes().vec();
      offsets.assign(global.size(), 0);
    }
    if (info_.unreadable.count(key)) refuse_unreadable(key);
    auto it = info_.tensors.find(key);
    if (it == info_.tensors.end()) {
      TORCH_CHECK(!info_.values.count(key) && !info_.per_rank_values.count(key),
                  api, ": '", key, "' is a ",
                  kind_name(v), " in the state dict but a Value in ", info_.dir, " (rank ", rank_, ")");
      result_.missing_keys.push_back(key);
      return;
    }
    const TensorInfo& t = it->second;
    TORCH_CHECK(t.sizes == global, api, ": '", key, "' has shape ", shape_str(t.sizes), " in ", info_.dir, " (e.g. ",
                first_file(t), ") but ", shape_str(global), " in the state dict (rank ", rank_,
                "). Fix: load into a model of the configuration that was saved");
    if (stream_) {
      // Plain safetensors files (a Hugging Face checkpoint in bf16, a model in fp32): floating-point
      // data converts on load, as Tensor.copy_ does in PyTorch's HuggingFaceStorageReader (round to
      // nearest even when narrowing). Integer and bool data must match: converting them is a bug.
      TORCH_CHECK(t.dtype == dst.scalar_type() ||
                      (c10::isFloatingType(t.dtype) && c10::isFloatingType(dst.scalar_type())),
                  api, ": '", key, "' has dtype ", t.dtype, " in ", info_.dir, "/", first_file(t), " but ",
                  dst.scalar_type(), " in the state dict (rank ", rank_, "): only floating-point data converts on ",
                  "load. Fix: give the state dict's tensor dtype ", t.dtype);
    } else {
      TORCH_CHECK(t.dtype == dst.scalar_type(), api, ": '", key, "' has dtype ", t.dtype, " in ", info_.dir, " (e.g. ",
                  first_file(t), ") but ", dst.scalar_type(), " in the state dict (rank ", rank_,
                  "). Fix: build the model with dtype ", t.dtype, " to load it, then convert");
    }
    auto problem = coverage_problem(t, offsets, dst.sizes().vec());
    TORCH_CHECK(problem.empty(), api, ": '", key, "' cannot be read from ", info_.dir, " (rank ", rank_, "): ", problem);
    if (dst.numel() == 0) return;
    const auto box = dst.sizes().vec();
    for (const auto& c : t.chunks) {
      auto ov = overlap_of(c, offsets, box);
      if (!ov) continue;
      if (stream_) {
        reads_.push_back({narrow_to(dst, offsets, *ov), key, &c, *ov, t.dtype});
      } else {
        pending_.push_back({narrow_to(dst, offsets, *ov), key, &c, *ov, t.dtype});
      }
    }
  }

  /// Reads and verifies what stage_tensor() found this rank needs, staging a view of the file's bytes per
  /// piece, once every entry has passed its checks (shapes, dtypes, coverage, strict keys): a load that
  /// is refused reads no data. The pieces are read in file order, file by file (a rank of a resharded
  /// load reads pieces of several files, which come per tensor otherwise).
  /// Not done, measured (issue 16, part 6; docs/BENCHMARKS.md "Checkpoint I/O"): asking the kernel for
  /// every range up front (MADV_WILLNEED whole, or in 512 KiB-4 MiB windows; MADV_SEQUENTIAL; pread into a
  /// scratch buffer) made the disk's requests smaller and the loads no faster than the read-around of
  /// the page faults below.
  void read_pending(detail::CooperativePrefetch* prefetch) {
    struct Range {
      int64_t begin, end;  // bytes of the file
      size_t piece;
    };
    std::map<std::string, std::vector<Range>> by_file;
    for (size_t i = 0; i < pending_.size(); ++i) {
      const Read& p = pending_[i];
      const auto r = chunk_range(info_, *p.chunk, p.fqn, p.dtype, p.ov, options_.verify_checksums(), api_);
      by_file[p.chunk->file].push_back({p.chunk->file_offset + r.begin, p.chunk->file_offset + r.end, i});
    }
    copies_.reserve(copies_.size() + pending_.size());
    for (auto& [name, ranges] : by_file) {
      std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
      for (const auto& r : ranges) {
        const Read& p = pending_[r.piece];
        if (prefetch) prefetch->wait_for(name, r.end);
        copies_.push_back({p.dst, chunk_view(info_, *p.chunk, p.fqn, p.dtype, p.ov, options_.verify_checksums(),
                                             files_, api_, &result_.bytes_read)});
      }
    }
    pending_.clear();
  }

  void check_strict_missing() const {
    const char* api = api_;
    TORCH_CHECK(result_.missing_keys.empty(), api, ": ", result_.missing_keys.size(),
                " key(s) of the state dict are not in ", info_.dir, " (rank ", rank_, "): ", list_keys(result_.missing_keys),
                ". Fix: load the checkpoint this state dict's model was saved to, or pass LoadOptions().strict(false) to ",
                "leave them unchanged");
  }

  /// The number a one-element tensor holds, as JSON: an integer for integer dtypes, and for a float
  /// with an integral value when the Value it replaces holds an integer (a step counter stays one).
  static nlohmann::json number_of(const torch::Tensor& t, const nlohmann::json& current) {
    auto s = t.reshape({}).cpu();
    if (s.scalar_type() == torch::kBool) return s.item<bool>();
    if (c10::isIntegralType(s.scalar_type(), /*includeBool=*/false)) return s.item<int64_t>();
    TORCH_CHECK(!c10::isComplexType(s.scalar_type()), "dcp::load: a complex tensor cannot load into a Value");
    const double d = s.to(torch::kFloat64).item<double>();
    if (current.is_number_integer() && std::nearbyint(d) == d && std::abs(d) < 9.0e15) return static_cast<int64_t>(d);
    return d;
  }

  const StateDictValue* sd_value_ = nullptr;  // the entry stage_value() is staging
  // Keys of Stateful objects' per-rank Values -> the object's key, and whether it reshards.
  const std::map<std::string, std::pair<std::string, bool>>* stateful_keys_;
  std::set<std::string> resharded_;
  CheckpointInfo info_;
  FileCache files_;
  const LoadOptions& options_;
  int rank_, world_;
  const char* api_;
  bool stream_;  // no metadata file: no checksums, the data is read in phase 3
  std::vector<Copy> copies_;
  std::vector<Read> reads_;
  std::vector<Read> pending_;  // pieces of a checkpoint with checksums, read by read_pending()
  std::map<std::string, detail::File> open_;  // files of the streamed reads, by name
  std::vector<std::pair<std::string, nlohmann::json>> values_;
  LoadResult result_;
};

}  // namespace

void detail::set_load_stage_bytes(int64_t bytes) { stage_bytes = bytes > 0 ? bytes : kStageBytes; }
void detail::set_cooperative_prefetch(bool on) { prefetch_on = on; }

LoadResult load(StateDict& state_dict, const std::string& dir, const LoadOptions& options) {
  const char* api = "dcp::load";
  auto group = detail::resolve_group(state_dict, options.group());
  detail::Coordinator coord(group, api);
  std::optional<LoadPlan> plan;
  // Stateful objects: their entries are loaded with the others (in `work`), then handed back.
  std::vector<StateDict> subs;
  std::map<std::string, std::pair<std::string, bool>> stateful_keys;
  StateDict work;
  std::string error;
  try {
    work = detail::with_stateful_entries(state_dict, api, &subs);
  } catch (const std::exception& e) {
    error = fsdp::detail::message_of(e);
  }
  for (size_t i = 0; i < subs.size(); ++i) {
    const auto& [key, obj] = state_dict.stateful()[i];
    for (const auto& [k, v] : subs[i]) {
      if (const auto* val = std::get_if<Value>(&v); val && val->per_rank) {
        stateful_keys[key + "." + k] = {key, obj->reshardable()};
      }
    }
  }
  auto validate = [&] {  // see [Note: validate, agree, apply]
    // Every rank takes part in the prefetch exchange, even one whose checks failed (with nothing to
    // read), so that no rank waits for another; its error is raised after it.
    std::exception_ptr failed;
    try {
      TORCH_CHECK(error.empty(), error);
      plan.emplace(dir, options, coord.rank(), coord.world(), api, &stateful_keys);
      plan->stage(state_dict.stateful().empty() ? state_dict : work);
    } catch (...) {
      failed = std::current_exception();
    }
    // Strict: the checkpoint's keys that no rank asked for (each rank's dict may hold only part of the keys).
    std::vector<std::string> unasked = plan && !failed ? plan->result().unexpected_keys : std::vector<std::string>{};
    if (options.strict()) unasked = detail::unasked_by_every_rank(coord, unasked, failed || !plan);
    if (!failed && plan) {
      try {
        plan->check_strict_unexpected(unasked);
      } catch (...) {
        failed = std::current_exception();
      }
    }
    std::optional<detail::CooperativePrefetch> prefetch;
    if (!coord.single() && cooperative_prefetch_enabled()) {
      prefetch.emplace(coord, plan ? plan->dir() : dir, failed ? detail::FileRanges() : plan->needed());
    }
    if (failed) std::rethrow_exception(failed);
    plan->read(prefetch ? &*prefetch : nullptr);
    if (prefetch) prefetch->finish();
  };
  fsdp::detail::validate_agree_apply(api, validate, coord.agreement(),
                                     [&] { plan->apply(state_dict.stateful().empty() ? state_dict : work); });
  if (state_dict.stateful().empty()) return plan->result();
  // The caller's own entries: tensors were loaded in place; Values come back from `work`.
  for (auto& [k, v] : state_dict) {
    if (std::holds_alternative<Value>(v)) v = work.at(k);
  }
  // The objects' own code may throw (a position past the data, a version it does not know). Then every
  // rank raises that error together instead of one rank failing while the others train on: the ranks
  // exchange their outcomes once (only loads with Stateful objects pay the round trip).
  std::string failed;
  for (size_t i = 0; i < subs.size() && failed.empty(); ++i) {
    const auto& [key, obj] = state_dict.stateful()[i];
    try {
      StateDict loaded = work.with_prefix(key + ".");
      StateDict sub;  // in the object's own order
      for (const auto& [k, _] : subs[i]) sub.insert_or_assign(k, loaded.at(k));
      if (plan->resharded().count(key)) {
        obj->load_state_dict_resharded(sub, plan->saved_world_size(), coord.world(), coord.rank());
      } else {
        obj->load_state_dict(sub);
      }
    } catch (const std::exception& e) {
      failed = "the Stateful '" + key + "' failed to load its state: " + fsdp::detail::message_of(e);
    }
  }
  if (!subs.empty()) {
    const auto reports = coord.gather("stateful", failed, "to load its Stateful objects");
    std::string verdict;
    for (size_t r = 0; r < reports.size() && verdict.empty(); ++r) {
      if (!reports[r].empty()) verdict = std::string(api) + " of " + dir + ": rank " + std::to_string(r) + ": " + reports[r];
    }
    verdict = coord.broadcast("stateful_verdict", verdict, "to collect every rank's Stateful objects");
    TORCH_CHECK(verdict.empty(), verdict,
                " (the tensors and Values were loaded; the Stateful objects before it on that rank too. Fix the "
                "object's load_state_dict, or the checkpoint, and load again)");
  }
  return plan->result();
}

}  // namespace fsdp::dcp
