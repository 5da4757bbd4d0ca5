// Reading checkpoints: load with resharding, verify, read_tensor and consolidate. The checkpoint's
// description (inspect) is read by metadata.cpp.
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
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <map>
#include <set>

#include "checkpoint/coordinator.h"
#include "checkpoint/metadata.h"
#include "checkpoint/safetensors.h"
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

/// CRC-32Cs of a chunk's data blocks (empty when the checkpoint has none).
const nlohmann::json* chunk_crcs(const CheckpointInfo& info, const ChunkInfo& c, const std::string& fqn) {
  if (!info.metadata.is_object()) return nullptr;
  const auto& files = info.metadata["files"];
  if (!files.contains(c.file)) return nullptr;
  const auto& t = files[c.file]["tensor_crc32c"];
  if (!t.contains(fqn)) return nullptr;
  return &t[fqn];
}

int64_t block_bytes_of(const CheckpointInfo& info) {
  if (!info.metadata.is_object() || !info.metadata.contains("checksum")) return 0;
  return info.metadata["checksum"].value("block_bytes", int64_t(0));
}

/// A read-only mapping of a whole checkpoint file. Loads stage what they read here, in the page cache,
/// rather than in a copy: nothing is written to the destinations before everything is verified, and
/// no anonymous memory has to be allocated (page faults of fresh memory cost as much as the disk).
struct Mapping {
  std::string path;
  const char* base = nullptr;
  size_t len = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (base) ::munmap(const_cast<char*>(base), len);
  }
};

/// Mapped files of one read, by name.
class FileCache {
 public:
  explicit FileCache(std::string dir, const char* api) : dir_(std::move(dir)), api_(api) {}
  std::shared_ptr<Mapping> get(const std::string& name) {
    auto it = files_.find(name);
    if (it != files_.end()) return it->second;
    auto m = std::make_shared<Mapping>();
    m->path = dir_ + "/" + name;
    auto f = detail::File::open_read(m->path, api_);
    m->len = static_cast<size_t>(f.size());
    if (m->len > 0) {
      void* p = ::mmap(nullptr, m->len, PROT_READ, MAP_SHARED, f.fd(), 0);
      TORCH_CHECK(p != MAP_FAILED, api_, ": cannot map ", m->path, ": ", detail::errno_text(errno));
      m->base = static_cast<const char*>(p);
    }
    files_.emplace(name, m);
    return m;
  }

 private:
  std::string dir_;
  const char* api_;
  std::map<std::string, std::shared_ptr<Mapping>> files_;
};

/// The box of the global tensor where chunk `c` and the box [box_off, box_off + box_size) overlap.
struct Overlap {
  std::vector<int64_t> lo, len;
};
std::optional<Overlap> overlap_of(const ChunkInfo& c, const std::vector<int64_t>& box_off,
                                  const std::vector<int64_t>& box_size) {
  Overlap o;
  for (size_t d = 0; d < c.sizes.size(); ++d) {
    int64_t a = std::max(c.offsets[d], box_off[d]);
    int64_t b = std::min(c.offsets[d] + c.sizes[d], box_off[d] + box_size[d]);
    if (b <= a) return std::nullopt;
    o.lo.push_back(a);
    o.len.push_back(b - a);
  }
  return o;
}

