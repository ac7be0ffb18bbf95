// dist/tp/cross_entropy.h: cross-entropy over logits whose vocabulary is split over a tensor-parallel
// group (a rowwise embedding's or colwise head's output), as Megatron-LM's vocab-parallel
// cross-entropy and PyTorch's loss_parallel: three all-reduces of one value per row (the max, the
// sum of exponentials, the target's logit) instead of gathering [N, vocab] logits on any rank.
//
//   // logits [N, V_r]: this rank's vocabulary entries [offset, offset + V_r) of each row.
//   Variable loss = dist::vocab_parallel_cross_entropy(logits, targets, {offset, vocab}, mesh["tp"],
//                                                      pad_id, Reduction::sum);
#pragma once

#include <cstdint>

#include "autograd/functional.h"
#include "dist/comm/communicator.h"

namespace shardlab::dist {

// logits [N, V_r] (floating), targets [N] (i64/i32, each in [0, vocabulary) or ignore_index): the
// losses of autograd's cross_entropy over the whole vocabulary, each rank computing them from its
// piece, the same on every rank of `group`, in f32 for bf16/f16 logits as there. Reduction mean divides by the rows that count (NaN
// when none does). Backward gives each rank the gradient of its own piece, with no collective.
// Every rank of `group` calls it with the same targets. Throws naming what is wrong: logits not
// [N, V_r], targets not [N] of an integer dtype, a piece outside the vocabulary, a target outside
// it (checked by the device, as autograd's cross_entropy does).
struct VocabPiece {
  std::int64_t offset = 0;      // the vocabulary entry of this rank's first column
  std::int64_t vocabulary = 0;  // the whole vocabulary's size
};
Variable vocab_parallel_cross_entropy(const Variable& logits, const Tensor& targets, VocabPiece piece,
                                      Communicator& group, std::int64_t ignore_index = -100,
                                      Reduction reduction = Reduction::mean);

}  // namespace shardlab::dist
