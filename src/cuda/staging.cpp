#include "cuda/staging.hpp"

#include <map>
#include <mutex>
#include <vector>

#include "cuda/cuda_util.hpp"

namespace sluice::detail::staging {
namespace {

namespace cu = sluice::detail::cuda;

constexpr uint64_t kChunk = 1ull << 20;
constexpr size_t kPoolPerClass = 32;  // at most 32 idle buffers per size class are kept

std::mutex g_mu;
std::map<uint64_t, std::vector<uint8_t*>> g_pool;  // size class -> free buffers

uint64_t size_class(uint64_t n) {
  uint64_t c = 64 << 10;
  while (c < n) c <<= 1;
  return c;
}

// The device of a pointer, made current for the copy.
void set_device_of(const void* p) {
  int d = cu::pointer_device(p);
  if (d < 0) throw Error(ErrorCode::kInvalidArgument, "staging: not device memory");
  cu::check(cudaSetDevice(d), "cudaSetDevice");
}

}  // namespace

bool available() { return cu::device_count() > 0; }
bool is_device_ptr(const void* p) { return cu::pointer_device(p) >= 0; }

std::shared_ptr<uint8_t> pinned(uint64_t n) {
  uint64_t c = size_class(n);
  uint8_t* p = nullptr;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto& v = g_pool[c];
    if (!v.empty()) {
      p = v.back();
      v.pop_back();
    }
  }
  if (!p) cu::check(cudaMallocHost(reinterpret_cast<void**>(&p), c), "cudaMallocHost");
  return std::shared_ptr<uint8_t>(p, [c](uint8_t* q) {
    {
      std::lock_guard<std::mutex> lk(g_mu);
      auto& v = g_pool[c];
      if (v.size() < kPoolPerClass) {
        v.push_back(q);
        return;
      }
    }
    cudaFreeHost(q);
  });
}

void download(void* host, const void* device, uint64_t n) {
  set_device_of(device);
  cu::check(cudaMemcpy(host, device, n, cudaMemcpyDeviceToHost), "cudaMemcpy (staging download)");
}

void upload(void* device, const void* host, uint64_t n) {
  set_device_of(device);
  cu::check(cudaMemcpy(device, host, n, cudaMemcpyHostToDevice), "cudaMemcpy (staging upload)");
}

std::shared_ptr<uint8_t> download_copy(const void* device, uint64_t n) {
  auto buf = pinned(n);
  download(buf.get(), device, n);
  return buf;
}

bool receive(void* device, uint64_t n, const std::function<bool(void*, uint64_t)>& read) {
  set_device_of(device);
  thread_local cudaStream_t stream = nullptr;
  thread_local int stream_dev = -1;
  int dev = 0;
  cudaGetDevice(&dev);
  if (!stream || stream_dev != dev) {
    cu::check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    stream_dev = dev;
  }
  std::shared_ptr<uint8_t> buf[2] = {pinned(std::min(n, kChunk)), pinned(std::min(n, kChunk))};
  cudaEvent_t done[2] = {nullptr, nullptr};
  for (auto& e : done) cu::check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  bool ok = true;
  uint64_t off = 0;
  for (int k = 0; off < n; k ^= 1) {
    uint64_t m = std::min(kChunk, n - off);
    cudaEventSynchronize(done[k]);  // the upload that last used this buffer
    if (!read(buf[k].get(), m)) {
      ok = false;
      break;
    }
    cu::check(cudaMemcpyAsync(static_cast<uint8_t*>(device) + off, buf[k].get(), m, cudaMemcpyHostToDevice, stream),
              "cudaMemcpyAsync (staging upload)");
    cu::check(cudaEventRecord(done[k], stream), "cudaEventRecord");
    off += m;
  }
  cudaStreamSynchronize(stream);
  for (auto e : done) cudaEventDestroy(e);
  return ok;
}

}  // namespace sluice::detail::staging
