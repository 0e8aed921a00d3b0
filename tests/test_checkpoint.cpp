// Checkpoints end to end on the CPU: bit-exact resume, the files and `latest`, loud
// failures on damaged checkpoints, Hugging Face import and export, precision switches
// and SIGTERM; and the guarantees of docs/RELIABILITY.md ("[reliability]"): kills at each
// point of a save, manifest checksums, incomplete checkpoints, the save lock, convert's
// output rules, a full disk and a resume with another seed.
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <nlohmann/json.hpp>

#include "apps/checkpointing.h"
#include "apps/cli.h"
#include "apps/engine.h"
#include "apps/run_setup.h"
#include "cli_testing.h"
#include "temp_dir.h"
#include "core/checksum.h"
#include "core/error.h"
#include "core/dtype.h"
#include "core/random.h"
#include "core/safetensors.h"
#include "layers/gpt.h"
#include "layers/gpt_hf.h"

using namespace fp8lm;
using Catch::Matchers::ContainsSubstring;
namespace fs = std::filesystem;

namespace {

using testing::TempDir;

const std::string kTiny = testing::source_path("configs/tiny.json");
const std::string kRun = "--config " + kTiny +
                         " --mock-data --device cpu --seq-length 32 --micro-batch-size 2 --global-batch-size 4 "
                         "--lr 1e-3 --lr-warmup-iters 2 --log-interval 1 --eval-interval 0 --eval-iters 0 "
                         "--log-level warn --train-iters 8 ";

std::vector<nlohmann::json> read_metrics(const std::string& path) {
  std::vector<nlohmann::json> lines;
  std::ifstream file(path);
  std::string line;
  while (std::getline(file, line)) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

std::string file_bytes(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(file), {});
}

testing::CommandResult run(const std::string& args) {
  auto result = testing::run_fp8lm(args);
  INFO("fp8lm " << args << "\n" << result.output);
  return result;
}

}  // namespace

TEST_CASE("resume is bit-exact: 8 steps straight equal 4, save, load, 4 more", "[checkpoint]") {
  for (const char* precision : {"--fp8-hybrid", "--bf16"}) {
    TempDir dir;
    INFO(precision);
    const std::string args = kRun + precision;
    REQUIRE(run(args + " --save " + (dir.file("straight")) + " --metrics-file " + (dir.file("straight.jsonl"))).exit_code == 0);
    REQUIRE(run(args + " --exit-interval 4 --save " + (dir.file("split")) + " --metrics-file " + (dir.file("split.jsonl")))
                .exit_code == 0);
    CHECK(file_bytes(dir.file("split/latest")) == "4\n");
    REQUIRE(run(args + " --load " + (dir.file("split")) + " --save " + (dir.file("split")) + " --metrics-file " +
                (dir.file("split.jsonl")))
                .exit_code == 0);

    const auto straight = read_metrics(dir.file("straight.jsonl"));
    const auto split = read_metrics(dir.file("split.jsonl"));
    REQUIRE(straight.size() == 8);
    REQUIRE(split.size() == 8);
    for (size_t i = 0; i < 8; ++i) {
      INFO("iteration " << i + 1);
      CHECK(split[i]["iter"] == straight[i]["iter"]);
      CHECK(split[i]["loss"].get<double>() == straight[i]["loss"].get<double>());  // to the last bit
      CHECK(split[i]["grad_norm"].get<double>() == straight[i]["grad_norm"].get<double>());
    }
    for (const char* file : {"model.safetensors", "optimizer.safetensors"})
      CHECK(file_bytes(dir.file(std::string("straight/iter_0000008/") + file)) ==
            file_bytes(dir.file(std::string("split/iter_0000008/") + file)));
    if (std::string(precision) == "--fp8-hybrid")
      CHECK(file_bytes(dir.file("straight/iter_0000008/fp8_scaling.safetensors")) ==
            file_bytes(dir.file("split/iter_0000008/fp8_scaling.safetensors")));
  }
}

TEST_CASE("a checkpoint directory: its files, latest, checksums, no temporaries", "[checkpoint]") {
  TempDir dir;
  REQUIRE(run(kRun + "--fp8-hybrid --save-interval 4 --save " + (dir.file("ck"))).exit_code == 0);
  CHECK(file_bytes(dir.file("ck/latest")) == "8\n");
  for (const char* iteration : {"iter_0000004", "iter_0000008"}) {
    const fs::path d = fs::path(dir.file("ck")) / iteration;
    for (const char* file : {"model.safetensors", "optimizer.safetensors", "fp8_scaling.safetensors", "state.json"})
      CHECK(fs::is_regular_file(d / file));
  }
  for (const auto& entry : fs::directory_iterator(dir.file("ck")))
    CHECK(entry.path().filename().string().find(".tmp") == std::string::npos);

  std::ifstream state_file(dir.file("ck/iter_0000008/state.json"));
  const auto state = nlohmann::json::parse(state_file);
  CHECK(state["iteration"] == 8);
  CHECK(state["consumed_samples"] == 32);  // 8 steps x global batch 4
  CHECK(state["config"]["n_embd"] == 64);
  CHECK(state["args"]["fp8_amax_history_len"] == 1);  // the default, Megatron-LM's
  CHECK(state["files"]["model.safetensors"]["crc32"].get<std::string>().size() == 8);

  // The weights are Hugging Face GPT-2 names and layout; E4M3 m and FP16 v in the optimizer file.
  const auto model = SafetensorsFile::open(dir.file("ck/iter_0000008/model.safetensors"));
  CHECK(model.tensor("h.0.attn.c_attn.weight").shape == std::vector<int64_t>{64, 192});  // Conv1D [in, out]
  CHECK(model.tensor("wte.weight").shape == std::vector<int64_t>{256, 64});
  const auto optimizer = SafetensorsFile::open(dir.file("ck/iter_0000008/optimizer.safetensors"));
  CHECK(optimizer.tensor("h.0.mlp.c_fc.weight.exp_avg").dtype == SafetensorsDtype::F8_E4M3);
  CHECK(optimizer.tensor("h.0.mlp.c_fc.weight.exp_avg_sq").dtype == SafetensorsDtype::F16);
  CHECK(optimizer.metadata().at("step_count") == "8");
  const auto scaling = SafetensorsFile::open(dir.file("ck/iter_0000008/fp8_scaling.safetensors"));
  // [history, states]: this step's amaxes are one contiguous row (checkpoint version 2).
  CHECK(scaling.tensor("amax_history").shape == std::vector<int64_t>{1, 24});
  CHECK(state["version"] == 2);

  // --ckpt-step picks an older iteration; --load without --config takes the stored one.
  const auto resumed = run("--mock-data --device cpu --seq-length 32 --micro-batch-size 2 --global-batch-size 4 "
                           "--fp8-hybrid --train-iters 5 --log-level info --eval-iters 0 --load " +
                           (dir.file("ck")) + " --ckpt-step 4");
  CHECK(resumed.exit_code == 0);
  CHECK_THAT(resumed.output, ContainsSubstring("at iteration 4"));
  CHECK_THAT(resumed.output, ContainsSubstring("iter      5/5"));
}

