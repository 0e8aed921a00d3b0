#include "core/indexed_dataset.h"

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

#include "core/error.h"

namespace fp8lm {

static_assert(std::endian::native == std::endian::little, "indexed datasets are read as little-endian");

namespace fs = std::filesystem;

namespace {

const char* kFormatHint = "PREFIX.idx/PREFIX.bin must be a Megatron-LM indexed dataset (tools/preprocess_data.py, "
                          "or fp8lm tokenize --output-format megatron)";

std::optional<TokenElementType> element_for_code(uint8_t code) {
  switch (static_cast<IndexedDtypeCode>(code)) {
    case IndexedDtypeCode::uint8: return TokenElementType::uint8;
    case IndexedDtypeCode::int8: return TokenElementType::int8;
    case IndexedDtypeCode::int16: return TokenElementType::int16;
    case IndexedDtypeCode::int32: return TokenElementType::int32;
    case IndexedDtypeCode::int64: return TokenElementType::int64;
    case IndexedDtypeCode::uint16: return TokenElementType::uint16;
    case IndexedDtypeCode::float32:
    case IndexedDtypeCode::float64: return std::nullopt;
  }
  return std::nullopt;
}

// Reads `count` values of T at `offset` of the index, after its size was checked to hold them.
template <typename T>
std::vector<T> read_array(const InputFile& file, uint64_t offset, uint64_t count) {
  std::vector<T> values(count);
  if (count > 0) file.read_exact_at(offset, values.data(), count * sizeof(T));
  return values;
}

[[noreturn]] void truncated_index(const InputFile& idx, uint64_t needed_end, const char* what) {
  throw InputError(detail::concat(idx.path(), ": truncated at byte offset ", idx.size(), ": ", what,
                                  " needs the file to extend to byte offset ", needed_end),
                   "the index was not fully written; rebuild the dataset");
}

}  // namespace

IndexedDtypeCode indexed_dtype_for_vocab(int64_t vocab_size) {
  return vocab_size < 65500 ? IndexedDtypeCode::uint16 : IndexedDtypeCode::int32;
}

IndexedDataset IndexedDataset::open(const std::string& prefix) {
  IndexedDataset dataset;
  dataset.prefix_ = prefix;
  const InputFile idx = InputFile::open(prefix + ".idx");
  const std::string& name = idx.path();

  unsigned char header[kIndexedHeaderBytes] = {};
  const uint64_t header_bytes = std::min<uint64_t>(idx.size(), kIndexedHeaderBytes);
  idx.read_exact_at(0, header, header_bytes);
  if (idx.size() < sizeof(kIndexedMagic)) truncated_index(idx, sizeof(kIndexedMagic), "the magic");
  if (std::memcmp(header, kIndexedMagic, sizeof(kIndexedMagic)) != 0) {
    throw InputError(detail::concat(name, ": bad magic at byte offset 0 (expected \"MMIDIDX\\0\\0\")"), kFormatHint);
  }
  if (idx.size() < 17) truncated_index(idx, 17, "the version (uint64 at byte offset 9)");
  uint64_t version = 0;
  std::memcpy(&version, header + 9, 8);
  if (version != kIndexedVersion) {
    throw InputError(detail::concat(name, ": unsupported version ", version, " at byte offset 9 (expected 1)"),
                     kFormatHint);
  }
  if (idx.size() < 18) truncated_index(idx, 18, "the dtype code (uint8 at byte offset 17)");
  const uint8_t code = header[17];
  const auto element = element_for_code(code);
  if (!element) {
    const bool is_float = code == uint8_t(IndexedDtypeCode::float32) || code == uint8_t(IndexedDtypeCode::float64);
    throw InputError(detail::concat(name, ": dtype code ", int(code), " at byte offset 17 ",
                                    is_float ? "is a float type; token ids must be integers"
                                             : "is not one of Megatron's codes 1-8"),
                     kFormatHint);
  }
  dataset.dtype_code_ = static_cast<IndexedDtypeCode>(code);
  dataset.element_ = *element;
  if (idx.size() < kIndexedHeaderBytes) {
    truncated_index(idx, kIndexedHeaderBytes, "the sequence and document counts (uint64 at byte offsets 18, 26)");
  }
  uint64_t sequences = 0, document_entries = 0;
  std::memcpy(&sequences, header + 18, 8);
  std::memcpy(&document_entries, header + 26, 8);
  if (document_entries == 0) {
    throw InputError(detail::concat(name, ": document count 0 at byte offset 26 (the document indices start with 0, "
                                    "so even an empty dataset has one)"),
                     kFormatHint);
  }

  // Where each array begins; counts that cannot fit any file are refused before multiplying.
  constexpr uint64_t kLimit = uint64_t{1} << 58;
  if (sequences >= kLimit || document_entries >= kLimit) {
    truncated_index(idx, UINT64_MAX, "the sequence and document counts at byte offsets 18 and 26");
  }
  const uint64_t lengths_at = kIndexedHeaderBytes;
  const uint64_t pointers_at = lengths_at + 4 * sequences;
  const uint64_t documents_at = pointers_at + 8 * sequences;
  const uint64_t end = documents_at + 8 * document_entries;
  if (idx.size() < pointers_at) truncated_index(idx, pointers_at, "the sequence lengths");
  if (idx.size() < documents_at) truncated_index(idx, documents_at, "the sequence pointers");
  if (idx.size() < end) truncated_index(idx, end, "the document indices");
  if (idx.size() == end + sequences && sequences > 0) {
    throw InputError(detail::concat(name, ": holds sequence modes after byte offset ", end,
                                    " (a multimodal dataset), which fp8lm does not read"),
                     "build a text-only dataset");
  }
  if (idx.size() != end) {
    throw InputError(detail::concat(name, ": ", idx.size() - end, " unexpected bytes after byte offset ", end,
                                    " (the end of the document indices)"),
                     kFormatHint);
  }

  dataset.sequence_lengths_ = read_array<int32_t>(idx, lengths_at, sequences);
  dataset.sequence_pointers_ = read_array<int64_t>(idx, pointers_at, sequences);
  dataset.document_indices_ = read_array<int64_t>(idx, documents_at, document_entries);

  // Sequences back to back from byte 0, as Megatron's writer places them.
  const uint64_t element_size = element_bytes(dataset.element_);
  uint64_t next_byte = 0;
  for (uint64_t i = 0; i < sequences; ++i) {
    const int32_t length = dataset.sequence_lengths_[i];
    if (length < 0) {
      throw InputError(detail::concat(name, ": sequence ", i, " has negative length ", length, " (byte offset ",
                                      lengths_at + 4 * i, ")"),
                       kFormatHint);
    }
    const int64_t pointer = dataset.sequence_pointers_[i];
    if (pointer < 0 || uint64_t(pointer) != next_byte) {
      throw InputError(detail::concat(name, ": sequence ", i, " points to byte ", pointer, " of the .bin (byte offset ",
                                      pointers_at + 8 * i, "), but the sequences before it end at byte ", next_byte),
                       kFormatHint);
    }
    next_byte += uint64_t(length) * element_size;
    dataset.total_tokens_ += uint64_t(length);
  }
  for (uint64_t d = 0; d < document_entries; ++d) {
    const int64_t first = dataset.document_indices_[d];
    const int64_t previous = d == 0 ? 0 : dataset.document_indices_[d - 1];
    const bool last = d + 1 == document_entries;
    const bool ok = d == 0 ? first == 0 : first >= previous && uint64_t(first) <= sequences;
    if (!ok || (last && uint64_t(first) != sequences)) {
      throw InputError(detail::concat(name, ": document index ", d, " is ", first, " (byte offset ",
                                      documents_at + 8 * d, "); the indices must rise from 0 to the sequence count ",
                                      sequences),
                       kFormatHint);
    }
  }

  const InputFile bin = InputFile::open(prefix + ".bin");
  if (bin.size() < next_byte) {
    throw InputError(detail::concat(bin.path(), ": truncated at byte offset ", bin.size(), ": the index (", name,
                                    ") places tokens up to byte offset ", next_byte),
                     "the data file was not fully written; rebuild the dataset");
  }
  if (bin.size() > next_byte) {
    throw InputError(detail::concat(bin.path(), ": ", bin.size() - next_byte, " bytes after byte offset ", next_byte,
                                    ", where the sequences of ", name, " end"),
                     "the .bin and .idx come from different datasets");
  }
  return dataset;
}

IndexedDataset::Span IndexedDataset::document_span(uint64_t begin, uint64_t end) const {
  FP8LM_CHECK(begin <= end && end <= num_documents(), "documents [", begin, ", ", end, ") of ", num_documents());
  const uint64_t first_sequence = uint64_t(document_indices_[begin]);
  const uint64_t end_sequence = uint64_t(document_indices_[end]);
  Span span;
  span.first_byte = first_sequence < num_sequences() ? uint64_t(sequence_pointers_[first_sequence])
                                                     : total_tokens_ * element_bytes(element_);
  for (uint64_t s = first_sequence; s < end_sequence; ++s) span.tokens += uint64_t(sequence_lengths_[s]);
  return span;
}

std::vector<uint16_t> IndexedDataset::read_document(uint64_t d, int vocab_size) const {
  const Span span = document_span(d, d + 1);
  std::vector<uint16_t> tokens(span.tokens);
  if (span.tokens == 0) return tokens;
  const TokenShard shard = TokenShard::open_span(bin_path(), span.first_byte, span.tokens, element_, vocab_size, 1);
  shard.read(0, tokens.size(), tokens.data());
  return tokens;
}

// ---------------------------------------------------------------------------------------------
// Writer

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, int64_t vocab_size,
                                           std::vector<fs::path>* written)
    : prefix_(std::move(prefix)), dtype_code_(indexed_dtype_for_vocab(vocab_size)), written_(written) {
  // Tokens arrive as uint16, so a larger vocabulary cannot reach here.
  FP8LM_CHECK(vocab_size > 0 && vocab_size <= 65536, "vocab_size ", vocab_size);
  const std::string temp = prefix_ + ".bin.tmp";
  bin_ = std::fopen(temp.c_str(), "wb");
  if (bin_ == nullptr) fail(temp, "cannot create");
  if (written_ != nullptr) written_->push_back(temp);
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (bin_ != nullptr) std::fclose(bin_);
}

