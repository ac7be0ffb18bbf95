// tests/data/test_bpe.cpp: BpeTokenizer and the ByteLevel pre-tokenizer: the GPT-2 split on
// hand-written strings, merges learned on a hand-computed corpus, exact round trips (random bytes,
// every fortune), specials never split, save/load, every tokenizer.json refusal, and golden
// merges and ids from Hugging Face tokenizers (tests/tools/make_bpe_golden.py).
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "data/bpe.h"
#include "data/byte_level.h"
#include "data/text_corpus.h"
#include "tests/check.h"
#include "tests/temp_dir.h"

using namespace shardlab;
using data::BpeTokenizer;
using data::BpeTrainOptions;
using Ids = std::vector<std::int64_t>;
using Json = nlohmann::ordered_json;
using Merges = std::vector<std::pair<std::string, std::string>>;

#define CHECK_THROWS_EXACT(expr, message) CHECK_THROWS_WITH((expr), Catch::Matchers::Equals(message))

namespace {

const std::string kGolden = SHARDLAB_DATA_GOLDEN_DIR;

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The corpus as HF's train_from_files reads it: one sequence per line, the newline kept.
std::vector<std::string> corpus_lines() {
  const std::string text = read_text(kGolden + "/bpe_corpus.txt");
  std::vector<std::string> lines;
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t newline = text.find('\n', pos);
    const std::size_t end = newline == std::string::npos ? text.size() : newline + 1;
    lines.push_back(text.substr(pos, end - pos));
    pos = end;
  }
  return lines;
}

std::vector<std::string> split(std::string_view text) {
  std::vector<std::string_view> words;
  data::split_words(text, words);
  return {words.begin(), words.end()};
}

// A small trained tokenizer whose JSON the refusal tests edit.
const BpeTokenizer& small() {
  static const BpeTokenizer tokenizer = BpeTokenizer::train(corpus_lines(), {.vocab_size = 300});
  return tokenizer;
}

std::string edited(const std::function<void(Json&)>& edit) {
  Json json = Json::parse(small().to_json());
  edit(json);
  return json.dump();
}

std::string random_bytes(std::size_t size, unsigned seed) {
  std::mt19937 generator(seed);
  std::string bytes;
  for (std::size_t i = 0; i < size; ++i) bytes.push_back(static_cast<char>(generator() & 0xff));
  return bytes;
}

}  // namespace

TEST_CASE("bytes_to_symbols is GPT-2's mapping and symbols_to_bytes inverts it", "[data][bpe]") {
  CHECK(data::bytes_to_symbols("a b!") ==
        "a\xc4\xa0"
        "b!");                                      // the space is U+0120 'Ġ'
  CHECK(data::byte_symbols()[0] == "\xc4\x80");     // U+0100 'Ā'
  CHECK(data::byte_symbols()[0x7f] == "\xc4\xa1");  // after the 33 controls and space
  CHECK(data::byte_symbols()[0xad] == "\xc5\x83");  // the last one, U+0143
  CHECK(data::byte_symbols()[0xe9] == "\xc3\xa9");  // printable Latin-1 is itself
  const std::string all = random_bytes(2048, 7);
  CHECK(data::symbols_to_bytes(data::bytes_to_symbols(all)) == all);
  CHECK(data::symbols_to_bytes("\xe2\x82\xac") == std::nullopt);  // '€' stands for no byte
  CHECK(data::symbols_to_bytes("\xc4") == std::nullopt);          // truncated UTF-8
}

