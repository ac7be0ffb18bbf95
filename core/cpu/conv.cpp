// core/cpu/conv.cpp: conv2d forward and its input/weight gradients as im2col + GEMM, a few images
// at a time: the chunk's column buffer stays in L2 between im2col writing it and the GEMMs reading
// it, and each image's GEMM reads and writes the NCHW tensors in place (an image's [O, pixels] is
// GEMM layout), so nothing is transposed. The forward and the input gradient split the images over
// the pool's threads (each runs its GEMMs single-threaded) when there are enough of them, else each
// GEMM; the weight gradient, whose images all add into one sum, splits the patch's rows.
#include <algorithm>
#include <memory>
#include <vector>

#include "core/cpu/gemm.h"
#include "core/cpu/kernels.h"
#include "core/parallel.h"

namespace shardlab::cpu {
namespace {

struct ConvGeometry {
  std::int64_t batch, channels, height, width;    // input
  std::int64_t out_channels, kernel_h, kernel_w;  // weight
  std::int64_t out_h, out_w, stride, padding;

  std::int64_t patch() const { return channels * kernel_h * kernel_w; }  // rows of cols
  std::int64_t pixels() const { return out_h * out_w; }

  // Images per chunk: a column buffer of `rows` of the patch's rows of about half a (1 MiB) L2, at
  // least one image.
  std::int64_t chunk(std::size_t element_size, std::int64_t rows) const {
    const std::int64_t per_image = rows * pixels() * static_cast<std::int64_t>(element_size);
    return std::clamp<std::int64_t>((512 << 10) / std::max<std::int64_t>(per_image, 1), 1, batch);
  }
};

ConvGeometry geometry(const Shape& input, const Shape& weight, const Shape& output, Conv2dParams p) {
  return {input[0],  input[1],  input[2],  input[3], weight[0], weight[2],
          weight[3], output[2], output[3], p.stride, p.padding};
}

// The output columns ow whose tap kw lands inside the input row: [first, last).
struct ValidColumns {
  std::int64_t first, last;
};

ValidColumns valid_columns(const ConvGeometry& g, std::int64_t kw) {
  // w = ow * stride - padding + kw must lie in [0, width).
  const std::int64_t shift = g.padding - kw;
  const std::int64_t first = shift <= 0 ? 0 : (shift + g.stride - 1) / g.stride;
  const std::int64_t last = g.width - 1 + shift < 0 ? 0 : (g.width - 1 + shift) / g.stride + 1;
  return {std::min(first, g.out_w), std::clamp<std::int64_t>(last, 0, g.out_w)};
}

// The patch rows [first, last) of the column matrix: all of them, or one thread's band.
struct PatchRows {
  std::int64_t first, last;
  std::int64_t count() const { return last - first; }
};

// cols[(c, kh, kw) - rows.first, image * pixels + (oh, ow)] = input pixel under that kernel tap (0 in
// the padding), for `count` images starting at `images` and the patch rows `rows`. Each output row
// is a zero head, a (for stride 1 contiguous) copied middle and a zero tail.
template <typename T>
void im2col(const ConvGeometry& g, const T* images, std::int64_t count, PatchRows rows, T* cols) {
  const std::int64_t row_length = count * g.pixels();
  parallel_for(0, rows.count() * count, 1, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t task = first; task < last; ++task) {
      const std::int64_t band_row = task / count, image = task % count, row = rows.first + band_row;
      const std::int64_t c = row / (g.kernel_h * g.kernel_w);
      const std::int64_t kh = row / g.kernel_w % g.kernel_h, kw = row % g.kernel_w;
      const T* plane = images + (image * g.channels + c) * g.height * g.width;
      T* dst = cols + band_row * row_length + image * g.pixels();
      const ValidColumns valid = valid_columns(g, kw);
      for (std::int64_t oh = 0; oh < g.out_h; ++oh) {
        T* out = dst + oh * g.out_w;
        const std::int64_t h = oh * g.stride - g.padding + kh;
        if (h < 0 || h >= g.height) {
          std::fill_n(out, g.out_w, T(0));
          continue;
        }
        std::fill_n(out, valid.first, T(0));
        const T* src = plane + h * g.width - g.padding + kw;
        if (g.stride == 1) {
          std::copy(src + valid.first, src + valid.last, out + valid.first);
        } else {
          for (std::int64_t ow = valid.first; ow < valid.last; ++ow) out[ow] = src[ow * g.stride];
        }
        std::fill(out + valid.last, out + g.out_w, T(0));
      }
    }
  });
}

