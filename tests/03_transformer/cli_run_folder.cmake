# A run owns its output folder, and a resumed run is the run it resumes:
#   cmake -DFIVEFOLD=<program> -DWORK=<scratch folder> -P cli_run_folder.cmake
# - two runs started together into one folder: one trains, the other is refused at once naming
#   the owner; every metrics line parses; a lock left by a dead process is taken over;
# - an output folder that is a checkpoint folder is refused (fresh and --resume);
# - --resume with a setting that changes the computation is refused naming each one, while
#   steps, evaluation and checkpoint settings may change; a longer run says what its schedule does;
# - a checkpoint folder written again for the same step replaces the old one whole.

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/../support/cli.cmake)
set(model --d-model 32 --n-layers 2 --n-heads 4 --n-kv-heads 2 --d-ff 64 --seq 16 --batch 4
    --synthetic-examples 300 --peak-gflops 100 --no-progress --exact-match 0 --eval-every 0)

# Two runs into one folder, started together (a pipeline runs both commands at once).
set(shared ${WORK}/shared)
execute_process(COMMAND ${FIVEFOLD} train --out ${shared} --steps 300 --save-every 100 ${model}
                COMMAND ${FIVEFOLD} train --out ${shared} --steps 300 --save-every 100 ${model}
                RESULTS_VARIABLE statuses OUTPUT_VARIABLE text ERROR_VARIABLE text TIMEOUT 300)
message("$ two runs into ${shared}: exit ${statuses}\n${text}")
list(SORT statuses)
# The refused run is refused by the lock ('in use') while the other trains, or, when the other
# has already finished its 300 steps before this one looks (CI saw it once), as a folder that
# already holds a run: either way it must say why and write nothing.
if(NOT statuses STREQUAL "0;1" OR NOT text MATCHES
   "(is in use by process [0-9]+ on |already holds a training run: resume it)")
  message(FATAL_ERROR "expected one run to finish and the other to be refused as 'in use'")
endif()
file(STRINGS ${shared}/metrics.jsonl lines)
list(LENGTH lines count)
if(NOT count EQUAL 301)  # 300 training lines and the final evaluation
  message(FATAL_ERROR "metrics.jsonl has ${count} lines, expected 301")
endif()
foreach(line IN LISTS lines)
  string(JSON kind ERROR_VARIABLE bad GET "${line}" kind)
  if(bad)
    message(FATAL_ERROR "metrics.jsonl has a line that does not parse: ${line}")
  endif()
endforeach()
if(EXISTS ${shared}/.lock)
  message(FATAL_ERROR "the lock outlived its run")
endif()

# A stale lock (a process that no longer exists, on this host) is taken over with a warning.
execute_process(COMMAND hostname OUTPUT_VARIABLE host OUTPUT_STRIP_TRAILING_WHITESPACE)
set(stale ${WORK}/stale)
file(WRITE ${stale}/.lock "999999999 ${host}\n")
execute_process(COMMAND ${FIVEFOLD} train --out ${stale} --steps 2 ${model}
                RESULT_VARIABLE status OUTPUT_VARIABLE text ERROR_VARIABLE text TIMEOUT 120)
message("$ fivefold train --out ${stale} (a stale lock)\n${text}")
if(NOT status EQUAL 0 OR NOT text MATCHES "taking over the lock of process 999999999"
   OR NOT EXISTS ${stale}/latest)
  message(FATAL_ERROR "the run did not take over the stale lock with a warning")
endif()
file(WRITE ${WORK}/live/.lock "1 ${host}\n")  # pid 1 is alive
refused("in use by process 1 on" train --out ${WORK}/live --steps 1 ${model})

# An output folder that is a checkpoint folder, fresh or resumed.
set(run ${WORK}/run)
run("" train --out ${run} --steps 4 --save-every 2 ${model})
refused("is a checkpoint folder" train --out ${run}/step-00000002 --resume --steps 6 ${model})
refused("is a checkpoint folder" train --out ${run}/step-00000004 --steps 6 ${model})
if(EXISTS ${run}/step-00000002/metrics.jsonl OR EXISTS ${run}/step-00000002/latest)
  message(FATAL_ERROR "a refused run wrote into a checkpoint folder")
endif()

# --resume refuses changed settings, naming each, and writes nothing.
file(SHA256 ${run}/metrics.jsonl before)
refused("--batch 8 \\(the run has 4\\); --lr 0.01 \\(the run has 0.003\\)"
        train --out ${run} --resume --steps 6 --lr 0.01 --batch 8)
refused("--model-config describes another model" train --out ${run} --resume --steps 6
        --model-config ${CONFIG})
file(SHA256 ${run}/metrics.jsonl after)
if(NOT before STREQUAL after)
  message(FATAL_ERROR "a refused resume changed metrics.jsonl")
endif()
# The same values, and the settings that may change, are accepted; the schedule is explained.
execute_process(COMMAND ${FIVEFOLD} train --out ${run} --resume --steps 6 --lr 3e-3 --batch 4
                --save-every 1 --keep 3 --eval-every 3 --no-progress --peak-gflops 100
                RESULT_VARIABLE status OUTPUT_VARIABLE text ERROR_VARIABLE text TIMEOUT 120)
message("$ fivefold train --out ${run} --resume --steps 6 (same values, new intervals)\n${text}")
if(NOT status EQUAL 0 OR NOT text MATCHES "cosine decay ends at step 4.*steps after it run at min_lr")
  message(FATAL_ERROR "the resume with unchanged settings failed or did not explain the schedule")
endif()
foreach(step 4 5 6)
  if(NOT EXISTS ${run}/step-0000000${step}/model.safetensors)
    message(FATAL_ERROR "--save-every 1 on resume did not save step ${step}")
  endif()
endforeach()

# A checkpoint written again for a step that has a folder replaces it whole: resume from step 4
# again (latest pointed back) and run to 6: step-00000005 and step-00000006 are written over.
file(WRITE ${run}/latest "step-00000004\n")
file(WRITE ${run}/step-00000006/stale-marker "from the first time")
run("" train --out ${run} --resume --steps 6 --save-every 1 --keep 3 --no-progress
    --peak-gflops 100)
if(EXISTS ${run}/step-00000006/stale-marker)
  message(FATAL_ERROR "step-00000006 still holds a file of the folder it replaced")
endif()
file(GLOB leftovers ${run}/.step-*)
if(leftovers)
  message(FATAL_ERROR "temporary checkpoint folders left behind: ${leftovers}")
endif()