TEST_CASE("split_words splits as the GPT-2 regex does", "[data][bpe]") {
  using Words = std::vector<std::string>;
  CHECK(split("Hello world's 42!!") == Words{"Hello", " world", "'s", " 42", "!!"});
  CHECK(split("they're we've I'm you'll he'd don't") ==
        Words{"they", "'re", " we", "'ve", " I", "'m", " you", "'ll", " he", "'d", " don", "'t"});
  CHECK(split("'S 's'x") == Words{"'", "S", " '", "s", "'", "x"});  // case-sensitive contractions
  CHECK(split("abc123def 7") == Words{"abc", "123", "def", " 7"});
  CHECK(split(" ?!x...") == Words{" ?!", "x", "..."});
  // \s+(?!\S): a run before text leaves its last space to the word; at the end it stays whole.
  CHECK(split("I   here  \n") == Words{"I", "  ", " here", "  \n"});
  CHECK(split("a\nb \tc") == Words{"a", "\n", "b", " ", "\t", "c"});
  CHECK(split("x  ") == Words{"x", "  "});
  CHECK(split("   ") == Words{"   "});
  CHECK(split("h\xc3\xa9llo \xe6\x97\xa5\xe6\x9c\xac") == Words{"h\xc3\xa9llo", " \xe6\x97\xa5\xe6\x9c\xac"});
  CHECK(split("x\xd9\xa3\xd9\xa4") == Words{"x", "\xd9\xa3\xd9\xa4"});  // Arabic-Indic digits are \p{N}
  CHECK(split("a\xc2\xa0"
              "b") == Words{"a", "\xc2\xa0", "b"});                           // NO-BREAK SPACE is \s
  CHECK(split("go \xf0\x9f\x99\x82!") == Words{"go", " \xf0\x9f\x99\x82!"});  // emoji are punctuation-like
  // Invalid UTF-8: each bad byte is one character of the punctuation class.
  CHECK(split("ab\xff"
              "cd") == Words{"ab", "\xff", "cd"});
  CHECK(split(" \xff\xfe!x") == Words{" \xff\xfe!", "x"});
  CHECK(split("\xc3(") == Words{"\xc3("});
  CHECK(split("") == Words{});
}

TEST_CASE("train learns the hand-computed merges, ties going to the smaller pair", "[data][bpe]") {
  // Words: "ab" x1, " ab" x2, "abc" x1, " abc" x1 (' ' is the symbol 'Ġ'). Ids: 3 specials, then
  // the alphabet by code point: 'a' 67, 'b' 68, 'c' 69, 'Ġ' 223.
  //   pairs: (a,b) 5, (Ġ,a) 3, (b,c) 2          -> merge a+b = "ab" (259)
  //   pairs: (Ġ,ab) 3, (ab,c) 2                 -> merge Ġ+ab = "Ġab" (260)
  //   pairs: (ab,c) 1 in "abc", (Ġab,c) 1        -> tie: (259, 69) < (260, 69): ab+c = "abc" (261)
  const std::vector<std::string> documents = {"ab ab ab", "abc abc"};
  const BpeTokenizer all = BpeTokenizer::train(documents, {.vocab_size = 1000, .min_frequency = 1});
  CHECK(all.merges() == Merges{{"a", "b"},
                               {"\xc4\xa0", "ab"},
                               {"ab", "c"},
                               {"\xc4\xa0"
                                "ab",
                                "c"}});
  CHECK(all.vocab_size() == 263);
  CHECK(all.name() == "bpe:263");
  CHECK(all.encode("ab abc") == Ids{259, 262});
  // min_frequency 2 stops at the first pair seen once; vocab_size stops exactly there.
  CHECK(BpeTokenizer::train(documents, {.vocab_size = 1000}).merges() ==
        Merges{{"a", "b"}, {"\xc4\xa0", "ab"}});
  CHECK(BpeTokenizer::train(documents, {.vocab_size = 260, .min_frequency = 1}).merges() ==
        Merges{{"a", "b"}});
  const BpeTokenizer trained = BpeTokenizer::train(documents, {.vocab_size = 259});
  CHECK(trained.merges().empty());
  CHECK(trained.bot_id() == 0);
  CHECK(trained.eot_id() == 1);
  CHECK(trained.pad_id() == 2);
  CHECK(trained.encode("a") == Ids{67});
  CHECK_THROWS_EXACT(
      BpeTokenizer::train(documents, {.vocab_size = 258}),
      "BpeTokenizer::train: vocab_size 258 is below the 3 special tokens + 256 byte symbols = 259");
}

