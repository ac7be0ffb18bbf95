// core/tensor.cpp: Tensor metadata, views, copies between devices and dtypes, and factories.
#include "core/tensor.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

#include "core/call_log.h"
#include "core/cuda/runtime.h"
#include "core/kernels.h"
#include "core/profile.h"

namespace shardlab {

std::string shape_str(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::int64_t shape_numel(const Shape& shape) {
  return std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
}

bool shape_addressable(const Shape& shape) {
  std::int64_t extent = 1;
  for (const std::int64_t size : shape) {
    if (__builtin_mul_overflow(extent, std::max<std::int64_t>(size, 1), &extent)) return false;
  }
  return true;
}

Strides contiguous_strides(const Shape& shape) {
  Strides strides(shape.size());
  std::int64_t stride = 1;
  for (std::size_t d = shape.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= std::max<std::int64_t>(shape[d], 1);
  }
  return strides;
}

std::int64_t wrap_dim(std::int64_t dim, std::int64_t rank, const char* op) {
  const std::int64_t wrapped = dim < 0 ? dim + rank : dim;
  SHARDLAB_CHECK(wrapped >= 0 && wrapped < rank, "{}: dimension {} is out of range for a tensor of rank {}",
                 op, dim, rank);
  return wrapped;
}

Tensor::Tensor(std::shared_ptr<Storage> storage, Shape shape, Strides strides, std::int64_t offset,
               DType dtype)
    : storage_(std::move(storage)),
      shape_(std::move(shape)),
      strides_(std::move(strides)),
      offset_(offset),
      dtype_(dtype) {}

std::int64_t Tensor::wrap_dim(std::int64_t dim, std::int64_t rank, const char* op) const {
  return shardlab::wrap_dim(dim, rank, op);
}

std::int64_t Tensor::size(std::int64_t dim) const { return shape_[wrap_dim(dim, this->dim(), "size")]; }
std::int64_t Tensor::stride(std::int64_t dim) const { return strides_[wrap_dim(dim, this->dim(), "stride")]; }
std::int64_t Tensor::numel() const { return shape_numel(shape_); }
Device Tensor::device() const { return storage_ ? storage_->device() : Device::cpu(); }

bool Tensor::is_pinned() const { return storage_ && storage_->pinned(); }

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // no element to misplace
  std::int64_t expected = 1;
  for (std::size_t d = shape_.size(); d-- > 0;) {
    if (shape_[d] == 1) continue;
    if (strides_[d] != expected) return false;
    expected *= shape_[d];
  }
  return true;
}

void* Tensor::raw_data() const {
  SHARDLAB_CHECK(defined(), "raw_data: tensor is undefined");
  if (storage_->data() == nullptr) return nullptr;  // no bytes: an empty tensor
  return static_cast<char*>(storage_->data()) + offset_ * static_cast<std::int64_t>(element_size());
}

// --- views ---------------------------------------------------------------------------------

namespace {

Shape infer_size(Shape shape, std::int64_t numel, const char* op) {
  std::optional<std::size_t> inferred;
  std::int64_t known = 1;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == -1) {
      SHARDLAB_CHECK(!inferred, "{}: only one dimension can be -1, got {}", op, shape_str(shape));
      inferred = d;
    } else {
      SHARDLAB_CHECK(shape[d] >= 0, "{}: invalid size {} in {}", op, shape[d], shape_str(shape));
      known *= shape[d];
    }
  }
  if (inferred) {
    SHARDLAB_CHECK(known != 0 && numel % known == 0, "{}: shape {} is invalid for a tensor of {} elements",
                   op, shape_str(shape), numel);
    shape[*inferred] = numel / known;
  }
  SHARDLAB_CHECK(shape_numel(shape) == numel, "{}: shape {} is invalid for a tensor of {} elements", op,
                 shape_str(shape), numel);
  return shape;
}

