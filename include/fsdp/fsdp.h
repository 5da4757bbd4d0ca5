// libfsdp: PyTorch's FSDP2 for LibTorch. One include for the whole public API.
#pragma once

#include <torch/torch.h>  // the LibTorch API every libfsdp program uses alongside ours

#include "fsdp/activation_checkpoint.h"
#include "fsdp/checkpoint.h"
#include "fsdp/clip_grad.h"
#include "fsdp/deferred_init.h"
#include "fsdp/collectives.h"
#include "fsdp/device_mesh.h"
#include "fsdp/distributed.h"
#include "fsdp/dtensor.h"
#include "fsdp/flight_recorder.h"
#include "fsdp/fully_shard.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/join.h"
#include "fsdp/memory_estimate.h"
#include "fsdp/policies.h"
#include "fsdp/state_dict.h"
#include "fsdp/tensor_parallel.h"
