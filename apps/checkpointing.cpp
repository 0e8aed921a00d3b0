#include "apps/checkpointing.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "apps/cli.h"
#include "core/checksum.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/input_file.h"
#include "core/safetensors.h"
#include "layers/gpt.h"
#include "layers/gpt_hf.h"
#include "parallel/communicator.h"

namespace fp8lm {

namespace fs = std::filesystem;

namespace {

// A checkpoint's model against the run's: the same shape, and the LM head tied or untied alike.
void check_checkpoint_model(const GptConfig& stored, const GptConfig& config, const std::string& state_path,
                            const char* whose) {
  FP8LM_INPUT_CHECK(stored.n_layer == config.n_layer && stored.n_embd == config.n_embd &&
                        stored.n_head == config.n_head && stored.n_inner == config.n_inner &&
                        stored.vocab_size == config.vocab_size && stored.n_positions == config.n_positions,
                    state_path, ": the checkpoint's model shape differs from ", whose);
  if (stored.tie_word_embeddings != config.tie_word_embeddings)
    throw InputError(state_path + ": the checkpoint's LM head is " + (stored.tie_word_embeddings ? "tied" : "untied") +
                         " to the token embedding and " + whose + " is " +
                         (config.tie_word_embeddings ? "tied" : "untied"),
                     stored.tie_word_embeddings ? "leave out --untie-embeddings-and-output-weights"
                                                : "add --untie-embeddings-and-output-weights (or leave out --config: "
                                                  "the checkpoint's config is used)");
}

constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kScalingFile = "fp8_scaling.safetensors";
constexpr const char* kStateFile = "state.json";
constexpr const char* kStateChecksumFile = "state.json.crc32";
constexpr const char* kLatestFile = "latest";
constexpr const char* kLockFile = ".fp8lm.lock";
// Manifests and checksum records are small; anything larger is not one.
constexpr uint64_t kMaxSmallFileBytes = uint64_t{64} << 20;
// Version 2 stores the amax history [history, states] (Transformer Engine's layout);
// version 1 stored it [states, history] and is converted when loaded.
constexpr int kFormatVersion = 2;
constexpr int kOldestReadableVersion = 1;

std::string iteration_dir_name(int64_t iteration) {
  char name[32];
  std::snprintf(name, sizeof name, "iter_%07lld", static_cast<long long>(iteration));
  return name;
}

[[noreturn]] void throw_io_error(const std::string& path, const std::string& step, int error_number) {
  throw RuntimeError(path + ": " + step + " failed (" + std::strerror(error_number) + ")",
                     "check free disk space, quotas and permissions");
}

// Makes the directory's entries (creations, renames) durable. Some file systems refuse
// fsync on a directory (EINVAL); they offer nothing stronger, so that is not an error.
void fsync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw_io_error(dir.string(), "opening the directory for fsync", errno);
  if (::fsync(fd) != 0 && errno != EINVAL) {
    const int error_number = errno;
    ::close(fd);
    throw_io_error(dir.string(), "fsync of the directory", error_number);
  }
  ::close(fd);
}

void rename_durably(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw_io_error(to.string(), "renaming " + from.string() + " to it", errno);
  fsync_directory(to.parent_path());
}

// Test hooks for the save's crash tests, from FP8LM_TEST_SAVE (comma-separated):
// "kill-at=<point>" SIGKILLs this process at that named point of the save, and
// "no-exchange" takes the two-rename path of file systems without RENAME_EXCHANGE.
struct SaveTestHooks {
  std::string kill_at;
  bool no_exchange = false;
};

SaveTestHooks save_test_hooks() {
  SaveTestHooks hooks;
  const char* value = std::getenv("FP8LM_TEST_SAVE");
  std::stringstream list(value ? value : "");
  std::string item;
  while (std::getline(list, item, ',')) {
    if (item == "no-exchange") hooks.no_exchange = true;
    if (item.rfind("kill-at=", 0) == 0) hooks.kill_at = item.substr(8);
  }
  return hooks;
}

void crash_point(const SaveTestHooks& hooks, const char* point) {
  if (hooks.kill_at == point) ::raise(SIGKILL);
}

std::string state_checksum_record(const std::string& state_text) {
  return "crc32 " + crc32_hex(crc32(state_text.data(), state_text.size())) + " bytes " +
         std::to_string(state_text.size()) + "\n";
}

nlohmann::json options_json(const TrainOptions& o) {
  return {{"config", o.config_path},
          {"precision", std::string(to_string(o.precision))},
          {"fp8_format", std::string(to_string(o.fp8.format))},
          {"fp8_recipe", std::string(to_string(o.fp8.recipe))},
          {"fp8_amax_history_len", o.fp8.amax_history_len},
          {"fp8_amax_compute_algo", std::string(to_string(o.fp8.amax_compute_algo))},
          {"fp8_margin", o.fp8.margin},
          {"fp8_interval", o.fp8.interval},
          {"fp8_lm_head", o.fp8_lm_head},
          {"first_last_layers_bf16", o.first_last_layers_bf16},
          {"num_layers_at_start_in_bf16", o.num_layers_at_start_in_bf16},
          {"num_layers_at_end_in_bf16", o.num_layers_at_end_in_bf16},
          {"bf16_blocks", o.bf16_blocks},
          {"fp8_auto_precision", o.fp8_auto_precision},
          {"fp8_auto_precision_saturation", o.fp8_auto_precision_saturation},
          {"fp8_auto_precision_underflow", o.fp8_auto_precision_underflow},
          {"fp8_auto_precision_steps", o.fp8_auto_precision_steps},
          {"optimizer_state_precision", std::string(to_string(o.optimizer_state))},
          {"micro_batch_size", o.micro_batch_size},
          {"global_batch_size", o.global_batch_size},
          {"seq_length", o.seq_length},
          {"eod_mask_loss", o.eod_mask_loss},
          {"reset_position_ids", o.reset_position_ids},
          {"reset_attention_mask", o.reset_attention_mask},
          {"calculate_per_token_loss", o.calculate_per_token_loss},
          {"lr", o.lr},
          {"min_lr", o.min_lr},
          {"lr_warmup_iters", o.lr_warmup_iters},
          {"lr_warmup_fraction", o.lr_warmup_fraction ? nlohmann::json(*o.lr_warmup_fraction) : nlohmann::json()},
          {"lr_warmup_init", o.lr_warmup_init},
          {"lr_decay_iters", o.lr_decay_iters},
          {"lr_decay_style", std::string(to_string(o.lr_decay_style))},
          {"train_iters", o.train_iters},
          {"train_samples", o.train_samples},
          {"lr_decay_samples", o.lr_decay_samples},
          {"lr_warmup_samples", o.lr_warmup_samples},
          {"rampup_batch_size", o.rampup_batch_size},
          {"lr_wsd_decay_style", std::string(to_string(o.lr_wsd_decay_style))},
          {"lr_wsd_decay_iters", o.lr_wsd_decay_iters},
          {"lr_wsd_decay_samples", o.lr_wsd_decay_samples},
          {"weight_decay", o.weight_decay},
          {"weight_decay_incr_style", std::string(to_string(o.weight_decay_incr_style))},
          {"start_weight_decay", o.start_weight_decay ? nlohmann::json(*o.start_weight_decay) : nlohmann::json()},
          {"end_weight_decay", o.end_weight_decay ? nlohmann::json(*o.end_weight_decay) : nlohmann::json()},
          {"adam_beta1", o.adam_beta1},
          {"adam_beta2", o.adam_beta2},
          {"adam_eps", o.adam_eps},
          {"clip_grad", o.clip_grad},
          {"max_skipped_steps", o.max_skipped_steps},
          {"seed", o.seed},
          {"train_data_path", o.train_data_path},
          {"valid_data_path", o.valid_data_path},
          {"train_data_blend", o.train_data_blend},
          {"valid_data_blend", o.valid_data_blend},
          {"data_path", o.data_path},
          {"split", o.split},
          {"mock_data", o.mock_data},
          {"save", o.save_dir},
          {"save_retain_interval", o.save_retain_interval},
          {"load", o.load_dir},
          {"save_interval", o.save_interval},
          {"eval_interval", o.eval_interval},
          {"eval_iters", o.eval_iters},
          {"log_interval", o.log_interval},
          {"tensor_model_parallel_size", o.tensor_model_parallel_size},
          {"sequence_parallel", o.sequence_parallel},
          {"fp8_grad_comm", o.fp8_grad_comm},
          {"fp8_param_gather", o.fp8_param_gather},
          {"device", std::string(to_string(o.device))}};
}

std::string dtype_name(Fp8Dtype dtype) { return std::string(to_string(dtype)); }

// ---- Optimizer state <-> safetensors

void add_optimizer_tensors(SafetensorsWriter& writer, const TensorLayout& layout, const OptimizerSnapshot& state) {
  const bool fp8 = state.precision == OptimizerStatePrecision::fp8_fp16;
  for (const TensorInfo& t : layout.tensors()) {
    if (fp8) {
      writer.add_borrowed(t.name + ".exp_avg", SafetensorsDtype::F8_E4M3, t.shape, state.m8.data() + t.offset, t.numel);
      writer.add_borrowed(t.name + ".exp_avg_sq", SafetensorsDtype::F16, t.shape, state.v16.data() + t.offset,
                          t.numel * 2);
    } else {
      writer.add_borrowed(t.name + ".exp_avg", SafetensorsDtype::F32, t.shape, state.m32.data() + t.offset,
                          t.numel * 4);
      writer.add_borrowed(t.name + ".exp_avg_sq", SafetensorsDtype::F32, t.shape, state.v32.data() + t.offset,
                          t.numel * 4);
    }
  }
  if (fp8) {
    const int64_t count = static_cast<int64_t>(layout.tensors().size());
    writer.add_borrowed("exp_avg.scales", SafetensorsDtype::F32, {count}, state.m_scales.data(), count * 4);
    writer.add_borrowed("exp_avg_sq.scales", SafetensorsDtype::F32, {count}, state.v_scales.data(), count * 4);
  }
  writer.set_metadata("precision", std::string(to_string(state.precision)));
  writer.set_metadata("step_count", std::to_string(state.step_count));
}

const SafetensorsTensorView& expect_tensor(const SafetensorsFile& file, const std::string& name,
                                           SafetensorsDtype dtype, const std::vector<int64_t>& shape) {
  FP8LM_INPUT_CHECK(file.contains(name), file.path(), ": missing tensor \"", name, "\"");
  const SafetensorsTensorView& view = file.tensor(name);
  FP8LM_INPUT_CHECK(view.dtype == dtype && view.shape == shape, file.path(), ": tensor \"", name,
                    "\" has the wrong dtype or shape for this model");
  return view;
}

// Reads the stored state and converts it to `target` precision when it differs: FP32
// moments are quantized with fresh per-tensor scales, FP8/FP16 ones dequantized.
OptimizerSnapshot read_optimizer_state(const SafetensorsFile& file, const TensorLayout& layout,
                                       OptimizerStatePrecision target) {
  const auto& meta = file.metadata();
  FP8LM_INPUT_CHECK(meta.count("precision") && meta.count("step_count"), file.path(),
                    ": missing optimizer metadata (precision, step_count)");
  const bool stored_fp8 = meta.at("precision") == "fp8-fp16";
  FP8LM_INPUT_CHECK(stored_fp8 || meta.at("precision") == "fp32", file.path(), ": unknown optimizer precision \"",
                    meta.at("precision"), "\"");
  OptimizerSnapshot state;
  state.precision = target;
  state.step_count = std::stoll(meta.at("step_count"));
  const size_t slab = layout.total_elements();
  const size_t count = layout.tensors().size();
  const bool target_fp8 = target == OptimizerStatePrecision::fp8_fp16;
  if (target_fp8) {
    state.m8.assign(slab, 0);
    state.v16.assign(slab, 0);
    state.m_scales.assign(count, 1.0f);
    state.v_scales.assign(count, 1.0f);
  } else {
    state.m32.assign(slab, 0.0f);
    state.v32.assign(slab, 0.0f);
  }
  std::vector<float> stored_m_scales, stored_v_scales;
  if (stored_fp8) {
    const int64_t n = static_cast<int64_t>(count);
    stored_m_scales = read_as_float(expect_tensor(file, "exp_avg.scales", SafetensorsDtype::F32, {n}));
    stored_v_scales = read_as_float(expect_tensor(file, "exp_avg_sq.scales", SafetensorsDtype::F32, {n}));
  }
  for (size_t k = 0; k < count; ++k) {
    const TensorInfo& t = layout.tensors()[k];
    const auto& m = expect_tensor(file, t.name + ".exp_avg", stored_fp8 ? SafetensorsDtype::F8_E4M3 : SafetensorsDtype::F32, t.shape);
    const auto& v = expect_tensor(file, t.name + ".exp_avg_sq", stored_fp8 ? SafetensorsDtype::F16 : SafetensorsDtype::F32, t.shape);
    if (stored_fp8 && target_fp8) {  // same precision: the bytes, untouched
      std::copy(m.data, m.data + m.bytes, state.m8.begin() + t.offset);
      std::memcpy(state.v16.data() + t.offset, v.data, v.bytes);
      state.m_scales[k] = stored_m_scales[k];
      state.v_scales[k] = stored_v_scales[k];
      continue;
    }
    std::vector<float> m_values = read_as_float(m), v_values = read_as_float(v);
    if (stored_fp8) {
      for (float& x : m_values) x /= stored_m_scales[k];
      for (float& x : v_values) x /= stored_v_scales[k];
    }
    if (!target_fp8) {
      std::copy(m_values.begin(), m_values.end(), state.m32.begin() + t.offset);
      std::copy(v_values.begin(), v_values.end(), state.v32.begin() + t.offset);
      continue;
    }
    float m_amax = 0.0f, v_amax = 0.0f;
    for (float x : m_values) m_amax = std::max(m_amax, std::fabs(x));
    for (float x : v_values) v_amax = std::max(v_amax, x);
    state.m_scales[k] = moment_scale(m_amax, fp8_max(kFirstMomentDtype));
    state.v_scales[k] = moment_scale(v_amax, kFp16Max);
    for (size_t i = 0; i < t.numel; ++i) {
      state.m8[t.offset + i] = fp8_encode(m_values[i] * state.m_scales[k], kFirstMomentDtype);
      state.v16[t.offset + i] = fp16_from_float(std::min(v_values[i] * state.v_scales[k], kFp16Max));
    }
  }
  return state;
}

// ---- FP8 scaling state <-> safetensors

void add_scaling_tensors(SafetensorsWriter& writer, const ScalingSnapshot& state) {
  const int64_t S = static_cast<int64_t>(state.names.size());
  writer.add_borrowed("amax_history", SafetensorsDtype::F32, {state.history_len, S}, state.history.data(),
                      state.history.size() * 4);
  writer.add_borrowed("scale", SafetensorsDtype::F32, {S}, state.scale.data(), S * 4);
  writer.add_borrowed("scale_inv", SafetensorsDtype::F32, {S}, state.scale_inv.data(), S * 4);
  nlohmann::json names = state.names, dtypes = nlohmann::json::array();
  for (Fp8Dtype d : state.dtypes) dtypes.push_back(dtype_name(d));
  writer.set_metadata("names", names.dump());
  writer.set_metadata("dtypes", dtypes.dump());
  writer.set_metadata("initialized", state.initialized ? "1" : "0");
}

// The stored scaling state, laid out for this run's operands: each operand takes the stored
// state of the same name and format. Operands the checkpoint lacks (blocks that were BF16 under
// another --first-last-layers-bf16, another --fp8-lm-head or --fp8-format) start empty, and then
// the whole table quantizes its first step with current scaling (as a fresh run does) while the
// matched windows keep their amaxes. None (with the reason logged) when the history length
// differs or no operand matches: every state starts afresh.
std::optional<ScalingSnapshot> read_scaling_state(const SafetensorsFile& file, const ScalingSnapshot& expected,
                                                  int version) {
  const auto& meta = file.metadata();
  FP8LM_INPUT_CHECK(meta.count("names") && meta.count("dtypes") && meta.count("initialized"), file.path(),
                    ": missing FP8 scaling metadata");
  ScalingSnapshot stored;
  try {
    stored.names = nlohmann::json::parse(meta.at("names")).get<std::vector<std::string>>();
    for (const std::string& d : nlohmann::json::parse(meta.at("dtypes")).get<std::vector<std::string>>())
      stored.dtypes.push_back(d == "e4m3" ? Fp8Dtype::e4m3 : Fp8Dtype::e5m2);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(file.path() + ": bad FP8 scaling metadata (" + e.what() + ")");
  }
  FP8LM_INPUT_CHECK(stored.dtypes.size() == stored.names.size(), file.path(),
                    ": FP8 scaling metadata names ", stored.names.size(), " operands but ", stored.dtypes.size(),
                    " formats");
  FP8LM_INPUT_CHECK(file.contains("amax_history"), file.path(), ": missing tensor \"amax_history\"");
  const auto& history = file.tensor("amax_history");
  const bool state_major = version < 2;  // version 1: [states, history]
  const int64_t S = int64_t(stored.names.size());
  FP8LM_INPUT_CHECK(history.shape.size() == 2 && history.shape[state_major ? 0 : 1] == S, file.path(),
                    ": amax_history shape does not match its names");
  stored.history_len = static_cast<int>(history.shape[state_major ? 1 : 0]);
  if (stored.history_len != expected.history_len) {
    spdlog::warn("{}: its amax histories are {} steps long and --fp8-amax-history-len is {}: the FP8 scaling "
                 "state starts afresh (current scaling on the first step)",
                 file.path(), stored.history_len, expected.history_len);
    return std::nullopt;
  }
  stored.history = read_as_float(history);
  if (state_major) stored.history = history_from_state_major(stored.history, int(S), stored.history_len);
  stored.scale = read_as_float(expect_tensor(file, "scale", SafetensorsDtype::F32, {S}));
  stored.scale_inv = read_as_float(expect_tensor(file, "scale_inv", SafetensorsDtype::F32, {S}));
  stored.initialized = meta.at("initialized") == "1";
  if (stored.names == expected.names && stored.dtypes == expected.dtypes) return stored;
  int64_t matched = 0;
  ScalingSnapshot state = match_scaling_by_name(stored, expected, &matched);
  const int64_t R = int64_t(expected.names.size());
  if (matched == 0) {
    spdlog::warn("{}: FP8 scaling state is for other operands or formats; starting it afresh", file.path());
    return std::nullopt;
  }
  spdlog::warn("{}: {} of this run's {} FP8 scaling states resume by name ({} stored); the operands differ "
               "(--first-last-layers-bf16, --bf16-blocks, --fp8-lm-head or --fp8-format changed){}",
               file.path(), matched, R, S,
               state.initialized ? "" : ": those without one start empty, and the first step takes current scaling");
  return state;
}

}  // namespace