// Strides that let `new_shape` view the same elements, or nullopt when the old strides
// make that impossible. Old dims are grouped into runs that are contiguous with each
// other; each run must be covered exactly by consecutive new dims.
std::optional<Strides> view_strides(const Shape& old_shape, const Strides& old_strides,
                                    const Shape& new_shape) {
  if (old_shape.empty() || shape_numel(old_shape) == 0) return contiguous_strides(new_shape);
  Strides strides(new_shape.size());
  std::int64_t view_d = static_cast<std::int64_t>(new_shape.size()) - 1;
  std::int64_t run_stride = old_strides.back();
  std::int64_t run_numel = 1, view_numel = 1;
  for (std::int64_t d = static_cast<std::int64_t>(old_shape.size()) - 1; d >= 0; --d) {
    run_numel *= old_shape[d];
    const bool run_ends = d == 0 || (old_shape[d - 1] != 1 && old_strides[d - 1] != run_numel * run_stride);
    if (!run_ends) continue;
    while (view_d >= 0 && (view_numel < run_numel || new_shape[view_d] == 1)) {
      strides[view_d] = view_numel * run_stride;
      view_numel *= new_shape[view_d];
      --view_d;
    }
    if (view_numel != run_numel) return std::nullopt;
    if (d > 0) {
      run_stride = old_strides[d - 1];
      run_numel = 1;
      view_numel = 1;
    }
  }
  if (view_d != -1) return std::nullopt;
  return strides;
}

}  // namespace

Tensor Tensor::view(Shape shape) const {
  shape = infer_size(std::move(shape), numel(), "view");
  const auto strides = view_strides(shape_, strides_, shape);
  SHARDLAB_CHECK(strides.has_value(),
                 "view: cannot view a tensor of shape {} and strides {} as {}; use reshape, "
                 "which copies",
                 shape_str(shape_), shape_str(strides_), shape_str(shape));
  return Tensor(storage_, std::move(shape), *strides, offset_, dtype_);
}

Tensor Tensor::reshape(Shape shape) const {
  shape = infer_size(std::move(shape), numel(), "reshape");
  if (const auto strides = view_strides(shape_, strides_, shape)) {
    return Tensor(storage_, std::move(shape), *strides, offset_, dtype_);
  }
  return contiguous().view(std::move(shape));
}

Tensor Tensor::flatten(std::int64_t start_dim, std::int64_t end_dim) const {
  if (dim() == 0) return reshape({1});
  const std::int64_t start = wrap_dim(start_dim, dim(), "flatten");
  const std::int64_t end = wrap_dim(end_dim, dim(), "flatten");
  SHARDLAB_CHECK(start <= end, "flatten: start_dim {} comes after end_dim {}", start_dim, end_dim);
  Shape shape(shape_.begin(), shape_.begin() + start);
  std::int64_t merged = 1;
  for (std::int64_t d = start; d <= end; ++d) merged *= shape_[d];
  shape.push_back(merged);
  shape.insert(shape.end(), shape_.begin() + end + 1, shape_.end());
  return reshape(std::move(shape));
}

Tensor Tensor::permute(const std::vector<std::int64_t>& dims) const {
  SHARDLAB_CHECK(static_cast<std::int64_t>(dims.size()) == dim(),
                 "permute: got {} dims {} for a tensor of rank {}", dims.size(), shape_str(dims), dim());
  std::vector<bool> seen(dims.size(), false);
  Shape shape(dims.size());
  Strides strides(dims.size());
  for (std::size_t i = 0; i < dims.size(); ++i) {
    const std::int64_t d = wrap_dim(dims[i], dim(), "permute");
    SHARDLAB_CHECK(!seen[d], "permute: dims {} repeat dimension {}", shape_str(dims), d);
    seen[d] = true;
    shape[i] = shape_[d];
    strides[i] = strides_[d];
  }
  return Tensor(storage_, std::move(shape), std::move(strides), offset_, dtype_);
}

Tensor Tensor::transpose(std::int64_t dim0, std::int64_t dim1) const {
  const std::int64_t a = wrap_dim(dim0, dim(), "transpose");
  const std::int64_t b = wrap_dim(dim1, dim(), "transpose");
  Shape shape = shape_;
  Strides strides = strides_;
  std::swap(shape[a], shape[b]);
  std::swap(strides[a], strides[b]);
  return Tensor(storage_, std::move(shape), std::move(strides), offset_, dtype_);
}

Tensor Tensor::narrow(std::int64_t dim, std::int64_t start, std::int64_t length) const {
  const std::int64_t d = wrap_dim(dim, this->dim(), "narrow");
  const std::int64_t first = start < 0 ? start + shape_[d] : start;
  SHARDLAB_CHECK(first >= 0 && length >= 0 && first + length <= shape_[d],
                 "narrow: start {} and length {} do not fit dimension {} of size {}", start, length, d,
                 shape_[d]);
  Shape shape = shape_;
  shape[d] = length;
  return Tensor(storage_, std::move(shape), strides_, offset_ + first * strides_[d], dtype_);
}

