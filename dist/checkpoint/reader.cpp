// dist/checkpoint/reader.cpp: reading a sharded checkpoint without its model: metadata.json parsed
// and checked whole (in the order it was written, which is the model's), the files checked
// against it, then the consolidation that copies chunks into one safetensors file.
#include "dist/checkpoint/reader.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <memory>

#include "core/error.h"
#include "core/file_io.h"
#include "dist/checkpoint/format.h"
#include "nn/safetensors.h"

namespace shardlab::dist {

static_assert(std::endian::native == std::endian::little, "checkpoint files hold little-endian f32");

bool CheckpointTensor::optimizer_slot() const { return name.starts_with(detail::kOptimPrefix); }

std::vector<CheckpointRun> CheckpointTensor::runs() const {
  std::vector<CheckpointRun> out;
  for (const CheckpointChunk& chunk : chunks) {
    for (std::int64_t k = 0; k < chunk.runs; ++k) {
      out.push_back({.chunk = &chunk,
                     .first = chunk.first + k * chunk.stride,
                     .count = chunk.count,
                     .offset = chunk.offset + k * chunk.count * detail::kElementBytes});
    }
  }
  std::sort(out.begin(), out.end(),
            [](const CheckpointRun& a, const CheckpointRun& b) { return a.first < b.first; });
  return out;
}

const CheckpointTensor* CheckpointInfo::tensor(const std::string& name) const {
  const auto it = std::find_if(tensors.begin(), tensors.end(), [&](const auto& t) { return t.name == name; });
  return it == tensors.end() ? nullptr : &*it;
}

const CheckpointFile* CheckpointInfo::file(const std::string& name) const {
  const auto it = std::find_if(files.begin(), files.end(), [&](const auto& f) { return f.name == name; });
  return it == files.end() ? nullptr : &*it;
}

std::int64_t CheckpointInfo::total_bytes() const {
  std::int64_t total = 0;
  for (const CheckpointFile& file : files) total += file.bytes;
  return total;
}

namespace detail {

namespace {

// Ordered: the tensors come out in the order save_checkpoint wrote them, the model's.
using Json = nlohmann::ordered_json;

constexpr std::uint64_t kMaxMetadataBytes = 1ull << 30;

// Field access that names what is wrong: "metadata.json: tensor 'x' chunk 2 has no 'offset'".
class Reader {
 public:
  explicit Reader(std::string where) : where_(std::move(where)) {}

  const Json& field(const Json& object, const char* key, const std::string& context) const {
    SHARDLAB_CHECK(object.is_object(), "{}: {}: {} is a JSON {}, expected an object", where_, kMetadata,
                   context, object.type_name());
    SHARDLAB_CHECK(object.contains(key), "{}: {}: {} has no '{}'", where_, kMetadata, context, key);
    return object[key];
  }
  std::int64_t size(const Json& object, const char* key, const std::string& context) const {
    const Json& value = field(object, key, context);
    SHARDLAB_CHECK(value.is_number_unsigned() &&
                       value.get<std::uint64_t>() <=
                           static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max() / 8),
                   "{}: {}: {} has '{}' = {}, expected a non-negative integer", where_, kMetadata, context,
                   key, value.dump());
    return static_cast<std::int64_t>(value.get<std::uint64_t>());
  }
  std::string string(const Json& object, const char* key, const std::string& context) const {
    const Json& value = field(object, key, context);
    SHARDLAB_CHECK(value.is_string(), "{}: {}: {} has '{}' = {}, expected a string", where_, kMetadata,
                   context, key, value.dump());
    return value.get<std::string>();
  }
  const Json& object(const Json& parent, const char* key, const std::string& context) const {
    const Json& value = field(parent, key, context);
    SHARDLAB_CHECK(value.is_object(), "{}: {}: {} has '{}' = a JSON {}, expected an object", where_,
                   kMetadata, context, key, value.type_name());
    return value;
  }
  const Json& array(const Json& parent, const char* key, const std::string& context) const {
    const Json& value = field(parent, key, context);
    SHARDLAB_CHECK(value.is_array(), "{}: {}: {} has '{}' = a JSON {}, expected an array", where_, kMetadata,
                   context, key, value.type_name());
    return value;
  }
  template <typename... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) const {
    throw Error(
        fmt::format("{}: {}: {}", where_, kMetadata, fmt::format(format, std::forward<Args>(args)...)));
  }