/// Where overlap `ov` of chunk `c` (of tensor `fqn`) lies in the chunk's data: its first and last
/// elements in the chunk's C order, and the bytes [begin, end) of the chunk to read for them (widened to
/// whole checksum blocks when `verify` and the checkpoint has checksums; `crcs` and `block` then say
/// which).
struct ChunkRange {
  std::vector<int64_t> strides;  // the chunk's C-order strides
  int64_t first = 0, last = 0;   // elements
  int64_t begin = 0, end = 0;    // bytes within the chunk's data
  const nlohmann::json* crcs = nullptr;
  int64_t block = 0;
};
ChunkRange chunk_range(const CheckpointInfo& info, const ChunkInfo& c, const std::string& fqn, torch::ScalarType dtype,
                       const Overlap& ov, bool verify, const char* api) {
  const size_t nd = c.sizes.size();
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  ChunkRange r;
  r.strides.assign(nd, 1);
  for (int64_t d = static_cast<int64_t>(nd) - 2; d >= 0; --d) r.strides[d] = r.strides[d + 1] * c.sizes[d + 1];
  for (size_t d = 0; d < nd; ++d) {
    r.first += (ov.lo[d] - c.offsets[d]) * r.strides[d];
    r.last += (ov.lo[d] - c.offsets[d] + ov.len[d] - 1) * r.strides[d];
  }
  r.begin = r.first * es;
  r.end = (r.last + 1) * es;
  r.crcs = verify ? chunk_crcs(info, c, fqn) : nullptr;
  r.block = r.crcs ? block_bytes_of(info) : 0;
  if (r.crcs) {
    TORCH_CHECK(r.block > 0 && r.block % es == 0, api, ": ", info.dir, "/", kMetadataFileName,
                " has an invalid checksum block size");
    r.begin = r.begin / r.block * r.block;
    r.end = std::min(c.nbytes, (r.end + r.block - 1) / r.block * r.block);
  }
  return r;
}

/// The elements of overlap `ov` of chunk `c` (of tensor `fqn`), as a strided tensor over the mapped
/// file. Only the chunk's bytes of chunk_range() are touched; they are read from the disk here
/// (MADV_POPULATE_READ, so that an I/O error is an exception, not a SIGBUS later) and verified.
/// Adds the bytes it reads from the file to `*bytes_read` when given.
torch::Tensor chunk_view(const CheckpointInfo& info, const ChunkInfo& c, const std::string& fqn, torch::ScalarType dtype,
                         const Overlap& ov, bool verify, FileCache& files, const char* api,
                         int64_t* bytes_read = nullptr) {
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  const ChunkRange r = chunk_range(info, c, fqn, dtype, ov, verify, api);
  const auto& strides = r.strides;
  const int64_t first = r.first, last = r.last, begin = r.begin, end = r.end, block = r.block;
  const nlohmann::json* crcs = r.crcs;
  auto m = files.get(c.file);
  TORCH_CHECK(static_cast<int64_t>(m->len) >= c.file_offset + c.nbytes, api, ": ", m->path,
              " is truncated: reading '", fqn, "' needs bytes up to ", c.file_offset + c.nbytes, " but the file has ",
              m->len);
  const char* data = m->base + c.file_offset;  // the chunk's first byte
  if (bytes_read) *bytes_read += end - begin;
  {
    static const int64_t page = ::sysconf(_SC_PAGESIZE);
    int64_t a = (c.file_offset + begin) / page * page;
    int64_t n = c.file_offset + end - a;
    if (n > 0 && ::madvise(const_cast<char*>(m->base) + a, static_cast<size_t>(n), MADV_POPULATE_READ) != 0) {
      int err = errno;
      TORCH_CHECK(err == EINVAL || err == ENOSYS, api, ": reading '", fqn, "' from ", m->path, " failed: ",
                  detail::errno_text(err));
    }
  }
  if (crcs) {
    auto got = detail::block_crcs(data + begin, static_cast<size_t>(end - begin), block);
    for (size_t i = 0; i < got.size(); ++i) {
      const size_t bi = static_cast<size_t>(begin / block) + i;
      const int64_t b = static_cast<int64_t>(bi) * block;
      TORCH_CHECK(bi < crcs->size() && got[i] == (*crcs)[bi].get<uint32_t>(), api, ": checksum mismatch in ", m->path,
                  " reading '", fqn, "' (bytes ", c.file_offset + b, "-", c.file_offset + std::min(b + block, c.nbytes),
                  " of the file): the file was modified or damaged after it was written; restore it or use another ",
                  "checkpoint");
    }
  }
  const auto opts = torch::TensorOptions().dtype(dtype);
  if (reinterpret_cast<uintptr_t>(data) % static_cast<uintptr_t>(es) != 0) {
    // Misaligned for its dtype (a preceding tensor of an odd size): copy the run out.
    auto buf = torch::empty({last - first + 1}, opts);
    std::memcpy(buf.data_ptr(), data + first * es, static_cast<size_t>((last - first + 1) * es));
    return buf.as_strided(ov.len, strides, 0);
  }
  return torch::from_blob(const_cast<char*>(data), {c.nbytes / es}, [m](void*) {}, opts)
      .as_strided(ov.len, strides, first);
}