Tensor Tensor::slice(std::int64_t dim, std::int64_t start, std::int64_t end, std::int64_t step) const {
  const std::int64_t d = wrap_dim(dim, this->dim(), "slice");
  SHARDLAB_CHECK(step > 0, "slice: step must be positive, got {}", step);
  const std::int64_t size = shape_[d];
  const auto clamp_index = [size](std::int64_t i) {
    return std::clamp<std::int64_t>(i < 0 ? i + size : i, 0, size);
  };
  const std::int64_t first = clamp_index(start);
  const std::int64_t last = std::max(first, clamp_index(end));
  Shape shape = shape_;
  Strides strides = strides_;
  shape[d] = (last - first + step - 1) / step;
  strides[d] *= step;
  return Tensor(storage_, std::move(shape), std::move(strides), offset_ + first * strides_[d], dtype_);
}

Tensor Tensor::select(std::int64_t dim, std::int64_t index) const {
  const std::int64_t d = wrap_dim(dim, this->dim(), "select");
  const std::int64_t i = index < 0 ? index + shape_[d] : index;
  SHARDLAB_CHECK(i >= 0 && i < shape_[d], "select: index {} is out of range for dimension {} of size {}",
                 index, d, shape_[d]);
  Shape shape = shape_;
  Strides strides = strides_;
  shape.erase(shape.begin() + d);
  strides.erase(strides.begin() + d);
  return Tensor(storage_, std::move(shape), std::move(strides), offset_ + i * strides_[d], dtype_);
}

Tensor Tensor::expand(Shape shape) const {
  SHARDLAB_CHECK(shape.size() >= shape_.size(), "expand: cannot expand shape {} to fewer dims {}",
                 shape_str(shape_), shape_str(shape));
  const std::size_t lead = shape.size() - shape_.size();
  Strides strides(shape.size(), 0);
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (d < lead) {
      SHARDLAB_CHECK(shape[d] >= 0, "expand: new leading dimension {} cannot be {} in {}", d, shape[d],
                     shape_str(shape));
      continue;
    }
    const std::int64_t old_size = shape_[d - lead];
    if (shape[d] == -1) shape[d] = old_size;
    if (old_size == shape[d]) {
      strides[d] = strides_[d - lead];
    } else {
      SHARDLAB_CHECK(old_size == 1, "expand: cannot expand shape {} to {} (dimension {}: {} vs {})",
                     shape_str(shape_), shape_str(shape), d, old_size, shape[d]);
    }
  }
  return Tensor(storage_, std::move(shape), std::move(strides), offset_, dtype_);
}

Tensor Tensor::broadcast_to(const Shape& shape) const { return expand(shape); }

Tensor Tensor::squeeze() const {
  Shape shape;
  Strides strides;
  for (std::size_t d = 0; d < shape_.size(); ++d) {
    if (shape_[d] == 1) continue;
    shape.push_back(shape_[d]);
    strides.push_back(strides_[d]);
  }
  return Tensor(storage_, std::move(shape), std::move(strides), offset_, dtype_);
}

Tensor Tensor::squeeze(std::int64_t dim) const {
  const std::int64_t d = wrap_dim(dim, this->dim(), "squeeze");
  if (shape_[d] != 1) return *this;
  Shape shape = shape_;
  Strides strides = strides_;
  shape.erase(shape.begin() + d);
  strides.erase(strides.begin() + d);
  return Tensor(storage_, std::move(shape), std::move(strides), offset_, dtype_);
}

Tensor Tensor::unsqueeze(std::int64_t dim) const {
  const std::int64_t d = wrap_dim(dim, this->dim() + 1, "unsqueeze");
  Shape shape = shape_;
  Strides strides = strides_;
  const std::int64_t stride = d < this->dim() ? shape_[d] * strides_[d] : 1;
  shape.insert(shape.begin() + d, 1);
  strides.insert(strides.begin() + d, stride);
  return Tensor(storage_, std::move(shape), std::move(strides), offset_, dtype_);
}

// --- copies --------------------------------------------------------------------------------

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor Tensor::clone() const {
  Tensor out = empty(shape_, TensorOptions{dtype_, device()});
  out.copy_(*this);
  return out;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return *this;
  Tensor out = empty(shape_, TensorOptions{dtype, device()});
  out.copy_(*this);
  return out;
}