void IndexedDatasetWriter::append(const uint16_t* tokens, size_t count) {
  FP8LM_CHECK(bin_ != nullptr, prefix_, ": append after finish");
  document_open_ = true;
  if (count == 0) return;
  size_t wrote = 0;
  if (dtype_code_ == IndexedDtypeCode::uint16) {
    wrote = std::fwrite(tokens, sizeof(uint16_t), count, bin_);
  } else {
    std::vector<int32_t> widened(tokens, tokens + count);
    wrote = std::fwrite(widened.data(), sizeof(int32_t), count, bin_);
  }
  if (wrote != count) fail(prefix_ + ".bin.tmp", "cannot write");
  open_document_tokens_ += count;
  total_tokens_ += count;
}

void IndexedDatasetWriter::end_document() {
  FP8LM_CHECK(open_document_tokens_ <= uint64_t(INT32_MAX), prefix_, ": a document of ", open_document_tokens_,
              " tokens does not fit Megatron's int32 sequence length");
  sequence_lengths_.push_back(static_cast<int32_t>(open_document_tokens_));
  open_document_tokens_ = 0;
  document_open_ = false;
}

void IndexedDatasetWriter::finish() {
  FP8LM_CHECK(bin_ != nullptr, prefix_, ": finished twice");
  if (document_open_) end_document();
  const std::string bin_temp = prefix_ + ".bin.tmp", idx_temp = prefix_ + ".idx.tmp";
  const int closed = std::fclose(bin_);
  bin_ = nullptr;
  if (closed != 0) fail(bin_temp, "cannot write");

  const uint64_t sequences = sequence_lengths_.size();
  const uint64_t element_size = dtype_code_ == IndexedDtypeCode::uint16 ? 2 : 4;
  std::vector<int64_t> pointers(sequences);
  std::vector<int64_t> document_indices(sequences + 1);
  int64_t next_byte = 0;
  for (uint64_t i = 0; i < sequences; ++i) {
    pointers[i] = next_byte;
    next_byte += int64_t(sequence_lengths_[i]) * int64_t(element_size);
    document_indices[i + 1] = int64_t(i + 1);  // one sequence per document
  }
  const uint64_t document_entries = document_indices.size();
  const uint8_t code = static_cast<uint8_t>(dtype_code_);

  std::FILE* idx = std::fopen(idx_temp.c_str(), "wb");
  if (idx == nullptr) fail(idx_temp, "cannot create");
  if (written_ != nullptr) written_->push_back(idx_temp);
  bool ok = std::fwrite(kIndexedMagic, 1, sizeof(kIndexedMagic), idx) == sizeof(kIndexedMagic);
  ok = ok && std::fwrite(&kIndexedVersion, 8, 1, idx) == 1;
  ok = ok && std::fwrite(&code, 1, 1, idx) == 1;
  ok = ok && std::fwrite(&sequences, 8, 1, idx) == 1;
  ok = ok && std::fwrite(&document_entries, 8, 1, idx) == 1;
  ok = ok && std::fwrite(sequence_lengths_.data(), 4, sequences, idx) == sequences;
  ok = ok && std::fwrite(pointers.data(), 8, sequences, idx) == sequences;
  ok = ok && std::fwrite(document_indices.data(), 8, document_entries, idx) == document_entries;
  const int idx_closed = std::fclose(idx);
  if (!ok || idx_closed != 0) fail(idx_temp, "cannot write");

  // The .bin first: a reader that finds PREFIX.idx finds a complete PREFIX.bin beside it.
  for (const char* extension : {".bin", ".idx"}) {
    const std::string temp = prefix_ + extension + ".tmp", final_name = prefix_ + extension;
    std::error_code error;
    fs::rename(temp, final_name, error);
    if (error) throw RuntimeError(final_name + ": cannot rename from " + temp + " (" + error.message() + ")");
    if (written_ != nullptr) {
      for (auto& path : *written_) {
        if (path == temp) path = final_name;
      }
    }
  }
}