TEST_CASE("special tokens are never split and decode to their text", "[data][bpe]") {
  const BpeTokenizer& tokenizer = small();
  const Ids ids = tokenizer.encode("a[EOT]b");
  REQUIRE(ids.size() == 3);
  CHECK(ids[1] == tokenizer.eot_id());
  CHECK(tokenizer.encode("[BOT][EOT][PAD]") == Ids{0, 1, 2});
  // A special inside a word splits it; a broken one is plain text.
  const Ids broken = tokenizer.encode("[BO[EOT]T]");
  CHECK(std::count(broken.begin(), broken.end(), tokenizer.eot_id()) == 1);
  CHECK(std::count(broken.begin(), broken.end(), tokenizer.bot_id()) == 0);
  CHECK(tokenizer.decode(tokenizer.encode("x [EOT] [PAD]y")) == "x [EOT] [PAD]y");
}

TEST_CASE("decode(encode(x)) == x on random bytes and invalid UTF-8", "[data][bpe]") {
  const BpeTokenizer& tokenizer = small();
  for (unsigned seed = 0; seed < 20; ++seed) {
    const std::string text = random_bytes(1000 + seed * 37, seed);
    CHECK(tokenizer.decode(tokenizer.encode(text)) == text);
  }
  for (const std::string& text :
       {std::string("\0\0a\0", 4), std::string("\xc3\x28"), std::string("\xed\xa0\x80"),
        std::string("\xf8\x88\x80\x80 \xf4\x90\x80\x80"), std::string("  \n\n\t ")}) {
    CHECK(tokenizer.decode(tokenizer.encode(text)) == text);
  }
}

TEST_CASE("encode from several threads at once gives the single-threaded ids", "[data][bpe]") {
  const BpeTokenizer tokenizer = BpeTokenizer::train(corpus_lines(), {.vocab_size = 400});
  const std::string text = read_text(kGolden + "/bpe_corpus.txt");
  const Ids expected = BpeTokenizer::train(corpus_lines(), {.vocab_size = 400}).encode(text);
  std::vector<Ids> results(4);
  std::vector<std::thread> threads;
  for (Ids& result : results) threads.emplace_back([&] { result = tokenizer.encode(text); });
  for (std::thread& thread : threads) thread.join();
  for (const Ids& result : results) CHECK(result == expected);
}

TEST_CASE("every fortune round-trips through a 4096 tokenizer", "[data][bpe][fortunes-corpus]") {
  const std::vector<std::string> documents = data::read_documents({"/usr/share/games/fortunes"});
  const BpeTokenizer tokenizer = BpeTokenizer::train(documents, {.vocab_size = 4096});
  CHECK(tokenizer.vocab_size() == 4096);
  std::size_t bytes = 0, tokens = 0;
  for (const std::string& document : documents) {
    const Ids ids = tokenizer.encode(document);
    bytes += document.size();
    tokens += ids.size();
    if (tokenizer.decode(ids) != document) FAIL("no round trip: " << document);
  }
  // English text: BPE-4096 gives well over 3 bytes per token.
  CHECK(static_cast<double>(bytes) / static_cast<double>(tokens) > 3.0);
}

TEST_CASE("save and load give the same ids and the same JSON; make_tokenizer loads a path", "[data][bpe]") {
  const test::TempDir dir;
  const std::string path = dir.file("tokenizer.json");
  small().save(path);
  CHECK(dir.entries() == std::vector<std::string>{"tokenizer.json"});  // no temporary file left
  const BpeTokenizer loaded = BpeTokenizer::load(path);
  CHECK(loaded.name() == path);
  CHECK(loaded.to_json() == small().to_json());
  const std::string text = read_text(kGolden + "/bpe_corpus.txt");
  CHECK(loaded.encode(text) == small().encode(text));
  const std::unique_ptr<data::Tokenizer> made = data::make_tokenizer(path);
  CHECK(made->encode(text) == small().encode(text));
  CHECK(made->eot_id() == 1);
  CHECK_THROWS_EXACT(BpeTokenizer::load(dir.file("none.json")),
                     "BpeTokenizer::load: cannot open '" + dir.file("none.json") + "'");
  CHECK_THROWS_ERROR(small().save(dir.file("missing/tokenizer.json")),
                     "BpeTokenizer::save: cannot open '" + dir.file("missing/tokenizer.json") + ".tmp-");
  // Older files write merges as "left right" strings.
  const BpeTokenizer old =
      BpeTokenizer::from_json(edited([](Json& json) {
                                for (Json& merge : json["model"]["merges"])
                                  merge = merge[0].get<std::string>() + " " + merge[1].get<std::string>();
                              }),
                              "old.json");
  CHECK(old.encode(text) == small().encode(text));
  CHECK(old.to_json() == small().to_json());
}

