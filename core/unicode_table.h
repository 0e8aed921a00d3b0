// Unicode code point ranges for GPT-2's pre-tokenizer: letters (\p{L}), numbers (\p{N}) and
// white space (\s as ECMAScript defines it). The data lives in core/unicode_table.cpp,
// generated from the Unicode Character Database by scripts/make_unicode_table.py.
#pragma once

#include <cstddef>

namespace fp8lm::unicode_data {

struct CodePointRange {
  char32_t first;
  char32_t last;  // inclusive
};

extern const char kUnicodeVersion[];  // of the UnicodeData.txt the table came from
extern const CodePointRange kLetterRanges[];
extern const size_t kLetterRangeCount;
extern const CodePointRange kNumberRanges[];
extern const size_t kNumberRangeCount;
extern const CodePointRange kSpaceRanges[];
extern const size_t kSpaceRangeCount;

}  // namespace fp8lm::unicode_data