Tensor Tensor::to(Device device, bool non_blocking) const {
  if (device == this->device()) return *this;
  SHARDLAB_CHECK(device.is_cpu() || this->device().is_cpu(),
                 "to: copies between {} and {} go through the host: use .to(cpu) first", this->device().str(),
                 device.str());
  const Tensor source = contiguous();
  Tensor out = empty(shape_, TensorOptions{dtype_, device});
  const std::size_t nbytes = static_cast<std::size_t>(numel()) * element_size();
  if (nbytes == 0) return out;
  if (non_blocking && device.is_cuda() && source.is_pinned()) {
    cuda::copy_to_device_async(out.raw_data(), source.raw_data(), nbytes, device.index);
  } else {
    const int cuda_index = device.is_cuda() ? device.index : this->device().index;
    cuda::copy_bytes(out.raw_data(), device.is_cuda(), source.raw_data(), this->device().is_cuda(), nbytes,
                     cuda_index);
  }
  return out;
}

Tensor Tensor::pin_memory() const {
  SHARDLAB_CHECK(defined(), "pin_memory: tensor is undefined");
  SHARDLAB_CHECK(device().is_cpu(), "pin_memory: the tensor is on {}; only CPU tensors can be pinned",
                 device().str());
  if (is_pinned()) return *this;
  Tensor out = empty(shape_, TensorOptions{dtype_, Device::cpu(), true});
  out.copy_(*this);
  return out;
}

const Tensor& Tensor::fill_(Scalar value) const {
  if (numel() == 0) return *this;
  const call_log::Scope logged("fill", device(), *this);
  const profile::KernelTimer timer("fill", device());
  kernels_for(device()).fill(*this, value);
  return *this;
}

const Tensor& Tensor::copy_(const Tensor& src) const {
  SHARDLAB_CHECK(src.defined(), "copy_: source tensor is undefined");
  Tensor expanded = src.expand(shape_);
  if (numel() == 0) return *this;
  if (src.device() != device()) {
    // Stage through a contiguous copy so the bytes cross the bus once, in one piece.
    expanded = expanded.contiguous().to(device());
  }
  const char* op = src.dtype() == dtype() ? "copy" : "cast";
  const call_log::Scope logged(op, device(), *this, expanded);
  const profile::KernelTimer timer(op, device());
  kernels_for(device()).copy(*this, expanded);
  return *this;
}

template <typename T>
T Tensor::item() const {
  SHARDLAB_CHECK(numel() == 1, "item: tensor of shape {} has {} elements, not 1", shape_str(shape_), numel());
  return to_vector<T>()[0];
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  const Tensor host = to(Device::cpu()).to(dtype_of<T>).contiguous();
  const T* data = static_cast<const T*>(host.raw_data());
  return std::vector<T>(data, data + host.numel());
}

#define SHARDLAB_INSTANTIATE_ACCESS(T) \
  template T Tensor::item<T>() const;  \
  template std::vector<T> Tensor::to_vector<T>() const;
SHARDLAB_INSTANTIATE_ACCESS(float)
SHARDLAB_INSTANTIATE_ACCESS(double)
SHARDLAB_INSTANTIATE_ACCESS(std::int64_t)
SHARDLAB_INSTANTIATE_ACCESS(std::int32_t)
SHARDLAB_INSTANTIATE_ACCESS(std::uint8_t)
SHARDLAB_INSTANTIATE_ACCESS(bf16)
SHARDLAB_INSTANTIATE_ACCESS(f16)
SHARDLAB_INSTANTIATE_ACCESS(bool)
#undef SHARDLAB_INSTANTIATE_ACCESS

// --- factories -----------------------------------------------------------------------------

Tensor empty(const Shape& shape, TensorOptions options) {
  for (const std::int64_t size : shape) {
    SHARDLAB_CHECK(size >= 0, "empty: negative size in shape {}", shape_str(shape));
  }
  std::int64_t nbytes = 0;
  SHARDLAB_CHECK(shape_addressable(shape) &&
                     !__builtin_mul_overflow(shape_numel(shape),
                                             static_cast<std::int64_t>(dtype_size(options.dtype)), &nbytes),
                 "empty: shape {} of {} has more elements or bytes than int64 can count", shape_str(shape),
                 dtype_name(options.dtype));
  auto storage = std::make_shared<Storage>(options.device, static_cast<std::size_t>(nbytes), options.pinned);
  return Tensor(std::move(storage), shape, contiguous_strides(shape), 0, options.dtype);
}

Tensor full(const Shape& shape, Scalar value, TensorOptions options) {
  Tensor out = empty(shape, options);
  out.fill_(value);
  return out;
}

