// data/text_corpus.h: text documents read from files (fortune format) and the next-token
// pretraining dataset built from them.
//
//   auto docs = data::read_documents({"/usr/share/games/fortunes"});
//   data::PretrainingDataset corpus(docs, *data::make_tokenizer("bytes"), /*seq=*/256);
//   data::DataLoader loader = data::rank_loader(corpus.dataset(), batch);
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "data/loader.h"
#include "data/tokenizer.h"

namespace shardlab::data {

// The documents of every path, in order. A path is a file, or a directory whose regular files
// are read in name order (not recursively; symlinks and strfile ".dat" indexes are skipped, so
// Debian's fortune directory, which links "x.u8" to "x", is read once). In a file, a line that is
// exactly `separator` (no '\r', no spaces) ends a document; a document is its lines joined by
// '\n', so it keeps its inner newlines and loses the one before the separator. Empty and
// whitespace-only documents are dropped. A missing path, a file that cannot be read, a directory
// with no file to read and a corpus with no document are Errors naming the path.
std::vector<std::string> read_documents(const std::vector<std::string>& paths,
                                        std::string_view separator = "%");

// One sample per document: [BOT] + tokens + [EOT], clipped to seq + 1 ids and padded with [PAD]
// to seq + 1; the input is its first seq ids and the target its last seq (the next token at each
// position). Targets after the document are [PAD], which a loss should ignore.
class PretrainingDataset {
 public:
  PretrainingDataset(const std::vector<std::string>& documents, const Tokenizer& tokenizer, std::int64_t seq);

  // inputs i64 [size, seq] and targets i64 [size, seq], for DataLoader / rank_loader.
  TensorDataset dataset() const { return TensorDataset(inputs_, targets_); }
  std::int64_t size() const { return inputs_.size(0); }
  std::int64_t seq_len() const { return inputs_.size(1); }
  // Targets that are not [PAD] over the whole dataset: the tokens an epoch trains on.
  std::int64_t target_tokens() const { return target_tokens_; }

 private:
  // Inputs and targets are kept as two contiguous tensors rather than two views of one
  // [size, seq + 1] tensor: gathering a batch copies a non-contiguous source whole.
  Tensor inputs_, targets_;
  std::int64_t target_tokens_ = 0;
};

}  // namespace shardlab::data
