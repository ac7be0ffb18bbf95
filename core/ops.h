// core/ops.h: the tensor operations. Each validates its inputs, allocates its output and
// runs the kernel of the input's device (core/kernels.h).
//
// Elementwise ops broadcast like NumPy and promote dtypes (promote_types); a Scalar operand
// takes the tensor's dtype unless it is floating and the tensor is not (then f32).
// Reductions take any set of dims (empty = all) and keepdim.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "core/adam_math.h"
#include "core/tensor.h"

namespace shardlab {

using Dims = std::vector<std::int64_t>;

// --- elementwise: unary --------------------------------------------------------------------
// Integer and bool inputs of exp/log/sqrt/rsqrt/tanh/sigmoid/silu/gelu compute in f32.
Tensor neg(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
Tensor silu(const Tensor& x);
enum class GeluApproximation : unsigned char { none, tanh };
Tensor gelu(const Tensor& x, GeluApproximation approximate = GeluApproximation::none);
Tensor erf(const Tensor& x);
Tensor isfinite(const Tensor& x);  // bool
Tensor clamp(const Tensor& x, std::optional<Scalar> min, std::optional<Scalar> max);
Tensor cast(const Tensor& x, DType dtype);

// --- elementwise: binary (broadcasting) ----------------------------------------------------
// div of integers is true division (result f32), as in PyTorch.
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);  // NaN propagates
Tensor minimum(const Tensor& a, const Tensor& b);
// ReLU's input gradient from its output: output > 0 ? grad : 0 (NaN outputs pass nothing), one pass.
Tensor relu_backward(const Tensor& grad, const Tensor& output);
Tensor add(const Tensor& a, Scalar b);
Tensor sub(const Tensor& a, Scalar b);
Tensor mul(const Tensor& a, Scalar b);
Tensor div(const Tensor& a, Scalar b);
Tensor pow(const Tensor& a, Scalar exponent);
// Comparisons give bool.
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, Scalar b);
Tensor ne(const Tensor& a, Scalar b);
Tensor lt(const Tensor& a, Scalar b);
Tensor le(const Tensor& a, Scalar b);
Tensor gt(const Tensor& a, Scalar b);
Tensor ge(const Tensor& a, Scalar b);
// condition ? a : b, elementwise; condition is bool; all three broadcast together.
Tensor where(const Tensor& condition, const Tensor& a, const Tensor& b);
Tensor where(const Tensor& condition, const Tensor& a, Scalar b);

// In place: self = self op other, other broadcast to self's shape and cast to self's dtype
// (self keeps its shape and dtype). other must not partially overlap self. Returns self.
const Tensor& add_(const Tensor& self, const Tensor& other);
const Tensor& sub_(const Tensor& self, const Tensor& other);
const Tensor& mul_(const Tensor& self, const Tensor& other);
const Tensor& div_(const Tensor& self, const Tensor& other);
const Tensor& add_(const Tensor& self, Scalar other);
const Tensor& sub_(const Tensor& self, Scalar other);
const Tensor& mul_(const Tensor& self, Scalar other);
const Tensor& div_(const Tensor& self, Scalar other);

Tensor operator-(const Tensor& x);
Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, Scalar b);
Tensor operator-(const Tensor& a, Scalar b);
Tensor operator*(const Tensor& a, Scalar b);
Tensor operator/(const Tensor& a, Scalar b);

