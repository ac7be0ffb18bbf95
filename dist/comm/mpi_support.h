// dist/comm/mpi_support.h: internal to dist/: the one macro that checks MPI calls, the MPI environment
// (init/finalize and our reductions for 16-bit floats) and an owning MPI communicator.
#pragma once

#include <mpi.h>

#include "core/dtype.h"
#include "dist/comm/collective.h"

namespace shardlab::dist {

// Throws shardlab::Error "MPI error at file:line: expr failed: <MPI's error string>".
void check_mpi(int code, const char* expr, const char* file, int line);

// Asks Open MPI (through OMPI_MCA_mpi_yield_when_idle, read by MPI_Init) to yield the core while
// a collective waits for a peer, rather than spin on it: the collectives run on a thread beside
// the compute thread, often on the same cores, and a spinning wait takes their time (the CNN at 2
// ranks x 1 thread: 3.9 of a 32 ms step outside the kernels, 2.3 when yielding). A value already in
// the environment (the user's, or mpirun's) is kept; other MPI libraries ignore the variable.
void prefer_yielding_waits();

// Owns MPI for the process: prefer_yielding_waits(), then MPI_Init_thread(MPI_THREAD_MULTIPLE) (each
// communicator has a communication thread, and FSDP issues collectives from more than one thread) and, on
// destruction, MPI_Finalize. MPI can be initialised once per process.
class MpiEnvironment {
 public:
  MpiEnvironment(int& argc, char**& argv);
  ~MpiEnvironment();
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;
};

// The MPI datatype that carries `dtype` (bf16 and f16 travel as 16-bit words); throws an
// Error naming `op` for dtypes collectives do not support (bool).
MPI_Datatype mpi_datatype(DType dtype, std::string_view op);
// The MPI reduction for `op` on `dtype` (avg is a sum the caller divides). 16-bit floats use
// our own commutative reductions, which add or compare in f32 and round back; max on floats
// is ours too, so that NaN propagates.
MPI_Op mpi_reduction(ReduceOp op, DType dtype);

// An owned MPI communicator (freed on destruction). Collective constructors (dup, split)
// must be called by every rank in the same order.
class MpiComm {
 public:
  MpiComm() = default;
  // A duplicate of `comm`, with errors returned rather than aborting the job.
  static MpiComm duplicate(MPI_Comm comm);
  MpiComm split(int color, int key) const;
  // The ranks of this communicator that share this machine's memory (MPI_COMM_TYPE_SHARED).
  MpiComm split_by_machine() const;
  ~MpiComm();
  MpiComm(MpiComm&& other) noexcept;
  MpiComm& operator=(MpiComm&& other) noexcept;

  MPI_Comm get() const { return comm_; }
  int rank() const;
  int size() const;

 private:
  explicit MpiComm(MPI_Comm comm) : comm_(comm) {}
  MPI_Comm comm_ = MPI_COMM_NULL;
};

}  // namespace shardlab::dist

#define SHARDLAB_MPI_CHECK(expr) ::shardlab::dist::check_mpi((expr), #expr, __FILE__, __LINE__)
