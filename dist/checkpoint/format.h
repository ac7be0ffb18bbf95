// dist/checkpoint/format.h: internal to dist/: the sharded checkpoint's format, shared by its
// writer (save_checkpoint) and its readers (load_checkpoint, checkpoint_info, consolidation):
// names, sizes, CRC32, and metadata.json and the rank files checked against each other.
#pragma once

#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "dist/checkpoint/reader.h"

namespace shardlab::dist::detail {

inline constexpr std::string_view kCheckpointFormat = "shardlab-sharded-checkpoint";
// Version 2 adds chunks of several runs (the "runs" and "stride" fields); a checkpoint is written
// as version 1, which readers before it read, unless it holds such a chunk.
inline constexpr std::int64_t kCheckpointVersion = 2;
inline constexpr std::string_view kMetadata = "metadata.json";
inline constexpr std::string_view kOptimPrefix = "optim.";
inline constexpr std::int64_t kElementBytes = 4;  // f32

// The CRC32 each rank file's entry in metadata.json holds, continued over `size` more bytes.
inline std::uint32_t crc_update(std::uint32_t crc, const void* data, std::size_t size) {
  return static_cast<std::uint32_t>(crc32_z(crc, static_cast<const Bytef*>(data), size));
}

// `dir`/metadata.json, parsed and checked whole; errors begin with `where`.
CheckpointInfo read_metadata(const std::string& dir, std::string_view where);
// Every file the metadata lists present with its size (a stat each).
void check_files(const std::string& dir, const CheckpointInfo& info, std::string_view where);
// Reads `file` whole and compares its CRC32 with the metadata's.
void check_crc(const std::string& dir, const CheckpointFile& file, std::string_view where);

}  // namespace shardlab::dist::detail
