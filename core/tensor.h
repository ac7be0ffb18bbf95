// core/tensor.h: Tensor (shape, strides, offset over a shared Storage), its views and factories.
//
//   Tensor x = arange(6).reshape({2, 3});        // [2, 3] i64 cpu
//   Tensor y = x.to(DType::f32).transpose(0, 1);  // a view: no bytes copied
//   Tensor z = y.contiguous();                    // now a copy in row-major order
//   fmt::print("{}\n", z.str());
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/scalar.h"
#include "core/storage.h"

namespace shardlab {

using Shape = std::vector<std::int64_t>;    // sizes per dimension
using Strides = std::vector<std::int64_t>;  // element strides per dimension

std::string shape_str(const Shape& shape);  // "[2, 3]"
std::int64_t shape_numel(const Shape& shape);
Strides contiguous_strides(const Shape& shape);
// Whether `shape`'s sizes, zeros counted as ones, multiply to at most INT64_MAX: then its numel and
// contiguous strides fit int64. empty() refuses other shapes; readers of untrusted files check it
// first so that their error can name the file.
bool shape_addressable(const Shape& shape);

struct TensorOptions {
  DType dtype = DType::f32;
  Device device = Device::cpu();
  // Page-locked host memory (CPU tensors only; needs a usable GPU): copies from it to a GPU can
  // run while the host goes on (Tensor::to with non_blocking).
  bool pinned = false;

  TensorOptions& with_dtype(DType value) {
    dtype = value;
    return *this;
  }
  TensorOptions& with_device(Device value) {
    device = value;
    return *this;
  }
  TensorOptions& with_pinned(bool value) {
    pinned = value;
    return *this;
  }
};
inline TensorOptions dtype(DType value) { return TensorOptions{}.with_dtype(value); }
inline TensorOptions device(Device value) { return TensorOptions{}.with_device(value); }

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false
  Tensor(std::shared_ptr<Storage> storage, Shape shape, Strides strides, std::int64_t offset, DType dtype);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  const Strides& strides() const { return strides_; }
  std::int64_t dim() const { return static_cast<std::int64_t>(shape_.size()); }
  std::int64_t size(std::int64_t dim) const;  // negative dims count from the end
  std::int64_t stride(std::int64_t dim) const;
  std::int64_t offset() const { return offset_; }  // in elements, into the storage
  std::int64_t numel() const;
  DType dtype() const { return dtype_; }
  Device device() const;
  std::size_t element_size() const { return dtype_size(dtype_); }
  bool is_contiguous() const;
  bool is_pinned() const;  // in page-locked host memory (TensorOptions::pinned, pin_memory())
  const std::shared_ptr<Storage>& storage() const { return storage_; }

  // Address of element [0, 0, ...]; typed access checks the dtype.
  void* raw_data() const;
  template <typename T>
  T* data() const {
    SHARDLAB_CHECK(dtype_of<T> == dtype_, "data<{}>(): tensor has dtype {}", dtype_name(dtype_of<T>),
                   dtype_name(dtype_));
    return static_cast<T*>(raw_data());
  }

  // --- views: share the storage, copy nothing ------------------------------------------
  // view() needs strides compatible with the new shape and throws otherwise; reshape()
  // falls back to a copy. Either accepts one -1 to be inferred.
  Tensor view(Shape shape) const;
  Tensor reshape(Shape shape) const;
  Tensor flatten(std::int64_t start_dim = 0, std::int64_t end_dim = -1) const;
  Tensor permute(const std::vector<std::int64_t>& dims) const;
  Tensor transpose(std::int64_t dim0, std::int64_t dim1) const;
  Tensor narrow(std::int64_t dim, std::int64_t start, std::int64_t length) const;
  // Python-style slice [start:end:step] along dim, ends clamped, negatives from the end.
  Tensor slice(std::int64_t dim, std::int64_t start, std::int64_t end, std::int64_t step = 1) const;
  Tensor select(std::int64_t dim, std::int64_t index) const;  // drops dim
  Tensor expand(Shape shape) const;                           // -1 keeps a size
  Tensor broadcast_to(const Shape& shape) const;
  Tensor squeeze() const;                  // all size-1 dims
  Tensor squeeze(std::int64_t dim) const;  // that dim, if its size is 1
  Tensor unsqueeze(std::int64_t dim) const;

  // --- copies ----------------------------------------------------------------------------
  Tensor contiguous() const;  // itself when already contiguous
  Tensor clone() const;       // always a fresh contiguous copy
  // A copy on `device`. From pinned host memory to a GPU with non_blocking, the copy is queued on
  // the device's current stream and this returns at once: later work on that stream sees the
  // values, and the pinned bytes stay reserved until the copy has read them, but writing into
  // this tensor meanwhile races with the copy. Every other copy returns once it is done.
  Tensor to(Device device, bool non_blocking = false) const;
  Tensor to(DType dtype) const;
  // A contiguous copy in pinned host memory (itself when already pinned); throws for a tensor
  // that is not on the CPU, or when no GPU is usable.
  Tensor pin_memory() const;

  // In place: fill with a value; copy from src (broadcast to this shape, any dtype). They
  // change the elements, not the handle, so they work on const tensors and views.
  const Tensor& fill_(Scalar value) const;
  const Tensor& copy_(const Tensor& src) const;

  // The value of a one-element tensor, converted to T (copies from the device if needed).
  template <typename T>
  T item() const;
  // All values in row-major order, converted to T (tests and printing).
  template <typename T>
  std::vector<T> to_vector() const;

  // "[2, 3] f32 cpu" then the values, abbreviated to the first and last 3 along each
  // dimension when the tensor has more than 1000 elements.
  std::string str() const;

 private:
  std::int64_t wrap_dim(std::int64_t dim, std::int64_t rank, const char* op) const;

  std::shared_ptr<Storage> storage_;
  Shape shape_;
  Strides strides_;
  std::int64_t offset_ = 0;
  DType dtype_ = DType::f32;
};

// Normalises a possibly negative dim against a rank, throwing "op: dimension d is out of
// range for a tensor of rank r".
std::int64_t wrap_dim(std::int64_t dim, std::int64_t rank, const char* op);

// --- factories ---------------------------------------------------------------------------
Tensor empty(const Shape& shape, TensorOptions options = {});
Tensor zeros(const Shape& shape, TensorOptions options = {});
Tensor ones(const Shape& shape, TensorOptions options = {});
Tensor full(const Shape& shape, Scalar value, TensorOptions options = {});
Tensor zeros_like(const Tensor& like);
// A dense tensor of `shape` (like's rank) whose dims lie in memory in the order of like's strides,
// largest first: contiguous for a contiguous `like`, the same permutation for a transposed view of
// one (what an op's output takes so that transposing it back is free).
Tensor empty_in_layout_of(const Tensor& like, const Shape& shape, TensorOptions options);
// Values start, start+step, ... below end (above end for negative step).
Tensor arange(Scalar start, Scalar end, Scalar step = 1, TensorOptions options = dtype(DType::i64));
Tensor arange(std::int64_t end, TensorOptions options = dtype(DType::i64));

// A tensor holding `values` (dtype from T): 1-D, or with `shape` (numel must match).
template <typename T>
Tensor from_vector(const std::vector<T>& values, Device device = Device::cpu());
template <typename T>
Tensor from_vector(const std::vector<T>& values, Shape shape, Device device = Device::cpu());
// A 0-dimensional tensor.
Tensor scalar_tensor(Scalar value, TensorOptions options = {});

}  // namespace shardlab