TEST_CASE("damaged checkpoints fail with the file named, and nothing is overwritten", "[checkpoint]") {
  TempDir dir;
  REQUIRE(run(kRun + "--fp8-hybrid --save " + (dir.file("ck"))).exit_code == 0);
  const fs::path iteration = fs::path(dir.file("ck")) / "iter_0000008";
  const std::string load = kRun + "--fp8-hybrid --train-iters 10 --save " + (dir.file("ck")) + " --load " + (dir.file("ck"));

  auto expect_failure = [&](const std::string& args, const std::string& phrase) {
    const std::string before = file_bytes(dir.file("ck/latest"));
    const auto result = run(args);
    CHECK(result.exit_code == 2);
    CHECK_THAT(result.output, ContainsSubstring(phrase));
    CHECK(file_bytes(dir.file("ck/latest")) == before);
    CHECK_FALSE(fs::exists(fs::path(dir.file("ck")) / "iter_0000009"));
  };
  SECTION("a flipped byte: checksum mismatch") {
    std::fstream file(iteration / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(-7, std::ios::end);
    file.put('\x5A');
    file.close();
    expect_failure(load, "model.safetensors: checksum mismatch");
  }
  SECTION("a truncated file") {
    fs::resize_file(iteration / "optimizer.safetensors", fs::file_size(iteration / "optimizer.safetensors") - 100);
    expect_failure(load, "optimizer.safetensors: size");
  }
  SECTION("a missing file") {
    fs::remove(iteration / "fp8_scaling.safetensors");
    expect_failure(load, "fp8_scaling.safetensors: missing from the checkpoint");
  }
  SECTION("state.json with a string where a number belongs: the file and the key named") {
    const fs::path state_path = iteration / "state.json";
    nlohmann::json state = nlohmann::json::parse(std::ifstream(state_path));
    state["data_position"]["epoch"] = "0";
    std::ofstream(state_path) << state.dump();
    // The checksum sidecar would refuse the edit first; without one (an older checkpoint)
    // the typed read names the key.
    fs::remove(iteration / "state.json.crc32");
    expect_failure(load, state_path.string() + ": key \"data_position/epoch\" must be a non-negative integer, not \"0\"");
  }
  SECTION("a broken latest") {
    std::ofstream(dir.file("ck/latest")) << "12\n";
    expect_failure(load, "latest names iteration 12");
  }
  SECTION("shapes that disagree with the config") {
    expect_failure(load + " --num-layers 3", "model shape differs from this run's config");
  }
  SECTION("no such step") { expect_failure(load + " --ckpt-step 7", "no checkpoint for --ckpt-step 7"); }
}

TEST_CASE("a Hugging Face GPT-2 safetensors file imports: Conv1D, prefix, BF16, tied head", "[checkpoint]") {
  TempDir dir;
  GptConfig config = load_gpt_config(kTiny);
  const TensorLayout layout = make_gpt_layout(config);
  std::vector<float> reference(layout.total_elements(), 0.0f);
  init_gpt_parameters(reference.data(), layout, config, 77);
  // What transformers would save: BF16, "transformer." names, Conv1D [in, out], the
  // tied lm_head, and the attention-mask buffers of older checkpoints.
  std::vector<std::vector<uint16_t>> storage;
  SafetensorsWriter writer;
  for (const HfTensor& t : to_hf_tensors(layout, reference.data(), config)) {
    auto& bits = storage.emplace_back(t.values.size());
    for (size_t i = 0; i < bits.size(); ++i) bits[i] = bf16_from_float(t.values[i]);
    writer.add_borrowed("transformer." + t.name, SafetensorsDtype::BF16, t.shape, bits.data(), bits.size() * 2);
    if (t.name == "wte.weight")
      writer.add_borrowed("lm_head.weight", SafetensorsDtype::BF16, t.shape, bits.data(), bits.size() * 2);
  }
  std::vector<uint16_t> mask(64 * 64, bf16_from_float(1.0f));
  writer.add_borrowed("transformer.h.0.attn.bias", SafetensorsDtype::BF16, {1, 1, 64, 64}, mask.data(), mask.size() * 2);
  fs::create_directories(dir.file("hf"));
  writer.write(dir.file("hf/model.safetensors"));
  std::ofstream(dir.file("hf/config.json")) << nlohmann::json(to_hf_json(config)).dump();

  const RunSetup setup = resolve_run_setup(
      parse_train_command_line({"--init-from", dir.file("hf"), "--mock-data", "--device", "cpu", "--fp8-hybrid"}).options);
  CHECK(setup.model.n_embd == 64);  // from the directory's config.json
  auto engine = make_engine(setup);
  const LoadedState loaded = load_into_engine(dir.file("hf"), std::nullopt, setup, *engine, CheckpointUse::weights_only);
  CHECK_FALSE(loaded.resumed);
  const std::vector<float> params = engine->parameters();
  for (const TensorInfo& t : layout.tensors()) {
    for (size_t i = 0; i < t.numel; ++i) {
      INFO(t.name << "[" << i << "]");
      REQUIRE(params[t.offset + i] == round_to_bf16(reference[t.offset + i]));
    }
  }
  // Fresh FP8 state: the first step uses current scaling, not scale 1.
  CHECK_FALSE(engine->scaling_state().initialized);
  CHECK(engine->optimizer_state().step_count == 0);

  // Training from it works, and a wrong shape names the file and tensor.
  CHECK(run(kRun + "--fp8-hybrid --train-iters 3 --init-from " + (dir.file("hf"))).exit_code == 0);
  const auto wrong = run(kRun + "--fp8-hybrid --train-iters 3 --hidden-size 128 --init-from " + (dir.file("hf")));
  CHECK(wrong.exit_code == 2);
  CHECK_THAT(wrong.output, ContainsSubstring("model.safetensors: tensor \"transformer.wte.weight\" has shape"));
}

TEST_CASE("precision switches both ways with loss continuity", "[checkpoint]") {
  TempDir dir;
  const std::string base = "--config " + kTiny +
                           " --mock-data --device cpu --seq-length 32 --micro-batch-size 4 --lr 3e-3 "
                           "--lr-warmup-iters 5 --log-interval 1 --eval-interval 0 --eval-iters 0 --log-level warn "
                           "--train-iters 60 --lr-decay-style constant ";
  struct Switch {
    const char* first;
    const char* second;
  };
  for (const Switch s : {Switch{"--bf16", "--fp8-hybrid"}, Switch{"--fp8-hybrid", "--bf16"},
                         Switch{"--fp8-hybrid --optimizer-state-precision fp32", "--fp8-hybrid"}}) {
    INFO(s.first << " -> " << s.second);
    const std::string name = std::to_string(std::hash<std::string>{}(std::string(s.first) + s.second));
    const std::string ck = dir.file(name), metrics = dir.file(name + ".jsonl");
    REQUIRE(run(base + s.first + " --exit-interval 40 --save " + ck + " --metrics-file " + metrics).exit_code == 0);
    REQUIRE(run(base + s.second + " --load " + ck + " --metrics-file " + metrics).exit_code == 0);
    const auto lines = read_metrics(metrics);
    REQUIRE(lines.size() == 60);
    CHECK(lines[40]["iter"] == 41);
    // Continuity: the first steps after the switch stay near the last steps before it
    // (mean of 5 vs 5, within 10%), and far below the initial loss.
    double before = 0, after = 0;
    for (int i = 35; i < 40; ++i) before += lines[i]["loss"].get<double>() / 5;
    for (int i = 40; i < 45; ++i) after += lines[i]["loss"].get<double>() / 5;
    CHECK(std::fabs(after - before) < 0.10 * before);
    CHECK(after < 0.7 * lines[0]["loss"].get<double>());
  }
}

TEST_CASE("SIGTERM finishes the step, saves a checkpoint and exits 0", "[checkpoint]") {
  TempDir dir;
  const std::string log = dir.file("run.log");
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    const std::string command = std::string(FP8LM_BINARY) + " " + kRun + "--train-iters 100000 --log-level info --save " +
                                (dir.file("ck")) + " > " + log + " 2>&1";
    execl("/bin/sh", "sh", "-c", ("exec " + command).c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // Wait until training runs, then stop it as a cluster scheduler would.
  bool started = false;
  for (int i = 0; i < 600 && !started; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    started = file_bytes(log).find("iter      1/") != std::string::npos;
  }
  REQUIRE(started);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  kill(child, SIGTERM);
  int status = 0;
  waitpid(child, &status, 0);
  INFO(file_bytes(log));
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK_THAT(file_bytes(log), ContainsSubstring("checkpoint saved"));
  const std::string latest = file_bytes(dir.file("ck/latest"));
  REQUIRE_FALSE(latest.empty());
  const long iteration = std::stol(latest);
  CHECK(iteration >= 1);
  CHECK(fs::is_regular_file(fs::path(dir.file("ck")) / ("iter_" + std::string(7 - std::to_string(iteration).size(), '0') +
                                                    std::to_string(iteration)) / "state.json"));
}

TEST_CASE("convert exports a Hugging Face GPT-2 model in BF16", "[checkpoint]") {
  TempDir dir;
  REQUIRE(run(kRun + "--fp8-hybrid --save " + (dir.file("ck"))).exit_code == 0);
  const auto result = run("convert --load " + (dir.file("ck")) + " --to " + (dir.file("hf")) + " --dtype bf16");
  REQUIRE(result.exit_code == 0);
  const auto model = SafetensorsFile::open(dir.file("hf/model.safetensors"));
  const auto& c_attn = model.tensor("transformer.h.1.attn.c_attn.weight");
  CHECK(c_attn.dtype == SafetensorsDtype::BF16);
  CHECK(c_attn.shape == std::vector<int64_t>{64, 192});
  CHECK(model.contains("transformer.wte.weight"));
  CHECK_FALSE(model.contains("lm_head.weight"));  // tied, as save_pretrained writes it
  std::ifstream config_file(dir.file("hf/config.json"));
  const auto config = nlohmann::json::parse(config_file);
  CHECK(config["model_type"] == "gpt2");
  CHECK(config["architectures"][0] == "GPT2LMHeadModel");
  CHECK(config["n_embd"] == 64);
  // The export's weights equal the checkpoint's, rounded to BF16.
  const auto master = SafetensorsFile::open(dir.file("ck/iter_0000008/model.safetensors"));
  const auto exported = read_as_float(c_attn);
  const auto original = read_as_float(master.tensor("h.1.attn.c_attn.weight"));
  for (size_t i = 0; i < original.size(); ++i) REQUIRE(exported[i] == round_to_bf16(original[i]));
  CHECK(run("convert --load " + (dir.file("nowhere")) + " --to " + (dir.file("x"))).exit_code == 2);
}

TEST_CASE("a version-1 checkpoint (amax history [states, history]) resumes exactly as its version-2 twin",
          "[checkpoint]") {
  TempDir dir;
  const std::string args = kRun + "--fp8-hybrid --fp8-amax-history-len 16";
  REQUIRE(run(args + " --exit-interval 4 --save " + dir.file("v2")).exit_code == 0);
  // The same checkpoint as version 1 wrote it: the history transposed, state.json version 1,
  // the file's size and CRC-32 recorded again.
  fs::copy(dir.file("v2"), dir.file("v1"), fs::copy_options::recursive);
  const fs::path v1 = fs::path(dir.file("v1")) / "iter_0000004";
  const fs::path scaling_path = v1 / "fp8_scaling.safetensors";
  {
    const SafetensorsFile v2_scaling = SafetensorsFile::open((fs::path(dir.file("v2")) / "iter_0000004" /
                                                              "fp8_scaling.safetensors").string());
    const auto& history = v2_scaling.tensor("amax_history");
    REQUIRE(history.shape.size() == 2);
    const int64_t L = history.shape[0], S = history.shape[1];
    CHECK(L == 16);
    const std::vector<float> rows = read_as_float(history);  // [L, S]
    std::vector<float> state_major(rows.size());
    for (int64_t s = 0; s < S; ++s)
      for (int64_t l = 0; l < L; ++l) state_major[s * L + l] = rows[l * S + s];
    const std::vector<float> scale = read_as_float(v2_scaling.tensor("scale"));
    const std::vector<float> scale_inv = read_as_float(v2_scaling.tensor("scale_inv"));
    SafetensorsWriter writer;
    writer.add_borrowed("amax_history", SafetensorsDtype::F32, {S, L}, state_major.data(), state_major.size() * 4);
    writer.add_borrowed("scale", SafetensorsDtype::F32, {S}, scale.data(), scale.size() * 4);
    writer.add_borrowed("scale_inv", SafetensorsDtype::F32, {S}, scale_inv.data(), scale_inv.size() * 4);
    for (const auto& [key, value] : v2_scaling.metadata()) writer.set_metadata(key, value);
    writer.write(scaling_path.string());
  }
  nlohmann::json state = nlohmann::json::parse(file_bytes((v1 / "state.json").string()));
  state["version"] = 1;
  state["files"]["fp8_scaling.safetensors"] = {{"bytes", fs::file_size(scaling_path)},
                                               {"crc32", file_crc32_hex(scaling_path.string())}};
  std::ofstream(v1 / "state.json") << state.dump(2) << "\n";
  fs::remove(v1 / "state.json.crc32");  // version 1 had no manifest checksum: loads, with a warning

  for (const char* version : {"v1", "v2"}) {
    const auto resumed =
        run(args + " --load " + dir.file(version) + " --metrics-file " + dir.file(std::string(version) + ".jsonl"));
    REQUIRE(resumed.exit_code == 0);
    CHECK((resumed.output.find("no state.json.crc32") != std::string::npos) == (std::string(version) == "v1"));
  }
  const auto from_v1 = read_metrics(dir.file("v1.jsonl")), from_v2 = read_metrics(dir.file("v2.jsonl"));
  REQUIRE(from_v1.size() == 4);
  REQUIRE(from_v2.size() == 4);
  for (size_t i = 0; i < 4; ++i) {
    CHECK(from_v1[i]["loss"].get<double>() == from_v2[i]["loss"].get<double>());
    CHECK(from_v1[i]["grad_norm"].get<double>() == from_v2[i]["grad_norm"].get<double>());
  }
}

// ---- Reliability: what a damaged, partial or contested checkpoint gets (docs/RELIABILITY.md)
//
// Checkpoints are made in-process (an untrained tiny model saves in milliseconds) and the
// binary runs only where its exit code and message are the point; kills happen in a forked
// child, so each costs a save, not a start-up.

namespace {

std::vector<std::string> split_words(const std::string& text) {
  std::vector<std::string> words;
  std::istringstream in(text);
  for (std::string word; in >> word;) words.push_back(word);
  return words;
}

// kRun's model, data and batch flags (BF16), plus `extra`.
RunSetup tiny_setup(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = split_words(kRun + "--bf16");
  args.insert(args.end(), extra.begin(), extra.end());
  return resolve_run_setup(parse_train_command_line(args).options);
}

std::string save_tiny(const std::string& dir, const RunSetup& setup, TrainingEngine& engine, int64_t iteration,
                      uint64_t consumed_samples = 0) {
  TrainingProgress progress;
  progress.iteration = iteration;
  progress.consumed_samples = consumed_samples;
  return save_checkpoint(dir, setup, engine, progress);
}

// Flips one bit of a file in place (no truncation: ext4 would flush a rewritten file).
void flip_bit(const fs::path& path, size_t byte, int bit) {
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(file.good());
  file.seekg(static_cast<std::streamoff>(byte));
  const int value = file.get();
  REQUIRE(value != EOF);
  file.seekp(static_cast<std::streamoff>(byte));
  file.put(static_cast<char>(value ^ (1 << bit)));
  REQUIRE(file.good());
}

std::string load_error(const std::string& path, bool verify_data = true) {
  try {
    read_checkpoint(path, std::nullopt, verify_data);
  } catch (const InputError& e) {
    return e.full_message();
  }
  return "(no error)";
}

std::vector<std::string> leftovers(const std::string& root) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(root))
    if (entry.path().filename().string().rfind(".iter_", 0) == 0) names.push_back(entry.path().filename().string());
  return names;
}

}  // namespace

