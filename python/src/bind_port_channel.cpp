// sluice._sluice.ProxyService / PortChannel: the port channel's host objects for Python. A
// channel's device handle comes out as bytes (handle_bytes) that a CUDA kernel, a C++ or a
// torch extension, takes by value as a sluice::PortChannelDeviceHandle. For host producers
// (ProducerKind::kHost) the channel's put / signal / flush / wait also run from Python, on the
// calling thread with the GIL released, as the CI tests do. python/sluice/port_channel.py
// wraps this with the package's Engine and Endpoint.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>

#include "gil.hpp"
#include "sluice/port_channel.hpp"
#include "sluice/sluice.hpp"

namespace py = pybind11;
using sluice::pybind::NoGil;
using sluice::pybind::NoGilUnlessExiting;

namespace {

using sluice::ErrorCode;
using sluice::PortResult;

struct PyProxy {
  std::shared_ptr<sluice::Engine> engine;  // the registry the proxy checks handles against
  std::unique_ptr<sluice::ProxyService> proxy;
  ~PyProxy() {
    NoGilUnlessExiting nogil;  // stop() joins workers
    proxy.reset();
  }
};

struct PyPortChannel {
  sluice::PortChannel ch;
  sluice::ProducerKind producers;

  const sluice::PortChannelDeviceHandle host_handle() const {
    if (producers != sluice::ProducerKind::kHost)
      throw sluice::Error(ErrorCode::kUnsupported,
                          "PortChannel: this channel's producers are GPU threads (producers='cuda'); pass "
                          "handle_bytes() to a kernel instead of calling it from Python");
    return ch.device_handle();
  }
  // kOk -> None; kTimeout -> SluiceTimeoutError; kFailed -> the channel's own error.
  void check(PortResult r, const char* what) const {
    if (r == PortResult::kOk) return;
    if (r == PortResult::kTimeout)
      throw sluice::Error(ErrorCode::kTimeout, std::string("PortChannel.") + what + ": the spin bound ran out");
    sluice::Status st = ch.status();
    if (st.ok()) st = {ErrorCode::kClosed, "the channel's FIFO failed (a push timed out or the proxy stopped)"};
    throw sluice::Error(st.code, std::string("PortChannel.") + what + ": " + st.message);
  }
};

uint64_t ns_of(double seconds) {
  if (!(seconds > 0) || seconds > 1e9) throw sluice::Error(ErrorCode::kInvalidArgument, "timeout must be > 0 seconds");
  return static_cast<uint64_t>(seconds * 1e9);
}

}  // namespace

