// The chunk reader of checkpoint loads (checkpoint/chunk_reader.h).
#include "checkpoint/chunk_reader.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include <algorithm>

#include "util.h"

namespace fsdp::dcp::detail {

using fsdp::detail::numel_of;
using fsdp::detail::shape_str;

std::shared_ptr<Mapping> FileCache::get(const std::string& name) {
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
                         int64_t* bytes_read) {
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  const ChunkRange r = chunk_range(info, c, fqn, dtype, ov, verify, api);
  const auto& strides = r.strides;
  const int64_t first = r.first, last = r.last, begin = r.begin, end = r.end, block = r.block;
  const nlohmann::json* crcs = r.crcs;
  auto m = files.get(c.file);
  TORCH_CHECK(c.file_offset >= 0 && c.nbytes >= 0, api, ": ", m->path, ": '", fqn, "' has a negative byte range (",
              c.file_offset, ", ", c.nbytes, " bytes): the checkpoint's metadata is damaged");
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

}  // namespace fsdp::dcp::detail
