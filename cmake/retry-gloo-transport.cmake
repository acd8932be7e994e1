# Runs a Gloo-backend test (COMMAND: its command line, '|'-separated) and runs it once more when,
# and only when, the first run failed on Gloo's TCP transport ("Connection closed by peer" from
# gloo/transport/tcp/pair.cc, on every rank at once): seen twice in CI-sized runs of the whole
# suite (test_ch12_context_parallel_gloo_np2, 2026-12-01 and 12-02), never in a rerun, cause not
# yet found. Any other failure, an assertion's included, fails at once; every output is printed,
# and a retry says so.
string(REPLACE "|" ";" command "${COMMAND}")
execute_process(COMMAND ${command} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("${out}")
if(status EQUAL 0)
  return()
endif()
if(NOT out MATCHES "gloo/transport/tcp/pair\\.cc:[0-9]+\\] Connection closed by peer")
  message(FATAL_ERROR "exit status ${status}")
endif()
message("RETRY: the run above failed on Gloo's TCP transport (connection closed by peer), not on "
        "a check; running it once more")
execute_process(COMMAND ${command} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("${out}")
if(NOT status EQUAL 0)
  message(FATAL_ERROR "exit status ${status} on the second run too")
endif()
