// fp8lm convert: export a checkpoint's weights as a Hugging Face GPT-2 model
// (model.safetensors + config.json) that transformers loads as GPT2LMHeadModel.
#include <filesystem>
#include <fstream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "apps/checkpointing.h"
#include "apps/cli.h"
#include "apps/commands.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/logging.h"
#include "core/safetensors.h"
#include "layers/gpt.h"
#include "layers/gpt_hf.h"

namespace fp8lm {

namespace fs = std::filesystem;

int run_convert_command(const std::vector<std::string>& args) {
  std::string load, to, dtype = "bf16", log_level = "info";
  std::optional<int64_t> step;
  CLI::App app{"fp8lm convert: export a checkpoint as a Hugging Face GPT-2 model", "fp8lm convert"};
  // As with argparse (Megatron), a repeated flag takes its last value, so scripts can
  // append overrides.
  app.option_defaults()->always_capture_default()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--load", load, "Checkpoint directory (uses `latest`) or iteration directory")->required();
  app.add_option("--ckpt-step", step, "Export this iteration instead of `latest`");
  app.add_option("--to", to, "Output directory for model.safetensors and config.json")->required();
  app.add_option("--dtype", dtype, "bf16, fp16 or fp32")->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  app.add_option("--log-level", log_level, "trace, debug, info, warn or error")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));
  if (!parse_subcommand_arguments(app, args, "convert")) return kExitOk;
  init_logging(log_level);

  // The same load-and-verify path as `train --load`: the manifest's checksum, then every
  // file's size and CRC-32, before anything is exported.
  const CheckpointManifest checkpoint = read_checkpoint(load, step, /*verify_data=*/true);
  check_export_directory(to, load, checkpoint);
  const std::string& dir = checkpoint.dir;
  const GptConfig& config = checkpoint.config;
  const TensorLayout layout = make_gpt_layout(config);
  std::vector<float> params(layout.total_elements(), 0.0f);
  const SafetensorsFile model = SafetensorsFile::open((fs::path(dir) / "model.safetensors").string());
  load_hf_parameters(model, layout, config, params.data());

  // transformers' GPT2LMHeadModel names: "transformer." + GPT2Model names; a tied lm_head
  // is left out, as save_pretrained does, and an untied one is "lm_head.weight".
  const std::vector<HfTensor> tensors = to_hf_tensors(layout, params.data(), config);
  const SafetensorsDtype out_dtype =
      dtype == "bf16" ? SafetensorsDtype::BF16 : dtype == "fp16" ? SafetensorsDtype::F16 : SafetensorsDtype::F32;
  std::vector<std::vector<uint16_t>> halves;
  halves.reserve(tensors.size());
  SafetensorsWriter writer;
  for (const HfTensor& t : tensors) {
    const std::string name = t.name == "lm_head.weight" ? t.name : "transformer." + t.name;
    if (out_dtype == SafetensorsDtype::F32) {
      writer.add_borrowed(name, out_dtype, t.shape, t.values.data(), t.values.size() * 4);
      continue;
    }
    std::vector<uint16_t>& bits = halves.emplace_back(t.values.size());
    for (size_t i = 0; i < bits.size(); ++i)
      bits[i] = out_dtype == SafetensorsDtype::BF16 ? bf16_from_float(t.values[i]) : fp16_from_float(t.values[i]);
    writer.add_borrowed(name, out_dtype, t.shape, bits.data(), bits.size() * 2);
  }
  writer.set_metadata("format", "pt");
  std::error_code error;
  fs::create_directories(to, error);
  FP8LM_INPUT_CHECK(!error, "--to ", to, ": cannot create the directory (", error.message(), ")");
  writer.write((fs::path(to) / "model.safetensors").string());
  nlohmann::json hf_config = to_hf_json(config);
  hf_config["torch_dtype"] = dtype == "bf16" ? "bfloat16" : dtype == "fp16" ? "float16" : "float32";
  write_file_durably((fs::path(to) / "config.json").string(), hf_config.dump(2) + "\n");
  spdlog::info("exported {} ({} tensors, {}) to {}", dir, tensors.size(), dtype, to);
  return kExitOk;
}

}  // namespace fp8lm
