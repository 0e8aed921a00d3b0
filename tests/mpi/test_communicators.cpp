// Every collective against hand-worked results, on the world, tp and dp groups that
// ProcessGroups builds with TP = 2 (at 4 ranks: tp {0,1} {2,3}, dp {0,2} {1,3}; at 2 ranks the dp
// groups have one rank, which exercises the no-MPI path inside an MPI job).
//
// "mpi: ..." cases run MpiCommunicator on host buffers; "nccl: ..." cases run the same checks on
// NcclCommunicator with device buffers, and skip (on every rank alike) without a GPU per rank.
//
// Reduction inputs are chosen so that the result does not depend on the order in which the
// implementation combines the ranks, except in the two-rank tables, where order cannot matter.
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <mpi.h>

#include "collective_testing.h"
#include "gpu_fixture.h"
#include "core/error.h"
#include "parallel/mpi_communicator.h"
#include "parallel/nccl_communicator.h"
#include "parallel/process_groups.h"
#include "parallel/recording_communicator.h"

using namespace fp8lm;
using namespace fp8lm::testing;
using Catch::Matchers::ContainsSubstring;

namespace {

int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int test_tp_size() { return world_size() % 2 == 0 ? 2 : 1; }

BufferSpace space_of(Communicator& comm) {
  if (auto* nccl = dynamic_cast<NcclCommunicator*>(&comm)) return {true, nccl->stream()};
  return {};
}

std::vector<GroupUnderTest> groups_under_test(const ProcessGroups& groups) {
  const ParallelLayout& layout = groups.layout();
  std::vector<int> everyone(static_cast<size_t>(layout.world_size));
  std::iota(everyone.begin(), everyone.end(), 0);
  std::vector<GroupUnderTest> out;
  out.push_back({&groups.world(), everyone, space_of(groups.world())});
  out.push_back({&groups.tp(), tensor_parallel_group_ranks(layout), space_of(groups.tp())});
  out.push_back({&groups.dp(), data_parallel_group_ranks(layout), space_of(groups.dp())});
  out.push_back({&groups.dp_background(), data_parallel_group_ranks(layout), space_of(groups.dp_background())});
  return out;
}

template <typename Check>
void for_each_host_group(Check check) {
  const ProcessGroups groups = ProcessGroups::create_host(detect_parallel_layout(test_tp_size()));
  for (GroupUnderTest& group : groups_under_test(groups)) {
    INFO("group " << group.comm->name() << " (size " << group.comm->size() << ", rank " << group.comm->rank()
                  << ", world rank " << world_rank() << ")");
    check(group);
  }
}

template <typename Check>
void for_each_gpu_group(Check check) {
  GpuFixture* gpu = gpu_fixture();
  if (gpu == nullptr) SKIP("no CUDA GPU for every rank");
  for (GroupUnderTest& group : groups_under_test(*gpu->groups)) {
    INFO("group " << group.comm->name() << " (size " << group.comm->size() << ", rank " << group.comm->rank()
                  << ", world rank " << world_rank() << ")");
    check(group);
  }
}

// Equal element by element, NaN equal to NaN (for float results).
template <typename T>
bool same_values(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if constexpr (std::is_floating_point_v<T>) {
      if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    }
    if (a[i] != b[i]) return false;
  }
  return true;
}

const Placement kPlacements[] = {Placement::out_of_place, Placement::in_place};

// ---- hand-worked codes
// BF16: sign, 8 exponent bits (bias 127), 7 mantissa bits. FP8 E4M3: sign, 4 exponent bits
// (bias 7), 3 mantissa bits, max 448 = 0x7E, NaN 0x7F. E5M2: sign, 5 exponent bits (bias 15),
// 2 mantissa bits, max 57344 = 0x7B, inf 0x7C, NaN 0x7F. A negative value is its magnitude's
// code with the sign bit (0x8000 / 0x80) set.

uint16_t bf16_code(int value) {
  switch (value) {
    case 0: return 0x0000;
    case 1: return 0x3F80;   // 1.0 x 2^0
    case 2: return 0x4000;   // 1.0 x 2^1
    case 3: return 0x4040;   // 1.5 x 2^1
    case 4: return 0x4080;   // 1.0 x 2^2
    case 5: return 0x40A0;   // 1.25 x 2^2
    case 10: return 0x4120;  // 1.25 x 2^3
    default: break;
  }
  if (value < 0) return static_cast<uint16_t>(bf16_code(-value) | 0x8000);
  throw RuntimeError("no hand-worked BF16 code for " + std::to_string(value));
}

struct Fp8Codes {
  const char* name;
  CommDtype dtype;
  uint8_t half, one, two, three, four, ten;
  uint8_t max, nan;

  uint8_t of(int value) const {
    switch (value) {
      case 0: return 0x00;
      case 1: return one;
      case 2: return two;
      case 3: return three;
      case 4: return four;
      case 10: return ten;
      default: break;
    }
    if (value < 0) return static_cast<uint8_t>(of(-value) | 0x80);
    throw RuntimeError("no hand-worked FP8 code for " + std::to_string(value));
  }
  uint8_t minus_max() const { return static_cast<uint8_t>(max | 0x80); }
};

