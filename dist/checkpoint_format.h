// dist/checkpoint_format.h: internal to dist/: the sharded checkpoint's format, shared by its
// writer (save_checkpoint) and its readers (load_checkpoint, checkpoint_info, consolidation):
// names, sizes, and metadata.json and the rank files checked against each other.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "dist/checkpoint_reader.h"

namespace shardlab::dist::detail {

inline constexpr std::string_view kCheckpointFormat = "shardlab-sharded-checkpoint";
inline constexpr std::int64_t kCheckpointVersion = 1;
inline constexpr std::string_view kMetadata = "metadata.json";
inline constexpr std::string_view kOptimPrefix = "optim.";
inline constexpr std::int64_t kElementBytes = 4;  // f32

// `dir`/metadata.json, parsed and checked whole; errors begin with `where`.
CheckpointInfo read_metadata(const std::string& dir, std::string_view where);
// Every file the metadata lists present with its size (a stat each).
void check_files(const std::string& dir, const CheckpointInfo& info, std::string_view where);
// Reads `file` whole and compares its CRC32 with the metadata's.
void check_crc(const std::string& dir, const CheckpointFile& file, std::string_view where);

}  // namespace shardlab::dist::detail
