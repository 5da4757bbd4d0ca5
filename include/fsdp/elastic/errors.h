// torch.distributed.elastic.multiprocessing.errors: a worker's error, recorded where its launcher reads it.
//
// Under fsdprun (or torchrun) each worker gets TORCHELASTIC_ERROR_FILE, a path of its own. A worker that
// fails writes its error there, and the launcher's failure summary shows that message (and the stack it
// came with) instead of only "exit code 1" and the tail of stderr. Python programs do it with the
// @record decorator; a LibTorch program wraps its main in fsdp::elastic::record.
#pragma once

#include <exception>
#include <functional>
#include <string>

namespace fsdp::elastic {

/// Runs `main` (a program's main body) and returns what it returns. If it throws, the error is written to
/// TORCHELASTIC_ERROR_FILE (when set: torch's format, {"message": {"message": "<type>: <what>", "extraInfo":
/// {"py_callstack": "<stack>", "timestamp": "<s>"}}}), printed to stderr, and record returns 1: the launcher
/// then reports the failed rank with this message. The stack is c10::Error's own (where it was thrown,
/// when TORCH_SHOW_CPP_STACKTRACES=1), empty for other exceptions (they carry none). Never throws itself
/// (an error file that cannot be written is reported on stderr).
/// Mirrors torch.distributed.elastic.multiprocessing.errors.record.
/// Example: `int main(int argc, char** argv) { return fsdp::elastic::record([&] { return train(argc, argv); }); }`
int record(const std::function<int()>& main);

/// Writes `e` to TORCHELASTIC_ERROR_FILE as record() does (nothing when the variable is unset), for a
/// program that catches its errors itself. Never throws. Mirrors ErrorHandler.record_exception.
/// Example: `catch (const std::exception& e) { fsdp::elastic::record_exception(e); return 1; }`
void record_exception(const std::exception& e);

}  // namespace fsdp::elastic