//                         0.5   1     2     3     4     10    max   NaN
const Fp8Codes kE4M3{"e4m3", CommDtype::e4m3, 0x30, 0x38, 0x40, 0x44, 0x48, 0x52, 0x7E, 0x7F};
const Fp8Codes kE5M2{"e5m2", CommDtype::e5m2, 0x38, 0x3C, 0x40, 0x42, 0x44, 0x49, 0x7B, 0x7F};

// Two-rank tables where rounding matters: row0 from group rank 0, row1 from group rank 1.
template <typename T>
struct PairTable {
  std::vector<T> row0, row1, expected;
};

// BF16 sum, rounding to nearest even at a tie:
//   1 + 2^-8         = 1.00390625, halfway between 1 (0x3F80, even) and 1+2^-7  -> 0x3F80
//   256 + 1          = 257, halfway between 256 (0x4380, even) and 258          -> 0x4380
//   (1+2^-7) + 2^-8  = halfway between 1+2^-7 (odd) and 1+2^-6 (0x3F82, even)   -> 0x3F82 (up)
//   -3 + 1           = -2 exactly                                               -> 0xC000
//   max + max        overflows: BF16 has infinity and does not saturate        -> 0x7F80
const PairTable<uint16_t> kBf16Sum{{0x3F80, 0x4380, 0x3F81, 0xC040, 0x7F7F},
                                   {0x3B80, 0x3F80, 0x3B80, 0x3F80, 0x7F7F},
                                   {0x3F80, 0x4380, 0x3F82, 0xC000, 0x7F80}};
// BF16 max: max(1, 2) = 2; max(-1, -2) = -1; a NaN operand loses to the number (as fmax).
const PairTable<uint16_t> kBf16Max{{0x3F80, 0xBF80, 0x7FC0, 0xBF00},
                                   {0x4000, 0xC000, 0x4040, 0x7FC0},
                                   {0x4000, 0xBF80, 0x4040, 0xBF00}};
// E4M3 sum (unit in the last place 1/8 in [1, 2), 32 in [256, 448]):
//   1 + 1 = 2 -> 0x40;  1 + 1/16: tie between 1 (m=0) and 1.125 (m=1) -> 1 (0x38);
//   1.125 + 1/16: tie between 1.125 (m=1) and 1.25 (m=2) -> 1.25 (0x3A);
//   448 + 256 = 704 saturates to 448 (0x7E);  -448 + -448 saturates to -448 (0xFE);
//   NaN + 1 = NaN (0x7F);  320 + 128 = 448 exactly (0x7E);  0.5 + -0.5 = +0 (0x00).
const PairTable<uint8_t> kE4M3Sum{{0x38, 0x38, 0x39, 0x7E, 0xFE, 0x7F, 0x7A, 0x30},
                                  {0x38, 0x18, 0x18, 0x78, 0xFE, 0x38, 0x70, 0xB0},
                                  {0x40, 0x38, 0x3A, 0x7E, 0xFE, 0x7F, 0x7E, 0x00}};
// E4M3 max: max(1, 2) = 2; max(-1, -2) = -1; max(NaN, 0.5) = 0.5; max(448, 2^-9) = 448;
// max(-2^-9, 2^-9) = 2^-9 (0x01, the smallest subnormal).
const PairTable<uint8_t> kE4M3Max{{0x38, 0xB8, 0x7F, 0x7E, 0x81},
                                  {0x40, 0xC0, 0x30, 0x01, 0x01},
                                  {0x40, 0xB8, 0x30, 0x7E, 0x01}};
// E5M2 sum (unit in the last place 1/4 in [1, 2)):
//   1 + 1 = 2 -> 0x40;  1 + 1/8: tie between 1 (m=0) and 1.25 (m=1) -> 1 (0x3C);
//   1.25 + 1/8: tie between 1.25 (m=1) and 1.5 (m=2) -> 1.5 (0x3E);
//   57344 + 32768 saturates to 57344 (0x7B);  -57344 + -57344 -> 0xFB;  NaN + 1 -> 0x7F;
//   inf + 1 = inf, which the saturating conversion turns into 57344 (0x7B).
const PairTable<uint8_t> kE5M2Sum{{0x3C, 0x3C, 0x3D, 0x7B, 0xFB, 0x7F, 0x7C},
                                  {0x3C, 0x30, 0x30, 0x78, 0xFB, 0x3C, 0x3C},
                                  {0x40, 0x3C, 0x3E, 0x7B, 0xFB, 0x7F, 0x7B}};
// E5M2 max: max(1, 2) = 2; max(-1, -2) = -1; max(NaN, 0.5) = 0.5; max(inf, 1) = inf -> 0x7B.
const PairTable<uint8_t> kE5M2Max{{0x3C, 0xBC, 0x7F, 0x7C}, {0x40, 0xC0, 0x38, 0x3C}, {0x40, 0xBC, 0x38, 0x7B}};

// What a group of n (1 or 2) returns for a pair table: the table's result, or alone, the input.
template <typename T>
const std::vector<T>& pair_expected(const PairTable<T>& table, int n) {
  return n == 1 ? table.row0 : table.expected;
}

template <typename T>
const std::vector<T>& pair_row(const PairTable<T>& table, int rank) {
  return rank == 0 ? table.row0 : table.row1;
}

