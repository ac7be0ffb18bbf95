// core/ops.h: the tensor operations, one header per family (each op validates its inputs, allocates
// its output and runs the kernel of the input's device, core/kernels.h); including this one includes
// them all.
//
// Elementwise ops broadcast like NumPy and promote dtypes (promote_types); a Scalar operand
// takes the tensor's dtype unless it is floating and the tensor is not (then f32).
// Reductions take any set of dims (empty = all) and keepdim.
#pragma once

#include "core/attention.h"
#include "core/conv.h"
#include "core/elementwise.h"
#include "core/index.h"
#include "core/join.h"
#include "core/loss.h"
#include "core/matmul.h"
#include "core/optimizer.h"
#include "core/reduce.h"
#include "core/softmax.h"
#include "core/transformer.h"
