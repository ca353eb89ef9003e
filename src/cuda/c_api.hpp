// The convention of the C functions that the ctypes wrappers call (python/sluice/
// cuda_allgather.py, hier_allgather.py): nothing throws across the C boundary. A function runs
// its body through guarded(), which returns the body's value, or writes the exception's message
// into the caller's buffer and returns the failure value the function documents.
#pragma once

#include <cstring>
#include <exception>
#include <string>

namespace sluice::detail::capi {

inline void put_message(const char* what, char* err, int len) {
  if (err && len > 0) {
    std::strncpy(err, what, static_cast<size_t>(len) - 1);
    err[len - 1] = 0;
  }
}

template <class R, class F>
R guarded(char* err, int errlen, R failed, F&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    put_message(e.what(), err, errlen);
    return failed;
  }
}

}  // namespace sluice::detail::capi
