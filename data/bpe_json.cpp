// data/bpe_json.cpp: reading Hugging Face's tokenizer.json strictly into a BpeTokenizer (every
// field checked, what we do not implement refused by name), and the sections a trained one writes.
#include <algorithm>
#include <map>

#include "core/error.h"
#include "data/bpe.h"
#include "data/byte_level.h"

namespace shardlab::data {
namespace {

using Json = nlohmann::ordered_json;

std::string_view type_name(const Json& value) {
  switch (value.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      return "a boolean";
    case Json::value_t::string:
      return "a string";
    case Json::value_t::array:
      return "an array";
    case Json::value_t::object:
      return "an object";
    default:
      return "a number";
  }
}

// A value short enough for a message.
std::string shown(const Json& value) {
  std::string text = value.dump();
  return text.size() <= 80 ? text : text.substr(0, 77) + "...";
}

// Field access that fails naming the file and the field's path ("model.merges[3]").
class Reader {
 public:
  explicit Reader(const std::string& source) : source_(source) {}

  [[noreturn]] void refuse(const std::string& field, const std::string& message) const {
    fail("{}: {}: {}", source_, field, message);
  }

  const Json& member(const Json& object, const std::string& field) const {
    const std::string key = field.substr(field.rfind('.') + 1);
    const auto found = object.find(key);
    if (found == object.end()) fail("{}: {} is missing", source_, field);
    return *found;
  }
  const Json& typed(const Json& value, const std::string& field, Json::value_t type,
                    std::string_view want) const {
    const bool ok =
        type == Json::value_t::number_unsigned ? value.is_number_unsigned() : value.type() == type;
    if (!ok) refuse(field, fmt::format("expected {}, found {}", want, type_name(value)));
    return value;
  }
  const Json& object(const Json& parent, const std::string& field) const {
    return typed(member(parent, field), field, Json::value_t::object, "an object");
  }
  const Json& array(const Json& parent, const std::string& field) const {
    return typed(member(parent, field), field, Json::value_t::array, "an array");
  }
  std::string string(const Json& parent, const std::string& field) const {
    return typed(member(parent, field), field, Json::value_t::string, "a string").get<std::string>();
  }
  bool boolean(const Json& parent, const std::string& field) const {
    return typed(member(parent, field), field, Json::value_t::boolean, "a boolean").get<bool>();
  }
  std::int64_t id(const Json& value, const std::string& field) const {
    typed(value, field, Json::value_t::number_unsigned, "a non-negative integer");
    if (value.get<std::uint64_t>() >= (1u << 31))
      refuse(field, fmt::format("id {} is too large", shown(value)));
    return value.get<std::int64_t>();
  }
  // The field must hold one of `allowed` (absent counts as `absent` when given).
  void one_of(const Json& parent, const std::string& field, std::initializer_list<Json> allowed,
              const Json* absent = nullptr) const {
    const std::string key = field.substr(field.rfind('.') + 1);
    const auto found = parent.find(key);
    if (found == parent.end() && absent == nullptr) fail("{}: {} is missing", source_, field);
    const Json& value = found == parent.end() ? *absent : *found;
    if (std::find(allowed.begin(), allowed.end(), value) != allowed.end()) return;
    std::string expected;
    for (const Json& option : allowed) expected += (expected.empty() ? "" : " or ") + option.dump();
    refuse(field, fmt::format("{} is not supported (expected {})", shown(value), expected));
  }
  // An object whose "type" must be `type`.
  const Json& typed_section(const Json& parent, const std::string& field, std::string_view type) const {
    const Json& section = object(parent, field);
    one_of(section, field + ".type", {std::string(type)});
    return section;
  }

