// tests/nn/test_safetensors.cpp: safetensors round trips of every dtype, the exact bytes of a
// tiny file and its layout, a golden file written from PyTorch, each malformed-file class, and the
// temporary-file-then-rename writer.
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "nn/safetensors.h"
#include "tests/check.h"
#include "tests/temp_dir.h"

using namespace shardlab;
using Catch::Matchers::EndsWith;
using Catch::Matchers::StartsWith;
using nn::load_safetensors;
using nn::save_safetensors;
using nn::StateDict;
using test::Bytes;
using test::check_equal;
using test::read_file;
using test::TempDir;
using test::write_file;

#define CHECK_THROWS_EXACT(expr, message) CHECK_THROWS_WITH((expr), Catch::Matchers::Equals(message))

#ifndef SHARDLAB_NN_GOLDEN_DIR
#error "tests/meson.build defines SHARDLAB_NN_GOLDEN_DIR, the directory of the committed golden files"
#endif

namespace {

void append_u64(Bytes& out, std::uint64_t value) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(value >> (8 * i)));
}

// A file with the given header length field, header text and data section.
Bytes craft(std::uint64_t length_field, const std::string& header, const Bytes& data) {
  Bytes out;
  append_u64(out, length_field);
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}
Bytes craft(const std::string& header, const Bytes& data) { return craft(header.size(), header, data); }

// The tensor's elements as bytes, row-major (what the file must hold).
Bytes tensor_bytes(const Tensor& t) {
  const Tensor c = t.contiguous();
  const auto* p = static_cast<const std::uint8_t*>(c.numel() > 0 ? c.raw_data() : nullptr);
  return p ? Bytes(p, p + c.numel() * static_cast<std::int64_t>(c.element_size())) : Bytes{};
}

Tensor bf16_tensor(const std::vector<std::uint16_t>& bits) {
  std::vector<bf16> values;
  for (const auto b : bits) values.push_back(bf16{b});
  return from_vector(values);
}

Tensor f16_tensor(const std::vector<std::uint16_t>& bits) {
  std::vector<f16> values;
  for (const auto b : bits) values.push_back(f16{b});
  return from_vector(values);
}

}  // namespace

// --- round trips --------------------------------------------------------------------------------------

TEST_CASE("safetensors round-trips every dtype, 0-d, empty and non-contiguous tensors", "[nn][safetensors]") {
  TempDir dir;
  const float inf = std::numeric_limits<float>::infinity();
  const Tensor transposed = test::random_strided({3, 4}, 5);  // a transposed view
  REQUIRE(!transposed.is_contiguous());
  const Tensor stepped = arange(20, dtype(DType::i32)).reshape({4, 5}).slice(1, 0, 5, 2);  // columns 0, 2, 4
  REQUIRE(!stepped.is_contiguous());
  const StateDict tensors = {
      {"f32", from_vector<float>({1.5f, -0.0f, inf, 3e-39f}, {2, 2})},
      {"f64", from_vector<double>({0.1, -1e300, 5e-324})},
      // bf16 1.0, -2.0, smallest subnormal, NaN; f16 1.0, -65504, smallest subnormal, +inf.
      {"bf16", bf16_tensor({0x3F80, 0xC000, 0x0001, 0x7FC1})},
      {"f16", f16_tensor({0x3C00, 0xFBFF, 0x0001, 0x7C00})},
      {"i64", from_vector<std::int64_t>(
                  {(std::int64_t{1} << 60) + 1, -5, std::numeric_limits<std::int64_t>::min()})},
      {"i32", from_vector<std::int32_t>({-1, 2147483647, 7})},
      {"u8", from_vector<std::uint8_t>({0, 1, 128, 255})},
      {"bool", from_vector<bool>({true, false, false, true, true})},
      {"scalar", scalar_tensor(2.5, dtype(DType::f64))},
      {"empty", empty({0, 3})},
      {"empty_i64", empty({2, 0, 4}, dtype(DType::i64))},
      {"transposed", transposed},
      {"stepped", stepped},
  };
  const std::string path = dir.file("all.safetensors");
  save_safetensors(path, tensors);
  const nn::SafetensorsFile file = load_safetensors(path);
  CHECK(file.metadata.empty());
  REQUIRE(file.tensors.size() == tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, original] = tensors[i];
    const auto& [loaded_name, loaded] = file.tensors[i];
    INFO(name);
    CHECK(loaded_name == name);  // written in the given order, read in data order: the same
    CHECK(loaded.dtype() == original.dtype());
    CHECK(loaded.shape() == original.shape());
    CHECK(loaded.is_contiguous());
    CHECK(tensor_bytes(loaded) == tensor_bytes(original));  // bit for bit, NaN payloads included
  }
  // The views were stored in their logical order; values written out independently.
  std::vector<double> t = test::values(test::random_tensor({4, 3}, 5));
  check_equal(file.tensors[11].second,
              {t[0], t[3], t[6], t[9], t[1], t[4], t[7], t[10], t[2], t[5], t[8], t[11]});
  check_equal(file.tensors[12].second, {0, 2, 4, 5, 7, 9, 10, 12, 14, 15, 17, 19});
  check_equal(file.tensors[8].second, {2.5});
  CHECK(file.tensors[8].second.dim() == 0);
}

