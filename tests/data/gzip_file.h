// tests/data/gzip_file.h: writes test files through zlib's gzip, for the IDX reader's tests.
#pragma once

#include <zlib.h>

#include "tests/temp_dir.h"

namespace shardlab::test {

inline void write_gzip(const std::string& path, const Bytes& bytes) {
  gzFile file = gzopen(path.c_str(), "wb");
  REQUIRE(file != nullptr);
  const int written = bytes.empty() ? 0 : gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size()));
  const int closed = gzclose(file);
  REQUIRE(written == static_cast<int>(bytes.size()));
  REQUIRE(closed == Z_OK);
}

}  // namespace shardlab::test