TEST_CASE("a --load of a directory that is not a complete checkpoint is refused; --init-from takes weights alone",
          "[checkpoint][reliability]") {
  TempDir dir;
  const RunSetup setup = tiny_setup();
  auto engine = make_engine(setup);
  const fs::path iteration = save_tiny(dir.file("ck"), setup, *engine, 4);

  // A whole checkpoint, loaded for its weights only: no optimizer state, no progress.
  auto fresh = make_engine(setup);
  const LoadedState weights = load_into_engine(dir.file("ck"), std::nullopt, setup, *fresh, CheckpointUse::weights_only);
  CHECK_FALSE(weights.resumed);
  CHECK(fresh->optimizer_state().step_count == 0);

  fs::remove(iteration / "state.json");
  const auto refused = run(kRun + "--bf16 --train-iters 6 --save " + dir.file("ck") + " --load " + dir.file("ck"));
  CHECK(refused.exit_code == 2);
  CHECK_THAT(refused.output, ContainsSubstring("iter_0000004: not a complete fp8lm checkpoint (state.json"));
  CHECK_THAT(refused.output, ContainsSubstring("HINT: --init-from"));
  CHECK_FALSE(fs::exists(fs::path(dir.file("ck")) / "iter_0000006"));
  // The iteration directory itself, or a directory with nothing of a checkpoint, the same.
  for (const std::string& load : {iteration.string(), dir.file("empty")}) {
    INFO("--load " << load);
    fs::create_directories(dir.file("empty"));
    TrainOptions options = setup.options;
    options.load_dir = load;
    try {
      adopt_resume_checkpoint(options);
      FAIL("accepted");
    } catch (const InputError& e) {
      CHECK_THAT(e.full_message(), ContainsSubstring(load + ": not "));
    }
  }
  // The same weights as a fresh run's starting point are --init-from's job.
  const LoadedState initialised =
      load_into_engine(iteration.string(), std::nullopt, setup, *fresh, CheckpointUse::weights_only);
  CHECK_FALSE(initialised.resumed);
  CHECK(initialised.path == (iteration / "model.safetensors").string());
}