 private:
  const std::string& source_;
};

// A merge as "left right" (older files) or ["left", "right"] (current ones).
std::pair<std::string, std::string> merge_parts(const Reader& reader, const Json& merge,
                                                const std::string& field) {
  if (merge.is_string()) {
    const std::string text = merge.get<std::string>();
    const std::size_t space = text.find(' ');
    if (space != std::string::npos && text.find(' ', space + 1) == std::string::npos) {
      return {text.substr(0, space), text.substr(space + 1)};
    }
  } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
    return {merge[0].get<std::string>(), merge[1].get<std::string>()};
  }
  reader.refuse(field,
                fmt::format("expected \"left right\" or [\"left\", \"right\"], found {}", shown(merge)));
}

// What Hugging Face applies after the model: trimming offsets (ByteLevel) and adding special
// tokens when a caller asks for them (TemplateProcessing, Llama's "<|begin_of_text|> $A"), or a
// Sequence of those. encode() never adds special tokens (its callers place BOT and EOT), so the
// ids are the same either way; the section is kept as read for Hugging Face. Other processors
// (BERT's, RoBERTa's) belong to other tokenizers and are refused.
void check_post_processor(const Reader& reader, const Json& post_processor) {
  if (post_processor.is_null()) return;
  reader.typed(post_processor, "post_processor", Json::value_t::object, "an object");
  reader.one_of(post_processor, "post_processor.type", {"ByteLevel", "TemplateProcessing", "Sequence"});
  if (post_processor["type"] != "Sequence") return;
  const Json& processors = reader.array(post_processor, "post_processor.processors");
  for (std::size_t i = 0; i < processors.size(); ++i) {
    const std::string field = fmt::format("post_processor.processors[{}]", i);
    reader.typed(processors[i], field, Json::value_t::object, "an object");
    reader.one_of(processors[i], field + ".type", {"ByteLevel", "TemplateProcessing"});
  }
}

}  // namespace

Json BpeTokenizer::trained_document() {
  const Json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", Json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", nullptr},
          {"decoder",
           {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", false},
            {"vocab", Json::object()},
            {"merges", Json::array()}}}};
}

