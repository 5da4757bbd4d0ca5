// Reading checkpoints: inspect (metadata and headers), load with resharding, verify, read_tensor and
// consolidate.
//
// Resharding: a destination is a box of the global tensor (a DTensor's local piece, or a whole tensor).
// For each chunk of the checkpoint that overlaps it, the overlap is one run of the chunk's C-order
// elements from its first to its last element (exactly the overlap when it spans the trailing dims, as
// with Shard(0)); only that byte range of the file is read (widened to whole checksum blocks when
// checksums are verified). Files are memory-mapped: what a load reads stays in the page cache, verified,
// until every rank has read and verified everything; only then is it copied into the destinations.
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include <algorithm>
#include <filesystem>
#include <map>
#include <regex>
#include <set>

#include "checkpoint/coordinator.h"
#include "checkpoint/safetensors.h"
#include "fsdp/checkpoint.h"
#include "util.h"

namespace fsdp::dcp {

namespace fs = std::filesystem;

namespace {

using fsdp::detail::list_keys;
using fsdp::detail::numel_of;
using fsdp::detail::shape_str;

/// `dir`, or the folder a `latest` pointer file names when `dir` is that file.
std::string resolve_dir(const std::string& dir, const char* api) {
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  TORCH_CHECK(fs::exists(d), api, ": checkpoint folder ", d, " does not exist");
  if (fs::is_regular_file(d)) {
    auto parent = fs::path(d).parent_path();
    auto target = latest(parent.empty() ? "." : parent.string());
    TORCH_CHECK(target && fs::path(d).filename() == kLatestFileName, api, ": ", d,
                " is a file, not a checkpoint folder (nor a `latest` pointer)");
    TORCH_CHECK(fs::is_directory(*target), api, ": ", d, " names ", *target, ", which does not exist");
    return *target;
  }
  TORCH_CHECK(fs::is_directory(d), api, ": ", d, " is not a checkpoint folder");
  return d;
}

int rank_from_name(const std::string& name) {
  static const std::regex re("^shard-(\\d+)-model-\\d+-of-\\d+\\.safetensors$");
  std::smatch m;
  if (std::regex_match(name, m, re)) return std::stoi(m[1].str()) - 1;
  return -1;
}

/// Problems either throw (problems == null) or are collected.
struct Problems {
  std::vector<std::string>* out = nullptr;
  const char* api;
  void report(const std::string& msg) {
    if (!out) TORCH_CHECK(false, msg);
    out->push_back(msg);
  }
};

std::string tensors_in(const nlohmann::json& file_meta) {
  std::string s;
  size_t n = 0;
  if (file_meta.contains("tensor_crc32c")) {
    for (const auto& [k, v] : file_meta["tensor_crc32c"].items()) {
      if (n++ < 3) s += (s.empty() ? "'" : ", '") + k + "'";
    }
  }
  if (n > 3) s += ", ... (" + std::to_string(n) + " tensors)";
  return s.empty() ? "" : ", holding " + s;
}

CheckpointInfo read_info(const std::string& dir_arg, const char* api, std::vector<std::string>* problems_out) {
  Problems problems{problems_out, api};
  CheckpointInfo info;
  info.dir = resolve_dir(dir_arg, api);
  const fs::path dir = info.dir;
  const fs::path meta_path = dir / kMetadataFileName;
  std::vector<std::string> names;
  if (fs::exists(meta_path)) {
    std::string text = detail::read_small_file(meta_path.string(), api);
    try {
      info.metadata = nlohmann::json::parse(text);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, api, ": ", meta_path.string(), " is not valid JSON (truncated or damaged?): ", e.what());
    }
    const auto& m = info.metadata;
    TORCH_CHECK(m.is_object() && m.value("format", "") == "libfsdp-dcp", api, ": ", meta_path.string(),
                " is not libfsdp checkpoint metadata (format '", m.is_object() ? m.value("format", "") : "", "')");
    info.format = "libfsdp-dcp";
    info.version = m.value("version", 0);
    TORCH_CHECK(info.version >= 1 && info.version <= 1, api, ": ", meta_path.string(), " has format version ",
                info.version, "; this libfsdp reads version 1. Fix: use a newer libfsdp");
    try {
      info.world_size = m.at("world_size").get<int>();
      info.mesh_shape = m.at("mesh").at("shape").get<std::vector<int64_t>>();
      info.mesh_dim_names = m.at("mesh").at("dim_names").get<std::vector<std::string>>();
      for (const auto& [k, v] : m.at("values").items()) info.values[k] = v;
      for (const auto& [k, v] : m.at("per_rank_values").items()) info.per_rank_values[k] = v.get<std::vector<nlohmann::json>>();
      for (const auto& [name, f] : m.at("files").items()) names.push_back(name);
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, api, ": ", meta_path.string(), " is malformed: ", e.what());
    }
  } else {
    info.format = "safetensors";
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      auto n = e.path().filename().string();
      if (e.is_regular_file() && n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0) names.push_back(n);
    }
    std::sort(names.begin(), names.end());
    TORCH_CHECK(!names.empty(), api, ": ", dir.string(), " holds neither ", kMetadataFileName,
                " nor any *.safetensors file: not a checkpoint");
  }

  for (const auto& name : names) {
    const std::string path = (dir / name).string();
    const nlohmann::json fmeta = info.metadata.is_object() ? info.metadata["files"][name] : nlohmann::json();
    FileInfo fi;
    fi.name = name;
    fi.rank = fmeta.is_object() ? fmeta.value("rank", -1) : rank_from_name(name);
    fi.checksummed = fmeta.is_object() && fmeta.contains("header_crc32c");
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      problems.report(std::string(api) + ": " + path + " is missing: the checkpoint's metadata lists it (written by rank " +
                      std::to_string(fi.rank) + tensors_in(fmeta) + ")" +
                      ". The checkpoint is incomplete; restore the file or use another checkpoint");
      continue;
    }
    fi.bytes = static_cast<int64_t>(st.st_size);
    if (fmeta.is_object()) {
      const int64_t expect = fmeta.value("bytes", int64_t(-1));
      if (fi.bytes != expect) {
        problems.report(std::string(api) + ": " + path + (fi.bytes < expect ? " is truncated" : " has the wrong size") +
                        ": " + std::to_string(fi.bytes) + " bytes, but the checkpoint's metadata records " +
                        std::to_string(expect) + " (written by rank " + std::to_string(fi.rank) + tensors_in(fmeta) +
                        "). The file was damaged; restore it or use another checkpoint");
        continue;
      }
    }
    detail::Header h;
    try {
      auto f = detail::File::open_read(path, api);
      h = detail::read_header(f, fi.bytes, api);
    } catch (const c10::Error& e) {
      problems.report(e.what_without_backtrace());
      continue;
    }
    if (fi.checksummed) {
      uint32_t crc = detail::crc32c(0, h.raw.data(), h.raw.size());
      if (crc != fmeta["header_crc32c"].get<uint32_t>()) {
        problems.report(std::string(api) + ": checksum mismatch in the header of " + path + " (written by rank " +
                        std::to_string(fi.rank) + tensors_in(fmeta) + "): the file was modified or damaged after it was written; restore it or use another checkpoint");
        continue;
      }
    }
    info.files.push_back(fi);
    for (const auto& e : h.entries) {
      ChunkInfo c;
      c.file = name;
      c.sizes = e.shape;
      c.offsets = e.saved_offsets ? *e.saved_offsets : std::vector<int64_t>(e.shape.size(), 0);
      c.file_offset = h.data_start + e.begin;
      c.nbytes = e.end - e.begin;
      auto [it, fresh] = info.tensors.try_emplace(e.name);
      auto& t = it->second;
      if (fresh) {
        t.dtype = e.dtype;
        t.sizes.assign(e.shape.size(), 0);
      } else if (t.dtype != e.dtype || t.sizes.size() != e.shape.size()) {
        problems.report(std::string(api) + ": '" + e.name + "' is " + c10::toString(e.dtype) + " " +
                        shape_str(e.shape) + " in " + path + " but " + c10::toString(t.dtype) + " with " +
                        std::to_string(t.sizes.size()) + " dims in " + t.chunks[0].file);
        continue;
      }
      for (size_t d = 0; d < e.shape.size(); ++d) t.sizes[d] = std::max(t.sizes[d], c.offsets[d] + c.sizes[d]);
      t.chunks.push_back(std::move(c));
    }
  }
  // The metadata's summary must agree with the headers.
  if (info.metadata.is_object() && info.metadata.contains("tensors")) {
    for (const auto& [k, v] : info.metadata["tensors"].items()) {
      auto it = info.tensors.find(k);
      if (it == info.tensors.end()) {
        problems.report(std::string(api) + ": '" + k + "' is listed in " + meta_path.string() +
                        " but no safetensors file holds it (a file is missing?)");
        continue;
      }
      auto shape = v.value("shape", std::vector<int64_t>());
      if (detail::dtype_name(it->second.dtype, api, k) != v.value("dtype", "") || shape != it->second.sizes) {
        problems.report(std::string(api) + ": '" + k + "' is " + v.value("dtype", "") + " " + shape_str(shape) + " in " +
                        meta_path.string() + " but " + detail::dtype_name(it->second.dtype, api, k) + " " +
                        shape_str(it->second.sizes) + " in the safetensors headers (a chunk is missing?)");
      }
    }
  }
  return info;
}

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

