# Installation: libsluice, the public headers and a CMake package, so that an out-of-tree
# project (a torch C++ extension, tests/consumer) can do find_package(sluice) and link
# sluice::sluice. Components: `runtime` (the library) and `dev` (headers, namelink, package).
# python/CMakeLists.txt installs the same things into the wheel, with the same helpers.
include(CMakePackageConfigHelpers)

# The public headers, generated version.hpp included, into <include_dir>/sluice.
function(sluice_install_headers include_dir component)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/sluice DESTINATION ${include_dir}
          COMPONENT ${component} FILES_MATCHING PATTERN "*.hpp")
  install(FILES ${SLUICE_GENERATED_INCLUDE}/sluice/version.hpp DESTINATION ${include_dir}/sluice
          COMPONENT ${component})
endfunction()

# sluiceConfig.cmake, sluiceConfigVersion.cmake and the targets file of export set
# <export_set> into <config_dir> (relative to the install prefix).
function(sluice_install_package export_set config_dir component)
  set(_out ${CMAKE_CURRENT_BINARY_DIR}/sluice_package/${export_set})
  configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/sluiceConfig.cmake.in
    ${_out}/sluiceConfig.cmake INSTALL_DESTINATION ${config_dir})
  write_basic_package_version_file(${_out}/sluiceConfigVersion.cmake
    VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
  install(FILES ${_out}/sluiceConfig.cmake ${_out}/sluiceConfigVersion.cmake
          DESTINATION ${config_dir} COMPONENT ${component})
  install(EXPORT ${export_set} FILE sluiceTargets.cmake NAMESPACE sluice::
          DESTINATION ${config_dir} COMPONENT ${component})
endfunction()

install(TARGETS sluice EXPORT sluiceTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
sluice_install_headers(${CMAKE_INSTALL_INCLUDEDIR} dev)
sluice_install_package(sluiceTargets ${CMAKE_INSTALL_LIBDIR}/cmake/sluice dev)