TEST_CASE("safetensors round-trips metadata, and writes none when there is none", "[nn][safetensors]") {
  TempDir dir;
  const std::string path = dir.file("meta.safetensors");
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"note", "quotes \" and \\ and \xC3\xBCnicode"}, {"empty", ""}};
  save_safetensors(path, {{"w", ones({2})}}, metadata);
  CHECK(load_safetensors(path).metadata == metadata);

  save_safetensors(path, {{"w", ones({2})}});
  const Bytes bytes = read_file(path);
  const std::string text(bytes.begin(), bytes.end());
  CHECK(text.find("__metadata__") == std::string::npos);
  CHECK(load_safetensors(path).metadata.empty());

  // A file of metadata alone, and a file of nothing.
  save_safetensors(path, {}, metadata);
  const nn::SafetensorsFile only = load_safetensors(path);
  CHECK(only.tensors.empty());
  CHECK(only.metadata == metadata);
  save_safetensors(path, {});
  CHECK(read_file(path) == craft("{}      ", {}));
  CHECK(load_safetensors(path).tensors.empty());
}

TEST_CASE("safetensors writes exactly the bytes of the format", "[nn][safetensors]") {
  TempDir dir;
  const std::string path = dir.file("tiny.safetensors");
  save_safetensors(path,
                   {{"b", from_vector<std::uint8_t>({1, 2, 3})}, {"a", from_vector<float>({1.0f, -2.0f})}},
                   {{"k", "v"}});
  // 132 bytes of JSON (metadata first, then the tensors in the given order) padded with 4
  // spaces to 136 = 0x88, a multiple of 8.
  const std::string json = R"({"__metadata__":{"k":"v"},"b":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
                           R"("a":{"dtype":"F32","shape":[2],"data_offsets":[3,11]}})";
  REQUIRE(json.size() == 132);
  // Data: u8 1, 2, 3; then f32 1.0 = 0x3F800000 and -2.0 = 0xC0000000, little-endian.
  const Bytes expected =
      craft(0x88, json + "    ", {1, 2, 3, 0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0xC0});
  REQUIRE(expected.size() == 8 + 136 + 11);
  CHECK(read_file(path) == expected);
  CHECK(read_file(path)[0] == 0x88);
  // The layout the writers share: those header bytes, each tensor's data at its file offset.
  const nn::SafetensorsLayout layout = nn::safetensors_layout(
      {{.name = "b", .dtype = DType::u8, .shape = {3}}, {.name = "a", .dtype = DType::f32, .shape = {2}}},
      {{"k", "v"}}, "test");
  CHECK(Bytes(layout.header.begin(), layout.header.end()) ==
        Bytes(expected.begin(), expected.begin() + 8 + 136));
  CHECK(layout.offsets == std::vector<std::uint64_t>{8 + 136, 8 + 136 + 3});
  CHECK(layout.file_bytes == expected.size());

  // BOOL is one byte per element, 0 or 1; a header of exactly 8k bytes gets no padding.
  save_safetensors(path, {{"mm", from_vector<bool>({true, false, true})}});
  const std::string bool_json = R"({"mm":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})";
  REQUIRE(bool_json.size() == 56);
  CHECK(read_file(path) == craft(bool_json, {1, 0, 1}));
}

