// libfsdp: PyTorch's distributed training for LibTorch. One include for the whole public API, one
// folder per torch.distributed package (README, Layout).
#pragma once

#include <torch/torch.h>  // the LibTorch API every libfsdp program uses alongside ours

// torch.utils.checkpoint
#include "fsdp/utils/activation_checkpoint.h"
#include "fsdp/utils/saved_tensor_hooks.h"
#include "fsdp/utils/selective_checkpoint.h"
// torch.distributed (c10d)
#include "fsdp/c10d/collectives.h"
#include "fsdp/c10d/distributed.h"
#include "fsdp/c10d/flight_recorder.h"
#include "fsdp/c10d/p2p.h"
// torch.distributed.tensor, torch.distributed.tensor.parallel
#include "fsdp/tensor/device_mesh.h"
#include "fsdp/tensor/distribute_module.h"
#include "fsdp/tensor/dtensor.h"
#include "fsdp/tensor/dtensor_factories.h"
#include "fsdp/tensor/dtensor_ops.h"
#include "fsdp/tensor/experimental/context_parallel.h"
#include "fsdp/tensor/parallel/tensor_parallel.h"
#include "fsdp/tensor/parallel/style.h"
#include "fsdp/tensor/parallel/loss.h"
#include "fsdp/tensor/random.h"
// torch.distributed.fsdp
#include "fsdp/fsdp/deferred_init.h"
#include "fsdp/fsdp/fully_shard.h"
#include "fsdp/fsdp/grad_scaler.h"
#include "fsdp/fsdp/memory_estimate.h"
#include "fsdp/fsdp/policies.h"
#include "fsdp/fsdp/replicate.h"
// torch.distributed.checkpoint
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/optimizer_adapter.h"
#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/checkpoint/stateful.h"
// torch.distributed.algorithms, torch.nn.utils
#include "fsdp/algorithms/checkpoint_wrapper.h"
#include "fsdp/algorithms/clip_grad.h"
#include "fsdp/algorithms/join.h"
// torch.distributed.pipelining
#include "fsdp/pipelining/clip_grad.h"
#include "fsdp/pipelining/schedules.h"
#include "fsdp/pipelining/split.h"
#include "fsdp/pipelining/stage.h"
// torch.distributed.elastic
#include "fsdp/elastic/errors.h"
// torchft (after TorchFT; not part of torch.distributed): live recovery across replica groups
#include "fsdp/ft/manager.h"
