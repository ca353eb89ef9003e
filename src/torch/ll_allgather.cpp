#include "ll_allgather.hpp"

#include <dlfcn.h>

#include <map>
#include <sstream>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "core/log.hpp"
#include "sluice/allgather.hpp"
#include "sluice/cuda.hpp"
#include "sluice/error.hpp"

namespace sluice::torch_backend {

namespace {

void put(c10d::Store& store, const std::string& k, const std::string& v) {
  store.set(k, std::vector<uint8_t>(v.begin(), v.end()));
}

std::string first_word(const std::string& s, std::string* rest) {
  auto sp = s.find(' ');
  if (rest) *rest = sp == std::string::npos ? "" : s.substr(sp + 1);
  return s.substr(0, sp);
}

}  // namespace

std::string gpu_bus_id(int ordinal) {
  static void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib || ordinal < 0) return "";
  using Init = int (*)(unsigned);
  using Get = int (*)(int*, int);
  using BusId = int (*)(char*, int, int);
  auto init = reinterpret_cast<Init>(::dlsym(lib, "cuInit"));
  auto get = reinterpret_cast<Get>(::dlsym(lib, "cuDeviceGet"));
  auto bus = reinterpret_cast<BusId>(::dlsym(lib, "cuDeviceGetPCIBusId"));
  int dev = 0;
  char buf[64] = {};
  if (!init || !get || !bus || init(0) != 0 || get(&dev, ordinal) != 0 || bus(buf, sizeof buf, dev) != 0) return "";
  return buf;
}

LowLatencyAllGather::LowLatencyAllGather(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                         uint64_t max_bytes, const std::string& local_off, bool publish,
                                         std::chrono::steady_clock::time_point deadline)
    : store_(std::move(store)), rank_(rank), size_(size), max_bytes_(max_bytes) {
  if (!publish) {
    off_ = local_off;
    return;
  }
  const std::string base = "sluice_torch/ll_ag/agree/";
  put(*store_, base + std::to_string(rank), local_off.empty() ? "1 " + std::to_string(max_bytes) : "0 " + local_off);
  if (!local_off.empty()) {
    off_ = local_off;
    return;
  }
  // Every other rank runs nvlink (we have a device endpoint to each), so each publishes.
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  auto all = gather(base, std::max(left, std::chrono::milliseconds(1)), "agreeing on the low-latency all_gather");
  for (int j = 0; j < size_; ++j) {
    std::string rest;
    const std::string ok = first_word(all[j], &rest);
    if (ok != "1") {
      off_ = "rank " + std::to_string(j) + ": " + rest;
      return;
    }
    if (rest != std::to_string(max_bytes)) {
      off_ = "ranks disagree on SLUICE_TORCH_LL_ALLGATHER_BYTES (rank " + std::to_string(rank) + ": " +
             std::to_string(max_bytes) + ", rank " + std::to_string(j) + ": " + rest + ")";
      return;
    }
  }
}

LowLatencyAllGather::~LowLatencyAllGather() = default;

void LowLatencyAllGather::abandon() {
  std::lock_guard<std::mutex> lk(mu_);
  (void)ag_.release();
  off_ = "the group was aborted";
}

bool LowLatencyAllGather::on() const {
  std::lock_guard<std::mutex> lk(mu_);
  return off_.empty();
}

std::string LowLatencyAllGather::state() const {
  std::lock_guard<std::mutex> lk(mu_);
  if (!off_.empty()) return "off: " + off_;
  if (!ag_) return "on (not set up yet: the first eligible call sets it up)";
  std::ostringstream os;
  os << "on: " << *device_ << ", up to " << max_bytes_ << " bytes per rank";
  return os.str();
}

void LowLatencyAllGather::turn_off(std::string why) {
  SLUICE_LOG(kWarn, "sluice torch: rank " << rank_ << ": the low-latency all_gather is off for this group, "
                                          << "CUDA all_gathers go through host memory: " << why);
  off_ = std::move(why);
  ag_.reset();
  device_.reset();
}

std::vector<std::string> LowLatencyAllGather::gather(const std::string& prefix, std::chrono::milliseconds timeout,
                                                     const char* what) {
  std::vector<std::string> keys;
  for (int j = 0; j < size_; ++j) keys.push_back(prefix + std::to_string(j));
  try {
    store_->wait(keys, timeout);
  } catch (const std::exception& e) {
    std::string missing;
    for (int j = 0; j < size_; ++j) {
      bool there = false;
      try {
        there = store_->check({keys[j]});
      } catch (const std::exception&) {
      }
      if (!there) missing += (missing.empty() ? "" : ", ") + std::to_string(j);
    }
    throw Error(ErrorCode::kTimeout, "rank " + std::to_string(rank_) + ": " + what + ": rank(s) " +
                                         (missing.empty() ? "?" : missing) + " did not answer within " +
                                         std::to_string(timeout.count()) + " ms (" + e.what() + ")");
  }
  std::vector<std::string> out;
  for (auto& k : keys) {
    auto v = store_->get(k);
    out.emplace_back(v.begin(), v.end());
  }
  return out;
}

