// Megatron-LM's indexed datasets: what tools/preprocess_data.py writes, read and written here.
//
// A dataset is two files with a common prefix:
//   PREFIX.bin  the tokens of every sequence, back to back, each a little-endian integer of the
//               index's dtype.
//   PREFIX.idx  the index, little-endian:
//     offset 0   9 bytes   magic "MMIDIDX\0\0"
//            9   uint64    version, 1
//           17   uint8     dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
//                          7 float32, 8 uint16 (Megatron's DType enum)
//           18   uint64    S, the sequence count
//           26   uint64    D, the document-index count (documents + 1)
//           34   int32[S]  sequence lengths, in tokens
//                int64[S]  sequence pointers, byte offsets into PREFIX.bin
//                int64[D]  document indices: document d is sequences [idx[d], idx[d+1]);
//                          idx[0] = 0 and idx[D-1] = S
// Megatron's writer places sequences back to back from byte 0, so sequence i begins where
// i - 1 ends; the reader requires exactly that (it is what makes a range of documents one
// contiguous span of tokens). A multimodal index (one int8 mode per sequence after the
// document indices) is refused, as are float dtypes.
//
// Validation happens when a dataset is opened: every field, every pointer and length against
// the .bin's size; every problem is an InputError naming the file and the byte offset.
// Tokens are checked against the vocabulary when a split of them is opened for training.
//
// Splits (--split 969,30,1): the weights are normalised to fractions f_train, f_valid, f_test;
// split k holds documents [round(F_k * N), round(F_{k+1} * N)) of the N documents, where F_k is
// the sum of the fractions before k and round() rounds half to even (Python's round, as
// Megatron computes it). A split whose fraction is 0 does not exist.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "core/input_file.h"
#include "core/token_data.h"

namespace fp8lm {

inline constexpr char kIndexedMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr uint64_t kIndexedVersion = 1;
inline constexpr uint64_t kIndexedHeaderBytes = 34;

enum class IndexedDtypeCode : uint8_t {
  uint8 = 1, int8 = 2, int16 = 3, int32 = 4, int64 = 5, float64 = 6, float32 = 7, uint16 = 8
};

// Megatron's choice for a vocabulary of `vocab_size` tokens: uint16 below 65500, else int32.
IndexedDtypeCode indexed_dtype_for_vocab(int64_t vocab_size);

class IndexedDataset {
 public:
  // Opens and validates PREFIX.idx and PREFIX.bin (InputError naming the file and offset).
  static IndexedDataset open(const std::string& prefix);

  const std::string& prefix() const { return prefix_; }
  std::string idx_path() const { return prefix_ + ".idx"; }
  std::string bin_path() const { return prefix_ + ".bin"; }
  IndexedDtypeCode dtype_code() const { return dtype_code_; }
  TokenElementType element_type() const { return element_; }
  uint64_t num_sequences() const { return sequence_lengths_.size(); }
  uint64_t num_documents() const { return document_indices_.size() - 1; }
  uint64_t num_tokens() const { return total_tokens_; }

  // Documents [begin, end) as one span of the .bin: its first byte and its token count.
  struct Span {
    uint64_t first_byte = 0;
    uint64_t tokens = 0;
  };
  Span document_span(uint64_t begin, uint64_t end) const;

  // The tokens of document `d`, each checked against vocab_size (InputError naming the file
  // and the token's byte offset).
  std::vector<uint16_t> read_document(uint64_t d, int vocab_size) const;

 private:
  std::string prefix_;
  IndexedDtypeCode dtype_code_ = IndexedDtypeCode::uint16;
  TokenElementType element_ = TokenElementType::uint16;
  std::vector<int32_t> sequence_lengths_;
  std::vector<int64_t> sequence_pointers_;
  std::vector<int64_t> document_indices_;
  uint64_t total_tokens_ = 0;
};

// Writes PREFIX.bin and PREFIX.idx as Megatron's IndexedDatasetBuilder does: one sequence per
// document, the dtype chosen from the vocabulary size. Both files are written under .tmp names
// and renamed by finish(), .bin first, so a prefix whose .idx exists is complete.
class IndexedDatasetWriter {
 public:
  // `written` (optional) collects every path created, for clean-up on failure.
  IndexedDatasetWriter(std::string prefix, int64_t vocab_size,
                       std::vector<std::filesystem::path>* written = nullptr);
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;
  ~IndexedDatasetWriter();

  // Appends tokens to the current document.
  void append(const uint16_t* tokens, size_t count);
  // Ends the current document (an empty one too: Megatron keeps empty documents).
  void end_document();
  void add_document(const std::vector<uint16_t>& tokens) {
    append(tokens.data(), tokens.size());
    end_document();
  }
  // Writes the index and publishes both files. A document still open is ended first.
  void finish();

  uint64_t documents() const { return sequence_lengths_.size(); }
  uint64_t total_tokens() const { return total_tokens_; }

 private:
  [[noreturn]] void fail(const std::string& path, const char* what) const;

  std::string prefix_;
  IndexedDtypeCode dtype_code_;
  std::vector<std::filesystem::path>* written_;
  std::FILE* bin_ = nullptr;
  std::vector<int32_t> sequence_lengths_;
  uint64_t open_document_tokens_ = 0;
  bool document_open_ = false;
  uint64_t total_tokens_ = 0;
  std::vector<unsigned char> buffer_;
};

// --split: "969,30,1" (commas or slashes, up to three non-negative numbers, missing ones 0).
// Returns the normalised fractions; InputError naming --split when malformed or all zero.
std::array<double, 3> parse_split(const std::string& text);

enum class DataSplit : uint8_t { train = 0, valid = 1, test = 2 };
std::string_view to_string(DataSplit split);

struct DocumentRange {
  uint64_t begin = 0, end = 0;
};
// The documents of `split`, or nullopt when its fraction is 0 (see the top of this file).
std::optional<DocumentRange> split_documents(const std::array<double, 3>& fractions, DataSplit split,
                                             uint64_t num_documents);

// --data-path: one PREFIX, or weight/prefix pairs "0.3 A 0.7 B". Weights are positive and
// returned normalised. InputError naming `flag` (--data-path, or Megatron's per-split
// --train-data-path / --valid-data-path, which take the same list) when malformed.
struct DataBlend {
  std::vector<std::string> prefixes;
  std::vector<double> weights;
};
DataBlend parse_data_path(const std::vector<std::string>& values, const std::string& flag = "--data-path");

// Whether `values` name Megatron indexed datasets rather than an llm.c shard glob: a weighted
// list (two values or more, the first a number), or one PREFIX whose PREFIX.idx exists.
bool names_indexed_datasets(const std::vector<std::string>& values);

// A loader over `split` of every dataset of `blend`, blended by weight (one dataset: a plain
// loader). nullopt when the split's fraction is 0. Every dataset's split must hold at least
// one sample of seq_len + 1 tokens (InputError naming the dataset).
std::optional<DataLoader> open_indexed_loader(const DataBlend& blend, const std::array<double, 3>& fractions,
                                              DataSplit split, const DataLoaderOptions& options);
// Whether the split's fraction is above 0 and every dataset's split holds `samples` samples of
// seq_len tokens and their next-token targets (one global micro-batch: what a loader needs).
// Reads the indexes only.
bool indexed_split_holds(const DataBlend& blend, const std::array<double, 3>& fractions, DataSplit split,
                         int seq_len, uint64_t samples);

}  // namespace fp8lm
