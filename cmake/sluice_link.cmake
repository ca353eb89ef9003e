# sluice_private_static_runtimes(target): the static archives a shared library or Python module
# links (libcudart_static.a, and libstdc++.a / libgcc.a where the toolchain links the C++
# runtime statically, as the GPU machines' /opt/gcc does) keep their symbols to themselves.
# Exported, they interpose on the process's own libstdc++.so and libcudart.so (torch loads
# both first): calls from one copy land in the other, whose internals differ between versions.
# Seen 2026-11-28 on 1 x H200: _sluice_torch crashed in `ostringstream << int` (a locale facet
# of one libstdc++ read through the other) when creating a process group.
function(sluice_private_static_runtimes target)
  if(CMAKE_SYSTEM_NAME STREQUAL "Linux" AND NOT APPLE)
    target_link_options(${target} PRIVATE "LINKER:--exclude-libs,ALL")
  endif()
endfunction()
