// Multiple-choice evaluation (HellaSwag as llm.c scores it): llm.c's eval file, read and written
// here, its examples laid out as rows of a batch, and the choice a model's losses make.
//
// The file (llm.c's dev/data/data_common.py, write_evalfile; dev/data/hellaswag.py writes
// HellaSwag's validation set, 10,042 examples, in it), little-endian:
//   header   int32[256]: magic 20240522, version 1, the example count, the longest example's
//            bytes; the rest 0
//   examples one after another, each a stream of uint16:
//            65535 (the start of an example), the example's bytes (this stream's, header
//            words included), its index, its label (the right completion), K (the number of
//            completions), the context's length and tokens, then K times an ending's length
//            and tokens
// Every field is checked when the file is read; a problem is an InputError naming the file
// and the byte offset.
//
// Scoring (llm.c's evalloader_stat_losses, HellaSwag's acc_norm by tokens): completion k of an
// example is one row, context + ending, whose targets are the ending's tokens only (the rest
// kMaskedTarget, core/loss_mask.h); its score is the mean loss over those targets, and the
// model's choice is the completion with the lowest (the first of equal ones).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace fp8lm {

inline constexpr int32_t kChoiceFileMagic = 20240522;

struct ChoiceExample {
  int64_t index = 0;  // in the dataset
  int label = 0;      // the right ending
  std::vector<int32_t> context;
  std::vector<std::vector<int32_t>> endings;
};

// Reads and validates `path`: every token below vocab_size, every example's context and
// ending non-empty, and context + ending at most seq_length + 1 tokens (a row holds the
// context and all but the ending's last token), so that no example is cut short.
std::vector<ChoiceExample> read_choice_file(const std::string& path, int vocab_size, int seq_length);

// The file's bytes in llm.c's format (written with write_file_durably, apps/checkpointing.h).
std::string choice_file_bytes(const std::vector<ChoiceExample>& examples);

// The row of `example`'s ending `ending`: inputs [seq_length] the context and the ending but
// its last token, then 0; targets [seq_length] the ending's tokens where they are predicted,
// kMaskedTarget elsewhere.
void fill_choice_row(const ChoiceExample& example, int ending, int seq_length, int32_t* inputs, int32_t* targets);

// The completion with the lowest mean loss; the first of equal ones.
int predicted_choice(std::span<const double> mean_losses);

}  // namespace fp8lm
