// Datatypes and reduction ops of the "mpi" backend (see mpi_types.h). Compiled only in a build with MPI.
#include "c10d/mpi/mpi_types.h"

#include <cmath>
#include <sstream>

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

namespace fsdp::detail {

namespace {

// 16-bit floats reduce as Gloo does: each pairwise step in float, rounded back to the 16-bit type.
template <typename T, typename F>
void reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  F f;
  for (int i = 0; i < *len; ++i) b[i] = static_cast<T>(f(static_cast<float>(a[i]), static_cast<float>(b[i])));
}
struct Add { float operator()(float a, float b) const { return a + b; } };
struct Mul { float operator()(float a, float b) const { return a * b; } };
struct Min { float operator()(float a, float b) const { return std::isnan(a) ? a : (b < a ? b : a); } };
struct Max { float operator()(float a, float b) const { return std::isnan(a) ? a : (b > a ? b : a); } };

// A sum or max of booleans is "any", a product or min is "all" (as Gloo).
MPI_Op bool_op(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::MAX:
    case c10d::ReduceOp::BOR: return MPI_LOR;
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::BAND: return MPI_LAND;
    case c10d::ReduceOp::BXOR: return MPI_LXOR;
    default: return MPI_OP_NULL;
  }
}

// Half and BFloat16: user ops (reduce16), made once, on first use.
MPI_Op float16_op(c10d::ReduceOp::RedOpType op, at::ScalarType t) {
  static MPI_Op ops[2][4] = {};
  static bool made = false;
  if (!made) {
    MPI_Op_create(&reduce16<c10::Half, Add>, 1, &ops[0][0]);
    MPI_Op_create(&reduce16<c10::Half, Mul>, 1, &ops[0][1]);
    MPI_Op_create(&reduce16<c10::Half, Min>, 1, &ops[0][2]);
    MPI_Op_create(&reduce16<c10::Half, Max>, 1, &ops[0][3]);
    MPI_Op_create(&reduce16<c10::BFloat16, Add>, 1, &ops[1][0]);
    MPI_Op_create(&reduce16<c10::BFloat16, Mul>, 1, &ops[1][1]);
    MPI_Op_create(&reduce16<c10::BFloat16, Min>, 1, &ops[1][2]);
    MPI_Op_create(&reduce16<c10::BFloat16, Max>, 1, &ops[1][3]);
    made = true;
  }
  int k = t == at::kHalf ? 0 : 1;
  switch (op) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG: return ops[k][0];
    case c10d::ReduceOp::PRODUCT: return ops[k][1];
    case c10d::ReduceOp::MIN: return ops[k][2];
    case c10d::ReduceOp::MAX: return ops[k][3];
    default: return MPI_OP_NULL;
  }
}

// MPI's built-in ops for the other dtypes: AVG (as SUM) only for floating point, bitwise ops only for
// integers.
MPI_Op builtin_op(c10d::ReduceOp::RedOpType op, bool floating) {
  switch (op) {
    case c10d::ReduceOp::SUM: return MPI_SUM;
    case c10d::ReduceOp::AVG: return floating ? MPI_SUM : MPI_OP_NULL;
    case c10d::ReduceOp::PRODUCT: return MPI_PROD;
    case c10d::ReduceOp::MIN: return MPI_MIN;
    case c10d::ReduceOp::MAX: return MPI_MAX;
    case c10d::ReduceOp::BAND: return floating ? MPI_OP_NULL : MPI_BAND;
    case c10d::ReduceOp::BOR: return floating ? MPI_OP_NULL : MPI_BOR;
    case c10d::ReduceOp::BXOR: return floating ? MPI_OP_NULL : MPI_BXOR;
    default: return MPI_OP_NULL;
  }
}

}  // namespace

MPI_Datatype mpi_type(at::ScalarType t, const std::string& what) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kHalf:
    case at::kBFloat16: return MPI_UINT16_T;  // moved as bits; reduced by the user ops of mpi_op()
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kShort: return MPI_INT16_T;
    case at::kChar: return MPI_INT8_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kBool: return MPI_C_BOOL;
    default: break;
  }
  TORCH_CHECK(false, "ProcessGroupMPI: ", what, ": dtype ", t, " is not supported: expected one of Float, Double, "
              "Half, BFloat16, Int, Long, Short, Char, Byte, Bool");
}

const char* op_name(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

MPI_Op mpi_op(c10d::ReduceOp::RedOpType op, at::ScalarType t, const std::string& what) {
  const bool floating = t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
  MPI_Op m = t == at::kBool                            ? bool_op(op)
             : (t == at::kHalf || t == at::kBFloat16) ? float16_op(op, t)
                                                      : builtin_op(op, floating);
  TORCH_CHECK(m != MPI_OP_NULL, "ProcessGroupMPI: ", what, ": reduce op ", op_name(op),
              " is not supported for dtype ", t,
              ": expected SUM, AVG (floating point), PRODUCT, MIN, MAX, or BAND/BOR/BXOR (integers, bool)");
  return m;
}

std::string describe_tensor(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes() << " " << t.scalar_type();
  return os.str();
}

}  // namespace fsdp::detail
