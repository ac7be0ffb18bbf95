// core/parallel.h: the CPU thread pool behind every CPU kernel, and how many threads it uses.
#pragma once

#include <cstdint>
#include <functional>

namespace shardlab {

// Threads CPU kernels use (GEMMs included, core/cpu/gemm.h). Default: SHARDLAB_NUM_THREADS if set; else the
// cores this process may run on (its affinity mask), divided among the ranks on this node
// when the process is not pinned (OMPI_COMM_WORLD_LOCAL_SIZE), at least 1.
int num_threads();
void set_num_threads(int threads);

// Runs fn(begin, end) over [begin, end) split into chunks of at least `grain` items, on
// the pool and the calling thread. The first exception a chunk throws is rethrown here.
// Nested calls run serially in the calling thread.
void parallel_for(std::int64_t begin, std::int64_t end, std::int64_t grain,
                  const std::function<void(std::int64_t, std::int64_t)>& fn);

}  // namespace shardlab
