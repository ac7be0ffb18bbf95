// core/file_io.h: files on disk the way shardlab writes them: a descriptor that closes itself and
// reads or writes whole ranges at an offset, and a file written under a temporary name and renamed
// into place when complete, so that a reader never sees half a file.
//
//   PendingFile file("model.safetensors", "save_safetensors");  // errors start with "save_safetensors:"
//   file.write(bytes.data(), bytes.size());
//   file.commit();  // flush, rename, flush the directory; without it the destructor removes the file
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace shardlab {

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

// A file being written as "<path>.tmp-<id>" next to `path` (one file system, so the rename is
// atomic), created empty by the constructor and removed when this goes unless commit() renamed it
// into place. One process makes it; with an id agreed among several, the others open temp() by
// name and write their parts of it. `what` opens every error message.
class PendingFile {
 public:
  PendingFile(std::string path, std::string what);  // a random id: a file this process alone writes
  PendingFile(std::string path, std::uint64_t id, std::string what);
  PendingFile(const PendingFile&) = delete;
  PendingFile& operator=(const PendingFile&) = delete;
  ~PendingFile();

  static std::string temp_name(const std::string& path, std::uint64_t id);
  const std::string& temp() const { return temp_; }

  // Appends after what write() wrote before.
  void write(const void* data, std::size_t size);
  void write_at(const void* data, std::size_t size, std::uint64_t offset);
  void resize(std::uint64_t bytes);
  // Flushes the file (every process's writes), renames it into place and flushes the directory
  // that holds it, so that the new name survives a crash and never points at unwritten blocks.
  void commit();

 private:
  std::string path_, what_, temp_;
  Fd file_;
  std::uint64_t end_ = 0;
  bool committed_ = false;
};

}  // namespace shardlab