 private:
  std::string where_;
};

std::string read_text(const std::string& path, std::string_view where) {
  struct stat info {};
  SHARDLAB_CHECK(::stat(path.c_str(), &info) == 0, "{}: {} is missing ({}): not a complete checkpoint", where,
                 kMetadata, std::strerror(errno));
  SHARDLAB_CHECK(static_cast<std::uint64_t>(info.st_size) <= kMaxMetadataBytes,
                 "{}: {} has {} bytes, more than the {} a checkpoint's metadata may have", where, kMetadata,
                 info.st_size, kMaxMetadataBytes);
  std::string text(static_cast<std::size_t>(info.st_size), '\0');
  Fd in(path, O_RDONLY, where);
  in.pread_all(text.data(), text.size(), 0, where);
  return text;
}

// A chunk's runs and stride: absent for one run (and in version 1, which has no other); several
// runs must not overlap (stride at least count).
void read_runs(const Reader& read, std::int64_t version, const Json& chunk, const std::string& at,
               CheckpointChunk& out) {
  if (!chunk.is_object() || !chunk.contains("runs")) return;
  if (version < 2) read.fail("{} has 'runs', which format version {} does not have", at, version);
  out.runs = read.size(chunk, "runs", at);
  out.stride = read.size(chunk, "stride", at);
  if (out.runs < 1) read.fail("{} has 'runs' = 0, expected at least 1", at);
  if (out.runs > 1 && out.stride < out.count)
    read.fail("{} has runs of {} elements {} apart: they overlap", at, out.count, out.stride);
}

// A tensor's entry: its shape (F32) and chunks, each inside its file and the tensor, sorted by
// element and covering the tensor exactly once. Notes the tensor each file holds first.
CheckpointTensor read_tensor(const Reader& read, std::int64_t version, const std::string& name,
                             const Json& info, std::vector<CheckpointFile>& files,
                             std::vector<std::int64_t>& first_offsets) {
  const std::string context = fmt::format("tensor '{}'", name);
  CheckpointTensor entry{.name = name};
  std::int64_t numel = 1;
  for (const Json& size : read.array(info, "shape", context)) {
    if (!size.is_number_unsigned() || size.get<std::uint64_t>() > (1ull << 48))
      read.fail("{} has shape {}: {} is not a size", context, info["shape"].dump(), size.dump());
    entry.shape.push_back(size.get<std::int64_t>());
    if (__builtin_mul_overflow(numel, entry.shape.back(), &numel) || numel > (1ll << 48))
      read.fail("{} has shape {} with too many elements", context, info["shape"].dump());
  }
  // Consolidation writes the shape into a safetensors header, whose reader refuses it otherwise.
  if (!shape_addressable(entry.shape))
    read.fail("{} has shape {}: its sizes, zeros counted as ones, multiply past int64", context,
              info["shape"].dump());
  const std::string dtype = read.string(info, "dtype", context);
  if (dtype != "F32") read.fail("{} has dtype '{}', expected 'F32'", context, dtype);
  const Json& chunks = read.array(info, "chunks", context);
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const std::string at = fmt::format("{} chunk {}", context, i);
    CheckpointChunk chunk{.file = read.string(chunks[i], "file", at),
                          .offset = read.size(chunks[i], "offset", at),
                          .bytes = read.size(chunks[i], "bytes", at),
                          .first = read.size(chunks[i], "first", at),
                          .count = read.size(chunks[i], "count", at)};
    read_runs(read, version, chunks[i], at, chunk);
    const auto file =
        std::find_if(files.begin(), files.end(), [&](const auto& f) { return f.name == chunk.file; });
    if (file == files.end()) read.fail("{} names file '{}', which 'files' does not list", at, chunk.file);
    std::int64_t elements = 0, last = 0;  // all its runs' elements; one past its last run's last element
    if (__builtin_mul_overflow(chunk.runs, chunk.count, &elements) ||
        __builtin_mul_overflow(chunk.runs - 1, chunk.stride, &last) || (last += chunk.count) > numel ||
        chunk.first + last > numel)
      read.fail("{} holds elements beyond the tensor's {}: {} runs of {} from {}, {} apart", at, numel,
                chunk.runs, chunk.count, chunk.first, chunk.stride);
    if (chunk.bytes != elements * kElementBytes)
      read.fail("{} has {} bytes for {} F32 elements, expected {}", at, chunk.bytes, elements,
                elements * kElementBytes);
    if (chunk.offset + chunk.bytes > file->bytes)
      read.fail("{} holds bytes [{}, {}) of file '{}', beyond its {} bytes", at, chunk.offset,
                chunk.offset + chunk.bytes, chunk.file, file->bytes);
    std::int64_t& first_offset = first_offsets[static_cast<std::size_t>(file - files.begin())];
    if (chunk.offset < first_offset) {
      first_offset = chunk.offset;
      file->first_tensor = name;
    }
    entry.chunks.push_back(std::move(chunk));
  }
  std::sort(entry.chunks.begin(), entry.chunks.end(),
            [](const CheckpointChunk& a, const CheckpointChunk& b) { return a.first < b.first; });
  std::int64_t covered = 0;
  for (const CheckpointRun& run : entry.runs()) {
    if (run.first < covered)
      read.fail("{} has chunks overlapping at element {} (in file '{}')", context, run.first,
                run.chunk->file);
    if (run.first > covered) read.fail("{} has elements [{}, {}) in no chunk", context, covered, run.first);
    covered = run.first + run.count;
  }
  if (covered != numel) read.fail("{} has elements [{}, {}) in no chunk", context, covered, numel);
  return entry;
}