ScalingSnapshot match_scaling_by_name(const ScalingSnapshot& stored, const ScalingSnapshot& expected,
                                      int64_t* matched_count) {
  // Match by name, as Transformer Engine matches a module's FP8 metadata to its module.
  const int64_t S = int64_t(stored.names.size());
  std::map<std::string, int64_t> index_of;
  for (int64_t j = 0; j < S; ++j) index_of.emplace(stored.names[size_t(j)], j);
  const int64_t R = int64_t(expected.names.size());
  ScalingSnapshot state = expected;
  std::fill(state.history.begin(), state.history.end(), 0.0f);
  std::fill(state.scale.begin(), state.scale.end(), 1.0f);
  std::fill(state.scale_inv.begin(), state.scale_inv.end(), 1.0f);
  int64_t matched = 0;
  for (int64_t i = 0; i < R; ++i) {
    const auto found = index_of.find(expected.names[size_t(i)]);
    if (found == index_of.end() || stored.dtypes[size_t(found->second)] != expected.dtypes[size_t(i)]) continue;
    const int64_t j = found->second;
    for (int slot = 0; slot < state.history_len; ++slot)
      state.history[size_t(slot * R + i)] = stored.history[size_t(slot * S + j)];
    state.scale[size_t(i)] = stored.scale[size_t(j)];
    state.scale_inv[size_t(i)] = stored.scale_inv[size_t(j)];
    ++matched;
  }
  // Delayed scales are used as a table (all initialized or none): with an operand new to the
  // table, every operand takes current scaling until the first update.
  state.initialized = stored.initialized && matched == R;
  if (matched_count) *matched_count = matched;
  return state;
}

