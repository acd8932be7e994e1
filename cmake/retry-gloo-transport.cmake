# Runs a Gloo-backend test (COMMAND: its command line, '|'-separated) and runs it once more when,
# and only when, the first run failed on Gloo's TCP transport ("Connection closed by peer" from
# gloo/transport/tcp/pair.cc, on every rank at once): seen in CI-sized runs of the whole suite
# (test_ch12_context_parallel_gloo_np2 on 2026-12-01, 12-02 and 12-03; launcher_killed_gloo's
# start-up on 12-03, which retries the same way), never in a rerun; cause not yet found. On
# 12-03 it came with no other test running, in the third test of a binary that builds and drops
# a device mesh per layout (new Gloo groups connecting while the last ones close), after the
# rendezvous files were named after the launcher's pid and start time: a reused stale file is
# not the cause. On 12-05, on a loaded machine, it came in the constructor of a group: a mesh
# drops its unused groups as soon as it is built, and a rank could drop one while its peer was
# still finishing that group's handshake. Each Gloo group now ends its construction with a barrier
# on itself (gloo_backend.cpp); the test that failed 1 run in 6 (and twice in a row under this
# retry) then passed 14 of 14 beside 1 failure in 14 without it. The retry stays until CI-sized
# runs show no more. Any other failure, an assertion's included, fails at once; every output is
# printed, and a retry says so.
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
