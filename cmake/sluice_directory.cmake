# Directory backends (docs/cluster.md): etcd through its v3 JSON gateway with libcurl, Redis
# through hiredis. Both are optional: each is compiled in (SLUICE_HAVE_ETCD / SLUICE_HAVE_REDIS)
# only when its client library is found; an engine asked for a missing one fails with an
# error that names the package to install. The definitions go on the few sources that read
# them, not on the whole target: every other compile line (and its ccache entry) stays as it
# was.
set(_sluice_dir_src ${CMAKE_CURRENT_SOURCE_DIR}/src/directory)
option(SLUICE_WITH_ETCD "Build the etcd directory when libcurl is found" ON)
option(SLUICE_WITH_REDIS "Build the Redis directory when hiredis is found" ON)
set(SLUICE_HAVE_ETCD OFF)
set(SLUICE_HAVE_REDIS OFF)
if(SLUICE_WITH_ETCD)
  find_package(CURL QUIET)
  if(CURL_FOUND)
    set(SLUICE_HAVE_ETCD ON)
    set_property(SOURCE ${_sluice_dir_src}/etcd_directory.cpp ${_sluice_dir_src}/directory_url.cpp
                 APPEND PROPERTY COMPILE_DEFINITIONS SLUICE_HAVE_ETCD=1)
    target_link_libraries(sluice_objects PUBLIC CURL::libcurl)
  else()
    message(STATUS "sluice: libcurl not found, building without the etcd directory (install libcurl4-openssl-dev)")
  endif()
endif()
if(SLUICE_WITH_REDIS)
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND)
    pkg_check_modules(SLUICE_HIREDIS QUIET IMPORTED_TARGET hiredis)
  endif()
  if(SLUICE_HIREDIS_FOUND)
    set(SLUICE_HAVE_REDIS ON)
    set_property(SOURCE ${_sluice_dir_src}/redis_directory.cpp ${_sluice_dir_src}/directory_url.cpp
                 APPEND PROPERTY COMPILE_DEFINITIONS SLUICE_HAVE_REDIS=1)
    # The library only: the sources include <hiredis/hiredis.h>, so its include dir is not
    # added to every compile line.
    target_link_libraries(sluice_objects PUBLIC ${SLUICE_HIREDIS_LINK_LIBRARIES})
  else()
    message(STATUS "sluice: hiredis not found, building without the Redis directory (install libhiredis-dev)")
  endif()
endif()
message(STATUS "sluice: directory backends: etcd ${SLUICE_HAVE_ETCD}, redis ${SLUICE_HAVE_REDIS}")
