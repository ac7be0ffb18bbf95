// data/random_tokens.h: a data set of uniform random token ids, what speed comparisons train on so
// that no corpus or tokenizer decides the vocabulary or the padding (as peers' benchmarks do).
#pragma once

#include <cstdint>

#include "data/loader.h"

namespace shardlab::data {

// `sequences` rows of seq + 1 ids drawn uniformly from [0, vocab) by `seed` (the same on every
// machine and rank): inputs i64 [sequences, seq] are each row's first seq ids, targets the last
// seq (the next token of each input). No id is padding. Throws Error naming a size below 1.
TensorDataset random_token_dataset(std::int64_t sequences, std::int64_t seq, std::int64_t vocab,
                                   std::uint64_t seed);

}  // namespace shardlab::data
