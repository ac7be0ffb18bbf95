// tests/core/test_host_wait.cpp: host waits are counted by reason and refused, naming the reason,
// inside a HostWaitsForbidden scope of the waiting thread, with their call stacks where asked; CPU
// work never waits.
#include <cstdlib>
#include <thread>

#include "core/host_wait.h"
#include "core/notice.h"
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

// Out of line and of external linkage, so that the call stack names it (test_core links with -rdynamic).
[[gnu::noinline]] void copy_for_the_stack_test();
void copy_for_the_stack_test() { host_wait("copy to host memory", "cuda:0"); }

TEST_CASE(
    "SHARDLAB_HOST_WAIT_STACKS=1: a refused wait's error ends with its call stack, a counted one is "
    "said once per call stack",
    "[host_wait]") {
  ::setenv("SHARDLAB_HOST_WAIT_STACKS", "1", 1);
  {
    const HostWaitsForbidden step("training step");
    try {
      copy_for_the_stack_test();
      FAIL("the wait was not refused");
    } catch (const Error& error) {
      const std::string message = error.what();
      CHECK_THAT(message, Catch::Matchers::Contains("keep the value on the device; called from:\n  #0 "));
      CHECK_THAT(message, Catch::Matchers::Contains("copy_for_the_stack_test"));
    }
  }
  const std::size_t before = notices().size();
  volatile int calls = 2;                                              // one call site, not unrolled into two
  for (int call = 0; call < calls; ++call) copy_for_the_stack_test();  // the same stack: said once
  ::unsetenv("SHARDLAB_HOST_WAIT_STACKS");
  copy_for_the_stack_test();  // not asked: not said
  const std::vector<std::string> said = notices();
  REQUIRE(said.size() == before + 1);
  CHECK_THAT(said.back(),
             Catch::Matchers::StartsWith("host wait: copy to host memory on cuda:0, called from:\n  #0 "));
  CHECK_THAT(said.back(), Catch::Matchers::Contains("copy_for_the_stack_test"));
}