namespace {

// ---- Hugging Face model files

void write_model_file(const fs::path& path, const TensorLayout& layout, const std::vector<float>& params,
                      const GptConfig& config) {
  const std::vector<HfTensor> tensors = to_hf_tensors(layout, params.data(), config);
  SafetensorsWriter writer;
  for (const HfTensor& t : tensors)
    writer.add_borrowed(t.name, SafetensorsDtype::F32, t.shape, t.values.data(), t.values.size() * 4);
  writer.set_metadata("format", "pt");
  writer.write(path.string());
}

fs::path hf_model_file(const std::string& path) {
  const fs::path p(path);
  if (fs::is_regular_file(p)) return p;
  return p / kModelFile;
}

bool is_fp8lm_checkpoint(const fs::path& dir) { return fs::is_regular_file(dir / kStateFile); }

// A small file's bytes (a manifest, a checksum record, `latest`): the one rule for input
// files, so a FIFO or a device is refused, not waited on.
std::string read_small_file(const fs::path& path) { return read_input_file(path.string(), kMaxSmallFileBytes); }

// Checks state.json's bytes against the sidecar record. A checkpoint from before the sidecar
// existed has none: it loads, with a warning, since refusing every old checkpoint would be
// worse than the risk; a record that is present and disagrees is always refused.
void verify_state_checksum(const fs::path& dir, const std::string& state_text) {
  const fs::path state_path = dir / kStateFile;
  const fs::path record_path = dir / kStateChecksumFile;
  std::error_code error;
  if (!fs::exists(fs::symlink_status(record_path, error))) {
    spdlog::warn("{}: no {} (a checkpoint written before fp8lm recorded it): the manifest's integrity cannot be "
                 "checked; the next save of this run records it",
                 state_path.string(), kStateChecksumFile);
    return;
  }
  const std::string record = read_small_file(record_path);
  char hex[9] = {};
  unsigned long long bytes = 0;
  char trailing = 0;
  const bool parsed = std::sscanf(record.c_str(), "crc32 %8[0-9a-f] bytes %llu%c", hex, &bytes, &trailing) >= 2 &&
                      std::strlen(hex) == 8 && (trailing == 0 || trailing == '\n') &&
                      record == "crc32 " + std::string(hex) + " bytes " + std::to_string(bytes) + "\n";
  FP8LM_INPUT_CHECK(parsed, record_path.string(),
                    ": not a checksum record (expected \"crc32 <8 hex digits> bytes <size>\")");
  if (state_text.size() != bytes || crc32_hex(crc32(state_text.data(), state_text.size())) != hex) {
    throw InputError(state_path.string() + ": checksum mismatch with " + kStateChecksumFile +
                         " (the manifest is corrupt or was edited; its progress fields cannot be trusted)",
                     "restore this checkpoint from a copy, or resume from another iteration with --ckpt-step");
  }
}

const nlohmann::json& manifest_field(const nlohmann::json& state, const std::string& state_path,
                                     const std::string& pointer) {
  const nlohmann::json::json_pointer key(pointer);
  FP8LM_INPUT_CHECK(state.contains(key), state_path, ": missing key \"", pointer.substr(1), "\"");
  return state.at(key);
}

uint64_t manifest_count(const nlohmann::json& state, const std::string& state_path, const std::string& pointer) {
  const nlohmann::json& value = manifest_field(state, state_path, pointer);
  FP8LM_INPUT_CHECK(value.is_number_unsigned(), state_path, ": key \"", pointer.substr(1),
                    "\" must be a non-negative integer, not ", value.dump());
  return value.get<uint64_t>();
}

std::string manifest_string(const nlohmann::json& state, const std::string& state_path, const std::string& pointer) {
  const nlohmann::json& value = manifest_field(state, state_path, pointer);
  FP8LM_INPUT_CHECK(value.is_string(), state_path, ": key \"", pointer.substr(1), "\" must be a string, not ",
                    value.dump());
  return value.get<std::string>();
}

// The decay style, weight decay and beta2 of the run that saved `state`, those it recorded.
CheckpointManifest::OptimizerSettings saved_optimizer_settings(const nlohmann::json& state,
                                                               const std::string& state_path) {
  CheckpointManifest::OptimizerSettings saved;
  auto number = [&](const char* key) -> std::optional<double> {
    const nlohmann::json::json_pointer pointer(std::string("/args/") + key);
    if (!state.contains(pointer)) return std::nullopt;
    const nlohmann::json& value = state[pointer];
    FP8LM_INPUT_CHECK(value.is_number(), state_path, ": key \"args/", key, "\" must be a number");
    return value.get<double>();
  };
  saved.weight_decay = number("weight_decay");
  saved.adam_beta2 = number("adam_beta2");
  saved.lr = number("lr");
  saved.min_lr = number("min_lr");
  saved.lr_warmup_init = number("lr_warmup_init");
  if (state.contains(nlohmann::json::json_pointer("/args/lr_warmup_fraction")) &&
      !state[nlohmann::json::json_pointer("/args/lr_warmup_fraction")].is_null())
    saved.lr_warmup_fraction = number("lr_warmup_fraction");
  if (const std::optional<double> warmup = number("lr_warmup_iters")) saved.lr_warmup_iters = int64_t(*warmup);
  const std::optional<double> decay = number("lr_decay_iters"), train = number("train_iters");
  if (decay && train) saved.lr_decay_iters = int64_t(*decay >= 0 ? *decay : *train);  // -1: --train-iters
  if (const std::optional<double> samples = number("train_samples")) saved.train_samples = int64_t(*samples);
  // A style key, when recorded: one of `Style`'s names (to_string), or an error naming the key.
  auto style = [&]<typename Style>(const char* key, std::initializer_list<Style> styles) -> std::optional<Style> {
    const std::string pointer = std::string("/args/") + key;
    if (!state.contains(nlohmann::json::json_pointer(pointer))) return std::nullopt;
    const std::string name = manifest_string(state, state_path, pointer);
    std::string names;
    for (const Style candidate : styles) {
      if (to_string(candidate) == name) return candidate;
      names += (names.empty() ? "" : ", ") + std::string(to_string(candidate));
    }
    throw InputError(state_path + ": key \"args/" + key + "\" must be one of " + names + ", not \"" + name + "\"");
  };
  saved.lr_decay_style = style("lr_decay_style", {LrDecayStyle::cosine, LrDecayStyle::linear, LrDecayStyle::constant,
                                                  LrDecayStyle::inverse_square_root, LrDecayStyle::wsd});
  saved.lr_wsd_decay_style = style("lr_wsd_decay_style", {WsdDecayStyle::exponential, WsdDecayStyle::linear,
                                                          WsdDecayStyle::cosine, WsdDecayStyle::minus_sqrt});
  if (const std::optional<double> iters = number("lr_wsd_decay_iters")) saved.lr_wsd_decay_iters = int64_t(*iters);
  if (const std::optional<double> samples = number("lr_wsd_decay_samples"))
    saved.lr_wsd_decay_samples = int64_t(*samples);
  saved.weight_decay_incr_style =
      style("weight_decay_incr_style",
            {WeightDecayIncrStyle::constant, WeightDecayIncrStyle::linear, WeightDecayIncrStyle::cosine});
  for (const auto& [key, field] : {std::pair{"start_weight_decay", &saved.start_weight_decay},
                                   std::pair{"end_weight_decay", &saved.end_weight_decay}})
    if (state.contains(nlohmann::json::json_pointer(std::string("/args/") + key)) &&
        !state[nlohmann::json::json_pointer(std::string("/args/") + key)].is_null())
      *field = number(key);
  return saved;
}

// The FP8 settings of the run that saved `state`, when it trained with FP8 GEMMs. Keys added
// after the first checkpoints may be absent: their flags were off then.
std::optional<CheckpointManifest::Fp8Settings> saved_fp8_settings(const nlohmann::json& state,
                                                                  const std::string& state_path) {
  const nlohmann::json::json_pointer precision("/args/precision");
  if (!state.contains(precision) || state[precision] != "fp8") return std::nullopt;
  CheckpointManifest::Fp8Settings fp8;
  auto count = [&](const std::string& key) {
    const uint64_t value = manifest_count(state, state_path, "/args/" + key);
    FP8LM_INPUT_CHECK(value <= uint64_t(std::numeric_limits<int>::max()), state_path, ": key \"args/", key,
                      "\" out of range");
    return static_cast<int>(value);
  };
  fp8.amax_history_len = count("fp8_amax_history_len");
  FP8LM_INPUT_CHECK(fp8.amax_history_len >= 1 && fp8.amax_history_len <= kMaxAmaxHistoryLen, state_path,
                    ": key \"args/fp8_amax_history_len\" must be in [1, ", kMaxAmaxHistoryLen, "], not ",
                    fp8.amax_history_len);
  const std::string algo = manifest_string(state, state_path, "/args/fp8_amax_compute_algo");
  FP8LM_INPUT_CHECK(algo == "max" || algo == "most_recent", state_path,
                    ": key \"args/fp8_amax_compute_algo\" must be \"max\" or \"most_recent\", not \"", algo, "\"");
  fp8.amax_compute_algo = algo == "max" ? AmaxComputeAlgo::max : AmaxComputeAlgo::most_recent;
  if (state.contains(nlohmann::json::json_pointer("/args/first_last_layers_bf16"))) {
    const nlohmann::json& flag = manifest_field(state, state_path, "/args/first_last_layers_bf16");
    FP8LM_INPUT_CHECK(flag.is_boolean(), state_path, ": key \"args/first_last_layers_bf16\" must be true or false");
    fp8.first_last_layers_bf16 = flag.get<bool>();
    fp8.num_layers_at_start_in_bf16 = count("num_layers_at_start_in_bf16");
    fp8.num_layers_at_end_in_bf16 = count("num_layers_at_end_in_bf16");
  }
  if (state.contains(nlohmann::json::json_pointer("/args/bf16_blocks"))) {
    const nlohmann::json& blocks = manifest_field(state, state_path, "/args/bf16_blocks");
    const bool valid = blocks.is_array() && std::all_of(blocks.begin(), blocks.end(), [](const nlohmann::json& b) {
                         return b.is_number_integer() && b.get<int64_t>() >= 0 &&
                                b.get<int64_t>() <= std::numeric_limits<int>::max();
                       });
    FP8LM_INPUT_CHECK(valid, state_path, ": key \"args/bf16_blocks\" must be a list of block numbers, not ",
                      blocks.dump());
    for (const nlohmann::json& block : blocks) fp8.bf16_blocks.insert(block.get<int>());
  }
  if (state.contains(nlohmann::json::json_pointer("/args/fp8_recipe"))) {
    const std::string recipe = manifest_string(state, state_path, "/args/fp8_recipe");
    for (ScalingRecipe known : {ScalingRecipe::delayed, ScalingRecipe::tensorwise, ScalingRecipe::blockwise})
      if (recipe == to_string(known)) fp8.recipe = known;
    FP8LM_INPUT_CHECK(fp8.recipe.has_value(), state_path,
                      ": key \"args/fp8_recipe\" must be \"delayed\", \"tensorwise\" or \"blockwise\", not \"",
                      recipe, "\"");
  }
  return fp8;
}

// A recorded file's size and CRC-32, before anything is read from it.
void verify_data_file(const fs::path& dir, const std::string& name, const nlohmann::json& state,
                      const std::string& state_path) {
  const fs::path file = dir / name;
  FP8LM_INPUT_CHECK(fs::is_regular_file(file), file.string(), ": missing from the checkpoint");
  const uint64_t bytes = manifest_count(state, state_path, "/files/" + name + "/bytes");
  const std::string crc = manifest_string(state, state_path, "/files/" + name + "/crc32");
  FP8LM_INPUT_CHECK(fs::file_size(file) == bytes, file.string(), ": size ", fs::file_size(file),
                    " bytes, the checkpoint recorded ", bytes, " (truncated or replaced)");
  FP8LM_INPUT_CHECK(file_crc32_hex(file.string()) == crc, file.string(), ": checksum mismatch (the file is corrupt)");
}

CheckpointManifest read_manifest(const fs::path& dir, bool verify_data) {
  const fs::path state_file = dir / kStateFile;
  const std::string state_path = state_file.string();
  const std::string text = read_small_file(state_file);
  verify_state_checksum(dir, text);
  nlohmann::json state;
  try {
    state = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(state_path + ": not valid JSON (" + e.what() + ")");
  }
  FP8LM_INPUT_CHECK(state.is_object(), state_path, ": not a JSON object");
  FP8LM_INPUT_CHECK(state.value("format", nlohmann::json()) == "fp8lm-checkpoint", state_path,
                    ": not an fp8lm checkpoint (key \"format\" is not \"fp8lm-checkpoint\")");
  CheckpointManifest manifest;
  manifest.dir = dir.string();
  const uint64_t version = manifest_count(state, state_path, "/version");
  FP8LM_INPUT_CHECK(version >= kOldestReadableVersion && version <= kFormatVersion, state_path,
                    ": unsupported checkpoint version ", version, " (this fp8lm reads versions ", kOldestReadableVersion,
                    " to ", kFormatVersion, ")");
  manifest.version = static_cast<int>(version);
  const uint64_t iteration = manifest_count(state, state_path, "/iteration");
  const uint64_t skipped = state.contains("skipped_steps") ? manifest_count(state, state_path, "/skipped_steps") : 0;
  FP8LM_INPUT_CHECK(iteration <= uint64_t{INT64_MAX} && skipped <= uint64_t{INT64_MAX}, state_path,
                    ": iteration or skipped_steps out of range");
  manifest.progress.iteration = static_cast<int64_t>(iteration);
  manifest.progress.skipped_steps = static_cast<int64_t>(skipped);
  manifest.progress.consumed_samples = manifest_count(state, state_path, "/consumed_samples");
  manifest.progress.data.epoch = manifest_count(state, state_path, "/data_position/epoch");
  manifest.progress.data.next_sample = manifest_count(state, state_path, "/data_position/next_sample");
  if (state.contains(nlohmann::json::json_pointer("/rng/seed"))) {
    manifest.seed = manifest_count(state, state_path, "/rng/seed");
  } else if (state.contains(nlohmann::json::json_pointer("/args/seed"))) {
    manifest.seed = manifest_count(state, state_path, "/args/seed");
  }
  manifest.config = parse_gpt_config(manifest_field(state, state_path, "/config"), state_path);
  manifest.config.name = state.contains("config_name") ? manifest_string(state, state_path, "/config_name")
                                                       : std::string("checkpoint");
  manifest.precision = state.contains("precision") ? manifest_string(state, state_path, "/precision") : "?";
  manifest.fp8 = saved_fp8_settings(state, state_path);
  manifest.optimizer = saved_optimizer_settings(state, state_path);

  const nlohmann::json& files = manifest_field(state, state_path, "/files");
  FP8LM_INPUT_CHECK(files.is_object(), state_path, ": key \"files\" must be an object of file records");
  for (const auto& [name, record] : files.items()) {
    // Only the names a save writes: a manifest never sends the reader outside its directory.
    FP8LM_INPUT_CHECK(name == kModelFile || name == kOptimizerFile || name == kScalingFile, state_path,
                      ": key \"files\" records an unknown file \"", name, "\"");
    FP8LM_INPUT_CHECK(record.is_object(), state_path, ": key \"files/", name, "\" must be an object");
    if (verify_data) verify_data_file(dir, name, state, state_path);
    manifest.files.push_back(name);
  }
  // A checkpoint written under --no-save-optim says so; any other lacks nothing.
  if (state.contains("optimizer_saved")) {
    const nlohmann::json& saved = state["optimizer_saved"];
    FP8LM_INPUT_CHECK(saved.is_boolean(), state_path, ": key \"optimizer_saved\" must be true or false");
    manifest.optimizer_saved = saved.get<bool>();
  }
  for (const char* required : {kModelFile, kOptimizerFile}) {
    if (required == std::string(kOptimizerFile) && !manifest.optimizer_saved) continue;
    FP8LM_INPUT_CHECK(files.contains(required), state_path, ": key \"files\" does not record ", required,
                      " (not a complete checkpoint)");
  }
  return manifest;
}

bool records(const CheckpointManifest& manifest, const std::string& file) {
  return std::find(manifest.files.begin(), manifest.files.end(), file) != manifest.files.end();
}

// A resume restores the optimizer state unless --no-load-optim: a checkpoint saved without it
// (--no-save-optim) needs that flag, or --finetune, which takes the weights alone. fp8lm eval
// and fp8lm sample read no optimizer state.
void check_optimizer_loadable(const CheckpointManifest& manifest, const TrainOptions& options) {
  if (manifest.optimizer_saved || options.no_load_optim || options.command != RunCommand::train) return;
  throw InputError("--load " + manifest.dir + ": saved without its optimizer state (--no-save-optim)",
                   "pass --no-load-optim to resume from it with a fresh optimizer, or --finetune to start from its "
                   "weights at iteration 0");
}

// `dir` is what `path` resolved to; it must be a complete checkpoint.
CheckpointManifest read_resolved_checkpoint(const fs::path& dir, const std::string& path, bool verify_data) {
  if (!is_fp8lm_checkpoint(dir)) {
    // An iteration directory (named by `latest` or --ckpt-step), or a directory with weights:
    // a checkpoint that lost its manifest, or a Hugging Face model.
    if (fs::is_directory(dir) && (fs::exists(dir / kModelFile) || dir != fs::path(path)))
      throw InputError(dir.string() + ": not a complete fp8lm checkpoint (" + kStateFile +
                           ", its progress and checksums, is missing)",
                       "--init-from " + dir.string() + " starts a fresh run from its weights alone");
    throw InputError(path + ": not an fp8lm checkpoint (no `latest`, no " + kStateFile + ")",
                     "--load takes a --save directory or one of its iter_N directories; --init-from takes a Hugging "
                     "Face model");
  }
  return read_manifest(dir, verify_data);
}

// ".iter_0000100.tmp-<pid>" (staging) or ".iter_0000100.old-<pid>" (aside): hidden, and
// tagged with the saving process so a leftover is recognisable.
std::string leftover_name(const std::string& name, const char* kind) {
  return detail::concat(".", name, kind, ::getpid());
}

// The copy of iter_N that a save moved aside before moving the new one in (file systems
// without RENAME_EXCHANGE), if a kill between the two renames left it there.
std::optional<fs::path> aside_copy(const fs::path& root, const std::string& name) {
  const std::string prefix = "." + name + ".old-";
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(root, error)) {
    const bool aside = entry.path().filename().string().rfind(prefix, 0) == 0;
    if (aside && is_fp8lm_checkpoint(entry.path())) return entry.path();
  }
  return std::nullopt;
}