template <typename T>
std::vector<T> repeated(const std::vector<T>& block, int times) {
  std::vector<T> out;
  for (int i = 0; i < times; ++i) out.insert(out.end(), block.begin(), block.end());
  return out;
}

// ---- checks, each run on every group

void check_membership(GroupUnderTest& g) {
  Communicator& comm = *g.comm;
  REQUIRE(comm.size() == static_cast<int>(g.members.size()));
  CHECK(g.members[static_cast<size_t>(comm.rank())] == world_rank());
  const std::vector<double> gathered =
      all_gather_result<double>(comm, g.space, {static_cast<double>(world_rank())}, CommDtype::f64,
                                Placement::out_of_place);
  CHECK(gathered == std::vector<double>(g.members.begin(), g.members.end()));
}

void check_all_reduce_floats(GroupUnderTest& g) {
  Communicator& comm = *g.comm;
  const int n = comm.size(), r = comm.rank();
  const double triangle = n * (n + 1) / 2.0;  // 1 + 2 + ... + n
  for (Placement placement : kPlacements) {
    INFO(to_string(placement));
    std::vector<float> f32_in(6), f32_sum(6), f32_max_in(6), f32_max(6);
    for (int i = 0; i < 6; ++i) {
      f32_in[i] = 0.5f * float(r + 1) * float(i + 1);
      f32_sum[i] = float(0.5 * (i + 1) * triangle);
      const float sign = i % 2 == 0 ? 1.0f : -1.0f;
      f32_max_in[i] = sign * float(r + 1) * float(i + 1);
      f32_max[i] = i % 2 == 0 ? float(n * (i + 1)) : -float(i + 1);
    }
    // Last element: NaN from rank 0, r+1 from the others; max ignores the NaN unless it is alone.
    f32_max_in[5] = r == 0 ? NAN : float(r + 1);
    f32_max[5] = n == 1 ? NAN : float(n);
    CHECK(all_reduce_result(comm, g.space, f32_in, CommDtype::f32, ReduceOp::sum, placement) == f32_sum);
    CHECK(same_values(all_reduce_result(comm, g.space, f32_max_in, CommDtype::f32, ReduceOp::max, placement), f32_max));

    // (r+1)(1 + (i+1) 2^-40): exact in FP64 only, so an FP32 detour would show.
    std::vector<double> f64_in(4), f64_sum(4), f64_max_in(4), f64_max(4);
    for (int i = 0; i < 4; ++i) {
      const double fine = 1.0 + std::ldexp(double(i + 1), -40);
      f64_in[i] = double(r + 1) * fine;
      f64_sum[i] = triangle * fine;
      f64_max_in[i] = (i % 2 == 0 ? 1.0 : -1.0) * double(r + 1) * fine;
      f64_max[i] = i % 2 == 0 ? double(n) * fine : -fine;
    }
    CHECK(all_reduce_result(comm, g.space, f64_in, CommDtype::f64, ReduceOp::sum, placement) == f64_sum);
    CHECK(all_reduce_result(comm, g.space, f64_max_in, CommDtype::f64, ReduceOp::max, placement) == f64_max);

    // Large enough for the implementations' pipelined paths.
    const std::vector<float> ones(size_t{1} << 16, 1.0f);
    CHECK(all_reduce_result(comm, g.space, ones, CommDtype::f32, ReduceOp::sum, placement) ==
          std::vector<float>(ones.size(), float(n)));
  }
}

void check_all_reduce_bf16(GroupUnderTest& g) {
  Communicator& comm = *g.comm;
  const int n = comm.size(), r = comm.rank();
  const int triangle = n * (n + 1) / 2;  // 1, 3 or 10: exact in BF16, as every partial sum is
  for (Placement placement : kPlacements) {
    INFO(to_string(placement));
    const std::vector<uint16_t> sum_in = {bf16_code(1), bf16_code(r + 1), bf16_code(-(r + 1))};
    const std::vector<uint16_t> sum_out = {bf16_code(n), bf16_code(triangle), bf16_code(-triangle)};
    CHECK(all_reduce_result(comm, g.space, sum_in, CommDtype::bf16, ReduceOp::sum, placement) == sum_out);
    const uint16_t nan = 0x7FC0;
    const std::vector<uint16_t> max_in = {bf16_code(r + 1), bf16_code(-(r + 1)), r == 0 ? nan : bf16_code(1)};
    const std::vector<uint16_t> max_out = {bf16_code(n), bf16_code(-1), n == 1 ? nan : bf16_code(1)};
    CHECK(all_reduce_result(comm, g.space, max_in, CommDtype::bf16, ReduceOp::max, placement) == max_out);

    const std::vector<uint16_t> many_ones(4096, bf16_code(1));
    CHECK(all_reduce_result(comm, g.space, many_ones, CommDtype::bf16, ReduceOp::sum, placement) ==
          std::vector<uint16_t>(many_ones.size(), bf16_code(n)));

    if (n > 2) continue;
    CHECK(all_reduce_result(comm, g.space, pair_row(kBf16Sum, r), CommDtype::bf16, ReduceOp::sum, placement) ==
          pair_expected(kBf16Sum, n));
    CHECK(all_reduce_result(comm, g.space, pair_row(kBf16Max, r), CommDtype::bf16, ReduceOp::max, placement) ==
          pair_expected(kBf16Max, n));
  }
}

