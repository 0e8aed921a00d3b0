// Helpers for the multi-rank tests: run one collective on host (MPI) or device (NCCL) buffers and
// return this rank's result on the host, so that one test body checks both implementations.
//
// Every rank of a group must make the same calls in the same order. Checks after a collective use
// CHECK (never REQUIRE), so a wrong value on one rank does not make it skip the next collective
// and leave the others waiting.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch_tostring.hpp>
#include <cuda_runtime.h>

#include "core/check_cuda.h"
#include "core/error.h"
#include "parallel/communicator.h"

namespace fp8lm::testing {

// Output buffers start as this byte: NaN in every float format, so an unwritten result shows.
inline constexpr uint8_t kPoison = 0xFF;

// Where a communicator's buffers live; device buffers are used on the communicator's stream.
struct BufferSpace {
  bool on_device = false;
  cudaStream_t stream = nullptr;
};

class TestBuffer {
 public:
  TestBuffer(const BufferSpace& space, size_t bytes) : space_(space), bytes_(bytes) {
    if (space_.on_device) {
      CUDA_CHECK(cudaMalloc(&device_, bytes_ == 0 ? 1 : bytes_));
      // cudaMemset runs on the legacy default stream, which does not order itself with the
      // communicator's non-blocking stream: wait, or the poison may land after the result.
      CUDA_CHECK(cudaMemset(device_, kPoison, bytes_));
      CUDA_CHECK(cudaDeviceSynchronize());
    } else {
      host_.assign(bytes_, kPoison);
    }
  }
  ~TestBuffer() {
    if (device_ != nullptr) cudaFree(device_);
  }
  TestBuffer(const TestBuffer&) = delete;
  TestBuffer& operator=(const TestBuffer&) = delete;

  void* data() { return space_.on_device ? device_ : static_cast<void*>(host_.data()); }
  char* bytes_at(size_t offset) { return static_cast<char*>(data()) + offset; }

  void write(const void* source, size_t bytes, size_t offset = 0) {
    FP8LM_CHECK(offset + bytes <= bytes_);
    if (space_.on_device) {
      CUDA_CHECK(cudaMemcpy(static_cast<char*>(device_) + offset, source, bytes, cudaMemcpyHostToDevice));
    } else {
      std::memcpy(host_.data() + offset, source, bytes);
    }
  }
  // Waits for the stream first: the collective may still be running there.
  std::vector<uint8_t> read(size_t offset, size_t bytes) const {
    FP8LM_CHECK(offset + bytes <= bytes_);
    std::vector<uint8_t> out(bytes);
    if (space_.on_device) {
      CUDA_CHECK(cudaStreamSynchronize(space_.stream));
      CUDA_CHECK(cudaMemcpy(out.data(), static_cast<char*>(device_) + offset, bytes, cudaMemcpyDeviceToHost));
    } else {
      std::memcpy(out.data(), host_.data() + offset, bytes);
    }
    return out;
  }