/// `dst` (holding the box at box_off of the global tensor) narrowed to the overlap `ov`.
torch::Tensor narrow_to(const torch::Tensor& dst, const std::vector<int64_t>& box_off, const Overlap& ov) {
  torch::Tensor v = dst;
  for (size_t d = 0; d < ov.lo.size(); ++d) v = v.narrow(static_cast<int64_t>(d), ov.lo[d] - box_off[d], ov.len[d]);
  return v;
}

/// Checks that the chunks of `fqn` cover the box exactly once. Returns the problem or "".
std::string coverage_problem(const TensorInfo& t, const std::vector<int64_t>& box_off, const std::vector<int64_t>& box_size) {
  int64_t covered = 0;
  std::vector<const ChunkInfo*> hits;
  for (const auto& c : t.chunks) {
    int64_t v = 1;
    for (size_t d = 0; d < c.sizes.size(); ++d) {
      int64_t a = std::max(c.offsets[d], box_off[d]);
      int64_t b = std::min(c.offsets[d] + c.sizes[d], box_off[d] + box_size[d]);
      v *= std::max<int64_t>(0, b - a);
    }
    if (v > 0) hits.push_back(&c);
    covered += v;
  }
  const int64_t need = numel_of(box_size);
  if (covered == need) return "";
  if (covered < need) {
    return "its chunks cover " + std::to_string(covered) + " of the " + std::to_string(need) +
           " elements needed here (box at " + shape_str(box_off) + " of size " + shape_str(box_size) +
           "): a file of the checkpoint is missing";
  }
  return "chunks overlap in the box at " + shape_str(box_off) + " of size " + shape_str(box_size) +
         " (e.g. in " + hits[0]->file + "): the checkpoint is inconsistent";
}

/// Largest staging buffer of a streamed read (a box is staged in slabs of rows of at most this size,
/// or one row when a row is larger): bounds the extra memory of a load whatever the tensor's size.
constexpr int64_t kStageBytes = int64_t(64) << 20;
std::atomic<int64_t> stage_bytes{kStageBytes};  // tests lower it (detail::set_load_stage_bytes)

/// Reads the box [lo, lo + len) (global coordinates) of chunk `c` from `file`, in C order, into `out`
/// (contiguous, the file's dtype of `es` bytes per element). The trailing dims the box spans in full
/// make each run contiguous in the file: one pread for a box of whole rows (Shard(0)), one per run
/// otherwise (e.g. a row of a Shard(1) box). Returns the bytes read.
int64_t read_box(const detail::File& file, const ChunkInfo& c, const std::vector<int64_t>& lo,
                 const std::vector<int64_t>& len, int64_t es, char* out, const std::string& what) {
  const size_t nd = c.sizes.size();
  if (nd == 0) {
    file.pread_exact(out, static_cast<size_t>(es), c.file_offset, what);
    return es;
  }
  std::vector<int64_t> strides(nd, 1);  // the chunk's C-order strides
  for (int64_t d = static_cast<int64_t>(nd) - 2; d >= 0; --d) strides[d] = strides[d + 1] * c.sizes[d + 1];
  size_t j = nd - 1;  // runs span dims j.. (all dims after j in full)
  while (j > 0 && len[j] == c.sizes[j]) --j;
  const int64_t run = len[j] * strides[j] * es;
  std::vector<int64_t> idx(j, 0);  // odometer over the dims before j
  int64_t done = 0;
  while (true) {
    int64_t elem = (lo[j] - c.offsets[j]) * strides[j];
    for (size_t d = 0; d < j; ++d) elem += (lo[d] - c.offsets[d] + idx[d]) * strides[d];
    file.pread_exact(out + done, static_cast<size_t>(run), c.file_offset + elem * es, what);
    done += run;
    size_t d = j;
    while (d > 0 && ++idx[d - 1] == len[d - 1]) idx[--d] = 0;
    if (d == 0) break;
  }
  return done;
}