TEST_CASE("safetensors loads a golden file written from PyTorch", "[nn][safetensors][golden]") {
  // tests/nn/make_safetensors_golden.py wrote it: header keys sorted by name, data ordered by
  // element size then name, so file order is data order, not header order.
  const nn::SafetensorsFile file =
      load_safetensors(std::string(SHARDLAB_NN_GOLDEN_DIR) + "/torch_small.safetensors");
  CHECK(file.metadata ==
        std::map<std::string, std::string>{{"format", "pt"}, {"source", "make_safetensors_golden.py"}});
  std::vector<std::string> names;
  for (const auto& [name, t] : file.tensors) names.push_back(name);
  CHECK(names == std::vector<std::string>{"double", "step", "embed.weight", "empty", "ids", "proj.weight",
                                          "head.bias", "norm.weight", "mask", "pixels"});
  std::map<std::string, Tensor> by_name(file.tensors.begin(), file.tensors.end());

  std::vector<double> embed;
  for (int k = 0; k < 12; ++k) embed.push_back(k / 8.0 - 0.5);
  CHECK(by_name["embed.weight"].shape() == Shape{3, 4});
  check_equal(by_name["embed.weight"], embed);
  // arange(6).reshape(2, 3).t(): element (i, j) is 3 j + i.
  CHECK(by_name["proj.weight"].shape() == Shape{3, 2});
  check_equal(by_name["proj.weight"], {0, 3, 1, 4, 2, 5});
  // PyTorch's round-to-nearest-even: 1/3 -> 0x3EAB, 1e-3 -> 0x3A83, 262016 -> 2^18 (a tie, to even).
  CHECK(by_name["norm.weight"].dtype() == DType::bf16);
  check_equal(by_name["norm.weight"], {0.333984375, -2.5, 0.00099945068359375, 262144.0});
  // 0.1 -> 0x2E66 = 0.0999755859375; 6e-8 -> the smallest subnormal 2^-24.
  CHECK(by_name["head.bias"].dtype() == DType::f16);
  check_equal(by_name["head.bias"], {0.0999755859375, -65504.0, 5.9604644775390625e-08, 1.0});
  CHECK(by_name["double"].dtype() == DType::f64);
  CHECK(by_name["double"].to_vector<double>() == std::vector<double>{3.141592653589793, -1e-300});
  CHECK(by_name["step"].dim() == 0);
  CHECK(by_name["step"].item<std::int64_t>() == 123456789012345);
  CHECK(by_name["ids"].dtype() == DType::i32);
  check_equal(by_name["ids"], {-1, 2, 3, -2147483648.0});
  CHECK(by_name["pixels"].dtype() == DType::u8);
  check_equal(by_name["pixels"], {0, 128, 255});
  CHECK(by_name["mask"].dtype() == DType::boolean);
  check_equal(by_name["mask"], {1, 0, 1});
  CHECK(by_name["empty"].shape() == Shape{0, 2});
}

