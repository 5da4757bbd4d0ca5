// The op tape of an implicit checkpoint region: the ops a region recorded in forward, with where each tensor
// argument comes from, and its replay in backward. Recorded by implicit_checkpoint.cpp; see [Note: implicit checkpoint
// regions] there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/types.h>

namespace fsdp::detail {

/// A tensor argument of a recorded op: where the replay finds it.
struct TapeRef {
  size_t arg = 0;
  int64_t element = -1;  // in a list, else -1
  bool outside = false;  // an outside tensor (index into Tape::outside), else a slot
  size_t index = 0;
};

/// One recorded op.
struct TapeOp {
  c10::OperatorHandle op;
  bool grad_mode = true;
  std::vector<c10::IValue> args;  // tensors blanked (None), lists copied
  std::vector<TapeRef> refs;
  size_t first_slot = 0;            // its tensor outputs fill slots first_slot, first_slot + 1, ...
  size_t n_outputs = 0;
  std::vector<bool> requires_grad;  // per output, after the forward's op (and what the region did to it since)
};

/// A tensor from outside the region that its ops used.
struct TapeOutside {
  torch::Tensor value;     // detached (no cycle through a grad_fn of the region), unless as_is
  bool requires_grad = false;
  int64_t version = 0;
  bool as_is = false;      // a keyed tensor (a parameter): passed itself (FSDP and TP know it by identity)
  torch::Tensor before;    // written by the region: the value before its first write
  size_t first_use = 0;    // the op that first used it
};

/// A region's tape.
struct Tape {
  std::string name;         // the checkpointed module, for messages
  std::mutex mu;            // recording (the forward's thread) against a replay (a backward's thread)
  bool sealed = false;      // replayed: nothing more is recorded
  std::vector<TapeOp> ops;
  std::vector<TapeOutside> outside;
  size_t n_slots = 0;
};

/// Replays `tape` (its outside tensors detached with their requires_grad, written ones from fresh copies of their
/// values before the write; each op under its grad mode; each slot released after its last use) and seals it.
/// Throws c10::Error naming the module and the op when an outside tensor was modified in place after the region read
/// it, or an op returns another number of tensors than in the forward.
void replay(Tape& tape);

/// Whether this thread is replaying a tape (its ops are not recorded).
bool in_tape_replay();

/// "aten::add.Tensor" (the op's name and overload), for messages.
std::string op_name(const c10::OperatorHandle& op);

/// Calls `f(tensor, element)` for a tensor IValue (element -1) or each tensor of a list.
template <typename F>
void each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor(), int64_t{-1});
  } else if (v.isList()) {
    const auto list = v.toList();
    for (size_t e = 0; e < list.size(); ++e) {
      const c10::IValue item = list.get(e);
      if (item.isTensor()) f(item.toTensor(), static_cast<int64_t>(e));
    }
  }
}

/// Sets argument `arg` (element `element` of its list, or the argument itself when -1) to `value`.
void set_arg(std::vector<c10::IValue>& args, size_t arg, int64_t element, c10::IValue value);

/// A copy of `t` with its strides (the replay's kernels, and their roundings, are those of the forward).
torch::Tensor copy_of(const torch::Tensor& t);

}  // namespace fsdp::detail
