// nn/safetensors.cpp: the layout of a file (the header every writer shares), the writer (temporary
// file renamed into place) and a reader that validates every field of an untrusted file before it
// allocates a tensor.
#include "nn/safetensors.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "core/file_io.h"

namespace shardlab::nn {

// The format stores little-endian bytes and both directions copy tensor memory verbatim.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

using Json = nlohmann::ordered_json;  // keeps the header's key order: tensors are written as given

// The reference implementation's bound on the header, against files that claim gigabytes of JSON.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

std::string_view format_name(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "F32";
    case DType::f64:
      return "F64";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::i64:
      return "I64";
    case DType::i32:
      return "I32";
    case DType::u8:
      return "U8";
    case DType::boolean:
      return "BOOL";
  }
  __builtin_unreachable();
}

std::optional<DType> parse_dtype(std::string_view name) {
  for (const DType dtype :
       {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i64, DType::i32, DType::u8, DType::boolean}) {
    if (format_name(dtype) == name) return dtype;
  }
  return std::nullopt;
}

// --- reading ---------------------------------------------------------------------------------------

struct FileCloser {
  void operator()(std::FILE* file) const { std::fclose(file); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

void read_exact(std::FILE* file, void* out, std::size_t size, const std::string& path,
                std::string_view what) {
  SHARDLAB_CHECK(std::fread(out, 1, size, file) == size, "load_safetensors: '{}': reading {} failed: {}",
                 path, what, std::ferror(file) ? std::strerror(errno) : "unexpected end of file");
}

struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  std::uint64_t begin, end;
};

std::string_view type_of(const Json& value) { return value.type_name(); }

// A size from the header: a JSON integer that is non-negative and fits int64.
std::optional<std::int64_t> as_size(const Json& value) {
  if (!value.is_number_unsigned()) return std::nullopt;
  const auto size = value.get<std::uint64_t>();
  if (size > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
  return static_cast<std::int64_t>(size);
}

Entry parse_entry(const std::string& path, const std::string& name, const Json& info,
                  std::uint64_t data_size) {
  SHARDLAB_CHECK(
      info.is_object(),
      "load_safetensors: '{}': tensor '{}' is described by a JSON {}, expected an object with dtype, "
      "shape and data_offsets",
      path, name, type_of(info));
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    SHARDLAB_CHECK(info.contains(field), "load_safetensors: '{}': tensor '{}' has no '{}'", path, name,
                   field);
  }

  const Json& dtype_field = info["dtype"];
  SHARDLAB_CHECK(dtype_field.is_string(),
                 "load_safetensors: '{}': tensor '{}' has dtype {}, expected a string", path, name,
                 dtype_field.dump());
  const std::string dtype_text = dtype_field.get<std::string>();
  const std::optional<DType> dtype = parse_dtype(dtype_text);
  SHARDLAB_CHECK(
      dtype.has_value(),
      "load_safetensors: '{}': tensor '{}' has dtype '{}', expected one of F32, F64, BF16, F16, I64, I32, "
      "U8, BOOL",
      path, name, dtype_text);

  const Json& shape_field = info["shape"];
  SHARDLAB_CHECK(shape_field.is_array(),
                 "load_safetensors: '{}': tensor '{}' has shape {}, expected an array of sizes", path, name,
                 shape_field.dump());
  Shape shape;
  std::uint64_t bytes = dtype_size(*dtype);
  bool overflow = false;
  for (const Json& size_field : shape_field) {
    const std::optional<std::int64_t> size = as_size(size_field);
    SHARDLAB_CHECK(
        size.has_value(),
        "load_safetensors: '{}': tensor '{}' has shape {}: {} is not a non-negative 64-bit integer", path,
        name, shape_field.dump(), size_field.dump());
    shape.push_back(*size);
    overflow = overflow || __builtin_mul_overflow(bytes, static_cast<std::uint64_t>(*size), &bytes);
  }
  // Checked against int64 too: numel() and byte counts are int64 everywhere else.
  SHARDLAB_CHECK(
      !overflow && bytes <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()),
      "load_safetensors: '{}': tensor '{}' has shape {} whose size in bytes ({} each) overflows 64 bits",
      path, name, shape_field.dump(), dtype_size(*dtype));

