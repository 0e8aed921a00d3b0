// Megatron-LM flags that fp8lm train accepts so that a Megatron GPT script runs as written,
// beyond the ones it implements with their Megatron meaning (apps/cli.cpp). Each is one of:
//   no effect     switches of Megatron's own implementation (kernel fusions, model classes, data
//                 loader workers) whose request fp8lm's fixed kernels already satisfy or make moot;
//                 accepted and listed at start-up;
//   one value     a model or layout choice fp8lm implements one way (no dropout, learned
//                 absolute positions, LayerNorm, no pipeline stages): that value is accepted,
//                 any other is refused naming the flag;
//   not written   logging outputs fp8lm does not produce (TensorBoard, Weights & Biases):
//                 accepted with a warning at start-up that names where fp8lm's metrics go;
//   refused       features fp8lm does not have (an untied head, SwiGLU, FP16, MoE, ...): a
//                 one-line error naming the flag and what fp8lm offers instead.
// docs/MEGATRON.md lists them with the flags fp8lm implements.
#pragma once

#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace fp8lm {

enum class MegatronFlagKind : unsigned char { no_effect, one_value, not_written, refused };

struct MegatronFlag {
  const char* name;
  bool takes_value;
  MegatronFlagKind kind;
  // one_value: the value fp8lm implements ("0" for the dropouts compares as a number).
  const char* accepted_value;
  // Why: shown for no_effect at start-up, and in the error or warning of the others.
  const char* why;
};

const std::vector<MegatronFlag>& megatron_compatibility_flags();

// What the command line gave for these flags, filled by CLI11 during the parse.
struct MegatronFlagValues {
  // One per flag of megatron_compatibility_flags(), in order: its words (--rampup-batch-size
  // takes three, the others one).
  std::vector<std::vector<std::string>> values;
  std::vector<int> given;           // 1 where the flag was on the command line
};

// Adds every compatibility flag to `app` (group "Megatron compatibility").
void add_megatron_compatibility_flags(CLI::App& app, MegatronFlagValues& values);

// After the parse: throws InputError naming the first refused flag or unaccepted value; returns
// the start-up notes: "--flag: why" for each no-effect flag given, and the warnings of the
// not-written ones in `warnings`.
std::vector<std::string> check_megatron_compatibility_flags(const MegatronFlagValues& values,
                                                            std::vector<std::string>& warnings);

// A flag fp8lm does not know: the error's text, with the nearest known flag when one is close.
std::string unknown_flag_message(const std::string& flag, const std::vector<std::string>& known_flags);

}  // namespace fp8lm