void check_all_reduce_fp8(GroupUnderTest& g) {
  Communicator& comm = *g.comm;
  const int n = comm.size(), r = comm.rank();
  for (const Fp8Codes& codes : {kE4M3, kE5M2}) {
    for (Placement placement : kPlacements) {
      INFO(codes.name << ", " << to_string(placement));
      // Every rank adds 1, 0.5, max and -max: all partial sums exact or saturated, in any order.
      const uint8_t n_halves = n == 1 ? codes.half : codes.of(n / 2);
      const std::vector<uint8_t> sum_in = {codes.one, codes.half, codes.max, codes.minus_max()};
      const std::vector<uint8_t> sum_out = {codes.of(n), n_halves, codes.max, codes.minus_max()};
      CHECK(all_reduce_result(comm, g.space, sum_in, codes.dtype, ReduceOp::sum, placement) == sum_out);
      const std::vector<uint8_t> max_in = {codes.of(r + 1), codes.of(-(r + 1)), r == 0 ? codes.nan : codes.one};
      const std::vector<uint8_t> max_out = {codes.of(n), codes.of(-1), n == 1 ? codes.nan : codes.one};
      CHECK(all_reduce_result(comm, g.space, max_in, codes.dtype, ReduceOp::max, placement) == max_out);
    }
  }
  if (n > 2) return;
  for (Placement placement : kPlacements) {
    INFO(to_string(placement));
    CHECK(all_reduce_result(comm, g.space, pair_row(kE4M3Sum, r), CommDtype::e4m3, ReduceOp::sum, placement) ==
          pair_expected(kE4M3Sum, n));
    CHECK(all_reduce_result(comm, g.space, pair_row(kE4M3Max, r), CommDtype::e4m3, ReduceOp::max, placement) ==
          pair_expected(kE4M3Max, n));
    CHECK(all_reduce_result(comm, g.space, pair_row(kE5M2Sum, r), CommDtype::e5m2, ReduceOp::sum, placement) ==
          pair_expected(kE5M2Sum, n));
    CHECK(all_reduce_result(comm, g.space, pair_row(kE5M2Max, r), CommDtype::e5m2, ReduceOp::max, placement) ==
          pair_expected(kE5M2Max, n));
  }
}

void check_reduce_scatter(GroupUnderTest& g) {
  Communicator& comm = *g.comm;
  const int n = comm.size(), r = comm.rank();
  const double triangle = n * (n + 1) / 2.0;
  constexpr int k = 3;  // elements per rank
  for (Placement placement : kPlacements) {
    INFO(to_string(placement));
    // Element e of the [n*k] input is (r+1)(e+1); rank r receives elements r*k .. r*k+k-1.
    std::vector<float> f32_in(size_t(n) * k), f32_max_in(size_t(n) * k);
    std::vector<double> f64_in(size_t(n) * k);
    for (int e = 0; e < n * k; ++e) {
      f32_in[e] = float(r + 1) * float(e + 1);
      f64_in[e] = double(r + 1) * (1.0 + std::ldexp(double(e + 1), -40));
      f32_max_in[e] = (e % 2 == 0 ? 1.0f : -1.0f) * float(r + 1) * float(e + 1);
    }
    std::vector<float> f32_sum(k), f32_max(k);
    std::vector<double> f64_sum(k);
    for (int i = 0; i < k; ++i) {
      const int e = r * k + i;
      f32_sum[i] = float(triangle * (e + 1));
      f64_sum[i] = triangle * (1.0 + std::ldexp(double(e + 1), -40));
      f32_max[i] = e % 2 == 0 ? float(n * (e + 1)) : -float(e + 1);
    }
    CHECK(reduce_scatter_result(comm, g.space, f32_in, CommDtype::f32, ReduceOp::sum, placement) == f32_sum);
    CHECK(reduce_scatter_result(comm, g.space, f32_max_in, CommDtype::f32, ReduceOp::max, placement) == f32_max);
    CHECK(reduce_scatter_result(comm, g.space, f64_in, CommDtype::f64, ReduceOp::sum, placement) == f64_sum);

    // Encoded types, blocks of 2: element 0 sums (or maxes) every rank; element 1 carries the
    // block's destination (j+1) from rank 0 alone, so each rank sees it received its own block.
    std::vector<uint16_t> bf16_sum_in, bf16_max_in;
    for (int j = 0; j < n; ++j) {
      bf16_sum_in.insert(bf16_sum_in.end(), {bf16_code(1), r == 0 ? bf16_code(j + 1) : bf16_code(0)});
      bf16_max_in.insert(bf16_max_in.end(), {bf16_code(r + 1), r == 0 ? bf16_code(j + 1) : bf16_code(-1)});
    }
    const std::vector<uint16_t> bf16_out = {bf16_code(n), bf16_code(r + 1)};
    CHECK(reduce_scatter_result(comm, g.space, bf16_sum_in, CommDtype::bf16, ReduceOp::sum, placement) == bf16_out);
    CHECK(reduce_scatter_result(comm, g.space, bf16_max_in, CommDtype::bf16, ReduceOp::max, placement) == bf16_out);
    for (const Fp8Codes& codes : {kE4M3, kE5M2}) {
      INFO(codes.name);
      std::vector<uint8_t> sum_in, max_in;
      for (int j = 0; j < n; ++j) {
        sum_in.insert(sum_in.end(), {codes.one, r == 0 ? codes.of(j + 1) : codes.of(0)});
        max_in.insert(max_in.end(), {codes.of(r + 1), r == 0 ? codes.of(j + 1) : codes.of(-1)});
      }
      const std::vector<uint8_t> out = {codes.of(n), codes.of(r + 1)};
      CHECK(reduce_scatter_result(comm, g.space, sum_in, codes.dtype, ReduceOp::sum, placement) == out);
      CHECK(reduce_scatter_result(comm, g.space, max_in, codes.dtype, ReduceOp::max, placement) == out);
    }

    if (n > 2) continue;
    // The rounding tables, every block the same: every rank receives the table's result.
    CHECK(reduce_scatter_result(comm, g.space, repeated(pair_row(kBf16Sum, r), n), CommDtype::bf16, ReduceOp::sum,
                                placement) == pair_expected(kBf16Sum, n));
    CHECK(reduce_scatter_result(comm, g.space, repeated(pair_row(kE4M3Sum, r), n), CommDtype::e4m3, ReduceOp::sum,
                                placement) == pair_expected(kE4M3Sum, n));
    CHECK(reduce_scatter_result(comm, g.space, repeated(pair_row(kE5M2Max, r), n), CommDtype::e5m2, ReduceOp::max,
                                placement) == pair_expected(kE5M2Max, n));
  }
}

