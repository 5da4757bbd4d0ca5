// Reading a checkpoint's description: its metadata file (ours) or its safetensors headers alone
// (PyTorch's HuggingFaceStorageWriter, plain Hugging Face files), validated against each other.
#pragma once

#include <string>
#include <vector>

#include "fsdp/checkpoint/checkpoint.h"

namespace fsdp::dcp::detail {

/// The description of the checkpoint in `dir` (or in the folder a `latest` pointer file names).
/// A missing, truncated or damaged file is reported into `problems` when given (and left out of the
/// description), else thrown as c10::Error naming the file, the rank that wrote it and what it holds.
/// A missing folder or unreadable metadata file always throws.
CheckpointInfo read_info(const std::string& dir, const char* api, std::vector<std::string>* problems);

}  // namespace fsdp::dcp::detail
