// data/byte_level.h: GPT-2's byte <-> symbol mapping and the ByteLevel pre-tokenizer (the GPT-2
// split regex, by hand), as Hugging Face tokenizers' ByteLevel pre-tokenizer and decoder do them.
//
//   std::vector<std::string_view> words;
//   data::split_words("Hello world's 42!!", words);  // "Hello", " world", "'s", " 42", "!!"
//   data::bytes_to_symbols(" world");                  // "Ġworld": the space is shown as 'Ġ'
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace shardlab::data {

// The UTF-8 text of the symbol standing for each byte: printable Latin-1 bytes stand for
// themselves, the other 68 (controls, space, 0x7f-0xa0, 0xad) for U+0100 onwards, in byte order.
// A BPE vocabulary over these symbols is printable and every byte string has a spelling.
const std::array<std::string, 256>& byte_symbols();
// The byte whose symbol is `cp`, or nullopt when `cp` stands for no byte.
std::optional<unsigned char> symbol_byte(char32_t cp);
// Each byte of `bytes` as its symbol.
std::string bytes_to_symbols(std::string_view bytes);
// The bytes `symbols` spell, or nullopt when they hold invalid UTF-8 or a character that stands
// for no byte.
std::optional<std::string> symbols_to_bytes(std::string_view symbols);

// Appends to `words` the pieces of `text` that HF's ByteLevel pre-tokenizer regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// matches, in order; they cover `text` exactly. HF takes Rust strings, which are always valid
// UTF-8; ours may be any bytes: a byte that does not start a valid UTF-8 sequence (bad lead byte,
// missing or stray continuation, overlong form, surrogate, beyond U+10FFFF) counts as one
// character that is neither a letter, a number nor a space, so it joins a punctuation run and
// every byte string splits and round-trips. \s is Unicode White_Space, as Oniguruma (HF's regex
// engine) reads it.
void split_words(std::string_view text, std::vector<std::string_view>& words);

// \p{L} and \p{N}: Unicode general categories L* and N* (data/unicode_tables.cpp).
bool is_unicode_letter(char32_t cp);
bool is_unicode_number(char32_t cp);

}  // namespace shardlab::data
