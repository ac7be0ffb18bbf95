// core/pending_read.cpp: PendingRead: an asynchronous copy to pinned memory and its event.
#include "core/pending_read.h"

#include <utility>

#include "core/cuda/runtime.h"
#include "core/error.h"
#include "core/ops.h"

namespace shardlab {

PendingRead::PendingRead() = default;
PendingRead::~PendingRead() = default;
PendingRead::PendingRead(PendingRead&&) noexcept = default;
PendingRead& PendingRead::operator=(PendingRead&&) noexcept = default;

PendingRead::PendingRead(const std::vector<Tensor>& values) {
  SHARDLAB_CHECK(!values.empty(), "PendingRead: no values to read");
  const Device device = values.front().device();
  std::vector<Tensor> flat;
  for (const Tensor& value : values) {
    SHARDLAB_CHECK(value.defined() && value.numel() == 1, "PendingRead: value {} is {}, not one element",
                   flat.size(), value.defined() ? shape_str(value.shape()) : std::string("undefined"));
    SHARDLAB_CHECK(value.device() == device, "PendingRead: value {} is on {} but value 0 is on {}",
                   flat.size(), value.device().str(), device.str());
    flat.push_back(value.to(DType::f64).reshape({1}));
  }
  const Tensor gathered = cat(flat, 0);
  if (!device.is_cuda()) {
    host_ = gathered;
    return;
  }
  host_ = shardlab::empty({gathered.numel()}, TensorOptions{DType::f64, Device::cpu(), /*pinned=*/true});
  cuda::Stream& stream = cuda::current_stream(device.index);
  cuda::copy_to_host_async(host_.raw_data(), gathered.raw_data(),
                           static_cast<std::size_t>(gathered.numel()) * sizeof(double), stream);
  copied_ = std::make_unique<cuda::Event>(device.index);
  copied_->record(stream);
}

std::vector<double> PendingRead::take() {
  SHARDLAB_CHECK(!empty(), "PendingRead::take: nothing to read (read once, or never queued)");
  if (copied_ && !copied_->query()) copied_->synchronize("read values queued earlier");
  std::vector<double> values = host_.to_vector<double>();
  host_ = Tensor();
  copied_.reset();
  return values;
}

}  // namespace shardlab
