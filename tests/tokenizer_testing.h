// Synthetic GPT-2-style tokenizer files for tests that must not depend on the real ones.
#pragma once

#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "temp_dir.h"

namespace fp8lm::testing {

// GPT-2's byte alphabet, written out independently of core/tokenizer.cpp, for synthetic files.
inline std::string alphabet_char(int byte) {
  int code_point = byte;
  const bool prints = (byte >= 33 && byte <= 126) || (byte >= 161 && byte <= 172) || (byte >= 174);
  if (!prints) {
    int rank = 0;
    for (int b = 0; b < byte; ++b) rank += !((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174));
    code_point = 256 + rank;
  }
  std::string utf8;
  if (code_point < 0x80) {
    utf8 += static_cast<char>(code_point);
  } else {
    utf8 += static_cast<char>(0xC0 | (code_point >> 6));
    utf8 += static_cast<char>(0x80 | (code_point & 0x3F));
  }
  return utf8;
}

// A tiny byte-level vocabulary: the 256 bytes (id = byte), then `extra` tokens, then
// <|endoftext|>; and its merges.
struct SyntheticFiles {
  std::string vocab, merges;
};
inline SyntheticFiles write_synthetic(const TempDir& dir, const std::vector<std::string>& extra, const std::string& merges_text) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[alphabet_char(b)] = b;
  int id = 256;
  for (const std::string& token : extra) vocab[token] = id++;
  vocab["<|endoftext|>"] = id;
  SyntheticFiles files{dir.file("encoder.json"), dir.file("vocab.bpe")};
  std::ofstream(files.vocab, std::ios::binary) << vocab.dump();
  std::ofstream(files.merges, std::ios::binary) << "#version: 0.2\n" + merges_text;
  return files;
}

}  // namespace fp8lm::testing