TEST_CASE("a post-processor that adds special tokens on request is kept and changes no id", "[data][bpe]") {
  // Hugging Face's LlamaTokenizerFast writes a TemplateProcessing that adds the BOS token when asked
  // (add_special_tokens); Llama 3's tokenizer.json wraps it with ByteLevel in a Sequence.
  const Json bos_template = {
      {"type", "TemplateProcessing"},
      {"single",
       {{{"SpecialToken", {{"id", "[BOT]"}, {"type_id", 0}}}},
        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"pair", Json::array()},
      {"special_tokens", {{"[BOT]", {{"id", "[BOT]"}, {"ids", {0}}, {"tokens", {"[BOT]"}}}}}}};
  const Json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}};
  const std::string text = read_text(kGolden + "/bpe_corpus.txt");
  for (const Json& post_processor :
       {bos_template, Json{{"type", "Sequence"}, {"processors", {byte_level, bos_template}}}}) {
    INFO(post_processor.dump());
    const BpeTokenizer loaded = BpeTokenizer::from_json(
        edited([&](Json& json) { json["post_processor"] = post_processor; }), "t.json");
    CHECK(loaded.encode(text) == small().encode(text));
    CHECK(Json::parse(loaded.to_json())["post_processor"] == post_processor);  // Hugging Face still sees it
  }
}

TEST_CASE("a tokenizer without our special roles gets them appended", "[data][bpe]") {
  // No special tokens: the roles' [BOT] [EOT] [PAD] follow the 256 + 41 merged tokens.
  const BpeTokenizer bare = BpeTokenizer::train(corpus_lines(), {.vocab_size = 297, .special_tokens = {}});
  CHECK(bare.vocab_size() == 300);
  CHECK(bare.bot_id() == 297);
  CHECK(bare.eot_id() == 298);
  CHECK(bare.pad_id() == 299);
  CHECK(bare.encode("x[PAD]") == Ids{static_cast<std::int64_t>('x' - '!'), 299});
  const Json written = Json::parse(bare.to_json());
  CHECK(written["model"]["vocab"].size() == 297);
  CHECK(written["added_tokens"].size() == 3);
  CHECK(written["added_tokens"][2]["content"] == "[PAD]");
  CHECK(written["added_tokens"][2]["id"] == 299);
  CHECK(BpeTokenizer::from_json(bare.to_json(), "bare.json").to_json() == bare.to_json());
  // A vocabulary that holds "[EOT]" as an ordinary token gives the role that id.
  const BpeTokenizer plain =
      BpeTokenizer::from_json(edited([](Json& json) { json["added_tokens"] = Json::array(); }), "plain.json");
  CHECK(plain.eot_id() == 1);
  CHECK(plain.vocab_size() == 300);
  // The common HF names take the roles.
  const BpeTokenizer gpt = BpeTokenizer::from_json(edited([](Json& json) {
                                                     json["added_tokens"][1]["content"] = "<|endoftext|>";
                                                     json["model"]["vocab"].erase("[EOT]");
                                                     json["model"]["vocab"]["<|endoftext|>"] = 1;
                                                   }),
                                                   "gpt.json");
  CHECK(gpt.eot_id() == 1);
  CHECK(gpt.vocab_size() == small().vocab_size());  // no role is missing, none is appended
}

