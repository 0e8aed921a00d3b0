#include "core/tokenizer.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/unicode_table.h"

namespace fp8lm {

namespace {

constexpr char32_t kMaxCodePoint = 0x10FFFF;
constexpr char32_t kInvalidByte = 0xFFFFFFFF;  // stands for a byte that is not valid UTF-8

// One class per code point, 1.1 MB, built once from the generated ranges: the pre-tokenizer
// classifies every character, so the lookup is a single load.
const uint8_t* class_table() {
  static const std::vector<uint8_t> table = [] {
    std::vector<uint8_t> classes(kMaxCodePoint + 1, static_cast<uint8_t>(CharClass::kOther));
    auto fill = [&](const unicode_data::CodePointRange* ranges, size_t count, CharClass cls) {
      for (size_t i = 0; i < count; ++i)
        std::fill(classes.begin() + ranges[i].first, classes.begin() + ranges[i].last + 1, static_cast<uint8_t>(cls));
    };
    fill(unicode_data::kLetterRanges, unicode_data::kLetterRangeCount, CharClass::kLetter);
    fill(unicode_data::kNumberRanges, unicode_data::kNumberRangeCount, CharClass::kNumber);
    fill(unicode_data::kSpaceRanges, unicode_data::kSpaceRangeCount, CharClass::kSpace);
    return classes;
  }();
  return table.data();
}

struct CodePoint {
  char32_t value;  // kInvalidByte for a byte that starts no valid sequence
  uint32_t length;  // bytes
};

inline bool is_continuation(unsigned char byte) { return (byte & 0xC0) == 0x80; }

// Strict UTF-8 (no overlong forms, surrogates or values past U+10FFFF): anything else is one
// byte standing for itself.
inline CodePoint decode_utf8(const unsigned char* s, size_t available) {
  const unsigned char b0 = s[0];
  if (b0 < 0x80) return {b0, 1};
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    if (available >= 2 && is_continuation(s[1])) return {static_cast<char32_t>(((b0 & 0x1F) << 6) | (s[1] & 0x3F)), 2};
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    const unsigned char low = b0 == 0xE0 ? 0xA0 : 0x80, high = b0 == 0xED ? 0x9F : 0xBF;
    if (available >= 3 && s[1] >= low && s[1] <= high && is_continuation(s[2]))
      return {static_cast<char32_t>(((b0 & 0x0F) << 12) | ((s[1] & 0x3F) << 6) | (s[2] & 0x3F)), 3};
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    const unsigned char low = b0 == 0xF0 ? 0x90 : 0x80, high = b0 == 0xF4 ? 0x8F : 0xBF;
    if (available >= 4 && s[1] >= low && s[1] <= high && is_continuation(s[2]) && is_continuation(s[3]))
      return {static_cast<char32_t>(((b0 & 0x07) << 18) | ((s[1] & 0x3F) << 12) | ((s[2] & 0x3F) << 6) | (s[3] & 0x3F)), 4};
  }
  return {kInvalidByte, 1};
}

struct ClassifiedChar {
  CharClass cls;
  uint32_t length;
};

inline ClassifiedChar classify_at(const unsigned char* s, size_t available, const uint8_t* table) {
  if (s[0] < 0x80) return {static_cast<CharClass>(table[s[0]]), 1};
  const CodePoint cp = decode_utf8(s, available);
  const CharClass cls = cp.value == kInvalidByte ? CharClass::kOther : static_cast<CharClass>(table[cp.value]);
  return {cls, cp.length};
}

// Calls emit(begin, end) for each pre-token of `text`, in order. The alternatives of GPT-2's
// pattern are tried in its order at each position; only \s+(?!\S) needs a look-ahead: a
// whitespace run followed by a non-space gives its last character to the next piece.
template <typename Emit>
void for_each_pre_token(std::string_view text, Emit&& emit) {
  const uint8_t* table = class_table();
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  // The end of the run of `cls` characters starting at `pos`.
  auto run_end = [&](size_t pos, CharClass cls) {
    while (pos < n) {
      const ClassifiedChar c = classify_at(s + pos, n - pos, table);
      if (c.cls != cls) break;
      pos += c.length;
    }
    return pos;
  };
  size_t pos = 0;
  while (pos < n) {
    const size_t start = pos;
    if (s[pos] == '\'' && pos + 1 < n) {  // 's 't 're 've 'm 'll 'd (lower case only, as in GPT-2)
      const unsigned char next = s[pos + 1];
      size_t length = 0;
      if (next == 's' || next == 't' || next == 'm' || next == 'd') {
        length = 2;
      } else if (pos + 2 < n && ((next == 'r' && s[pos + 2] == 'e') || (next == 'v' && s[pos + 2] == 'e') ||
                                 (next == 'l' && s[pos + 2] == 'l'))) {
        length = 3;
      }
      if (length != 0) {
        emit(start, start + length);
        pos += length;
        continue;
      }
    }
    const ClassifiedChar first = classify_at(s + pos, n - pos, table);
    if (first.cls != CharClass::kSpace) {  // \p{L}+, \p{N}+ or [^\s\p{L}\p{N}]+
      pos = run_end(pos + first.length, first.cls);
      emit(start, pos);
      continue;
    }
    if (s[pos] == ' ' && pos + 1 < n) {  // " ?" before a letter, number or other run
      const ClassifiedChar second = classify_at(s + pos + 1, n - pos - 1, table);
      if (second.cls != CharClass::kSpace) {
        pos = run_end(pos + 1 + second.length, second.cls);
        emit(start, pos);
        continue;
      }
    }
    // A whitespace run: all of it at the end of the text or when it is one character
    // (\s+(?!\S), else \s+); otherwise all but its last character (\s+(?!\S) backtracks).
    size_t last_start = pos;
    pos += first.length;
    while (pos < n) {
      const ClassifiedChar c = classify_at(s + pos, n - pos, table);
      if (c.cls != CharClass::kSpace) break;
      last_start = pos;
      pos += c.length;
    }
    if (pos < n && last_start > start) pos = last_start;
    emit(start, pos);
  }
}

// GPT-2's byte alphabet: bytes that print (33..126, 161..172, 174..255) stand for themselves,
// the others for 256 + their rank among them. encoder.json and vocab.bpe spell tokens in it.
struct ByteAlphabet {
  char32_t code_point_of[256];
  int16_t byte_of(char32_t code_point) const {
    for (int b = 0; b < 256; ++b)
      if (code_point_of[b] == code_point) return static_cast<int16_t>(b);
    return -1;
  }
  ByteAlphabet() {
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool prints = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      code_point_of[b] = prints ? static_cast<char32_t>(b) : next++;
    }
  }
};