// Puts the complete directory `staged` at `final_dir` so that `final_dir` is, at every
// instant, the old complete checkpoint or the new one: `latest` may name it already (a
// resumed run re-saving an iteration).
void publish_directory(const fs::path& staged, const fs::path& final_dir, const SaveTestHooks& hooks) {
  const fs::path root = final_dir.parent_path();
  if (!fs::exists(final_dir)) {
    rename_durably(staged, final_dir);
    return;
  }
  if (!hooks.no_exchange) {
    if (::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      fsync_directory(root);
      crash_point(hooks, "after-exchange");
      std::error_code ignored;  // a leftover is removed by the next save
      fs::remove_all(staged, ignored);  // the old checkpoint, now under the staging name
      return;
    }
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
      throw_io_error(final_dir.string(), "exchanging it with " + staged.string(), errno);
  }
  // No atomic exchange here (NFS, for one): the old copy moves aside under a name that
  // resolve_checkpoint_dir falls back to while final_dir is missing.
  const fs::path aside = root / leftover_name(final_dir.filename().string(), ".old-");
  rename_durably(final_dir, aside);
  crash_point(hooks, "between-renames");
  rename_durably(staged, final_dir);
  std::error_code ignored;  // a leftover is removed by the next save
  fs::remove_all(aside, ignored);
}