TEST_CASE("every bit flip in state.json is refused, naming the file; an old checkpoint without a checksum loads",
          "[checkpoint][reliability]") {
  TempDir dir;
  const RunSetup setup = tiny_setup();
  auto engine = make_engine(setup);
  save_tiny(dir.file("ck"), setup, *engine, 4, 16);
  const fs::path state = fs::path(dir.file("ck")) / "iter_0000004" / "state.json";
  const std::string original = file_bytes(state.string());
  CHECK(file_bytes(state.string() + ".crc32") ==
        "crc32 " + crc32_hex(crc32(original.data(), original.size())) + " bytes " + std::to_string(original.size()) +
            "\n");

  // One flip per byte, the bit rotating: in the progress fields, the config, the file records.
  for (size_t byte = 0; byte < original.size(); ++byte) {
    flip_bit(state, byte, static_cast<int>(byte % 8));
    INFO("byte " << byte);
    REQUIRE_THAT(load_error(dir.file("ck"), false), ContainsSubstring(state.string() + ": checksum mismatch"));
    flip_bit(state, byte, static_cast<int>(byte % 8));
  }
  // The sweep's case, end to end: "iteration": 4 -> 6 resumes nowhere.
  const size_t at = original.find("\"iteration\": 4");
  REQUIRE(at != std::string::npos);
  flip_bit(state, at + 13, 1);  // '4' -> '6'
  const auto flipped = run(kRun + "--bf16 --train-iters 8 --load " + dir.file("ck"));
  CHECK(flipped.exit_code == 2);
  CHECK_THAT(flipped.output, ContainsSubstring("state.json: checksum mismatch with state.json.crc32"));
  flip_bit(state, at + 13, 1);

  // A damaged record is refused too; a missing one (checkpoints from before it) loads, with
  // a warning (checked end to end by the version-1 test).
  std::ofstream(state.string() + ".crc32") << "crc32 zz\n";
  CHECK_THAT(load_error(dir.file("ck")), ContainsSubstring("state.json.crc32: not a checksum record"));
  fs::remove(state.string() + ".crc32");
  CHECK(load_error(dir.file("ck")) == "(no error)");
  CHECK(read_checkpoint(dir.file("ck"), std::nullopt, true).progress.consumed_samples == 16);
  // Without the checksum, a malformed field still names the file and the key.
  std::string edited = original;
  edited.replace(at, 14, "\"iteration\": \"4\"");
  std::ofstream(state, std::ios::binary | std::ios::trunc) << edited;
  CHECK_THAT(load_error(dir.file("ck")),
             ContainsSubstring(state.string() + ": key \"iteration\" must be a non-negative integer, not \"4\""));
}

