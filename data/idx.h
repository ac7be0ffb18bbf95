// data/idx.h: IDX files (the MNIST format), plain or gzip-compressed, read with every field
// validated, and the MNIST/Fashion-MNIST train and test sets built from them.
#pragma once

#include <string>

#include "core/tensor.h"

namespace shardlab::data {

// The array an IDX file holds, with the file's shape. Type codes: 0x08 -> u8,
// 0x09 (i8) and 0x0B (i16) -> i32, 0x0C -> i32, 0x0D -> f32, 0x0E -> f64 (big-endian in the
// file). Any problem is an Error naming the file, the field, and expected vs actual values.
Tensor read_idx(const std::string& path);

struct ImageSet {
  Tensor images;  // f32 [N, 1, H, W], normalised as the FSDP tutorial: (x / 255 - 0.1307) / 0.3081
  Tensor labels;  // i64 [N]
};

// <dir>/train-images-idx3-ubyte[.gz] and train-labels-idx1-ubyte[.gz] (test: t10k-...),
// checking that images are 3-D, labels 1-D and their counts agree.
ImageSet load_mnist(const std::string& dir, bool train);

}  // namespace shardlab::data
