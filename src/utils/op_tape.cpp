// The op tape of an implicit checkpoint region and its replay (see [Note: implicit checkpoint regions],
// implicit_checkpoint.cpp, which records it).
#include "utils/op_tape.h"

#include <optional>

#include <torch/csrc/autograd/grad_mode.h>

#include "utils/selective_checkpoint_internal.h"

namespace fsdp::detail {
namespace {
thread_local int t_replay_depth = 0;

struct ReplayDepth {
  ReplayDepth() { ++t_replay_depth; }
  ~ReplayDepth() { --t_replay_depth; }
};
}  // namespace

bool in_tape_replay() { return t_replay_depth > 0; }

std::string op_name(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

void set_arg(std::vector<c10::IValue>& args, size_t arg, int64_t element, c10::IValue value) {
  if (element < 0) {
    args[arg] = std::move(value);
  } else {
    auto list = args[arg].toList();
    list.set(element, std::move(value));
  }
}

torch::Tensor copy_of(const torch::Tensor& t) {
  auto c = at::empty_like(t, at::MemoryFormat::Preserve);
  c.copy_(t);
  return c;
}

void replay(Tape& tape) {
  std::lock_guard<std::mutex> lock(tape.mu);
  tape.sealed = true;
  ReplayDepth replaying;
  std::vector<torch::Tensor> outside(tape.outside.size());
  std::optional<SuspendSelective> suspend(std::in_place);  // (the outside tensors' copies and detaches are not the
                                                          // region's ops)
  for (size_t i = 0; i < tape.outside.size(); ++i) {
    const TapeOutside& o = tape.outside[i];
    if (o.before.defined()) {
      outside[i] = copy_of(o.before);  // the replay writes its own copy
      if (o.requires_grad) outside[i].requires_grad_(true);
      continue;
    }
    TORCH_CHECK(o.as_is || static_cast<int64_t>(o.value._version()) == o.version, "apply_activation_checkpointing: a ",
                "tensor of shape ", o.value.sizes(), " that op #", o.first_use, " (",
                o.first_use < tape.ops.size() ? op_name(tape.ops[o.first_use].op) : std::string("?"), ") of the checkpointed region of ", tape.name, " read was modified in place afterwards (its ",
                "version moved from ", o.version, " to ", o.value._version(), "), so the recomputation would compute ",
                "from the new value. Fix: make that change out of place (y = x + 1, not x += 1), or do not checkpoint ",
                "this module");
    outside[i] = o.as_is ? o.value : o.value.detach().requires_grad_(o.requires_grad);
  }
  // Each slot is released after its last use (the replay holds what a forward would, not the whole region).
  std::vector<size_t> last_use(tape.n_slots, 0);
  for (size_t k = 0; k < tape.ops.size(); ++k) {
    for (const auto& ref : tape.ops[k].refs) {
      if (!ref.outside) last_use[ref.index] = k;
    }
  }
  suspend.reset();
  std::vector<torch::Tensor> slots(tape.n_slots);
  for (size_t k = 0; k < tape.ops.size(); ++k) {
    const TapeOp& rec = tape.ops[k];
    torch::jit::Stack stack;
    stack.reserve(rec.args.size());
    for (const auto& a : rec.args) stack.push_back(a.isList() ? c10::IValue(a.toList().copy()) : a);
    for (const auto& ref : rec.refs) {
      const torch::Tensor& t = ref.outside ? outside[ref.index] : slots[ref.index];
      set_arg(stack, ref.arg, ref.element, c10::IValue(t));
    }
    {
      torch::AutoGradMode grad_mode(rec.grad_mode);
      rec.op.callBoxed(&stack);
    }
    size_t produced = 0;
    for (const auto& v : stack) {
      each_tensor(v, [&](const torch::Tensor& t, int64_t) {
        if (produced < rec.n_outputs) {
          torch::Tensor out = t;
          // An output whose requires_grad the forward changed outside the dispatcher (requires_grad_(), a custom
          // autograd::Function's output) gets the forward's, so that the ops after it save what they saved then.
          const bool want = rec.requires_grad[produced];
          if (out.defined() && out.requires_grad() != want) {
            SuspendSelective suspend;  // (not the region's op)
            if (!want) {
              out = out.detach();
            } else if (out.is_leaf()) {
              out.requires_grad_(true);
            }
          }
          slots[rec.first_slot + produced] = out;
        }
        ++produced;
      });
    }
    TORCH_CHECK(produced == rec.n_outputs, "apply_activation_checkpointing: the recomputation of op #", k, " (",
                op_name(rec.op), ") of the checkpointed region of ", tape.name, " returned ", produced,
                " tensors, the forward ", rec.n_outputs, ". The region's ops depend on state that changed between ",
                "forward and backward; make them depend on the inputs only");
    for (const auto& ref : rec.refs) {
      if (!ref.outside && last_use[ref.index] == k) slots[ref.index] = torch::Tensor();
    }
    for (size_t s = rec.first_slot; s < rec.first_slot + rec.n_outputs; ++s) {
      if (last_use[s] <= k) slots[s] = torch::Tensor();  // never used by a later op of the region
    }
  }
}


}  // namespace fsdp::detail