/// The elements of overlap `ov` of chunk `c` (of tensor `fqn`), as a strided tensor over the mapped
/// file. Only the chunk's bytes from the overlap's first element to its last are touched (widened to
/// checksum blocks when `verify` and the checkpoint has checksums); they are read from the disk here
/// (MADV_POPULATE_READ, so that an I/O error is an exception, not a SIGBUS later) and verified.
torch::Tensor chunk_view(const CheckpointInfo& info, const ChunkInfo& c, const std::string& fqn, torch::ScalarType dtype,
                         const Overlap& ov, bool verify, FileCache& files, const char* api) {
  const size_t nd = c.sizes.size();
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  std::vector<int64_t> strides(nd, 1);  // the chunk's C-order strides
  for (int64_t d = static_cast<int64_t>(nd) - 2; d >= 0; --d) strides[d] = strides[d + 1] * c.sizes[d + 1];
  int64_t first = 0, last = 0;
  for (size_t d = 0; d < nd; ++d) {
    first += (ov.lo[d] - c.offsets[d]) * strides[d];
    last += (ov.lo[d] - c.offsets[d] + ov.len[d] - 1) * strides[d];
  }
  int64_t begin = first * es, end = (last + 1) * es;  // bytes within the chunk's data
  const nlohmann::json* crcs = verify ? chunk_crcs(info, c, fqn) : nullptr;
  const int64_t block = crcs ? block_bytes_of(info) : 0;
  if (crcs) {
    TORCH_CHECK(block > 0 && block % es == 0, api, ": ", info.dir, "/", kMetadataFileName,
                " has an invalid checksum block size");
    begin = begin / block * block;
    end = std::min(c.nbytes, (end + block - 1) / block * block);
  }
  auto m = files.get(c.file);
  TORCH_CHECK(static_cast<int64_t>(m->len) >= c.file_offset + c.nbytes, api, ": ", m->path,
              " is truncated: reading '", fqn, "' needs bytes up to ", c.file_offset + c.nbytes, " but the file has ",
              m->len);
  const char* data = m->base + c.file_offset;  // the chunk's first byte
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

}  // namespace