void check_all_gather(GroupUnderTest& g) {
  Communicator& comm = *g.comm;
  const int n = comm.size(), r = comm.rank();
  for (Placement placement : kPlacements) {
    INFO(to_string(placement));
    std::vector<float> f32_expected;
    std::vector<double> f64_expected;
    std::vector<uint8_t> u8_expected, e4m3_expected;
    std::vector<uint16_t> bf16_expected;
    for (int j = 0; j < n; ++j) {
      for (int i = 0; i < 3; ++i) {
        f32_expected.push_back(float(10 * j + i) + 0.25f);
        u8_expected.push_back(uint8_t(16 * j + i));
        bf16_expected.push_back(uint16_t(0x1000 * j + i));
        e4m3_expected.push_back(uint8_t(0x10 * j + i));
      }
      f64_expected.push_back(j + 0.5);
    }
    CHECK(all_gather_result<float>(comm, g.space, {10.0f * r + 0.25f, 10.0f * r + 1.25f, 10.0f * r + 2.25f},
                                   CommDtype::f32, placement) == f32_expected);
    CHECK(all_gather_result<double>(comm, g.space, {r + 0.5}, CommDtype::f64, placement) == f64_expected);
    CHECK(all_gather_result<uint8_t>(comm, g.space, {uint8_t(16 * r), uint8_t(16 * r + 1), uint8_t(16 * r + 2)},
                                     CommDtype::u8, placement) == u8_expected);
    // Encoded types travel as raw codes, whatever they mean.
    CHECK(all_gather_result<uint16_t>(comm, g.space,
                                      {uint16_t(0x1000 * r), uint16_t(0x1000 * r + 1), uint16_t(0x1000 * r + 2)},
                                      CommDtype::bf16, placement) == bf16_expected);
    CHECK(all_gather_result<uint8_t>(comm, g.space, {uint8_t(0x10 * r), uint8_t(0x10 * r + 1), uint8_t(0x10 * r + 2)},
                                     CommDtype::e4m3, placement) == e4m3_expected);
  }
}

void check_broadcast(GroupUnderTest& g) {
  Communicator& comm = *g.comm;
  for (int root = 0; root < comm.size(); ++root) {
    INFO("root " << root);
    const std::vector<uint8_t> u8 = {uint8_t(40 * root + 1), uint8_t(40 * root + 2), uint8_t(40 * root + 3)};
    CHECK(broadcast_result(comm, g.space, u8, CommDtype::u8, root) == u8);
    const std::vector<float> f32 = {100.0f * root + 0.5f, -1.0f, 3.0e30f};
    CHECK(broadcast_result(comm, g.space, f32, CommDtype::f32, root) == f32);
    const std::vector<uint8_t> e5m2 = {uint8_t(0x20 * root), 0x7C, 0x7F};
    CHECK(broadcast_result(comm, g.space, e5m2, CommDtype::e5m2, root) == e5m2);
  }
}

void check_all_to_all(GroupUnderTest& g) {
  Communicator& comm = *g.comm;
  const int n = comm.size(), r = comm.rank();
  constexpr int k = 3;
  // Block j of rank r's input goes to rank j: element i of it is (r, j, i) in a code.
  std::vector<uint8_t> u8_in, u8_out;
  std::vector<float> f32_in, f32_out;
  std::vector<uint16_t> bf16_in, bf16_out;
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < k; ++i) {
      u8_in.push_back(uint8_t(64 * r + 16 * j + i));
      u8_out.push_back(uint8_t(64 * j + 16 * r + i));  // block j came from rank j
      f32_in.push_back(float(100 * r + 10 * j + i));
      f32_out.push_back(float(100 * j + 10 * r + i));
      bf16_in.push_back(uint16_t(0x100 * r + 0x10 * j + i));
      bf16_out.push_back(uint16_t(0x100 * j + 0x10 * r + i));
    }
  }
  CHECK(all_to_all_result(comm, g.space, u8_in, CommDtype::u8) == u8_out);
  CHECK(all_to_all_result(comm, g.space, f32_in, CommDtype::f32) == f32_out);
  CHECK(all_to_all_result(comm, g.space, bf16_in, CommDtype::bf16) == bf16_out);
}