TEST_CASE("ignore_merges makes a word that is a vocabulary token one id", "[data][bpe]") {
  // Without merges, "ab" would be two byte ids; ignore_merges finds it whole in the vocabulary.
  const BpeTokenizer tokenizer = BpeTokenizer::from_json(edited([](Json& json) {
                                                           json["model"]["ignore_merges"] = true;
                                                           json["model"]["merges"] = Json::array();
                                                         }),
                                                         "ignore.json");
  const std::string word = data::bytes_to_symbols(" t");  // a frequent merge in any English corpus
  REQUIRE(Json::parse(small().to_json())["model"]["vocab"].contains(word));
  CHECK(tokenizer.encode(" t").size() == 1);
  CHECK(tokenizer.encode(" tx").size() == 3);
}

TEST_CASE("from_json refuses what it does not implement and every inconsistency, naming the field",
          "[data][bpe]") {
  const auto refuses = [](const std::function<void(Json&)>& edit, const std::string& message) {
    CHECK_THROWS_EXACT(BpeTokenizer::from_json(edited(edit), "t.json"), "t.json: " + message);
  };
  // The small tokenizer's JSON with the value at `pointer` set (or added) to `value`.
  const auto refuses_value = [&](const std::string& pointer, const Json& value, const std::string& message) {
    refuses([&](Json& j) { j[Json::json_pointer(pointer)] = value; }, message);
  };
  // ... with one more added token.
  const auto refuses_added = [&](const std::string& content, std::int64_t id, const std::string& message) {
    refuses(
        [&](Json& j) {
          Json token = j["added_tokens"][0];
          token["content"] = content;
          token["id"] = id;
          j["added_tokens"].push_back(token);
        },
        message);
  };
  using Catch::Matchers::StartsWith;
  CHECK_THROWS_WITH(BpeTokenizer::from_json("{", "t.json"), StartsWith("t.json: not valid JSON: "));
  const std::string text = small().to_json();
  CHECK_THROWS_WITH(BpeTokenizer::from_json(text.substr(0, text.size() / 2), "t.json"),
                    StartsWith("t.json: not valid JSON: "));
  CHECK_THROWS_EXACT(BpeTokenizer::from_json("[]", "t.json"),
                     "t.json: the document: expected an object, found an array");
  refuses([](Json& j) { j["model"].erase("merges"); }, "model.merges is missing");
  refuses([](Json& j) { j.erase("decoder"); }, "decoder is missing");
  refuses_value("/model/vocab", Json::array(), "model.vocab: expected an object, found an array");
  refuses_value("/version", "2.0", "version: \"2.0\" is not supported (expected \"1.0\")");
  refuses_value("/model/type", "WordPiece", "model.type: \"WordPiece\" is not supported (expected \"BPE\")");
  refuses_value("/normalizer", {{"type", "NFC"}},
                "normalizer: {\"type\":\"NFC\"} is not supported (expected null)");
  refuses_value("/pre_tokenizer/type", "Sequence",
                "pre_tokenizer.type: \"Sequence\" is not supported (expected \"ByteLevel\")");
  refuses_value("/pre_tokenizer/use_regex", false,
                "pre_tokenizer.use_regex: false is not supported (expected true)");
  refuses_value("/decoder/type", "Metaspace",
                "decoder.type: \"Metaspace\" is not supported (expected \"ByteLevel\")");
  refuses_value("/post_processor", {{"type", "BertProcessing"}},
                "post_processor.type: \"BertProcessing\" is not supported (expected \"ByteLevel\" or "
                "\"TemplateProcessing\" or \"Sequence\")");
  refuses_value("/post_processor", {{"type", "Sequence"}}, "post_processor.processors is missing");
  refuses_value("/post_processor", {{"type", "Sequence"}, {"processors", {{{"type", "RobertaProcessing"}}}}},
                "post_processor.processors[0].type: \"RobertaProcessing\" is not supported (expected "
                "\"ByteLevel\" or \"TemplateProcessing\")");
  refuses_value("/post_processor", "ByteLevel", "post_processor: expected an object, found a string");
  refuses_value("/truncation", {{"max_length", 8}},
                "truncation: {\"max_length\":8} is not supported (expected null)");
  refuses_value("/model/dropout", 0.5, "model.dropout: 0.5 is not supported (expected null)");
  refuses_value("/model/byte_fallback", true, "model.byte_fallback: true is not supported (expected false)");
  refuses_value("/added_tokens/0/lstrip", true,
                "added_tokens[0].lstrip: true is not supported (expected false)");
  refuses_value("/added_tokens/1/special", "yes",
                "added_tokens[1].special: expected a boolean, found a string");
  refuses_value("/model/merges/12", {"a", "zz"}, "model.merges[12]: 'a' + 'zz': 'zz' is not in model.vocab");
  refuses_value("/model/merges/3", {"q", "Q"},
                "model.merges[3]: 'q' + 'Q': the result 'qQ' is not in model.vocab");
  refuses_value("/model/merges/0", "a b c",
                "model.merges[0]: expected \"left right\" or [\"left\", \"right\"], found \"a b c\"");
  refuses_value("/model/vocab/a", 3, "model.vocab: '!' and 'a' both have id 3");
  refuses_value("/model/vocab/a", -1, "model.vocab['a']: expected a non-negative integer, found a number");
  refuses_value("/model/vocab/a", 9999,
                "model.vocab: 'a' has id 9999, but the 300 tokens must have ids 0..299");
  refuses(
      [](Json& j) {
        j["model"]["vocab"].erase("\xc4\x80");
        j["model"]["vocab"]["\xc4\x80\xc4\x80"] = 191;
      },
      "model.vocab: byte 0x00 (symbol '\xc4\x80') has no token: every byte needs one");
  refuses_value(
      "/model/vocab/\xe2\x82\xac", 300,
      "model.vocab: '\xe2\x82\xac' (id 300) is neither made of ByteLevel byte symbols nor an added token");
  refuses_value("/added_tokens/2/id", 7, "added_tokens[2]: '[PAD]' has id 7 but model.vocab gives it id 2");
  refuses_added("<x>", 0, "added_tokens[3]: id 0 is also added_tokens[0]'s");
  refuses_added("<x>", 5, "added_tokens[3]: id 5 of '<x>' is already model.vocab's '#'");
  refuses_added("<x>", 301,
                "added_tokens[3]: id 301 leaves a gap: ids after model.vocab must run on from 300");
  refuses_added("", 300, "added_tokens[3].content: an added token cannot be empty");
}