TEST_CASE("convert verifies the checkpoint as train --load does, and never writes into it", "[checkpoint][reliability]") {
  TempDir dir;
  const RunSetup setup = tiny_setup();
  auto engine = make_engine(setup);
  const fs::path iteration = save_tiny(dir.file("ck"), setup, *engine, 4);
  const std::string model_before = file_bytes((iteration / "model.safetensors").string());

  // The sweep's case, end to end.
  const auto into = run("convert --load " + dir.file("ck") + " --to " + iteration.string());
  CHECK(into.exit_code == 2);
  CHECK_THAT(into.output, ContainsSubstring("--to " + iteration.string() + ": is the checkpoint directory"));
  // Inside it, the save directory itself, through a symbolic link, or over an input through a
  // hard link.
  fs::create_directories(dir.file("linked"));
  fs::create_hard_link(iteration / "model.safetensors", dir.file("linked/model.safetensors"));
  fs::create_directory_symlink(iteration, dir.file("alias"));
  const CheckpointManifest checkpoint = read_checkpoint(dir.file("ck"), std::nullopt, true);
  for (const std::string& to : {(iteration / "sub").string(), dir.file("ck"), dir.file("ck/hf"), dir.file("alias"),
                                dir.file("linked")}) {
    INFO("--to " << to);
    try {
      check_export_directory(to, dir.file("ck"), checkpoint);
      FAIL("accepted");
    } catch (const InputError& e) {
      CHECK_THAT(e.full_message(), ContainsSubstring("--to " + to + ": ") && ContainsSubstring("convert never writes"));
    }
  }
  CHECK_NOTHROW(check_export_directory(dir.file("out"), dir.file("ck"), checkpoint));
  CHECK(file_bytes((iteration / "model.safetensors").string()) == model_before);
  CHECK(load_error(dir.file("ck")) == "(no error)");

  // A corrupt file anywhere in the checkpoint is refused before anything is written: the
  // verification train --load does (read_checkpoint), shown end to end for one file.
  for (const char* file : {"model.safetensors", "optimizer.safetensors", "state.json"}) {
    INFO(file);
    flip_bit(iteration / file, 100, 3);
    CHECK_THAT(load_error(dir.file("ck")), ContainsSubstring(std::string(file) + ": checksum mismatch"));
    if (std::string(file) == "optimizer.safetensors") {
      const auto corrupt = run("convert --load " + dir.file("ck") + " --to " + dir.file("out"));
      CHECK(corrupt.exit_code == 2);
      CHECK_THAT(corrupt.output, ContainsSubstring("optimizer.safetensors: checksum mismatch"));
      CHECK_FALSE(fs::exists(dir.file("out")));
    }
    flip_bit(iteration / file, 100, 3);
  }
  REQUIRE(run("convert --load " + dir.file("ck") + " --to " + dir.file("out")).exit_code == 0);
  CHECK(fs::is_regular_file(dir.file("out/config.json")));
}