void IndexedDatasetWriter::fail(const std::string& path, const char* what) const {
  throw RuntimeError(path + ": " + what + " (" + std::strerror(errno) + ")");
}

// ---------------------------------------------------------------------------------------------
// Splits and blends

std::array<double, 3> parse_split(const std::string& text) {
  const std::string hint = "--split takes up to three non-negative weights for train, valid and test, e.g. 969,30,1";
  std::vector<double> weights;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t sep = text.find_first_of(",/", begin);
    if (sep == std::string::npos) sep = text.size();
    std::string item = text.substr(begin, sep - begin);
    const auto first = item.find_first_not_of(" \t");
    const auto last = item.find_last_not_of(" \t");
    item = first == std::string::npos ? std::string() : item.substr(first, last - first + 1);
    double value = 0;
    size_t used = 0;
    try {
      value = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size() || !std::isfinite(value) || value < 0) {
      throw InputError(detail::concat("--split '", text, "': '", item, "' is not a non-negative number"), hint);
    }
    weights.push_back(value);
    begin = sep + 1;
  }
  if (weights.size() > 3) {
    throw InputError(detail::concat("--split '", text, "': ", weights.size(), " weights, at most 3"), hint);
  }
  weights.resize(3, 0.0);
  const double total = weights[0] + weights[1] + weights[2];
  if (!(total > 0)) throw InputError(detail::concat("--split '", text, "': the weights sum to 0"), hint);
  return {weights[0] / total, weights[1] / total, weights[2] / total};
}