  // A zero size makes the tensor empty whatever the others are, but its strides still multiply them.
  SHARDLAB_CHECK(
      shape_addressable(shape),
      "load_safetensors: '{}': tensor '{}' has shape {}: its sizes, zeros counted as ones, multiply "
      "past int64",
      path, name, shape_field.dump());

  const Json& offsets = info["data_offsets"];
  const bool pair = offsets.is_array() && offsets.size() == 2 && as_size(offsets[0]) && as_size(offsets[1]);
  SHARDLAB_CHECK(
      pair, "load_safetensors: '{}': tensor '{}' has data_offsets {}, expected [begin, end] (non-negative)",
      path, name, offsets.dump());
  const auto begin = offsets[0].get<std::uint64_t>();
  const auto end = offsets[1].get<std::uint64_t>();
  SHARDLAB_CHECK(begin <= end,
                 "load_safetensors: '{}': tensor '{}' has data_offsets [{}, {}] that end before they begin",
                 path, name, begin, end);
  SHARDLAB_CHECK(end <= data_size,
                 "load_safetensors: '{}': tensor '{}' has data_offsets [{}, {}] past the end of the {}-byte "
                 "data section",
                 path, name, begin, end, data_size);
  SHARDLAB_CHECK(
      end - begin == bytes,
      "load_safetensors: '{}': tensor '{}' ({} {}) needs {} bytes but data_offsets [{}, {}] span {}", path,
      name, dtype_text, shape_str(shape), bytes, begin, end, end - begin);
  return Entry{name, *dtype, std::move(shape), begin, end};
}

// Parses the header, refusing a key repeated within one object: nlohmann would silently keep one
// of the two values, and which tensor a file means must not depend on that.
Json parse_header(const std::string& path, const std::string& text) {
  std::vector<std::set<std::string>> keys;  // the keys seen in each open object
  std::optional<std::string> repeated;
  const Json::parser_callback_t callback = [&](int, Json::parse_event_t event, Json& parsed) {
    using Event = Json::parse_event_t;
    if (event == Event::object_start) keys.emplace_back();
    if (event == Event::object_end) keys.pop_back();
    if (event == Event::key && !keys.back().insert(parsed.get<std::string>()).second && !repeated) {
      repeated = parsed.get<std::string>();
    }
    return true;
  };
  // nlohmann-json stops at a NUL byte as if the input ended there, which would let anything
  // after it pass unread; JSON has no NUL outside strings (and inside them it must be escaped).
  const std::size_t nul = text.find('\0');
  SHARDLAB_CHECK(
      nul == std::string::npos,
      "load_safetensors: '{}': the header holds a NUL byte at offset {}, which JSON does not allow", path,
      nul);
  Json header;
  try {
    header = Json::parse(text, callback);
  } catch (const Json::exception& error) {
    fail("load_safetensors: '{}': the header is not valid JSON: {}", path, error.what());
  }
  SHARDLAB_CHECK(!repeated, "load_safetensors: '{}': the header repeats the key '{}' within one object", path,
                 repeated.value_or(""));
  SHARDLAB_CHECK(header.is_object(), "load_safetensors: '{}': the header is a JSON {}, expected an object",
                 path, type_of(header));
  return header;
}

}  // namespace

SafetensorsLayout safetensors_layout(const std::vector<SafetensorsEntry>& entries,
                                     const std::map<std::string, std::string>& metadata,
                                     std::string_view where) {
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  std::vector<std::uint64_t> data_offsets;
  std::uint64_t offset = 0;
  for (const SafetensorsEntry& entry : entries) {
    SHARDLAB_CHECK(entry.name != "__metadata__", "{}: the name '__metadata__' is reserved", where);
    SHARDLAB_CHECK(names.insert(entry.name).second, "{}: the name '{}' appears twice", where, entry.name);
    const auto bytes = static_cast<std::uint64_t>(shape_numel(entry.shape)) * dtype_size(entry.dtype);
    Json info = Json::object();
    info["dtype"] = std::string(format_name(entry.dtype));
    info["shape"] = entry.shape;
    info["data_offsets"] = Json::array({offset, offset + bytes});
    header[entry.name] = std::move(info);
    data_offsets.push_back(offset);
    offset += bytes;
  }
  std::string text = header.dump();
  // Spaces up to a multiple of 8, as the reference implementation pads, so the data is aligned.
  text.append((8 - text.size() % 8) % 8, ' ');

  SafetensorsLayout out;
  const auto length = static_cast<std::uint64_t>(text.size());
  out.header.assign(reinterpret_cast<const char*>(&length), sizeof length);
  out.header += text;
  for (const std::uint64_t data_offset : data_offsets) out.offsets.push_back(out.header.size() + data_offset);
  out.file_bytes = out.header.size() + offset;
  return out;
}

