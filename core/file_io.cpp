// core/file_io.cpp: Fd and PendingFile over POSIX open/pwrite/fsync and rename.
#include "core/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

#include "core/error.h"

namespace shardlab {

Fd::Fd(const std::string& path, int flags, std::string_view what) : path_(path) {
  fd_ = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
  SHARDLAB_CHECK(fd_ >= 0, "{}: cannot open '{}': {}", what, path, std::strerror(errno));
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

void Fd::pwrite_all(const void* data, std::size_t size, std::uint64_t offset, std::string_view what) const {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = ::pwrite(fd_, bytes, size, static_cast<off_t>(offset));
    if (written < 0 && errno == EINTR) continue;
    SHARDLAB_CHECK(written > 0, "{}: writing '{}' failed: {}", what, path_, std::strerror(errno));
    bytes += written;
    offset += static_cast<std::uint64_t>(written);
    size -= static_cast<std::size_t>(written);
  }
}

void Fd::pread_all(void* data, std::size_t size, std::uint64_t offset, std::string_view what) const {
  auto* bytes = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t got = ::pread(fd_, bytes, size, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    SHARDLAB_CHECK(got > 0, "{}: reading '{}' failed: {}", what, path_,
                   got == 0 ? "unexpected end of file" : std::strerror(errno));
    bytes += got;
    offset += static_cast<std::uint64_t>(got);
    size -= static_cast<std::size_t>(got);
  }
}

void Fd::truncate(std::uint64_t size, std::string_view what) const {
  SHARDLAB_CHECK(::ftruncate(fd_, static_cast<off_t>(size)) == 0, "{}: sizing '{}' to {} bytes failed: {}",
                 what, path_, size, std::strerror(errno));
}

void Fd::sync(std::string_view what) const {
  SHARDLAB_CHECK(::fsync(fd_) == 0, "{}: flushing '{}' failed: {}", what, path_, std::strerror(errno));
}

void Fd::close(std::string_view what) {
  const int closed = ::close(fd_);
  fd_ = -1;
  SHARDLAB_CHECK(closed == 0, "{}: closing '{}' failed: {}", what, path_, std::strerror(errno));
}

void sync_directory(const std::string& path, std::string_view what) {
  Fd directory(path, O_RDONLY | O_DIRECTORY, what);
  directory.sync(what);
}

std::string join_path(const std::string& dir, std::string_view name) {
  return (std::filesystem::path(dir) / name).string();
}

std::uint64_t random_id() {
  std::random_device random;
  return (static_cast<std::uint64_t>(random()) << 32) ^ random() ^ static_cast<std::uint64_t>(::getpid());
}

PendingFile::PendingFile(std::string path, std::string what)
    : PendingFile(std::move(path), random_id(), std::move(what)) {}

PendingFile::PendingFile(std::string path, std::uint64_t id, std::string what)
    : path_(std::move(path)),
      what_(std::move(what)),
      temp_(temp_name(path_, id)),
      file_(temp_, O_WRONLY | O_CREAT | O_EXCL, what_) {}

PendingFile::~PendingFile() {
  if (!committed_) ::unlink(temp_.c_str());
}

std::string PendingFile::temp_name(const std::string& path, std::uint64_t id) {
  return fmt::format("{}.tmp-{:016x}", path, id);
}

void PendingFile::write(const void* data, std::size_t size) { write_at(data, size, end_); }

void PendingFile::write_at(const void* data, std::size_t size, std::uint64_t offset) {
  file_.pwrite_all(data, size, offset, what_);
  end_ = std::max(end_, offset + size);
}

void PendingFile::resize(std::uint64_t bytes) { file_.truncate(bytes, what_); }

void PendingFile::commit() {
  file_.sync(what_);
  file_.close(what_);
  SHARDLAB_CHECK(std::rename(temp_.c_str(), path_.c_str()) == 0, "{}: cannot rename '{}' to '{}': {}", what_,
                 temp_, path_, std::strerror(errno));
  committed_ = true;
  sync_directory(std::filesystem::absolute(path_).parent_path().string(), what_);
}

}  // namespace shardlab
