# Helper functions: warnings, the shared precompiled header, the chapter mechanism and the test
# launcher. Read this file to see how `FIVEFOLD_EXERCISES` swaps a learner's file in.

set(FIVEFOLD_ROOT ${CMAKE_CURRENT_LIST_DIR}/..)
set(FIVEFOLD_ALL_CHAPTERS "" CACHE INTERNAL "chapters declared so far")

# Warnings are kept at zero. Torch's own headers are system headers, so they do not count.
function(fivefold_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    # clang's -Wall flags a member that shares a name with one of torch::nn::Module's virtuals
    # (MoE's load(), the expert counts, beside Module::load(archive)); the two never meet.
    target_compile_options(${target} PRIVATE -Wno-overloaded-virtual)
  endif()
  if(FIVEFOLD_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()

# Every target reuses the precompiled header built once by fivefold_pch (common/CMakeLists.txt).
function(fivefold_use_pch target)
  if(NOT target STREQUAL "fivefold_pch")
    target_precompile_headers(${target} REUSE_FROM fivefold_pch)
  endif()
endfunction()

# fivefold_chapter(<NN_topic> SOURCES <file.cpp>... [DEPENDS <chapter targets>...])
#
# Declares the library `ch<NN_topic>` (e.g. ch04_rope) from solutions/<NN_topic>/<file.cpp>. When
# the chapter is in FIVEFOLD_EXERCISES (or that is `all`), each file that also exists in
# exercises/<NN_topic>/ is taken from there instead: the learner's version replaces its twin.
# chapters/<NN_topic>/demo.cpp, if present, becomes the program `ch<NN_topic>_demo`.
function(fivefold_chapter chapter)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPENDS" ${ARGN})
  set(target ch${chapter})
  set(exercise_mode OFF)
  if(FIVEFOLD_EXERCISES STREQUAL "all" OR chapter IN_LIST FIVEFOLD_EXERCISES)
    set(exercise_mode ON)
  endif()

  set(files "")
  set(swapped "")
  foreach(src IN LISTS ARG_SOURCES)
    set(exercise ${FIVEFOLD_ROOT}/exercises/${chapter}/${src})
    set(solution ${FIVEFOLD_ROOT}/solutions/${chapter}/${src})
    if(exercise_mode AND EXISTS ${exercise})
      list(APPEND files ${exercise})
      list(APPEND swapped ${src})
    elseif(EXISTS ${solution})
      list(APPEND files ${solution})
    else()
      message(FATAL_ERROR "fivefold_chapter(${chapter}): no solutions/${chapter}/${src}")
    endif()
  endforeach()
  if(exercise_mode)
    message(STATUS "fivefold: ${chapter} in exercise mode (from exercises/: ${swapped})")
  endif()

  add_library(${target} STATIC ${files})
  target_include_directories(${target} PUBLIC ${FIVEFOLD_ROOT}/chapters)
  target_link_libraries(${target} PUBLIC fivefold_common ${ARG_DEPENDS})
  fivefold_warnings(${target})
  fivefold_use_pch(${target})

  set(demo ${FIVEFOLD_ROOT}/chapters/${chapter}/demo.cpp)
  if(EXISTS ${demo})
    add_executable(${target}_demo ${demo})
    target_link_libraries(${target}_demo PRIVATE ${target})
    fivefold_warnings(${target}_demo)
    fivefold_use_pch(${target}_demo)
  endif()

  # The chapter's tests, if any, live in tests/<NN_topic>/ (labelled ch<NN> there).
  if(EXISTS ${FIVEFOLD_ROOT}/tests/${chapter}/CMakeLists.txt)
    add_subdirectory(${FIVEFOLD_ROOT}/tests/${chapter} ${CMAKE_BINARY_DIR}/tests/${chapter})
  endif()
  set(FIVEFOLD_ALL_CHAPTERS ${FIVEFOLD_ALL_CHAPTERS} ${chapter} CACHE INTERNAL "")
endfunction()

# A misspelt chapter in FIVEFOLD_EXERCISES would silently build the solution: refuse it.
function(fivefold_check_exercise_list)
  if(FIVEFOLD_EXERCISES STREQUAL "all" OR FIVEFOLD_EXERCISES STREQUAL "")
    return()
  endif()
  foreach(ch IN LISTS FIVEFOLD_EXERCISES)
    if(NOT ch IN_LIST FIVEFOLD_ALL_CHAPTERS)
      message(FATAL_ERROR "FIVEFOLD_EXERCISES names '${ch}', which is no chapter. Chapters: ${FIVEFOLD_ALL_CHAPTERS}")
    endif()
  endforeach()
endfunction()

# fivefold_test(<name> SOURCES <file>... LIBS <targets>... LABELS <labels>...
#               [RANKS <n>...] [GLOO_RANKS <n>...] [TIMEOUT <seconds>] [LOOP [<n>...]])
#
# One GoogleTest executable, registered once per process count. RANKS 1 runs the binary directly;
# RANKS n > 1 runs it as n real processes under mpirun (MPI backend). GLOO_RANKS adds the same
# runs over the c10d/Gloo backend. A failed assertion on any rank aborts the whole job.
# LOOP puts the tests (with counts, only those process counts' MPI runs) in their chapter's
# exercise loop: label `loop_chNN` (NN from the `chNN` label) and build target `loop_chNN`, the
# tests that check the exercise directly and quickly, so that a learner's edit-build-test cycle
# relinks and runs only those (`cmake --build build --target loop_chNN && ctest --test-dir build
# -L loop_chNN`); `-L chNN` runs the whole chapter once the loop is green.
function(fivefold_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;LIBS;LABELS;RANKS;GLOO_RANKS;LOOP" ${ARGN})
  set(loop_everything FALSE)
  if("LOOP" IN_LIST ARG_KEYWORDS_MISSING_VALUES)
    set(loop_everything TRUE)
  endif()
  if(NOT ARG_RANKS AND NOT ARG_GLOO_RANKS)
    set(ARG_RANKS 1)
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  get_property(scheduled DIRECTORY PROPERTY FIVEFOLD_SESSIONS_SCHEDULED)
  if(NOT scheduled)
    set_property(DIRECTORY PROPERTY FIVEFOLD_SESSIONS_SCHEDULED TRUE)
    cmake_language(DEFER CALL fivefold_isolate_mpi_sessions)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE fivefold_test_main ${ARG_LIBS})
  set(loop_label "")
  if(loop_everything OR ARG_LOOP)
    set(chapter ${ARG_LABELS})
    list(FILTER chapter INCLUDE REGEX "^ch[0-9][0-9]$")
    list(LENGTH chapter found)
    if(NOT found EQUAL 1)
      message(FATAL_ERROR "fivefold_test(${name} LOOP): needs exactly one chNN label")
    endif()
    if(NOT TARGET loop_${chapter})
      add_custom_target(loop_${chapter})
    endif()
    add_dependencies(loop_${chapter} ${name})
    set(loop_label loop_${chapter})
  endif()
  fivefold_warnings(${name})
  fivefold_use_pch(${name})

  foreach(backend mpi gloo)
    if(backend STREQUAL "mpi")
      set(counts ${ARG_RANKS})
      set(suffix "")
    else()
      set(counts ${ARG_GLOO_RANKS})
      set(suffix "_gloo")
    endif()
    foreach(n IN LISTS counts)
      set(test_name ${name}${suffix}_np${n})
      if(n EQUAL 1 AND backend STREQUAL "mpi")
        add_test(NAME ${test_name} COMMAND $<TARGET_FILE:${name}>)
      else()
        if(backend STREQUAL "gloo")  # once more after a transport flake only (see the script)
          string(REPLACE ";" "|" mpirun "${FIVEFOLD_MPIRUN}")
          add_test(NAME ${test_name}
                   COMMAND ${CMAKE_COMMAND} "-DCOMMAND=${mpirun}|-np|${n}|$<TARGET_FILE:${name}>"
                           -P ${FIVEFOLD_ROOT}/cmake/retry-gloo-transport.cmake)
        else()
          add_test(NAME ${test_name} COMMAND ${FIVEFOLD_MPIRUN} -np ${n} $<TARGET_FILE:${name}>)
        endif()
      endif()
      set(labels ${ARG_LABELS})
      if(loop_label AND (loop_everything OR (backend STREQUAL "mpi" AND n IN_LIST ARG_LOOP)))
        list(APPEND labels ${loop_label})
      endif()
      set_tests_properties(${test_name} PROPERTIES
        LABELS "${labels}" TIMEOUT ${ARG_TIMEOUT} PROCESSORS ${n}
        ENVIRONMENT "FIVEFOLD_BACKEND=${backend};${FIVEFOLD_MPI_ENV}")
    endforeach()
  endforeach()
endfunction()

# Open MPI keeps each job's session folder under <tmpdir>/ompi.<host>.<uid> and removes that
# folder when the last job in it ends; a job starting at that moment fails in orte_init ("A call
# to mkdir was unable to create the desired directory ... File exists", open-mpi/ompi#8510). CTest
# runs tests side by side (seen once in a run of the suite), so each test gets a base folder of
# its own. fivefold_test schedules this for the end of its folder, when every test there exists.
function(fivefold_isolate_mpi_sessions)
  get_property(tests DIRECTORY PROPERTY TESTS)
  foreach(test IN LISTS tests)
    set_property(TEST ${test} APPEND PROPERTY ENVIRONMENT
                 "OMPI_MCA_orte_tmpdir_base=${CMAKE_BINARY_DIR}/mpi-sessions/${test}")
  endforeach()
endfunction()

# mpirun as the tests use it: root is allowed (CI runs as root), more ranks than cores are
# allowed, and ranks yield the core while they wait (2 cores often run 8-16 ranks).
set(FIVEFOLD_MPIRUN ${MPIEXEC_EXECUTABLE} --oversubscribe --mca mpi_yield_when_idle 1 CACHE INTERNAL "")
# OMP_WAIT_POLICY=passive: idle OpenMP threads sleep instead of spinning; with several processes
# on 2 cores, spinning threads made a 1 s test take 15 s (measured, see notes/foundation.md, "Threads and cores").
set(FIVEFOLD_MPI_ENV "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMP_WAIT_POLICY=passive" CACHE INTERNAL "")
