// tests/data/test_tokenizer.cpp: ByteTokenizer through the Tokenizer interface (exact round trip
// on every byte value and invalid UTF-8, special ids, the out-of-range error) and make_tokenizer.
#include <random>

#include "data/tokenizer.h"
#include "tests/check.h"

using namespace shardlab;
using data::ByteTokenizer;
using data::make_tokenizer;
using data::Tokenizer;
using Ids = std::vector<std::int64_t>;

#define CHECK_THROWS_EXACT(expr, message) CHECK_THROWS_WITH((expr), Catch::Matchers::Equals(message))

TEST_CASE("make_tokenizer builds the byte tokenizer and names the known ones", "[data][tokenizer]") {
  const std::unique_ptr<Tokenizer> tokenizer = make_tokenizer("bytes");
  CHECK(tokenizer->name() == "bytes");
  CHECK(tokenizer->vocab_size() == 259);
  CHECK(tokenizer->bot_id() == 256);
  CHECK(tokenizer->eot_id() == 257);
  CHECK(tokenizer->pad_id() == 258);
  CHECK_THROWS_EXACT(
      make_tokenizer("gpt2"),
      "make_tokenizer: unknown tokenizer 'gpt2' (known: bytes, or the path of a tokenizer.json)");
}

TEST_CASE("ByteTokenizer encodes bytes as their unsigned values and adds no special ids",
          "[data][tokenizer]") {
  const ByteTokenizer bytes;
  const Tokenizer& tokenizer = bytes;
  CHECK(tokenizer.encode("") == Ids{});
  CHECK(tokenizer.encode("hi\n") == Ids{104, 105, 10});
  CHECK(tokenizer.encode(std::string("\0\x7f\x80\xff", 4)) == Ids{0, 127, 128, 255});
  // The text of a special token is plain bytes to encode.
  CHECK(tokenizer.encode("[EOT]") == Ids{91, 69, 79, 84, 93});
}

TEST_CASE("ByteTokenizer round-trips every byte value and invalid UTF-8 exactly", "[data][tokenizer]") {
  const ByteTokenizer bytes;
  const Tokenizer& tokenizer = bytes;
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  std::string random;
  std::mt19937 generator(20240531);
  for (int i = 0; i < 4096; ++i) random.push_back(static_cast<char>(generator() & 0xff));
  const std::vector<std::string> texts = {
      all,
      random,
      std::string("\0\0a\0", 4),
      "\xc3\x28",          // a lead byte followed by a non-continuation byte
      "\x80\xbf",          // lone continuation bytes
      "\xed\xa0\x80",      // an encoded UTF-16 surrogate
      "\xf8\x88\x80\x80",  // a 5-byte form
      "caf\xc3\xa9 \xe2\x82\xac",
  };
  for (const std::string& text : texts) {
    const Ids ids = tokenizer.encode(text);
    REQUIRE(ids.size() == text.size());
    for (std::size_t i = 0; i < ids.size(); ++i) CHECK(ids[i] == static_cast<unsigned char>(text[i]));
    CHECK(tokenizer.decode(ids) == text);
  }
}

TEST_CASE("ByteTokenizer decodes special ids to their text", "[data][tokenizer]") {
  const ByteTokenizer tokenizer;
  CHECK(tokenizer.decode(Ids{256, 104, 105, 257, 258, 258}) == "[BOT]hi[EOT][PAD][PAD]");
  CHECK(tokenizer.decode(Ids{0, 257, 255}) == std::string("\0[EOT]\xff", 7));
  CHECK(tokenizer.decode(Ids{}) == "");
}

TEST_CASE("decode refuses an id outside the vocabulary, naming it and the vocabulary size",
          "[data][tokenizer]") {
  const std::unique_ptr<Tokenizer> tokenizer = make_tokenizer("bytes");
  CHECK_THROWS_EXACT(tokenizer->decode(Ids{104, 259}),
                     "decode: id 259 at position 1 is out of range for tokenizer 'bytes' (vocab_size 259)");
  CHECK_THROWS_EXACT(tokenizer->decode(Ids{-1}),
                     "decode: id -1 at position 0 is out of range for tokenizer 'bytes' (vocab_size 259)");
}