// What errors about a file say it holds.
std::string holds(const CheckpointFile& file) {
  return file.first_tensor.empty() ? "no tensor" : fmt::format("tensor '{}'", file.first_tensor);
}

}  // namespace

CheckpointInfo read_metadata(const std::string& dir, std::string_view where) {
  const std::string text = read_text(join_path(dir, kMetadata), where);
  const Reader read{std::string(where)};
  Json root;
  try {
    root = Json::parse(text);
  } catch (const Json::exception& error) {
    read.fail("not valid JSON: {}", error.what());
  }
  const std::string top = "the top level";
  CheckpointInfo out;
  out.format = read.string(root, "format", top);
  if (out.format != kCheckpointFormat)
    read.fail("format is '{}', expected '{}'", out.format, kCheckpointFormat);
  out.version = read.size(root, "version", top);
  if (out.version < 1 || out.version > kCheckpointVersion)
    read.fail("format version {}, this shardlab reads versions 1 to {}", out.version, kCheckpointVersion);
  out.world_size = read.size(root, "world_size", top);
  out.sharding = read.string(root, "sharding", top);

  for (const auto& [name, info] : read.object(root, "files", top).items()) {
    const std::string context = fmt::format("file '{}'", name);
    if (name.empty() || name.find('/') != std::string::npos || name == kMetadata || name == "." ||
        name == "..")
      read.fail("file name '{}' is not a plain file name in the checkpoint directory", name);
    const std::int64_t crc = read.size(info, "crc32", context);
    if (crc > 0xffffffff) read.fail("{} has 'crc32' = {}, more than 32 bits", context, crc);
    out.files.push_back(
        {.name = name, .bytes = read.size(info, "bytes", context), .crc32 = static_cast<std::uint32_t>(crc)});
  }

  std::vector<std::int64_t> first_offsets(out.files.size(), std::numeric_limits<std::int64_t>::max());
  for (const auto& [name, info] : read.object(root, "tensors", top).items())
    out.tensors.push_back(read_tensor(read, out.version, name, info, out.files, first_offsets));

  const std::string optim_context = "'optimizer'";
  const Json& optimizer = read.object(root, "optimizer", top);
  out.step = read.size(optimizer, "step", optim_context);
  for (const auto& [key, value] : read.object(optimizer, "hyper_parameters", optim_context).items()) {
    if (!value.is_number())
      read.fail("optimizer hyper-parameter '{}' is {}, expected a number", key, value.dump());
    out.hyper_parameters.emplace_back(key, value.get<double>());
  }
  const Json& steps = read.object(optimizer, "parameter_steps", optim_context);
  for (const auto& [key, value] : steps.items())
    out.parameter_steps[key] = read.size(steps, key.c_str(), "'parameter_steps'");
  out.extra = nlohmann::json(read.field(root, "extra", top));
  return out;
}

