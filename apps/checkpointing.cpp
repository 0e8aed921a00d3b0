#include "apps/checkpointing.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/checksum.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "layers/gpt.h"
#include "layers/gpt_hf.h"
#include "parallel/communicator.h"

namespace fp8lm {

namespace fs = std::filesystem;

namespace {

constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kScalingFile = "fp8_scaling.safetensors";
constexpr const char* kStateFile = "state.json";
// Version 2 stores the amax history [history, states] (Transformer Engine's layout);
// version 1 stored it [states, history] and is converted when loaded.
constexpr int kFormatVersion = 2;
constexpr int kOldestReadableVersion = 1;

std::string iteration_dir_name(int64_t iteration) {
  char name[32];
  std::snprintf(name, sizeof name, "iter_%07lld", static_cast<long long>(iteration));
  return name;
}

// Writes `text` to `path` through a temporary file and a rename: never half-written.
void write_text_atomically(const fs::path& path, const std::string& text) {
  const fs::path temporary = path.string() + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << text;
    out.flush();
    if (!out.good()) throw RuntimeError(temporary.string() + ": write failed", "check free disk space");
  }
  std::error_code error;
  fs::rename(temporary, path, error);
  if (error) throw RuntimeError(path.string() + ": rename failed: " + error.message());
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
          {"optimizer_state_precision", std::string(to_string(o.optimizer_state))},
          {"micro_batch_size", o.micro_batch_size},
          {"global_batch_size", o.global_batch_size},
          {"seq_length", o.seq_length},
          {"lr", o.lr},
          {"min_lr", o.min_lr},
          {"lr_warmup_iters", o.lr_warmup_iters},
          {"lr_decay_iters", o.lr_decay_iters},
          {"lr_decay_style", std::string(to_string(o.lr_decay_style))},
          {"train_iters", o.train_iters},
          {"weight_decay", o.weight_decay},
          {"adam_beta1", o.adam_beta1},
          {"adam_beta2", o.adam_beta2},
          {"adam_eps", o.adam_eps},
          {"clip_grad", o.clip_grad},
          {"max_skipped_steps", o.max_skipped_steps},
          {"seed", o.seed},
          {"train_data_path", o.train_data_path},
          {"valid_data_path", o.valid_data_path},
          {"data_path", o.data_path},
          {"split", o.split},
          {"mock_data", o.mock_data},
          {"save", o.save_dir},
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

// The stored scaling state when it matches the run's operands exactly; otherwise none
// (with the reason logged), and the run starts with an empty history.
std::optional<ScalingSnapshot> read_scaling_state(const SafetensorsFile& file, const ScalingSnapshot& expected,
                                                  int version) {
  const auto& meta = file.metadata();
  FP8LM_INPUT_CHECK(meta.count("names") && meta.count("dtypes") && meta.count("initialized"), file.path(),
                    ": missing FP8 scaling metadata");
  ScalingSnapshot state;
  try {
    state.names = nlohmann::json::parse(meta.at("names")).get<std::vector<std::string>>();
    for (const std::string& d : nlohmann::json::parse(meta.at("dtypes")).get<std::vector<std::string>>())
      state.dtypes.push_back(d == "e4m3" ? Fp8Dtype::e4m3 : Fp8Dtype::e5m2);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(file.path() + ": bad FP8 scaling metadata (" + e.what() + ")");
  }
  FP8LM_INPUT_CHECK(file.contains("amax_history"), file.path(), ": missing tensor \"amax_history\"");
  const auto& history = file.tensor("amax_history");
  const bool state_major = version < 2;  // version 1: [states, history]
  const int64_t states = int64_t(state.names.size());
  FP8LM_INPUT_CHECK(history.shape.size() == 2 && history.shape[state_major ? 0 : 1] == states, file.path(),
                    ": amax_history shape does not match its names");
  state.history_len = static_cast<int>(history.shape[state_major ? 1 : 0]);
  if (state.names != expected.names || state.dtypes != expected.dtypes || state.history_len != expected.history_len) {
    spdlog::warn("{}: FP8 scaling state is for other operands, formats or history length; starting it afresh",
                 file.path());
    return std::nullopt;
  }
  const int64_t S = static_cast<int64_t>(state.names.size());
  state.history = read_as_float(history);
  if (state_major) state.history = history_from_state_major(state.history, int(S), state.history_len);
  state.scale = read_as_float(expect_tensor(file, "scale", SafetensorsDtype::F32, {S}));
  state.scale_inv = read_as_float(expect_tensor(file, "scale_inv", SafetensorsDtype::F32, {S}));
  state.initialized = meta.at("initialized") == "1";
  return state;
}

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

nlohmann::json read_json(const fs::path& path) {
  std::ifstream file(path);
  FP8LM_INPUT_CHECK(file.good(), path.string(), ": cannot open");
  try {
    return nlohmann::json::parse(file);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(path.string() + ": not valid JSON (" + e.what() + ")");
  }
}

// Verifies each file's size and CRC-32 against state.json before anything is read.
void verify_files(const fs::path& dir, const nlohmann::json& state) {
  FP8LM_INPUT_CHECK(state.contains("files") && state["files"].is_object(), (dir / kStateFile).string(),
                    ": no file checksums recorded");
  for (const auto& [name, record] : state["files"].items()) {
    const fs::path file = dir / name;
    FP8LM_INPUT_CHECK(fs::is_regular_file(file), file.string(), ": missing from the checkpoint");
    const uint64_t bytes = record.at("bytes").get<uint64_t>();
    FP8LM_INPUT_CHECK(fs::file_size(file) == bytes, file.string(), ": size ", fs::file_size(file),
                      " bytes, the checkpoint recorded ", bytes, " (truncated or replaced)");
    FP8LM_INPUT_CHECK(file_crc32_hex(file.string()) == record.at("crc32").get<std::string>(), file.string(),
                      ": checksum mismatch (the file is corrupt)");
  }
}

}  // namespace

std::string resolve_checkpoint_dir(const std::string& path, std::optional<int64_t> step) {
  const fs::path root(path);
  FP8LM_INPUT_CHECK(fs::exists(root), path, ": no such checkpoint directory or file");
  if (step) {
    const fs::path dir = root / iteration_dir_name(*step);
    FP8LM_INPUT_CHECK(fs::is_directory(dir), dir.string(), ": no checkpoint for --ckpt-step ", *step);
    return dir.string();
  }
  const fs::path latest = root / "latest";
  if (fs::is_regular_file(latest)) {
    std::ifstream file(latest);
    long long iteration = -1;
    file >> iteration;
    FP8LM_INPUT_CHECK(iteration >= 0, latest.string(), ": does not hold an iteration number");
    const fs::path dir = root / iteration_dir_name(iteration);
    FP8LM_INPUT_CHECK(fs::is_directory(dir), latest.string(), " names iteration ", iteration, " but ", dir.string(),
                      " does not exist");
    return dir.string();
  }
  return root.string();  // a checkpoint directory itself, or a Hugging Face model
}

std::optional<GptConfig> stored_model_config(const std::string& path, std::optional<int64_t> step) {
  const fs::path dir = resolve_checkpoint_dir(path, step);
  if (is_fp8lm_checkpoint(dir)) {
    const nlohmann::json state = read_json(dir / kStateFile);
    FP8LM_INPUT_CHECK(state.contains("config"), (dir / kStateFile).string(), ": no model config");
    GptConfig config = parse_gpt_config(state["config"], (dir / kStateFile).string());
    config.name = state.value("config_name", std::string("checkpoint"));
    return config;
  }
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
  const OptimizerSnapshot optimizer = engine.optimizer_state();
  std::optional<ScalingSnapshot> scaling;
  if (setup.options.fp8_enabled()) scaling = engine.scaling_state();
  Communicator& world = engine.host_groups().world();
  if (world.rank() != 0) {
    world.barrier();
    return final_dir.string();
  }

  std::error_code error;
  fs::create_directories(root, error);
  if (error) throw InputError("--save " + dir + ": cannot create the directory (" + error.message() + ")");
  const fs::path temporary = root / ("." + name + ".tmp-" + std::to_string(::getpid()));
  fs::remove_all(temporary);
  fs::create_directories(temporary);

  write_model_file(temporary / kModelFile, layout, parameters, setup.model);
  {
    SafetensorsWriter writer;
    add_optimizer_tensors(writer, layout, optimizer);
    writer.write((temporary / kOptimizerFile).string());
  }
  std::vector<std::string> files = {kModelFile, kOptimizerFile};
  if (scaling) {
    SafetensorsWriter writer;
    add_scaling_tensors(writer, *scaling);
    writer.write((temporary / kScalingFile).string());
    files.push_back(kScalingFile);
  }

  nlohmann::json state = {{"format", "fp8lm-checkpoint"},
                          {"version", kFormatVersion},
                          {"iteration", progress.iteration},
                          {"consumed_samples", progress.consumed_samples},
                          {"data_position", {{"epoch", progress.data.epoch}, {"next_sample", progress.data.next_sample}}},
                          {"skipped_steps", progress.skipped_steps},
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
  write_text_atomically(temporary / kStateFile, state.dump(2) + "\n");

  // Publish: the complete directory takes the final name, then `latest` moves.
  if (fs::exists(final_dir)) {
    const fs::path old = root / ("." + name + ".old-" + std::to_string(::getpid()));
    fs::rename(final_dir, old);
    fs::rename(temporary, final_dir);
    fs::remove_all(old);
  } else {
    fs::rename(temporary, final_dir);
  }
  write_text_atomically(root / "latest", std::to_string(progress.iteration) + "\n");
  spdlog::info("saved checkpoint {} (iteration {})", final_dir.string(), progress.iteration);
  world.barrier();
  return final_dir.string();
}

LoadedState load_into_engine(const std::string& path, std::optional<int64_t> step, const RunSetup& setup,
                             TrainingEngine& engine) {
  const fs::path dir = resolve_checkpoint_dir(path, step);
  const TensorLayout& layout = engine.layout();
  LoadedState loaded;
  loaded.path = dir.string();
  std::vector<float> params(layout.total_elements(), 0.0f);

  if (!is_fp8lm_checkpoint(dir)) {
    // A Hugging Face GPT-2 model: weights only; optimizer and FP8 scaling start fresh
    // (the first FP8 step takes its scales from the tensors themselves).
    const fs::path file = hf_model_file(dir.string());
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

  const nlohmann::json state = read_json(dir / kStateFile);
  const std::string state_path = (dir / kStateFile).string();
  FP8LM_INPUT_CHECK(state.value("format", "") == "fp8lm-checkpoint", state_path, ": not an fp8lm checkpoint");
  const int version = state.value("version", 0);
  FP8LM_INPUT_CHECK(version >= kOldestReadableVersion && version <= kFormatVersion, state_path,
                    ": unsupported checkpoint version ", version, " (this fp8lm reads versions ", kOldestReadableVersion,
                    " to ", kFormatVersion, ")");
  verify_files(dir, state);
  const GptConfig stored = parse_gpt_config(state.at("config"), state_path);
  FP8LM_INPUT_CHECK(stored.n_layer == setup.model.n_layer && stored.n_embd == setup.model.n_embd &&
                        stored.n_head == setup.model.n_head && stored.n_inner == setup.model.n_inner &&
                        stored.vocab_size == setup.model.vocab_size && stored.n_positions == setup.model.n_positions,
                    state_path, ": the checkpoint's model shape differs from this run's config");

  // Read and check everything before the engine changes.
  const SafetensorsFile model = SafetensorsFile::open((dir / kModelFile).string());
  load_hf_parameters(model, layout, setup.model, params.data());
  const SafetensorsFile optimizer_file = SafetensorsFile::open((dir / kOptimizerFile).string());
  const OptimizerSnapshot optimizer = read_optimizer_state(optimizer_file, layout, setup.options.optimizer_state);
  std::optional<ScalingSnapshot> scaling;
  if (setup.options.fp8_enabled()) {
    if (fs::is_regular_file(dir / kScalingFile)) {
      const SafetensorsFile scaling_file = SafetensorsFile::open((dir / kScalingFile).string());
      scaling = read_scaling_state(scaling_file, engine.scaling_state(), version);
    } else {
      spdlog::info("{}: no FP8 scaling state (a BF16 run); FP8 starts with empty amax histories", dir.string());
    }
  }

  engine.set_parameters(params);
  engine.set_optimizer_state(optimizer);
  if (scaling) engine.set_scaling_state(*scaling);
  loaded.resumed = true;
  loaded.progress.iteration = state.at("iteration").get<int64_t>();
  loaded.progress.consumed_samples = state.at("consumed_samples").get<uint64_t>();
  loaded.progress.data.epoch = state.at("data_position").at("epoch").get<uint64_t>();
  loaded.progress.data.next_sample = state.at("data_position").at("next_sample").get<uint64_t>();
  loaded.progress.skipped_steps = state.value("skipped_steps", int64_t{0});
  engine.set_total_skips(loaded.progress.skipped_steps);
  spdlog::info("resumed from {} at iteration {} ({} precision checkpoint)", dir.string(), loaded.progress.iteration,
               state.value("precision", std::string("?")));
  return loaded;
}

}  // namespace fp8lm