// The bytes a token string of the GPT-2 files stands for; false when it has a character
// outside the byte alphabet or is not valid UTF-8.
bool alphabet_to_bytes(std::string_view token, const int16_t* byte_of_code_point /*[324]*/, std::string& bytes) {
  bytes.clear();
  const auto* s = reinterpret_cast<const unsigned char*>(token.data());
  for (size_t pos = 0; pos < token.size();) {
    const CodePoint cp = decode_utf8(s + pos, token.size() - pos);
    if (cp.value == kInvalidByte || cp.value >= 324 || byte_of_code_point[cp.value] < 0) return false;
    bytes.push_back(static_cast<char>(byte_of_code_point[cp.value]));
    pos += cp.length;
  }
  return true;
}

std::string read_whole_file(const std::string& path, const char* what) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    throw InputError(detail::concat(path, ": cannot open the ", what, " (", std::strerror(errno), ")"),
                     "scripts/fetch_tokenizer.sh fetches GPT-2's encoder.json and vocab.bpe");
  }
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A fast hash of a short byte string (pre-tokens average a few bytes); never 0, which marks an
// empty cache slot.
inline uint64_t hash_piece(std::string_view piece) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ piece.size();
  size_t pos = 0;
  for (; pos + 8 <= piece.size(); pos += 8) {
    uint64_t word;
    std::memcpy(&word, piece.data() + pos, 8);
    h = (h ^ word) * 0xFF51AFD7ED558CCDull;
    h ^= h >> 32;
  }
  uint64_t tail = 0;
  std::memcpy(&tail, piece.data() + pos, piece.size() - pos);
  h = mix64(h ^ tail);
  return h == 0 ? 1 : h;
}

}  // namespace

BpeCache::BpeCache(size_t max_entries) : max_entries_(std::max<size_t>(max_entries, 1)) {
  size_t capacity = 16;
  while (capacity < 2 * max_entries_) capacity *= 2;
  slots_.resize(capacity);
}

