# Cross toolchain: Linux aarch64 with Debian's GNU cross compiler (g++-aarch64-linux-gnu), tests
# run under qemu user mode (qemu-user). Used by scripts/ci_aarch64.sh:
#
#   cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/toolchain-aarch64-linux-gnu.cmake \
#         -DCMAKE_PREFIX_PATH=<prefix with an aarch64 GoogleTest>
#
# CMAKE_CROSSCOMPILING_EMULATOR makes ctest, and gtest_discover_tests at build time, run the
# aarch64 binaries through qemu-aarch64. Only aarch64 libraries are searched (the sysroot
# /usr/aarch64-linux-gnu and CMAKE_PREFIX_PATH); header-only / architecture-independent CMake
# packages such as Eigen3 (/usr/share/eigen3/cmake) are still found on the host.
#   TILEDECODE_CROSS_TRIPLE   compiler prefix (default aarch64-linux-gnu)
#   TILEDECODE_QEMU           emulator (default: qemu-aarch64 from PATH)
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

if(NOT TILEDECODE_CROSS_TRIPLE)
  set(TILEDECODE_CROSS_TRIPLE aarch64-linux-gnu)
endif()
set(CMAKE_C_COMPILER ${TILEDECODE_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${TILEDECODE_CROSS_TRIPLE}-g++)
set(CMAKE_LIBRARY_ARCHITECTURE ${TILEDECODE_CROSS_TRIPLE})
# Forwarded to try_compile projects.
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES TILEDECODE_CROSS_TRIPLE TILEDECODE_QEMU)

set(_td_sysroot /usr/${TILEDECODE_CROSS_TRIPLE})
if(NOT TILEDECODE_QEMU)
  find_program(TILEDECODE_QEMU NAMES qemu-aarch64 qemu-aarch64-static)
endif()
if(TILEDECODE_QEMU)
  # -L: where qemu finds the aarch64 dynamic loader and libc/libstdc++.
  set(CMAKE_CROSSCOMPILING_EMULATOR ${TILEDECODE_QEMU};-L;${_td_sysroot})
elseif(NOT CMAKE_IN_TRY_COMPILE)
  message(WARNING "qemu-aarch64 not found (Debian: qemu-user): the tests cannot run here")
endif()

# Libraries only from the target side; programs (ninja, qemu) from the host. Headers and package
# config files: target side first, then the host, for header-only / architecture-independent ones
# (Eigen3); x86 library packages are not found there, CMAKE_LIBRARY_ARCHITECTURE selects
# lib/aarch64-linux-gnu.
set(CMAKE_FIND_ROOT_PATH ${_td_sysroot})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
