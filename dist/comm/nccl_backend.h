// dist/comm/nccl_backend.h: internal to dist/: the NCCL backend (CUDA tensors on one device).
#pragma once

#include <memory>

#include "dist/comm/backend.h"
#include "dist/comm/mpi_support.h"

namespace shardlab::dist {

// Whether this build has NCCL.
bool nccl_built();

// Creates the NCCL communicator of `comm`'s ranks on cuda:`device` (rank 0's ncclUniqueId is
// broadcast over `comm`). Collective over `comm`. Throws when built without NCCL.
std::unique_ptr<Backend> make_nccl_backend(const MpiComm& comm, int device, std::shared_ptr<Monitor> monitor);

}  // namespace shardlab::dist
