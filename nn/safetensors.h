// nn/safetensors.h: the safetensors file format (model weights readable by PyTorch and
// Hugging Face): an 8-byte little-endian header length, a JSON header mapping each name to
// {dtype, shape, data_offsets} (plus optional "__metadata__" strings), then the raw
// little-endian bytes, contiguous and in offset order.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "nn/module.h"

namespace shardlab::nn {

// Writes `tensors` (any device, any strides; copied to the host in row-major order) to `path`
// in the given order, "__metadata__" first when `metadata` is not empty, the header padded with
// spaces to a multiple of 8 bytes. The bytes go to a temporary file next to `path`, flushed and
// renamed into place when complete, so a reader never sees half a file; on failure the
// temporary file is removed. Names must be unique and not "__metadata__".
void save_safetensors(const std::string& path, const StateDict& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// One tensor of a file to be written: what the header says about it.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
};

// Where everything of a file goes: the bytes before the data (the 8-byte header length and the
// header) and each tensor's first byte in the file. The one place the header is built, so that
// every writer (save_safetensors, dist::save_full_safetensors, dist::consolidate_checkpoint)
// writes the same bytes for the same tensors.
struct SafetensorsLayout {
  std::string header;                  // the file's first bytes, a multiple of 8 long
  std::vector<std::uint64_t> offsets;  // per entry, in the file (header.size() + its data offset)
  std::uint64_t file_bytes = 0;        // the whole file
};

// The layout of `entries` in this order, "__metadata__" first when `metadata` is not empty, the
// header padded with spaces to a multiple of 8 bytes. Names must be unique and not
// "__metadata__"; errors begin with `where` (e.g. "save_safetensors: 'model.safetensors'").
SafetensorsLayout safetensors_layout(const std::vector<SafetensorsEntry>& entries,
                                     const std::map<std::string, std::string>& metadata,
                                     std::string_view where);

struct SafetensorsFile {
  StateDict tensors;  // in file order (by data offset)
  std::map<std::string, std::string> metadata;
};

// Reads and validates an untrusted file: header length bounded (100 MB) and inside the file,
// valid JSON (no NUL bytes, no key repeated within an object) of the expected structure, known
// dtypes (F32, F64, BF16, F16, I64, I32, U8, BOOL), shapes non-negative with numel x dtype size
// free of overflow and equal to the offsets' span, offsets inside the data section and, sorted,
// covering it exactly (no gap, overlap or trailing byte), BOOL bytes 0 or 1. Keys of an entry
// other than dtype, shape and data_offsets are ignored, as the reference implementation does.
// Each problem is an Error naming the file, the tensor and what was expected; nothing is
// returned unless the whole file is valid.
SafetensorsFile load_safetensors(const std::string& path);

// One tensor of a file, as its validated header describes it.
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  std::uint64_t offset = 0;  // of its first byte in the file
};
// The tensors of a file in data order, validated as load_safetensors validates them (the data
// section's size taken from the file's, so a file cut short is refused), without reading their bytes.
std::vector<SafetensorsTensor> read_safetensors_header(const std::string& path);
// Elements [first, first + out.numel()) of `tensor` flattened, read from `path` by offset and converted
// to out's dtype and device (bf16 and f16 widen exactly): a rank takes its shard of a parameter
// without reading the rest. Refused: a range past the tensor's end, a read that fails or ends early.
void read_safetensors_elements(const std::string& path, const SafetensorsTensor& tensor, std::int64_t first,
                               const Tensor& out);

}  // namespace shardlab::nn
