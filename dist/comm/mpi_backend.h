// dist/comm/mpi_backend.h: internal to dist/: the MPI backend (CPU tensors; CUDA tensors staged
// through host memory, so several processes sharing one GPU can still run multi-rank).
#pragma once

#include <memory>

#include "dist/comm/backend.h"
#include "dist/comm/mpi_support.h"

namespace shardlab::dist {

// Which tensors reach MPI through host copies: CUDA ones (MPI reads host memory), or every one, a
// testing mode that runs the staging (its copies, and its in-place aliasing) with CPU tensors.
enum class MpiStaging { device_tensors, every_tensor };

// Runs collectives on a communication thread of its own, in issue order, on a duplicate
// of `comm`, so they overlap with whatever the caller computes meanwhile.
std::unique_ptr<Backend> make_mpi_backend(const MpiComm& comm, std::shared_ptr<Monitor> monitor,
                                          MpiStaging staging = MpiStaging::device_tensors);

}  // namespace shardlab::dist