// The iteration number a `latest` file holds (digits, with whitespace after them), or nullopt.
std::optional<int64_t> iteration_in_latest(const fs::path& latest) {
  std::string text = read_small_file(latest);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  const bool digits = !text.empty() && text.size() <= 18 &&
                      std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (!digits) return std::nullopt;
  return std::stoll(text);
}

// What killed saves leave: staging directories and aside copies. Called once `latest`
// names the new checkpoint, so none of them is needed any more; the save lock keeps other
// runs' saves out of this directory.
void remove_stale_save_directories(const fs::path& root) {
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(root, error)) {
    const std::string name = entry.path().filename().string();
    const bool leftover = name.find(".tmp-") != std::string::npos || name.find(".old-") != std::string::npos;
    if (name.rfind(".iter_", 0) != 0 || !leftover) continue;
    std::error_code remove_error;
    fs::remove_all(entry.path(), remove_error);
    if (remove_error)
      spdlog::warn("{}: cannot remove this leftover of an interrupted save ({})", entry.path().string(),
                   remove_error.message());
    else
      spdlog::info("removed {}, left by an interrupted save", entry.path().string());
  }
}

// An iteration directory (state.json), or a --save root: `latest` beside iter_* directories.
bool is_checkpoint_directory(const fs::path& dir) {
  std::error_code error;
  if (fs::is_regular_file(dir / kStateFile, error)) return true;
  if (!fs::is_regular_file(dir / kLatestFile, error)) return false;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, error)) {
    if (entry.path().filename().string().rfind("iter_", 0) == 0 && entry.is_directory(error)) return true;
  }
  return false;
}

std::string read_lock_holder(int fd) {
  char buffer[256] = {};
  const ssize_t got = ::pread(fd, buffer, sizeof buffer - 1, 0);
  std::string holder = got > 0 ? std::string(buffer, static_cast<size_t>(got)) : std::string();
  while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
  return holder.empty() ? "a process that has not yet written its pid and host" : holder;
}

}  // namespace