/// Phase 1 of dcp::load on one rank: validates the state dict against the checkpoint and stages every
/// copy (views of verified file bytes) and Value, changing nothing.
class LoadPlan {
 public:
  LoadPlan(const std::string& dir, const LoadOptions& options, int rank, int world, const char* api)
      : info_(read_info_of_rank(dir, api, rank)), files_(info_.dir, api), options_(options), rank_(rank),
        world_(world), api_(api), stream_(!info_.metadata.is_object()) {
    for (const auto& f : info_.files) result_.bytes_read += f.header_bytes;
    if (!stream_) {
      std::error_code ec;
      auto n = fs::file_size(fs::path(info_.dir) / kMetadataFileName, ec);
      if (!ec) result_.bytes_read += static_cast<int64_t>(n);
    }
  }

  /// Stages every entry of `sd`, then checks the keys (strict). Throws on the first problem.
  void stage(const StateDict& sd) {
    std::set<std::string> seen;
    for (const auto& [key, v] : sd) {
      seen.insert(key);
      if (std::holds_alternative<Value>(v)) stage_value(key);
      else stage_tensor(key, v);
    }
    for (const auto& [k, _] : info_.tensors)
      if (!seen.count(k)) result_.unexpected_keys.push_back(k);
    for (const auto& [k, _] : info_.values)
      if (!seen.count(k)) result_.unexpected_keys.push_back(k);
    for (const auto& [k, _] : info_.per_rank_values)
      if (!seen.count(k)) result_.unexpected_keys.push_back(k);
    if (options_.strict()) check_strict();
    read_pending();
  }

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