void bind_port_channel(py::module_& m, const std::function<std::shared_ptr<sluice::Engine>(py::handle)>& engine_of,
                       const std::function<sluice::Endpoint(py::handle)>& endpoint_of) {
  py::class_<PyProxy>(m, "ProxyService")
      .def(py::init([engine_of](py::handle engine, int workers, uint32_t fifo_depth, const std::string& producers,
                                int cuda_device, double idle_spin, double idle_sleep, double push_timeout) {
             sluice::ProxyOptions o;
             o.workers = workers;
             o.fifo_depth = fifo_depth;
             if (producers == "host") o.producers = sluice::ProducerKind::kHost;
             else if (producers == "cuda") o.producers = sluice::ProducerKind::kCuda;
             else throw sluice::Error(ErrorCode::kInvalidArgument, "ProxyService: producers must be 'host' or 'cuda', not '" + producers + "'");
             o.cuda_device = cuda_device;
             if (idle_spin < 0 || idle_sleep < 0) throw sluice::Error(ErrorCode::kInvalidArgument, "ProxyService: idle times must be >= 0");
             o.idle_spin = std::chrono::microseconds(static_cast<int64_t>(idle_spin * 1e6));
             o.idle_sleep = std::chrono::microseconds(static_cast<int64_t>(idle_sleep * 1e6));
             o.push_spin_ns = ns_of(push_timeout);
             auto p = std::make_unique<PyProxy>();
             p->engine = engine_of(engine);
             p->proxy = std::make_unique<sluice::ProxyService>(*p->engine, o);
             return p;
           }),
           py::arg("engine"), py::arg("workers"), py::arg("fifo_depth"), py::arg("producers"), py::arg("cuda_device"),
           py::arg("idle_spin"), py::arg("idle_sleep"), py::arg("push_timeout"))
      .def("add_memory", [](PyProxy& p, uint64_t h) { return p.proxy->add_memory(sluice::MemoryHandle{h}); })
      .def("add_remote_memory",
           [endpoint_of](PyProxy& p, py::handle ep, uint64_t r) {
             return p.proxy->add_memory(endpoint_of(ep), sluice::RemoteHandle{r});
           })
      .def("add_channel",
           [endpoint_of](PyProxy& p, py::handle ep, uint32_t dst, uint32_t src, uint64_t rsem, uint64_t rsem_off,
                         uint64_t lsem, uint64_t lsem_off, int worker) {
             sluice::Endpoint e = endpoint_of(ep);
             return PyPortChannel{p.proxy->add_channel(e, dst, src, {sluice::RemoteHandle{rsem}, rsem_off},
                                                       {sluice::MemoryHandle{lsem}, lsem_off}, worker),
                                  p.proxy->options().producers};
           })
      .def("start", [](PyProxy& p) { p.proxy->start(); })
      .def("stop",
           [](PyProxy& p) {
             NoGilUnlessExiting nogil;
             p.proxy->stop();
           })
      .def("stats",
           [](const PyProxy& p) {
             sluice::ProxyStats s = p.proxy->stats();
             py::dict d;
             d["requests"] = s.requests;
             d["puts"] = s.puts;
             d["signals"] = s.signals;
             d["flushes"] = s.flushes;
             d["dropped"] = s.dropped;
             d["batches"] = s.batches;
             return d;
           })
      .def_property_readonly("channels", [](const PyProxy& p) { return p.proxy->channels(); })
      .def_property_readonly("memories", [](const PyProxy& p) { return p.proxy->memories(); });

  using H = sluice::PortChannelDeviceHandle;
  py::class_<PyPortChannel>(m, "PortChannel")
      .def_property_readonly("id", [](const PyPortChannel& c) { return c.ch.id(); })
      .def("status",
           [](const PyPortChannel& c) {
             sluice::Status s = c.ch.status();
             return py::make_tuple(static_cast<int>(s.code), s.message);
           })
      .def("handle_bytes",
           [](const PyPortChannel& c) {
             H h = c.ch.device_handle();
             return py::bytes(reinterpret_cast<const char*>(&h), sizeof(h));
           })
      .def_property_readonly_static("handle_size", [](py::object) { return sizeof(H); })
      .def("put",
           [](const PyPortChannel& c, uint64_t dst_off, uint64_t src_off, uint64_t size, std::optional<uint32_t> dst,
              std::optional<uint32_t> src, bool signal) {
             H h = c.host_handle();
             PortResult r;
             {
               NoGil nogil;
               uint32_t d = dst.value_or(h.dst_mem), s = src.value_or(h.src_mem);
               r = signal ? h.put_with_signal(d, dst_off, s, src_off, size) : h.put(d, dst_off, s, src_off, size);
             }
             c.check(r, signal ? "put_with_signal" : "put");
           })
      .def("signal",
           [](const PyPortChannel& c) {
             H h = c.host_handle();
             PortResult r;
             {
               NoGil nogil;
               r = h.signal();
             }
             c.check(r, "signal");
           })
      .def("flush",
           [](const PyPortChannel& c, double timeout) {
             H h = c.host_handle();
             uint64_t ns = ns_of(timeout);
             PortResult r;
             {
               NoGil nogil;
               r = h.flush(ns);
             }
             c.check(r, "flush");
           })
      .def("wait",
           [](const PyPortChannel& c, double timeout) {
             H h = c.host_handle();
             uint64_t ns = ns_of(timeout);
             PortResult r;
             {
               NoGil nogil;
               r = h.wait(ns);
             }
             c.check(r, "wait");
           })
      .def("poll", [](const PyPortChannel& c) { return c.host_handle().poll(); });
}