TEST_CASE("safetensors accepts what the format allows", "[nn][safetensors]") {
  TempDir dir;
  const std::string path = dir.file("ok.safetensors");
  // Header order differs from data order; an empty tensor shares an offset with a full one;
  // an unknown key in an entry is ignored, as the reference implementation ignores it.
  write_file(path, craft(R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4],"extra":[1]},)"
                         R"("e":{"dtype":"F32","shape":[0],"data_offsets":[2,2]},)"
                         R"("a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}   )",
                         {10, 11, 12, 13}));
  const nn::SafetensorsFile file = load_safetensors(path);
  REQUIRE(file.tensors.size() == 3);
  CHECK(file.tensors[0].first == "a");
  check_equal(file.tensors[0].second, {10, 11});
  CHECK(file.tensors[1].first == "e");
  CHECK(file.tensors[1].second.numel() == 0);
  CHECK(file.tensors[2].first == "b");
  check_equal(file.tensors[2].second, {12, 13});
}

// --- malformed files -------------------------------------------------------------------------------------

TEST_CASE("safetensors refuses files it cannot open or too short for the length",
          "[nn][safetensors][errors]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  CHECK_THROWS_EXACT(load_safetensors(path),
                     "load_safetensors: cannot open '" + path + "': No such file or directory");
  CHECK_THROWS_EXACT(load_safetensors(dir.file("")),
                     "load_safetensors: '" + dir.file("") + "' is not a regular file");
  write_file(path, {0x10, 0, 0, 0, 0});
  CHECK_THROWS_EXACT(
      load_safetensors(path),
      "load_safetensors: '" + path + "' is too short for the 8-byte header length: the file has 5 bytes");
  write_file(path, {});
  CHECK_THROWS_EXACT(
      load_safetensors(path),
      "load_safetensors: '" + path + "' is too short for the 8-byte header length: the file has 0 bytes");
}

TEST_CASE("safetensors refuses header lengths past the file or the 100 MB bound",
          "[nn][safetensors][errors]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const std::string prefix = "load_safetensors: '" + path + "': ";
  write_file(path, craft(1000, "{}", Bytes(18, 0)));
  CHECK_THROWS_EXACT(
      load_safetensors(path),
      prefix + "header length 1000 runs past the end of the file (20 bytes follow the length field)");
  write_file(path, craft(3, "{}", {}));
  CHECK_THROWS_EXACT(
      load_safetensors(path),
      prefix + "header length 3 runs past the end of the file (2 bytes follow the length field)");
  write_file(path, craft(100'000'001, "{}", {}));
  CHECK_THROWS_EXACT(load_safetensors(path),
                     prefix + "header length 100000001 exceeds the limit of 100000000 bytes");
  write_file(path, craft(~std::uint64_t{0}, "{}", {}));
  CHECK_THROWS_EXACT(load_safetensors(path),
                     prefix + "header length 18446744073709551615 exceeds the limit of 100000000 bytes");
}

TEST_CASE("safetensors refuses headers that are not a JSON object", "[nn][safetensors][errors]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const std::string prefix = "load_safetensors: '" + path + "': ";
  write_file(path, craft(R"({"a": )", {}));
  CHECK_THROWS_WITH(load_safetensors(path),
                    StartsWith(prefix + "the header is not valid JSON: [json.exception.parse_error.101]"));
  // nlohmann-json alone would take a NUL for the end of its input and ignore what follows.
  CHECK(nlohmann::ordered_json::parse(std::string("{}\0junk", 7)) == nlohmann::ordered_json::object());
  write_file(path, craft(std::string("{}\0junk", 7), {}));
  CHECK_THROWS_EXACT(load_safetensors(path),
                     prefix + "the header holds a NUL byte at offset 2, which JSON does not allow");
  write_file(path, craft(std::string("{}  \0   ", 8), {}));  // NUL padding is not JSON whitespace
  CHECK_THROWS_EXACT(load_safetensors(path),
                     prefix + "the header holds a NUL byte at offset 4, which JSON does not allow");
  write_file(path, craft(R"({"a": 1e999})", {}));
  CHECK_THROWS_EXACT(
      load_safetensors(path),
      prefix +
          "the header is not valid JSON: [json.exception.out_of_range.406] number overflow parsing "
          "'1e999'");
  write_file(path, craft("[1, 2]", {}));
  CHECK_THROWS_EXACT(load_safetensors(path), prefix + "the header is a JSON array, expected an object");
  write_file(path, craft(R"("weights")", {}));
  CHECK_THROWS_EXACT(load_safetensors(path), prefix + "the header is a JSON string, expected an object");
  write_file(path, craft(R"({"__metadata__":[1]})", {}));
  CHECK_THROWS_EXACT(load_safetensors(path),
                     prefix + "__metadata__ is a JSON array, expected an object of strings");
  write_file(path, craft(R"({"__metadata__":{"k":1}})", {}));
  CHECK_THROWS_EXACT(load_safetensors(path), prefix + "__metadata__ entry 'k' is 1, expected a string");
}

