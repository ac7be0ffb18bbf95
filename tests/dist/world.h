// tests/dist/world.h: helpers of the mpirun tests: the world communicator, exact rank
// patterns (nccl-tests style) and a count of wrong elements summed over all ranks with raw MPI,
// so a broken Communicator cannot vouch for itself.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "core/tensor.h"
#include "dist/comm/init.h"
#include "tests/check.h"

namespace shardlab::test {

// The MPI communicator of all ranks, which the CPU tests use whatever the session's device.
inline dist::Communicator& world() { return dist::session().cpu_world(); }

inline std::int64_t sum_over_ranks(std::int64_t local, MPI_Comm comm = MPI_COMM_WORLD) {
  std::int64_t total = 0;
  MPI_Allreduce(&local, &total, 1, MPI_INT64_T, MPI_SUM, comm);
  return total;
}

// The mean of `local` over all ranks (a loss, for one-process comparisons).
inline double mean_over_ranks(double local, MPI_Comm comm = MPI_COMM_WORLD) {
  double total = 0;
  int size = 1;
  MPI_Allreduce(&local, &total, 1, MPI_DOUBLE, MPI_SUM, comm);
  MPI_Comm_size(comm, &size);
  return total / size;
}

inline double max_over_ranks(double local, MPI_Comm comm = MPI_COMM_WORLD) {
  double largest = 0;
  MPI_Allreduce(&local, &largest, 1, MPI_DOUBLE, MPI_MAX, comm);
  return largest;
}

// A tensor of `count` elements whose element i is value(i), built in f64 and cast: every
// value used here is a small integer, exact in every dtype including bf16, f16 and u8.
inline Tensor pattern(DType dtype, std::int64_t count, const std::function<double(std::int64_t)>& value) {
  std::vector<double> values(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) values[static_cast<std::size_t>(i)] = value(i);
  return from_vector(values, {count}).to(dtype);
}

// Elements of `actual` that differ from expected(i) on this rank, summed over all ranks.
inline std::int64_t wrong_on_any_rank(const Tensor& actual,
                                      const std::function<double(std::int64_t)>& expected) {
  const std::vector<double> got = actual.to(Device::cpu()).to_vector<double>();
  std::vector<double> want(got.size());
  for (std::size_t i = 0; i < want.size(); ++i) want[i] = expected(static_cast<std::int64_t>(i));
  return sum_over_ranks(count_mismatches(got, want, Tolerance{0.0, 0.0}));
}

}  // namespace shardlab::test
