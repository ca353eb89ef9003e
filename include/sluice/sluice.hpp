// Umbrella header for the public C++ API.
#pragma once

#include "sluice/config.hpp"
#include "sluice/endpoint.hpp"
#include "sluice/engine.hpp"
#include "sluice/error.hpp"
#include "sluice/future.hpp"
#include "sluice/types.hpp"
#include "sluice/version.hpp"