BpeTokenizer BpeTokenizer::from_json(std::string_view json_text, const std::string& source) {
  Json root;
  try {
    root = Json::parse(json_text);
  } catch (const Json::exception& error) {
    fail("{}: not valid JSON: {}", source, error.what());
  }
  const Reader reader(source);
  reader.typed(root, "the document", Json::value_t::object, "an object");
  reader.one_of(root, "version", {"1.0"});
  reader.one_of(root, "truncation", {nullptr});
  reader.one_of(root, "padding", {nullptr});
  reader.one_of(root, "normalizer", {nullptr});
  const Json& pre_tokenizer = reader.typed_section(root, "pre_tokenizer", "ByteLevel");
  reader.boolean(pre_tokenizer, "pre_tokenizer.add_prefix_space");
  reader.boolean(pre_tokenizer, "pre_tokenizer.trim_offsets");
  const Json yes = true, no = false, null = nullptr;
  reader.one_of(pre_tokenizer, "pre_tokenizer.use_regex", {true}, &yes);
  check_post_processor(reader, reader.member(root, "post_processor"));
  reader.typed_section(root, "decoder", "ByteLevel");

  const Json& model = reader.typed_section(root, "model", "BPE");
  reader.one_of(model, "model.dropout", {nullptr});
  reader.one_of(model, "model.unk_token", {nullptr});
  reader.one_of(model, "model.continuing_subword_prefix", {nullptr, ""}, &null);
  reader.one_of(model, "model.end_of_word_suffix", {nullptr, ""}, &null);
  reader.one_of(model, "model.byte_fallback", {false}, &no);
  reader.one_of(model, "model.fuse_unk", {false, true}, &no);
  reader.one_of(model, "model.ignore_merges", {false, true}, &no);

  // model.vocab: ids exactly 0..N-1.
  const Json& vocab_json = reader.object(model, "model.vocab");
  std::vector<std::string> vocab(vocab_json.size());
  std::vector<bool> seen(vocab.size());
  std::unordered_map<std::string, std::int32_t> ids;
  for (const auto& [token, value] : vocab_json.items()) {
    const std::int64_t id = reader.id(value, fmt::format("model.vocab['{}']", token));
    if (id >= static_cast<std::int64_t>(vocab.size())) {
      reader.refuse("model.vocab", fmt::format("'{}' has id {}, but the {} tokens must have ids 0..{}", token,
                                               id, vocab.size(), vocab.size() - 1));
    }
    if (seen[id])
      reader.refuse("model.vocab", fmt::format("'{}' and '{}' both have id {}", vocab[id], token, id));
    seen[id] = true;
    vocab[id] = token;
    ids.emplace(token, static_cast<std::int32_t>(id));
  }
  for (int b = 0; b < 256; ++b) {
    if (!ids.contains(byte_symbols()[b])) {
      reader.refuse("model.vocab",
                    fmt::format("byte 0x{:02x} (symbol '{}') has no token: every byte needs one", b,
                                byte_symbols()[b]));
    }
  }

  // model.merges: both tokens and their concatenation in the vocabulary.
  const Json& merges_json = reader.array(model, "model.merges");
  std::vector<std::pair<std::int32_t, std::int32_t>> merges;
  for (std::size_t i = 0; i < merges_json.size(); ++i) {
    const std::string field = fmt::format("model.merges[{}]", i);
    const auto [left, right] = merge_parts(reader, merges_json[i], field);
    for (const std::string& part : {left, right}) {
      if (!ids.contains(part)) {
        reader.refuse(field, fmt::format("'{}' + '{}': '{}' is not in model.vocab", left, right, part));
      }
    }
    if (!ids.contains(left + right)) {
      reader.refuse(field, fmt::format("'{}' + '{}': the result '{}' is not in model.vocab", left, right,
                                       left + right));
    }
    merges.emplace_back(ids.at(left), ids.at(right));
  }

  // added_tokens: in the vocabulary at their own id, or after it without gaps.
  const Json& added_json = reader.array(root, "added_tokens");
  std::vector<AddedToken> added;
  std::map<std::int64_t, std::size_t> beyond;  // ids past model.vocab -> their index in added_tokens
  std::map<std::int64_t, std::size_t> added_ids;
  for (std::size_t i = 0; i < added_json.size(); ++i) {
    const std::string field = fmt::format("added_tokens[{}]", i);
    const Json& token = reader.typed(added_json[i], field, Json::value_t::object, "an object");
    AddedToken entry{.id = reader.id(reader.member(token, field + ".id"), field + ".id"),
                     .content = reader.string(token, field + ".content"),
                     .normalized = reader.boolean(token, field + ".normalized"),
                     .special = reader.boolean(token, field + ".special")};
    for (const std::string_view flag : {"single_word", "lstrip", "rstrip"}) {
      reader.boolean(token, fmt::format("{}.{}", field, flag));
      reader.one_of(token, fmt::format("{}.{}", field, flag), {false});
    }
    if (entry.content.empty()) reader.refuse(field + ".content", "an added token cannot be empty");
    if (const auto [at, inserted] = added_ids.emplace(entry.id, i); !inserted) {
      reader.refuse(field, fmt::format("id {} is also added_tokens[{}]'s", entry.id, at->second));
    }
    const auto in_vocab = ids.find(entry.content);
    if (in_vocab != ids.end() && in_vocab->second != entry.id) {
      reader.refuse(field, fmt::format("'{}' has id {} but model.vocab gives it id {}", entry.content,
                                       entry.id, in_vocab->second));
    }
    if (in_vocab == ids.end() && entry.id < static_cast<std::int64_t>(vocab.size())) {
      reader.refuse(field, fmt::format("id {} of '{}' is already model.vocab's '{}'", entry.id, entry.content,
                                       vocab[entry.id]));
    }
    if (entry.id >= static_cast<std::int64_t>(vocab.size())) beyond.emplace(entry.id, i);
    added.push_back(std::move(entry));
  }
  auto expected = static_cast<std::int64_t>(vocab.size());
  for (const auto& [id, index] : beyond) {
    if (id != expected) {
      reader.refuse(
          fmt::format("added_tokens[{}]", index),
          fmt::format("id {} leaves a gap: ids after model.vocab must run on from {}", id, expected));
    }
    ++expected;
  }
  for (std::size_t id = 0; id < vocab.size(); ++id) {
    if (!added_ids.contains(static_cast<std::int64_t>(id)) && !symbols_to_bytes(vocab[id])) {
      reader.refuse("model.vocab",
                    fmt::format("'{}' (id {}) is neither made of ByteLevel byte symbols nor an added token",
                                vocab[id], id));
    }
  }
  return BpeTokenizer(source, std::move(root), std::move(vocab), std::move(merges), std::move(added));
}

}  // namespace shardlab::data
