# nlohmann/json for the engine's private use, as one INTERFACE target: sluice_json.
# An installed nlohmann_json >= 3.11 wins (distributions can unvendor); otherwise the
# vendored single-include copy in third_party/nlohmann_json. Never part of the public API:
# libsluice is built with hidden visibility, so none of its instantiations are exported.
add_library(sluice_json INTERFACE)
find_package(nlohmann_json 3.11 CONFIG QUIET)
if(nlohmann_json_FOUND)
  message(STATUS "sluice: using nlohmann_json ${nlohmann_json_VERSION} from ${nlohmann_json_DIR}")
  target_link_libraries(sluice_json INTERFACE nlohmann_json::nlohmann_json)
else()
  target_include_directories(sluice_json SYSTEM INTERFACE ${PROJECT_SOURCE_DIR}/third_party/nlohmann_json/include)
endif()