std::pair<const int32_t*, size_t> BpeCache::find(std::string_view piece, uint64_t hash) const {
  const size_t mask = slots_.size() - 1;
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    const Slot& slot = slots_[i];
    if (slot.hash == 0) return {nullptr, 0};
    if (slot.hash == hash && slot.key_length == piece.size() &&
        std::memcmp(keys_.data() + slot.key_offset, piece.data(), piece.size()) == 0) {
      return {ids_.data() + slot.ids_offset, slot.ids_count};
    }
  }
}

void BpeCache::insert(std::string_view piece, uint64_t hash, const int32_t* ids, size_t count) {
  if (piece.size() > UINT16_MAX || count > UINT16_MAX) return;
  if (entries_ >= max_entries_ || keys_.size() + piece.size() > UINT32_MAX || ids_.size() + count > UINT32_MAX) {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    keys_.clear();
    ids_.clear();
    entries_ = 0;
  }
  const size_t mask = slots_.size() - 1;
  size_t i = hash & mask;
  while (slots_[i].hash != 0) i = (i + 1) & mask;
  slots_[i] = Slot{hash, static_cast<uint32_t>(keys_.size()), static_cast<uint32_t>(ids_.size()),
                   static_cast<uint16_t>(piece.size()), static_cast<uint16_t>(count)};
  keys_.append(piece);
  ids_.insert(ids_.end(), ids, ids + count);
  ++entries_;
}

const Gpt2Tokenizer::MergeSlot* Gpt2Tokenizer::find_merge(int32_t left, int32_t right) const {
  const uint64_t key = pair_key(left, right);
  const size_t mask = merge_slots_.size() - 1;
  for (size_t i = mix64(key) & mask;; i = (i + 1) & mask) {
    const MergeSlot& slot = merge_slots_[i];
    if (slot.rank < 0) return nullptr;
    if (slot.pair == key) return &slot;
  }
}

bool Gpt2Tokenizer::add_merge(int32_t left, int32_t right, int32_t merged_id) {
  if (2 * (num_merges_ + 1) > merge_slots_.size()) {  // grow, keeping it at most half full
    std::vector<MergeSlot> old = std::move(merge_slots_);
    merge_slots_.assign(std::max<size_t>(1024, 2 * old.size()), MergeSlot{});
    const size_t mask = merge_slots_.size() - 1;
    for (const MergeSlot& slot : old) {
      if (slot.rank < 0) continue;
      size_t i = mix64(slot.pair) & mask;
      while (merge_slots_[i].rank >= 0) i = (i + 1) & mask;
      merge_slots_[i] = slot;
    }
  }
  const uint64_t key = pair_key(left, right);
  const size_t mask = merge_slots_.size() - 1;
  size_t i = mix64(key) & mask;
  for (; merge_slots_[i].rank >= 0; i = (i + 1) & mask) {
    if (merge_slots_[i].pair == key) return false;
  }
  merge_slots_[i] = MergeSlot{key, static_cast<int32_t>(num_merges_), merged_id};
  ++num_merges_;
  return true;
}

CharClass char_class(char32_t code_point) {
  if (code_point > kMaxCodePoint) return CharClass::kOther;
  return static_cast<CharClass>(class_table()[code_point]);
}

namespace {

// The class of the code point that ends at `end` (> 0), as the forward decoder sees it.
CharClass class_before(const unsigned char* s, size_t end, const uint8_t* table) {
  if (s[end - 1] < 0x80) return static_cast<CharClass>(table[s[end - 1]]);
  size_t start = end - 1;
  while (start > 0 && end - start < 4 && is_continuation(s[start])) --start;
  // A lead byte is never inside another sequence, so forward decoding reaches `start`.
  const CodePoint cp = decode_utf8(s + start, end - start);
  if (cp.value == kInvalidByte || start + cp.length != end) return CharClass::kOther;
  return static_cast<CharClass>(table[cp.value]);
}

}  // namespace

size_t gpt2_split_point(std::string_view text, size_t limit, size_t lowest) {
  const uint8_t* table = class_table();
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  auto is_space_at = [&](size_t pos) { return classify_at(s + pos, n - pos, table).cls == CharClass::kSpace; };
  // The text may be the start of a longer one (a read buffer): a cut is reported only where
  // the characters it depends on (at most 5 bytes after it) are all there.
  constexpr size_t kLookahead = 5;
  if (n < kLookahead + 2) return 0;
  for (size_t p = std::min(limit, n - kLookahead); p >= std::max<size_t>(lowest, 2); --p) {
    // " Y" after X: X's run ends at the space, and " ?" joins the space to Y's run.
    if (s[p] == ' ' && p + 1 < n && !is_space_at(p + 1) && class_before(s, p, table) != CharClass::kSpace) return p;
    // X "\n" Y: a lone newline before a non-space is its own piece (\s+), and at the end of
    // the first part too (\s+(?!\S)).
    if (s[p - 1] == '\n' && !is_space_at(p) && class_before(s, p - 1, table) != CharClass::kSpace) return p;
  }
  return 0;
}

