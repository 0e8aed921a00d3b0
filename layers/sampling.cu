// The next token of each sequence, chosen on the GPU (layers/sampling_cuda.h): the CPU's
// sample_token (layers/sampling.cpp) is the specification, and tests/test_sampling_gpu.cpp
// holds this kernel to it.
//
// Order of summation: every sum is a fixed tree (per-thread runs, then a block scan), so the
// same logits and numbers give the same token on every run.
#include "layers/sampling_cuda.h"

#include <cuda_runtime.h>

#include "core/check_cuda.h"
#include "core/error.h"
#include "core/launch.cuh"

namespace fp8lm::cuda {

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kKeys = 65536;                 // the BF16 values
constexpr int kKeysPerThread = kKeys / kThreads;
static_assert(kWarps == 32, "block_exclusive_scan scans the warps' sums in one warp");

// An order-preserving key of a BF16 value: a larger value has a larger key; -0 is +0's.
__device__ __forceinline__ uint32_t order_key(uint16_t bits) {
  if (bits == 0x8000u) bits = 0;
  return (bits & 0x8000u) ? (~uint32_t(bits) & 0xFFFFu) : (uint32_t(bits) | 0x8000u);
}

__device__ __forceinline__ float value_of_key(uint32_t key) {
  const uint32_t bits = (key & 0x8000u) ? (key & 0x7FFFu) : (~key & 0xFFFFu);
  return __uint_as_float(bits << 16);
}

__device__ __forceinline__ float logit_at(const uint16_t* row, int i) { return __uint_as_float(uint32_t(row[i]) << 16); }

struct Shared {
  double scan_doubles[kWarps + 1];
  int scan_ints[kWarps + 1];
  float best_value[kWarps];
  int best_id[kWarps];
  // The thread that finds what the block looks for writes it here.
  int found_key, found_ties, found_id;
  double found_mass;
};

// Exclusive prefix of `value` over the block in thread order, and the block's total. Every
// thread calls it.
template <typename T>
__device__ T block_exclusive_scan(T value, T* warp_sums, T& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T inclusive = value;
  for (int offset = 1; offset < 32; offset *= 2) {
    const T other = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  T exclusive = __shfl_up_sync(0xFFFFFFFFu, inclusive, 1);
  if (lane == 0) exclusive = T(0);
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {  // the warps' sums scanned the same way; kWarps == 32
    T running = warp_sums[lane];
    for (int offset = 1; offset < 32; offset *= 2) {
      const T other = __shfl_up_sync(0xFFFFFFFFu, running, offset);
      if (lane >= offset) running += other;
    }
    T before = __shfl_up_sync(0xFFFFFFFFu, running, 1);
    if (lane == 0) before = T(0);
    warp_sums[lane] = before;
    if (lane == 31) warp_sums[kWarps] = running;
  }
  __syncthreads();
  const T result = warp_sums[warp] + exclusive;
  total = warp_sums[kWarps];
  __syncthreads();  // warp_sums is reused by the next scan
  return result;
}

// The block's largest logit and its lowest id among ties.
__device__ void block_argmax(const uint16_t* row, int V, Shared& sh, float& best, int& best_id) {
  float value = -__int_as_float(0x7f800000);
  int id = V;
  for (int i = threadIdx.x; i < V; i += kThreads) {
    const float l = logit_at(row, i);
    if (l > value) value = l, id = i;  // ids rise: the first of ties stays
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other_value = __shfl_down_sync(0xFFFFFFFFu, value, offset);
    const int other_id = __shfl_down_sync(0xFFFFFFFFu, id, offset);
    if (other_value > value || (other_value == value && other_id < id)) value = other_value, id = other_id;
  }
  if (threadIdx.x % 32 == 0) sh.best_value[threadIdx.x / 32] = value, sh.best_id[threadIdx.x / 32] = id;
  __syncthreads();
  best = sh.best_value[0];
  best_id = sh.best_id[0];
  for (int w = 1; w < kWarps; ++w)
    if (sh.best_value[w] > best || (sh.best_value[w] == best && sh.best_id[w] < best_id))
      best = sh.best_value[w], best_id = sh.best_id[w];
  __syncthreads();
  if (best_id >= V) best_id = 0;  // every logit NaN: id 0, as the host's max_element
}

// Temperature only: candidates in id order. Thread t owns ids [t * chunk, (t + 1) * chunk).
__device__ int draw_in_id_order(const uint16_t* row, int V, double temperature, double shift, double uniform,
                                Shared& sh) {
  const int chunk = (V + kThreads - 1) / kThreads;
  const int begin = min(V, int(threadIdx.x) * chunk), end = min(V, begin + chunk);
  double mine = 0.0;
  for (int i = begin; i < end; ++i) mine += exp(double(logit_at(row, i)) / temperature - shift);
  double total;
  const double before = block_exclusive_scan(mine, sh.scan_doubles, total);
  const double draw = uniform * total;
  if (threadIdx.x == 0) sh.found_id = V - 1;  // rounding left a sliver: the last id, as the host
  __syncthreads();
  if (begin < end && before <= draw && draw < before + mine) {
    double left = draw - before;
    int id = end - 1;
    for (int i = begin; i < end; ++i) {
      left -= exp(double(logit_at(row, i)) / temperature - shift);
      if (left < 0.0) {
        id = i;
        break;
      }
    }
    sh.found_id = id;
  }
  __syncthreads();
  return sh.found_id;
}

// Top-k and/or top-p: the walk over candidates sorted by (logit down, id up), through the
// histogram of the row's BF16 values. Thread t owns keys top(t) - j, j < kKeysPerThread, the
// largest first, so thread order is sorted order.
__device__ int draw_in_sorted_order(const uint16_t* row, int V, const SamplingOptions& rule, double shift,
                                    double uniform, int32_t* histogram, Shared& sh) {
  for (int k = threadIdx.x; k < kKeys; k += kThreads) histogram[k] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < V; i += kThreads) atomicAdd(&histogram[order_key(row[i])], 1);
  __syncthreads();
  const int top = kKeys - 1 - int(threadIdx.x) * kKeysPerThread;
  auto probability = [&](int key) { return exp(double(value_of_key(uint32_t(key))) / rule.temperature - shift); };

  // The top-k cut: the k-th element in sorted order is tie number cut_ties of key cut_key.
  const int k = rule.top_k > 0 ? min(rule.top_k, V) : V;
  int my_count = 0;
  for (int j = 0; j < kKeysPerThread; ++j) my_count += histogram[top - j];
  int all;
  const int count_before = block_exclusive_scan(my_count, sh.scan_ints, all);
  if (count_before < k && k <= count_before + my_count) {
    int seen = count_before;
    for (int j = 0; j < kKeysPerThread; ++j) {
      const int c = histogram[top - j];
      if (seen + c >= k) {
        sh.found_key = top - j;
        sh.found_ties = k - seen;
        break;
      }
      seen += c;
    }
  }
  __syncthreads();
  const int cut_key = sh.found_key, cut_ties = sh.found_ties;

  // How many of a key's elements are in a set cut at (key, ties): all above it, `ties` of it.
  auto kept = [&](int key, int set_key, int set_ties) {
    return key > set_key ? histogram[key] : key == set_key ? set_ties : 0;
  };
  auto mass_of = [&](int set_key, int set_ties) {
    double mass = 0.0;
    for (int j = 0; j < kKeysPerThread; ++j) {
      const int c = kept(top - j, set_key, set_ties);
      if (c > 0) mass += c * probability(top - j);
    }
    return mass;
  };
  // The first element of the set, in sorted order, at which the running mass from `before`
  // reaches `target` (reach: >= when inclusive, > otherwise): its key and tie number, and the
  // mass up to it.
  auto walk = [&](double before, double target, bool inclusive, int set_key, int set_ties) {
    double seen = before;
    for (int j = 0; j < kKeysPerThread; ++j) {
      const int c = kept(top - j, set_key, set_ties);
      if (c == 0) continue;
      const double p = probability(top - j);
      const bool reached = inclusive ? seen + c * p >= target : seen + c * p > target;
      if (reached) {
        // Ties have equal probabilities: the first n with seen + n * p reaching the target.
        double n = inclusive ? ceil((target - seen) / p) : floor((target - seen) / p) + 1.0;
        n = fmin(fmax(n, 1.0), double(c));
        sh.found_key = top - j;
        sh.found_ties = int(n);
        sh.found_mass = seen + n * p;
        return;
      }
      seen += c * p;
    }
  };

  // The candidates' mass, then the nucleus: the shortest prefix whose mass reaches top_p of it.
  const double my_mass = mass_of(cut_key, cut_ties);
  double candidates_mass;
  const double mass_before = block_exclusive_scan(my_mass, sh.scan_doubles, candidates_mass);
  int nucleus_key = cut_key, nucleus_ties = cut_ties;
  double nucleus_mass = candidates_mass;
  if (rule.top_p < 1.0) {
    const double target = rule.top_p * candidates_mass;
    if (threadIdx.x == 0) sh.found_key = -1;
    __syncthreads();
    if (mass_before < target && target <= mass_before + my_mass) walk(mass_before, target, true, cut_key, cut_ties);
    __syncthreads();
    if (sh.found_key >= 0) nucleus_key = sh.found_key, nucleus_ties = sh.found_ties, nucleus_mass = sh.found_mass;
    __syncthreads();
  }

  // The draw: the first element of the nucleus whose running mass passes uniform * its mass.
  const double draw = uniform * nucleus_mass;
  const double my_nucleus_mass = mass_of(nucleus_key, nucleus_ties);
  double unused;
  const double nucleus_before = block_exclusive_scan(my_nucleus_mass, sh.scan_doubles, unused);
  if (threadIdx.x == 0) sh.found_key = nucleus_key, sh.found_ties = nucleus_ties;  // a sliver: its last
  __syncthreads();
  if (my_nucleus_mass > 0.0 && nucleus_before <= draw && draw < nucleus_before + my_nucleus_mass)
    walk(nucleus_before, draw, false, nucleus_key, nucleus_ties);
  __syncthreads();
  const uint32_t drawn_key = uint32_t(sh.found_key);
  const int drawn_tie = sh.found_ties;  // 1 = the lowest id of that value

  // The id of that tie: ids in thread-contiguous chunks, the elements of the drawn value counted.
  const int chunk = (V + kThreads - 1) / kThreads;
  const int begin = min(V, int(threadIdx.x) * chunk), end = min(V, begin + chunk);
  int matches = 0;
  for (int i = begin; i < end; ++i) matches += order_key(row[i]) == drawn_key;
  if (threadIdx.x == 0) sh.found_id = 0;  // always overwritten: the drawn value has drawn_tie elements
  int total_matches;
  const int matches_before = block_exclusive_scan(matches, sh.scan_ints, total_matches);
  if (matches_before < drawn_tie && drawn_tie <= matches_before + matches) {
    int seen = matches_before;
    for (int i = begin; i < end; ++i)
      if (order_key(row[i]) == drawn_key && ++seen == drawn_tie) {
        sh.found_id = i;
        break;
      }
  }
  __syncthreads();
  return sh.found_id;
}

__global__ void __launch_bounds__(kThreads) choose_next_tokens_kernel(TokenChoiceLaunch a) {
  device::start_after_previous_kernel();
  __shared__ Shared sh;
  const int b = blockIdx.x;
  const int position = a.stored_position ? *a.stored_position : a.position;
  const DecodingTokens& t = a.tokens;
  const bool ended = t.ended[b] != 0;
  int token = -1;
  if (!ended) {
    const uint16_t* row = a.logits + size_t(b) * a.row_stride;
    float best;
    int best_id;
    block_argmax(row, a.vocab_size, sh, best, best_id);
    if (a.rule.temperature == 0.0) {
      token = best_id;
    } else {
      const double shift = double(best) / a.rule.temperature;
      const double uniform = step_uniform(t.seed, b, position - t.first_position);
      token = a.rule.top_k > 0 || a.rule.top_p < 1.0
                  ? draw_in_sorted_order(row, a.vocab_size, a.rule, shift, uniform, t.scratch + 1 + size_t(b) * kKeys, sh)
                  : draw_in_id_order(row, a.vocab_size, a.rule.temperature, shift, uniform, sh);
    }
  }
  if (threadIdx.x != 0) return;
  if (position + 1 < t.rows) t.chosen[size_t(position + 1) * a.B + b] = token;
  if (!ended) {
    a.next_inputs[b] = token;
    if (token == t.stop_token) t.ended[b] = 1;
  }
  // The last block to finish moves the step on: every block has read the position by then.
  __threadfence();
  unsigned int* finished = reinterpret_cast<unsigned int*>(t.scratch);
  if (atomicAdd(finished, 1u) == unsigned(a.B) - 1) {
    *a.next_position = position + 1;
    *finished = 0;
  }
}

}  // namespace

void choose_next_tokens(const TokenChoiceLaunch& a, cudaStream_t stream) {
  FP8LM_CHECK(a.B > 0 && a.vocab_size > 0 && a.vocab_size <= a.row_stride, "choose_next_tokens: bad shape B=", a.B,
              " V=", a.vocab_size, " Vs=", a.row_stride);
  FP8LM_CHECK(a.logits && a.next_inputs && a.next_position && a.tokens.chosen && a.tokens.ended && a.tokens.scratch,
              "choose_next_tokens: null memory");
  FP8LM_CHECK(a.stored_position != nullptr || (a.position >= a.tokens.first_position && a.position + 1 < a.tokens.rows),
              "choose_next_tokens: position ", a.position, " outside the decoding loop's [", a.tokens.first_position,
              ", ", a.tokens.rows - 1, ")");
  launch_kernel(choose_next_tokens_kernel, unsigned(a.B), kThreads, 0, stream, a);
}

}  // namespace fp8lm::cuda