// The distributed optimizer's use of the in-place forms (apps/engine.cpp): a bucket in the
// middle of a slab is reduce-scattered in place (this rank's block of the sum lands where its
// block was) and later all-gathered in place (this rank's block goes out from where it is),
// and nothing outside the bucket moves; a staging buffer of one bucket, reused by the next
// bucket, does the same in BF16.
void check_in_place_in_a_slab(GroupUnderTest& g) {
  Communicator& comm = *g.comm;
  const int n = comm.size(), r = comm.rank();
  constexpr int k = 3, guard = 2;  // elements per rank; guard elements on each side of the bucket
  const double triangle = n * (n + 1) / 2.0;
  // [guard | bucket of n*k | guard]; bucket element e is (r+1)(e+1), the guards -1 .. -4.
  std::vector<float> slab = {-1.0f, -2.0f};
  for (int e = 0; e < n * k; ++e) slab.push_back(float(r + 1) * float(e + 1));
  slab.insert(slab.end(), {-3.0f, -4.0f});
  TestBuffer buffer(g.space, slab.size() * sizeof(float));
  buffer.write(slab.data(), slab.size() * sizeof(float));
  const size_t own = (guard + size_t(r) * k) * sizeof(float);
  comm.reduce_scatter(buffer.bytes_at(guard * sizeof(float)), buffer.bytes_at(own), k, CommDtype::f32, ReduceOp::sum);
  std::vector<float> reduced(k);
  for (int i = 0; i < k; ++i) reduced[i] = float(triangle * (r * k + i + 1));
  CHECK(from_bytes<float>(buffer.read(own, k * sizeof(float))) == reduced);
  const std::vector<float> front = {-1.0f, -2.0f}, back = {-3.0f, -4.0f};
  CHECK(from_bytes<float>(buffer.read(0, guard * sizeof(float))) == front);
  CHECK(from_bytes<float>(buffer.read((guard + size_t(n) * k) * sizeof(float), guard * sizeof(float))) == back);

  // Each rank's updated block, 1000r + i, gathered in place over the bucket.
  std::vector<float> updated(k), gathered;
  for (int i = 0; i < k; ++i) updated[i] = float(1000 * r + i);
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < k; ++i) gathered.push_back(float(1000 * j + i));
  buffer.write(updated.data(), k * sizeof(float), own);
  comm.all_gather(buffer.bytes_at(own), buffer.bytes_at(guard * sizeof(float)), k, CommDtype::f32);
  CHECK(from_bytes<float>(buffer.read(guard * sizeof(float), size_t(n) * k * sizeof(float))) == gathered);
  CHECK(from_bytes<float>(buffer.read(0, guard * sizeof(float))) == front);
  CHECK(from_bytes<float>(buffer.read((guard + size_t(n) * k) * sizeof(float), guard * sizeof(float))) == back);

  // One staging buffer of n*2 BF16 values, two buckets in turn, each reduced in place in it.
  // Bucket b, block j: (1 from every rank, summed: n), then (j + 1 + b from rank 0 alone).
  TestBuffer staging(g.space, size_t(n) * 2 * sizeof(uint16_t));
  for (int bucket = 0; bucket < 2; ++bucket) {
    INFO("staged bucket " << bucket);
    std::vector<uint16_t> codes;
    for (int j = 0; j < n; ++j) codes.insert(codes.end(), {bf16_code(1), r == 0 ? bf16_code(j + 1 + bucket) : bf16_code(0)});
    staging.write(codes.data(), codes.size() * sizeof(uint16_t));
    const size_t own_codes = size_t(r) * 2 * sizeof(uint16_t);
    comm.reduce_scatter(staging.data(), staging.bytes_at(own_codes), 2, CommDtype::bf16, ReduceOp::sum);
    CHECK(from_bytes<uint16_t>(staging.read(own_codes, 2 * sizeof(uint16_t))) ==
          std::vector<uint16_t>{bf16_code(n), bf16_code(r + 1 + bucket)});
  }
}

// Bytes sent by this rank for a fixed sequence of calls, worked out from the ring volumes:
//   all_reduce f32 x1000: 2(n-1)/n * 4000;  all_reduce e4m3 x1: 2(n-1)/n * 1, rounded down;
//   reduce_scatter f64 x10: (n-1) * 80;  all_gather bf16 x3: (n-1) * 6;
//   all_to_all u8 x5: (n-1) * 5;  broadcast f32 x7 from rank 0: 28 on rank 0, 0 elsewhere.
struct ExpectedTraffic {
  uint64_t all_reduce, reduce_scatter, all_gather, all_to_all, broadcast_on_root;
};
ExpectedTraffic expected_traffic(int n) {
  switch (n) {
    case 1: return {0, 0, 0, 0, 0};
    case 2: return {4000 + 1, 80, 6, 5, 28};
    case 4: return {6000 + 1, 240, 18, 15, 28};  // 2*3/4 of one byte rounds down to 1
    default: break;
  }
  throw RuntimeError("no hand-worked traffic for a group of " + std::to_string(n));
}