std::vector<std::string_view> gpt2_pre_tokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  for_each_pre_token(text, [&](size_t begin, size_t end) { pieces.push_back(text.substr(begin, end - begin)); });
  return pieces;
}

void Gpt2Tokenizer::check_fits_model(const std::string& vocab_file, int model_vocab_size, const std::string& hint) const {
  if (vocab_size() <= model_vocab_size) return;
  throw InputError("--vocab-file " + vocab_file + " has " + std::to_string(vocab_size()) +
                       " tokens, more than the model's vocab_size " + std::to_string(model_vocab_size),
                   hint);
}

Gpt2Tokenizer Gpt2Tokenizer::load(const std::string& vocab_file, const std::string& merge_file) {
  const ByteAlphabet alphabet;
  int16_t byte_of_code_point[324];
  for (char32_t cp = 0; cp < 324; ++cp) byte_of_code_point[cp] = alphabet.byte_of(cp);

  Gpt2Tokenizer tokenizer;
  const std::string hint = "expected GPT-2's encoder.json (--vocab-file) and vocab.bpe (--merge-file)";
  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(read_whole_file(vocab_file, "vocabulary file"));
  } catch (const nlohmann::json::exception& e) {
    throw InputError(detail::concat(vocab_file, ": not valid JSON (", e.what(), ")"), hint);
  }
  if (!vocab.is_object() || vocab.empty()) {
    throw InputError(detail::concat(vocab_file, ": not a GPT-2 vocabulary (a JSON object of token -> id)"), hint);
  }
  // Ids must be 0..size-1, each once: the table is indexed by id.
  const size_t size = vocab.size();
  tokenizer.token_bytes_.assign(size, {});
  std::vector<bool> seen(size, false);
  std::unordered_map<std::string, int32_t> id_of_bytes;
  id_of_bytes.reserve(size);
  std::string bytes;
  for (const auto& [token, value] : vocab.items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() >= static_cast<int64_t>(size)) {
      throw InputError(detail::concat(vocab_file, ": token ", nlohmann::json(token).dump(), " has id ", value.dump(),
                                      ", not an integer in [0, ", size, ")"),
                       hint);
    }
    const auto id = static_cast<int32_t>(value.get<int64_t>());
    if (seen[id]) throw InputError(detail::concat(vocab_file, ": id ", id, " is given to two tokens"), hint);
    seen[id] = true;
    if (!alphabet_to_bytes(token, byte_of_code_point, bytes)) {
      throw InputError(detail::concat(vocab_file, ": token ", nlohmann::json(token).dump(),
                                      " has a character outside GPT-2's byte alphabet"),
                       hint);
    }
    tokenizer.token_bytes_[id] = bytes;
    id_of_bytes.emplace(bytes, id);
    if (token == "<|endoftext|>") tokenizer.end_of_text_id_ = id;
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = id_of_bytes.find(std::string(1, static_cast<char>(b)));
    if (it == id_of_bytes.end()) {
      throw InputError(detail::concat(vocab_file, ": no token for byte ", b, ", which a byte-level vocabulary must have"), hint);
    }
    tokenizer.byte_ids_[b] = it->second;
  }
  FP8LM_INPUT_CHECK(tokenizer.end_of_text_id_ >= 0, vocab_file, ": no \"<|endoftext|>\" token");

  // vocab.bpe: a "#version" line, then one merge per line ("left right"), best first.
  const std::string merges_text = read_whole_file(merge_file, "merges file");
  std::istringstream lines(merges_text);
  std::string line, left_bytes, right_bytes;
  int64_t line_number = 0;
  while (std::getline(lines, line)) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (line_number == 1 && line[0] == '#')) continue;
    const size_t space = line.find(' ');
    const std::string_view left = std::string_view(line).substr(0, space);
    const std::string_view right = space == std::string::npos ? std::string_view() : std::string_view(line).substr(space + 1);
    auto where = [&] { return detail::concat(merge_file, ":", line_number, ": "); };
    if (left.empty() || right.empty() || right.find(' ') != std::string_view::npos) {
      throw InputError(where() + "not a merge (two tokens separated by one space)", hint);
    }
    if (!alphabet_to_bytes(left, byte_of_code_point, left_bytes) || !alphabet_to_bytes(right, byte_of_code_point, right_bytes)) {
      throw InputError(where() + "a token has a character outside GPT-2's byte alphabet", hint);
    }
    const auto left_id = id_of_bytes.find(left_bytes), right_id = id_of_bytes.find(right_bytes);
    const auto merged_id = id_of_bytes.find(left_bytes + right_bytes);
    if (left_id == id_of_bytes.end() || right_id == id_of_bytes.end() || merged_id == id_of_bytes.end()) {
      throw InputError(where() + "merges tokens that are not in the vocabulary " + vocab_file,
                       "the vocabulary and merges files must come from the same tokenizer");
    }
    if (!tokenizer.add_merge(left_id->second, right_id->second, merged_id->second)) {
      throw InputError(where() + "repeats an earlier merge", hint);
    }
  }
  FP8LM_INPUT_CHECK(tokenizer.num_merges_ > 0, merge_file, ": no merges", " HINT: ", hint);
  return tokenizer;
}

