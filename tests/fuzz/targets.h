// tests/fuzz/targets.h: the fuzz targets of the file readers, one function per reader, shared by the
// libFuzzer binaries (tests/fuzz/fuzzer.cpp) and the replay of the committed inputs (test_replay.cpp).
//
// Each target hands `data` to its reader as the whole file (or, for the checkpoint, as metadata.json
// in an otherwise valid checkpoint directory). The reader must either succeed, with a result whose
// invariants hold, or throw shardlab::Error; an invariant that fails is a std::logic_error, and any
// other exception, crash or sanitizer report is a bug in the reader.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace shardlab::fuzz {

void fuzz_idx(const std::uint8_t* data, std::size_t size);          // data::read_idx
void fuzz_safetensors(const std::uint8_t* data, std::size_t size);  // nn::load_safetensors
void fuzz_tokenizer(const std::uint8_t* data, std::size_t size);    // data::BpeTokenizer::from_json
void fuzz_checkpoint(const std::uint8_t* data, std::size_t size);   // dist::checkpoint_info, consolidate
void fuzz_text_corpus(const std::uint8_t* data, std::size_t size);  // data::read_documents

struct Target {
  std::string_view name;  // the corpus directory's name: tests/fuzz/corpus/<name>
  void (*run)(const std::uint8_t* data, std::size_t size);
};

inline constexpr Target kTargets[] = {
    {"idx", fuzz_idx},
    {"safetensors", fuzz_safetensors},
    {"tokenizer", fuzz_tokenizer},
    {"checkpoint", fuzz_checkpoint},
    {"text_corpus", fuzz_text_corpus},
};

// The fixed rank files the checkpoint target's directory holds next to the fuzzed metadata.json:
// kCheckpointFileBytes bytes each, byte k of file r being (r * 64 + k) & 0xff (tests/fuzz/make_seeds.py
// writes seeds whose sizes and CRC32s match).
inline constexpr int kCheckpointFiles = 2;
inline constexpr std::size_t kCheckpointFileBytes = 48;

}  // namespace shardlab::fuzz