TEST_CASE("safetensors refuses repeated keys, which nlohmann-json would silently merge",
          "[nn][safetensors][errors]") {
  // What the parser alone does: the last value wins, so a file could carry two tensors of one name.
  CHECK(nlohmann::ordered_json::parse(R"({"x":1,"x":2})") == nlohmann::ordered_json::parse(R"({"x":2})"));
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const std::string prefix = "load_safetensors: '" + path + "': ";
  write_file(path, craft(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                         R"("w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                         {1, 2}));
  CHECK_THROWS_EXACT(load_safetensors(path), prefix + "the header repeats the key 'w' within one object");
  write_file(path, craft(R"({"w":{"dtype":"U8","dtype":"F32","shape":[1],"data_offsets":[0,1]}})", {1}));
  CHECK_THROWS_EXACT(load_safetensors(path), prefix + "the header repeats the key 'dtype' within one object");
  // The same key in different objects is fine.
  write_file(path,
             craft(R"({"__metadata__":{"w":"x"},"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", {1}));
  CHECK(load_safetensors(path).tensors.size() == 1);
}

TEST_CASE("safetensors refuses entries without dtype, shape or data_offsets, or of the wrong kind",
          "[nn][safetensors][errors]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const std::string prefix = "load_safetensors: '" + path + "': ";
  const auto check = [&](const std::string& header, const Bytes& data, const std::string& message) {
    write_file(path, craft(header, data));
    CHECK_THROWS_EXACT(load_safetensors(path), prefix + message);
  };
  check(R"({"a":5})", {},
        "tensor 'a' is described by a JSON number, expected an object with dtype, shape and data_offsets");
  check(R"({"a":{"shape":[1],"data_offsets":[0,1]}})", {1}, "tensor 'a' has no 'dtype'");
  check(R"({"a":{"dtype":"U8","data_offsets":[0,1]}})", {1}, "tensor 'a' has no 'shape'");
  check(R"({"a":{"dtype":"U8","shape":[1]}})", {1}, "tensor 'a' has no 'data_offsets'");
  check(R"({"a":{"dtype":8,"shape":[1],"data_offsets":[0,1]}})", {1},
        "tensor 'a' has dtype 8, expected a string");
  for (const std::string unknown : {"I16", "F8_E4M3", "f32", ""}) {
    check(R"({"a":{"dtype":")" + unknown + R"(","shape":[1],"data_offsets":[0,1]}})", {1},
          "tensor 'a' has dtype '" + unknown + "', expected one of F32, F64, BF16, F16, I64, I32, U8, BOOL");
  }
  check(R"({"a":{"dtype":"U8","shape":3,"data_offsets":[0,3]}})", {1, 2, 3},
        "tensor 'a' has shape 3, expected an array of sizes");
}

TEST_CASE("safetensors refuses negative, non-integer and overflowing shapes", "[nn][safetensors][errors]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const std::string prefix = "load_safetensors: '" + path + "': ";
  const auto check = [&](const std::string& shape, const std::string& dtype, const std::string& message) {
    write_file(path,
               craft(R"({"a":{"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":[0,4]}})",
                     {1, 2, 3, 4}));
    CHECK_THROWS_EXACT(load_safetensors(path), prefix + message);
  };
  check("[2,-2]", "U8", "tensor 'a' has shape [2,-2]: -2 is not a non-negative 64-bit integer");
  check("[1.5]", "U8", "tensor 'a' has shape [1.5]: 1.5 is not a non-negative 64-bit integer");
  check("[4.0]", "U8", "tensor 'a' has shape [4.0]: 4.0 is not a non-negative 64-bit integer");
  check(R"(["4"])", "U8", R"(tensor 'a' has shape ["4"]: "4" is not a non-negative 64-bit integer)");
  check(
      "[9223372036854775808]", "U8",
      "tensor 'a' has shape [9223372036854775808]: 9223372036854775808 is not a non-negative 64-bit integer");
  // 2^32 x 2^32 x 4 bytes wraps to 0 in 64 bits: it must not pass for an empty tensor.
  check("[4294967296,4294967296]", "F32",
        "tensor 'a' has shape [4294967296,4294967296] whose size in bytes (4 each) overflows 64 bits");
  // 2^62 x 2 bytes fits in uint64 but not in int64.
  check("[4611686018427387904]", "F16",
        "tensor 'a' has shape [4611686018427387904] whose size in bytes (2 each) overflows 64 bits");
  // Empty, but its strides would be 2^64 (found by scripts/fuzz, tests/fuzz/regressions/safetensors/).
  check("[0,4294967296,4294967296]", "U8",
        "tensor 'a' has shape [0,4294967296,4294967296]: its sizes, zeros counted as ones, multiply past "
        "int64");
  // A zero anywhere makes the tensor empty, however large the other sizes, while its strides fit.
  write_file(path,
             craft(R"({"a":{"dtype":"F64","shape":[0,9223372036854775807],"data_offsets":[0,0]}})", {}));
  CHECK(load_safetensors(path).tensors[0].second.shape() ==
        Shape{0, std::numeric_limits<std::int64_t>::max()});
}

TEST_CASE("safetensors refuses bad data_offsets: malformed, reversed, out of range, wrong span",
          "[nn][safetensors][errors]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const std::string prefix = "load_safetensors: '" + path + "': ";
  const auto check = [&](const std::string& shape, const std::string& offsets, const std::string& message) {
    write_file(path, craft(R"({"a":{"dtype":"F32","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}}",
                           Bytes(8, 0)));
    CHECK_THROWS_EXACT(load_safetensors(path), prefix + message);
  };
  check("[2]", "[0]", "tensor 'a' has data_offsets [0], expected [begin, end] (non-negative)");
  check("[2]", "[0,8,8]", "tensor 'a' has data_offsets [0,8,8], expected [begin, end] (non-negative)");
  check("[2]", "[-8,0]", "tensor 'a' has data_offsets [-8,0], expected [begin, end] (non-negative)");
  check("[2]", "[0,8.0]", "tensor 'a' has data_offsets [0,8.0], expected [begin, end] (non-negative)");
  check("[2]", R"({"begin":0})",
        R"(tensor 'a' has data_offsets {"begin":0}, expected [begin, end] (non-negative))");
  check("[1]", "[8,4]", "tensor 'a' has data_offsets [8, 4] that end before they begin");
  check("[4]", "[0,16]", "tensor 'a' has data_offsets [0, 16] past the end of the 8-byte data section");
  check("[0]", "[9,9]", "tensor 'a' has data_offsets [9, 9] past the end of the 8-byte data section");
  check("[3]", "[0,8]", "tensor 'a' (F32 [3]) needs 12 bytes but data_offsets [0, 8] span 8");
  check("[1]", "[0,8]", "tensor 'a' (F32 [1]) needs 4 bytes but data_offsets [0, 8] span 8");
  check("[]", "[0,8]", "tensor 'a' (F32 []) needs 4 bytes but data_offsets [0, 8] span 8");
}