// The adjoint of im2col: adds each column entry back onto its input pixel. Per tap, the valid
// output columns are a range, as in im2col: no bounds check per pixel.
template <typename T>
void col2im(const ConvGeometry& g, const T* cols, std::int64_t count, T* images) {
  const std::int64_t row_length = count * g.pixels();
  parallel_for(0, count * g.channels, 1, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t task = first; task < last; ++task) {
      const std::int64_t image = task / g.channels, c = task % g.channels;
      T* plane = images + (image * g.channels + c) * g.height * g.width;
      for (std::int64_t kh = 0; kh < g.kernel_h; ++kh) {
        for (std::int64_t kw = 0; kw < g.kernel_w; ++kw) {
          const T* src = cols + ((c * g.kernel_h + kh) * g.kernel_w + kw) * row_length + image * g.pixels();
          const ValidColumns valid = valid_columns(g, kw);
          for (std::int64_t oh = 0; oh < g.out_h; ++oh) {
            const std::int64_t h = oh * g.stride - g.padding + kh;
            if (h < 0 || h >= g.height) continue;
            T* dst = plane + h * g.width - g.padding + kw;
            const T* row = src + oh * g.out_w;
            if (g.stride == 1) {
              for (std::int64_t ow = valid.first; ow < valid.last; ++ow) dst[ow] += row[ow];
            } else {
              for (std::int64_t ow = valid.first; ow < valid.last; ++ow) dst[ow * g.stride] += row[ow];
            }
          }
        }
      }
    }
  });
}

// The column buffer of one chunk of images, [rows, chunk * pixels], uninitialised (every element
// is written before it is read); per thread, only growing: fresh buffers on every call cost more in
// page faults than im2col.
template <typename T>
T* column_buffer(const ConvGeometry& g, std::int64_t rows) {
  struct Buffer {
    std::unique_ptr<char[]> bytes;
    std::size_t size = 0;
  };
  thread_local Buffer buffer;
  const auto needed = static_cast<std::size_t>(rows * g.chunk(sizeof(T), rows) * g.pixels()) * sizeof(T);
  if (buffer.size < needed) {
    buffer.bytes = std::make_unique_for_overwrite<char[]>(needed);
    buffer.size = needed;
  }
  return reinterpret_cast<T*>(buffer.bytes.get());
}

// fn(start, count) over consecutive chunks of the batch. With at least as many images as threads,
// the images are split over the pool and the kernels fn runs (im2col, gemm, col2im) run serially
// inside each thread (nested parallel_for); with fewer, chunk after chunk, each kernel split. A
// GEMM's bits do not depend on how it is split (core/cpu/gemm.h) and each pixel is summed in the
// same order either way, so the result has the same bits
// whatever the thread count.
template <typename T, typename Fn>
void over_image_chunks(const ConvGeometry& g, Fn fn) {
  const std::int64_t chunk = g.chunk(sizeof(T), g.patch());
  const auto chunks = [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t start = first; start < last; start += chunk) fn(start, std::min(chunk, last - start));
  };
  if (g.batch >= num_threads() && num_threads() > 1) {
    parallel_for(0, g.batch, 1, chunks);
  } else {
    chunks(0, g.batch);
  }
}

template <typename T>
void conv2d_typed(const ConvGeometry& g, const T* input, const T* weight, const T* bias, T* out) {
  over_image_chunks<T>(g, [&](std::int64_t start, std::int64_t count) {
    T* cols = column_buffer<T>(g, g.patch());
    const std::int64_t columns = count * g.pixels();
    im2col(g, input + start * g.channels * g.height * g.width, count, {0, g.patch()}, cols);
    for (std::int64_t image = 0; image < count; ++image) {
      // out[image] [O, pixels] = W [O, patch] x the image's columns [patch, pixels] (of a wider buffer).
      T* result = out + (start + image) * g.out_channels * g.pixels();
      gemm<T>(g.out_channels, g.pixels(), g.patch(), row_major(weight, g.patch()),
              row_major(cols + image * g.pixels(), columns), result, g.pixels(), false);
      if (bias == nullptr) continue;
      for (std::int64_t o = 0; o < g.out_channels; ++o) {
        T* row = result + o * g.pixels();
        for (std::int64_t p = 0; p < g.pixels(); ++p) row[p] += bias[o];
      }
    }
  });
}

template <typename T>
void conv2d_backward_input_typed(const ConvGeometry& g, const T* grad_out, const T* weight, T* grad_in) {
  over_image_chunks<T>(g, [&](std::int64_t start, std::int64_t count) {
    T* cols = column_buffer<T>(g, g.patch());
    const std::int64_t columns = count * g.pixels();
    for (std::int64_t image = 0; image < count; ++image) {
      // The image's columns [patch, pixels] = W^T [patch, O] x grad_out[image] [O, pixels].
      gemm<T>(g.patch(), g.pixels(), g.out_channels, transposed(weight, g.patch()),
              row_major(grad_out + (start + image) * g.out_channels * g.pixels(), g.pixels()),
              cols + image * g.pixels(), columns, false);
    }
    col2im(g, cols, count, grad_in + start * g.channels * g.height * g.width);
  });
}