void check_files(const std::string& dir, const CheckpointInfo& info, std::string_view where) {
  for (const CheckpointFile& file : info.files) {
    struct stat status {};
    SHARDLAB_CHECK(::stat(join_path(dir, file.name).c_str(), &status) == 0,
                   "{}: file '{}' ({}) is missing: {}", where, file.name, holds(file), std::strerror(errno));
    SHARDLAB_CHECK(status.st_size == file.bytes,
                   "{}: file '{}' ({}) has {} bytes but {} says {}: truncated or overwritten", where,
                   file.name, holds(file), status.st_size, kMetadata, file.bytes);
  }
}

void check_crc(const std::string& dir, const CheckpointFile& file, std::string_view where) {
  Fd in(join_path(dir, file.name), O_RDONLY, where);
  constexpr std::int64_t kBlock = 4 << 20;
  std::vector<char> block(static_cast<std::size_t>(std::min(kBlock, std::max<std::int64_t>(file.bytes, 1))));
  std::uint32_t crc = crc_update(0, nullptr, 0);
  for (std::int64_t at = 0; at < file.bytes; at += kBlock) {
    const auto size = static_cast<std::size_t>(std::min(kBlock, file.bytes - at));
    in.pread_all(block.data(), size, static_cast<std::uint64_t>(at), where);
    crc = crc_update(crc, block.data(), size);
  }
  SHARDLAB_CHECK(crc == file.crc32,
                 "{}: file '{}' ({}) fails its CRC32 check: {:#010x} computed, {:#010x} in {}: corrupt",
                 where, file.name, holds(file), crc, file.crc32, kMetadata);
}

}  // namespace detail

CheckpointInfo checkpoint_info(const std::string& dir) {
  const std::string where = fmt::format("checkpoint_info: '{}'", dir);
  CheckpointInfo info = detail::read_metadata(dir, where);
  detail::check_files(dir, info, where);
  return info;
}

void consolidate_checkpoint(const std::string& dir, const std::string& out_path,
                            const ConsolidateOptions& options) {
  const std::string where = fmt::format("consolidate_checkpoint: '{}'", dir);
  const CheckpointInfo info = detail::read_metadata(dir, where);
  detail::check_files(dir, info, where);
  for (const CheckpointFile& file : info.files) detail::check_crc(dir, file, where);

  std::vector<const CheckpointTensor*> tensors;
  std::vector<nn::SafetensorsEntry> entries;
  for (const CheckpointTensor& tensor : info.tensors) {
    if (tensor.optimizer_slot() && !options.optimizer) continue;
    tensors.push_back(&tensor);
    entries.push_back({.name = tensor.name, .dtype = DType::f32, .shape = tensor.shape});
  }
  const nn::SafetensorsLayout layout =
      nn::safetensors_layout(entries, options.metadata, fmt::format("{}: '{}'", where, out_path));

  // The runs of each tensor cover it once, in order: every byte of the data is written once,
  // front to back, through one buffer of at most kBlock bytes.
  constexpr std::int64_t kBlock = 4 << 20;
  std::vector<char> buffer(static_cast<std::size_t>(kBlock));
  std::map<std::string, std::unique_ptr<Fd>> inputs;
  PendingFile out(out_path, where);  // removed unless renamed into place
  out.write(layout.header.data(), layout.header.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    for (const CheckpointRun& run : tensors[i]->runs()) {
      auto& input = inputs[run.chunk->file];
      if (!input) input = std::make_unique<Fd>(join_path(dir, run.chunk->file), O_RDONLY, where);
      const std::uint64_t target =
          layout.offsets[i] + static_cast<std::uint64_t>(run.first * detail::kElementBytes);
      const std::int64_t bytes = run.count * detail::kElementBytes;
      for (std::int64_t done = 0; done < bytes; done += kBlock) {
        const auto size = static_cast<std::size_t>(std::min(kBlock, bytes - done));
        input->pread_all(buffer.data(), size, static_cast<std::uint64_t>(run.offset + done), where);
        out.write_at(buffer.data(), size, target + static_cast<std::uint64_t>(done));
      }
    }
  }
  out.commit();
}

}  // namespace shardlab::dist