 private:
  BufferSpace space_;
  size_t bytes_;
  std::vector<uint8_t> host_;
  void* device_ = nullptr;
};

enum class Placement { out_of_place, in_place };

inline const char* to_string(Placement placement) {
  return placement == Placement::in_place ? "in place" : "out of place";
}

template <typename T>
std::vector<T> from_bytes(const std::vector<uint8_t>& bytes) {
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

template <typename T>
void check_element_type(CommDtype dtype) {
  FP8LM_CHECK(sizeof(T) == comm_dtype_size(dtype), "test element type does not match ", to_string(dtype));
}

// input [count] -> [count]
template <typename T>
std::vector<T> all_reduce_result(Communicator& comm, const BufferSpace& space, const std::vector<T>& input,
                                 CommDtype dtype, ReduceOp op, Placement placement) {
  check_element_type<T>(dtype);
  const size_t bytes = input.size() * sizeof(T);
  TestBuffer send(space, bytes);
  send.write(input.data(), bytes);
  if (placement == Placement::in_place) {
    comm.all_reduce(send.data(), send.data(), input.size(), dtype, op);
    return from_bytes<T>(send.read(0, bytes));
  }
  TestBuffer recv(space, bytes);
  comm.all_reduce(send.data(), recv.data(), input.size(), dtype, op);
  return from_bytes<T>(recv.read(0, bytes));
}

// input [size*count] -> [count]: block `rank` of the reduction
template <typename T>
std::vector<T> reduce_scatter_result(Communicator& comm, const BufferSpace& space, const std::vector<T>& input,
                                     CommDtype dtype, ReduceOp op, Placement placement) {
  check_element_type<T>(dtype);
  const size_t count = input.size() / static_cast<size_t>(comm.size());
  const size_t block_bytes = count * sizeof(T);
  TestBuffer send(space, input.size() * sizeof(T));
  send.write(input.data(), input.size() * sizeof(T));
  if (placement == Placement::in_place) {
    const size_t own = static_cast<size_t>(comm.rank()) * block_bytes;
    comm.reduce_scatter(send.data(), send.bytes_at(own), count, dtype, op);
    return from_bytes<T>(send.read(own, block_bytes));
  }
  TestBuffer recv(space, block_bytes);
  comm.reduce_scatter(send.data(), recv.data(), count, dtype, op);
  return from_bytes<T>(recv.read(0, block_bytes));
}

// input [count] -> [size*count]
template <typename T>
std::vector<T> all_gather_result(Communicator& comm, const BufferSpace& space, const std::vector<T>& input,
                                 CommDtype dtype, Placement placement) {
  check_element_type<T>(dtype);
  const size_t block_bytes = input.size() * sizeof(T);
  const size_t total_bytes = block_bytes * static_cast<size_t>(comm.size());
  TestBuffer recv(space, total_bytes);
  if (placement == Placement::in_place) {
    const size_t own = static_cast<size_t>(comm.rank()) * block_bytes;
    recv.write(input.data(), block_bytes, own);
    comm.all_gather(recv.bytes_at(own), recv.data(), input.size(), dtype);
  } else {
    TestBuffer send(space, block_bytes);
    send.write(input.data(), block_bytes);
    comm.all_gather(send.data(), recv.data(), input.size(), dtype);
    return from_bytes<T>(recv.read(0, total_bytes));  // before `send` is freed
  }
  return from_bytes<T>(recv.read(0, total_bytes));
}

// root's input [count] -> [count]; the other ranks' buffers start poisoned
template <typename T>
std::vector<T> broadcast_result(Communicator& comm, const BufferSpace& space, const std::vector<T>& root_input,
                                CommDtype dtype, int root) {
  check_element_type<T>(dtype);
  const size_t bytes = root_input.size() * sizeof(T);
  TestBuffer buffer(space, bytes);
  if (comm.rank() == root) buffer.write(root_input.data(), bytes);
  comm.broadcast(buffer.data(), root_input.size(), dtype, root);
  return from_bytes<T>(buffer.read(0, bytes));
}

// input [size*count] -> [size*count]
template <typename T>
std::vector<T> all_to_all_result(Communicator& comm, const BufferSpace& space, const std::vector<T>& input,
                                 CommDtype dtype) {
  check_element_type<T>(dtype);
  const size_t bytes = input.size() * sizeof(T);
  TestBuffer send(space, bytes), recv(space, bytes);
  send.write(input.data(), bytes);
  comm.all_to_all(send.data(), recv.data(), input.size() / static_cast<size_t>(comm.size()), dtype);
  return from_bytes<T>(recv.read(0, bytes));
}

// A group under test: its communicator, the world ranks it should contain (in group-rank order),
// and where its buffers live.
struct GroupUnderTest {
  Communicator* comm;
  std::vector<int> members;
  BufferSpace space;
};

}  // namespace fp8lm::testing

// Encoded values (BF16, FP8 and raw bytes) print as hex codes, as the tests' tables write them.
namespace Catch {
template <typename Code>
std::string hex_codes(const std::vector<Code>& codes) {
  std::string out = "{";
  for (size_t i = 0; i < codes.size(); ++i) {
    char code[8];
    std::snprintf(code, sizeof code, sizeof(Code) == 1 ? "0x%02X" : "0x%04X", static_cast<unsigned>(codes[i]));
    out += (i ? ", " : " ") + std::string(code);
  }
  return out + " }";
}
template <>
struct StringMaker<std::vector<uint8_t>> {
  static std::string convert(const std::vector<uint8_t>& codes) { return hex_codes(codes); }
};
template <>
struct StringMaker<std::vector<uint16_t>> {
  static std::string convert(const std::vector<uint16_t>& codes) { return hex_codes(codes); }
};
}  // namespace Catch