void write_file_durably(const std::string& path, const std::string& text) {
  const std::string temporary = path + ".tmp";
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw_io_error(temporary, "creating", errno);
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(fd, text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error_number = errno;
      ::close(fd);
      ::unlink(temporary.c_str());
      throw_io_error(temporary, "writing", error_number);
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int error_number = errno;
    ::close(fd);
    ::unlink(temporary.c_str());
    throw_io_error(temporary, "fsync", error_number);
  }
  if (::close(fd) != 0) {
    const int error_number = errno;
    ::unlink(temporary.c_str());
    throw_io_error(temporary, "closing", error_number);
  }
  const fs::path target(path);
  rename_durably(temporary, target.has_parent_path() ? target : fs::path(".") / target);
}

SaveDirectoryLock::SaveDirectoryLock(const std::string& dir) {
  std::error_code error;
  fs::create_directories(dir, error);
  FP8LM_INPUT_CHECK(!error, "--save ", dir, ": cannot create the directory (", error.message(), ")");
  const std::string path = (fs::path(dir) / kLockFile).string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  FP8LM_INPUT_CHECK(fd_ >= 0, "--save ", dir, ": cannot create the lock file ", path, " (", std::strerror(errno), ")");
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error_number = errno;
    if (error_number == EWOULDBLOCK) {
      const std::string holder = read_lock_holder(fd_);
      ::close(fd_);
      fd_ = -1;
      throw InputError("--save " + dir + ": another fp8lm run is saving into this directory (" + holder + ", lock " +
                           path + ")",
                       "wait for it to end, or give this run another --save directory");
    }
    // A file system without locks (some NFS setups): say so rather than pretend.
    spdlog::warn("--save {}: cannot lock {} ({}); make sure no other run saves into this directory", dir, path,
                 std::strerror(error_number));
    return;
  }
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "unknown");
  const std::string holder = "pid " + std::to_string(::getpid()) + " on host " + host + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, holder.data(), holder.size(), 0) != ssize_t(holder.size()))
    spdlog::warn("{}: cannot record this run's pid and host in the lock file ({})", path, std::strerror(errno));
}

SaveDirectoryLock::~SaveDirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

std::string resolve_checkpoint_dir(const std::string& path, std::optional<int64_t> step) {
  const fs::path root(path);
  FP8LM_INPUT_CHECK(fs::exists(root), path, ": no such checkpoint directory or file");
  if (step) {
    const fs::path dir = root / iteration_dir_name(*step);
    FP8LM_INPUT_CHECK(fs::is_directory(dir), dir.string(), ": no checkpoint for --ckpt-step ", *step);
    return dir.string();
  }
  const fs::path latest = root / kLatestFile;
  if (!fs::exists(latest)) return root.string();  // a checkpoint directory itself, or a Hugging Face model
  const std::optional<int64_t> latest_iteration = iteration_in_latest(latest);
  FP8LM_INPUT_CHECK(latest_iteration.has_value(), latest.string(), ": does not hold an iteration number");
  const int64_t iteration = *latest_iteration;
  const std::string name = iteration_dir_name(iteration);
  const fs::path dir = root / name;
  if (fs::is_directory(dir)) return dir.string();
  if (const std::optional<fs::path> aside = aside_copy(root, name)) {
    spdlog::warn("{} names iteration {}, but {} is missing: a save was killed between its two renames; using the "
                 "previous copy {}",
                 latest.string(), iteration, dir.string(), aside->string());
    return aside->string();
  }
  throw InputError(detail::concat(latest.string(), " names iteration ", iteration, " but ", dir.string(),
                                  " does not exist"),
                   "--ckpt-step N resumes from another iteration");
}

CheckpointManifest read_checkpoint(const std::string& path, std::optional<int64_t> step, bool verify_data) {
  return read_resolved_checkpoint(resolve_checkpoint_dir(path, step), path, verify_data);
}

void check_export_directory(const std::string& to, const std::string& load, const CheckpointManifest& checkpoint) {
  const fs::path target = fs::weakly_canonical(to);
  const fs::path load_root = fs::weakly_canonical(load);
  const fs::path checkpoint_dir = fs::weakly_canonical(checkpoint.dir);
  const std::string hint = "give --to a directory outside every checkpoint directory";
  for (fs::path p = target;; p = p.parent_path()) {
    if (p == load_root || p == checkpoint_dir || is_checkpoint_directory(p)) {
      throw InputError("--to " + to + ": " + (p == target ? "is" : "lies inside") + " the checkpoint directory " +
                           p.string() + "; convert never writes into a checkpoint",
                       hint);
    }
    if (p == p.parent_path()) break;
  }
  std::vector<fs::path> inputs = {fs::path(checkpoint.dir) / kStateFile};
  for (const std::string& file : checkpoint.files) inputs.push_back(fs::path(checkpoint.dir) / file);
  for (const char* output : {kModelFile, "config.json"}) {
    const fs::path written = target / output;
    std::error_code error;
    for (const fs::path& input : inputs) {
      if (fs::exists(written) && fs::equivalent(written, input, error))
        throw InputError("--to " + to + ": " + written.string() + " is the checkpoint's own " + input.string() +
                             " (a link); convert never writes over its inputs",
                         hint);
    }
  }
}

void start_fresh_without_checkpoint(TrainOptions& options) {
  if (options.command != RunCommand::train || options.load_dir.empty() || options.save_dir.empty()) return;
  std::error_code error;
  const fs::path load = options.load_dir;
  // The same directory however spelled ("ckpt", "./ckpt/", a link), existing or not yet.
  auto normal = [](const fs::path& path) {
    std::error_code ignored;
    fs::path resolved = fs::weakly_canonical(path, ignored);
    return resolved.has_filename() ? resolved : resolved.parent_path();
  };
  const bool same = fs::exists(load, error) && fs::exists(options.save_dir, error)
                        ? fs::equivalent(load, options.save_dir, error)
                        : normal(load) == normal(options.save_dir);
  if (!same) return;
  if (fs::exists(load, error)) {
    if (!fs::is_directory(load, error) || is_checkpoint_directory(load)) return;
    for (const fs::directory_entry& entry : fs::directory_iterator(load, error)) {
      const std::string name = entry.path().filename().string();
      if (name == kLatestFile || name == kStateFile || name.rfind("iter_", 0) == 0) return;  // read_checkpoint judges
    }
  }
  if (options.ckpt_step)
    throw InputError("--load " + options.load_dir + ": no checkpoint there yet (--ckpt-step " +
                         std::to_string(*options.ckpt_step) + " names one)",
                     "leave out --ckpt-step to start from iteration 0 when --load is the --save directory");
  if (options.exit_on_missing_checkpoint)
    throw InputError("--load " + options.load_dir + ": no checkpoint there yet (--exit-on-missing-checkpoint)",
                     "leave out --exit-on-missing-checkpoint to start from iteration 0 when --load is the --save "
                     "directory");
  spdlog::warn("--load {}: no checkpoint there yet (it is the --save directory): training from iteration 0, as "
               "Megatron does; --exit-on-missing-checkpoint makes this an error",
               options.load_dir);
  options.load_dir.clear();
  options.use_checkpoint_lr_schedule = false;  // no schedule to take yet: the flags' (as in Megatron)
}