bool LowLatencyAllGather::ensure(c10::Device device, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!off_.empty()) return false;
  if (ag_) {
    TORCH_CHECK(*device_ == device, "sluice: rank ", rank_, ": all_gather: the group's low-latency all_gather runs on ",
                *device_, " (its first CUDA all_gather), this call's tensors are on ", device,
                ": every CUDA all_gather of a group must use the same GPU on a rank");
    return true;
  }
  const c10::impl::DeviceGuardImplInterface* g = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  // Setting up allocates and synchronises the device, which a graph capture forbids; every
  // rank is at the same call, so every rank refuses it alike.
  TORCH_CHECK(!cuda::stream_capturing(g->getStream(device).native_handle()), "sluice: rank ", rank_,
              ": all_gather: the first CUDA all_gather of a group sets up its low-latency path and cannot run "
              "inside a CUDA graph capture: run one before capturing (as NCCL needs a warm-up too)");
  const std::string prefix = "sluice_torch/ll_ag/" + std::to_string(++objects_) + "/";
  std::string mine;
  std::unique_ptr<cuda::AllGather> ag;
  try {
    ag = std::make_unique<cuda::AllGather>(max_bytes_, 1, cuda::DType::kUInt8, size_, rank_, device.index());
    const std::string bus = gpu_bus_id(device.index());
    if (bus.empty()) throw Error(ErrorCode::kNoDevice, "the driver did not name the PCI bus id of " + device.str());
    mine = "1 " + bus + " " + ag->handle();
  } catch (const std::exception& e) {
    ag.reset();
    mine = std::string("0 ") + e.what();
  }
  put(*store_, prefix + "h/" + std::to_string(rank_), mine);
  auto all = gather(prefix + "h/", timeout, "setting up the low-latency all_gather");
  std::vector<std::string> handles(size_);
  std::string why;
  std::map<std::string, int> by_bus;
  for (int j = 0; j < size_ && why.empty(); ++j) {
    std::string rest;
    if (first_word(all[j], &rest) != "1") {
      why = "rank " + std::to_string(j) + " could not set it up: " + rest;
      break;
    }
    std::string h;
    const std::string bus = first_word(rest, &h);
    auto [it, fresh] = by_bus.emplace(bus, j);
    if (!fresh)
      why = "ranks " + std::to_string(it->second) + " and " + std::to_string(j) + " share the GPU at " + bus +
            " (it needs one GPU per rank)";
    handles[j] = h;
  }
  if (!why.empty()) {
    turn_off(why);
    return false;
  }
  // Every rank got here with the same handles; now each maps the others' buffers.
  std::string connected = "1";
  try {
    ag->connect(handles);
  } catch (const std::exception& e) {
    connected = std::string("0 ") + e.what();
  }
  put(*store_, prefix + "c/" + std::to_string(rank_), connected);
  auto done = gather(prefix + "c/", timeout, "connecting the low-latency all_gather");
  for (int j = 0; j < size_; ++j) {
    std::string rest;
    if (first_word(done[j], &rest) != "1") {
      ag_ = std::move(ag);  // turn_off() drops it
      turn_off("rank " + std::to_string(j) + " could not map the peers' buffers: " + rest);
      return false;
    }
  }
  ag_ = std::move(ag);
  device_ = device;
  SLUICE_LOG(kInfo, "sluice torch: rank " << rank_ << ": low-latency all_gather set up on " << device << ", up to "
                                          << max_bytes_ << " bytes per rank");
  return true;
}

void LowLatencyAllGather::launch(const void* in, void* out, uint64_t bytes, const c10::Stream& stream,
                                 bool capturing) {
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(ag_, "sluice: the low-latency all_gather is not set up");
  // The AllGather's calls on one rank must be ordered (its epochs live in its buffer): a call
  // on another stream than the last one waits for the last one. Not across the start or end
  // of a capture: an event recorded outside a capture cannot be waited on inside it, and the
  // capture's own events mean nothing outside it; torch.cuda.graph synchronises the device
  // before it captures, and replays are ordered by the caller, as for any graph.
  if (last_ && *last_stream_ != stream && last_captured_ == capturing) last_->block(stream);
  ag_->all_gather_bytes(in, out, bytes, stream.native_handle());
}

void LowLatencyAllGather::note_done(std::shared_ptr<c10::Event> done, const c10::Stream& stream, bool capturing) {
  std::lock_guard<std::mutex> lk(mu_);
  last_ = std::move(done);
  last_stream_ = stream;
  last_captured_ = capturing;
}

}  // namespace sluice::torch_backend
