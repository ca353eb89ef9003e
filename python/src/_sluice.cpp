// sluice._sluice: the pybind11 binding of the public C++ API. The Python package (sluice/)
// wraps these classes; everything here is thin: convert, release the GIL, call, convert back.
//
// Rules kept throughout:
//  * every call that can block (waits, connect, accept, unregister, close, engine start)
//    releases the GIL, so engine threads that run Python callbacks can always get it;
//  * Python objects captured by completion callbacks are dropped with the GIL held;
//  * sluice::Error becomes the matching sluice.errors exception (errors._from_code).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

#include "gil.hpp"
#include "sluice/sluice.hpp"

namespace py = pybind11;
using namespace std::chrono_literals;

namespace {

using sluice::ErrorCode;
using sluice::pybind::GilForCallback;
using sluice::pybind::NoGil;
using sluice::pybind::NoGilUnlessExiting;
using sluice::Status;

// ------------------------------------------------------------------ errors

py::object& errors_module() {
  static py::object* mod = new py::object(py::module_::import("sluice.errors"));  // leaked on purpose
  return *mod;
}

py::object make_exception(ErrorCode code, const std::string& message) {
  return errors_module().attr("_from_code")(static_cast<int>(code), message);
}

[[noreturn]] void raise_status(const Status& s) {
  py::object exc = make_exception(s.code, s.message);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

[[noreturn]] void invalid(const std::string& what) { throw sluice::Error(ErrorCode::kInvalidArgument, what); }

// A Python object that may be released on a thread without the GIL.
struct PyRef {
  py::object obj;
  explicit PyRef(py::object o) : obj(std::move(o)) {}
  ~PyRef() {
    if (!obj) return;
    GilForCallback gil;  // re-entrant where this thread holds the GIL already
    if (!gil) {
      obj.release();  // the interpreter is gone or going: leak rather than touch it
      return;
    }
    obj = py::object();
  }
};

// Wait in slices so that Ctrl-C reaches Python; returns false on timeout.
template <class Pred>
bool wait_sliced(Pred ready_within, std::optional<double> timeout_s) {
  auto deadline = timeout_s ? std::chrono::steady_clock::now() +
                                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                      std::chrono::duration<double>(std::max(0.0, *timeout_s)))
                            : std::chrono::steady_clock::time_point::max();
  while (true) {
    auto now = std::chrono::steady_clock::now();
    auto slice = std::chrono::duration_cast<std::chrono::nanoseconds>(std::min<std::chrono::steady_clock::duration>(
        deadline - now, std::chrono::milliseconds(100)));
    if (slice.count() < 0) slice = std::chrono::nanoseconds(0);
    bool ok;
    {
      NoGil nogil;
      ok = ready_within(slice);
    }
    if (ok) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

// ------------------------------------------------------------------ batches

uint64_t as_u64(PyObject* o, const char* field) {
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    invalid(std::string("batch: ") + field + " must be a non-negative integer < 2**64");
  }
  return v;
}

// A batch from a sequence of 5-tuples (local, local_off, remote, remote_off, length) or from
// anything exposing a C-contiguous N x 5 buffer of 64-bit unsigned (or signed) integers.
sluice::Batch to_batch(py::handle obj) {
  sluice::Batch batch;
  PyObject* o = obj.ptr();
  if (PyObject_CheckBuffer(o) && !PyBytes_Check(o) && !PyByteArray_Check(o)) {
    Py_buffer view;
    if (PyObject_GetBuffer(o, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
      PyErr_Clear();
      invalid("batch: an array batch must be C-contiguous");
    }
    struct Release {
      Py_buffer* v;
      ~Release() { PyBuffer_Release(v); }
    } release{&view};
    std::string fmt = view.format ? view.format : "B";
    if (!fmt.empty() && (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@')) fmt = fmt.substr(1);
    bool u64 = fmt == "Q" || fmt == "L" || fmt == "K" || fmt == "q" || fmt == "l";
    if (!u64 || view.itemsize != 8) invalid("batch: an array batch must hold 64-bit integers (got format '" + fmt + "')");
    if (view.ndim != 2 || view.shape[1] != 5) invalid("batch: an array batch must have shape (N, 5)");
    const auto* p = static_cast<const uint64_t*>(view.buf);
    batch.resize(static_cast<size_t>(view.shape[0]));
    for (size_t i = 0; i < batch.size(); ++i, p += 5) batch[i] = {{p[0]}, p[1], {p[2]}, p[3], p[4]};
    return batch;
  }
  py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(o, "batch must be a sequence of 5-tuples"));
  if (!seq) {
    PyErr_Clear();
    invalid("batch must be a list of (local, local_offset, remote, remote_offset, length) tuples or an (N, 5) uint64 array");
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  batch.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = items[i];
    if (!(PyTuple_Check(t) || PyList_Check(t)) || PySequence_Fast_GET_SIZE(t) != 5)
      invalid("batch item " + std::to_string(i) + " is not a (local, local_offset, remote, remote_offset, length) tuple");
    PyObject** f = PySequence_Fast_ITEMS(t);
    batch[i] = {{as_u64(f[0], "local handle")}, as_u64(f[1], "local_offset"), {as_u64(f[2], "remote handle")},
                as_u64(f[3], "remote_offset"), as_u64(f[4], "length")};
  }
  return batch;
}

// ------------------------------------------------------------------ futures

struct PyFuture {
  sluice::Future f;

  bool done() const { return f.test(); }

  // True once complete (raises the operation's error if it failed); False on timeout.
  bool wait(std::optional<double> timeout) const {
    if (!f.test() && (!timeout || *timeout > 0)) {
      // Like Future::wait(): a short spin before sleeping hides the wake-up latency of small
      // operations (the GIL is released meanwhile).
      NoGil nogil;
      auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(30);
      while (!f.test() && std::chrono::steady_clock::now() < end) {
#if defined(__x86_64__) || defined(__i386__)
        for (int i = 0; i < 64; ++i) __builtin_ia32_pause();
#endif
      }
    }
    if (!f.test()) {
      auto fut = f;
      if (!wait_sliced([&](std::chrono::nanoseconds d) { return fut.wait_for(d); }, timeout)) return false;
    }
    Status s = f.status();
    if (!s.ok()) raise_status(s);
    return true;
  }

  py::object code() const {
    if (!f.test()) return py::none();
    return errors_module().attr("ErrorCode")(static_cast<int>(f.status().code));
  }
  py::object message() const {
    if (!f.test()) return py::none();
    return py::str(f.status().message);
  }
  py::object exception() const {
    if (!f.test()) return py::none();
    Status s = f.status();
    if (s.ok()) return py::none();
    return make_exception(s.code, s.message);
  }
  double elapsed() const { return std::chrono::duration<double>(f.elapsed()).count(); }

  // `cb()` runs once on completion: right away (this thread) if complete, else on an engine
  // thread with the GIL taken. Exceptions it raises are reported as unraisable.
  void on_complete(py::object cb) const {
    auto ref = std::make_shared<PyRef>(std::move(cb));
    NoGil nogil;  // on_complete may run the callback at once
    f.on_complete([ref](const Status&) {
      GilForCallback gil;
      if (!gil) return;  // at interpreter exit the callback is dropped (PyRef leaks it)
      py::object cb = std::move(ref->obj);
      try {
        cb();
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("sluice future callback");
      }
    });
  }
};

// ------------------------------------------------------------------ memory

// A second mapping of an engine allocation's memfd, owned by Python: it outlives
// Engine::free()/close() (which unmap the engine's own mapping), so a numpy array over it
// never dangles.
struct Mapping {
  void* ptr = nullptr;
  uint64_t length = 0;
  ~Mapping() {
    if (ptr) ::munmap(ptr, length);
  }
};

// Holds a Py_buffer export (so e.g. a bytearray cannot be resized while registered).
struct BufferPin {
  Py_buffer view{};
  bool held = false;
  ~BufferPin() { release(); }
  void release() {
    if (held) {
      if (GilForCallback gil; gil) PyBuffer_Release(&view);  // else leaked at interpreter exit
      held = false;
    }
  }
};

// (pin, address, nbytes, readonly) of a C- or F-contiguous buffer.
py::tuple pin_buffer(py::handle obj, bool writable) {
  auto pin = std::make_unique<BufferPin>();
  int flags = PyBUF_ANY_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), &pin->view, flags) != 0) {
    std::string why;
    if (PyErr_Occurred()) {
      py::error_already_set e;
      why = e.what();
    }
    invalid("register: the object's buffer cannot be used (" + why + ")");
  }
  pin->held = true;
  auto addr = reinterpret_cast<uintptr_t>(pin->view.buf);
  auto len = static_cast<uint64_t>(pin->view.len);
  bool ro = pin->view.readonly != 0;
  return py::make_tuple(py::cast(std::move(pin)), addr, len, ro);
}

// DLPack (v0.x ABI): (address, nbytes, device_type, device_id) of a contiguous tensor.
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code, bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

py::tuple dlpack_info(py::capsule cap) {
  if (std::strcmp(cap.name() ? cap.name() : "", "dltensor") != 0) invalid("register: not an unused 'dltensor' capsule");
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap.ptr(), "dltensor"));
  if (!m) throw py::error_already_set();
  const DLTensor& t = m->dl_tensor;
  uint64_t item = (uint64_t(t.dtype.bits) * t.dtype.lanes + 7) / 8;
  uint64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= static_cast<uint64_t>(t.shape[i]);
  if (t.strides && n > 0) {  // must be C-contiguous
    int64_t expect = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      if (t.shape[i] != 1 && t.strides[i] != expect) invalid("register: the DLPack tensor is not contiguous");
      expect *= t.shape[i];
    }
  }
  auto addr = reinterpret_cast<uintptr_t>(static_cast<char*>(t.data) + t.byte_offset);
  // The capsule stays unconsumed: its destructor frees the DLManagedTensor; the memory itself
  // is kept alive by the producer object, which the caller holds.
  return py::make_tuple(addr, n * item, t.device.device_type, t.device.device_id);
}