TEST_CASE("our trainer makes Hugging Face's merges, and both tokenizers give HF's ids",
          "[data][bpe][golden]") {
  const std::vector<std::string> lines = corpus_lines();
  // The whole run, until no pair is left: HF's default BpeTrainer (no specials) made the same list.
  const BpeTokenizer full =
      BpeTokenizer::train(lines, {.vocab_size = 30000, .special_tokens = {}, .min_frequency = 0});
  // (HF's file itself does not load here: its alphabet is only the bytes the corpus holds.)
  const Merges hf_merges =
      Json::parse(read_text(kGolden + "/bpe_hf_full.json"))["model"]["merges"].get<Merges>();
  CHECK(hf_merges.size() == 2751);
  CHECK(full.merges() == hf_merges);
  // At 512 with our specials: the file HF wrote holds our vocab and merges, and the rest of it.
  const BpeTokenizer ours = BpeTokenizer::train(lines, {.vocab_size = 512, .min_frequency = 0});
  CHECK(ours.to_json() == read_text(kGolden + "/bpe_ours_512.json"));
  CHECK(nlohmann::json::parse(ours.to_json()) ==
        nlohmann::json::parse(read_text(kGolden + "/bpe_hf_512.json")));
  const BpeTokenizer hf = BpeTokenizer::load(kGolden + "/bpe_hf_512.json");
  const Json golden = Json::parse(read_text(kGolden + "/bpe_golden_ids.json"));
  REQUIRE(golden["texts"].size() == 15);
  for (std::size_t i = 0; i < golden["texts"].size(); ++i) {
    const std::string text = golden["texts"][i].get<std::string>();
    INFO("text " << i << ": " << text);
    CHECK(hf.encode(text) == golden["hf_512"][i].get<Ids>());
    CHECK(ours.encode(text) == golden["ours_512"][i].get<Ids>());
    CHECK(hf.decode(hf.encode(text)) == text);
  }
}
