# cmake -DCOMMAND="a;b;c" -DSECONDS=<bound> -DEXPECT=<regex> -P expect_failure.cmake
# Passes when COMMAND exits non-zero within SECONDS and its output matches EXPECT: the test of a
# job that must end with an error (never hang, never succeed).
string(TIMESTAMP start "%s")
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err
                TIMEOUT ${SECONDS})
string(TIMESTAMP stop "%s")
math(EXPR elapsed "${stop} - ${start}")
message("${out}${err}")
message("--- exit: ${result}, ${elapsed} s (bound ${SECONDS} s)")
if(result MATCHES "timeout")
  message(FATAL_ERROR "the job did not end within ${SECONDS} s: it hung")
endif()
if(result EQUAL 0)
  message(FATAL_ERROR "the job succeeded but should have failed")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT}")
  message(FATAL_ERROR "the output does not explain the failure (expected to match: ${EXPECT})")
endif()
