// tests/data/test_idx.cpp: read_idx on hand-built IDX files (every type, plain and gzip, each
// malformed-file class) and load_mnist on crafted directories and the real Fashion-MNIST test set.
#include <zlib.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "data/idx.h"
#include "tests/check.h"
#include "tests/data/gzip_file.h"

using namespace shardlab;
using data::load_mnist;
using data::read_idx;
using test::Bytes;
using test::check_close;
using test::check_equal;
using test::TempDir;
using test::write_file;
using test::write_gzip;

namespace {

// Header (two zero bytes, type code, ndim, big-endian u32 sizes) followed by `payload`,
// which the caller writes out byte by byte in big-endian order.
Bytes idx_file(std::uint8_t type, const std::vector<std::uint32_t>& sizes, const Bytes& payload) {
  Bytes out = {0, 0, type, static_cast<std::uint8_t>(sizes.size())};
  for (const std::uint32_t s : sizes) {
    out.insert(out.end(), {static_cast<std::uint8_t>(s >> 24), static_cast<std::uint8_t>(s >> 16),
                           static_cast<std::uint8_t>(s >> 8), static_cast<std::uint8_t>(s)});
  }
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

#define CHECK_THROWS_EXACT(expr, message) CHECK_THROWS_WITH((expr), Catch::Matchers::Equals(message))

// Writes `bytes` plainly and gzip-compressed, and checks that both read back the same tensor.
Tensor read_both(const TempDir& dir, const Bytes& bytes) {
  write_file(dir.file("plain.idx"), bytes);
  write_gzip(dir.file("packed.idx.gz"), bytes);
  const Tensor plain = read_idx(dir.file("plain.idx"));
  const Tensor packed = read_idx(dir.file("packed.idx.gz"));
  REQUIRE(plain.shape() == packed.shape());
  REQUIRE(plain.dtype() == packed.dtype());
  CHECK(test::values(plain) == test::values(packed));
  return plain;
}

}  // namespace

TEST_CASE("read_idx reads u8 arrays with their shape, plain and gzip", "[data][idx]") {
  TempDir dir;
  const Tensor t = read_both(dir, idx_file(0x08, {2, 3}, {0, 1, 127, 128, 254, 255}));
  CHECK(t.dtype() == DType::u8);
  CHECK(t.shape() == Shape{2, 3});
  check_equal(t, {0, 1, 127, 128, 254, 255});

  const Tensor four = read_both(dir, idx_file(0x08, {1, 2, 1, 3}, {9, 8, 7, 6, 5, 4}));
  CHECK(four.shape() == Shape{1, 2, 1, 3});
  check_equal(four, {9, 8, 7, 6, 5, 4});

  const Tensor eight = read_both(dir, idx_file(0x08, {1, 1, 1, 2, 1, 1, 1, 1}, {3, 4}));
  CHECK(eight.shape() == Shape{1, 1, 1, 2, 1, 1, 1, 1});
  check_equal(eight, {3, 4});

  const Tensor none = read_both(dir, idx_file(0x08, {0, 5}, {}));
  CHECK(none.shape() == Shape{0, 5});
  CHECK(none.numel() == 0);
}

TEST_CASE("read_idx widens i8 and i16 to i32 with their sign", "[data][idx]") {
  TempDir dir;
  const Tensor i8 = read_both(dir, idx_file(0x09, {5}, {0x00, 0x01, 0x7F, 0x80, 0xFF}));
  CHECK(i8.dtype() == DType::i32);
  check_equal(i8, {0, 1, 127, -128, -1});

  // 0x1234 read big-endian is 4660 (little-endian would give 0x3412 = 13330).
  const Tensor i16 =
      read_both(dir, idx_file(0x0B, {5}, {0x00, 0x01, 0x7F, 0xFF, 0x80, 0x00, 0xFF, 0xFF, 0x12, 0x34}));
  CHECK(i16.dtype() == DType::i32);
  check_equal(i16, {1, 32767, -32768, -1, 4660});
}

TEST_CASE("read_idx reads big-endian i32, f32 and f64", "[data][idx]") {
  TempDir dir;
  const Tensor i32 = read_both(
      dir, idx_file(0x0C, {3}, {0x01, 0x02, 0x03, 0x04, 0xFF, 0xFF, 0xFF, 0xFE, 0x80, 0x00, 0x00, 0x00}));
  CHECK(i32.dtype() == DType::i32);
  check_equal(i32, {16909060, -2, -2147483648.0});

  // IEEE-754 single: 0x3FC00000 = 1.5, 0xC0100000 = -2.25, 0x7F800000 = +inf, 0x00000001 = 2^-149.
  const Tensor f32 = read_both(dir, idx_file(0x0D, {2, 2},
                                             {0x3F, 0xC0, 0x00, 0x00, 0xC0, 0x10, 0x00, 0x00, 0x7F, 0x80,
                                              0x00, 0x00, 0x00, 0x00, 0x00, 0x01}));
  CHECK(f32.dtype() == DType::f32);
  CHECK(f32.shape() == Shape{2, 2});
  const std::vector<float> floats = f32.to_vector<float>();
  CHECK(floats[0] == 1.5f);
  CHECK(floats[1] == -2.25f);
  CHECK(std::isinf(floats[2]));
  CHECK(floats[2] > 0);
  CHECK(floats[3] == std::ldexp(1.0f, -149));

  // IEEE-754 double: 0x3FB999999999999A is the double nearest 0.1; 0xC000000000000000 = -2.
  const Tensor f64 = read_both(dir, idx_file(0x0E, {2},
                                             {0x3F, 0xB9, 0x99, 0x99, 0x99, 0x99, 0x99, 0x9A, 0xC0, 0x00,
                                              0x00, 0x00, 0x00, 0x00, 0x00, 0x00}));
  CHECK(f64.dtype() == DType::f64);
  const std::vector<double> doubles = f64.to_vector<double>();
  CHECK(doubles[0] == 0.1);
  CHECK(doubles[1] == -2.0);
}

TEST_CASE("read_idx reports a file it cannot open or read", "[data][idx][errors]") {
  TempDir dir;
  const std::string path = dir.file("absent.idx");
  CHECK_THROWS_EXACT(read_idx(path), "read_idx: cannot open '" + path + "': No such file or directory");
  // A directory opens but cannot be read: the system's error comes through.
  CHECK_THROWS_EXACT(read_idx(dir.path()),
                     "read_idx: '" + dir.path() + "' is not a readable gzip or IDX file: Is a directory");
}

TEST_CASE("read_idx refuses files too short for the header", "[data][idx][errors]") {
  TempDir dir;
  const std::string path = dir.file("short.idx");
  write_file(path, {});
  CHECK_THROWS_EXACT(read_idx(path),
                     "read_idx: '" + path + "' is too short for an IDX header: 0 bytes, expected at least 4");
  write_gzip(path, {0, 0, 8});
  CHECK_THROWS_EXACT(read_idx(path),
                     "read_idx: '" + path + "' is too short for an IDX header: 3 bytes, expected at least 4");
  // Two dimensions need 4 + 2 * 4 header bytes; only one size is present.
  write_file(path, {0, 0, 8, 2, 0, 0, 0, 1});
  CHECK_THROWS_EXACT(read_idx(path),
                     "read_idx: '" + path +
                         "' is too short for an IDX header of 2 dimensions: 8 bytes, expected at "
                         "least 12");
}

TEST_CASE("read_idx refuses nonzero magic bytes", "[data][idx][errors]") {
  TempDir dir;
  const std::string path = dir.file("magic.idx");
  write_file(path, {0x01, 0x00, 0x08, 0x01, 0, 0, 0, 1, 7});
  CHECK_THROWS_EXACT(
      read_idx(path),
      "read_idx: '" + path + "' is not an IDX file: magic bytes are 0x01 0x00, expected 0x00 0x00");
  write_gzip(path, {0x00, 0xAB, 0x08, 0x01, 0, 0, 0, 1, 7});
  CHECK_THROWS_EXACT(
      read_idx(path),
      "read_idx: '" + path + "' is not an IDX file: magic bytes are 0x00 0xAB, expected 0x00 0x00");
}

TEST_CASE("read_idx refuses unknown type codes", "[data][idx][errors]") {
  TempDir dir;
  const std::string path = dir.file("type.idx");
  for (const std::uint8_t code : {0x00, 0x0A, 0x0F, 0xFF}) {
    write_file(path, idx_file(code, {1}, {0}));
    CHECK_THROWS_EXACT(read_idx(path), "read_idx: '" + path + "' has unknown IDX type code 0x" +
                                           fmt::format("{:02X}", code) +
                                           " (expected 0x08, 0x09, 0x0B, 0x0C, 0x0D or 0x0E)");
  }
}

TEST_CASE("read_idx refuses 0 or more than 8 dimensions", "[data][idx][errors]") {
  TempDir dir;
  const std::string path = dir.file("ndim.idx");
  write_file(path, {0, 0, 0x08, 0});
  CHECK_THROWS_EXACT(read_idx(path), "read_idx: '" + path + "' has 0 dimensions, expected 1 to 8");
  write_file(path, idx_file(0x08, {1, 1, 1, 1, 1, 1, 1, 1, 1}, {5}));
  CHECK_THROWS_EXACT(read_idx(path), "read_idx: '" + path + "' has 9 dimensions, expected 1 to 8");
}

TEST_CASE("read_idx refuses data whose length does not match the sizes", "[data][idx][errors]") {
  TempDir dir;
  const std::string path = dir.file("length.idx");
  write_file(path, idx_file(0x08, {2, 3}, {1, 2, 3, 4, 5}));
  CHECK_THROWS_EXACT(
      read_idx(path),
      "read_idx: '" + path + "' has 5 data bytes, expected 6 (sizes [2, 3] x 1 bytes per element)");
  write_gzip(path, idx_file(0x0D, {2}, Bytes(9, 0)));
  CHECK_THROWS_EXACT(read_idx(path), "read_idx: '" + path +
                                         "' has 9 data bytes, expected 8 (sizes [2] x 4 bytes per element)");
  write_file(path, idx_file(0x0B, {0}, {1, 2}));
  CHECK_THROWS_EXACT(read_idx(path), "read_idx: '" + path +
                                         "' has 2 data bytes, expected 0 (sizes [0] x 2 bytes per element)");
  // 8 x (2^32 - 1)^3 does not fit 64 bits: reported as such, not as a wrapped-around length.
  write_file(path, idx_file(0x0E, {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}, {}));
  CHECK_THROWS_EXACT(read_idx(path), "read_idx: '" + path +
                                         "' has sizes [4294967295, 4294967295, 4294967295] whose data length "
                                         "overflows 64 bits");
  // A zero size empties the data, but the other sizes still make the strides: (2^32 - 1)^3 overflows
  // int64 (found by scripts/fuzz, tests/fuzz/regressions/idx/).
  write_file(path, idx_file(0x08, {0, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}, {}));
  CHECK_THROWS_EXACT(read_idx(path),
                     "read_idx: '" + path +
                         "' has sizes [0, 4294967295, 4294967295, 4294967295]: their product, "
                         "zeros counted as ones, overflows int64");
}

TEST_CASE("read_idx reports gzip corruption with zlib's description", "[data][idx][errors]") {
  TempDir dir;
  const std::string good = dir.file("good.idx.gz");
  Bytes payload(600);
  for (std::size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::uint8_t>(i * 7 % 251);
  write_gzip(good, idx_file(0x08, {600}, payload));
  const Bytes compressed = test::read_file(good);
  REQUIRE(compressed.size() > 40);
  REQUIRE(read_idx(good).numel() == 600);

  const std::string path = dir.file("bad.idx.gz");
  // Cut inside the deflate stream: zlib runs out of input before the end of the stream.
  write_file(path, Bytes(compressed.begin(),
                         compressed.begin() + static_cast<std::ptrdiff_t>(compressed.size() / 2)));
  CHECK_THROWS_EXACT(read_idx(path),
                     "read_idx: '" + path + "' is not a readable gzip or IDX file: unexpected end of file");

  // The trailer is CRC-32 then the length, both little-endian; flipping a bit of either is caught.
  Bytes bad_crc = compressed;
  bad_crc[bad_crc.size() - 8] ^= 0x01;
  write_file(path, bad_crc);
  CHECK_THROWS_EXACT(read_idx(path),
                     "read_idx: '" + path + "' is not a readable gzip or IDX file: incorrect data check");
  Bytes bad_length = compressed;
  bad_length[bad_length.size() - 4] ^= 0x01;
  write_file(path, bad_length);
  CHECK_THROWS_EXACT(read_idx(path),
                     "read_idx: '" + path + "' is not a readable gzip or IDX file: incorrect length check");

  // A bad block type (3 is reserved) in the first deflate header after the 10-byte gzip header.
  Bytes bad_block = compressed;
  bad_block[10] |= 0x06;
  write_file(path, bad_block);
  CHECK_THROWS_EXACT(read_idx(path),
                     "read_idx: '" + path + "' is not a readable gzip or IDX file: invalid block type");
}

// --- load_mnist --------------------------------------------------------------------------------

namespace {

struct MnistFiles {
  Bytes images, labels;
};

// n images of h x w with pixel (i, y, x) = (i * 31 + y * 7 + x * 3) % 256, and labels 3i + 1 (not < 10:
// load_mnist must not care).
MnistFiles tiny_mnist(std::uint32_t n, std::uint32_t h, std::uint32_t w) {
  Bytes pixels, labels;
  for (std::uint32_t i = 0; i < n; ++i) {
    for (std::uint32_t y = 0; y < h; ++y) {
      for (std::uint32_t x = 0; x < w; ++x)
        pixels.push_back(static_cast<std::uint8_t>((i * 31 + y * 7 + x * 3) % 256));
    }
    labels.push_back(static_cast<std::uint8_t>(3 * i + 1));
  }
  return {idx_file(0x08, {n, h, w}, pixels), idx_file(0x08, {n}, labels)};
}

double normalised(double pixel) { return (pixel / 255.0 - 0.1307) / 0.3081; }

}  // namespace

TEST_CASE("load_mnist builds normalised [N, 1, H, W] images and i64 labels", "[data][idx][mnist]") {
  TempDir dir;
  const MnistFiles files = tiny_mnist(5, 3, 4);
  write_gzip(dir.file("train-images-idx3-ubyte.gz"), files.images);
  write_gzip(dir.file("train-labels-idx1-ubyte.gz"), files.labels);
  const data::ImageSet set = load_mnist(dir.path(), true);
  REQUIRE(set.images.shape() == Shape{5, 1, 3, 4});
  CHECK(set.images.dtype() == DType::f32);
  std::vector<double> expected;
  for (int i = 0; i < 5; ++i) {
    for (int y = 0; y < 3; ++y) {
      for (int x = 0; x < 4; ++x) expected.push_back(normalised((i * 31 + y * 7 + x * 3) % 256));
    }
  }
  check_close(set.images, expected);
  CHECK(set.labels.dtype() == DType::i64);
  CHECK(set.labels.shape() == Shape{5});
  check_equal(set.labels, {1, 4, 7, 10, 13});
}

TEST_CASE("load_mnist reads the test split from plain files and prefers .gz when both exist",
          "[data][idx][mnist]") {
  TempDir dir;
  const MnistFiles files = tiny_mnist(2, 2, 2);
  write_file(dir.file("t10k-images-idx3-ubyte"), files.images);
  write_file(dir.file("t10k-labels-idx1-ubyte"), files.labels);
  const data::ImageSet plain = load_mnist(dir.path(), false);
  CHECK(plain.images.shape() == Shape{2, 1, 2, 2});
  check_equal(plain.labels, {1, 4});

  // Different labels (i32 this time) in the .gz twin: those are the ones loaded.
  write_gzip(dir.file("t10k-labels-idx1-ubyte.gz"), idx_file(0x0C, {2}, {0, 0, 0, 9, 0, 0, 1, 0}));
  const data::ImageSet packed = load_mnist(dir.path(), false);
  check_equal(packed.labels, {9, 256});
  CHECK(packed.labels.dtype() == DType::i64);
}

TEST_CASE("load_mnist names both paths it tried when a file is missing", "[data][idx][mnist][errors]") {
  TempDir dir;
  const std::string images = dir.file("t10k-images-idx3-ubyte");
  const std::string labels = dir.file("t10k-labels-idx1-ubyte");
  CHECK_THROWS_EXACT(load_mnist(dir.path(), false),
                     "load_mnist: found neither '" + images + ".gz' nor '" + images + "'");
  write_file(images, tiny_mnist(2, 2, 2).images);
  CHECK_THROWS_EXACT(load_mnist(dir.path(), false),
                     "load_mnist: found neither '" + labels + ".gz' nor '" + labels + "'");
  // The train split looks for its own names.
  const std::string train = dir.file("train-images-idx3-ubyte");
  CHECK_THROWS_EXACT(load_mnist(dir.path(), true),
                     "load_mnist: found neither '" + train + ".gz' nor '" + train + "'");
}

TEST_CASE("load_mnist refuses mismatched counts, wrong ranks and wrong element types",
          "[data][idx][mnist][errors]") {
  TempDir dir;
  const std::string images = dir.file("train-images-idx3-ubyte.gz");
  const std::string labels = dir.file("train-labels-idx1-ubyte.gz");
  const MnistFiles files = tiny_mnist(3, 2, 2);

  write_gzip(images, files.images);
  write_gzip(labels, idx_file(0x08, {2}, {0, 1}));
  CHECK_THROWS_EXACT(load_mnist(dir.path(), true),
                     "load_mnist: '" + images + "' has 3 images but '" + labels + "' has 2 labels");

  write_gzip(labels, idx_file(0x08, {3, 1}, {0, 1, 2}));
  CHECK_THROWS_EXACT(load_mnist(dir.path(), true),
                     "load_mnist: '" + labels + "' holds an array of shape [3, 1], expected 1-D labels [N]");

  write_gzip(labels, idx_file(0x0D, {3}, Bytes(12, 0)));
  CHECK_THROWS_EXACT(load_mnist(dir.path(), true),
                     "load_mnist: '" + labels + "' holds f32 values, expected integer labels");

  write_gzip(labels, files.labels);
  write_gzip(images, idx_file(0x08, {3, 4}, Bytes(12, 0)));
  CHECK_THROWS_EXACT(
      load_mnist(dir.path(), true),
      "load_mnist: '" + images + "' holds an array of shape [3, 4], expected 3-D images [N, H, W]");

  write_gzip(images, idx_file(0x0D, {3, 1, 1}, Bytes(12, 0)));
  CHECK_THROWS_EXACT(load_mnist(dir.path(), true),
                     "load_mnist: '" + images + "' holds f32 values, expected u8 pixels (type 0x08)");

  // Errors of the IDX layer come through unchanged.
  write_gzip(images, {0, 0, 8});
  CHECK_THROWS_EXACT(
      load_mnist(dir.path(), true),
      "read_idx: '" + images + "' is too short for an IDX header: 3 bytes, expected at least 4");
}

namespace {

// The first `count` bytes after `skip` of a gzip file, read without shardlab's reader.
Bytes gz_bytes(const std::string& path, std::size_t skip, std::size_t count) {
  gzFile file = gzopen(path.c_str(), "rb");
  REQUIRE(file != nullptr);
  Bytes out(skip + count);
  const int got = gzread(file, out.data(), static_cast<unsigned>(out.size()));
  gzclose(file);
  REQUIRE(got == static_cast<int>(out.size()));
  return Bytes(out.begin() + static_cast<std::ptrdiff_t>(skip), out.end());
}

}  // namespace

TEST_CASE("load_mnist reads the real Fashion-MNIST test set", "[data][idx][mnist][fashion-mnist]") {
  const std::string dir = "/usr/share/datasets/fashion-mnist";
  if (!std::filesystem::exists(dir + "/t10k-images-idx3-ubyte.gz") &&
      !std::filesystem::exists(dir + "/t10k-images-idx3-ubyte")) {
    // Without the data set the same call must say exactly what it looked for.
    const std::string images = dir + "/t10k-images-idx3-ubyte";
    CHECK_THROWS_EXACT(load_mnist(dir, false),
                       "load_mnist: found neither '" + images + ".gz' nor '" + images + "'");
    return;
  }
  const data::ImageSet set = load_mnist(dir, false);
  REQUIRE(set.images.shape() == Shape{10000, 1, 28, 28});
  REQUIRE(set.labels.shape() == Shape{10000});

  // Labels are the 10 classes, 1000 test images each (the published class balance).
  std::vector<int> per_class(10, 0);
  for (const std::int64_t label : set.labels.to_vector<std::int64_t>()) {
    REQUIRE(label >= 0);
    REQUIRE(label <= 9);
    ++per_class[static_cast<std::size_t>(label)];
  }
  CHECK(per_class == std::vector<int>(10, 1000));

  // The first label and first image, read straight from the files past their 8- and 16-byte
  // headers (gzread passes a plain file through, so either name works).
  const auto file = [&](const std::string& name) {
    return std::filesystem::exists(dir + "/" + name + ".gz") ? dir + "/" + name + ".gz" : dir + "/" + name;
  };
  const Bytes first_label = gz_bytes(file("t10k-labels-idx1-ubyte"), 8, 1);
  CHECK(set.labels.to_vector<std::int64_t>()[0] == first_label[0]);
  const Bytes first_image = gz_bytes(file("t10k-images-idx3-ubyte"), 16, 28 * 28);
  std::vector<double> expected;
  for (const std::uint8_t pixel : first_image) expected.push_back(normalised(pixel));
  check_close(set.images.select(0, 0).reshape({-1}), expected);
}
