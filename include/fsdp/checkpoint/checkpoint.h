// Distributed checkpoints (DCP): every rank writes its own shards in parallel; any number of ranks,
// on any mesh, loads them back (load-time resharding). PyTorch reads them, and we read PyTorch's.
//
//   fsdp::dcp::save(fsdp::get_state_dict(model, opt), "ckpt/step-1000");   // collective
//   auto sd = fsdp::get_state_dict(model, opt);
//   fsdp::dcp::load(sd, *fsdp::dcp::latest("ckpt"));                       // any world size
//   fsdp::set_state_dict(model, opt, sd);
//
// On disk (docs/CHECKPOINTS.md has the details), one folder per checkpoint:
//   shard-00001-model-00001-of-00001.safetensors   rank 0's chunks (rank r: shard-{r+1:05d}-...), each
//   ...                                             tensor under its key, `__metadata__` holding
//                                                   DCP_SHARDING_INFO (where each chunk starts)
//   libfsdp_checkpoint.json                         format, version, world size and mesh at save time,
//                                                   checksums (CRC-32C), non-tensor Values
// exactly what PyTorch's HuggingFaceStorageWriter(save_distributed=True) writes, so that
// `dcp.load(sd, storage_reader=HuggingFaceStorageReader(dir))` reads it; and `load` reads folders
// that writer produced (no JSON file: everything comes from the safetensors headers), as well as
// consolidated Hugging Face checkpoints (model.safetensors, or an index and its shards) straight into a
// sharded model, each rank reading only its own rows (see load).
//
// PyTorch's default format is read and written too: `__{rank}_{n}.distcp` files of torch.save archives
// and a pickled `.metadata`, what `torch.distributed.checkpoint.save(sd, checkpoint_id=DIR)` (its
// FileSystemWriter; torchtitan's checkpoints) writes: `load` recognises it, and
// `SaveOptions().storage_format(StorageFormat::Distcp)` writes it so that PyTorch's `dcp.load` reads it.
//
// Saves are atomic: the folder is written as DIR.tmp-<nonce>, fsynced, renamed to DIR, and only then
// (with SaveOptions().update_latest(true)) does the `latest` file next to it (holding DIR's name) move,
// by an atomic rename. A crash at any point leaves the previous checkpoint and `latest` intact.
//
// Mirrors torch.distributed.checkpoint.{save, async_save, load} with the Hugging Face storage layer
// (StorageFormat::Safetensors) or FileSystemWriter / FileSystemReader (StorageFormat::Distcp).
#pragma once

#include <cstdint>
#include <future>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/arg.h>
#include <torch/types.h>

#include "fsdp/c10d/distributed.h"
#include "fsdp/checkpoint/state_dict.h"

