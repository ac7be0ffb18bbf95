// tests/core/test_host_wait.cpp: host waits are counted by reason and refused, naming the reason,
// inside a HostWaitsForbidden scope of the waiting thread; CPU work never waits.
#include <thread>

#include "core/host_wait.h"
#include "core/ops.h"
#include "tests/check.h"

using namespace shardlab;

TEST_CASE("host waits are counted per reason in order of first use", "[host_wait]") {
  reset_host_wait_counts();
  host_wait("copy to host memory", "cuda:0");
  host_wait("Stream::synchronize", "cuda:1");
  host_wait("copy to host memory", "cuda:0");
  const std::vector<HostWaitCount> counts = host_wait_counts();
  REQUIRE(counts.size() == 2);
  CHECK(counts[0].reason == "copy to host memory");
  CHECK(counts[0].count == 2);
  CHECK(counts[1].reason == "Stream::synchronize");
  CHECK(counts[1].count == 1);
  CHECK(host_wait_total() == 3);
  reset_host_wait_counts();
  CHECK(host_wait_counts().empty());
  CHECK(host_wait_total() == 0);
}

TEST_CASE("a host wait inside a forbidding scope throws naming scope, reason and device", "[host_wait]") {
  reset_host_wait_counts();
  CHECK_FALSE(host_waits_forbidden());
  {
    HostWaitsForbidden step("training step");
    CHECK(host_waits_forbidden());
    CHECK_THROWS_ERROR(
        host_wait("copy to host memory", "cuda:0"),
        "host wait inside 'training step': copy to host memory on cuda:0 would block the host");
    {
      HostWaitsForbidden inner("optimizer step");
      CHECK_THROWS_ERROR(host_wait("Event::synchronize", "cuda:0"), "host wait inside 'optimizer step'");
    }
    CHECK_THROWS_ERROR(host_wait("Event::synchronize", "cuda:0"), "host wait inside 'training step'");
  }
  CHECK_FALSE(host_waits_forbidden());
  CHECK(host_wait_total() == 0);  // refused waits are not counted
  host_wait("copy to host memory", "cuda:0");
  CHECK(host_wait_total() == 1);
  reset_host_wait_counts();
}

TEST_CASE("a forbidding scope holds for its own thread only", "[host_wait]") {
  reset_host_wait_counts();
  HostWaitsForbidden step("training step");
  bool other_forbidden = true;
  std::thread other([&] {
    other_forbidden = host_waits_forbidden();
    host_wait("Stream::synchronize", "cuda:0");
  });
  other.join();
  CHECK_FALSE(other_forbidden);
  CHECK(host_wait_total() == 1);
  reset_host_wait_counts();
}

TEST_CASE("CPU ops, reading values included, are no host waits", "[host_wait]") {
  reset_host_wait_counts();
  HostWaitsForbidden step("training step");
  const Tensor x = full({3}, 2.0f);
  CHECK(sum(x * x).item<float>() == 12.0f);
  CHECK(index_select(x, 0, from_vector(std::vector<std::int64_t>{2, 0}, {2})).numel() == 2);
  CHECK_THROWS_ERROR(index_select(x, 0, from_vector(std::vector<std::int64_t>{3}, {1})),
                     "index_select: index 3 is out of range for the dimension of size 3");
  CHECK(host_wait_total() == 0);
}

TEST_CASE("an unavoidable wait is counted under its scope's reason, inside a forbidding scope too",
          "[host_wait]") {
  reset_host_wait_counts();
  {
    HostWaitsForbidden step("training step");
    {
      HostWaitsUnavoidable retry("out of memory: cached blocks returned to the device");
      host_wait("return cached blocks to the device", "cuda:0");
      {
        HostWaitsUnavoidable inner("gradient flags");
        host_wait("copy to host memory", "cuda:0");
      }
      host_wait("copy to host memory", "cuda:0");  // the outer reason again
    }
    // Its end restores the refusal.
    CHECK_THROWS_ERROR(host_wait("copy to host memory", "cuda:0"), "host wait inside 'training step'");
  }
  const std::vector<HostWaitCount> counts = host_wait_counts();
  REQUIRE(counts.size() == 2);
  CHECK(counts[0].reason == "out of memory: cached blocks returned to the device");
  CHECK(counts[0].count == 2);
  CHECK(counts[1].reason == "gradient flags");
  CHECK(counts[1].count == 1);
  reset_host_wait_counts();
}
