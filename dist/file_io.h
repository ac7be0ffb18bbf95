// dist/file_io.h: internal to dist/: what its readers and writers of files share: a file
// descriptor that closes itself and reads or writes whole ranges at an offset, a file written
// under a temporary name and renamed into place, flushing a directory, and CRC32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace shardlab::dist::detail {

// An open file. Each failure is an Error "<what>: <the call> '<path>' failed: <errno text>".
class Fd {
 public:
  Fd(const std::string& path, int flags, std::string_view what);
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();

  void pwrite_all(const void* data, std::size_t size, std::uint64_t offset, std::string_view what) const;
  // Fails on a file shorter than offset + size.
  void pread_all(void* data, std::size_t size, std::uint64_t offset, std::string_view what) const;
  void truncate(std::uint64_t size, std::string_view what) const;
  void sync(std::string_view what) const;
  void close(std::string_view what);

 private:
  std::string path_;
  int fd_ = -1;
};

void sync_directory(const std::string& path, std::string_view what);

std::string join_path(const std::string& dir, std::string_view name);

// A random id for the temporary name of one save (so that two saves never share one).
std::uint64_t random_id();

// A file that is being written as "<path>.tmp-<id>", next to `path` (one file system, so the
// rename is atomic): removed when this goes unless commit() renamed it into place. The process
// that made it owns it; other processes write into temp() by name.
class PendingFile {
 public:
  PendingFile(std::string path, std::uint64_t id);
  PendingFile(const PendingFile&) = delete;
  PendingFile& operator=(const PendingFile&) = delete;
  ~PendingFile();

  static std::string temp_name(const std::string& path, std::uint64_t id);
  const std::string& temp() const { return temp_; }
  // Renames the (flushed) file into place and flushes the directory that holds it, so that the
  // new name survives a crash.
  void commit(std::string_view what);

 private:
  std::string path_, temp_;
  bool committed_ = false;
};

std::uint32_t crc_update(std::uint32_t crc, const void* data, std::size_t size);

}  // namespace shardlab::dist::detail
