# `fivefold train` data-parallel under mpirun, as a user runs it:
#   cmake -DFIVEFOLD=<program> -DMPIRUN=<mpirun and its flags> -DWORK=<scratch> [-DMOE_CONFIG=..]
#         -P cli_data_parallel.cmake
# The same run (global batch 8, 4 steps, AdamW with clipping) on 1 process and on 2 and 4 ranks
# with each ZeRO stage and with gradient accumulation: every step's loss and gradient norm
# (before clipping) in metrics.jsonl must equal the single process's. A missing 1/N in the
# gradient average multiplies the norm by N: removing it from DDP's bucket (ddp.cpp) or from
# ZeRO's gradient pack (zero.cpp) fails the first 2-rank layout of that kind (tried). Then resume across layouts: a run
# saved on 4 ranks with ZeRO-3 resumes on 2 ranks with ZeRO-1 and on 1 process, and continues
# the uninterrupted curve. Bad layouts are refused on every rank before anything runs.

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/../support/cli.cmake)
string(REPLACE ";" " " launcher "${MPIRUN}")  # a CMake list or a command line
separate_arguments(mpirun UNIX_COMMAND "${launcher}")

set(common --steps 4 --batch 8 --seq 16 --d-model 32 --n-layers 2 --n-heads 4 --n-kv-heads 2
    --d-ff 64 --synthetic-examples 300 --warmup 1 --grad-clip 0.5 --eval-every 0 --exact-match 0
    --eval-batches 1 --save-every 2 --peak-gflops 100 --no-progress)

# Runs `np` ranks (1: the program alone) and fails unless it exits 0.
function(train np out)
  set(launch ${FIVEFOLD})
  if(np GREATER 1)
    set(launch ${mpirun} -np ${np} ${FIVEFOLD})
  endif()
  execute_process(COMMAND ${launch} train --out ${out} ${ARGN} RESULT_VARIABLE status
                  OUTPUT_VARIABLE text ERROR_VARIABLE text TIMEOUT 300)
  message("$ [${np} ranks] fivefold train --out ${out} ${ARGN}\n${text}")
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "exit status ${status}")
  endif()
endfunction()

# The training rows of metrics.jsonl as "step loss grad_norm" lines.
function(curve out var)
  file(STRINGS ${out}/metrics.jsonl lines REGEX "\"kind\":\"train\"")
  set(result "")
  foreach(line IN LISTS lines)
    string(JSON step GET "${line}" step)
    string(JSON loss GET "${line}" loss)
    string(JSON norm GET "${line}" grad_norm)
    list(APPEND result "${step} ${loss} ${norm}")
  endforeach()
  set(${var} "${result}" PARENT_SCOPE)
endfunction()

# |a - b| <= tol * |b| for every step's loss and norm. fp32: per-rank means averaged in another
# order than one mean change the last bits; over 4 AdamW steps 1e-4 relative holds with margin.
function(expect_same_curve got want label)
  list(LENGTH got n)
  list(LENGTH want m)
  if(NOT n EQUAL m OR n EQUAL 0)
    message(FATAL_ERROR "${label}: ${n} training rows, the single process has ${m}")
  endif()
  math(EXPR last "${n} - 1")
  foreach(i RANGE ${last})
    list(GET got ${i} g)
    list(GET want ${i} w)
    string(REPLACE " " ";" g "${g}")
    string(REPLACE " " ";" w "${w}")
    foreach(k 1 2)
      list(GET g ${k} a)
      list(GET w ${k} b)
      # CMake has no floating-point arithmetic: awk compares.
      execute_process(COMMAND awk "BEGIN { d = ${a} - ${b}; if (d < 0) d = -d; t = ${b}; if (t < 0) t = -t; exit !(d <= 1e-4 * t) }"
                      RESULT_VARIABLE far)
      if(NOT far EQUAL 0)
        message(FATAL_ERROR "${label}: row ${i} field ${k}: ${a} vs the single process's ${b}")
      endif()
    endforeach()
  endforeach()
  message("${label}: ${n} steps equal the single process's (loss and gradient norm, 1e-4)")
endfunction()

train(1 ${WORK}/single ${common})
curve(${WORK}/single want)
foreach(layout "2;0;1" "2;1;1" "2;3;2" "4;0;1" "4;2;1" "4;3;2")
  list(GET layout 0 np)
  list(GET layout 1 zero)
  list(GET layout 2 accum)
  set(out ${WORK}/np${np}-zero${zero}-accum${accum})
  train(${np} ${out} ${common} --zero ${zero} --accum ${accum})
  curve(${out} got)
  expect_same_curve("${got}" "${want}" "${np} ranks, ZeRO-${zero}, accum ${accum}")
endforeach()

# A run saved on 4 ranks with ZeRO-3 at step 2 continues on 2 ranks (ZeRO-1) and on 1 process.
set(saved ${WORK}/np4-zero3-accum2)
foreach(target "2;1" "1;0")
  list(GET target 0 np)
  list(GET target 1 zero)
  set(out ${WORK}/resumed-np${np})
  file(MAKE_DIRECTORY ${out})
  file(COPY ${saved}/step-00000002 DESTINATION ${out})
  file(COPY ${saved}/metrics.jsonl DESTINATION ${out})
  file(WRITE ${out}/latest "step-00000002\n")
  train(${np} ${out} --resume --steps 4 --zero ${zero} --peak-gflops 100 --no-progress)
  curve(${out} got)
  expect_same_curve("${got}" "${want}" "saved on 4 ranks (ZeRO-3), resumed on ${np}")
endforeach()

# Refusals, on every rank, before anything is written.
foreach(bad "--tp;2;tensor parallelism" "--dp;3;must equal the number of processes"
            "--zero;4;must be 0, 1, 2 or 3" "--accum;3;must split into 2 data-parallel ranks")
  list(GET bad 0 flag)
  list(GET bad 1 value)
  list(GET bad 2 expect)
  execute_process(COMMAND ${mpirun} -np 2 ${FIVEFOLD} train --out ${WORK}/bad ${common}
                  ${flag} ${value} RESULT_VARIABLE status OUTPUT_VARIABLE text ERROR_VARIABLE text
                  TIMEOUT 120)
  message("$ [2 ranks] fivefold train ${flag} ${value} (exit ${status})\n${text}")
  string(REGEX MATCHALL "${expect}" said "${text}")
  list(LENGTH said times)
  if(status EQUAL 0 OR times LESS 2)
    message(FATAL_ERROR "expected both ranks to refuse ${flag} ${value} saying: ${expect}")
  endif()
  if(EXISTS ${WORK}/bad)
    message(FATAL_ERROR "a refused run wrote ${WORK}/bad")
  endif()
endforeach()
