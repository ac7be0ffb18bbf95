// core/cuda/cudnn_conv.h: internal to core/cuda: conv2d and its two gradients through cuDNN, in
// builds that found it (SHARDLAB_CUDNN); conv.cu's im2col path serves the others. Contiguous NCHW
// operands of one floating dtype; the bias is added by conv.cu. Each returns false, queuing
// nothing, when cuDNN cannot take the convolution (sizes over its int limits, or its fixed algorithm
// not supported for this case: CUDNN_STATUS_NOT_SUPPORTED); the reason is then said once per
// process (core/notice.h) and the caller takes the im2col path.
#pragma once

#include <cuda_runtime_api.h>

#include "core/cuda/conv_shape.h"
#include "core/dtype.h"

namespace shardlab::cuda::cudnn {

[[nodiscard]] bool conv2d(DType dtype, const void* input, const void* weight, void* out,
                          const ConvShape& shape, int device, cudaStream_t stream);
// grad_in and grad_weight are overwritten.
[[nodiscard]] bool conv2d_backward_input(DType dtype, const void* grad_out, const void* weight, void* grad_in,
                                         const ConvShape& shape, int device, cudaStream_t stream);
[[nodiscard]] bool conv2d_backward_weight(DType dtype, const void* grad_out, const void* input,
                                          void* grad_weight, const ConvShape& shape, int device,
                                          cudaStream_t stream);

}  // namespace shardlab::cuda::cudnn
