// tests/dist/mpi_process.cpp: the TestProcess of the dist tests, which mpirun starts on every
// rank: it opens the dist session the tests use, and combines their outcomes so that rank 0
// prints one summary line for the whole run, a case failing on any rank counting as failed.
#include <mpi.h>

#include <stdexcept>

#include "dist/comm/init.h"
#include "tests/runner.h"

namespace shardlab::test {

namespace {

class MpiProcess final : public TestProcess {
 public:
  // Several ranks share one GPU where a machine has fewer (one GPU runs the [cuda] cases at 4 ranks).
  MpiProcess(int& argc, char**& argv) : session_(dist::init(argc, argv, {.share_gpu = true})) {}

  std::string summary_name(const std::string& binary) const override {
    return binary + "@np" + std::to_string(session_->world_size());
  }

  // Raw MPI rather than the Communicator under test, so a broken collective cannot hide failures.
  std::vector<char> combine(const std::vector<char>& failed) const override {
    int count = static_cast<int>(failed.size()), most = 0, least = 0;
    MPI_Allreduce(&count, &most, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(&count, &least, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (most != least) throw std::runtime_error("the ranks ran different numbers of test cases");
    std::vector<char> anywhere(failed.size());
    MPI_Allreduce(failed.data(), anywhere.data(), count, MPI_CHAR, MPI_MAX, MPI_COMM_WORLD);
    return anywhere;
  }

  bool prints_summary() const override { return session_->rank() == 0; }

 private:
  std::unique_ptr<dist::Session> session_;
};

}  // namespace

std::unique_ptr<TestProcess> start_test_process(int& argc, char**& argv) {
  return std::make_unique<MpiProcess>(argc, argv);
}

}  // namespace shardlab::test
