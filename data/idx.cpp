// data/idx.cpp: the IDX reader (plain or gzip through zlib, every header field validated) and
// the MNIST loader built on it.
#include "data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"

namespace shardlab::data {

namespace {

// zlib's description of the stream's error state, without the "<path>: " gzerror prepends.
std::string zlib_error(gzFile file, const std::string& path) {
  int code = Z_OK;
  std::string message = gzerror(file, &code);
  if (code == Z_ERRNO) return std::strerror(errno);
  if (message.starts_with(path + ": ")) message.erase(0, path.size() + 2);
  return message;
}

struct GzCloser {
  void operator()(gzFile_s* file) const { gzclose(file); }
};

// The whole decompressed stream (gzread passes plain files through unchanged). Decoding
// errors, including a stream cut short, are reported with zlib's own description.
std::vector<std::uint8_t> read_stream(const std::string& path) {
  errno = 0;
  std::unique_ptr<gzFile_s, GzCloser> file(gzopen(path.c_str(), "rb"));
  if (!file) {
    fail("read_idx: cannot open '{}': {}", path, errno != 0 ? std::strerror(errno) : "out of memory");
  }
  gzbuffer(file.get(), 1 << 17);  // MNIST's largest file is 47 MB: fewer, larger reads
  std::vector<std::uint8_t> bytes;
  for (;;) {
    // Reads that double what was read (64 KiB first, at most 1 GiB, gzread's count being an
    // unsigned int): a 16-byte header costs no megabyte, a 47 MB file ten reads.
    const std::size_t used = bytes.size();
    const std::size_t chunk = std::clamp<std::size_t>(used, std::size_t{1} << 16, std::size_t{1} << 30);
    bytes.resize(used + chunk);
    const int got = gzread(file.get(), bytes.data() + used, static_cast<unsigned>(chunk));
    if (got < 0)
      fail("read_idx: '{}' is not a readable gzip or IDX file: {}", path, zlib_error(file.get(), path));
    bytes.resize(used + static_cast<std::size_t>(got));
    if (got == 0) break;
  }
  // A truncated gzip stream ends in a short read with Z_BUF_ERROR set rather than -1, so the
  // error state is checked once the data runs out.
  int code = Z_OK;
  gzerror(file.get(), &code);
  if (code != Z_OK)
    fail("read_idx: '{}' is not a readable gzip or IDX file: {}", path, zlib_error(file.get(), path));
  return bytes;
}

std::uint32_t big_endian_u32(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
         std::uint32_t{p[3]};
}

std::uint64_t big_endian_u64(const std::uint8_t* p) {
  return (std::uint64_t{big_endian_u32(p)} << 32) | big_endian_u32(p + 4);
}

struct IdxType {
  std::size_t file_size;  // bytes per element in the file
  DType dtype;            // what the tensor holds
};

IdxType idx_type(const std::string& path, std::uint8_t code) {
  switch (code) {
    case 0x08:
      return {1, DType::u8};
    case 0x09:
      return {1, DType::i32};
    case 0x0B:
      return {2, DType::i32};
    case 0x0C:
      return {4, DType::i32};
    case 0x0D:
      return {4, DType::f32};
    case 0x0E:
      return {8, DType::f64};
    default:
      fail(
          "read_idx: '{}' has unknown IDX type code 0x{:02X} (expected 0x08, 0x09, 0x0B, 0x0C, 0x0D or 0x0E)",
          path, code);
  }
}

// Converts the big-endian elements of `in` into `out` (numel elements of the tensor's dtype).
void decode(std::uint8_t code, const std::uint8_t* in, const Tensor& out, std::int64_t numel) {
  // An empty tensor has no storage, and memcpy to its null pointer is undefined even for 0 bytes.
  if (numel == 0) return;
  switch (code) {
    case 0x08:
      std::memcpy(out.data<std::uint8_t>(), in, static_cast<std::size_t>(numel));
      return;
    case 0x09: {
      auto* dst = out.data<std::int32_t>();
      for (std::int64_t i = 0; i < numel; ++i) dst[i] = static_cast<std::int8_t>(in[i]);
      return;
    }
    case 0x0B: {
      auto* dst = out.data<std::int32_t>();
      for (std::int64_t i = 0; i < numel; ++i) {
        dst[i] = static_cast<std::int16_t>(static_cast<std::uint16_t>((in[2 * i] << 8) | in[2 * i + 1]));
      }
      return;
    }
    case 0x0C: {
      auto* dst = out.data<std::int32_t>();
      for (std::int64_t i = 0; i < numel; ++i) dst[i] = static_cast<std::int32_t>(big_endian_u32(in + 4 * i));
      return;
    }
    case 0x0D: {
      auto* dst = out.data<float>();
      for (std::int64_t i = 0; i < numel; ++i) dst[i] = std::bit_cast<float>(big_endian_u32(in + 4 * i));
      return;
    }
    case 0x0E: {
      auto* dst = out.data<double>();
      for (std::int64_t i = 0; i < numel; ++i) dst[i] = std::bit_cast<double>(big_endian_u64(in + 8 * i));
      return;
    }
    default:
      fail("read_idx: no decoder for type code 0x{:02X}", code);  // idx_type rejected it already
  }
}

// <dir>/<name>.gz if it exists, else <dir>/<name>; an error naming both when neither does.
std::string find_file(const std::string& dir, const std::string& name) {
  const std::filesystem::path plain = std::filesystem::path(dir) / name;
  const std::filesystem::path gz = std::filesystem::path(dir) / (name + ".gz");
  if (std::filesystem::exists(gz)) return gz.string();
  if (std::filesystem::exists(plain)) return plain.string();
  fail("load_mnist: found neither '{}' nor '{}'", gz.string(), plain.string());
}

}  // namespace

Tensor read_idx(const std::string& path) {
  const std::vector<std::uint8_t> bytes = read_stream(path);
  SHARDLAB_CHECK(bytes.size() >= 4,
                 "read_idx: '{}' is too short for an IDX header: {} bytes, expected at least 4", path,
                 bytes.size());
  SHARDLAB_CHECK(bytes[0] == 0 && bytes[1] == 0,
                 "read_idx: '{}' is not an IDX file: magic bytes are 0x{:02X} 0x{:02X}, expected 0x00 0x00",
                 path, bytes[0], bytes[1]);
  const std::uint8_t code = bytes[2];
  const IdxType type = idx_type(path, code);
  const std::size_t ndim = bytes[3];
  SHARDLAB_CHECK(ndim >= 1 && ndim <= 8, "read_idx: '{}' has {} dimensions, expected 1 to 8", path, ndim);
  const std::size_t header = 4 + 4 * ndim;
  SHARDLAB_CHECK(
      bytes.size() >= header,
      "read_idx: '{}' is too short for an IDX header of {} dimensions: {} bytes, expected at least {}", path,
      ndim, bytes.size(), header);

  Shape shape(ndim);
  std::uint64_t expected = type.file_size;
  bool overflow = false;
  for (std::size_t d = 0; d < ndim; ++d) {
    const std::uint32_t size = big_endian_u32(bytes.data() + 4 + 4 * d);
    shape[d] = size;
    overflow = overflow || __builtin_mul_overflow(expected, std::uint64_t{size}, &expected);
  }
  const std::size_t data_bytes = bytes.size() - header;
  SHARDLAB_CHECK(!overflow, "read_idx: '{}' has sizes {} whose data length overflows 64 bits", path,
                 shape_str(shape));
  // A zero size makes the data empty whatever the others are, but the tensor's strides still multiply them.
  SHARDLAB_CHECK(shape_addressable(shape),
                 "read_idx: '{}' has sizes {}: their product, zeros counted as ones, overflows int64", path,
                 shape_str(shape));
  SHARDLAB_CHECK(data_bytes == expected,
                 "read_idx: '{}' has {} data bytes, expected {} (sizes {} x {} bytes per element)", path,
                 data_bytes, expected, shape_str(shape), type.file_size);

  Tensor out = empty(shape, dtype(type.dtype));
  decode(code, bytes.data() + header, out, out.numel());
  return out;
}

ImageSet load_mnist(const std::string& dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  const std::string images_path = find_file(dir, prefix + "-images-idx3-ubyte");
  const std::string labels_path = find_file(dir, prefix + "-labels-idx1-ubyte");
  const Tensor raw_images = read_idx(images_path);
  const Tensor raw_labels = read_idx(labels_path);

  SHARDLAB_CHECK(raw_images.dim() == 3,
                 "load_mnist: '{}' holds an array of shape {}, expected 3-D images [N, H, W]", images_path,
                 shape_str(raw_images.shape()));
  // The normalisation below assumes pixel bytes 0..255, as every MNIST-format set stores them.
  SHARDLAB_CHECK(raw_images.dtype() == DType::u8,
                 "load_mnist: '{}' holds {} values, expected u8 pixels (type 0x08)", images_path,
                 dtype_name(raw_images.dtype()));
  SHARDLAB_CHECK(raw_labels.dim() == 1,
                 "load_mnist: '{}' holds an array of shape {}, expected 1-D labels [N]", labels_path,
                 shape_str(raw_labels.shape()));
  SHARDLAB_CHECK(raw_labels.dtype() == DType::u8 || raw_labels.dtype() == DType::i32,
                 "load_mnist: '{}' holds {} values, expected integer labels", labels_path,
                 dtype_name(raw_labels.dtype()));
  SHARDLAB_CHECK(raw_images.size(0) == raw_labels.size(0),
                 "load_mnist: '{}' has {} images but '{}' has {} labels", images_path, raw_images.size(0),
                 labels_path, raw_labels.size(0));

  const std::int64_t n = raw_images.size(0);
  Tensor images = empty({n, 1, raw_images.size(1), raw_images.size(2)}, dtype(DType::f32));
  // Same float32 operations as torchvision's ToTensor (x / 255) then Normalize ((x - m) / s).
  const std::uint8_t* src = raw_images.data<std::uint8_t>();
  float* dst = images.data<float>();
  for (std::int64_t i = 0; i < images.numel(); ++i) {
    dst[i] = (static_cast<float>(src[i]) / 255.0f - 0.1307f) / 0.3081f;
  }
  return ImageSet{images, raw_labels.to(DType::i64)};
}

}  // namespace shardlab::data
