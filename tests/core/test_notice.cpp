// tests/core/test_notice.cpp: a notice is said once per key, kept in order, from any thread.
#include <string>
#include <thread>
#include <vector>

#include "core/notice.h"
#include "tests/check.h"

using namespace shardlab;

TEST_CASE("a notice is kept once per key, in the order given, from any thread", "[notice]") {
  const std::size_t before = notices().size();
  notice_once("test notice a", "conv2d in bf16 on cuda: first");
  notice_once("test notice a", "conv2d in bf16 on cuda: said again, not kept");
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back([] { notice_once("test notice b", "second"); });
  for (std::thread& thread : threads) thread.join();
  const std::vector<std::string> now = notices();
  REQUIRE(now.size() == before + 2);
  CHECK(now[before] == "conv2d in bf16 on cuda: first");
  CHECK(now[before + 1] == "second");
}