// --- reductions ------------------------------------------------------------------------------
// sum of integers and bools gives i64; mean needs a floating input. Floating sums
// accumulate in double on CPU.
Tensor sum(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
Tensor sum_squares(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
// The sum of the squares of every element of all `tensors` (at least one; floating, any dtypes and
// shapes, all on one device), as an f64 scalar there: a gradient norm's square over many parameters
// in one pass over memory, one launch on a GPU (PyTorch's _foreach_norm), the same bits on every
// device (core/square_sums.h). Not differentiable.
Tensor foreach_sum_squares(std::span<const Tensor> tensors);
Tensor max(const Tensor& x, const Dims& dims = {}, bool keepdim = false);  // NaN propagates
Tensor min(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
// i64 index of the first maximum within the reduced dims, counted in row-major order over
// those dims (the usual index when one dim is reduced).
Tensor argmax(const Tensor& x, const Dims& dims = {}, bool keepdim = false);
// log(sum(exp(x))) computed stably; rows of -inf give -inf.
Tensor logsumexp(const Tensor& x, const Dims& dims, bool keepdim = false);

// --- linear algebra and neural-network building blocks ---------------------------------------
// torch.matmul semantics: 1-D operands are promoted and the added dim removed; leading
// (batch) dims broadcast. Floating dtypes only; bf16/f16 accumulate in f32.
Tensor matmul(const Tensor& a, const Tensor& b);
// torch.nn.functional.linear: x [..., in] times weight [out, in] transposed, plus bias [out] (may be
// undefined) added to every row in the compute type before the product is rounded (on CUDA in
// cuBLASLt's epilogue, not a second pass over the output).
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = {});

Tensor softmax(const Tensor& x, std::int64_t dim);
Tensor log_softmax(const Tensor& x, std::int64_t dim);

struct Conv2dParams {
  std::int64_t stride = 1;
  std::int64_t padding = 0;
};
// input [N, C, H, W], weight [O, C, KH, KW], optional bias [O] -> [N, O, OH, OW].
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias = {}, Conv2dParams params = {});
// The two gradients of conv2d (bias gradient is sum(grad_output, {0, 2, 3})).
Tensor conv2d_backward_input(const Tensor& grad_output, const Tensor& weight, const Shape& input_shape,
                             Conv2dParams params = {});
Tensor conv2d_backward_weight(const Tensor& grad_output, const Tensor& input, const Shape& weight_shape,
                              Conv2dParams params = {});

struct MaxPool2dParams {
  std::int64_t kernel_size = 2;
  std::int64_t stride = 0;  // 0 means kernel_size, as in PyTorch
  std::int64_t padding = 0;
};
struct MaxPool2dResult {
  Tensor values;   // [N, C, OH, OW]
  Tensor indices;  // i64, flat index h * W + w of each maximum within its input plane
};
MaxPool2dResult max_pool2d(const Tensor& input, MaxPool2dParams params = {});
Tensor max_pool2d_backward(const Tensor& grad_output, const Tensor& indices, const Shape& input_shape);

// weight [V, D], indices (i64/i32, any shape) -> [..., D].
Tensor embedding(const Tensor& weight, const Tensor& indices);
// Sums the rows of grad [..., D] into a [num_embeddings, D] gradient (scatter-add).
Tensor embedding_backward(const Tensor& grad, const Tensor& indices, std::int64_t num_embeddings);

// index is 1-D (i64/i32); picks slices of x along dim.
Tensor index_select(const Tensor& x, std::int64_t dim, const Tensor& index);
// out[i][j] = x[i][index[i][j]] (dim 1); index has x's rank, no larger in other dims.
Tensor gather(const Tensor& x, std::int64_t dim, const Tensor& index);
// A copy of self with src added at the positions index names along dim (gather's adjoint).
Tensor scatter_add(const Tensor& self, std::int64_t dim, const Tensor& index, const Tensor& src);
// A copy of self with src.select(dim, j) added to self.select(dim, index[j]).
Tensor index_add(const Tensor& self, std::int64_t dim, const Tensor& index, const Tensor& src);

Tensor cat(const std::vector<Tensor>& tensors, std::int64_t dim);
Tensor stack(const std::vector<Tensor>& tensors, std::int64_t dim);
// Views of pieces of split_size along dim (the last may be smaller).
std::vector<Tensor> split(const Tensor& x, std::int64_t split_size, std::int64_t dim);
// `chunks` views of equal size along dim, the last smaller if needed (torch.chunk).
std::vector<Tensor> chunk(const Tensor& x, std::int64_t chunks, std::int64_t dim);

// Keep elements on and above (triu) / on and below (tril) the diagonal-th diagonal of the
// last two dims, zero elsewhere.
Tensor triu(const Tensor& x, std::int64_t diagonal = 0);
Tensor tril(const Tensor& x, std::int64_t diagonal = 0);

// --- attention ---------------------------------------------------------------------------------
// Fused scaled dot-product attention (FlashAttention-2: blocked over keys with an online softmax,
// no [T, S] score matrix), the core of autograd's scaled_dot_product_attention:
//   out[b, h, t] = sum_s softmax_s(scale * q[b, h, t] . k[b, h / G, s]) v[b, h / G, s]
// over the keys s query t may see, for q [B, H, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv],
// H = G * Hkv (grouped-query attention). f32 or f64.
struct AttentionParams {
  bool causal = false;          // query t sees keys 0..t (top-left aligned, as PyTorch)
  Tensor padding;               // optional bool [B, S]: true marks a padding token (see below)
  std::optional<double> scale;  // default 1 / sqrt(D)
};
// No query sees a padding key; when T == S the queries are the same tokens, and a padding
// query sees nothing. A query that sees no key outputs zeros (logsumexp -inf) and passes no
// gradient.
struct AttentionResult {
  Tensor out;        // [B, H, T, Dv]
  Tensor logsumexp;  // [B, H, T]: of each query's scaled scores over the keys it sees (f32 for halves)
};
AttentionResult attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const AttentionParams& params = {});
// The kernel attention_forward and attention_backward run, a pure function of the operands (the same
// answer on any machine): f32 and f64 take the device's fused kernel; bf16 and f16 take flash
// attention on tensor cores on a GPU where q's and v's head dims are both 64 or both 128, and
// elsewhere the f32 kernel on operands cast to f32, the results cast back. logsumexp is f32 for
// bf16 and f16.
enum class AttentionKernel : unsigned char { fused, flash, in_f32 };
AttentionKernel attention_kernel(DType dtype, Device device, std::int64_t head_dim, std::int64_t value_dim);
struct AttentionGrads {
  Tensor q, k, v;  // in the shapes of q, k and v: k and v summed over each group's query heads
};
AttentionGrads attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const AttentionResult& forward, const AttentionParams& params = {});
// The shape checks attention_forward makes (4-D operands that agree, H a multiple of Hkv, a
// bool [B, S] padding), with errors that start with `op` and name the shapes.
void check_attention_operands(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& padding);

