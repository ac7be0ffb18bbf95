// data/text_corpus.h: text documents read from files (fortune format) and the next-token
// pretraining dataset built from them.
//
//   auto docs = data::read_documents({"/usr/share/games/fortunes"});
//   data::PretrainingDataset corpus(docs, *data::make_tokenizer("bytes"), /*seq=*/256);  // or
//   Packing::packed data::DataLoader loader = data::rank_loader(corpus.dataset(), batch);
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

// How documents become samples of seq + 1 ids, the input their first seq and the target their last seq
// (the next token at each position):
// - one_per_document: [BOT] + tokens + [EOT], clipped to seq + 1 ids (a clipped document loses its
//   EOT) and padded with [PAD], targets after the document [PAD], which a loss should ignore;
// - packed: every document's [BOT] + tokens + [EOT] in corpus order, one stream cut every seq ids into
//   windows of seq + 1 (each id but the first a target once; attention reaches across documents), as
//   Hugging Face's run_clm concatenates and groups texts: no padding, the last window that would run
//   past the stream dropped.
enum class Packing { one_per_document, packed };

class PretrainingDataset {
 public:
  // An Error for seq below 1, no documents, or (packed) a stream too short for one window.
  PretrainingDataset(const std::vector<std::string>& documents, const Tokenizer& tokenizer, std::int64_t seq,
                     Packing packing = Packing::one_per_document);

  // inputs i64 [size, seq] and targets i64 [size, seq], for DataLoader / rank_loader.
  TensorDataset dataset() const { return TensorDataset(inputs_, targets_); }
  // The same with each input's document (packed only: an Error otherwise): i64 [size, seq], counted
  // within its sample from 0 (a sample's first ids may end a document begun in the one before) up by
  // one at each [BOT] after its first position, so an [EOT] belongs to the document it ends. For
  // block-causal attention, under which each document of a sample attends to its own ids only.
  TensorDataset dataset_with_documents() const;
  std::int64_t size() const { return inputs_.size(0); }
  std::int64_t seq_len() const { return inputs_.size(1); }
  // Targets that are not [PAD] over the whole dataset: the tokens an epoch trains on.
  std::int64_t target_tokens() const { return target_tokens_; }

 private:
  // The samples of `count` windows of seq + 1 ids each, `window(i, ids)` writing the i-th into `ids`.
  template <typename Window>
  void fill(std::int64_t count, std::int64_t seq, std::int64_t pad, const Window& window);

  // Inputs and targets are kept as two contiguous tensors rather than two views of one
  // [size, seq + 1] tensor: gathering a batch copies a non-contiguous source whole.
  Tensor inputs_, targets_;
  std::int64_t target_tokens_ = 0;
  Packing packing_;
  std::int64_t bot_id_;
};

}  // namespace shardlab::data
