# cmake -DPROGRAM=<benchmark> -P expect_clean_error.cmake: an unknown flag must end the program with
# exit status 1 and a message naming the flag (not a signal, not a backtrace).
execute_process(COMMAND ${PROGRAM} --no-such-flag RESULT_VARIABLE status OUTPUT_VARIABLE out
                ERROR_VARIABLE err TIMEOUT 60)
message("$ ${PROGRAM} --no-such-flag: exit ${status}\n${out}${err}")
if(NOT status STREQUAL "1" OR NOT "${err}" MATCHES "no-such-flag")
  message(FATAL_ERROR "expected exit status 1 and a message naming --no-such-flag")
endif()