void adopt_resume_checkpoint(TrainOptions& options) {
  if (options.load_dir.empty()) return;
  const CheckpointManifest manifest = read_checkpoint(options.load_dir, options.ckpt_step, /*verify_data=*/false);
  check_optimizer_loadable(manifest, options);
  if (manifest.seed && *manifest.seed != options.seed) {
    spdlog::warn("--seed {} differs from the seed {} of the checkpoint {}; resuming with {} so the data order "
                 "continues where it stopped",
                 options.seed, *manifest.seed, manifest.dir, *manifest.seed);
    options.seed = *manifest.seed;
  }
  // The settings that wrote the checkpoint, for the flags left out: the run then resumes as it
  // was, whatever this build's defaults (which changed to Megatron-LM's).
  auto adopt = [&](const char* flag, auto& value, auto saved_value, auto describe) {
    if (options.given(flag) || value == saved_value) return;
    spdlog::info("{} not given: resuming with the checkpoint's {} (the default is {})", flag, describe(saved_value),
                 describe(value));
    value = saved_value;
  };
  auto real = [](double value) {  // the shortest text that reads back as the value
    char text[32];
    return std::string(text, std::to_chars(text, text + sizeof text, value).ptr);
  };
  auto style_name = [](LrDecayStyle style) { return std::string(to_string(style)); };
  const CheckpointManifest::OptimizerSettings& optimizer = manifest.optimizer;
  if (optimizer.lr_decay_style) adopt("--lr-decay-style", options.lr_decay_style, *optimizer.lr_decay_style, style_name);
  // A WSD schedule resumes with its anneal: the style's own flags, where they are left out.
  auto integer = [](int64_t value) { return std::to_string(value); };
  auto wsd_name = [](WsdDecayStyle style) { return std::string(to_string(style)); };
  auto take_wsd_anneal = [&](auto&& apply) {
    if (options.lr_decay_style != LrDecayStyle::wsd || optimizer.lr_decay_style != LrDecayStyle::wsd) return;
    if (optimizer.lr_wsd_decay_style)
      apply("--lr-wsd-decay-style", options.lr_wsd_decay_style, *optimizer.lr_wsd_decay_style, wsd_name);
    if (optimizer.lr_wsd_decay_iters)
      apply("--lr-wsd-decay-iters", options.lr_wsd_decay_iters, *optimizer.lr_wsd_decay_iters, integer);
    if (optimizer.lr_wsd_decay_samples)
      apply("--lr-wsd-decay-samples", options.lr_wsd_decay_samples, *optimizer.lr_wsd_decay_samples, integer);
  };
  take_wsd_anneal(adopt);
  if (optimizer.weight_decay) adopt("--weight-decay", options.weight_decay, *optimizer.weight_decay, real);
  if (optimizer.adam_beta2) adopt("--adam-beta2", options.adam_beta2, *optimizer.adam_beta2, real);
  if (options.use_checkpoint_lr_schedule) {
    FP8LM_INPUT_CHECK(optimizer.train_samples.value_or(0) == 0, manifest.dir,
                      ": the checkpoint's run counted its learning-rate schedule in samples (--train-samples), which "
                      "--use-checkpoint-opt_param-scheduler does not take; give the schedule's flags instead");
    FP8LM_INPUT_CHECK(optimizer.lr && optimizer.min_lr && optimizer.lr_warmup_iters && optimizer.lr_decay_iters &&
                          optimizer.lr_decay_style,
                      manifest.dir, ": the checkpoint does not record its learning-rate schedule, which "
                      "--use-checkpoint-opt_param-scheduler takes");
    auto take = [&](const char* flag, auto& value, auto saved_value, auto describe) {
      if (value != saved_value)
        spdlog::info("--use-checkpoint-opt_param-scheduler: {} {} (the checkpoint's) instead of {}", flag,
                     describe(saved_value), describe(value));
      value = saved_value;
    };
    take("--lr", options.lr, *optimizer.lr, real);
    take("--min-lr", options.min_lr, *optimizer.min_lr, real);
    take("--lr-decay-style", options.lr_decay_style, *optimizer.lr_decay_style, style_name);
    take("--lr-decay-iters", options.lr_decay_iters, *optimizer.lr_decay_iters, integer);
    take("--lr-warmup-iters", options.lr_warmup_iters, *optimizer.lr_warmup_iters, integer);
    if (optimizer.lr_warmup_init) take("--lr-warmup-init", options.lr_warmup_init, *optimizer.lr_warmup_init, real);
    options.lr_warmup_fraction = optimizer.lr_warmup_fraction;
    take_wsd_anneal(take);
    // Megatron's scheduler state holds the weight-decay schedule too.
    if (optimizer.weight_decay_incr_style) {
      auto incr_name = [](WeightDecayIncrStyle style) { return std::string(to_string(style)); };
      take("--weight-decay-incr-style", options.weight_decay_incr_style, *optimizer.weight_decay_incr_style,
           incr_name);
      options.start_weight_decay = optimizer.start_weight_decay;
      options.end_weight_decay = optimizer.end_weight_decay;
    }
  }
  if (!manifest.fp8 || !options.fp8_enabled()) return;
  const CheckpointManifest::Fp8Settings& saved = *manifest.fp8;
  auto number = [](int value) { return std::to_string(value); };
  auto algo_name = [](AmaxComputeAlgo algo) { return std::string(to_string(algo)); };
  auto recipe_name = [](ScalingRecipe recipe) { return std::string(to_string(recipe)); };
  if (saved.recipe) adopt("--fp8-recipe", options.fp8.recipe, *saved.recipe, recipe_name);
  adopt("--fp8-amax-history-len", options.fp8.amax_history_len, saved.amax_history_len, number);
  adopt("--fp8-amax-compute-algo", options.fp8.amax_compute_algo, saved.amax_compute_algo, algo_name);
  // The three BF16-layer flags go together: they decide which blocks have FP8 scaling states.
  const bool layers_given = options.given("--first-last-layers-bf16") ||
                            options.given("--num-layers-at-start-in-bf16") ||
                            options.given("--num-layers-at-end-in-bf16");
  const int saved_start = saved.first_last_layers_bf16 ? saved.num_layers_at_start_in_bf16 : 0;
  const int saved_end = saved.first_last_layers_bf16 ? saved.num_layers_at_end_in_bf16 : 0;
  if (!layers_given && (options.bf16_layers_at_start() != saved_start || options.bf16_layers_at_end() != saved_end)) {
    spdlog::info("--first-last-layers-bf16 not given: resuming with the checkpoint's BF16 layers ({})",
                 saved.first_last_layers_bf16 ? "first " + number(saved_start) + ", last " + number(saved_end)
                                              : std::string("none"));
    options.first_last_layers_bf16 = saved.first_last_layers_bf16;
    options.num_layers_at_start_in_bf16 = saved.num_layers_at_start_in_bf16;
    options.num_layers_at_end_in_bf16 = saved.num_layers_at_end_in_bf16;
  }
  // The blocks --bf16-blocks named and --fp8-auto-precision switched: a switched block stays BF16.
  if (!options.given("--bf16-blocks") && options.bf16_blocks != saved.bf16_blocks) {
    spdlog::info("--bf16-blocks not given: resuming with the checkpoint's BF16 blocks ({})",
                 saved.bf16_blocks.empty() ? std::string("none") : block_list_text(saved.bf16_blocks));
    options.bf16_blocks = saved.bf16_blocks;
  }
}

std::optional<GptConfig> stored_model_config(const std::string& path, std::optional<int64_t> step) {
  const fs::path dir = resolve_checkpoint_dir(path, step);
  if (is_fp8lm_checkpoint(dir)) return read_manifest(dir, /*verify_data=*/false).config;
  const fs::path hf_dir = fs::is_regular_file(dir) ? dir.parent_path() : dir;
  if (fs::is_regular_file(hf_dir / "config.json")) {
    GptConfig config = load_gpt_config((hf_dir / "config.json").string());
    return config;
  }
  return std::nullopt;
}

