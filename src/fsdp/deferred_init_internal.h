// The dispatcher side of deferred_init (fsdp/deferred_init.h): the fallback of kInterceptKey hands
// every op to it while this thread records a constructor or replays one. See [Note: deferred init].
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace fsdp::detail {

/// Whether this thread is recording (inside deferred_init) or replaying (inside materialize_module).
bool deferred_init_active();

/// Records the op (recording) or runs it with the replay's generator (replaying).
void deferred_init_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

}  // namespace fsdp::detail
