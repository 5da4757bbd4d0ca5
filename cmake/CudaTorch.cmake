# What a CUDA LibTorch (a pip wheel's torch/share/cmake) needs before and after find_package(Torch), measured
# on the 2.14.1+cu130 and 2.11.0+cu130 wheels (../shared/reference/cuda-build.md). Nothing here changes a
# build against a CPU LibTorch.
#
# fsdp_prepare_cuda_torch(): before find_package(Torch). When the LibTorch found through CMAKE_PREFIX_PATH /
#   Torch_DIR ships libtorch_cuda:
#   - TORCH_CUDA_ARCH_LIST (environment) defaults to FSDP_CUDA_ARCH_LIST ("8.0;9.0": A100, H100/H200):
#     without it Torch's CMake probes the GPU with a try_run that CMake < 3.27 cannot generate for nvcc;
#   - CUDA_TOOLKIT_ROOT_DIR defaults to /usr/local/cuda;
#   - CUDA_nvrtc_LIBRARY defaults to the toolkit's libnvrtc, else the wheel's (nvidia/*/lib/libnvrtc.so*);
#   - FSDP_CUDA_EXTRA_INCLUDES: the wheels' nvidia/*/include folders (cuBLAS, cuSPARSE, NCCL, cuDNN
#     headers that a bare toolkit lacks); the fsdp target adds them as public system includes.
# fsdp_after_torch(): after it. Sets FSDP_WITH_CUDA (ON for a CUDA LibTorch) and FSDP_TORCH_VERSION_NUM
#   (major * 10000 + minor * 100 + patch, e.g. 21401), and stops on LibTorch < 2.11.

set(FSDP_CUDA_ARCH_LIST "8.0;9.0" CACHE STRING "TORCH_CUDA_ARCH_LIST when the environment sets none")

function(_fsdp_find_torch_root out)
  set(root "")
  set(candidates)
  if(Torch_DIR)
    list(APPEND candidates "${Torch_DIR}/../../..")
  endif()
  foreach(p ${CMAKE_PREFIX_PATH})
    list(APPEND candidates "${p}/../.." "${p}")
  endforeach()
  foreach(c ${candidates})
    get_filename_component(c "${c}" ABSOLUTE)
    if(EXISTS "${c}/share/cmake/Torch/TorchConfig.cmake")
      set(root "${c}")
      break()
    endif()
  endforeach()
  set(${out} "${root}" PARENT_SCOPE)
endfunction()

macro(fsdp_prepare_cuda_torch)
  _fsdp_find_torch_root(_fsdp_torch_root)
  set(FSDP_CUDA_EXTRA_INCLUDES "")
  if(_fsdp_torch_root AND (EXISTS "${_fsdp_torch_root}/lib/libtorch_cuda.so"))
    message(STATUS "libfsdp: CUDA LibTorch at ${_fsdp_torch_root}")
    if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
      set(ENV{TORCH_CUDA_ARCH_LIST} "${FSDP_CUDA_ARCH_LIST}")
    endif()
    if(NOT CUDA_TOOLKIT_ROOT_DIR AND EXISTS /usr/local/cuda/bin/nvcc)
      set(CUDA_TOOLKIT_ROOT_DIR /usr/local/cuda CACHE PATH "CUDA toolkit")
    endif()
    if(NOT CMAKE_CUDA_COMPILER AND CUDA_TOOLKIT_ROOT_DIR AND EXISTS "${CUDA_TOOLKIT_ROOT_DIR}/bin/nvcc")
      set(CMAKE_CUDA_COMPILER "${CUDA_TOOLKIT_ROOT_DIR}/bin/nvcc" CACHE FILEPATH "nvcc")
    endif()
    # site-packages of the wheel: its nvidia-* packages.
    get_filename_component(_fsdp_site "${_fsdp_torch_root}/.." ABSOLUTE)
    if(NOT CUDA_nvrtc_LIBRARY)
      set(_nvrtc "")
      if(CUDA_TOOLKIT_ROOT_DIR AND EXISTS "${CUDA_TOOLKIT_ROOT_DIR}/lib64/libnvrtc.so")
        set(_nvrtc "${CUDA_TOOLKIT_ROOT_DIR}/lib64/libnvrtc.so")
      else()
        file(GLOB _nvrtc_all "${_fsdp_site}/nvidia/*/lib/libnvrtc.so*")
        list(FILTER _nvrtc_all EXCLUDE REGEX "builtins|alt")
        list(SORT _nvrtc_all)
        if(_nvrtc_all)
          list(GET _nvrtc_all 0 _nvrtc)
        endif()
      endif()
      if(_nvrtc)
        set(CUDA_nvrtc_LIBRARY "${_nvrtc}" CACHE FILEPATH "libnvrtc")
      endif()
    endif()
    file(GLOB _incs LIST_DIRECTORIES true "${_fsdp_site}/nvidia/*/include")
    foreach(i ${_incs})
      if(IS_DIRECTORY "${i}")
        list(APPEND FSDP_CUDA_EXTRA_INCLUDES "${i}")
      endif()
    endforeach()
    # Torch's CMake compiles its CUDA probes with these too.
    foreach(i ${FSDP_CUDA_EXTRA_INCLUDES})
      include_directories(SYSTEM "${i}")
    endforeach()
  endif()
endmacro()

macro(fsdp_after_torch)
  set(_fsdp_tv "${Torch_VERSION}")
  if(EXISTS "${TORCH_INSTALL_PREFIX}/version.py")
    file(STRINGS "${TORCH_INSTALL_PREFIX}/version.py" _fsdp_tv_line REGEX "^__version__")
    string(REGEX MATCH "[0-9]+\\.[0-9]+\\.[0-9]+" _fsdp_tv "${_fsdp_tv_line}")
  endif()
  string(REGEX MATCH "^([0-9]+)\\.([0-9]+)\\.([0-9]+)" _m "${_fsdp_tv}")
  if(NOT _m)
    message(FATAL_ERROR "libfsdp: cannot read the LibTorch version ('${_fsdp_tv}')")
  endif()
  math(EXPR FSDP_TORCH_VERSION_NUM "${CMAKE_MATCH_1} * 10000 + ${CMAKE_MATCH_2} * 100 + ${CMAKE_MATCH_3}")
  if(FSDP_TORCH_VERSION_NUM LESS 21100)
    message(FATAL_ERROR "libfsdp: LibTorch ${_fsdp_tv} is too old: expected >= 2.11")
  endif()
  if(TARGET torch_cuda OR EXISTS "${TORCH_INSTALL_PREFIX}/lib/libtorch_cuda.so")
    set(FSDP_WITH_CUDA ON)
  else()
    set(FSDP_WITH_CUDA OFF)
  endif()
  message(STATUS "libfsdp: LibTorch ${_fsdp_tv} (FSDP_TORCH_VERSION=${FSDP_TORCH_VERSION_NUM}), CUDA ${FSDP_WITH_CUDA}")
endmacro()
