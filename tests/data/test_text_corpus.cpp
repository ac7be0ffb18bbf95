// tests/data/test_text_corpus.cpp: read_documents on hand-made corpora (separators, blank
// documents, skipped .dat files, symlinks and subdirectories, every error) and on Debian's fortunes
// against strfile's own counts; PretrainingDataset's samples against hand-written ids.
#include <sys/stat.h>

#include <filesystem>
#include <sstream>

#include "data/text_corpus.h"
#include "tests/check.h"
#include "tests/temp_dir.h"

using namespace shardlab;
using data::ByteTokenizer;
using data::PretrainingDataset;
using data::read_documents;
using test::TempDir;
using Documents = std::vector<std::string>;
using namespace std::string_literals;

#define CHECK_THROWS_EXACT(expr, message) CHECK_THROWS_WITH((expr), Catch::Matchers::Equals(message))

namespace {

void write_text(const std::string& path, const std::string& text) {
  test::write_file(path, test::Bytes(text.begin(), text.end()));
}

// Documents of a.txt: lines that merely contain '%' are text; an empty and a whitespace-only
// document are dropped; a blank line inside a document stays.
const std::string kFileA =
    "first line\nsecond line\n%\n%\n  \n \t\n%\nthird\n\ninner blank\n%\n100%\n%%\n %\n% \n%\n";
const Documents kDocumentsA = {"first line\nsecond line", "third\n\ninner blank", "100%\n%%\n %\n% "};
// b.txt: a NUL byte, a '\r' that makes "%\r" text, and a last document with no final newline.
const std::string kFileB = "x\0y\n%\ncarriage\r\n%\r\nlast line"s;
const Documents kDocumentsB = {"x\0y"s, "carriage\r\n%\r\nlast line"};

Documents concat(Documents a, const Documents& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The number of strings strfile counted in `dat` (big-endian u32 after the version).
std::uint32_t strfile_count(const std::string& dat) {
  const test::Bytes header = test::read_file(dat);
  REQUIRE(header.size() >= 8);
  return (std::uint32_t{header[4]} << 24) | (std::uint32_t{header[5]} << 16) |
         (std::uint32_t{header[6]} << 8) | std::uint32_t{header[7]};
}

}  // namespace

TEST_CASE("read_documents splits files at separator lines and reads directories in name order",
          "[data][corpus]") {
  TempDir dir;
  write_text(dir.file("b.txt"), kFileB);
  write_text(dir.file("a.txt"), kFileA);
  write_text(dir.file("a.txt.dat"), "strfile index\n%\nnot a document\n");
  std::filesystem::create_symlink(dir.file("a.txt"), dir.file("a.txt.u8"));
  std::filesystem::create_directory(dir.file("sub"));
  write_text(dir.file("sub/c.txt"), "nested, not read\n");

  CHECK(read_documents({dir.file("a.txt")}) == kDocumentsA);
  CHECK(read_documents({dir.file("b.txt")}) == kDocumentsB);
  // The .dat index, the symlink and the subdirectory add nothing.
  CHECK(read_documents({dir.path()}) == concat(kDocumentsA, kDocumentsB));
  // Paths are read in the order given, and a symlink named directly is followed.
  CHECK(read_documents({dir.file("b.txt"), dir.file("a.txt.u8")}) == concat(kDocumentsB, kDocumentsA));
  // A file without separators is one document.
  CHECK(read_documents({dir.file("sub/c.txt")}) == Documents{"nested, not read"});
}

TEST_CASE("read_documents takes another separator line", "[data][corpus]") {
  TempDir dir;
  write_text(dir.file("chat.txt"), "hello\n%\nworld\n<|end|>\nsecond\n<|end|>\n");
  CHECK(read_documents({dir.file("chat.txt")}, "<|end|>") == Documents{"hello\n%\nworld", "second"});
  CHECK_THROWS_EXACT(read_documents({dir.file("chat.txt")}, "a\nb"),
                     "read_documents: the separator must be a single line, got 'a\nb'");
}

TEST_CASE("read_documents names the path it cannot use", "[data][corpus]") {
  TempDir dir;
  const std::string missing = dir.file("missing");
  CHECK_THROWS_EXACT(read_documents({missing}), "read_documents: '" + missing + "' does not exist");

  // Only things a directory read skips: an index, a symlink, a subdirectory.
  const std::string unusable = dir.file("unusable");
  std::filesystem::create_directory(unusable);
  write_text(dir.file("unusable/x.dat"), "index");
  write_text(dir.file("x"), "outside\n");
  std::filesystem::create_symlink(dir.file("x"), dir.file("unusable/x"));
  std::filesystem::create_directory(dir.file("unusable/sub"));
  CHECK_THROWS_EXACT(read_documents({unusable}),
                     "read_documents: directory '" + unusable +
                         "' has no file to read (subdirectories, symlinks and .dat files are skipped)");

  const std::string blank = dir.file("blank");
  write_text(blank, "%\n \n\t\n%\n%\n");
  write_text(dir.file("empty"), "");
  CHECK_THROWS_EXACT(
      read_documents({blank, dir.file("empty")}),
      "read_documents: empty corpus: no non-blank document in '" + blank + "', '" + dir.file("empty") + "'");

  const std::string fifo = dir.file("fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_EXACT(read_documents({fifo}),
                     "read_documents: '" + fifo + "' is neither a file nor a directory");

  // A regular file whose read fails even for root: this process's memory at address 0.
  if (std::filesystem::exists("/proc/self/mem")) {
    CHECK_THROWS_ERROR(read_documents({"/proc/self/mem"}), "read_documents: cannot read '/proc/self/mem': ");
  }
}

TEST_CASE("read_documents reads Debian's fortunes as strfile counted them", "[data][corpus][fortunes]") {
  const std::string dir = "/usr/share/games/fortunes";
  if (!std::filesystem::exists(dir)) {
    // Without the package the same call must say what it looked for.
    CHECK_THROWS_EXACT(read_documents({dir}), "read_documents: '" + dir + "' does not exist");
    return;
  }
  const Documents documents = read_documents({dir});
  CHECK(documents.size() > 1000);
  std::size_t lines_of_percent = 0, blank = 0;
  for (const std::string& document : documents) {
    std::istringstream lines(document);
    for (std::string line; std::getline(lines, line);) lines_of_percent += line == "%";
    blank += document.find_first_not_of(" \t\n\r\f\v") == std::string::npos;
  }
  CHECK(lines_of_percent == 0);
  CHECK(blank == 0);

  // Each file's count equals the one strfile wrote into its .dat index, and the directory is
  // the sum of its files (the "x.u8" symlinks are not read again).
  std::size_t total = 0, compared = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.is_symlink() || !entry.is_regular_file() || entry.path().extension() == ".dat") continue;
    const std::size_t count = read_documents({entry.path().string()}).size();
    total += count;
    const std::string dat = entry.path().string() + ".dat";
    if (!std::filesystem::exists(dat)) continue;
    INFO(entry.path().string());
    CHECK(count == strfile_count(dat));
    ++compared;
  }
  CHECK(compared > 0);
  CHECK(documents.size() == total);
}