void save_safetensors(const std::string& path, const StateDict& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const std::string where = fmt::format("save_safetensors: '{}'", path);
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, tensor] : tensors) {
    SHARDLAB_CHECK(tensor.defined(), "{}: tensor '{}' is undefined", where, name);
    entries.push_back({.name = name, .dtype = tensor.dtype(), .shape = tensor.shape()});
  }
  const SafetensorsLayout layout = safetensors_layout(entries, metadata, where);
  std::vector<Tensor> host;  // contiguous CPU copies (or the tensors themselves when they already are)
  for (const auto& [name, tensor] : tensors) host.push_back(tensor.to(Device::cpu()).contiguous());

  // The layout lays the tensors end to end in order: written one after the other, each lands at its offset.
  PendingFile file(path, "save_safetensors");
  file.write(layout.header.data(), layout.header.size());
  for (const Tensor& tensor : host) {
    if (tensor.numel() > 0)
      file.write(tensor.raw_data(), static_cast<std::size_t>(tensor.numel()) * tensor.element_size());
  }
  file.commit();
}

namespace {

// An opened file's validated header: its metadata, and its tensors sorted by offset, laid end to end
// over exactly the data section (which starts at data_start).
struct ParsedFile {
  File file;
  std::map<std::string, std::string> metadata;
  std::vector<Entry> entries;
  std::uint64_t data_start = 0;
};

ParsedFile parse_file(const std::string& path) {
  errno = 0;
  ParsedFile out{File(std::fopen(path.c_str(), "rb")), {}, {}, 0};
  std::FILE* file = out.file.get();
  SHARDLAB_CHECK(file != nullptr, "load_safetensors: cannot open '{}': {}", path, std::strerror(errno));
  // The file's size bounds every offset, so it has to be a regular file, whose size is known.
  struct stat status {};
  SHARDLAB_CHECK(::fstat(::fileno(file), &status) == 0 && S_ISREG(status.st_mode),
                 "load_safetensors: '{}' is not a regular file", path);
  const auto file_size = static_cast<std::uint64_t>(status.st_size);

  SHARDLAB_CHECK(file_size >= 8,
                 "load_safetensors: '{}' is too short for the 8-byte header length: the file has {} bytes",
                 path, file_size);
  std::uint64_t header_size = 0;
  read_exact(file, &header_size, sizeof header_size, path, "the header length");
  SHARDLAB_CHECK(header_size <= kMaxHeaderBytes,
                 "load_safetensors: '{}': header length {} exceeds the limit of {} bytes", path, header_size,
                 kMaxHeaderBytes);
  SHARDLAB_CHECK(
      header_size <= file_size - 8,
      "load_safetensors: '{}': header length {} runs past the end of the file ({} bytes follow the length "
      "field)",
      path, header_size, file_size - 8);
  std::string text(header_size, '\0');
  read_exact(file, text.data(), text.size(), path, "the header");
  const Json header = parse_header(path, text);
  out.data_start = 8 + header_size;
  const std::uint64_t data_size = file_size - out.data_start;

  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      SHARDLAB_CHECK(info.is_object(),
                     "load_safetensors: '{}': __metadata__ is a JSON {}, expected an object of strings", path,
                     type_of(info));
      for (const auto& [key, value] : info.items()) {
        SHARDLAB_CHECK(value.is_string(),
                       "load_safetensors: '{}': __metadata__ entry '{}' is {}, expected a string", path, key,
                       value.dump());
        out.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    out.entries.push_back(parse_entry(path, name, info, data_size));
  }

  // The data section must be exactly the tensors laid end to end: empty tensors sit anywhere
  // their zero-length span fits, ties keep header order. A file cut short fails here.
  std::stable_sort(out.entries.begin(), out.entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry& entry : out.entries) {
    SHARDLAB_CHECK(
        entry.begin <= covered,
        "load_safetensors: '{}': bytes [{}, {}) of the data section belong to no tensor (a gap before "
        "tensor '{}')",
        path, covered, entry.begin, entry.name);
    SHARDLAB_CHECK(
        entry.begin == covered,
        "load_safetensors: '{}': tensor '{}' at data_offsets [{}, {}] overlaps tensor '{}' at [{}, {}]", path,
        entry.name, entry.begin, entry.end, previous->name, previous->begin, previous->end);
    covered = entry.end;
    previous = &entry;
  }
  SHARDLAB_CHECK(
      covered == data_size,
      "load_safetensors: '{}': {} bytes of the data section follow the last tensor (tensors end at byte {} "
      "of {})",
      path, data_size - covered, covered, data_size);
  return out;
}

}  // namespace

