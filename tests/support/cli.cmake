# What the command-line tests share: run `fivefold` (the path in FIVEFOLD) and check its output.
#   include(${CMAKE_CURRENT_LIST_DIR}/../support/cli.cmake)

# Runs the program; fails the test unless the exit status is 0 and the output matches `expect`.
function(run expect)
  execute_process(COMMAND ${FIVEFOLD} ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE out
                  ERROR_VARIABLE err TIMEOUT 120)
  message("$ fivefold ${ARGN}\n${out}${err}")
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "exit status ${status}")
  endif()
  if(NOT "${out}" MATCHES "${expect}")
    message(FATAL_ERROR "output does not match: ${expect}")
  endif()
  set(output "${out}" PARENT_SCOPE)
endfunction()

# Runs the program; fails the test unless it exits non-zero and says what `expect` matches.
function(refused expect)
  execute_process(COMMAND ${FIVEFOLD} ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE out
                  ERROR_VARIABLE err TIMEOUT 120)
  message("$ fivefold ${ARGN}\n${out}${err}")
  if(status EQUAL 0 OR NOT "${out}${err}" MATCHES "${expect}")
    message(FATAL_ERROR "expected a failure mentioning: ${expect}")
  endif()
endfunction()