TEST_CASE("safetensors refuses gaps, overlaps and trailing bytes in the data section",
          "[nn][safetensors][errors]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const std::string prefix = "load_safetensors: '" + path + "': ";
  const auto check = [&](const std::string& header, std::size_t data_size, const std::string& message) {
    write_file(path, craft(header, Bytes(data_size, 0)));
    CHECK_THROWS_EXACT(load_safetensors(path), prefix + message);
  };
  check(
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}})",
      12, "bytes [4, 8) of the data section belong to no tensor (a gap before tensor 'b')");
  check(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", 8,
        "bytes [0, 4) of the data section belong to no tensor (a gap before tensor 'a')");
  check(
      R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})",
      12, "tensor 'b' at data_offsets [4, 12] overlaps tensor 'a' at [0, 8]");
  // The same tensor twice under two names is an overlap too.
  check(
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
      4, "tensor 'b' at data_offsets [0, 4] overlaps tensor 'a' at [0, 4]");
  check(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 8,
        "4 bytes of the data section follow the last tensor (tensors end at byte 4 of 8)");
  check("{}", 3, "3 bytes of the data section follow the last tensor (tensors end at byte 0 of 3)");
}

TEST_CASE("safetensors refuses BOOL bytes other than 0 and 1", "[nn][safetensors][errors]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  write_file(path, craft(R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})", {0, 1, 2}));
  CHECK_THROWS_EXACT(
      load_safetensors(path),
      "load_safetensors: '" + path + "': tensor 'm' (BOOL) holds byte 0x02 at element 2, expected 0 or 1");
}