// Multiply-adds below which the weight gradient stays on the calling thread (as a GEMM would).
constexpr std::int64_t kMinParallelWork = std::int64_t{1} << 18;

template <typename T>
void conv2d_backward_weight_typed(const ConvGeometry& g, const T* grad_out, const T* input, T* grad_weight) {
  // Accumulated transposed, as [patch, O] += the image's columns [patch, pixels] x grad_out[image]^T
  // [pixels, O]: the patch's rows give a tall C and a narrow operand to pack (O x pixels, not
  // patch x pixels). Each thread takes a band of the patch's rows for the whole batch: it writes
  // only its rows of the columns and runs its GEMMs serially, image after image, so the pool wakes
  // once per call, not once per image. Every element's sum runs over the images and pixels in
  // order, whatever the thread count, as in the untransposed product.
  const std::int64_t patch = g.patch(), outs = g.out_channels;
  std::vector<T> transposed_grad(static_cast<std::size_t>(patch * outs));
  for (std::int64_t o = 0; o < outs; ++o) {
    for (std::int64_t e = 0; e < patch; ++e) transposed_grad[e * outs + o] = grad_weight[o * patch + e];
  }
  const bool small = patch * outs * g.pixels() * g.batch < kMinParallelWork;
  const std::int64_t bands = small ? 1 : std::min<std::int64_t>(num_threads(), patch);
  parallel_for(0, bands, 1, [&](std::int64_t first_band, std::int64_t last_band) {
    for (std::int64_t band = first_band; band < last_band; ++band) {
      const PatchRows rows{patch * band / bands, patch * (band + 1) / bands};
      const std::int64_t chunk = g.chunk(sizeof(T), rows.count());
      T* cols = column_buffer<T>(g, rows.count());
      for (std::int64_t start = 0; start < g.batch; start += chunk) {
        const std::int64_t count = std::min(chunk, g.batch - start), columns = count * g.pixels();
        im2col(g, input + start * g.channels * g.height * g.width, count, rows, cols);
        for (std::int64_t image = 0; image < count; ++image) {
          gemm<T>(rows.count(), outs, g.pixels(), row_major(cols + image * g.pixels(), columns),
                  transposed(grad_out + (start + image) * outs * g.pixels(), g.pixels()),
                  transposed_grad.data() + rows.first * outs, outs, true);
        }
      }
    }
  });
  for (std::int64_t o = 0; o < outs; ++o) {
    for (std::int64_t e = 0; e < patch; ++e) grad_weight[o * patch + e] = transposed_grad[e * outs + o];
  }
}

template <typename T>
const T* maybe(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.raw_data()) : nullptr;
}

// Calls fn<T>() with T = double for f64 outputs and float otherwise (halves run in f32).
template <typename Fn>
void in_float_type(const Tensor& out, Fn fn) {
  if (out.dtype() == DType::f64) return fn.template operator()<double>();
  fn.template operator()<float>();
}

void conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, Conv2dParams p,
            const Tensor& out) {
  const ConvGeometry g = geometry(input.shape(), weight.shape(), out.shape(), p);
  in_f32_precision(
      out,
      [&](const Tensor& o, const Tensor& x, const Tensor& w, const Tensor& b) {
        in_float_type(o, [&]<typename T>() {
          conv2d_typed<T>(g, maybe<T>(x), maybe<T>(w), maybe<T>(b), static_cast<T*>(o.raw_data()));
        });
      },
      input, weight, bias);
}

void conv2d_backward_input(const Tensor& grad_out, const Tensor& weight, Conv2dParams p,
                           const Tensor& grad_in) {
  const ConvGeometry g = geometry(grad_in.shape(), weight.shape(), grad_out.shape(), p);
  in_f32_precision(
      grad_in,
      [&](const Tensor& gi, const Tensor& go, const Tensor& w) {
        in_float_type(gi, [&]<typename T>() {
          conv2d_backward_input_typed<T>(g, maybe<T>(go), maybe<T>(w), static_cast<T*>(gi.raw_data()));
        });
      },
      grad_out, weight);
}

void conv2d_backward_weight(const Tensor& grad_out, const Tensor& input, Conv2dParams p,
                            const Tensor& grad_weight) {
  const ConvGeometry g = geometry(input.shape(), grad_weight.shape(), grad_out.shape(), p);
  in_f32_precision(
      grad_weight,
      [&](const Tensor& gw, const Tensor& go, const Tensor& x) {
        in_float_type(gw, [&]<typename T>() {
          conv2d_backward_weight_typed<T>(g, maybe<T>(go), maybe<T>(x), static_cast<T*>(gw.raw_data()));
        });
      },
      grad_out, input);
}

}  // namespace

ConvKernels conv_kernels() {
  return {.conv2d = conv2d,
          .conv2d_backward_input = conv2d_backward_input,
          .conv2d_backward_weight = conv2d_backward_weight};
}

}  // namespace shardlab::cpu