  void stage_value(const std::string& key) {
    const char* api = api_;
    if (auto it = info_.values.find(key); it != info_.values.end()) {
      values_.emplace_back(key, it->second);
    } else if (auto pr = info_.per_rank_values.find(key); pr != info_.per_rank_values.end()) {
      TORCH_CHECK(info_.world_size == world_ && static_cast<int>(pr->second.size()) == world_, api, ": '", key,
                  "' is per-rank state saved by ", info_.world_size, " ranks in ", info_.dir, ", but this job has ",
                  world_, " (rank ", rank_, "): per-rank state cannot be resharded to another world size. Fix: load on ",
                  info_.world_size, " ranks, or remove '", key, "' from the state dict (and restore it another way)");
      values_.emplace_back(key, pr->second[static_cast<size_t>(rank_)]);
    } else if (info_.tensors.count(key)) {
      TORCH_CHECK(false, api, ": '", key, "' is a Value in the state dict but a tensor in ", info_.dir, " (rank ", rank_,
                  ")");
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
    auto it = info_.tensors.find(key);
    if (it == info_.tensors.end()) {
      TORCH_CHECK(!info_.values.count(key) && !info_.per_rank_values.count(key), api, ": '", key, "' is a ",
                  kind_name(v), " in the state dict but a Value in ", info_.dir, " (rank ", rank_, ")");
      result_.missing_keys.push_back(key);
      return;
    }
    const TensorInfo& t = it->second;
    TORCH_CHECK(t.sizes == global, api, ": '", key, "' has shape ", shape_str(t.sizes), " in ", info_.dir, " (e.g. ",
                t.chunks[0].file, ") but ", shape_str(global), " in the state dict (rank ", rank_,
                "). Fix: load into a model of the configuration that was saved");
    if (stream_) {
      // Plain safetensors files (a Hugging Face checkpoint in bf16, a model in fp32): floating-point
      // data converts on load, as Tensor.copy_ does in PyTorch's HuggingFaceStorageReader (round to
      // nearest even when narrowing). Integer and bool data must match: converting them is a bug.
      TORCH_CHECK(t.dtype == dst.scalar_type() ||
                      (c10::isFloatingType(t.dtype) && c10::isFloatingType(dst.scalar_type())),
                  api, ": '", key, "' has dtype ", t.dtype, " in ", info_.dir, "/", t.chunks[0].file, " but ",
                  dst.scalar_type(), " in the state dict (rank ", rank_, "): only floating-point data converts on ",
                  "load. Fix: give the state dict's tensor dtype ", t.dtype);
    } else {
      TORCH_CHECK(t.dtype == dst.scalar_type(), api, ": '", key, "' has dtype ", t.dtype, " in ", info_.dir, " (e.g. ",
                  t.chunks[0].file, ") but ", dst.scalar_type(), " in the state dict (rank ", rank_,
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
  void read_pending() {
    struct Range {
      int64_t begin;  // byte of the file
      size_t piece;
    };
    std::map<std::string, std::vector<Range>> by_file;
    for (size_t i = 0; i < pending_.size(); ++i) {
      const Read& p = pending_[i];
      const auto r = chunk_range(info_, *p.chunk, p.fqn, p.dtype, p.ov, options_.verify_checksums(), api_);
      by_file[p.chunk->file].push_back({p.chunk->file_offset + r.begin, i});
    }
    copies_.reserve(copies_.size() + pending_.size());
    for (auto& [name, ranges] : by_file) {
      std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
      for (const auto& r : ranges) {
        const Read& p = pending_[r.piece];
        copies_.push_back({p.dst, chunk_view(info_, *p.chunk, p.fqn, p.dtype, p.ov, options_.verify_checksums(),
                                             files_, api_, &result_.bytes_read)});
      }
    }
    pending_.clear();
  }

  void check_strict() const {
    const char* api = api_;
    TORCH_CHECK(result_.missing_keys.empty(), api, ": ", result_.missing_keys.size(),
                " key(s) of the state dict are not in ", info_.dir, " (rank ", rank_, "): ", list_keys(result_.missing_keys),
                ". Fix: load the checkpoint this state dict's model was saved to, or pass LoadOptions().strict(false) to ",
                "leave them unchanged");
    TORCH_CHECK(result_.unexpected_keys.empty(), api, ": ", info_.dir, " holds ", result_.unexpected_keys.size(),
                " key(s) the state dict does not (rank ", rank_, "): ", list_keys(result_.unexpected_keys),
                ". Fix: add them to the state dict (e.g. get_state_dict(model, optimizer) for a checkpoint with ",
                "optimizer state), or pass LoadOptions().strict(false) to ignore them");
  }

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

LoadResult load(StateDict& state_dict, const std::string& dir, const LoadOptions& options) {
  const char* api = "dcp::load";
  auto group = detail::resolve_group(state_dict, options.group());
  detail::Coordinator coord(group, api);
  std::optional<LoadPlan> plan;
  auto validate = [&] {  // see [Note: validate, agree, apply]
    plan.emplace(dir, options, coord.rank(), coord.world(), api);
    plan->stage(state_dict);
  };
  fsdp::detail::validate_agree_apply(api, validate, coord.agreement(), [&] { plan->apply(state_dict); });
  return plan->result();
}

torch::Tensor read_tensor(const CheckpointInfo& info, const std::string& fqn) {
  const char* api = "dcp::read_tensor";
  auto it = info.tensors.find(fqn);
  TORCH_CHECK(it != info.tensors.end(), api, ": ", info.dir, " holds no tensor '", fqn, "'");
  const auto& t = it->second;
  std::vector<int64_t> zeros(t.sizes.size(), 0);
  auto problem = coverage_problem(t, zeros, t.sizes);
  TORCH_CHECK(problem.empty(), api, ": '", fqn, "' in ", info.dir, ": ", problem);
  auto out = torch::empty(t.sizes, torch::TensorOptions().dtype(t.dtype));
  FileCache files(info.dir, api);
  for (const auto& c : t.chunks) {
    if (auto ov = overlap_of(c, zeros, t.sizes)) {
      narrow_to(out, zeros, *ov).copy_(chunk_view(info, c, fqn, t.dtype, *ov, /*verify=*/true, files, api));
    }
  }
  return out;
}

std::vector<std::string> verify(const std::string& dir) {
  const char* api = "dcp::verify";
  std::vector<std::string> problems;
  CheckpointInfo info;
  try {
    info = read_info(dir, api, &problems);
  } catch (const c10::Error& e) {
    problems.push_back(e.what_without_backtrace());
    return problems;
  }
  if (info.metadata.is_object()) {
    // Files nobody listed: PyTorch's reader would read them too.
    std::set<std::string> listed;
    for (const auto& [name, _] : info.metadata["files"].items()) listed.insert(name);
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(info.dir, ec)) {
      auto n = e.path().filename().string();
      if (n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0 && !listed.count(n))
        problems.push_back(std::string(api) + ": " + info.dir + "/" + n + " is not listed in the metadata (a stray file: "
                           "PyTorch's HuggingFaceStorageReader would read it too)");
    }
  }
  for (const auto& [fqn, t] : info.tensors) {
    // Exactly-once coverage: pairwise disjoint chunks whose volumes sum to the tensor's.
    std::vector<int64_t> zeros(t.sizes.size(), 0);
    auto problem = coverage_problem(t, zeros, t.sizes);
    for (size_t i = 0; problem.empty() && i < t.chunks.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        const auto &a = t.chunks[i], &b = t.chunks[j];
        bool overlap = numel_of(a.sizes) > 0 && numel_of(b.sizes) > 0;
        for (size_t d = 0; overlap && d < a.sizes.size(); ++d)
          overlap = a.offsets[d] < b.offsets[d] + b.sizes[d] && b.offsets[d] < a.offsets[d] + a.sizes[d];
        if (overlap) {
          problem = "its chunks in " + a.file + " and " + b.file + " overlap";
          break;
        }
      }
    }
    if (!problem.empty()) problems.push_back(std::string(api) + ": '" + fqn + "': " + problem);
    // Checksums: read every chunk whole.
    FileCache files(info.dir, api);
    for (const auto& c : t.chunks) {
      if (c.nbytes == 0) continue;
      try {
        chunk_view(info, c, fqn, t.dtype, Overlap{c.offsets, c.sizes}, /*verify=*/true, files, api);
      } catch (const c10::Error& e) {
        problems.push_back(e.what_without_backtrace());
      }
    }
  }
  return problems;
}

std::vector<std::string> consolidate(const std::string& dir, const std::string& out_dir, const ConsolidateOptions& o) {
  const char* api = "dcp::consolidate";
  CheckpointInfo info = inspect(dir);
  struct Out {
    std::string fqn, name;
    const TensorInfo* t;
  };
  std::vector<Out> tensors;
  std::set<std::string> names;
  for (const auto& [fqn, t] : info.tensors) {
    if (fqn.compare(0, o.prefix().size(), o.prefix()) != 0) continue;
    std::string name = o.strip_prefix() ? fqn.substr(o.prefix().size()) : fqn;
    TORCH_CHECK(!name.empty() && names.insert(name).second, api, ": stripping '", o.prefix(), "' from '", fqn,
                "' gives an empty or duplicate name");
    tensors.push_back({fqn, name, &t});
  }
  TORCH_CHECK(!tensors.empty(), api, ": ", info.dir, " holds no tensor whose key starts with '", o.prefix(), "'");
  // Split into files of at most max_file_bytes (a larger tensor gets a file of its own).
  std::vector<std::vector<size_t>> groups(1);
  int64_t cur = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    int64_t n = numel_of(tensors[i].t->sizes) * static_cast<int64_t>(c10::elementSize(tensors[i].t->dtype));
    total += n;
    if (o.max_file_bytes() > 0 && !groups.back().empty() && cur + n > o.max_file_bytes()) {
      groups.emplace_back();
      cur = 0;
    }
    groups.back().push_back(i);
    cur += n;
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  TORCH_CHECK(!ec, api, ": cannot create ", out_dir, ": ", ec.message());
  std::vector<std::string> written;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (size_t g = 0; g < groups.size(); ++g) {
    char name[64];
    if (groups.size() == 1) std::snprintf(name, sizeof(name), "model.safetensors");
    else std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", g + 1, groups.size());
    std::vector<detail::WriteEntry> entries;
    for (auto i : groups[g]) {
      entries.push_back({tensors[i].name, tensors[i].t->dtype, tensors[i].t->sizes, std::nullopt});
      weight_map[tensors[i].name] = name;
    }
    const std::string path = (fs::path(out_dir) / name).string();
    detail::write_safetensors(
        path, entries, [&](size_t k) { return read_tensor(info, tensors[groups[g][k]].fqn); }, /*sharding_info=*/false,
        int64_t(1) << 20, /*do_fsync=*/true, api);
    written.push_back(path);
  }
  if (groups.size() > 1) {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = weight_map;
    const std::string path = (fs::path(out_dir) / "model.safetensors.index.json").string();
    detail::write_file_atomic(path, index.dump(2) + "\n", true, api);
    written.push_back(path);
  }
  return written;
}

}  // namespace fsdp::dcp