// ------------------------------------------------------------------ engine / endpoint

sluice::Location location_of(const std::string& s) { return sluice::Location::parse(s.empty() ? "host" : s); }

struct PyEndpoint {
  sluice::Endpoint ep;

  // `stream`: a cudaStream_t as an integer, already checked and mapped by the Python layer
  // (None: not stream-ordered; the legacy default stream arrives as cudaStreamLegacy).
  PyFuture op(int kind, py::handle batch_obj, uint32_t imm, std::optional<uint64_t> stream) {
    sluice::Batch b = to_batch(batch_obj);
    sluice::OpOptions o;
    if (stream) o.cuda_stream = reinterpret_cast<void*>(static_cast<uintptr_t>(*stream));
    NoGil nogil;
    if (kind == 0) return {ep.read(b, o)};
    if (kind == 1) return {ep.write(b, o)};
    return {ep.write_with_imm(b, imm, o)};
  }
  PyFuture send(uint64_t h, uint64_t off, uint64_t len) {
    NoGil nogil;
    return {ep.send({h}, off, len)};
  }
  PyFuture recv(uint64_t h, uint64_t off, uint64_t len) {
    NoGil nogil;
    return {ep.recv({h}, off, len)};
  }
  PyFuture imm_recv() {
    NoGil nogil;
    return {ep.imm_recv()};
  }
  void post_write(uint64_t h, uint64_t loff, uint64_t r, uint64_t roff, uint64_t len) {
    NoGil nogil;
    ep.post_write({h}, loff, {r}, roff, len);
  }
  void post_signal(uint64_t r, uint64_t off, uint64_t add) {
    NoGil nogil;
    ep.post_signal({r}, off, add);
  }
  void flush(uint64_t timeout_ms) {
    NoGil nogil;
    ep.flush(std::chrono::milliseconds(timeout_ms));
  }
  uint64_t import_region(const std::string& descriptor) { return ep.import_region(descriptor).id; }
  std::optional<uint64_t> remote_region(const std::string& name) const {
    auto r = ep.remote_region(name);
    if (!r) return std::nullopt;
    return r->id;
  }
  py::list remote_regions() const {
    py::list out;
    for (const auto& r : ep.remote_regions()) {
      py::dict d;
      d["id"] = r.id;
      d["addr"] = r.addr;
      d["length"] = r.length;
      d["location"] = r.location.to_string();
      d["name"] = r.name;
      d["shareable"] = r.shareable;
      out.append(d);
    }
    return out;
  }
  void refresh() {
    NoGil nogil;
    ep.refresh_remote_regions();
  }
  void close() {
    NoGilUnlessExiting nogil;
    ep.close();
  }
};