// --- the writer
// ---------------------------------------------------------------------------------------------

TEST_CASE("save_safetensors refuses reserved, repeated and undefined names and leaves the old file",
          "[nn][safetensors][errors]") {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  save_safetensors(path, {{"w", full({2}, 7.0)}});
  CHECK_THROWS_EXACT(save_safetensors(path, {{"w", ones({1})}, {"w", ones({1})}}),
                     "save_safetensors: '" + path + "': the name 'w' appears twice");
  CHECK_THROWS_EXACT(save_safetensors(path, {{"__metadata__", ones({1})}}),
                     "save_safetensors: '" + path + "': the name '__metadata__' is reserved");
  CHECK_THROWS_EXACT(save_safetensors(path, {{"u", Tensor()}}),
                     "save_safetensors: '" + path + "': tensor 'u' is undefined");
  const nn::SafetensorsFile file = load_safetensors(path);
  REQUIRE(file.tensors.size() == 1);
  check_equal(file.tensors[0].second, {7, 7});
  CHECK(dir.entries() == std::vector<std::string>{"model.safetensors"});
}

TEST_CASE("save_safetensors goes through a temporary file and leaves nothing when it fails",
          "[nn][safetensors][errors]") {
  TempDir dir;
  // Into a directory that does not exist: the temporary file cannot even be created.
  const std::string missing = dir.file("no-such-dir") + "/model.safetensors";
  CHECK_THROWS_WITH(save_safetensors(missing, {{"w", ones({2})}}),
                    StartsWith("save_safetensors: cannot open '" + missing + ".tmp-") &&
                        EndsWith("': No such file or directory"));
  CHECK(!std::filesystem::exists(missing));

  // Onto a non-empty directory: everything is written, the rename fails, and the temporary
  // file is removed again.
  const std::string occupied = dir.file("occupied");
  std::filesystem::create_directories(occupied + "/inside");
  CHECK_THROWS_WITH(save_safetensors(occupied, {{"w", ones({2})}}),
                    StartsWith("save_safetensors: cannot rename '" + occupied + ".tmp-") &&
                        EndsWith("' to '" + occupied + "': Is a directory"));
  CHECK(dir.entries() == std::vector<std::string>{"occupied"});

  // Success replaces an existing file whole, and leaves no temporary behind.
  const std::string path = dir.file("model.safetensors");
  save_safetensors(path, {{"w", ones({2})}});
  save_safetensors(path, {{"v", full({3}, 4.0, dtype(DType::f64))}});
  const nn::SafetensorsFile file = load_safetensors(path);
  REQUIRE(file.tensors.size() == 1);
  CHECK(file.tensors[0].first == "v");
  check_equal(file.tensors[0].second, {4, 4, 4});
  CHECK(dir.entries() == std::vector<std::string>{"model.safetensors", "occupied"});
}

