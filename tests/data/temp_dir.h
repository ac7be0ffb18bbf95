// tests/data/temp_dir.h: a uniquely named scratch directory, removed with everything in it,
// and helpers that write files into it (plain bytes, or gzip through zlib).
#pragma once

#include <unistd.h>
#include <zlib.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace shardlab::test {

using Bytes = std::vector<std::uint8_t>;

class TempDir {
 public:
  TempDir() {
    static std::atomic<unsigned> counter{0};
    // pid + counter keeps test binaries running side by side apart; the random part keeps a
    // stale directory from an earlier crashed run with the same pid from being reused.
    const std::string name = "shardlab-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) +
                             "-" + std::to_string(std::random_device{}());
    path_ = std::filesystem::temp_directory_path() / name;
    std::filesystem::create_directories(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }

  std::string path() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline void write_file(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

inline void write_gzip(const std::string& path, const Bytes& bytes) {
  gzFile file = gzopen(path.c_str(), "wb");
  REQUIRE(file != nullptr);
  const int written = bytes.empty() ? 0 : gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size()));
  const int closed = gzclose(file);
  REQUIRE(written == static_cast<int>(bytes.size()));
  REQUIRE(closed == Z_OK);
}

inline Bytes read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace shardlab::test
