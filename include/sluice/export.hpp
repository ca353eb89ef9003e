// SLUICE_API marks what libsluice exports. The library is built with -fvisibility=hidden, so
// everything else (sluice::detail, the vendored JSON library) stays inside it and cannot
// clash with another copy in the consumer's process. Exported classes also export their
// type info, so `catch (const sluice::Error&)` works across the library boundary.
#pragma once

#define SLUICE_API __attribute__((visibility("default")))