TEST_CASE("PretrainingDataset frames, clips, pads and shifts each document", "[data][corpus]") {
  const ByteTokenizer tokenizer;
  // a = 97: BOT 256, EOT 257, PAD 258.
  const PretrainingDataset corpus({"ab", "abc", "abcd", "abcdef", ""}, tokenizer, 4);
  CHECK(corpus.size() == 5);
  CHECK(corpus.seq_len() == 4);
  const data::Batch all = corpus.dataset().gather({0, 1, 2, 3, 4});
  CHECK(all.inputs.dtype() == DType::i64);
  CHECK(all.targets.dtype() == DType::i64);
  REQUIRE(all.inputs.shape() == Shape{5, 4});
  REQUIRE(all.targets.shape() == Shape{5, 4});
  test::check_equal(all.inputs, {
                                    256, 97,  98,  257,  // ab: BOT a b EOT | PAD
                                    256, 97,  98,  99,   // abc: exactly seq + 1 with its EOT
                                    256, 97,  98,  99,   // abcd: clipped, the EOT falls off
                                    256, 97,  98,  99,   // abcdef: clipped
                                    256, 257, 258, 258,  // empty: BOT EOT and padding
                                });
  test::check_equal(all.targets, {
                                     97,  98,  257, 258,  //
                                     97,  98,  99,  257,  //
                                     97,  98,  99,  100,  //
                                     97,  98,  99,  100,  //
                                     257, 258, 258, 258,  //
                                 });
  CHECK(corpus.target_tokens() == 3 + 4 + 4 + 4 + 1);

  const PretrainingDataset one({"xy", ""}, tokenizer, 1);
  const data::Batch pair = one.dataset().gather({0, 1});
  test::check_equal(pair.inputs, {256, 256});
  test::check_equal(pair.targets, {120, 257});
  CHECK(one.target_tokens() == 2);
}

