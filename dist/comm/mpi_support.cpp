// dist/comm/mpi_support.cpp: MPI status checks, init/finalize, 16-bit float reductions, owned communicators.
#include "dist/comm/mpi_support.h"

#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/error.h"

namespace shardlab::dist {

void check_mpi(int code, const char* expr, const char* file, int line) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  fail("MPI error at {}:{}: {} failed: {}", file, line, expr, std::string_view(text, length));
}

namespace {

// MPI user functions (MPI_User_function's signature), elementwise in the compute type
// (f32 for bf16 and f16, which MPI cannot add).
template <typename T, typename Combine>
void combine(void* in, void* inout, int* length, MPI_Datatype*) {
  const auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *length; ++i) b[i] = narrow<T>(Combine{}(widen(a[i]), widen(b[i])));
}

struct Add {
  template <typename F>
  F operator()(F a, F b) const {
    return a + b;
  }
};
// A NaN on either side propagates (MPI_MAX's plain comparison may drop it), so a rank that
// diverged is never hidden by the others.
struct Max {
  template <typename F>
  F operator()(F a, F b) const {
    return (a != a || a > b) ? a : b;
  }
};

// Our reductions, created after MPI_Init and freed before MPI_Finalize.
struct Reductions {
  MPI_Op bf16_sum = MPI_OP_NULL, bf16_max = MPI_OP_NULL, f16_sum = MPI_OP_NULL, f16_max = MPI_OP_NULL;
  MPI_Op f32_max = MPI_OP_NULL, f64_max = MPI_OP_NULL;

  std::array<MPI_Op*, 6> all() { return {&bf16_sum, &bf16_max, &f16_sum, &f16_max, &f32_max, &f64_max}; }
};
Reductions reductions;

}  // namespace

void prefer_yielding_waits() {
  SHARDLAB_CHECK(setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0) == 0,
                 "dist::init: could not set OMPI_MCA_mpi_yield_when_idle: {}", std::strerror(errno));
}

MpiEnvironment::MpiEnvironment(int& argc, char**& argv) {
  int initialized = 0;
  SHARDLAB_MPI_CHECK(MPI_Initialized(&initialized));
  SHARDLAB_CHECK(!initialized,
                 "dist::init: MPI is already initialised in this process (call dist::init once)");
  prefer_yielding_waits();
  int provided = 0;
  SHARDLAB_MPI_CHECK(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided));
  if (provided < MPI_THREAD_MULTIPLE) {
    MPI_Finalize();
    fail("dist::init: this MPI library provides thread level {} but shardlab needs MPI_THREAD_MULTIPLE ({})",
         provided, MPI_THREAD_MULTIPLE);
  }
  SHARDLAB_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  SHARDLAB_MPI_CHECK(MPI_Op_create(combine<bf16, Add>, 1, &reductions.bf16_sum));
  SHARDLAB_MPI_CHECK(MPI_Op_create(combine<bf16, Max>, 1, &reductions.bf16_max));
  SHARDLAB_MPI_CHECK(MPI_Op_create(combine<f16, Add>, 1, &reductions.f16_sum));
  SHARDLAB_MPI_CHECK(MPI_Op_create(combine<f16, Max>, 1, &reductions.f16_max));
  SHARDLAB_MPI_CHECK(MPI_Op_create(combine<float, Max>, 1, &reductions.f32_max));
  SHARDLAB_MPI_CHECK(MPI_Op_create(combine<double, Max>, 1, &reductions.f64_max));
}

MpiEnvironment::~MpiEnvironment() {
  for (MPI_Op* op : reductions.all()) MPI_Op_free(op);
  MPI_Finalize();
}

MPI_Datatype mpi_datatype(DType dtype, std::string_view op) {
  switch (dtype) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::bf16:
    case DType::f16:
      return MPI_UINT16_T;
    case DType::i64:
      return MPI_INT64_T;
    case DType::i32:
      return MPI_INT32_T;
    case DType::u8:
      return MPI_UINT8_T;
    case DType::boolean:
      break;
  }
  fail("{}: dtype {} is not supported by collectives (f32, f64, bf16, f16, i64, i32, u8 are)", op,
       dtype_name(dtype));
}

MPI_Op mpi_reduction(ReduceOp op, DType dtype) {
  const bool max = op == ReduceOp::max;
  if (dtype == DType::bf16) return max ? reductions.bf16_max : reductions.bf16_sum;
  if (dtype == DType::f16) return max ? reductions.f16_max : reductions.f16_sum;
  if (max && dtype == DType::f32) return reductions.f32_max;
  if (max && dtype == DType::f64) return reductions.f64_max;
  return max ? MPI_MAX : MPI_SUM;
}

MpiComm MpiComm::duplicate(MPI_Comm comm) {
  MPI_Comm copy = MPI_COMM_NULL;
  SHARDLAB_MPI_CHECK(MPI_Comm_dup(comm, &copy));
  MpiComm owned(copy);
  SHARDLAB_MPI_CHECK(MPI_Comm_set_errhandler(copy, MPI_ERRORS_RETURN));
  return owned;
}

MpiComm MpiComm::split(int color, int key) const {
  SHARDLAB_CHECK(color >= 0, "Communicator::split: color must be >= 0, got {}", color);
  MPI_Comm part = MPI_COMM_NULL;
  SHARDLAB_MPI_CHECK(MPI_Comm_split(comm_, color, key, &part));
  MpiComm owned(part);
  SHARDLAB_MPI_CHECK(MPI_Comm_set_errhandler(part, MPI_ERRORS_RETURN));
  return owned;
}

MpiComm MpiComm::split_by_machine() const {
  MPI_Comm local = MPI_COMM_NULL;
  SHARDLAB_MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank(), MPI_INFO_NULL, &local));
  return MpiComm(local);
}

MpiComm::~MpiComm() {
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

MpiComm::MpiComm(MpiComm&& other) noexcept : comm_(std::exchange(other.comm_, MPI_COMM_NULL)) {}

MpiComm& MpiComm::operator=(MpiComm&& other) noexcept {
  if (this != &other) {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    comm_ = std::exchange(other.comm_, MPI_COMM_NULL);
  }
  return *this;
}

int MpiComm::rank() const {
  int rank = 0;
  SHARDLAB_MPI_CHECK(MPI_Comm_rank(comm_, &rank));
  return rank;
}

int MpiComm::size() const {
  int size = 0;
  SHARDLAB_MPI_CHECK(MPI_Comm_size(comm_, &size));
  return size;
}

}  // namespace shardlab::dist
