# Writes <out_dir>/sluice/version.hpp from include/sluice/version.hpp.in. The version has one
# source, project(sluice VERSION ...) in the top-level CMakeLists.txt; tests/fuzz (a separate
# project) reads it from there with sluice_read_project_version().
set(_sluice_version_template ${CMAKE_CURRENT_LIST_DIR}/../include/sluice/version.hpp.in)

function(sluice_read_project_version top_cmakelists out_var)
  file(STRINGS ${top_cmakelists} _line REGEX "^project\\(sluice VERSION [0-9.]+" LIMIT_COUNT 1)
  string(REGEX MATCH "[0-9]+\\.[0-9]+\\.[0-9]+" _v "${_line}")
  if(NOT _v)
    message(FATAL_ERROR "no 'project(sluice VERSION x.y.z' line in ${top_cmakelists}")
  endif()
  set(${out_var} ${_v} PARENT_SCOPE)
endfunction()

function(sluice_write_version_header version out_dir)
  string(REPLACE "." ";" _parts ${version})
  list(GET _parts 0 SLUICE_VERSION_MAJOR)
  list(GET _parts 1 SLUICE_VERSION_MINOR)
  list(GET _parts 2 SLUICE_VERSION_PATCH)
  set(SLUICE_VERSION ${version})
  configure_file(${_sluice_version_template} ${out_dir}/sluice/version.hpp @ONLY)
endfunction()
