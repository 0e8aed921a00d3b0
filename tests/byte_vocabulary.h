// A small GPT-2-format tokenizer for tests: encoder.json and vocab.bpe whose ids 0-255 are the
// bytes in GPT-2's printable alphabet, 256 is "aa" (the one merge) and 257 <|endoftext|>.
#pragma once

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "temp_dir.h"

namespace fp8lm::testing {

struct ByteVocabulary {
  std::string vocab_file, merge_file;
  static constexpr int kTokens = 258;
};

inline ByteVocabulary write_byte_vocabulary(const TempDir& dir) {
  nlohmann::json vocab = nlohmann::json::object();
  // GPT-2's byte-to-character map: printable bytes stand for themselves, the others for 256 + n.
  auto alphabet_char = [](int byte) {
    const auto prints = [](int b) { return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174; };
    int code_point = byte;
    if (!prints(byte)) {
      int rank = 0;
      for (int b = 0; b < byte; ++b) rank += !prints(b);
      code_point = 256 + rank;
    }
    std::string utf8;
    if (code_point < 0x80) {
      utf8 += char(code_point);
    } else {
      utf8 += char(0xC0 | (code_point >> 6));
      utf8 += char(0x80 | (code_point & 0x3F));
    }
    return utf8;
  };
  for (int b = 0; b < 256; ++b) vocab[alphabet_char(b)] = b;
  vocab["aa"] = 256;
  vocab["<|endoftext|>"] = 257;
  ByteVocabulary files{dir.file("encoder.json"), dir.file("vocab.bpe")};
  std::ofstream(files.vocab_file, std::ios::binary) << vocab.dump();
  std::ofstream(files.merge_file, std::ios::binary) << "#version: 0.2\na a\n";
  return files;
}

}  // namespace fp8lm::testing