struct PyEngine {
  std::shared_ptr<sluice::Engine> engine;  // guarded by mu
  std::atomic<bool> closed{false};
  std::mutex mu;
  std::map<uint64_t, sluice::Allocation> allocations;

  std::shared_ptr<sluice::Engine> e() {
    std::shared_ptr<sluice::Engine> p;
    {
      std::lock_guard<std::mutex> lk(mu);
      p = engine;
    }
    if (!p) throw sluice::Error(ErrorCode::kClosed, "the engine is closed");
    return p;
  }

  ~PyEngine() {
    if (!engine) return;
    if (Py_IsInitialized() && PyGILState_Check()) {
      NoGilUnlessExiting nogil;
      engine.reset();
    } else {
      engine.reset();
    }
  }

  void close() {
    std::shared_ptr<sluice::Engine> e;
    {
      std::lock_guard<std::mutex> lk(mu);
      e.swap(engine);
    }
    if (!e) return;
    closed = true;
    NoGilUnlessExiting nogil;
    e->close();
    e.reset();
  }
};

// Every option arrives as text and is parsed by EngineConfig::set, exactly as its SLUICE_*
// variable would be (one parser for C++, Python and the environment).
std::unique_ptr<PyEngine> make_engine(const std::map<std::string, std::string>& options) {
  sluice::EngineConfig c;
  for (const auto& [key, value] : options) c.set(key, value);
  auto pe = std::make_unique<PyEngine>();
  NoGil nogil;
  pe->engine = std::make_shared<sluice::Engine>(c);
  return pe;
}

}  // namespace

