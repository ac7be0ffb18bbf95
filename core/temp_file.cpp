// core/temp_file.cpp: TempFile over POSIX open/write/fsync and rename.
#include "core/temp_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/error.h"

namespace shardlab {

TempFile::TempFile(const std::string& path, std::string what) : path_(path), what_(std::move(what)) {
  static std::atomic<unsigned> counter{0};
  temp_ = fmt::format("{}.tmp.{}.{}", path, ::getpid(), counter++);
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  SHARDLAB_CHECK(fd_ >= 0, "{}: cannot create '{}' (temporary file for '{}'): {}", what_, temp_, path_,
                 std::strerror(errno));
}

TempFile::~TempFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_.c_str());
}

void TempFile::write(const void* data, std::size_t size) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = ::write(fd_, bytes, size);
    if (written < 0 && errno == EINTR) continue;
    SHARDLAB_CHECK(written > 0, "{}: writing '{}' failed: {}", what_, temp_, std::strerror(errno));
    bytes += written;
    size -= static_cast<std::size_t>(written);
  }
}

void TempFile::commit() {
  SHARDLAB_CHECK(::fsync(fd_) == 0, "{}: flushing '{}' failed: {}", what_, temp_, std::strerror(errno));
  const int closed = ::close(fd_);
  fd_ = -1;
  SHARDLAB_CHECK(closed == 0, "{}: closing '{}' failed: {}", what_, temp_, std::strerror(errno));
  SHARDLAB_CHECK(std::rename(temp_.c_str(), path_.c_str()) == 0, "{}: cannot rename '{}' to '{}': {}", what_,
                 temp_, path_, std::strerror(errno));
  committed_ = true;
}

}  // namespace shardlab
