// The safetensors file format, CRC-32C, POSIX file I/O with errors that name the file, and the fault
// hook the checkpoint tests use to simulate crashes and full disks.
//
// A safetensors file, byte for byte:
//   [u64 little-endian N][N bytes of UTF-8 JSON, space-padded to a multiple of 8][data buffer]
//   JSON = {"__metadata__": {string: string}, "<name>": {"dtype": "F32", "shape": [..],
//           "data_offsets": [begin, end]}, ...}
// data_offsets are relative to the data buffer and tile it with no hole; data is C-order little-endian.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/types.h>

namespace fsdp::dcp::detail {

// ---------------------------------------------------------------------------------------------
// dtypes

/// "F32", "BF16", ... Throws c10::Error ("<api>: '<fqn>' has dtype ComplexFloat, which safetensors
/// cannot store") for a dtype without a safetensors name.
std::string dtype_name(torch::ScalarType dtype, const char* api, const std::string& fqn);
/// The dtype of a safetensors name, or nullopt.
std::optional<torch::ScalarType> dtype_from_name(const std::string& name);

// ---------------------------------------------------------------------------------------------
// CRC-32C (Castagnoli), hardware-accelerated on x86-64 with SSE4.2. Chainable: crc32c(crc32c(0, a), b)
// equals the CRC of a followed by b.
uint32_t crc32c(uint32_t crc, const void* data, size_t n);
/// CRCs of consecutive `block_bytes` blocks of [data, data + n) (the last block may be shorter).
std::vector<uint32_t> block_crcs(const void* data, size_t n, int64_t block_bytes);

// ---------------------------------------------------------------------------------------------
// Files

/// An open file descriptor; every failure throws c10::Error naming `path` and errno.
class File {
 public:
  File() = default;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  File(File&& o) noexcept;
  File& operator=(File&& o) noexcept;
  ~File();
  /// Opens for reading. `api` prefixes error messages.
  static File open_read(const std::string& path, const char* api);
  /// Creates a new file for writing (fails if it exists).
  static File create(const std::string& path, const char* api);
  /// Reads exactly n bytes at `offset`; throws (naming `what`) on a short read (truncated file).
  void pread_exact(void* buf, size_t n, int64_t offset, const std::string& what) const;
  /// Writes all n bytes at the current position, in pieces of at most 64 MiB.
  void write_all(const void* buf, size_t n, const std::string& what);
  void fsync();
  /// Drops the file's pages from the page cache (benchmarks).
  void drop_cache();
  int64_t size() const;
  void close();
  const std::string& path() const { return path_; }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  std::string path_;
  const char* api_ = "dcp";
};

/// fsyncs a directory (makes renames and creations in it durable).
void fsync_dir(const std::string& path, const char* api);
/// Writes `content` to `path` atomically: into `path.tmp-<nonce>`, fsync, rename, fsync of the parent.
void write_file_atomic(const std::string& path, const std::string& content, bool do_fsync, const char* api);
/// Reads a whole (small) file. Throws naming the file when it is missing.
std::string read_small_file(const std::string& path, const char* api);
/// A random hex string of `n` characters (temp names).
std::string random_nonce(size_t n = 12);
/// "No space left on device (ENOSPC)".
std::string errno_text(int err);

// ---------------------------------------------------------------------------------------------
// Headers

struct HeaderEntry {
  std::string name;
  torch::ScalarType dtype = torch::kFloat32;
  std::vector<int64_t> shape;
  int64_t begin = 0;  // relative to the data buffer
  int64_t end = 0;
  std::optional<std::vector<int64_t>> saved_offsets;  // from DCP_SHARDING_INFO
};

struct Header {
  int64_t data_start = 0;  // 8 + N: where the data buffer starts in the file
  int64_t data_bytes = 0;  // size of the data buffer
  std::vector<HeaderEntry> entries;  // sorted by begin
  nlohmann::json metadata;           // "__metadata__" (an object, possibly empty)
  bool has_sharding_info = false;    // DCP_SHARDING_INFO present
  std::string raw;                   // the 8 + N header bytes (for checksums)
};

/// Reads and validates a file's header: JSON, dtypes, shapes that match their byte counts, offsets
/// that tile the data buffer, a file size of exactly data_start + data_bytes (a shorter file is
/// reported as truncated). Throws c10::Error "<api>: <path>: ..." naming the tensor at fault.
Header read_header(const File& file, int64_t file_size, const char* api);

/// One tensor to write: its name, dtype, shape, and where its chunk starts in the global tensor.
struct WriteEntry {
  std::string name;
  torch::ScalarType dtype = torch::kFloat32;
  std::vector<int64_t> shape;
  std::optional<std::vector<int64_t>> saved_offsets;  // written into DCP_SHARDING_INFO when set
  int64_t nbytes() const;
};

/// The checksums of a written file.
struct FileRecord {
  std::string name;
  int64_t bytes = 0;
  uint32_t header_crc = 0;
  std::vector<std::vector<uint32_t>> tensor_crcs;  // per entry (in entries' order), per block
};

/// The "__metadata__" of a file written by save_file (string to string, as safetensors allows).
using Metadata = std::map<std::string, std::string>;

/// Builds the 8 + N header bytes. With `sharding_info`, __metadata__ holds DCP_SHARDING_INFO (every
/// entry must then have saved_offsets), DCP_VERSION "1.0" and format "pt", as PyTorch writes them.
/// Otherwise __metadata__ is `*metadata` (absent when empty), or {"format": "pt"} when `metadata` is null.
std::string build_header(const std::vector<WriteEntry>& entries, bool sharding_info,
                         const Metadata* metadata = nullptr);

/// Writes a safetensors file at `path` (created: must not exist): the header, then the data of each
/// entry, which `data(i)` returns (a contiguous CPU tensor of entry i's dtype and shape; called once,
/// in order, so that only one tensor needs to be in memory). Computes CRC-32Cs per `block_bytes` of
/// each tensor. Calls the fault hook ("write", with the bytes written so far) after the header and
/// after each tensor. fsyncs when `do_fsync`. `metadata`: as build_header's.
FileRecord write_safetensors(const std::string& path, const std::vector<WriteEntry>& entries,
                             const std::function<torch::Tensor(size_t)>& data, bool sharding_info,
                             int64_t block_bytes, bool do_fsync, const char* api,
                             const Metadata* metadata = nullptr);

// ---------------------------------------------------------------------------------------------
// Fault hook (tests only)

/// Where a save is: stage is "write" (bytes_written of `path` so far), "before_metadata",
/// "before_rename", "before_latest" or "done".
struct FaultPoint {
  std::string stage;
  std::string path;
  int64_t bytes_written = 0;
};
using FaultHook = std::function<void(const FaultPoint&)>;
/// Installs a hook called at each FaultPoint of this process's saves (null removes it). It may throw
/// (the save fails as if the write failed) or kill the process (a crash).
void set_fault_hook(FaultHook hook);
/// Calls the hook, if any.
void fault_point(const FaultPoint& point);

/// Sets the largest staging buffer of dcp::load's streamed reads (see load.cpp; tests make it tiny to
/// read a box in many slabs). 0 restores the default (64 MiB).
void set_load_stage_bytes(int64_t bytes);
/// Drops the staging buffers async_save keeps between saves (SaveOptions::cache_staging).
void clear_staging_cache();
/// Turns [Note: one reader per file region] in dcp::load on or off (benchmarks, tests; default off).
void set_cooperative_prefetch(bool on);
/// How many async saves staged into a previous save's buffers (tests).
int64_t staging_cache_reuses();

}  // namespace fsdp::dcp::detail
