// tests/core/test_file_io.cpp: PendingFile (a file written under a temporary name and renamed into
// place) and Fd: what a reader sees before and after commit, what a failure leaves, and the parts
// several writers put into one pending file by name.
#include <fcntl.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/file_io.h"
#include "tests/check.h"
#include "tests/temp_dir.h"

using namespace shardlab;
using shardlab::test::TempDir;

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST_CASE("PendingFile shows nothing under its name until commit, then the whole file", "[file_io]") {
  TempDir dir;
  const std::string path = dir.file("out.txt");
  PendingFile file(path, "test");
  file.write("hello ", 6);
  // Before commit only the temporary file exists, named after the target.
  CHECK(!std::filesystem::exists(path));
  CHECK(std::filesystem::exists(file.temp()));
  CHECK(file.temp().starts_with(path + ".tmp-"));
  file.write("world", 5);
  file.commit();
  CHECK(read_text(path) == "hello world");
  CHECK(dir.entries() == std::vector<std::string>{"out.txt"});
}

TEST_CASE("PendingFile replaces an existing file whole", "[file_io]") {
  TempDir dir;
  const std::string path = dir.file("out.txt");
  test::write_file(path, {'o', 'l', 'd', ' ', 'c', 'o', 'n', 't', 'e', 'n', 't', 's'});
  PendingFile file(path, "test");
  file.write("new", 3);
  CHECK(read_text(path) == "old contents");  // a reader still sees the old file
  file.commit();
  CHECK(read_text(path) == "new");
}

TEST_CASE("PendingFile writes at offsets and sizes the file", "[file_io]") {
  TempDir dir;
  const std::string path = dir.file("out.bin");
  PendingFile file(path, "test");
  file.resize(8);
  file.write_at("cd", 2, 2);
  file.write_at("ab", 2, 0);
  file.write("ef", 2);  // appends after the furthest write so far: at 4
  file.commit();
  CHECK(read_text(path) == std::string("abcdef\0\0", 8));
}

TEST_CASE("an uncommitted PendingFile leaves nothing behind", "[file_io]") {
  TempDir dir;
  {
    PendingFile file(dir.file("out.txt"), "test");
    file.write("half", 4);
  }
  CHECK(dir.entries().empty());
  // Nor does one whose writer failed between the writes.
  CHECK_THROWS_ERROR(
      [&] {
        PendingFile file(dir.file("out.txt"), "test");
        file.write("half", 4);
        fail("the writer failed");
      }(),
      "the writer failed");
  CHECK(dir.entries().empty());
}

TEST_CASE("several writers fill one PendingFile by its agreed id", "[file_io]") {
  TempDir dir;
  const std::string path = dir.file("shared.bin");
  constexpr std::uint64_t kId = 0x1234;
  PendingFile owner(path, kId, "rank 0");
  CHECK(owner.temp() == PendingFile::temp_name(path, kId));
  owner.resize(6);
  for (int writer = 1; writer <= 2; ++writer) {
    Fd part(PendingFile::temp_name(path, kId), O_WRONLY, "rank");
    const std::string bytes(3, static_cast<char>('0' + writer));
    part.pwrite_all(bytes.data(), bytes.size(), static_cast<std::uint64_t>(3 * (writer - 1)), "rank");
    part.sync("rank");
    part.close("rank");
  }
  owner.commit();
  CHECK(read_text(path) == "111222");
}

TEST_CASE("PendingFile's errors name the caller, the call and the file, and lose nothing",
          "[file_io][errors]") {
  TempDir dir;
  // Into a directory that does not exist: the temporary file cannot be created.
  const std::string missing = dir.file("no-such-dir") + "/out.txt";
  CHECK_THROWS_WITH(PendingFile(missing, "save"),
                    Catch::Matchers::StartsWith("save: cannot open '" + missing + ".tmp-") &&
                        Catch::Matchers::EndsWith("': No such file or directory"));

  // A temporary name that is taken (another save with the same id) is refused, and left alone.
  const std::string path = dir.file("out.txt");
  const std::string taken = PendingFile::temp_name(path, 7);
  test::write_file(taken, {'x'});
  CHECK_THROWS_WITH(PendingFile(path, 7, "save"),
                    Catch::Matchers::StartsWith("save: cannot open '" + taken + "': File exists"));
  CHECK(read_text(taken) == "x");
  std::filesystem::remove(taken);

  // Onto a non-empty directory: the rename fails and the temporary file is removed.
  const std::string occupied = dir.file("occupied");
  std::filesystem::create_directories(occupied + "/inside");
  CHECK_THROWS_WITH(
      [&] {
        PendingFile file(occupied, "save");
        file.write("data", 4);
        file.commit();
      }(),
      Catch::Matchers::StartsWith("save: cannot rename '" + occupied + ".tmp-") &&
          Catch::Matchers::EndsWith("' to '" + occupied + "': Is a directory"));
  CHECK(dir.entries() == std::vector<std::string>{"occupied"});
}

TEST_CASE("Fd reads whole ranges and refuses a short file", "[file_io][errors]") {
  TempDir dir;
  const std::string path = dir.file("in.bin");
  test::write_file(path, {1, 2, 3, 4});
  const Fd in(path, O_RDONLY, "read");
  std::vector<std::uint8_t> bytes(2);
  in.pread_all(bytes.data(), 2, 2, "read");
  CHECK(bytes == std::vector<std::uint8_t>{3, 4});
  CHECK_THROWS_WITH(in.pread_all(bytes.data(), 2, 3, "read"),
                    "read: reading '" + path + "' failed: unexpected end of file");
  CHECK_THROWS_WITH(Fd(dir.file("none"), O_RDONLY, "read"),
                    "read: cannot open '" + dir.file("none") + "': No such file or directory");
}