void check_traffic(GroupUnderTest& g) {
  Communicator& comm = *g.comm;
  comm.reset_traffic();
  const int n = comm.size();
  TestBuffer floats(g.space, 8 * 1000), bytes(g.space, 8 * 64);
  comm.all_reduce(floats.data(), floats.data(), 1000, CommDtype::f32, ReduceOp::sum);
  comm.all_reduce(bytes.data(), bytes.data(), 1, CommDtype::e4m3, ReduceOp::max);
  comm.reduce_scatter(floats.data(), floats.bytes_at(size_t(comm.rank()) * 80), 10, CommDtype::f64, ReduceOp::sum);
  comm.all_gather(bytes.data(), bytes.bytes_at(64), 3, CommDtype::bf16);
  comm.all_to_all(bytes.data(), bytes.bytes_at(256), 5, CommDtype::u8);
  comm.broadcast(floats.data(), 7, CommDtype::f32, 0);
  comm.barrier();
  (void)floats.read(0, 4);  // waits for the stream on the GPU

  const ExpectedTraffic expected = expected_traffic(n);
  const CommTraffic& t = comm.traffic();
  CHECK(t[Collective::all_reduce].bytes_sent == expected.all_reduce);
  CHECK(t[Collective::all_reduce].calls == 2);
  CHECK(t[Collective::reduce_scatter].bytes_sent == expected.reduce_scatter);
  CHECK(t[Collective::all_gather].bytes_sent == expected.all_gather);
  CHECK(t[Collective::all_to_all].bytes_sent == expected.all_to_all);
  CHECK(t[Collective::broadcast].bytes_sent == (comm.rank() == 0 ? expected.broadcast_on_root : 0));
  CHECK(t[Collective::barrier].bytes_sent == 0);
  CHECK(t[Collective::barrier].calls == 1);
  CHECK(t.total_calls() == 7);
  comm.reset_traffic();
  CHECK(comm.traffic().total_bytes_sent() == 0);
}

}  // namespace

// ---- MPI: host buffers

TEST_CASE("mpi: groups of TP=2 contain the ranks Megatron puts there", "[mpi]") {
  const int w = world_rank();
  const ProcessGroups groups = ProcessGroups::create_host(detect_parallel_layout(test_tp_size()));
  const ParallelLayout& layout = groups.layout();
  if (world_size() == 4) {  // worked out by hand
    CHECK(tensor_parallel_group_ranks(layout) == (w < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}));
    CHECK(data_parallel_group_ranks(layout) == (w % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3}));
    CHECK(layout.tp_rank == w % 2);
    CHECK(layout.dp_rank == w / 2);
  }
  if (world_size() == 2) {
    CHECK(tensor_parallel_group_ranks(layout) == std::vector<int>{0, 1});
    CHECK(data_parallel_group_ranks(layout) == std::vector<int>{w});
  }
  for (GroupUnderTest& group : groups_under_test(groups)) {
    INFO("group " << group.comm->name());
    check_membership(group);
  }
}

TEST_CASE("mpi: MpiSession and the layout under mpirun", "[mpi]") {
  MpiSession session;  // MPI is already initialized by main: the session only observes it
  CHECK(session.active());
  CHECK(session.thread_level() == MPI_THREAD_MULTIPLE);
  CHECK(launched_by_mpi());
  const ParallelLayout layout = detect_parallel_layout(1);
  CHECK(layout.world_size == world_size());
  CHECK(layout.world_rank == world_rank());
  CHECK(layout.local_size == world_size());  // every rank runs on this one machine
  CHECK(layout.local_rank == world_rank());
  CHECK_THROWS_AS(detect_parallel_layout(3), InputError);
}

TEST_CASE("mpi: a borrowed MPI_COMM_WORLD communicator", "[mpi]") {
  MpiCommunicator world(MPI_COMM_WORLD, "mpi_world");
  CHECK(world.size() == world_size());
  CHECK(world.rank() == world_rank());
  CHECK(world.name() == "mpi_world");
  std::vector<int> everyone(static_cast<size_t>(world_size()));
  std::iota(everyone.begin(), everyone.end(), 0);
  GroupUnderTest group{&world, everyone, {}};
  check_membership(group);
  check_all_reduce_floats(group);
}

TEST_CASE("mpi: all_reduce f32 and f64, sum and max", "[mpi]") { for_each_host_group(check_all_reduce_floats); }
TEST_CASE("mpi: all_reduce bf16 rounds each partial sum to nearest even", "[mpi]") {
  for_each_host_group(check_all_reduce_bf16);
}
TEST_CASE("mpi: all_reduce e4m3 and e5m2 round and saturate", "[mpi]") { for_each_host_group(check_all_reduce_fp8); }
TEST_CASE("mpi: reduce_scatter", "[mpi]") { for_each_host_group(check_reduce_scatter); }
TEST_CASE("mpi: all_gather", "[mpi]") { for_each_host_group(check_all_gather); }
TEST_CASE("mpi: reduce_scatter and all_gather in place within a slab touch only their bucket", "[mpi]") {
  for_each_host_group(check_in_place_in_a_slab);
}
TEST_CASE("mpi: broadcast from every root", "[mpi]") { for_each_host_group(check_broadcast); }
TEST_CASE("mpi: all_to_all", "[mpi]") { for_each_host_group(check_all_to_all); }
TEST_CASE("mpi: traffic counters follow the ring volumes", "[mpi]") { for_each_host_group(check_traffic); }

