# Precompiled LibTorch headers. <ATen/ATen.h> takes 17-27 s to parse in every file that includes
# it (2 cores, -O3), about a third of a typical LibTorch file's compile time: it is compiled once
# per build into fmoe_torch_pch's precompiled header, which every target that compiles against
# LibTorch's headers reuses (bench/RESULTS.md, "Build and test time").
#
# A target compiles against LibTorch's headers when the `torch` target is reachable from its
# LINK_LIBRARIES through the INTERFACE_LINK_LIBRARIES of what it links (usage requirements
# propagate that way; $<LINK_ONLY:...> entries do not carry them). GCC refuses a precompiled
# header made with other code-generation options (-Winvalid-pch, an error under FMOE_WERROR), so
# every user compiles position-independent code the same way: -fPIC (an executable's objects
# otherwise get -fPIE). Targets with CUDA sources use it for their C++ files only. ccache caches
# a file compiled with a precompiled header only under the sloppiness pch_defines,time_macros
# (its manual, "Precompiled headers"), which these targets' compiler launcher sets.
option(FMOE_TORCH_PCH "Precompile LibTorch's headers once per build" ON)

# Every build-system target defined under `dir`, recursively.
function(_fmoe_targets_under dir out)
  get_property(_targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
  get_property(_subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
  foreach(_sub IN LISTS _subdirs)
    _fmoe_targets_under("${_sub}" _more)
    list(APPEND _targets ${_more})
  endforeach()
  set(${out} ${_targets} PARENT_SCOPE)
endfunction()

# Sets `out` to TRUE when `torch` is reachable from the link entries `items` through the
# INTERFACE_LINK_LIBRARIES of the targets among them.
function(_fmoe_reaches_torch items out)
  set(_queue ${items})
  set(_seen)
  while(_queue)
    list(POP_FRONT _queue _item)
    if(_item STREQUAL "torch")
      set(${out} TRUE PARENT_SCOPE)
      return()
    endif()
    if(_item MATCHES "^\\$<" OR NOT TARGET "${_item}" OR _item IN_LIST _seen)
      continue()
    endif()
    list(APPEND _seen "${_item}")
    get_target_property(_next "${_item}" INTERFACE_LINK_LIBRARIES)
    if(_next)
      list(APPEND _queue ${_next})
    endif()
  endwhile()
  set(${out} FALSE PARENT_SCOPE)
endfunction()

function(fmoe_apply_torch_pch)
  if(NOT FMOE_TORCH OR NOT FMOE_TORCH_PCH OR NOT TARGET torch)
    return()
  endif()
  add_library(fmoe_torch_pch OBJECT "${PROJECT_SOURCE_DIR}/cmake/torch_pch.cc")
  target_link_libraries(fmoe_torch_pch PRIVATE ${TORCH_LIBRARIES})
  fmoe_torch_includes(fmoe_torch_pch PRIVATE)
  # The users' warnings too: -Wpedantic undefines __cpp_runtime_arrays, which LibTorch's headers
  # test.
  fmoe_target_warnings(fmoe_torch_pch)
  target_precompile_headers(fmoe_torch_pch PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:<ATen/ATen.h$<ANGLE-R>>")
  set(_launcher)
  if(FMOE_CCACHE)
    set(_launcher ${CMAKE_COMMAND} -E env CCACHE_SLOPPINESS=pch_defines,time_macros ${FMOE_CCACHE})
    set_target_properties(fmoe_torch_pch PROPERTIES CXX_COMPILER_LAUNCHER "${_launcher}")
  endif()
  _fmoe_targets_under("${PROJECT_SOURCE_DIR}" _all)
  set(_users)
  foreach(_t IN LISTS _all)
    get_target_property(_type ${_t} TYPE)
    if(NOT _type MATCHES "^(EXECUTABLE|STATIC_LIBRARY|SHARED_LIBRARY|MODULE_LIBRARY|OBJECT_LIBRARY)$"
       OR _t STREQUAL "fmoe_torch_pch")
      continue()
    endif()
    get_target_property(_links ${_t} LINK_LIBRARIES)
    if(NOT _links)
      continue()
    endif()
    _fmoe_reaches_torch("${_links}" _uses)
    if(NOT _uses)
      continue()
    endif()
    target_precompile_headers(${_t} REUSE_FROM fmoe_torch_pch)
    if(_launcher)
      set_target_properties(${_t} PROPERTIES CXX_COMPILER_LAUNCHER "${_launcher}")
    endif()
    if(_type STREQUAL "EXECUTABLE")
      target_compile_options(${_t} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fPIC>)
    endif()
    list(APPEND _users ${_t})
  endforeach()
  list(LENGTH _users _n)
  message(STATUS "LibTorch's headers precompiled once for ${_n} targets")
endfunction()