std::string save_checkpoint(const std::string& dir, const RunSetup& setup, TrainingEngine& engine,
                            const TrainingProgress& progress) {
  const fs::path root(dir);
  const std::string name = iteration_dir_name(progress.iteration);
  const fs::path final_dir = root / name;
  // Every rank gathers the whole tensors (collective); the first rank writes them, and the
  // others wait until the checkpoint is complete.
  const TensorLayout& layout = engine.layout();
  const std::vector<float> parameters = engine.parameters();
  // --no-save-optim: the AdamW moments are left out (the master weights are the model file's).
  const bool with_optimizer = !setup.options.no_save_optim;
  OptimizerSnapshot optimizer;
  if (with_optimizer) optimizer = engine.optimizer_state();
  std::optional<ScalingSnapshot> scaling;
  if (setup.options.fp8_enabled()) scaling = engine.scaling_state();
  Communicator& world = engine.host_groups().world();
  if (world.rank() != 0) {
    world.barrier();
    return final_dir.string();
  }
  const SaveTestHooks hooks = save_test_hooks();

  std::error_code error;
  fs::create_directories(root, error);
  if (error) throw InputError("--save " + dir + ": cannot create the directory (" + error.message() + ")");
  const fs::path temporary = root / leftover_name(name, ".tmp-");
  fs::remove_all(temporary);
  fs::create_directories(temporary);

  // A failed save (a full disk, say) removes its staging directory: the space goes back,
  // and what `latest` names was never touched.
  try {
    write_model_file(temporary / kModelFile, layout, parameters, setup.model);
    std::vector<std::string> files = {kModelFile};
    if (with_optimizer) {
      SafetensorsWriter writer;
      add_optimizer_tensors(writer, layout, optimizer);
      writer.write((temporary / kOptimizerFile).string());
      files.push_back(kOptimizerFile);
    }
    if (scaling) {
      SafetensorsWriter writer;
      add_scaling_tensors(writer, *scaling);
      writer.write((temporary / kScalingFile).string());
      files.push_back(kScalingFile);
    }
    crash_point(hooks, "files-written");

    nlohmann::json state = {{"format", "fp8lm-checkpoint"},
                            {"version", kFormatVersion},
                            {"iteration", progress.iteration},
                            {"consumed_samples", progress.consumed_samples},
                            {"data_position",
                             {{"epoch", progress.data.epoch}, {"next_sample", progress.data.next_sample}}},
                            {"skipped_steps", progress.skipped_steps},
                            {"optimizer_saved", with_optimizer},
                            // fp8lm draws random numbers only at initialisation and for the data order,
                            // which the seed and the data position reproduce exactly.
                            {"rng", {{"seed", setup.options.seed}, {"data_position_is_the_state", true}}},
                            {"precision", std::string(to_string(setup.options.precision))},
                            {"config", to_hf_json(setup.model)},
                            {"config_name", setup.model.name},
                            {"args", options_json(setup.options)}};
    for (const std::string& file : files) {
      const fs::path path = temporary / file;
      state["files"][file] = {{"bytes", fs::file_size(path)}, {"crc32", file_crc32_hex(path.string())}};
    }
    const std::string state_text = state.dump(2) + "\n";
    write_file_durably((temporary / kStateFile).string(), state_text);
    write_file_durably((temporary / kStateChecksumFile).string(), state_checksum_record(state_text));
    fsync_directory(temporary);
    crash_point(hooks, "staged");
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(temporary, ignored);
    throw;
  }

  // Publish: the complete directory takes the final name, then `latest` moves.
  // -1: no `latest` before this save (or one naming no iteration).
  const int64_t previous =
      fs::is_regular_file(root / kLatestFile) ? iteration_in_latest(root / kLatestFile).value_or(-1) : -1;
  publish_directory(temporary, final_dir, hooks);
  crash_point(hooks, "published");
  write_file_durably((root / kLatestFile).string(), std::to_string(progress.iteration) + "\n");
  remove_stale_save_directories(root);
  // Megatron's --save-retain-interval: the checkpoint `latest` named before goes, now that the
  // new one is complete, unless it is one the interval keeps.
  const int64_t retain = setup.options.save_retain_interval;
  if (retain > 0 && previous >= 0 && previous != progress.iteration && previous % retain != 0) {
    const fs::path old_dir = root / iteration_dir_name(previous);
    std::error_code error;
    if (is_fp8lm_checkpoint(old_dir)) fs::remove_all(old_dir, error);
    if (error)
      spdlog::warn("{}: cannot remove it ({}), though --save-retain-interval {} does not keep it", old_dir.string(),
                   error.message(), retain);
    else
      spdlog::info("removed {}: --save-retain-interval {} keeps every {}-th iteration and the latest",
                   old_dir.string(), retain, retain);
  }
  spdlog::info("saved checkpoint {} (iteration {})", final_dir.string(), progress.iteration);
  world.barrier();
  return final_dir.string();
}

TrainingStateSnapshot snapshot_training_state(TrainingEngine& engine, bool fp8) {
  TrainingStateSnapshot state;
  state.parameters = engine.parameters();
  state.optimizer = engine.optimizer_state();
  if (fp8) state.scaling = engine.scaling_state();
  state.skipped_steps = engine.skip_status().total;
  return state;
}

void restore_training_state(TrainingEngine& engine, const TrainingStateSnapshot& state) {
  // load_into_engine's order: parameters, optimizer, scaling, skips.
  std::optional<ScalingSnapshot> scaling;
  if (state.scaling) {
    const ScalingSnapshot expected = engine.scaling_state();
    if (state.scaling->names == expected.names && state.scaling->dtypes == expected.dtypes) {
      scaling = state.scaling;
    } else if (!expected.names.empty()) {
      scaling = match_scaling_by_name(*state.scaling, expected);
    }
  }
  engine.set_parameters(state.parameters);
  engine.set_optimizer_state(state.optimizer);
  if (scaling) engine.set_scaling_state(*scaling);
  engine.set_total_skips(state.skipped_steps);
}

InferenceWeights read_inference_weights(const std::string& path, std::optional<int64_t> step,
                                        const TensorLayout& layout, const GptConfig& config, bool fp8,
                                        const ScalingSnapshot& expected_scaling) {
  InferenceWeights weights;
  weights.params.assign(layout.total_elements(), 0.0f);
  const fs::path resolved = resolve_checkpoint_dir(path, step);
  if (!is_fp8lm_checkpoint(resolved)) {
    const fs::path file = hf_model_file(resolved.string());
    FP8LM_INPUT_CHECK(fs::is_regular_file(file), path,
                      ": neither an fp8lm checkpoint (state.json) nor a Hugging Face model (model.safetensors)");
    load_hf_parameters(SafetensorsFile::open(file.string()), layout, config, weights.params.data());
    weights.path = file.string();
    return weights;
  }
  const CheckpointManifest manifest = read_resolved_checkpoint(resolved, path, /*verify_data=*/true);
  const fs::path dir(manifest.dir);
  const GptConfig& stored = manifest.config;
  check_checkpoint_model(stored, config, (dir / kStateFile).string(), "--config's");
  load_hf_parameters(SafetensorsFile::open((dir / kModelFile).string()), layout, config, weights.params.data());
  if (fp8 && records(manifest, kScalingFile))
    weights.scaling =
        read_scaling_state(SafetensorsFile::open((dir / kScalingFile).string()), expected_scaling, manifest.version);
  weights.path = manifest.dir;
  return weights;
}

LoadedState load_into_engine(const std::string& path, std::optional<int64_t> step, const RunSetup& setup,
                             TrainingEngine& engine, CheckpointUse use) {
  const TensorLayout& layout = engine.layout();
  LoadedState loaded;
  std::vector<float> params(layout.total_elements(), 0.0f);

  const fs::path resolved = resolve_checkpoint_dir(path, step);
  if (use == CheckpointUse::weights_only && !is_fp8lm_checkpoint(resolved)) {
    // A Hugging Face GPT-2 model: weights only; optimizer and FP8 scaling start fresh
    // (the first FP8 step takes its scales from the tensors themselves).
    const fs::path file = hf_model_file(resolved.string());
    FP8LM_INPUT_CHECK(fs::is_regular_file(file), path,
                      ": neither an fp8lm checkpoint (state.json) nor a Hugging Face model (model.safetensors)");
    const SafetensorsFile model = SafetensorsFile::open(file.string());
    load_hf_parameters(model, layout, setup.model, params.data());
    engine.set_parameters(params);
    loaded.path = file.string();
    spdlog::info("initialised from Hugging Face GPT-2 weights {}; optimizer and FP8 scaling start fresh",
                 file.string());
    return loaded;
  }

  const CheckpointManifest manifest = read_resolved_checkpoint(resolved, path, /*verify_data=*/true);
  const fs::path dir(manifest.dir);
  const std::string state_path = (dir / kStateFile).string();
  loaded.path = manifest.dir;
  const GptConfig& stored = manifest.config;
  check_checkpoint_model(stored, setup.model, state_path, "this run's config");

  // Read and check everything before the engine changes.
  const SafetensorsFile model = SafetensorsFile::open((dir / kModelFile).string());
  load_hf_parameters(model, layout, setup.model, params.data());
  if (use == CheckpointUse::weights_only) {
    engine.set_parameters(params);
    spdlog::info("initialised from the weights of checkpoint {}; optimizer, FP8 scaling and progress start fresh",
                 manifest.dir);
    return loaded;
  }
  check_optimizer_loadable(manifest, setup.options);
  std::optional<OptimizerSnapshot> optimizer;
  if (!setup.options.no_load_optim)
    optimizer = read_optimizer_state(SafetensorsFile::open((dir / kOptimizerFile).string()), layout,
                                     setup.options.optimizer_state);
  std::optional<ScalingSnapshot> scaling;
  if (setup.options.fp8_enabled()) {
    if (records(manifest, kScalingFile)) {
      const SafetensorsFile scaling_file = SafetensorsFile::open((dir / kScalingFile).string());
      scaling = read_scaling_state(scaling_file, engine.scaling_state(), manifest.version);
    } else {
      spdlog::info("{}: no FP8 scaling state (a BF16 run); FP8 starts with empty amax histories", dir.string());
    }
  }

  engine.set_parameters(params);
  if (optimizer) engine.set_optimizer_state(*optimizer);  // else the engine's fresh state
  if (scaling) engine.set_scaling_state(*scaling);
  loaded.resumed = true;
  loaded.progress = manifest.progress;
  engine.set_total_skips(loaded.progress.skipped_steps);
  spdlog::info("resumed from {} at iteration {} ({} precision checkpoint{})", dir.string(), loaded.progress.iteration,
               manifest.precision, optimizer ? "" : "; the optimizer starts fresh: --no-load-optim");
  return loaded;
}

}  // namespace fp8lm