TEST_CASE("PretrainingDataset packed: the documents in one stream, cut every seq ids, no padding",
          "[data][corpus]") {
  const ByteTokenizer tokenizer;
  // The stream: BOT a b EOT BOT c EOT BOT EOT (9 ids; the empty document keeps its BOT and EOT).
  const PretrainingDataset corpus({"ab", "c", ""}, tokenizer, 3, data::Packing::packed);
  REQUIRE(corpus.size() == 2);  // windows at 0 and 3 of 4 ids; the one at 6 would run past the stream
  const data::Batch all = corpus.dataset().gather({0, 1});
  test::check_equal(all.inputs, {
                                    256, 97, 98,   // BOT a b
                                    257, 256, 99,  // EOT BOT c
                                });
  test::check_equal(all.targets, {
                                     97, 98, 257,   // a b EOT
                                     256, 99, 257,  // BOT c EOT: each id but the first a target once
                                 });
  CHECK(corpus.target_tokens() == 6);
  // A long document spans windows instead of being clipped: 7 ids, seq 2: windows at 0, 2 and 4.
  const PretrainingDataset long_one({"abcde"}, tokenizer, 2, data::Packing::packed);
  const data::Batch spans = long_one.dataset().gather({0, 1, 2});
  test::check_equal(spans.inputs, {256, 97, 98, 99, 100, 101});
  test::check_equal(spans.targets, {97, 98, 99, 100, 101, 257});
  CHECK_THROWS_EXACT(
      PretrainingDataset({"ab"}, tokenizer, 4, data::Packing::packed),
      "PretrainingDataset: the 1 documents pack into 4 ids, fewer than one sequence of 4 and its "
      "next id");
}

TEST_CASE("PretrainingDataset packed, with documents: each input's document within its sample",
          "[data][corpus]") {
  const ByteTokenizer tokenizer;
  // The stream: BOT a b EOT BOT c EOT BOT d e f g EOT (13 ids), seq 4: windows at 0, 4 and 8.
  const PretrainingDataset corpus({"ab", "c", "defg"}, tokenizer, 4, data::Packing::packed);
  REQUIRE(corpus.size() == 3);
  const data::Batch all = corpus.dataset_with_documents().gather({0, 1, 2});
  test::check_equal(all.inputs, {
                                    256, 97, 98, 257,    // BOT a b EOT
                                    256, 99, 257, 256,   // BOT c EOT BOT
                                    100, 101, 102, 103,  // d e f g
                                });
  REQUIRE(all.documents.dtype() == DType::i64);
  test::check_equal(all.documents, {
                                       0, 0, 0, 0,  // one document, its EOT included
                                       0, 0, 0, 1,  // c's, then the next one's BOT
                                       0, 0, 0, 0,  // the rest of the one begun in the sample before
                                   });
  // The same inputs and targets as without documents, and none there.
  const data::Batch plain = corpus.dataset().gather({0, 1, 2});
  test::check_equal(all.targets, test::values(plain.targets));
  CHECK_FALSE(plain.documents.defined());
  CHECK_THROWS_EXACT(PretrainingDataset({"ab"}, tokenizer, 4).dataset_with_documents(),
                     "PretrainingDataset: documents within a sample are for packed samples; these hold one "
                     "document each");
}

TEST_CASE("PretrainingDataset refuses a sequence length below 1 and no documents", "[data][corpus]") {
  const ByteTokenizer tokenizer;
  CHECK_THROWS_EXACT(PretrainingDataset({"a"}, tokenizer, 0),
                     "PretrainingDataset: seq must be at least 1, got 0");
  CHECK_THROWS_EXACT(PretrainingDataset({}, tokenizer, 4), "PretrainingDataset: no documents");
}