// python/src/bind_port_channel.cpp
// bind_metrics.cpp
py::dict metrics_dict(const sluice::EndpointMetrics& m);
void bind_port_channel(py::module_& m, const std::function<std::shared_ptr<sluice::Engine>(py::handle)>& engine_of,
                       const std::function<sluice::Endpoint(py::handle)>& endpoint_of);

PYBIND11_MODULE(_sluice, m) {
  m.doc() = "Sluice C++ core (use the `sluice` package, not this module)";
  m.attr("version") = sluice::kVersion;

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const sluice::Error& e) {
      // Runs Python code inside this handler, where a thread the interpreter ends at exit
      // could not unwind: gated (see gil.hpp).
      sluice::pybind::ExitGate gate(sluice::pybind::ExitGate::OnExitingThread::kProceed);
      py::object exc = make_exception(e.code(), e.status().message);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.def("quiesce_at_exit", &sluice::pybind::quiesce_at_exit, py::arg("timeout_s"),
        "For sluice's atexit hook, after it closed every engine: no call releases the GIL any more; "
        "waits for the threads inside a released section to retake it. Returns how many did not.");

  m.def("list_params", [] {
    py::list out;
    for (const auto& p : sluice::list_params()) {
      py::dict d;
      d["name"] = p.name;
      d["env"] = p.env;
      d["default"] = p.default_value;
      d["doc"] = p.doc;
      d["scope"] = p.scope;
      out.append(d);
    }
    return out;
  });
  m.def("error_text", [](int code) { return std::string(sluice::to_string(static_cast<ErrorCode>(code))); });
  m.def("pin_buffer", &pin_buffer, py::arg("obj"), py::arg("writable") = true);
  m.def("dlpack_info", &dlpack_info);

  py::class_<BufferPin>(m, "BufferPin").def("release", &BufferPin::release);

  py::class_<Mapping>(m, "Mapping", py::buffer_protocol())
      .def_buffer([](Mapping& mp) {
        return py::buffer_info(mp.ptr, 1, py::format_descriptor<uint8_t>::format(), 1, {static_cast<py::ssize_t>(mp.length)},
                               {1});
      })
      .def_property_readonly("address", [](const Mapping& mp) { return reinterpret_cast<uintptr_t>(mp.ptr); })
      .def("__len__", [](const Mapping& mp) { return mp.length; });

  py::class_<PyFuture>(m, "Future")
      .def("done", &PyFuture::done)
      .def("wait", &PyFuture::wait, py::arg("timeout") = py::none())
      .def_property_readonly("code", &PyFuture::code)
      .def_property_readonly("message", &PyFuture::message)
      .def("exception", &PyFuture::exception)
      .def_property_readonly("elapsed", &PyFuture::elapsed)
      .def_property_readonly("bytes", [](const PyFuture& f) { return f.f.bytes(); })
      .def_property_readonly("imm", [](const PyFuture& f) { return f.f.imm(); })
      .def("_on_complete", &PyFuture::on_complete);

  py::class_<PyEndpoint>(m, "Endpoint")
      .def("read", [](PyEndpoint& e, py::handle b, std::optional<uint64_t> s) { return e.op(0, b, 0, s); },
           py::arg("batch"), py::arg("stream") = py::none())
      .def("write", [](PyEndpoint& e, py::handle b, std::optional<uint64_t> s) { return e.op(1, b, 0, s); },
           py::arg("batch"), py::arg("stream") = py::none())
      .def("write_with_imm",
           [](PyEndpoint& e, py::handle b, uint32_t imm, std::optional<uint64_t> s) { return e.op(2, b, imm, s); },
           py::arg("batch"), py::arg("imm"), py::arg("stream") = py::none())
      .def_property_readonly("capabilities", [](const PyEndpoint& e) {
        const sluice::Capabilities c = e.ep.capabilities();
        py::dict d;
        d["host_memory"] = c.host_memory;
        d["cuda_memory"] = c.cuda_memory;
        d["stream_ordered"] = c.stream_ordered;
        d["stream_ordered_messages"] = c.stream_ordered_messages;
        d["imm"] = c.imm;
        d["signal"] = c.signal;
        d["rma_post"] = c.rma_post;
        return d;
      })
      .def("send", &PyEndpoint::send)
      .def("recv", &PyEndpoint::recv)
      .def("imm_recv", &PyEndpoint::imm_recv)
      .def("post_write", &PyEndpoint::post_write)
      .def("post_signal", &PyEndpoint::post_signal)
      .def("flush", &PyEndpoint::flush)
      .def("remote_region", &PyEndpoint::remote_region)
      .def("import_region", &PyEndpoint::import_region)
      .def("remote_regions", &PyEndpoint::remote_regions)
      .def("refresh_remote_regions", &PyEndpoint::refresh)
      .def_property_readonly("transport", [](const PyEndpoint& e) { return e.ep.transport(); })
      .def_property_readonly("channels", [](const PyEndpoint& e) { return e.ep.channels(); })
      .def_property_readonly("peer_engine_id", [](const PyEndpoint& e) { return e.ep.peer_engine_id(); })
      .def_property_readonly("connected", [](const PyEndpoint& e) { return e.ep.connected(); })
      .def("metrics", [](const PyEndpoint& e) { return metrics_dict(e.ep.metrics()); })
      .def("close", &PyEndpoint::close);

  py::class_<PyEngine>(m, "Engine")
      .def(py::init(&make_engine), py::arg("options"))
      .def("register_memory",
           [](PyEngine& pe, uintptr_t ptr, uint64_t len, const std::string& loc, const std::string& name) {
             return pe.e()->register_memory(reinterpret_cast<void*>(ptr), len, location_of(loc), name).id;
           })
      .def("unregister_memory",
           [](PyEngine& pe, uint64_t h) {
             auto e = pe.e();
             NoGilUnlessExiting nogil;
             e->unregister_memory({h});
           })
      .def("allocate",
           [](PyEngine& pe, uint64_t len, const std::string& loc, const std::string& name) {
             auto e = pe.e();
             sluice::Allocation a = e->allocate(len, location_of(loc), name);
             auto mp = std::make_unique<Mapping>();
             mp->length = a.length;
             if (a.fd >= 0) {
               void* p = ::mmap(nullptr, a.length, PROT_READ | PROT_WRITE, MAP_SHARED, a.fd, 0);
               if (p == MAP_FAILED) {
                 e->free(a);
                 throw sluice::Error(ErrorCode::kSystem, "mmap of the allocation failed");
               }
               mp->ptr = p;
             } else {
               e->free(a);
               throw sluice::Error(ErrorCode::kUnsupported, "allocate: the allocation has no memfd to map");
             }
             {
               std::lock_guard<std::mutex> lk(pe.mu);
               pe.allocations[a.handle.id] = a;
             }
             return py::make_tuple(a.handle.id, a.length, py::cast(std::move(mp)));
           })
      .def("free",
           [](PyEngine& pe, uint64_t h) {
             auto e = pe.e();
             sluice::Allocation a;
             {
               std::lock_guard<std::mutex> lk(pe.mu);
               auto it = pe.allocations.find(h);
               if (it == pe.allocations.end())
                 throw sluice::Error(ErrorCode::kUnknownHandle,
                                     "free: handle " + std::to_string(h) + " is not an engine allocation");
               a = it->second;
               pe.allocations.erase(it);
             }
             NoGilUnlessExiting nogil;
             e->free(a);
           })
      .def("is_allocation",
           [](PyEngine& pe, uint64_t h) {
             std::lock_guard<std::mutex> lk(pe.mu);
             return pe.allocations.count(h) > 0;
           })
      .def("local_info", [](PyEngine& pe) { return pe.e()->local_info(); })
      .def("region_descriptor", [](PyEngine& pe, uint64_t h) { return pe.e()->region_descriptor(sluice::MemoryHandle{h}); })
      .def("listen_address", [](PyEngine& pe) { return pe.e()->listen_address(); })
      .def("transports", [](PyEngine& pe) { return pe.e()->transports(); })
      .def("metrics",
           [](PyEngine& pe) {
             py::list out;
             for (const auto& x : pe.e()->metrics()) out.append(metrics_dict(x));
             return out;
           })
      .def("metrics_text", [](PyEngine& pe) { return pe.e()->metrics_text(); })
      .def("channels", [](PyEngine& pe) { return pe.e()->config().channels; })
      .def("connect",
           [](PyEngine& pe, const std::string& target, const std::string& transport, std::optional<double> timeout,
              bool reconnect) {
             auto e = pe.e();
             sluice::ConnectOptions co;
             co.transport = transport;
             co.reconnect = reconnect;
             if (timeout) co.timeout = std::chrono::milliseconds(static_cast<int64_t>(*timeout * 1000));
             NoGil nogil;
             return PyEndpoint{e->connect(target, co)};
           })
      .def("accept",
           [](PyEngine& pe, std::optional<double> timeout) -> std::optional<PyEndpoint> {
             auto e = pe.e();
             std::optional<sluice::Endpoint> got;
             wait_sliced(
                 [&](std::chrono::nanoseconds d) {
                   got = e->accept(std::chrono::duration_cast<std::chrono::milliseconds>(d));
                   return got.has_value() || pe.closed.load();
                 },
                 timeout);
             if (!got && pe.closed) throw sluice::Error(ErrorCode::kClosed, "accept: the engine was closed");
             if (!got) return std::nullopt;
             return PyEndpoint{*got};
           })
      .def_property_readonly("closed", [](const PyEngine& pe) { return pe.closed.load(); })
      .def("close", &PyEngine::close);
  bind_port_channel(
      m, [](py::handle e) { return e.cast<PyEngine&>().e(); }, [](py::handle e) { return e.cast<PyEndpoint&>().ep; });
}