// --- optimizer steps -----------------------------------------------------------------------------
// Fused in-place updates over a parameter and its state (one pass instead of one per op).
struct AdadeltaHyper {
  double lr = 1.0, rho = 0.9, eps = 1e-6, weight_decay = 0.0;
};
// PyTorch's Adadelta on one parameter: g = grad + wd p; square_avg = rho sa + (1 - rho) g^2;
// delta = sqrt(acc_delta + eps) / sqrt(square_avg + eps) g; acc_delta = rho ad + (1 - rho)
// delta^2; p -= lr delta. All four tensors share shape, dtype and device.
void adadelta_step(const Tensor& param, const Tensor& grad, const Tensor& square_avg, const Tensor& acc_delta,
                   const AdadeltaHyper& hyper);
// One Adam or AdamW update (PyTorch's, at the given step >= 1):
//   AdamW: p *= 1 - lr wd (decoupled);  Adam: g = grad + wd p (L2)
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   p -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
struct AdamHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool decoupled = false;  // AdamW's decay instead of Adam's L2
  std::int64_t step = 1;
};
inline AdamScalars adam_scalars(const AdamHyper& h) {
  return {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.decoupled, h.step};
}
// param, grad, exp_avg and exp_avg_sq share shape, dtype and device. When `copy_out` is defined
// (same shape and device, any floating dtype, e.g. bf16) it receives the updated parameter in
// its dtype in the same pass: FSDP's next all-gather reads it.
void adam_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
               const AdamHyper& hyper, const Tensor& copy_out = {});