namespace {

// Saves `iteration` in a forked child that FP8LM_TEST_SAVE kills at a named point; the
// child's end as a signal number (SIGKILL when the hook fired), or -1.
int save_killed_at(const std::string& hooks, const std::string& ck, const RunSetup& setup, TrainingEngine& engine,
                   int64_t iteration, uint64_t consumed_samples) {
  std::fflush(nullptr);
  const pid_t child = fork();
  if (child == 0) {
    alarm(60);  // a hung child ends by SIGALRM, which fails the test
    setenv("FP8LM_TEST_SAVE", hooks.c_str(), 1);
    try {
      save_tiny(ck, setup, engine, iteration, consumed_samples);
    } catch (...) {
    }
    _exit(0);
  }
  int status = 0;
  waitpid(child, &status, 0);
  return WIFSIGNALED(status) ? WTERMSIG(status) : -1;
}

}  // namespace

TEST_CASE("a save killed at any point leaves latest naming a complete checkpoint; the next save clears leftovers",
          "[checkpoint][reliability]") {
  TempDir dir;
  const RunSetup setup = tiny_setup();
  auto engine = make_engine(setup);
  save_tiny(dir.file("base"), setup, *engine, 1, 4);
  save_tiny(dir.file("base"), setup, *engine, 2, 8);  // latest: 2
  struct Kill {
    const char* hooks;
    uint64_t consumed_then;  // whose iter_0000002 `latest` leads to after the kill: old 8, new 99
    size_t leftovers;
  };
  // A resumed run re-saves iteration 2, which `latest` already names, and dies.
  const std::map<std::string, Kill> kills = {
      {"files-written", {"kill-at=files-written", 8, 1}},
      {"staged", {"kill-at=staged", 8, 1}},
      {"after-exchange", {"kill-at=after-exchange", 99, 1}},
      {"between-renames", {"no-exchange,kill-at=between-renames", 8, 2}},
      {"published", {"kill-at=published", 99, 0}},
  };
  for (const auto& [point, kill] : kills) {
    INFO(kill.hooks);
    const std::string ck = dir.file("ck-" + point);
    fs::copy(dir.file("base"), ck, fs::copy_options::recursive);
    CHECK(save_killed_at(kill.hooks, ck, setup, *engine, 2, 99) == SIGKILL);
    CHECK(file_bytes(ck + "/latest") == "2\n");
    CHECK(load_error(ck) == "(no error)");  // state.json, its checksum and every file's CRC-32
    CHECK(read_checkpoint(ck, std::nullopt, true).progress.consumed_samples == kill.consumed_then);
    CHECK(leftovers(ck).size() == kill.leftovers);
  }
  // Without the kill, the two-rename path publishes the new copy and leaves nothing behind.
  const std::string fallback = dir.file("ck-published");
  CHECK(save_killed_at("no-exchange", fallback, setup, *engine, 2, 77) == -1);
  CHECK(read_checkpoint(fallback, std::nullopt, true).progress.consumed_samples == 77);
  CHECK(leftovers(fallback).empty());

  // The kill between the renames left iter_0000002 missing; its previous copy stands in, and
  // the next save clears both leftovers.
  const std::string between = dir.file("ck-between-renames");
  CHECK_FALSE(fs::exists(between + "/iter_0000002"));
  const auto resumed = run(kRun + "--bf16 --train-iters 3 --log-level warn --load " + between + " --save " + between);
  CHECK(resumed.exit_code == 0);
  CHECK_THAT(resumed.output, ContainsSubstring("was killed between its two renames; using the previous copy"));
  CHECK(leftovers(between).empty());
  CHECK(file_bytes(between + "/latest") == "3\n");
  const std::string staged = dir.file("ck-files-written");
  save_tiny(staged, setup, *engine, 3);
  CHECK(leftovers(staged).empty());
}

TEST_CASE("a second run saving into a locked directory fails at once, naming the holder", "[checkpoint][reliability]") {
  TempDir dir;
  {
    const SaveDirectoryLock lock(dir.file("ck"));
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    const auto second = run(kRun + "--bf16 --save " + dir.file("ck"));
    CHECK(second.exit_code == 2);
    CHECK_THAT(second.output, ContainsSubstring("--save " + dir.file("ck") + ": another fp8lm run is saving into this "
                                                "directory (pid " + std::to_string(getpid()) + " on host " + host));
    CHECK_FALSE(fs::exists(dir.file("ck/latest")));
    CHECK_THROWS_AS(SaveDirectoryLock(dir.file("ck")), InputError);
  }
  const SaveDirectoryLock again(dir.file("ck"));  // released with its holder
}

TEST_CASE("resuming with another --seed keeps the checkpoint's seed, with a warning naming both",
          "[checkpoint][reliability]") {
  TempDir dir;
  const RunSetup setup = tiny_setup({"--seed", "5"});
  auto engine = make_engine(setup);
  save_tiny(dir.file("ck"), setup, *engine, 2);
  CHECK(tiny_setup({"--seed", "9", "--load", dir.file("ck")}).options.seed == 5);
  CHECK(tiny_setup({"--seed", "9", "--init-from", dir.file("ck")}).options.seed == 9);  // a fresh run's own
  const auto resumed = run(kRun + "--bf16 --train-iters 3 --seed 9 --load " + dir.file("ck") + " --save " + dir.file("ck"));
  REQUIRE(resumed.exit_code == 0);
  CHECK_THAT(resumed.output, ContainsSubstring("--seed 9 differs from the seed 5 of the checkpoint"));
  CHECK(read_checkpoint(dir.file("ck"), std::nullopt, false).seed == 5u);  // iteration 3's
  CHECK(read_checkpoint(dir.file("ck"), std::nullopt, false).progress.iteration == 3);
}

TEST_CASE("a save that runs out of space fails naming the file; latest and its checkpoint stay intact",
          "[checkpoint][reliability]") {
  TempDir dir;
  const RunSetup setup = tiny_setup();
  auto engine = make_engine(setup);
  save_tiny(dir.file("ck"), setup, *engine, 1);
  // A file-size limit stands in for a full disk: writes past it fail (EFBIG, with SIGXFSZ
  // ignored) the way they fail with ENOSPC.
  struct rlimit saved {};
  REQUIRE(getrlimit(RLIMIT_FSIZE, &saved) == 0);
  struct rlimit small = saved;
  small.rlim_cur = 64 * 1024;
  void (*previous)(int) = signal(SIGXFSZ, SIG_IGN);
  REQUIRE(setrlimit(RLIMIT_FSIZE, &small) == 0);
  std::string message;
  try {
    save_tiny(dir.file("ck"), setup, *engine, 2);
  } catch (const RuntimeError& e) {
    message = e.full_message();
  }
  setrlimit(RLIMIT_FSIZE, &saved);
  signal(SIGXFSZ, previous);
  CHECK_THAT(message, ContainsSubstring("model.safetensors") && ContainsSubstring("File too large") &&
                          ContainsSubstring("HINT: check free disk space"));
  CHECK(file_bytes(dir.file("ck/latest")) == "1\n");
  CHECK(leftovers(dir.file("ck")).empty());  // the staging directory is gone again
  CHECK_FALSE(fs::exists(dir.file("ck/iter_0000002")));
  CHECK(load_error(dir.file("ck")) == "(no error)");
}