std::string_view to_string(DataSplit split) {
  switch (split) {
    case DataSplit::train: return "train";
    case DataSplit::valid: return "valid";
    case DataSplit::test: return "test";
  }
  return "?";
}

std::optional<DocumentRange> split_documents(const std::array<double, 3>& fractions, DataSplit split,
                                             uint64_t num_documents) {
  const size_t k = static_cast<size_t>(split);
  if (fractions[k] == 0.0) return std::nullopt;
  // The running sums in Megatron's order, then rounded half to even (nearbyint under the
  // default rounding mode), as Python's round() does.
  double low = 0;
  for (size_t i = 0; i < k; ++i) low += fractions[i];
  const double high = low + fractions[k];
  const double n = static_cast<double>(num_documents);
  DocumentRange range;
  range.begin = static_cast<uint64_t>(std::nearbyint(low * n));
  range.end = std::min<uint64_t>(static_cast<uint64_t>(std::nearbyint(high * n)), num_documents);
  range.begin = std::min(range.begin, range.end);
  return range;
}

DataBlend parse_data_path(const std::vector<std::string>& values, const std::string& flag) {
  const std::string hint = flag + " takes one prefix (PREFIX for PREFIX.bin/.idx), or weight/prefix pairs: " + flag +
                           " 0.3 PREFIX_A 0.7 PREFIX_B";
  if (values.empty()) throw InputError(flag + ": no prefix given", hint);
  DataBlend blend;
  if (values.size() == 1) {
    blend.prefixes = values;
    blend.weights = {1.0};
    return blend;
  }
  if (values.size() % 2 != 0) {
    throw InputError(detail::concat(flag, ": ", values.size(), " values, not weight/prefix pairs"), hint);
  }
  double total = 0;
  for (size_t i = 0; i < values.size(); i += 2) {
    double weight = 0;
    size_t used = 0;
    try {
      weight = std::stod(values[i], &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != values[i].size() || !std::isfinite(weight) || weight <= 0) {
      throw InputError(detail::concat(flag, ": '", values[i], "' (value ", i + 1,
                                      ") is not a positive weight for prefix '", values[i + 1], "'"),
                       hint);
    }
    blend.weights.push_back(weight);
    blend.prefixes.push_back(values[i + 1]);
    total += weight;
  }
  for (double& w : blend.weights) w /= total;
  return blend;
}

bool names_indexed_datasets(const std::vector<std::string>& values) {
  if (values.size() >= 2) {
    size_t used = 0;
    try {
      std::stod(values[0], &used);
    } catch (const std::exception&) {
      used = 0;
    }
    return used > 0 && used == values[0].size();
  }
  return values.size() == 1 && std::filesystem::is_regular_file(values[0] + ".idx");
}

bool indexed_split_holds(const DataBlend& blend, const std::array<double, 3>& fractions, DataSplit split,
                         int seq_len, uint64_t samples) {
  if (fractions[static_cast<size_t>(split)] == 0.0) return false;
  for (const std::string& prefix : blend.prefixes) {
    const IndexedDataset dataset = IndexedDataset::open(prefix);
    const DocumentRange documents = *split_documents(fractions, split, dataset.num_documents());
    const uint64_t tokens = dataset.document_span(documents.begin, documents.end).tokens;
    if (tokens == 0 || (tokens - 1) / uint64_t(seq_len) < std::max<uint64_t>(samples, 1)) return false;
  }
  return true;
}

std::optional<DataLoader> open_indexed_loader(const DataBlend& blend, const std::array<double, 3>& fractions,
                                              DataSplit split, const DataLoaderOptions& options) {
  FP8LM_CHECK(!blend.prefixes.empty() && blend.prefixes.size() == blend.weights.size(), "blend");
  if (fractions[static_cast<size_t>(split)] == 0.0) return std::nullopt;
  const uint64_t min_tokens = uint64_t(options.seq_len) + 1;
  std::vector<std::vector<TokenShard>> sources;
  for (const std::string& prefix : blend.prefixes) {
    const IndexedDataset dataset = IndexedDataset::open(prefix);
    const DocumentRange documents = *split_documents(fractions, split, dataset.num_documents());
    const IndexedDataset::Span span = dataset.document_span(documents.begin, documents.end);
    if (span.tokens < min_tokens) {
      throw InputError(detail::concat(prefix, ": the ", to_string(split), " split (documents ", documents.begin, " to ",
                                      documents.end, " of ", dataset.num_documents(), ") holds ", span.tokens,
                                      " tokens, too few for one sample (seq_len + 1 = ", min_tokens, ")"),
                       "use more data, another --split, or a smaller --seq-length");
    }
    std::vector<TokenShard> shards;
    shards.push_back(TokenShard::open_span(dataset.bin_path(), span.first_byte, span.tokens, dataset.element_type(),
                                           options.vocab_size, min_tokens));
    sources.push_back(std::move(shards));
  }
  return DataLoader(std::move(sources), blend.weights, options);
}

}  // namespace fp8lm
