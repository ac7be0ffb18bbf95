// tests/fuzz/test_replay.cpp: every committed fuzz input (the seed corpus and the regressions, the
// inputs that once crashed a reader) replayed through its target, so builds without libFuzzer still
// check them.
#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tests/fuzz/targets.h"

namespace fs = std::filesystem;

namespace {

// The files of tests/fuzz/<kind>/<target>, sorted so that a failure names the same file each run.
std::vector<fs::path> inputs(const std::string& kind, std::string_view target) {
  const fs::path dir = fs::path(SHARDLAB_FUZZ_DIR) / kind / target;
  std::vector<fs::path> files;
  if (fs::is_directory(dir)) {
    for (const auto& entry : fs::directory_iterator(dir))
      if (entry.is_regular_file()) files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

void replay(const std::vector<fs::path>& files, void (*run)(const std::uint8_t*, std::size_t)) {
  for (const fs::path& file : files) {
    std::ifstream in(file, std::ios::binary);
    REQUIRE(in.good());
    const std::vector<std::uint8_t> bytes{std::istreambuf_iterator<char>(in),
                                          std::istreambuf_iterator<char>()};
    INFO(file.string());
    REQUIRE_NOTHROW(run(bytes.data(), bytes.size()));
  }
}

}  // namespace

TEST_CASE("every seed of the fuzz corpus is handled: read, or refused with an Error", "[fuzz]") {
  for (const auto& target : shardlab::fuzz::kTargets) {
    const std::vector<fs::path> files = inputs("corpus", target.name);
    INFO("tests/fuzz/corpus/" << target.name);
    CHECK(files.size() >= 3);
    replay(files, target.run);
  }
}

TEST_CASE("every input that once broke a reader is now read or refused with an Error", "[fuzz]") {
  for (const auto& target : shardlab::fuzz::kTargets) replay(inputs("regressions", target.name), target.run);
}
