// dist/comm/nccl_disabled.cpp: the NCCL backend of a build without NCCL: asking for it is an error.
#include "core/error.h"
#include "dist/comm/nccl_backend.h"

namespace shardlab::dist {

bool nccl_built() { return false; }

std::unique_ptr<Backend> make_nccl_backend(const MpiComm&, int device, std::shared_ptr<Monitor>) {
  fail(
      "dist: the NCCL backend was requested for cuda:{} but shardlab was built without NCCL "
      "(configure with -Dnccl=enabled where nccl.h and libnccl are installed)",
      device);
}

}  // namespace shardlab::dist
