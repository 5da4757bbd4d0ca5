// Precompiled header for the library and its tests: LibTorch's headers dominate compile time.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
