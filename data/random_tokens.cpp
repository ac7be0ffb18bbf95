// data/random_tokens.cpp: the random token data set (data/random_tokens.h).
#include "data/random_tokens.h"

#include <utility>

#include "core/error.h"
#include "core/random.h"

namespace shardlab::data {

TensorDataset random_token_dataset(std::int64_t sequences, std::int64_t seq, std::int64_t vocab,
                                   std::uint64_t seed) {
  for (const auto& [value, what] :
       {std::pair{sequences, "sequences"}, std::pair{seq, "seq"}, std::pair{vocab, "vocab"}})
    SHARDLAB_CHECK(value >= 1, "random_token_dataset: {} must be at least 1, got {}", what, value);
  // 53 random bits per draw, truncated: every id in [0, vocab) is as likely, up to 2^-53 * vocab.
  const Tensor ids = uniform({sequences, seq + 1}, {.seed = seed, .stream = 0}, 0.0,
                             static_cast<double>(vocab), dtype(DType::f64))
                         .to(DType::i64);
  return TensorDataset(ids.narrow(1, 0, seq).contiguous(), ids.narrow(1, 1, seq).contiguous());
}

}  // namespace shardlab::data
