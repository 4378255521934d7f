# Helpers for TileDecode's own targets (tests, benchmarks, examples). Not installed.

set(TILEDECODE_WARNINGS -Wall -Wextra -Wpedantic -Werror)

# Strict warnings + the library for one of our targets.
function(tiledecode_target name)
  target_link_libraries(${name} PRIVATE tiledecode::tiledecode)
  target_compile_options(${name} PRIVATE ${TILEDECODE_WARNINGS})
  if(TILEDECODE_SANITIZE)
    target_compile_options(${name} PRIVATE -fsanitize=address,undefined -fno-sanitize-recover=all
                                           -fno-omit-frame-pointer)
    target_link_options(${name} PRIVATE -fsanitize=address,undefined -fno-sanitize-recover=all)
  endif()
endfunction()