TEST_CASE("mpi: misuse throws on every rank, before any communication", "[mpi]") {
  const ProcessGroups groups = ProcessGroups::create_host(detect_parallel_layout(test_tp_size()));
  std::vector<uint8_t> bytes(64, 0);
  for (Communicator* comm : {&groups.world(), &groups.tp(), &groups.dp()}) {
    INFO(comm->name());
    try {
      comm->all_reduce(bytes.data(), bytes.data(), 8, CommDtype::u8, ReduceOp::sum);
      FAIL("u8 reduced");
    } catch (const RuntimeError& e) {
      CHECK_THAT(std::string(e.what()), ContainsSubstring(comm->name() + ".all_reduce: u8 is raw bytes"));
    }
    CHECK_THROWS_AS(comm->broadcast(bytes.data(), 8, CommDtype::u8, comm->size()), RuntimeError);
    CHECK_THROWS_AS(comm->reduce_scatter(bytes.data(), bytes.data() + 1, 4, CommDtype::e4m3, ReduceOp::sum),
                    RuntimeError);
    comm->barrier();  // every rank is still in step
  }
}

TEST_CASE("mpi: the recording decorator logs each call in order and forwards it", "[mpi]") {
  const ProcessGroups groups = ProcessGroups::create_host(detect_parallel_layout(test_tp_size()));
  std::vector<std::string> log;
  RecordingCommunicator tp(groups.tp(), log), dp(groups.dp(), log);
  const int n_tp = tp.size();
  CHECK(tp.name() == "tp");
  CHECK(dp.name() == "dp");
  CHECK(tp.rank() == groups.tp().rank());

  std::vector<uint16_t> ones(4, bf16_code(1));
  tp.all_reduce(ones.data(), ones.data(), 4, CommDtype::bf16, ReduceOp::sum);
  CHECK(ones == std::vector<uint16_t>(4, bf16_code(n_tp)));
  log.push_back("op: between the collectives");
  std::vector<uint8_t> bytes = {1, 2, 3};
  dp.broadcast(bytes.data(), 3, CommDtype::u8, 0);
  std::vector<float> floats(size_t(2) * n_tp, 1.0f), floats_out(2);
  tp.reduce_scatter(floats.data(), floats_out.data(), 2, CommDtype::f32, ReduceOp::max);
  std::vector<uint8_t> codes(2, 0x38), gathered(size_t(2) * n_tp);
  tp.all_gather(codes.data(), gathered.data(), 2, CommDtype::e4m3);
  std::vector<uint8_t> exchange(dp.size(), 0x3C), exchanged(dp.size());
  dp.all_to_all(exchange.data(), exchanged.data(), 1, CommDtype::e5m2);
  tp.barrier();

  CHECK(log == std::vector<std::string>{"tp.all_reduce bf16 x4 sum", "op: between the collectives",
                                        "dp.broadcast u8 x3 root=0", "tp.reduce_scatter f32 x2 max",
                                        "tp.all_gather e4m3 x2", "dp.all_to_all e5m2 x1", "tp.barrier"});
  CHECK(tp.traffic().total_calls() == 4);
  CHECK(dp.traffic().total_calls() == 2);
  CHECK(tp.traffic()[Collective::all_reduce].bytes_sent == groups.tp().traffic()[Collective::all_reduce].bytes_sent);
}

// ---- NCCL: the same checks on device buffers

TEST_CASE("nccl: groups of TP=2 contain the ranks Megatron puts there", "[nccl][gpu]") {
  for_each_gpu_group(check_membership);
}
TEST_CASE("nccl: all_reduce f32 and f64, sum and max", "[nccl][gpu]") { for_each_gpu_group(check_all_reduce_floats); }
TEST_CASE("nccl: all_reduce bf16 rounds each partial sum to nearest even", "[nccl][gpu]") {
  for_each_gpu_group(check_all_reduce_bf16);
}
TEST_CASE("nccl: all_reduce e4m3 and e5m2 round and saturate", "[nccl][gpu]") {
  for_each_gpu_group(check_all_reduce_fp8);
}
TEST_CASE("nccl: reduce_scatter", "[nccl][gpu]") { for_each_gpu_group(check_reduce_scatter); }
TEST_CASE("nccl: all_gather", "[nccl][gpu]") { for_each_gpu_group(check_all_gather); }
TEST_CASE("nccl: reduce_scatter and all_gather in place within a slab touch only their bucket", "[nccl][gpu]") {
  for_each_gpu_group(check_in_place_in_a_slab);
}
TEST_CASE("nccl: broadcast from every root", "[nccl][gpu]") { for_each_gpu_group(check_broadcast); }
TEST_CASE("nccl: all_to_all", "[nccl][gpu]") { for_each_gpu_group(check_all_to_all); }
TEST_CASE("nccl: traffic counters follow the ring volumes", "[nccl][gpu]") { for_each_gpu_group(check_traffic); }
