// core/temp_file.h: TempFile, a file written under a temporary name and renamed into place when
// complete, so a reader never sees half a file.
//
//   TempFile file("model.safetensors", "save_safetensors");  // errors start with "save_safetensors:"
//   file.write(bytes.data(), bytes.size());
//   file.commit();  // flush, then rename; without it the destructor removes the temporary file
#pragma once

#include <cstddef>
#include <string>

namespace shardlab {

class TempFile {
 public:
  // Opens "PATH.tmp.PID.N" next to `path`; `what` (the caller's name) opens every error message.
  TempFile(const std::string& path, std::string what);
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile();

  void write(const void* data, std::size_t size);
  // Flushes to disk before the rename, so the final name never points at unwritten blocks.
  void commit();

 private:
  std::string path_, what_, temp_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace shardlab
