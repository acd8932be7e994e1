# `fivefold train --config FILE`: the file is strict TOML, and the paths it names are read from
# its own folder. Each malformed file below was accepted before toml++ read them (2026-12-04:
# `lr = 3e-3 = 4` trained with lr 4, `tp = [1, 2]` gave tp 2, a repeated key took the first
# value); each must now be refused naming the file's line. Then the main preset plans from another
# working directory (its model-config sits beside it), and a run's settings.toml, which names its
# data file absolutely, trains again from anywhere.
# Inputs: FIVEFOLD (the program), WORK (a scratch folder), ROOT (the source tree).

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK}/elsewhere ${WORK}/config)
include(${CMAKE_CURRENT_LIST_DIR}/../support/cli.cmake)  # run, refused

# Each bad file and what the refusal must say (after "--config '<file>' ").
function(bad_config name text expect)
  file(WRITE ${WORK}/config/${name}.toml "${text}")
  refused("--config '[^']*${name}.toml' ${expect}" train --config ${WORK}/config/${name}.toml
          --out ${WORK}/bad --plan 2)
endfunction()
set(invalid "column [0-9]+: .*not valid TOML")
bad_config(second-equals "lr = 3e-3 = 4\n" "line 1, ${invalid}")
bad_config(trailing-text "d-ff = 64 extra junk\n" "line 1, ${invalid}")
bad_config(repeated-key "steps = 4\nsteps = 5\n" "line 2, ${invalid}")
bad_config(unclosed-table "steps = 4\n[section\n" "line 2, ${invalid}")
bad_config(array "tp = [1, 2]\n" "line 1: 'tp' is an array: an option takes one value")
bad_config(table "steps = 2\n[train]\nlr = 1\n" "line 2: 'train' is a table")
bad_config(flag-number "sequence-parallel = 1\n"
           "line 1: 'sequence-parallel' is a flag: give true or false")
bad_config(unknown "stpes = 4\n" "line 1: 'stpes': unknown setting")
if(EXISTS ${WORK}/bad)
  message(FATAL_ERROR "a refused configuration wrote ${WORK}/bad")
endif()

# The main preset names its model beside it ("moe-mla.json"): it plans from any folder.
execute_process(COMMAND ${FIVEFOLD} train --config ${ROOT}/chapters/15_trainer_5d/presets/main.toml
                        --plan 16 WORKING_DIRECTORY ${WORK}/elsewhere
                RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 120)
message("$ (cd elsewhere) fivefold train --config .../main.toml --plan 16\n${out}")
if(NOT status EQUAL 0 OR NOT out MATCHES "\\| 15 \\| 1, 1, 1, 1 \\| 2,3 \\|")
  message(FATAL_ERROR "the main preset does not plan from another working directory")
endif()

# A data file beside the config file; the run's settings.toml names it absolutely, so the same
# run trains again from another folder (command-line --out wins over the file's).
file(WRITE ${WORK}/config/corpus.txt "")
foreach(n RANGE 200)
  file(APPEND ${WORK}/config/corpus.txt "line ${n}: the quick brown fox jumps over the lazy dog\n")
endforeach()
file(WRITE ${WORK}/config/run.toml "data = \"corpus.txt\"\nsteps = 2\nbatch = 2\nseq = 16\n"
     "d-model = 32\nn-layers = 1\nn-heads = 2\nd-ff = 64\neval-every = 0\neval-batches = 1\n"
     "peak-gflops = 100\nno-progress = true\n")
execute_process(COMMAND ${FIVEFOLD} train --config config/run.toml --out ${WORK}/first
                WORKING_DIRECTORY ${WORK} RESULT_VARIABLE status OUTPUT_VARIABLE out
                ERROR_VARIABLE out TIMEOUT 120)
message("$ fivefold train --config config/run.toml\n${out}")
file(READ ${WORK}/first/settings.toml settings)
if(NOT status EQUAL 0 OR NOT settings MATCHES "data = \"${WORK}/config/corpus.txt\"")
  message(FATAL_ERROR "the run did not read corpus.txt beside its config, or settings.toml "
                      "does not name it absolutely:\n${settings}")
endif()
execute_process(COMMAND ${FIVEFOLD} train --config ${WORK}/first/settings.toml
                        --out ${WORK}/again WORKING_DIRECTORY ${WORK}/elsewhere
                RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 120)
message("$ (cd elsewhere) fivefold train --config first/settings.toml\n${out}")
file(READ ${WORK}/first/metrics.jsonl first)
file(READ ${WORK}/again/metrics.jsonl again)
string(REGEX MATCH "\"loss\":[^,]+" first "${first}")
string(REGEX MATCH "\"loss\":[^,]+" again "${again}")
if(NOT status EQUAL 0 OR NOT first STREQUAL again)
  message(FATAL_ERROR "settings.toml read back from another folder: ${again}, first run ${first}")
endif()
message("settings.toml trains the same run from another folder (${again})")
