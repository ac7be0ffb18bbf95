// tests/dist/shared_dir.h: a scratch directory that rank 0 makes and every rank of an mpirun test
// knows, removed once all ranks are done with it.
#pragma once

#include <mpi.h>

#include <filesystem>
#include <memory>
#include <string>

#include "tests/dist/world.h"
#include "tests/temp_dir.h"

namespace shardlab::test {

// A directory rank 0 makes and every rank knows; removed by rank 0 once all ranks are done.
class SharedDir {
 public:
  SharedDir() {
    std::string path;
    if (world().rank() == 0) {
      dir_ = std::make_unique<TempDir>();
      path = dir_->path();
    }
    int size = static_cast<int>(path.size());
    MPI_Bcast(&size, 1, MPI_INT, 0, MPI_COMM_WORLD);
    path.resize(static_cast<std::size_t>(size));
    MPI_Bcast(path.data(), size, MPI_CHAR, 0, MPI_COMM_WORLD);
    path_ = path;
  }
  ~SharedDir() { MPI_Barrier(MPI_COMM_WORLD); }  // then rank 0's TempDir goes
  std::string file(const std::string& name) const { return (std::filesystem::path(path_) / name).string(); }

 private:
  std::unique_ptr<TempDir> dir_;
  std::string path_;
};

}  // namespace shardlab::test