TEST_CASE("a checkpoint of the seed recipe (history 1024, max) resumes bit-exactly with its flags left out; "
          "another --fp8-amax-history-len starts the histories afresh, naming the flag",
          "[checkpoint]") {
  TempDir dir;
  const std::string seed_recipe = kRun + "--fp8-hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max";
  REQUIRE(run(seed_recipe + " --metrics-file " + dir.file("straight.jsonl")).exit_code == 0);
  REQUIRE(run(seed_recipe + " --exit-interval 4 --save " + dir.file("ck") + " --metrics-file " + dir.file("split.jsonl"))
              .exit_code == 0);
  // The recipe flags left out: the checkpoint's recipe, not this build's defaults (history 1, most_recent).
  const auto resumed = run(kRun + "--fp8-hybrid --log-level info --load " + dir.file("ck") + " --save " + dir.file("ck") +
                           " --metrics-file " + dir.file("split.jsonl"));
  REQUIRE(resumed.exit_code == 0);
  CHECK_THAT(resumed.output, ContainsSubstring("--fp8-amax-history-len not given: resuming with the checkpoint's 1024 "
                                               "(the default is 1)"));
  CHECK_THAT(resumed.output, ContainsSubstring("--fp8-amax-compute-algo not given: resuming with the checkpoint's max "
                                               "(the default is most_recent)"));
  const auto straight = read_metrics(dir.file("straight.jsonl")), split = read_metrics(dir.file("split.jsonl"));
  REQUIRE(straight.size() == 8);
  REQUIRE(split.size() == 8);
  for (size_t i = 0; i < 8; ++i) {
    INFO("iteration " << i + 1);
    CHECK(split[i]["loss"].get<double>() == straight[i]["loss"].get<double>());
    CHECK(split[i]["grad_norm"].get<double>() == straight[i]["grad_norm"].get<double>());
  }
  const auto state = nlohmann::json::parse(file_bytes(dir.file("ck/iter_0000008/state.json")));
  CHECK(state["args"]["fp8_amax_history_len"] == 1024);
  CHECK(state["args"]["fp8_amax_compute_algo"] == "max");
  const auto scaling = SafetensorsFile::open(dir.file("ck/iter_0000008/fp8_scaling.safetensors"));
  CHECK(scaling.tensor("amax_history").shape == std::vector<int64_t>{1024, 24});

  // A flag given explicitly wins. A 1024-step window does not fit a 1-step one: the scaling
  // state starts afresh (current scaling on the first step), and the warning names the flag.
  const auto changed = run(kRun + "--fp8-hybrid --fp8-amax-history-len 1 --train-iters 6 --ckpt-step 4 --load " +
                           dir.file("ck") + " --metrics-file " + dir.file("changed.jsonl"));
  REQUIRE(changed.exit_code == 0);
  CHECK_THAT(changed.output, ContainsSubstring("its amax histories are 1024 steps long and --fp8-amax-history-len is 1: "
                                               "the FP8 scaling state starts afresh"));
  for (const auto& line : read_metrics(dir.file("changed.jsonl"))) CHECK(std::isfinite(line["loss"].get<double>()));
}

TEST_CASE("BF16 first and last layers: a checkpoint resumes bit-exactly with the flags left out; other BF16 "
          "layers resume the FP8 scaling states that match by name",
          "[checkpoint]") {
  TempDir dir;
  const std::string three = kRun + "--fp8-hybrid --num-layers 3 ";
  const std::string layers = three + "--first-last-layers-bf16";  // blocks 0 and 2 in BF16
  REQUIRE(run(layers + " --metrics-file " + dir.file("straight.jsonl")).exit_code == 0);
  REQUIRE(run(layers + " --exit-interval 4 --save " + dir.file("ck") + " --metrics-file " + dir.file("split.jsonl"))
              .exit_code == 0);
  const auto resumed = run(three + "--log-level info --load " + dir.file("ck") + " --save " + dir.file("ck") +
                           " --metrics-file " + dir.file("split.jsonl"));
  REQUIRE(resumed.exit_code == 0);
  CHECK_THAT(resumed.output, ContainsSubstring("--first-last-layers-bf16 not given: resuming with the checkpoint's BF16 "
                                               "layers (first 1, last 1)"));
  const auto straight = read_metrics(dir.file("straight.jsonl")), split = read_metrics(dir.file("split.jsonl"));
  REQUIRE(straight.size() == 8);
  REQUIRE(split.size() == 8);
  for (size_t i = 0; i < 8; ++i) CHECK(split[i]["loss"].get<double>() == straight[i]["loss"].get<double>());
  // Only block 1 has FP8 scaling states (3 per Linear).
  const auto scaling = SafetensorsFile::open(dir.file("ck/iter_0000008/fp8_scaling.safetensors"));
  const auto names = nlohmann::json::parse(scaling.metadata().at("names")).get<std::vector<std::string>>();
  CHECK(names.size() == 12);
  for (const std::string& name : names) CHECK(name.rfind("h.1.", 0) == 0);

  // Given explicitly, every block in FP8: block 1's 12 states resume, blocks 0 and 2 start
  // empty, and the first step takes current scaling.
  const auto all_fp8 = run(three + "--first-last-layers-bf16 --num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0 "
                                   "--train-iters 6 --ckpt-step 4 --load " + dir.file("ck") + " --metrics-file " +
                           dir.file("all_fp8.jsonl"));
  REQUIRE(all_fp8.exit_code == 0);
  CHECK_THAT(all_fp8.output, ContainsSubstring("12 of this run's 36 FP8 scaling states resume by name (12 stored)"));
  CHECK_THAT(all_fp8.output, ContainsSubstring("the first step takes current scaling"));
  for (const auto& line : read_metrics(dir.file("all_fp8.jsonl"))) CHECK(std::isfinite(line["loss"].get<double>()));

  // The reverse: a plain FP8 checkpoint resumed with BF16 first and last layers keeps block 1's
  // delayed scales as they were (every operand of the run found its state).
  REQUIRE(run(three + "--exit-interval 4 --save " + dir.file("plain")).exit_code == 0);
  const auto to_bf16_ends = run(layers + " --train-iters 6 --load " + dir.file("plain") + " --metrics-file " +
                                dir.file("ends.jsonl"));
  REQUIRE(to_bf16_ends.exit_code == 0);
  CHECK_THAT(to_bf16_ends.output, ContainsSubstring("12 of this run's 12 FP8 scaling states resume by name (36 stored)"));
  CHECK(to_bf16_ends.output.find("the first step takes current scaling") == std::string::npos);
  for (const auto& line : read_metrics(dir.file("ends.jsonl"))) CHECK(std::isfinite(line["loss"].get<double>()));
}