void Gpt2Tokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  thread_local std::vector<int32_t> symbols;
  thread_local std::vector<int32_t> ranks;  // [i]: the rank of pair (i, i+1), INT_MAX when none
  symbols.resize(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) symbols[i] = byte_ids_[static_cast<unsigned char>(piece[i])];
  auto rank_of = [&](int32_t left, int32_t right) {
    const MergeSlot* slot = find_merge(left, right);
    return slot == nullptr ? INT_MAX : slot->rank;
  };
  size_t count = symbols.size();
  ranks.resize(count);
  for (size_t i = 0; i + 1 < count; ++i) ranks[i] = rank_of(symbols[i], symbols[i + 1]);
  while (count > 1) {
    // The best pair; every occurrence of it is merged, left to right, as encoder.py does.
    const int32_t best = *std::min_element(ranks.begin(), ranks.begin() + (count - 1));
    if (best == INT_MAX) break;
    size_t at = 0;
    while (ranks[at] != best) ++at;
    const int32_t left = symbols[at], right = symbols[at + 1];
    const int32_t merged = find_merge(left, right)->merged_id;
    size_t write = 0;
    for (size_t read = 0; read < count;) {
      if (read + 1 < count && symbols[read] == left && symbols[read + 1] == right) {
        symbols[write++] = merged;
        read += 2;
      } else {
        // The pair's rank moves with it; a pair that now touches a merged symbol is redone below.
        ranks[write] = ranks[read];
        symbols[write++] = symbols[read++];
      }
    }
    count = write;
    for (size_t i = 0; i + 1 < count; ++i) {
      if (symbols[i] == merged || symbols[i + 1] == merged) ranks[i] = rank_of(symbols[i], symbols[i + 1]);
    }
  }
  out.insert(out.end(), symbols.begin(), symbols.begin() + count);
}

void Gpt2Tokenizer::encode(std::string_view text, std::vector<int32_t>& out, BpeCache& cache) const {
  // Long pieces rarely repeat; caching them would only churn the cache.
  constexpr size_t kMaxCachedPiece = 64;
  for_each_pre_token(text, [&](size_t begin, size_t end) {
    const std::string_view piece = text.substr(begin, end - begin);
    if (piece.size() == 1) {
      out.push_back(byte_ids_[static_cast<unsigned char>(piece[0])]);
      return;
    }
    if (piece.size() > kMaxCachedPiece) {
      encode_piece(piece, out);
      return;
    }
    const uint64_t hash = hash_piece(piece);
    const auto [cached, count] = cache.find(piece, hash);
    if (cached != nullptr) {
      out.insert(out.end(), cached, cached + count);
      return;
    }
    const size_t first = out.size();
    encode_piece(piece, out);
    cache.insert(piece, hash, out.data() + first, out.size() - first);
  });
}

std::vector<int32_t> Gpt2Tokenizer::encode(std::string_view text) const {
  BpeCache cache;
  std::vector<int32_t> ids;
  encode(text, ids, cache);
  return ids;
}

std::string Gpt2Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size()) {
      throw InputError(detail::concat("decode: token ", ids[i], " at index ", i, " is outside the vocabulary [0, ",
                                      vocab_size(), ")"));
    }
    text += token_bytes_[ids[i]];
  }
  return text;
}

}  // namespace fp8lm
