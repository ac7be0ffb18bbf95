// dist/fsdp/copy_stream.h: internal to dist/fsdp: on a GPU, the copy-in of a unit's collectives
// (the shard cast to param_dtype for its all-gather, the gradient cast to reduce_dtype for its
// reduce-scatter) runs on a stream of its own per device, as FSDP2's copy-in streams do, so the
// casts overlap the layers' kernels on the compute stream; the collective is queued from that
// stream, and waiting for it makes the compute stream wait. On the CPU the work simply runs.
#pragma once

#include <functional>
#include <vector>

#include "core/tensor.h"

namespace shardlab::dist::detail {

// Runs `work` with `device`'s copy stream current, once that stream waited for what the current
// stream queued so far. `reads`: the device tensors `work` reads that the current stream may free
// afterwards, held by the allocator until the copy stream's work on them ran. What `work` makes
// must be read by its collective only (whose backend records it), never by the compute stream.
void on_copy_stream(Device device, const std::vector<Tensor>& reads, const std::function<void()>& work);

}  // namespace shardlab::dist::detail