TEST_CASE("a file's tensors are read by element range without reading the rest, widened exactly",
          "[nn][safetensors]") {
  TempDir dir;
  const std::string path = dir.file("weights.safetensors");
  const Tensor whole = test::random_tensor({7, 9}, 21);
  save_safetensors(path, {{"first", from_vector<std::int64_t>({1, 2, 3})},
                          {"f32", whole},
                          {"bf16", whole.to(DType::bf16)},
                          {"f16", whole.to(DType::f16)}});
  const std::vector<nn::SafetensorsTensor> header = nn::read_safetensors_header(path);
  REQUIRE(header.size() == 4);
  // In data order, each at its first byte in the file: the 8-byte length, the header, then the data.
  const std::uint64_t data_start = read_file(path).size() - (3 * 8 + 63 * (4 + 2 + 2));
  CHECK(header[0].name == "first");
  CHECK(header[0].offset == data_start);
  CHECK(header[1].offset == data_start + 3 * 8);
  CHECK(header[2].dtype == DType::bf16);
  CHECK(header[3].shape == Shape{7, 9});
  for (const nn::SafetensorsTensor& tensor : std::vector(header.begin() + 1, header.end())) {
    INFO(tensor.name);
    const Tensor expected = whole.to(tensor.dtype).to(DType::f32).flatten();
    for (const auto& [first, count] :
         std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 63}, {5, 13}, {62, 1}, {20, 0}}) {
      const Tensor out = empty({count});
      nn::read_safetensors_elements(path, tensor, first, out);
      CHECK(test::values(out) == test::values(expected.narrow(0, first, count)));
    }
    // Any shape of the same count, in any dtype: as copy_ casts.
    const Tensor rows = empty({2, 9}, dtype(DType::f64));
    nn::read_safetensors_elements(path, tensor, 9, rows);
    CHECK(test::values(rows) == test::values(expected.narrow(0, 9, 18)));
  }
  CHECK_THROWS_EXACT(nn::read_safetensors_elements(path, header[1], 60, empty({4})),
                     "read_safetensors_elements: '" + path +
                         "': elements [60, 64) of tensor 'f32' [7, 9] are past its 63 elements");
  CHECK_THROWS_EXACT(nn::read_safetensors_elements(path, header[1], -1, empty({1})),
                     "read_safetensors_elements: '" + path +
                         "': elements [-1, 0) of tensor 'f32' [7, 9] are past its 63 elements");
  // A file cut short after its header was read: the read says so.
  const Bytes bytes = read_file(path);
  write_file(path, Bytes(bytes.begin(), bytes.end() - 10));
  CHECK_THROWS_EXACT(
      nn::read_safetensors_elements(path, header[3], 60, empty({3})),
      "read_safetensors_elements: '" + path + "': reading tensor 'f16' failed: unexpected end of file");
  // Its header is refused as load_safetensors refuses it.
  CHECK_THROWS_ERROR(nn::read_safetensors_header(path), "past the end of the");
}

TEST_CASE("Init::from_file fills a parameter, or any range of it, with the file's values",
          "[nn][safetensors]") {
  TempDir dir;
  const std::string path = dir.file("weights.safetensors");
  const Tensor whole = test::random_tensor({4, 6}, 22);
  save_safetensors(path, {{"w", whole.to(DType::bf16)}});
  const nn::Init init = nn::Init::from_file(path, nn::read_safetensors_header(path).front());
  const Tensor out = empty({4, 6});
  init.fill(out, 123, "any name");  // seed and name do not matter
  CHECK(test::values(out) == test::values(whole.to(DType::bf16).to(DType::f32)));
  const Tensor part = empty({5});
  init.fill(part, 0, "w", 7);
  CHECK(test::values(part) == test::values(whole.to(DType::bf16).to(DType::f32).flatten().narrow(0, 7, 5)));
}
