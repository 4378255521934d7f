# Installs the build tree into PREFIX, then configures, builds and runs the consumer project
# against the installed package; then the same consumer through add_subdirectory.
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGV}")
  endif()
endfunction()
file(REMOVE_RECURSE ${PREFIX} ${CONSUMER_BIN} ${CONSUMER_BIN}-subdir)
run(${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${PREFIX})
run(${CMAKE_COMMAND} -S ${CONSUMER_SRC} -B ${CONSUMER_BIN} -DCMAKE_PREFIX_PATH=${PREFIX}
    -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${CONSUMER_BIN})
run(${CONSUMER_BIN}/consumer)
run(${CMAKE_COMMAND} -S ${CONSUMER_SRC} -B ${CONSUMER_BIN}-subdir
    -DTILEDECODE_SOURCE_DIR=${SOURCE_DIR} -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${CONSUMER_BIN}-subdir)
run(${CONSUMER_BIN}-subdir/consumer)
