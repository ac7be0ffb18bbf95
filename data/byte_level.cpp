// data/byte_level.cpp: the GPT-2 byte <-> symbol tables, UTF-8 decoding that tolerates invalid
// bytes, and the hand-written GPT-2 split regex.
#include "data/byte_level.h"

namespace shardlab::data {
namespace {

// A byte that does not begin a valid UTF-8 sequence decodes to this, one byte long.
constexpr char32_t kInvalid = 0xFFFFFFFF;

struct Char {
  char32_t cp;
  std::size_t length;
};

// The character at text[pos], or {kInvalid, 1} when the bytes there are not valid UTF-8.
Char decode_char(std::string_view text, std::size_t pos) {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(pos);
  if (lead < 0x80) return {lead, 1};
  std::size_t length;
  char32_t cp, min;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2, cp = lead & 0x1F, min = 0x80;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3, cp = lead & 0x0F, min = 0x800;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4, cp = lead & 0x07, min = 0x10000;
  } else {
    return {kInvalid, 1};
  }
  if (pos + length > text.size()) return {kInvalid, 1};
  for (std::size_t i = 1; i < length; ++i) {
    if ((byte(pos + i) & 0xC0) != 0x80) return {kInvalid, 1};
    cp = (cp << 6) | (byte(pos + i) & 0x3F);
  }
  // Overlong forms, UTF-16 surrogates and code points past Unicode are not valid UTF-8.
  if (cp < min || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return {kInvalid, 1};
  return {cp, length};
}

void append_utf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    // Symbols stop at U+0143; the wider forms are never needed here.
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Byte -> symbol code point, as GPT-2's bytes_to_unicode().
std::array<char32_t, 256> make_byte_code_points() {
  std::array<char32_t, 256> cps{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    cps[b] = printable ? static_cast<char32_t>(b) : next++;
  }
  return cps;
}

const std::array<char32_t, 256>& byte_code_points() {
  static const std::array<char32_t, 256> cps = make_byte_code_points();
  return cps;
}

// Unicode White_Space (PropList.txt), which is what Oniguruma's \s matches in UTF-8 text.
bool is_unicode_space(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

enum class Class : unsigned char { letter, number, space, other };

Class classify(char32_t cp) {
  if (cp == kInvalid) return Class::other;
  if (is_unicode_space(cp)) return Class::space;
  if (is_unicode_letter(cp)) return Class::letter;
  if (is_unicode_number(cp)) return Class::number;
  return Class::other;
}

// ASCII is most text: its classes come from a table instead of three searches.
std::array<Class, 128> make_ascii_classes() {
  std::array<Class, 128> classes{};
  for (char32_t c = 0; c < 128; ++c) classes[c] = classify(c);
  return classes;
}

struct Classified {
  Class cls;
  std::size_t length;
};

Classified classify_at(std::string_view text, std::size_t pos) {
  static const std::array<Class, 128> ascii = make_ascii_classes();
  const auto lead = static_cast<unsigned char>(text[pos]);
  if (lead < 0x80) return {ascii[lead], 1};
  const Char c = decode_char(text, pos);
  return {classify(c.cp), c.length};
}

// The length of the contraction ('s 't 're 've 'm 'll 'd) at text[pos], or 0.
std::size_t contraction_length(std::string_view text, std::size_t pos) {
  const std::string_view rest = text.substr(pos);
  for (const std::string_view suffix : {"'s", "'t", "'re", "'ve", "'m", "'ll", "'d"}) {
    if (rest.starts_with(suffix)) return suffix.size();
  }
  return 0;
}

// The end of the regex's match starting at `pos`: the alternatives in the regex's order.
std::size_t match_end(std::string_view text, std::size_t pos) {
  if (const std::size_t contraction = contraction_length(text, pos)) return pos + contraction;
  const Classified first = classify_at(text, pos);
  Class run = first.cls;
  std::size_t end = pos + first.length;
  // " ?X+": a single ASCII space joins the run of letters, numbers or other characters after it.
  if (text[pos] == ' ' && end < text.size()) {
    const Classified next = classify_at(text, end);
    if (next.cls != Class::space) run = next.cls, end += next.length;
  }
  if (run != Class::space) {
    while (end < text.size()) {
      const Classified c = classify_at(text, end);
      if (c.cls != run) break;
      end += c.length;
    }
    return end;
  }
  // "\s+(?!\S)" takes a whitespace run that reaches the end, or all of it but the last character
  // when text follows (which then starts the next word, " word"); a single space before text
  // falls through to "\s+" and stands alone.
  std::size_t last = pos;  // where the run's last character starts
  while (end < text.size()) {
    const Classified c = classify_at(text, end);
    if (c.cls != Class::space) return last == pos ? end : last;
    last = end;
    end += c.length;
  }
  return end;
}

}  // namespace

const std::array<std::string, 256>& byte_symbols() {
  static const std::array<std::string, 256> symbols = [] {
    std::array<std::string, 256> out;
    for (int b = 0; b < 256; ++b) append_utf8(byte_code_points()[b], out[b]);
    return out;
  }();
  return symbols;
}

std::optional<unsigned char> symbol_byte(char32_t cp) {
  static const std::array<int, 512> bytes = [] {
    std::array<int, 512> out;
    out.fill(-1);
    for (int b = 0; b < 256; ++b) out[byte_code_points()[b]] = b;
    return out;
  }();
  if (cp >= bytes.size() || bytes[cp] < 0) return std::nullopt;
  return static_cast<unsigned char>(bytes[cp]);
}

std::string bytes_to_symbols(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (const char b : bytes) out += byte_symbols()[static_cast<unsigned char>(b)];
  return out;
}

std::optional<std::string> symbols_to_bytes(std::string_view symbols) {
  std::string out;
  for (std::size_t pos = 0; pos < symbols.size();) {
    const Char c = decode_char(symbols, pos);
    if (c.cp == kInvalid) return std::nullopt;
    const std::optional<unsigned char> byte = symbol_byte(c.cp);
    if (!byte) return std::nullopt;
    out.push_back(static_cast<char>(*byte));
    pos += c.length;
  }
  return out;
}

void split_words(std::string_view text, std::vector<std::string_view>& words) {
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t end = match_end(text, pos);
    words.push_back(text.substr(pos, end - pos));
    pos = end;
  }
}

}  // namespace shardlab::data
