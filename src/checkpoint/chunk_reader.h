// Reading the chunks of a checkpoint: mapped files, the overlap of a chunk with a destination box, the
// byte range of a chunk to read (whole checksum blocks when verified), verified strided views of file
// bytes, and streamed reads of a box. Shared by dcp::load (load.cpp) and dcp::read_tensor / verify /
// consolidate (verify.cpp).
#pragma once

#include <sys/mman.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "checkpoint/safetensors.h"
#include "fsdp/checkpoint/checkpoint.h"

namespace fsdp::dcp::detail {

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
  /// The mapping of `name` in the folder (mapped on first use). Throws c10::Error naming the file.
  std::shared_ptr<Mapping> get(const std::string& name);


 private:
  std::string dir_;
  const char* api_;
  std::map<std::string, std::shared_ptr<Mapping>> files_;
};

/// The box of the global tensor where chunk `c` and the box [box_off, box_off + box_size) overlap.
struct Overlap {
  std::vector<int64_t> lo, len;
};

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

/// CRC-32Cs of a chunk's data blocks (null when the checkpoint has none).
const nlohmann::json* chunk_crcs(const CheckpointInfo& info, const ChunkInfo& c, const std::string& fqn);
/// The checksum block size of the checkpoint (0 when it has no checksums).
int64_t block_bytes_of(const CheckpointInfo& info);

/// The overlap of chunk `c` and the box [box_off, box_off + box_size), or nullopt when they do not meet.
std::optional<Overlap> overlap_of(const ChunkInfo& c, const std::vector<int64_t>& box_off,
                                  const std::vector<int64_t>& box_size);
/// Where overlap `ov` lies in chunk `c`'s data (see ChunkRange). Throws c10::Error on a bad block size.
ChunkRange chunk_range(const CheckpointInfo& info, const ChunkInfo& c, const std::string& fqn, torch::ScalarType dtype,
                       const Overlap& ov, bool verify, const char* api);
/// The elements of overlap `ov` of chunk `c` (of tensor `fqn`), as a strided tensor over the mapped
/// file. Only the chunk's bytes of chunk_range() are touched; they are read from the disk here
/// (MADV_POPULATE_READ, so that an I/O error is an exception, not a SIGBUS later) and verified when
/// `verify`. Adds the bytes it reads from the file to `*bytes_read` when given. Throws c10::Error on a
/// truncated file, an I/O error or a checksum mismatch, naming the file and the bytes.
torch::Tensor chunk_view(const CheckpointInfo& info, const ChunkInfo& c, const std::string& fqn, torch::ScalarType dtype,
                         const Overlap& ov, bool verify, FileCache& files, const char* api,
                         int64_t* bytes_read = nullptr);
/// `dst` (holding the box at box_off of the global tensor) narrowed to the overlap `ov`.
torch::Tensor narrow_to(const torch::Tensor& dst, const std::vector<int64_t>& box_off, const Overlap& ov);
/// Checks that the chunks of `t` cover the box exactly once. Returns the problem or "".
std::string coverage_problem(const TensorInfo& t, const std::vector<int64_t>& box_off, const std::vector<int64_t>& box_size);
/// Reads the box [lo, lo + len) (global coordinates) of chunk `c` from `file`, in C order, into `out`
/// (contiguous, the file's dtype of `es` bytes per element): one pread per contiguous run. Returns the
/// bytes read.
int64_t read_box(const File& file, const ChunkInfo& c, const std::vector<int64_t>& lo,
                 const std::vector<int64_t>& len, int64_t es, char* out, const std::string& what);

}  // namespace fsdp::dcp::detail