// The same updates over many parameters at once, each with its own hyper-parameters (an
// optimizer's step: its lr, weight decay and step count per parameter): one pass per device,
// on CUDA one kernel launch per dtype for all contiguous segments. Each segment is checked as
// the single-parameter call checks its operands (errors name "segment <i>" when there are
// several, and then nothing is updated); segments may differ in shape, dtype and device but
// must not share memory. On CPU each segment's result is bit-identical to the single-parameter
// call on it (which is a one-segment call).
//
//   std::vector<AdamSegment> segments;
//   for (...) segments.push_back({.param = p, .grad = g, .exp_avg = m, .exp_avg_sq = v, .hyper = h});
//   adam_step(segments);
//
// `apply`, when defined, gates the whole call on the device: a one-element bool tensor on the
// segments' device (all of them on it), read by the kernels and never by the host, so a GPU
// decides without the host waiting (an optimizer step skipped because the step's loss or
// gradient norm was found not finite there). Where it is false nothing is written.
struct AdadeltaSegment {
  Tensor param, grad, square_avg, acc_delta;
  AdadeltaHyper hyper;
};
void adadelta_step(std::span<const AdadeltaSegment> segments, const Tensor& apply = {});
struct AdamSegment {
  Tensor param, grad, exp_avg, exp_avg_sq;
  AdamHyper hyper;
  Tensor copy_out;  // undefined, or as adam_step's copy_out
};
void adam_step(std::span<const AdamSegment> segments, const Tensor& apply = {});

// --- loss building blocks -----------------------------------------------------------------------
// values [N, C], targets [N] (i64/i32) -> [N]: values[i, targets[i]], or 0 where
// targets[i] == ignore_index. Targets outside [0, C) are an error.
Tensor gather_targets(const Tensor& values, const Tensor& targets, std::int64_t ignore_index = -100);

// Cross-entropy from logits [N, C] (floating) and targets [N] (i64/i32, each in [0, C) or
// ignore_index), row by row without a softmax [N, C] in memory: losses [N] = logsumexp(logits[i]) -
// logits[i, targets[i]], 0 where ignored, and logsumexp [N] for the backward, both in f32 for
// bf16/f16 logits (the logits' dtype otherwise): half logits need no f32 copy for an f32 loss. The
// backward gives grad_losses[i] * (softmax(logits[i]) - onehot(targets[i])) in the logits' dtype,
// computed in f32 and rounded once: the bits of the f32 copy's gradient cast back.
struct CrossEntropyResult {
  Tensor losses, logsumexp;
};
// The Llama block's fused ops, each one kernel forward and one backward (autograd's rms_norm, swiglu
// and rotary_embedding use them): operands of one floating dtype on one device.
// x [..., D] * rsqrt(mean(x^2 over D) + eps) * weight [D]; rstd [...] (f32 for bf16/f16) for backward.
struct RmsNormResult {
  Tensor out, rstd;
  Tensor sum;  // add_rms_norm_forward's x + y, the rows it normalised; undefined for rms_norm_forward
};
RmsNormResult rms_norm_forward(const Tensor& x, const Tensor& weight, double eps);
// The residual stream's add and the norm of its result in one pass: sum = x + y (the bits of
// add(x, y)), out and rstd those rms_norm_forward(sum, ...) gives, x and y of one shape.
RmsNormResult add_rms_norm_forward(const Tensor& x, const Tensor& y, const Tensor& weight, double eps);
struct RmsNormGrads {
  Tensor x, weight;
};
RmsNormGrads rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                               const Tensor& rstd);
// silu(gate) * up, gate and up of one shape.
Tensor swiglu(const Tensor& gate, const Tensor& up);
struct SwigluGrads {
  Tensor gate, up;
};
SwigluGrads swiglu_backward(const Tensor& grad_out, const Tensor& gate, const Tensor& up);
// x [..., T, D] * cos + rotate_half(x) * sin, cos and sin [T, D] (D even); transpose: the map's
// transpose, which is its backward.
Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool transpose = false);

CrossEntropyResult cross_entropy_forward(const Tensor& logits, const Tensor& targets,
                                         std::int64_t ignore_index = -100);
Tensor cross_entropy_backward(const Tensor& grad_losses, const Tensor& logits, const Tensor& targets,
                              std::int64_t ignore_index, const Tensor& logsumexp);

}  // namespace shardlab