TEST_CASE("checkpoints without the optimizer (--no-save-optim): --load then needs --no-load-optim, which restores "
          "the rest and starts the optimizer fresh",
          "[checkpoint]") {
  TempDir dir;
  const std::string args = kRun + "--fp8-hybrid --exit-interval 4 ";
  // The same 4 steps saved with and without the optimizer state.
  REQUIRE(run(args + "--save " + dir.file("full")).exit_code == 0);
  REQUIRE(run(args + "--no-save-optim --save " + dir.file("lean")).exit_code == 0);
  const std::string lean = dir.file("lean/iter_0000004/"), full = dir.file("full/iter_0000004/");
  CHECK(!fs::exists(lean + "optimizer.safetensors"));
  CHECK(fs::exists(full + "optimizer.safetensors"));
  for (const char* file : {"model.safetensors", "fp8_scaling.safetensors"})
    CHECK(file_bytes(lean + file) == file_bytes(full + file));
  const nlohmann::json state = nlohmann::json::parse(file_bytes(lean + "state.json"));
  CHECK(state["optimizer_saved"] == false);
  CHECK(!state["files"].contains("optimizer.safetensors"));
  CHECK(nlohmann::json::parse(file_bytes(full + "state.json"))["optimizer_saved"] == true);

  // Without --no-load-optim the lean checkpoint is refused at start-up, naming both ways on.
  const auto refused = run(kRun + "--fp8-hybrid --load " + dir.file("lean"));
  CHECK(refused.exit_code == 2);
  CHECK_THAT(refused.output, ContainsSubstring("saved without its optimizer state (--no-save-optim)"));
  CHECK_THAT(refused.output, ContainsSubstring("HINT: pass --no-load-optim"));
  CHECK_THAT(refused.output, ContainsSubstring("--finetune"));
  // fp8lm eval and fp8lm sample read the weights and FP8 scales alone: the lean checkpoint serves them.
  const auto sampled = run("sample --load " + dir.file("lean") + " --device cpu --random-prompt 4 --max-new-tokens 3");
  CHECK(sampled.exit_code == 0);
  CHECK_THAT(sampled.output, ContainsSubstring("the checkpoint's delayed scales"));

  // --no-load-optim: iterations 5-8 from either checkpoint are the same run (weights, FP8 scales,
  // data position restored; fresh moments), and not the full resume's.
  auto resume = [&](const std::string& from, const std::string& flags) {
    const std::string metrics = dir.file(from + (flags.empty() ? "" : "-fresh") + ".jsonl");
    REQUIRE(run(kRun + "--fp8-hybrid --load " + dir.file(from) + " " + flags + " --metrics-file " + metrics)
                .exit_code == 0);
    return read_metrics(metrics);
  };
  const auto from_lean = resume("lean", "--no-load-optim");
  const auto from_full_fresh = resume("full", "--no-load-optim");
  const auto from_full = resume("full", "");
  REQUIRE(from_lean.size() == 4);
  REQUIRE(from_full_fresh.size() == 4);
  REQUIRE(from_full.size() == 4);
  CHECK(from_lean.front()["iter"] == 5);
  for (size_t i = 0; i < 4; ++i) {
    CHECK(from_lean[i]["loss"].get<double>() == from_full_fresh[i]["loss"].get<double>());
    CHECK(from_lean[i]["grad_norm"].get<double>() == from_full_fresh[i]["grad_norm"].get<double>());
  }
  // Iteration 5's loss is the restored weights' on the same batch; its update (a fresh Adam's
  // first step) differs, so iteration 6 does.
  CHECK(from_lean[0]["loss"].get<double>() == from_full[0]["loss"].get<double>());
  CHECK(from_lean[1]["loss"].get<double>() != from_full[1]["loss"].get<double>());
  CHECK(std::fabs(from_lean[3]["loss"].get<double>() - from_full[3]["loss"].get<double>()) <
        0.05 * from_full[3]["loss"].get<double>());
}

TEST_CASE("the RNG flags (--no-load-rng, --no-save-rng) change nothing: a checkpoint holds no random state",
          "[checkpoint]") {
  TempDir dir;
  const std::string args = kRun + "--bf16 --exit-interval 4 --save " + dir.file("ck");
  REQUIRE(run(args + " --metrics-file " + dir.file("a.jsonl")).exit_code == 0);
  const auto with_flags = run(kRun + "--bf16 --no-save-rng --no-load-rng --load " + dir.file("ck") +
                              " --log-level info --metrics-file " + dir.file("b.jsonl"));
  REQUIRE(with_flags.exit_code == 0);
  CHECK_THAT(with_flags.output, ContainsSubstring("--no-load-rng"));
  CHECK_THAT(with_flags.output, ContainsSubstring("no random state"));
  REQUIRE(run(kRun + "--bf16 --load " + dir.file("ck") + " --metrics-file " + dir.file("c.jsonl")).exit_code == 0);
  const auto b = read_metrics(dir.file("b.jsonl")), c = read_metrics(dir.file("c.jsonl"));
  REQUIRE(b.size() == 4);
  REQUIRE(c.size() == 4);
  for (size_t i = 0; i < 4; ++i) CHECK(b[i]["loss"].get<double>() == c[i]["loss"].get<double>());
}