CheckpointInfo inspect(const std::string& dir) { return read_info(dir, "dcp::inspect", nullptr); }

LoadResult load(StateDict& state_dict, const std::string& dir, const LoadOptions& options) {
  const char* api = "dcp::load";
  auto group = detail::resolve_group(state_dict, options.group());
  detail::Coordinator coord(group, api);
  const int rank = coord.rank();
  const int world = coord.world();

  struct Staged {
    torch::Tensor dst;  // a box of a destination (aliases the model's shard, an optimizer tensor, ...)
    torch::Tensor src;  // its verified bytes, a view of a mapped file: copied once every rank succeeded
  };
  std::vector<Staged> staged;
  std::vector<std::pair<std::string, nlohmann::json>> values;
  LoadResult result;
  std::string error;
  try {
    CheckpointInfo info = read_info(dir, api, nullptr);
    FileCache files(info.dir, api);
    std::set<std::string> seen;
    for (const auto& [key, v] : state_dict) {
      seen.insert(key);
      if (std::holds_alternative<Value>(v)) {
        if (auto it = info.values.find(key); it != info.values.end()) {
          values.emplace_back(key, it->second);
        } else if (auto pr = info.per_rank_values.find(key); pr != info.per_rank_values.end()) {
          TORCH_CHECK(info.world_size == world && static_cast<int>(pr->second.size()) == world, api, ": '", key,
                      "' is per-rank state saved by ", info.world_size, " ranks in ", info.dir, ", but this job has ",
                      world, " (rank ", rank, "): per-rank state cannot be resharded to another world size. Fix: load on ",
                      info.world_size, " ranks, or remove '", key, "' from the state dict (and restore it another way)");
          values.emplace_back(key, pr->second[static_cast<size_t>(rank)]);
        } else if (info.tensors.count(key)) {
          TORCH_CHECK(false, api, ": '", key, "' is a Value in the state dict but a tensor in ", info.dir, " (rank ", rank, ")");
        } else {
          result.missing_keys.push_back(key);
        }
        continue;
      }
      torch::Tensor dst;
      std::vector<int64_t> global, offsets;
      if (const auto* d = std::get_if<DTensor>(&v)) {
        dst = d->to_local();
        global = d->sizes();
        offsets = d->local_offsets();
      } else {
        dst = std::get<torch::Tensor>(v);
        TORCH_CHECK(dst.defined(), api, ": '", key, "' is an undefined tensor in the state dict (rank ", rank, ")");
        global = dst.sizes().vec();
        offsets.assign(global.size(), 0);
      }
      auto it = info.tensors.find(key);
      if (it == info.tensors.end()) {
        TORCH_CHECK(!info.values.count(key) && !info.per_rank_values.count(key), api, ": '", key, "' is a ",
                    kind_name(v), " in the state dict but a Value in ", info.dir, " (rank ", rank, ")");
        result.missing_keys.push_back(key);
        continue;
      }
      const TensorInfo& t = it->second;
      TORCH_CHECK(t.sizes == global, api, ": '", key, "' has shape ", shape_str(t.sizes), " in ", info.dir, " (e.g. ",
                  t.chunks[0].file, ") but ", shape_str(global), " in the state dict (rank ", rank,
                  "). Fix: load into a model of the configuration that was saved");
      TORCH_CHECK(t.dtype == dst.scalar_type(), api, ": '", key, "' has dtype ", t.dtype, " in ", info.dir, " (e.g. ",
                  t.chunks[0].file, ") but ", dst.scalar_type(), " in the state dict (rank ", rank,
                  "). Fix: build the model with dtype ", t.dtype, " to load it, then convert");
      auto problem = coverage_problem(t, offsets, dst.sizes().vec());
      TORCH_CHECK(problem.empty(), api, ": '", key, "' cannot be read from ", info.dir, " (rank ", rank, "): ", problem);
      if (dst.numel() == 0) continue;
      const auto box = dst.sizes().vec();
      for (const auto& c : t.chunks) {
        auto ov = overlap_of(c, offsets, box);
        if (!ov) continue;
        staged.push_back({narrow_to(dst, offsets, *ov),
                          chunk_view(info, c, key, t.dtype, *ov, options.verify_checksums(), files, api)});
      }
    }
    for (const auto& [k, _] : info.tensors)
      if (!seen.count(k)) result.unexpected_keys.push_back(k);
    for (const auto& [k, _] : info.values)
      if (!seen.count(k)) result.unexpected_keys.push_back(k);
    for (const auto& [k, _] : info.per_rank_values)
      if (!seen.count(k)) result.unexpected_keys.push_back(k);
    if (options.strict()) {
      TORCH_CHECK(result.missing_keys.empty(), api, ": ", result.missing_keys.size(), " key(s) of the state dict are not in ",
                  info.dir, " (rank ", rank, "): ", list_keys(result.missing_keys),
                  ". Fix: load the checkpoint this state dict's model was saved to, or pass LoadOptions().strict(false) to ",
                  "leave them unchanged");
      TORCH_CHECK(result.unexpected_keys.empty(), api, ": ", info.dir, " holds ", result.unexpected_keys.size(),
                  " key(s) the state dict does not (rank ", rank, "): ", list_keys(result.unexpected_keys),
                  ". Fix: add them to the state dict (e.g. get_state_dict(model, optimizer) for a checkpoint with ",
                  "optimizer state), or pass LoadOptions().strict(false) to ignore them");
    }
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = std::string(api) + ": " + e.what();
  }

  // Every rank staged everything, or nobody changes anything.
  auto reports = coord.gather("staged", error, "to read its part of the checkpoint");
  std::string verdict;
  if (rank == 0) {
    for (size_t r = 0; r < reports.size(); ++r) {
      if (!reports[r].empty()) {
        verdict = r == 0 ? reports[r] : "rank " + std::to_string(r) + " failed: " + reports[r];
        break;
      }
    }
  }
  verdict = coord.broadcast("verdict", verdict, "to collect every rank's reading of the checkpoint");
  if (!error.empty()) TORCH_CHECK(false, error, " (nothing was loaded on any rank)");
  TORCH_CHECK(verdict.empty(), api, ": ", verdict, " (nothing was loaded on any rank)");

  {
    torch::NoGradGuard no_grad;
    for (auto& s : staged) s.dst.copy_(s.src);
  }
  for (auto& [k, v] : values) std::get<Value>(state_dict.at(k)).json = std::move(v);
  return result;
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
