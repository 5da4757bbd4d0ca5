// Datatypes and reduction ops of the "mpi" backend (internal; MPI builds only): how a tensor's dtype and a
// c10d reduce op map onto MPI's, and the words its error messages use for them.
#pragma once

#include <mpi.h>

#include <string>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace fsdp::detail {

// The MPI datatype that moves a tensor of dtype `t`. Half and BFloat16 move as 16-bit words (MPI has no
// such floats) and reduce through mpi_op()'s user ops. Throws c10::Error naming `what` (the collective)
// for a dtype MPI cannot carry.
MPI_Datatype mpi_type(at::ScalarType t, const std::string& what);

// The MPI operation for `op` on dtype `t`. AVG is SUM here (MPI has no AVG); the caller divides afterwards.
// Called on the MPI thread (MPI_Op_create needs MPI initialised). Throws c10::Error naming `what` for an op
// the dtype does not support (bitwise ops of floats, AVG of integers, PREMUL_SUM).
MPI_Op mpi_op(c10d::ReduceOp::RedOpType op, at::ScalarType t, const std::string& what);

// "SUM", "AVG", ...: the op's name in error messages.
const char* op_name(c10d::ReduceOp::RedOpType op);

// "[4, 8] Float": a tensor's shape and dtype in error messages.
std::string describe_tensor(const at::Tensor& t);

}  // namespace fsdp::detail