SafetensorsFile load_safetensors(const std::string& path) {
  ParsedFile parsed = parse_file(path);
  SafetensorsFile out{{}, std::move(parsed.metadata)};
  for (const Entry& entry : parsed.entries) {
    Tensor tensor = empty(entry.shape, dtype(entry.dtype));
    const std::uint64_t bytes = entry.end - entry.begin;
    if (bytes > 0)
      read_exact(parsed.file.get(), tensor.raw_data(), bytes, path, fmt::format("tensor '{}'", entry.name));
    if (entry.dtype == DType::boolean) {
      // Inspected as bytes before anything reads them as bool: other values are not valid bools.
      const auto* raw = static_cast<const unsigned char*>(tensor.raw_data());
      for (std::uint64_t i = 0; i < bytes; ++i) {
        SHARDLAB_CHECK(
            raw[i] <= 1,
            "load_safetensors: '{}': tensor '{}' (BOOL) holds byte 0x{:02X} at element {}, expected 0 or 1",
            path, entry.name, raw[i], i);
      }
    }
    out.tensors.emplace_back(entry.name, std::move(tensor));
  }
  return out;
}

std::vector<SafetensorsTensor> read_safetensors_header(const std::string& path) {
  const ParsedFile parsed = parse_file(path);
  std::vector<SafetensorsTensor> out;
  for (const Entry& entry : parsed.entries)
    out.push_back({entry.name, entry.dtype, entry.shape, parsed.data_start + entry.begin});
  return out;
}

void read_safetensors_elements(const std::string& path, const SafetensorsTensor& tensor, std::int64_t first,
                               const Tensor& out) {
  const std::int64_t count = out.numel(), total = shape_numel(tensor.shape);
  SHARDLAB_CHECK(
      first >= 0 && count <= total - first,
      "read_safetensors_elements: '{}': elements [{}, {}) of tensor '{}' {} are past its {} elements", path,
      first, first + count, tensor.name, shape_str(tensor.shape), total);
  if (count == 0) return;
  errno = 0;
  const File file(std::fopen(path.c_str(), "rb"));
  SHARDLAB_CHECK(file != nullptr, "read_safetensors_elements: cannot open '{}': {}", path,
                 std::strerror(errno));
  const Tensor raw = empty({count}, dtype(tensor.dtype));
  const std::uint64_t element = dtype_size(tensor.dtype);
  const auto at = static_cast<off_t>(tensor.offset + static_cast<std::uint64_t>(first) * element);
  const auto bytes = static_cast<std::size_t>(count) * element;
  auto* into = static_cast<char*>(raw.raw_data());
  for (std::size_t done = 0; done < bytes;) {
    const ssize_t got =
        ::pread(::fileno(file.get()), into + done, bytes - done, at + static_cast<off_t>(done));
    SHARDLAB_CHECK(got > 0, "read_safetensors_elements: '{}': reading tensor '{}' failed: {}", path,
                   tensor.name, got == 0 ? "unexpected end of file" : std::strerror(errno));
    done += static_cast<std::size_t>(got);
  }
  out.copy_(raw.view(out.shape()));  // converted to out's dtype and moved to its device
}

}  // namespace shardlab::nn
