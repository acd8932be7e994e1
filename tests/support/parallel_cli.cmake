# What the tests of `fivefold train` under mpirun share (chapters 09 onwards):
#   include(${CMAKE_CURRENT_LIST_DIR}/../support/parallel_cli.cmake)
# with FIVEFOLD (the program) and MPIRUN (mpirun and its flags) defined.

string(REPLACE ";" " " launcher "${MPIRUN}")  # a CMake list or a command line
separate_arguments(mpirun UNIX_COMMAND "${launcher}")

# Runs `np` ranks (1: the program alone) and fails unless it exits 0. What it printed is left in
# the caller's `train_output`.
function(train np out)
  set(launch ${FIVEFOLD})
  if(np GREATER 1)
    set(launch ${mpirun} -np ${np} ${FIVEFOLD})
  endif()
  execute_process(COMMAND ${launch} train --out ${out} ${ARGN} RESULT_VARIABLE status
                  OUTPUT_VARIABLE text ERROR_VARIABLE text TIMEOUT 300)
  message("$ [${np} ranks] fivefold train --out ${out} ${ARGN}\n${text}")
  set(train_output "${text}" PARENT_SCOPE)
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

# |a - b| <= tol * |b| for every step's loss and norm; tol is the optional fourth argument, 1e-4
# when absent (fp32: per-rank means averaged in another order than one mean change the last bits;
# over 4 AdamW steps 1e-4 relative holds with margin). 0: equal.
function(expect_same_curve got want label)
  set(tol 1e-4)
  if(ARGC GREATER 3)
    set(tol ${ARGV3})
  endif()
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
      execute_process(COMMAND awk "BEGIN { d = ${a} - ${b}; if (d < 0) d = -d; t = ${b}; if (t < 0) t = -t; exit !(d <= ${tol} * t) }"
                      RESULT_VARIABLE far)
      if(NOT far EQUAL 0)
        message(FATAL_ERROR "${label}: row ${i} field ${k}: ${a} vs the single process's ${b}")
      endif()
    endforeach()
  endforeach()
  message("${label}: ${n} steps equal the single process's (loss and gradient norm, ${tol})")
endfunction()

# Runs `np` ranks of `fivefold train --out <out> ARGN` and fails the test unless the job exits
# non-zero, every rank says what `expect` matches, and nothing was written to `out`.
function(refused_on_every_rank np out expect)
  execute_process(COMMAND ${mpirun} -np ${np} ${FIVEFOLD} train --out ${out} ${ARGN}
                  RESULT_VARIABLE status OUTPUT_VARIABLE text ERROR_VARIABLE text TIMEOUT 120)
  message("$ [${np} ranks] fivefold train ${ARGN} (exit ${status})\n${text}")
  string(REGEX MATCHALL "${expect}" said "${text}")
  list(LENGTH said times)
  if(status EQUAL 0 OR times LESS np)
    message(FATAL_ERROR "expected all ${np} ranks to refuse, saying: ${expect}")
  endif()
  if(EXISTS ${out})
    message(FATAL_ERROR "a refused run wrote ${out}")
  endif()
endfunction()

# Resumes the run in `saved` from its step-2 checkpoint in a fresh folder `out` (the checkpoint
# and the metrics so far copied there) on `np` ranks with the layout flags that follow, trains to
# step 4, and expects every step's loss and norm to be those of the curve in the variable named
# `expected` (a name, not a value: the caller's list), within expect_same_curve's tolerance or the
# one given as `TOLERANCE t` among the flags.
function(expect_resumed np saved out expected label)
  cmake_parse_arguments(PARSE_ARGV 5 resumed "" "TOLERANCE" "")
  if(NOT DEFINED resumed_TOLERANCE)
    set(resumed_TOLERANCE 1e-4)
  endif()
  file(MAKE_DIRECTORY ${out})
  file(COPY ${saved}/step-00000002 DESTINATION ${out})
  file(COPY ${saved}/metrics.jsonl DESTINATION ${out})
  file(WRITE ${out}/latest "step-00000002\n")
  train(${np} ${out} --resume --steps 4 --peak-gflops 100 --no-progress
        ${resumed_UNPARSED_ARGUMENTS})
  set(train_output "${train_output}" PARENT_SCOPE)
  curve(${out} got)
  expect_same_curve("${got}" "${${expected}}" "${label}" ${resumed_TOLERANCE})
endfunction()
