// Releasing and retaking the GIL around blocking engine calls, safely at interpreter exit.
//
// Before 3.14, CPython ends a thread that asks for the GIL once the interpreter is
// finalizing with pthread_exit, which unwinds the thread's stack (a "forced unwind").
// pybind11's gil_scoped_release retakes the GIL in its destructor, which is noexcept and
// often runs while an engine error is already unwinding (a daemon thread's accept() woken
// by close() in the atexit hook); pybind11 also runs exception translators (Python code)
// inside a catch handler, where a forced unwind cannot be caught either. Any of these
// ends in std::terminate and the process aborts at exit. So:
//  1. sluice's atexit hook (it runs after non-daemon threads were joined) closes every
//     engine, then calls quiesce_at_exit(): it closes the gate below and waits for the
//     threads inside it (between a release and its retake, or translating an error) to
//     come out. From then on a daemon thread that calls into sluice releases the GIL and
//     parks for the moments left before the process exits, which is what CPython 3.14 does
//     itself (PyThread_hang_thread); the exiting thread gets ClosedError instead.
//  2. A thread that still asks for the GIL too late (one that outlived the wait) catches the
//     forced unwind where it starts and parks the same way.
#pragma once

#include <Python.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "sluice/sluice.hpp"

#if defined(__GLIBCXX__)
#include <cxxabi.h>
#endif

namespace sluice::pybind {

inline std::atomic<bool> g_exiting{false};   // set by quiesce_at_exit, never cleared
inline std::atomic<int> g_inside{0};         // threads inside the gate
inline std::atomic<std::thread::id> g_exit_thread{};

inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// The interpreter is going away and this thread may never run Python again.
[[noreturn]] inline void park_forever() {
  for (;;) ::pause();
}

// Takes the GIL, or parks the thread forever if the interpreter exits meanwhile. Never
// throws, so it may run in destructors and during unwinding.
inline void take_gil_or_park(PyThreadState* ts) noexcept {
#if defined(__GLIBCXX__)
  try {
    PyEval_RestoreThread(ts);
  } catch (abi::__forced_unwind&) {
    park_forever();  // a forced unwind must not be swallowed: never leave this handler
  }
#else
  PyEval_RestoreThread(ts);
#endif
}

// Entered before code that releases the GIL or runs Python inside a C++ catch handler.
// Once the interpreter is exiting, a daemon thread parks here without the GIL, and the
// exiting thread gets ClosedError (every engine is closed by then).
class ExitGate {
 public:
  enum class OnExitingThread { kThrow, kProceed };
  explicit ExitGate(OnExitingThread mode = OnExitingThread::kThrow) {
    g_inside.fetch_add(1);  // before the check: quiesce_at_exit sets the flag, then counts
    if (!g_exiting.load()) return;
    if (std::this_thread::get_id() == g_exit_thread.load()) {
      if (mode == OnExitingThread::kProceed) return;  // still inside: the destructor leaves
      g_inside.fetch_sub(1);
      throw sluice::Error(ErrorCode::kClosed, "the Python interpreter is exiting");
    }
    g_inside.fetch_sub(1);
    PyEval_SaveThread();
    park_forever();
  }
  ~ExitGate() { g_inside.fetch_sub(1); }
  ExitGate(const ExitGate&) = delete;
  ExitGate& operator=(const ExitGate&) = delete;
};

// Replaces py::gil_scoped_release around a call that may block.
class NoGil {
 public:
  NoGil() : ts_(PyEval_SaveThread()) {}
  ~NoGil() { take_gil_or_park(ts_); }
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;

 private:
  ExitGate gate_;  // constructed first, left last
  PyThreadState* ts_;
};

// For destructors and close(): releases the GIL like NoGil, but once the interpreter is
// exiting keeps it (and never throws or parks).
class NoGilUnlessExiting {
 public:
  NoGilUnlessExiting() {
    g_inside.fetch_add(1);
    if (g_exiting.load()) {
      g_inside.fetch_sub(1);
      return;
    }
    ts_ = PyEval_SaveThread();
  }
  ~NoGilUnlessExiting() {
    if (!ts_) return;
    take_gil_or_park(ts_);
    g_inside.fetch_sub(1);
  }
  NoGilUnlessExiting(const NoGilUnlessExiting&) = delete;
  NoGilUnlessExiting& operator=(const NoGilUnlessExiting&) = delete;

 private:
  PyThreadState* ts_ = nullptr;
};

// Replaces py::gil_scoped_acquire on threads Python did not create (engine threads running a
// callback, releasing a Python object): false once the interpreter is exiting, when the
// caller must drop (leak) what it holds rather than touch Python.
class GilForCallback {
 public:
  GilForCallback() {
    if (g_exiting.load() || !Py_IsInitialized() || interpreter_finalizing()) return;
#if defined(__GLIBCXX__)
    try {
      state_ = PyGILState_Ensure();
    } catch (abi::__forced_unwind&) {
      park_forever();
    }
#else
    state_ = PyGILState_Ensure();
#endif
    held_ = true;
  }
  ~GilForCallback() {
    if (held_) PyGILState_Release(state_);
  }
  explicit operator bool() const { return held_; }
  GilForCallback(const GilForCallback&) = delete;
  GilForCallback& operator=(const GilForCallback&) = delete;

 private:
  PyGILState_STATE state_{};
  bool held_ = false;
};

// Called with the GIL by sluice's atexit hook after it closed every engine: closes the gate
// and waits, up to `timeout_s`, for the threads inside it to come out. Returns how many
// were still inside.
inline int quiesce_at_exit(double timeout_s) {
  g_exit_thread.store(std::this_thread::get_id());
  g_exiting.store(true);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (g_inside.load() > 0 && std::chrono::steady_clock::now() < deadline) {
    PyThreadState* ts = PyEval_SaveThread();  // let them retake the GIL and leave
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    PyEval_RestoreThread(ts);
  }
  return g_inside.load();
}

}  // namespace sluice::pybind