Tensor zeros(const Shape& shape, TensorOptions options) { return full(shape, 0, options); }
Tensor ones(const Shape& shape, TensorOptions options) { return full(shape, 1, options); }
Tensor zeros_like(const Tensor& like) { return zeros(like.shape(), {like.dtype(), like.device()}); }

Tensor empty_in_layout_of(const Tensor& like, const Shape& shape, TensorOptions options) {
  const auto rank = static_cast<std::int64_t>(shape.size());
  SHARDLAB_CHECK(like.dim() == rank,
                 "empty_in_layout_of: shape {} has rank {}, but the tensor whose layout it takes is {}",
                 shape_str(shape), rank, shape_str(like.shape()));
  std::vector<std::int64_t> order(shape.size()), inverse(shape.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::int64_t a, std::int64_t b) { return like.stride(a) > like.stride(b); });
  Shape in_memory_order;
  for (std::int64_t d = 0; d < rank; ++d) {
    in_memory_order.push_back(shape[order[d]]);
    inverse[order[d]] = d;
  }
  return empty(in_memory_order, options).permute(inverse);
}

Tensor scalar_tensor(Scalar value, TensorOptions options) { return full({}, value, options); }

namespace {

// Values made on the host, onto `device`: on a GPU through pinned memory and a queued copy, so that
// making them (an arange inside a training step) never waits for the device's queued work; the pinned
// block is not reused before the copy ran.
Tensor onto(const Tensor& host, Device device) {
  return device.is_cuda() ? host.pin_memory().to(device, /*non_blocking=*/true) : host.to(device);
}

}  // namespace

Tensor arange(Scalar start, Scalar end, Scalar step, TensorOptions options) {
  const double first = start.to_double(), last = end.to_double(), increment = step.to_double();
  SHARDLAB_CHECK(increment != 0, "arange: step must be non-zero");
  const double span = (last - first) / increment;
  const auto count = static_cast<std::int64_t>(std::max(0.0, std::ceil(span)));
  // Computed on the host in the widest type of its kind, then converted once.
  const bool integral = start.kind() != Scalar::Kind::floating && end.kind() != Scalar::Kind::floating &&
                        step.kind() != Scalar::Kind::floating;
  Tensor host;
  if (integral) {
    std::vector<std::int64_t> values(count);
    for (std::int64_t i = 0; i < count; ++i) values[i] = start.to_int() + i * step.to_int();
    host = from_vector(values);
  } else {
    std::vector<double> values(count);
    for (std::int64_t i = 0; i < count; ++i) values[i] = first + static_cast<double>(i) * increment;
    host = from_vector(values);
  }
  return onto(host.to(options.dtype), options.device);
}

Tensor arange(std::int64_t end, TensorOptions options) { return arange(0, end, 1, options); }

template <typename T>
Tensor from_vector(const std::vector<T>& values, Shape shape, Device device) {
  SHARDLAB_CHECK(shape_numel(shape) == static_cast<std::int64_t>(values.size()),
                 "from_vector: {} values do not fill shape {}", values.size(), shape_str(shape));
  Tensor host = empty(shape, TensorOptions{dtype_of<T>, Device::cpu()});
  std::copy(values.begin(), values.end(), static_cast<T*>(host.raw_data()));
  return onto(host, device);
}

template <typename T>
Tensor from_vector(const std::vector<T>& values, Device device) {
  return from_vector(values, Shape{static_cast<std::int64_t>(values.size())}, device);
}

#define SHARDLAB_INSTANTIATE_FROM_VECTOR(T)                             \
  template Tensor from_vector<T>(const std::vector<T>&, Shape, Device); \
  template Tensor from_vector<T>(const std::vector<T>&, Device);
SHARDLAB_INSTANTIATE_FROM_VECTOR(float)
SHARDLAB_INSTANTIATE_FROM_VECTOR(double)
SHARDLAB_INSTANTIATE_FROM_VECTOR(std::int64_t)
SHARDLAB_INSTANTIATE_FROM_VECTOR(std::int32_t)
SHARDLAB_INSTANTIATE_FROM_VECTOR(std::uint8_t)
SHARDLAB_INSTANTIATE_FROM_VECTOR(bool)
SHARDLAB_INSTANTIATE_FROM_VECTOR(bf16)
SHARDLAB_INSTANTIATE_FROM_VECTOR(f16)
#undef SHARDLAB_INSTANTIATE_FROM_VECTOR

}  // namespace shardlab