namespace fsdp::dcp {

/// Name of the JSON metadata file in a checkpoint folder.
constexpr const char* kMetadataFileName = "libfsdp_checkpoint.json";
/// Name of the pointer file, next to the checkpoint folders, that holds the newest one's name.
constexpr const char* kLatestFileName = "latest";

/// How dcp::save lays a checkpoint out on disk (dcp::load reads both, and Hugging Face folders).
/// Example: `fsdp::dcp::SaveOptions().storage_format(fsdp::dcp::StorageFormat::Distcp)`
enum class StorageFormat {
  /// Sharded safetensors files plus libfsdp_checkpoint.json (CRC-32C checksums, atomic `latest`):
  /// what PyTorch's HuggingFaceStorageWriter(save_distributed=True) writes. The default.
  Safetensors,
  /// PyTorch's default: `__{rank}_0.distcp` files of torch.save archives and a pickled `.metadata`, as
  /// torch.distributed.checkpoint.save(sd, checkpoint_id=DIR) writes them with its FileSystemWriter, so
  /// that `dcp.load(sd, checkpoint_id=DIR)` reads it. No checksums (the format has none).
  Distcp,
};

/// Options of save and async_save.
/// Example: `fsdp::dcp::save(sd, "ckpt/step-100", fsdp::dcp::SaveOptions().keep_last(3))`
struct SaveOptions {
  /// Ranks taking part; every one must call save. (Default: null = the world group of the root mesh of
  /// the first DTensor's mesh (the whole (pp, dp, tp) mesh, not FSDP's dp sub-mesh), else the default process group when initialised, else this process alone)
  TORCH_ARG(ProcessGroupPtr, group) = nullptr;
  /// Replace a checkpoint already at DIR (by an atomic exchange of the folders where the filesystem
  /// supports it). Otherwise an existing DIR is an error. (Default: false)
  TORCH_ARG(bool, overwrite) = false;
  /// Point the file `latest` in DIR's parent at DIR once it is durable. Off by default: a save writes
  /// nothing outside DIR unless asked (the parent may be a folder shared with others). (Default: false)
  TORCH_ARG(bool, update_latest) = false;
  /// After `latest` moved, delete the oldest libfsdp checkpoints in DIR's parent so that this many
  /// remain (the new one included); 0 keeps all. (Default: 0)
  TORCH_ARG(int, keep_last) = 0;
  /// fsync files and folders before the renames (durability across power loss). (Default: true)
  TORCH_ARG(bool, fsync) = true;
  /// The layout on disk. (Default: StorageFormat::Safetensors)
  TORCH_ARG(StorageFormat, storage_format) = StorageFormat::Safetensors;
  /// Writer threads per rank: this rank's chunks are split into this many files of about equal size
  /// (largest first), written in parallel (`shard-{rank+1:05d}-model-{i:05d}-of-{n:05d}.safetensors`, or
  /// `__{rank}_{i}.distcp`). The checkpoint holds the same tensors either way. Mirrors FileSystemWriter's
  /// thread_count. (Default: 1)
  TORCH_ARG(int, thread_count) = 1;
  /// save (blocking): bytes each writer thread copies ahead of what it writes, for tensors that are not
  /// already contiguous CPU memory (GPU shards, strided views). A copier thread per writer copies them
  /// in write order into host memory (pinned, for CUDA), at most this many bytes ahead (one tensor at a
  /// time when a tensor alone is larger), so the copies overlap the writes and host memory holds about
  /// this much per writer instead of the rank's whole shard. 0 copies everything before writing.
  /// async_save copies everything before it returns and ignores it. Mirrors FileSystemWriter's
  /// per_thread_copy_ahead. Throws (on every rank) when negative. (Default: 10'000'000, as PyTorch)
  TORCH_ARG(int64_t, per_thread_copy_ahead) = 10'000'000;
  /// async_save: keep the CPU (pinned, for CUDA) staging buffers after the write, and copy the next
  /// save of the same shapes into them instead of allocating (and page-faulting) fresh memory. Holds one
  /// copy of this rank's saved state in memory between saves; one set per group (a save of other shapes
  /// replaces it). Mirrors FileSystemWriter's cache_staged_state_dict. (Default: true)
  TORCH_ARG(bool, cache_staging) = true;
};

/// Options of load.
/// Example: `fsdp::dcp::load(sd, "ckpt/latest", fsdp::dcp::LoadOptions().strict(false))`
struct LoadOptions {
  /// Ranks taking part; every one must call load. (Default: as SaveOptions::group)
  TORCH_ARG(ProcessGroupPtr, group) = nullptr;
  /// A key of the state dict absent from the checkpoint, or a key of the checkpoint absent from every
  /// rank's state dict, is an error (the ranks may hold different keys, as pipeline stages do: one
  /// exchange finds the keys no rank asked for). Otherwise they are returned in LoadResult (per rank)
  /// and skipped. (Default: true)
  TORCH_ARG(bool, strict) = true;
  /// Check the CRC-32C of every byte read against the checkpoint's metadata. (Default: true)
  TORCH_ARG(bool, verify_checksums) = true;
};

/// Writes `state_dict` into the folder `dir` (created; its parent must exist or is created), in our
/// format or, with SaveOptions::storage_format(StorageFormat::Distcp), PyTorch's default one.
/// Collective over the group: each rank writes the chunks it owns (the local piece of each DTensor,
/// once per replica group; a plain tensor or a Value from the lowest rank holding its key; per-rank
/// Values from every rank). The ranks may hold different keys, as pipeline stages do (each its own
/// FQNs): the checkpoint holds their union, and a key held by several ranks must have the same dtype
/// and shape everywhere.
/// Returns once the checkpoint is complete and durable on every rank. Throws c10::Error naming the
/// file, the FQN and the rank (e.g. a full disk); then the temporary folder is removed and the
/// previous checkpoint and `latest` are untouched.
void save(const StateDict& state_dict, const std::string& dir, const SaveOptions& options = {});

/// Stages (copies to CPU memory) every tensor of `state_dict` on the calling thread, then writes the
/// copy in the background: the returned future completes (or throws what save would have thrown)
/// once the checkpoint is durable. Training may continue at once; later changes to the model cannot
/// alter what is written. Collective like save (the background work uses the group's store, not its
/// collectives, so it runs alongside training). Async saves of one group complete in call order.
std::future<void> async_save(const StateDict& state_dict, const std::string& dir, const SaveOptions& options = {});

/// Reads the checkpoint in `dir` (or the one a `latest` file names, if `dir` is that file) into
/// `state_dict`'s tensors in place, resharded to their layout: each rank reads, from each file, only
/// the bytes of the chunks overlapping its local pieces. Values are replaced. Collective over the
/// group. Everything (files, sizes, checksums, keys, shapes, dtypes, per-rank Values on a changed world
/// size) is checked on every rank before anything is written, so a failed load leaves the state
/// dict's tensors (and the model and optimizer they alias) unchanged on every rank. Throws c10::Error
/// naming the file, the FQN and the rank.
///
/// PyTorch's default format (`.metadata` and `.distcp` files, no libfsdp_checkpoint.json): read like ours
/// (resharded, each rank reading only the byte runs of the archives it needs), without checksums (the
/// format has none). Non-tensor entries load into Values when they are None/bool/int/float/str or
/// lists, tuples and str-keyed dicts of them; a one-element tensor (PyTorch's Adam `step`) loads into a
/// Value as its number. A Python object without a JSON form is refused when the state dict asks for it
/// (naming the key and its type). Its param groups hold options LibTorch lacks (foreach, fused, ...): load
/// it with strict(false) and check LoadResult::missing_keys. Throws for a malformed or foreign
/// `.metadata` (naming the byte offset and the fault), a missing or truncated `.distcp` file, a damaged
/// archive (naming the key), storage transforms (compression extensions) it does not undo.
///
/// Consolidated checkpoints (no libfsdp_checkpoint.json): `dir` may also hold a checkpoint as Hugging
/// Face, Python's `safetensors` or consolidate() write it: model.safetensors.index.json and exactly the
/// files its weight_map names (each must exist and hold the tensors the index places in it), or else
/// every *.safetensors file of the folder (model.safetensors; PyTorch's HuggingFaceStorageWriter shards).
/// This loads a full checkpoint straight into a sharded model: each rank reads the headers, then for
/// each entry of `state_dict`, one at a time, only the byte ranges of its local piece (Shard(0) rows
/// are one range, read with one pread; any other box one pread per contiguous run), straight into the
/// local tensor when it is contiguous CPU memory of the file's dtype, else through a CPU staging
/// buffer of at most 64 MiB (or one row of the piece) that is then copied (converting the dtype,
/// moving to the device). Plain tensors (unsharded entries, buffers) are read in full. Extra memory:
/// that one staging buffer; nothing is memory-mapped, the file never enters memory whole. Floating-
/// point data converts to the state dict's dtype (Tensor.copy_, round to nearest even: a bf16 file
/// into an fp32 model is exact); integer and bool data must match. `bytes_read` of the result is then
/// exactly the files' header bytes plus the bytes of this rank's pieces (in the file's dtype).
/// Everything but the data (keys under `strict`, shapes, dtypes, file sizes, the index) is checked on
/// every rank before anything is written, as above; as there are no checksums to verify, the data is
/// read after the ranks agreed, so only an I/O error during that read (a file changed or failing
/// meanwhile) can leave part of this rank's state dict loaded: that rank throws, saying so.
/// Throws c10::Error for a folder holding none of these layouts (naming what was looked for), a file
/// the index names that is missing, a truncated file (naming the tensor cut off), a shape mismatch
/// (FQN, both shapes, the file, the rank), missing or unexpected keys when strict.
/// Mirrors torch.distributed.checkpoint.load(state_dict, storage_reader=HuggingFaceStorageReader(dir)).
LoadResult load(StateDict& state_dict, const std::string& dir, const LoadOptions& options = {});

/// The checkpoint folder `parent/latest` names, or nullopt when there is no `latest` file.
std::optional<std::string> latest(const std::string& parent);

/// One chunk of a tensor: a box of the global tensor stored contiguously in one file.
struct ChunkInfo {
  std::string file;              ///< file name inside the checkpoint folder
  std::vector<int64_t> offsets;  ///< where the box starts in the global tensor
  std::vector<int64_t> sizes;    ///< the box's shape
  int64_t file_offset = 0;       ///< first byte of its data in the file
  int64_t nbytes = 0;            ///< bytes of data
};

/// A tensor of a checkpoint: the union of its chunks.
struct TensorInfo {
  torch::ScalarType dtype = torch::kFloat32;
  std::vector<int64_t> sizes;  ///< global shape: max over chunks of offset + size
  std::vector<ChunkInfo> chunks;
};

/// A safetensors file of a checkpoint.
struct FileInfo {
  std::string name;
  int rank = -1;          ///< saving rank (from the metadata, else the shard-{r+1} name), -1 if unknown
  int64_t bytes = 0;      ///< size on disk
  int64_t header_bytes = 0;  ///< bytes of its safetensors header (the 8-byte length and the JSON)
  bool checksummed = false;  ///< the metadata holds CRC-32Cs of its header and data
};

/// What a checkpoint folder holds, from its metadata file (if any) and its safetensors headers.
struct CheckpointInfo {
  std::string dir;
  /// "libfsdp-dcp" (ours), "torch-dcp" (PyTorch's FileSystemWriter: `.metadata` and `.distcp` files),
  /// or "safetensors" (no metadata file: PyTorch's HuggingFaceStorageWriter or plain Hugging Face files).
  std::string format;
  int version = 0;                     ///< format version (ours), 0 otherwise
  int world_size = 0;                  ///< ranks at save time (0 if unknown)
  std::vector<int64_t> mesh_shape;     ///< mesh of the first DTensor at save time (empty if unknown)
  std::vector<std::string> mesh_dim_names;
  std::vector<FileInfo> files;
  std::map<std::string, TensorInfo> tensors;   ///< by FQN
  std::map<std::string, nlohmann::json> values;                 ///< replicated Values
  std::map<std::string, std::vector<nlohmann::json>> per_rank_values;  ///< per-rank Values, by rank
  /// "torch-dcp" only: entries this reader cannot load (key -> why): Python objects without a JSON form
  /// ("a value of type torch.Size(...), ..."), tensors of an unknown dtype or saved non-row-major, damaged
  /// archives. Loading such a key is refused, naming it and the reason; verify() reports them.
  std::map<std::string, std::string> unreadable;
  nlohmann::json metadata;             ///< the metadata file as read (null if none)
};

/// Reads a checkpoint's description (metadata file and safetensors headers, or PyTorch's `.metadata`
/// and the archives' directories; no tensor data, except PyTorch's non-tensor entries, which are small).
/// Throws c10::Error naming the file for a missing or truncated file or a malformed header.
CheckpointInfo inspect(const std::string& dir);

/// Checks a checkpoint: every file present with its recorded size, every checksum, chunks that
/// cover each tensor exactly once (no gap, no overlap), headers that agree with the metadata.
/// Returns the problems found (empty: the checkpoint is sound). Reads every byte once.
std::vector<std::string> verify(const std::string& dir);

/// Assembles one full tensor from its chunks (this process only; checksums verified when present).
torch::Tensor read_tensor(const CheckpointInfo& info, const std::string& fqn);

/// Options of consolidate.
/// Example:
/// `fsdp::dcp::consolidate("ckpt/step-100", "hf", fsdp::dcp::ConsolidateOptions().prefix("model.").strip_prefix(true))`
struct ConsolidateOptions {
  /// Start a new output file when the next tensor would take the current one past this many bytes;
  /// 0: one file. (Default: 0)
  TORCH_ARG(int64_t, max_file_bytes) = 0;
  /// Only tensors whose key starts with this prefix, e.g. "model.". (Default: all)
  TORCH_ARG(std::string, prefix) = "";
  /// Remove `prefix` from the keys written (e.g. to get Hugging Face parameter names). (Default: false)
  TORCH_ARG(bool, strip_prefix) = false;
};

/// Writes the checkpoint's tensors in full (one tensor in memory at a time) into `out_dir` as
/// `model.safetensors`, or `model-00001-of-0000N.safetensors`... plus `model.safetensors.index.json`
/// (weight_map) when split: the layout Hugging Face and the `safetensors` package load. Returns the
/// files written. Mirrors torch.distributed.checkpoint._consolidate_hf_safetensors.
std::vector<std::string> consolidate(const std::string& dir, const std::string& out_dir,
                                     const ConsolidateOptions& options = {});

// ---------------------------------------------------------------------------------------------
// Single safetensors files, outside any checkpoint folder.
//
//   fsdp::dcp::save_file({{"wte.weight", w}, {"batches", b}}, "init.safetensors", {{"producer", "me"}});
//   auto tensors = fsdp::dcp::load_file("init.safetensors");   // {"batches": ..., "wte.weight": ...}
//
// The same writer and reader as the checkpoints' shard files, so Python's
// `safetensors.torch.load_file` reads what save_file writes and load_file reads what
// `safetensors.torch.save_file` writes. Supported dtypes (safetensors name): float64 (F64), float32 (F32),
// bfloat16 (BF16), float16 (F16), int64 (I64), int32 (I32), int16 (I16), int8 (I8), uint8 (U8),
// bool (BOOL). Data is little-endian, C order.

/// Writes `tensors` into the safetensors file `path`, each under its key (the header lists them in key
/// order), with `metadata` as the header's "__metadata__" (absent when empty). Tensors may be on any
/// device, non-contiguous or views: each is copied to contiguous CPU memory as it is written, and
/// tensors that share memory are stored as separate copies (where safetensors.torch.save_file refuses
/// both). Scalars (shape []) and empty tensors are stored as such. Replaces an existing file
/// atomically: the data goes to `path.tmp-<nonce>`, which is renamed to `path` once complete, so that
/// a failed save leaves the old file (or none). Not fsynced (as the Python function).
/// Throws c10::Error "dcp::save_file: ..." naming the key and the fix for an undefined or sparse tensor,
/// a dtype safetensors cannot store (complex, float8, unsigned wider than 8 bits, ...) or the key
/// "__metadata__"; naming the path for a missing folder, or a failed write (with errno, e.g. ENOSPC).
/// Mirrors safetensors.torch.save_file(tensors, filename, metadata).
void save_file(const std::map<std::string, torch::Tensor>& tensors, const std::string& path,
               const std::map<std::string, std::string>& metadata = {});

/// Reads every tensor of the safetensors file `path` (any writer's: ours, the `safetensors` package,
/// PyTorch's DCP shards), onto `device`. Each tensor has its own memory. Throws c10::Error
/// "dcp::load_file: <path>: ..." for a missing or unreadable file, a truncated file (naming the tensor
/// cut off), a malformed header (not JSON, offsets that do not tile the data, bytes past the data) or
/// a dtype outside the list above (naming the tensor). The header's "__metadata__" is not returned
/// (as in Python, where safe_open(...).metadata() reads it).
/// Mirrors safetensors.torch.load_file(filename, device).
std::map<std::string, torch::Tensor> load_file(const std::string& path, torch::Device device = torch::kCPU);

}  // namespace fsdp::dcp
